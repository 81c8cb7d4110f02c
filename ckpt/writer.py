"""Writing one rank's part of a save: hash, dedup, encode and durably write every chunk of the host
buffer, then the rank report; and committing a step manifest merged from every rank's report.

The per-chunk work runs on the I/O pool it is handed. Chunks are hashed (unless the snapshot already
did) and written straight from the host buffer (the raw codec makes no copy); the buffer is handed
back to the next snapshot as soon as every chunk of it is durable, before the commit. When to write
and when to commit is the commit protocol's business (:mod:`ckpt.commit`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass

from . import _ext
from . import manifest as mf
from .codec import HEADER_SIZE, CodecSpec, check_header, chunk_hash, encode, parse_header
from .errors import CorruptCheckpointError, StepExistsError, StorageError
from .handle import SaveMetrics
from .snapshot import Snapshot
from .storage import Storage
from .structure import dtype_name

log = logging.getLogger("ckpt")


@dataclass
class SaveJob:
    """One save on its way from the snapshot to the commit."""

    step: int
    seq: int  # the save() call's number: the same on every rank
    snapshot: Snapshot
    structure: dict
    metrics: SaveMetrics
    started: float  # time.perf_counter() of the save() call
    on_local: Callable[[], None] | None = None  # every chunk durable in the first tier (SaveHandle stage)


class Writer:
    """Writes one rank's part of a save (chunks, then its rank report) and commits step manifests.

    ``io`` is the thread pool the per-chunk work runs on; whoever owns it hands it over."""

    def __init__(self, storage: Storage, codec: CodecSpec, io: Executor):
        self.storage = storage
        self.codec = codec
        self.io = io
        # Chunks known to be durable in storage, with what the manifest needs to say about them.
        self.known: dict[str, mf.ChunkInfo] = {}
        self._loaded: dict[str, mf.ChunkInfo] = {}  # chunks of the step this process loaded (never deleted)
        self._committed: dict[str, mf.ChunkInfo] = {}  # this rank's chunks in its last committed step
        self._lock = threading.Lock()

    # -- per chunk, on the I/O pool -------------------------------------------------------------
    def _put_chunk(self, data: memoryview, h: str | None, address: int,
                   core: _ext.CpuCore | None) -> tuple[str, mf.ChunkInfo, bool]:
        if h is None and core is not None:  # not hashed during the snapshot (CUDA bytes)
            h = core.xxh3_128(address, len(data))  # releases the GIL; None for tiny chunks
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
            hdr = parse_header(self.storage.read(key, 0, HEADER_SIZE), name=key)
            stored = self.storage.size(key)
            check_header(hdr, name=key, expect_hash=h, expect_len=size, object_len=stored)
        except FileNotFoundError:
            return None
        except CorruptCheckpointError:
            return None  # a damaged copy: write a good one over it
        return mf.ChunkInfo(size, stored, f"{hdr.codec}/1")

    # -- one rank's part of a save, on the commit thread -----------------------------------------
    def write_part(self, job: SaveJob, rank: int) -> mf.Manifest:
        """Write this rank's chunks durably, then its rank report; return the report. The host
        buffer is released as soon as every chunk is durable."""
        snap, m = job.snapshot, job.metrics
        buf = snap.buffer
        layout = buf.layout
        try:
            if snap.cuda is not None:
                snap.cuda.synchronize()
            snap_hashes = snap.hashes or [None] * len(layout.chunks)
            futures = [self.io.submit(self._put_chunk, buf.view(c.offset, c.length), h, buf.address(c.offset),
                                      buf.cpu_core) for c, h in zip(layout.chunks, snap_hashes)]
            results: list[tuple[str, mf.ChunkInfo, bool]] = []
            first_error: BaseException | None = None
            for f in futures:  # wait for every chunk, even after a failure: they all read the buffer
                try:
                    results.append(f.result())
                except BaseException as e:  # re-raised below
                    first_error = first_error or e
            if first_error is not None:
                raise first_error
        finally:
            buf.release()
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
        m.raw_bytes = sum(s.nbytes for s in layout.slots)

        tensors = []
        for slot in layout.slots:
            segs = [mf.Segment(hashes[i], off, ln) for i, off, ln in layout.segments(slot)]
            leaf = snap.leaves[slot.key]
            (offs, lens), owner = leaf.box, (rank if leaf.kind == "rank" else None)
            tensors.append(mf.TensorEntry(slot.key, dtype_name(slot.dtype), list(leaf.global_shape), [
                mf.Shard(rank, list(offs), list(lens), segs)], owner))
        stats = {"raw_bytes": m.raw_bytes, "written_bytes": m.written_bytes, "chunks": m.chunks,
                 "chunks_written": m.chunks_written, "chunks_reused": m.chunks_reused}
        part = mf.Manifest(step=job.step, kind="rank", rank=rank, structure=job.structure, tensors=tensors,
                           chunks=chunk_table, stats=stats)
        self.storage.write(mf.rank_key(job.step, rank), [part.to_json()])
        return part

    def commit(self, step: int, parts: list[mf.Manifest], per_rank: frozenset[str]) -> mf.Manifest:
        """Merge every rank's report into the step manifest and commit it (create-only)."""
        step_manifest = mf.merge(step, parts, per_rank)
        try:
            self.storage.commit(mf.manifest_key(step), step_manifest.to_json())
        except FileExistsError:
            raise StepExistsError(
                f"step {step} is already committed in {self.storage.describe()}; committed steps are never "
                "overwritten. Save under a new step number (or delete the old one with retention/`ckpt gc`).") from None
        return step_manifest

    # -- what the writer trusts to be stored --------------------------------------------------------
    def learn(self, chunks: dict[str, mf.ChunkInfo]) -> None:
        """The chunks of a step this process loaded: stored, and kept (retention protects that step)."""
        with self._lock:
            self._loaded = dict(chunks)
            self.known.update(chunks)

    def settle(self, committed: mf.Manifest | None) -> None:
        """After a save's decision: trust only the chunks of the loaded step and of this rank's last
        committed part (``committed``, when this save committed). Retention, on this rank or the
        coordinator, may delete anything else before the next save."""
        with self._lock:
            if committed is not None:
                self._committed = dict(committed.chunks)
            self.known = {**self._loaded, **self._committed}
