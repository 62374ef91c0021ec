"""grpo-kit against TRL's ``GRPOTrainer``: training wall time to a held-out accuracy target.

    python bench/vs_trl.py [--profile tiny|smol] [--repeats 3] [--steps N] [--prompts-per-step 8]
                           [--eval-every K] [--quick] [--lr ...] [--sides kit,dynamic,trl,trl_vllm]

Every side trains LoRA on the profile's base model (``tiny``: the kit's own ``grpo_kit.tiny``;
``smol``: the real pretrained SmolLM2-135M-Instruct, prompted through its ChatML chat template), on
CPU in fp32, one after the other in this process: the same training prompts in the same order (the
kit's own per-iteration draw), the same reward (the profile's task scorer: for ``smol`` 1 for the
right value after ``####``, 0.5 for the right value without it, 0.1 for the bare ``####`` form),
group size, batch, LoRA shape, learning rate, KL coefficient, clip epsilon, completion budget and
temperature 1.0, all taken from the profile unless a flag overrides them. The kit runs with its
defaults (vLLM engine, pipelined, the profile's stop strings).

TRL's side is TRL as a user gets it: conversational prompts rendered by its own chat-template code
(checked to give the kit's prompt token ids), generation until EOS or the completion budget (its
transformers path does not pass ``generate`` the tokenizer that ``stop_strings`` need; the reward
function reads the text up to the first of the profile's stop strings, so both sides are scored by
the same function of what was sampled).

``TRL vLLM`` is the same TRL run (same ``GRPOConfig``, prompts, reward, callback and clock) with
``use_vllm=True, vllm_mode="colocate"``: a vLLM engine in the training process samples, TRL pushes
the merged LoRA weights into it before each generation and corrects the sampler/trainer mismatch with
its importance weight (``vllm_importance_sampling_correction``, on by default). What had to be set
for CPU: ``vllm_max_model_length`` (the kit's ``max_model_len``) and ``VLLM_CPU_KVCACHE_SPACE``
(GiB; :data:`TRL_VLLM_KV_CACHE_GIB` unless already set, and only while the engine is built, since it
overrides the KV-cache size of any vLLM-CPU engine built with it; without it vLLM-CPU sizes its KV
cache from the NUMA node's memory minus what this process holds). TRL passes vLLM no dtype, so vLLM's
``dtype="auto"`` samples from a bfloat16 copy of the fp32 checkpoint; that is left as users get it
(the importance weight absorbs it) and recorded (``trl_vllm_sampling_dtype``). The engine runs in
this process with this process's torch threads: its CPU worker replaces ``torch.set_num_threads``
with a no-op (put back after the run) and changes no thread count; the count at the start of
training is recorded (``trl_torch_threads``, ``trl_vllm_torch_threads``). vLLM 0.32 is newer than
the range TRL 1.16 is tested with. ``--sides`` picks the runs (default all four; ``--no-dynamic``
and ``--only`` still work); a failing TRL vLLM run is reported, not fatal.

Every side is evaluated greedily on the same held-out problems after the same optimizer steps (every
``--eval-every`` steps and at the end), by the same evaluator: the kit's ``HFEngine`` (transformers,
fp32 argmax) on the adapter of that step. Clocks measure training wall time up to a checkpoint, with
start-up (model loads, engine builds) and evaluation off every clock:

- kit: ``t_iter_end`` of the iteration that produced the evaluated adapter version, minus the first
  iteration's ``t_iter_start`` (the loop builds engines and policies before that). The adapters are
  evaluated from the kit's store after its run. ``--live-eval`` instead evaluates inside the loop,
  as the kit does by default (non-blocking Dask tasks that share the rollout worker, so on one
  rollout worker their time is on the kit's clock).
- TRL (both TRL sides): time since ``on_train_begin`` at the ``on_step_end`` of that step, minus the
  time spent in this bench's evaluation callback (the adapter saved at that step, evaluated in the
  process). ``GRPOTrainer`` builds its colocated vLLM engine (model load, KV cache, torch.compile
  warm-up: 40-65 s on 2 cores) in its constructor, before ``on_train_begin``: like the kit's engine
  build and warm-up it is off the clock and reported as start-up (``trl_vllm_startup_s``, of which
  ``trl_vllm_trainer_build_s`` is the constructor). Per-step costs after it (weight pushes, any
  compilation for new shapes) are on the clock, as the kit's are.

A third run, ``grpo-kit dynamic``, is the kit with dynamic sampling (``dynamic_sampling=True``:
zero-spread groups dropped, extra generation rounds and carried-over groups keep the trainer fed with
usable groups, up to ``--max-gen-batches`` rounds per step; its extra prompts come from the same
training pool, drawn by the driver); ``--no-dynamic`` leaves it out. The TRL sides are unchanged; their
``frac_reward_zero_std`` (the share of groups without reward spread) is logged beside the kit's usable
share (the share of its generated completions in groups with spread).

Cost per usable sample (device-seconds per completion in a group with reward spread, the mean over
steps that had one, each step's figure from ``grpo_kit.sampling.usable_cost``): the kit's
``kit_usable_cost_s`` is its records' ``usable_cost_s``, ``(gen_device_s + train_device_s) /
usable_samples`` summed over its rollout and trainer workers; a TRL side's (``trl_usable_cost_s``,
``trl_vllm_usable_cost_s``) is the step's seconds on its clock (its one process holds the device for
the whole step; TRL's logged ``step_time`` leaves out the optimizer step and logging) over
``completions per step x (1 - frac_reward_zero_std)`` of that step.

The target is the smallest final accuracy of the runs minus 2 points; each side's time to target is
the clock at its first checkpoint (after step 0) that reaches it. ``time_ratio`` is kit / TRL and
``time_ratio_vs_trl_vllm`` kit / TRL vLLM (null, with ``time_ratio_vs_trl_vllm_reason``, where a side
did not run or did not reach the target). Timings on a shared 2-core VM vary by 10-30% from run to
run, so the runs repeat ``--repeats`` times (default 3), alternating which side goes first, and the
headline figures are medians (each repeat's table is printed too; the usable costs are the last
repeat's, as ``kit_usable_cost_s`` always was, with every repeat's in ``*_usable_cost_s_all``).
Prints each setting that could not be matched exactly, the tables, and as its last line a JSON object.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import shutil
import sys
import time
import traceback
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from grpo_kit import config, data, loop, tasks

TARGET_MARGIN = 0.02
"""The target is min(final accuracies) minus this."""
QUICK = {"steps": 4, "prompts_per_step": 4, "eval_every": 2, "eval_size": 32, "repeats": 1}
"""What ``--quick`` sets (a smoke run of a few minutes)."""
PROFILES = ("tiny", "smol")
"""The profiles the bench runs on: the kit's tiny model, and the real pretrained chat model."""
PROMPTS_PER_STEP = {"tiny": 8}
"""Bench defaults that differ from the profile: half the tiny profile's 16 prompts per step keeps the
tiny bench within ~15 minutes on 2 cores."""
SIDES = {"kit": "grpo-kit", "dynamic": "grpo-kit dynamic", "trl": "TRL", "trl_vllm": "TRL vLLM"}
"""The runs ``--sides`` can name, in the order they run (reversed on alternate repeats), and their titles."""
KEY_PREFIX = {"grpo-kit": "kit", "grpo-kit dynamic": "kit_dynamic", "TRL": "trl", "TRL vLLM": "trl_vllm"}
"""Each run's prefix of its keys in the JSON line (``kit_time_to_target_s``, ``trl_vllm_usable_cost_s``)."""
TRL_VLLM_KV_CACHE_GIB = 1
"""``VLLM_CPU_KVCACHE_SPACE`` for TRL's colocated engine (GiB) unless the environment sets it: TRL has no
``kv_cache_memory_bytes``. 1 GiB holds ~180 full 256-token sequences of SmolLM2-135M in bfloat16 (30 layers x 3
KV heads x 64), more than either profile's batch (48 or 32 completions)."""


