"""remote: the warm-up before the first batch on a real LocalCluster (one rollout, one trainer
worker), when a worker it was given has left the cluster."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from distributed import get_task_stream

from grpo_kit import cluster as cl
from grpo_kit import config, models, remote

CLUSTER_SHAPE = {"n_rollout_workers": 1, "n_trainer_workers": 1}
GONE = "tcp://127.0.0.1:9"
"""A worker address that is not in the cluster (a rollout worker that left during the warm-up)."""


def test_warm_up_leaves_out_a_worker_that_left_and_touches_no_other_role(client, tmp_path, monkeypatch):
    """The engine warm-up task of a rollout worker that is gone is dropped, not sent elsewhere.

    Before the fix it was pinned with ``allow_other_workers=True``: Dask then placed it on the
    trainer worker (the only other one), the scheduler's and the worker's state machines failed with
    ``KeyError: 'rollout'``, and a trainer worker was lost (test_loop's elastic-fleet test, 2 of 2
    trainers -> 1)."""
    cfg = config.profile("tiny", engine="hf", run_dir=str(tmp_path / "run"))
    remote.register_engines(client, cfg, models.resolve_model(cfg.model.model))
    [rollout] = cl.workers_with(client, cl.ROLLOUT)
    trainers = cl.workers_with(client, cl.TRAINER)
    monkeypatch.setattr(remote, "wait_until_warm", lambda c: [GONE, rollout])
    no_gang = SimpleNamespace(specs=list, workers=[])

    with get_task_stream(client) as stream:
        out = remote.warm_up(client, no_gang, 0, "warm-test")

    assert list(out) == [f"engine {rollout}"] and out[f"engine {rollout}"] > 0
    assert cl.workers_with(client, cl.TRAINER) == trainers  # the trainer worker is still there
    ran = {t["worker"] for t in stream.data if str(t["key"]).startswith("warm-test")}
    assert ran == {rollout}, ran  # the gone worker's task ran nowhere, the trainer ran none
    # and the cluster still places work by role
    assert client.submit(sum, [1, 2], resources={cl.TRAINER: 1}, pure=False).result(timeout=60) == 3


def test_gather_pinned_raises_a_failed_tasks_error(client):
    [trainer] = cl.workers_with(client, cl.TRAINER)
    bad = client.submit(int, "x", workers=[trainer], allow_other_workers=False, pure=False)
    try:
        remote.gather_pinned(client, {"bad": (trainer, bad)})
    except ValueError as e:
        assert "invalid literal" in str(e)
    else:
        raise AssertionError("gather_pinned returned past a failed task")


def test_waits_use_the_runs_client_when_it_is_not_the_default(client):
    """Review finding: gather_pinned and the gang's wait called distributed.wait, which looks up the
    default client: a run given ``Client(..., set_as_default=False)`` in a process with no other
    client failed with "No clients found". Checked in a fresh process, where no default exists."""
    import subprocess
    import sys

    code = f"""
from distributed import Client
from grpo_kit import cluster as cl, gang, remote
other = Client({client.scheduler.address!r}, set_as_default=False)
[trainer] = cl.workers_with(other, cl.TRAINER)
ok = other.submit(sum, [1, 2], workers=[trainer], allow_other_workers=False, pure=False)
print(remote.gather_pinned(other, {{"ok": (trainer, ok)}}), gang.wait_first_error([ok], timeout=30)[1])
other.close()
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split("\n")[-2] == "{'ok': 3} None"


def test_reward_task_passes_each_rollouts_completion_ids_to_the_rewards(monkeypatch):
    """In process, no cluster: the rewards get the rollouts' sampled token ids as TRL's
    ``completion_ids``, row by row (a length reward reads them)."""
    from grpo_kit.data import Problem
    from grpo_kit.tasks import Scorer

    seen = []

    def n_tokens(completions, completion_ids, **kwargs):
        seen.append(completion_ids)
        return [float(len(ids)) for ids in completion_ids]

    monkeypatch.setattr(remote, "get_worker", lambda: SimpleNamespace(address="in-process"))
    problems = [vars(Problem(id=f"p{i}", question=f"q{i}", gold="1")) for i in range(2)]
    ids = [[11, 12, 13], [21], [31, 32]]
    rows = [{"group_id": 5 + g, "text": t, "completion_ids": list(i)}
            for g, t, i in zip([0, 1, 1], ["a", "b", "c"], ids, strict=True)]
    out = remote.reward_task({"rollouts": rows}, problems, 5, Scorer([n_tokens], [1.0], ["n"]))
    assert seen == [ids]
    assert [r["reward"] for r in out["rollouts"]] == [3.0, 1.0, 2.0]
    assert out["reward_worker"] == "in-process"


