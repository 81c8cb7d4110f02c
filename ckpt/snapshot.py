"""The snapshot: one copy of every tensor into a host buffer that is allocated once and reused.

This copy is the only part of a save the training loop waits for. The buffer is pinned when CUDA
is available (so device-to-host copies are DMA transfers), ordinary memory otherwise; the code path
is the same. The buffer is zero-filled at allocation, which also faults every page in up front, so
steady-state saves touch no new memory.

CPU tensors are copied before ``save()`` returns; with the compiled core (csrc/copyhash.cpp) the copy
runs on several threads and hashes each chunk while its bytes are in cache, so the writer does not
read the buffer a second time to hash it. CUDA tensors are copied on a side stream and ``save()``
returns right after the launch; the host never waits:

* tensors that an optimizer in the saved state updates (its parameters and its state) are guarded by
  a global optimizer pre-step hook that makes the stepping stream wait for the copy on the device;
* every other CUDA tensor (buffers such as BatchNorm statistics, loose tensors, parameters no saved
  optimizer owns) is copied first, and the current stream waits for those copies at once, on the
  device, so nothing later on it can change them mid-copy;
* the background writer waits on the copy's event before it reads the buffer.

:class:`Snapshotter` owns the buffer between saves: it remakes the layout (and asks the coordinator
which tensors this rank writes) only when the state's structure changes.
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from . import _ext
from .dist import Comm, Inventory
from .layout import BufferLayout, TensorSlot, make_layout
from .state import Flat, Leaf

log = logging.getLogger("ckpt")

# Pieces at least this large go through cudaMemcpyAsync (copy engines, SMs stay free for training);
# smaller ones are batched into one kernel launch. Measured on H100: see README "GPU snapshot".
KERNEL_MAX_BYTES = int(os.environ.get("CKPT_KERNEL_MAX_BYTES", 1 << 20))


@dataclass
class Share:
    """This rank's part of the writing: the tensors it writes (the coordinator balances replicated
    ones across ranks) and the top-level keys saved per rank."""

    write: tuple[str, ...]
    per_rank: frozenset[str]


@dataclass
class Snapshot:
    """One save's copy of the state in the host buffer: what the writer needs from the snapshot."""

    buffer: HostBuffer
    leaves: dict[str, Leaf]  # where each written tensor sits in its global tensor
    per_rank: frozenset[str]
    hashes: list[str | None] | None  # per chunk, when the compiled core hashed it during the copy
    cuda: CudaSnapshot | None  # the device-to-host copy still in flight, if any


class Snapshotter:
    """The host buffer, its layout and this rank's share of the writing, kept between saves.

    Example (what ``Checkpointer.save`` does)::

        snap = snapshotter.take(seq, flatten(state), state)   # None: busy and skip_if_busy
        ...                                                    # the writer reads snap.buffer
        snap.buffer.release()
    """

    def __init__(self, comm: Comm, chunk_size: int, native: bool = True, threads: int | None = None):
        self.comm = comm
        self.chunk_size = chunk_size
        self.native = native
        self.threads = threads
        self.buffer: HostBuffer | None = None
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
            answer = self.comm.exchange_plan(seq, Inventory.of(flat))
            keys = list(flat.tensors)
            share = Share(tuple(keys[i] for i in answer.write), frozenset(answer.per_rank))
            if buf is not None:  # the structure changed: wait for the old buffer, then let it go
                buf.acquire()
                buf.release()
            self.buffer = buf = None
            buf = HostBuffer(make_layout({k: flat.tensors[k] for k in share.write}, self.chunk_size),
                             native=self.native, threads=self.threads)
            self.buffer, self._signature, self._share = buf, sig, share
            self.layouts_made += 1
            log.debug("ckpt: new layout (%s): %d tensors, %d chunks, host buffer %.1f MiB (pinned=%s)",
                      self.comm.describe(), len(buf.layout.slots), len(buf.layout.chunks), buf.nbytes / 2**20,
                      buf.pinned)
        share = self._share
        buf.acquire()
        try:
            cuda, hashes = buf.copy_in(flat.tensors, optimizer_guarded(state) if buf.has_cuda else frozenset())
        except BaseException:
            buf.release()
            raise
        return Snapshot(buf, {k: flat.leaves[k] for k in share.write}, share.per_rank, hashes, cuda)

    def adopt(self, other: Snapshotter) -> None:
        """Start from ``other``'s buffer and layout (both single-process): a save whose structure
        matches reuses them instead of allocating; the buffer's own lock orders the two users."""
        if self.comm.world != 1 or other.comm.world != 1 or other.buffer is None:
            return
        self.buffer, self._signature, self._share = other.buffer, other._signature, other._share


def signature(flat: Flat) -> tuple:
    """Everything the layout and the share depend on: keys, dtypes, local shapes, devices, boxes, kinds."""
    return (tuple((k, t.dtype, tuple(t.shape), t.device.type, flat.leaves[k]) for k, t in flat.tensors.items()),
            tuple(sorted(flat.per_rank)))


