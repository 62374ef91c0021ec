"""Scoring safely, measured: HumanEval in the sandbox, hostile programs, math-verify vs the ``####`` reward.

    python bench/rewards.py [--gsm8k ../shared/data/gsm8k] [--timeout 3] [--quick]

- ``humaneval_canonical_pass``: the 164 canonical solutions scored by the code reward (one batch, on
  ``code_reward``'s default threads, 4 per CPU); ``humaneval_empty_pass``: the same with empty completions (should be 0).
- ``code_hostile_zero`` of ``code_hostile_cases``: completions that attack the code reward instead of
  solving the problem (``testing.hostile_completions``: a forged verdict, objects equal to anything,
  rebound builtins, writes to every descriptor, a child writing later, hostile answers), each
  counted when it scored 0.
- ``sandbox_contained`` of ``sandbox_cases``: hostile programs (infinite loop, fork bomb, 10 GB
  allocation, writing outside the work directory, reading this file, a loopback connection, killing
  the parent, 100 MB of output, ``exit(0)``, ...), each counted contained when it failed with the expected reason
  within the time limit plus slack, nothing was written outside, and the next program still passed.
- ``mathverify_gsm8k_agree`` of ``gsm8k_rows`` (8,792): GSM8K gold solutions on which math-verify and
  the ``####`` reward give the same correctness; ``..._perturbed``: the same solutions with the final
  answer off by one (both must say wrong).
- ``ms_per_completion_{gsm8k,math,code}``: scoring cost per completion (gsm8k and math: one at a time on
  the gold solutions, math with its child process warm; code: the 164-completion batch's wall time
  divided by 164; ``ms_per_run_code_sequential``: one completion at a time; each completion is two
  sandboxes, the candidate's and the tests').

The last line is JSON. Timings depend on the machine's load; say so when it is shared.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import tempfile
import time
from pathlib import Path

from grpo_kit import testing
from grpo_kit.reward import gsm8k_reward
from grpo_kit.sandbox import SandboxLimits, probe, run_python
from grpo_kit.tasks.code import code_reward, load_humaneval
from grpo_kit.tasks.math import math_reward, verifier

GSM8K = Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k"


def hostile(port: int, outside: Path) -> dict[str, tuple[str, str]]:
    """name -> (program, text the failure reason must contain): the tests' table plus two cases."""
    return {
        **testing.hostile_programs(port, str(outside)),
        "CPU-bound loop past the CPU limit": ("while True:\n    pass\n", "CPU time limit"),
        "read a file outside": (f"print(open({str(Path(__file__).resolve())!r}).read())\n", "PermissionError"),
    }


def sandbox_cases(timeout_s: float, slack_s: float = 5.0) -> dict:
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()
    out = {}
    with tempfile.TemporaryDirectory() as d:
        outside = Path(d) / "escaped.txt"
        for name, (prog, why) in hostile(srv.getsockname()[1], outside).items():
            limits = SandboxLimits(timeout_s=timeout_s)
            if "CPU limit" in name:
                limits = SandboxLimits(timeout_s=timeout_s + 30, cpu_s=1)
            r = run_python(prog, limits)
            after = run_python("assert sum(range(10)) == 45", SandboxLimits(timeout_s=timeout_s))
            ok = (not r.passed and why in r.reason and r.duration_s - (r.setup_s or 0) < limits.timeout_s + slack_s
                  and after.passed and not outside.exists())
            out[name] = {"contained": ok, "reason": r.reason[:100], "s": round(r.duration_s, 2),
                         "setup_s": None if r.setup_s is None else round(r.setup_s, 2)}
            print(f"  {name:36s} {'contained' if ok else 'NOT CONTAINED':13s} {r.duration_s:6.2f} s "
                  f"(set-up {r.setup_s or 0:4.2f} s)  {r.reason[:70]}")
    srv.close()
    return out


