"""The task contract: problems to train and evaluate on, and the rewards that score completions.

A :class:`Task` is a name, a way to draw problems (:class:`~grpo_kit.data.Problem` rows) for the
``"train"`` and ``"heldout"`` splits, the answer-format instruction its prompts end with, and one or
more reward functions with weights. Reward functions are called as TRL's ``GRPOTrainer`` calls them,
with keywords only::

    reward(prompts=[...], completions=[...], completion_ids=[[...], ...], gold=[...], **columns)

``prompts`` are the questions, ``completions`` the sampled texts (stop strings and EOS removed),
``completion_ids`` each completion's sampled token ids (a list of int lists; None where the caller
has no token ids), and ``gold`` plus every column of the problems' ``columns`` dict come by name,
each as a list aligned with ``completions``. So ``def r(prompts, completions, **kwargs)``,
``def r(completions, answer, **kwargs)`` (TRL's and Unsloth's docs) and ``def r(completion_ids,
**kwargs)`` (TRL's length and repetition rewards) all bind; functions should accept ``**kwargs`` for
the arguments they ignore. A function may be ``async def`` (it is awaited, as TRL does). TRL's three
other keywords come too:

- ``trainer_state``: a :class:`TrainingProgress` (frozen): ``global_step`` (the iteration whose batch
  is scored, i.e. the optimizer steps before the one that trains on it), ``max_steps`` (the run's
  iterations), ``version`` (the adapter version that sampled the completions; with pipelining it
  can lag ``global_step``) and ``mode`` (``"train"`` or ``"eval"``; in evaluation ``global_step``
  is the evaluated version). It is not transformers' ``TrainerState``: ``epoch``, ``log_history``
  and the rest are not there (reading one raises, and that function's batch scores 0 with the reason).
- ``log_extra(column, values)``: one value per completion of the batch, kept in each completion's
  ``reward_extra`` (``rollouts.jsonl``, the samples in ``samples.jsonl`` and the report), as TRL
  adds them to its completions table. A column logged twice in a batch keeps the last values.
- ``log_metric(name, value)``: one finite number for the batch; the record's ``reward_metrics[name]``
  is the mean of the values logged for the iteration's batch (TRL averages over a logging step), and
  the report lists them. What a function logs counts only when it returns a score list (a function
  that raises or times out logs nothing); values logged in evaluation are not recorded.

Those names, like ``prompts``, ``completions`` and ``completion_ids`` (:data:`RESERVED`), are
reserved and a column so named is refused. A function may return
:class:`~grpo_kit.reward.RewardResult` items instead of floats, to give a parsed value, a reason and
its own correctness rule. ``None`` (or NaN) means "does not apply": that component counts 0 in the
sum. A completion that every function passed over (all None, none failing) is *unscorable*, as in
TRL: its reward is None, it is left out of its group's baseline and spread, and its advantage is 0
(:func:`grpo_kit.algorithms.compute_advantages`). A function that fails still scores 0, so a
completion that breaks a reward is never spared the penalty. A value beyond ``MAX_ABS_REWARD`` (1e9) is
clipped to it.

Conversational prompts (a problem's ``messages``, TRL's conversational format; see
:func:`~grpo_kit.tasks.rows.from_rows`): as TRL decides it from the first prompt of the batch,
``prompts`` are then the conversations (lists of messages) and each completion is a list of messages,
``[{"role": "assistant", "content": text}]``, so ``completion[0]["content"]`` (TRL's shipped rewards,
its docs' and Unsloth's) reads the text; the kit's own rewards take either form (:func:`text_of`).

Multi-turn tasks: a task with ``tools`` (plain functions, TRL's ``tools=``) or an
``environment_factory`` (a class, TRL's ``environment_factory=``) trains on episodes
(:mod:`grpo_kit.episode`, limits in ``Config.episode``). Their reward functions run on the rollout
worker right after the episodes end, called the same way: ``completions`` are the final
assistant messages' texts for text prompts, and for conversational prompts, as TRL gives tool
episodes, the messages after the prompt (``{"role": "assistant", "content"}`` for each model turn,
``{"role": "tool", "name", "content"}`` for each tool answer; unlike TRL's, an assistant message's
content is the turn's text with its tool-call markup, and there is no parsed ``tool_calls`` key).
Three more columns come beside the problem's: ``environments`` (each
episode's live environment instance, as TRL passes them; None without a factory), ``env_reward``
(each environment's ``get_reward()``, None where it has none or it raised) and ``episodes`` (each
episode's account: turns, tool calls and errors, end reason, token counts, the conversation; see
:attr:`grpo_kit.rollout.Scored.episode`). As in TRL, an environment whose class defines
``get_reward`` owns a reward: :func:`env_reward` is added after the task's reward functions (weight
1, named after the class) unless they already hold it, and a task whose only reward source would be
an environment without ``get_reward`` is refused (TRL: "No reward source provided").

The reward of a completion is the weighted sum of its components. Accuracy (training and held-out)
reads the first reward: its ``RewardResult.correct`` (and ``lenient_correct``) where it returns
those, else ``score >= correct_at``. :class:`Scorer` applies all of this on a Dask worker, and never
lets one bad function stop the run (see :meth:`Scorer.score`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import inspect
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..data import Problem
from ..reward import LENIENT_RULES, RewardResult
from ..tools import exception_text

RewardFn = Callable[..., Sequence[Any]]
"""``reward(*, prompts, completions, completion_ids, **columns) -> list[float | RewardResult | None]``
(called with keywords, as TRL calls reward functions)."""

RESERVED = ("prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric")
"""Argument names of TRL's reward call, all passed (module docstring); no column may take one."""

