"""grpo_kit.logprobs: token log-probs against a naive per-position reference, half-precision
logits, and shared prompts (values and gradients equal to the full forward; episode rows).

The tiny Qwen3 model, the batches and the float64 norms are tests/test_train_step.py's.
"""

from __future__ import annotations

import pytest
import torch
from test_train_step import (  # noqa: F401  (float64_norms: an autouse fixture)
    FLOAT32_LOGPROB_TOL,
    RowCounter,
    env_positions,
    float64_norms,
    make_batch,
    make_episode_batch,
    rel_err,
    stream_mask,
    tiny_model,
)

from grpo_kit.logprobs import shared_prompt_logprobs, token_logprobs


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_token_logprobs_matches_naive_per_position(temperature):
    """At a temperature, the log-probs of the tempered distribution the engines sample from."""
    model = tiny_model()
    batch = make_batch(5, seed=1)
    got = token_logprobs(model, batch.input_ids, batch.attention_mask, batch.completion_mask, chunk=3,
                         temperature=temperature)
    want = torch.zeros_like(got)
    with torch.no_grad():
        for b in range(len(batch)):
            for t in range(1, batch.input_ids.shape[1]):
                if batch.completion_mask[b, t]:
                    # the unpadded prefix alone: padding and later tokens cannot leak in
                    logits = model(input_ids=batch.input_ids[b : b + 1, :t]).logits[0, -1]
                    want[b, t] = torch.log_softmax(logits / temperature, dim=-1)[batch.input_ids[b, t]]
    assert got.shape == batch.input_ids.shape
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    assert (got[batch.completion_mask == 0] == 0).all()


def test_token_logprobs_upcasts_half_logits_and_keeps_gradients():
    model = tiny_model().to(torch.bfloat16)
    batch = make_batch(3, seed=2)
    got = token_logprobs(model, batch.input_ids, batch.attention_mask, batch.completion_mask)
    assert got.dtype == torch.float32 and got.requires_grad
    got.sum().backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters() if p.requires_grad)


@pytest.mark.parametrize(("attn", "logprob_tol", "grad_tol"),
                         [("sdpa", 1e-12, 1e-12), ("eager", FLOAT32_LOGPROB_TOL, 1e-6)])
def test_shared_prompt_logprobs_equal_the_full_forward(attn, logprob_tol, grad_tol):
    """Groups of different sizes and prompt lengths, a row with no completion, a group cut by the
    batch edge: the same log-probs, and the same gradients, as running every row in full (the norms
    in float64, see _float64_norms; eager attention's softmax is float32 even so: FLOAT32_LOGPROB_TOL)."""
    model = tiny_model(attn=attn)
    batch = make_batch(11, seed=4, group=4)
    assert batch.input_ids[0, 0] == batch.input_ids[3, 0] != batch.input_ids[4, 0]  # groups share a prompt
    args = (batch.input_ids, batch.attention_mask, batch.completion_mask)
    grads = []
    outs = []
    for fn in (token_logprobs, shared_prompt_logprobs):
        model.zero_grad()
        out = fn(model, *args, chunk=5)
        (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).reshape(out.shape)).sum().backward()
        outs.append(out.detach())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad})
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-10, atol=logprob_tol)
    assert (outs[1][batch.completion_mask == 0] == 0).all()
    with torch.no_grad():  # tempered: the same values as the full forward's, which differ from untempered
        hot = [fn(model, *args, temperature=0.7) for fn in (token_logprobs, shared_prompt_logprobs)]
    torch.testing.assert_close(hot[1], hot[0], rtol=1e-10, atol=logprob_tol)  # eager: float32 softmax here too
    assert (hot[0] - outs[0]).abs().max() > 0.01
    assert rel_err(grads[1], grads[0]) < grad_tol
    # one row, a batch of empty completions, a row of another layout
    one = batch[2:3].trim()
    torch.testing.assert_close(shared_prompt_logprobs(model, one.input_ids, one.attention_mask, one.completion_mask),
                               token_logprobs(model, one.input_ids, one.attention_mask, one.completion_mask))
    empty = batch[1:2].trim()
    assert shared_prompt_logprobs(model, empty.input_ids, empty.attention_mask, empty.completion_mask).requires_grad
    holes = batch.completion_mask.clone()
    holes[0, -1] = 1  # a "completion" token on padding
    with pytest.raises(ValueError, match="right-padded"):
        shared_prompt_logprobs(model, batch.input_ids, batch.attention_mask, holes)


@pytest.mark.parametrize(("attn", "logprob_tol", "grad_tol"),
                         [("sdpa", 1e-12, 1e-12), ("eager", FLOAT32_LOGPROB_TOL, 1e-6)])
def test_shared_prompt_logprobs_on_episode_rows(attn, logprob_tol, grad_tol):
    """Rows with environment holes: the shared prompt runs once per group and the values and
    gradients equal the full forward's; holes on real tokens are legal, scored padding is not."""
    model = tiny_model(attn=attn)
    batch = make_episode_batch(10, seed=22, group=4)
    assert env_positions(batch).sum() >= 6
    args = (batch.input_ids, batch.attention_mask, batch.completion_mask)
    outs, grads = [], []
    for fn in (token_logprobs, shared_prompt_logprobs):
        model.zero_grad()
        seen = RowCounter(model)
        out = fn(model, *args, chunk=5)
        (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).reshape(out.shape)).sum().backward()
        outs.append(out.detach())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad})
    assert seen.rows == 3 + 10  # 3 prompts (groups of 4, 4, 2) once, then the 10 rows on their caches
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-10, atol=logprob_tol)
    assert (outs[1][batch.completion_mask == 0] == 0).all()
    assert rel_err(grads[1], grads[0]) < grad_tol
    # the environment tokens scored too (the whole stream): the model tokens' values are the same
    whole = shared_prompt_logprobs(model, batch.input_ids, batch.attention_mask, stream_mask(batch))
    torch.testing.assert_close(whole.detach() * batch.completion_mask, outs[0], rtol=1e-10, atol=logprob_tol)
    assert (whole[env_positions(batch)] != 0).all()
    pad = batch.completion_mask.clone()
    pad[0, -1] = 1  # a scored token on padding (row 0 is shorter than the batch)
    assert batch.attention_mask[0, -1] == 0
    for fn in (token_logprobs, shared_prompt_logprobs):
        with pytest.raises(ValueError, match="right-padded"):
            fn(model, batch.input_ids, batch.attention_mask, pad)
    left = batch.attention_mask.clone()
    left[0, 0] = 0  # a left pad: not collate's layout
    with pytest.raises(ValueError, match="right-padded"):
        shared_prompt_logprobs(model, batch.input_ids, left, batch.completion_mask)


# ---------------------------------------------------------------- packed (padding-free) forwards