def test_reward_task_on_conversational_rows_passes_trls_forms_state_and_logs(monkeypatch):
    """A conversational chunk: prompts as the conversations, completions as assistant messages,
    ``trainer_state`` from the chunk's iteration and version; what ``log_extra`` logs lands in each
    row, what ``log_metric`` logs in the chunk (which the driver's record averages)."""
    from grpo_kit.data import Problem
    from grpo_kit.tasks import Scorer

    seen = {}

    def r(prompts, completions, trainer_state, log_extra, log_metric, **kwargs):
        seen.update(prompts=prompts, completions=completions, state=trainer_state)
        log_extra("chars", [len(c[0]["content"]) for c in completions])
        log_metric("calls", 1.0)
        return [1.0] * len(completions)

    monkeypatch.setattr(remote, "get_worker", lambda: SimpleNamespace(address="in-process"))
    conv = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "q?"}]
    problems = [remote.problem_dict(Problem(id="p", question="q?", gold="1", messages=conv))]
    rows = [{"group_id": 0, "text": t, "completion_ids": [1], "iteration": 7, "version": 5} for t in ("ab", "c")]
    out = remote.reward_task({"rollouts": rows}, problems, 0, Scorer([r], [1.0], ["r"], max_steps=9))
    assert seen["prompts"] == [conv, conv]
    assert seen["completions"] == [[{"role": "assistant", "content": "ab"}], [{"role": "assistant", "content": "c"}]]
    assert (seen["state"].global_step, seen["state"].max_steps, seen["state"].version, seen["state"].mode) == (7, 9, 5, "train")
    assert [row["reward_extra"] for row in out["rollouts"]] == [{"chars": 2}, {"chars": 1}]
    assert out["reward_metrics"] == {"calls": [1.0]}


def test_score_episodes_passes_each_episodes_completion_ids_beside_the_environments():
    from grpo_kit.data import Problem
    from grpo_kit.tasks import Scorer

    seen = {}

    def r(completions, completion_ids, environments, env_reward, **kwargs):
        seen.update(ids=completion_ids, envs=environments, env_reward=env_reward)
        return [float(len(ids)) for ids in completion_ids]

    lives = [SimpleNamespace(env=f"env{i}", ep=SimpleNamespace(env_reward=0.5 * i, end_reason="answered", sampled_tokens=1))
             for i in range(2)]
    rows = [{"text": "a", "completion_ids": [1, 2, 3, 4], "episode": {}}, {"text": "b", "completion_ids": [5], "episode": {}}]
    probs = [Problem(id="p", question="q", gold="1")] * 2
    scores = remote.score_episodes(Scorer([r], [1.0], ["n"]), probs, lives, rows)
    assert seen == {"ids": [[1, 2, 3, 4], [5]], "envs": ["env0", "env1"], "env_reward": [0.0, 0.5]}
    assert [s.reward for s in scores] == [4.0, 1.0] == [row["reward"] for row in rows]
    # a conversational prompt: each episode's messages after the prompt, as TRL gives tool episodes
    # (an episode that broke before a turn: its text as the assistant message)
    turns = [{"role": "assistant", "content": "<tool_call>x</tool_call>"}, {"role": "tool", "name": "f", "content": "4"},
             {"role": "assistant", "content": "#### 4"}]
    rows = [{"text": "#### 4", "completion_ids": [1], "episode": {"messages": turns}},
            {"text": "", "completion_ids": [], "episode": {"messages": []}}]
    conv = [Problem(id="p", question="q", gold="4", messages=[{"role": "user", "content": "q"}])] * 2

    def last(prompts, completions, **kwargs):
        seen.update(prompts=prompts, completions=completions)
        return [float(c[-1]["content"] == "#### 4") for c in completions]

    scores = remote.score_episodes(Scorer([last], [1.0], ["last"]), conv, lives, rows)
    assert seen["completions"] == [turns, [{"role": "assistant", "content": ""}]]
    assert seen["prompts"] == [[{"role": "user", "content": "q"}]] * 2 and [s.reward for s in scores] == [1.0, 0.0]


