"""A snapshot in pieces, for a state larger than ``host_memory``: two slabs of about half the budget
take the state's chunks in turn, instead of one host buffer the state's size.

The layout is today's (:mod:`ckpt.save.buffer_layout`); its chunks are grouped, in order, into
*pieces* of whole chunks of at most half the budget each (a chunk larger than that is a piece of its
own, and the slabs grow to it). ``save()`` copies piece 0 and 1 into the two slabs, hands the job to
the commit thread, then copies each next piece into the slab the writer gives back, waiting for one
when none is free, and returns once the last piece is copied: every byte of the state was copied
during the call, so later in-place changes are not saved, and only the writing of the last pieces
goes on behind. The writer (:meth:`ckpt.save.writer.Writer.write_part`) writes a piece's chunks,
then gives its slab back. Either side failing ends the other: the copier's error fails the save in
the writer, and a writer that stops (a failed piece) lets a waiting copier return. A piece's hashes
come from the fused copy + hash, as for a whole buffer; on a GPU each piece's copy is launched on
the side stream and the writer waits on that piece's copy before it reads the slab (pinned, like the
whole buffer). Deltas need the previous save's bytes, which a ring does not keep: its chunks are
written whole.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ..errors import CheckpointError
from ..flatten import Flat
from .buffer_layout import BufferLayout, TensorSlot
from .cuda_snapshot import CudaSnapshot, copy_to_host
from .snapshot import HostBuffer, Share, Snapshot
from .state_checks import optimizer_guarded

log = logging.getLogger("ckpt")


@dataclass(frozen=True)
class Piece:
    """Chunks ``first`` to ``end`` (exclusive) of the layout: bytes ``lo`` to ``hi`` of the state's buffer."""

    first: int
    end: int
    lo: int
    hi: int


def cut(layout: BufferLayout, size: int) -> list[Piece]:
    """The layout's chunks grouped in order into pieces of at most ``size`` bytes (a larger chunk
    alone). Pure.

    Args:
        layout: the state's layout.
        size: the most bytes of a piece (half the budget).

    Returns:
        list[Piece]: pieces covering every chunk once, in order.
    """
    out: list[Piece] = []
    first = 0
    chunks = layout.chunks
    for i in range(1, len(chunks) + 1):
        if i == len(chunks) or chunks[i].offset + chunks[i].length - chunks[first].offset > size:
            out.append(Piece(first, i, chunks[first].offset, chunks[i - 1].offset + chunks[i - 1].length))
            first = i
    return out


@dataclass
class _Copied:
    """One piece in a slab: where, its chunks' hashes, its CUDA copy still in flight."""

    slab: int
    hashes: list[str | None] | None
    cuda: CudaSnapshot | None


@dataclass
class _Save:
    """The ring's state during one save, shared by the copier (``save()``) and the writer."""

    copied: dict[int, _Copied] = field(default_factory=dict)
    free: list[int] = field(default_factory=lambda: [0, 1])
    error: BaseException | None = None  # the copier failed
    stopped: bool = False  # the writer is done (written, or failed)
    holders: int = 2  # the copier and the writer: the lock goes back when both are done
    nonfinite: list[str] = field(default_factory=list)
    blocked_s: float = 0.0


