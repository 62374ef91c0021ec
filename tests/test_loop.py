"""The pipelined driver end to end on a real LocalCluster (worker processes), with faults injected.

These runs use the HF engine (a vLLM engine per test would add ~20 s each; the vLLM path is run
end to end by the notebook test and tests/test_vllm_engine.py).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import platform
import signal
import threading
import time
import types
import warnings
from collections import Counter
from pathlib import Path

import pytest

from grpo_kit import cluster as cl
from grpo_kit import config, gang, loop, records, remote, tasks
from grpo_kit.adapters import AdapterStore
from grpo_kit.metrics import WrongPolicyWarning

pytestmark = pytest.mark.timeout(600)


def _cfg(tmp_path, **kw):
    base = dict(engine="hf", iterations=3, eval_every=0, eval_size=16, prompts_per_step=4, group_size=4,
                max_new_tokens=40, run_dir=str(tmp_path / "run"), collective_timeout_s=30, lr=1e-3)
    base.update(kw)
    return config.profile("tiny", **base)


def _rollouts(run_dir):
    return [json.loads(line) for line in (run_dir / "rollouts.jsonl").read_text().splitlines()]


def _assert_groups_exact(run_dir, cfg):
    """Every iteration trained on each of its groups exactly once, each with group_size samples."""
    by_iter = {}
    for r in _rollouts(run_dir):
        by_iter.setdefault(r["iteration"], Counter())[(r["group_id"], r["sample_idx"])] += 1
    assert sorted(by_iter) == list(range(cfg.run.iterations))
    want = {(g, i): 1 for g in range(cfg.sampling.prompts_per_step) for i in range(cfg.sampling.group_size)}
    for it, counts in by_iter.items():
        assert dict(counts) == want, f"iteration {it}: groups lost or duplicated"


def _chain(store: AdapterStore):
    vs = store.versions()
    assert vs == list(range(1, len(vs) + 1))
    assert [store.manifest(v)["parent"] for v in vs] == list(range(0, len(vs)))
    return vs


CLUSTER_SHAPE = {"n_rollout_workers": 2, "n_trainer_workers": 2}
"""The ``client`` fixture's cluster (conftest.py): two rollout workers, a DDP gang of two."""


def _kill_when(client, part: str, results: list, after: float = 0.0, timeout: float = 120):
    """Start a thread that SIGKILLs the worker process running a task whose key contains ``part``."""
    pids = client.run(os.getpid)

    def watch():
        time.sleep(after)
        deadline = time.time() + timeout
        while time.time() < deadline:
            for worker, keys in client.processing().items():
                if any(part in str(k) for k in keys) and worker in pids:
                    os.kill(pids[worker], signal.SIGKILL)
                    results.append(worker)
                    return
            time.sleep(0.02)

    t = threading.Thread(target=watch, daemon=True)
    t.start()
    return t


def _numeric_lists(x, in_record: bool = False) -> int:
    """How many non-empty lists of numbers ``x`` holds as fields of records (dict values, tuple
    items): token ids and log-probs, in a rollout dict or a trainer sample."""
    if in_record and isinstance(x, list) and x and all(type(v) in (int, float) for v in x):
        return 1
    if isinstance(x, dict):
        return sum(_numeric_lists(v, True) for v in x.values())
    if isinstance(x, (list, tuple)):
        return sum(_numeric_lists(v, isinstance(x, tuple)) for v in x)
    return 0


def _watch_driver(client, monkeypatch) -> list:
    """Record what the driver gathers from workers and puts in tasks' arguments or scatters."""
    seen = []
    for name in ("gather", "scatter", "submit"):
        fn = getattr(client, name)

        def wrapped(*args, _fn=fn, _name=name, **kwargs):
            out = _fn(*args, **kwargs)
            seen.append((_name, out if _name == "gather" else (args, kwargs)))
            return out

        monkeypatch.setattr(client, name, wrapped)
    return seen


def test_pipelined_run_records_and_chain(tmp_path, client, monkeypatch):
    # no pre-flight sweep here: its message sizes are a list of numbers the driver rightly sends
    cfg = _cfg(tmp_path, iterations=4, eval_every=2, world_size=2, preflight_sizes="", eval_samples=4)
    seen = []
    through_driver = _watch_driver(client, monkeypatch)
    sums4 = tasks.resolve("synthetic", n_digits=4)  # another held-out set (eval_sets), 4 problems to keep it cheap
    sums4 = dataclasses.replace(sums4, problems=lambda split, n, seed, t=sums4: t.problems(split, 4, seed))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        res = loop.run(cfg, client=client, callbacks=[seen.append], progress=False, eval_sets={"sums4": sums4})
    # the engines sampled with the adapters they claim: the wrong-policy check ran (kl_beta > 0, and
    # iterations 2-3 are one update behind a version >= 1) and said nothing
    assert not [w for w in caught if issubclass(w.category, WrongPolicyWarning)]
    assert all(r["base_mismatch_kl"] > 0 and r["wrong_policy"] is None for r in res.records[2:])
    assert res.summary["wrong_policy_iterations"] == 0
    # token ids and log-probs went from the rollout workers to both ranks, not through the driver
    assert cfg.cluster.world_size == 2 and any(name == "gather" for name, _ in through_driver)
    assert [name for name, x in through_driver if _numeric_lists(x)] == []
    rows = _rollouts(tmp_path / "run")
    assert not {"prompt_ids", "completion_ids", "logprobs"} & set(rows[0])
    assert all(r["prompt_tokens"] > 0 and r["completion_tokens"] > 0 for r in rows)
    assert sum(r["completion_tokens"] for r in rows) == sum(r["completion_tokens"] for r in res.records)
    assert [r["iteration"] for r in res.records] == [0, 1, 2, 3] and len(seen) == 4
    assert _chain(AdapterStore(cfg.run.store_root)) == [1, 2, 3, 4]
    # pipelined: batch N+1 was generated by the adapter from before step N, one version behind
    assert [r["staleness_max"] for r in res.records] == [0, 1, 1, 1]
    assert [r["rollout_version"] for r in res.records] == [0, 0, 1, 2]
    assert res.records[0]["ratio_mean"] == pytest.approx(1.0, abs=1e-4)  # on-policy first step
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["iteration"] for x in lines] == [0, 1, 2, 3]
    declared = records.schema_keys()  # every key the driver writes has its line in the record schema
    assert not {k for r in res.records for k in r} - declared
    assert not {k for r in res.records for e in r.get("evals", []) + r["spans"] for k in e} - declared
    for key in ("reward_mean", "ratio_min", "ratio_max", "clip_frac", "kl_mean", "grad_norm", "samples_nonzero_adv",
                "usable_samples", "usable_per_s", "truncated", "spans", "rejected_groups"):
        assert res.records[-1][key] is not None, key
    kinds = {s["name"] for r in res.records for s in r["spans"]}
    assert {"generate", "train", "publish", "eval"} <= kinds
    assert res.summary["acc_before"] is not None and res.summary["acc_after"] is not None
    assert res.summary["iterations"] == 4
    # eval_samples=4: every evaluation (base model's included) also sampled 4 completions per problem
    evals = [e for r in res.records for e in r.get("evals", [])]
    other = [e for e in evals if e.get("set") == "sums4"]  # eval_sets: another task's held-out set, beside
    evals = [e for e in evals if "set" not in e]
    assert sorted(e["version"] for e in evals) == [0, 2, 4] and sorted(e["version"] for e in other) == [0, 2, 4]
    assert {e["worker"] for e in evals + other} <= {"rollout-0", "rollout-1"}  # no eval workers: the rollout ones
    assert all(e["n"] == 4 and e["samples"] == 4 for e in other)
    assert all(e["unscored"] == 0 for e in evals + other)  # the arithmetic rewards score every completion
    assert res.summary["eval_sets"]["sums4"]["acc_after"] == next(e["acc"] for e in other if e["version"] == 4)
    assert res.summary["acc_after"] == next(e["acc"] for e in evals if e["version"] == 4)
    assert json.loads((tmp_path / "run" / "config.json").read_text())["eval_sets"]["sums4"]["name"] == "synthetic"
    for e in evals:
        p = e["pass_at"]
        assert e["samples"] == 4 and list(p) == ["1", "2", "4"] and e["temperature"] == 1.0
        assert p["1"] == pytest.approx(e["avg_acc"])  # c/n per problem, averaged: avg@k
        assert 0 <= p["1"] <= p["2"] <= p["4"] <= 1  # more tries never pass less
        assert e["maj_acc"] is not None and e["maj_acc"] <= p["4"]  # a right majority needs a right sample
    assert any(e["pass_at"]["4"] > e["pass_at"]["1"] for e in evals)  # sampled, not the greedy answer 4 times
    rec = next(r for r in res.records if r.get("eval_version") == 4)
    final = next(e for e in evals if e["version"] == 4)
    assert (rec["eval_pass_at_k"], rec["eval_maj_acc"]) == (final["pass_at"]["4"], final["maj_acc"])
    assert res.summary["pass_at_after"] == final["pass_at"] and res.summary["maj_acc_after"] == final["maj_acc"]
    assert res.summary["avg_acc_before"] == next(e for e in evals if e["version"] == 0)["avg_acc"]
    # engines and both ranks were built before the first iteration, and that time is kept apart
    warm = res.summary["warm_up_s"]
    assert sorted(k.split(" ")[0] for k in warm) == ["engine"] * 2 + ["trainer"] * cfg.cluster.world_size
    assert all(v > 0 for v in warm.values()) and res.summary["startup_s"] >= max(warm.values())
    _assert_groups_exact(tmp_path / "run", cfg)
    # the trainer gang was DDP over 2 ranks on 2 distinct worker processes
    assert res.records[0]["gang_restarts"] == 0


