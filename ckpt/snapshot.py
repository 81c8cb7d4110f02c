"""The snapshot: one copy of every tensor into a host buffer that is allocated once and reused.

This copy is the only part of a save the training loop waits for. The buffer is pinned when CUDA
is available (so device-to-host copies are DMA transfers), ordinary memory otherwise; the code path
is the same. The buffer is zero-filled at allocation, which also faults every page in up front, so
steady-state saves touch no new memory.
"""

from __future__ import annotations

import threading

import torch

from .plan import Plan


class HostPool:
    """One host buffer sized for a plan, lent to one save at a time."""

    def __init__(self, plan: Plan):
        self.plan = plan
        pin = torch.cuda.is_available()
        self.pinned = pin
        self.buffer = torch.zeros(max(plan.nbytes, 1), dtype=torch.uint8, pin_memory=pin)
        self._free = threading.Event()
        self._free.set()

    @property
    def nbytes(self) -> int:
        return self.buffer.numel()

    def view(self, offset: int, length: int) -> memoryview:
        """A zero-copy view of buffer bytes, for hashing and writing."""
        return memoryview(self.buffer.numpy())[offset : offset + length]

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

    def copy_in(self, tensors: dict[str, torch.Tensor]) -> torch.cuda.Event | None:
        """Copy every tensor into its slot. CPU tensors are copied before this returns; CUDA tensors
        are copied on a side stream, and the returned event marks the end of those copies."""
        event = None
        cuda_pending = []
        with torch.no_grad():
            for slot in self.plan.slots:
                if slot.nbytes == 0:
                    continue
                src = tensors[slot.key]
                dst = self.buffer[slot.offset : slot.offset + slot.nbytes].view(slot.dtype).view(slot.shape)
                if src.device.type == "cuda":
                    cuda_pending.append((dst, src))
                else:
                    dst.copy_(src)
            if cuda_pending:
                stream = _side_stream(cuda_pending[0][1].device)
                stream.wait_stream(torch.cuda.current_stream(cuda_pending[0][1].device))
                with torch.cuda.stream(stream):
                    for dst, src in cuda_pending:
                        dst.copy_(src, non_blocking=True)
                        src.record_stream(stream)
                    event = torch.cuda.Event()
                    event.record(stream)
        return event


_streams: dict[torch.device, torch.cuda.Stream] = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    s = _streams.get(device)
    if s is None:
        s = _streams[device] = torch.cuda.Stream(device=device)
    return s
