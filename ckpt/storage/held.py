"""Chunks a load from the local tiers keeps in memory, in front of both tiers of a
:class:`ckpt.storage.tiered.TieredStorage` (see its docstring).

* **held**: a chunk that came from a peer (or was rebuilt from parity), already verified: reads of
  its key are served from memory until :meth:`HeldChunks.release`, while the tier is healed behind
  the load.
* **coming**: a chunk a fetch from peers is still bringing (:meth:`HeldChunks.expect`): a read of
  its key waits until it is held, or until the fetch gives up on it (:meth:`HeldChunks.not_coming`:
  the read then goes to the tiers, or raises the fetch's error). So the loader's reads start at
  once and a peer's chunk is used the moment it arrives, instead of after the whole exchange.
* **captured**: what a load read from the remote tier for chunks this rank's tier lacks
  (:meth:`HeldChunks.capture`), copied as it was read, so the heal writes those bytes back into the
  tier instead of downloading them a second time over a link that may be the bottleneck.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence

from ..errors import CheckpointError, CorruptCheckpointError


class HeldChunks:
    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._held: dict[str, memoryview] = {}
        self._coming: set[str] = set()
        self._refused: dict[str, CheckpointError] = {}  # keys a failed fetch will never bring, and why
        self._capture: set[str] = set()
        self._captured: dict[str, list[tuple[int, bytes]]] = {}

    # -- held and coming ---------------------------------------------------------------------------
    def hold(self, key: str, data: memoryview) -> None:
        """Serve ``key`` from ``data`` (already verified) until :meth:`release`."""
        with self._cond:
            self._held[key] = memoryview(data).cast("B")
            self._coming.discard(key)
            self._cond.notify_all()

    def expect(self, keys: Iterable[str]) -> None:
        """``keys`` are on their way: reads of them wait for :meth:`hold` or :meth:`not_coming`."""
        with self._cond:
            for k in keys:
                self._refused.pop(k, None)
                if k not in self._held:
                    self._coming.add(k)

    def not_coming(self, keys: Iterable[str] | None = None, error: CheckpointError | None = None) -> None:
        """``keys`` (None: every key still coming) will not be brought: their reads go to the tiers,
        or, with ``error``, raise it."""
        with self._cond:
            gone = set(self._coming) if keys is None else self._coming.intersection(keys)
            self._coming -= gone
            if error is not None:
                self._refused.update(dict.fromkeys(gone, error))
            self._cond.notify_all()

    def get(self, key: str) -> memoryview | None:
        """The bytes held for ``key`` (waiting while they are coming), or None."""
        with self._cond:
            while key in self._coming:
                self._cond.wait()
            why = self._refused.get(key)
            if why is not None:
                cls = CorruptCheckpointError if isinstance(why, CorruptCheckpointError) else CheckpointError
                raise cls(f"chunk object {key} was to come from a peer's local tier, and did not: {why}")
            return self._held.get(key)

    def release(self, keys: Iterable[str]) -> None:
        with self._cond:
            for k in keys:
                self._held.pop(k, None)
                self._refused.pop(k, None)
                self._capture.discard(k)
                self._captured.pop(k, None)

    # -- captured ----------------------------------------------------------------------------------
    def capture(self, keys: Iterable[str]) -> None:
        """Keep a copy of what is read of ``keys`` from the remote tier, until :meth:`release`."""
        with self._cond:
            self._capture.update(keys)

    def read_remotely(self, key: str, offset: int, buffers: Sequence, n: int) -> None:
        """``n`` bytes of ``key`` from ``offset`` were just read from the remote tier into ``buffers``."""
        if key not in self._capture:  # a set lookup without the lock: most keys are not captured
            return
        views, left = [], n
        for b in buffers:
            v = memoryview(b).cast("B")
            views.append(v[: max(0, left)])
            left -= len(v)
        data = b"".join(views)
        with self._cond:
            if key in self._capture:
                self._captured.setdefault(key, []).append((offset, data))

    def captured(self, key: str) -> bytes | None:
        """The whole object as the load read it from the remote tier (unverified), if its reads
        covered it from its first byte without a gap; else None."""
        with self._cond:
            pieces = sorted(self._captured.get(key, []), key=lambda p: p[0])
        out, end = [], 0
        for off, data in pieces:
            if off > end:
                return None
            if off + len(data) > end:
                out.append(memoryview(data)[end - off:])
                end = off + len(data)
        return b"".join(out) if out else None
