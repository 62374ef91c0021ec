"""Rollout throughput: raw ``vllm.LLM.generate`` against the kit's engines, on the same prompts.

    python bench/engines.py [--problems 32] [--group-size 6] [--max-new-tokens 48] [--repeats 7]

One VLLMEngine on the tiny model (``--lora-mode``, default the kit's ``auto``: merged on CPU), with a
perturbed LoRA published as version 1. "raw" calls the engine's own ``vllm.LLM`` directly with the
token ids the kit sends (tokenized once, before any clock) and one ``SamplingParams`` per prompt
with the kit's settings (the same seeds, flat log-probs, no detokenizing, the model's stop ids), so
raw and kit run on one engine doing the same sampling work and sample identical tokens; the
difference is the kit's overhead (tokenizing, building Rollout records, decoding text). (Before
2026-12-03 raw sent text prompts with vLLM's default settings, which detokenize and build a log-prob
dict per token: a slower baseline, so the ratios measured then were too high.) The version is put in place before each raw/kit
pair (request mode: the LoRARequest; merged mode: the merged weights, whose switch time is reported
on its own), so neither side of a pair pays for it.
Each repeat runs raw and kit back to back, alternating which goes first, with and without the
adapter; the HFEngine runs once per repeat too. Reported: median completion tokens/s, and the
median over repeats of the paired kit/raw ratio (target >= 0.95), by wall time and by this
process's CPU time (the engine runs in-process on one thread, so CPU time is the same work measured
without the noise of other load on the machine). The last line is JSON.
"""

from __future__ import annotations

import argparse
import inspect
import json
import statistics
import tempfile
import time

