"""Run untrusted Python (a completion plus its tests) in a contained child process.

:func:`run_python` starts ``python -I -S -c <launcher>`` with :class:`subprocess.Popen` in a new
session, an empty temporary working directory (removed after) and a scrubbed environment, and
sends it the program on stdin. No ``preexec_fn`` (not safe when the caller has threads, as a Dask
worker does) and no ``SIGALRM`` (main thread only): all set-up happens inside the launcher, and
the caller bounds it with a wall clock, so it is safe from any thread. The launcher (trusted code,
before the program runs):

1. ``unshare`` new PID and network namespaces (with a user namespace when not root). In the new
   network namespace only a downed loopback exists, so no connection of any kind gets out; in the
   PID namespace the program cannot name any process outside it (``os.getppid()`` is 0), and when
   its first process dies the kernel kills every process it started.
2. forks the runner, which as root drops to an unprivileged uid (root ignores ``RLIMIT_NPROC``),
   turns on Landlock (writes allowed only beneath the temporary directory and to ``/dev/null``;
   TCP bind/connect and signals outside the sandbox refused where the kernel's ABI has them),
   sets the resource limits (:class:`SandboxLimits`), closes every other descriptor and runs the
   program with ``exec``. It reports "finished" to the launcher over a private pipe, with a nonce,
   only after the program returns, so ``exit(0)`` in a completion is a failure, not a pass.

The caller reads the output with a bound (over ``max_output_bytes`` the run is killed) and, at
``timeout_s`` after the program started (``setup_timeout_s`` bounds what comes before), kills the
process group and the runner (hence its whole PID namespace) with SIGKILL.

Where a layer is not available (no namespaces in an unprivileged container, an old kernel without
Landlock), the run goes ahead without it and :attr:`SandboxResult.isolation` lists the layers that
were in force; :func:`probe` says which are available here. Without a network namespace and
without Landlock's TCP rules the program can reach the network; without a PID namespace and
Landlock's signal scope it can signal processes of the same uid. The process-level limits (time,
memory, processes, output) hold everywhere. This contains accidents and reward-hacking habits
(``exit(0)``, runaway loops, fork bombs); it is not a boundary against a determined attacker with
a kernel exploit.
"""

from __future__ import annotations

import functools
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

__all__ = ["SandboxLimits", "SandboxResult", "probe", "readable", "run_python"]


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
    namespaces: bool = True
    """Try new PID and network namespaces (False: for tests of the fallback)."""
    landlock: bool = True
    """Try Landlock (False: for tests of the fallback)."""


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
    """Layers that were in force: ``pidns``, ``netns``, ``userns``, ``uid``, ``landlock-fs`` (writes),
    ``landlock-read``, ``landlock-net``, ``landlock-signal``, ``rlimits``."""
    setup_s: float | None = None
    """Seconds until the program started (Python's start, namespaces, limits); None if it never did."""


