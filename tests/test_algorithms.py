"""grpo_kit.algorithms: the registries, each built-in against a naive per-token float64 reference
(value and gradient), masked garbage, and the train step's exactness (micro-batches, DDP on real
gloo process groups with uneven and empty shards) for the new losses."""

import datetime
import math
import subprocess
import sys
import traceback
import zlib
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from test_train_step import (  # pytest puts tests/ on sys.path
    LR,
    _float64_norms,
    float64_norms,  # noqa: F401  (autouse: float64 norms in this module too)
    lora_params,
    make_batch,
    make_episode_batch,
    spawn_ranks,
    tiny_model,
)

from grpo_kit import algorithms
from grpo_kit.algorithms import (
    ADVANTAGES,
    GSPO_CLIP,
    POLICY_LOSSES,
    compute_advantages,
    gspo_clip_range,
    register_advantage,
    register_policy_loss,
)
from grpo_kit.config import LossConfig, OptimConfig, profile
from grpo_kit.logprobs import token_logprobs
from grpo_kit.loss import LossStats, Normalizer, aggregate, group_advantages, grpo_loss, token_stats
from grpo_kit.train_step import grpo_step, wrap_ddp

F64 = torch.float64


# ---------------------------------------------------------------- naive references (python floats, scalar autograd)


def _weights(old, samp, mask, mode, cap):
    """The engine-mismatch weight per token, naive (detached floats)."""
    B, T = len(mask), len(mask[0])
    out = [[0.0] * T for _ in range(B)]
    for i in range(B):
        seq = sum(float(old[i][t]) - float(samp[i][t]) for t in range(T) if mask[i][t])
        for t in range(T):
            if mask[i][t]:
                raw = math.exp(seq if mode.startswith("sequence") else float(old[i][t]) - float(samp[i][t]))
                out[i][t] = min(raw, cap) if mode.endswith("truncate") else (0.0 if raw > cap else raw)
    return out


def naive_loss(name, logp, old, ref, adv, mask, cfg, norm=None, samp=None):
    """The loss ``name`` summed token by token from scalar tensors (autograd through the loops)."""
    B, T = mask.shape
    w = _weights(old, samp, mask.tolist(), cfg.importance_sampling_mode, cfg.importance_sampling_cap) if samp is not None \
        else [[1.0] * T for _ in range(B)]
    per_seq, n_tok = [], 0
    for i in range(B):
        toks = [t for t in range(T) if mask[i, t]]
        n_tok += len(toks)
        a = float(adv[i])
        if name == "gspo":
            low, high = gspo_clip_range(cfg)
            s = sum((logp[i, t] - float(old[i, t]) for t in toks), torch.zeros((), dtype=F64))
            s = torch.exp(s / max(len(toks), 1))
        terms = []
        for t in toks:
            if name == "grpo":
                eh = cfg.clip_eps if cfg.clip_eps_high is None else cfg.clip_eps_high
                r = torch.exp(logp[i, t] - float(old[i, t]))
                pg = -torch.minimum(r * a, torch.clamp(r, 1 - cfg.clip_eps, 1 + eh) * a)
            elif name == "gspo":
                pg = -torch.minimum(s * a, torch.clamp(s, 1 - low, 1 + high) * a)
            else:  # cispo
                eh = cfg.clip_eps if cfg.clip_eps_high is None else cfg.clip_eps_high
                r = math.exp(float(logp[i, t].detach()) - float(old[i, t]))
                pg = -min(r, 1 + eh) * a * logp[i, t]
            term = pg * w[i][t]
            if cfg.kl_beta > 0:
                d = float(ref[i, t]) - logp[i, t]
                term = term + cfg.kl_beta * (torch.exp(d) - d - 1)
            terms.append(term)
        per_seq.append((sum(terms, torch.zeros((), dtype=F64)), len(toks)))
    num_seqs, num_tokens, max_len = (B, n_tok, T) if norm is None else (norm.num_seqs, norm.num_tokens, norm.max_len)
    total = torch.zeros((), dtype=F64)
    for v, n in per_seq:
        total = total + (v / max(n, 1) if cfg.loss_type == "grpo" else v)
    if cfg.loss_type == "grpo":
        return total / max(num_seqs, 1)
    return total / max(num_tokens if cfg.loss_type == "dapo" else num_seqs * max_len, 1)


def random_inputs(seed, B=6, T=7):
    g = torch.Generator().manual_seed(seed)
    logp = -2.0 + 0.5 * torch.randn(B, T, generator=g, dtype=F64)
    old = logp + 0.3 * torch.randn(B, T, generator=g, dtype=F64)
    ref = logp + 0.3 * torch.randn(B, T, generator=g, dtype=F64)
    samp = old + 0.3 * torch.randn(B, T, generator=g, dtype=F64)
    mask = (torch.rand(B, T, generator=g) > 0.3).long()
    mask[1] = 0  # a sequence without tokens
    mask[:, 0] = 0
    adv = torch.randn(B, generator=g, dtype=F64)
    adv[3] = 0.0
    return logp, old, ref, samp, mask, adv


