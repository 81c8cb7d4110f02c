"""The storage surface every backend provides.

Keys are '/'-separated paths relative to the checkpoint root. Every method translates backend
errors once: a missing object is a plain ``FileNotFoundError`` (callers know whether that means
"no such step" or "a chunk is missing"), anything else becomes :class:`~ckpt.errors.StorageError`
with the backend's error kept as ``__cause__``.
"""

from __future__ import annotations

import abc
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

RootState = Literal["missing", "file", "empty", "nonempty"]
Blob = bytes | bytearray  # what reads return: a local read fills a bytearray and hands it over, no copy


@dataclass
class TierCounters:
    """Where a tiered storage served chunk reads from (since the last reset), and what it uploaded."""

    local_hits: int = 0  # chunks read from the local tier after their hash matched
    remote_reads: int = 0  # chunks read from the remote tier
    local_rejected: list[str] = field(default_factory=list)  # local copies that failed their check
    uploaded: int = 0


class Storage(abc.ABC):
    """Abstract storage rooted at ``url``."""

    url: str

    @abc.abstractmethod
    def write(self, key: str, buffers: Sequence) -> int:
        """Write the concatenation of ``buffers`` to ``key`` durably; the object appears whole or not
        at all, replacing whatever was there. Returns the number of bytes written. New chunk objects
        go through :meth:`create`; this replaces one only with a whole (not delta) copy of the same
        chunk, which every manifest naming it can read."""

    def create(self, key: str, buffers: Sequence) -> int:
        """Write ``key`` like :meth:`write`, but only if nothing is stored under it: raises
        ``FileExistsError`` if something is, and leaves that object as it is. Chunk objects are
        written this way, so a chunk's key always names the bytes the first writer stored, whatever
        another writer (another job in the same root) encoded at the same moment.

        This default checks, then writes: a backend that can create atomically overrides it; here
        two writers between the check and the write both write, the last one's object staying."""
        if self.exists(key):
            raise FileExistsError(f"{self.describe()}/{key}")
        return self.write(key, buffers)

    def finish_creates(self, keys: Collection[str]) -> set[str]:
        """Wait until the creates of ``keys`` (earlier :meth:`create` calls that returned) are done
        everywhere this storage writes them, and return those that found another writer's object
        already there: that object stands (in every tier), so the caller describes it instead of
        its own. A storage whose creates finish inside :meth:`create` has nothing to wait for; a
        tiered one uploads in the background. Raises what a background write raised."""
        return set()

    @abc.abstractmethod
    def commit(self, key: str, data: bytes) -> None:
        """Create ``key`` atomically and durably, only if it does not exist yet.

        Raises ``FileExistsError`` if it does. This is the commit point of a step."""

    @abc.abstractmethod
    def read(self, key: str, start: int | None = None, end: int | None = None) -> Blob:
        """Bytes ``[start, end)`` of ``key`` (the whole object by default)."""

    @abc.abstractmethod
    def exists(self, key: str) -> bool: ...

    def head(self, key: str, n: int) -> Blob:
        """The first ``n`` bytes of ``key`` as a save sees it: what the writer reads to decide that a
        chunk is stored already (FileNotFoundError if it is not, for that save)."""
        return self.read(key, 0, n)

    @abc.abstractmethod
    def list(self, prefix: str) -> list[str]:
        """Names directly under the directory ``prefix`` (no listing cache); empty if it is absent."""

    @abc.abstractmethod
    def delete(self, key: str) -> None:
        """Delete ``key``; a missing key is not an error."""

    # Keys one bulk delete request may name (S3's DeleteObjects takes at most 1,000).
    delete_batch = 1000

    def delete_many(self, keys: Sequence[str]) -> None:
        """Delete every key of ``keys``, in order, missing ones not being an error: in bulk requests
        of at most :attr:`delete_batch` keys where the backend has them (S3's multi-object delete),
        one request a key otherwise. Raises at the first failure; a caller that needs one group of
        keys gone before another (retention: manifests, then rank files, then chunks) makes one call
        per group."""
        for key in keys:
            self.delete(key)

    @abc.abstractmethod
    def root_state(self) -> RootState:
        """``"missing"``, ``"file"``, ``"empty"`` or ``"nonempty"``: tells a new run from a wrong path.

        Backends without directories say ``"missing"`` for a root that holds no object."""

    @abc.abstractmethod
    def remove_root(self) -> None:
        """Delete every object under the root, and the root itself (a whole checkpoint dropped at
        once). Callers delete the step manifests first, so a removal cut short never leaves a step
        that looks committed but lacks its chunks (see :func:`ckpt.save.retention.remove_checkpoint`)."""

    def size(self, key: str) -> int:
        return len(self.read(key))

    def mtime(self, key: str) -> float | None:
        """When ``key`` was last written (seconds since the epoch), or None where the backend does not
        say. ``ckpt gc`` uses it so it never deletes what a running save may be about to commit."""
        return None

    def readv(self, key: str, buffers: Sequence, offset: int = 0) -> int:
        """Fill ``buffers`` in order from byte ``offset`` of ``key``; returns the bytes filled.

        Backends that can read straight into caller memory override this to skip a copy."""
        data = memoryview(self.read(key, offset, offset + sum(memoryview(b).nbytes for b in buffers)))
        pos = 0
        for buf in buffers:
            view = memoryview(buf).cast("B")
            n = min(len(view), len(data) - pos)
            view[:n] = data[pos : pos + n]
            pos += n
        return pos

    # How many reads of this storage a load runs at once (None: as many as its I/O pool has threads).
    read_width: int | None = None

    hashes_reads = False  # read_hashed hashes as it reads (so many small reads cost no extra pass)

    def read_hashed(self, key: str, buffer, offset: int = 0, head=None) -> tuple[int, str | None]:
        """:meth:`readv` into one buffer, and the xxh3-128 of the bytes read where the backend hashed
        them as they arrived (None: the caller hashes them). A backend that can fuse the two
        overrides this: hashing each piece while it is still in cache saves a pass over memory.
        ``head``: a buffer the ``len(head)`` bytes before ``offset`` are read into, in the same
        request (a chunk's header with its payload: one GET, not two); not hashed, and not counted in
        the bytes returned, which are negative where the object ends inside the head."""
        if head is None:
            return self.readv(key, [buffer], offset), None
        k = memoryview(head).nbytes
        return self.readv(key, [head, buffer], offset - k) - k, None

    def read_parts(self, key: str, parts: Sequence[tuple[int, Any]]) -> Sequence[int]:
        """Fill each ``(offset, buffer)`` of ``parts`` from ``key``; the bytes filled, per part. For a
        reader that checks each part itself (a chunk's span digests): a storage that checks a copy
        before serving it (a local tier) cannot check a copy whole from parts of it, and serves parts
        unchecked; a reader finding a part wrong reads the object whole, which it does check."""
        return [self.readv(key, [buf], offset) for offset, buf in parts]

    def read_object_into(self, key: str, limit: int) -> memoryview | None:
        """:meth:`read_object` into memory this thread reuses (a view valid until the thread's next
        read of this kind), or None where the backend has no such read: a fresh buffer per object
        costs a page fault every 4 KiB, more than reading it from the page cache."""
        return None

    def read_object(self, key: str, limit: int) -> Blob:
        """The whole object, read only up to ``limit + 1`` bytes: a result longer than ``limit``
        means the object is larger than its describer said (memory stays bounded by ``limit``).
        A storage with a local tier checks its local copy before serving it."""
        return self.read(key, 0, limit + 1)

    def flush(self) -> None:
        """Make directory entries created by :meth:`write` durable (a no-op where that is implied)."""

    def describe(self) -> str:
        return self.url

    def close(self) -> None:
        """Release threads and connections; waits for background uploads where there are any."""