SPLITS = ("train", "heldout")


def reward_name(fn: Callable) -> str:
    """A reward function's name as recorded in the run (``module:qualname``; ``__main__`` for a
    function defined in a notebook cell)."""
    if isinstance(fn, functools.partial):
        return reward_name(fn.func)
    return f"{getattr(fn, '__module__', None) or '?'}:{getattr(fn, '__qualname__', None) or type(fn).__name__}"


@dataclass
class Task:
    """A dataset and how completions on it are scored (see the module docstring)."""

    name: str
    """Recorded in the run's ``config.json`` and records."""
    problems: Callable[[str, int, int], Sequence[Problem]]
    """``(split, n, seed) -> problems``; ``split`` is ``"train"`` or ``"heldout"``; ``n`` caps the count."""
    rewards: Sequence[RewardFn] = ()
    """Reward functions (TRL's signature); the first one defines accuracy. An ``environment_factory``
    whose class defines ``get_reward`` adds :func:`env_reward` after them (TRL's rule; the only reward
    when this is empty)."""
    weights: Sequence[float] | None = None
    """One weight per reward function (the added :func:`env_reward` weighs 1 unless weighted here); None weighs each 1."""
    instruction: str = ""
    """The answer-format instruction after each question (``PromptConfig.instruction`` overrides it)."""
    correct_at: float = 1.0
    """A first reward that returns plain floats counts a completion correct when its score is at least this."""
    names: Sequence[str] | None = None
    """Component names for the records and plots; None uses the functions' ``__name__``."""
    tools: Sequence[Callable] = ()
    """Tool functions (type hints and a Google-style docstring, as TRL and transformers take them):
    with tools or an environment the task trains on multi-turn episodes (module docstring)."""
    environment_factory: Callable[[], Any] | None = None
    """Makes one environment per episode (TRL's shape: ``reset(**row)``, public methods as tools,
    optional ``get_reward()``); None: tools only."""
    tool_parser: Any = None
    """Tool-call format: a ``grpo_kit.tools.PARSERS`` name or an object with ``parse(text) ->
    list[ToolCall]``; None: the renderer's (Hermes for chat templates, plain for the tiny model)."""

    def __post_init__(self) -> None:
        if self.environment_factory is not None and not callable(self.environment_factory):
            raise TypeError(f"task {self.name!r}: environment_factory {self.environment_factory!r} is not callable")
        owner = environment_class(self.name, self.environment_factory) if self.environment_factory is not None else None
        if owner is not None and callable(getattr(owner, "get_reward", None)) and env_reward not in self.rewards:
            given = len(self.rewards)  # TRL: the environment's get_reward is one more reward, weight 1
            self.rewards = [*self.rewards, env_reward]
            if self.weights is not None and len(self.weights) == given:
                self.weights = [*self.weights, 1.0]
            if self.names is not None and len(self.names) == given:
                self.names = [*self.names, owner.__name__]
        if not self.rewards:
            raise ValueError(f"task {self.name!r} has no reward source: pass reward functions, or an "
                             "environment_factory whose environment defines get_reward()" if owner is not None
                             else f"task {self.name!r} has no reward function")
        for fn in self.tools:
            if not callable(fn):
                raise TypeError(f"task {self.name!r}: tool {fn!r} is not callable")
        for fn in self.rewards:
            if not callable(fn):
                raise TypeError(f"task {self.name!r}: reward {fn!r} is not callable")
        if self.weights is not None and len(self.weights) != len(self.rewards):
            raise ValueError(f"task {self.name!r}: {len(self.weights)} weights for {len(self.rewards)} reward functions")
        if self.weights is not None and not all(isinstance(w, (int, float)) and math.isfinite(w) for w in self.weights):
            raise ValueError(f"task {self.name!r}: weights must be finite numbers, got {list(self.weights)}")
        if self.names is not None and len(self.names) != len(self.rewards):
            raise ValueError(f"task {self.name!r}: {len(self.names)} names for {len(self.rewards)} reward functions")

    @property
    def multi_turn(self) -> bool:
        """Whether the task trains on multi-turn episodes (it has tools or an environment)."""
        return bool(self.tools) or self.environment_factory is not None

    def load(self, split: str, n: int, seed: int = 0) -> list[Problem]:
        """The split's problems, checked: a task that returns none (or not ``Problem`` rows) raises."""
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        out = list(self.problems(split, n, seed))
        if not out:
            raise ValueError(f"task {self.name!r} has no {split} problems")
        bad = [p for p in out[:5] if not isinstance(p, Problem)]
        if bad:
            raise TypeError(f"task {self.name!r}: problems must be grpo_kit.data.Problem, got {type(bad[0]).__name__}")
        return out[:n]

    def scorer(self, timeout_s: float = 60.0, max_steps: int | None = None) -> Scorer:
        names = list(self.names) if self.names is not None else [getattr(f, "__name__", f"reward{i}") for i, f in enumerate(self.rewards)]
        if len(set(names)) != len(names):
            names = [f"{n}_{i}" for i, n in enumerate(names)]
        weights = list(self.weights) if self.weights is not None else [1.0] * len(self.rewards)
        return Scorer(list(self.rewards), weights, names, self.correct_at, timeout_s, max_steps)

    def describe(self) -> dict:
        """What ``config.json`` records about the task."""
        sc = self.scorer()
        out = {"name": self.name, "rewards": [reward_name(f) for f in self.rewards], "components": sc.names,
               "weights": sc.weights, "instruction": self.instruction, "correct_at": self.correct_at}
        if self.multi_turn:
            out.update(tools=[reward_name(f) for f in self.tools],
                       tool_parser=self.tool_parser if isinstance(self.tool_parser, str | None) else reward_name(type(self.tool_parser)),
                       environment=reward_name(self.environment_factory) if self.environment_factory else None)
        return out