@dataclass
class SideResult:
    """One trainer's run, as the comparison needs it."""

    name: str
    checkpoints: list[tuple[int, float, float]] = field(default_factory=list)
    """(optimizer steps, training wall seconds when that policy existed, held-out accuracy); step 0 = base."""
    completions: int = 0
    """Completions sampled for training."""
    train_wall_s: float = 0.0
    """Training wall time of the whole run (evaluation excluded for TRL, as on its checkpoints)."""
    extra: dict = field(default_factory=dict)

    @property
    def final_acc(self) -> float | None:
        return self.checkpoints[-1][2] if self.checkpoints else None

    @property
    def completions_per_s(self) -> float | None:
        return self.completions / self.train_wall_s if self.train_wall_s > 0 else None

    @property
    def prefix(self) -> str:
        """Its keys' prefix in the JSON line."""
        return KEY_PREFIX[self.name]


# ----------------------------------------------------------------------------- settings


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--profile", choices=PROFILES, default="tiny")
    name = pre.parse_known_args(argv)[0].profile
    prof = config.profile(name)  # every default below is the chosen profile's
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--profile", choices=PROFILES, default="tiny",
                    help="tiny: the kit's own model; smol: SmolLM2-135M-Instruct with its chat template")
    ap.add_argument("--steps", type=int, default=prof.run.iterations, help="optimizer steps (kit iterations) for both")
    ap.add_argument("--prompts-per-step", type=int, default=PROMPTS_PER_STEP.get(name, prof.sampling.prompts_per_step),
                    help="prompts (groups) per step")
    ap.add_argument("--group-size", type=int, default=prof.sampling.group_size, help="completions per prompt")
    ap.add_argument(
        "--eval-every", type=int, default=prof.run.eval_every, help="evaluate every k steps (and after the last)"
    )
    ap.add_argument("--eval-size", type=int, default=prof.data.eval_size, help="held-out problems")
    ap.add_argument("--max-new-tokens", type=int, default=prof.sampling.max_new_tokens)
    ap.add_argument("--lr", type=float, default=prof.optim.lr)
    ap.add_argument("--kl-beta", type=float, default=prof.loss.kl_beta)
    ap.add_argument("--clip-eps", type=float, default=prof.loss.clip_eps)
    ap.add_argument("--lora-r", type=int, default=prof.lora.lora_r)
    ap.add_argument("--lora-alpha", type=int, default=prof.lora.lora_alpha)
    ap.add_argument("--seed", type=int, default=prof.run.seed)
    ap.add_argument("--out", default="runs/bench-vs-trl" + ("" if name == "tiny" else f"-{name}"),
                    help="run directory (kit/, trl/ and trl-vllm/ under it; replaced)")
    ap.add_argument("--sides", default=",".join(SIDES),
                    help=f"comma-separated runs among {', '.join(SIDES)} (default: all; a ratio needs kit and its peer)")
    ap.add_argument("--only", choices=tuple(SIDES), help="run one side only (debugging; the same as --sides X)")
    ap.add_argument(
        "--quick", action="store_true", help="smoke run: " + ", ".join(f"{k}={v}" for k, v in QUICK.items())
    )
    ap.add_argument("--no-progress", action="store_true", help="no progress bars")
    ap.add_argument("--engine", choices=("vllm", "hf"), default=prof.sampling.engine,
                    help="the kit's rollout engine (default: the kit's default, vllm)")
    ap.add_argument("--lora-mode", choices=("auto", "request", "merged"), default=prof.sampling.lora_mode,
                    help="the kit's vLLM LoRA mode (default: the kit's default, auto)")
    ap.add_argument("--repeats", type=int, default=3,
                    help="run both sides this many times, alternating which goes first; headline figures are medians")
    ap.add_argument("--live-eval", action="store_true",
                    help="the kit evaluates inside its loop, on its rollout worker and on its clock")
    ap.add_argument("--no-dynamic", action="store_true", help="leave out the kit run with dynamic sampling")
    ap.add_argument("--set", nargs="*", default=[], metavar="FIELD=VALUE",
                    help="config overrides after the profile and the options above (a Python literal, or a bare "
                         "string), e.g. packing=False; both sides read their hyperparameters from that config")
    ap.add_argument("--max-gen-batches", type=int, default=prof.sampling.max_gen_batches,
                    help="the dynamic run's generation rounds per step at most")
    args = ap.parse_args(argv)
    if args.quick:
        for k, v in QUICK.items():
            setattr(args, k, v)
    sides = [x.strip() for x in args.sides.split(",") if x.strip()]
    unknown = [x for x in sides if x not in SIDES]
    if unknown or not sides:
        ap.error(f"--sides takes a comma-separated list among {', '.join(SIDES)}; got {args.sides!r}")
    if args.only:
        sides = [args.only]
    args.sides = tuple(x for x in SIDES if x in sides and not (x == "dynamic" and args.no_dynamic))
    if args.steps < 1 or args.eval_every < 1 or args.repeats < 1:
        ap.error("--steps, --eval-every and --repeats must be >= 1")
    return args


def kit_config(args: argparse.Namespace) -> config.Config:
    """The profile with the bench's overrides; both sides read their hyperparameters from it."""
    return config.profile(
        args.profile,
        iterations=args.steps,
        prompts_per_step=args.prompts_per_step,
        group_size=args.group_size,
        eval_every=args.eval_every,
        eval_size=args.eval_size,
        max_new_tokens=args.max_new_tokens,
        lr=args.lr,
        kl_beta=args.kl_beta,
        clip_eps=args.clip_eps,
        lora_r=args.lora_r,
        lora_alpha=args.lora_alpha,
        seed=args.seed,
        engine=args.engine,
        lora_mode=args.lora_mode,
        run_dir=str(Path(args.out) / "kit"),
        keep_versions=0,  # every checkpoint is evaluated from the store after the run: retention off
    ).override(**config.parse_overrides(getattr(args, "set", None) or []))


def dynamic_config(cfg: config.Config, max_gen_batches: int) -> config.Config:
    """The kit's config with dynamic sampling on, in its own run directory."""
    return cfg.override(dynamic_sampling=True, max_gen_batches=max_gen_batches,
                        run_dir=str(Path(cfg.run.run_dir).with_name("kit-dynamic")))


def training_prompts(cfg: config.Config) -> list[list[data.Problem]]:
    """The problems of each kit iteration, drawn by the driver's own code (so TRL sees the same order)."""
    pool = tasks.for_config(cfg).load("train", cfg.data.train_size, cfg.run.seed)  # as loop.run loads it
    return [loop.iteration_problems(cfg, pool, it) for it in range(cfg.run.iterations)]


