"""The save engines ``ckpt.dcp.Writer`` saves through: one :class:`~ckpt.save.engine.SaveEngine` per
(root, options, rank) in the process that runs ``write_data``, kept across saves, closed at exit.

DCP makes one ``StorageWriter`` per save, so the engines live here, at module level (DCP's process
mode keeps its background process across saves, so there too). An engine keeps what the
Checkpointer's keeps between saves: the writer's dedup table and, with deltas, the snapshotter's pair
of host buffers that take turns (``Snapshotter.next_buffer``): save N+1 copies this rank's items into
the buffer save N did not use and encodes its chunks against save N's bytes. A rank learns whether
save N was committed (only the coordinator commits) at the start of save N+1, from the step's
manifest (:meth:`Kept.after_decision`); only then does save N become the base, and, with local commits
(``local_dir`` and ``redundancy``), is it committed to the rank's local directory too (the
coordinator's has it at once; the others at their next save, or when the engine closes). A save with other items or
shapes lays its buffers out anew. Only the newest root of each rank is kept: a save into another root
closes the engines of the rank's earlier roots (DCP's usual new directory per checkpoint would
otherwise keep one copy of the state per save, never freed; deltas only ever go against the same
root's previous save).
"""

from __future__ import annotations

import logging
import threading

from .. import at_exit
from ..format import manifest as mf
from ..format import paths
from ..options import Options
from ..ranks import LocalComm, make_comm
from ..save.engine import SaveEngine
from ..save.job import SaveJob
from ..storage.base import Storage

log = logging.getLogger("ckpt")


class Kept:
    """One rank's engine for one root and its options, and the save whose commit it has not seen."""

    def __init__(self, url: str, options: Options, storage: Storage | None):
        # the ranks talk through the store only for local commits (which steps each rank's directory holds)
        comm = make_comm(None, options.timeout) if options.local_commits else LocalComm(options.timeout)
        # a storage handed in stays open
        self.engine = SaveEngine(url, options, comm, storage, name="ckpt-dcp", exclusive=False,
                                 closes_storage=storage is None)
        self.pending: tuple[int, mf.Manifest, SaveJob] | None = None  # the newest save, until its commit is known
        self.lock = threading.Lock()  # one save of this rank into this root at a time

    def after_decision(self) -> None:
        """Is the previous save committed? If so its buffer becomes the next save's base; if not the
        writer trusts only what it trusted before it."""
        if self.pending is None:
            return
        step, part, job = self.pending
        self.pending = None
        engine = self.engine
        key = paths.manifest_key(step)
        committed = engine.durable.exists(key)
        # without deltas no buffer is kept: the writer keeps none as a base either
        engine.writer.after_decision(part if committed else None, job if engine.options.deltas else None)
        if committed and engine.local is not None:  # into this rank's local directory, then its retention
            engine.local.commit(step, engine.durable.read(key).decode())
            engine.local.after_commit(job)

    @property
    def held_bytes(self) -> int:
        """Host memory the engine's buffers hold."""
        return self.engine.snapshots.host_bytes

    def close(self) -> None:
        """Stop the engine (at exit, or when a newer root replaces it)."""
        at_exit.untrack(self)
        with self.lock:
            try:
                self.after_decision()
            except Exception as e:  # the step stays committed at the checkpoint path
                log.warning("could not commit the last DCP save to the local directory: %s", e)
            self.engine.close(announce=False)

    def _in_flight(self) -> list[int]:
        return []  # DCP waits for its own saves

    def __repr__(self) -> str:
        return f"ckpt.dcp.Writer({self.engine.path!r})"


_kept: dict[tuple[str, int, str, int], Kept] = {}
_lock = threading.Lock()


def engine_for(url: str, rank: int, options: Options, storage: Storage | None) -> Kept:
    """The engine of ``rank`` for root ``url`` with these options (and ``storage``, if one was handed
    in), made on first use; the rank's engines for other roots are closed."""
    key = (url, rank, repr(options), id(storage) if storage is not None else 0)
    with _lock:
        old = [k for k in _kept if k[1] == rank and k != key]
        stale = [_kept.pop(k) for k in old]
        kept = _kept.get(key)
        if kept is None:
            kept = _kept[key] = Kept(url, options, storage)
            at_exit.track(kept)
    for k in stale:  # a save still writing through one keeps its own reference until it is done
        k.close()
    return kept


def drop(url: str, rank: int) -> None:
    """Close what is kept for ``rank``'s saves into ``url``."""
    with _lock:
        gone = [_kept.pop(k) for k in list(_kept) if k[:2] == (url, rank)]
    for k in gone:
        k.close()


def roots(rank: int) -> list[str]:
    """The roots this process keeps an engine for, for ``rank``."""
    with _lock:
        return [k[0] for k in _kept if k[1] == rank]


def held_bytes() -> int:
    """Host memory the kept buffers hold, all roots and ranks of this process."""
    with _lock:
        return sum(k.held_bytes for k in _kept.values())
