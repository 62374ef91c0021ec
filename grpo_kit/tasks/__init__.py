"""Tasks as plug-ins: built-in ones by name, your own by import path or as a :class:`Task` object.

======================  ===============================================================
``"synthetic"``         seeded column addition (:mod:`.synthetic`), the tiny profile's task
``"gsm8k"``             GSM8K, scored by the ``####`` reward (:mod:`.gsm8k`)
``"math"``              final answers checked with math-verify (:mod:`.math`)
``"code"``              HumanEval, the completion's code run against the tests in a sandbox (:mod:`.code`)
``"calculator"``        multiplication with a ``multiply`` tool, multi-turn (:mod:`.calculator`)
``"guess_number"``      multi-turn: find a hidden number with a ``guess`` tool (higher/lower), :mod:`.guess`
``"pkg.module:fn"``     ``fn(**options)`` returns a :class:`Task`
======================  ===============================================================

The contract (problems, TRL-style reward functions, weights, accuracy) is in :mod:`.base`;
:func:`from_rows` builds a task from your own rows (a list of dicts, a ``datasets.Dataset``, a
JSONL/parquet file or a hub id) and reward functions, e.g. in a notebook cell.
"""

from __future__ import annotations

import dataclasses
import importlib
import warnings

from .base import RewardFn, RewardLog, Score, Scorer, Task, TrainingProgress, problem_columns, reward_name, text_of
from .rows import from_rows

BUILTIN = {
    "synthetic": "grpo_kit.tasks.synthetic:task",
    "gsm8k": "grpo_kit.tasks.gsm8k:task",
    "math": "grpo_kit.tasks.math:task",
    "code": "grpo_kit.tasks.code:task",
    "calculator": "grpo_kit.tasks.calculator:task",
    "guess_number": "grpo_kit.tasks.guess:task",
}

__all__ = ["BUILTIN", "RewardFn", "RewardLog", "Score", "Scorer", "Task", "TrainingProgress", "for_config", "from_rows",
           "load_callable", "problem_columns", "resolve", "reward_name", "text_of"]


def load_callable(spec: str):
    """``"package.module:name"`` -> the object (a task factory or a reward function)."""
    mod, sep, name = spec.partition(":")
    if not sep or not mod or not name:
        raise ValueError(f"expected 'package.module:name', got {spec!r}")
    try:
        obj = importlib.import_module(mod)
    except ImportError as e:
        raise ImportError(f"cannot import {mod!r} for {spec!r}: {e}") from e
    for part in name.split("."):
        if not hasattr(obj, part):
            raise AttributeError(f"{mod!r} has no {name!r} (from {spec!r})")
        obj = getattr(obj, part)
    return obj


def resolve(spec: str | Task, **options) -> Task:
    """The task named by ``spec`` (a built-in name or ``"package.module:factory"``), built with its options."""
    if isinstance(spec, Task):
        if options:
            raise ValueError("options apply to a task named by string, not to a Task object")
        return spec
    target = BUILTIN.get(spec, spec)
    if ":" not in target:
        raise ValueError(f"unknown task {spec!r}: use one of {sorted(BUILTIN)} or 'package.module:factory'")
    factory = load_callable(target)
    try:
        task = factory(**options)
    except TypeError as e:
        raise TypeError(f"task {spec!r}: bad options {sorted(options)}: {e}") from e
    if not isinstance(task, Task):
        raise TypeError(f"{target} returned {type(task).__name__}, not a grpo_kit.tasks.Task")
    return task


def _config_options(name: str, cfg) -> dict:
    """Options a built-in task takes from the config's data and reward fields."""
    d, r = cfg.data, cfg.reward
    arith = {"format_bonus": r.format_bonus, "lenient_credit": r.lenient_credit}
    if name == "synthetic":
        return {"n_digits": d.n_digits, "n_terms": d.n_terms, **arith}
    if name == "gsm8k":
        return {"source": d.dataset, **arith}
    if name == "calculator":
        return {"n_digits": d.n_digits, **arith}
    if name == "math" and d.dataset != "synthetic":
        return {"source": d.dataset}
    return {}


def for_config(cfg, task: Task | None = None) -> Task:
    """The run's task: ``task`` if given, else the one ``cfg.data.task`` names (built with the
    options the config supplies, then ``cfg.data.task_options``), plus ``cfg.reward.reward_functions``
    and ``cfg.reward.reward_weights``."""
    r = cfg.reward
    if task is None:
        name = cfg.data.task_name
        options = {**_config_options(name, cfg), **cfg.data.task_options}
        task = resolve(name, **options)
    elif cfg.data.task_options:
        raise ValueError("task_options apply to a task named in the config, not to a Task object passed in")
    else:
        options = {}
    ignored = [k for k in ("format_bonus", "lenient_credit") if getattr(r, k) and k not in options]
    if ignored:  # a profile's bonus meant for the #### reward does not reach another task's reward
        warnings.warn(f"reward.{' and reward.'.join(ignored)} apply to the synthetic, gsm8k and calculator tasks' "
                      f"#### reward only; task {task.name!r} does not take them (its rewards are its own)",
                      UserWarning, stacklevel=2)
    extra = [load_callable(f) for f in r.reward_functions]
    weights = list(task.weights) if task.weights is not None else [1.0] * len(task.rewards)
    weights += [1.0] * len(extra)
    if r.reward_weights:
        if len(r.reward_weights) != len(weights):
            raise ValueError(f"reward_weights has {len(r.reward_weights)} entries for {len(weights)} reward "
                             f"components ({task.name!r}'s {len(task.rewards)} + {len(extra)} reward_functions)")
        weights = list(r.reward_weights)
    if not extra and not r.reward_weights:
        return task
    names = list(task.names) if task.names is not None else [getattr(f, "__name__", f"reward{i}") for i, f in enumerate(task.rewards)]
    names += [getattr(f, "__name__", f"extra{i}") for i, f in enumerate(extra)]
    return dataclasses.replace(task, rewards=[*task.rewards, *extra], weights=weights, names=names)
