"""grpo_kit.train_step: token log-probs, collate, and the DDP step against a single-process reference.

The distributed tests run real gloo process groups: one spawn of 3 ranks runs every case, world size
3 on the default group and world size 2 on the subgroup of ranks 0 and 1. Every rank must finish, report identical stats, and end with the same LoRA update
as one process stepping on the whole batch.
"""

import datetime
import functools
import gc
import math
import socket
import time
import traceback
import warnings
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from peft import LoraConfig, get_peft_model
from torch import nn
from transformers import Qwen3Config, Qwen3ForCausalLM
from transformers.modeling_outputs import CausalLMOutput

from grpo_kit.config import LossConfig, OptimConfig
from grpo_kit.logprobs import token_logprobs
from grpo_kit.loss import Normalizer, grpo_loss
from grpo_kit.packing import micro_batch_bounds
from grpo_kit.train_step import (
    TrainBatch,
    collate,
    grpo_step,
    make_optimizer,
    shard_bounds,
    wrap_ddp,
)

VOCAB = 32
LR = 0.5  # SGD: the update is proportional to the gradient, so a wrong scale shows (Adam would hide it)


def _rmsnorm_in_input_dtype(self, hidden_states):
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


def _float64_norms() -> None:
    """Qwen3's RMSNorm computes in float32 whatever the model dtype, so float64 results that add
    gradients in different orders (DDP ranks, a shared prompt) would differ by float32 rounding
    (~1e-7). This module's models keep their norms in float64 (this process only)."""
    from transformers.models.qwen3 import modeling_qwen3

    modeling_qwen3.Qwen3RMSNorm.forward = _rmsnorm_in_input_dtype


@pytest.fixture(autouse=True)
def float64_norms(monkeypatch):
    from transformers.models.qwen3 import modeling_qwen3

    monkeypatch.setattr(modeling_qwen3.Qwen3RMSNorm, "forward", _rmsnorm_in_input_dtype)


def tiny_model(seed: int = 0, attn: str = "sdpa", **config):
    """A random float64 Qwen3 with a LoRA adapter whose B matrices are non-zero (so the adapter
    changes the logits and the KL to the adapter-disabled model is exercised); ``config``: more
    Qwen3Config fields."""
    torch.manual_seed(seed)
    cfg = Qwen3Config(**config,
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=64,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        attn_implementation=attn,
    )
    base = Qwen3ForCausalLM(cfg).to(torch.float64)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.1)
    return model