def optimizer_guarded(state: dict[str, Any]) -> set[int]:
    """Data pointers of the CUDA tensors that an optimizer in ``state`` updates (its parameters and its
    state): the optimizer pre-step hook protects those, so their snapshot copy may overlap compute."""
    out: set[int] = set()
    values = list(state.values())
    while values:
        v = values.pop()
        if isinstance(v, (list, tuple)):
            values.extend(v)
        elif isinstance(v, dict):
            values.extend(v.values())
        elif isinstance(v, torch.optim.Optimizer):
            for group in v.param_groups:
                for p in group["params"]:
                    if p.is_cuda:
                        out.add(p.data_ptr())
            for pst in v.state.values():
                for t in pst.values():
                    if isinstance(t, torch.Tensor) and t.is_cuda:
                        out.add(t.data_ptr())
    return out


class HostBuffer:
    """One host buffer sized for a layout, lent to one save at a time.

    ``native=False`` (or no compiled core) uses torch's copies and leaves hashing to the writer."""

    def __init__(self, layout: BufferLayout, native: bool = True, threads: int | None = None):
        self.layout = layout
        pin = torch.cuda.is_available()
        self.pinned = pin
        self.buffer = torch.zeros(max(layout.nbytes, 1), dtype=torch.uint8, pin_memory=pin)
        self._free = threading.Event()
        self._free.set()
        self.cpu_core = _ext.cpu() if native else None
        self.cuda_core = _ext.cuda() if native else None
        self.threads = threads or min(8, os.cpu_count() or 1)
        self._offsets = np.array([c.offset for c in layout.chunks] + [layout.nbytes], np.uint64)
        self.has_cuda = any(s.device == "cuda" for s in layout.slots)
        self._want = self._chunks_without_cuda()  # per chunk: no CUDA bytes, so hash it at snapshot time
        self.last_used = {"cpu": "none", "cuda": "none"}

    @property
    def nbytes(self) -> int:
        return self.buffer.numel()

    def view(self, offset: int, length: int) -> memoryview:
        """A zero-copy view of buffer bytes, for hashing and writing."""
        return self.buffer.numpy().data[offset : offset + length]  # .data is memoryview(array)

    def address(self, offset: int) -> int:
        return self.buffer.data_ptr() + offset

    def acquire(self, timeout: float | None = None) -> bool:
        """Wait until no save is reading the buffer, then take it."""
        if not self._free.wait(timeout):
            return False
        self._free.clear()
        return True

    def release(self) -> None:
        self._free.set()

    @property
    def busy(self) -> bool:
        return not self._free.is_set()

    def copy_in(self, tensors: dict[str, torch.Tensor], guarded: set[int] | frozenset[int] = frozenset()
                ) -> tuple[CudaSnapshot | None, list[str | None] | None]:
        """Copy every tensor into its slot.

        Returns the pending CUDA copy (None if no tensor is on a GPU) and, per chunk, its xxh3-128
        when the compiled core hashed it during the copy (else None: the writer hashes). ``guarded``
        holds the data pointers of CUDA tensors an optimizer pre-step hook protects."""
        cpu_slots: list[tuple[TensorSlot, torch.Tensor]] = []
        cuda_slots: list[tuple[TensorSlot, torch.Tensor]] = []
        for slot in self.layout.slots:
            if slot.nbytes:
                src = tensors[slot.key]
                (cuda_slots if src.device.type == "cuda" else cpu_slots).append((slot, src))
        pending = self._copy_cuda(cuda_slots, guarded) if cuda_slots else None
        hashes = self._copy_cpu(cpu_slots)
        return pending, hashes

    # -- CPU --------------------------------------------------------------------------------------
    def _dst(self, slot) -> torch.Tensor:
        return self.buffer[slot.offset : slot.offset + slot.nbytes].view(slot.dtype).view(slot.shape)

    def _copy_cpu(self, slots: list) -> list[str | None] | None:
        core = self.cpu_core
        if core is None:
            with torch.no_grad():
                for slot, src in slots:
                    self._dst(slot).copy_(src)
            self.last_used["cpu"] = "torch" if slots else "none"
            return None
        segs = np.empty(len(slots), _ext.SEG)
        n = 0
        with torch.no_grad():
            for slot, src in slots:
                if src.is_contiguous() and not (src.is_conj() or src.is_neg()) and src.dtype == slot.dtype:
                    segs[n] = (src.data_ptr(), slot.offset, slot.nbytes)
                    n += 1
                else:  # strided (or lazily conjugated) sources: torch lays them out first, the core hashes them
                    self._dst(slot).copy_(src)
        hashes = core.copy_hash(self.buffer.data_ptr(), segs[:n], self._offsets, self._want, self.threads)
        self.last_used["cpu"] = f"native/{core.simd}"
        return hashes

    def _chunks_without_cuda(self) -> np.ndarray:
        # the structure signature includes devices, so this is fixed for the layout's lifetime
        want = np.ones(len(self.layout.chunks), np.uint8)
        for slot in self.layout.slots if self.has_cuda else ():
            if slot.nbytes and slot.device == "cuda":
                for i, _, _ in self.layout.segments(slot):
                    want[i] = 0
        return want

    # -- CUDA -------------------------------------------------------------------------------------
    def _copy_cuda(self, slots: list, guarded: set[int] | frozenset[int]) -> CudaSnapshot:
        device = slots[0][1].device
        compute = torch.cuda.current_stream(device)
        side = _side_stream(device)
        side.wait_stream(compute)  # the copy sees every update queued before save()
        # unguarded tensors first: the compute stream waits for them right away (on the device)
        fast = [(s, t) for s, t in slots if t.data_ptr() not in guarded]
        slow = [(s, t) for s, t in slots if t.data_ptr() in guarded]
        keep: list = []
        with torch.cuda.stream(side), torch.no_grad():
            self._launch(fast, side, keep)
            fast_done = torch.cuda.Event()
            fast_done.record(side)
            compute.wait_event(fast_done)
            if slow:
                self._launch(slow, side, keep)
            done = torch.cuda.Event()
            done.record(side)
        snap = CudaSnapshot(done, keep)
        if slow:
            fence_optimizers(snap)
        return snap

    def _launch(self, slots: list, stream: torch.cuda.Stream, keep: list) -> None:
        core = self.cuda_core
        small: list[tuple[int, int, int]] = []  # (source address, destination address, bytes)
        large: list[tuple[int, int, int]] = []
        for slot, src in slots:
            src.record_stream(stream)  # the caching allocator must not reuse it before the copy ran
            if core is None or not src.is_contiguous() or src.dtype != slot.dtype:
                self._dst(slot).copy_(src, non_blocking=True)
                continue
            (small if slot.nbytes < KERNEL_MAX_BYTES else large).append(
                (src.data_ptr(), self.buffer.data_ptr() + slot.offset, slot.nbytes))
        if core is None:
            self.last_used["cuda"] = "torch"
            return
        device = stream.device.index if stream.device.index is not None else torch.cuda.current_device()
        if small:
            # the kernel reads its piece list from pinned memory in place: keep it until the copy is done
            pinned = torch.empty(len(small) * _ext.DESC.itemsize, dtype=torch.uint8, pin_memory=True)
            descs = pinned.numpy().view(_ext.DESC)
            descs[:] = np.array(small, _ext.DESC)
            if core.copy(descs, stream.cuda_stream, device, kernel=True):
                keep.append(pinned)
            else:  # this pinned memory is not mapped at the same address: copy engines for all
                large, small = large + small, []
        if large:
            core.copy(np.array(large, _ext.DESC), stream.cuda_stream, device, kernel=False)
        self.last_used["cuda"] = f"native (kernel {len(small)}, memcpy {len(large)})"


