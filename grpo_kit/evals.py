"""Held-out evaluation during a run: which sets, when each version's evaluation goes out, and where its result lands.

The driver (:mod:`grpo_kit.loop`) submits an evaluation of every ``eval_every``-th published version
(and of the base model, version 0, before the first step) through :class:`Evaluations`: one
:func:`grpo_kit.remote.eval_task` per held-out set (the task's own and ``DataConfig.eval_sets``:
:func:`eval_set_tasks`), on the eval workers where there are any, else on the rollout workers behind
generation. Results are collected as they finish, never waited for mid-run, and attached to the
record of the iteration in which they arrived (:func:`attach`); the run's end waits for the last one.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping

from . import cluster as cl
from . import remote, tasks
from .config import Config
from .tasks import Task


def eval_set_tasks(cfg: Config, task: Task, given: Mapping[str, Task | str | dict] | None = None) -> dict[str, Task]:
    """The run's other held-out sets (``cfg.data.eval_sets``, then ``given``) as tasks by name: a task
    name or ``"package.module:factory"``, ``{"task": ..., **options}``, or a Task. Refused: a
    multi-turn task, and one whose instruction differs from ``task``'s unless ``cfg.prompt.instruction``
    sets one for all (the engines render every prompt with the run's instruction)."""
    out = {}
    for name, spec in {**cfg.data.eval_sets, **(given or {})}.items():
        if isinstance(spec, dict):
            opts = dict(spec)
            t = tasks.resolve(opts.pop("task"), **opts)
        else:
            t = tasks.resolve(spec)
        if t.multi_turn:
            raise ValueError(f"eval set {name!r}: multi-turn tasks ({t.name!r}) are not supported as extra eval sets")
        if cfg.prompt.instruction is None and t.instruction != task.instruction:
            raise ValueError(f"eval set {name!r}: its instruction {t.instruction!r} is not the run task's "
                             f"{task.instruction!r}; every prompt gets the run's, so set instruction= for all")
        out[name] = t
    return out


class Evaluations:
    """The evaluations a run has submitted and not yet collected.

    ``sets``: ``[(name, problems, scorer, episodes)]``, the task's own held-out set first (name None;
    ``episodes``: a multi-turn task's plan), then the other sets by name. ``seed``: the sampled
    evaluation's, one for every version, so versions differ by policy, not by draw. ``retries``
    (:class:`grpo_kit.remote.TaskRetries`) resubmits an evaluation whose workers died."""

    def __init__(self, client, cfg: Config, key: str, sets: list[tuple], retries, seed: int):
        self.client, self.cfg, self.key, self.sets = client, cfg, key, sets
        self.retries, self.seed = retries, seed
        # on its own workers where there are any (off the rollout engines), else after generation
        self.role = cl.EVAL if cl.workers_with(client, cl.EVAL) else cl.ROLLOUT
        self.pending: list = []  # (iteration, future)
        self.errors: list[dict] = []
        """Evaluations that failed (``iteration``, ``version``, ``error`` and ``set`` for another set),
        until :meth:`take_errors`: a failed evaluation loses its number, not the run."""
        self.set_of: dict = {}  # an evaluation future's key -> its set's name (the task's own: absent)

    def submit(self, iteration: int, version: int, only=None) -> None:
        """Evaluate ``version`` on every set (``only``: these set names; None names the task's own)
        (``iteration``: the one whose step published it; -1 for the base)."""
        r = self.cfg.run
        for name, probs, scorer, episodes in self.sets:
            if only is not None and name not in only:
                continue
            tag = f"-{name}" if name is not None else ""
            fut = self.client.submit(remote.eval_task, probs, version, self.cfg.sampling.max_new_tokens, scorer,
                                     episodes=episodes, samples=r.eval_samples, temperature=r.eval_temperature,
                                     seed=self.seed, key=f"{self.key}-eval{tag}-{iteration}-v{version}",
                                     resources={self.role: 1},
                                     retries=2, priority=-10)  # generation goes first when both wait for an engine
            self.pending.append((iteration, fut))
            if name is not None:
                self.set_of[fut.key] = name

    def due(self) -> list[tuple[int, int]]:
        """The (iteration, version) pairs whose evaluations are pending (every set's at once), for the
        run state: a resumed run submits them again (the results would otherwise be lost)."""
        return sorted({(it, version_of(f)) for it, f in self.pending})

    def missing(self, version: int, results) -> list:
        """The names of the sets (None: the task's own) without a result for ``version`` among ``results``."""
        have = {r.get("set") for r in results if r.get("version") == version}
        return [name for name, *_ in self.sets if name not in have]

    def versions(self) -> set[int]:
        """The adapter versions pending evaluations read (retention keeps them)."""
        return {version_of(f) for _, f in self.pending}

    def collect(self, block: bool = False) -> list[dict]:
        """The results finished now (``block``: all of them, waited for), each with its ``iteration``
        and, for another set than the task's own, its ``set``."""
        done = []
        for it, fut in list(self.pending):
            try:
                if not block and self.retries.retry_lost([fut]):
                    continue  # resubmitted: its workers died (KilledWorker)
            except Exception as e:  # noqa: BLE001 - TasksLost: past max_task_failures, as gather raises it below
                self.fail(it, fut, e)
                continue
            if block or fut.done():
                try:
                    res = self.retries.gather([fut])[0]
                except Exception as e:  # noqa: BLE001 - a held-out prompt too long for the engine, a reward bug
                    self.fail(it, fut, e)
                    continue
                res["iteration"] = it
                if fut.key in self.set_of:
                    res["set"] = self.set_of.pop(fut.key)
                done.append(res)
                self.pending.remove((it, fut))
        return done

    def cancel(self) -> None:
        """Cancel the evaluations still pending (a run that stops: the run state keeps them for a resume)."""
        futures = [f for _, f in self.pending]
        self.pending.clear()
        self.set_of.clear()
        if futures:
            self.client.cancel(futures)

    def fail(self, it: int, fut, e: Exception) -> None:
        """Record and warn of a failed evaluation and drop it: raised out of :meth:`collect`, it aborted
        the run before the step just trained was committed, and a resumed run submitted it again first
        and failed the same way."""
        err = {"iteration": it, "version": version_of(fut), "error": f"{type(e).__name__}: {e}"[:500]}
        name = self.set_of.pop(fut.key, None)
        if name is not None:
            err["set"] = name
        self.errors.append(err)
        self.pending.remove((it, fut))
        warnings.warn(f"the evaluation of adapter v{err['version']}{f' on {name}' if name else ''} failed "
                      f"({err['error']}); the run goes on without it", RuntimeWarning, stacklevel=3)

    def take_errors(self) -> list[dict]:
        """The failed evaluations since the last call (a metrics record's ``eval_errors``)."""
        out, self.errors = self.errors, []
        return out


def attach(rec: dict, res: dict) -> None:
    """An evaluation that finished during this iteration, into its record: the base model's (version
    0) is the baseline, any other is the held-out accuracy of the version it names."""
    rec.setdefault("evals", []).append(res)
    rec.setdefault("spans", []).append({"name": "eval", "iteration": res["iteration"], "start": res["start"], "end": res["end"]})
    if res["version"] > 0 and "set" not in res:  # another eval set's result stays in ``evals``
        rec["eval_acc"], rec["eval_version"] = res["acc"], res["version"]
        rec["eval_lenient_acc"] = res.get("lenient_acc")
        if "pass_at" in res:  # a sampled evaluation (eval_samples = k): pass@k at k, maj@k
            rec["eval_pass_at_k"], rec["eval_maj_acc"] = res["pass_at"][str(res["samples"])], res["maj_acc"]


def version_of(fut) -> int:
    """The adapter version of an evaluation future (its key ends in ``-v<version>``: :meth:`Evaluations.submit`)."""
    return int(str(fut.key).rsplit("-v", 1)[1])