def gsm8k_rows(path: Path) -> list[tuple[str, str]]:
    rows = []
    for name in ("train.jsonl", "test.jsonl"):
        for line in (path / name).open(encoding="utf-8"):
            answer = json.loads(line)["answer"]
            rows.append((answer, answer.rsplit("####", 1)[1].strip().replace(",", "")))
    return rows


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gsm8k", type=Path, default=GSM8K)
    ap.add_argument("--timeout", type=float, default=3.0, help="sandbox wall-clock limit for the hostile programs")
    ap.add_argument("--quick", action="store_true", help="a sample of GSM8K and HumanEval (smoke run)")
    args = ap.parse_args(argv)
    res: dict = {"cpus": os.cpu_count(), "sandbox_isolation": list(probe())}
    print(f"sandbox layers here: {', '.join(probe())}")

    he_all = load_humaneval()
    he = he_all[: 20 if args.quick else None]
    cols = ([r["prompt"] for r in he], [r["test"] for r in he], [r["entry_point"] for r in he])
    t0 = time.perf_counter()
    canon = code_reward(cols[0], [r["canonical_solution"] for r in he], cols[1], cols[2])
    wall = time.perf_counter() - t0
    empty = code_reward(cols[0], [""] * len(he), cols[1], cols[2])
    seq = he[:20]
    t1 = time.perf_counter()
    for r in seq:
        code_reward([r["prompt"]], [r["canonical_solution"]], [r["test"]], [r["entry_point"]], workers=1)
    res |= {"humaneval_problems": len(he), "humaneval_canonical_pass": int(sum(s.score for s in canon)),
            "humaneval_empty_pass": int(sum(s.score for s in empty)),
            "ms_per_completion_code": round(1000 * wall / len(he), 1),
            "ms_per_run_code_sequential": round(1000 * (time.perf_counter() - t1) / len(seq), 1)}
    print(f"HumanEval canonical: {res['humaneval_canonical_pass']}/{len(he)} in {wall:.1f} s; empty bodies passing: "
          f"{res['humaneval_empty_pass']}")

    table = testing.hostile_completions()
    scores = code_reward([he_all[k]["prompt"] for k, _ in table.values()], [c for _, c in table.values()],
                         [he_all[k]["test"] for k, _ in table.values()], [he_all[k]["entry_point"] for k, _ in table.values()],
                         timeout_s=args.timeout)
    res |= {"code_hostile_cases": len(table), "code_hostile_zero": sum(s.score == 0.0 for s in scores),
            "code_hostile_outcomes": {n: s.reason[:100] for n, s in zip(table, scores, strict=True)}}
    print("hostile completions through the code reward:")
    for n, s in zip(table, scores, strict=True):
        print(f"  {n:44s} {'score 0' if s.score == 0.0 else 'SCORED':8s} {s.reason[:70]}")

    print("hostile programs:")
    cases = sandbox_cases(args.timeout)
    res |= {"sandbox_cases": len(cases), "sandbox_contained": sum(c["contained"] for c in cases.values()),
            "sandbox_outcomes": {k: v["reason"] for k, v in cases.items()}}

    rows = gsm8k_rows(args.gsm8k)
    if args.quick:
        rows = rows[::40]
    comps, golds = [a for a, _ in rows], [g for _, g in rows]
    t0 = time.perf_counter()
    hashes = [gsm8k_reward(a, g) for a, g in rows]
    res["ms_per_completion_gsm8k"] = round(1000 * (time.perf_counter() - t0) / len(rows), 3)
    math_reward(["q"], ["\\boxed{1}"], ["1"])  # start the child (imports sympy): not a per-completion cost
    starts = verifier().starts
    t0 = time.perf_counter()
    mv = [math_reward(["q"], [a], [g])[0] for a, g in rows]
    res["ms_per_completion_math"] = round(1000 * (time.perf_counter() - t0) / len(rows), 2)
    wrong = [a.rsplit("####", 1)[0] + "#### " + str(float(g) + 1).removesuffix(".0") for a, g in rows]
    mv_wrong = math_reward(["q"] * len(rows), wrong, golds)
    hash_wrong = [gsm8k_reward(a, g) for a, g in zip(wrong, golds, strict=True)]
    disagree = [(c[-50:], g, m.reason) for c, g, m, h in zip(comps, golds, mv, hashes, strict=True) if m.correct != h.correct]
    res |= {"gsm8k_rows": len(rows),
            "mathverify_gsm8k_agree": len(rows) - len(disagree),
            # both must say wrong (agreement on "right" would be both fooled by the off-by-one answer)
            "mathverify_gsm8k_agree_perturbed": sum(not m.correct and not h.correct for m, h in zip(mv_wrong, hash_wrong, strict=True)),
            "hash_gsm8k_correct": sum(h.correct for h in hashes), "mathverify_restarts": verifier().starts - starts}
    print(f"math-verify agrees with '####' on {res['mathverify_gsm8k_agree']}/{len(rows)} gold solutions, "
          f"{res['mathverify_gsm8k_agree_perturbed']}/{len(rows)} perturbed; disagreements: {disagree[:3]}")
    print(json.dumps(res))
    return res


if __name__ == "__main__":
    main()
