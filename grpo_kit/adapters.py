"""Versioned LoRA adapter store on fsspec: a local directory, ``s3://``, ``gs://`` or any fsspec URL.

The trainer publishes each adapter under an integer ``version``; rollout workers fetch a version
into a per-process cache directory that ``PeftModel.from_pretrained`` and vLLM's
``LoRARequest(path)`` both accept. Layout under ``root``::

    adapters/v000123/<attempt>/adapter_model.safetensors
    adapters/v000123/<attempt>/adapter_config.json   (and any other file the adapter directory held)
    adapters/v000123/manifest.json           version, parent, created (unix s), attempt, per file: sha256
                                             and key (its path under v000123/), meta
    state/<name>.pt                          save_state / load_state (torch.save; weights_only load)
    state/<name>.json                        write_json / read_json

The manifest is written last, so a version without one does not exist: ``versions()`` skips it and
``fetch`` refuses it. Each publish attempt uploads its files under its own random ``<attempt>``
folder and its manifest names them, so two attempts at one version (a retried task whose first try
still runs) never write the same object: whichever manifest lands, the files it names are its own
attempt's, and a losing attempt's uploads, however late, land beside them. A loser removes its
files when its manifest is refused; ``delete`` removes the whole version folder, every attempt's
leftovers included. Stores written before attempts had folders (manifest ``format`` 1: files
directly under ``v000123/``) are read as before. A version with a manifest is immutable:
``publish`` refuses to overwrite it, and ``fetch`` checks every file's sha256 against the manifest
before returning a path. Single-file writes (manifest, JSON, state) are
atomic from a reader's view: a temp file and a rename on a local disk, one PUT on object stores.
Nothing is unpickled from the store except through ``torch.load(weights_only=True)``.

Credentials and endpoints: ``storage_options`` go to the fsspec filesystem unchanged (for s3fs:
``key``, ``secret``, ``token``, ``profile``, ``endpoint_url`` or ``client_kwargs={"endpoint_url":
...}``, ``anon``). Without them the backend's usual chain applies: for s3fs the ``AWS_*``
environment variables, ``~/.aws/credentials`` and ``~/.aws/config``, instance roles, and for the
endpoint ``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL`` (read by botocore) or
``FSSPEC_S3_ENDPOINT_URL`` (fsspec's own config); for gcsfs, Application Default Credentials.
The options travel with the store when it is pickled to Dask workers.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import re
import shutil
import tempfile
import threading
import time
import uuid
import weakref
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

from grpo_kit.adapter_cache import (
    close_all,
    copy_matches,
    hold_shared,
    lock_path,
    process_cache_dir,
    remove_unless_held,
    sha256_file,
)
from grpo_kit.adapter_save import save_adapter

MANIFEST = "manifest.json"
MANIFEST_FORMAT = 2
"""2: each file's ``key`` (its path under the version folder, in the attempt's folder); 1: no keys,
files directly in the version folder (still read)."""
REQUIRED_FILES = ("adapter_config.json", "adapter_model.safetensors")
_VERSION_DIR = re.compile(r"v(\d+)")
_ATTEMPT = re.compile(r"[0-9a-f]{16}")
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*(/[A-Za-z0-9_][A-Za-z0-9_.-]*)*")


def new_attempt() -> str:
    """A fresh publish attempt's id (the folder its files go to; the manifest's ``attempt``)."""
    return uuid.uuid4().hex[:16]


class VersionNotFoundError(KeyError):
    """The version has no manifest in the store (never published, or a publish that did not finish)."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0])


class VersionExistsError(FileExistsError):
    """The version is already published; versions are immutable."""


class ChecksumError(ValueError):
    """A fetched file does not match the sha256 in its version's manifest."""