# Runs as `python -I -S -c LAUNCHER` (isolated mode: no PYTHON* variables, no site-packages, no cwd on
# sys.path). Reads {"code", "limits", "nonce", "uid"} on stdin; writes JSON lines on fd STATUS_FD.
_LAUNCHER = r'''
import ctypes, json, os, resource, sys
cfg = json.loads(sys.stdin.buffer.read()); status_fd = int(sys.argv[1])
os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
libc = ctypes.CDLL(None, use_errno=True)
def say(**kw): os.write(status_fd, (json.dumps(kw) + "\n").encode())
layers = []
NEWUSER, NEWPID, NEWNET = 0x10000000, 0x20000000, 0x40000000
root = os.geteuid() == 0
for flags in (([NEWPID | NEWNET] if root else []) + [NEWUSER | NEWPID | NEWNET]) * cfg["namespaces"]:
    if libc.unshare(flags) == 0:
        layers += ["pidns", "netns"] + (["userns"] if flags & NEWUSER else []); break
uid = cfg["uid"] if root else None
if uid is not None:
    os.chown(".", uid, uid)
r_fd, w_fd = os.pipe()
pid = os.fork()
if pid:
    os.close(w_fd)
    say(pid=pid)
    data, started = b"", False
    while True:
        chunk = os.read(r_fd, 65536)
        if not chunk: break
        data += chunk[: 4096 - len(data)]
        if not started and b"\n" in data:  # the runner is set up: the program's time starts now
            started = True; say(started=True)
    _, st = os.waitpid(pid, 0)
    say(report=data.decode("utf-8", "replace"), status=os.waitstatus_to_exitcode(st), layers=layers)
    os._exit(0)
os.close(r_fd); os.close(status_fd)
lim = cfg["limits"]
try:
    if uid is not None:
        # Keep only CAP_DAC_READ_SEARCH across the change, so the new uid can still read Python's own
        # files where they sit under a private home (pyenv in /root); it grants no writes.
        libc.prctl(8, 1, 0, 0, 0)  # PR_SET_KEEPCAPS
        os.setgroups([]); os.setresgid(uid, uid, uid); os.setresuid(uid, uid, uid)
        hdr = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
        caps = (ctypes.c_uint32 * 6)(1 << 2, 1 << 2, 0, 0, 0, 0)  # effective, permitted, inheritable (x2)
        if libc.capset(hdr, caps) != 0:
            raise OSError(ctypes.get_errno(), "capset")
        layers.append("uid")
    L = ctypes.c_long
    def ll(*args): return libc.syscall(*[a if not isinstance(a, int) else L(a) for a in args])
    libc.syscall.restype = L
    abi = ll(444, None, 0, 1)
    if cfg["landlock"] and abi >= 1 and libc.prctl(38, 1, 0, 0, 0) == 0:  # PR_SET_NO_NEW_PRIVS
        fs = 0x1FFF  # EXECUTE, WRITE_FILE, READ_FILE, READ_DIR, REMOVE_DIR..MAKE_SYM
        fs |= (1 << 13 if abi >= 2 else 0) | (1 << 14 if abi >= 3 else 0)  # REFER, TRUNCATE
        net = 3 if abi >= 4 else 0  # BIND_TCP, CONNECT_TCP
        scoped = 3 if abi >= 6 else 0  # abstract unix sockets, signals
        attr = (ctypes.c_uint64 * 3)(fs, net, scoped)
        size = 24 if abi >= 6 else 16 if abi >= 4 else 8
        rs = ll(444, ctypes.byref(attr), size, 0)
        class Beneath(ctypes.Structure):
            _pack_ = 1
            _fields_ = [("allowed", ctypes.c_uint64), ("fd", ctypes.c_int32)]
        ok = rs >= 0
        # Reads: Python's own files and the system's libraries, /proc and /dev; not /root, /home or the
        # project (a root run keeps CAP_DAC_READ_SEARCH, so this is what stops it reading any file).
        read = 0xD  # EXECUTE, READ_FILE, READ_DIR
        rules = [(".", fs), (os.devnull, 0x7 | (1 << 14 if abi >= 3 else 0)), ("/etc/localtime", 0x5)]
        rules += [(d, read) for d in {sys.base_prefix, sys.prefix, sys.exec_prefix, sys.base_exec_prefix,
                                       "/usr", "/lib", "/lib64", "/bin", "/proc", "/dev"}]
        for path, rights in rules:
            try:
                fd = os.open(path, os.O_PATH)
            except OSError:
                continue
            ok = ok and ll(445, rs, 1, ctypes.byref(Beneath(rights, fd)), 0) == 0
            os.close(fd)
        if ok and ll(446, rs, 0) == 0:
            layers += ["landlock-fs", "landlock-read"] + (["landlock-net"] if net else []) + (["landlock-signal"] if scoped else [])
    for name, value in (("CPU", lim["cpu_s"]), ("AS", lim["memory_bytes"]), ("NPROC", lim["max_processes"]),
                        ("FSIZE", lim["max_file_bytes"]), ("NOFILE", lim["max_open_files"]), ("CORE", 0)):
        # CPU: SIGXCPU at the soft limit (caught below: the first process of a PID namespace ignores
        # signals it has no handler for), SIGKILL a second later.
        resource.setrlimit(getattr(resource, "RLIMIT_" + name), (value, value + (name == "CPU")))
    layers.append("rlimits")
    os.closerange(3, w_fd); os.closerange(w_fd + 1, 1 << 16)
    import signal
    def on_xcpu(signum, frame):
        os.write(w_fd, b"CPU time limit exceeded"); os._exit(1)
    signal.signal(signal.SIGXCPU, on_xcpu)
    os.write(w_fd, (json.dumps({"layers": layers}) + "\n").encode())
except Exception as e:
    os.write(w_fd, ("setup failed: %r" % (e,)).encode()); os._exit(70)
code, nonce = cfg["code"], cfg["nonce"]
del cfg, lim
os.environ.clear(); os.environ.update({"PATH": "/usr/bin:/bin", "HOME": os.getcwd(), "LANG": "C.UTF-8"})
try:
    exec(compile(code, "<program>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
except SystemExit as e:
    report = "exit(%r) before the end of the program" % (e.code,)
except BaseException as e:
    tb, line = e.__traceback__, None
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == "<program>":
            line = tb.tb_lineno
        tb = tb.tb_next
    report = type(e).__name__ + (": %s" % (e,) if str(e) else "")
    if line is not None and 0 < line <= len(code.splitlines()):
        report += " (line %d: %s)" % (line, code.splitlines()[line - 1].strip()[:200])
    report = report[:500]
else:
    report = nonce
sys.stdout.flush(); sys.stderr.flush()
os.write(w_fd, report.encode())
os._exit(0)
'''

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


