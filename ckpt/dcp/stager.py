"""``ckpt.dcp.Stager``: DCP's snapshot seam (``AsyncStager``) over ckpt's host buffer.

``stage(state_dict)`` copies every tensor, CPU or CUDA, into one host buffer laid out by
:func:`ckpt.save.buffer_layout.make_layout` and filled by :meth:`ckpt.save.snapshot.HostBuffer.copy_in` (the
same copy ``Checkpointer.save`` makes: multi-threaded and fused with hashing on CPU, batched
device-to-host copies on GPU), and returns a state dict of the same shape whose tensors are views
into that buffer. The buffer is allocated at the state's size and reused while the structure
(keys, dtypes, shapes, devices, placements) stays the same, so memory stays flat over many saves.

The buffer is allocated in shared memory (``shared=True``, as DCP's own default stager does), so
``async_save`` in process mode hands it to its background process as it is, without moving a buffer
in use into shared memory. With CUDA it is pinned by registering it (no copy, no rounding up).
Staged DTensors are sent to that process as their local views (see
:func:`_send_dtensors_as_local_views`: torch's own DTensor pickling crashes on views at an offset).
``shared=False`` keeps it out of ``/dev/shm`` (small in some containers) for thread mode.

The buffer starts with a 64-byte header that the staged tensors share (their storage is the
buffer's), which a :class:`ckpt.dcp.Writer` in the same process reads: see :class:`Header`. The
Writer knows a Stager's buffer by its identity (the storages this process's Stagers allocated),
never by the bytes a tensor starts with.
"""

from __future__ import annotations

import copy
import logging
import time
import weakref
from typing import Any

import torch
from torch.distributed.checkpoint.staging import AsyncStager

from .._args import flag
from ..errors import CheckpointError, ConfigError
from ..save.buffer_layout import BufferLayout, TensorSlot, make_layout
from ..save.snapshot import HostBuffer
from ..save.state_checks import local_tensor as _local
from ..sharding import is_dtensor
from . import _serial

log = logging.getLogger("ckpt")

MAGIC = int.from_bytes(b"CKPTSTG1", "little")
HEADER_BYTES = 64
SEQ, READING, DONE = 1, 2, 3  # int64 fields after the magic


# The buffers of this process's Stagers, by the address of their storage: a tensor is a view into a
# Stager's buffer when its storage is one of these (identity), never because of what its bytes hold.
_buffers: dict[int, weakref.ref[torch.Tensor]] = {}


def _register(buffer: torch.Tensor) -> None:
    ptr = buffer.untyped_storage().data_ptr()
    for p in [p for p, r in _buffers.items() if r() is None]:
        del _buffers[p]
    _buffers[ptr] = weakref.ref(buffer)


class Header:
    """The first 64 bytes of a Stager's buffer, as int64 fields: the magic, ``seq`` (snapshots
    staged, times two; odd while one is being copied in), ``reading`` (the seq a Writer is copying
    out) and ``done`` (the last seq a Writer finished copying out, or gave up on). A seqlock: a
    Writer that sees ``seq`` change while it copies refuses the save instead of storing a mixture of
    two snapshots. Found by identity (:func:`Header.of`): only in the process that staged."""

    def __init__(self, fields: torch.Tensor):
        self.fields = fields

    def get(self, i: int) -> int:
        return int(self.fields[i])

    def set(self, i: int, v: int) -> None:
        self.fields[i] = v

    @classmethod
    def of(cls, t: torch.Tensor) -> Header | None:
        """The header of the Stager buffer ``t`` is a view into, or None: any other tensor, whatever
        its bytes (a user's tensor starting with the magic is a user's tensor)."""
        if t.device.type != "cpu" or t.is_meta:
            return None
        ptr = t.untyped_storage().data_ptr()
        ref = _buffers.get(ptr)
        buffer = ref() if ref is not None else None
        if buffer is None or buffer.untyped_storage().data_ptr() != ptr:
            return None
        return cls(buffer[:HEADER_BYTES].view(torch.int64))

    def wait_even(self, deadline: float) -> int:
        """The seq of a finished snapshot (waits while one is being copied in)."""
        while (seq := self.get(SEQ)) % 2:
            if time.monotonic() > deadline:
                raise CheckpointError("the Stager's snapshot did not finish in time; nothing was saved. Another "
                                      "stage() is stuck or its process died: wait for the previous async_save's "
                                      "future, or raise the Writer's timeout")
            time.sleep(0.001)
        return seq


_live: weakref.WeakSet[Stager] = weakref.WeakSet()  # this process's Stagers (see release_pending)


def release_pending() -> None:
    """A ckpt save in this process failed before copying its snapshot out (e.g. its step was already
    committed): let every Stager here stage over its pending snapshot at once instead of waiting
    ``wait_s`` for a copy that will never come. A snapshot a Writer is copying right now is left alone."""
    for stager in list(_live):
        buf = stager.buffer
        hdr = Header.of(buf.buffer) if buf is not None else None
        if hdr is not None and hdr.get(READING) <= hdr.get(DONE):
            hdr.set(DONE, hdr.get(SEQ))