def heldout_problems(cfg: config.Config) -> list[data.Problem]:
    """The held-out set exactly as ``loop.run`` builds it."""
    d = cfg.data
    return tasks.for_config(cfg).load("heldout", d.eval_size, 0)


def checkpoint_steps(cfg: config.Config) -> list[int]:
    """The optimizer steps both sides are evaluated after: 0, every ``eval_every``, and the last."""
    every, total = cfg.run.eval_every, cfg.run.iterations
    return sorted({0, *range(every, total + 1, every), total})


def prompt_fmt(cfg: config.Config):
    """The run's prompt format (chat template, system prompt, the task's instruction), as the loop's."""
    from grpo_kit.prompts import prompt_format

    return prompt_format(cfg, tasks.for_config(cfg).instruction)


def hf_evaluator(cfg: config.Config, store):
    """The evaluator of both sides: the kit's transformers engine on ``store``'s adapters, with the
    run's prompt format and stop strings."""
    from grpo_kit.hf_engine import HFEngine
    from grpo_kit.models import resolve_model

    return HFEngine(resolve_model(cfg.model.model), store=store, **HFEngine.options(cfg, prompt_fmt(cfg)))


def differences(cfg: config.Config, threads: int, live_eval: bool = False, trl_vllm: bool = True) -> list[str]:
    """Settings that differ between the runs (for the README, next to the result); ``trl_vllm``: with the
    TRL vLLM side's."""
    s, mb = cfg.sampling, cfg.optim.micro_batch
    if s.engine == "vllm":
        import torch

        from grpo_kit.vllm_engine import resolve_lora_mode

        mode = resolve_lora_mode(s.lora_mode, on_cpu=not torch.cuda.is_available())
        kit_engine = f"vLLM (lora_mode={mode}" + (": adapter merged into the weights)" if mode == "merged" else ")")
    else:
        kit_engine = "transformers generate (HFEngine)"
    return [
        f"generation: kit samples with {kit_engine} on its own Dask rollout worker; TRL samples with "
        "transformers generate inside the training process (use_vllm=False, TRL's default)"
        + ("; TRL vLLM with a vLLM engine colocated in the training process (use_vllm=True, vllm_mode='colocate'; "
           "vLLM's server mode, a separate process, was not tried)" if trl_vllm else ""),
        f"policy lag: kit pipelined (max_staleness={cfg.run.max_staleness}): batch N is sampled by adapter N-1 while "
        "step N-1 trains, and the clipped ratio is taken against the sampling log-probs; TRL is on-policy "
        "(generate then train, num_iterations=1, steps_per_generation=1, so its ratio is exactly 1)",
        "sampling randomness: same prompts in the same order, but each side draws completions from its own "
        "seeded generator, so the completions (and rewards) differ",
        (
            f"evaluation: kit decodes greedily with its {kit_engine} engine as non-blocking Dask tasks that share the "
            "rollout worker with generation (on its clock); TRL's checkpoints are decoded with the kit's HFEngine in "
            "the training process, off its clock"
            if live_eval
            else "evaluation: the same evaluator for both (the kit's HFEngine, transformers, fp32 argmax, same "
            "'correct' rule) on the adapter of each checkpoint step, off both clocks: TRL's in a callback whose time "
            "is subtracted, the kit's from its adapter store after its run (the kit's loop ran with eval_every=0)"
        ),
        "clock start: kit at the first iteration's start (the loop builds its engines and trainer policies and "
        "samples once from the base model before it; the cluster start is before it too); TRL at on_train_begin "
        "(model load, LoRA wrap and trainer construction happen before it); both start-ups are reported. Not "
        "symmetric: the kit's one warm-up sample takes its engine's first-call set-up off its clock, while TRL's "
        "first generate and backward pay theirs on its clock (each TRL repeat reuses one process, so only its "
        "first repeat pays the process's); on runs of a few seconds this favours the kit",
        f"processes and threads: kit uses {cfg.cluster.n_rollout_workers} rollout + {cfg.cluster.world_size} trainer "
        f"Dask worker(s) with {cfg.cluster.threads_per_worker} torch thread(s) each (the {cfg.profile} profile's); TRL runs in one "
        f"process with {threads} torch thread(s)"
        + (", TRL vLLM too, its engine sampling in that process with those threads (each TRL side's count at "
           "the start of training is recorded)" if trl_vllm else ""),
        f"batching: one optimizer step per batch of {s.batch_size} completions in both (no gradient accumulation; "
        f"TRL per_device_train_batch_size={s.batch_size}, gradient_accumulation_steps=1, generation_batch_size="
        f"{s.batch_size}); "
        + (
            f"the kit's forward/backward runs in micro-batches of {mb} (same update), TRL's in one"
            if s.batch_size > mb
            else "both run it as one forward/backward"
        ),
        "TRL computes per-token entropies in every training forward (logged only); the kit does not",
        *(
            [f"stops: kit completions end at EOS or at the first of {list(s.stop)} (tokens after it are neither "
             "sampled nor trained on); TRL's generation has no stop strings (nor its vLLM path's, by default), so its completions run "
             f"to EOS or {s.max_new_tokens} tokens and it trains on the tail too (its reward reads the text before "
             "the first stop string, the same function of the sample as the kit's)"]
            if s.stop else []
        ),
        *(
            [f"prompts: {cfg.model.model} through its chat template with system prompt "
             f"{cfg.prompt.system_prompt!r}; TRL gets conversational rows and renders them itself (checked to give "
             "the same prompt token ids)"]
            if cfg.prompt.chat_template != "never" and cfg.model.model != "tiny" else []
        ),
        "TRL defaults changed to match the kit: lr_scheduler_type=constant (TRL/transformers default: linear "
        "decay), gradient_checkpointing=False (TRL default True), bf16=False, optim=adamw_torch, top_k=0, top_p=1.0",
        *(
            ["TRL vLLM sampling precision: TRL passes vLLM no dtype, so vLLM's dtype='auto' samples from a bfloat16 "
             "copy of the fp32 checkpoint (and of the merged LoRA weights TRL pushes before each generation); TRL "
             "trains in fp32 and weighs each completion by its sequence-level importance ratio, dropping those above 3 "
             "(vllm_importance_sampling_correction, TRL's default mode sequence_mask); the kit's engine samples in "
             f"the model's dtype ({cfg.model.dtype})",
             "TRL vLLM start-up: GRPOTrainer builds the engine (torch.compile warm-up included) before "
             f"on_train_begin, so it is off the clock, as the kit's engine build is; CPU settings it needed: "
             f"vllm_max_model_length={cfg.model.max_model_len} (the kit's max_model_len) and "
             f"VLLM_CPU_KVCACHE_SPACE={os.environ.get('VLLM_CPU_KVCACHE_SPACE', TRL_VLLM_KV_CACHE_GIB)} GiB; "
             "vLLM also reseeds the process's random generators when it is built"]
            if trl_vllm else []
        ),
    ]


# ----------------------------------------------------------------------------- evaluation and clocks


