"""Padding-free packed training against the padded forward: the training step, same batch, same model.

    python bench/packing.py [--pairs 2] [--tiny-pairs 3] [--budgets 1024] [--threads 1] [--synthetic]

For each profile (``tiny``: the kit's tiny model, 16 x 6 rows in one micro-batch; ``smol``:
SmolLM2-135M-Instruct, 4 x 8 rows in micro-batches of 8) the rows are real completions sampled at
the profile's temperature by the HF engine from the base policy (the smol profile's stop string
"\\n\\n" and 64-token cap give completions of varied length), with seeded random nonzero advantages
so that every row is trained. ``--synthetic`` replaces the sampled completions with random token ids
of lengths drawn uniformly from 1..max_new_tokens (no sampling; a wider spread of lengths).

Arms, each a :func:`grpo_kit.train_step.grpo_step` on its own policy and AdamW, the profile's loss
and optimizer settings otherwise: ``padded`` (``packing=False``, the profile's ``micro_batch`` and
``share_prompt``), ``packed`` (``packing=True``, the profile's ``micro_batch_tokens``: 2048 on tiny,
1024 on smol, which packs by default; ``share_prompt`` as the profile has it), ``packed`` at each
other ``--budgets`` value, and ``packed`` without
``share_prompt``. Every round runs each arm once, the order rotating from round to round (pairs
alternated); reported are the medians of wall time and of this process's CPU time (one torch thread
by default, as a trainer rank has with ``threads_per_worker=1``: CPU time is then the step's work
without the other load on a shared machine), the load average at the start and end of each round, and
``max_abs_dlogp``: the largest |packed - padded| token log-prob over both profiles' scored tokens
(float32, the fresh policy, no_grad). The last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from dataclasses import replace
from types import SimpleNamespace

import torch

from grpo_kit import config, data, models
from grpo_kit.hf_engine import HFEngine
from grpo_kit.logprobs import shared_prompt_logprobs, token_logprobs
from grpo_kit.packing import packed_logprobs
from grpo_kit.prompts import prompt_format
from grpo_kit.train_step import collate, grpo_step, make_optimizer
from grpo_kit.trainer import build_policy


def load() -> str:
    one, five, _ = os.getloadavg()
    return f"{one:.2f}/{five:.2f}"


def samples_for(cfg: config.Config, path: str, synthetic: bool, seed: int = 0) -> list[tuple]:
    s = cfg.sampling
    problems = data.synthetic_problems(s.prompts_per_step, split="train", seed=seed, n_digits=cfg.data.n_digits)
    if synthetic:  # the prompts only: no sampling
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(path)
        fmt = prompt_format(cfg)
        rollouts = [SimpleNamespace(prompt_ids=fmt.encode(tok, p.question), completion_ids=[], logprobs=[])
                    for p in problems for _ in range(s.group_size)]
        vocab = len(tok)
    else:
        engine = HFEngine(path, **HFEngine.options(cfg, prompt_format(cfg)))
        rollouts = engine.generate(problems, s.group_size, 0, max_new_tokens=s.max_new_tokens,
                                   temperature=s.temperature, seed=seed)
        vocab = len(engine.tokenizer)
        del engine
    g = torch.Generator().manual_seed(seed)
    out = []
    for r in rollouts:
        comp, lp = list(r.completion_ids), list(r.logprobs)
        if synthetic:
            n = int(torch.randint(1, s.max_new_tokens + 1, (1,), generator=g))
            comp = torch.randint(0, vocab, (n,), generator=g).tolist()
            lp = [-5.0] * n
        adv = float(torch.randn((), generator=g)) or 0.5
        out.append((list(r.prompt_ids), comp, lp, adv))
    return out


def describe(samples: list[tuple]) -> dict:
    comp = [len(c) for _, c, _, _ in samples]
    real = [len(p) + len(c) for p, c, _, _ in samples]
    return {"rows": len(samples), "prompt_tokens": round(statistics.mean(len(p) for p, *_ in samples), 1),
            "completion_min": min(comp), "completion_mean": round(statistics.mean(comp), 1),
            "completion_max": max(comp), "real_tokens": sum(real)}


def max_dlogp(model, batch, optim: config.OptimConfig, temperature: float) -> float:
    """Largest |packed - padded| log-prob over the scored tokens, per micro-batch as the step cuts them."""
    worst = 0.0
    padded_fn = shared_prompt_logprobs if optim.share_prompt else token_logprobs
    with torch.no_grad():
        for i in range(0, len(batch), optim.micro_batch):
            mb = batch[i : i + optim.micro_batch].trim()
            args = (mb.input_ids, mb.attention_mask, mb.completion_mask)
            a = padded_fn(model, *args, temperature=temperature)
            b = packed_logprobs(model, *args, share_prompt=optim.share_prompt, temperature=temperature)
            worst = max(worst, float((a - b).abs().max()))
            worst = max(worst, float((token_logprobs(model, *args, temperature=temperature) - b).abs().max()))
    return worst


def bench_profile(name: str, rounds: int, budgets: list[int], synthetic: bool, noshare: bool = True) -> dict:
    cfg = config.profile(name)
    path = models.resolve_model(cfg.model.model)
    t0 = time.perf_counter()
    samples = samples_for(cfg, path, synthetic)
    info = describe(samples)
    batch = collate(samples, pad_id=0)
    mb = cfg.optim.micro_batch
    padded_cols = sum(batch[i : i + mb].trim().attention_mask.numel() for i in range(0, len(batch), mb))
    info["padding_share"] = round(1 - info["real_tokens"] / padded_cols, 3)  # of the padded micro-batches' tokens
    print(f"[{name}] {info} ({'synthetic' if synthetic else 'sampled'} completions, {time.perf_counter() - t0:.1f} s)",
          flush=True)

    base = replace(cfg.optim, packing=False)
    arms = {"padded": base, "packed": replace(base, packing=True)}
    for b in (b for b in budgets if b != base.micro_batch_tokens):
        arms[f"packed_{b}"] = replace(base, packing=True, micro_batch_tokens=b)
    if noshare:
        arms["packed_noshare"] = replace(base, packing=True, share_prompt=False)
    policies = {}
    for arm in arms:
        model = build_policy(path, cfg.model, cfg.lora, cfg.run.seed)
        policies[arm] = (model, make_optimizer(model, cfg.optim))
    dlogp = max_dlogp(policies["padded"][0], batch, base, cfg.sampling.temperature)
    print(f"[{name}] max |packed - padded| log-prob: {dlogp:.2e}", flush=True)

    times: dict[str, list[float]] = {arm: [] for arm in arms}
    cpu: dict[str, list[float]] = {arm: [] for arm in arms}
    order = list(arms)
    warm = {arm: False for arm in arms}
    for rnd in range(rounds + 1):  # round 0 warms every arm up (first-call allocations), untimed
        start = load()
        k = rnd % len(order)
        for arm in order[k:] + order[:k]:
            model, opt = policies[arm]
            t, c = time.perf_counter(), time.process_time()
            grpo_step(model, opt, batch, cfg.loss, arms[arm], max_len=cfg.sampling.max_new_tokens,
                      temperature=cfg.sampling.temperature)
            dt, dc = time.perf_counter() - t, time.process_time() - c
            if warm[arm]:
                times[arm].append(dt)
                cpu[arm].append(dc)
            warm[arm] = True
        if rnd:
            print(f"[{name}] round {rnd}: " + ", ".join(f"{a} {times[a][-1]:.3f} s (cpu {cpu[a][-1]:.3f})" for a in order)
                  + f"; load average {start} -> {load()}", flush=True)
    med = {arm: statistics.median(v) for arm, v in times.items()}
    med_cpu = {arm: statistics.median(v) for arm, v in cpu.items()}
    print(f"[{name}] median step: " + ", ".join(f"{a} {v:.3f} s (cpu {med_cpu[a]:.3f})" for a, v in med.items())
          + f"; packed / padded {med['packed'] / med['padded']:.3f} (cpu {med_cpu['packed'] / med_cpu['padded']:.3f})",
          flush=True)
    return {"info": info, "median_s": med, "median_cpu_s": med_cpu, "max_abs_dlogp": dlogp}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pairs", type=int, default=2, help="timed rounds on the smol profile")
    ap.add_argument("--tiny-pairs", type=int, default=3, help="timed rounds on the tiny profile")
    ap.add_argument("--budgets", default="1024", help="other micro_batch_tokens values tried")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (a trainer rank runs 1)")
    ap.add_argument("--profiles", default="tiny,smol", help="which profiles (the JSON holds null for the others)")
    ap.add_argument("--skip-noshare", action="store_true", help="leave out the packed arm without share_prompt")
    ap.add_argument("--synthetic", action="store_true", help="random completions of uniform random length")
    args = ap.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    print(f"load average at start {load()}; torch threads {torch.get_num_threads()}", flush=True)
    budgets = [int(b) for b in args.budgets.split(",") if b]
    which = args.profiles.split(",")
    none = {"info": None, "median_s": {}, "median_cpu_s": {}, "max_abs_dlogp": 0.0}
    tiny = bench_profile("tiny", args.tiny_pairs, budgets, args.synthetic, not args.skip_noshare) if "tiny" in which else none
    smol = bench_profile("smol", args.pairs, budgets, args.synthetic, not args.skip_noshare) if "smol" in which else none
    r4 = lambda d, k: round(d[k], 4) if k in d else None  # noqa: E731
    ratio = lambda d: round(d["packed"] / d["padded"], 3) if d else None  # noqa: E731
    out = {
        "smol_step_s_padded": r4(smol["median_s"], "padded"),
        "smol_step_s_packed": r4(smol["median_s"], "packed"),
        "tiny_step_s_padded": r4(tiny["median_s"], "padded"),
        "tiny_step_s_packed": r4(tiny["median_s"], "packed"),
        "max_abs_dlogp": max(smol["max_abs_dlogp"], tiny["max_abs_dlogp"]),
        "smol_packed_over_padded": ratio(smol["median_s"]),
        "tiny_packed_over_padded": ratio(tiny["median_s"]),
        "smol_cpu_packed_over_padded": ratio(smol["median_cpu_s"]),
        "tiny_cpu_packed_over_padded": ratio(tiny["median_cpu_s"]),
        "smol_arms_s": {k: round(v, 4) for k, v in smol["median_s"].items()},
        "smol_arms_cpu_s": {k: round(v, 4) for k, v in smol["median_cpu_s"].items()},
        "tiny_arms_s": {k: round(v, 4) for k, v in tiny["median_s"].items()},
        "tiny_arms_cpu_s": {k: round(v, 4) for k, v in tiny["median_cpu_s"].items()},
        "smol_batch": smol["info"],
        "tiny_batch": tiny["info"],
        "completions": "synthetic" if args.synthetic else "sampled",
        "profiles": which,
        "load_average_end": load(),
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