class Stager(AsyncStager):
    """Stages a state for ``dcp.async_save`` into one reused host buffer; ``async_save`` returns as
    soon as the copy is done (CUDA copies included). Example::

        stager = ckpt.dcp.Stager()
        fut = dcp.async_save(state, storage_writer=ckpt.dcp.Writer(url, step=200), async_stager=stager)
        ...                      # training goes on; the next async_save reuses the buffer
        fut.result()

    **One buffer.** The next ``stage`` waits until the save of the previous snapshot is done with
    it: a :class:`ckpt.dcp.Writer` copied it out (or its save failed first), or nothing holds the
    staged tensors any more (a save with another ``StorageWriter`` ended; DCP's process mode). So
    several ``async_save`` calls in flight each commit the values of their own call. At most
    ``wait_s`` seconds: a snapshot held elsewhere (a failed save's future keeps it) is then staged
    over, with a warning; a Writer that finds the buffer restaged while it copies fails that save
    (nothing committed, never a mixture). The saves themselves then run one after the other (see
    :mod:`ckpt.dcp._serial`), so two ranks never wait on each other's collectives.

    ``should_synchronize_after_execute`` is True and :meth:`synchronize_staging` returns at once:
    ``stage`` returns only when every copy, CUDA ones included, is done.

    Args:
        native: use the compiled core's copy when it is built.
        threads: threads for the CPU copy (default: cores, at most 8).
        wait_s: seconds ``stage`` waits for the previous snapshot's save to be done with the buffer.
        shared: allocate the buffer in shared memory (needed for DCP's process mode); ``False`` keeps it out of
            ``/dev/shm`` for thread mode.

    Raises:
        ConfigError: a bad argument (it names it).
    """

    _synchronize_after_execute: bool = True

    def __init__(self, *, native: bool = True, threads: int | None = None, wait_s: float = 60.0,
                 shared: bool = True):
        self.shared = flag("shared", shared)
        flag("native", native)
        if threads is not None and (type(threads) is not int or threads < 1):
            raise ConfigError(f"threads must be a positive integer or None, got {threads!r}")
        if isinstance(wait_s, bool) or not isinstance(wait_s, (int, float)) or wait_s < 0:
            raise ConfigError(f"wait_s must be a number of seconds ≥ 0, got {wait_s!r}")
        self.native, self.threads, self.wait_s = native, threads, float(wait_s)
        self.buffer: HostBuffer | None = None
        self.layouts_made = 0
        self._signature: tuple | None = None
        self._header: Header | None = None
        self._held: list[weakref.ref[torch.Tensor]] = []  # the tensors of the buffer's last snapshot
        _live.add(self)

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """Copy ``state_dict`` into the host buffer, once the previous snapshot's save is done with it.

        Args:
            state_dict: the state DCP stages.

        Returns:
            dict[str, Any]: a copy whose tensors are views into the host buffer (DTensors stay DTensors, over a
            view of their local shard); other values are deep-copied.

        Raises:
            ConfigError: ``state_dict`` is not a dict.
        """
        try:
            return self._stage(state_dict)
        except BaseException:
            _serial.give_up_newest()  # this call's save never starts: later ones must not wait for its Writer
            raise

    def _stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        if not isinstance(state_dict, dict):
            raise ConfigError(f"stage needs a state dict, got {type(state_dict).__name__}")
        found = _tensors(state_dict)
        tensors = {str(i): _local(t).detach() for i, t in enumerate(found)}
        sig = tuple((t.dtype, tuple(t.shape), t.device.type, _placement(src))
                    for t, src in zip(tensors.values(), found))
        buf = self._buffer_for(sig, tensors)
        hdr = self._header
        assert hdr is not None
        self._wait_for_previous(buf, hdr)
        buf.acquire()
        seq = hdr.get(SEQ)
        hdr.set(SEQ, seq + 1)  # odd: copying in
        try:
            cuda, _, _ = buf.copy_in(tensors)
            if cuda is not None:
                cuda.synchronize()
        finally:
            hdr.set(SEQ, seq + 2)
            buf.release()
        views = iter([_view(buf, slot) for slot in buf.layout.slots])
        staged = _walk(state_dict, lambda t: _rebuild(t, next(views)))
        self._held = [weakref.ref(t) for t in _tensors(staged)]  # what a save holds of this snapshot
        return staged

    def _buffer_for(self, sig: tuple, tensors: dict[str, torch.Tensor]) -> HostBuffer:
        """The buffer for this structure: the last one, or (the structure changed) a new one; the old
        buffer is left to the save that may still hold its snapshot (never written again)."""
        if self.buffer is not None and sig == self._signature:
            return self.buffer
        self.buffer = buf = HostBuffer(_layout(tensors), native=self.native, threads=self.threads, shared=self.shared)
        buf.buffer[:HEADER_BYTES].view(torch.int64)[0] = MAGIC
        _register(buf.buffer)
        self._header = Header(buf.buffer[:HEADER_BYTES].view(torch.int64))
        self._held = []  # nothing staged in it yet
        self._signature = sig
        self.layouts_made += 1
        return buf

    def _wait_for_previous(self, buf: HostBuffer, hdr: Header) -> None:
        """Before staging over the buffer's previous snapshot: wait until its save is done with it,
        i.e. a ckpt.dcp.Writer copied it out (or gave up on it: its save failed first), or nothing
        holds a view of it any more (a save with another StorageWriter ended; DCP's process mode)."""
        deadline = time.monotonic() + self.wait_s
        while True:
            seq, reading, done = hdr.get(SEQ), hdr.get(READING), hdr.get(DONE)
            copying = reading > done
            if not copying and (done >= seq or all(ref() is None for ref in self._held)):
                return
            if time.monotonic() > deadline:
                if copying:
                    raise CheckpointError(
                        f"a ckpt.dcp.Writer has been copying the previous snapshot out of the Stager's buffer for more "
                        f"than {self.wait_s:.0f}s; nothing was staged. Wait for the previous save's future first")
                log.warning("the previous snapshot in the Stager's buffer is still held after %.0fs and no ckpt.dcp."
                            "Writer copied it out (its save failed, or it is held elsewhere); staging over it: a "
                            "ckpt.dcp.Writer that copies it now refuses its save", self.wait_s)
                return
            time.sleep(0.002)

    def synchronize_staging(self) -> None:
        """Nothing to wait for: :meth:`stage` returns once every copy is done."""

    def close(self) -> None:
        """Let the buffer go (the next ``stage`` allocates a new one)."""
        self.buffer, self._signature, self._header, self._held = None, None, None, []