def greedy_acc(cfg: config.Config, engine, problems: list[data.Problem], version: int) -> float:
    """Held-out (strict) accuracy of adapter ``version`` by the rule of ``grpo_kit.remote.eval_task``."""
    outs = engine.greedy(problems, version, max_new_tokens=cfg.sampling.max_new_tokens)
    scores = tasks.for_config(cfg).scorer().score_problems(problems, [r.text for r in outs])
    return sum(sc.correct for sc in scores) / max(1, len(scores))


def time_to_target(checkpoints: list[tuple[int, float, float]], target: float) -> tuple[int, float] | None:
    """``(step, seconds)`` of the first checkpoint after step 0 whose accuracy reaches ``target``.

    >>> time_to_target([(0, 0.0, 0.5), (5, 10.0, 0.4), (10, 20.0, 0.6)], 0.55)
    (10, 20.0)
    """
    for step, t, acc in checkpoints:
        if step > 0 and acc >= target - 1e-12:
            return step, t
    return None


def kit_checkpoints(records: list[dict], accs: dict[int, float] | None = None) -> tuple[list[tuple[int, float, float]], float]:
    """Checkpoints from the kit's metric records, and the training wall time of the run.

    Version ``v``'s time is ``t_iter_end`` of the record that produced it (the first whose ``version``
    is ``v``) minus the first record's ``t_iter_start``; version 0 (the base model) is at time 0.
    ``accs`` maps versions to accuracies measured after the run; None takes the evaluations the loop
    recorded.
    """
    t0 = records[0]["t_iter_start"]
    produced = {}
    for r in records:
        produced.setdefault(r["version"], r["t_iter_end"] - t0)
    produced[0] = 0.0
    if accs is None:
        accs = {}
        for r in records:
            for ev in r.get("evals", []):
                accs[ev["version"]] = ev["acc"]
    points = [(v, produced[v], accs[v]) for v in sorted(accs) if v in produced]
    return points, records[-1]["t_iter_end"] - t0


# ----------------------------------------------------------------------------- the two runs


def run_kit(cfg: config.Config, progress: bool, live_eval: bool = False, name: str = "grpo-kit") -> SideResult:
    from dataclasses import replace

    from grpo_kit.adapters import AdapterStore

    run_dir = Path(cfg.run.run_dir)
    shutil.rmtree(run_dir, ignore_errors=True)  # loop.run refuses a store that already holds versions
    loop_cfg = cfg if live_eval else replace(cfg, run=replace(cfg.run, eval_every=0))
    t = time.time()
    res = loop.run(loop_cfg, progress=progress)
    total = time.time() - t
    records = res.records
    first = records[0]
    accs = None
    if not live_eval:
        t_eval = time.time()
        engine = hf_evaluator(cfg, AdapterStore(cfg.run.store_root))
        heldout = heldout_problems(cfg)
        # dynamic sampling skips the optimizer step of an iteration without usable groups: versions
        # (optimizer steps) can end below the iteration count
        final_v = records[-1]["version"]
        versions = sorted({v for v in checkpoint_steps(cfg) if v <= final_v} | {final_v})
        accs = {v: greedy_acc(cfg, engine, heldout, v) for v in versions}
        engine.close()
        eval_s = time.time() - t_eval
    points, wall = kit_checkpoints(records, accs)
    extra = {
        "kit_total_s": total,
        "kit_startup_s": first["t_iter_start"] - t,  # cluster start, engine build, policy load, warm-up
        "kit_warmup_s": res.summary.get("startup_s"),
        "kit_eval_s": None if live_eval else eval_s,
        "kit_reward_first": first["reward_mean"],
        "kit_reward_last": records[-1]["reward_mean"],
        "kit_rejected_groups": res.summary.get("rejected_groups"),
        "kit_usable_share": _mean(r.get("usable_share") for r in records),
        "kit_usable_cost_s": _mean(r.get("usable_cost_s") for r in records),
        "kit_steps": records[-1]["version"],
    }
    if cfg.sampling.dynamic_sampling:
        extra = {k.replace("kit_", "kit_dynamic_", 1): v for k, v in extra.items()}
        extra["kit_dynamic_gen_batches_mean"] = _mean(r.get("gen_batches") for r in records)
        extra["kit_dynamic_dropped_groups"] = sum(r.get("dropped_groups", 0) for r in records)
        extra["kit_dynamic_max_gen_batches"] = cfg.sampling.max_gen_batches
    completions = sum((r.get("generated_groups", r["kept_groups"]) + r["rejected_groups"]) * cfg.sampling.group_size
                      for r in records)
    return SideResult(name, points, completions, wall, extra)


def _mean(values) -> float | None:
    vals = [v for v in values if v is not None]
    return sum(vals) / len(vals) if vals else None


def trl_inputs(cfg: config.Config, rows: list[data.Problem], tok):
    """TRL's prompt column for ``rows`` and its reward function.

    With a chat template the rows are conversational (TRL renders them itself; the first few are
    checked to give the kit's prompt token ids); without one they are the kit's plain prompt text.
    The reward function takes the row index column and scores, with the run's task scorer, the text
    before the first of the run's stop strings: the kit's reward of the same sample.
    """
    fmt, scorer, stops = prompt_fmt(cfg), tasks.for_config(cfg).scorer(), cfg.sampling.stop
    if fmt.uses_chat(tok):
        prompts = [fmt.messages(p.question) for p in rows]
        for p, msgs in zip(rows[:4], prompts, strict=False):
            ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=True)
            if list(ids["input_ids"]) != fmt.encode(tok, p.question):
                raise RuntimeError("TRL's chat-template tokens differ from the kit's prompt tokens")
    else:
        prompts = [fmt.render(tok, p.question) for p in rows]

    def completion_text(c) -> str:
        text = c[-1]["content"] if isinstance(c, list) else c
        for stop in stops:
            text = text.split(stop, 1)[0]
        return text

    def task_reward(completions, row, **_):
        scores = scorer.score_problems([rows[i] for i in row], [completion_text(c) for c in completions])
        return [sc.reward for sc in scores]

    return prompts, task_reward


def usable_cost_per_step(step_s: list[float], frac_zero_std: list[float | None], batch_size: int) -> float | None:
    """A TRL run's device-seconds per usable completion, as the kit's ``kit_usable_cost_s``: the mean over
    steps of ``grpo_kit.sampling.usable_cost(step seconds, usable completions)``, where a step's usable
    completions are ``batch_size x (1 - frac_reward_zero_std)`` (those in groups with reward spread);
    steps without one (or without a logged share) are left out.

    >>> usable_cost_per_step([2.0, 3.0, 1.0], [0.5, 1.0, 0.0], 4)
    0.625
    """
    from grpo_kit.sampling import usable_cost

    costs = [usable_cost(t, round(batch_size * (1 - f)))[0] for t, f in zip(step_s, frac_zero_std, strict=True)
             if f is not None]
    return _mean(costs)


@contextlib.contextmanager
def _vllm_logs_at(level: int):
    """vLLM's loggers at ``level`` for the block: its weight loader warns about the dtype of every tensor
    TRL pushes, at every step."""
    logger = logging.getLogger("vllm")
    before = logger.level
    logger.setLevel(level)
    try:
        yield
    finally:
        logger.setLevel(before)