def _loss_and_grad(fn, logp, *args, **kw):
    x = logp.clone().requires_grad_(True)
    loss, stats = fn(x, *args, **kw)
    (g,) = torch.autograd.grad(loss, x)
    return loss.detach(), g, stats


CASES = [
    # (loss_type, kl_beta, clip_eps, clip_eps_high, mismatch weight mode or None)
    ("grpo", 0.0, 0.2, None, None),
    ("dapo", 0.1, 0.1, 0.28, None),
    ("dr_grpo", 0.05, 0.2, 0.2, "token_truncate"),
    ("grpo", 0.1, 0.05, None, "sequence_mask"),
    ("dapo", 0.0, 0.3, 0.4, "token_mask"),
]


@pytest.mark.parametrize("name", ["grpo", "gspo", "cispo"])
@pytest.mark.parametrize(("loss_type", "kl_beta", "clip_eps", "clip_eps_high", "is_mode"), CASES)
@pytest.mark.parametrize("with_norm", [False, True])
def test_policy_losses_match_the_naive_reference(name, loss_type, kl_beta, clip_eps, clip_eps_high, is_mode, with_norm):
    logp, old, ref, samp, mask, adv = random_inputs(seed=zlib.crc32(f"{name}{loss_type}{is_mode}".encode()))
    cfg = LossConfig(loss_type=loss_type, kl_beta=kl_beta, clip_eps=clip_eps, clip_eps_high=clip_eps_high,
                     importance_sampling_mode=is_mode or "sequence_mask", importance_sampling_cap=1.3)
    norm = Normalizer(num_seqs=9, num_tokens=31, max_len=11) if with_norm else None
    s = samp if is_mode else None
    fn = algorithms.policy_loss(name)
    got, grad, stats = _loss_and_grad(fn, logp, old, ref, adv, mask, cfg=cfg, norm=norm, sampling_logp=s)
    x = logp.clone().requires_grad_(True)
    want = naive_loss(name, x, old, ref, adv, mask, cfg, norm, s)
    (want_grad,) = torch.autograd.grad(want, x)
    want = want.detach()
    assert abs(float(got) - float(want)) <= 1e-12 * max(1.0, abs(float(want)))
    torch.testing.assert_close(grad, want_grad, rtol=1e-12, atol=1e-12)
    assert (grad[mask == 0] == 0).all()
    assert float(grad.abs().sum()) > 0  # the case trains something
    assert stats.tokens == mask.sum()


def test_grpo_policy_loss_is_grpo_loss_bit_for_bit():
    logp, old, ref, samp, mask, adv = random_inputs(seed=5)
    cfg = LossConfig(loss_type="dapo", kl_beta=0.1, clip_eps_high=0.28, importance_sampling_mode="token_truncate")
    a = _loss_and_grad(algorithms.policy_loss("grpo"), logp, old, ref, adv, mask, cfg=cfg, sampling_logp=samp)
    b = _loss_and_grad(grpo_loss, logp, old, ref, adv, mask, clip_eps=0.2, clip_eps_high=0.28, kl_beta=0.1,
                       loss_type="dapo", sampling_logp=samp, is_mode="token_truncate", is_cap=3.0)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert a[2].summary() == b[2].summary()


def test_gspo_ratio_is_per_sequence_and_clips_whole_sequences():
    """A sequence whose mean log-ratio is +0.1 (tokens +0.3 and -0.1): ratio exp(0.1) on both tokens,
    clipped at 1 + 4e-4 (the default range), so with A > 0 both tokens count as clipped and the
    gradient is 0; the other sequence's ratio is 1 exactly (unclipped, gradient A / n per token)."""
    logp = torch.tensor([[0.0, -1.0, -2.0], [0.0, -1.0, -2.0]], dtype=F64)
    old = torch.tensor([[0.0, -1.3, -1.9], [0.0, -1.0, -2.0]], dtype=F64)
    mask = torch.tensor([[0, 1, 1], [0, 1, 1]])
    adv = torch.tensor([1.0, 1.0], dtype=F64)
    cfg = LossConfig(kl_beta=0.0)
    assert gspo_clip_range(cfg) == GSPO_CLIP
    loss, grad, stats = _loss_and_grad(algorithms.policy_loss("gspo"), logp, old, None, adv, mask, cfg=cfg)
    s = stats.summary()
    assert s["ratio_max"] == pytest.approx(math.exp(0.1), rel=1e-12) and s["ratio_min"] == 1.0
    assert s["clip_high"] == 0.5 and s["clip_low"] == 0.0
    assert (grad[0] == 0).all() and grad[1].tolist() == pytest.approx([0.0, -0.25, -0.25])  # -A/n / B
    # a range the user set is used as given
    assert gspo_clip_range(LossConfig(clip_eps=0.1)) == (0.1, 0.1)
    assert gspo_clip_range(LossConfig(clip_eps_high=0.2)) == (0.2, 0.2)
    _, grad_wide, _ = _loss_and_grad(algorithms.policy_loss("gspo"), logp, old, None, adv, mask,
                                     cfg=LossConfig(kl_beta=0.0, clip_eps=0.2, clip_eps_high=0.2))
    assert (grad_wide[0, 1:] != 0).all()