def test_steps_submitted_ahead_train_what_steps_submitted_in_turn_train(tmp_path, client, monkeypatch):
    """RunConfig.train_ahead: each step is submitted with its batch's generation, before the record of
    the step before it is written (so the trainer starts it without a round trip through the driver),
    and a run ends with the same records and weights as with every step submitted in its turn
    (DDP over two ranks, uneven completion lengths)."""
    import torch
    from safetensors.torch import load_file

    submitted, recorded = [], []
    real = gang.TrainerGang.submit

    def spy(self, batch, version, iteration, after=None):
        submitted.append((iteration, time.time(), batch.picks is None))
        return real(self, batch, version, iteration, after)

    monkeypatch.setattr(gang.TrainerGang, "submit", spy)
    out = {}
    for ahead in (True, False):
        submitted.clear()
        recorded.clear()
        cfg = _cfg(tmp_path, run_dir=str(tmp_path / f"ahead-{ahead}"), iterations=4, world_size=2, train_ahead=ahead)
        res = loop.run(cfg, client=client, progress=False, callbacks=[lambda r: recorded.append((r["iteration"], time.time()))])
        when = dict((it, t) for it, t, _ in submitted)
        assert sorted(when) == [0, 1, 2, 3] and len(submitted) == 4  # each step once: no resubmission
        # ahead: step j was on its way before iteration j - 1 was recorded; in turn: only after it
        before = [when[j] < dict(recorded)[j - 1] for j in (1, 2, 3)]
        assert before == [ahead] * 3
        assert all(everything is ahead for _, _, everything in submitted)  # picks=None: the whole batch
        out[ahead] = (res, AdapterStore(cfg.run.store_root))
    same = ("iteration", "version", "rollout_version", "reward_mean", "completion_tokens", "loss", "grad_norm")
    (ra, sa), (rb, sb) = out[True], out[False]
    for a, b in zip(ra.records, rb.records, strict=True):
        assert {k: a[k] for k in same} == pytest.approx({k: b[k] for k in same}, rel=1e-6, abs=1e-9)
    assert _chain(sa) == _chain(sb) == [1, 2, 3, 4]
    wa, wb = (load_file(f"{s.fetch(4)}/adapter_model.safetensors") for s in (sa, sb))
    for k in wa:
        assert torch.allclose(wa[k], wb[k], atol=1e-6, rtol=0), k
    assert any(wa[k].abs().sum() > 0 for k in wa if "lora_B" in k)
    # the trainer's start is the rank's: a step that began before the driver waited for it counts from there
    spans = [next(s for s in r["spans"] if s["name"] == "train") for r in ra.records]
    assert all(r["train_s"] >= s["end"] - s["start"] for r, s in zip(ra.records, spans, strict=True))


def test_withdraw_waits_for_a_started_step_and_cancels_those_not_started(tmp_path, client, monkeypatch):
    """TrainerGang.withdraw, on stand-in steps that publish a version as a rank task does. The one a
    worker runs is waited for and its version deleted (adapter and optimizer state); the next one,
    whose batch is ready and which would start the moment the running one ends, is cancelled before
    the wait, and with it the one chained after it: neither ever publishes. The store ends at the
    committed version (0 here)."""
    from distributed import Event

    from grpo_kit.trainer import RankSpec

    cfg = _cfg(tmp_path, world_size=1)
    root = str(tmp_path / "store")
    store = AdapterStore(root)
    g = gang.TrainerGang(client, RankSpec.for_run(cfg, "withdraw", "unused", root, None))
    running = Event(f"step-may-end-{os.urandom(3).hex()}", client=client)
    src = str(tmp_path)

    def publish(version, *after, gate=None):
        if gate is not None:
            Event(gate).wait(60)
        d = Path(src) / f"v{version}"
        d.mkdir()
        (d / "adapter_config.json").write_text("{}")
        (d / "adapter_model.safetensors").write_bytes(b"x" * 64)
        st = AdapterStore(root)
        st.save_state(f"optimizer/v{version:06d}-a", {"step": version})
        st.publish_dir(str(d), version, meta={"optimizer_state": f"optimizer/v{version:06d}-a"}, parent=version - 1)
        return {"param_checksum": 0.0}

    w = g.workers[0]
    batch = client.submit(lambda: 1, pure=False)
    batch.result()  # the next step's batch is ready: only the step before it holds it back
    try:
        f1 = client.submit(publish, 1, gate=running.name, workers=[w], pure=False)
        f2 = client.submit(publish, 2, f1, batch, workers=[w], pure=False)
        f3 = client.submit(publish, 3, f2, workers=[w], pure=False)
        handles = [gang.StepHandle(None, v - 1, v, g.gang_id, [f]) for v, f in ((3, f3), (1, f1), (2, f2))]
        deadline = time.time() + 60
        while gang.task_states(client, [f1]) != ["processing"]:
            assert time.time() < deadline
            time.sleep(0.02)
        waited = []
        real_results_of = gang.results_of

        def release_then_wait(futures, *a, **kw):  # the running step ends only once withdraw waits for it
            waited.append([f.key for f in futures])
            running.set()
            return real_results_of(futures, *a, **kw)

        monkeypatch.setattr(gang, "results_of", release_then_wait)
        assert g.withdraw(handles, store, committed=0) == [1]
        assert waited == [[f1.key]]  # it waited for the running step, and for no other
        assert store.versions() == []
        assert not list(Path(root, "state", "optimizer").glob("*.pt"))
        time.sleep(1.0)
        assert store.versions() == [] and f2.cancelled() and f3.cancelled()
    finally:
        running.set()


