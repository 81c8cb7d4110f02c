"""The snapshot: one copy of every tensor into a host buffer that is allocated once and reused.

This copy is the only part of a save the training loop waits for. The buffer is pinned when CUDA
is available (so device-to-host copies are DMA transfers), ordinary memory otherwise; the code path
is the same. The buffer is zero-filled at allocation, which also faults every page in up front, so
steady-state saves touch no new memory.

CPU tensors are copied before ``save()`` returns; with the compiled core (csrc/copyhash.cpp) the copy
runs on several threads and hashes each chunk while its bytes are in cache, so the writer does not
read the buffer a second time to hash it. CUDA tensors are copied on a side stream per device and
``save()`` returns right after the launch; the host never waits (:mod:`ckpt.save.cuda_snapshot`: the
copies, the device-side NaN/Inf check and the optimizer pre-step fence). The background writer
waits on the copy's events before it reads the buffer, and the buffer is handed back only once
every copy into it is done.

The same pass checks the state for NaN and Inf (:func:`ckpt.save.state_checks.finite_checked` says
which tensors): on CPU
the compiled core tests each element right after copying it, while it is in cache; without the core
torch checks the copy; on a GPU a reduction per dtype runs on the side stream, before anything
queued later may change the tensors, and its verdict travels with the copy's event. The writer
refuses the save before writing anything.

:class:`Snapshotter` owns the buffer between saves: it remakes the layout (and asks the coordinator
which tensors this rank writes) only when the state's structure changes.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from .. import _cpus, _ext
from ..flatten import Flat, Leaf
from ..ranks import Comm
from ..tree import dtype_name
from .buffer_layout import BufferLayout, TensorSlot, make_layout
from .commit_plan import PlanLayout, lazily
from .cuda_snapshot import CudaSnapshot, copy_to_host, launch_native, native_core
from .planning import Inventory, exchange_plan
from .state_checks import finite_checked, nonfinite_settings, optimizer_guarded

log = logging.getLogger("ckpt")

@dataclass
class Share:
    """This rank's part of the writing: the tensors it writes (the coordinator balances replicated
    ones across ranks) and the top-level keys saved per rank."""

    write: tuple[str, ...]
    per_rank: frozenset[str]
    fresh: frozenset[str] = frozenset()  # where a pack of small replicated tensors starts a chunk
    plan: Callable[[], PlanLayout | None] | None = None  # coordinator: the step's layout, from the plan


@dataclass
class Snapshot:
    """One save's copy of the state in the host buffer: what the writer needs from the snapshot."""

    buffer: HostBuffer
    leaves: dict[str, Leaf]  # where each written tensor sits in its global tensor
    per_rank: frozenset[str]
    hashes: list[str | None] | None  # per chunk, when the compiled core hashed it during the copy
    cuda: CudaSnapshot | None  # the device-to-host copy still in flight, if any
    nonfinite: list[str]  # checked CPU tensors found holding NaN or Inf
    generation: int = 0  # the buffer's generation holding this snapshot (the next snapshot into it changes it)
    other: HostBuffer | None = None  # the other buffer of the pair (it holds the delta base, if any)
    released: bool = False
    bad_settings: list[str] = field(default_factory=list)  # optimizer settings found NaN or Inf (their key paths)
    plan: Callable[[], PlanLayout | None] | None = None  # coordinator: the step's layout, from the plan
    store: Any = None  # the deltas' bases within host_memory (ckpt.save.base_store), if any
    rest: Callable[[], float] | None = None  # in pieces (:mod:`ckpt.save.ring`): copy the pieces left, once
    # the job is the writer's; returns the seconds it waited for a free slab
    pieces: int = 0  # in pieces: how many

    def release(self) -> None:
        """Give the host buffer back to the next snapshot, once every CUDA copy into it is done (on
        every path, failures included); only the first call does anything."""
        if not self.released:
            self.released = True
            try:
                if self.cuda is not None:
                    self.cuda.synchronize()
            finally:
                self.buffer.finished()

    def abandon(self, error: BaseException) -> None:
        """The save stopped before its job reached the writer (``error``): give the buffer back (a
        ring's copier is done too)."""
        self.buffer.fail(error)
        self.release()

    def poisoned(self) -> list[str]:
        """Every checked tensor holding NaN or Inf, in state order, then every optimizer setting that
        is NaN or Inf; call after the CUDA copy is done."""
        bad = set(self.nonfinite) | set(self.cuda.nonfinite() if self.cuda is not None else ())
        bad |= set(self.buffer.nonfinite)  # a ring's, once every piece is copied
        return [k for k in self.buffer.layout_keys if k in bad] + self.bad_settings


