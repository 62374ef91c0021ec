"""Tests for grpo_kit.sandbox: every HumanEval canonical solution passes and empty or wrong bodies fail;
hostile programs (infinite loop, fork bomb, 10 GB allocation, writes outside the work directory, a
loopback connection, killing the parent, 100 MB of output, ``exit(0)``) each end as a failure with a
reason within the time limit, and this process goes on to score the next completion; the code
reward works inside a real Dask worker's thread."""

from __future__ import annotations

import concurrent.futures
import json
import os
import socket
import time
from pathlib import Path

import pytest

from grpo_kit import testing
from grpo_kit.sandbox import SandboxLimits, probe, run_python
from grpo_kit.tasks.code import code_reward, load_humaneval

TIMEOUT_S = 5.0
"""The hostile programs' wall-clock limit: what fails fast must fail within it even on a loaded machine."""
SLACK_S = 10.0
"""Allowed beyond the time limit: process start and kill, on a loaded 2-core machine."""


def _score(completions, rows, **kw):
    return code_reward([r["prompt"] for r in rows], completions, [r["test"] for r in rows],
                       [r["entry_point"] for r in rows], **kw)


def test_every_humaneval_canonical_solution_passes_and_empty_or_wrong_bodies_fail():
    rows = load_humaneval()
    assert len(rows) == 164
    t0 = time.monotonic()
    canonical = _score([r["canonical_solution"] for r in rows], rows)
    failed = [(r["task_id"], s.reason) for r, s in zip(rows, canonical, strict=True) if s.score != 1.0]
    assert not failed, failed
    assert all(s.correct and s.reason == "tests passed" for s in canonical)
    # Empty: the prompt alone defines a function that returns None. Wrong: a body that raises.
    for body, why in (("", "AssertionError"), ("    raise NotImplementedError\n", "NotImplementedError")):
        scores = _score([body] * len(rows), rows)
        passed = [r["task_id"] for r, s in zip(rows, scores, strict=True) if s.score != 0.0]
        assert not passed, f"body {body!r} passed {passed}"
        assert sum(why in s.reason for s in scores) > 100, [s.reason for s in scores[:5]]
    print(f"3 x 164 HumanEval programs in {time.monotonic() - t0:.1f} s")


@pytest.fixture(scope="module")
def listener():
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()
    yield srv
    srv.close()


def hostile_programs(port: int, outside: Path) -> dict[str, tuple[str, str]]:
    """name -> (program, a word the failure reason must contain); the table ``bench/rewards.py`` runs too."""
    return testing.hostile_programs(port, str(outside))


def test_reads_outside_python_and_the_system_libraries_are_refused(tmp_path):
    if "landlock-read" not in probe():
        pytest.skip("no Landlock here: the program reads what its uid may read")
    secret = tmp_path / "secret.txt"
    secret.write_text("s3cret")
    for path in (secret, Path(__file__)):
        r = run_python(f"print(open({str(path)!r}).read())\n")
        assert not r.passed and "PermissionError" in r.reason and "s3cret" not in r.output, r
    assert run_python("import json, fractions, hashlib\nprint(open('/dev/null').read())\n").passed


@pytest.mark.parametrize("namespaces,landlock", [(True, True), (True, False), (False, True)],
                         ids=["all-layers", "namespaces-only", "landlock-only"])
def test_hostile_programs_fail_with_a_reason_within_the_limit(listener, tmp_path, namespaces, landlock):
    layers = probe()
    if namespaces and "netns" not in layers:
        pytest.skip(f"no namespaces on this machine (layers: {layers})")
    if landlock and "landlock-fs" not in layers:
        pytest.skip(f"no Landlock on this machine (layers: {layers})")
    if not namespaces and not landlock and "uid" not in layers:
        pytest.skip("nothing to contain network and signals")
    outside = tmp_path / "escaped.txt"
    limits = SandboxLimits(timeout_s=TIMEOUT_S, namespaces=namespaces, landlock=landlock)
    programs = hostile_programs(listener.getsockname()[1], outside)
    with concurrent.futures.ThreadPoolExecutor(len(programs)) as pool:  # all at once, as a reward batch runs
        results = dict(zip(programs, pool.map(lambda p: run_python(p[0], limits), programs.values()), strict=True))
    for name, r in results.items():
        why = programs[name][1]
        print(f"{name:30s} {r.duration_s:5.2f} s  {r.reason[:80]}")
        assert not r.passed, (name, r)
        assert why in r.reason and r.reason, (name, r.reason)
        # the limit runs from the program's start; the set-up before it has its own bound
        assert r.duration_s - (r.setup_s or 0) < TIMEOUT_S + SLACK_S, (name, r.duration_s, r.setup_s)
        assert r.duration_s < limits.setup_timeout_s + TIMEOUT_S + SLACK_S, (name, r.duration_s)
    # this process survives and scores the next program
    assert run_python("assert sum(range(10)) == 45", SandboxLimits(timeout_s=60)).passed
    assert not outside.exists()