def _worker_task_states(keys, dask_worker=None):
    """The worker's own state of each of ``keys`` it holds ("executing": its function runs)."""
    return {k: dask_worker.state.tasks[k].state for k in keys if k in dask_worker.state.tasks}


def test_a_step_a_worker_begins_as_the_driver_cancels_it_publishes_nothing(tmp_path, client, monkeypatch, recwarn):
    """The race a fresh-clone CI run lost once: the driver stops after committing iteration 1 while
    the step of iteration 2, submitted ahead, waits for its batch; the scheduler answers "waiting",
    and a worker begins the step before the cancel lands (a cancel does not stop a running task).
    Made certain here: the answer "waiting" is given once the trainer worker executes the step. That
    step used to publish v3 after the take-back, and the resumed run adopted it with a record rebuilt
    from the trainer's statistics (no rewards, no rollout version). Now the take-back fences the gang
    and waits until no trainer is in a publish of it: once the step has ended, the store is still at
    the committed v2, and the resumed run trains iteration 2 itself, with a full record."""
    cfg = _cfg(tmp_path, iterations=4, world_size=1)
    store = AdapterStore(cfg.run.store_root)
    real_states, asked = gang.task_states, []
    trainers = cl.workers_with(client, cl.TRAINER)

    def on_trainers(keys):
        return {k: st for d in client.run(_worker_task_states, keys, workers=trainers).values() for k, st in d.items()}

    def answer_waiting_once_it_runs(client_, futures):
        keys = [f.key for f in futures]
        if any("-train-" in k for k in keys):
            asked.append(keys)
            deadline = time.time() + 120
            while "executing" not in on_trainers(keys).values():
                if time.time() > deadline:  # pytest.fail: an assertion would become the take-back's warning
                    pytest.fail("the step of iteration 2 never began")
                time.sleep(0.01)
            return ["waiting"] * len(futures)
        return real_states(client_, futures)

    monkeypatch.setattr(gang, "task_states", answer_waiting_once_it_runs)

    def stop_after_1(rec):
        if rec["iteration"] == 1:
            raise _Stop

    with pytest.raises(_Stop):
        loop.run(cfg, client=client, callbacks=[stop_after_1], progress=False)
    assert len(asked) == 1 and "-train-2-" in asked[0][0]  # the step of iteration 2 was the one cancelled
    deadline = time.time() + 120
    while set(on_trainers(asked[0]).values()) & {"executing", "cancelled", "long-running"}:
        assert time.time() < deadline, "the cancelled step never ended"
        time.sleep(0.05)  # until it has ended: a publish that escaped has landed by then
    assert not [w for w in recwarn if "could not take back" in str(w.message)]
    assert store.read_json("run")["version"] == 2 and store.versions() == [1, 2]
    states = sorted(p.name for p in Path(cfg.run.store_root, "state", "optimizer").glob("*.pt"))
    assert states and not [n for n in states if n.startswith("v000003")], states
    monkeypatch.setattr(gang, "task_states", real_states)
    res = loop.run(cfg, client=client, resume=True, progress=False)
    assert [r["iteration"] for r in res.records] == [0, 1, 2, 3]
    assert not [r for r in res.records if r.get("recovered")]
    assert [r["rollout_version"] for r in res.records] == [0, 0, 1, 2]
    assert _chain(store) == [1, 2, 3, 4]


def test_without_reward_workers_a_chunk_is_scored_in_its_generation_task(tmp_path, client, monkeypatch):
    """No reward workers: the rollout task scores its chunk itself (one task and one scheduler round
    trip fewer between generation and the driver), so the driver submits no reward task and every
    chunk was scored on the worker that generated it, with the same rewards the rules give."""
    submitted = []
    real = client.submit

    def spy(fn, *args, **kw):
        submitted.append(fn.__name__)
        return real(fn, *args, **kw)

    monkeypatch.setattr(client, "submit", spy)
    cfg = _cfg(tmp_path, iterations=2, world_size=1)
    res = loop.run(cfg, client=client, progress=False)
    assert "reward_task" not in submitted and submitted.count("rollout_task") == submitted.count("summary_task") > 0
    assert all(r["reward_workers"] == r["rollout_workers"] == 2 for r in res.records)  # each chunk where it was made
    rows = _rollouts(tmp_path / "run")
    task = tasks.for_config(cfg)
    pool = {p.id: p for p in task.load("train", cfg.data.train_size, cfg.run.seed)}
    scores = task.scorer(cfg.reward.reward_timeout_s).score_problems([pool[r["prompt_id"]] for r in rows],
                                                                    [r["text"] for r in rows])
    assert len(rows) == 2 * 16 and [r["reward"] for r in rows] == [sc.reward for sc in scores]
    assert len({r["reward"] for r in rows}) > 1  # right and wrong completions both scored


def test_sequential_is_on_policy(tmp_path, client):
    cfg = _cfg(tmp_path, pipelined=False, world_size=1)
    res = loop.run(cfg, client=client, progress=False)
    assert [r["staleness_max"] for r in res.records] == [0, 0, 0]
    for r in res.records:
        assert abs(r["ratio_mean"] - 1) <= 1e-4 and r["clip_frac"] == 0


def test_staleness_bound_zero_keeps_nothing_in_flight(tmp_path, client):
    cfg = _cfg(tmp_path, max_staleness=0, world_size=1)
    res = loop.run(cfg, client=client, progress=False)
    # max_staleness=0 with pipelining on: no batch may lag, so none is generated ahead
    assert [r["staleness_max"] for r in res.records] == [0, 0, 0]
    assert [r["rejected_groups"] for r in res.records] == [0, 0, 0]


def test_deeper_pipeline_paces_or_discards(tmp_path, client, monkeypatch):
    """max_staleness=K: pacing generates K batches ahead and never more; discarding runs further
    ahead, each chunk sampling from the newest adapter when it starts, and regenerates exactly the
    batches that came back too stale."""
    assert config.profile("tiny", pipeline_depth=3, max_staleness=1).run.depth == 1  # pace caps the depth
    deep = _cfg(tmp_path, iterations=5, world_size=1, max_staleness=2, run_dir=str(tmp_path / "k2"))
    res = loop.run(deep, client=client, progress=False)
    assert [r["rollout_version"] for r in res.records] == [0, 0, 0, 1, 2]  # two batches ahead
    assert [r["staleness_max"] for r in res.records] == [0, 1, 2, 2, 2]
    assert [r["rejected_groups"] for r in res.records] == [0] * 5

    discard = _cfg(tmp_path, iterations=5, world_size=1, max_staleness=1, pipeline_depth=2, staleness_policy="discard",
                   run_dir=str(tmp_path / "discard"))
    through_driver = _watch_driver(client, monkeypatch)
    res = loop.run(discard, client=client, progress=False)
    monkeypatch.undo()
    assert [r["version"] for r in res.records] == [1, 2, 3, 4, 5]  # every iteration trained
    assert all(r["staleness_max"] <= 1 for r in res.records)
    # each batch as first gathered: the version it was submitted with (the newest then) and the
    # versions its chunks sampled from (the newest when each started)
    submitted, sampled = {}, {}
    for name, x in through_driver:
        if name == "submit" and x[0][0] is remote.rollout_task:
            assert x[1]["newest"] is True
            submitted.setdefault(x[0][8], x[0][3])  # iteration, version
        elif name == "gather" and isinstance(x, list) and x and isinstance(x[0], dict) and "rollouts" in x[0]:
            it = x[0]["rollouts"][0]["iteration"]
            sampled.setdefault(it, min(r["version"] for res_ in x for r in res_["rollouts"]))
    assert sorted(sampled) == list(range(5))
    assert all(sampled[it] >= submitted[it] for it in sampled)
    # a batch is discarded exactly when it was sampled more than max_staleness behind the trainer
    p, trainer = discard.sampling.prompts_per_step, [r["version"] - 1 for r in res.records]
    assert [r["rejected_groups"] for r in res.records] == [p if trainer[it] - sampled[it] > 1 else 0 for it in range(5)]
    for r in res.records:  # a discarded batch's generation counts in the device time (and so in the cost)
        kept = sum(sp["end"] - sp["start"] for sp in r["spans"] if sp["name"] == "generate")
        assert (r["gen_device_s"] > kept + 1e-6) if r["rejected_groups"] else r["gen_device_s"] == pytest.approx(kept)
    assert res.summary["rejected_groups"] == sum(r["rejected_groups"] for r in res.records)
    _assert_groups_exact(tmp_path / "discard", discard)  # a discarded batch is neither trained nor lost
    # a chunk started now samples from the newest version (5), not the one it was submitted with (0)
    prob = remote.problem_dict(tasks.for_config(discard).load("train", 1, 0)[0])
    late = client.submit(remote.rollout_task, [prob], 2, 0, 4, 1.0, 0, 0, 0, newest=True, resources={cl.ROLLOUT: 1},
                         pure=False).result()
    assert {r["version"] for r in late["rollouts"]} == {AdapterStore(discard.run.store_root).latest()} == {5}