def lora_params(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def make_batch(n: int, seed: int, zero_adv: range = range(0), group: int = 1) -> TrainBatch:
    """``n`` random samples (one with an empty completion), float64; ``zero_adv`` rows get adv 0.
    Consecutive runs of ``group`` samples share a prompt, as a GRPO group does."""
    g = torch.Generator().manual_seed(seed)
    samples = []
    for i in range(n):
        p = int(torch.randint(1, 5, (1,), generator=g))
        c = 0 if i == 1 else int(torch.randint(1, 7, (1,), generator=g))
        fresh = torch.randint(1, VOCAB, (p,), generator=g).tolist()
        prompt = fresh if i % group == 0 else samples[-1][0]
        completion = torch.randint(1, VOCAB, (c,), generator=g).tolist()
        # near the model's own log-probs (~ -log 32), so ratios straddle both clips
        old = (-math.log(VOCAB) + 0.5 * torch.randn(c, generator=g, dtype=torch.float64)).tolist()
        adv = 0.0 if i in zero_adv else float(torch.randn((), generator=g, dtype=torch.float64))
        samples.append((prompt, completion, old, adv))
    return collate(samples, pad_id=0, dtype=torch.float64)


def episode_samples(n: int, seed: int, zero_adv: range = range(0), group: int = 1) -> list[tuple]:
    """``n`` random multi-turn samples ``(prompt, completion, logprobs, adv, mask)``: model turns
    (mask 1) and environment segments between them (mask 0, log-prob 0.0, as an Episode holds), of
    random lengths; rows of one group share a prompt. Row 1 is a single model turn (no hole), the others
    have 2 or 3."""
    g = torch.Generator().manual_seed(seed)

    def rand(k):
        return int(torch.randint(1, k, (1,), generator=g))

    samples = []
    for i in range(n):
        prompt = torch.randint(1, VOCAB, (rand(5),), generator=g).tolist() if i % group == 0 else samples[-1][0]
        mask = []
        for turn in range(1 if i == 1 else 1 + rand(3)):  # 2 or 3 turns
            if turn:
                mask += [0] * rand(4)  # the environment's answer and the next turn's header
            mask += [1] * rand(5)
        completion = torch.randint(1, VOCAB, (len(mask),), generator=g).tolist()
        old = [(-math.log(VOCAB) + 0.5 * float(torch.randn((), generator=g, dtype=torch.float64))) if m else 0.0
               for m in mask]
        adv = 0.0 if i in zero_adv else float(torch.randn((), generator=g, dtype=torch.float64))
        samples.append((prompt, completion, old, adv, mask))
    return samples


def make_episode_batch(n: int, seed: int, zero_adv: range = range(0), group: int = 1) -> TrainBatch:
    return collate(episode_samples(n, seed, zero_adv, group), pad_id=0, dtype=torch.float64)


def stream_mask(batch: TrainBatch) -> torch.Tensor:
    """(B, T) 1 on every completion-side token, model's and environment's (the real tokens after the prompt)."""
    first = torch.where(batch.completion_mask.any(1), batch.completion_mask.argmax(1), batch.attention_mask.sum(1))
    return batch.attention_mask * (torch.arange(batch.input_ids.shape[1])[None] >= first[:, None])


def env_positions(batch: TrainBatch) -> torch.Tensor:
    """(B, T) bool: the environment tokens (real, after the prompt, not scored)."""
    return stream_mask(batch).bool() & ~batch.completion_mask.bool()


# ---------------------------------------------------------------- world size 1


def test_collate_alignment():
    b = collate([([5, 6], [7, 8, 9], [-1.0, -2.0, -3.0], 0.5), ([4], [], [], -1.0)], pad_id=0)
    assert b.input_ids.tolist() == [[5, 6, 7, 8, 9], [4, 0, 0, 0, 0]]
    assert b.attention_mask.tolist() == [[1, 1, 1, 1, 1], [1, 0, 0, 0, 0]]
    assert b.completion_mask.tolist() == [[0, 0, 1, 1, 1], [0, 0, 0, 0, 0]]
    assert b.old_logp.tolist() == [[0, 0, -1.0, -2.0, -3.0], [0, 0, 0, 0, 0]]
    assert b.adv.tolist() == [0.5, -1.0]
    assert b[1:].trim().input_ids.tolist() == [[4]]
    with pytest.raises(ValueError, match="empty prompt"):
        collate([([], [1], [-1.0], 0.0)], pad_id=0)
    with pytest.raises(ValueError, match="log-probs"):
        collate([([1], [1, 2], [-1.0], 0.0)], pad_id=0)


def _reference_step(batches, loss_cfg, optim_cfg, max_len=None, adamw=False, temperature=1.0, build=None,
                    score_all=False):
    """The plain single-process update(s): the whole batch in one forward, no sharding, no micro-batches
    (on ``build()``'s model, default :func:`tiny_model`). ``score_all``: the log-probs of every
    completion-side token (environment ones too, :func:`stream_mask`) are computed, and only the loss's
    mask (``completion_mask``) keeps the model tokens out of them."""
    model = (build or tiny_model)()
    lp = functools.partial(token_logprobs, temperature=temperature)
    opt = make_optimizer(model, optim_cfg) if adamw else torch.optim.SGD(model.parameters(), lr=LR)
    before = lora_params(model)
    for batch in batches:
        scored = stream_mask(batch) if score_all else batch.completion_mask
        logp = lp(model, batch.input_ids, batch.attention_mask, scored)
        ref_logp = None
        if loss_cfg.kl_beta > 0:
            with torch.no_grad(), model.disable_adapter():
                ref_logp = lp(model, batch.input_ids, batch.attention_mask, scored)
        norm = None
        if loss_cfg.loss_type == "dr_grpo":  # sum / (B * max_len), max_len the longest completion or given
            longest = int(batch.completion_mask.sum(dim=1).max())
            norm = Normalizer(len(batch), int(batch.completion_mask.sum()), max_len or longest)
        trainer_old = loss_cfg.old_logp_source == "trainer"
        loss, st = grpo_loss(
            logp,
            logp.detach() if trainer_old else batch.old_logp,
            ref_logp,
            batch.adv,
            batch.completion_mask,
            clip_eps=loss_cfg.clip_eps,
            clip_eps_high=loss_cfg.clip_eps_high,
            kl_beta=loss_cfg.kl_beta,
            loss_type=loss_cfg.loss_type,
            norm=norm,
            sampling_logp=batch.old_logp if trainer_old and loss_cfg.importance_sampling_correction else None,
            is_mode=loss_cfg.importance_sampling_mode,
            is_cap=loss_cfg.importance_sampling_cap,
        )
        loss.backward()
        tokens = st.summary()["tokens"]
        if loss_cfg.kl_beta == 0:  # the step's stats cover the rows it trains: those with an advantage
            rows = (batch.adv != 0).nonzero().squeeze(1)
            _, st = grpo_loss(
                logp[rows], (logp.detach() if trainer_old else batch.old_logp)[rows], None, batch.adv[rows],
                batch.completion_mask[rows], clip_eps=loss_cfg.clip_eps, clip_eps_high=loss_cfg.clip_eps_high,
                sampling_logp=batch.old_logp[rows] if trainer_old and loss_cfg.importance_sampling_correction else None,
                is_mode=loss_cfg.importance_sampling_mode, is_cap=loss_cfg.importance_sampling_cap,
            )
        max_norm = optim_cfg.max_grad_norm if optim_cfg.max_grad_norm > 0 else float("inf")
        grad_norm = float(torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], max_norm))
        opt.step()
        opt.zero_grad()
    after = lora_params(model)
    stats = {"loss": loss.item(), **st.summary(), "grad_norm": grad_norm}
    stats["tokens"], stats["tokens_trained"] = tokens, stats["tokens"]
    return {k: after[k] - before[k] for k in after}, stats


def rel_err(got: dict, want: dict) -> float:
    num = sum(float((got[k] - want[k]).pow(2).sum()) for k in want)
    den = sum(float(want[k].pow(2).sum()) for k in want)
    return math.sqrt(num / den)


def _assert_stats_close(got: dict, want: dict, rel=1e-8):
    for k, v in want.items():
        if v is None:
            assert got[k] is None, k
        elif math.isnan(v):
            assert math.isnan(got[k]), k
        else:
            assert got[k] == pytest.approx(v, rel=rel, abs=1e-12), k


FLOAT32_LOGPROB_TOL = 8 * torch.finfo(torch.float32).eps
"""Eager attention computes its softmax in float32 (transformers' ``eager_attention_forward``) even in
a float64 model, so two layouts of the same rows (a shared prompt, or every row in full) round the
attention weights differently, by a CPU's float32 kernels: a few float32 ulps in each log-prob (2.1e-8
was measured on one machine, exactly 0 on another), never float64's 1e-12."""


LAYOUTS = {"padded": dict(share_prompt=False), "shared": dict(share_prompt=True),
           "packed": dict(share_prompt=False, packing=True, micro_batch_tokens=24),
           "packed_shared": dict(share_prompt=True, packing=True, micro_batch_tokens=24)}