def test_an_episode_whose_environment_failed_before_the_policy_acted_is_unscorable():
    """Review finding (2026-12-03): a reset that raised scored its episode 0, which moved the group's
    mean: three episodes that all earned 1.0 got advantages [0.5, 0.5, 0.5] beside a -1.5. An error
    after the policy sampled keeps its 0 (the policy may have caused it)."""
    import torch

    from grpo_kit import algorithms
    from grpo_kit.config import LossConfig
    from grpo_kit.data import Problem
    from grpo_kit.tasks import Scorer
    from grpo_kit.tasks.base import env_reward

    eps = [SimpleNamespace(env_reward=1.0, end_reason="answered", error=None, sampled_tokens=5),
           SimpleNamespace(env_reward=None, end_reason="error", error="reset raised ConnectionError: down", sampled_tokens=0),
           SimpleNamespace(env_reward=1.0, end_reason="answered", error=None, sampled_tokens=4),
           SimpleNamespace(env_reward=None, end_reason="error", error="multiply timed out", sampled_tokens=3)]
    lives = [SimpleNamespace(env=None, ep=ep) for ep in eps]
    rows = [{"text": "", "completion_ids": [1] * ep.sampled_tokens, "episode": {}} for ep in eps]
    scores = remote.score_episodes(Scorer([env_reward], [1.0], ["env"]), [Problem(id="p", question="q", gold="1")] * 4,
                                   lives, rows)
    assert [s.reward for s in scores] == [1.0, None, 1.0, 0.0] == [r["reward"] for r in rows]
    assert scores[1].reason == "not scored: reset raised ConnectionError: down (before the policy acted)"
    first3 = torch.tensor([float("nan") if s.reward is None else s.reward for s in scores[:3]])
    adv = algorithms.compute_advantages(algorithms.advantage("grpo"), first3, 3, LossConfig())
    assert adv.tolist() == [0.0, 0.0, 0.0]  # the episodes that ran earned one reward: nothing to learn


def test_sampled_eval_plays_k_episodes_per_problem_for_a_multi_turn_task():
    """In process, no cluster: with a multi-turn task the sampled evaluation plays ``samples``
    episodes of every problem (the rewards see each question that often) and gives pass@k and
    avg@k; the environment's reward extracts no answer, so maj@k is None, not 0."""
    from collections import Counter

    from grpo_kit import data, testing, tiny
    from grpo_kit.episode import EpisodePlan
    from grpo_kit.hf_engine import HFEngine
    from grpo_kit.tasks import Scorer

    task = testing.notes_task()
    cfg = config.profile("tiny", max_turns=2, max_turn_tokens=8, max_episode_tokens=64)
    seen = []

    def env(prompts, completions, env_reward, **kwargs):
        seen.extend(prompts)
        return list(env_reward)

    probs = data.synthetic_problems(3, split="heldout", seed=0)
    engine = HFEngine(str(tiny.ensure_tiny_model()), max_model_len=256)
    out = remote.sampled_eval(engine, probs, 0, 8, Scorer([env], [1.0], ["env"], correct_at=2.0),
                              EpisodePlan.of(task, cfg), 2, 1.0, seed=0)
    assert Counter(seen) == {p.question: 2 for p in probs}
    assert out["samples"] == 2 and list(out["pass_at"]) == ["1", "2"] and out["temperature"] == 1.0
    assert out["pass_at"]["1"] == pytest.approx(out["avg_acc"]) and 0 <= out["pass_at"]["1"] <= out["pass_at"]["2"] <= 1
    assert out["maj_acc"] is None and out["sample_reward_errors"] == 0
