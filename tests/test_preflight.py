"""The pre-flight all-reduce sweep on a real LocalCluster: two trainer worker processes, real gloo."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from grpo_kit import cluster as cl
from grpo_kit import config, loop, preflight, report
from grpo_kit.adapters import AdapterStore

pytestmark = pytest.mark.timeout(600)
ROOT = Path(__file__).resolve().parents[1]
SIZES = [1024, 64 << 10, 1 << 20]


def test_sweep_across_two_gloo_ranks(client):
    res = preflight.run_preflight(client, sizes=SIZES)
    assert res.world_size == 2 and res.backend == "gloo" and res.sizes == SIZES
    assert res.workers == cl.workers_with(client, cl.TRAINER)
    assert all(t > 0 for t in res.time_s)
    for s, t, a, b in zip(res.sizes, res.time_s, res.algbw_gbps, res.busbw_gbps, strict=True):
        assert a == pytest.approx(s / t / 1e9) and b == pytest.approx(a * 2 * (2 - 1) / 2)
    assert res.ok and res.busbw_peak_gbps == max(res.busbw_gbps) > 0
    # the ranks tore their group down: a second sweep forms a new one on the same workers
    assert preflight.run_preflight(client, sizes=SIZES[:1]).world_size == 2


def test_floor_warns_or_fails_clearly(client):
    with pytest.warns(RuntimeWarning, match="below the floor"):
        res = preflight.run_preflight(client, sizes=SIZES[:2], min_busbw_gbps=1e6)
    assert not res.ok
    with pytest.raises(preflight.FabricTooSlow, match=r"peaks at .* GB/s, below the floor of 1000000.0 GB/s"):
        preflight.run_preflight(client, sizes=SIZES[:2], min_busbw_gbps=1e6, on_slow="error")


def test_cli_against_a_scheduler_ends_with_a_json_line(client):
    out = subprocess.run([sys.executable, "-m", "grpo_kit.preflight", "--scheduler", client.scheduler.address,
                          "--sizes", "1K,64K"], capture_output=True, text=True, timeout=300, cwd=ROOT, check=True)
    last = json.loads(out.stdout.strip().splitlines()[-1])
    assert last["world_size"] == 2 and last["sizes"] == [1024, 65536] and len(last["busbw_gbps"]) == 2
    assert all(b > 0 for b in last["busbw_gbps"]) and last["ok"] is True


def test_run_records_the_sweep_and_a_slow_fabric_stops_it(tmp_path, client):
    base = dict(engine="hf", iterations=1, eval_every=0, eval_size=8, prompts_per_step=2, group_size=2,
                max_new_tokens=8, world_size=2, collective_timeout_s=30)
    res = loop.run(config.profile("tiny", run_dir=str(tmp_path / "ok"), **base), client=client, progress=False)
    fabric = res.summary["preflight"]
    assert fabric["world_size"] == 2 and fabric["sizes"] == preflight.parse_sizes("1K:1M")
    assert json.loads((tmp_path / "ok" / "summary.json").read_text())["preflight"] == fabric
    html = report.write_report(tmp_path / "ok").read_text()
    assert 'data-key="preflight"' in html and "busbw_peak_gbps" in html  # the report's summary table shows it
    slow = config.profile("tiny", run_dir=str(tmp_path / "slow"), preflight_min_busbw_gbps=1e6,
                          preflight_on_slow="error", **base)
    with pytest.raises(preflight.FabricTooSlow):
        loop.run(slow, client=client, progress=False)
    assert (tmp_path / "slow" / "metrics.jsonl").read_text() == ""  # failed before the first iteration
    assert AdapterStore(slow.run.store_root).versions() == []


def _kill_rank_during_sweep(client, rank: int, killed: list, after: float = 1.0, timeout: float = 120):
    """A thread that SIGKILLs the worker process running the sweep's rank ``rank`` once both ranks'
    tasks have run for ``after`` seconds; appends (worker, monotonic time of the kill) to ``killed``."""
    pids = client.run(os.getpid)

    def watch():
        deadline, seen = time.time() + timeout, None
        while time.time() < deadline and not killed:
            procs = client.processing()
            ranks = {str(k).rsplit("-", 1)[1]: w for w, keys in procs.items() for k in keys if "preflight-" in str(k)}
            if len(ranks) == 2:
                seen = seen or time.monotonic()
                w = ranks.get(f"r{rank}")
                if time.monotonic() - seen >= after and w in pids:
                    os.kill(pids[w], signal.SIGKILL)
                    killed.append((w, time.monotonic()))
                    return
            time.sleep(0.02)

    t = threading.Thread(target=watch, daemon=True)
    t.start()
    return t


def test_a_worker_lost_mid_sweep_fails_it_fast_and_the_next_sweep_runs(client):
    """Rank 1's worker killed mid-sweep: its task stays pinned to an address that is gone, yet the
    sweep raises SweepFailed within seconds (not after timeout_s + 60), and leaves no survivor
    busy: a sweep right after runs on the trainer workers there are then."""
    timeout_s = 120.0
    killed = []
    _kill_rank_during_sweep(client, 1, killed)
    with pytest.raises(Exception) as err:  # its type is checked below, after the clock
        preflight.run_preflight(client, sizes=preflight.DEFAULT_SIZES, timeout_s=timeout_s)
    assert killed, "no trainer worker was killed (the sweep ended before the fault)"
    took = time.monotonic() - killed[0][1]
    assert took < 30.0 < timeout_s, f"the sweep raised {took:.1f}s after its worker died"
    assert isinstance(err.value, preflight.SweepFailed), err.value
    back = cl.wait_for_role(client, cl.TRAINER, 2)
    assert killed[0][0] not in back  # the nanny brought the worker back under a new address
    res = preflight.run_preflight(client, back[:2], sizes=SIZES[:1], timeout_s=60)
    assert res.world_size == 2 and res.workers == back[:2]


def test_a_rank_pinned_to_a_departed_worker_fails_the_sweep_fast(client):
    """A lost worker as the sweep sees it before its peer notices: rank 1 pinned to an address no
    worker has (its task never runs), rank 0 waiting for it in the rendezvous. SweepFailed comes
    within seconds, not after timeout_s + 60, and rank 0's worker, stuck in the rendezvous, is
    restarted rather than left busy until timeout_s: a sweep right after runs."""
    timeout_s = 120.0
    w0 = cl.workers_with(client, cl.TRAINER)[0]
    t0 = time.monotonic()
    with pytest.raises(Exception) as err:  # its type is checked below, after the clock
        preflight.run_preflight(client, [w0, "tcp://127.0.0.1:9"], sizes=SIZES[:1], timeout_s=timeout_s)
    took = time.monotonic() - t0
    assert took < 45.0 < timeout_s, f"the sweep raised after {took:.1f}s"
    assert isinstance(err.value, preflight.SweepFailed), err.value
    back = cl.wait_for_role(client, cl.TRAINER, 2)
    assert w0 not in back  # restarted by its nanny
    res = preflight.run_preflight(client, back[:2], sizes=SIZES[:1], timeout_s=60)
    assert res.world_size == 2 and res.workers == back[:2]


def test_run_reforms_the_gang_when_a_rank_dies_in_the_sweep(tmp_path, client):
    cfg = config.profile("tiny", engine="hf", iterations=2, eval_every=0, eval_size=8, prompts_per_step=2,
                         group_size=2, max_new_tokens=8, world_size=2, collective_timeout_s=30,
                         preflight_sizes="1K:256M", run_dir=str(tmp_path / "run"))
    killed = []
    _kill_rank_during_sweep(client, 1, killed)
    res = loop.run(cfg, client=client, progress=False)
    assert killed, "no trainer worker was killed during the sweep"
    assert [r["iteration"] for r in res.records] == [0, 1]
    assert res.summary["gang_restarts"] >= 1 and res.records[0]["gang_restarts"] >= 1
    fabric = res.summary["preflight"]
    assert fabric["world_size"] == 2 and fabric["sizes"] == preflight.parse_sizes("1K:256M") and fabric["ok"]
    assert AdapterStore(cfg.run.store_root).versions() == [1, 2]
    cl.wait_for_role(client, cl.TRAINER, 2)