def _layout(tensors: dict[str, torch.Tensor]) -> BufferLayout:
    """Where each tensor goes: the 64-byte header first (in no tensor's slot), then the tensors."""
    full = make_layout({"": torch.empty(HEADER_BYTES, dtype=torch.uint8), **tensors}, 1 << 30)
    assert full.slots[0].offset == 0 and full.slots[0].nbytes == HEADER_BYTES
    return BufferLayout(full.slots[1:], full.chunks, full.nbytes)


def _view(buf: HostBuffer, slot: TensorSlot) -> torch.Tensor:
    return buf.buffer[slot.offset : slot.offset + slot.nbytes].view(slot.dtype).view(slot.shape)


def _placement(t: torch.Tensor) -> Any:
    if not is_dtensor(t):
        return None
    return (tuple(t.shape), tuple(t.placements), id(t.device_mesh))


_dtensor_reduction_registered = False


def _send_dtensors_as_local_views() -> None:
    """Make multiprocessing pickle a DTensor as (its local tensor, mesh, placements, shape, stride).

    DCP's process mode pickles the staged state for its background process. torch 2.13 pickles a
    DTensor whose local tensor starts at a nonzero offset of its storage (every staged tensor but the
    first: they are views into one buffer) by a path that crashes the process (SIGSEGV), while a plain
    tensor view at any offset of a shared storage is sent by torch's own tensor reduction, which this
    uses. Registered once, on the first ``stage()``; it changes nothing but how DTensors are sent
    between processes."""
    global _dtensor_reduction_registered
    if _dtensor_reduction_registered:
        return
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing  # noqa: F401  (registers torch's tensor reductions)
    from torch.distributed.tensor import DTensor

    ForkingPickler.register(DTensor, _reduce_dtensor)
    _dtensor_reduction_registered = True


def _reduce_dtensor(t: Any) -> tuple:
    return _dtensor_from_local, (t._local_tensor, t.device_mesh, t.placements, t.shape, t.stride())


def _dtensor_from_local(local: torch.Tensor, mesh: Any, placements: Any, shape: torch.Size, stride: tuple) -> Any:
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, stride=stride)


def _rebuild(src: torch.Tensor, view: torch.Tensor) -> torch.Tensor:
    """``view`` standing where ``src`` stood: a DTensor over it when ``src`` is one."""
    if not is_dtensor(src):
        return view
    _send_dtensors_as_local_views()
    return _dtensor_from_local(view, src.device_mesh, src.placements, src.shape, src.stride())


def _tensors(obj: Any) -> list[torch.Tensor]:
    """Every tensor in ``obj``, in :func:`_walk`'s order (nothing copied)."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors(v)]
    if type(obj) in (list, tuple):
        return [t for v in obj for t in _tensors(v)]
    return []


def _walk(obj: Any, on_tensor: Any) -> Any:
    """A copy of ``obj`` (dicts, lists, tuples rebuilt) with ``on_tensor(t)`` for every tensor, in order."""
    if isinstance(obj, torch.Tensor):
        return on_tensor(obj)
    if isinstance(obj, dict):
        return {k: _walk(v, on_tensor) for k, v in obj.items()}
    if type(obj) in (list, tuple):
        return type(obj)(_walk(v, on_tensor) for v in obj)
    return copy.deepcopy(obj)