def test_cispo_keeps_the_gradient_of_clipped_tokens():
    """A token far above the clip still has a gradient (scaled by 1 + eps_high), where grpo drops it."""
    logp = torch.tensor([[0.0, -1.0, -1.0]], dtype=F64)
    old = torch.tensor([[0.0, -2.0, -1.0]], dtype=F64)  # token 1's ratio is e
    mask = torch.tensor([[0, 1, 1]])
    adv = torch.tensor([2.0], dtype=F64)
    cfg = LossConfig(kl_beta=0.0, loss_type="dapo", clip_eps_high=0.28)
    _, g_cispo, st = _loss_and_grad(algorithms.policy_loss("cispo"), logp, old, None, adv, mask, cfg=cfg)
    _, g_grpo, _ = _loss_and_grad(algorithms.policy_loss("grpo"), logp, old, None, adv, mask, cfg=cfg)
    assert g_grpo[0, 1] == 0 and g_cispo[0, 1] == pytest.approx(-1.28 * 2.0 / 2)
    assert g_cispo[0, 2] == pytest.approx(-1.0 * 2.0 / 2)
    assert st.summary()["clip_high"] == 0.5 and st.summary()["clip_low"] == 0.0


@pytest.mark.parametrize("name", ["grpo", "gspo", "cispo"])
def test_masked_garbage_changes_neither_value_nor_gradient(name):
    """Environment/template and padding tokens (mask 0) holding NaN and inf in every input."""
    logp, old, ref, samp, mask, adv = random_inputs(seed=11)
    cfg = LossConfig(loss_type="grpo", kl_beta=0.1, old_logp_source="trainer", importance_sampling_mode="token_truncate")
    fn = algorithms.policy_loss(name)
    clean = _loss_and_grad(fn, logp, old, ref, adv, mask, cfg=cfg, sampling_logp=samp)
    off = mask == 0
    dirty = [x.masked_fill(off, v) for x, v in zip((logp, old, ref, samp), (float("nan"), float("inf"),
                                                                           float("-inf"), float("nan")), strict=True)]
    got = _loss_and_grad(fn, dirty[0], dirty[1], dirty[2], adv, mask, cfg=cfg, sampling_logp=dirty[3])
    assert torch.equal(got[0], clean[0]) and torch.equal(got[1], clean[1])
    assert torch.isfinite(got[1]).all() and (got[1][off] == 0).all()
    assert got[2].summary() == clean[2].summary()


@pytest.mark.parametrize("name", ["grpo", "gspo", "cispo"])
def test_parts_of_a_batch_add_up_to_the_whole(name):
    """With global normalizers, losses and stats of disjoint row sets add up to the whole batch's:
    what the micro-batched, sharded step relies on."""
    logp, old, ref, _, mask, adv = random_inputs(seed=3, B=7)
    for loss_type in ("grpo", "dapo", "dr_grpo"):
        cfg = LossConfig(loss_type=loss_type, kl_beta=0.05, clip_eps=0.1)
        norm = Normalizer(num_seqs=7, num_tokens=int(mask.sum()), max_len=7)
        fn = algorithms.policy_loss(name)
        whole = _loss_and_grad(fn, logp, old, ref, adv, mask, cfg=cfg, norm=norm)
        parts = [_loss_and_grad(fn, logp[r], old[r], ref[r], adv[r], mask[r], cfg=cfg, norm=norm)
                 for r in (slice(0, 2), slice(2, 3), slice(3, 3), slice(3, 7))]
        assert float(sum(p[0] for p in parts)) == pytest.approx(float(whole[0]), rel=1e-13, abs=1e-15)
        torch.testing.assert_close(torch.cat([p[1] for p in parts]), whole[1], rtol=1e-13, atol=1e-15)
        st = parts[0][2] + parts[1][2] + parts[2][2] + parts[3][2]
        for k, v in whole[2].summary().items():
            if v is None:  # no mismatch weight in this case
                assert st.summary()[k] is None, k
            else:
                assert st.summary()[k] == pytest.approx(v, rel=1e-12), (name, loss_type, k)


