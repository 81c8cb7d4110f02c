"""The deltas' bases within ``host_memory``: where the budget holds the host buffer but not a second
one the state's size, the room left keeps the previous save's bytes of some chunks, and only those
chunks may be stored as deltas (the others are encoded whole, their chains restarting; the format
does not change).

After a save's chunks are stored, and before its buffer is handed back, :meth:`BaseStore.keep`
copies into the room the chunks whose delta paid off in that save first (their bytes change
little from save to save: frozen layers' moments, sparse embeddings), then the others in order,
until it is full. They are the next save's bases once this save commits (:meth:`BaseStore.committed`);
a save that does not commit leaves no bases (its bytes are not a committed step's).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from .buffer_layout import BufferLayout
from .snapshot import HostBuffer

log = logging.getLogger("ckpt")


class BaseStore:
    """``room`` bytes of the previous save's chunks, for one layout.

    Example (what the writer does)::

        store.bases()                      # {chunk index: (bytes, hash)}: the bases this save may use
        store.keep(buf, hashes, deltas)    # after its chunks are stored, before the buffer goes back
        store.committed(True)              # its decision: they become the next save's bases
    """

    def __init__(self, layout: BufferLayout, room: int):
        self.layout = layout
        self.memory = torch.zeros(max(room, 1), dtype=torch.uint8)
        self._held: dict[int, tuple[int, str]] = {}  # chunk index -> (offset in memory, hash)
        self._valid = False  # the held chunks are the last committed save's
        self._said = False

    @property
    def nbytes(self) -> int:
        return self.memory.numel()

    def bases(self) -> dict[int, tuple[memoryview, str]]:
        """Per chunk index, the last committed save's bytes of that chunk and its hash (those held)."""
        if not self._valid:
            return {}
        mem = self.memory.numpy().data
        return {i: (mem[off:off + self.layout.chunks[i].length], h) for i, (off, h) in self._held.items()}

    def keep(self, buf: HostBuffer, hashes: Sequence[str], deltas: Sequence[bool]) -> None:
        """Copy from ``buf`` (this save's snapshot) the chunks to keep: those stored as deltas now
        (``deltas``) first, then the others in order, while they fit. Not bases until :meth:`committed`.

        Args:
            buf: the snapshot's host buffer, still held.
            hashes: per chunk, its hash.
            deltas: per chunk, whether this save stored it as a delta.
        """
        self._valid = False
        self._held = {}
        order = [i for i, d in enumerate(deltas) if d] + [i for i, d in enumerate(deltas) if not d]
        at, room = 0, self.nbytes
        dst, src = self.memory.numpy(), buf.buffer.numpy()
        for i in order:
            c = self.layout.chunks[i]
            if at + c.length > room:
                continue
            dst[at:at + c.length] = src[c.offset:c.offset + c.length]
            self._held[i] = (at, hashes[i])
            at += c.length
        if not self._said:
            self._said = True
            log.info("deltas for %.0f%% of the state within host_memory (%.1f MiB keep the previous save's chunks)",
                     100.0 * at / max(self.layout.nbytes, 1), self.nbytes / 2**20)

    def committed(self, ok: bool) -> None:
        """The decision on the save that kept them: its chunks are the next save's bases, or none are."""
        self._valid = ok
        if not ok:
            self._held = {}
