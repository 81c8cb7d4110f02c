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
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field

from . import _ext
from . import manifest as mf
from ._tasks import run_all
from .codec import HEADER_SIZE, CodecSpec, check_header, chunk_hash, encode, parse_header
from .errors import CorruptCheckpointError, NonFiniteStateError, StepExistsError
from .handle import SaveMetrics
from .lease import Leases
from .snapshot import HostBuffer, Snapshot
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
    created: list[str] = field(default_factory=list)  # chunks this save wrote where none was stored


@dataclass(frozen=True)
class _Put:
    """What became of one chunk of the buffer."""

    hash: str
    info: mf.ChunkInfo
    how: str  # "known" (in the dedup table), "found" (already stored), "written" or "created" (written, none was there)


class Writer:
    """Writes one rank's part of a save (chunks, then its rank report) and commits step manifests.

    ``io`` is the thread pool the per-chunk work runs on; whoever owns it hands it over. ``leases``
    says whether this job may delete what a failed save alone wrote (no other writer is live)."""

    def __init__(self, storage: Storage, codec: CodecSpec, io: Executor, leases: Leases | None = None):
        self.storage = storage
        self.codec = codec
        self.io = io
        self.leases = leases
        # Chunks known to be durable in storage, with what the manifest needs to say about them.
        self.known: dict[str, mf.ChunkInfo] = {}
        self._loaded: dict[str, mf.ChunkInfo] = {}  # chunks of the step this process loaded (never deleted)
        self._committed: dict[str, mf.ChunkInfo] = {}  # this rank's chunks in its last committed step
        self._inflight: dict[str, Future] = {}  # chunks being written by this save: a twin waits for it
        self._lock = threading.Lock()

    # -- per chunk, on the I/O pool -------------------------------------------------------------
    def _put_chunk(self, job: SaveJob, data: memoryview, h: str | None, address: int,
                   core: _ext.CpuCore | None) -> _Put:
        if h is None and core is not None:  # not hashed during the snapshot (CUDA bytes)
            h = core.xxh3_128(address, len(data))  # releases the GIL; None for tiny chunks
        if h is None:
            h = chunk_hash(data)
        with self._lock:
            info = self.known.get(h)
            twin = self._inflight.get(h) if info is None else None
            mine: Future | None = None
            if info is None and twin is None:
                mine = self._inflight[h] = Future()
        if info is not None:
            return _Put(h, info, "known")
        if twin is not None:  # an identical chunk of this save is being written: written once, then known
            return _Put(h, twin.result().info, "known")
        assert mine is not None
        try:
            put = self._store(job, h, data)
        except BaseException as e:
            mine.set_exception(e)
            raise
        finally:
            with self._lock:
                self._inflight.pop(h, None)
        mine.set_result(put)
        return put

    def _store(self, job: SaveJob, h: str, data: memoryview) -> _Put:
        found, damaged = self._probe(h, len(data))
        if found is not None:
            with self._lock:
                self.known[h] = found
            return _Put(h, found, "found")
        codec, buffers = encode(data, h, self.codec)
        stored = self.storage.write(mf.chunk_key(h), buffers)
        info = mf.ChunkInfo(len(data), stored, f"{codec}/1")
        with self._lock:
            self.known[h] = info
            if not damaged:
                job.created.append(h)  # nothing was stored under this name: this save alone wrote it
        return _Put(h, info, "written" if damaged else "created")

    def _probe(self, h: str, size: int) -> tuple[mf.ChunkInfo | None, bool]:
        """Is chunk ``h`` already stored (by an earlier run)? Read its header to describe it.
        Returns (what is stored or None, whether a damaged copy is there)."""
        key = mf.chunk_key(h)
        try:
            hdr = parse_header(self.storage.read(key, 0, HEADER_SIZE), name=key)
            stored = self.storage.size(key)
            check_header(hdr, name=key, expect_hash=h, expect_len=size, object_len=stored)
        except FileNotFoundError:
            return None, False
        except CorruptCheckpointError:
            return None, True  # a damaged copy: write a good one over it
        return mf.ChunkInfo(size, stored, f"{hdr.codec}/1"), False

    def _restore_missing(self, job: SaveJob, puts: list[_Put], buf: HostBuffer) -> None:
        """Chunks taken from the dedup table must still be stored: another process may have deleted
        them before this job held its lease (or one that keeps no lease: a bucket lifecycle rule, an
        operator), or a local tier may hold a copy its remote lost. Write back any that are gone,
        from the buffer, while it is still held."""
        known = [(i, p) for i, p in enumerate(puts) if p.how == "known"]
        gone = [ip for ip, ok in zip(known, run_all(self.io, lambda ip: self.storage.exists(mf.chunk_key(ip[1].hash)),
                                                    known)) if not ok]
        if not gone:
            return
        log.warning("ckpt: %d chunk(s) this save reuses had been deleted by another process; writing them again",
                    len(gone))
        layout = buf.layout
        seen: set[str] = set()
        for i, p in gone:
            if p.hash in seen:
                continue
            seen.add(p.hash)
            c = layout.chunks[i]
            with self._lock:
                self.known.pop(p.hash, None)
            puts[i] = self._store(job, p.hash, buf.view(c.offset, c.length))

    def _check_not_committed(self, step: int) -> None:
        if self.storage.exists(mf.manifest_key(step)):
            raise StepExistsError(
                f"step {step} is already committed in {self.storage.describe()}; committed steps are never "
                "overwritten. Save under a new step number (or delete the old one with retention/`ckpt gc`).")

    # -- one rank's part of a save, on the commit thread -----------------------------------------
    def write_part(self, job: SaveJob, rank: int) -> mf.Manifest:
        """Write this rank's chunks durably, then its rank report; return the report.

        Nothing is written for a step that is already committed (:class:`StepExistsError`). The
        chunks taken from the dedup table are checked to still be stored, and written again from the
        buffer if not; then the host buffer is released. On failure, the chunks this save alone
        created are deleted again where that is safe."""
        snap = job.snapshot
        buf = snap.buffer
        layout = buf.layout
        try:
            try:
                self._check_not_committed(job.step)
                if snap.cuda is not None:
                    snap.cuda.synchronize()
                _refuse_poison(job.step, rank, snap.poisoned())
                snap_hashes = snap.hashes or [None] * len(layout.chunks)
                job.created = []
                puts = run_all(self.io, lambda ch: self._put_chunk(job, buf.view(ch[0].offset, ch[0].length), ch[1],
                                                                   buf.address(ch[0].offset), buf.cpu_core),
                               list(zip(layout.chunks, snap_hashes)))
                self._restore_missing(job, puts, buf)
            finally:
                buf.release()
            self.storage.flush()
            if job.on_local is not None:
                job.on_local()
            part = self._report(job, rank, puts)
            self._check_not_committed(job.step)  # a committed step's rank reports never change
            self.storage.write(mf.rank_key(job.step, rank), [part.to_json()])
            return part
        except BaseException:
            self.discard(job)
            raise

    def _report(self, job: SaveJob, rank: int, puts: list[_Put]) -> mf.Manifest:
        m, snap = job.metrics, job.snapshot
        layout = snap.buffer.layout
        hashes = [p.hash for p in puts]
        chunk_table = {p.hash: p.info for p in puts}
        new = {p.hash: p.info for p in puts if p.how in ("written", "created")}
        m.chunks = len(chunk_table)
        m.chunks_written = len(new)
        m.chunks_reused = m.chunks - m.chunks_written
        m.written_bytes = sum(info.stored for info in new.values())
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
        return mf.Manifest(step=job.step, kind="rank", rank=rank, structure=job.structure, tensors=tensors,
                           chunks=chunk_table, stats=stats)

    def discard(self, job: SaveJob) -> None:
        """A save failed: delete the chunks it alone created (nothing stored had them before it, and
        no other writer is live to have written them meanwhile), so a full disk is freed at once.
        Where another writer is live they stay, for ``ckpt gc``."""
        created, job.created = job.created, []
        if not created:
            return
        with self._lock:
            for h in created:
                self.known.pop(h, None)
        try:
            if self.leases is None or not self.leases.exclusive():
                log.info("ckpt: step %d failed; its %d new chunk(s) are left for `ckpt gc` (another writer is live)",
                         job.step, len(created))
                return
            run_all(self.io, self.storage.delete, [mf.chunk_key(h) for h in created])
            self.storage.flush()
            log.info("ckpt: step %d failed; removed the %d chunk(s) it had written", job.step, len(created))
        except Exception as e:  # the save's own error matters more; gc removes them later
            log.warning("ckpt: removing the chunks of failed step %d failed: %s", job.step, e)

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
    def in_use(self) -> set[str]:
        """The chunks this writer may reuse without asking storage: never to be deleted under it."""
        with self._lock:
            return set(self.known)

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


def _refuse_poison(step: int, rank: int, bad: list[str]) -> None:
    """Refuse the save, before anything of it is written, if a checked tensor holds NaN or Inf."""
    if not bad:
        return
    names = ", ".join(bad[:5]) + (f" and {len(bad) - 5} more" if len(bad) > 5 else "")
    raise NonFiniteStateError(
        f"step {step} was not saved: rank {rank}'s state holds NaN or Inf in {names}. Nothing was committed; the "
        "newest committed step is the last healthy one: resume from it (load('latest', state)) and find what "
        "diverged (learning rate, loss scale, bad data, a faulty GPU). check_finite=False saves such a state anyway.",
        tensors=bad, ranks=[rank])