"""The forward layouts a step can train with; the packed ones with a budget that cuts these tests'
batches into several micro-batches (rows of 2-12 tokens)."""


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo"])
def test_single_process_step_matches_reference(loss_type, layout, monkeypatch):
    def no_collectives(*a, **k):
        raise AssertionError("world_size 1 must not call torch.distributed")

    for name in ("all_reduce", "broadcast", "all_gather", "get_rank", "get_world_size", "barrier"):
        monkeypatch.setattr(dist, name, no_collectives)
    batch = make_batch(5, seed=3, group=2)
    loss_cfg = LossConfig(loss_type=loss_type, kl_beta=0.05, clip_eps_high=0.28)
    optim_cfg = OptimConfig(micro_batch=3, max_grad_norm=10.0, **LAYOUTS[layout])
    assert len(micro_batch_bounds(batch, optim_cfg)) >= 2
    model = tiny_model()
    before = lora_params(model)
    stats = grpo_step(model, torch.optim.SGD(model.parameters(), lr=LR), batch, loss_cfg, optim_cfg)
    delta = {k: v - before[k] for k, v in lora_params(model).items()}
    want_delta, want_stats = _reference_step([batch], loss_cfg, optim_cfg)
    assert rel_err(delta, want_delta) < 1e-10
    _assert_stats_close(stats, want_stats)
    assert stats["samples"] == 5 and stats["clip_frac"] > 0 and stats["kl"] > 0
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("share_prompt", [True, False])
def test_tempered_step_scores_the_tempered_policy_and_reference(share_prompt):
    """temperature: the ratio and the KL are those of the tempered distributions (TRL's scoring),
    which the engines' sampling log-probs are of."""
    batch = make_batch(5, seed=3, group=2)
    loss_cfg = LossConfig(kl_beta=0.05)
    optim_cfg = OptimConfig(micro_batch=3, max_grad_norm=10.0, share_prompt=share_prompt)
    runs = {}
    for temperature in (0.7, 1.0):
        model = tiny_model()
        before = lora_params(model)
        stats = grpo_step(model, torch.optim.SGD(model.parameters(), lr=LR), batch, loss_cfg, optim_cfg,
                          temperature=temperature)
        runs[temperature] = ({k: v - before[k] for k, v in lora_params(model).items()}, stats)
    delta, stats = runs[0.7]
    want_delta, want_stats = _reference_step([batch], loss_cfg, optim_cfg, temperature=0.7)
    assert rel_err(delta, want_delta) < 1e-10
    _assert_stats_close(stats, want_stats)
    assert stats["kl"] != pytest.approx(runs[1.0][1]["kl"], rel=1e-3)  # the temperature mattered
    assert stats["ratio_mean"] != pytest.approx(runs[1.0][1]["ratio_mean"], rel=1e-3)


class RowCounter:
    """Counts the sequences the model's forwards see (hooked on the embedding)."""

    def __init__(self, model):
        self.rows = 0
        emb = model.get_input_embeddings()
        emb.register_forward_hook(lambda mod, args, out: setattr(self, "rows", self.rows + args[0].shape[0]))


@pytest.mark.parametrize("share_prompt", [True, False])
@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo"])
def test_zero_advantage_rows_are_skipped_without_changing_the_update(loss_type, share_prompt):
    """kl_beta = 0: rows with advantage 0 (two whole groups and a lone row) never reach the model,
    and the update equals the plain one on the whole batch; with the KL term on, every row is trained."""
    batch = make_batch(9, seed=5, zero_adv=range(0, 6), group=3)
    batch = TrainBatch(**{**{f: getattr(batch, f) for f in ("input_ids", "attention_mask", "completion_mask", "old_logp")},
                          "adv": torch.cat([batch.adv[:6], torch.tensor([0.0, 0.7, -1.3], dtype=batch.adv.dtype)])})
    optim_cfg = OptimConfig(micro_batch=4, max_grad_norm=10.0, share_prompt=share_prompt)
    for kl_beta, trained in ((0.0, 2), (0.05, 9)):
        loss_cfg = LossConfig(loss_type=loss_type, kl_beta=kl_beta)
        model = tiny_model()
        seen = RowCounter(model)
        before = lora_params(model)
        stats = grpo_step(model, torch.optim.SGD(model.parameters(), lr=LR), batch, loss_cfg, optim_cfg, max_len=8)
        delta = {k: v - before[k] for k, v in lora_params(model).items()}
        want_delta, want_stats = _reference_step([batch], loss_cfg, optim_cfg, max_len=8)
        assert rel_err(delta, want_delta) < 1e-10, (kl_beta, rel_err(delta, want_delta))
        _assert_stats_close(stats, want_stats)
        # the forwards saw what a step on the trained rows alone sees (prompt rows included with share_prompt)
        alone = tiny_model()
        want_rows = RowCounter(alone)
        rows = (batch.adv != 0).nonzero().squeeze(1) if kl_beta == 0 else torch.arange(9)
        grpo_step(alone, torch.optim.SGD(alone.parameters(), lr=LR), batch[rows], loss_cfg, optim_cfg, max_len=8)
        assert seen.rows == want_rows.rows and len(rows) == trained
        assert stats["samples"] == 9 and stats["samples_nonzero_adv"] == 2
        assert stats["tokens"] == int(batch.completion_mask.sum())
        assert (stats["tokens_trained"] < stats["tokens"]) == (kl_beta == 0)


def test_all_zero_advantage_batch_without_kl_does_no_work():
    model = tiny_model()
    seen = RowCounter(model)
    before = lora_params(model)
    batch = make_batch(6, seed=6, zero_adv=range(6), group=3)
    stats = grpo_step(model, torch.optim.SGD(model.parameters(), lr=LR), batch, LossConfig(kl_beta=0.0), OptimConfig())
    assert seen.rows == 0 and stats["loss"] == 0 and stats["tokens_trained"] == 0 and stats["grad_norm"] == 0
    assert all(torch.equal(v, before[k]) for k, v in lora_params(model).items())


@pytest.mark.parametrize("packing", [False, True])
def test_a_sliding_window_model_trains_without_shared_prompts_past_its_window(packing):
    """Review finding: the shared-prompt forwards put completions at cache indices past the padded
    prompt, which a sliding window counts (Gemma-2/3, Mistral-v0.1): log-probs off by 0.08 on
    sequences longer than the window. Past it, share_prompt is off for the step (with a warning), so
    the update is the unshared one; within it, shared prompts stay on."""
    from grpo_kit.logprobs import attention_window

    windowed = {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 0}
    assert attention_window(tiny_model(**windowed)) == 4 and attention_window(tiny_model()) is None
    batch = make_batch(6, seed=3, group=3)
    assert batch.input_ids.shape[1] > 4
    shared_off_as_unshared(batch, windowed, OptimConfig(packing=packing, micro_batch_tokens=10_000))


def shared_off_as_unshared(batch, windowed: dict, cfg: OptimConfig) -> None:
    """A step with ``share_prompt`` on warns that the window turned it off and makes the update of the
    step with it off."""
    updates = {}
    for share in (False, True):
        model = tiny_model(**windowed)
        before = lora_params(model)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            grpo_step(model, torch.optim.SGD(model.parameters(), lr=LR), batch, LossConfig(kl_beta=0.0),
                      replace(cfg, share_prompt=share))
        window = windowed["sliding_window"]
        assert any(f"sliding attention window ({window} tokens)" in str(w.message) for w in caught) == share
        updates[share] = {k: v - before[k] for k, v in lora_params(model).items()}
    assert all(torch.allclose(updates[True][k], updates[False][k], rtol=1e-9, atol=1e-12) for k in updates[False])


