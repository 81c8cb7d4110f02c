"""Writing one rank's part of a save: hash, dedup, encode and durably write every chunk of the host
buffer, then the rank report. Committing a step is :mod:`ckpt.save.committer`'s.

The per-chunk work runs on the I/O pool it is handed. Chunks are hashed (unless the snapshot already
did) and written straight from the host buffer (the raw codec makes no copy); the buffer is handed
back to the next snapshot as soon as every chunk of it is durable, before the commit. When to write
and when to commit is the commit protocol's business (:mod:`ckpt.save.commit`).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from concurrent.futures import Executor, Future
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

from .. import _cpus
from .._tasks import run_all
from ..errors import CheckpointError, CorruptCheckpointError, StepExistsError
from ..flatten import tensor_of
from ..format import manifest as mf
from ..format import paths, spans
from ..format.chunk import Base, chunk_hash, parse_header
from ..lease import Leases
from ..storage import Storage
from ..tree import dtype_name
from . import adopt
from .buffer_layout import ChunkSlot
from .encode import Choice, CodecSpec, encode_chunk
from .job import SaveJob
from .snapshot import HostBuffer, Snapshot
from .state_checks import refuse_poison

log = logging.getLogger("ckpt")


@dataclass(frozen=True)
class _Put:
    """What became of one chunk of the buffer."""

    hash: str
    info: mf.ChunkInfo
    how: str  # "known" (in the dedup table), "found" (already stored), "written" or "created" (written, none was there)
    encode_cpu_s: float = 0.0  # CPU time of this thread in encode() (written, created)
    choice: Choice | None = None  # auto's trials, for the chunk at this place in the next save (written, created)


class Writer:
    """Writes one rank's part of a save (chunks, then its rank report) and commits step manifests.

    ``io`` is the thread pool the per-chunk work runs on; whoever owns it hands it over. ``leases``
    says whether this job may delete what a failed save alone wrote (no other writer is live)."""

    def __init__(self, storage: Storage, codec: CodecSpec, io: Executor, leases: Leases | None = None,
                 delta_chain: int = 1, delta_budget: float = 1.0):
        self.storage = storage
        self.codec = codec
        self.io = io
        self.leases = leases
        # Deltas: a chunk may be stored as the XOR of the chunk at its place in this rank's last
        # committed save (still in the other host buffer), in chains of at most delta_chain chunks.
        self.delta_chain = delta_chain if codec.name in CodecSpec.CHOOSING else 1
        self.delta_budget = delta_budget  # a load of a chunk reads at most this times its raw size
        self._base: tuple[HostBuffer, int, list[str]] | None = None  # (buffer, its generation, chunk hashes)
        # Chunks known to be durable in storage, with what the manifest needs to say about them.
        self.known: dict[str, mf.ChunkInfo] = {}
        self._loaded: dict[str, mf.ChunkInfo] = {}  # chunks of the step this process loaded (never deleted)
        self._committed: dict[str, mf.ChunkInfo] = {}  # this rank's chunks in its last committed step
        self._inflight: dict[str, Future] = {}  # chunks being written by this save: a twin waits for it
        # auto's trials on the chunk last encoded at each place of the buffer, which the next save there reuses
        # (ckpt.save.encode._auto); pruned to the places of the last save's layout
        self._choices: dict[ChunkSlot, Choice] = {}
        self._lock = threading.Lock()
        # One encoding per core at a time: the pool's other threads write (all encoding at once put off the first write)
        self._encoders = threading.BoundedSemaphore(_cpus.usable())

    # -- per chunk, on the I/O pool -------------------------------------------------------------
    def _put_chunk(self, job: SaveJob, data: memoryview, h: str, base: _BaseRef | None, chunk: ChunkSlot,
                   first: ChunkSlot) -> _Put:
        """Store the chunk at place ``chunk``: encoded as at ``first``, its first place in the save (that
        place's delta ``base``, hint, element width and rotation), so that a chunk at two places is stored
        the same whichever is written. The trials of the copy written are kept for each place of the same
        width and rotation as ``first`` (a hint applies at the width it was made at)."""
        same = (chunk.width, chunk.rotate) == (first.width, first.rotate)
        with self._lock:
            info = self.known.get(h)
            twin = self._inflight.get(h) if info is None else None
            mine: Future | None = None
            if info is None and twin is None:
                mine = self._inflight[h] = Future()
        if info is not None:
            if info.spans is None and (spanned := spans.attach(info, data)) is not info:
                info = spanned  # learnt from a manifest written without them
                with self._lock:
                    self.known[h] = info
            return _Put(h, info, "known")
        if twin is not None:  # an identical chunk of this save is being written: written once, then known
            done = twin.result()
            if same:  # its place takes the twin's trials: they are of the same bytes
                self._chose(chunk, done.choice)
            return _Put(h, done.info, "known")
        assert mine is not None
        try:
            put = self._store(job, h, data, base, first.width, first.rotate, slot=first)
            if same:  # kept only once written: a failed write leaves the last one
                self._chose(chunk, put.choice)
        except BaseException as e:
            mine.set_exception(e)
            raise
        finally:
            with self._lock:
                self._inflight.pop(h, None)
        mine.set_result(put)
        return put

    def _store(self, job: SaveJob, h: str, data: memoryview, base: _BaseRef | None = None, width: int = 1,
               rotate: bool = False, again: bool = False, slot: ChunkSlot | None = None) -> _Put:
        """Write chunk ``h`` unless it is stored already (``again``: write it whole over whatever is there).

        A new chunk is created, never written over: where another writer (another job in the same
        root) created it between the probe and the create, its copy stands and is described instead,
        so every manifest describes the bytes stored under the chunk's key. Only a damaged copy, or
        one whose chain lost a link, is replaced, and by a whole copy, which every manifest naming
        the chunk can read whatever it says of it (a whole copy ends a chain)."""
        found, damaged = (None, True) if again else self._probe(job, h, len(data))
        lost = 0
        with self._lock:  # read once: a retried create encodes the same way
            hint = self._choices.get(slot) if slot is not None else None
        while found is None and not damaged:
            try:
                return self._write(job, h, data, base, width, rotate, create=True, hint=hint)
            except FileExistsError:
                found, damaged = self._probe(job, h, len(data))
                lost += 1
                damaged = damaged or lost >= 3  # created and deleted again each time: replace it whole
        if found is not None:
            found = spans.attach(found, data)
            with self._lock:
                self.known[h] = found
            return _Put(h, found, "found")
        return self._write(job, h, data, None, width, rotate, create=False, hint=hint)

    def _chose(self, slot: ChunkSlot | None, choice: Choice | None) -> None:
        """Keep auto's trials on a chunk written at place ``slot`` for the next save's chunk there."""
        if slot is not None and choice is not None:
            with self._lock:
                self._choices[slot] = choice

    def _write(self, job: SaveJob, h: str, data: memoryview, base: _BaseRef | None, width: int, rotate: bool,
               create: bool, hint: Choice | None = None) -> _Put:
        """Encode chunk ``h`` (``hint``: auto's trials on the chunk at its place in the last save) and create it
        (FileExistsError if a copy is there), or write it over one."""
        b = base.resolve(self) if base is not None and base.digest != h else None
        with self._encoders if self.codec.name != "raw" else nullcontext():  # raw: a header, no coding
            cpu = time.thread_time()  # this thread's CPU time: the other writer threads' work is not counted
            out = encode_chunk(data, h, self.codec, width=width, base=b, rotate=rotate, reuse=True, hint=hint)
            cpu = time.thread_time() - cpu
        codec, buffers = out.codec, out.buffers
        storage, key = self.over(job), paths.chunk_key(h)
        stored = storage.create(key, buffers) if create else storage.write(key, buffers)
        label = parse_header(buffers[0], name=key).label
        of = b.digest if codec == "xor" and b is not None else None
        info = spans.attach(mf.ChunkInfo(len(data), stored, label, of), data)
        with self._lock:
            self.known[h] = info
            if create:
                job.created.append(h)  # nothing was stored under this name: this save alone wrote it
        return _Put(h, info, "created" if create else "written", cpu, out.choice)

    def _probe(self, job: SaveJob, h: str, size: int) -> tuple[mf.ChunkInfo | None, bool]:
        """Is chunk ``h`` already stored (by an earlier run, another rank or another job)? It is
        adopted only once read and verified, down its delta chain (:mod:`ckpt.save.adopt`). Returns
        (what is stored or None, whether a damaged copy, or a delta whose chain is broken, is
        there: then a whole copy is written over it)."""
        table, damaged = adopt.adoptable(self.over(job), h, size, self._known_chain)
        if table is None:
            return None, damaged
        with self._lock:  # every link was verified: a base is as good as a chunk this writer wrote
            for x, info in table.items():
                if x != h:
                    self.known.setdefault(x, info)
        return table[h], False

    def _known_chain(self, h: str) -> dict[str, mf.ChunkInfo] | None:
        """Chunk ``h``'s chain as the dedup table knows it, if it trusts ``h``; else None."""
        with self._lock:
            if h not in self.known:
                return None
            return {x: self.known[x] for x in mf.chain(self.known, h) if x in self.known}

    def _table(self, puts: list[_Put]) -> tuple[dict[str, mf.ChunkInfo], set[str]]:
        """The chunk table of a rank report: the chunks written or reused and every base their chains
        need; and the bases this writer no longer knows (so cannot vouch for)."""
        table = {p.hash: p.info for p in puts}
        unknown: set[str] = set()
        with self._lock:
            known = {**self.known, **table}
        return mf.closure(known, table, unknown), unknown

    def _restore_missing(self, job: SaveJob, puts: list[_Put], buf: HostBuffer,
                         chunks: list[ChunkSlot], at: int) -> None:
        """Chunks taken from the dedup table, and the bases of deltas, must still be stored: another
        process may have deleted them before this job held its lease (or one that keeps no lease: a
        bucket lifecycle rule, an operator), or a local tier may hold a copy its remote lost. Every
        chunk of the buffer that is gone, or whose chain needs a chunk that is gone, is written again,
        whole, from the buffer while it is still held."""
        table, gone = self._table(puts)
        fresh = {p.hash for p in puts if p.how != "known"}  # written or probed by this save
        check = [h for h in table if h not in fresh]
        gone |= {h for h, ok in zip(check, run_all(self.io, lambda h: self.over(job).exists(paths.chunk_key(h)),
                                                   check))
                 if not ok}
        if not gone:
            return
        log.warning("%d chunk(s) this save needs (reused ones, or bases of its deltas) had been deleted by "
                    "another process; writing the chunks that need them again, whole", len(gone))
        with self._lock:
            for h in gone:
                self.known.pop(h, None)
        again: dict[str, _Put] = {}
        for i, p in enumerate(puts):
            if p.hash in again:
                puts[i] = again[p.hash]
            elif any(x in gone for x in mf.chain(table, p.hash)):
                c = chunks[i]
                with self._lock:
                    self.known.pop(p.hash, None)
                puts[i] = again[p.hash] = self._store(job, p.hash, buf.view(c.offset + at, c.length), None, c.width,
                                                      c.rotate, again=True)

    def _adopt_lost(self, job: SaveJob, puts: list[_Put]) -> None:
        """Chunks whose create the storage finished in the background (a tiered storage's upload) and
        found another writer's copy in place: that copy stands, in every tier, and is what this
        save's report describes."""
        keys = {paths.chunk_key(p.hash): p.hash for p in puts if p.how == "created"}
        lost = {keys[k] for k in self.over(job).finish_creates(list(keys)) if k in keys}
        if not lost:
            return
        with self._lock:  # not this save's to delete if it fails
            job.created = [h for h in job.created if h not in lost]
        adopted: dict[str, _Put] = {}
        for h in sorted(lost):
            found = self._probe(job, h, next(p.info.size for p in puts if p.hash == h))[0]
            if found is None:  # the buffer is released: the next save writes it whole over the damaged copy
                raise CorruptCheckpointError(
                    f"step {job.step} was not committed: chunk {h}, stored by another writer into "
                    f"{self.over(job).describe()} while this save wrote it, is damaged or its delta chain is "
                    "incomplete. Save again: the next save writes it whole")
            adopted[h] = _Put(h, found, "found")
            with self._lock:
                self.known[h] = found
        puts[:] = [adopted.get(p.hash, p) for p in puts]
        log.info("%d chunk(s) of step %d were stored by another writer at the same time; the step lists "
                 "their copies", len(lost), job.step)

    def over(self, job: SaveJob) -> Storage:
        """The storage ``job`` runs over."""
        return job.storage if job.storage is not None else self.storage

    def _check_not_committed(self, job: SaveJob) -> None:
        step, storage = job.step, self.over(job)
        if storage.exists(paths.manifest_key(step)):
            raise StepExistsError(
                f"step {step} is already committed in {storage.describe()}; committed steps are never "
                f"overwritten. {STEP_EXISTS_ADVICE}")

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
                self._check_not_committed(job)
                if snap.cuda is not None:
                    snap.cuda.synchronize()
                refuse_poison(job.step, rank, snap.poisoned(), lambda: mf.committed_steps(self.over(job)))
                job.created = []
                if snap.rest is not None:  # a ring (ckpt.save.ring): piece by piece, as save() copies them
                    puts = self._write_pieces(job, buf, rank)
                    bases: list[_BaseRef | None] = []
                else:
                    snap_hashes = snap.hashes or [None] * len(layout.chunks)
                    bases = self._bases(snap)
                    puts = self._put_chunks(job, buf, layout.chunks, snap_hashes, bases, 0)
                    self._restore_missing(job, puts, buf, list(layout.chunks), 0)
                    if snap.store is not None:  # this save's bytes of some chunks: the next one's bases
                        snap.store.keep(buf, [p.hash for p in puts], [p.info.base is not None for p in puts])
                base = self._base
                if snap.store is None and any(bases) and base is not None and base[0].generation != base[1]:
                    raise CheckpointError(f"step {job.step}: the previous save's buffer changed while this save "
                                          "encoded deltas against it (a bug: please report it); nothing was committed")
                job.hashes = [p.hash for p in puts]
                places = set(layout.chunks)  # the choices of places this layout no longer has are dropped
                with self._lock:
                    self._choices = {c: v for c, v in self._choices.items() if c in places}
            finally:
                snap.release()
            self.over(job).flush()
            if job.on_local is not None:
                job.on_local()
            self._adopt_lost(job, puts)
            part = self._report(job, rank, puts)
            self._check_not_committed(job)  # a committed step's rank reports never change
            job.report = part.to_json()
            self.over(job).write(paths.rank_key(job.step, rank), [job.report])
            return part
        except BaseException:
            self.discard(job)
            raise

    def _put_chunks(self, job: SaveJob, buf: HostBuffer, chunks: list[ChunkSlot] | tuple[ChunkSlot, ...],
                    hashes: list[str | None], bases: list[_BaseRef | None], at: int) -> list[_Put]:
        """Store ``chunks``, whose bytes are at their layout offset plus ``at`` in ``buf`` (``hashes``: their
        digests, or None where the snapshot did not hash them: CUDA bytes, hashed here first)."""
        def view(c: ChunkSlot) -> memoryview:
            return buf.view(c.offset + at, c.length)

        def digest(c: ChunkSlot) -> str:
            core = buf.cpu_core  # its hash releases the GIL; None for chunks of 240 bytes or fewer
            h = core.xxh3_128(buf.address(c.offset + at), c.length) if core is not None else None
            return h if h is not None else chunk_hash(view(c))

        hashed = iter(run_all(self.io, digest, [c for c, h in zip(chunks, hashes) if h is None]))
        digests = [h if h is not None else next(hashed) for h in hashes]
        first: dict[str, int] = {}
        args = [(c, h, first.setdefault(h, i)) for i, (c, h) in enumerate(zip(chunks, digests))]
        return run_all(self.io, lambda a: self._put_chunk(job, view(a[0]), a[1], bases[a[2]], a[0], chunks[a[2]]),
                       args)

    def _write_pieces(self, job: SaveJob, ring: Any, rank: int) -> list[_Put]:
        """Store the chunks of a ring's pieces, each once ``save()`` copied it, giving its slab back
        once its chunks are stored (and the reused ones checked); then refuse NaN or Inf, which is
        known only once every piece is copied (the chunks written are then deleted, nothing committed)."""
        snap, chunks = job.snapshot, ring.layout.chunks
        puts: list[_Put] = []
        for k, piece in enumerate(ring.pieces):
            at, hashes = ring.piece(k)
            mine = list(chunks[piece.first:piece.end])
            got = self._put_chunks(job, ring, mine, hashes or [None] * len(mine), [None] * len(mine), at)
            self._restore_missing(job, got, ring, mine, at)
            puts += got
            ring.written(k)
        ring.wait_copied()
        refuse_poison(job.step, rank, snap.poisoned(), lambda: mf.committed_steps(self.over(job)))
        return puts

    def _bases(self, snap: Snapshot) -> list[_BaseRef | None]:
        """Per chunk of the snapshot's buffer, the chunk at its place in this rank's last committed
        save, where the other buffer of the pair still holds it (deltas are on and nothing has
        been copied over it since)."""
        layout = snap.buffer.layout
        if snap.store is not None:  # within host_memory: the bases of the chunks it keeps
            held = snap.store.bases() if self.delta_chain >= 2 else {}
            return [_BaseRef(*held[i]) if i in held else None for i in range(len(layout.chunks))]
        base = self._base
        if (base is None or self.delta_chain < 2 or snap.other is not base[0] or base[0].generation != base[1]
                or base[0].layout is not layout):
            return [None] * len(layout.chunks)
        buf, _, hashes = base
        return [_BaseRef(buf.view(c.offset, c.length), h) for c, h in zip(layout.chunks, hashes)]

    def _report(self, job: SaveJob, rank: int, puts: list[_Put]) -> mf.Manifest:
        m, snap = job.metrics, job.snapshot
        layout = snap.buffer.layout
        hashes = [p.hash for p in puts]
        chunk_table, unknown = self._table(puts)
        if unknown:  # _restore_missing rewrote every chunk whose chain it could not vouch for
            raise CorruptCheckpointError(f"step {job.step} was not committed: delta base(s) {sorted(unknown)[:3]} are "
                                         "unknown to the writer, so the step could not be loaded. This is a bug "
                                         "(please report it); the committed steps are unaffected, save again")
        new = {p.hash: p.info for p in puts if p.how in ("written", "created")}
        m.chunks = len(chunk_table)
        m.chunks_written = len(new)
        m.chunks_reused = m.chunks - m.chunks_written
        m.written_bytes = sum(info.stored for info in new.values())
        m.raw_bytes = sum(s.nbytes for s in layout.slots)
        tensors: dict[str, mf.TensorEntry] = {}  # one entry per tensor, a shard per piece this rank holds
        for slot in layout.slots:
            segs = [mf.Segment(hashes[i], off, ln) for i, off, ln in layout.segments(slot)]
            leaf, key = snap.leaves[slot.key], tensor_of(slot.key, snap.leaves[slot.key])
            (offs, lens), owner = leaf.box, (rank if leaf.kind == "rank" else None)
            tensors.setdefault(key, mf.TensorEntry(key, dtype_name(slot.dtype), list(leaf.global_shape), [], owner)
                               ).shards.append(mf.Shard(rank, list(offs), list(lens), segs))
        m.chunks_delta = sum(1 for info in new.values() if info.base is not None)
        encoded = {p.hash: p for p in puts if p.how in ("written", "created")}  # a chunk at two places: once
        m.encoded_bytes = sum(p.info.size for p in encoded.values())
        m.encode_cpu_s = sum(p.encode_cpu_s for p in encoded.values())
        stats = {"raw_bytes": m.raw_bytes, "written_bytes": m.written_bytes, "chunks": m.chunks,
                 "chunks_written": m.chunks_written, "chunks_reused": m.chunks_reused, "chunks_delta": m.chunks_delta}
        return mf.Manifest(step=job.step, kind="rank", rank=rank, structure=job.structure,
                           tensors=list(tensors.values()), chunks=chunk_table, stats=stats)

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
                log.info("step %d failed; its %d new chunk(s) are left for `ckpt gc` (another writer is live)",
                         job.step, len(created))
                return
            storage = self.over(job)
            run_all(self.io, storage.delete, [paths.chunk_key(h) for h in created])
            storage.flush()
            log.info("step %d failed; removed the %d chunk(s) it had written", job.step, len(created))
        except Exception as e:  # the save's own error matters more; gc removes them later
            log.warning("removing the chunks of failed step %d failed: %s", job.step, e)

    # -- what the writer trusts to be stored --------------------------------------------------------
    def in_use(self) -> set[str]:
        """The chunks this writer may reuse without asking storage: never to be deleted under it."""
        with self._lock:
            return set(self.known)

    def learn(self, chunks: dict[str, mf.ChunkInfo]) -> None:
        """The chunks of a step this process loaded: stored, and kept (retention protects that step); known
        without span digests, which a save reusing one computes from its bytes (wrong ones are not copied on)."""
        with self._lock:
            self._loaded = {h: dataclasses.replace(c, spans=None) if c.spans else c for h, c in chunks.items()}
            self.known.update(self._loaded)

    def forget_loaded(self) -> None:
        """The loaded step's chunks are not all where the next save writes (a local tier that could
        not be healed): ask storage again instead of trusting them."""
        with self._lock:
            self._loaded = {}
            self.known = dict(self._committed)

    def after_decision(self, committed: mf.Manifest | None, job: SaveJob | None = None) -> None:
        """After a save's decision: trust only the chunks of the loaded step and of this rank's last
        committed part (``committed``, when this save committed: its buffer becomes the base of the
        next save's deltas). Retention, on this rank or the coordinator, may delete anything else
        before the next save."""
        with self._lock:
            if committed is not None:
                self._committed = dict(committed.chunks)
                if (job is not None and job.snapshot.rest is None and job.snapshot.store is None
                        and len(job.hashes) == len(job.snapshot.buffer.layout.chunks)):
                    self._base = (job.snapshot.buffer, job.snapshot.generation, list(job.hashes))
            self.known = {**self._loaded, **self._committed}
        if job is not None and job.snapshot.store is not None:
            job.snapshot.store.committed(committed is not None)




@dataclass(frozen=True)
class _BaseRef:
    """Where a chunk's base is: its bytes in the other host buffer, and its hash."""

    view: memoryview
    digest: str

    def resolve(self, writer: Writer) -> Base | None:
        """The base, if it is known to be stored and a delta on it keeps the chain within delta_chain
        links and delta_budget × the chunk's size of bytes read (what is left is the delta's room)."""
        with writer._lock:
            links = mf.chain(writer.known, self.digest)
            infos = [writer.known.get(x) for x in links]
        if not links or any(i is None for i in infos) or len(links) >= writer.delta_chain:
            return None
        room = int(writer.delta_budget * len(self.view)) - sum(i.stored for i in infos if i is not None)
        return Base(self.view, self.digest, room) if room > 0 else None


# `ckpt gc` removes only what failed saves left, never a committed step: it cannot make room for a save.
STEP_EXISTS_ADVICE = ("Save under a new step number, or delete that step's directory (or prefix) by hand first; "
                       "retention (keep_last) drops old steps as new ones commit.")