def _close_colocated_vllm(trainer) -> None:
    """Shut TRL's colocated engine down and tear down the process group vLLM set up for it (vLLM's own
    cleanup between engines), so that a later repeat can build another in this process."""
    llm = getattr(getattr(trainer, "vllm_generation", None), "llm", None)
    if llm is not None:
        with contextlib.suppress(Exception):  # best effort: already down, or no such client API
            llm.llm_engine.engine_core.shutdown()
        trainer.vllm_generation.llm = llm = None  # the cleanup's gc.collect frees it
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    cleanup_dist_env_and_memory()


def _restore_environ(saved: dict[str, str]) -> None:
    """Make ``os.environ`` ``saved`` again."""
    for k in set(os.environ) - set(saved):
        del os.environ[k]
    for k, v in saved.items():
        if os.environ.get(k) != v:
            os.environ[k] = v


def run_trl(cfg: config.Config, out: Path, progress: bool, use_vllm: bool = False) -> SideResult:
    """TRL's GRPOTrainer on the kit's prompts; ``use_vllm``: sampling with its colocated vLLM engine (the
    ``TRL vLLM`` side: the same run otherwise, its keys prefixed ``trl_vllm_``)."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

    warnings.filterwarnings("ignore", message="TRL currently supports vLLM versions")
    from trl import GRPOConfig, GRPOTrainer

    from grpo_kit.adapters import AdapterStore
    from grpo_kit.models import resolve_model
    from grpo_kit.trainer import peft_lora_config
    from grpo_kit.vllm_engine import modules_unsafe_to_scan

    name = SIDES["trl_vllm" if use_vllm else "trl"]
    key = KEY_PREFIX[name]
    s, loss_cfg, lora_cfg = cfg.sampling, cfg.loss, cfg.lora
    model_path = resolve_model(cfg.model.model)
    trl_dir = out / key.replace("_", "-")
    shutil.rmtree(trl_dir, ignore_errors=True)
    store = AdapterStore(str(trl_dir / "store"))
    heldout = heldout_problems(cfg)

    # Row i*P + j is problem j of kit iteration i; shuffle_dataset=False keeps that order, and TRL's
    # sampler repeats each row num_generations times in a row, as the kit's groups.
    rows = [p for batch in training_prompts(cfg) for p in batch]
    prompts, task_reward = trl_inputs(cfg, rows, AutoTokenizer.from_pretrained(model_path))
    dataset = Dataset.from_dict({"prompt": prompts, "row": list(range(len(rows)))})

    vllm_args = {}
    if use_vllm:
        vllm_args = {"use_vllm": True, "vllm_mode": "colocate", "vllm_max_model_length": cfg.model.max_model_len}
    kv_gib = os.environ.get("VLLM_CPU_KVCACHE_SPACE") or str(TRL_VLLM_KV_CACHE_GIB)
    args = GRPOConfig(
        output_dir=str(trl_dir),
        use_cpu=not torch.cuda.is_available(),
        bf16=False,
        fp16=False,
        report_to=[],
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=not progress,
        dataloader_num_workers=0,
        dataloader_pin_memory=False,
        seed=cfg.run.seed,
        max_steps=cfg.run.iterations,
        shuffle_dataset=False,
        per_device_train_batch_size=s.batch_size,
        gradient_accumulation_steps=1,
        steps_per_generation=1,
        num_iterations=1,
        num_generations=s.group_size,
        max_completion_length=s.max_new_tokens,
        temperature=s.temperature,
        top_p=1.0,
        top_k=0,
        learning_rate=cfg.optim.lr,
        lr_scheduler_type="constant",
        optim="adamw_torch",
        weight_decay=cfg.optim.weight_decay,
        max_grad_norm=max(cfg.optim.max_grad_norm, 0.0),  # 0 disables clipping in both
        gradient_checkpointing=False,
        beta=loss_cfg.kl_beta,
        epsilon=loss_cfg.clip_eps,
        epsilon_high=loss_cfg.clip_eps_high if loss_cfg.clip_eps_high is not None else loss_cfg.clip_eps,
        loss_type=loss_cfg.loss_type,
        scale_rewards=loss_cfg.adv_scale,
        mask_truncated_completions=False,
        log_completions=False,
        **vllm_args,
    )
    peft_config = peft_lora_config(lora_cfg)  # exactly the kit trainer's LoRA
    t_start = time.time()
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, cfg.model.dtype))
    tokenizer = AutoTokenizer.from_pretrained(model_path, padding_side="left")

    engine = hf_evaluator(cfg, store)
    every, total = cfg.run.eval_every, cfg.run.iterations

    class GreedyEval(TrainerCallback):
        """Evaluates the policy every ``every`` steps and after the last; keeps its time off the clock,
        and notes each step's seconds on it."""

        def __init__(self):
            self.t0, self.eval_s, self.points, self.step_s, self.clock = 0.0, 0.0, [], [], 0.0

        def on_train_begin(self, args, state, control, **kw):
            self.startup_s = time.time() - t_start
            self.threads = torch.get_num_threads()  # what training (and a colocated engine) runs with
            t = time.perf_counter()
            self.points.append((0, 0.0, greedy_acc(cfg, engine, heldout, 0)))
            self.base_eval_s = time.perf_counter() - t
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, model=None, **kw):
            step = state.global_step
            t = time.perf_counter()
            train_s = t - self.t0 - self.eval_s
            self.step_s.append(train_s - self.clock)
            self.clock = train_s
            if step % every and step != total:
                return
            store.publish(model, step)
            self.points.append((step, train_s, greedy_acc(cfg, engine, heldout, step)))
            self.eval_s += time.perf_counter() - t

        def on_train_end(self, args, state, control, **kw):
            self.wall = time.perf_counter() - self.t0 - self.eval_s

    cb = GreedyEval()
    # Process-wide changes a colocated engine makes, undone after the run: vLLM's in-process CPU worker
    # replaces torch.set_num_threads with a no-op; TRL sets RANK, WORLD_SIZE and MASTER_* for it, and the
    # KV-cache size below would override the explicit one of the kit's engines (its workers, started
    # later, inherit os.environ).
    set_num_threads, environ = torch.set_num_threads, dict(os.environ)
    trainer = None
    try:
        # vLLM 0.32 on CPU scans every module's globals while it builds an engine (the kit's engine hides
        # the modules that break the scan the same way)
        hidden = modules_unsafe_to_scan() if use_vllm else {}
        for mod in hidden:
            del sys.modules[mod]
        if use_vllm:
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = kv_gib  # read when the engine is built
        t_build = time.time()
        try:
            trainer = GRPOTrainer(
                model=model,
                reward_funcs=task_reward,
                args=args,
                train_dataset=dataset,
                processing_class=tokenizer,
                peft_config=peft_config,
                callbacks=[cb],
            )
        finally:
            sys.modules.update(hidden)
        build_s = time.time() - t_build
        # Guard the two alignments the comparison rests on.
        if trainer.ref_model is not None and loss_cfg.kl_beta > 0:
            raise RuntimeError("expected TRL to take the KL reference from the base model (adapter disabled)")
        if trainer.args.generation_batch_size != s.batch_size:
            raise RuntimeError(f"TRL generation_batch_size {trainer.args.generation_batch_size} != {s.batch_size}")
        vllm_extra = {}
        if use_vllm:
            import vllm

            llm = trainer.vllm_generation.llm
            kv_bytes = llm.llm_engine.vllm_config.cache_config.kv_cache_memory_bytes
            vllm_extra = {
                f"{key}_vllm_version": vllm.__version__,
                f"{key}_sampling_dtype": str(llm.llm_engine.vllm_config.model_config.dtype).removeprefix("torch."),
                f"{key}_kv_cache_gib": None if kv_bytes is None else kv_bytes / 2**30,
            }
        t = time.time()
        with _vllm_logs_at(logging.ERROR) if use_vllm else contextlib.nullcontext():
            trainer.train()
        total_s = time.time() - t
    finally:
        engine.close()
        if use_vllm and "vllm" in sys.modules:  # not imported: nothing to tear down
            _close_colocated_vllm(trainer)
        torch.set_num_threads = set_num_threads
        if use_vllm:
            _restore_environ(environ)
    logs = [h for h in trainer.state.log_history if "reward" in h]
    frac_by_step = {h.get("step"): h.get("frac_reward_zero_std") for h in logs}
    extra = {
        f"{key}_total_s": total_s,
        f"{key}_startup_s": cb.startup_s,  # model load, LoRA wrap, GRPOTrainer construction (engine build)
        f"{key}_trainer_build_s": build_s,  # GRPOTrainer construction alone
        f"{key}_eval_s": cb.eval_s + cb.base_eval_s,
        f"{key}_reward_first": logs[0]["reward"] if logs else None,
        f"{key}_reward_last": logs[-1]["reward"] if logs else None,
        f"{key}_frac_zero_std": _mean(h.get("frac_reward_zero_std") for h in logs),
        f"{key}_usable_cost_s": usable_cost_per_step(
            cb.step_s, [frac_by_step.get(i + 1) for i in range(len(cb.step_s))], s.batch_size
        ),
        f"{key}_torch_threads": cb.threads,
        f"{key}_version": __import__("trl").__version__,
        **vllm_extra,
    }
    if use_vllm:
        extra[f"{key}_is_ratio_mean"] = _mean(h.get("sampling/importance_sampling_ratio/mean") for h in logs)
        extra[f"{key}_is_ratio_min"] = min((h["sampling/importance_sampling_ratio/min"] for h in logs
                                            if "sampling/importance_sampling_ratio/min" in h), default=None)
    return SideResult(name, cb.points, total * s.batch_size, cb.wall, extra)


