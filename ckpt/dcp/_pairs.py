"""What ``ckpt.dcp.Writer`` keeps between saves so that they store deltas: per (root, rank) the core
writer (its dedup table and ``_base``) and a pair of host buffers that take turns.

DCP makes one ``StorageWriter`` per save, so this lives at module level, in the process that runs
``write_data`` (DCP's process mode keeps its background process across saves, so there too). Save
N+1 copies this rank's items into the buffer save N did not use and encodes its chunks against save
N's bytes, exactly as the Checkpointer's ``Snapshotter(pair=True)`` does. A rank learns whether save
N was committed (only the coordinator commits) at the start of save N+1, from the step's manifest;
only then does save N become the base (``ChunkWriter.settle``). A save with other items, shapes or
options into the same root starts a new pair (the old one is dropped); ``delta_chain=1`` drops it.
Nothing is shared between roots: the key is the root as given, and only
the newest root of each rank is kept (a save into a new root frees what the previous root kept).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from ..buffer_layout import BufferLayout
from ..format import manifest as mf
from ..format import paths
from ..snapshot import HostBuffer
from ..storage.base import Storage
from ..writer import SaveJob
from ..writer import Writer as ChunkWriter

log = logging.getLogger("ckpt")


@dataclass
class Pair:
    """One rank's delta state for one root: see the module's docstring."""

    signature: tuple  # the items (keys, dtypes, shapes, devices, boxes) and the options the layout and writer need
    layout: BufferLayout
    writer: ChunkWriter
    native: bool
    threads: int | None
    buffer: HostBuffer | None = None  # the buffer of the newest save
    spare: HostBuffer | None = None  # the other one: the save before (the base of the next save's deltas)
    pending: tuple[int, mf.Manifest, SaveJob] | None = None  # the newest save, until its commit is known
    lock: threading.Lock = field(default_factory=threading.Lock)  # one save of this rank into this root at a time

    def settle(self, storage: Storage) -> None:
        """Is the previous save committed? If so its buffer becomes the next save's base; if not
        the writer trusts only what it trusted before it."""
        if self.pending is None:
            return
        step, part, job = self.pending
        self.pending = None
        committed = storage.exists(paths.manifest_key(step))
        self.writer.settle(part if committed else None, job)

    def next_buffer(self) -> tuple[HostBuffer, HostBuffer | None]:
        """The buffer this save copies into and the other one of the pair (None before the second save)."""
        if self.buffer is None:
            self.buffer = HostBuffer(self.layout, native=self.native, threads=self.threads)
            return self.buffer, None
        if self.spare is None:
            self.spare = HostBuffer(self.layout, native=self.native, threads=self.threads, lock_with=self.buffer)
            log.info("ckpt.dcp.Writer keeps a second host buffer of %.1f MiB: the previous save, for delta "
                     "encoding (delta_chain=1 turns deltas and both kept buffers off)", self.spare.nbytes / 2**20)
        self.buffer, self.spare = self.spare, self.buffer
        return self.buffer, self.spare


_pairs: dict[tuple[str, int], Pair] = {}
_lock = threading.Lock()


def get(url: str, rank: int, signature: tuple, make: Callable[[], Pair]) -> Pair:
    """The pair of ``rank`` for root ``url``, made anew (dropping the old one) if ``signature`` changed.

    Only the newest root of each rank is kept: a save into another root drops what was kept for the
    rank's earlier roots (DCP's usual new directory per checkpoint would otherwise keep one copy of the
    state per save, never freed; deltas only ever go against the same root's previous save)."""
    with _lock:
        for old in [k for k in _pairs if k[1] == rank and k[0] != url]:
            del _pairs[old]  # a save still writing from it keeps its own reference until it is done
        pair = _pairs.get((url, rank))
        if pair is None or pair.signature != signature:
            pair = _pairs[(url, rank)] = make()
        return pair


def drop(url: str, rank: int) -> None:
    """Forget what is kept for ``rank``'s saves into ``url`` (its buffers are freed once no save uses them)."""
    with _lock:
        _pairs.pop((url, rank), None)


def held_bytes() -> int:
    """Host memory the kept buffers hold, all roots and ranks of this process."""
    with _lock:
        return sum(b.nbytes for p in _pairs.values() for b in (p.buffer, p.spare) if b is not None)