def test_no_process_outlives_the_run():
    """A child that leaves the process group (setsid) still dies with the run: it is in the run's PID
    namespace. It prints its pid as this machine sees it (``/proc/self`` of the host's procfs)."""
    if "pidns" not in probe():
        pytest.skip("no PID namespace here: a child that calls setsid() escapes the group kill")
    prog = ("import os, sys, time\nif os.fork() == 0:\n    os.setsid()\n    print(os.readlink('/proc/self'), flush=True)\n"
            "    time.sleep(1000)\ntime.sleep(1000)\n")
    r = run_python(prog, SandboxLimits(timeout_s=TIMEOUT_S))
    assert "timed out" in r.reason
    pid = int(r.output.split()[0])
    deadline = time.monotonic() + 5
    while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not os.path.exists(f"/proc/{pid}"), f"pid {pid} outlived the run"


def test_a_hostile_completion_scores_zero_and_the_next_one_scores(listener):
    """Through the reward: HumanEval/0 answered with a body that kills its parent, then a fork bomb,
    then the canonical solution."""
    row = load_humaneval()[0]
    bodies = ["    import os, signal\n    os.kill(os.getppid(), signal.SIGKILL)\n",
              "    import os\n    while True:\n        os.fork()\n",
              row["canonical_solution"]]
    scores = _score(bodies, [row] * 3, timeout_s=TIMEOUT_S)
    assert [s.score for s in scores] == [0.0, 0.0, 1.0], [s.reason for s in scores]
    assert all(s.reason for s in scores)


def test_work_directory_is_empty_private_and_removed():
    r = run_python("import os, json\nprint(json.dumps([os.getcwd(), os.listdir('.'), sorted(os.environ)]))\n"
                   "open('f.txt', 'w').write('x' * 100)\n")
    assert r.passed, r
    cwd, listing, env = json.loads(r.output)
    assert listing == []
    assert set(env) <= {"PATH", "HOME", "LANG", "LC_CTYPE"}, env  # nothing of this process's environment
    assert not os.path.exists(cwd)


def test_cpu_limit_ends_a_busy_loop_before_the_wall_clock():
    # on a loaded machine one CPU second can take many wall seconds: the reason says which limit ended it
    r = run_python("while True:\n    pass\n", SandboxLimits(timeout_s=120, cpu_s=1))
    assert not r.passed and "CPU time limit" in r.reason, r.reason


def test_file_size_and_open_files_are_limited():
    limits = SandboxLimits(max_file_bytes=1 << 20, max_open_files=32)
    big = run_python("open('big', 'wb').write(b'x' * (2 << 20))\n", limits)
    assert not big.passed and "File too large" in big.reason, big.reason
    many = run_python("fs = [open('f%d' % i, 'w') for i in range(100)]\n", limits)
    assert not many.passed and "Too many open files" in many.reason, many.reason


def _score_in_worker(completion: str, row: dict, timeout_s: float) -> tuple[str, float, str]:
    import threading

    (s,) = code_reward([row["prompt"]], [completion], [row["test"]], [row["entry_point"]], timeout_s=timeout_s)
    return threading.current_thread().name, s.score, s.reason


def test_code_reward_in_a_dask_worker_thread():
    distributed = pytest.importorskip("distributed")
    import dask

    row = load_humaneval()[2]
    with dask.config.set({"distributed.comm.timeouts.connect": "120s"}), \
            distributed.LocalCluster(n_workers=1, threads_per_worker=2, processes=True, host="127.0.0.1",
                                     dashboard_address=None) as cluster, distributed.Client(cluster) as client:
        hang = client.submit(_score_in_worker, "    while True:\n        pass\n", row, TIMEOUT_S, pure=False)
        good = client.submit(_score_in_worker, row["canonical_solution"], row, 60.0, pure=False)
        (t1, s1, why1), (t2, s2, why2) = client.gather([hang, good])
    assert t1 != "MainThread" and t2 != "MainThread"
    assert (s1, s2) == (0.0, 1.0), (why1, why2)
    assert "timed out" in why1