class Snapshotter:
    """The host buffer, its layout and this rank's share of the writing, kept between saves.

    Example (what ``Checkpointer.save`` does)::

        snap = snapshotter.take(seq, flatten(state), state)   # None: busy and skip_if_busy
        ...                                                    # the writer reads snap.buffer
        snap.buffer.release()
    """

    def __init__(self, comm: Comm, chunk_size: int, native: bool = True, threads: int | None = None,
                 check_finite: bool | str = True, pair: bool = False, budget: int | None = None):
        self.comm = comm
        # With deltas, two buffers take turns: the previous save's bytes stay in one (the base the
        # writer XORs against) while the next snapshot goes into the other.
        self.pair = pair
        self.spare: HostBuffer | None = None
        self.check_finite = check_finite
        self.chunk_size = chunk_size
        self.native = native
        self.threads = threads
        self.buffer: HostBuffer | None = None
        # host_memory in bytes (None: no cap): a state larger saves through a ring of two slabs
        # (ckpt.save.ring); with deltas, a second buffer that would pass it is a BaseStore of what fits.
        self.budget = budget
        self.store: Any = None  # with deltas, where a second buffer passes the budget: ckpt.save.base_store
        # Memory a load staged into before the first save: that save's buffer takes it over when
        # the sizes agree, so the pages faulted in once serve both (SaveEngine.lend_buffer).
        self.reserve: torch.Tensor | None = None
        self.layouts_made = 0  # the first save, and one per structure change
        self._signature: tuple | None = None
        self._share: Share | None = None

    def take(self, seq: int, flat: Flat, state: dict[str, Any], *, skip_if_busy: bool = False) -> Snapshot | None:
        """Copy ``flat``'s tensors into the buffer (CUDA copies are only launched) and return the
        snapshot. Waits while the previous save still reads the buffer, or returns None then if
        ``skip_if_busy`` and the structure is unchanged."""
        sig = signature(flat)
        buf = self.buffer
        if buf is not None and skip_if_busy and buf.busy and sig == self._signature:
            return None
        if buf is None or sig != self._signature or self._share is None:
            kept: list = []
            answer = exchange_plan(self.comm, seq, Inventory.of(flat), self.chunk_size,
                                   kept if self.comm.rank == 0 and self.comm.world > 1 else None)
            keys = list(flat.tensors)
            self._share = share = Share(tuple(keys[i] for i in answer.write), frozenset(answer.per_rank),
                                        frozenset(keys[i] for i in answer.fresh), lazily(kept))
            self._signature = None  # a new share: a new layout
        share = self._share
        assert share is not None
        buf = self.next_buffer(sig, lambda: make_layout({k: flat.tensors[k] for k in share.write}, self.chunk_size,
                                                        share.fresh))
        check = finite_checked(flat, self.check_finite)
        bad_settings = nonfinite_settings(flat) if self.check_finite is not False else []
        buf.acquire()
        if buf.in_pieces:
            from .ring import Ring, take_pieces

            assert isinstance(buf, Ring)
            return take_pieces(buf, flat, share, check, bad_settings)
        try:
            cuda, hashes, bad = buf.copy_in(flat.tensors, optimizer_guarded(flat) if buf.has_cuda else frozenset(),
                                            check)
        except BaseException:
            buf.release()
            raise
        return Snapshot(buf, {k: flat.leaves[k] for k in share.write}, share.per_rank, hashes, cuda, bad,
                        buf.generation, self.spare, bad_settings=bad_settings, plan=share.plan, store=self.store)

    def next_buffer(self, sig: tuple, layout: Callable[[], BufferLayout]) -> HostBuffer:
        """The buffer the next snapshot goes into, for a state of signature ``sig``: a new one laid out by
        ``layout()`` when ``sig`` changed (after the old one is free), else the same one or, with deltas,
        the other of the pair (the previous snapshot stays where it is, as the next one's base)."""
        buf = self.buffer
        if buf is None or sig != self._signature:
            if buf is not None:  # the structure changed: wait for the old buffer, then let it go
                buf.acquire()
                buf.release()
            self.buffer = self.spare = self.store = None
            made = layout()
            if self.budget is not None and made.nbytes > self.budget:  # larger than host_memory: in pieces
                from .ring import Ring

                self.reserve = None
                buf = Ring(made, self.budget, native=self.native, threads=self.threads)
            else:
                buf = HostBuffer(made, native=self.native, threads=self.threads, memory=self._reserved(made.nbytes))
                if self.pair and self.budget is not None and 2 * made.nbytes > self.budget:
                    from .base_store import BaseStore  # no second buffer: the room left keeps some chunks' bases

                    self.store = BaseStore(made, self.budget - made.nbytes)
            self.buffer, self._signature = buf, sig
            self.layouts_made += 1
            log.debug("new layout (%s): %d tensors, %d chunks, host buffer %.1f MiB (pinned=%s)",
                      self.comm.describe(), len(buf.layout.slots), len(buf.layout.chunks), buf.nbytes / 2**20,
                      buf.pinned)
        elif self.pair and not buf.in_pieces and self.store is None:  # both buffers within the budget
            if self.spare is None:
                self.spare = HostBuffer(buf.layout, native=self.native, threads=self.threads, lock_with=buf)
                log.info("a second host buffer of %.1f MiB keeps the previous save for delta encoding "
                         "(delta_chain=1 turns deltas and this buffer off)", self.spare.nbytes / 2**20)
            buf, self.spare = self.spare, buf
            self.buffer = buf
        return buf

    def drop(self) -> None:
        """Let both buffers go (their memory is freed once no save uses them)."""
        self.buffer = self.spare = self.store = None
        self._signature = self._share = None

    def _reserved(self, nbytes: int) -> torch.Tensor | None:
        """The reserve, for a buffer of ``nbytes`` if it is that size (within 2%); let go either way."""
        memory, self.reserve = self.reserve, None
        if memory is None or not nbytes <= memory.numel() <= nbytes * 1.02 + 4096:
            return None
        return memory[:max(nbytes, 1)]

    @property
    def host_bytes(self) -> int:
        """Host memory the snapshot buffers hold (both, with deltas)."""
        return sum(b.nbytes for b in (self.buffer, self.spare, self.store) if b is not None)

    def adopt(self, other: Snapshotter) -> None:
        """Start from ``other``'s buffer and layout (both single-process): a save whose structure
        matches reuses them instead of allocating; the buffer's own lock orders the two users."""
        if self.comm.world != 1 or other.comm.world != 1 or other.buffer is None:
            return
        self.buffer, self._signature, self._share = other.buffer, other._signature, other._share
        self.store = other.store if self.pair else None
        self.spare = other.spare if self.pair else None


