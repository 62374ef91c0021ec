"""vLLM-CPU's KV-cache block size, side by side: ``VLLMEngine.generate`` tokens/s at two block sizes.

    python bench/kv_block.py [--model smollm2-135m] [--blocks 128 32] [--problems 16] [--group-size 6]
                             [--max-new-tokens 48] [--repeats 3]

Two engines in one process, one per block size (the kit's default, ``vllm_engine.KV_BLOCK_TOKENS``,
is 32; vLLM-CPU's own is 128), the same adapter (a perturbed v1), prompts and seeds. Each repeat runs
both, alternating which goes first; a first unmeasured round warms both up. Seeded sampling gives the
same samples at either block size (the token counts are printed per call: they must agree), so the
figure is tokens per second of the same work (a round whose counts differ stops the bench). The last line is JSON: median tokens/s per block size
and their ratio (``ratio``: the second block over the first). vLLM's CPU engine must start under
``if __name__ == "__main__"``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

from grpo_kit import data, models
from grpo_kit.adapters import AdapterStore
from grpo_kit.testing import perturbed_adapter


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m", help="tiny, smollm2-135m or a checkpoint directory")
    ap.add_argument("--blocks", nargs=2, type=int, default=[128, 32], help="the two KV block sizes (tokens)")
    ap.add_argument("--problems", type=int, default=16)
    ap.add_argument("--group-size", type=int, default=6)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3, help="measured rounds (after one warm-up round)")
    args = ap.parse_args(argv)

    from grpo_kit.vllm_engine import VLLMEngine

    path = models.resolve_model(args.model)
    store = AdapterStore(tempfile.mkdtemp(prefix="bench-kv-block-"))
    store.publish(perturbed_adapter(path, seed=1), 1)
    problems = data.synthetic_problems(args.problems, split="train", seed=0, n_digits=3 if args.model == "tiny" else 2)
    engines = {b: VLLMEngine(path, store=store, max_lora_rank=8, max_model_len=512,
                             max_batch_seqs=args.problems * args.group_size, block_size=b) for b in args.blocks}
    speeds: dict[int, list[float]] = {b: [] for b in args.blocks}
    for rnd in range(args.repeats + 1):
        order = args.blocks if rnd % 2 == 0 else args.blocks[::-1]
        counts = {}
        for b in order:
            t0 = time.perf_counter()
            out = engines[b].generate(problems, args.group_size, 1, max_new_tokens=args.max_new_tokens, seed=rnd)
            dt = time.perf_counter() - t0
            counts[b] = sum(len(r.completion_ids) for r in out)
            if rnd > 0:
                speeds[b].append(counts[b] / dt)
            print(f"round {rnd}{' (warm-up)' if rnd == 0 else ''}: block {b}: {counts[b]} tokens in {dt:.2f} s "
                  f"({counts[b] / dt:.0f} tokens/s)", flush=True)
        if len(set(counts.values())) != 1:  # then the two sides did different work: not a comparison
            raise SystemExit(f"the two block sizes sampled different token counts {counts}")
    for e in engines.values():
        e.close()
    a, b = (statistics.median(speeds[x]) for x in args.blocks)
    print(json.dumps({"model": args.model, "blocks": args.blocks, f"tokens_per_s_block_{args.blocks[0]}": a,
                      f"tokens_per_s_block_{args.blocks[1]}": b, "ratio": b / a,
                      "ratios_per_round": [y / x for x, y in zip(speeds[args.blocks[0]], speeds[args.blocks[1]], strict=True)]}))


if __name__ == "__main__":
    main()
