"""Calibrate the tiny profile: pretraining time, greedy held-out accuracy, and sampled signal.

    python bench/tiny_calibration.py [--build] [--steps N] [--slip-rate P] [--temperature T]

Prints the figures the tiny profile must meet (pretraining <= 5 min; greedy accuracy 15-55%;
sampled mean reward >= 0.2; >= 40% of groups of 6 with reward spread; truncation count), and as
its last line a JSON object with them. ``pretrain_s`` is the pretraining time the model's build
record holds: without ``--build`` that of the copy ``ensure_tiny_model`` gives (for the default spec
the build shipped in ``grpo_kit/prebuilt/``, timed where it was built, not here: ``pretrain_from``
says ``"build record"``); with ``--build`` the model is pretrained here, into a temporary cache,
and the figure is this machine's (``pretrain_from``: ``"built here"``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import tempfile
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from grpo_kit import data, tiny
from grpo_kit.reward import gsm8k_reward


def generate(model, tok, prompts, *, n=1, greedy=True, temperature=1.0, max_new_tokens=48, seed=0):
    enc = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    torch.manual_seed(seed)
    with torch.no_grad():
        out = model.generate(
            **enc,
            do_sample=not greedy,
            temperature=temperature if not greedy else None,
            top_k=0 if not greedy else None,
            top_p=1.0 if not greedy else None,
            num_return_sequences=n,
            max_new_tokens=max_new_tokens,
            pad_token_id=tok.pad_token_id,
            eos_token_id=tok.eos_token_id,
        )
    comp = out[:, enc["input_ids"].shape[1] :]
    texts = tok.batch_decode(comp, skip_special_tokens=True)
    truncated = [(tok.eos_token_id not in row.tolist()) for row in comp]
    return texts, truncated


def main() -> None:
    ap = argparse.ArgumentParser()
    for f in dataclasses.fields(tiny.TinySpec):
        ap.add_argument("--" + f.name.replace("_", "-"), type=type(f.default), default=None)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--eval-size", type=int, default=256)
    ap.add_argument("--groups", type=int, default=64)
    ap.add_argument("--build", action="store_true", help="pretrain the model here (timed), not the cached or shipped copy")
    args = ap.parse_args()
    overrides = {f.name: getattr(args, f.name) for f in dataclasses.fields(tiny.TinySpec) if getattr(args, f.name) is not None}
    spec = tiny.TinySpec(**overrides)
    t0 = time.time()
    if args.build:  # pretrain here (never the shipped copy), into a cache of its own
        os.environ["GRPO_KIT_TINY_BUILD"] = "1"
        path = tiny.ensure_tiny_model(spec, cache_dir=tempfile.mkdtemp(prefix="tiny-build-"))
    else:
        path = tiny.ensure_tiny_model(spec)
    info = tiny.tiny_info(path)
    print(f"model at {path}; pretraining {info['pretrain_s']:.0f}s, {info['tokens_per_s']:.0f} tok/s (call {time.time() - t0:.0f}s)")
    tok = AutoTokenizer.from_pretrained(path, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    held = data.synthetic_problems(args.eval_size, split="heldout", seed=0, n_digits=spec.n_digits, n_terms=spec.n_terms)
    texts, trunc = generate(model, tok, [p.prompt for p in held], max_new_tokens=args.max_new_tokens)
    greedy_acc = sum(gsm8k_reward(t, p.gold).score >= 1 for t, p in zip(texts, held, strict=True)) / len(held)
    train = data.synthetic_problems(args.groups, split="train", seed=99, n_digits=spec.n_digits, n_terms=spec.n_terms)
    texts, strunc = generate(model, tok, [p.prompt for p in train], n=6, greedy=False, temperature=args.temperature, max_new_tokens=args.max_new_tokens)
    rewards = [gsm8k_reward(t, train[i // 6].gold).score for i, t in enumerate(texts)]
    groups = [rewards[i : i + 6] for i in range(0, len(rewards), 6)]
    spread = sum(max(g) > min(g) for g in groups) / len(groups)
    res = {
        "pretrain_s": round(info["pretrain_s"], 1),
        "pretrain_from": "built here" if args.build else "build record",
        "params": sum(p.numel() for p in model.parameters()),
        "greedy_acc": greedy_acc,
        "sampled_reward_mean": sum(rewards) / len(rewards),
        "groups_with_spread": spread,
        "greedy_truncated": sum(trunc),
        "sampled_truncated": sum(strunc),
        "temperature": args.temperature,
    }
    print("example greedy completion:\n" + texts[0])
    print(json.dumps(res))


if __name__ == "__main__":
    main()
