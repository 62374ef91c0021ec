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


def test_a_pending_evaluations_version_comes_from_its_key():
    class Fut:
        def __init__(self, key):
            self.key = key

    assert evals.version_of(Fut("abc-12-eval-sums-v4-3-v17")) == 17
    assert evals.version_of(Fut("abc-eval--1-v0")) == 0