def test_rollout_worker_killed_during_generation(tmp_path, client):
    cfg = _cfg(tmp_path, iterations=4, world_size=1, prompts_per_step=8)
    killed = []
    _kill_when(client, "-rollout-2-", killed)
    res = loop.run(cfg, client=client, progress=False)
    assert killed, "no rollout worker was killed (the test did not exercise the fault)"
    assert len(res.records) == 4
    _assert_groups_exact(tmp_path / "run", cfg)
    cl.wait_for_role(client, cl.ROLLOUT, 2)


def test_trainer_rank_killed_gang_reforms(tmp_path, client):
    cfg = _cfg(tmp_path, iterations=4, world_size=2, max_restarts=2)
    killed = []
    _kill_when(client, "-train-1-", killed)
    res = loop.run(cfg, client=client, progress=False)
    assert killed, "no trainer was killed"
    assert len(res.records) == 4 and res.summary["gang_restarts"] >= 1
    assert _chain(AdapterStore(cfg.run.store_root)) == [1, 2, 3, 4]
    cl.wait_for_role(client, cl.TRAINER, 2)


def test_trainer_failures_past_the_limit_fail_clearly(tmp_path, client):
    cfg = _cfg(tmp_path, iterations=3, world_size=2, max_restarts=0)
    killed = []
    _kill_when(client, "-train-1-", killed)
    with pytest.raises(gang.GangFailed, match="max_restarts=0"):
        loop.run(cfg, client=client, progress=False)
    assert killed
    cl.wait_for_role(client, cl.TRAINER, 2)


class _Stop(Exception):
    pass


def test_resume_after_driver_death(tmp_path, client):
    cfg = _cfg(tmp_path, iterations=5, world_size=1)

    def die_after_2(rec):
        if rec["iteration"] == 1:
            raise _Stop  # the driver (kernel) dies after iteration 1 was checkpointed

    with pytest.raises(_Stop):
        loop.run(cfg, client=client, callbacks=[die_after_2], progress=False)
    store = AdapterStore(cfg.run.store_root)
    assert store.read_json("run")["next_iteration"] == 2
    with pytest.raises(FileExistsError, match="resume=True"):
        loop.run(cfg, client=client, progress=False)  # refusing to clobber the run
    seen = []
    res = loop.run(cfg, client=client, callbacks=[seen.append], resume=True, progress=False)
    assert [r["iteration"] for r in seen] == [2, 3, 4]  # no finished iteration repeated
    assert [r["iteration"] for r in res.records] == [0, 1, 2, 3, 4]
    assert _chain(store) == [1, 2, 3, 4, 5]


def test_evaluations_a_stopped_run_left_pending_are_run_on_resume(tmp_path, client):
    """Review finding: pending evaluations lived only in the driver's memory, so a run stopped while
    one ran (here: right after iteration 1 committed and submitted v2's) never evaluated that version
    on resume, nor the base model if its evaluation had not finished; the run state now lists them."""
    cfg = _cfg(tmp_path, iterations=3, world_size=1, eval_every=2, eval_size=8)

    def stop_at_1(rec):
        if rec["iteration"] == 1:
            raise _Stop  # v2's evaluation was submitted at this commit, and has not finished

    before = set(client.futures)
    with pytest.raises(_Stop) as stopped:
        loop.run(cfg, client=client, callbacks=[stop_at_1], progress=False)
    state = AdapterStore(cfg.run.store_root).read_json("run")
    assert [1, 2] in state["evals_pending"]
    # review: the stopped run (its traceback still holds the driver) cancelled that evaluation too,
    # which would otherwise hold an engine slot while the resumed run submits it again
    assert stopped.traceback is not None
    assert not [k for k in set(client.futures) - before if "-eval-" in str(k)]
    res = loop.run(cfg, client=client, resume=True, progress=False)
    final = AdapterStore(cfg.run.store_root).read_json("run")
    evaluated = {e["version"] for e in final["evals"] if "set" not in e}
    assert {0, 2, 3} <= evaluated, evaluated  # the base model, the stopped run's v2, and the final v3
    assert res.summary["acc_before"] is not None


def test_an_interrupt_while_a_batch_is_waited_for_cancels_that_batch_too(tmp_path, client, monkeypatch):
    """Review finding (2026-12-03): the batch the driver waited for was out of ``pending`` while it
    waited, so an interrupt there (where the driver spends its time) cancelled only the batches
    ahead; iteration 1's generation ran on, held by the traceback, ahead of a resumed run's work."""
    cfg = _cfg(tmp_path, iterations=3, world_size=1, pipelined=False, max_new_tokens=200, prompts_per_step=8)
    real = remote.TaskRetries.gather

    def gather(self, futures):
        if futures and "-summary-1-" in str(futures[0].key):
            raise KeyboardInterrupt  # Ctrl-C while iteration 1's batch is generated
        return real(self, futures)

    monkeypatch.setattr(remote.TaskRetries, "gather", gather)
    before = set(client.futures)
    with pytest.raises(KeyboardInterrupt) as stopped:
        loop.run(cfg, client=client, progress=False)
    assert stopped.traceback is not None  # (it holds the driver, as a notebook's does)
    held = [str(k) for k in set(client.futures) - before]
    assert not [k for k in held if "-rollout-1-" in k or "-summary-1-" in k], held


def test_a_second_interrupt_while_a_step_is_taken_back_still_cancels_the_work_in_flight(tmp_path, client, monkeypatch):
    """Review finding (2026-12-03): a second Ctrl-C during the take-back (which may wait for a started
    step) skipped the cancelling of the evaluations and batches in flight."""
    cfg = _cfg(tmp_path, iterations=4, world_size=1, eval_every=1, eval_size=16)

    def withdraw(self, *a, **kw):
        raise KeyboardInterrupt  # the second interrupt

    def stop_at_0(rec):
        if rec["iteration"] == 0:
            raise _Stop  # v1's evaluation was just submitted

    monkeypatch.setattr(gang.TrainerGang, "withdraw", withdraw)
    before = set(client.futures)
    with pytest.raises(KeyboardInterrupt):
        loop.run(cfg, client=client, progress=False, callbacks=[stop_at_0])
    held = {str(k): f for k, f in client.futures.items() if k not in before}
    assert not [k for k in held if "-eval-" in k], held
    # iteration 0's chunks, which the committed step trained on, may stay referenced (the traceback holds
    # the driver's frame) but are finished; nothing generating is left
    running = [k for k, f in held.items() if ("-rollout-" in k or "-summary-" in k) and f.status == "pending"]
    assert not running, held