@pytest.mark.parametrize("packing", [False, True])
def test_shared_prompts_stay_off_where_the_longest_prompt_and_completion_pass_the_window(packing):
    """Review finding: the guard compared the batch's width with the window, but a completion token's
    cache index is the micro-batch's longest prompt plus its own place: one row with a long prompt
    and one with a long completion (width 11, window 12) trained on log-probs 0.08 off, unwarned."""
    gen = torch.Generator().manual_seed(1)
    ids = lambda n: torch.randint(1, VOCAB, (n,), generator=gen).tolist()  # noqa: E731
    batch = collate([(ids(10), ids(1), [-3.0], 1.0), (ids(1), ids(10), [-3.0] * 10, -1.0)], pad_id=0,
                    dtype=torch.float64)
    windowed = {"use_sliding_window": True, "sliding_window": 12, "max_window_layers": 0}
    assert batch.input_ids.shape[1] <= 12  # the old guard let sharing on
    shared_off_as_unshared(batch, windowed, OptimConfig(packing=packing, micro_batch_tokens=10_000, max_grad_norm=0))


def test_gpt_neo_local_layers_are_a_sliding_window():
    """Review finding: GPT-Neo names its window ``window_size`` on ``local`` layers; read as no window,
    shared prompts stayed on and its update was 12% off past 256 tokens."""
    from transformers import GPTNeoConfig, GPTNeoForCausalLM

    from grpo_kit.logprobs import attention_window

    local = GPTNeoForCausalLM(GPTNeoConfig(vocab_size=VOCAB, hidden_size=16, num_layers=2, num_heads=2,
                                           attention_types=[[["global", "local"], 1]], window_size=4))
    plain = GPTNeoForCausalLM(GPTNeoConfig(vocab_size=VOCAB, hidden_size=16, num_layers=2, num_heads=2,
                                           attention_types=[[["global"], 2]], window_size=4))
    assert (attention_window(local), attention_window(plain)) == (4, None)


def test_an_all_zero_advantage_batch_still_steps_the_optimizer_as_the_whole_batch_would():
    """Review finding: with no row left to run, no gradient existed and AdamW skipped every parameter
    (no decay, no moment update, no step count) in one process, while DDP (zero reduced gradients)
    and the whole-batch update step: single- and multi-rank runs diverged from then on."""
    import copy

    model = tiny_model()
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1)
    ref_opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1)
    batch = make_batch(6, seed=6, zero_adv=range(6), group=3)
    grpo_step(model, opt, batch, LossConfig(kl_beta=0.0), OptimConfig())
    for p in ref.parameters():
        if p.requires_grad:
            p.grad = torch.zeros_like(p)  # the whole batch's gradient: exactly 0
    ref_opt.step()
    got, want = lora_params(model), lora_params(ref)
    assert any(not torch.equal(v, lora_params(tiny_model())[k]) for k, v in got.items())  # weight decay moved them
    assert all(torch.equal(v, want[k]) for k, v in got.items())
    assert [s["step"] for s in opt.state.values()] == [s["step"] for s in ref_opt.state.values()] and opt.state


# ---------------------------------------------------------------- episode masks (environment tokens in the stream)


def test_collate_episode_mask():
    b = collate([([5], [7, 8, 9, 3], [-1.0, 0.0, 0.0, -3.0], 0.5, [1, 0, 0, 1]), ([4, 2], [6], [-2.0], 1.0)], pad_id=0)
    assert b.input_ids.tolist() == [[5, 7, 8, 9, 3], [4, 2, 6, 0, 0]]
    assert b.attention_mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]]  # env ids are real tokens
    assert b.completion_mask.tolist() == [[0, 1, 0, 0, 1], [0, 0, 1, 0, 0]]  # and not scored
    assert b.old_logp.tolist() == [[0, -1.0, 0, 0, -3.0], [0, 0, -2.0, 0, 0]]
    # log-probs off the mask are not kept, whatever they hold
    junk = collate([([5], [7, 8], [-1.0, float("nan")], 0.5, [1, 0])], pad_id=0)
    assert junk.old_logp.tolist() == [[0, -1.0, 0]]
    for bad in ([1, 0, 1], [1, 2], [1]):
        with pytest.raises(ValueError, match="mask"):
            collate([([5], [7, 8], [-1.0, -1.0], 0.5, bad)], pad_id=0)
    with pytest.raises(ValueError, match="padding"):  # a scored token the model cannot see
        token_logprobs(tiny_model(), b.input_ids, b.attention_mask, b.completion_mask | torch.tensor([[0] * 5, [0, 0, 0, 1, 0]]))


@pytest.mark.parametrize("layout", ["padded", "shared", "packed_shared"])  # plain packing: the log-prob tests
@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo"])
def test_masked_step_matches_the_whole_stream_scored_with_the_mask_applied(loss_type, layout):
    """Episodes with environment holes: the step equals a reference that scores every completion-side
    token in one full forward and keeps the model tokens by the loss's mask only; the stats count the
    model tokens."""
    batch = make_episode_batch(7, seed=21, group=3)
    env = env_positions(batch)
    assert env.sum() >= 6 and (env.any(1)).sum() >= 4  # holes in most rows
    loss_cfg = LossConfig(loss_type=loss_type, kl_beta=0.05, clip_eps_high=0.28)
    optim_cfg = OptimConfig(micro_batch=3, max_grad_norm=10.0, **LAYOUTS[layout])
    model = tiny_model()
    before = lora_params(model)
    stats = grpo_step(model, torch.optim.SGD(model.parameters(), lr=LR), batch, loss_cfg, optim_cfg)
    delta = {k: v - before[k] for k, v in lora_params(model).items()}
    want_delta, want_stats = _reference_step([batch], loss_cfg, optim_cfg, score_all=True)
    assert rel_err(delta, want_delta) < 1e-10
    _assert_stats_close(stats, want_stats)
    assert stats["tokens"] == int(batch.completion_mask.sum()) < int(stream_mask(batch).sum())
    assert stats["clip_frac"] > 0 and stats["kl"] > 0
    # the mask is what made it so: the same rows with every completion-side token scored differ
    full = replace(batch, completion_mask=stream_mask(batch))
    other = tiny_model()
    grpo_step(other, torch.optim.SGD(other.parameters(), lr=LR), full, loss_cfg, optim_cfg)
    assert rel_err({k: v - before[k] for k, v in lora_params(other).items()}, want_delta) > 1e-3


