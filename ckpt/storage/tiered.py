"""A fast local tier (NVMe) staged in front of a durable remote tier (object storage).

Writes land in the local tier first (temp file written around the page cache, fsync, rename) and
return; an upload pool with bounded parallelism copies each object to the remote tier behind them,
from a copy held in memory while less than ``HOLD_BYTES`` wait (else read back from the local tier).
The remote tier is the truth: a step exists when its MANIFEST.json exists there.

* ``flush()`` makes the local tier durable (a stage the SaveHandle reports); it does not wait for
  uploads.
* Writing a step file (a rank report) or committing a manifest first waits for every pending upload,
  so "my report exists" means "my chunks are durable remotely", and the commit PUT comes after every
  chunk it names.
* ``exists(chunk)`` answers for the durable tier; a chunk only staged locally (its earlier upload
  failed) is uploaded then, so dedup never commits a manifest naming a chunk the remote lacks.
* A new chunk (``create``) is created in the remote (create-only) by its upload. Where another
  writer's copy got there first (another job saving into the same root), that copy stands and
  replaces the staged one in the local tier, and ``finish_creates`` (which waits for the uploads)
  names the key: the writer then describes that copy, never its own. The tiers hold the same bytes
  under a chunk's key.
* Reading a chunk tries the local copy and checks it with the ``verify`` function it was given (the
  chunk format is the codec's business, not the storage's); a copy that fails is ignored, reported
  (``tier_counters().local_rejected``, a warning) and read from the remote instead.
* Deletes go to both tiers (local first), so retention and GC apply to both.

With ``local_commits`` (``redundancy`` or ``persist_every``: the local tier is a committed checkpoint
of its own), each save runs over its own :class:`SaveView` (``view(persist)``, carried by the save's
job; nothing on this shared object changes): ``persist`` says whether it is uploaded. Local-only,
writes, ``exists``, ``head`` and ``commit`` concern the local tier alone; uploaded, a chunk counts as
stored (``exists``, ``head``) only when both tiers have it: one only the local tier has is uploaded
then (the heal path of failed uploads), one only the remote has is copied into the local tier. So
every step a tier commits names chunks that tier holds, and an uploaded one chunks the remote holds.
Outside a save both tiers are read (the local first for chunks); a step file the remote lacks is read
from the local tier (a step committed only there).

``memory`` (:class:`ckpt.storage.held.HeldChunks`) is read before both tiers: the chunks a load from
the local tiers got from peers (or rebuilt from parity), and those still coming, while the local
tier is healed behind it; it also keeps what such a load read from the remote for the heal.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Collection, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from ..errors import CheckpointError, StorageError
from ..format.paths import is_chunk_key
from .base import Blob, RootState, Storage, TierCounters
from .held import HeldChunks
from .local import LocalStorage
from .save_view import SaveView

log = logging.getLogger("ckpt")


_MISS = object()  # a local copy that was there but failed its check


class _NotUploaded(StorageError):
    """An upload given up because an earlier one of the same save failed."""

# A chunk object's check: (storage key, its bytes in order as read); raises CheckpointError.
Verify = Callable[[str, list[memoryview]], None]


class TieredStorage(Storage):
    HOLD_BYTES = 256 << 20  # staged chunks held in memory for their uploads: two 16 MiB chunks per thread of 8

    def __init__(self, local: LocalStorage, remote: Storage, *, verify: Verify, upload_threads: int = 8,
                 local_commits: bool = False):
        self.local = local
        local.direct_io = hasattr(os, "O_DIRECT")  # a staged chunk is read once at most: no page cache
        self.local_commits = local_commits
        self.remote = remote
        self.url = remote.url
        self._verify = verify
        self._uploads = ThreadPoolExecutor(upload_threads, thread_name_prefix="ckpt-upload")
        self._pending: list[Future] = []
        self._bad: set[str] = set()  # keys whose local copy failed its check: served by the remote
        self._lock = threading.Lock()
        self._counters = TierCounters()
        self._failed: str | None = None  # the first upload failure since the last drain
        self.memory = HeldChunks()  # chunks in memory, read before either tier (a load from the local tiers)
        self._lost: set[str] = set()  # chunks created where another writer's object stood (see finish_creates)
        self._held_bytes = 0  # staged chunks held in memory until uploaded (see _stage)

    def view(self, persist: bool) -> Storage:
        """One save's storage (local commits): ``persist`` is whether it is uploaded."""
        return SaveView(self, persist) if self.local_commits else self

    def describe(self) -> str:
        return f"{self.remote.describe()} (staged in {self.local.root})"

    def durable_tier(self) -> Storage:
        """The tier that is the truth (the remote): small control objects (leases) go straight there."""
        return self.remote

    def tier_counters(self) -> TierCounters:
        """Where chunk reads came from since :meth:`reset_tier_counters`."""
        with self._lock:
            c = self._counters
            return TierCounters(c.local_hits, c.remote_reads, list(c.local_rejected), c.uploaded)

    def reset_tier_counters(self) -> None:
        """Start counting :meth:`tier_counters` afresh."""
        with self._lock:
            self._counters = TierCounters()

    # -- writing --------------------------------------------------------------------------------
    def _upload(self, key: str, create: bool = False, blob: bytes | None = None) -> None:
        failed = self._failed
        if failed is not None:  # an upload already failed: the rest would only wait out their own retries
            raise _NotUploaded(f"not uploading {key}: an earlier upload to {self.remote.describe()} failed "
                               f"({failed})")
        try:
            data = blob if blob is not None else self.local.read(key)
            if create:
                try:
                    self.remote.create(key, [data])
                except FileExistsError:
                    if self._take_remote(key):
                        with self._lock:
                            self._lost.add(key)
                        return
                    self.remote.write(key, [data])  # what stood there is damaged: no manifest can use it
            else:
                self.remote.write(key, [data])
        except BaseException as e:
            self._failed = self._failed or f"{type(e).__name__}: {e}"
            raise
        with self._lock:
            self._counters.uploaded += 1

    def _stage(self, key: str, buffers: Sequence, create: bool) -> int:
        """Write chunk ``key`` to the local tier and queue its upload. While less than ``HOLD_BYTES``
        wait for their uploads, the upload is given a copy in memory (made once; the local copy is
        written from it) rather than reading the local copy back from the disk."""
        views = [memoryview(b).cast("B") for b in buffers]
        size = sum(len(v) for v in views)
        with self._lock:
            held = size if self._held_bytes + size <= self.HOLD_BYTES else 0
            self._held_bytes += held
        blob = b"".join(views) if held else None
        try:
            n = self.local.write(key, [blob] if blob is not None else views)
            upload = self._uploads.submit(self._upload, key, create, blob)
        except BaseException:
            self._unhold(held)
            raise
        upload.add_done_callback(lambda _: self._unhold(held))
        with self._lock:
            self._pending.append(upload)
        return n

    def _unhold(self, size: int) -> None:
        with self._lock:
            self._held_bytes -= size

    def _take_remote(self, key: str) -> bool:
        """Another writer's copy of chunk ``key`` is in the remote, and it stands: put the same bytes
        in the local tier, so both tiers hold what one manifest entry describes. False (the local
        tier unchanged) if the remote copy is gone again or fails its check."""
        try:
            blob = self.remote.read(key)
        except FileNotFoundError:
            return False
        try:
            self._verify(key, [memoryview(blob)])
        except CheckpointError as e:
            log.warning("the copy of %s in %s is damaged (%s); writing this one over it", key,
                        self.remote.describe(), e)
            return False
        self.local.write(key, [blob])
        return True

    def write(self, key: str, buffers: Sequence) -> int:
        if not is_chunk_key(key):
            # A step file: every chunk before it must be durable remotely first.
            self.drain()
            n = self.local.write(key, buffers)
            self.local.flush()
            self.remote.write(key, [self.local.read(key)])
            return n
        return self._stage(key, buffers, create=False)

    def create(self, key: str, buffers: Sequence) -> int:
        """A chunk is staged (the local tier holds what the remote does, or nothing good) and created
        in the remote behind it; where another writer's copy is there first, that copy is put in the
        local tier too, and :meth:`finish_creates` names the key."""
        if not is_chunk_key(key):
            return super().create(key, buffers)
        return self._stage(key, buffers, create=True)

    def finish_creates(self, keys: Collection[str]) -> set[str]:
        self.drain()
        with self._lock:
            lost = self._lost.intersection(keys)
            self._lost -= lost
        return lost

    def flush(self) -> None:
        """The local tier is durable (directory entries fsynced); uploads may still be running."""
        self.local.flush()
        self.remote.flush()

    def drain(self) -> None:
        """Wait for every pending upload; raise the first failure (after all have finished)."""
        with self._lock:
            pending, self._pending = self._pending, []
        errors = []
        for f in pending:
            try:
                f.result()
            except BaseException as e:  # re-raised below
                errors.append(e)
        self._failed = None  # the next save tries the remote afresh
        if errors:
            first = next((e for e in errors if not isinstance(e, _NotUploaded)), errors[0])
            if isinstance(first, CheckpointError):
                raise first
            raise StorageError(f"uploading to {self.remote.describe()} failed: {first}") from first

    def commit(self, key: str, data: bytes) -> None:
        self.drain()
        self.local.flush()
        self.remote.commit(key, data)  # the commit point: the durable tier
        try:
            self.local.commit(key, data)
        except FileExistsError:
            pass  # a stale local copy from a deleted step of the same number; the remote is the truth
        except CheckpointError as e:  # the step is committed; the local tier only loses a copy
            log.warning("committed %s remotely but not in the local tier: %s", key, e)

    # -- reading --------------------------------------------------------------------------------
    def _local_ok(self, key: str, blob: Blob) -> bool:
        try:
            self._verify(key, [memoryview(blob)])
            return True
        except CheckpointError as e:
            self._reject(key, e)
            return False

    def _reject(self, key: str, why: object) -> None:
        with self._lock:
            self._counters.local_rejected.append(key)
            self._bad.add(key)
        log.warning("local copy of %s is damaged (%s); reading it from %s instead", key, why,
                    self.remote.describe())

    def _local_first(self, key: str, local, remote, *, count: bool = True):
        """``local()`` for a chunk, unless it is missing or damaged (it returns _MISS after rejecting
        the copy): then ``remote()``. Every other key goes to the remote (with local commits: then to
        the local tier, if the remote lacks it). ``count``: a read of the chunk's contents (not of its
        header alone), for the tier counters."""
        if not is_chunk_key(key):
            try:
                return remote()
            except FileNotFoundError:
                if not self.local_commits:
                    raise
                return local()
        try:
            got = local()
            if got is not _MISS:
                return got
        except FileNotFoundError:
            pass
        except CheckpointError as e:
            self._reject(key, e)
        if count:
            with self._lock:
                self._counters.remote_reads += 1
        return remote()

    def _hit(self, value):
        with self._lock:
            self._counters.local_hits += 1
        return value

    def read(self, key: str, start: int | None = None, end: int | None = None) -> Blob:
        mem = self.memory.get(key)
        if mem is not None:
            return self._hit(bytes(mem[start:end])) if start is None and end is None else bytes(mem[start:end])

        def local() -> object:
            if start is not None or end is not None or not is_chunk_key(key):  # the caller checks a part
                return self.local.read(key, start, end)
            blob = self.local.read(key)
            return self._hit(blob) if self._local_ok(key, blob) else _MISS

        def remote() -> Blob:
            blob = self.remote.read(key, start, end)
            self.memory.read_remotely(key, start or 0, [blob], len(blob))
            return blob

        return self._local_first(key, local, remote, count=start is None and end is None)

    def read_object(self, key: str, limit: int) -> Blob:
        mem = self.memory.get(key)
        if mem is not None:
            return self._hit(bytes(mem[: limit + 1]))

        def local() -> object:
            blob = self.local.read(key, 0, limit + 1)
            if not is_chunk_key(key):
                return blob
            return self._hit(blob) if self._local_ok(key, blob) else _MISS

        def remote() -> Blob:
            blob = self.remote.read_object(key, limit)
            self.memory.read_remotely(key, 0, [blob], len(blob))
            return blob

        return self._local_first(key, local, remote)

    def readv(self, key: str, buffers: Sequence, offset: int = 0) -> int:
        mem = self.memory.get(key)
        if mem is not None:
            pos = offset
            for b in buffers:
                v = memoryview(b).cast("B")
                n = max(0, min(len(v), len(mem) - pos))
                v[:n] = mem[pos: pos + n]
                pos += n
            return self._hit(pos - offset)

        def local() -> object:
            if not is_chunk_key(key):
                return self.local.readv(key, buffers, offset)
            # the bytes before `offset` are read too, into a scratch buffer: the copy is checked whole
            prefix = bytearray(offset)
            n = self.local.readv(key, [prefix, *buffers])
            views, left = [], n
            for b in [prefix, *buffers]:
                v = memoryview(b).cast("B")
                views.append(v[: max(0, left)])
                left -= len(v)
            try:
                self._verify(key, views)
            except CheckpointError as e:
                self._reject(key, e)
                return _MISS
            return self._hit(max(0, n - offset))

        def remote() -> int:
            n = self.remote.readv(key, buffers, offset)
            self.memory.read_remotely(key, offset, buffers, n)
            return n

        return self._local_first(key, local, remote)

    def read_parts(self, key: str, parts: Sequence[tuple[int, Any]]) -> Sequence[int]:
        # readv would check the local copy whole from the parts, and reject every good copy; a copy
        # shorter than a part is a miss (the remote has it whole), one with wrong bytes the reader
        # finds by its span digests (then its whole read, checked here, rejects the copy)
        mem = self.memory.get(key)
        if mem is not None:  # one hit per chunk, as a whole read counts
            got = []
            for offset, buf in parts:
                v = memoryview(buf).cast("B")
                n = max(0, min(len(v), len(mem) - offset))
                v[:n] = mem[offset : offset + n]
                got.append(n)
            return self._hit(got)

        def local() -> object:
            got = [self.local.readv(key, [buf], offset) for offset, buf in parts]
            if any(n < memoryview(buf).nbytes for n, (_, buf) in zip(got, parts)):
                self._reject(key, "it is shorter than the parts read of it")
                return _MISS
            return self._hit(got)

        def remote() -> list[int]:
            got = []
            for offset, buf in parts:
                n = self.remote.readv(key, [buf], offset)
                self.memory.read_remotely(key, offset, [buf], n)
                got.append(n)
            return got

        return self._local_first(key, local, remote)

    def size(self, key: str) -> int:
        mem = self.memory.get(key)
        if mem is not None:
            return len(mem)
        if is_chunk_key(key) and key not in self._bad:
            try:
                return self.local.size(key)
            except FileNotFoundError:
                pass
        return self.remote.size(key)

    def mtime(self, key: str) -> float | None:
        return self.remote.mtime(key)

    def head(self, key: str, n: int) -> Blob:
        if self.local_commits and is_chunk_key(key):
            if not self.exists(key):  # in a save's sense: see the module's docstring
                raise FileNotFoundError(key)
            return self.local.read(key, 0, n)
        return self.read(key, 0, n)

    def exists(self, key: str) -> bool:
        return self.stored(key)

    def stored(self, key: str) -> bool:
        """Whether ``key`` is stored, for an uploaded save. With local commits a chunk counts only when
        both tiers hold it: one only the remote has is copied into the local tier first (the same
        bytes: a copy encoded anew could be another delta than the one the remote's manifests name)."""
        if self.remote.exists(key):
            if self.local_commits and is_chunk_key(key) and not self.local.exists(key):
                return self._take_remote(key)  # the local tier is a checkpoint too, and lacks it
            return True
        if is_chunk_key(key) and self.local.exists(key):
            blob = self.local.read(key)
            if self._local_ok(key, blob):  # staged but never uploaded (an earlier failed save): heal
                try:
                    self.remote.create(key, [blob])
                except FileExistsError:  # another writer's went up meanwhile: it stands, in both tiers
                    return self._take_remote(key)
                return True
        return False

    def list(self, prefix: str) -> list[str]:
        return self.remote.list(prefix)

    def delete(self, key: str) -> None:
        self.local.delete(key)
        self.remote.delete(key)

    def delete_many(self, keys: Sequence[str]) -> None:
        self.local.delete_many(keys)
        self.remote.delete_many(keys)

    def root_state(self) -> RootState:
        return self.remote.root_state()

    def remove_root(self) -> None:
        try:  # an upload still running would bring objects back after the removal
            self.drain()
        except CheckpointError:
            pass  # what failed to upload is being removed anyway
        self.local.remove_root()
        self.remote.remove_root()

    def close(self) -> None:
        self._uploads.shutdown(wait=True)
        self.remote.close()