def signature(flat: Flat) -> tuple:
    """Everything the layout and the share depend on: keys, dtypes, local shapes, devices, boxes, kinds."""
    return (tuple((k, t.dtype, tuple(t.shape), t.device.type, flat.leaves[k]) for k, t in flat.tensors.items()),
            tuple(sorted(flat.per_rank)))


class HostBuffer:
    """One host buffer sized for a layout, lent to one save at a time.

    ``native=False`` (or no compiled core) uses torch's copies and leaves hashing to the writer."""

    def __init__(self, layout: BufferLayout, native: bool = True, threads: int | None = None,
                 lock_with: HostBuffer | None = None, shared: bool = False, memory: torch.Tensor | None = None,
                 size: int | None = None):
        self.layout = layout
        # Allocated at the layout's exact size, then pinned where it lies (cudaHostRegister):
        # pin_memory=True would take it from torch's caching host allocator, which rounds every
        # block up to a power of two (a 40 GiB state would pin 64 GiB, twice that with deltas).
        if memory is not None and not shared:  # already faulted in (a load staged there): cleared, not allocated
            self.buffer = memory.zero_()
        else:
            self.buffer = torch.zeros(max(layout.nbytes if size is None else size, 1), dtype=torch.uint8)
        if shared:  # for another process to map (DCP's process mode): shared before anything views it
            self.buffer = self.buffer.share_memory_()
        self.pinned = _register_pinned(self, self.buffer)
        self.generation = 0  # snapshots copied in so far
        # A pair of buffers shares one lock: a save holds both (it reads the other as its base)
        # until its chunks are durable. A plain Lock: the thread that takes it (save()) is not the
        # one that gives it back (the writer).
        self._lock: threading.Lock = lock_with._lock if lock_with is not None else threading.Lock()
        self.cpu_core = _ext.cpu() if native else None
        self.cuda_core = _ext.cuda() if native else None
        self.threads = threads or min(8, _cpus.usable())
        self._offsets = np.array([c.offset for c in layout.chunks] + [layout.nbytes], np.uint64)
        self.has_cuda = any(s.device == "cuda" for s in layout.slots)
        self._want = self._chunks_without_cuda()  # per chunk: no CUDA bytes, so hash it at snapshot time
        self.last_used = {"cpu": "none", "cuda": "none"}
        self.layout_keys = [s.key for s in layout.slots]

    @property
    def nbytes(self) -> int:
        return self.buffer.numel()

    @property
    def nonfinite(self) -> list[str]:
        """A ring's checked tensors its pieces found holding NaN or Inf; a whole buffer's are the snapshot's."""
        return []

    def view(self, offset: int, length: int) -> memoryview:
        """A zero-copy view of buffer bytes, for hashing and writing."""
        return self.buffer.numpy().data[offset : offset + length]  # .data is memoryview(array)

    def address(self, offset: int) -> int:
        return self.buffer.data_ptr() + offset

    def acquire(self, timeout: float | None = None) -> bool:
        """Wait until no save is reading the buffer, then take it."""
        return self._lock.acquire(timeout=-1 if timeout is None else timeout)

    def release(self) -> None:
        """Give the buffer back; once per :meth:`acquire` (a second release would let two saves in)."""
        self._lock.release()

    def finished(self) -> None:
        """The writer is done with the snapshot in it: give the buffer back (a ring waits for its copier too)."""
        self.release()

    in_pieces = False  # a ring (ckpt.save.ring.Ring): a save copies the state in pieces

    def zero_padding(self) -> None:
        """Zero every byte no slot holds. A load that borrowed the buffer placed its stand-ins by its
        own layout and read chunks' padding across the gaps between them; a save copies only the
        slots, and the padding between them is part of its chunks' hashes, so it must be zero again."""
        pos = 0
        for slot in sorted(self.layout.slots, key=lambda s: s.offset):
            if slot.offset > pos:
                self.buffer[pos:slot.offset].zero_()
            pos = max(pos, slot.offset + slot.nbytes)
        if pos < self.buffer.numel():
            self.buffer[pos:].zero_()

    def fail(self, error: BaseException) -> None:
        """The copy stopped on ``error`` (a ring's copier: :class:`ckpt.save.ring.Ring`); one buffer has no copier."""

    @property
    def busy(self) -> bool:
        return self._lock.locked()

    def copy_in(self, tensors: dict[str, torch.Tensor], guarded: set[int] | frozenset[int] = frozenset(),
                check: frozenset[str] = frozenset()
                ) -> tuple[CudaSnapshot | None, list[str | None] | None, list[str]]:
        """Copy every tensor into its slot, checking those in ``check`` for NaN and Inf.

        Returns the pending CUDA copy (None if no tensor is on a GPU), per chunk its xxh3-128 when
        the compiled core hashed it during the copy (else None: the writer hashes), and the checked
        CPU tensors holding NaN or Inf (the CUDA ones are known once the copy is done).
        ``guarded`` holds the data pointers of CUDA tensors an optimizer pre-step hook protects."""
        self.generation += 1
        cpu_slots: list[tuple[TensorSlot, torch.Tensor]] = []
        cuda_slots: list[tuple[TensorSlot, torch.Tensor]] = []
        for slot in self.layout.slots:
            if slot.nbytes:
                src = tensors[slot.key]
                (cuda_slots if src.device.type == "cuda" else cpu_slots).append((slot, src))
        pending = copy_to_host(cuda_slots, guarded, check, self._launch) if cuda_slots else None
        try:
            hashes, bad = self._copy_cpu(cpu_slots, check)
        except BaseException:
            if pending is not None:
                pending.synchronize()  # the caller hands the buffer back: no copy may still write into it
            raise
        return pending, hashes, bad

    # -- CPU --------------------------------------------------------------------------------------
    def _dst(self, slot) -> torch.Tensor:
        return self.buffer[slot.offset : slot.offset + slot.nbytes].view(slot.dtype).view(slot.shape)

    def _copy_cpu(self, slots: list, check: frozenset[str], offsets: np.ndarray | None = None,
                  want: np.ndarray | None = None) -> tuple[list[str | None] | None, list[str]]:
        """Copy ``slots`` and hash the chunks that start at ``offsets`` (default: the layout's, with
        ``want`` saying which to hash)."""
        core = self.cpu_core
        bad: list[str] = []
        if core is None:
            with torch.no_grad():
                for slot, src in slots:
                    self._torch_copy(slot, src, check, bad)
            self.last_used["cpu"] = "torch" if slots else "none"
            return None, bad
        segs = np.empty(len(slots), _ext.SEG)
        keys: list[str] = []
        with torch.no_grad():
            for slot, src in slots:
                if _plain(src, slot.dtype):
                    kind = _ext.CHECK_KINDS[dtype_name(src.dtype)] if slot.key in check else 0
                    segs[len(keys)] = (src.data_ptr(), slot.offset, slot.nbytes, kind)
                    keys.append(slot.key)
                else:  # strided (or lazily conjugated) sources: torch lays them out first, the core hashes them
                    self._torch_copy(slot, src, check, bad)
        hashes, flags = core.copy_hash(self.buffer.data_ptr(), segs[:len(keys)],
                                       self._offsets if offsets is None else offsets,
                                       self._want if want is None else want, self.threads)
        bad += [keys[i] for i in np.flatnonzero(flags)]  # each slot once: native or torch, never both
        self.last_used["cpu"] = f"native/{core.simd}"
        return hashes, bad

    def _torch_copy(self, slot: TensorSlot, src: torch.Tensor, check: frozenset[str], bad: list[str]) -> None:
        dst = self._dst(slot)
        dst.copy_(src)
        if slot.key in check and not bool(torch.isfinite(dst).all()):  # the copy is in cache
            bad.append(slot.key)

    def _chunks_without_cuda(self) -> np.ndarray:
        # the structure signature includes devices, so this is fixed for the layout's lifetime
        want = np.ones(len(self.layout.chunks), np.uint8)
        for slot in self.layout.slots if self.has_cuda else ():
            if slot.nbytes and slot.device == "cuda":
                for i, _, _ in self.layout.segments(slot):
                    want[i] = 0
        return want

    # -- CUDA (ckpt/save/cuda_snapshot.py) ------------------------------------------------------------
    def _launch(self, slots: list, stream: torch.cuda.Stream, keep: list) -> None:
        """Enqueue the copies of ``slots`` on ``stream``: the compiled core for plain contiguous
        sources, torch's copy for the rest (strided, lazily conjugated or negated views)."""
        core = native_core(self.cuda_core, stream.device)  # None where this build cannot run (one warning)
        batch: list[tuple[int, int, int]] = []  # (source address, destination address, bytes)
        for slot, src in slots:
            src.record_stream(stream)  # the caching allocator must not reuse it before the copy ran
            if core is None or not _plain(src, slot.dtype):
                self._dst(slot).copy_(src.resolve_conj().resolve_neg(), non_blocking=True)
            else:
                batch.append((src.data_ptr(), self.buffer.data_ptr() + slot.offset, slot.nbytes))
        if core is None:
            self.last_used["cuda"] = "torch"
        elif batch:
            kernel, memcpy = launch_native(core, batch, stream, keep)
            self.last_used["cuda"] = f"native (kernel {kernel}, memcpy {memcpy})"