class Ring(HostBuffer):
    """Two slabs taking the pieces of a state larger than the budget in turn, lent to one save at a
    time (its lock, as a :class:`HostBuffer`'s; a load mid-run may borrow the ring when it is idle).

    Example (what ``Snapshotter.take`` and ``Checkpointer.save`` do)::

        ring.acquire(); ring.begin()
        ring.copy_next(tensors, check)   # piece 0, then piece 1: both slabs
        ...                              # the job goes to the writer
        ring.copy_rest(tensors, check)   # the other pieces, each into a slab the writer gave back
    """

    in_pieces = True

    def __init__(self, layout: BufferLayout, budget: int, native: bool = True, threads: int | None = None):
        pieces = cut(layout, max(budget // 2, 1))
        slab = max([budget // 2] + [p.hi - p.lo for p in pieces])
        # the whole budget where the slabs fit in it: a load's window (at most the budget) borrows it mid-run
        super().__init__(layout, native=native, threads=threads, size=max(2 * slab, budget))
        self.pieces = pieces
        self.slab = slab
        self._cond = threading.Condition()
        self._save = _Save()
        self._next = 0  # the next piece to copy
        log.info("the state's %.1f MiB are larger than host_memory (%.1f MiB): saves copy it in %d pieces through "
                 "two slabs of %.1f MiB, and write its chunks without deltas", layout.nbytes / 2**20, budget / 2**20,
                 len(pieces), slab / 2**20)
        if 2 * slab > budget:
            log.warning("a chunk of %.1f MiB is larger than half of host_memory (%.1f MiB): the ring of two slabs "
                        "holds %.1f MiB; a smaller chunk_size keeps it within", slab / 2**20, budget / 2**20,
                        2 * slab / 2**20)

    # -- one save -------------------------------------------------------------------------------
    def begin(self) -> None:
        """A save took the ring (after :meth:`acquire`): both slabs free, piece 0 next."""
        self.generation += 1
        self._save = _Save()
        self._next = 0

    @property
    def blocked_s(self) -> float:
        """Seconds this save's copier waited for a free slab."""
        return self._save.blocked_s

    @property
    def nonfinite(self) -> list[str]:
        """The checked tensors found holding NaN or Inf so far (CUDA ones once their piece was waited for)."""
        return list(self._save.nonfinite)

    def copy_next(self, tensors: dict[str, torch.Tensor], check: frozenset[str], guarded: Any = frozenset()) -> bool:
        """Copy the next piece into a free slab, waiting for one; False once every piece is copied or
        the writer stopped (it needs no more)."""
        s = self._save
        k = self._next
        if k >= len(self.pieces):
            return False
        with self._cond:
            waited = time.perf_counter()
            while not s.free and not s.stopped:
                self._cond.wait()
            s.blocked_s += time.perf_counter() - waited if k >= 2 else 0.0
            if s.stopped:
                return False
            slab = s.free.pop(0)
        copied = self._copy_piece(self.pieces[k], slab, tensors, check, guarded)
        with self._cond:
            s.copied[k] = copied
            self._next = k + 1
            self._cond.notify_all()
        return True

    def copy_rest(self, tensors: dict[str, torch.Tensor], check: frozenset[str], guarded: Any = frozenset()) -> None:
        """Copy every piece left, each into a slab the writer gave back; then the copier is done (on
        every path: an error is handed to the writer, which fails the save with it, and raised)."""
        try:
            while self.copy_next(tensors, check, guarded):
                pass
        except BaseException as e:
            self.fail(e)
            raise
        self._done()

    def fail(self, error: BaseException) -> None:
        """The copier failed: the writer raises ``error`` instead of waiting for a piece; the copier is done."""
        with self._cond:
            self._save.error = error
            self._cond.notify_all()
        self._done()

    def piece(self, k: int) -> tuple[int, list[str | None] | None]:
        """The writer, for piece ``k``: wait until it is copied (its CUDA copy too); its slab's offset in
        the ring and its chunks' hashes (None: the writer hashes)."""
        s = self._save
        with self._cond:
            while k not in s.copied and s.error is None:
                self._cond.wait()
            if k not in s.copied:
                assert s.error is not None
                raise CheckpointError(f"the snapshot of piece {k} of {len(self.pieces)} failed: "
                                      f"{type(s.error).__name__}: {s.error}") from s.error
            got = s.copied[k]
        if got.cuda is not None:
            got.cuda.synchronize()
            s.nonfinite += got.cuda.nonfinite()  # Snapshot.poisoned() makes it a set
        return got.slab * self.slab - self.pieces[k].lo, got.hashes

    def written(self, k: int) -> None:
        """The writer is done with piece ``k``: its slab takes the next piece."""
        with self._cond:
            got = self._save.copied.pop(k)
            self._save.free.append(got.slab)
            self._cond.notify_all()

    def wait_copied(self) -> None:
        """The writer, after the last piece: wait until the copier is done (its NaN/Inf findings are in)."""
        with self._cond:
            while self._save.holders > 1 and self._save.error is None:
                self._cond.wait()

    def finished(self) -> None:
        """The writer is done (every piece written, or failed): a copier waiting for a slab returns,
        and the ring goes to the next save once the copier is done too."""
        with self._cond:
            self._save.stopped = True
            for got in self._save.copied.values():  # failed midway: no copy may still land in a slab
                if got.cuda is not None:
                    got.cuda.synchronize()
            self._cond.notify_all()
        self._done()

    def _done(self) -> None:
        with self._cond:
            self._save.holders -= 1
            last = self._save.holders == 0
            self._cond.notify_all()
        if last:
            self.release()

    # -- the copy of one piece ---------------------------------------------------------------------
    def _copy_piece(self, piece: Piece, slab: int, tensors: dict[str, torch.Tensor], check: frozenset[str],
                    guarded: Any) -> _Copied:
        """Copy the bytes of ``piece`` into slab ``slab``: each tensor's part within it, as a slot of
        its own at its place in the slab, by the same copies (and hashes) as a whole buffer's."""
        at = slab * self.slab - piece.lo  # a layout offset plus this is an offset in the ring's memory
        cpu: list[tuple[TensorSlot, torch.Tensor]] = []
        cuda: list[tuple[TensorSlot, torch.Tensor]] = []
        bad: list[str] = []
        for slot in self.layout.slots:
            a, b = max(slot.offset, piece.lo), min(slot.offset + slot.nbytes, piece.hi)
            if a >= b:
                continue
            src = tensors[slot.key]
            part = _part(src, slot, a, b)
            clipped = TensorSlot(slot.key, slot.dtype, tuple(part.shape), a + at, b - a, slot.device)
            (cuda if src.device.type == "cuda" else cpu).append((clipped, part))
        pending = None
        if cuda:
            pending = copy_to_host(cuda, guarded, check, self._launch)
        try:
            offsets = np.array([c.offset + at for c in self.layout.chunks[piece.first:piece.end]] + [piece.hi + at],
                               np.uint64)
            hashes, bad = self._copy_cpu(cpu, check, offsets, self._want[piece.first:piece.end])
        except BaseException:
            if pending is not None:
                pending.synchronize()
            raise
        self._save.nonfinite += bad  # Snapshot.poisoned() makes it a set
        return _Copied(slab, hashes, pending)


def take_pieces(ring: Ring, flat: Flat, share: Share, check: frozenset[str], bad_settings: list[str]) -> Snapshot:
    """The snapshot of ``flat`` into ``ring`` (taken: :meth:`Ring.acquire`): its first two pieces
    copied (a slab each), the others left to ``Snapshot.rest``, which ``save()`` calls once the job
    is the writer's (it returns the seconds it waited for a free slab).

    Args:
        ring: the ring, acquired.
        flat: the state, flattened.
        share: this rank's share of the writing.
        check: the tensors checked for NaN and Inf.
        bad_settings: optimizer settings found NaN or Inf.

    Returns:
        Snapshot: the snapshot, with ``rest`` set.

    Raises:
        Exception: whatever the copy of the first pieces raised (the ring is given back).
    """
    guarded = optimizer_guarded(flat) if ring.has_cuda else frozenset()
    ring.begin()
    try:
        ring.copy_next(flat.tensors, check, guarded)
        ring.copy_next(flat.tensors, check, guarded)
    except BaseException as e:
        ring.fail(e)  # the copier's part
        ring.finished()  # and the writer's: no job will exist
        raise

    def rest() -> float:
        ring.copy_rest(flat.tensors, check, guarded)
        return float(ring.blocked_s)

    return Snapshot(ring, {k: flat.leaves[k] for k in share.write}, share.per_rank, None, None, [],
                    ring.generation, None, bad_settings=bad_settings, plan=share.plan, rest=rest,
                    pieces=len(ring.pieces))


def _part(src: torch.Tensor, slot: TensorSlot, a: int, b: int) -> torch.Tensor:
    """Bytes ``a`` to ``b`` of the buffer, of the tensor ``src`` laid out at ``slot``: its elements
    there, as a flat tensor (a view where ``src`` is contiguous)."""
    if a == slot.offset and b == slot.offset + slot.nbytes:
        return src
    size = slot.dtype.itemsize
    if (a - slot.offset) % size or (b - a) % size:
        raise CheckpointError(f"a piece boundary cuts an element of {slot.key} (a bug: please report it)")
    lo, hi = (a - slot.offset) // size, (b - slot.offset) // size  # elements, in row-major order
    if src.is_contiguous() or src.dim() == 0:
        return src.reshape(-1)[lo:hi]  # a view
    # a strided tensor: copy only the rows of dim 0 that hold the piece, not the whole tensor per piece
    row = max(src.numel() // max(src.shape[0], 1), 1)
    r0, r1 = lo // row, -(-hi // row)
    return src[r0:r1].reshape(-1)[lo - r0 * row:hi - r0 * row]