@pytest.mark.parametrize("share_prompt", [True, False])
@pytest.mark.parametrize(("loss_type", "old_source", "is_mode"),
                         [("grpo", "engine", "sequence_mask"), ("dapo", "trainer", "sequence_mask"),
                          ("dr_grpo", "trainer", "sequence_truncate")])
def test_env_token_old_logprobs_change_nothing(loss_type, old_source, is_mode, share_prompt):
    """Whatever the environment tokens' old (engine) log-probs hold, the update and the stats are
    bit-identical, also where they feed the per-sequence mismatch weight; the model tokens' change both."""
    batch = make_episode_batch(6, seed=23, group=2)
    env = env_positions(batch)
    loss_cfg = LossConfig(loss_type=loss_type, kl_beta=0.05, old_logp_source=old_source, importance_sampling_mode=is_mode,
                          importance_sampling_cap=2.0)
    optim_cfg = OptimConfig(micro_batch=4, max_grad_norm=10.0, share_prompt=share_prompt)

    def step(b):
        model = tiny_model()
        before = lora_params(model)
        stats = grpo_step(model, torch.optim.SGD(model.parameters(), lr=LR), b, loss_cfg, optim_cfg)
        return {k: v - before[k] for k, v in lora_params(model).items()}, stats

    delta, stats = step(batch)
    junk = torch.tensor([float("nan"), float("inf"), -float("inf"), 1e4, -7.0], dtype=batch.old_logp.dtype)
    old = batch.old_logp.clone()
    old[env] = junk.repeat(int(env.sum()))[: int(env.sum())]
    got_delta, got_stats = step(replace(batch, old_logp=old))
    assert all(torch.equal(got_delta[k], delta[k]) for k in delta)
    assert got_stats == stats
    moved = batch.old_logp - 0.02 * batch.completion_mask  # the model tokens' (a capped row may hide one token's)
    moved_delta, moved_stats = step(replace(batch, old_logp=moved))
    assert rel_err(moved_delta, delta) > 1e-6
    assert moved_stats["is_mean" if old_source == "trainer" else "ratio_mean"] != stats[
        "is_mean" if old_source == "trainer" else "ratio_mean"]


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo"])
def test_zero_advantage_episodes_are_skipped(loss_type):
    """kl_beta = 0: a group of episodes without reward spread never reaches the model; the update is
    the plain one on the whole batch (its model tokens still in the normalizers)."""
    batch = make_episode_batch(6, seed=24, zero_adv=range(0, 3), group=3)
    loss_cfg = LossConfig(loss_type=loss_type, kl_beta=0.0)
    optim_cfg = OptimConfig(micro_batch=4, max_grad_norm=10.0)
    model = tiny_model()
    seen = RowCounter(model)
    before = lora_params(model)
    stats = grpo_step(model, torch.optim.SGD(model.parameters(), lr=LR), batch, loss_cfg, optim_cfg)
    delta = {k: v - before[k] for k, v in lora_params(model).items()}
    want_delta, want_stats = _reference_step([batch], loss_cfg, optim_cfg, score_all=True)
    assert rel_err(delta, want_delta) < 1e-10
    _assert_stats_close(stats, want_stats)
    assert stats["tokens"] == int(batch.completion_mask.sum())
    assert stats["tokens_trained"] == int(batch.completion_mask[3:].sum())
    assert seen.rows == 3 + 1  # the second group's three rows, and its prompt once


def test_make_optimizer_and_shard_bounds():
    model = tiny_model()
    opt = make_optimizer(model, OptimConfig(lr=1e-3, weight_decay=0.1))
    assert isinstance(opt, torch.optim.AdamW)
    trainable = {id(p) for p in model.parameters() if p.requires_grad}
    assert {id(p) for g in opt.param_groups for p in g["params"]} == trainable
    assert all("lora_" in n for n, p in model.named_parameters() if p.requires_grad)
    assert [shard_bounds(5, r, 3) for r in range(3)] == [(0, 2), (2, 4), (4, 5)]  # numpy.array_split
    assert [shard_bounds(2, r, 3) for r in range(3)] == [(0, 1), (1, 2), (2, 2)]
    assert [shard_bounds(4, r, 3, [2, 0, 2]) for r in range(3)] == [(0, 2), (2, 2), (2, 4)]
    with pytest.raises(ValueError):
        shard_bounds(4, 0, 2, [1, 1])


def test_single_process_rejects_world_size_without_ddp():
    model = tiny_model()
    with pytest.raises(ValueError, match="DDP"):
        grpo_step(
            model, make_optimizer(model, OptimConfig()), make_batch(2, 0), LossConfig(), OptimConfig(), world_size=2
        )


# ---------------------------------------------------------------- real gloo process groups


@dataclass(frozen=True)
class Case:
    name: str
    loss: LossConfig
    optim: OptimConfig
    n: int
    shard_sizes: tuple[int, ...] | None = None
    zero_adv_rank: int | None = None  # that rank's samples all get advantage 0
    max_len: int | None = None
    steps: int = 1
    adamw: bool = False
    episodes: bool = False  # multi-turn rows with environment holes (make_episode_batch)

    def batches(self, world_size: int) -> list[TrainBatch]:
        zero = range(0)
        if self.zero_adv_rank is not None:
            zero = range(*shard_bounds(self.n, self.zero_adv_rank, world_size, self.shard_sizes))
        # groups of 3 share a prompt, so groups straddle shard and micro-batch edges
        make = make_episode_batch if self.episodes else make_batch
        return [make(self.n, seed=100 + s, zero_adv=zero, group=3) for s in range(self.steps)]