# ---------------------------------------------------------------- advantages


def naive_advantages(name, rewards, G, adv_scale="group"):
    r = [float(x) for x in rewards]
    groups = [r[i:i + G] for i in range(0, len(r), G)]
    out = []
    if name == "reinforce_pp":
        x = [v - sum(g) / G for g in groups for v in g]
        mu = sum(x) / len(x)
        sd = math.sqrt(sum((v - mu) ** 2 for v in x) / (len(x) - 1))
    for gi, g in enumerate(groups):
        flat = max(g) == min(g)
        mean = sum(g) / G
        sd_g = math.sqrt(sum((v - mean) ** 2 for v in g) / (G - 1))
        for j, v in enumerate(g):
            if flat:
                out.append(0.0)
            elif name == "grpo":
                out.append((v - mean) / (sd_g + 1e-4))
            elif name == "dr_grpo":
                out.append(v - mean)
            elif name == "rloo":
                out.append(v - sum(g[k] for k in range(G) if k != j) / (G - 1))
            else:
                out.append((x[gi * G + j] - mu) / (sd + 1e-8))
    return out


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo", "reinforce_pp"])
def test_advantages_match_the_naive_reference(name):
    g = torch.Generator().manual_seed(0)
    G = 4
    rewards = torch.rand(5 * G, generator=g, dtype=F64)
    rewards[4:8] = 0.1  # a flat group: its float mean is not 0.1
    rewards[8:12] = torch.tensor([1.0, 0.0, 0.0, 0.0], dtype=F64)
    got = compute_advantages(algorithms.advantage(name), rewards, G, LossConfig())
    want = naive_advantages(name, rewards, G)
    assert got.dtype == F64 and got.shape == rewards.shape
    assert got.tolist() == pytest.approx(want, rel=1e-12, abs=1e-12)
    assert (got[4:8] == 0).all()  # exactly 0, not a residue
    assert (got != 0).sum() == 4 * G  # the others have signal


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo", "reinforce_pp"])
def test_all_flat_groups_give_exactly_zero(name):
    rewards = torch.tensor([0.1] * 6 + [1.0] * 6 + [0.0] * 6, dtype=F64)
    assert (compute_advantages(algorithms.advantage(name), rewards, 6, LossConfig()) == 0).all()


def test_reinforce_pp_global_baseline_matches_the_naive_reference():
    """No group mean: the batch's rewards whitened, so a flat group carries its reward's signal against
    the batch (the contract's exception); only a batch without any spread gets 0."""
    G = 3
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.5, 0.2, 0.9, 0.4], dtype=F64)
    got = compute_advantages(algorithms.advantage("reinforce_pp_global"), rewards, G, LossConfig())
    r = rewards.tolist()
    mean = math.fsum(r) / len(r)
    sd = math.sqrt(math.fsum((v - mean) ** 2 for v in r) / (len(r) - 1))  # unbiased, as torch.std
    assert got.dtype == F64 and got.tolist() == pytest.approx([(v - mean) / (sd + 1e-8) for v in r], rel=1e-12, abs=1e-12)
    assert (got[:3] > 0).all() and (got[3:6] < 0).all()  # the all-right group pushed up, the all-wrong one down
    assert torch.equal(got, algorithms.advantage("reinforce_pp_global")(rewards, G, LossConfig()))
    flat = torch.full((2 * G,), 0.7, dtype=F64)  # its float mean is not exactly 0.7
    assert (compute_advantages(algorithms.advantage("reinforce_pp_global"), flat, G, LossConfig()) == 0).all()
    with pytest.raises(ValueError, match="whole groups"):
        algorithms.advantage("reinforce_pp_global")(rewards[:5], G, LossConfig())


