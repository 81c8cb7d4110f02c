"""The background half of a save: chunk, hash, dedup, encode, write durably, report, commit.

One long-lived thread (``ckpt-commit``) runs saves one after another, in the order they were
asked for; a long-lived pool of I/O threads (``ckpt-io``) does the per-chunk work. Chunks are
hashed and written straight from the host buffer (the raw codec makes no copy); the buffer is
handed back to the next snapshot as soon as every chunk of it is durable, before the commit.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Callable
from dataclasses import dataclass

from . import manifest as mf
from .codec import HEADER_SIZE, CodecSpec, chunk_hash, encode, parse_header
from .errors import CheckpointError, CorruptCheckpointError, StepExistsError, StorageError
from .plan import Plan
from . import _ext
from .snapshot import CudaSnapshot, HostPool
from .state import dtype_name
from .storage import Storage

log = logging.getLogger("ckpt")


@dataclass
class SaveMetrics:
    """What one save cost. ``stall_s`` is the time the caller was blocked inside ``save()``."""

    step: int
    stall_s: float = 0.0
    raw_bytes: int = 0
    written_bytes: int = 0  # bytes this save put in storage (new chunks, headers included)
    chunks: int = 0
    chunks_written: int = 0
    chunks_reused: int = 0  # chunks already stored (dedup): not written again
    duration_s: float | None = None  # from the save() call until the step was committed
    skipped: bool = False  # busy="skip" dropped this save
    local_s: float | None = None  # from the save() call until every chunk was durable in the first tier


@dataclass
class SaveJob:
    step: int
    plan: Plan
    pool: HostPool
    structure: dict
    metrics: SaveMetrics
    started: float
    leaves: dict  # key -> state.Leaf, for the tensors this rank writes
    per_rank: frozenset = frozenset()  # top-level keys saved per rank
    rank: int = 0
    seq: int = 0
    cuda_event: "CudaSnapshot | None" = None  # the device-to-host copy the buffer waits for
    hashes: "list[str | None] | None" = None  # per chunk, when the snapshot hashed it (compiled core)
    on_local: "Callable[[], None] | None" = None  # every chunk durable in the first tier (SaveHandle stage)


class Writer:
    def __init__(self, storage: Storage, codec: CodecSpec, io_threads: int):
        self.storage = storage
        self.codec = codec
        self.io = ThreadPoolExecutor(io_threads, thread_name_prefix="ckpt-io")
        self.commit_thread = ThreadPoolExecutor(1, thread_name_prefix="ckpt-commit")
        # Chunks known to be durable in storage, with what the manifest needs to say about them.
        self.known: dict[str, mf.ChunkInfo] = {}
        self._lock = threading.Lock()

    # -- per chunk, on the I/O pool -------------------------------------------------------------
    def _put_chunk(self, data: memoryview, h: str | None = None, address: int | None = None,
                   core: "_ext.CpuCore | None" = None) -> tuple[str, mf.ChunkInfo, bool]:
        if h is None:  # not hashed during the snapshot (CUDA bytes, or no compiled core)
            h = core.xxh3_128(address, len(data)) if core is not None else None  # releases the GIL
            if h is None:
                h = chunk_hash(data)
        with self._lock:
            info = self.known.get(h)
        if info is None:
            info = self._probe(h, len(data))
        if info is not None:
            return h, info, False
        codec, buffers = encode(data, h, self.codec)
        stored = self.storage.write(mf.chunk_key(h), buffers)
        info = mf.ChunkInfo(len(data), stored, f"{codec}/1")
        with self._lock:
            self.known[h] = info
        return h, info, True

    def _probe(self, h: str, size: int) -> mf.ChunkInfo | None:
        """Is chunk ``h`` already stored (by an earlier run)? Read its header to describe it."""
        key = mf.chunk_key(h)
        try:
            head = self.storage.read(key, 0, HEADER_SIZE)
            hdr = parse_header(head, name=key)
            stored = self.storage.size(key)
        except FileNotFoundError:
            return None
        except CorruptCheckpointError:
            return None  # a damaged copy: write a good one over it
        if hdr.digest != h or hdr.raw_len != size or stored != HEADER_SIZE + hdr.payload_len:
            return None
        return mf.ChunkInfo(size, stored, f"{hdr.codec}/1")

    # -- one rank's part of a save, on the commit thread -----------------------------------------
    def write_part(self, job: SaveJob) -> mf.Manifest:
        """Write this rank's chunks durably, then its rank report; return the report."""
        plan, pool, m = job.plan, job.pool, job.metrics
        try:
            if job.cuda_event is not None:
                job.cuda_event.synchronize()
            hashes = job.hashes or [None] * len(plan.chunks)
            futures = [self.io.submit(self._put_chunk, pool.view(c.offset, c.length), h, pool.address(c.offset),
                                      pool.cpu_core) for c, h in zip(plan.chunks, hashes)]
            results, first_error = [], None
            for f in futures:  # wait for every chunk, even after a failure: they all read the buffer
                try:
                    results.append(f.result())
                except BaseException as e:  # noqa: BLE001 - re-raised below
                    first_error = first_error or e
            if first_error is not None:
                raise first_error
        finally:
            pool.release()
        self.storage.flush()
        if job.on_local is not None:
            job.on_local()

        hashes = [h for h, _, _ in results]
        chunk_table = {h: info for h, info, _ in results}
        written = {h for h, _, new in results if new}
        reused = [h for h in chunk_table if h not in written]
        # A reused chunk may have been deleted since we learnt of it (another job's GC): check.
        missing = [h for h, ok in zip(reused, self.io.map(lambda h: self.storage.exists(mf.chunk_key(h)), reused))
                   if not ok]
        if missing:
            with self._lock:
                for h in missing:
                    self.known.pop(h, None)
            raise StorageError(
                f"step {job.step}: {len(missing)} chunk(s) it reuses vanished from storage before the commit "
                f"(e.g. {missing[0]}); another process is deleting chunks. The step was not committed; save again.")

        m.chunks = len(hashes)
        m.chunks_written = sum(1 for _, _, new in results if new)
        m.chunks_reused = m.chunks - m.chunks_written
        m.written_bytes = sum(info.stored for _, info, new in results if new)
        m.raw_bytes = sum(s.nbytes for s in plan.slots)

        tensors = []
        for slot in plan.slots:
            segs = [mf.Segment(hashes[i], off, ln) for i, off, ln in plan.segments(slot)]
            leaf = job.leaves[slot.key]
            (offs, lens), owner = leaf.box, (job.rank if leaf.kind == "rank" else None)
            tensors.append(mf.TensorEntry(slot.key, dtype_name(slot.dtype), list(leaf.global_shape), [
                mf.Shard(job.rank, list(offs), list(lens), segs)], owner))
        stats = {"raw_bytes": m.raw_bytes, "written_bytes": m.written_bytes, "chunks": m.chunks,
                 "chunks_written": m.chunks_written, "chunks_reused": m.chunks_reused}
        part = mf.Manifest(step=job.step, kind="rank", rank=job.rank, structure=job.structure, tensors=tensors,
                           chunks=chunk_table, stats=stats)
        self.storage.write(mf.rank_key(job.step, job.rank), [part.to_json()])
        return part

    def commit(self, job: SaveJob, parts: list[mf.Manifest]) -> mf.Manifest:
        """Merge every rank's report into the step manifest and commit it (create-only)."""
        step_manifest = mf.merge(job.step, parts, job.per_rank)
        try:
            self.storage.commit(mf.manifest_key(job.step), step_manifest.to_json())
        except FileExistsError:
            raise StepExistsError(
                f"step {job.step} is already committed in {self.storage.describe()}; committed steps are never "
                "overwritten. Save under a new step number (or delete the old one with retention/`ckpt gc`).") from None
        m = job.metrics
        m.duration_s = time.perf_counter() - job.started
        log.info("ckpt: step %d committed in %.2fs: %.1f MiB state, %.1f MiB written (%d new chunks, %d reused) "
                 "by %d rank(s); save() blocked %.3fs", job.step, m.duration_s,
                 step_manifest.stats.get("raw_bytes", 0) / 2**20, step_manifest.stats.get("written_bytes", 0) / 2**20,
                 step_manifest.stats.get("chunks_written", 0), step_manifest.stats.get("chunks_reused", 0),
                 len(parts), m.stall_s)
        return step_manifest

    def reset_known(self, chunks: dict[str, mf.ChunkInfo]) -> None:
        """Trust only ``chunks`` from now on (other ranks' retention may have deleted the rest)."""
        with self._lock:
            self.known = dict(chunks)

    def forget(self, hashes) -> None:
        with self._lock:
            for h in hashes:
                self.known.pop(h, None)

    def learn(self, chunks: dict[str, mf.ChunkInfo]) -> None:
        with self._lock:
            self.known.update(chunks)

    def shutdown(self) -> None:
        self.commit_thread.shutdown(wait=True)
        self.io.shutdown(wait=True)


def describe_failure(step: int, e: BaseException) -> CheckpointError:
    """Background failures reach the caller as CheckpointErrors that keep the original cause."""
    if isinstance(e, CheckpointError):
        return e
    err = StorageError(f"saving step {step} failed: {type(e).__name__}: {e}")
    err.__cause__ = e
    return err
