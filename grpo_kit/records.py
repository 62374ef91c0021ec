"""The run record: what a run writes to its directory, in one typed definition, and how it is read back.

The driver (:mod:`grpo_kit.loop`) appends one :class:`MetricsRecord` per iteration to
``metrics.jsonl``, three :class:`Sample` s per iteration to ``samples.jsonl`` and, every
``rollouts_every`` iterations, every completion's :class:`~grpo_kit.rollout.RolloutSummary` to
``rollouts.jsonl``; ``config.json`` and ``summary.json`` sit beside them (:class:`RunFiles`). The
figures, the live widgets and the report read the same keys; ``tests/test_records.py`` checks that
every key they read is declared here, so a renamed key breaks loudly.

A record is a plain ``dict`` (JSON in, JSON out): the classes below are ``TypedDict`` s, a schema
for readers and type checkers, not a wrapper. Any key may be missing or ``None`` in a record
rebuilt after a crash (``recovered``) or written by an older version of the kit.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NotRequired, TypedDict

if TYPE_CHECKING:
    from .rollout import RolloutSummary

# ---------------------------------------------------------------- the schema


class Span(TypedDict):
    """One timed piece of work, drawn in the pipeline timeline."""

    name: str
    """``generate``, ``train``, ``publish`` or ``eval``."""
    iteration: int
    """The iteration the work belongs to (an evaluation: the one that submitted it; -1 for the base model)."""
    start: float
    """Unix time the work started."""
    end: float
    """Unix time it ended."""


class EvalResult(TypedDict, total=False):
    """A held-out evaluation of one adapter version (``remote.eval_task``), in ``MetricsRecord.evals``."""

    version: int
    """The adapter version evaluated (0: the base model)."""
    acc: float
    """Strict accuracy (for the arithmetic tasks: the ``#### <n>`` form and the right value)."""
    lenient_acc: float
    """Lenient accuracy (the right value by any rule)."""
    n: int
    """Held-out problems evaluated."""
    truncated: int
    """Completions that hit the token budget."""
    reward_errors: int
    """Reward-function failures on the completions (a completion counts once per function that failed on it)."""
    unscored: int
    """Completions no reward applied to (their reward is None: a code reward not run within its
    batch's time, a reward that does not apply): ``acc`` counts them as not correct, over all ``n``."""
    start: float
    """Unix time the evaluation started."""
    end: float
    """Unix time it ended."""
    reward_metrics: dict[str, float]
    """What the reward functions logged with ``log_metric`` while scoring the greedy completions: each
    name's mean (``{}`` when nothing was); ``log_extra`` columns are not kept (evaluation writes no rows)."""
    worker: str
    """The Dask worker's name (``eval-0`` on an evaluation worker, ``rollout-0`` on a rollout one)."""
    iteration: int
    """The iteration that submitted it (-1: the base model's, before the first)."""
    set: str
    """The held-out set's name in ``DataConfig.eval_sets``; absent for the task's own held-out set."""
    # a multi-turn task's evaluation (one greedy episode per problem); absent for a single-turn task
    tool_rate: float
    """Share of the episodes that called a tool."""
    turns_mean: float
    """Model turns per episode."""
    tool_errors: int
    """Tool calls that failed (any kind), summed over the episodes."""
    # a sampled evaluation (RunConfig.eval_samples = k >= 1; grpo_kit.passk); absent otherwise
    samples: int
    """k: completions (episodes) sampled per problem at ``temperature``, besides the greedy one."""
    temperature: float
    """Their sampling temperature (``eval_temperature``)."""
    pass_at: dict[str, float]
    """pass@k (Chen et al.'s unbiased estimator, strict correctness) by k: ``"1"``, ``"2"``, ``"4"``, ... and ``str(samples)``."""
    avg_acc: float
    """avg@k: the samples' mean strict accuracy (equal to pass@1)."""
    maj_acc: float | None
    """maj@k: share of problems whose majority extracted answer is correct (None: no sample had an
    answer to vote on; see :mod:`grpo_kit.passk`)."""
    sample_truncated: int
    """Sampled completions that hit the token budget."""
    sample_reward_errors: int
    """Reward-function failures on the sampled completions (once per failing function and completion)."""


class EpisodeAccount(TypedDict):
    """A multi-turn completion's account (:func:`grpo_kit.episode.summary`; ``RolloutSummary.episode``
    in ``rollouts.jsonl``, :attr:`Sample.episode`)."""

    turns: int
    """Model turns."""
    tool_calls: int
    """Tool calls answered (good or not)."""
    tool_errors: dict[str, int]
    """Failed calls by kind (:data:`grpo_kit.tools.ERROR_KINDS`)."""
    end_reason: str
    """``answered``, ``max_turns``, ``budget`` or ``error`` (:data:`grpo_kit.episode.END_REASONS`)."""
    model_tokens: int
    """Tokens the policy sampled."""
    env_tokens: int
    """Environment and template tokens between the model's turns (not trained on)."""
    env_reward: float | None
    """The environment's ``get_reward()`` (None without one, or when it raised)."""
    error: str | None
    """What raised (the environment's ``reset``, the rendering of its answers, ``get_reward``)."""
    messages: list[dict]
    """The conversation after the prompt: ``{"role": "assistant", "content"}`` for the model's turns,
    ``{"role": "tool", "name", "content"}`` for the environment's answers."""


class Sample(TypedDict):
    """One completion kept for the report (``samples.jsonl``: three per iteration)."""

    iteration: int
    """The iteration that generated it."""
    prompt: str
    """The problem's id."""
    completion: str
    """The completion's text."""
    reward: float
    """Its reward."""
    gold: str
    """The reference answer."""
    version: int
    """The adapter version that generated it."""
    episode: NotRequired[EpisodeAccount]
    """A multi-turn completion's episode (absent for a single-turn one)."""
    extra: NotRequired[dict]
    """What the reward functions logged for it with ``log_extra`` (column -> value; absent when nothing was)."""


class MetricsRecord(TypedDict, total=False):
    """One iteration of a run: a line of ``metrics.jsonl``, and what the run's callbacks receive."""

    iteration: int
    """0-based iteration number."""
    version: int
    """The trainer's adapter version after this iteration's step (published as ``v<version>``)."""
    rollout_version: int
    """The oldest adapter version the batch's rollouts were sampled from: the version it was submitted
    with, unless a chunk took a newer one when it started (``staleness_policy="discard"``) or dynamic
    sampling's extra rounds sampled at a later version."""
    recovered: bool
    """Rebuilt on resume from the adapter's manifest (the driver died before writing it): trainer
    statistics only, no rewards or timings."""
    # rewards and accuracy
    reward_mean: float | None
    """Mean reward over the batch's completions that have one (None where none has)."""
    reward_std: float | None
    """Standard deviation of those rewards (None for fewer than two)."""
    unscorable: int
    """Completions no reward function applied to (reward None, advantage 0; :mod:`grpo_kit.tasks.base`)."""
    train_acc: float
    """Share of the batch's completions graded correct (strict)."""
    train_lenient_acc: float
    """Share graded correct by the lenient rule."""
    reward_components: dict[str, float | None]
    """Each reward function's batch mean (unweighted; over the completions where it applied)."""
    reward_errors: int
    """Reward-function failures (raised, timed out, returned a non-score), once per failing function
    and completion: one completion both rewards failed on counts 2."""
    reward_metrics: dict[str, float]
    """What the reward functions logged with ``log_metric`` (TRL's): each name's mean over the values
    logged for the batch (``{}`` when none were)."""
    reward_s: float
    """Seconds the reward tasks spent scoring, summed over chunks."""
    reward_workers: int
    """Distinct workers that scored the batch."""
    eval_acc: float | None
    """Held-out accuracy (strict) of ``eval_version``, when an evaluation finished during this iteration."""
    eval_lenient_acc: float | None
    """Held-out accuracy (lenient) of ``eval_version``."""
    eval_version: int
    """The adapter version ``eval_acc`` measures (present with ``eval_acc``)."""
    eval_pass_at_k: float | None
    """pass@k of ``eval_version`` at k = ``eval_samples`` (present with a sampled evaluation; every k in ``evals``)."""
    eval_maj_acc: float | None
    """maj@k of ``eval_version`` (present with ``eval_pass_at_k``; None: no answer to vote on)."""
    evals: list[EvalResult]
    """Every evaluation that finished during this iteration (the base model's included)."""
    eval_errors: list[dict]
    """Evaluations that failed during this iteration (``iteration``, ``version``, ``error``, ``set`` for
    another set): warned of and dropped; the run goes on (present only when there are any)."""
    base_acc: float | None
    """The base model's held-out accuracy (strict), once measured."""
    # the trainer's statistics (loss.py / train_step.py); the means are None, never NaN, for a step
    # that trained no token (no group with reward spread and kl_beta=0)
    loss: float | None
    """The step's loss."""
    ratio_mean: float | None
    """Mean importance ratio pi/pi_old over the batch's tokens."""
    ratio_std: float | None
    """Its standard deviation."""
    ratio_min: float | None
    """Its minimum."""
    ratio_max: float | None
    """Its maximum."""
    clip_frac_low: float | None
    """Share of tokens clipped at 1 - clip_eps."""
    clip_frac_high: float | None
    """Share of tokens clipped at 1 + clip_eps_high."""
    clip_frac: float | None
    """Share of tokens clipped either way."""
    kl_mean: float | None
    """Mean k3 KL to the base model (None when not computed)."""
    is_mean: float | None
    """Mean engine-mismatch weight pi_old/pi_engine (``old_logp_source="trainer"``)."""
    is_min: float | None
    """Its minimum, before the cap."""
    is_max: float | None
    """Its maximum, before the cap."""
    is_capped_frac: float | None
    """Share of tokens whose engine-mismatch weight was capped."""
    mismatch_kl: float | None
    """Mean k3 KL(engine || trainer) over the trained tokens: the engine's sampling log-probs against
    the trainer's at the step (staleness included)."""
    mismatch_far_frac: float | None
    """Share of those tokens whose engine and trainer log-probs differ by more than log 2."""
    sampled_nll: float | None
    """Mean -logp of the trained tokens under the trainer (an estimate of the per-token entropy)."""
    base_mismatch_kl: float | None
    """Mean k3 KL(engine || base model) over the trained tokens (None when ``kl_beta == 0``: no base forward)."""
    wrong_policy: str | None
    """Why the batch looks sampled from the base model rather than the version it claims
    (:func:`grpo_kit.metrics.wrong_policy`), or None; the driver warns once per run of such iterations."""
    grad_norm: float | None
    """Gradient norm before clipping; inf or NaN: the optimizer step was skipped (the adapter is unchanged)."""
    tokens: int | None
    """Completion tokens of the training batch (model tokens of multi-turn episodes), the rows a step
    skips for a zero advantage (``kl_beta == 0``) included: the trainer's own ``tokens_trained``
    leaves those out."""
    samples_nonzero_adv: int | None
    """Completions with a non-zero advantage."""
    # staleness and the groups trained on
    staleness_max: int
    """Largest version lag (trainer version minus generating version) of the groups trained on."""
    staleness_mean: float
    """Mean version lag of those groups."""
    rejected_groups: int
    """Groups dropped as too stale and generated again (``staleness_policy="discard"``)."""
    kept_groups: int
    """Groups trained on."""
    generated_groups: int
    """Groups generated for this iteration (every dynamic-sampling round)."""
    zero_spread_groups: int
    """Generated groups whose rewards were all equal (no advantage signal)."""
    all_zero_spread: bool
    """Every generated group had zero spread."""
    trained_groups: int
    """Groups in the training batch."""
    # usable samples and their cost
    usable_samples: int
    """Completions trained on that sit in groups with reward spread."""
    usable_tokens: int
    """The completion tokens of the usable groups trained on (every completion of such a group,
    an unscorable one's too: it is in the batch, with advantage 0)."""
    usable_share: float
    """Share of the generated completions that were usable."""
    usable_per_s: float
    """Usable samples per second of iteration wall time."""
    usable_cost_s: float | None
    """Device-seconds (generation plus training) per usable sample."""
    usable_cost: float | None
    """Money per usable sample (``price_per_hour`` units; None without a price)."""
    gen_device_s: float
    """Seconds the rollout tasks ran, summed over workers (a batch discarded as too stale included)."""
    train_device_s: float
    """The training step's wall time times the trainer ranks."""
    rollout_workers: int
    """Distinct rollout workers that generated the batch."""
    # dynamic sampling (sampling.py)
    gen_batches: int
    """Generation rounds this iteration took (1 without dynamic sampling)."""
    dropped_groups: int
    """Zero-spread groups dropped by dynamic sampling."""
    carried_in_groups: int
    """Usable groups carried in from the previous iteration."""
    carried_out_groups: int
    """Usable groups carried over to the next iteration."""
    expired_groups: int
    """Usable groups not trained and not carried: carried-in groups too stale to train, and surplus
    of this batch that would be too stale by the next (:func:`grpo_kit.sampling.select_groups`)."""
    # completions
    truncated: int
    """Completions that hit the token budget."""
    completion_tokens: int
    """Completion tokens generated for the batch."""
    # timings (seconds; Unix times for t_*)
    gen_s: float
    """Wall time from the first rollout chunk's start to the last one's end."""
    gen_wait_s: float
    """Seconds from the iteration's start until its batch was in (dynamic sampling's extra rounds included)."""
    train_s: float
    """Wall time of the training step, publishing included."""
    train_compute_s: float | None
    """Rank 0's forward/backward/optimizer time."""
    publish_s: float | None
    """Rank 0's time publishing the adapter."""
    checkpoint_s: float | None
    """Rank 0's time writing the optimizer checkpoint."""
    prepare_s: float | None
    """Rank 0's time fetching and preparing the batch."""
    gang_restarts: int
    """Times the trainer gang was re-formed so far in this run."""
    task_resubmits: int
    """Rollout, reward, summary and eval tasks the driver resubmitted since the previous record because
    their workers kept dying (Dask's ``KilledWorker``; at most ``max_task_failures`` per task)."""
    t_iter_start: float
    """Unix time the iteration started."""
    t_iter_end: float
    """Unix time its record was complete."""
    iter_s: float
    """``t_iter_end - t_iter_start``."""
    grpo_wall_s: float
    """Wall time of the loop so far, summed over resumed sessions."""
    spans: list[Span]
    """Timed pieces of work: this iteration's generation, training, publishing, and evaluations that finished."""
    # multi-turn episodes (grpo_kit.metrics.episode_metrics): present only when the batch's completions
    # are episodes; "per episode" is a mean over the batch's episodes
    episodes: int
    """Completions of the batch that are multi-turn episodes."""
    turns_mean: float
    """Model turns per episode."""
    turns_max: int
    """The most turns an episode took."""
    tool_rate: float
    """Share of the episodes that called a tool."""
    tool_calls_mean: float
    """Tool calls per episode (good or not)."""
    tool_errors_mean: float
    """Failed tool calls per episode."""
    tool_errors_by_kind: dict[str, int]
    """Failed tool calls by kind (:data:`grpo_kit.tools.ERROR_KINDS`), summed over the episodes."""
    model_tokens_mean: float
    """Tokens the policy sampled per episode (their sum is ``completion_tokens``)."""
    env_tokens_mean: float
    """Environment and template tokens per episode (in the streams, not trained on)."""
    env_tokens: int
    """Environment and template tokens, summed over the episodes."""
    end_answered: int
    """Episodes that ended on a turn without a tool call."""
    end_max_turns: int
    """Episodes whose last allowed turn still called tools."""
    end_budget: int
    """Episodes that ran out of tokens (a turn's limit, ``max_episode_tokens`` or the context)."""
    end_error: int
    """Episodes the environment broke (``reset`` or the rendering of its answers raised)."""


def schema_keys() -> frozenset[str]:
    """Every key the record types declare (metrics, spans, evaluations, samples, episode accounts)."""
    return frozenset().union(*(t.__annotations__ for t in (MetricsRecord, Span, EvalResult, Sample, EpisodeAccount)))


SAMPLES_PER_ITERATION = 3
"""Completions of each iteration kept in ``samples.jsonl``."""


def samples_of(iteration: int, rollouts: Sequence[RolloutSummary]) -> list[Sample]:
    """The :class:`Sample` s of an iteration for ``samples.jsonl``: three completions spread over the
    batch, each with its episode (:class:`EpisodeAccount`) when it is a multi-turn one."""
    picked = rollouts[:: max(1, len(rollouts) // SAMPLES_PER_ITERATION)][:SAMPLES_PER_ITERATION]
    out: list[Sample] = []
    for r in picked:
        sample: Sample = {"iteration": iteration, "prompt": r.prompt_id, "completion": r.text, "reward": r.reward,
                          "gold": r.gold, "version": r.version}
        if r.episode is not None:
            sample["episode"] = r.episode
        if r.reward_extra:
            sample["extra"] = r.reward_extra
        out.append(sample)
    return out


# ---------------------------------------------------------------- the run directory


@dataclass(frozen=True)
class RunFiles:
    """The files of a run directory."""

    root: Path
    """The run directory (``RunConfig.run_dir``)."""

    @property
    def metrics(self) -> Path:
        """One :class:`MetricsRecord` per line."""
        return self.root / "metrics.jsonl"

    @property
    def samples(self) -> Path:
        """Three :class:`Sample` s per iteration."""
        return self.root / "samples.jsonl"

    @property
    def rollouts(self) -> Path:
        """Every completion's :class:`~grpo_kit.rollout.RolloutSummary`, every ``rollouts_every`` iterations."""
        return self.root / "rollouts.jsonl"

    @property
    def config(self) -> Path:
        """The run's config and its task's description."""
        return self.root / "config.json"

    @property
    def summary(self) -> Path:
        """The run's final numbers, written at the end."""
        return self.root / "summary.json"

    @property
    def report(self) -> Path:
        """The HTML report's default path."""
        return self.root / "report.html"


def run_files(run_dir: str | os.PathLike) -> RunFiles:
    """The :class:`RunFiles` of ``run_dir``."""
    return RunFiles(Path(run_dir))


# ---------------------------------------------------------------- JSONL


def append_jsonl(path: Path, rows: Iterable[dict]) -> None:
    """Append ``rows`` to a JSONL file, one line each, and flush."""
    with open(path, "a") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
        f.flush()


def write_jsonl(path: Path, rows: Iterable[dict]) -> None:
    """Replace a JSONL file's contents with ``rows``, atomically: a write that fails (a full disk) or
    is killed leaves the old file whole."""
    tmp = path.with_name(path.name + ".write")
    try:
        tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def read_jsonl(path: Path, *, stop_at_bad_line: bool = False) -> list[dict[str, Any]]:
    """Rows of a JSONL file (``[]`` when it is missing).

    The last line may be half written (a run in progress, or a crash mid-write): it is dropped.
    An unreadable line elsewhere is skipped with a warning or, with ``stop_at_bad_line`` (what the
    driver uses on resume), ends the rows there.
    """
    if not path.is_file():
        return []
    if stop_at_bad_line:
        out = []
        for line in path.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                break  # a half-written last line from a crash
        return out
    lines = [ln for ln in path.read_text(encoding="utf-8", errors="replace").splitlines() if ln.strip()]
    rows = []
    for i, line in enumerate(lines):
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            if i < len(lines) - 1:
                warnings.warn(f"{path}: skipping unreadable line {i + 1}", stacklevel=3)
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows


def trim_jsonl(path: Path, keep: Callable[[dict], bool]) -> int:
    """Rewrite a JSONL file with the lines for which ``keep(record)`` holds, streaming (a long run's
    ``rollouts.jsonl`` holds hundreds of MB; nothing is read whole). Stops at a half-written last
    line (a crash mid-write). Returns the number of lines kept."""
    if not path.exists():
        return 0
    tmp = path.with_name(path.name + ".trim")
    kept = 0
    with open(path) as src, open(tmp, "w") as dst:
        for line in src:
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                break
            if keep(rec):
                dst.write(line if line.endswith("\n") else line + "\n")
                kept += 1
    os.replace(tmp, path)
    return kept


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object, or ``{}`` when the file is missing or not (yet) complete."""
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except (FileNotFoundError, json.JSONDecodeError):
        return {}
    return obj if isinstance(obj, dict) else {}


def load_run(run_dir: str | os.PathLike) -> dict[str, Any]:
    """``{"records", "config", "summary", "samples"}`` of a run directory; missing files read as empty."""
    files = run_files(run_dir)
    return {
        "records": read_jsonl(files.metrics),
        "config": read_json(files.config),
        "summary": read_json(files.summary),
        "samples": read_jsonl(files.samples),
    }
