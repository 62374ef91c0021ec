"""On-policy alignment of each rollout engine with the trainer's log-probs.

    python bench/alignment.py [--problems 32] [--group-size 6] [--max-new-tokens 48]

For each engine (vLLM with the adapter merged into its weights, vLLM with a per-request LoRA, HF) on the tiny model with a non-trivial LoRA adapter (random B matrices,
published to an AdapterStore as version 1): sample completions, recompute the log-probs of the
same token ids with ``train_step.token_logprobs`` under the same adapter (loaded from the store the
way the trainer loads it), and report the on-policy importance ratio ``exp(logp - old_logp)``:
its mean (should be 1), std and the largest |delta logp|. The last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM

from grpo_kit import data, tiny
from grpo_kit.adapters import AdapterStore
from grpo_kit.rollout import HFEngine
from grpo_kit.train_step import collate, token_logprobs

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def perturbed_adapter(path, seed: int, scale: float = 0.05):
    """A LoRA on the model at ``path`` whose B matrices are random, so it changes the outputs."""
    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules=TARGETS, lora_dropout=0.0))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, scale)
    return model.eval()


def ratio_stats(path, store, version: int, rollouts) -> dict[str, float]:
    """Recompute the rollouts' log-probs as the trainer does; stats of the on-policy ratio."""
    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model = base if version == 0 else PeftModel.from_pretrained(base, store.fetch(version)).eval()
    batch = collate([(r.prompt_ids, r.completion_ids, r.logprobs, 0.0) for r in rollouts], pad_id=0)
    with torch.no_grad():
        logp = token_logprobs(model, batch.input_ids, batch.attention_mask, batch.completion_mask)
    m = batch.completion_mask.bool()
    d = (logp[m] - batch.old_logp[m]).double()  # (N,)
    ratio = d.exp()
    return {
        "tokens": int(m.sum()),
        "ratio_mean": ratio.mean().item(),
        "ratio_std": ratio.std().item(),
        "max_abs_dlogp": d.abs().max().item(),
        "truncated": sum(r.truncated for r in rollouts),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--problems", type=int, default=32)
    ap.add_argument("--group-size", type=int, default=6)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--version", type=int, default=1, help="1: the perturbed adapter; 0: the base model")
    args = ap.parse_args()

    from grpo_kit.vllm_engine import VLLMEngine

    path = str(tiny.ensure_tiny_model())
    store = AdapterStore(tempfile.mkdtemp(prefix="bench-alignment-"))
    store.publish(perturbed_adapter(path, seed=1), 1)
    problems = data.synthetic_problems(args.problems, split="train", seed=0)
    kw = {"max_new_tokens": args.max_new_tokens, "seed": 0}

    results = {}
    engines = {
        "vllm_merged": lambda: VLLMEngine(path, store=store, lora_mode="merged"),
        "vllm_request": lambda: VLLMEngine(path, store=store, max_lora_rank=8,
                                           lora_mode="request"),
        "hf": lambda: HFEngine(path, store=store),
    }
    for name, build in engines.items():
        t0 = time.perf_counter()
        engine = build()
        rollouts = engine.generate(problems, args.group_size, args.version, **kw)
        engine.close()
        st = ratio_stats(path, store, args.version, rollouts)
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
                "version": args.version,
                **{f"{e}_{k}": v for e, st in results.items() for k, v in st.items()},
            }
        )
    )


if __name__ == "__main__":
    main()