def naive_unscorable(name, rewards, G, adv_scale="group"):
    """The reference with NaN rewards left out of everything, as TRL's nanmean/nanstd (0 on them)."""
    r = [float(x) for x in rewards]
    groups = [r[i:i + G] for i in range(0, len(r), G)]

    def std(v):
        mu = sum(v) / len(v)
        return math.sqrt(sum((x - mu) ** 2 for x in v) / (len(v) - 1))

    kept = [v for v in r if not math.isnan(v)]
    x = [v - sum(s) / len(s) for g in groups for s in [[u for u in g if not math.isnan(u)]] for v in g if not math.isnan(v)]
    out = []
    for g in groups:
        s = [v for v in g if not math.isnan(v)]
        flat = len(s) < 2 or max(s) == min(s)
        for v in g:
            if math.isnan(v):
                out.append(0.0)
            elif name == "reinforce_pp_global":
                out.append(0.0 if max(kept) == min(kept) else (v - sum(kept) / len(kept)) / (std(kept) + 1e-8))
            elif flat:
                out.append(0.0)
            elif name == "grpo":
                d = std(s) if adv_scale == "group" else std(kept) if adv_scale == "batch" else 1.0 - 1e-4
                out.append((v - sum(s) / len(s)) / (d + 1e-4))
            elif name == "dr_grpo":
                out.append(v - sum(s) / len(s))
            elif name == "rloo":
                out.append(v - (sum(s) - v) / (len(s) - 1))
            else:  # reinforce_pp: group mean over the scored, whitened over the scored
                out.append((v - sum(s) / len(s) - sum(x) / len(x)) / (std(x) + 1e-8))
    return out


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_global"])
def test_unscorable_completions_are_left_out_of_every_builtin_estimator(name):
    """NaN (no reward function applied) is out of the group's mean, std and leave-one-out mean and of
    the batch's whitening, and gets exactly 0; a group with one scored completion has no spread."""
    nan = math.nan
    rewards = torch.tensor([1.0, nan, 0.0, 0.0,  0.3, 0.9, nan, 0.4,  nan, nan, nan, nan,  nan, 1.0, nan, nan,
                            0.2, 0.7, 0.5, 1.0], dtype=F64)
    got = compute_advantages(algorithms.advantage(name), rewards, 4, LossConfig())
    assert got.tolist() == pytest.approx(naive_unscorable(name, rewards, 4), rel=1e-12, abs=1e-12)
    assert (got[torch.isnan(rewards)] == 0).all() and bool(torch.isfinite(got).all())
    if name != "reinforce_pp_global":
        assert (got[12:16] == 0).all()  # one scored completion: no spread
    whole = torch.tensor([0.2, 0.7, 0.5, 1.0], dtype=F64)  # the full group is unchanged by the others' NaNs (group baselines)
    if name in ("grpo", "dr_grpo", "rloo"):
        assert got[16:].tolist() == pytest.approx(compute_advantages(algorithms.advantage(name), whole, 4, LossConfig()).tolist(), abs=1e-12)


@pytest.mark.parametrize("adv_scale", ["group", "batch", "none"])
def test_grpo_with_unscorable_completions_is_trls_nan_formula(adv_scale):
    """TRL 1.16's _generate_and_score_completions: rewards NaN where unscorable, nanmean and nanstd
    (unbiased) per group or over the batch, advantages nan_to_num'd to 0."""
    nan = math.nan
    rewards = torch.tensor([1.0, nan, 0.0, 0.5,  0.3, 0.9, nan, 0.4], dtype=F64)
    got = group_advantages(rewards, 4, scale=adv_scale)
    assert got.tolist() == pytest.approx(naive_unscorable("grpo", rewards, 4, adv_scale), rel=1e-12, abs=1e-12)


def test_an_estimator_that_does_not_take_unscorable_gets_them_as_their_groups_mean():
    seen = []

    def mine(rewards, group_size, cfg):
        seen.append(rewards.clone())
        return rewards - rewards.view(-1, group_size).mean(dim=1).repeat_interleave(group_size)

    nan = math.nan
    rewards = torch.tensor([1.0, nan, 0.0, 0.5,  nan, nan, nan, nan], dtype=F64)
    got = compute_advantages(mine, rewards, 4, LossConfig())
    assert seen[0].tolist() == [1.0, 0.5, 0.0, 0.5, 0.0, 0.0, 0.0, 0.0]  # filled with the scored mean (0 where none)
    assert got.tolist() == pytest.approx([0.5, 0.0, -0.5, 0.0, 0.0, 0.0, 0.0, 0.0])
    mine.takes_unscorable = True  # declared: it gets the NaNs, and must return finite values where scored
    with pytest.raises(ValueError, match="non-finite"):
        compute_advantages(mine, rewards, 4, LossConfig())


def test_named_advantages_are_what_adv_scale_does():
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.5, 0.2, 0.9], dtype=F64)
    cfg = LossConfig(adv_scale="batch")
    assert torch.equal(algorithms.advantage("grpo")(rewards, 3, cfg), group_advantages(rewards, 3, scale="batch"))
    assert torch.equal(algorithms.advantage("dr_grpo")(rewards, 3, cfg), group_advantages(rewards, 3, scale="none"))
    with pytest.raises(ValueError, match="group_size"):
        algorithms.advantage("rloo")(rewards, 1, cfg)


def test_compute_advantages_checks_the_contract():
    rewards = torch.tensor([1.0, 0.0], dtype=F64)
    with pytest.raises(ValueError, match="one advantage per reward"):
        compute_advantages(lambda r, g, c: r[:1], rewards, 2, LossConfig())
    with pytest.raises(ValueError, match="non-finite"):
        compute_advantages(lambda r, g, c: r / 0.0, rewards, 2, LossConfig())
    assert compute_advantages(lambda r, g, c: 1 / 0, torch.zeros(0, dtype=F64), 2, LossConfig()).numel() == 0


