"""On-policy alignment of each rollout engine with the trainer's log-probs.

    python bench/alignment.py [--model tiny|smollm2-135m|DIR] [--problems 32] [--group-size 6] [--max-new-tokens 48]
                              [--temperature 1.0]

For each engine (vLLM with the adapter merged into its weights, vLLM with a per-request LoRA, HF)
on the model (default the tiny one; ``smollm2-135m`` is a real chat model, prompted through its chat
template) with a non-trivial LoRA adapter (random B matrices,
published to an AdapterStore as version 1): sample completions, recompute the log-probs of the
same token ids with ``train_step.token_logprobs`` under the same adapter (loaded from the store the
way the trainer loads it), and report the on-policy importance ratio ``exp(logp - old_logp)``:
its mean (should be 1), std and the largest |delta logp|. At ``--temperature`` the engines sample
and record the tempered distribution, and the trainer scores the same one. The last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

from grpo_kit import data, models
from grpo_kit.adapters import AdapterStore
from grpo_kit.prompts import PromptFormat
from grpo_kit.rollout import HFEngine
from grpo_kit.testing import dlogp, perturbed_adapter, policy, ratio_stats


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--problems", type=int, default=32)
    ap.add_argument("--group-size", type=int, default=6)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--model", default="tiny", help="tiny, smollm2-135m or a checkpoint directory")
    ap.add_argument("--lora-scale", type=float, default=None, help="std of the random B matrices "
                    "(default 0.05 for tiny, 0.01 otherwise)")
    ap.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (scored tempered)")
    ap.add_argument("--version", type=int, default=1, help="1: the perturbed adapter; 0: the base model")
    ap.add_argument("--engines", nargs="+", default=["vllm_merged", "vllm_request", "hf"],
                    choices=["vllm_merged", "vllm_request", "hf"])
    args = ap.parse_args()

    from grpo_kit.vllm_engine import VLLMEngine

    path = models.resolve_model(args.model)
    scale = args.lora_scale if args.lora_scale is not None else (0.05 if args.model == "tiny" else 0.01)
    store = AdapterStore(tempfile.mkdtemp(prefix="bench-alignment-"))
    store.publish(perturbed_adapter(path, seed=1, scale=scale), 1)
    problems = data.synthetic_problems(args.problems, split="train", seed=0, n_digits=3 if args.model == "tiny" else 2)
    kw = {"max_new_tokens": args.max_new_tokens, "seed": 0, "temperature": args.temperature}
    common = {"store": store, "prompt_format": PromptFormat(), "max_model_len": 256}

    results = {}
    engines = {
        "vllm_merged": lambda: VLLMEngine(path, lora_mode="merged", **common),
        "vllm_request": lambda: VLLMEngine(path, max_lora_rank=8, lora_mode="request", **common),
        "hf": lambda: HFEngine(path, **common),
    }
    scorer = policy(path, store, args.version)
    for name, build in engines.items():
        if name not in args.engines:
            continue
        t0 = time.perf_counter()
        engine = build()
        rollouts = engine.generate(problems, args.group_size, args.version, **kw)
        engine.close()
        st = ratio_stats(dlogp(scorer, rollouts, temperature=args.temperature), rollouts)
        results[name] = st
        print(
            f"{name:12s} v{args.version}: {st['tokens']} completion tokens ({st['truncated']} truncated), "
            f"ratio mean {st['ratio_mean']:.8f} std {st['ratio_std']:.2e}, max |dlogp| {st['max_abs_dlogp']:.2e} "
            f"({time.perf_counter() - t0:.1f}s)",
            flush=True,
        )
    print(
        json.dumps(
            {
                "model": args.model,
                "version": args.version,
                "temperature": args.temperature,
                **{f"{e}_{k}": v for e, st in results.items() for k, v in st.items()},
            }
        )
    )


if __name__ == "__main__":
    main()