from grpo_kit import data, tiny
from grpo_kit.adapters import AdapterStore
from grpo_kit.hf_engine import HFEngine
from grpo_kit.prompts import encode_prompts
from grpo_kit.rollout import group_seed
from grpo_kit.testing import perturbed_adapter


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--problems", type=int, default=32)
    ap.add_argument("--group-size", type=int, default=6)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--lora-mode", choices=("auto", "request", "merged"), default="auto")
    args = ap.parse_args()

    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from grpo_kit.vllm_engine import VLLMEngine

    path = str(tiny.ensure_tiny_model())
    store = AdapterStore(tempfile.mkdtemp(prefix="bench-engines-"))
    store.publish(perturbed_adapter(path, seed=1), 1)
    problems = data.synthetic_problems(args.problems, split="train", seed=0)
    n, max_new = args.group_size, args.max_new_tokens

    engine = VLLMEngine(path, store=store, max_lora_rank=8, lora_mode=args.lora_mode)
    if engine.stop:
        raise SystemExit("this bench compares runs without stop strings (the kit would detokenize for them)")
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in
               encode_prompts(engine.tokenizer, problems, max_new, engine.max_model_len, engine.prompt_format)]
    flat = {"flat_logprobs": True} if "flat_logprobs" in inspect.signature(SamplingParams).parameters else {}
    hf = HFEngine(path, store=store)
    switch_s: list[float] = []

    def prepare(version: int):
        """Put ``version`` in place as the kit does; returns the LoRARequest (None when merged or base)."""
        t = time.perf_counter()
        lora = engine.lora_for(version)
        switch_s.append(time.perf_counter() - t)
        return lora

    def raw(version: int, seed: int) -> int:
        params = [
            SamplingParams(
                n=n, temperature=1.0, top_p=1.0, top_k=0, logprobs=0, seed=group_seed(seed, i), max_tokens=max_new,
                stop_token_ids=list(engine.stop_ids), detokenize=False, **flat,
            )
            for i in range(len(prompts))
        ]
        outs = engine.llm.generate(prompts, params, lora_request=current["lora"], use_tqdm=False)
        return sum(len(c.token_ids) for o in outs for c in o.outputs)

    def kit(eng, version: int, seed: int) -> int:
        return sum(len(r.completion_ids) for r in eng.generate(problems, n, version, max_new_tokens=max_new, seed=seed))

    def timed(fn, *a) -> tuple[float, int, float]:
        """(tokens per wall second, tokens, tokens per CPU second of this process)."""
        t0, c0 = time.perf_counter(), time.process_time()
        tokens = fn(*a)
        return tokens / (time.perf_counter() - t0), tokens, tokens / (time.process_time() - c0)

    current = {"lora": None}
    for version in (1, 0):  # warm-up: first calls load the adapter and touch every kernel; it ends on v0, so the
        # first timed switch (to v1) is a real one (ending on v1, a review found it timed a no-op: [0.0, 30.2, ...])
        current["lora"] = prepare(version)
        raw(version, 0)
        kit(engine, version, 0)
        kit(hf, version, 0)

    rows: dict[str, list[float]] = {k: [] for k in ("raw", "kit", "raw_base", "kit_base", "hf", "hf_base")}
    ratios: dict[str, list[float]] = {"adapter": [], "base": [], "adapter_cpu": [], "base_cpu": []}
    for rep in range(args.repeats):
        seed = 1000 + rep
        for version, suffix in ((1, ""), (0, "_base")):
            current["lora"] = prepare(version)
            pair = [
                ("raw", lambda v=version, s=seed: timed(raw, v, s)),
                ("kit", lambda v=version, s=seed: timed(kit, engine, v, s)),
            ]
            res = dict((name, fn()) for name, fn in (pair if rep % 2 == 0 else pair[::-1]))
            if res["raw"][1] != res["kit"][1]:
                raise RuntimeError(f"raw and kit sampled different token counts: {res['raw'][1]} vs {res['kit'][1]}")
            rows["raw" + suffix].append(res["raw"][0])
            rows["kit" + suffix].append(res["kit"][0])
            ratios["adapter" if version else "base"].append(res["kit"][0] / res["raw"][0])
            ratios["adapter_cpu" if version else "base_cpu"].append(res["kit"][2] / res["raw"][2])
            rows["hf" + suffix].append(timed(kit, hf, version, seed)[0])
        print(
            f"repeat {rep}: raw {rows['raw'][-1]:.0f} kit {rows['kit'][-1]:.0f} tok/s (v1); "
            f"raw {rows['raw_base'][-1]:.0f} kit {rows['kit_base'][-1]:.0f} tok/s (v0); "
            f"hf {rows['hf'][-1]:.0f} / {rows['hf_base'][-1]:.0f} tok/s (v1 / v0)",
            flush=True,
        )
    mode = engine.lora_mode
    engine.close()
    hf.close()
    switch = statistics.median(switch_s[2:])  # after the warm-up's two

    med = {k: statistics.median(v) for k, v in rows.items()}
    kit_vs_raw = statistics.median(ratios["adapter"])
    kit_vs_raw_base = statistics.median(ratios["base"])
    cpu, cpu_base = statistics.median(ratios["adapter_cpu"]), statistics.median(ratios["base_cpu"])
    print(
        f"medians over {args.repeats} repeats, {args.problems} prompts x {n}, max_new_tokens={max_new}:\n"
        f"  with adapter (v1): raw {med['raw']:.0f}  VLLMEngine {med['kit']:.0f}  HFEngine {med['hf']:.0f} tok/s; "
        f"kit/raw {kit_vs_raw:.3f}\n"
        f"  base model (v0):   raw {med['raw_base']:.0f}  VLLMEngine {med['kit_base']:.0f}  "
        f"HFEngine {med['hf_base']:.0f} tok/s; kit/raw {kit_vs_raw_base:.3f}\n"
        f"  kit/raw by CPU time of this process (robust to other load on the machine): "
        f"{cpu:.3f} (v1), {cpu_base:.3f} (v0)\n"
        f"  lora_mode={mode}: median version switch {switch * 1000:.1f} ms"
    )
    print(
        json.dumps(
            {
                "raw_tok_s": med["raw"],
                "vllm_engine_tok_s": med["kit"],
                "hf_engine_tok_s": med["hf"],
                "kit_vs_raw": kit_vs_raw,
                "raw_base_tok_s": med["raw_base"],
                "vllm_engine_base_tok_s": med["kit_base"],
                "hf_engine_base_tok_s": med["hf_base"],
                "kit_vs_raw_base": kit_vs_raw_base,
                "kit_vs_raw_cpu": cpu,
                "kit_vs_raw_base_cpu": cpu_base,
                "kit_vs_raw_all": sorted(ratios["adapter"]),
                "repeats": args.repeats,
                "lora_mode": mode,
                "version_switch_s": switch,
            }
        )
    )


if __name__ == "__main__":
    main()
