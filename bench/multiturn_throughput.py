"""Model tokens/s in multi-turn episodes against single-turn sampling, on one engine.

    python bench/multiturn_throughput.py [--engines vllm [hf]] [--model tiny] [--problems 8] [--group-size 4]
                                         [--turns 3] [--turn-tokens 48] [--tool-latency-ms 50] [--tool-workers N]
                                         [--tool-gather-ms MS] [--repeats 5] [--warm-prompts]

Multi-turn side: ``--problems`` x ``--group-size`` episodes in one chunk (one
:meth:`grpo_kit.episode.EpisodeRunner.run`, as a rollout task plays them), the
:class:`~grpo_kit.testing.Notes` environment whose tool sleeps ``--tool-latency-ms`` before it
answers, and the scripted :class:`~grpo_kit.testing.CallEveryTurn` parser (the tiny model never calls
tools), so each episode plays up to ``--turns`` turns of at most ``--turn-tokens`` sampled tokens,
its tool calls running in the runner's thread pool while other episodes' turns are sampled.
Single-turn side: the same episodes' prompts, one turn each with the same per-turn limit and the same
stop strings (the renderer's: the plain format's ``</call>``, so both sides detokenize and match
them; until 2026-12-03 the single side had none), sampled by the same engine's ``sample_ids`` in
calls of the same batch size (a fresh seed per row and call)
until they hold at least as many model tokens as the multi-turn side did (on a repeat where the
single side runs first, the previous repeat's multi-turn count: ``single_target_tokens``); no tools,
no waiting.
Prompts are cold on both sides (2026-12-03 on; ``--warm-prompts`` for the figure before): vLLM's
prefix cache is emptied before each side and before each single-turn call, outside the timing. The
single side samples the same prompts call after call to reach the token count, and with the cache
kept only its first call prefilled them (and none when the multi-turn side, with the same prompts,
had just run): a real single-turn batch prefills new prompts, as the multi-turn side's first turn
does. Within an episode, later turns still reuse the cache (the engine's real behaviour).
Both sides run back to back in each repeat, alternating which goes first, and the figure is the
median over repeats of the paired ratio of model tokens per wall second (``multiturn_vs_single_tokens_per_s``,
target >= 0.8); ``multiturn_vs_single_tokens_per_cpu_s`` is the same by this process's CPU time (the
engine runs in-process, and a sleeping tool costs none): robust to other load on the machine, blind
to waiting. ``multiturn_engine_busy_share`` is the multi-turn side's time inside ``sample_ids``
over its wall time; the rest is tool waits (``tool_gather_s`` included) and the runner's own work.
The profile keys say where a low ratio comes from: engine calls and rows per call (a call per turn
wave, smaller batches as episodes end or wait), the prompt ids each call re-reads (the whole stream
each turn: ``multiturn_prompt_tokens`` against ``single_prompt_tokens``), the seconds outside the
engine and the CPU seconds spent there (``multiturn_cpu_outside_engine_s``: the runner's rendering,
decoding and parsing, and the tool threads). The machine is shared: absolute tokens/s are context only; the paired ratio is the figure.

:func:`measure` takes a built engine (``bench/multiturn.py`` imports it); :func:`make_engine` builds
one the way ``__main__`` does. vLLM's CPU engine must start under ``if __name__ == "__main__"``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import tempfile
import time
from collections.abc import Sequence

from grpo_kit import data, models
from grpo_kit.adapters import AdapterStore
from grpo_kit.config import EpisodeConfig
from grpo_kit.episode import EpisodeRunner, turn_seed
from grpo_kit.hf_engine import HFEngine
from grpo_kit.renderers import for_engine
from grpo_kit.testing import CallEveryTurn, Notes, perturbed_adapter


class Timed:
    """An engine wrapper that times every ``sample_ids`` call and counts its rows, prompt ids and
    sampled ids (what the runner needs from an engine passes through). On an engine with continuous
    batching (``turn_batch``) the multi-turn side's entries are engine steps instead of calls: a
    step's rows are the turns in flight, its prompt ids those of the turns queued since the last step,
    its tokens those of the turns that finished in it."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.tokenizer, self.stop_ids, self.max_model_len = engine.tokenizer, engine.stop_ids, engine.max_model_len
        self.prompt_format = engine.prompt_format
        self.calls: list[dict] = []
        self.continuous = hasattr(engine, "turn_batch")
        if self.continuous:
            self.turn_batch = self._turn_batch

    def sample_ids(self, prompts, **kw):
        t0, c0 = time.perf_counter(), time.process_time()
        out = self.engine.sample_ids(prompts, **kw)
        self.calls.append({"s": time.perf_counter() - t0, "cpu_s": time.process_time() - c0, "rows": len(prompts), "prompt_tokens": sum(map(len, prompts)),
                           "tokens": sum(len(c.ids) for c in out)})
        return out

    @contextlib.contextmanager
    def _turn_batch(self, **kw):
        with self.engine.turn_batch(**kw) as batch:
            yield TimedBatch(batch, self.calls)

    def totals(self, prefix: str, wall: float, cpu: float) -> dict:
        busy, tokens = sum(c["s"] for c in self.calls), sum(c["tokens"] for c in self.calls)
        steps = any(c.get("step") for c in self.calls)
        rows = [c["rows"] for c in self.calls]
        return {f"{prefix}tokens": tokens, f"{prefix}calls": len(self.calls), f"{prefix}cpu_s": cpu,
                f"{prefix}batching": "continuous (calls are engine steps)" if steps else "calls",
                f"{prefix}tokens_per_s": tokens / wall, f"{prefix}tokens_per_cpu_s": tokens / cpu,
                f"{prefix}rows_per_call": sum(rows) / max(len(self.calls), 1), f"{prefix}rows_max": max(rows, default=0),
                f"{prefix}prompt_tokens": sum(c["prompt_tokens"] for c in self.calls),
                f"{prefix}wall_s": wall, f"{prefix}engine_s": busy, f"{prefix}engine_busy_share": busy / wall,
                f"{prefix}cpu_outside_engine_s": cpu - sum(c["cpu_s"] for c in self.calls),
                **({} if steps else {f"{prefix}call_rows": rows,
                                     f"{prefix}call_tokens_per_s": [round(c["tokens"] / c["s"]) for c in self.calls]})}