class AdapterStore:
    """Versioned LoRA adapters, optimizer state and run state under one fsspec ``root``.

    ``fs`` and ``path`` are the fsspec filesystem and the root as that filesystem names it.
    ``cache_dir`` holds fetched versions; by default a per-process temp directory removed at exit.
    It keeps the ``cache_versions`` most recently fetched versions: fetching another evicts the least
    recently fetched one (a long run would otherwise keep every version it ever sampled from, about
    175 MB each for an 8B model at r16). Callers read a fetched directory right away (engines and
    trainers load the adapter into memory), and fetching it again re-downloads an evicted version.

    Processes may share a ``cache_dir``: each holds a shared ``flock`` on a version's lock file
    (``.v000123.lock`` beside it) from its fetch until it evicts that version, and eviction removes
    a copy only when it gets the lock exclusively, so no process removes a copy another one still
    holds; the last holder to evict it removes it (:mod:`grpo_kit.adapter_cache`). A store that is
    garbage-collected lets go of its holds (its copies then stay on disk until some process fetches
    and evicts them again).
    """

    def __init__(self, root: str, storage_options: dict | None = None, cache_dir: str | None = None,
                 cache_versions: int = 4) -> None:
        if cache_versions < 1:
            raise ValueError(f"cache_versions must be >= 1, got {cache_versions}")
        self.cache_versions = cache_versions
        self.storage_options = dict(storage_options or {})
        self.fs, path = fsspec.core.url_to_fs(root, **self.storage_options)
        self._local = isinstance(self.fs, LocalFileSystem)
        self.path = os.path.abspath(path) if self._local else path.rstrip("/")
        self.root = self.path if self._local else self.fs.unstrip_protocol(self.path)
        self.cache_dir = cache_dir
        self._reset_process_state()

    def _reset_process_state(self) -> None:
        held = getattr(self, "_held", None)
        if held is not None:  # forked: the parent's holds are the parent's (closing ours keeps them)
            self._finalizer.detach()
            close_all(held)
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._version_locks: dict[int, threading.Lock] = {}
        self._fetched: dict[int, str] = {}
        self._held: dict[int, int] = {}  # version -> fd of its lock file, shared flock held
        self._held_at: dict[int, str] = {}  # version -> the cached copy that fd holds
        self._finalizer = weakref.finalize(self, close_all, self._held)
        self._manifests: dict[int, dict] = {}

    def __reduce__(self):
        # The filesystem, locks and caches are per process: a worker rebuilds them from the arguments.
        return (AdapterStore, (self.root, self.storage_options, self.cache_dir, self.cache_versions))

    def __repr__(self) -> str:
        return f"AdapterStore({self.root!r})"

    # ---- paths -----------------------------------------------------------------------------------

    def _version_path(self, version: int) -> str:
        return f"{self.path}/adapters/v{_check_version(version):06d}"

    def version_url(self, version: int) -> str:
        """Where ``version`` lives in the store (a local path or a URL)."""
        return f"{self.root}/adapters/v{_check_version(version):06d}"

    def _state_path(self, name: str, ext: str) -> str:
        if not isinstance(name, str) or not _NAME.fullmatch(name) or ".." in name.split("/"):
            raise ValueError(f"state name must be a relative path of [A-Za-z0-9_.-] segments, got {name!r}")
        return f"{self.path}/state/{name}{ext}"

    # ---- publishing ------------------------------------------------------------------------------

    def publish(self, peft_model, version: int, meta: dict | None = None, parent: int | None = None,
                attempt: str | None = None) -> str:
        """Save ``peft_model``'s active adapter (:func:`save_adapter`) as ``version``; returns its URL."""
        _check_version(version)
        if self.exists(version):  # fail before spending time on saving
            raise self._exists_error(version)
        with tempfile.TemporaryDirectory(prefix="grpo-adapter-") as tmp:
            save_adapter(peft_model, tmp)
            return self.publish_dir(tmp, version, meta=meta, parent=parent, attempt=attempt)

    def publish_dir(self, local_dir: str, version: int, meta: dict | None = None, parent: int | None = None,
                    attempt: str | None = None) -> str:
        """Publish an adapter directory already saved with ``save_pretrained`` as ``version``; returns its URL.
        ``attempt``: this attempt's id (16 lowercase hex digits, :func:`new_attempt`; a fresh one if
        None), which the manifest records: a writer that passes its own knows it without reading back.

        Every top-level file is uploaded into this attempt's own folder, then the manifest naming
        them. Refuses a version that has a manifest. Of two writers racing on one version exactly
        one manifest lands; the other gets :class:`VersionExistsError` and removes its own files.
        Neither writes the other's files, so the version that lands verifies whatever the loser did.
        """
        _check_version(version)
        if parent is not None:
            _check_version(parent)
        names = sorted(n for n in os.listdir(local_dir) if os.path.isfile(os.path.join(local_dir, n)))
        missing = [n for n in REQUIRED_FILES if n not in names]
        if missing:
            raise FileNotFoundError(f"{local_dir} is not a safetensors PEFT adapter directory: missing {missing}")
        if MANIFEST in names:
            raise ValueError(f"{local_dir} holds a {MANIFEST}; the store writes its own")
        meta = dict(meta or {})
        try:  # fail on unserializable metrics before anything is uploaded, as the manifest is written
            _json_bytes(meta)  # (sorted keys: a dict mixing int and str keys failed only after the upload)
        except (TypeError, ValueError) as e:
            raise TypeError(f"publish v{version}: meta is not JSON the manifest can hold ({e}); use str keys "
                            "and plain values") from e
        if self.exists(version):
            raise self._exists_error(version)

        vpath = self._version_path(version)
        attempt = new_attempt() if attempt is None else attempt
        if not _ATTEMPT.fullmatch(attempt):
            raise ValueError(f"attempt {attempt!r}: 16 lowercase hex digits expected (adapters.new_attempt())")
        if self._local:
            self.fs.makedirs(f"{vpath}/{attempt}", exist_ok=True)
        files = {}
        for name in names:
            local = os.path.join(local_dir, name)
            key = f"{attempt}/{name}"
            files[name] = {"sha256": sha256_file(local), "size": os.path.getsize(local), "key": key}
            self.fs.put_file(local, f"{vpath}/{key}")
        manifest = {
            "format": MANIFEST_FORMAT,
            "version": version,
            "parent": parent,
            "created": time.time(),
            "attempt": attempt,
            "files": files,
            "meta": meta,
        }
        try:
            self._write_bytes(f"{vpath}/{MANIFEST}", _json_bytes(manifest), exclusive=True)
        except FileExistsError:  # another writer finished the same version first: ours are leftovers
            self.fs.invalidate_cache(vpath)
            there = self._read_manifest(version)
            if there is not None and there.get("attempt") == attempt:  # ours landed (a PUT retried after it did)
                return self.version_url(version)
            try:
                self.fs.rm(f"{vpath}/{attempt}", recursive=True)
            except OSError:  # best effort: delete() removes whatever is left with the version
                pass
            raise self._exists_error(version) from None
        return self.version_url(version)

    def _exists_error(self, version: int) -> VersionExistsError:
        return VersionExistsError(
            f"adapter version {version} already exists at {self.version_url(version)}; versions are immutable, "
            f"publish a new one (latest is {self.latest()})"
        )

    # ---- listing ---------------------------------------------------------------------------------

    def versions(self) -> list[int]:
        """Published versions (those with a manifest), ascending."""
        return self._scan()[0]

    def unpublished(self) -> list[int]:
        """Versions whose folder holds files but no manifest, ascending: a publish that has not
        written its manifest yet (or never will: it crashed), or a deletion that removed the
        manifest and failed before the files (retention sweeps those)."""
        published, folders = self._scan()
        return sorted(set(folders) - set(published))

    def _scan(self) -> tuple[list[int], list[int]]:
        """(versions with a manifest, versions with any file), from one listing."""
        base = f"{self.path}/adapters"
        self.fs.invalidate_cache(base)  # s3fs caches listings
        try:
            found = self.fs.find(base)  # one recursive listing on object stores
        except FileNotFoundError:
            return [], []
        out, folders = set(), set()
        top = base.split("://")[-1].strip("/")  # find() gives paths without the protocol
        for p in found:
            rel = p.split("://")[-1].strip("/").removeprefix(top).strip("/").split("/")
            # only a folder directly in adapters/ named as _version_path names it (a nested copy or
            # "v12" would list a version that exists() and fetch() cannot find)
            if len(rel) >= 2 and (m := _VERSION_DIR.fullmatch(rel[0])) and rel[0] == f"v{int(m.group(1)):06d}":
                folders.add(int(m.group(1)))
                if len(rel) == 2 and rel[1] == MANIFEST:
                    out.add(int(m.group(1)))
        return sorted(out), sorted(folders)

    def latest(self) -> int | None:
        """The highest published version, or None for an empty store."""
        vs = self.versions()
        return vs[-1] if vs else None

    def exists(self, version: int) -> bool:
        """Whether ``version`` is published (has a manifest)."""
        path = f"{self._version_path(version)}/{MANIFEST}"
        self.fs.invalidate_cache(path)
        return self.fs.exists(path)

    def manifest(self, version: int, fresh: bool = False) -> dict:
        """The manifest of ``version``; raises :class:`VersionNotFoundError` when it is not published.
        Manifests are cached per process (a version is immutable while it exists); ``fresh`` reads the
        store again, for a version that may have been deleted and published anew since, and when it
        was (or is gone) this process forgets its cached manifest and fetched copy of it."""
        self._check_process()
        if fresh:
            with self._version_lock(version):  # not while a fetch of this version reads its manifest
                man = self._read_manifest(version)  # a read that raises keeps what this process knew
                before = self._manifests.pop(version, None)
                if man is None or (before is not None and before.get("attempt") != man.get("attempt")):
                    self._forget(version)
                if man is None:  # no listing here: callers on the hot path ask about a version that may be gone
                    raise VersionNotFoundError(f"adapter version {version} not found in {self.root}")
                self._manifests[version] = man
                return man
        if version in self._manifests:
            return self._manifests[version]
        man = self._read_manifest(version)
        if man is None:
            raise self._not_found(version)
        self._manifests[version] = man
        return man

    def _read_manifest(self, version: int) -> dict | None:
        path = f"{self._version_path(version)}/{MANIFEST}"
        self.fs.invalidate_cache(path)  # s3fs sizes files from cached listings, which may predate the manifest
        try:
            man = json.loads(self.fs.cat_file(path))
        except FileNotFoundError:
            return None
        if man.get("version") != version:
            raise ValueError(f"manifest of adapter version {version} names version {man.get('version')}")
        return man

    def _version_lock(self, version: int) -> threading.Lock:
        with self._lock:
            return self._version_locks.setdefault(version, threading.Lock())

    def _forget(self, version: int) -> None:
        """Drop this process's cached manifest and fetched copy of ``version`` (deleted, or published
        anew), giving up its hold on the copy (removed unless another holder has it). The caller
        holds the version's lock."""
        with self._lock:
            self._manifests.pop(version, None)
            self._fetched.pop(version, None)
            fd = self._held.pop(version, None)
            path = self._held_at.pop(version, None)
        if fd is not None and path is not None:
            remove_unless_held(path, fd)

    def attempt(self, version: int) -> str | None:
        """The publish attempt of ``version`` as the store holds it now (read fresh; None for version 0,
        the base model, and for stores older than attempts). Raises :class:`VersionNotFoundError`
        (without listing the store)."""
        return self.manifest(version, fresh=True).get("attempt") if version else None

    def descends(self, version: int) -> bool:
        """Whether ``version`` was trained from the ``version - 1`` the store holds now: its manifest's
        ``meta["parent_attempt"]`` (written by :func:`grpo_kit.publish.publish_step`) names that
        version's attempt. False when ``version - 1`` is gone, or was taken back and published anew
        since (``version`` is then an orphan, trained from weights the run no longer has); True for
        versions published without the key (older stores); False when ``version`` itself is gone. Both
        manifests are read fresh."""
        try:
            meta = self.manifest(version, fresh=True).get("meta", {})
        except VersionNotFoundError:  # deleted meanwhile (an orphan another step replaced)
            return False
        if "parent_attempt" not in meta:
            return True
        try:
            return meta["parent_attempt"] == self.attempt(version - 1)
        except VersionNotFoundError:
            return False

    def _not_found(self, version: int) -> VersionNotFoundError:
        vs = self.versions()
        shown = vs if len(vs) <= 10 else [*vs[:3], "...", *vs[-3:]]
        avail = f"available: {shown}" if vs else "the store has no published versions"
        return VersionNotFoundError(f"adapter version {version} not found in {self.root} ({avail})")

    def delete(self, version: int, leftovers: bool = False) -> None:
        """Remove a published ``version`` (retention: :mod:`grpo_kit.retention`): the manifest first,
        so the version stops existing before any of its files go, then the files that manifest named
        (its attempt's folder; an old layout's top-level files). Another attempt's folder is left: it
        may be a publish of this version running now (a step retried while an orphan is deleted),
        whose files a recursive removal would take from under its manifest. ``leftovers=True`` (for
        retention, long past any publish of ``version``) removes the whole folder, a crashed
        attempt's leftovers too (a losing attempt removes its own). A missing version is a no-op.
        This process forgets its copy; copies other processes fetched stay in their caches until
        evicted, or until a fresh read of the manifest there finds the version gone or replaced."""
        vpath = self._version_path(version)
        self.fs.invalidate_cache(vpath)
        removed = self._read_manifest(version)
        if removed is not None:
            self.fs.rm_file(f"{vpath}/{MANIFEST}")
        with self._version_lock(version):
            self._forget(version)
        attempt = (removed or {}).get("attempt")
        if leftovers:
            try:
                self.fs.rm(vpath, recursive=True)
            except FileNotFoundError:
                pass
            self.fs.invalidate_cache(vpath)
            return
        try:
            entries = self.fs.ls(vpath, detail=True)
        except FileNotFoundError:
            entries = []
        for entry in entries:
            name = entry["name"].rstrip("/").rsplit("/", 1)[-1]
            try:
                if entry.get("type") == "directory" and attempt is not None and name == attempt:
                    self.fs.rm(f"{vpath}/{name}", recursive=True)
                elif entry.get("type") != "directory" and name != MANIFEST:  # an old layout's files
                    self.fs.rm_file(f"{vpath}/{name}")
            except FileNotFoundError:
                pass
        if self._local:  # an empty folder left on disk (object stores have none); a publish recreates it
            with contextlib.suppress(OSError):
                os.rmdir(vpath)
        self.fs.invalidate_cache(vpath)

    # ---- fetching --------------------------------------------------------------------------------

    def fetch(self, version: int) -> str:
        """A local directory holding ``version``, every file checked against the manifest's sha256.

        Cached per process: a second fetch of the same version returns the same path at once. The
        copy stays on disk until this store evicts it, whatever other processes sharing
        ``cache_dir`` evict (class docstring).
        """
        self._check_process()
        _check_version(version)
        with self._version_lock(version):  # one download per version; other versions proceed in parallel
            with self._lock:
                hit = self._fetched.pop(version, None)
                if hit is not None and os.path.isdir(hit):
                    self._fetched[version] = hit  # most recently used last
                    return hit
                fd, held_at = self._held.pop(version, None), self._held_at.pop(version, None)
            man = self.manifest(version)
            # one folder per publish attempt: a version published anew never replaces a copy another
            # holder sharing cache_dir may still be reading
            dest = os.path.join(self._cache_root(), f"v{version:06d}" + (f"-{man['attempt']}" if man.get("attempt") else ""))
            if fd is not None and held_at != dest:  # a hold on an earlier attempt's copy: let it go
                if held_at is not None:
                    remove_unless_held(held_at, fd)
                else:
                    os.close(fd)
                fd = None
            try:
                if fd is None:  # waits while another process removes its copy, then downloads anew
                    fd = hold_shared(lock_path(dest))
                if not (os.path.isdir(dest) and copy_matches(dest, man)):
                    self._download(version, man, dest)
            except BaseException:
                if fd is not None:
                    os.close(fd)
                raise
            with self._lock:
                self._fetched[version] = dest
                self._held[version], self._held_at[version] = fd, dest
        self._evict()
        return dest

    def _evict(self) -> None:
        """Let go of the least recently fetched versions beyond ``cache_versions``, removing each
        copy unless another holder (a process or store sharing ``cache_dir``) still has it."""
        with self._lock:
            old = list(self._fetched)[: max(0, len(self._fetched) - self.cache_versions)]
            gone = [(v, self._fetched.pop(v)) for v in old]
            for v in old:  # a long run fetches thousands of versions: per-version entries go too
                self._manifests.pop(v, None)
        for v, path in gone:
            with self._lock:
                lock = self._version_locks.setdefault(v, threading.Lock())
            with lock:
                with self._lock:
                    fd = None if v in self._fetched else self._held.pop(v, None)  # not fetched again meanwhile
                    if fd is not None:
                        path = self._held_at.pop(v, path)
                if fd is not None:
                    remove_unless_held(path, fd)
            with self._lock:
                if v not in self._fetched and not lock.locked():
                    self._version_locks.pop(v, None)

    def _download(self, version: int, man: dict, dest: str) -> None:
        tmp = f"{dest}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        os.makedirs(tmp)
        try:
            vpath = self._version_path(version)
            self.fs.invalidate_cache(vpath)
            for name, info in man["files"].items():
                local = os.path.join(tmp, name)
                try:
                    self.fs.get_file(f"{vpath}/{_file_key(version, name, info)}", local)
                except FileNotFoundError:
                    raise ChecksumError(
                        f"adapter version {version}: {name} is listed in the manifest but missing from the store"
                    ) from None
                got = sha256_file(local)
                if got != info["sha256"]:
                    raise ChecksumError(
                        f"adapter version {version}: {name} has sha256 {got}, manifest says {info['sha256']}; "
                        f"the copy at {self.version_url(version)} is corrupt or was modified"
                    )
            with open(os.path.join(tmp, MANIFEST), "wb") as f:
                f.write(_json_bytes(man))
            # A stale or corrupt copy from an earlier run goes; a good one (another process sharing
            # cache_dir renamed its download in meanwhile, and may be reading it) stays.
            if os.path.isdir(dest) and not copy_matches(dest, man):
                shutil.rmtree(dest, ignore_errors=True)
            try:
                os.rename(tmp, dest)
            except OSError:  # another process sharing cache_dir got there first
                if not copy_matches(dest, man):
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def _cache_root(self) -> str:
        base = self.cache_dir if self.cache_dir is not None else process_cache_dir()
        # Stores with different roots may share a cache_dir.
        root = os.path.join(base, hashlib.sha1(self.root.encode()).hexdigest()[:16])
        os.makedirs(root, exist_ok=True)
        return root

    def _check_process(self) -> None:
        if self._pid != os.getpid():  # forked: locks may be held by threads that do not exist here
            self._reset_process_state()

    # ---- run state -------------------------------------------------------------------------------

    def save_state(self, name: str, state_dict: Any) -> None:
        """Store tensors / nested dicts (e.g. an optimizer ``state_dict()``) as ``state/<name>.pt``."""
        import torch

        buf = io.BytesIO()
        torch.save(state_dict, buf)
        self._write_bytes(self._state_path(name, ".pt"), buf.getvalue())

    def delete_state(self, name: str) -> None:
        """Remove ``state/<name>.pt`` if present (old optimizer checkpoints)."""
        path = self._state_path(name, ".pt")
        self.fs.invalidate_cache(path)
        if self.fs.exists(path):
            self.fs.rm(path)

    def state_exists(self, name: str) -> bool:
        """Whether ``state/<name>.pt`` is in the store."""
        path = self._state_path(name, ".pt")
        self.fs.invalidate_cache(path)
        return self.fs.exists(path)

    def load_state(self, name: str, map_location: Any = "cpu") -> Any:
        """Load ``state/<name>.pt`` with ``torch.load(weights_only=True)``: tensors and plain containers only."""
        import torch

        data = self._read_bytes(self._state_path(name, ".pt"), f"state {name!r}")
        return torch.load(io.BytesIO(data), map_location=map_location, weights_only=True)

    def write_json(self, name: str, obj: Any) -> None:
        """Atomically replace ``state/<name>.json`` with ``obj``."""
        self._write_bytes(self._state_path(name, ".json"), _json_bytes(obj))

    def read_json(self, name: str) -> Any:
        """Read ``state/<name>.json``; raises FileNotFoundError when it was never written."""
        return json.loads(self._read_bytes(self._state_path(name, ".json"), f"run state {name!r}"))

    # ---- bytes -----------------------------------------------------------------------------------

    def _read_bytes(self, path: str, what: str) -> bytes:
        self.fs.invalidate_cache(path)  # a cached size from before an overwrite would truncate the read
        try:
            return self.fs.cat_file(path)
        except FileNotFoundError:
            raise FileNotFoundError(f"no {what} in {self.root}") from None

    def _write_bytes(self, path: str, data: bytes, exclusive: bool = False) -> None:
        """Write so that readers see the old object or the new one, never a part.

        With ``exclusive``, raise FileExistsError if ``path`` exists (atomic on local disks and S3).
        """
        if not self._local:
            # One PUT is atomic on object stores; mode="create" is a conditional PUT (If-None-Match) on S3.
            self.fs.pipe_file(path, data, **({"mode": "create"} if exclusive else {}))
            return
        parent = path.rsplit("/", 1)[0]
        self.fs.makedirs(parent, exist_ok=True)
        tmp = f"{parent}/.{path.rsplit('/', 1)[1]}.tmp-{uuid.uuid4().hex[:8]}"
        self.fs.pipe_file(tmp, data)
        try:
            if exclusive:
                self.fs.link(tmp, path)  # fails if path exists
            else:
                self.fs.mv(tmp, path)  # rename(2) replaces atomically
        finally:
            if self.fs.exists(tmp):
                self.fs.rm_file(tmp)


def _check_version(version: int) -> int:
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise ValueError(f"version must be a non-negative int, got {version!r}")
    return version


def _file_key(version: int, name: str, info: dict) -> str:
    """Where a manifest's file lives under its version folder: its ``key`` (format 2: in the
    attempt's folder), or its name (format 1)."""
    key = info.get("key", name)
    attempt, _, base = key.rpartition("/")
    if base != name or not (attempt == "" or _ATTEMPT.fullmatch(attempt)):
        raise ChecksumError(f"adapter version {version}: the manifest puts {name} at {key!r}, outside an attempt folder")
    return key


def _json_bytes(obj: Any) -> bytes:
    return json.dumps(obj, indent=1, sort_keys=True).encode()