KL = LossConfig(kl_beta=0.05)
CASES = {
    2: [
        # rank 0 empty in both steps (step 2 also covers DDP's bucket rebuild after the first sync)
        Case("grpo_empty_shard", KL, OptimConfig(micro_batch=2, max_grad_norm=10.0), n=5, shard_sizes=(0, 5), steps=2),
        Case(
            "dapo_uneven_clip_higher",
            replace(KL, loss_type="dapo", clip_eps_high=0.28),
            OptimConfig(micro_batch=3, max_grad_norm=0.05, lr=1e-2),  # the clip is active
            n=5,
            shard_sizes=(4, 1),
            adamw=True,
        ),
        Case(
            "dr_grpo_zero_adv_no_kl",
            LossConfig(loss_type="dr_grpo", kl_beta=0.0),
            OptimConfig(micro_batch=2, max_grad_norm=10.0),
            n=6,
            zero_adv_rank=1,
            max_len=8,
        ),
        # TRL's semantics: the trainer's own old log-probs, the engine's corrected by a capped weight
        Case(
            "grpo_trainer_old_sequence_mask",
            replace(KL, old_logp_source="trainer", importance_sampling_mode="sequence_mask", importance_sampling_cap=2.0),
            OptimConfig(micro_batch=2, max_grad_norm=10.0),
            n=5,
            shard_sizes=(1, 4),
        ),
        Case(
            "dapo_trainer_old_token_truncate",
            replace(KL, loss_type="dapo", old_logp_source="trainer", importance_sampling_mode="token_truncate",
                    importance_sampling_cap=1.5),
            OptimConfig(micro_batch=3, max_grad_norm=10.0),
            n=6,
            zero_adv_rank=0,
        ),
        # packed, padding-free, the ranks balanced by tokens (shard_sizes None: 4 and 3 rows here)
        Case("dapo_packed_shared_balanced", replace(KL, loss_type="dapo", clip_eps_high=0.28),
             OptimConfig(max_grad_norm=10.0, packing=True, micro_batch_tokens=20), n=7),
    ],
    3: [
        Case("grpo_array_split", KL, OptimConfig(micro_batch=2, max_grad_norm=10.0), n=7, zero_adv_rank=2),
        Case(
            "dapo_empty_middle",
            replace(KL, loss_type="dapo", kl_beta=0.0),
            OptimConfig(micro_batch=1, max_grad_norm=10.0),
            n=4,
            shard_sizes=(2, 0, 2),
            steps=2,
        ),
        # array_split of 2 samples over 3 ranks leaves the last one empty
        Case(
            "dr_grpo_tiny_batch", replace(KL, loss_type="dr_grpo"), OptimConfig(micro_batch=4, max_grad_norm=10.0), n=2
        ),
        Case("dr_grpo_packed_zero_adv_balanced", LossConfig(loss_type="dr_grpo", kl_beta=0.0),
             OptimConfig(max_grad_norm=10.0, packing=True, micro_batch_tokens=12), n=8, zero_adv_rank=1),
    ],
}


def _run_cases(rank: int, world_size: int, group) -> dict:
    results = {}
    for case in CASES[world_size]:
        model = tiny_model()
        before = lora_params(model)
        ddp = wrap_ddp(model, process_group=group)
        opt = make_optimizer(model, case.optim) if case.adamw else torch.optim.SGD(model.parameters(), lr=LR)
        for batch in case.batches(world_size):
            kw = dict(rank=rank, world_size=world_size, shard_sizes=case.shard_sizes, max_len=case.max_len)
            stats = grpo_step(ddp, opt, batch, case.loss, case.optim, **kw)
        results[case.name] = ({k: v - before[k] for k, v in lora_params(model).items()}, stats)
        del ddp, opt  # the DDP reducer must not outlive the process group (teardown can hang)
    gc.collect()
    return results


