"""grpo_kit.packing: the packed row's layout, packed log-probs equal to the padded forward
(float64 and float32, shared prompts, episodes), sequences independent of their neighbours, and
micro-batches and shards by tokens.

The tiny Qwen3 model, the batches and the float64 norms are tests/test_train_step.py's.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from test_train_step import (  # noqa: F401  (float64_norms: an autouse fixture)
    FLOAT32_LOGPROB_TOL,
    VOCAB,
    RowCounter,
    float64_norms,
    make_batch,
    make_episode_batch,
    rel_err,
    tiny_model,
)

from grpo_kit.config import OptimConfig
from grpo_kit.logprobs import token_logprobs
from grpo_kit.packing import balanced_shard_sizes, micro_batch_bounds, pack_attention_mask, pack_layout, packed_logprobs
from grpo_kit.train_step import collate


def test_pack_layout_positions_segments_and_index():
    """Rows 0-1 share a prompt [5, 6], row 2 has nothing scored (left out), row 3 is an episode with a hole."""
    b = collate([([5, 6], [7, 8], [-1.0, -1.0], 1.0), ([5, 6], [9], [-1.0], 1.0), ([4], [], [], 1.0),
                 ([3], [2, 1, 7], [-1.0, 0.0, -1.0], 1.0, [1, 0, 1])], pad_id=0)
    args = (b.input_ids, b.attention_mask, b.completion_mask)
    plain = pack_layout(*args)
    ids = b.input_ids.reshape(-1)[plain.src]
    assert ids.tolist() == [5, 6, 7, 8, 5, 6, 9, 3, 2, 1, 7]
    assert plain.position_ids.tolist() == [0, 1, 2, 3, 0, 1, 2, 0, 1, 2, 3]  # a reset at every sequence
    assert plain.unit.tolist() == [0, 0, 0, 0, 1, 1, 1, 2, 2, 2, 2]
    assert plain.index[1].tolist() == [4, 5, 6, -1] and plain.index[2].tolist() == [-1] * 4
    shared = pack_layout(*args, share_prompt=True)
    assert b.input_ids.reshape(-1)[shared.src].tolist() == [5, 6, 7, 8, 9, 3, 2, 1, 7]
    assert shared.position_ids.tolist() == [0, 1, 2, 3, 2, 0, 1, 2, 3]  # row 1's completion continues its prompt
    assert shared.segment.tolist() == [-1, -1, 0, 0, 1, -1, 0, 0, 0]
    assert shared.index[:2].tolist() == [[0, 1, 2, 3], [0, 1, 4, -1]]


def grads_of(model, out):
    model.zero_grad()
    (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).reshape(out.shape)).sum().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize(("attn", "logprob_tol", "grad_tol", "share_prompt"),
                         [("sdpa", 1e-12, 1e-12, False), ("sdpa", 1e-12, 1e-12, True),
                          ("eager", FLOAT32_LOGPROB_TOL, 1e-6, True)])  # eager: the additive 4-D mask
def test_packed_logprobs_equal_the_padded_forward(attn, logprob_tol, grad_tol, share_prompt):
    """Single-turn groups (a row with no completion, a group cut by the batch edge) and episodes with
    holes: one packed row gives the padded forward's log-probs and gradients (float64; eager's softmax
    is float32, FLOAT32_LOGPROB_TOL), tempered too."""
    model = tiny_model(attn=attn)
    for batch in (make_batch(11, seed=4, group=4), make_episode_batch(10, seed=22, group=4)):
        args = (batch.input_ids, batch.attention_mask, batch.completion_mask)
        seen = RowCounter(model)
        got = packed_logprobs(model, *args, share_prompt=share_prompt, chunk=5)
        assert seen.rows == 1  # one packed row
        want = token_logprobs(model, *args)
        torch.testing.assert_close(got, want, rtol=1e-10, atol=logprob_tol)
        assert (got[batch.completion_mask == 0] == 0).all()
        assert rel_err(grads_of(model, got), grads_of(model, want)) < grad_tol
        with torch.no_grad():
            hot = [fn(model, *args, temperature=0.7) for fn in (token_logprobs, packed_logprobs)]
        torch.testing.assert_close(hot[1], hot[0], rtol=1e-10, atol=logprob_tol)
    none = make_batch(11, seed=4, group=4)[1:2].trim()  # nothing scored: still a graph for the backward
    assert int(none.completion_mask.sum()) == 0  # (the episode batch's row 1 has scored tokens: review)
    assert packed_logprobs(model, none.input_ids, none.attention_mask, none.completion_mask).requires_grad


@pytest.mark.parametrize("share_prompt", [False, True])
def test_packed_logprobs_in_float32_match_the_padded_forward(share_prompt):
    model = tiny_model().to(torch.float32)
    batch = make_episode_batch(10, seed=25, group=3)
    args = (batch.input_ids, batch.attention_mask, batch.completion_mask)
    with torch.no_grad():
        got = packed_logprobs(model, *args, share_prompt=share_prompt)
        want = token_logprobs(model, *args)
    assert got.dtype == torch.float32
    assert (got - want).abs().max() <= 1e-6


def test_a_packed_sequence_does_not_depend_on_its_neighbours():
    """huggingface/trl#7087: positions that do not reset, or a mask of ones that switches transformers'
    packed-sequence detection off, let a sequence attend to its neighbours. Row 0's log-probs are the
    same alone and packed behind any neighbours; the same pack with positions 0..N-1 is not."""
    model = tiny_model()
    batch = make_batch(6, seed=7)
    target = batch[0:1].trim()
    alone = packed_logprobs(model, target.input_ids, target.attention_mask, target.completion_mask).detach()
    for order in ([1, 2, 0, 3], [5, 4, 3, 2, 0], [3, 0]):
        rows = batch[torch.tensor(order)].trim()
        got = packed_logprobs(model, rows.input_ids, rows.attention_mask, rows.completion_mask).detach()
        torch.testing.assert_close(got[order.index(0), : alone.shape[1]], alone[0], rtol=0, atol=1e-12)
    lay = pack_layout(rows.input_ids, rows.attention_mask, rows.completion_mask)
    ids = rows.input_ids.reshape(-1)[lay.src][None]
    pos = lay.position_ids[None]
    with torch.no_grad():
        good = model(input_ids=ids, position_ids=pos, use_cache=False).logits
        leaks = [model(input_ids=ids, position_ids=torch.arange(ids.shape[1])[None], use_cache=False).logits,
                 model(input_ids=ids, position_ids=pos, attention_mask=torch.ones_like(ids), use_cache=False).logits,
                 model(input_ids=ids, position_ids=pos).logits]  # a cache switches the detection off as well
    later = lay.unit == 1  # row 0, second in this pack
    with torch.no_grad():  # the pack's logits of row 0 are its own forward's
        own = model(input_ids=target.input_ids, use_cache=False).logits[0]
    torch.testing.assert_close(good[0, later], own, rtol=0, atol=1e-12)
    assert all((good - leak)[0, later].abs().max() > 1e-3 for leak in leaks)


def test_micro_batches_by_token_budget_and_balanced_shards():
    b = collate([([5, 6], [7, 8], [-1.0] * 2, 1.0), ([5, 6], [9], [-1.0], 1.0), ([4], [], [], 1.0),
                 ([3], [2, 1, 7], [-1.0] * 3, 1.0)], pad_id=0)  # 4, 3 (1 after its group), 0, 4 tokens
    plain = OptimConfig(micro_batch=3, share_prompt=False)
    assert micro_batch_bounds(b, plain) == [(0, 3), (3, 4)]
    assert micro_batch_bounds(b, replace(plain, packing=True, micro_batch_tokens=7)) == [(0, 3), (3, 4)]
    assert micro_batch_bounds(b, replace(plain, packing=True, micro_batch_tokens=6)) == [(0, 1), (1, 3), (3, 4)]
    shared = replace(plain, packing=True, share_prompt=True, micro_batch_tokens=5)
    assert micro_batch_bounds(b, shared) == [(0, 3), (3, 4)]  # the group's prompt counted once
    assert micro_batch_bounds(b, replace(shared, micro_batch_tokens=1)) == [(0, 1), (1, 3), (3, 4)]  # each alone
    assert balanced_shard_sizes([9, 1, 1, 1], 2) == [1, 3] and balanced_shard_sizes([1, 1, 1, 9], 2) == [3, 1]
    assert balanced_shard_sizes([2] * 6, 3) == [2, 2, 2] and balanced_shard_sizes([], 3) == [0, 0, 0]
    assert balanced_shard_sizes([6, 0, 5, 8, 5, 5, 4], 2) == [4, 3]  # past a row that costs nothing
    lay = pack_layout(b.input_ids, b.attention_mask, b.completion_mask, share_prompt=True)
    with pytest.raises(ValueError, match="sdpa or eager"):  # flash attention takes no 4-D mask
        pack_attention_mask(lay, "flash_attention_2", torch.float32)


def test_packing_is_refused_for_a_model_whose_attention_crosses_packed_sequences():
    """Review finding: Falcon (and Bloom) do not find packed sequences from position resets, so a
    packed sequence attended to the one before it (log-probs off by 0.12). The probe runs once per
    model class; the kit's own architectures pass it exactly."""
    from transformers import FalconConfig, FalconForCausalLM

    from grpo_kit.config import LossConfig
    from grpo_kit.packing import check_packing
    from grpo_kit.train_step import grpo_step

    torch.manual_seed(0)
    falcon = FalconForCausalLM(FalconConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                            new_decoder_architecture=False, alibi=False)).to(torch.float64)
    batch = make_batch(4, seed=1)
    with pytest.raises(ValueError, match="packing=True is not exact for FalconForCausalLM"):
        grpo_step(falcon, torch.optim.SGD(falcon.parameters(), lr=1e-3), batch, LossConfig(kl_beta=0.0),
                  OptimConfig(packing=True, share_prompt=False))
    grpo_step(falcon, torch.optim.SGD(falcon.parameters(), lr=1e-3), batch, LossConfig(kl_beta=0.0),
              OptimConfig(packing=False, share_prompt=False))  # padded: fine
    check_packing(tiny_model())  # Qwen3: no leak