class CudaSnapshot:
    """A device-to-host copy in flight: ``event`` completes when the host buffer holds the snapshot."""

    def __init__(self, event: torch.cuda.Event, keep: list):
        self.event = event
        self._keep = keep  # pinned piece lists the kernel reads

    def synchronize(self) -> None:
        self.event.synchronize()
        self._keep = []

    def query(self) -> bool:
        return self.event.query()


_streams: dict[torch.device, torch.cuda.Stream] = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    s = _streams.get(device)
    if s is None:
        s = _streams[device] = torch.cuda.Stream(device=device)
    return s


# -- the optimizer pre-step fence -------------------------------------------------------------------
_pending: weakref.WeakSet[CudaSnapshot] = weakref.WeakSet()
_pending_lock = threading.Lock()
_hook_handle = None


def fence_optimizers(snap: CudaSnapshot) -> None:
    """Make the next ``optimizer.step()`` (any optimizer) wait on the device for ``snap``'s copy."""
    global _hook_handle
    with _pending_lock:
        _pending.add(snap)
        if _hook_handle is None:
            _hook_handle = torch.optim.optimizer.register_optimizer_step_pre_hook(_wait_before_step)


def fence(stream: torch.cuda.Stream | None = None) -> None:
    """Make ``stream`` (default: the current one) wait, on the device, for every snapshot copy in flight.

    The optimizer pre-step hook does this before every ``optimizer.step()``; call it yourself before
    changing saved CUDA parameters in place by other means."""
    with _pending_lock:
        snaps = list(_pending)
        _pending.clear()
    s = stream or torch.cuda.current_stream()
    for snap in snaps:
        if not snap.query():
            s.wait_event(snap.event)


def _wait_before_step(optimizer, args, kwargs) -> None:
    if _pending:
        fence()