def run_python(code: str, limits: SandboxLimits = SandboxLimits()) -> SandboxResult:
    """Run ``code`` as a program in the sandbox; it passes when it runs to its end without raising.

    >>> run_python("assert sum(range(4)) == 6").passed
    True
    >>> run_python("while True: pass", SandboxLimits(timeout_s=0.5)).reason
    'timed out after 0.5 s'
    """
    t0 = time.monotonic()
    workdir = tempfile.mkdtemp(prefix="grpo-sandbox-")
    nonce = secrets.token_hex(16)
    cpu_s = limits.cpu_s if limits.cpu_s is not None else math.ceil(limits.timeout_s) + 1
    cfg = {"code": code, "nonce": nonce, "uid": 0x70000000 + secrets.randbelow(1 << 24),
           "namespaces": limits.namespaces, "landlock": limits.landlock,
           "limits": {"cpu_s": cpu_s, "memory_bytes": limits.memory_bytes, "max_processes": limits.max_processes,
                      "max_file_bytes": limits.max_file_bytes, "max_open_files": limits.max_open_files}}
    status_r, status_w = os.pipe()
    env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": workdir}
    proc = None
    try:
        proc = subprocess.Popen([sys.executable, "-I", "-S", "-c", _LAUNCHER, str(status_w)], cwd=workdir, env=env,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                pass_fds=(status_w,), start_new_session=True)
        os.close(status_w)
        status_w = -1
        try:
            proc.stdin.write(json.dumps(cfg).encode())
            proc.stdin.close()
        except BrokenPipeError:  # the launcher died at once: reported below as such
            pass
        out, status, why, runner = _collect(proc, status_r, t0, limits)
        if "report" in status:  # the launcher has reaped the runner; give its last output a moment to arrive
            _drain(proc, out, time.monotonic() + 0.5, limits)
        elif runner:  # not reaped, so its pid is still its own: killing it ends its whole PID namespace
            _kill(None, runner)
        _kill(proc.pid, None)  # the group, whatever is left in it (the launcher is not reaped yet: no pid reuse)
        proc.wait()
    finally:
        os.close(status_r)
        if status_w >= 0:
            os.close(status_w)
        if proc is not None and proc.poll() is None:
            _kill(proc.pid, None)
            proc.wait()
        shutil.rmtree(workdir, ignore_errors=True)
    text = bytes(out[: limits.keep_output_bytes]).decode("utf-8", "replace")
    final = status.get("report")
    layers, _, report = (final or "").partition("\n") if final and final.startswith("{") else ("", "", final or "")
    isolation = tuple(json.loads(layers)["layers"]) if layers else tuple(status.get("layers", ()))
    code_ = status.get("status", proc.returncode)
    if why is None:
        if report == nonce:
            why = "passed"
        elif report:
            why = report
        elif "report" not in status:  # the launcher itself died: killed by the program where nothing stopped it
            why = f"the sandbox launcher died ({_status_text(code_)}) before the program ended"
        elif code_ is not None and code_ < 0:
            why = f"killed by {_status_text(code_)}"
        else:
            why = f"exited with status {code_} before the end of the program"
    setup_s = status["started"] - t0 if "started" in status else None
    return SandboxResult(why == "passed", why, time.monotonic() - t0, code_, text, isolation, setup_s)


