"""grpo_kit.adapter_cache: the flock protocol that lets processes share fetched copies.

Holders are separate open file descriptions (as separate processes have), which is what ``flock``
tells apart; the store-level behaviour across real processes is in tests/test_adapters.py."""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import threading
import time

from grpo_kit.adapter_cache import (
    close_all,
    copy_matches,
    hold_shared,
    lock_path,
    process_cache_dir,
    remove_unless_held,
    sha256_file,
)


def cached_copy(tmp_path, name: str = "v000001") -> str:
    entry = tmp_path / name
    entry.mkdir()
    (entry / "adapter_model.safetensors").write_bytes(b"weights")
    return str(entry)


def test_the_last_holder_to_let_go_removes_the_copy_and_its_lock_file(tmp_path):
    entry = cached_copy(tmp_path)
    assert lock_path(entry) == str(tmp_path / ".v000001.lock")
    a, b = hold_shared(lock_path(entry)), hold_shared(lock_path(entry))
    assert remove_unless_held(entry, a) is False  # b still holds it
    assert os.path.isdir(entry) and os.path.exists(lock_path(entry))
    assert remove_unless_held(entry, b) is True
    assert not os.path.exists(entry) and not os.path.exists(lock_path(entry))
    for fd in (a, b):  # both closed either way
        try:
            os.fstat(fd)
        except OSError:
            continue
        raise AssertionError(f"fd {fd} left open")


def test_a_waiter_behind_a_remover_locks_the_new_lock_file_not_the_unlinked_one(tmp_path):
    """A holder waiting while the last holder removes the copy gets the lock of the file that was
    unlinked; it must notice and hold the path's new lock file, or the next download would be
    unprotected (the remover's lock is on a file nobody else can open)."""
    entry = cached_copy(tmp_path)
    remover = hold_shared(lock_path(entry))
    import fcntl

    fcntl.flock(remover, fcntl.LOCK_EX)  # mid-removal
    got: list[int] = []
    waiter = threading.Thread(target=lambda: got.append(hold_shared(lock_path(entry))))
    waiter.start()
    time.sleep(0.3)
    assert not got  # blocked behind the exclusive lock
    os.unlink(lock_path(entry))
    os.close(remover)  # releases the lock of the unlinked file
    waiter.join(10)
    assert got, "hold_shared never returned"
    fd = got[0]
    here, there = os.fstat(fd), os.stat(lock_path(entry))
    assert (here.st_dev, here.st_ino) == (there.st_dev, there.st_ino)
    other = os.open(lock_path(entry), os.O_RDWR)  # another holder sees the waiter's shared lock
    try:
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
        raise AssertionError("the new lock file is not held")
    except BlockingIOError:
        pass
    finally:
        os.close(other)
    os.close(fd)


def test_close_all_lets_go_without_removing(tmp_path):
    entry = cached_copy(tmp_path)
    held = {1: hold_shared(lock_path(entry))}
    close_all(held)
    assert held == {} and os.path.isdir(entry)
    assert remove_unless_held(entry, hold_shared(lock_path(entry))) is True  # no hold was left behind


def test_a_copy_matches_only_with_every_file_and_its_sha256(tmp_path):
    entry = cached_copy(tmp_path)
    (tmp_path / "v000001" / "adapter_config.json").write_text("{}")
    man = {"files": {"adapter_model.safetensors": {"sha256": hashlib.sha256(b"weights").hexdigest()},
                     "adapter_config.json": {"sha256": hashlib.sha256(b"{}").hexdigest()}}}
    assert sha256_file(os.path.join(entry, "adapter_config.json")) == man["files"]["adapter_config.json"]["sha256"]
    assert copy_matches(entry, man)
    (tmp_path / "v000001" / "adapter_model.safetensors").write_bytes(b"weightz")
    assert not copy_matches(entry, man)
    os.remove(os.path.join(entry, "adapter_model.safetensors"))
    assert not copy_matches(entry, man)


def child_cache_dir(q) -> None:
    q.put(process_cache_dir())


def test_process_cache_dir_is_per_process_and_a_child_removes_its_own():
    """A multiprocessing child (a Dask worker is one, started by forkserver by default) ends in
    ``os._exit``, past ``atexit``: its cache directory goes with multiprocessing's exit handlers;
    its parent's stays. A fork child ends the same way (``popen_fork``); forkserver itself is not
    used here: the process's one forkserver, started without the kit's preloads, would serve every
    later LocalCluster of the test run (test_cluster checks those preloads)."""
    mine = process_cache_dir()
    assert process_cache_dir() == mine and os.path.isdir(mine)
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=child_cache_dir, args=(q,))
    p.start()
    theirs = q.get(timeout=60)
    p.join(60)
    assert p.exitcode == 0 and theirs != mine
    assert os.path.isdir(mine) and not os.path.exists(theirs)


def test_a_killed_processs_cache_is_removed_once_its_process_is_gone(tmp_path):
    """A SIGKILLed worker (preempted, or killed by these tests) runs no exit handler; its directory
    is removed by a later cache, once its process is gone and it is old enough, never before."""
    from grpo_kit import adapter_cache

    ctx = mp.get_context("fork")
    p = ctx.Process(target=time.sleep, args=(60,))
    p.start()
    dead, alive, young = (tmp_path / f"grpo-adapters-{p.pid}-x", tmp_path / f"grpo-adapters-{os.getpid()}-y",
                          tmp_path / "grpo-adapters-999999999-z")
    for d in (dead, alive, young):
        d.mkdir()
        (d / "adapter_model.safetensors").write_bytes(b"x")
    old = time.time() - 2 * adapter_cache.ORPHAN_AGE_S
    for d in (dead, alive):
        os.utime(d, (old, old))
    assert adapter_cache.remove_orphans(str(tmp_path)) == []  # its process is still there
    p.kill()
    p.join(30)
    assert adapter_cache.remove_orphans(str(tmp_path)) == [str(dead)]
    assert not dead.exists() and alive.exists() and young.exists()  # a live process's, and one too new


def test_a_cache_whose_process_holds_its_lock_is_kept_though_its_pid_looks_gone(tmp_path):
    """Review finding (2026-12-03): a process in another PID namespace (a container sharing the temp
    directory) looks dead by its pid, and its cache was removed while it fetched; a live process
    holds a lock in its cache, which the cleanup cannot take."""
    import fcntl

    from grpo_kit import adapter_cache

    held, left = tmp_path / "grpo-adapters-999999998-a", tmp_path / "grpo-adapters-999999997-b"
    for d in (held, left):
        d.mkdir()
        (d / adapter_cache.ALIVE).write_bytes(b"")
    fd = os.open(held / adapter_cache.ALIVE, os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_SH)  # (the lock a live process in another namespace holds)
    try:
        old = time.time() - 2 * adapter_cache.ORPHAN_AGE_S
        for d in (held, left):
            os.utime(d, (old, old))
        assert adapter_cache.remove_orphans(str(tmp_path)) == [str(left)]
        assert held.exists()
    finally:
        os.close(fd)
    assert os.path.isfile(os.path.join(adapter_cache.process_cache_dir(), adapter_cache.ALIVE))