# ----------------------------------------------------------------------------- report


def _load() -> float | None:
    """The 1-minute load average (other work on the machine makes timings noisy)."""
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else None


def _fmt(x, spec: str = ".3f") -> str:
    return "-" if x is None else format(x, spec)


def missing_ratio_reason(kit: SideResult | None, peer: SideResult | None, peer_name: str, target: float | None,
                         ttt: dict, failed: str | None = None) -> str:
    """Why kit / ``peer`` time to target has no value."""
    if peer is None:
        return f"{peer_name} did not run" + (f": {failed}" if failed else " (not in --sides)")
    if kit is None:
        return "grpo-kit did not run (not in --sides)"
    if target is None:
        return "no target: a run has no final accuracy"
    for r in (kit, peer):
        if ttt.get(r.name) is None:
            return f"{r.name} did not reach the target {target:.3f} (final accuracy {_fmt(r.final_acc)})"
    return f"{peer_name} reached the target at 0 s"


def report(
    cfg: config.Config,
    kit: SideResult | None,
    trl: SideResult | None,
    diffs: list[str],
    bench_s: float,
    cross: dict,
    load: dict | None = None,
    live_eval: bool = False,
    dyn: SideResult | None = None,
    trl_vllm: SideResult | None = None,
    failed: dict[str, str] | None = None,
) -> dict:
    """Prints the tables and returns the JSON line's dict; ``failed`` maps a side's title to why it has no
    result (a run that raised)."""
    failed = failed or {}
    sides = [r for r in (kit, dyn, trl, trl_vllm) if r is not None]
    finals = [r.final_acc for r in sides if r.final_acc is not None]
    target = min(finals) - TARGET_MARGIN if len(finals) >= 2 and len(finals) == len(sides) else None
    ttt = {}
    for r in sides:
        if target is not None:
            ttt[r.name] = time_to_target(r.checkpoints, target)

    def t_of(r):
        hit = ttt.get(r.name) if r is not None else None
        return None if hit is None else hit[1]

    kit_t, trl_t, dyn_t, vllm_t = t_of(kit), t_of(trl), t_of(dyn), t_of(trl_vllm)
    ratio = kit_t / trl_t if kit_t is not None and trl_t else None
    ratio_dyn = dyn_t / trl_t if dyn_t is not None and trl_t else None
    ratio_vllm = kit_t / vllm_t if kit_t is not None and vllm_t else None
    vllm_name = SIDES["trl_vllm"]
    ratio_vllm_reason = None if ratio_vllm is not None else missing_ratio_reason(
        kit, trl_vllm, vllm_name, target, ttt, failed.get(vllm_name))

    print("\ndifferences between the runs:")
    for d in diffs:
        print(f"  - {d}")

    print("\nheld-out greedy accuracy at each checkpoint (step: training seconds / accuracy):")
    cols = [(r.name, r) for r in sides] or [("grpo-kit", None), ("TRL", None)]
    steps = sorted({c[0] for r in sides for c in r.checkpoints})
    by = {r.name: {c[0]: c for c in r.checkpoints} for r in sides}
    print("  " + f"{'step':>5} | " + " | ".join(f"{name + ' s':>16} {'acc':>6}" for name, _ in cols))
    for st in steps:
        cells = []
        for name, _ in cols:
            c = by.get(name, {}).get(st)
            cells.append(f"{_fmt(c and c[1], '16.1f'):>16} {_fmt(c and c[2], '6.3f'):>6}")
        print(f"  {st:>5} | " + " | ".join(cells))

    print(f"\ntarget: {_fmt(target)} (smallest final accuracy minus {TARGET_MARGIN:.2f})")
    print(f"  {'':<26}" + "".join(f"{name:>18}" for name, _ in cols))

    def usable(r):
        e = r.extra
        if f"{r.prefix}_frac_zero_std" in e:  # a TRL side: its groups with spread
            f = e[f"{r.prefix}_frac_zero_std"]
            return None if f is None else 1 - f
        return e.get(f"{r.prefix}_usable_share")

    rows = [
        ("base accuracy", lambda r: r.checkpoints[0][2] if r.checkpoints else None, ".3f"),
        ("final accuracy", lambda r: r.final_acc, ".3f"),
        ("time to target (s)", t_of, ".1f"),
        ("step reaching target", lambda r: ttt[r.name][0] if ttt.get(r.name) else None, "d"),
        ("training wall (s)", lambda r: r.train_wall_s, ".1f"),
        ("start-up, off clock (s)", lambda r: r.extra.get(f"{r.prefix}_startup_s"), ".1f"),
        ("completions / s", lambda r: r.completions_per_s, ".2f"),
        ("usable share", usable, ".3f"),
        ("usable cost (s/sample)", lambda r: r.extra.get(f"{r.prefix}_usable_cost_s"), ".3f"),
    ]
    for label, get, spec in rows:
        print(f"  {label:<26}" + "".join(f"{(_fmt(get(r), spec) if r is not None else '-'):>18}" for _, r in cols))
    print("  (usable share: the kit's generated completions in groups with reward spread; a TRL side's 1 - "
          "frac_reward_zero_std, its groups with spread. usable cost: device-seconds per completion in such a "
          "group, mean over steps: the kit's rollout + trainer workers' seconds, a TRL side's step seconds on its "
          "clock in its one process)")
    for name, why in failed.items():
        print(f"  {name}: no result ({why})")
    goal = 0.5 if cfg.model.model == "tiny" else 0.7  # the README's targets: tiny 0.5, the real model 0.7
    print(f"  time ratio grpo-kit / TRL: {_fmt(ratio)} (goal <= {goal})")
    if dyn is not None:
        print(f"  time ratio grpo-kit dynamic sampling / TRL: {_fmt(ratio_dyn)} (goal <= 0.7)")
    print(f"  time ratio grpo-kit / {vllm_name}: "
          + (_fmt(ratio_vllm) if ratio_vllm is not None else f"- ({ratio_vllm_reason})"))
    if target is not None:
        base = [r.checkpoints[0][2] for r in sides if r.checkpoints and r.checkpoints[0][0] == 0]
        if base and min(base) >= target:
            print(
                "  NOTE: the base model already reaches the target; time to target then only measures the "
                "first checkpoint. Train longer or raise the learning rate for a meaningful ratio."
            )
    first_hit = bool(ttt) and all(
        hit is not None and hit[0] == min((c[0] for c in r.checkpoints if c[0] > 0), default=None)
        for r in sides
        for hit in [ttt.get(r.name)]
    )
    if first_hit:
        print(
            "  NOTE: every run reaches the target at its first checkpoint, so time to target is start-up plus "
            f"{cfg.run.eval_every} steps; a smaller --eval-every resolves it more finely."
        )
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    busiest = max((v for v in (load or {}).values() if v is not None), default=None)
    if busiest is not None and busiest > cpus + 0.5:
        print(
            f"  NOTE: the machine was busy (1-min load average up to {busiest:.1f} on {cpus} CPUs): timings are "
            "noisy; rerun when it is idle."
        )
    if cross:
        print(
            "  cross-check: kit's final adapter decoded with TRL's evaluator (HFEngine): "
            f"acc {_fmt(cross.get('kit_final_acc_hf'))}"
        )
    print(f"  bench wall time: {bench_s:.0f} s")

    s = cfg.sampling
    result = {
        "kit_time_to_target_s": kit_t,
        "trl_time_to_target_s": trl_t,
        "time_ratio": ratio,
        "kit_dynamic_time_to_target_s": dyn_t,
        "time_ratio_dynamic": ratio_dyn,
        "trl_vllm_time_to_target_s": vllm_t,
        "time_ratio_vs_trl_vllm": ratio_vllm,
        "time_ratio_vs_trl_vllm_reason": ratio_vllm_reason,
        "kit_usable_share": kit.extra.get("kit_usable_share") if kit else None,
        "kit_dynamic_usable_share": dyn.extra.get("kit_dynamic_usable_share") if dyn else None,
        "trl_frac_zero_std": trl.extra.get("trl_frac_zero_std") if trl else None,
        "trl_vllm_frac_zero_std": trl_vllm.extra.get("trl_vllm_frac_zero_std") if trl_vllm else None,
        "kit_usable_cost_s": kit.extra.get("kit_usable_cost_s") if kit else None,
        "kit_dynamic_usable_cost_s": dyn.extra.get("kit_dynamic_usable_cost_s") if dyn else None,
        "trl_usable_cost_s": trl.extra.get("trl_usable_cost_s") if trl else None,
        "trl_vllm_usable_cost_s": trl_vllm.extra.get("trl_vllm_usable_cost_s") if trl_vllm else None,
        "kit_final_acc": kit.final_acc if kit else None,
        "kit_dynamic_final_acc": dyn.final_acc if dyn else None,
        "trl_final_acc": trl.final_acc if trl else None,
        "trl_vllm_final_acc": trl_vllm.final_acc if trl_vllm else None,
        "target_acc": target,
        "kit_base_acc": kit.checkpoints[0][2] if kit and kit.checkpoints else None,
        "trl_base_acc": trl.checkpoints[0][2] if trl and trl.checkpoints else None,
        "trl_vllm_base_acc": trl_vllm.checkpoints[0][2] if trl_vllm and trl_vllm.checkpoints else None,
        "kit_completions_per_s": kit.completions_per_s if kit else None,
        "trl_completions_per_s": trl.completions_per_s if trl else None,
        "trl_vllm_completions_per_s": trl_vllm.completions_per_s if trl_vllm else None,
        "kit_train_wall_s": kit.train_wall_s if kit else None,
        "trl_train_wall_s": trl.train_wall_s if trl else None,
        "trl_vllm_train_wall_s": trl_vllm.train_wall_s if trl_vllm else None,
        "kit_checkpoints": kit.checkpoints if kit else None,
        "kit_dynamic_checkpoints": dyn.checkpoints if dyn else None,
        "trl_checkpoints": trl.checkpoints if trl else None,
        "trl_vllm_checkpoints": trl_vllm.checkpoints if trl_vllm else None,
        **cross,
        **(kit.extra if kit else {}),
        **(dyn.extra if dyn else {}),
        **(trl.extra if trl else {}),
        **(trl_vllm.extra if trl_vllm else {}),
        "failed_sides": failed,
        "bench_wall_s": bench_s,
        "target_at_first_checkpoint": first_hit,
        "load_avg_1min": load or {},
        "settings": {
            "steps": cfg.run.iterations,
            "prompts_per_step": s.prompts_per_step,
            "group_size": s.group_size,
            "completions_per_step": s.batch_size,
            "max_new_tokens": s.max_new_tokens,
            "temperature": s.temperature,
            "lr": cfg.optim.lr,
            "kl_beta": cfg.loss.kl_beta,
            "clip_eps": cfg.loss.clip_eps,
            "loss_type": cfg.loss.loss_type,
            "scale_rewards": cfg.loss.adv_scale,
            "lora_r": cfg.lora.lora_r,
            "lora_alpha": cfg.lora.lora_alpha,
            "lora_targets": list(cfg.lora.lora_targets),
            "eval_every": cfg.run.eval_every,
            "eval_size": cfg.data.eval_size,
            "seed": cfg.run.seed,
            "kit_engine": s.engine,
            "kit_lora_mode": s.lora_mode,
            "kit_live_eval": live_eval,
            "kit_pipelined": cfg.run.pipelined,
            "kit_dynamic_max_gen_batches": dyn.extra.get("kit_dynamic_max_gen_batches") if dyn else None,
            "cpus": cpus,
        },
        "differences": diffs,
    }
    return result


