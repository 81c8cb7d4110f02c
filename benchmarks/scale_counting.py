"""What crosses the store and the storage, for benchmarks/scale.py: an in-process store shared by N
simulated ranks, a :class:`~ckpt.ranks.LocalComm` per rank over it counting every request and byte
(ckpt's Comm protocol unchanged: only its transport is here), and a storage wrapper counting
requests and bytes."""

from __future__ import annotations

import threading
import time
import traceback
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

from ckpt.ranks import LocalComm
from ckpt.storage.base import Blob, Storage
from ckpt.testing.faults import FaultyStorage


class SharedStore:
    """The key-value store of a job, in one process: values by key, a wait per key (no thundering herd)."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}
        self._events: dict[str, threading.Event] = {}
        self._lock = threading.Lock()

    def _event(self, key: str) -> threading.Event:
        with self._lock:
            return self._events.setdefault(key, threading.Event())

    def put(self, key: str, value: bytes) -> None:
        with self._lock:
            self.data[key] = value
            self._events.setdefault(key, threading.Event()).set()

    def get(self, key: str, deadline: float) -> bytes | None:
        self._event(key).wait(max(0.0, deadline - time.monotonic()))
        with self._lock:
            return self.data.get(key)

    def delete(self, key: str) -> None:
        with self._lock:
            self.data.pop(key, None)

    def compare_set(self, key: str, value: bytes) -> bytes:
        with self._lock:
            out = self.data.setdefault(key, value)
            self._events.setdefault(key, threading.Event()).set()
            return out

    def add(self, key: str, amount: int) -> int:
        with self._lock:
            n = int(self.data.get(key, b"0")) + amount
            self.data[key] = str(n).encode()
            self._events.setdefault(key, threading.Event()).set()
            return n


class CountingComm(LocalComm):
    """Rank ``rank`` of ``world`` over a :class:`SharedStore`, counting its requests and bytes by kind
    (set, get, delete, compare_set): ckpt's Comm protocol unchanged, only its transport is here."""

    def __init__(self, store: SharedStore, rank: int, world: int, timeout: float = 300.0):
        super().__init__(timeout)
        self.rank, self.world, self.shared = rank, world, store
        self.requests: Counter[str] = Counter()
        self.bytes: Counter[str] = Counter()

    def describe(self) -> str:
        return f"simulated rank {self.rank} of {self.world}"

    def _put(self, key: str, value: bytes) -> None:
        self.requests["set"] += 1
        self.bytes["set"] += len(value)
        self.shared.put(key, value)

    def _get(self, key: str, deadline: float) -> bytes | None:
        self.requests["get"] += 1
        out = self.shared.get(key, deadline)
        self.bytes["get"] += len(out) if out is not None else 0
        return out

    def _delete(self, key: str) -> bool:
        self.requests["delete"] += 1
        self.shared.delete(key)
        return True

    def _compare_set(self, key: str, value: bytes) -> bytes:
        self.requests["compare_set"] += 1
        self.bytes["set"] += len(value)
        return self.shared.compare_set(key, value)

    def _add(self, key: str, amount: int) -> int:
        self.requests["add"] += 1
        return self.shared.add(key, amount)

    def reset(self) -> None:
        self.requests.clear()
        self.bytes.clear()


def comms(world: int) -> list[CountingComm]:
    store = SharedStore()
    return [CountingComm(store, r, world) for r in range(world)]


def on_threads(world: int, fn: Callable[[int], Any]) -> list[Any]:
    """``fn(rank)`` for every rank at once, one thread each (the protocol's waits need them all running)."""
    out: list[Any] = [None] * world
    errors: list[BaseException] = []

    def run(r: int) -> None:
        try:
            out[r] = fn(r)
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            errors.append(e)
            traceback.print_exc()  # at once: the other ranks may wait for this one until their deadline

    old = threading.stack_size(256 * 1024)
    try:
        threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(world)]
    finally:
        threading.stack_size(old)
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return out


def totals(cs: Sequence[CountingComm]) -> dict[str, int]:
    """Requests of every rank together (by kind and in all), and bytes set and got."""
    req: Counter[str] = Counter()
    for c in cs:
        req.update(c.requests)
    return {**{f"requests_{k}": v for k, v in req.items()}, "requests": sum(req.values()),
            "max_requests_one_rank": max(sum(c.requests.values()) for c in cs),
            "bytes_set": sum(c.bytes["set"] for c in cs), "bytes_got": sum(c.bytes["get"] for c in cs)}


class CountingStorage(FaultyStorage):
    """A storage that counts requests (``calls``, by operation) and bytes read and written."""

    def __init__(self, inner: Storage):
        super().__init__(inner)
        self.read_bytes = 0
        self.written_bytes = 0

    def write(self, key: str, buffers: Sequence) -> int:
        n = super().write(key, buffers)
        self.written_bytes += n
        return n

    def commit(self, key: str, data: bytes) -> None:
        super().commit(key, data)
        self.written_bytes += len(data)

    def read(self, key: str, start: int | None = None, end: int | None = None) -> Blob:
        out = super().read(key, start, end)
        self.read_bytes += len(out)
        return out

    def read_object(self, key: str, limit: int) -> Blob:
        out = super().read_object(key, limit)
        self.read_bytes += len(out)
        return out