# ---------------------------------------------------------------- registries


def test_registries_list_the_builtins_and_reject_unknown_names():
    assert {"grpo", "gspo", "cispo"} <= set(POLICY_LOSSES) and {"grpo", "dr_grpo", "rloo", "reinforce_pp"} <= set(ADVANTAGES)
    with pytest.raises(ValueError, match=r"unknown policy loss 'ppo'; registered: \['cispo', 'grpo', 'gspo'"):
        algorithms.policy_loss("ppo")
    with pytest.raises(ValueError, match=r"unknown advantage estimator 'gae'.*'dr_grpo', 'grpo'"):
        algorithms.advantage("gae")
    with pytest.raises(ValueError, match=r"policy_loss must be one of \[.*'gspo'.*\]"):
        LossConfig(policy_loss="ppo")
    with pytest.raises(ValueError, match="advantage must be one of"):
        profile("tiny", advantage="gae")
    with pytest.raises(ValueError, match="without ':'"):
        register_policy_loss("a:b")
    assert profile("tiny").loss.policy_loss == "grpo" and profile("tiny").loss.advantage == "grpo"


def test_module_qualname_names_resolve_by_import():
    assert algorithms.policy_loss("grpo_kit.loss:grpo_loss") is grpo_loss
    assert algorithms.reference(algorithms.policy_loss("cispo")) == "grpo_kit.algorithms:cispo_policy_loss"
    assert LossConfig(advantage="grpo_kit.algorithms:rloo_advantage").advantage == "grpo_kit.algorithms:rloo_advantage"
    with pytest.raises(ValueError, match="no 'nope'"):
        algorithms.advantage("grpo_kit.algorithms:nope")


def test_a_user_loss_registered_here_trains_through_the_step():
    """A REINFORCE loss defined and registered in the test: the config names it, the step uses it,
    and without ``zero_adv_is_zero`` the step trains every row (the same update)."""
    calls = []

    @register_policy_loss("test_reinforce")
    def reinforce(logp, old_logp, ref_logp, adv, mask, *, cfg, norm=None, sampling_logp=None):
        calls.append(len(adv))
        m = mask.bool()
        logp = torch.where(m, logp, 0.0)
        per_tok = torch.where(m, -adv.to(logp.dtype)[:, None] * logp, 0.0)
        zero = torch.zeros_like(m)
        return aggregate(per_tok, m, cfg.loss_type, norm), token_stats(torch.ones_like(logp), m, zero, zero, None)

    @register_advantage("test_sign")
    def sign(rewards, group_size, cfg):
        return algorithms.zero_flat_groups(torch.sign(rewards - 0.5), rewards, group_size)

    try:
        cfg = LossConfig(policy_loss="test_reinforce", advantage="test_sign", kl_beta=0.0, loss_type="dapo")
        assert algorithms.policy_loss(cfg.policy_loss) is reinforce and not algorithms.skips_zero_adv(reinforce)
        assert compute_advantages(algorithms.advantage(cfg.advantage), torch.tensor([1.0, 0.0, 1.0, 1.0]), 2,
                                  cfg).tolist() == [1.0, -1.0, 0.0, 0.0]
        batch = make_batch(5, seed=2, zero_adv=range(2, 4))
        optim = OptimConfig(micro_batch=2, max_grad_norm=0.0)
        model = tiny_model()
        before = lora_params(model)
        stats = grpo_step(model, torch.optim.SGD(model.parameters(), lr=LR), batch, cfg, optim)
        assert sum(calls) == 5  # every row, zero advantage or not
        assert stats["tokens_trained"] == stats["tokens"] and stats["ratio_mean"] == 1.0
        delta = {k: v - before[k] for k, v in lora_params(model).items()}
        want = _reference_update(batch, cfg, reinforce)
        assert _rel_err(delta, want) < 1e-10
    finally:
        del POLICY_LOSSES["test_reinforce"], ADVANTAGES["test_sign"]