def run_pair(cfg: config.Config, args: argparse.Namespace, out: Path, threads: int, diffs: list[str],
             kit_first: bool) -> dict:
    """One run of each of ``args.sides`` (in ``SIDES`` order, reversed unless ``kit_first``), reported;
    returns the report's dict. A TRL vLLM run that raises is reported with its error, not re-raised."""
    t0 = time.time()
    progress = not args.no_progress
    runs: dict[str, SideResult] = {}
    cross, load, failed = {}, {}, {}

    def kit_side():
        print(
            f"[grpo-kit] {cfg.run.iterations} iterations of {cfg.sampling.prompts_per_step} prompts x "
            f"{cfg.sampling.group_size}, engine={cfg.sampling.engine}, pipelined={cfg.run.pipelined}",
            flush=True,
        )
        return run_kit(cfg, progress, args.live_eval)

    def dyn_side():
        dcfg = dynamic_config(cfg, args.max_gen_batches)
        print(f"[grpo-kit dynamic] the same with dynamic_sampling=True, max_gen_batches={args.max_gen_batches}",
              flush=True)
        return run_kit(dcfg, progress, args.live_eval, name=SIDES["dynamic"])

    def trl_side():
        print(f"[TRL] GRPOTrainer, same settings, {threads} torch threads", flush=True)
        return run_trl(cfg, out, progress)

    def trl_vllm_side():
        print(f"[TRL vLLM] the same with use_vllm=True, vllm_mode='colocate', {threads} torch threads", flush=True)
        return run_trl(cfg, out, progress, use_vllm=True)

    run_side = {"kit": kit_side, "dynamic": dyn_side, "trl": trl_side, "trl_vllm": trl_vllm_side}
    for side in args.sides if kit_first else args.sides[::-1]:
        name, prefix = SIDES[side], KEY_PREFIX[SIDES[side]]
        load[f"{prefix}_start"] = _load()
        try:
            runs[side] = run_side[side]()
        except Exception as e:  # noqa: BLE001 - TRL vLLM only: an untested TRL/vLLM pair; the other runs stand
            if side != "trl_vllm":
                raise
            traceback.print_exc()
            failed[name] = f"{type(e).__name__}: {e}"
        load[f"{prefix}_end"] = _load()
        got = runs.get(side) and runs[side].extra.get(f"{prefix}_torch_threads")
        if got is not None and got != threads:
            print(f"  NOTE: {name} trained with {got} torch threads, not {threads}", flush=True)
    kit, trl = runs.get("kit"), runs.get("trl")
    if kit is not None and trl is not None and args.live_eval:
        from grpo_kit.adapters import AdapterStore

        final_v = kit.checkpoints[-1][0]
        eng = hf_evaluator(cfg, AdapterStore(cfg.run.store_root))
        cross["kit_final_acc_hf"] = greedy_acc(cfg, eng, heldout_problems(cfg), final_v)
        eng.close()
    result = report(cfg, kit, trl, diffs, time.time() - t0, cross, load, args.live_eval, runs.get("dynamic"),
                    runs.get("trl_vllm"), failed)
    result["kit_first"] = kit_first
    result["sides"] = list(args.sides)
    return result


