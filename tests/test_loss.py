"""grpo_kit.loss: hand-computed cases, clip boundaries, a naive per-token reference, masks, normalizers."""

import math

import pytest
import torch

from grpo_kit.loss import LOSS_TYPES, LossStats, Normalizer, group_advantages, grpo_loss

f64 = torch.float64


# ---------------------------------------------------------------- group_advantages


def test_group_advantages_hand_computed():
    r = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0], dtype=f64)
    # group 0: mean 0.25, unbiased std sqrt((0.75^2 + 3 * 0.25^2) / 3) = 0.5; group 1: all equal -> 0
    adv = group_advantages(r, 4, scale="group", eps=1e-4)
    want = torch.tensor([0.75, -0.25, -0.25, -0.25, 0, 0, 0, 0], dtype=f64)
    torch.testing.assert_close(adv, want / torch.tensor([0.5001] * 4 + [1.0] * 4, dtype=f64))
    torch.testing.assert_close(group_advantages(r, 4, scale="none"), want)
    torch.testing.assert_close(group_advantages(r, 4, scale="batch", eps=0.0), want / r.std())


def test_group_advantages_integer_rewards_become_float():
    adv = group_advantages(torch.tensor([1, 0, 3, 3]), 2, scale="none")
    assert adv.dtype == torch.float32
    assert adv.tolist() == [0.5, -0.5, 0.0, 0.0]