def test_the_packing_check_is_per_architecture_under_peft_and_ignores_lora_dropout():
    """Review findings: the check was cached per ``type(model)``, which under PEFT is
    PeftModelForCausalLM for every architecture: once a Qwen3 passed, a PEFT Falcon in the same
    process (a reused trainer worker, a sweep) was accepted; and it probed in train mode, where LoRA
    dropout drew two masks and refused a trained adapter that packs exactly."""
    from peft import LoraConfig, get_peft_model
    from transformers import FalconConfig, FalconForCausalLM

    from grpo_kit.packing import check_packing

    torch.manual_seed(0)
    qwen = get_peft_model(tiny_model(), LoraConfig(r=4, lora_alpha=8, lora_dropout=0.5, target_modules=["q_proj", "v_proj"],
                                                   task_type="CAUSAL_LM", init_lora_weights=False))  # B != 0: trained
    qwen.train()
    check_packing(qwen)  # dropout on, a trained adapter: no false leak
    assert qwen.training  # the mode it came in
    falcon = get_peft_model(
        FalconForCausalLM(FalconConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                       new_decoder_architecture=False, alibi=False)),
        LoraConfig(r=4, target_modules=["query_key_value"], task_type="CAUSAL_LM"))
    with pytest.raises(ValueError, match="packing=True is not exact for FalconForCausalLM"):
        check_packing(falcon)