class TimedBatch:
    """A :class:`~grpo_kit.episode.TurnBatch` wrapper recording each step in ``calls`` (see :class:`Timed`)."""

    def __init__(self, batch, calls: list[dict]) -> None:
        self.batch, self.calls, self.continuous = batch, calls, batch.continuous
        self.in_flight = self.queued_prompt_tokens = 0

    @property
    def busy(self) -> bool:
        return self.batch.busy

    def add(self, key, prompt, **kw) -> None:
        self.batch.add(key, prompt, **kw)
        self.in_flight += 1
        self.queued_prompt_tokens += len(prompt)

    def step(self):
        t0, c0 = time.perf_counter(), time.process_time()
        out = self.batch.step()
        self.calls.append({"s": time.perf_counter() - t0, "cpu_s": time.process_time() - c0, "rows": self.in_flight,
                           "prompt_tokens": self.queued_prompt_tokens, "tokens": sum(len(c.ids) for _, c in out),
                           "step": True})
        self.in_flight -= len(out)
        self.queued_prompt_tokens = 0
        return out


def slow_notes(latency_s: float):
    """An environment factory: :class:`~grpo_kit.testing.Notes` whose tool takes ``latency_s`` to answer."""

    class SlowNotes(Notes):
        def note(self, text: str) -> str:
            """Write a note down (slowly).

            Args:
                text: What to note.
            """
            time.sleep(latency_s)
            return super().note(text)

    return SlowNotes


def cold(engine) -> None:
    """vLLM's prefix cache emptied (the transformers engine keeps none), outside the timing: what comes
    next prefills its prompts as new prompts are prefilled."""
    llm = getattr(engine, "llm", None)
    if llm is not None and not llm.reset_prefix_cache():
        raise RuntimeError("vLLM could not reset its prefix cache (requests in flight)")


def multi_turn(engine, problems, group_size: int, version: int, cfg: EpisodeConfig, latency_s: float,
               iteration: int, cold_prompts: bool = True) -> dict:
    timed = Timed(engine)
    runner = EpisodeRunner(timed, for_engine(engine), environment_factory=slow_notes(latency_s),
                           tool_parser=CallEveryTurn(), cfg=cfg, prompt_format=engine.prompt_format)
    if cold_prompts:
        cold(engine)
    t0, c0 = time.perf_counter(), time.process_time()
    eps = runner.run(problems, group_size, version, seed=0, iteration=iteration)
    out = timed.totals("multiturn_", time.perf_counter() - t0, time.process_time() - c0)
    assert out["multiturn_tokens"] == sum(e.sampled_tokens for e in eps)
    return {**out, "multiturn_episodes": len(eps), "multiturn_turns_mean": sum(e.turns for e in eps) / len(eps),
            "multiturn_tool_calls": sum(e.tool_calls for e in eps), "prompts": [e.prompt_ids for e in eps]}