def test_the_final_evaluation_sits_at_the_iteration_that_published_the_final_version(tmp_path, client):
    """Review finding (2026-12-03): the final evaluation was tagged with the run's last iteration even
    where that iteration trained nothing (dynamic sampling found no usable group) and the final
    version came from an earlier one: every figure drew it late."""
    def spread_then_flat(completions, trainer_state, **kw):  # usable groups at iteration 0 only
        if trainer_state.mode == "train" and trainer_state.global_step == 0:
            return [float(len(c) % 2) for c in completions]
        return [1.0] * len(completions)

    task = dataclasses.replace(tasks.resolve("synthetic"), rewards=[spread_then_flat], names=["flat"])
    cfg = _cfg(tmp_path, iterations=2, world_size=1, eval_every=2, eval_size=8, dynamic_sampling=True,
               max_gen_batches=1, max_new_tokens=24, temperature=1.5)
    res = loop.run(cfg, client=client, progress=False, task=task)
    assert [r["version"] for r in res.records] == [1, 1]  # iteration 1 trained nothing
    finals = [e for e in res.records[-1].get("evals", []) if e["version"] == 1]
    assert [e["iteration"] for e in finals] == [0], res.records[-1].get("evals")


def test_an_evaluation_that_fails_loses_its_number_not_the_run(tmp_path, client):
    """Review finding: an evaluation task that raised (here another held-out set with a prompt longer
    than the engine's context) was re-raised at the next commit: the run stopped, the step just
    trained was taken back, and a resumed run submitted it again first and failed the same way."""
    cfg = _cfg(tmp_path, iterations=3, world_size=1, eval_every=2, eval_size=8)
    long = tasks.resolve("synthetic")
    long = dataclasses.replace(long, problems=lambda split, n, seed, t=long: [
        dataclasses.replace(p, question=p.question + " and" * 2000) for p in t.problems(split, 2, seed)])
    with pytest.warns(RuntimeWarning, match="evaluation of adapter v.* on long failed"):
        res = loop.run(cfg, client=client, progress=False, eval_sets={"long": long})
    assert [r["iteration"] for r in res.records] == [0, 1, 2] and _chain(AdapterStore(cfg.run.store_root)) == [1, 2, 3]
    errors = [e for r in res.records for e in r.get("eval_errors", [])]
    assert {e["version"] for e in errors} == {0, 2, 3} and all(e["set"] == "long" and "max_model_len" in e["error"]
                                                               for e in errors)
    own = {e["version"] for r in res.records for e in r.get("evals", []) if "set" not in e}
    assert own == {0, 2, 3} and res.summary["acc_after"] is not None  # the task's own set was evaluated


def test_a_stopping_driver_takes_back_the_version_of_a_step_submitted_ahead(tmp_path, client, monkeypatch):
    """With train_ahead (the default), the step of iteration 2 is submitted before iteration 1 is
    committed. A driver that stops after committing iteration 1, once that step has published v3,
    waits for it and deletes v3 and its optimizer state: the store ends at the committed v2, and the
    resumed run trains iteration 2 again with a full record (none rebuilt as ``recovered``)."""
    cfg = _cfg(tmp_path, iterations=4, world_size=1)
    assert cfg.run.train_ahead
    store = AdapterStore(cfg.run.store_root)
    taken = []
    real = gang.TrainerGang.withdraw

    def spy(self, handles, st, committed, delete=True, timeout=None):
        taken.append([h.iteration for h in handles])
        out = real(self, handles, st, committed, delete, timeout)
        taken.append(out)
        return out

    monkeypatch.setattr(gang.TrainerGang, "withdraw", spy)

    def stop_once_v3_is_out(rec):
        if rec["iteration"] == 1:
            deadline = time.time() + 120
            while not store.exists(3):  # the step submitted ahead runs on without the driver
                assert time.time() < deadline, "the step of iteration 2 never published v3"
                time.sleep(0.05)
            raise _Stop

    with pytest.raises(_Stop):
        loop.run(cfg, client=client, callbacks=[stop_once_v3_is_out], progress=False)
    assert taken == [[2], [3]]  # the step submitted ahead, waited for, its version deleted
    assert store.read_json("run")["version"] == 2 and store.versions() == [1, 2]
    states = sorted(p.name for p in Path(cfg.run.store_root, "state", "optimizer").glob("*.pt"))
    assert states and not [n for n in states if n.startswith("v000003") or n.startswith("v000004")], states
    res = loop.run(cfg, client=client, resume=True, progress=False)
    assert [r["iteration"] for r in res.records] == [0, 1, 2, 3]
    assert not [r for r in res.records if r.get("recovered")]
    assert all(r["reward_mean"] is not None and r["rollout_version"] is not None for r in res.records)
    assert _chain(store) == [1, 2, 3, 4]
    # rank 0's ring of three optimizer states let the taken-back v3's go when it reloaded v2: the last three stay
    states = sorted(int(p.name[1:7]) for p in Path(cfg.run.store_root, "state", "optimizer").glob("*.pt"))
    assert states == [2, 3, 4], states


def test_a_driver_failing_before_it_commits_takes_back_the_version_it_waited_for(tmp_path, client, monkeypatch):
    """The driver waited for iteration 1's step (v2 published) and fails before writing the run state
    (building the record raises): v2, and whatever the step submitted ahead published, are taken
    back, so the store ends at the committed v1 and the resumed run trains iteration 1 again with a
    full record instead of adopting v2 with one rebuilt from the trainer's statistics."""
    cfg = _cfg(tmp_path, iterations=3, world_size=1)
    store = AdapterStore(cfg.run.store_root)
    real = loop.iteration_record

    def fails_at_1(cfg_, batch, *a, **kw):
        if batch.iteration == 1:
            raise _Stop
        return real(cfg_, batch, *a, **kw)

    monkeypatch.setattr(loop, "iteration_record", fails_at_1)
    with pytest.raises(_Stop):
        loop.run(cfg, client=client, progress=False)
    assert store.read_json("run")["version"] == 1 and store.versions() == [1]
    monkeypatch.setattr(loop, "iteration_record", real)
    res = loop.run(cfg, client=client, resume=True, progress=False)
    assert [r["iteration"] for r in res.records] == [0, 1, 2]
    assert not [r for r in res.records if r.get("recovered")]
    assert all(r["reward_mean"] is not None for r in res.records)
    assert _chain(store) == [1, 2, 3]


def test_a_version_is_evaluated_only_once_the_run_state_commits_it(tmp_path, client, monkeypatch):
    """No engine reads a version the run has not committed (a stopping driver takes such versions
    back, and an engine's copy of one must never outlive it): each evaluation goes out after the
    run state names its version."""
    from grpo_kit import evals

    cfg = _cfg(tmp_path, iterations=3, world_size=1, eval_every=1)
    store = AdapterStore(cfg.run.store_root)
    seen, real = [], evals.Evaluations.submit

    def spy(self, iteration, version):
        seen.append((version, store.read_json("run")["version"] if version else None))
        return real(self, iteration, version)

    monkeypatch.setattr(evals.Evaluations, "submit", spy)
    res = loop.run(cfg, client=client, progress=False)
    assert [v for v, _ in seen] == [0, 1, 2, 3]
    assert all(committed >= v for v, committed in seen if v)
    assert [r.get("eval_version") for r in res.records if r.get("eval_version")]  # they were collected