@pytest.mark.parametrize("scale", ["group", "batch", "none"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("value", [0.1, 1.1, 0.3, 0.7])
def test_group_advantages_zero_spread_is_exactly_zero(scale, dtype, value):
    """A group of formatted but wrong answers under format_bonus=0.1 scores [0.1] * 6; its float mean
    is not exactly 0.1, so r - mean left ~1e-13 (float64; ~3e-4 after the group std in float32 for
    0.3), which the trainer's zero-advantage skip and ``samples_nonzero_adv`` counted as signal."""
    rewards = torch.tensor([value] * 6 + [1.1, 0.1, 0.1, 1.1, 0.1, 0.1], dtype=dtype)
    adv = group_advantages(rewards, 6, scale=scale)
    assert adv[:6].tolist() == [0.0] * 6
    assert (adv[6:] != 0).all()  # the group with spread keeps its advantages
    assert int((adv != 0).sum()) == 6


def test_group_advantages_zero_where_the_groups_have_no_spread():
    """``adv != 0`` (the trainer's skip, ``samples_nonzero_adv``) agrees with sampling's has_spread,
    group by group, and an eps of 0 leaves no NaN in a constant group or batch."""
    from grpo_kit.sampling import Group

    gen = torch.Generator().manual_seed(0)
    vals = torch.tensor([0.0, 0.1, 1.1, 1 / 3, 0.7], dtype=f64)
    rewards = vals[torch.randint(0, len(vals), (40, 4), generator=gen)]  # (40 groups, 4)
    rewards[::3] = rewards[::3, :1]  # every third group constant
    for scale in ("group", "batch", "none"):
        adv = group_advantages(rewards.reshape(-1), 4, scale=scale).view(40, 4)
        spread = [Group(tuple(g.tolist()), 0).has_spread for g in rewards]
        assert [bool((a != 0).any()) for a in adv] == spread
        assert 0 < sum(spread) < 40
    assert group_advantages(torch.full((4,), 0.1, dtype=f64), 2, scale="group", eps=0.0).tolist() == [0.0] * 4
    assert group_advantages(torch.full((4,), 0.1, dtype=f64), 2, scale="batch", eps=0.0).tolist() == [0.0] * 4
    # unscorable completions (NaN here, None in a Group) are out of the spread on both sides
    rewards[torch.rand(rewards.shape, generator=gen) < 0.3] = float("nan")
    for scale in ("group", "batch", "none"):
        adv = group_advantages(rewards.reshape(-1), 4, scale=scale).view(40, 4)
        spread = [Group(tuple(None if v != v else v for v in g.tolist()), 0).has_spread for g in rewards]
        assert [bool((a != 0).any()) for a in adv] == spread and bool(torch.isfinite(adv).all())
        assert 0 < sum(spread) < 40

@pytest.mark.parametrize(
    "n, group_size, scale",
    [
        (7, 4, "group"),  # 7 rewards are not whole groups of 4
        (4, 0, "none"),  # no group size
        (4, 1, "group"),  # the std of one reward is undefined
        (4, 2, "median"),  # unknown scale
    ],
)
def test_group_advantages_rejects(n, group_size, scale):
    with pytest.raises(ValueError):
        group_advantages(torch.zeros(n), group_size, scale=scale)


# ---------------------------------------------------------------- grpo_loss: hand-computed


def _hand_case():
    logp = torch.log(torch.tensor([[1.1, 1.5], [0.5, 0.9]], dtype=f64))  # ratios (old_logp = 0)
    old_logp = torch.zeros(2, 2, dtype=f64)
    adv = torch.tensor([1.0, -1.0], dtype=f64)
    mask = torch.tensor([[1, 1], [1, 0]])
    return logp, old_logp, adv, mask


@pytest.mark.parametrize(
    "loss_type, want",
    [
        # per-token loss: -1.1 (inside), -1.2 (1.5 clipped to 1.2, A > 0), +0.8 (0.5 clipped to 0.8, A < 0)
        ("grpo", ((-1.1 - 1.2) / 2 + 0.8) / 2),  # mean of per-sequence means
        ("dapo", (-1.1 - 1.2 + 0.8) / 3),  # token mean
        ("dr_grpo", (-1.1 - 1.2 + 0.8) / (2 * 2)),  # sum / (B * T)
    ],
)
def test_grpo_loss_hand_computed(loss_type, want):
    logp, old_logp, adv, mask = _hand_case()
    loss, stats = grpo_loss(logp, old_logp, None, adv, mask, clip_eps=0.2, loss_type=loss_type)
    assert loss.item() == pytest.approx(want, rel=1e-12)
    s = stats.summary()
    assert s["tokens"] == 3
    assert s["ratio_mean"] == pytest.approx((1.1 + 1.5 + 0.5) / 3)
    assert s["ratio_std"] == pytest.approx(torch.tensor([1.1, 1.5, 0.5], dtype=f64).std(correction=0).item())
    assert (s["ratio_min"], s["ratio_max"]) == (pytest.approx(0.5), pytest.approx(1.5))
    assert (s["clip_low"], s["clip_high"], s["clip_frac"]) == (pytest.approx(1 / 3), pytest.approx(1 / 3), 2 / 3)
    assert math.isnan(s["kl"])  # no reference given


def test_grpo_loss_hand_computed_kl():
    logp, old_logp, adv, mask = _hand_case()
    ref_logp = torch.zeros(2, 2, dtype=f64)
    beta = 0.1
    loss, stats = grpo_loss(logp, old_logp, ref_logp, adv, mask, kl_beta=beta, loss_type="dapo")

    def k3(r):  # ref - logp = -log r
        return 1 / r + math.log(r) - 1

    kl = [k3(1.1), k3(1.5), k3(0.5)]
    assert loss.item() == pytest.approx((-1.1 - 1.2 + 0.8 + beta * sum(kl)) / 3, rel=1e-12)
    assert stats.summary()["kl"] == pytest.approx(sum(kl) / 3, rel=1e-12)


# ---------------------------------------------------------------- clip boundaries


def test_clip_boundaries_both_signs():
    eps, eps_high, d = 0.2, 0.3, 1e-6
    cases = [
        # (ratio, adv, clipped?, which count)
        (1.3 - d, 1.0, False, None),  # just inside the upper clip
        (1.3 + d, 1.0, True, "high"),  # just outside: the clipped (constant) branch wins
        (0.8 - d, 1.0, False, None),  # below the lower clip but A > 0: min keeps the ratio term
        (0.8 + d, -1.0, False, None),  # just inside the lower clip
        (0.8 - d, -1.0, True, "low"),  # just outside: clipped
        (1.3 + d, -1.0, False, None),  # above the upper clip but A < 0: min keeps the ratio term
        (1.0, 0.0, False, None),  # zero advantage: no gradient, never clipped
    ]
    ratio = torch.tensor([c[0] for c in cases], dtype=f64)
    adv = torch.tensor([c[1] for c in cases], dtype=f64)
    logp = torch.log(ratio)[:, None].requires_grad_()  # (B, 1), old_logp = 0
    loss, stats = grpo_loss(
        logp, torch.zeros_like(logp), None, adv, torch.ones(len(cases), 1), clip_eps=eps, clip_eps_high=eps_high
    )
    (grad,) = torch.autograd.grad(loss, logp)
    n = len(cases)
    # unclipped: d(-ratio * A / n) / dlogp = -A * ratio / n; clipped: 0
    want = torch.tensor([0.0 if c else -a * r / n for r, a, c, _ in cases], dtype=f64)
    torch.testing.assert_close(grad[:, 0], want, rtol=1e-12, atol=0)
    assert stats.clip_low_count.item() == sum(w == "low" for *_, w in cases)
    assert stats.clip_high_count.item() == sum(w == "high" for *_, w in cases)


def test_clip_eps_high_defaults_to_clip_eps():
    logp = torch.log(torch.tensor([[1.25]], dtype=f64))
    args = (logp, torch.zeros_like(logp), None, torch.ones(1, dtype=f64), torch.ones(1, 1))
    assert grpo_loss(*args, clip_eps=0.2)[0].item() == pytest.approx(-1.2)  # clipped at 1 + clip_eps
    assert grpo_loss(*args, clip_eps=0.2, clip_eps_high=0.28)[0].item() == pytest.approx(-1.25)


def test_kl_zero_when_ref_equals_logp():
    logp, old_logp, adv, mask = _random_case(seed=1)
    logp.requires_grad_()
    with_kl, st = grpo_loss(logp, old_logp, logp.detach(), adv, mask, kl_beta=0.5)
    without, _ = grpo_loss(logp, old_logp, None, adv, mask)
    assert st.kl_sum.item() == 0.0
    assert with_kl.item() == without.item()
    g1, g2 = (torch.autograd.grad(x, logp)[0] for x in (with_kl, without))
    torch.testing.assert_close(g1, g2, rtol=0, atol=1e-15)  # k3 has zero slope at ref == logp


# ---------------------------------------------------------------- a naive per-token reference


def _random_case(seed, B=5, T=7):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(B, T, generator=g, dtype=f64) * 3  # (B, T)
    old_logp = logp + 0.4 * torch.randn(B, T, generator=g, dtype=f64)  # ratios on both sides of the clips
    adv = torch.randn(B, generator=g, dtype=f64)
    adv[1] = 0.0
    mask = torch.rand(B, T, generator=g) < 0.7
    mask[2] = False  # a sequence without tokens
    mask[0, 0] = True
    return logp, old_logp, adv, mask


def _naive_loss(logp, old_logp, ref_logp, adv, mask, eps, eps_high, beta, loss_type, max_len=None,
                sampling_logp=None, is_mode=None, cap=None):
    """Token by token, with the clip written as branches instead of min/clamp, and the engine-mismatch
    weight computed per token or per sequence with an explicit loop and if/else."""
    B, T = logp.shape
    seq_sums, seq_counts = [], []
    for b in range(B):
        total, count = torch.zeros((), dtype=f64), 0
        seq_logw = 0.0
        for t in range(T):
            if mask[b, t]:
                seq_logw += float(old_logp[b, t] - sampling_logp[b, t]) if sampling_logp is not None else 0.0
        for t in range(T):
            if not mask[b, t]:
                continue
            r = torch.exp(logp[b, t] - old_logp[b, t])
            a = adv[b]
            if a > 0 and r > 1 + eps_high:
                surr = (1 + eps_high) * a
            elif a < 0 and r < 1 - eps:
                surr = (1 - eps) * a
            else:
                surr = r * a
            if sampling_logp is not None:
                logw = seq_logw if is_mode.startswith("sequence") else float(old_logp[b, t] - sampling_logp[b, t])
                w = math.exp(logw)
                if w > cap:
                    w = cap if is_mode.endswith("truncate") else 0.0
                surr = surr * w
            tok = -surr
            if beta:
                d = ref_logp[b, t] - logp[b, t]
                tok = tok + beta * (torch.exp(d) - d - 1)
            total, count = total + tok, count + 1
        seq_sums.append(total)
        seq_counts.append(count)
    if loss_type == "grpo":
        return sum(s / max(c, 1) for s, c in zip(seq_sums, seq_counts, strict=True)) / B
    if loss_type == "dapo":
        return sum(seq_sums) / max(sum(seq_counts), 1)
    return sum(seq_sums) / (B * (max_len or T))


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("kl_beta, eps_high", [(0.0, None), (0.1, 0.28)])
def test_gradients_match_naive_loop(loss_type, kl_beta, eps_high):
    logp, old_logp, adv, mask = _random_case(seed=0)
    ref_logp = logp.detach() + 0.3 * torch.randn(logp.shape, generator=torch.Generator().manual_seed(9), dtype=f64)
    logp.requires_grad_()
    kw = dict(clip_eps=0.2, clip_eps_high=eps_high, kl_beta=kl_beta, loss_type=loss_type)
    loss, stats = grpo_loss(logp, old_logp, ref_logp, adv, mask, **kw)
    want = _naive_loss(logp, old_logp, ref_logp, adv, mask, 0.2, eps_high or 0.2, kl_beta, loss_type)
    assert loss.item() == pytest.approx(want.item(), rel=1e-12)
    (g,) = torch.autograd.grad(loss, logp)
    (g_want,) = torch.autograd.grad(want, logp)
    torch.testing.assert_close(g, g_want, rtol=1e-12, atol=1e-15)
    assert stats.clip_low_count.item() + stats.clip_high_count.item() > 0  # the case exercises the clips


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("is_mode", ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"])
def test_engine_mismatch_weight_matches_naive_loop(loss_type, is_mode):
    """TRL's semantics: the old log-probs are the trainer's (here logp itself, detached, as at the one
    update per batch: the ratio is 1) and the sampling policy is corrected by a capped weight."""
    logp, sampling_logp, adv, mask = _random_case(seed=6)
    ref_logp = logp + 0.1
    logp.requires_grad_()
    old = logp.detach()
    cap = 1.5 if is_mode.startswith("token") else 3.0
    kw = dict(clip_eps=0.2, kl_beta=0.1, loss_type=loss_type)
    loss, stats = grpo_loss(logp, old, ref_logp, adv, mask, sampling_logp=sampling_logp, is_mode=is_mode, is_cap=cap, **kw)
    want = _naive_loss(logp, old, ref_logp, adv, mask, 0.2, 0.2, 0.1, loss_type, sampling_logp=sampling_logp,
                       is_mode=is_mode, cap=cap)
    assert loss.item() == pytest.approx(want.item(), rel=1e-12)
    (g,) = torch.autograd.grad(loss, logp)
    (g_want,) = torch.autograd.grad(want, logp)
    torch.testing.assert_close(g, g_want, rtol=1e-12, atol=1e-15)
    s = stats.summary()
    assert s["ratio_mean"] == 1.0 and s["clip_frac"] == 0.0  # the policy ratio, trainer new/old
    m = mask.bool()
    d = torch.where(m, old - sampling_logp, 0.0)
    w = (d.sum(1, keepdim=True).expand_as(d) if is_mode.startswith("sequence") else d).exp()[m]
    assert s["is_mean"] == pytest.approx(w.mean().item(), rel=1e-12)
    assert (s["is_min"], s["is_max"]) == (pytest.approx(w.min().item()), pytest.approx(w.max().item()))
    assert s["is_capped_frac"] == pytest.approx((w > cap).double().mean().item())
    assert 0 < s["is_capped_frac"] < 1  # the case exercises the cap


def test_engine_mismatch_weight_is_one_when_aligned():
    logp, _, adv, mask = _random_case(seed=7)
    logp.requires_grad_()
    plain, _ = grpo_loss(logp, logp.detach(), None, adv, mask)
    weighted, st = grpo_loss(logp, logp.detach(), None, adv, mask, sampling_logp=logp.detach(), is_mode="sequence_mask")
    assert weighted.item() == plain.item()
    assert st.summary()["is_mean"] == 1.0 and st.summary()["is_capped_frac"] == 0.0
    with pytest.raises(ValueError, match="is_mode"):
        grpo_loss(logp, logp, None, adv, mask, sampling_logp=logp.detach(), is_mode="sequence")


@pytest.mark.parametrize("is_mode", ["sequence_mask", "sequence_truncate"])
def test_a_long_sequences_mismatch_weight_stays_finite_in_float32(is_mode):
    """1,000 tokens each 0.1 nat above the engine sum to a log-weight of 100, past float32's exp
    range: the statistics must stay finite (records are strict JSON) and the capped weight unchanged
    (masked to 0, or the cap)."""
    T = 1000
    logp = torch.zeros(1, T, requires_grad=True)
    mask = torch.ones(1, T, dtype=torch.long)
    loss, st = grpo_loss(logp, logp.detach(), None, torch.ones(1), mask, sampling_logp=torch.full((1, T), -0.1),
                         is_mode=is_mode, is_cap=2.0)
    s = st.summary()
    assert all(math.isfinite(s[k]) for k in ("is_mean", "is_min", "is_max")), s
    assert s["is_capped_frac"] == 1.0 and s["is_max"] > 1e25
    loss.backward()
    expected = 0.0 if is_mode == "sequence_mask" else -2.0 / T  # grpo: the sequence mean of -w * A * ratio
    assert logp.grad.abs().max().item() == pytest.approx(abs(expected), abs=1e-9)


# ---------------------------------------------------------------- masks and empty sequences


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_garbage_off_the_mask_changes_nothing(loss_type):
    logp, old_logp, adv, mask = _random_case(seed=2)
    ref_logp = logp + 0.1
    off = ~mask

    def run(lp, old, ref):
        lp = lp.clone().requires_grad_()
        loss, st = grpo_loss(lp, old, ref, adv, mask, kl_beta=0.1, loss_type=loss_type)
        return loss, torch.autograd.grad(loss, lp)[0], st

    clean = run(logp, old_logp, ref_logp)
    junk = torch.tensor([float("nan"), float("inf"), -float("inf"), 1e4], dtype=f64).repeat(20)[: int(off.sum())]
    dirty = [x.clone() for x in (logp, old_logp, ref_logp)]
    for x in dirty:
        x[off] = junk
    got = run(*dirty)
    assert got[0].item() == clean[0].item()
    torch.testing.assert_close(got[1], clean[1], rtol=0, atol=0)
    assert (got[1][off] == 0).all()
    assert got[2].summary() == clean[2].summary()


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_no_tokens_no_nan(loss_type):
    logp = torch.randn(3, 4, dtype=f64, requires_grad=True)
    mask = torch.zeros(3, 4, dtype=torch.bool)
    loss, stats = grpo_loss(
        logp, logp.detach(), logp.detach(), torch.ones(3, dtype=f64), mask, kl_beta=0.1, loss_type=loss_type
    )
    assert loss.item() == 0.0
    assert torch.autograd.grad(loss, logp)[0].abs().sum().item() == 0.0
    # nothing measured: None, never NaN (a record holding NaN is not JSON); the ratios' extremes too
    assert stats.summary() == {k: None for k in LossStats.SUMMARY_KEYS} | {"tokens": 0.0}
    assert (stats + LossStats.empty(is_weight=True)).summary()["is_mean"] is None
    empty, _ = grpo_loss(
        *(torch.zeros(0, 0, dtype=f64),) * 3, torch.zeros(0, dtype=f64), torch.zeros(0, 0), loss_type=loss_type
    )
    assert empty.item() == 0.0


def test_rejects_bad_arguments():
    logp, old_logp, adv, mask = _random_case(seed=3)
    with pytest.raises(ValueError, match="ref_logp"):
        grpo_loss(logp, old_logp, None, adv, mask, kl_beta=0.1)
    with pytest.raises(ValueError, match="loss_type"):
        grpo_loss(logp, old_logp, None, adv, mask, loss_type="ppo")
    with pytest.raises(ValueError, match="shape|expected"):
        grpo_loss(logp, old_logp, None, adv[:-1], mask)


# ---------------------------------------------------------------- global normalizers and stats


def _numbers(summary: dict) -> dict:
    return {k: v for k, v in summary.items() if v is not None}


@pytest.mark.parametrize("is_mode", [None, "sequence_mask", "token_truncate"])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_norm_override_sums_parts_to_the_whole(loss_type, is_mode):
    logp, old_logp, adv, mask = _random_case(seed=4, B=6)
    ref_logp = logp + 0.2
    logp.requires_grad_()
    kw = dict(clip_eps=0.2, clip_eps_high=0.3, kl_beta=0.05, loss_type=loss_type)
    if is_mode:  # the engine-mismatch weight is per token or per whole sequence: parts split by rows
        g = torch.Generator().manual_seed(11)
        kw.update(is_mode=is_mode, is_cap=1.5, sampling_logp=old_logp + 0.3 * torch.randn(old_logp.shape, generator=g, dtype=f64))
    # uneven parts, the second trimmed to fewer columns as a micro-batch would be
    parts = [(slice(0, 1), slice(None)), (slice(1, 6), slice(0, 5))]
    mask = mask.clone()
    mask[1:, 5:] = False
    norm = Normalizer(num_seqs=6, num_tokens=int(mask.sum()), max_len=logp.shape[1])
    full, full_stats = grpo_loss(logp, old_logp, ref_logp, adv, mask, **kw)
    total, stats = 0.0, LossStats.empty(is_weight=is_mode is not None)
    for rows, cols in parts:
        part_kw = {**kw, "sampling_logp": kw["sampling_logp"][rows, cols]} if is_mode else kw
        loss, st = grpo_loss(
            logp[rows, cols], old_logp[rows, cols], ref_logp[rows, cols], adv[rows], mask[rows, cols], norm=norm,
            **part_kw,
        )
        total, stats = total + loss, stats + st
    assert total.item() == pytest.approx(full.item(), rel=1e-12)
    g_full, g_parts = (torch.autograd.grad(x, logp)[0] for x in (full, total))
    torch.testing.assert_close(g_parts, g_full, rtol=1e-12, atol=1e-15)
    # stats combine exactly, also through the packed form an all-reduce would carry
    assert _numbers(stats.summary()) == pytest.approx(_numbers(full_stats.summary()), rel=1e-12)
    assert LossStats.unpack(*stats.pack()).summary() == stats.summary()
    assert (stats.summary()["is_mean"] is None) == (is_mode is None)


def test_dr_grpo_max_len_is_a_constant():
    logp, old_logp, adv, mask = _random_case(seed=5)
    B, T = logp.shape
    a, _ = grpo_loss(logp, old_logp, None, adv, mask, loss_type="dr_grpo")
    b, _ = grpo_loss(logp, old_logp, None, adv, mask, loss_type="dr_grpo", norm=Normalizer(B, 0, 4 * T))
    assert b.item() == pytest.approx(a.item() / 4, rel=1e-12)


# ---------------------------------------------------------------- episode masks (holes of environment tokens)


def _episode_case():
    """Two episodes laid out as the trainer sees them: prompt (mask 0), model tokens (1), environment
    tokens (0, real tokens between model turns), model tokens, padding. Every position off the mask
    holds a ratio far outside the clip (e^3), so any of them counted would move every figure."""
    mask = torch.tensor([[0, 1, 1, 0, 0, 1, 0],  # 3 model tokens, 2 env tokens between them
                         [0, 0, 1, 0, 0, 0, 1]])  # 2 model tokens, 3 env tokens
    ratios = {(0, 1): 1.1, (0, 2): 0.9, (0, 5): 1.05, (1, 2): 0.95, (1, 6): 1.15}  # inside the clip (0.2)
    logp = torch.full((2, 7), 3.0, dtype=f64)
    for (i, t), r in ratios.items():
        logp[i, t] = math.log(r)
    return logp, torch.zeros(2, 7, dtype=f64), torch.tensor([2.0, -1.0], dtype=f64), mask, ratios


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_normalizers_count_model_tokens_only(loss_type):
    """grpo: each episode's sum over its own model tokens (3 and 2, not its 5 and 5 completion-side
    tokens); dapo: the batch's 5 model tokens; dr_grpo: its constant (B * max_len), whatever the holes."""
    logp, old, adv, mask, ratios = _episode_case()
    tok = {k: -r * float(adv[k[0]]) for k, r in ratios.items()}  # per-token loss: -ratio * adv (no clip)
    row = [[v for (i, _), v in tok.items() if i == b] for b in (0, 1)]
    want = {"grpo": (sum(row[0]) / 3 + sum(row[1]) / 2) / 2, "dapo": sum(tok.values()) / 5,
            "dr_grpo": sum(tok.values()) / (2 * 7)}[loss_type]
    loss, st = grpo_loss(logp, old, None, adv, mask, clip_eps=0.2, loss_type=loss_type)
    assert loss.item() == pytest.approx(want, rel=1e-12)
    s = st.summary()
    assert s["tokens"] == 5 and s["clip_frac"] == 0
    assert s["ratio_mean"] == pytest.approx(sum(ratios.values()) / 5, rel=1e-12)
    assert (s["ratio_min"], s["ratio_max"]) == (pytest.approx(0.9), pytest.approx(1.15))
    # the global normalizer of a sharded step: dapo's token count, dr_grpo's constant, grpo's sequences
    norm = Normalizer(num_seqs=4, num_tokens=10, max_len=16)
    got, _ = grpo_loss(logp, old, None, adv, mask, clip_eps=0.2, loss_type=loss_type, norm=norm)
    want_norm = {"grpo": want * 2 / 4, "dapo": sum(tok.values()) / 10, "dr_grpo": sum(tok.values()) / (4 * 16)}
    assert got.item() == pytest.approx(want_norm[loss_type], rel=1e-12)


@pytest.mark.parametrize("is_mode", ["sequence_mask", "sequence_truncate"])
def test_sequence_weight_sums_over_model_tokens_only(is_mode):
    """The per-sequence engine-mismatch weight is exp(sum over the episode's model tokens): the env
    tokens' (garbage here, which would push every weight over the cap) take no part."""
    logp, _, adv, mask, ratios = _episode_case()
    old = logp.detach().clone()  # the trainer's own log-probs: ratio 1 everywhere
    sampling = torch.full((2, 7), -50.0, dtype=f64)  # off the mask: log-weights of +50 each
    d = {(0, 1): 0.1, (0, 2): 0.2, (0, 5): -0.1, (1, 2): 0.9, (1, 6): 0.5}  # old - sampling on model tokens
    for (i, t), v in d.items():
        sampling[i, t] = old[i, t] - v
    cap = 1.5
    w = [math.exp(0.2), math.exp(1.4)]  # 1.22 under the cap; 4.06 over it
    kept = [w[0], min(w[1], cap) if is_mode == "sequence_truncate" else 0.0]
    lp = logp.clone().requires_grad_()
    loss, st = grpo_loss(lp, old, None, adv, mask, loss_type="dapo", sampling_logp=sampling, is_mode=is_mode,
                         is_cap=cap)
    want = -(3 * kept[0] * float(adv[0]) + 2 * kept[1] * float(adv[1])) / 5  # ratio 1: -w * adv per token
    assert loss.item() == pytest.approx(want, rel=1e-12)
    s = st.summary()
    assert s["is_mean"] == pytest.approx((3 * w[0] + 2 * w[1]) / 5, rel=1e-12)
    assert s["is_capped_frac"] == pytest.approx(2 / 5) and s["is_max"] == pytest.approx(w[1], rel=1e-12)
    g = torch.autograd.grad(loss, lp)[0]
    assert (g[~mask.bool()] == 0).all() and (g[mask.bool()] != 0).sum() == (5 if is_mode == "sequence_truncate" else 3)


def test_mismatch_sums_match_a_naive_reference_and_estimate_kl_engine_to_trainer():
    from grpo_kit.loss import MISMATCH_FAR, mismatch_sums

    g = torch.Generator().manual_seed(0)
    trainer = torch.log_softmax(torch.randn(6, generator=g, dtype=torch.float64), 0)  # over a 6-token vocab
    engine = torch.log_softmax(trainer + 0.8 * torch.randn(6, generator=g, dtype=torch.float64), 0)
    # each vocab token as one sampled token; off the mask: garbage that must not be read
    logp = torch.stack([trainer, torch.full((6,), float("nan"), dtype=torch.float64)])  # (2, 6)
    eng = torch.stack([engine, torch.full((6,), float("inf"), dtype=torch.float64)])
    mask = torch.tensor([[1] * 6, [0] * 6])
    k3, far, nll = mismatch_sums(logp, eng, mask).tolist()
    naive = [math.exp(t - e) - (t - e) - 1 for t, e in zip(trainer.tolist(), engine.tolist(), strict=True)]
    assert k3 == pytest.approx(sum(naive), rel=1e-12)
    assert far == sum(abs(t - e) > MISMATCH_FAR for t, e in zip(trainer.tolist(), engine.tolist(), strict=True)) > 0
    assert nll == pytest.approx(-float(trainer.sum()), rel=1e-12)
    # under the engine's sampling, E[k3] is KL(engine || trainer) exactly (the direction the samples allow)
    kl = float((engine.exp() * (engine - trainer)).sum())
    per_token = [mismatch_sums(trainer[i].reshape(1, 1), engine[i].reshape(1, 1), torch.ones(1, 1))[0] for i in range(6)]
    assert float(sum(engine.exp()[i] * per_token[i] for i in range(6))) == pytest.approx(kl, rel=1e-12)
    assert mismatch_sums(logp[:0], eng[:0], mask[:0]).tolist() == [0.0, 0.0, 0.0]