def single_turn(engine, prompts: Sequence[Sequence[int]], version: int, turn_tokens: int, min_tokens: int,
                iteration: int, stop: Sequence[str] = (), cold_prompts: bool = True) -> dict:
    timed = Timed(engine)
    wall = cpu = 0.0
    k = 0
    while k == 0 or sum(c["tokens"] for c in timed.calls) < min_tokens:
        if cold_prompts:  # each call's prompts are new to the engine, as a real batch's are
            cold(engine)
        seeds = [turn_seed(10_000 * iteration + k, i) for i in range(len(prompts))]
        t0, c0 = time.perf_counter(), time.process_time()
        timed.sample_ids(prompts, seeds=seeds, max_new_tokens=[turn_tokens] * len(prompts), version=version, stop=stop)
        wall, cpu = wall + time.perf_counter() - t0, cpu + time.process_time() - c0
        k += 1
    return timed.totals("single_", wall, cpu)


def measure(engine, problems: Sequence[data.Problem], *, group_size: int = 4, turns: int = 3, turn_tokens: int = 48,
            tool_latency_s: float = 0.05, version: int = 0, repeats: int = 3, warmup: bool = True,
            episode_cfg: EpisodeConfig | None = None, cold_prompts: bool = True) -> dict:
    """The paired multi-turn / single-turn comparison on ``engine`` (module docstring). ``episode_cfg``
    (default: ``EpisodeConfig`` with ``turns``, ``turn_tokens`` and a budget that fits them) sets the
    runner's limits, ``tool_workers`` and ``tool_gather_s``. ``cold_prompts``: each side, and each
    single-turn call, starts from an empty prefix cache (:func:`cold`). Returns medians over ``repeats``
    (the ratio's per-repeat values in ``multiturn_vs_single_tokens_per_s_all``) and the last repeat's profile."""
    cfg = episode_cfg or EpisodeConfig(max_turns=turns, max_turn_tokens=turn_tokens,
                                       max_episode_tokens=min(turns * (turn_tokens + 16), engine.max_model_len // 2))
    stop = for_engine(engine).stop  # the turns' stop strings: the single side samples with them too
    if warmup:  # first calls load the adapter and touch every kernel
        mt = multi_turn(engine, problems[:2], 2, version, cfg, tool_latency_s, iteration=10_000)
        single_turn(engine, mt["prompts"], version, cfg.max_turn_tokens, 1, iteration=10_000, stop=stop)
    reps: list[dict] = []
    for rep in range(repeats):
        mt = st = None
        for side in ("multi", "single") if rep % 2 == 0 else ("single", "multi"):
            if side == "multi":
                mt = multi_turn(engine, problems, group_size, version, cfg, tool_latency_s, iteration=rep,
                                cold_prompts=cold_prompts)
            else:  # the episodes' prompts and token count (the previous repeat's when single goes first:
                ref = mt or reps[-1]  # the ratio is of tokens per second, so the sizes need not match exactly)
                st = single_turn(engine, ref["prompts"], version, cfg.max_turn_tokens, ref["multiturn_tokens"],
                                 iteration=rep, stop=stop, cold_prompts=cold_prompts)
                st["single_target_tokens"] = ref["multiturn_tokens"]
        reps.append({**mt, **st,
                     "multiturn_vs_single_tokens_per_s": mt["multiturn_tokens_per_s"] / st["single_tokens_per_s"],
                     "multiturn_vs_single_tokens_per_cpu_s": mt["multiturn_tokens_per_cpu_s"] / st["single_tokens_per_cpu_s"]})
    last = {k: v for k, v in reps[-1].items() if k != "prompts"}
    med = {k: statistics.median(r[k] for r in reps) for k in
           ("multiturn_vs_single_tokens_per_s", "multiturn_vs_single_tokens_per_cpu_s", "multiturn_tokens_per_s",
            "single_tokens_per_s", "multiturn_engine_busy_share")}
    return {**last, **med, "multiturn_vs_single_tokens_per_s_all": [r["multiturn_vs_single_tokens_per_s"] for r in reps],
            "repeats": repeats, "episodes_per_chunk": len(problems) * group_size, "max_turns": cfg.max_turns,
            "turn_tokens": cfg.max_turn_tokens, "tool_latency_s": tool_latency_s, "tool_workers": cfg.tool_workers,
            "tool_gather_s": cfg.tool_gather_s, "version": version, "cold_prompts": cold_prompts}


def make_engine(name: str, path: str, store, max_model_len: int = 512, block_size: int | None = None):
    """``"vllm"`` (a VLLMEngine, the kit's default ``lora_mode``; ``block_size``: vLLM's KV-cache block
    in tokens, None for the engine's, KV_BLOCK_TOKENS) or ``"hf"`` on ``path``."""
    if name == "hf":
        return HFEngine(path, store=store, max_model_len=max_model_len)
    from grpo_kit.vllm_engine import VLLMEngine

    return VLLMEngine(path, store=store, max_lora_rank=8, max_model_len=max_model_len,
                      **({"block_size": block_size} if block_size else {}))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--engines", nargs="+", default=["vllm"], choices=["vllm", "hf"])
    ap.add_argument("--model", default="tiny", help="tiny, smollm2-135m or a checkpoint directory")
    ap.add_argument("--problems", type=int, default=8)
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--turn-tokens", type=int, default=48)
    ap.add_argument("--tool-latency-ms", type=float, default=50.0)
    ap.add_argument("--tool-workers", type=int, default=None, help="the runner's tool threads (default: EpisodeConfig's)")
    ap.add_argument("--tool-gather-ms", type=float, default=None, help="the runner's tool_gather_s in ms (default: EpisodeConfig's)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--warm-prompts", action="store_true",
                    help="keep vLLM's prefix cache between sides and calls (the figure until 2026-12-03: the single "
                         "side's repeated prompts were then served from it, prefilled once for all its calls)")
    ap.add_argument("--version", type=int, default=1, help="1: a perturbed adapter; 0: the base model")
    ap.add_argument("--block-size", type=int, default=None,
                    help="vLLM's KV-cache block in tokens (default: the engine's; vLLM's CPU default is 128, and "
                         "prefix caching reuses whole blocks only)")
    args = ap.parse_args(argv)

    path = models.resolve_model(args.model)
    store = AdapterStore(tempfile.mkdtemp(prefix="bench-multiturn-"))
    store.publish(perturbed_adapter(path, seed=1), 1)
    problems = data.synthetic_problems(args.problems, split="train", seed=0, n_digits=3 if args.model == "tiny" else 2)
    cfg = EpisodeConfig(max_turns=args.turns, max_turn_tokens=args.turn_tokens,
                        max_episode_tokens=args.turns * (args.turn_tokens + 16),
                        **({"tool_workers": args.tool_workers} if args.tool_workers else {}),
                        **({"tool_gather_s": args.tool_gather_ms / 1000} if args.tool_gather_ms is not None else {}))
    result = {"model": args.model, "block_size": args.block_size}
    for name in args.engines:
        engine = make_engine(name, path, store, block_size=args.block_size)
        r = measure(engine, problems, group_size=args.group_size, tool_latency_s=args.tool_latency_ms / 1000,
                    version=args.version, repeats=args.repeats, episode_cfg=cfg, cold_prompts=not args.warm_prompts)
        engine.close()
        print(f"{name}: multi-turn {r['multiturn_tokens_per_s']:.0f} tok/s ({r['multiturn_tokens']} model tokens, "
              f"{r['multiturn_episodes']} episodes, {r['multiturn_turns_mean']:.2f} turns, {r['multiturn_calls']} "
              f"{'engine steps' if r['multiturn_batching'].startswith('continuous') else 'calls'} of "
              f"{r['multiturn_rows_per_call']:.1f} rows, {r['multiturn_prompt_tokens']} prompt ids read), single-turn "
              f"{r['single_tokens_per_s']:.0f} tok/s ({r['single_tokens']} tokens, {r['single_calls']} calls, "
              f"{r['single_prompt_tokens']} prompt ids); ratio {r['multiturn_vs_single_tokens_per_s']:.3f} "
              f"(all {', '.join(f'{x:.3f}' for x in r['multiturn_vs_single_tokens_per_s_all'])}), engine busy "
              f"{r['multiturn_engine_busy_share']:.0%} of the multi-turn wall time; by this process's CPU time "
              f"{r['multiturn_vs_single_tokens_per_cpu_s']:.3f}", flush=True)
        result.update(r if name == args.engines[0] else {})
        result.update({f"{name}_{k}": v for k, v in r.items()})
    print(json.dumps(result))


if __name__ == "__main__":
    main()