MEDIAN_KEYS = ("kit_time_to_target_s", "trl_time_to_target_s", "time_ratio", "kit_dynamic_time_to_target_s",
               "time_ratio_dynamic", "kit_usable_share", "kit_dynamic_usable_share", "trl_frac_zero_std",
               "trl_vllm_time_to_target_s", "time_ratio_vs_trl_vllm", "trl_vllm_frac_zero_std")
"""The headline keys: medians over the repeats (null unless every repeat has one), each repeat's in ``<key>_all``."""
ALL_KEYS = ("kit_usable_cost_s", "kit_dynamic_usable_cost_s", "trl_usable_cost_s", "trl_vllm_usable_cost_s")
"""Keys that stay the last repeat's, with every repeat's in ``<key>_all``."""


def summarize(results: list[dict]) -> dict:
    """The last repeat's report with the headline keys replaced by medians over all repeats."""
    import statistics

    out = dict(results[-1])
    for key in MEDIAN_KEYS:
        vals = [r.get(key) for r in results if r.get(key) is not None]
        out[key] = statistics.median(vals) if len(vals) == len(results) else None
        out[key + "_all"] = [r.get(key) for r in results]
    for key in ALL_KEYS:
        out[key + "_all"] = [r.get(key) for r in results]
    reason = "time_ratio_vs_trl_vllm_reason"
    if out["time_ratio_vs_trl_vllm"] is not None:
        out[reason] = None
    elif len(results) > 1:
        out[reason] = "; ".join(f"repeat {i + 1}: {r.get(reason)}" for i, r in enumerate(results)
                                if r.get("time_ratio_vs_trl_vllm") is None)
    out["repeats"] = len(results)
    return out


def _median(values) -> float | None:
    import statistics

    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything here is local; never wait on the hub
    cfg = kit_config(args)
    out = Path(args.out)
    import torch

    threads = torch.get_num_threads()
    diffs = differences(cfg, threads, args.live_eval, trl_vllm="trl_vllm" in args.sides)
    results = []
    for rep in range(args.repeats):
        if args.repeats > 1:
            print(f"\n===== repeat {rep + 1} of {args.repeats} ({'kit' if rep % 2 == 0 else 'TRL'} first)", flush=True)
        results.append(run_pair(cfg, args, out, threads, diffs, kit_first=rep % 2 == 0))
    result = summarize(results)
    if args.repeats > 1:
        ratios = ", ".join(_fmt(r) for r in result["time_ratio_all"])
        print(f"\nover {args.repeats} repeats (alternating which side runs first): time ratio grpo-kit / TRL "
              f"median {_fmt(result['time_ratio'])} (each: {ratios}); time to target median "
              f"{_fmt(result['kit_time_to_target_s'], '.1f')} s against {_fmt(result['trl_time_to_target_s'], '.1f')} s")
        if "dynamic" in args.sides:
            each = ", ".join(_fmt(r) for r in result["time_ratio_dynamic_all"])
            print(f"with dynamic sampling: time ratio median {_fmt(result['time_ratio_dynamic'])} (each: {each}); "
                  f"time to target median {_fmt(result['kit_dynamic_time_to_target_s'], '.1f')} s; usable share "
                  f"kit {_fmt(result['kit_usable_share'])}, kit dynamic {_fmt(result['kit_dynamic_usable_share'])}, "
                  f"TRL 1 - frac_reward_zero_std {_fmt(None if result['trl_frac_zero_std'] is None else 1 - result['trl_frac_zero_std'])}")
        if "trl_vllm" in args.sides:
            each = ", ".join(_fmt(r) for r in result["time_ratio_vs_trl_vllm_all"])
            print(f"against TRL vLLM: time ratio grpo-kit / TRL vLLM median {_fmt(result['time_ratio_vs_trl_vllm'])} "
                  f"(each: {each}); TRL vLLM time to target median "
                  f"{_fmt(result['trl_vllm_time_to_target_s'], '.1f')} s"
                  + (f" ({result['time_ratio_vs_trl_vllm_reason']})" if result["time_ratio_vs_trl_vllm_reason"] else ""))
        costs = ", ".join(f"{SIDES[side]} {_fmt(_median(result[KEY_PREFIX[SIDES[side]] + '_usable_cost_s_all']))}"
                          for side in args.sides)
        print(f"usable cost, device-seconds per usable sample, median over repeats: {costs}")
    out.mkdir(parents=True, exist_ok=True)
    (out / "result.json").write_text(json.dumps(result, indent=1))
    sys.stdout.flush()
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