def _rollout_iterations(keys) -> list[int]:
    """The iterations of the rollout tasks among ``keys`` (a chunk's key is ``<run>-rollout-<iteration>-...``)."""
    return sorted({int(str(k).split("-rollout-")[1].split("-")[0]) for k in keys if "-rollout-" in str(k)})


@pytest.mark.parametrize("dynamic,multi_turn", [(False, False), (True, False), (True, True)],
                         ids=["plain", "dynamic", "multi-turn-dynamic"])
def test_resumed_run_ends_with_the_uninterrupted_runs_weights(tmp_path, client, dynamic, multi_turn):
    """Killed after an iteration and resumed on trainer workers that lost their state (adapter and
    optimizer state reloaded from the store, as after a restart), a pipelined run ends where the
    uninterrupted run ends. With dynamic sampling the kill comes after an iteration that carried
    groups over: the resumed run regenerates them, over-samples by the same running usable share, and
    so draws and trains the same prompts and completions; with multi-turn episodes (a TRL-shaped
    environment, every turn a tool call) the resumed run replays the same episodes, token for token
    in effect (same texts, rewards and tool counts). (Restarting the worker processes
    themselves, with Client.restart_workers, timed out once in a fresh-clone run, with a nanny that
    did not bring its worker back in 120 s.)"""
    import torch
    from safetensors.torch import load_file

    from grpo_kit import testing, trainer
    from grpo_kit.testing import assert_run_exact

    kw = dict(iterations=4, world_size=1)
    if dynamic:  # one batch ahead within max_staleness=2: the pipelined batch's surplus is carried
        kw.update(iterations=5, dynamic_sampling=True, max_gen_batches=3, max_staleness=2, pipeline_depth=1)
    if multi_turn:
        kw.update(max_turns=3, max_turn_tokens=24, max_episode_tokens=100)
    task = testing.notes_task() if multi_turn else None
    full = _cfg(tmp_path, run_dir=str(tmp_path / "full"), **kw)
    full_res = loop.run(full, client=client, progress=False, task=task)
    kill = 1
    if dynamic:
        carried = [r["iteration"] for r in full_res.records[:-1] if r["carried_out_groups"]]
        assert carried, "no group was carried over (the test did not exercise the carry)"
        kill = carried[0]
    part = _cfg(tmp_path, run_dir=str(tmp_path / "part"), **kw)

    def die_after(rec):
        if rec["iteration"] == kill:
            raise _Stop

    before = set(client.futures)  # earlier runs' futures their drivers may hold until collected
    with pytest.raises(_Stop) as stopped:
        loop.run(part, client=client, callbacks=[die_after], progress=False, task=task)
    # the failed run's generations in flight (the batches after the last commit) were cancelled, though
    # its traceback (as a notebook's would) still holds the driver: the client holds none of them
    assert stopped.traceback is not None
    left = set(client.futures) - before
    assert max(_rollout_iterations(left), default=-1) <= kill
    dropped = client.run(trainer.drop_state, workers=cl.workers_with(client, cl.TRAINER))
    assert list(dropped.values()) == [True, True]
    res = loop.run(part, client=client, resume=True, progress=False, task=task)
    if not dynamic:
        assert [r["rollout_version"] for r in res.records] == [0, 0, 1, 2]  # the pending batch's version too
    same = ("iteration", "version", "rollout_version", "generated_groups", "trained_groups", "carried_in_groups",
            "carried_out_groups", "expired_groups", "gen_batches", "reward_mean")
    assert [{k: r[k] for k in same} for r in res.records] == [{k: r[k] for k in same} for r in full_res.records]
    keys = ("iteration", "prompt_id", "group_id", "sample_idx", "version", "reward", "text", "completion_tokens")
    keys += ("episode",) if multi_turn else ()
    rows = [[{k: r[k] for k in keys} for r in _rollouts(tmp_path / d)] for d in ("full", "part")]
    assert rows[0] == rows[1]  # the same prompts drawn, the same completions (episodes)
    if multi_turn:
        # the run did replay multi-turn episodes (about a quarter had two turns or more when written)
        assert sum(r["episode"]["turns"] >= 2 and r["episode"]["env_tokens"] > 0 for r in rows[0]) >= len(rows[0]) // 8
    a, b = AdapterStore(full.run.store_root), AdapterStore(part.run.store_root)
    assert_run_exact(tmp_path / "full", full, a)
    assert_run_exact(tmp_path / "part", part, b)
    last = full_res.records[-1]["version"]
    wa = load_file(f"{a.fetch(last)}/adapter_model.safetensors")
    wb = load_file(f"{b.fetch(last)}/adapter_model.safetensors")
    assert wa.keys() == wb.keys()
    for k in wa:
        assert torch.allclose(wa[k], wb[k], atol=1e-6, rtol=0), k
    assert any(wa[k].abs().sum() > 0 for k in wa if "lora_B" in k)  # the adapter did move


def test_resume_when_publish_happened_but_state_was_not_written(tmp_path, client):
    from grpo_kit import trackers

    cfg = _cfg(tmp_path, iterations=3, world_size=1)
    loop.run(cfg.override(iterations=2), client=client, progress=False)
    store = AdapterStore(cfg.run.store_root)
    state = store.read_json("run")
    # simulate a crash between rank 0's publish of v2 and the driver's record and state writes for
    # iteration 1 (a kernel interrupt lands there as easily)
    store.write_json("run", {**state, "next_iteration": 1, "version": 1})
    metrics = tmp_path / "run" / "metrics.jsonl"
    metrics.write_text(metrics.read_text().splitlines(keepends=True)[0])
    logged = []

    class Steps(trackers.Tracker):
        def on_log(self, scalars, step):
            logged.append((step, scalars.get("loss")))

    trackers.register_tracker("steps", Steps)
    try:
        res = loop.run(cfg.override(report_to="steps"), client=client, resume=True, progress=False)
    finally:
        trackers.TRACKERS.pop("steps")
    assert [r["iteration"] for r in res.records] == [0, 1, 2]  # iteration 1 not repeated, and not lost
    assert [s for s, _ in logged] == [1, 2] and logged[0][1] == res.records[1]["loss"]  # the rebuilt one logged too
    recovered = res.records[1]
    assert recovered["recovered"] and recovered["version"] == 2 and recovered["loss"] is not None
    assert [json.loads(x)["iteration"] for x in metrics.read_text().splitlines()] == [0, 1, 2]
    assert res.summary["recovered_records"] == 1
    assert _chain(store) == [1, 2, 3]


def test_all_zero_spread_batch_trains_and_is_reported(tmp_path, client):
    # one new token: every completion is truncated and scores 0, so no group has reward spread
    cfg = _cfg(tmp_path, iterations=2, world_size=2, max_new_tokens=1)
    res = loop.run(cfg, client=client, progress=False)
    for r in res.records:
        assert r["all_zero_spread"] and r["usable_samples"] == 0 and r["samples_nonzero_adv"] == 0
        assert r["truncated"] == cfg.sampling.batch_size
    assert _chain(AdapterStore(cfg.run.store_root)) == [1, 2]


def _stuck(seconds: float = 30.0) -> bool:
    time.sleep(seconds)  # a worker whose teardown is blocked (e.g. in destroy_process_group)
    return True


def _stuck_on(address: str, dask_worker=None) -> bool:
    if dask_worker.address == address:
        time.sleep(30.0)
    return True