def _worker(rank: int, port: int, out_dir: str) -> None:
    """World size 3 on the default group, then world size 2 on the subgroup of ranks 0 and 1."""
    out = Path(out_dir)
    try:
        torch.set_num_threads(1)
        _float64_norms()
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=3,
            timeout=datetime.timedelta(seconds=60),
        )
        pair = dist.new_group([0, 1])  # every rank must take part in creating it
        results = {3: _run_cases(rank, 3, None)}
        if rank < 2:
            results[2] = _run_cases(rank, 2, pair)
        torch.save(results, out / f"rank{rank}.pt")
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        (out / f"rank{rank}.err").write_text(traceback.format_exc())
        raise


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_ranks(nprocs: int, out_dir: Path, timeout: float = 150.0, target=None) -> list[dict]:
    """Run ``target(rank, port, out_dir)`` (default ``_worker``) on ``nprocs`` ranks, each saving
    ``rank{r}.pt`` (or writing ``rank{r}.err``); kill them all and fail on a hang or an error."""
    ctx = mp.get_context("spawn")
    port = _free_port()
    target = target or _worker
    procs = [ctx.Process(target=target, args=(r, port, str(out_dir)), daemon=True) for r in range(nprocs)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(10)
    errors = {f.name: f.read_text() for f in sorted(out_dir.glob("*.err"))}
    done = [r for r in range(nprocs) if (out_dir / f"rank{r}.pt").exists()]
    assert not hung, f"ranks {hung} still running after {timeout} s (killed); results from {done}; errors: {errors}"
    assert all(p.exitcode == 0 for p in procs), f"exit codes {[p.exitcode for p in procs]}; errors: {errors}"
    return [torch.load(out_dir / f"rank{r}.pt") for r in range(nprocs)]


@pytest.fixture(scope="module")
def ddp_results(tmp_path_factory) -> list[dict]:
    """One spawn of 3 ranks runs every case (a spawn costs seconds of imports; the steps take less)."""
    return spawn_ranks(3, tmp_path_factory.mktemp("ddp"))


@pytest.mark.parametrize("world_size", [2, 3])
def test_ddp_step_matches_single_process(world_size, ddp_results):
    results = [res[world_size] for res in ddp_results[:world_size]]
    for case in CASES[world_size]:
        batches = case.batches(world_size)
        want_delta, want_stats = _reference_step(batches, case.loss, case.optim, case.max_len, case.adamw)
        rank0 = results[0][case.name][1]
        for rank, res in enumerate(results):
            delta, stats = res[case.name]
            # float64 throughout (norms patched, sdpa attention): only summation order differs
            assert rel_err(delta, want_delta) <= 1e-10, (case.name, rank, rel_err(delta, want_delta))
            # every rank reports the same (all-reduced) stats
            assert stats.keys() == rank0.keys()
            assert all(stats[k] == rank0[k] or (stats[k] is not None and math.isnan(stats[k]) and math.isnan(rank0[k]))
                       for k in stats)
        _assert_stats_close(rank0, want_stats, rel=1e-9)
        # the scenarios are what they claim to be
        last = batches[-1]
        assert rank0["samples"] == case.n
        assert rank0["samples_nonzero_adv"] == int((last.adv != 0).sum())
        assert rank0["tokens"] == int(last.completion_mask.sum())
        if case.loss.old_logp_source == "engine":
            assert rank0["clip_frac"] > 0 and rank0["is_mean"] is None
        else:  # the policy ratio is 1 at the single update; the mismatch weight was applied and capped
            assert rank0["ratio_mean"] == 1.0 and rank0["clip_frac"] == 0
            assert 0 < rank0["is_capped_frac"] < 1 and rank0["is_max"] > case.loss.importance_sampling_cap
        assert (rank0["kl"] > 0) if case.loss.kl_beta > 0 else math.isnan(rank0["kl"])
        if case.zero_adv_rank is not None:
            assert 0 < rank0["samples_nonzero_adv"] < case.n
            # without the KL term the zero-advantage rank skipped its whole shard (and still synced)
            assert (rank0["tokens_trained"] < rank0["tokens"]) == (case.loss.kl_beta == 0)


EPISODE_CASES = [
    Case("grpo_episodes_shared_prompt", KL, OptimConfig(micro_batch=2, max_grad_norm=10.0, share_prompt=True), n=7,
         shard_sizes=(2, 5), steps=2, episodes=True),
    Case("dapo_episodes_zero_adv_no_kl", LossConfig(loss_type="dapo", kl_beta=0.0, clip_eps_high=0.28),
         OptimConfig(micro_batch=3, max_grad_norm=10.0), n=6, zero_adv_rank=0, episodes=True),
    # max_len None: the longest row's model tokens, all-reduced with MAX
    Case("dr_grpo_episodes_trainer_sequence_mask",
         replace(KL, loss_type="dr_grpo", old_logp_source="trainer", importance_sampling_mode="sequence_mask",
                 importance_sampling_cap=2.0),
         OptimConfig(micro_batch=2, max_grad_norm=10.0, share_prompt=True), n=6, shard_sizes=(4, 2), episodes=True),
    Case("dapo_episodes_empty_rank_sequence_truncate",
         replace(KL, loss_type="dapo", old_logp_source="trainer", importance_sampling_mode="sequence_truncate",
                 importance_sampling_cap=1.5),
         OptimConfig(micro_batch=2, max_grad_norm=10.0), n=5, shard_sizes=(0, 5), episodes=True),
    Case("grpo_episodes_packed_shared", replace(KL, clip_eps_high=0.28),
         OptimConfig(max_grad_norm=10.0, packing=True, micro_batch_tokens=20), n=7, shard_sizes=(5, 2), episodes=True),
]


def _episode_worker(rank: int, port: int, out_dir: str) -> None:
    """:data:`EPISODE_CASES` at world size 2."""
    out = Path(out_dir)
    try:
        torch.set_num_threads(1)
        _float64_norms()
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                                timeout=datetime.timedelta(seconds=60))
        CASES[2], saved = EPISODE_CASES, CASES[2]  # _run_cases runs CASES[world_size]
        try:
            results = _run_cases(rank, 2, None)
        finally:
            CASES[2] = saved
        torch.save(results, out / f"rank{rank}.pt")
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        (out / f"rank{rank}.err").write_text(traceback.format_exc())
        raise


def test_ddp_step_on_episodes_matches_single_process(tmp_path):
    """Uneven episode lengths and hole patterns across two real gloo ranks (one empty, one whose rows
    all have advantage 0): the update and the stats are the single-process reference's, which scores
    the whole stream and keeps the model tokens by the mask."""
    results = spawn_ranks(2, tmp_path, target=_episode_worker)
    for case in EPISODE_CASES:
        batches = case.batches(2)
        for batch in batches:  # each non-empty shard holds environment holes
            for rank in range(2):
                lo, hi = shard_bounds(len(batch), rank, 2, case.shard_sizes)
                assert hi == lo or env_positions(batch[lo:hi]).any(), case.name
        want_delta, want_stats = _reference_step(batches, case.loss, case.optim, case.max_len, case.adamw,
                                                 score_all=True)
        rank0 = results[0][case.name][1]
        for res in results:
            delta, stats = res[case.name]
            assert rel_err(delta, want_delta) <= 1e-10, (case.name, rel_err(delta, want_delta))
            assert stats.keys() == rank0.keys() and all(  # a NaN statistic must be NaN on every rank
                stats[k] == rank0[k] or (isinstance(rank0[k], float) and math.isnan(rank0[k]) and math.isnan(stats[k]))
                for k in stats), (stats, rank0)
        _assert_stats_close(rank0, want_stats, rel=1e-9)
        last = batches[-1]
        assert rank0["tokens"] == int(last.completion_mask.sum()) < int(stream_mask(last).sum())
        if case.zero_adv_rank is not None:
            assert rank0["tokens_trained"] < rank0["tokens"]


class Routed(nn.Module):
    """A tiny LM whose layer runs each of two experts only on the tokens routed to it (odd or even
    ids), as a MoE block runs only the experts its router picked. The DDP step's 1-token sync
    forward (token 0) never reaches the ``odd`` expert, whose LoRA the default-style targets cover."""

    def __init__(self, hidden: int = 16):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, hidden)
        self.even = nn.Linear(hidden, hidden)
        self.odd = nn.Linear(hidden, hidden)
        self.head = nn.Linear(hidden, VOCAB)

    def forward(self, input_ids, attention_mask=None, use_cache=False, **kw):
        h = self.embed(input_ids)  # (B, T, H)
        h = h.cumsum(1) / torch.arange(1, h.shape[1] + 1, dtype=h.dtype)[:, None]  # causal: the prefix mean
        odd = input_ids % 2 == 1  # (B, T) the router
        mixed = torch.zeros_like(h)
        for routed, expert in ((~odd, self.even), (odd, self.odd)):
            if routed.any():  # an expert no token picked does not run
                mixed = mixed.index_put(routed.nonzero(as_tuple=True), torch.tanh(expert(h[routed])))
        return CausalLMOutput(logits=self.head(h + mixed))


