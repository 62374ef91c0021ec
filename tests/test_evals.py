"""Held-out evaluation bookkeeping (grpo_kit.evals): the other sets, a result into its record, pending versions."""

from __future__ import annotations

import pytest

from grpo_kit import config, evals, tasks


def test_other_eval_sets_resolve_and_are_refused_clearly():
    task = tasks.resolve("synthetic")
    cfg = config.profile("tiny", eval_sets={"gsm8k-like": "synthetic", "sums4": {"task": "synthetic", "n_digits": 4}})
    other = tasks.Task("words", lambda split, n, seed: [], [lambda completions, **kw: [0.0] * len(completions)],
                       instruction="Answer in words.")
    got = evals.eval_set_tasks(cfg, task, {"mine": task})
    assert list(got) == ["gsm8k-like", "sums4", "mine"] and got["mine"] is task
    with pytest.raises(ValueError, match="multi-turn"):
        evals.eval_set_tasks(cfg, task, {"tools": "calculator"})
    with pytest.raises(ValueError, match="instruction 'Answer in words.' is not the run task's"):
        evals.eval_set_tasks(cfg, task, {"words": other})
    # one instruction for every prompt (PromptConfig.instruction): then any single-turn task goes
    assert evals.eval_set_tasks(cfg.override(instruction="Say it."), task, {"words": other})["words"] is other


def test_a_result_lands_in_its_record_as_the_versions_accuracy_unless_it_is_the_base_or_another_set():
    rec = {"spans": []}
    evals.attach(rec, {"version": 0, "acc": 0.25, "iteration": -1, "start": 1.0, "end": 2.0})
    assert "eval_acc" not in rec and rec["spans"] == [{"name": "eval", "iteration": -1, "start": 1.0, "end": 2.0}]
    evals.attach(rec, {"version": 3, "acc": 0.5, "set": "sums4", "iteration": 2, "start": 2.0, "end": 3.0})
    assert "eval_acc" not in rec  # another set's result stays in ``evals`` only
    evals.attach(rec, {"version": 3, "acc": 0.75, "lenient_acc": 0.8, "samples": 4, "pass_at": {"1": 0.7, "4": 0.9},
                       "maj_acc": 0.8, "iteration": 2, "start": 3.0, "end": 4.0})
    assert (rec["eval_acc"], rec["eval_version"], rec["eval_lenient_acc"]) == (0.75, 3, 0.8)
    assert (rec["eval_pass_at_k"], rec["eval_maj_acc"]) == (0.9, 0.8)  # pass@k at k = samples
    assert [e["version"] for e in rec["evals"]] == [0, 3, 3]


def test_a_result_lands_in_a_record_rebuilt_on_resume():
    """A record rebuilt from the store's manifest on resume (``checkpoint.recovered_records``) has no
    spans: the run's last evaluation, attached to it, must not fail the run's end."""
    from grpo_kit.checkpoint import STAT_KEYS

    rec = {"iteration": 3, "version": 4, "recovered": True, "reward_mean": None, "eval_acc": None,
           **dict.fromkeys(STAT_KEYS.values())}
    evals.attach(rec, {"version": 4, "acc": 0.5, "iteration": 3, "start": 1.0, "end": 2.0})
    assert rec["eval_acc"] == 0.5 and rec["spans"] == [{"name": "eval", "iteration": 3, "start": 1.0, "end": 2.0}]


def test_a_pending_evaluations_version_comes_from_its_key():
    class Fut:
        def __init__(self, key):
            self.key = key

    assert evals.version_of(Fut("abc-12-eval-sums-v4-3-v17")) == 17
    assert evals.version_of(Fut("abc-eval--1-v0")) == 0


def test_an_evaluation_lost_past_the_retry_budget_loses_its_number_not_the_run():
    """Review finding: between iterations (collect without blocking) the lost-task check ran outside
    the error handling, so an evaluation whose workers kept dying (TasksLost past max_task_failures)
    aborted the run before the trained step was committed; the blocking path recorded it."""
    import warnings

    from distributed.scheduler import KilledWorker

    from grpo_kit import remote

    class Lost:  # a Dask future whose workers died
        key, status = "run-eval-3-v4", "error"

        def done(self):
            return True

        def exception(self):
            return KilledWorker(self.key, "tcp://w", None)

    class Client:
        def gather(self, futures):
            raise KilledWorker(Lost.key, "tcp://w", None)

        def retry(self, futures):
            pass

    for block in (False, True):
        ev = evals.Evaluations.__new__(evals.Evaluations)
        ev.retries = remote.TaskRetries(Client(), max_failures=0)  # the budget is spent
        ev.pending, ev.errors, ev.set_of = [(3, Lost())], [], {}
        with warnings.catch_warnings(record=True):
            warnings.simplefilter("always")
            assert ev.collect(block=block) == []
        errors = ev.take_errors()
        assert ev.pending == [] and [(e["iteration"], e["version"]) for e in errors] == [(3, 4)]
        assert "TasksLost" in errors[0]["error"], errors


def test_a_stopped_run_cancels_its_pending_evaluations():
    """Review finding: a failed run cancelled its generations in flight but not its evaluations, which
    kept engine slots while a resumed run submitted them again (the run state names them)."""
    cancelled = []

    class Client:
        def cancel(self, futures):
            cancelled.extend(futures)

    class Fut:
        def __init__(self, key):
            self.key = key

    ev = evals.Evaluations.__new__(evals.Evaluations)
    ev.client = Client()
    a, b = Fut("run-eval-3-v4"), Fut("run-eval-3-v4-more")
    ev.pending, ev.set_of, ev.errors = [(3, a), (3, b)], {b.key: "more"}, []
    ev.cancel()
    assert cancelled == [a, b] and ev.pending == [] and ev.set_of == {}


def test_a_resumed_run_evaluates_each_pending_version_on_the_sets_without_a_result():
    """Review finding: the run state's pending evaluations are (iteration, version) for every set, but
    the resume checked the task's own set only: a version whose own result was in and another set's
    was not was never evaluated there (that set's acc_after None), and the converse ran twice."""
    from grpo_kit import config

    submitted = []

    class Client:
        def submit(self, fn, *args, key, **kw):
            submitted.append(key)
            return type("Fut", (), {"key": key})()

    ev = evals.Evaluations.__new__(evals.Evaluations)
    ev.client, ev.cfg, ev.key, ev.seed, ev.role = Client(), config.profile("tiny"), "run", 0, "rollout"
    ev.sets = [(None, [], None, None), ("sums4", [], None, None)]
    ev.pending, ev.set_of, ev.errors = [], {}, []
    own_in = [{"version": 0, "acc": 0.1}, {"version": 2, "acc": 0.3}]
    other_in = [{"version": 2, "acc": 0.2, "set": "sums4"}]
    assert ev.missing(2, own_in) == ["sums4"] and ev.missing(2, other_in) == [None]
    assert ev.missing(2, own_in + other_in) == [] and ev.missing(4, own_in) == [None, "sums4"]
    ev.submit(1, 2, only=ev.missing(2, own_in))
    ev.submit(1, 2, only=ev.missing(2, other_in))
    ev.submit(3, 4)
    assert submitted == ["run-eval-sums4-1-v2", "run-eval-1-v2", "run-eval-3-v4", "run-eval-sums4-3-v4"]
    assert ev.set_of == {"run-eval-sums4-1-v2": "sums4", "run-eval-sums4-3-v4": "sums4"}