def test_a_notebook_function_travels_by_value(tmp_path):
    """A loss defined in ``__main__`` (a notebook cell) is cloudpickled by value: a process that never
    defined it runs it."""
    blob = tmp_path / "fn.pkl"
    code = ("import torch\nfrom grpo_kit import algorithms\n"
            "def my_loss(logp, *a, **k):\n    return logp.sum() * 3.0\n"
            f"open({str(blob)!r}, 'wb').write(algorithms.pack(my_loss))\n"
            "print(algorithms.reference(my_loss))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**__import__("os").environ, "PYTHONPATH": str(Path(algorithms.__file__).parents[1])})
    assert out.stdout.strip() == "__main__:my_loss"
    fn = algorithms.unpack(blob.read_bytes())
    assert float(fn(torch.ones(2, 2))) == 12.0


# ---------------------------------------------------------------- the train step


def _rel_err(got: dict, want: dict) -> float:
    num = sum(float((got[k] - want[k]).pow(2).sum()) for k in want)
    den = sum(float(want[k].pow(2).sum()) for k in want)
    return math.sqrt(num / den)


def _reference_update(batch, cfg, fn, max_len=None):
    """One SGD step on the whole batch: one forward, ``fn`` with the batch's own counts, no skip."""
    model = tiny_model()
    before = lora_params(model)
    logp = token_logprobs(model, batch.input_ids, batch.attention_mask, batch.completion_mask)
    ref = None
    if cfg.kl_beta > 0:
        with torch.no_grad(), model.disable_adapter():
            ref = token_logprobs(model, batch.input_ids, batch.attention_mask, batch.completion_mask)
    longest = int(batch.completion_mask.sum(dim=1).max())
    norm = Normalizer(len(batch), int(batch.completion_mask.sum()), max_len or longest)
    trainer_old = cfg.old_logp_source == "trainer"
    loss, _ = fn(logp, logp.detach() if trainer_old else batch.old_logp, ref, batch.adv, batch.completion_mask, cfg=cfg,
                 norm=norm, sampling_logp=batch.old_logp if trainer_old and cfg.importance_sampling_correction else None)
    loss.backward()
    torch.optim.SGD(model.parameters(), lr=LR).step()
    return {k: v - before[k] for k, v in lora_params(model).items()}


STEP_CASES = [
    ("gspo", LossConfig(policy_loss="gspo", kl_beta=0.05, clip_eps=0.02)),
    ("gspo", LossConfig(policy_loss="gspo", kl_beta=0.0, loss_type="dapo")),  # the default range, zero-adv skip
    ("cispo", LossConfig(policy_loss="cispo", kl_beta=0.05, loss_type="dapo", clip_eps_high=0.1)),
    ("cispo", LossConfig(policy_loss="cispo", kl_beta=0.0, loss_type="dr_grpo", old_logp_source="trainer",
                         importance_sampling_mode="token_truncate", importance_sampling_cap=1.5)),
]


@pytest.mark.parametrize(("name", "cfg"), STEP_CASES)
def test_micro_batched_step_equals_the_full_batch_update(name, cfg):
    batch = make_batch(7, seed=8, zero_adv=range(3, 5), group=3)
    want = _reference_update(batch, cfg, algorithms.policy_loss(name))
    for micro in (1, 3, 7):
        model = tiny_model()
        before = lora_params(model)
        stats = grpo_step(model, torch.optim.SGD(model.parameters(), lr=LR), batch, cfg,
                          OptimConfig(micro_batch=micro, max_grad_norm=0.0))
        delta = {k: v - before[k] for k, v in lora_params(model).items()}
        assert _rel_err(delta, want) < 1e-10, (name, micro, _rel_err(delta, want))
        assert (stats["tokens_trained"] < stats["tokens"]) == (cfg.kl_beta == 0)  # rows without advantage skipped


DDP_CASES = {
    "gspo_empty_shard": (LossConfig(policy_loss="gspo", kl_beta=0.05, clip_eps=0.02), (0, 6), False),
    "gspo_uneven_episodes": (LossConfig(policy_loss="gspo", kl_beta=0.0, loss_type="dapo"), (5, 1), True),
    "cispo_uneven": (LossConfig(policy_loss="cispo", kl_beta=0.05, loss_type="dapo", clip_eps_high=0.1), (1, 5), False),
    "cispo_empty_shard_episodes": (LossConfig(policy_loss="cispo", kl_beta=0.0, loss_type="grpo"), (6, 0), True),
}


def _ddp_batch(episodes: bool):
    return (make_episode_batch if episodes else make_batch)(6, seed=21, zero_adv=range(2, 3), group=3)


def _ddp_worker(rank: int, port: int, out_dir: str) -> None:
    out = Path(out_dir)
    try:
        torch.set_num_threads(1)
        _float64_norms()
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                                timeout=datetime.timedelta(seconds=60))
        results = {}
        for name, (cfg, shards, episodes) in DDP_CASES.items():
            model = tiny_model()
            before = lora_params(model)
            ddp = wrap_ddp(model)
            optim = OptimConfig(micro_batch=2, max_grad_norm=0.0)
            stats = grpo_step(ddp, torch.optim.SGD(model.parameters(), lr=LR), _ddp_batch(episodes), cfg, optim,
                              rank=rank, world_size=2, shard_sizes=shards)
            results[name] = ({k: v - before[k] for k, v in lora_params(model).items()}, stats)
            del ddp
        torch.save(results, out / f"rank{rank}.pt")
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        (out / f"rank{rank}.err").write_text(traceback.format_exc())
        raise


