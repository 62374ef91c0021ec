"""Adapter-store retention over long runs: keep the last N versions, every k-th, and what resume needs.

A run publishes one adapter version per iteration (about 175 MB each for an 8B model at r16), so a
store that keeps every version grows without bound. After each committed iteration the driver
deletes the versions the policy no longer keeps:

- the last ``keep_versions`` versions (``RunConfig.keep_versions``; 0 keeps every version),
- every version that is a multiple of ``keep_every`` (``RunConfig.keep_every``; 0: none of them),
- always: the latest committed version (resume loads its adapter and the optimizer state its
  manifest names; the trainer keeps the three optimizer states it wrote last) and any version a
  batch in flight, a pending evaluation or a carried group (dynamic sampling) uses: Dask recomputes
  a lost chunk from its version (the driver's ``protect`` set; a resumed run's sweep protects those
  its run state names).

A version is deleted manifest first (:meth:`AdapterStore.delete`), so a reader never fetches half of
one; its optimizer state, if the trainer has not already removed it, goes with it. A deletion that
fails (an object store's transient error) warns and is retried after the next commit: it never
stops the run. A resumed run sweeps the whole store once, so a version a crash left behind is
pruned then, and so are the files of a version whose manifest a failed deletion had removed (an
optimizer state such a deletion left is not found again once its process is gone).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable

from .adapters import AdapterStore, VersionNotFoundError

OPTIMIZER_STATE_KEY = "optimizer_state"
"""The manifest's ``meta`` key that names a version's optimizer state (``trainer.train_rank``)."""


def kept(version: int, latest: int, keep_versions: int, keep_every: int) -> bool:
    """Whether the policy keeps ``version`` once ``latest`` is committed.

    >>> [v for v in range(1, 13) if kept(v, 12, 3, 5)]
    [5, 10, 11, 12]
    >>> all(kept(v, 12, 0, 0) for v in range(1, 13))  # keep_versions=0: retention off
    True
    """
    if keep_versions <= 0 or version >= latest:
        return True
    return version > latest - keep_versions or (keep_every > 0 and version % keep_every == 0)


def delete_version(store: AdapterStore, version: int, leftovers: bool = False) -> bool:
    """Delete ``version`` from ``store``: the adapter (manifest first, :meth:`AdapterStore.delete`;
    ``leftovers``: every attempt's files, for versions no step can be publishing now), then the
    optimizer state its manifest names. Returns False if it was not there."""
    try:
        meta = store.manifest(version).get("meta", {})
    except VersionNotFoundError:
        return False
    store.delete(version, leftovers=leftovers)
    state = meta.get(OPTIMIZER_STATE_KEY)
    if state:
        store.delete_state(state)
    return True


class Pruner:
    """Deletes the versions that fall out of the policy as the run commits new ones.

    ``after_commit(latest, protect)`` is called once per committed version: the one version that
    just left the last-``keep_versions`` window is deleted unless the policy or ``protect`` keeps
    it (a protected one is retried on later calls). ``sweep(latest, protect)`` checks every
    published version (at the start of a resumed run).
    """

    def __init__(self, store: AdapterStore, keep_versions: int, keep_every: int):
        self.store, self.keep_versions, self.keep_every = store, keep_versions, keep_every
        self.deferred: set[int] = set()
        self.deleted: list[int] = []
        """Versions removed (a published one, or the files a failed deletion or a crash left)."""
        self.unfinished: dict[int, str | None] = {}
        """Versions whose deletion failed -> the optimizer state still to remove ("" none, None not
        known yet): retried after each commit."""

    def _drop(self, version: int, latest: int, protect: set[int]) -> None:
        if version <= 0 or kept(version, latest, self.keep_versions, self.keep_every):
            self.deferred.discard(version)
            return
        if version in protect:
            self.deferred.add(version)
            return
        self.deferred.discard(version)
        self._remove(version)

    def _remove(self, version: int) -> None:
        """Delete ``version`` whole (old versions: no publish of them runs), its optimizer state
        too; a failure warns and leaves it in :attr:`unfinished` for the next commit."""
        state = self.unfinished.pop(version, None)
        try:
            if state is None:
                try:
                    state = self.store.manifest(version).get("meta", {}).get(OPTIMIZER_STATE_KEY) or ""
                except VersionNotFoundError:  # no manifest (left by a failed deletion or a crash): files only
                    state = ""
            self.store.delete(version, leftovers=True)
            if state:
                self.store.delete_state(state)
        except Exception as e:  # noqa: BLE001 - storage errors: the run goes on, the deletion is retried
            self.unfinished[version] = state
            warnings.warn(f"retention could not delete adapter v{version} ({type(e).__name__}: {e}); retried after "
                          "the next commit", RuntimeWarning, stacklevel=3)
            return
        self.deleted.append(version)

    def after_commit(self, latest: int, protect: Iterable[int] = ()) -> None:
        if self.keep_versions <= 0:
            return
        protect = {latest, *protect}
        for v in sorted(self.unfinished):
            self._remove(v)
        for v in sorted({latest - self.keep_versions, *self.deferred}):
            self._drop(v, latest, protect)

    def sweep(self, latest: int, protect: Iterable[int] = ()) -> None:
        if self.keep_versions <= 0:
            return
        protect = {latest, *protect}
        for v in self.store.versions():
            self._drop(v, latest, protect)
        for v in self.store.unpublished():  # below the latest: no publish of them can be running
            if v < latest and v not in protect:
                self._remove(v)