def test_stuck_teardown_is_bounded_and_worker_restarted(client):
    """Only the worker that did not answer is restarted (review finding: every worker was, the ones
    that answered losing their warm trainer state)."""
    trainers = cl.workers_with(client, cl.TRAINER)
    pids_before = client.run(os.getpid, workers=trainers)
    t0 = time.time()
    answers = gang.run_bounded(client, functools.partial(_stuck_on, trainers[0]), trainers, timeout=2.0)
    assert time.time() - t0 < 60
    assert isinstance(answers[trainers[0]], TimeoutError) and answers[trainers[1]] is True
    back = cl.wait_for_role(client, cl.TRAINER, 2)
    pids_after = client.run(os.getpid, workers=back)
    assert pids_before[trainers[0]] not in pids_after.values()  # the stuck process was replaced
    assert pids_after.get(trainers[1]) == pids_before[trainers[1]]  # the one that answered was not


def test_a_reset_whose_first_pass_restarts_a_stuck_worker_waits_for_it(monkeypatch):
    """Review finding: the deadline started before the first pass, which a stuck teardown makes as
    long as the collective timeout: the restarted workers never got a second pass, and a recoverable
    rank failure ended the run."""
    clock = {"t": 0.0}
    passes = []

    def fake_run_bounded(client, fn, workers, timeout):
        passes.append(list(workers))
        if len(passes) == 1:  # a stuck teardown: the whole bound, then the nannies' restarts
            clock["t"] += timeout + 30.0
            return {w: TimeoutError("teardown timed out") for w in workers}
        clock["t"] += 0.1
        return dict.fromkeys(workers, True)

    monkeypatch.setattr(gang, "run_bounded", fake_run_bounded)
    monkeypatch.setattr(gang, "workers_with", lambda client, role: ["tcp://a:1", "tcp://b:1"])
    monkeypatch.setattr(gang.time, "time", lambda: clock["t"])
    monkeypatch.setattr(gang.time, "sleep", lambda s: clock.__setitem__("t", clock["t"] + s))
    g = object.__new__(gang.TrainerGang)
    g.client, g.base_spec = None, types.SimpleNamespace(world_size=2, timeout_s=120.0)
    formed = []
    g._form = formed.append
    g.reset(timeout=120)
    assert len(passes) == 2 and formed == [["tcp://a:1", "tcp://b:1"]]


def _malloc_state(dask_worker) -> tuple:
    return os.environ.get("MALLOC_TRIM_THRESHOLD_"), getattr(dask_worker, "grpo_kit_malloc_tuned", None)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc only")
def test_workers_undo_the_nannys_malloc_setting(client):
    """Dask's nanny sets MALLOC_TRIM_THRESHOLD_ (2x slower training steps, cluster.tune_malloc);
    every kit worker, including a restarted one, raises the thresholds back at setup."""
    states = client.run(_malloc_state)
    assert len(states) == 4
    for env, tuned in states.values():
        assert env is not None  # the setting the plugin exists for is really there
        assert tuned is True
    assert cl.tune_malloc() is True


def _has_engine_plugin(dask_worker) -> bool:
    return cl.ENGINE_PLUGIN in dask_worker.plugins


def test_rollout_workers_join_and_leave_mid_run(tmp_path, client):
    """The elastic fleet on a real LocalCluster: 1 -> 2 -> 1 rollout workers while the run goes on.
    The joining worker gets the engine plugin and takes rollout tasks only once warm, from the next
    batch on; the leaving one is retired with a batch in flight; nothing is lost or duplicated and the
    trainer gang is never touched."""
    cl.scale_rollout(client, 1)
    try:
        cfg = _cfg(tmp_path, iterations=8, world_size=1)
        trainers_before = cl.workers_with(client, cl.TRAINER)
        fleet = {}

        def scale(rec):
            if rec["iteration"] == 1:
                before = set(cl.workers_with(client, cl.ROLLOUT))
                fleet["joined"] = sorted(set(cl.scale_rollout(client, 2)) - before)
                fleet["plugin"] = client.run(_has_engine_plugin, workers=fleet["joined"])
            elif rec["iteration"] == 5:
                fleet["left"] = cl.scale_rollout(client, 1)

        res = loop.run(cfg, client=client, callbacks=[scale], progress=False)
        recs = res.records
        assert [r["iteration"] for r in recs] == list(range(8))
        assert _chain(AdapterStore(cfg.run.store_root)) == list(range(1, 9))
        _assert_groups_exact(tmp_path / "run", cfg)
        assert len(fleet["joined"]) == 1 and all(fleet["plugin"].values()) and len(fleet["left"]) == 1
        # batches 0-2 were submitted before the join, 3-6 with two workers, 7 after the leave
        assert [r["rollout_workers"] for r in recs] == [1, 1, 1, 2, 2, 2] + [recs[6]["rollout_workers"], 1]
        assert [r["staleness_max"] for r in recs] == [0] + [1] * 7  # the pipeline's lag, unchanged by scaling
        assert abs(recs[0]["ratio_mean"] - 1) <= 1e-4
        assert cl.workers_with(client, cl.TRAINER) == trainers_before and recs[-1]["gang_restarts"] == 0
    finally:
        cl.scale_rollout(client, 2)


def _kill_repeatedly(client, part: str, times: int, killed: list, timeout: float = 300):
    """A thread that SIGKILLs, ``times`` times, the worker process holding a task whose key contains
    ``part`` (each kill a new process: the nanny's replacement, under a new address)."""

    def watch():
        pids: dict = {}
        deadline = time.time() + timeout
        while time.time() < deadline and len(killed) < times:
            for worker, keys in client.processing().items():
                if worker in killed or not any(part in str(k) for k in keys):
                    continue
                if worker not in pids:
                    pids.update({w: p for w, p in client.run(os.getpid, on_error="return").items() if isinstance(p, int)})
                if worker in pids:
                    os.kill(pids[worker], signal.SIGKILL)
                    killed.append(worker)
                    break
            time.sleep(0.02)

    t = threading.Thread(target=watch, daemon=True)
    t.start()
    return t


@pytest.fixture
def storm_client():
    """A cluster of the module's shape for one preemption-storm test, closed after it. Its own: Dask's
    SpecCluster closes the nanny of a worker that has not re-registered within
    ``distributed.deploy.lost-worker-timeout`` (15 s), which a worker killed again and again can
    miss, and nothing then starts that worker again (seen once on a fresh clone: the run completed,
    and the module's cluster was left one rollout worker short for the tests after it). Its scheduler
    allows one failure a task (``allowed-failures`` 1, Dask's default 3): the tests kill ``allowed + 2``
    and ``allowed + 1`` times, and the two kills more a task the default would take are two more worker
    restarts and rollout re-runs that prove nothing more."""
    import dask

    with dask.config.set({"distributed.scheduler.allowed-failures": 1}):  # read by the scheduler it starts
        c = cl.connect(**CLUSTER_SHAPE, quiet=True)
        yield c
        cl.shutdown(c)


def test_a_rollout_task_outlives_a_storm_of_preemptions(tmp_path, storm_client):
    """The worker holding one rollout task is killed allowed + 2 times, past Dask's allowed-failures
    (1 on storm_client): the 2nd loss ends the task in KilledWorker, and so does each loss after it. The driver resubmits it
    (seeded: the same groups come back), the run completes and the records count the resubmissions."""
    import dask

    allowed = dask.config.get("distributed.scheduler.allowed-failures")  # this process runs the scheduler
    cfg = _cfg(tmp_path, iterations=3, world_size=1)
    killed = []
    watcher = _kill_repeatedly(storm_client, "-rollout-1-0-", allowed + 2, killed)
    res = loop.run(cfg, client=storm_client, progress=False)
    watcher.join(timeout=5)
    assert len(killed) == allowed + 2, f"only {len(killed)} workers were killed"
    assert [r["iteration"] for r in res.records] == [0, 1, 2]
    _assert_groups_exact(tmp_path / "run", cfg)
    _chain(AdapterStore(cfg.run.store_root))
    resubmits = [r["task_resubmits"] for r in res.records]
    # every loss past the allowed ones was a KilledWorker the driver resubmitted, while gathering batch 1
    assert resubmits[0] == 0 and resubmits[1] >= len(killed) - allowed and resubmits[2] == 0, resubmits
    assert res.records[-1]["gang_restarts"] == 0  # the trainer gang never noticed