def routed_model(seed: int = 0):
    torch.manual_seed(seed)
    base = Routed().to(torch.float64)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["even", "odd"], lora_dropout=0.0))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.1)
    return model


ROUTED = Case("routed_experts", KL, OptimConfig(micro_batch=2, max_grad_norm=10.0, share_prompt=False),  # no KV cache
              n=6, shard_sizes=(2, 4), steps=2)


def _routed_worker(rank: int, port: int, out_dir: str) -> None:
    """Two steps of :data:`ROUTED` on :func:`routed_model` at world size 2."""
    out = Path(out_dir)
    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                                timeout=datetime.timedelta(seconds=60))
        model = routed_model()
        before = lora_params(model)
        ddp = wrap_ddp(model)
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        for batch in ROUTED.batches(2):
            stats = grpo_step(ddp, opt, batch, ROUTED.loss, ROUTED.optim, rank=rank, world_size=2,
                              shard_sizes=ROUTED.shard_sizes)
        torch.save(({k: v - before[k] for k, v in lora_params(model).items()}, stats), out / f"rank{rank}.pt")
        del ddp, opt
        gc.collect()
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        (out / f"rank{rank}.err").write_text(traceback.format_exc())
        raise


def test_ddp_step_reduces_experts_the_sync_forward_skips(tmp_path):
    """The sync backward's 1-token forward skips an expert: without every trainable parameter in its
    graph, that expert's bucket was never reduced (ranks stepped on their local gradients) and the
    next step failed with "Expected to have finished reduction"."""
    batches = ROUTED.batches(2)
    for batch in batches:  # both experts are trained on both ranks' shards, and token 0 is even
        for lo, hi in ((0, 2), (2, 6)):
            ids = batch.input_ids[lo:hi][batch.attention_mask[lo:hi].bool()]
            assert (ids % 2 == 1).any() and (ids % 2 == 0).any()
    results = spawn_ranks(2, tmp_path, target=_routed_worker)
    want_delta, want_stats = _reference_step(batches, ROUTED.loss, ROUTED.optim, build=routed_model)
    assert any("odd" in k for k in want_delta) and all(v.abs().sum() > 0 for v in want_delta.values())
    for delta, stats in results:
        assert rel_err(delta, want_delta) <= 1e-10, rel_err(delta, want_delta)
        _assert_stats_close(stats, want_stats, rel=1e-9)


def test_ddp_requires_broadcast_buffers_false():
    # checked before any collective, so an unreachable process group is fine here
    model = tiny_model()
    fake = torch.nn.parallel.DistributedDataParallel.__new__(torch.nn.parallel.DistributedDataParallel)
    torch.nn.Module.__init__(fake)
    fake.module, fake.forward_sync_buffers, fake.process_group = model, True, None
    with pytest.raises(ValueError, match="broadcast_buffers"):
        grpo_step(
            fake, make_optimizer(model, OptimConfig()), make_batch(2, 0), LossConfig(), OptimConfig(), world_size=2
        )


@pytest.mark.parametrize("kl_beta", [0.0, 0.05])
def test_step_reports_the_engine_trainer_mismatch_of_the_trained_tokens(kl_beta):
    """``mismatch_kl`` / ``mismatch_far_frac`` / ``sampled_nll`` of the step (micro-batched, rows
    without advantage skipped when kl_beta == 0) are the whole batch's, from one forward, over the
    tokens trained; the engine's log-probs are the batch's ``old_logp``."""
    from grpo_kit.loss import mismatch_sums

    batch = make_batch(7, seed=12, zero_adv=range(2, 4), group=3)
    shift = torch.zeros_like(batch.old_logp)
    shift[0] = 1.5  # row 0's engine log-probs far from the trainer's (a 4.5x probability)
    batch = replace(batch, old_logp=torch.where(batch.completion_mask.bool(), batch.old_logp + shift, 0.0))
    loss_cfg = LossConfig(kl_beta=kl_beta)
    model = tiny_model()
    with torch.no_grad():
        logp = token_logprobs(model, batch.input_ids, batch.attention_mask, batch.completion_mask)
    rows = (batch.adv != 0) if kl_beta == 0 else torch.ones(len(batch), dtype=torch.bool)
    k3, far, nll = mismatch_sums(logp[rows], batch.old_logp[rows], batch.completion_mask[rows]).tolist()
    n = int(batch.completion_mask[rows].sum())
    stats = grpo_step(model, torch.optim.SGD(model.parameters(), lr=LR), batch, loss_cfg, OptimConfig(micro_batch=2))
    assert stats["tokens_trained"] == n < stats["tokens"] or kl_beta > 0
    assert stats["mismatch_kl"] == pytest.approx(k3 / n, rel=1e-10) and stats["mismatch_kl"] > 0
    assert stats["mismatch_far_frac"] == far / n and 0 < far < n
    assert stats["sampled_nll"] == pytest.approx(nll / n, rel=1e-10)


def test_step_without_trained_tokens_reports_no_mismatch():
    batch = make_batch(4, seed=1, zero_adv=range(4))
    model = tiny_model()
    stats = grpo_step(model, torch.optim.SGD(model.parameters(), lr=LR), batch, LossConfig(kl_beta=0.0), OptimConfig())
    assert stats["mismatch_kl"] is None and stats["mismatch_far_frac"] is None and stats["sampled_nll"] is None


def test_a_non_finite_gradient_skips_the_step_instead_of_writing_nan():
    """Review finding: an inf gradient (the KL term past ~88 nats in float32, an fp16 overflow) went
    through clipping as NaN and the optimizer wrote NaN into the adapter, which was then published."""
    model = tiny_model()
    params = [p for p in model.parameters() if p.requires_grad]
    before = [p.detach().clone() for p in params]
    params[0].register_hook(lambda g: torch.full_like(g, float("inf")))
    stats = grpo_step(model, torch.optim.AdamW(params, lr=1e-2), make_batch(4, seed=3), LossConfig(kl_beta=0.0),
                      OptimConfig(micro_batch=2))
    assert not math.isfinite(stats["grad_norm"])
    assert all(torch.equal(a, p) for a, p in zip(before, params, strict=True))  # unchanged, no NaN
    assert all(p.grad is None for p in params)  # and nothing carried into the next step
