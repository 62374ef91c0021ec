"""Multi-turn episodes, measured: does GRPO teach a model to use a tool?

    python bench/multiturn.py [--parts tiny,smol,throughput] [--budget-s S] [--run-dir DIR] [name=value ...]

Parts (``--parts``, comma-separated; each returns a dict of figures and :func:`main` merges them):

- ``tiny``: builds the ``tiny-tools`` model (:data:`grpo_kit.tiny.TOOLS_SPEC`, pretrained on
  calculator episodes that call the ``multiply`` tool only ``tool_rate`` of the time and otherwise
  guess), measures the base model on the held-out questions (greedy episodes: accuracy and the share
  that call the tool; sampled episodes: tool-call rate and how often a call ends in the right
  answer), runs GRPO with the ``tiny-tools`` profile on a LocalCluster (``loop.run``, stopped at the
  first iteration past ``--budget-s`` of GRPO wall time), and reports the run's own greedy
  evaluations of the base and final adapters (``remote.eval_task`` on the episodes). Overrides such
  as ``lr=2e-3`` go to the profile.

- ``smol``: SmolLM2-135M-Instruct on the calculator task (2-digit factors, Hermes tool calls, two
  worked call examples before each question): greedy strict accuracy and sampled tool-call rate of
  the base model, and GRPO where it calls the tool often enough to give a signal (``smol_skipped``
  otherwise), within ``--smol-budget-s`` (30 min) of GRPO wall time.
- ``throughput``: multi-turn against single-turn model tokens/s on one vLLM engine
  (``bench/multiturn_throughput.py``): ``multiturn_vs_single_tokens_per_s``, ``multiturn_engine_busy_share``.

Ends with ONE JSON line: the merged figures (``tiny_acc_before``, ``tiny_acc_after``,
``tiny_tool_rate_before``, ``tiny_tool_rate_after``, ``tiny_grpo_wall_s``, ...), all measured in
this run except ``tiny_pretrain_recorded_s``: the tiny-tools model's pretraining time as its build
record holds it (the shipped build's, timed where it was built).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from collections.abc import Callable

from grpo_kit import config, loop, tasks

sys.path.insert(0, str(__import__('pathlib').Path(__file__).resolve().parent))  # the other benches' modules


def play(model_path: str, cfg, n: int, *, temperature: float, samples: int = 1, seed: int = 0) -> dict:
    """The task's held-out episodes played in this process with the HF engine (the base model):
    accuracy (strict, the task's first reward), tool-call rate, and the accuracy of the episodes that
    called the tool (how reliably the model copies the tool's answer)."""
    from grpo_kit.episode import EpisodePlan, to_rollout
    from grpo_kit.hf_engine import HFEngine
    from grpo_kit.prompts import prompt_format
    from grpo_kit.renderers import for_engine

    task = tasks.for_config(cfg)
    probs = task.load("heldout", n, 0)
    engine = HFEngine(model_path, max_model_len=cfg.model.max_model_len, device="cpu",
                      prompt_format=prompt_format(cfg, task.instruction))
    eps = EpisodePlan.of(task, cfg).runner(engine, for_engine(engine), temperature).run(probs, samples, seed=seed)
    scores = task.scorer().score_problems([probs[e.group_id] for e in eps], [to_rollout(e).text for e in eps])
    called = [s.correct for e, s in zip(eps, scores, strict=True) if e.tool_calls > 0]
    return {"acc": sum(s.correct for s in scores) / len(eps), "tool_rate": len(called) / len(eps),
            "acc_when_called": sum(called) / len(called) if called else None, "n": len(eps),
            "end_reasons": dict(sorted({r: sum(e.end_reason == r for e in eps) for r in {e.end_reason for e in eps}}.items()))}


class BudgetSpent(Exception):
    def __init__(self, iteration: int):
        super().__init__(f"budget spent after iteration {iteration}")
        self.iteration = iteration


def train(cfg, budget_s: float) -> tuple:
    """GRPO with ``cfg`` on a LocalCluster, stopped at the first iteration past ``budget_s`` of GRPO
    wall time (then resumed for one last evaluation of the final adapter): the run's result, every
    evaluation it made, and the learning curve (printed as it goes)."""
    curve, evals = [], []

    def collect(rec: dict) -> None:
        for e in rec.get("evals", []):
            evals.append(e)
            curve.append({"iteration": rec["iteration"], "wall_s": round(rec["grpo_wall_s"], 1), "version": e["version"],
                          "acc": e["acc"], "tool_rate": e.get("tool_rate")})
            print(f"  iteration {rec['iteration']:3d}  wall {rec['grpo_wall_s']:6.0f} s  v{e['version']}  held-out acc "
                  f"{e['acc']:.3f}  tool rate {e.get('tool_rate', 0):.3f}", flush=True)

    def budget(rec: dict) -> None:
        if rec["grpo_wall_s"] > budget_s:
            raise BudgetSpent(rec["iteration"])

    shutil.rmtree(cfg.run.run_dir, ignore_errors=True)
    try:
        res = loop.run(cfg, callbacks=[collect, budget], progress=False)
    except BudgetSpent as stop:  # ends at an iteration boundary; resume evaluates the last adapter
        print(f"budget of {budget_s:.0f} s spent after iteration {stop.iteration}; final evaluation", flush=True)
        res = loop.run(cfg.override(iterations=stop.iteration + 1), resume=True, progress=False, callbacks=[collect])
    seen = {(e["version"], e["start"]) for e in evals}  # the final evaluation is attached after the last callback
    evals += [e for r in res.records for e in r.get("evals", []) if (e["version"], e["start"]) not in seen]
    return res, evals, curve


def tiny_part(args) -> dict:
    """The tiny tool model before and after GRPO (module docstring)."""
    from grpo_kit import models, tiny

    cfg = config.profile("tiny-tools", run_dir=f"{args.run_dir}/tiny", **config.parse_overrides(args.overrides))
    t0 = time.time()
    path = models.resolve_model(cfg.model.model, progress=False)
    info = tiny.tiny_info(path)
    build_s = time.time() - t0
    print(f"tiny-tools at {path}: pretraining {info['pretrain_s']:.0f} s (this call {build_s:.0f} s)", flush=True)
    greedy = play(path, cfg, cfg.data.eval_size, temperature=0.0)
    sampled = play(path, cfg, args.sampled_problems, temperature=cfg.sampling.temperature,
                   samples=cfg.sampling.group_size, seed=1)
    print(f"base, here: greedy {greedy}\n            sampled {sampled}", flush=True)

    res, evals, curve = train(cfg, args.budget_s)
    base = next(e for e in evals if e["version"] == 0)
    final = max(evals, key=lambda e: e["version"])
    return {
        "tiny_acc_before": base["acc"], "tiny_acc_after": final["acc"],
        "tiny_tool_rate_before": base["tool_rate"], "tiny_tool_rate_after": final["tool_rate"],
        "tiny_grpo_wall_s": res.summary["grpo_wall_s"], "tiny_iterations": res.summary["iterations"],
        "tiny_final_version": final["version"], "tiny_eval_size": base["n"],
        "tiny_sampled_tool_rate_before": sampled["tool_rate"], "tiny_sampled_acc_before": sampled["acc"],
        "tiny_acc_when_called_before": sampled["acc_when_called"], "tiny_greedy_acc_before_here": greedy["acc"],
        "tiny_pretrain_recorded_s": info["pretrain_s"], "tiny_engine": cfg.sampling.engine, "tiny_lr": cfg.optim.lr,
        "tiny_group_size": cfg.sampling.group_size, "tiny_prompts_per_step": cfg.sampling.prompts_per_step,
        "tiny_curve": curve,
    }


SMOL_MIN_TOOL_RATE = 0.05
"""The sampled tool-call rate below which the smol part does not train: with fewer of a group's
episodes calling the tool, GRPO has almost no group with a right answer to reinforce."""
SMOL_DEMOS = "tool,tool"
"""The calculator's worked examples before each smol question (``calculator.demo_messages``): without
them SmolLM2-135M-Instruct never called the tool (0 of 32 sampled episodes); with two call examples
it calls it, but often by a wrong name (``add``, ``divide``), which GRPO can correct."""


def smol_part(args) -> dict:
    """SmolLM2-135M-Instruct on the calculator task (the smol profile's model and chat template, the
    Hermes tool-call format in a system message, since its template ignores ``tools=``; two worked
    call examples before each question, :data:`SMOL_DEMOS`; the final answer's strict ``####`` only,
    no format bonus or lenient credit): greedy strict accuracy and the sampled tool-call rate of the
    base model here; GRPO where the base model calls the tool at least :data:`SMOL_MIN_TOOL_RATE` of
    the time (``smol_skipped`` says why not), stopped past ``--smol-budget-s``, with the run's own
    greedy evaluations of the base and final adapters as before and after."""
    from grpo_kit import models

    over = {"task": "calculator", "n_digits": 2, "max_turns": 2, "max_turn_tokens": 64, "max_episode_tokens": 160,
            "max_model_len": 512, "system_prompt": None, "stop": (), "run_dir": f"{args.run_dir}/smol",
            "task_options": {"demos": SMOL_DEMOS}, "format_bonus": 0.0, "lenient_credit": 0.0, "eval_size": 64,
            **config.parse_overrides(args.overrides)}
    cfg = config.profile("smol", **over)
    path = models.resolve_model(cfg.model.model, progress=False)
    greedy = play(path, cfg, args.smol_problems, temperature=0.0)
    sampled = play(path, cfg, args.smol_problems, temperature=cfg.sampling.temperature, samples=4, seed=1)
    print(f"smol base: greedy {greedy}\n           sampled {sampled}", flush=True)
    out = {"smol_greedy_acc_before_here": greedy["acc"], "smol_tool_rate_before_here": greedy["tool_rate"],
           "smol_sampled_tool_rate_before": sampled["tool_rate"], "smol_sampled_acc_before": sampled["acc"],
           "smol_acc_when_called_before": sampled["acc_when_called"], "smol_demos": cfg.data.task_options.get("demos"),
           "smol_strict_before": greedy["acc"], "smol_strict_after": None, "smol_grpo_wall_s": None}
    if sampled["tool_rate"] < SMOL_MIN_TOOL_RATE:
        out["smol_skipped"] = (f"the base model called the tool in {sampled['tool_rate']:.0%} of {sampled['n']} sampled "
                               f"episodes (< {SMOL_MIN_TOOL_RATE:.0%}): no signal to train on")
        return out
    res, evals, curve = train(cfg.override(iterations=args.smol_iterations), args.smol_budget_s)
    base = next(e for e in evals if e["version"] == 0)
    final = max(evals, key=lambda e: e["version"])
    out.update(smol_strict_before=base["acc"], smol_strict_after=final["acc"], smol_tool_rate_before=base.get("tool_rate"),
               smol_tool_rate_after=final.get("tool_rate"), smol_grpo_wall_s=res.summary["grpo_wall_s"],
               smol_iterations=res.summary["iterations"], smol_final_version=final["version"], smol_eval_size=base["n"],
               smol_engine=cfg.sampling.engine, smol_curve=curve)
    return out


def throughput_part(args) -> dict:
    """Model tokens/s of multi-turn episodes against single-turn sampling on one vLLM engine (the
    tiny model, a 50 ms tool): ``bench/multiturn_throughput.py``'s ``measure``, with its keys."""
    import tempfile

    import multiturn_throughput as mt

    from grpo_kit import data, models
    from grpo_kit.adapters import AdapterStore
    from grpo_kit.config import EpisodeConfig
    from grpo_kit.testing import perturbed_adapter

    path = models.resolve_model("tiny")
    store = AdapterStore(tempfile.mkdtemp(prefix="bench-multiturn-"))
    store.publish(perturbed_adapter(path, seed=1), 1)
    problems = data.synthetic_problems(8, split="train", seed=0)
    engine = mt.make_engine("vllm", path, store)
    try:
        return mt.measure(engine, problems, group_size=4, tool_latency_s=0.05, version=1, repeats=5,
                          episode_cfg=EpisodeConfig(max_turns=3, max_turn_tokens=48, max_episode_tokens=3 * 64))
    finally:
        engine.close()


PARTS: dict[str, Callable] = {"tiny": tiny_part, "smol": smol_part, "throughput": throughput_part}
"""Each part's figures (keys prefixed with the part's name); more parts plug in here."""


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default="tiny,smol,throughput", help=f"comma-separated parts to run, of {sorted(PARTS)}")
    ap.add_argument("--budget-s", type=float, default=600.0, help="stop a GRPO run after this much wall time")
    ap.add_argument("--run-dir", default="runs/multiturn")
    ap.add_argument("--sampled-problems", type=int, default=32, help="held-out questions of the sampled base measurement")
    ap.add_argument("--smol-problems", type=int, default=16, help="held-out questions of the smol part's base measurement")
    ap.add_argument("--smol-iterations", type=int, default=40, help="GRPO iterations of the smol part (when it trains)")
    ap.add_argument("--smol-budget-s", type=float, default=1800.0, help="stop the smol part's GRPO after this much wall time")
    ap.add_argument("overrides", nargs="*", help="profile overrides, name=value (the tiny and smol parts)")
    args = ap.parse_args(argv)
    names = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = sorted(set(names) - set(PARTS))
    if unknown:
        ap.error(f"unknown parts {unknown}; known: {sorted(PARTS)}")
    out: dict = {}
    t0 = time.time()
    for name in names:
        out.update(PARTS[name](args))
    out["total_s"] = time.time() - t0
    print(json.dumps(out), flush=True)
    return out


if __name__ == "__main__":  # engines start here (vLLM CPU), never at import
    sys.exit(0 if main() else 1)