def readable(fds: list[int], timeout_s: float) -> list[int]:
    """The descriptors of ``fds`` ready to read (or at EOF) within ``timeout_s``; ``poll``, so a
    process with over 1024 open files (select's limit) works too."""
    p = select.poll()
    for fd in fds:
        p.register(fd, select.POLLIN | select.POLLHUP | select.POLLERR)
    return [fd for fd, _ in p.poll(max(0, int(timeout_s * 1000)) + 1)]


def _drain(proc, out: bytearray, deadline: float, limits: SandboxLimits) -> bool:
    """Read output until EOF or ``deadline``; False when it passed ``max_output_bytes``."""
    fd = proc.stdout.fileno()
    while (left := deadline - time.monotonic()) > 0:
        if not readable([fd], left):
            break
        chunk = os.read(fd, 65536)
        if not chunk:
            break
        out += chunk
        if len(out) > limits.max_output_bytes:
            return False
    return True


def _collect(proc, status_fd: int, t0: float, limits: SandboxLimits):
    """Read output and status lines until the launcher's final report, the deadline or the output cap."""
    out, status, buf, runner = bytearray(), {}, b"", None
    fds = [proc.stdout.fileno(), status_fd]
    deadline = t0 + limits.setup_timeout_s
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            if "started" not in status:
                return out, status, f"set-up took over {limits.setup_timeout_s:g} s", runner
            return out, status, f"timed out after {limits.timeout_s:g} s", runner
        ready = readable(fds, left)
        if proc.stdout.fileno() in ready:
            chunk = os.read(proc.stdout.fileno(), 65536)
            if not chunk:
                fds.remove(proc.stdout.fileno())
            out += chunk
            if len(out) > limits.max_output_bytes:
                return out, status, f"output over {limits.max_output_bytes} bytes", runner
        if status_fd in ready:
            chunk = os.read(status_fd, 65536)
            buf += chunk
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                msg = json.loads(line)
                runner = msg.get("pid", runner)
                if msg.get("started"):
                    msg["started"] = time.monotonic()
                    deadline = msg["started"] + limits.timeout_s
                status.update(msg)
            if "status" in status:
                return out, status, None, runner
            if not chunk:  # the launcher died without a report (killed by the program, or a setup error)
                return out, status, None, runner


@functools.cache
def probe() -> tuple[str, ...]:
    """The isolation layers a sandboxed run gets on this machine (see :attr:`SandboxResult.isolation`)."""
    return run_python("pass", SandboxLimits(timeout_s=30)).isolation
