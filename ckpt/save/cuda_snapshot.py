"""The CUDA side of the snapshot: device-to-host copies on a side stream, the NaN/Inf check on the
device, and the optimizer pre-step fence that lets the copy overlap training.

Copies are grouped by device: each device gets its own side stream (one per device, made by ckpt,
not taken from torch's shared pool), its own events and its own fence entry, so a model split over
several GPUs is copied and fenced device by device. Per device:

* the side stream first waits for everything queued on the device's current stream before
  ``save()``, so the snapshot holds the values as of the call;
* tensors no saved optimizer updates (buffers, loose tensors) are copied first, their NaN/Inf
  verdict is reduced, then an event is recorded that the current stream waits for at once (on
  the device): nothing queued later can change them mid-copy or mid-check;
* tensors an optimizer in the state (or one handed over with :func:`guarding`, for a state of
  ``state_dict()`` results) updates, its parameters and state, are copied next; the optimizer
  pre-step hook makes the stepping stream wait for the copy's event on the device, so the host
  never blocks and the copy overlaps the forward and backward passes.

What is *not* fenced: in-place writes to optimizer-owned tensors outside ``optimizer.step()``
(call :func:`fence` first), and optimizer steps captured in a CUDA graph (the hook does not run
inside a replay): a save while a capture is under way is refused (:class:`ConfigError`).

The compiled core copies only on a device it can run on (:func:`native_core`: asked once per
device, torch's copies and one warning otherwise).

The host buffer is handed back only after every copy into it is done (:meth:`CudaSnapshot.synchronize`),
on every path, failures included: the GPU never writes into a buffer a later save owns.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

# ``torch.optim`` deletes the name ``optimizer`` from its namespace (``del optimizer`` in its
# __init__), so ``torch.optim.optimizer.register_optimizer_step_pre_hook`` raises AttributeError even
# though the submodule is loaded: import the function from its module.
from torch.optim.optimizer import register_optimizer_step_pre_hook

from .. import _ext
from ..errors import ConfigError

# Pieces at least this large go through cudaMemcpyAsync (copy engines, SMs stay free for training);
# smaller ones are batched into one kernel launch. See docs/api.md "Compiled core and GPU snapshots";
# measured by benchmarks/gpu_snapshot.py: docs/benchmarks.md "The snapshot on GPU".
KERNEL_MAX_BYTES = int(os.environ.get("CKPT_KERNEL_MAX_BYTES", 1 << 20))

# For tests of the ordering: spin the side stream this many GPU clock cycles before each batch of
# copies, so that anything not ordered after the copy (an unfenced optimizer step) certainly runs
# first. 0 in production.
COPY_DELAY_CYCLES = 0

# (slot, source tensor): a slot has .key, .offset, .nbytes, .dtype; the destination is given by a function
Pieces = list[tuple[Any, torch.Tensor]]


class DeviceCopy:
    """The copies of one device in flight: ``event`` completes when the host buffer holds them (and
    the NaN/Inf verdicts of that device's checked tensors, if any)."""

    def __init__(self, device: torch.device, event: torch.cuda.Event, keep: list,
                 verdicts: list[tuple[list[str], torch.Tensor]]):
        self.device = device
        self.event = event
        self._keep = keep  # pinned piece lists the kernel reads in place
        self._verdicts = verdicts

    def query(self) -> bool:
        return self.event.query()

    def synchronize(self) -> None:
        self.event.synchronize()
        self._keep = []

    def nonfinite(self) -> list[str]:
        return [k for keys, finite in self._verdicts for k, ok in zip(keys, finite.tolist()) if not ok]


class CudaSnapshot:
    """Every device's copy of one snapshot."""

    def __init__(self, parts: list[DeviceCopy]):
        self.parts = parts

    def synchronize(self) -> None:
        """Wait (yielding the CPU: blocking events) until every copy is in the host buffer."""
        for p in self.parts:
            p.synchronize()

    def query(self) -> bool:
        return all(p.query() for p in self.parts)

    def nonfinite(self) -> list[str]:
        """The checked CUDA tensors holding NaN or Inf (after :meth:`synchronize`)."""
        return [k for p in self.parts for k in p.nonfinite()]


def copy_to_host(pieces: Pieces, guarded: set[int] | frozenset[int], check: frozenset[str],
                 launch: Callable[[Pieces, torch.cuda.Stream, list], None]) -> CudaSnapshot:
    """Launch the copies of ``pieces`` (CUDA sources) device by device; ``launch(pieces, stream,
    keep)`` enqueues one batch on ``stream``. ``guarded``: data pointers the optimizer pre-step hook
    protects (copied last, fenced). On an error, waits for whatever was launched before raising."""
    if torch.cuda.is_current_stream_capturing():
        raise ConfigError("save() was called while a CUDA graph is being captured: the snapshot's copies and events "
                          "cannot be captured. Save outside the captured region (e.g. between graph replays).")
    # per device: (unguarded pieces, guarded pieces), split once
    by_device: dict[torch.device, tuple[Pieces, Pieces]] = {}
    for slot, src in pieces:
        fast, slow = by_device.setdefault(src.device, ([], []))
        (slow if src.data_ptr() in guarded else fast).append((slot, src))
    if any(slow for _, slow in by_device.values()):
        install_step_hook()  # before any copy is launched: a failure here leaves nothing in flight
    parts: list[DeviceCopy] = []
    try:
        for device, (fast, slow) in by_device.items():
            parts.append(_copy_device(device, fast, slow, check, launch))
    except BaseException:
        for device in by_device:
            _side_stream(device).synchronize()  # nothing may still write into the buffer or read `keep`
        raise
    snap = CudaSnapshot(parts)
    for part in parts:
        if by_device[part.device][1]:
            fence_optimizers(part)
    return snap


def _copy_device(device: torch.device, fast: Pieces, slow: Pieces, check: frozenset[str],
                 launch: Callable[[Pieces, torch.cuda.Stream, list], None]) -> DeviceCopy:
    """One device's copies: ``fast`` (nothing fences them: the compute stream waits for them at
    once), then ``slow`` (an optimizer updates them: the pre-step hook fences them)."""
    compute = torch.cuda.current_stream(device)
    side = _side_stream(device)
    side.wait_stream(compute)  # the copy sees every update queued before save()
    keep: list = []
    verdicts: list[tuple[list[str], torch.Tensor]] = []
    with torch.cuda.device(device), torch.cuda.stream(side), torch.no_grad():
        _delay()
        launch(fast, side, keep)
        # the verdict reads the sources: reduce before the compute stream may change them
        checked = [(s.key, t) for s, t in fast if s.key in check]
        if checked:
            verdicts.append(_finite_on_device(checked))
        fast_done = torch.cuda.Event()
        fast_done.record(side)
        compute.wait_event(fast_done)
        if slow:
            _delay()
            launch(slow, side, keep)
            checked = [(s.key, t) for s, t in slow if s.key in check]
            if checked:
                verdicts.append(_finite_on_device(checked))
        done = torch.cuda.Event(blocking=True)  # the writer's wait yields the CPU instead of spinning
        done.record(side)
    return DeviceCopy(device, done, keep, verdicts)


def _delay() -> None:
    if COPY_DELAY_CYCLES:
        torch.cuda._sleep(COPY_DELAY_CYCLES)


def _finite_on_device(checked: list[tuple[str, torch.Tensor]]) -> tuple[list[str], torch.Tensor]:
    """Enqueue, on the current (side) stream, a NaN/Inf test of ``checked`` (key, CUDA tensor): one
    fused max-abs reduction per dtype (NaN propagates through it, Inf is its own maximum), its
    verdicts copied into pinned host memory. Returns the keys and that host tensor (valid once the
    stream has run)."""
    by_dtype: dict[torch.dtype, list[tuple[str, torch.Tensor]]] = {}
    for key, t in checked:
        by_dtype.setdefault(t.dtype, []).append((key, t))
    keys: list[str] = []
    verdicts = []
    for group in by_dtype.values():
        norms = torch._foreach_norm([t for _, t in group], float("inf"))
        verdicts.append(torch.isfinite(torch.stack(norms)))
        keys += [k for k, _ in group]
    host = torch.empty(len(keys), dtype=torch.bool, pin_memory=True)
    host.copy_(torch.cat(verdicts), non_blocking=True)
    return keys, host


def launch_native(core: Any, batch: list[tuple[int, int, int]], stream: torch.cuda.Stream, keep: list
                  ) -> tuple[int, int]:
    """Copy ``batch`` of (source address, destination address, bytes) with the compiled core:
    small pieces in one kernel launch, large ones on the copy engines. Returns (kernel, memcpy) counts."""
    small = [p for p in batch if p[2] < KERNEL_MAX_BYTES]
    large = [p for p in batch if p[2] >= KERNEL_MAX_BYTES]
    device = stream.device.index if stream.device.index is not None else torch.cuda.current_device()
    if small:
        # the kernel reads its piece list from pinned memory in place: keep it until the copy is done
        pinned = torch.empty(len(small) * _ext.DESC.itemsize, dtype=torch.uint8, pin_memory=True)
        descs = pinned.numpy().view(_ext.DESC)
        descs[:] = np.array(small, _ext.DESC)
        keep.append(pinned)
        if not core.copy(descs, stream.cuda_stream, device, kernel=True):
            large, small = large + small, []  # this pinned memory is not mapped at the same address
    if large:
        core.copy(np.array(large, _ext.DESC), stream.cuda_stream, device, kernel=False)
    return len(small), len(large)


def native_core(core: Any, device: torch.device) -> Any:
    """``core`` (the compiled CUDA copy) if it can run on ``device``, else None (torch's copies);
    asked with ``device`` current, once per device (a no gives one warning, :meth:`_ext.CudaCore.usable`)."""
    if core is None:
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    return core if core.usable(index) else None


_streams: dict[torch.device, torch.cuda.Stream] = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    """The snapshot's side stream on ``device``: made once and kept for the process.

    ``torch.cuda.Stream()`` hands out streams round-robin from a small per-device pool that every
    caller shares (FSDP2's all-gather and reduce-scatter streams, DDP, other libraries): the copy
    could land on the stream of a collective and wait behind it, or hold it up. So the stream comes
    from ckpt's CUDA core (non-blocking, lowest priority, ckpt's alone); only without a usable core
    does it fall back to torch's pool."""
    s = _streams.get(device)
    if s is None:
        with torch.cuda.device(device):
            core = native_core(_ext.cuda(), device)
            if core is not None:
                index = torch.cuda.current_device()
                s = torch.cuda.ExternalStream(core.stream(index), device=device)
            else:
                s = torch.cuda.Stream(device=device)
        _streams[device] = s
    return s


# -- the optimizer pre-step fence -------------------------------------------------------------------
_pending: weakref.WeakSet[Any] = weakref.WeakSet()  # DeviceCopy objects whose copy may still run
_pending_lock = threading.Lock()
_hook_handle = None


def install_step_hook() -> None:
    """Register the global optimizer pre-step hook that runs :func:`fence` (once per process)."""
    global _hook_handle
    with _pending_lock:
        if _hook_handle is None:
            _hook_handle = register_optimizer_step_pre_hook(_wait_before_step)


def fence_optimizers(copy: Any) -> None:
    """Make the next ``optimizer.step()`` (any optimizer) wait on the device for ``copy`` (a
    :class:`DeviceCopy`: ``device``, ``event``, ``query()``)."""
    install_step_hook()
    with _pending_lock:
        _pending.add(copy)


def pending_copies() -> list[DeviceCopy]:
    """The snapshot copies the fence still holds (each stays until an optimizer step or :func:`fence`
    finds it done); ``synchronize()`` on one waits for that copy."""
    with _pending_lock:
        return list(_pending)


def fence(stream: torch.cuda.Stream | None = None) -> None:
    """Make ``stream`` (default: the current stream of each snapshot's device) wait, on the device, for
    every snapshot copy in flight.

    The optimizer pre-step hook does this before every ``optimizer.step()``; call it yourself before
    changing saved CUDA parameters in place by other means. A copy stays fenced until it is done
    (another optimizer on another stream must wait for it too).

    Args:
        stream: the CUDA stream to make wait; None: the current stream of each snapshot's device.

    Raises:
        ConfigError: a CUDA graph is being captured while a copy is in flight (wait for the save first).
    """
    with _pending_lock:
        copies = list(_pending)
    for copy in copies:
        if copy.query():
            with _pending_lock:
                _pending.discard(copy)
            continue
        if torch.cuda.is_current_stream_capturing():
            raise ConfigError("an optimizer step is being captured in a CUDA graph while a snapshot copy is still in "
                              "flight: the fence cannot wait on it inside the capture. Call h.wait() on the save's "
                              "handle (or ckpt.fence() and torch.cuda.synchronize()) before capturing.")
        (stream or torch.cuda.current_stream(copy.device)).wait_event(copy.event)


def _wait_before_step(optimizer, args, kwargs) -> None:
    if _pending:
        fence()


# -- optimizers the caller hands over ----------------------------------------------------------------
# A state made of state_dict()s (Lightning's checkpoint dict, FSDP2's get_state_dict) holds no
# optimizer object, so nothing in it says which tensors only optimizer.step() changes: every one
# would be copied before the compute stream may go on. Whoever knows the optimizers hands them over.
_handed = threading.local()


@contextmanager
def guarding(optimizers: Iterable[torch.optim.Optimizer]) -> Iterator[None]:
    """Saves made in this block on this thread treat ``optimizers`` as if they were in the state: the
    saved CUDA tensors that are their parameters or state (matched by storage address, as for
    optimizers in the state) are copied behind the optimizer pre-step fence, overlapping the next
    forward and backward. Nothing else changes (they are not saved, nor NaN-checked, through this).

    Example (a state of ``state_dict()`` results)::

        with ckpt.save.cuda_snapshot.guarding([opt]):
            c.save(step, {"model": model.state_dict(), "optim": opt.state_dict()})

    The fence's rule then covers them: change them in place outside ``optimizer.step()`` only after
    :func:`fence`."""
    optimizers = tuple(optimizers)
    wrong = [type(o).__name__ for o in optimizers if not isinstance(o, torch.optim.Optimizer)]
    if wrong:
        raise ConfigError(f"guarding() takes torch.optim.Optimizer objects, got {', '.join(wrong)}: pass the "
                          "optimizers themselves (Lightning: trainer.optimizers), not wrappers or state_dict()s")
    before = handed_over()
    _handed.optimizers = before + optimizers
    try:
        yield
    finally:
        _handed.optimizers = before


def handed_over() -> tuple[torch.optim.Optimizer, ...]:
    """The optimizers :func:`guarding` hands to saves on this thread (empty outside it)."""
    return getattr(_handed, "optimizers", ())


_stepped: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
_track_handle = None


def track_stepping_optimizers() -> None:
    """From now on, note every optimizer that takes a step in this process (once per process; one
    set insertion per step). For callers that are never shown the optimizers, such as a Lightning
    ``CheckpointIO``: :func:`stepping_optimizers` then names them."""
    global _track_handle
    with _pending_lock:
        if _track_handle is None:
            _track_handle = register_optimizer_step_pre_hook(_note_step)


def stepping_optimizers() -> list[torch.optim.Optimizer]:
    """The live optimizers that took a step since :func:`track_stepping_optimizers` was called."""
    return list(_stepped)


def _note_step(optimizer, args, kwargs) -> None:
    _stepped.add(optimizer)
