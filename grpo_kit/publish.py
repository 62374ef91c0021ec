"""A training step's commit to the adapter store: rank 0 saves the optimizer state under this
attempt's own name, then publishes the adapter as ``v + 1``, whose manifest (naming that state) is the
commit point; what an existing ``v + 1`` means (an earlier attempt of the step, or an orphan trained
from a version since taken back), and the names of optimizer states. The rank task that calls it is
:func:`grpo_kit.trainer.train_rank`."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from .adapters import AdapterStore, VersionExistsError, VersionNotFoundError, new_attempt
from .retention import delete_version

if TYPE_CHECKING:
    from .trainer import TrainerState

log = logging.getLogger(__name__)


FENCE = "withdrawn"
"""The store's record (``AdapterStore.write_json``) of the gangs whose steps a stopping driver took
back (:func:`fence`): a step of one of them publishes nothing (:func:`publish_step`)."""


def fence(store: AdapterStore, gang_id: int, keep: int = 32) -> None:
    """Record that the steps of gang ``gang_id`` must publish nothing from now on: a stopping driver
    (:meth:`TrainerGang.withdraw`) cancelled them, and a cancelled task a worker had already begun
    still runs to its end. The newest ``keep`` gangs are kept (a resumed run forms new ones)."""
    try:
        ids = store.read_json(FENCE)
    except FileNotFoundError:
        ids = []
    store.write_json(FENCE, [*(i for i in ids if i != gang_id), gang_id][-keep:])


def fenced(store: AdapterStore, gang_id: int) -> bool:
    """Whether a stopping driver took back the steps of gang ``gang_id`` (:func:`fence`)."""
    try:
        return gang_id in store.read_json(FENCE)
    except FileNotFoundError:
        return False


class Withdrawn(RuntimeError):
    """The step's gang was taken back by a stopping driver (:func:`fence`): nothing was published."""


PUBLISHED, ADOPTED, FAILED = 0, 1, 2
"""Outcomes of rank 0's publish of ``v + 1``: it committed this attempt's update; an earlier
attempt had committed ``v + 1`` (every rank adopts that version); it raised (every rank fails)."""


def optimizer_state_name(version: int, attempt: str | None = None) -> str:
    """Where a step's optimizer state goes: one name per attempt (``attempt``), so that a retried
    step never overwrites the state of an attempt whose adapter was published (the manifest's
    ``meta["optimizer_state"]`` names the one that belongs to the version)."""
    return f"optimizer/v{version:06d}" + (f"-{attempt}" if attempt else "")


def state_version(name: str) -> int:
    """The version of an optimizer state's name (:func:`optimizer_state_name`).

    >>> state_version("optimizer/v000012-1a2b3c4d"), state_version("optimizer/v000003")
    (12, 3)
    """
    return int(name.rsplit("/v", 1)[1].split("-", 1)[0])


def publish_step(state: TrainerState, version: int, iteration: int, stats: dict,
                 parent: str | None, gang_id: int | None = None) -> tuple[int, str | None, float]:
    """Rank 0's publish of the step from ``version``: the optimizer state, then the adapter as
    ``version + 1`` (its manifest, which names that state, is the commit point). Returns the outcome,
    the attempt published (None when adopted) and when the optimizer state was saved.

    A step of a gang a stopping driver took back (``gang_id`` :func:`fenced`: its task was cancelled
    after a worker began it) raises :class:`Withdrawn` before writing anything.

    Each publish records the manifest attempt of the version it trained from (``meta["parent_attempt"]``,
    :meth:`AdapterStore.descends`), which tells apart what a ``version + 1`` already in the store is:

    - first, the ``version`` this rank trained from (``parent``: the attempt of it that it held) must
      still be the store's (every rank checked it at the step's start, :meth:`TrainerState.sync_to`;
      it is read again here): a step that escaped a stopping driver's take-back
      (:meth:`TrainerGang.withdraw`; one its fence could not stop: the wait for it timed out, or the
      driver was killed outright) trained from a version deleted while it ran, or deleted and
      trained anew by a resumed run, and fails here, publishing nothing;
    - a ``version + 1`` trained from the same ``version``: an earlier attempt of this very step
      committed it first (the driver saw that attempt fail while its publish was still running):
      ADOPTED, every rank loads it;
    - one trained from another attempt of ``version``: an orphan (an escaped step that passed the
      check above and published after the take-back). It is deleted, and this step's update published.
    An exception after the optimizer state is saved deletes that state unless the store's
    ``version + 1`` is this attempt's (a manifest that landed although its write raised)."""
    if gang_id is not None and fenced(state.store, gang_id):
        raise Withdrawn(f"the steps of gang {gang_id} were taken back by a stopping driver: v{version + 1} "
                        "not published")
    if state.store.attempt(version) != parent:  # VersionNotFoundError: the version trained from is gone
        raise RuntimeError(f"v{version} was taken back and trained again since this step loaded it: "
                           f"v{version + 1} not published")
    attempt = new_attempt()
    name = optimizer_state_name(version + 1, attempt)
    state.store.save_state(name, state.optimizer.state_dict())
    t_saved = time.time()
    meta = {"iteration": iteration, "stats": stats, "optimizer_state": name, "parent_attempt": parent}
    try:
        for _ in range(3):  # each round past the first follows an orphan this step deleted
            try:
                state.store.publish(state.model, version + 1, meta=meta, parent=version, attempt=attempt)
                return PUBLISHED, attempt, t_saved
            except VersionExistsError:
                try:
                    there = state.store.manifest(version + 1, fresh=True)
                except VersionNotFoundError:  # deleted meanwhile: publish again
                    continue
            if there.get("attempt") == attempt:
                return PUBLISHED, attempt, t_saved
            if there.get("meta", {}).get("parent_attempt", parent) == parent:  # older stores: adopt, as before
                state.store.delete_state(name)
                return ADOPTED, None, t_saved
            log.warning("v%d in the store was trained from a v%d that is no longer in the store (published by a "
                        "step a stopping driver could not take back): deleted, and this step's v%d published "
                        "instead", version + 1, version, version + 1)
            try:
                if state.store.attempt(version + 1) == there.get("attempt"):  # still the orphan read above
                    delete_version(state.store, version + 1)
            except VersionNotFoundError:  # already deleted
                pass
            orphan_state = there.get("meta", {}).get("optimizer_state")
            state.saved_states = [n for n in state.saved_states if n != orphan_state]
        raise RuntimeError(f"v{version + 1} kept being published by other steps: this step's update is dropped")
    except BaseException:
        drop_unless_committed(state.store, version + 1, attempt, name)
        raise


def drop_unless_committed(store: AdapterStore, version: int, attempt: str, state_name: str) -> None:
    """After a failed publish of ``version`` by ``attempt``: delete its optimizer state, unless the
    store's ``version`` is that attempt's (its manifest landed although the write raised: the state
    is then part of a committed version) or that cannot be told (a leaked file is the lesser harm)."""
    try:
        ours = store.attempt(version) == attempt
    except VersionNotFoundError:
        ours = False
    except Exception:  # noqa: BLE001 - the store cannot be read: keep the state
        return
    if not ours:
        try:
            store.delete_state(state_name)
        except Exception as e:  # noqa: BLE001 - never masks the publish's own error
            log.warning("could not delete the optimizer state %s of a failed publish: %r", state_name, e)