def test_task_resubmissions_are_bounded(tmp_path, storm_client):
    """max_task_failures=0: the first KilledWorker of a rollout task ends the run, clearly."""
    import dask

    from grpo_kit import remote

    allowed = dask.config.get("distributed.scheduler.allowed-failures")
    cfg = _cfg(tmp_path, iterations=3, world_size=1, max_task_failures=0)
    killed = []
    _kill_repeatedly(storm_client, "-rollout-1-0-", allowed + 1, killed)
    with pytest.raises(remote.TasksLost, match="max_task_failures=0"):
        loop.run(cfg, client=storm_client, progress=False)
    assert len(killed) == allowed + 1


def test_multi_turn_episodes_train_through_the_pipelined_loop(tmp_path, client):
    """A TRL-shaped environment's episodes (every turn calls its tool) through the pipelined loop on
    two DDP ranks: the streams reach the trainer with their masks (on-policy ratio 1 over the model's
    tokens only), the records and rollouts.jsonl show the episodes, and evaluation plays them greedily."""
    from grpo_kit import testing

    cfg = _cfg(tmp_path, iterations=3, eval_every=2, world_size=2, preflight_sizes="", max_turns=3,
               max_turn_tokens=32, max_episode_tokens=160)
    res = loop.run(cfg, client=client, progress=False, task=testing.notes_task())
    rows = _rollouts(tmp_path / "run")
    eps = [r["episode"] for r in rows]
    assert all(e["turns"] >= 1 and e["end_reason"] in ("max_turns", "budget") for e in eps)
    assert sum(e["turns"] >= 2 for e in eps) >= len(eps) // 2 and all(e["env_tokens"] > 0 for e in eps if e["turns"] >= 2)
    assert all(r["completion_tokens"] == e["model_tokens"] for r, e in zip(rows, eps, strict=True))
    assert all(r["reward"] == e["env_reward"] == e["tool_calls"] for r, e in zip(rows, eps, strict=True))
    tool_msgs = [m for e in eps for m in e["messages"] if m["role"] == "tool"]
    assert tool_msgs and all(m["content"].startswith("noted ") for m in tool_msgs)
    assert res.records[0]["ratio_mean"] == pytest.approx(1.0, abs=1e-4)  # on-policy through the turns
    assert [r["staleness_max"] for r in res.records] == [0, 1, 1]
    _assert_groups_exact(tmp_path / "run", cfg)
    assert _chain(AdapterStore(cfg.run.store_root)) == [1, 2, 3]
    evals = [e for r in res.records for e in r.get("evals", [])]
    assert evals and all(0 <= e["tool_rate"] <= 1 and e["turns_mean"] >= 1 for e in evals)
    # each record counts its batch's episodes (grpo_kit.metrics.episode_metrics); the summary, the tool rate
    declared = records.schema_keys()
    assert not {k for r in res.records for k in r} - declared and not {k for e in evals for k in e} - declared
    for rec in res.records:
        mine = [e for r, e in zip(rows, eps, strict=True) if r["iteration"] == rec["iteration"]]
        assert rec["episodes"] == len(mine) and rec["turns_max"] == max(e["turns"] for e in mine)
        assert rec["turns_mean"] == pytest.approx(sum(e["turns"] for e in mine) / len(mine))
        assert rec["env_tokens"] == sum(e["env_tokens"] for e in mine)
        assert rec["end_max_turns"] + rec["end_budget"] == len(mine) and rec["end_answered"] == rec["end_error"] == 0
    assert res.summary["tool_rate_before"] is not None and 0 <= res.summary["tool_rate_after"] <= 1


NOTEBOOK_CELL = '''
import torch
from grpo_kit.loss import aggregate, token_stats

def sentinel_loss(logp, old_logp, ref_logp, adv, mask, *, cfg, norm=None, sampling_logp=None):
    m = mask.bool()
    per_tok = torch.where(m, -torch.where(m, logp, 0.0), 0.0)
    no = torch.zeros_like(m)
    return aggregate(per_tok, m, cfg.loss_type, norm), token_stats(torch.full_like(logp, 7.0), m, no, no, None)

def zero_advantage(rewards, group_size, cfg):
    return torch.zeros_like(rewards)
'''


def test_functions_from_a_notebook_cell_train_on_the_ranks(tmp_path, client):
    """``loop.run(policy_loss=fn, advantage=fn)`` with functions defined in ``__main__`` (a notebook
    cell; the trainer workers cannot import them): they run on both DDP ranks (the loss's sentinel
    ratio 7 and the estimator's zero advantages reach the records), and config.json names them."""
    cell = {"__name__": "__main__"}
    exec(NOTEBOOK_CELL, cell)
    cfg = _cfg(tmp_path, iterations=1, world_size=2, kl_beta=0.02)
    res = loop.run(cfg, client=client, progress=False, policy_loss=cell["sentinel_loss"],
                   advantage=cell["zero_advantage"])
    assert [r["ratio_mean"] for r in res.records] == [7.0]
    assert [r["samples_nonzero_adv"] for r in res.records] == [0]
    saved = json.loads((res.run_dir / "config.json").read_text())["loss"]
    assert (saved["policy_loss"], saved["advantage"]) == ("__main__:sentinel_loss", "__main__:zero_advantage")


def test_evaluation_runs_on_eval_workers_where_there_are_any(tmp_path):
    """``n_eval_workers``: a worker with the ``eval`` resource builds an engine of its own and takes
    every evaluation (the base model's included); generation stays on the rollout worker."""
    client = cl.connect(n_rollout_workers=1, n_trainer_workers=1, n_eval_workers=1, quiet=True)
    try:
        assert cl.workers_with(client, cl.EVAL) and len(client.scheduler_info()["workers"]) == 3
        cfg = _cfg(tmp_path, iterations=2, eval_every=1, eval_size=8, world_size=1, preflight_sizes="")
        res = loop.run(cfg, client=client, progress=False)
        evals = [e for r in res.records for e in r.get("evals", [])]
        assert sorted(e["version"] for e in evals) == [0, 1, 2]
        assert {e["worker"] for e in evals} == {"eval-0"}
        assert res.summary["acc_before"] is not None and res.summary["acc_after"] is not None
        # the run's warm-up waits for the rollout worker's engine only (the eval worker warms on its own)
        assert [k.split(" ")[0] for k in res.summary["warm_up_s"]].count("engine") == 1
    finally:
        cl.shutdown(client)


def test_a_training_pool_smaller_than_a_batch_is_refused_before_any_cluster(tmp_path):
    """Review finding: 3 training rows and prompts_per_step=4 failed only at iteration 0's batch
    ("rollouts do not form 4 complete groups"), after the engines and the trainer ranks were built."""
    three = tasks.resolve("synthetic")
    three = dataclasses.replace(three, problems=lambda split, n, seed, t=three: t.problems(split, min(n, 3), seed))
    cfg = _cfg(tmp_path, prompts_per_step=4)
    with pytest.raises(ValueError, match="3 training problems .* fewer than prompts_per_step=4"):
        loop.run(cfg, task=three, progress=False)  # no client: it would start a LocalCluster first
