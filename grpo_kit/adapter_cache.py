"""The local copies of fetched adapter versions, shared safely by the processes of one machine.

:class:`grpo_kit.adapters.AdapterStore` downloads a version into a cache directory (by default
:func:`process_cache_dir`, one per process) and hands engines and trainers its path. Processes may
share a ``cache_dir``, so a copy is removed only when no process still holds it:

- Each holder of a copy ``v000123`` keeps a shared ``flock`` on its lock file ``.v000123.lock``
  beside it (:func:`lock_path`, :func:`hold_shared`), from its fetch until it lets the copy go.
- Letting go (:func:`remove_unless_held`) upgrades the hold to an exclusive lock without waiting:
  if that fails, another holder remains and the copy stays; if it succeeds, this was the last
  holder, which removes the copy and unlinks the lock file while it holds the lock.
- A process that waits for a shared hold while a remover holds the lock exclusively gets the lock
  of a file that is then unlinked; :func:`hold_shared` checks that the file it locked is still the
  one at the path and opens the path again when it is not, so a new download is never covered by
  a lock nobody else can see.

A copy is trusted only when every file's sha256 matches the version's manifest (:func:`copy_matches`).
"""

from __future__ import annotations

import atexit
import fcntl
import glob
import hashlib
import multiprocessing.util
import os
import shutil
import tempfile
import threading
import time

READ_CHUNK = 1 << 20
"""Bytes read at a time when hashing a file."""


def lock_path(entry: str) -> str:
    """The lock file of a cached version directory: ``.v000123.lock`` beside ``v000123``."""
    head, tail = os.path.split(entry)
    return os.path.join(head, f".{tail}.lock")


def hold_shared(path: str) -> int:
    """An open fd of the lock file ``path`` (created if missing) holding a shared ``flock`` on it;
    waits while a remover holds it exclusively. The fd locks the file that is at ``path`` when it
    returns: a remover unlinks the lock file while holding it, so a waiter that got the lock of an
    unlinked file opens the path again."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
            got, now = os.fstat(fd), os.stat(path)
        except FileNotFoundError:  # unlinked between our flock and stat: lock the new one
            os.close(fd)
            continue
        except BaseException:
            os.close(fd)
            raise
        if (got.st_dev, got.st_ino) == (now.st_dev, now.st_ino):
            return fd
        os.close(fd)


def remove_unless_held(entry: str, fd: int) -> bool:
    """Give up our shared hold ``fd`` on the cached version directory ``entry``, removing the
    directory and its lock file if no one else holds it (we then hold the lock exclusively while
    removing). Returns whether it removed them; ``fd`` is closed either way."""
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # shared -> exclusive, or fail if others hold it
        except BlockingIOError:
            return False  # still held elsewhere: its last holder removes it
        shutil.rmtree(entry, ignore_errors=True)
        try:
            os.unlink(lock_path(entry))
        except FileNotFoundError:
            pass
        return True
    finally:
        os.close(fd)


def close_all(held: dict[int, int]) -> None:
    """Close the lock fds in ``held`` (version -> fd), letting go of those holds without removing
    anything, and empty it."""
    for fd in held.values():
        try:
            os.close(fd)
        except OSError:
            pass
    held.clear()


def sha256_file(path: str) -> str:
    """The hex sha256 of a file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(READ_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def copy_matches(dest: str, manifest: dict) -> bool:
    """Whether the directory ``dest`` holds every file of ``manifest["files"]`` with its sha256."""
    for name, info in manifest["files"].items():
        local = os.path.join(dest, name)
        if not os.path.isfile(local) or sha256_file(local) != info["sha256"]:
            return False
    return True


_process_cache: tuple[int, str] | None = None
_process_cache_lock = threading.Lock()


def process_cache_dir() -> str:
    """A temp directory for this process's fetches, removed when the process exits (a forked
    child gets its own on first use, and never removes its parent's). Removed by ``atexit`` and by a
    multiprocessing finalizer: a Dask worker started by forkserver or spawn ends in ``os._exit``,
    which skips ``atexit`` but not multiprocessing's own exit handlers (with ``atexit`` alone every
    worker left its cache behind: 800 directories, 2.9 GB in /tmp after two days of this suite). A
    killed process (SIGKILL: a preempted or killed worker) runs no handler at all, so a new cache
    first removes those whose process is gone (:func:`remove_orphans`)."""
    global _process_cache
    with _process_cache_lock:
        if _process_cache is None or _process_cache[0] != os.getpid():
            remove_orphans()
            path = tempfile.mkdtemp(prefix=f"grpo-adapters-{os.getpid()}-")
            _hold_alive(path)
            atexit.register(_remove_own_dir, os.getpid(), path)
            multiprocessing.util.Finalize(None, _remove_own_dir, args=(os.getpid(), path), exitpriority=0)
            _process_cache = (os.getpid(), path)
        return _process_cache[1]


ALIVE = ".alive"
"""The file in a process's cache directory that the process holds a shared ``flock`` on while it
lives: a process in another PID namespace (a container sharing the temp directory, another node on
shared storage) looks dead by its pid, and a review saw its cache removed while it fetched."""
_alive_fds: list[int] = []  # (held for the process's lifetime)


def _hold_alive(path: str) -> None:
    try:
        fd = os.open(os.path.join(path, ALIVE), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        fcntl.flock(fd, fcntl.LOCK_SH)
        _alive_fds.append(fd)
    except OSError:  # a file system without flock: the pid and the age decide, as before
        pass


def _held_elsewhere(path: str) -> bool:
    """Whether a live process holds ``path``'s :data:`ALIVE` lock."""
    try:
        fd = os.open(os.path.join(path, ALIVE), os.O_RDWR | os.O_CLOEXEC)
    except OSError:  # none (a cache made before the lock, or being made): not held
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except OSError:
        return True
    finally:
        os.close(fd)


ORPHAN_AGE_S = 60.0
"""A cache directory is removed as an orphan only once it is this old (and its process is gone)."""


def remove_orphans(root: str | None = None) -> list[str]:
    """Remove the cache directories (``grpo-adapters-<pid>-*`` under ``root``, default the temp
    directory) of processes that no longer exist, at least :data:`ORPHAN_AGE_S` old and whose
    :data:`ALIVE` lock no process holds; returns them."""
    removed = []
    for path in glob.glob(os.path.join(root or tempfile.gettempdir(), "grpo-adapters-*-*")):
        pid = os.path.basename(path).split("-")[2]
        try:
            if not pid.isdigit() or _alive(int(pid)) or time.time() - os.stat(path).st_mtime < ORPHAN_AGE_S or \
                    _held_elsewhere(path):
                continue
        except OSError:
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        return True
    return True


def _remove_own_dir(pid: int, path: str) -> None:
    if os.getpid() == pid:  # a forked child inherits atexit handlers; the directory is not its own
        shutil.rmtree(path, ignore_errors=True)