@dataclass(frozen=True)
class TrainingProgress:
    """What reward functions get as ``trainer_state`` (TRL passes transformers' ``TrainerState``):
    where the run is, as far as the kit knows it where the rewards run."""

    global_step: int
    """The iteration whose batch is scored: the optimizer steps before the one that trains on it
    (TRL's ``global_step`` when it generates). In evaluation: the evaluated adapter version."""
    max_steps: int | None = None
    """The run's iterations (``RunConfig.iterations``); None outside a run."""
    version: int | None = None
    """The adapter version that sampled the completions (0: the base model)."""
    mode: str = "train"
    """``"train"`` or ``"eval"``."""


class RewardLog:
    """What reward functions logged for one batch of ``n`` completions through ``log_extra`` and
    ``log_metric`` (module docstring): ``extra`` maps a column to its ``n`` values, ``metrics`` a
    name to the values logged for it."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.extra: dict[str, list] = {}
        self.metrics: dict[str, list[float]] = {}
        self.closed = False

    def log_extra(self, column: str, values: Sequence) -> None:
        """Log a column of one value per completion (TRL's ``log_extra``). Values that are not JSON
        are kept as their ``str``; a non-finite float as None."""
        if self.closed:
            return  # a function that timed out, still running
        if not isinstance(column, str) or not column:
            raise TypeError(f"log_extra: the column name must be a non-empty string, got {column!r:.40}")
        sized = hasattr(values, "__len__") and hasattr(values, "__iter__") and not isinstance(values, str | bytes | dict)
        if not sized or len(values) != self.n:  # a list, a tuple, an array
            got = f"{len(values)} values" if sized else type(values).__name__
            raise ValueError(f"log_extra({column!r}): expected a list of {self.n} values (one per completion), got {got}")
        self.extra[column] = [_jsonable(v.item() if hasattr(v, "item") and not isinstance(v, dict) else v) for v in values]

    def log_metric(self, name: str, value: float) -> None:
        """Log one number for the batch (TRL's ``log_metric``)."""
        if self.closed:
            return
        if not isinstance(name, str) or not name:
            raise TypeError(f"log_metric: the name must be a non-empty string, got {name!r:.40}")
        v, why = _value(value)
        if v is None:
            raise ValueError(f"log_metric({name!r}): {why or 'got None'}".replace("returned", "got"))
        self.metrics.setdefault(name, []).append(v)

    def merge(self, other: RewardLog) -> None:
        """Add what one function logged (its columns replace same-named ones)."""
        self.extra.update(other.extra)
        for k, vs in other.metrics.items():
            self.metrics.setdefault(k, []).extend(vs)

    def row(self, i: int) -> dict | None:
        """Completion ``i``'s logged columns (None when nothing was logged)."""
        return {k: v[i] for k, v in self.extra.items()} or None


def _jsonable(v):
    if isinstance(v, float) and not math.isfinite(v):
        return None
    try:
        json.dumps(v, allow_nan=False)
    except (TypeError, ValueError):
        return str(v)
    return v


def text_of(completion) -> str:
    """A completion's text, in either form: text, or TRL's conversational form (the last assistant
    message's content).

    >>> text_of("#### 4"), text_of([{"role": "assistant", "content": "#### 4"}])
    ('#### 4', '#### 4')
    """
    if isinstance(completion, str):
        return completion
    if not isinstance(completion, list | tuple) or not all(isinstance(m, dict) for m in completion):
        raise TypeError(f"a completion is a str or a list of messages, got {type(completion).__name__}")
    return next((m.get("content") or "" for m in reversed(completion) if m.get("role") == "assistant"), "")


@dataclass(frozen=True)
class Score:
    """One completion's reward and what it is made of."""

    reward: float | None
    """The weighted sum of the components (0 where a component failed or did not apply); None where
    no component applied and none failed (the completion is unscorable: module docstring)."""
    components: dict
    """Component name -> its score (None where it did not apply or failed)."""
    reason: str
    """The first reward's reason, or why a component failed."""
    correct: bool
    lenient_correct: bool
    errors: int = 0
    """Components that raised, timed out or returned something that is not a score."""
    answer: Any = None
    """The first reward's extracted answer (its ``RewardResult.parsed``), None where it returned a
    plain number, read none, or read one only leniently (:data:`~grpo_kit.reward.LENIENT_RULES`: a
    review found maj@k moved with ``lenient_credit``): what maj@k votes on (:mod:`grpo_kit.passk`)."""


@dataclass
class Scorer:
    """Applies a task's rewards to a batch, on whichever worker runs it (it pickles with cloudpickle,
    so functions defined in a notebook cell travel too)."""

    rewards: list
    weights: list
    names: list
    correct_at: float = 1.0
    timeout_s: float = 60.0
    """Bound on one reward function's call for one batch. A function that runs past it scores the
    batch 0 with reason "timed out"; its thread cannot be killed and is left to finish (rewards that
    can hang, like code execution, bound themselves at process level: see :mod:`grpo_kit.sandbox`)."""
    max_steps: int | None = None
    """The run's iterations, for ``trainer_state.max_steps``."""
    _pool: Any = field(default=None, repr=False, compare=False)

    def __getstate__(self):
        return {k: v for k, v in self.__dict__.items() if k != "_pool"}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._pool = None

    def _call(self, fn, kwargs, stage: RewardLog):
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="reward")
        fut = self._pool.submit(call_reward, fn, {**kwargs, "log_extra": stage.log_extra, "log_metric": stage.log_metric})
        try:
            return fut.result(timeout=self.timeout_s), None
        except concurrent.futures.TimeoutError:
            self._pool.shutdown(wait=False)  # the hung thread keeps one pool; the next call gets a new one
            self._pool = None
            return None, f"timed out after {self.timeout_s:g} s"
        except KeyboardInterrupt:
            raise
        except BaseException as e:  # noqa: BLE001 - a user's reward: any error (SystemExit, an async reward's
            # CancelledError too) is this batch's failure, recorded
            return None, f"raised {exception_text(e)}"[:300]
        finally:
            stage.closed = True

    def progress(self, global_step: int, version: int | None = None, mode: str = "train") -> TrainingProgress:
        """The ``trainer_state`` of a batch (:class:`TrainingProgress`)."""
        return TrainingProgress(int(global_step), self.max_steps, version, mode)

    def score(self, prompts: Sequence, completions: Sequence, columns: dict[str, list],
              completion_ids: Sequence[Sequence[int]] | None = None, *,
              state: TrainingProgress | None = None, log: RewardLog | None = None) -> list[Score]:
        """Score a batch: each reward function is called with the keywords ``prompts``,
        ``completions``, ``completion_ids`` (None when not given), every column by name,
        ``trainer_state`` (``state``; default: step 0 of a run of ``max_steps``), ``log_extra`` and
        ``log_metric`` (what they log goes to ``log``; see the module docstring). ``prompts`` and
        ``completions`` go as given (:meth:`score_problems` puts them in TRL's form). A function that
        raises, hangs, returns the wrong number of items or an item that is neither a finite number, a
        ``RewardResult`` nor None scores those completions 0 for that component, with the reason, and
        counts as an error; the other components still count. A completion that no component scored
        and none failed on gets reward None (unscorable)."""
        n = len(completions)
        clash = sorted(set(columns) & set(RESERVED))
        if clash:
            raise ValueError(f"column(s) {clash} clash with reward arguments of those names; rename them")
        if completion_ids is not None and len(completion_ids) != n:
            raise ValueError(f"{len(completion_ids)} completion_ids for {n} completions")
        log = log if log is not None else RewardLog(n)
        kwargs = {"prompts": list(prompts), "completions": list(completions),
                  "completion_ids": None if completion_ids is None else [list(ids) for ids in completion_ids],
                  "trainer_state": state if state is not None else self.progress(0), **columns}
        comps: list[list[float | None]] = []
        firsts: list[RewardResult | None] = [None] * n
        reasons: list[str | None] = [None] * n
        errors = [0] * n
        for k, fn in enumerate(self.rewards):
            stage = RewardLog(n)
            out, err = self._call(fn, kwargs, stage)
            if err is None:  # a numpy array or a tensor is taken as TRL iterates it
                got, out = out, as_list(out)
                if out is None:
                    err = f"returned {type(got).__name__}, expected a list of {n}"
                elif len(out) != n:
                    err = f"returned {len(out)} values, expected a list of {n}"
            if err is None:
                log.merge(stage)
            vals: list[float | None] = []
            for i in range(n):
                v, why = (None, err) if err else _value(out[i])
                if why:
                    errors[i] += 1
                    reasons[i] = reasons[i] or f"{self.names[k]}: {why}"
                elif v is not None and abs(v) > MAX_ABS_REWARD:  # order kept, no overflow downstream
                    reasons[i] = reasons[i] or f"{self.names[k]}: {v:g} clipped to {math.copysign(MAX_ABS_REWARD, v):g}"
                    v = math.copysign(MAX_ABS_REWARD, v)
                if k == 0 and err is None and isinstance(out[i], RewardResult):
                    firsts[i] = out[i]
                vals.append(v)
            comps.append(vals)
        scores = []
        for i in range(n):
            applied = errors[i] or any(c[i] is not None for c in comps)  # a failure counts 0, not "unscorable"
            total = sum(w * (c[i] or 0.0) for w, c in zip(self.weights, comps, strict=True)) if applied else None
            if total is not None and abs(total) > MAX_ABS_REWARD:  # (large weights)
                total = math.copysign(MAX_ABS_REWARD, total)
            first = firsts[i]
            if first is not None:
                ok, lenient, reason = first.correct, first.lenient_correct, first.reason
            else:
                v0 = comps[0][i]
                ok = lenient = v0 is not None and v0 >= self.correct_at
                reason = f"{self.names[0]}={v0:g}" if v0 is not None else f"{self.names[0]} did not apply"
            scores.append(Score(None if total is None else float(total), {nm: c[i] for nm, c in zip(self.names, comps, strict=True)},
                                reasons[i] or reason, bool(ok), bool(lenient), errors[i],
                                first.parsed if first is not None and first.rule not in LENIENT_RULES else None))
        return scores

    def score_problems(self, problems: Sequence[Problem], completions: Sequence,
                       extra: dict[str, list] | None = None,
                       completion_ids: Sequence[Sequence[int]] | None = None, *,
                       state: TrainingProgress | None = None, log: RewardLog | None = None) -> list[Score]:
        """:meth:`score` with the prompts and columns taken from the problems (one per completion),
        plus ``extra`` columns (a multi-turn task's ``environments``, ``env_reward``, ``episodes``)
        and the completions' token ids where the caller has them. Prompts and completions take TRL's
        form (:func:`trl_form`)."""
        cols = problem_columns(problems)
        for k, v in (extra or {}).items():
            if k in cols:
                raise ValueError(f"problem column {k!r} clashes with the multi-turn column of that name; rename it")
            cols[k] = list(v)
        prompts, completions = trl_form(problems, completions)
        return self.score(prompts, completions, cols, completion_ids, state=state, log=log)


def trl_form(problems: Sequence[Problem], completions: Sequence) -> tuple[list, list]:
    """The prompts and completions as TRL hands them to rewards: text prompts and text completions,
    or, when the first problem is conversational (TRL's ``is_conversational`` on the first prompt),
    the conversations and each completion as a list of messages (a text becomes
    ``[{"role": "assistant", "content": text}]``; a list of messages, an episode's, stays as it is)."""
    if not problems or not problems[0].conversational:
        return [p.question for p in problems], list(completions)
    prompts = [[dict(m) for m in p.messages] if p.messages is not None else p.question for p in problems]
    return prompts, [[{"role": "assistant", "content": c}] if isinstance(c, str) else [dict(m) for m in c]
                     for c in completions]


def call_reward(fn: Callable, kwargs: dict) -> Any:
    """Call one reward function with keywords, as TRL does; an ``async def`` function (or any that
    returns an awaitable) is awaited in its own event loop (the scorer runs it in a worker thread)."""
    out = fn(**kwargs)
    if inspect.isawaitable(out):
        async def wait():
            return await out

        out = asyncio.run(wait())
    return out


def environment_class(task: str, factory: Callable[[], Any]) -> type:
    """The class of the environments ``factory`` makes: ``factory`` itself when it is a class, else
    the type of one instance made for the purpose (TRL probes each factory the same way)."""
    if isinstance(factory, type):
        return factory
    try:
        return type(factory())
    except Exception as e:
        raise ValueError(f"task {task!r}: environment_factory() raised {type(e).__name__} when probed for "
                         f"get_reward: {e}") from e


def env_reward(prompts, completions, env_reward=None, **kwargs) -> list[float]:
    """The environments' own rewards (``get_reward()``, recorded when each episode ended): the
    reward of a task that has an environment and no reward functions. An episode without one (it
    ended in an error, so ``get_reward`` was not called) scores 0: the policy can cause an error (a
    tool call that runs past its time limit), so an error must not spare it the penalty (one that
    ended before the policy acted, its environment failing to start, is made unscorable by
    :func:`grpo_kit.remote.score_episodes`). A reward that
    is not a finite number (an environment's NaN) scores 0 for the same reason: None or NaN here
    would make the episode unscorable, advantage 0, where it earned the penalty."""
    if env_reward is None:
        return [0.0] * len(completions)
    return [r if isinstance(r, (int, float)) and not isinstance(r, bool) and math.isfinite(r) else 0.0
            for r in env_reward]


def problem_columns(problems: Sequence[Problem]) -> dict[str, list]:
    """``gold`` and every extra column, each a list aligned with ``problems`` (a column a problem
    lacks is None there). ``gold`` is the problem's raw ``columns["gold"]`` where it has one (a rows
    task whose gold column is named ``gold``: TRL passes it unconverted), else :attr:`Problem.gold`."""
    keys = sorted({k for p in problems for k in p.columns} - {"gold"})
    cols = {"gold": [p.columns["gold"] if "gold" in p.columns else p.gold for p in problems]}
    for k in keys:
        if k in RESERVED:
            raise ValueError(f"problem column {k!r} clashes with a reward argument; rename it")
        cols[k] = [p.columns.get(k) for p in problems]
    return cols


def as_list(out) -> list | None:
    """A reward function's return value as a list: a list or tuple, or any other sized iterable that
    is not text or a mapping (a numpy array, a 1-D tensor; TRL iterates whatever it gets); None for
    anything else (a number, a string, a dict, a generator, a 0-d array)."""
    if isinstance(out, list | tuple):
        return list(out)
    if out is None or isinstance(out, str | bytes | dict) or not hasattr(out, "__len__") or not hasattr(out, "__iter__"):
        return None
    try:
        return list(out)
    except TypeError:  # a 0-d array or tensor has __len__ but no length
        return None


MAX_ABS_REWARD = 1e9
"""A reward component (and the weighted total) beyond this magnitude is clipped to it, with the
reason saying so: two rewards near 1e308 in a group (a distance reward against an answer of "1e308")
overflowed the group's mean, and the step failed on every retry until the run died; near 1e200 the
std overflowed and the whole group's advantages became 0 (a review, 2026-12-03). Clipping keeps the
order: such an answer is still the group's worst."""


def _value(x) -> tuple[float | None, str | None]:
    """A reward item as a float, None where the function did not score it (None or NaN, as TRL
    counts both), or the reason it is not a number."""
    if isinstance(x, RewardResult):
        x = x.score
    if x is None:
        return None, None
    if isinstance(x, str | bytes) or not hasattr(x, "__float__"):
        return None, f"returned {type(x).__name__} {x!r:.40}, not a number"
    try:
        v = float(x)
    except (TypeError, ValueError, OverflowError):  # 10**400, a huge Fraction: not a float
        return None, f"returned {str(x)[:40]!r}, not a number a float holds"
    if math.isnan(v):  # TRL's "did not apply" after it converts None to NaN
        return None, None
    if not math.isfinite(v):
        return None, f"returned {v}, not a finite number"
    return v, None