def _register_pinned(owner: object, buf: torch.Tensor) -> bool:
    """Pin ``buf``'s memory where it lies (cudaHostRegister: no copy, no power-of-two rounding) for
    as long as ``owner`` lives; False (plain memory, slower device copies) without CUDA or if the
    driver refuses."""
    if not torch.cuda.is_available():
        return False
    cudart = torch.cuda.cudart()
    # cudaHostRegisterPortable (1): pinned for every device's context, not only the current one's
    # (one buffer takes the copies of all the GPUs this process drives)
    rc = cudart.cudaHostRegister(buf.data_ptr(), buf.numel(), 1)
    if int(rc) != 0:
        log.warning("could not pin the %.1f MiB host buffer (cudaHostRegister: %s); device copies into it "
                    "go through plain memory", buf.numel() / 2**20, rc)
        return False
    weakref.finalize(owner, _unregister, cudart, buf)  # holds ``buf``: unregistered before the memory goes
    return True


def _unregister(cudart: Any, buf: torch.Tensor) -> None:
    cudart.cudaHostUnregister(buf.data_ptr())


def _plain(src: torch.Tensor, dtype: torch.dtype) -> bool:
    """Can ``src``'s bytes be copied as they lie? (Not for strided or lazily conjugated/negated views.)"""
    return src.is_contiguous() and not (src.is_conj() or src.is_neg()) and src.dtype == dtype