def test_ddp_step_with_uneven_and_empty_shards_equals_the_full_batch_update(tmp_path):
    results = spawn_ranks(2, tmp_path, target=_ddp_worker)
    for name, (cfg, _, episodes) in DDP_CASES.items():
        want = _reference_update(_ddp_batch(episodes), cfg, algorithms.policy_loss(cfg.policy_loss))
        for rank in (0, 1):
            delta, stats = results[rank][name]
            assert _rel_err(delta, want) <= 1e-10, (name, rank, _rel_err(delta, want))
            rank0 = results[0][name][1]  # every rank reports the same (all-reduced) stats
            assert stats.keys() == rank0.keys()
            assert all(stats[k] == v or (isinstance(v, float) and math.isnan(v) and math.isnan(stats[k]))
                       for k, v in rank0.items())
        assert results[0][name][1]["samples_nonzero_adv"] == 5


def test_new_losses_report_every_statistic_the_figures_read():
    logp, old, ref, _, mask, adv = random_inputs(seed=1)
    for name in ("gspo", "cispo"):
        _, st = algorithms.policy_loss(name)(logp, old, ref, adv, mask, cfg=replace(LossConfig(), kl_beta=0.1))
        s = st.summary()
        assert set(s) == set(LossStats.SUMMARY_KEYS) and s["kl"] > 0 and s["tokens"] == int(mask.sum())
        assert s["ratio_min"] <= s["ratio_mean"] <= s["ratio_max"] and s["ratio_std"] > 0


def test_gspo_against_stale_batches_warns_with_its_recommended_clip_only():
    def warning(**kw):
        cfg = profile("tiny", policy_loss="gspo", **kw)
        return algorithms.stale_clip_warning(cfg.loss, cfg.run.depth)

    message = warning()  # the kit's default: pipelined, ratio against the engine's log-probs
    assert message and "old_logp_source='trainer'" in message and "pipelined=False" in message
    assert warning(pipelined=False) is None  # on-policy: the ratio starts at 1
    assert warning(old_logp_source="trainer") is None  # TRL's ratio: 1 at the one update
    assert warning(clip_eps=0.01, clip_eps_high=0.02) is None  # a clip the user chose
    assert warning(max_staleness=0) is None  # depth 0
    cfg = profile("tiny")  # the default loss
    assert cfg.loss.policy_loss == "grpo" and algorithms.stale_clip_warning(cfg.loss, cfg.run.depth) is None
    # review (2026-12-03): GSPO given as its function is GSPO too
    cfg = profile("tiny", policy_loss="grpo_kit.algorithms:gspo_policy_loss")
    assert algorithms.stale_clip_warning(cfg.loss, cfg.run.depth) == message


def test_a_plug_in_that_is_no_plain_function_is_refused_by_name():
    """Review finding (2026-12-03): a functools.partial failed with AttributeError '__qualname__'; its
    name would not rebuild its arguments in a resumed run or an export anyway."""
    import functools

    with pytest.raises(ValueError, match="plain function.*not partial"):
        algorithms.reference(functools.partial(algorithms.grpo_policy_loss, cfg=None))


def test_huge_rewards_are_clipped_and_the_group_still_trains():
    """Review finding (2026-12-03): a distance reward against an answer of "1e308", twice in a group,
    overflowed the group's mean and failed the step on every retry ("non-finite advantages"); near
    1e200 the std overflowed and every advantage of the group became 0."""
    from grpo_kit.data import Problem
    from grpo_kit.tasks import Scorer
    from grpo_kit.tasks.base import MAX_ABS_REWARD

    def distance(completions, **kw):
        return [-abs(float(c) - 42) for c in completions]

    for huge in ("1e308", "1e200"):
        scores = Scorer([distance], [1.0], ["distance"]).score_problems([Problem("p", "Q?", "42")] * 4,
                                                                        ["41", huge, huge, "40"])
        rewards = [s.reward for s in scores]
        assert rewards == [-1.0, -MAX_ABS_REWARD, -MAX_ABS_REWARD, -2.0] and "clipped to -1e+09" in scores[1].reason
        for name in ("grpo", "dr_grpo", "rloo", "reinforce_pp"):
            adv = algorithms.compute_advantages(algorithms.advantage(name), torch.tensor(rewards, dtype=torch.float64),
                                                4, LossConfig(advantage=name))
            assert bool(torch.isfinite(adv).all()) and adv[0] > adv[3] > adv[1], (name, adv)
