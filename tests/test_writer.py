"""The writer alone, over memory://: one rank's part of a save (chunks, then the rank report) and the
commit, with no Checkpointer, no commit thread and no process group around it."""

from __future__ import annotations

import os
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

import ckpt
from ckpt import _cpus
from ckpt.flatten import flatten
from ckpt.format import manifest as mf
from ckpt.format import paths
from ckpt.format.chunk import decode
from ckpt.handle import SaveMetrics
from ckpt.lease import Leases
from ckpt.ranks import LocalComm
from ckpt.save import writer as writer_module
from ckpt.save.commit import CommitProtocol
from ckpt.save.committer import commit_step
from ckpt.save.encode import CodecSpec
from ckpt.save.job import SaveJob
from ckpt.save.snapshot import Snapshotter
from ckpt.save.writer import Writer
from ckpt.storage import open_storage
from ckpt.testing import FaultyStorage

CHUNK = 64 * 1024


@pytest.fixture
def io():
    pool = ThreadPoolExecutor(4)
    yield pool
    pool.shutdown()


def memory_storage():
    return open_storage(f"memory://writer-{uuid.uuid4().hex}")


def job_for(snapshotter: Snapshotter, step: int, state: dict, seq: int = 0) -> SaveJob:
    flat = flatten(state)
    snap = snapshotter.take(seq, flat, state)
    assert snap is not None
    return SaveJob(step=step, seq=seq, snapshot=snap, structure=flat.structure, metrics=SaveMetrics(step),
                   started=0.0)


def state_of(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"big": torch.randn(50_000, generator=g), "small": torch.arange(10), "frozen": torch.linspace(0, 1, 40_000)}


def test_part_chunks_and_report_then_create_only_commit(io):
    storage = memory_storage()
    w = Writer(storage, CodecSpec("auto"), io)
    snaps = Snapshotter(LocalComm(), CHUNK, native=False)
    local = []
    job = job_for(snaps, 1, state_of(1))
    job.on_local = lambda: local.append(True)
    part = w.write_part(job, rank=0)
    assert local == [True] and not job.snapshot.buffer.busy  # the buffer is free once chunks are durable
    assert part.kind == "rank" and mf.read_rank_part(storage, 1, 0).chunks == part.chunks
    for h, info in part.chunks.items():  # every chunk stored, whole and verifiable
        raw = decode(storage.read(paths.chunk_key(h)), name=h, expect_hash=h, expect_len=info.size)
        assert len(raw) == info.size
    assert job.metrics.chunks == len(part.chunks) == job.metrics.chunks_written
    committed = commit_step(storage, 1, [part], frozenset())
    assert mf.read_step(storage, 1).chunks == committed.chunks
    with pytest.raises(ckpt.StepExistsError):
        commit_step(storage, 1, [part], frozenset())


def test_unchanged_chunks_are_reused_known_or_found_by_their_header(io):
    storage = memory_storage()
    snaps = Snapshotter(LocalComm(), CHUNK, native=False)
    w = Writer(storage, CodecSpec("raw"), io)
    s1 = state_of(1)
    p1 = w.write_part(job_for(snaps, 1, s1), 0)
    w.after_decision(p1)
    s1["big"][:10] += 1  # one chunk of "big" changes
    j2 = job_for(snaps, 2, s1, seq=1)
    w.write_part(j2, 0)
    assert j2.metrics.chunks_written == 1 and j2.metrics.chunks_reused == j2.metrics.chunks - 1
    fresh = Writer(storage, CodecSpec("raw"), io)  # knows nothing: probes each chunk's header
    j3 = job_for(snaps, 3, s1, seq=2)
    fresh.write_part(j3, 0)
    assert j3.metrics.chunks_written == 0


def test_after_a_decision_the_writer_trusts_only_the_loaded_and_last_committed_chunks(io):
    w = Writer(memory_storage(), CodecSpec("raw"), io)
    snaps = Snapshotter(LocalComm(), CHUNK, native=False)
    p1 = w.write_part(job_for(snaps, 1, state_of(1)), 0)
    w.learn({"a" * 32: mf.ChunkInfo(1, 65, "raw/1")})
    w.after_decision(None)  # the save failed: what it wrote is not trusted
    assert set(w.known) == {"a" * 32}
    w.after_decision(p1)
    assert set(w.known) == {"a" * 32} | set(p1.chunks)


def test_a_storage_failure_releases_the_buffer_and_raises(io):
    storage = FaultyStorage(memory_storage())
    w = Writer(storage, CodecSpec("raw"), io)
    snaps = Snapshotter(LocalComm(), CHUNK, native=False)
    job = job_for(snaps, 1, state_of(1))
    storage.fail("write", exc=ckpt.StorageError("disk full"))  # every write, from here on
    with pytest.raises(ckpt.StorageError, match="disk full"):
        w.write_part(job, 0)
    assert not job.snapshot.buffer.busy


def test_commit_protocol_alone_commits_retains_and_raises_its_own_error(io):
    """The single-process path is the multi-rank one with a LocalComm: decision, then after_commit."""
    storage = memory_storage()
    w = Writer(storage, CodecSpec("raw"), io)
    comm = LocalComm()
    snaps = Snapshotter(comm, CHUNK, native=False)
    after = []
    with ThreadPoolExecutor(1) as commit_thread:
        proto = CommitProtocol(comm, w, io, commit_thread, lambda m, _persisted: after.append(m.step), Leases(storage))
        futures = []
        for seq, step in enumerate((1, 2, 2)):
            from concurrent.futures import Future
            f: Future = Future()
            proto.submit(job_for(snaps, step, state_of(step), seq=seq), f)
            futures.append(f)
        assert futures[0].result().duration_s is not None and futures[1].result().step == 2
        with pytest.raises(ckpt.StepExistsError):  # alone, the rank's own error is the save's error
            futures[2].result()
        proto.drain()
    assert after == [1, 2] and mf.committed_steps(storage) == [1, 2]


# -- leases: writers and deleters of other processes keep out of each other's way -----------------------

def test_a_writer_waits_for_a_deletion_in_progress_then_holds_its_lease(caplog):
    import logging
    import threading

    storage = memory_storage()
    gc_side, writer = Leases(storage), Leases(storage)
    waiting, held = threading.Event(), threading.Event()

    class Seen(logging.Handler):
        def emit(self, record):
            if "waiting for" in record.getMessage():
                waiting.set()

    handler = Seen()
    logging.getLogger("ckpt").addHandler(handler)
    caplog.set_level(logging.INFO, logger="ckpt")
    try:
        with gc_side.deleting() as writers:
            assert writers == []  # nobody writes yet: the deleter may delete chunks
            t = threading.Thread(target=lambda: (writer.hold(), held.set()))
            t.start()
            assert waiting.wait(30) and not held.is_set()  # the writer saw the deletion and waits
        t.join(30)
        assert held.is_set()
        with gc_side.deleting() as writers:  # now the writer is live: the deleter must not delete chunks
            assert [w.id for w in writers] == [writer.writer_id]
        assert not gc_side.exclusive()
        writer.release()
        assert gc_side.exclusive()
    finally:
        logging.getLogger("ckpt").removeHandler(handler)
        writer.release()


@pytest.mark.multiprocess
def test_leases_of_dead_or_expired_holders_count_for_nothing():
    import json
    import socket
    import time

    from ckpt.lease import list_leases

    storage = memory_storage()
    dead = subprocess_pid_that_has_exited()
    for name, pid, host, expires in [("dead", dead, socket.gethostname(), time.time() + 60),
                                     ("expired", os.getpid(), "elsewhere", time.time() - 600),
                                     ("alive", os.getpid(), "elsewhere", time.time() + 60)]:
        doc = {"id": name, "kind": "writer", "pid": pid, "host": host, "expires": expires}
        storage.write(f"leases/{name}.json", [json.dumps(doc).encode()])
    mine = Leases(storage)
    assert [x.id for x in mine.others()] == ["alive"] and not mine.exclusive()
    mine.sweep()
    assert sorted(x.id for x in list_leases(storage)) == ["alive"]


def subprocess_pid_that_has_exited() -> int:
    import subprocess
    import sys

    p = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                       check=True)
    return int(p.stdout)


def test_metrics_count_the_bytes_encoded_and_the_cpu_spent_on_them(io):
    w = Writer(memory_storage(), CodecSpec("auto"), io)
    snaps = Snapshotter(LocalComm(), CHUNK, native=False)
    s = state_of(1)
    s["noise"] = torch.randn(300_000, generator=torch.Generator().manual_seed(2))  # several chunks to encode
    j1 = job_for(snaps, 1, s)
    p1 = w.write_part(j1, 0)
    w.after_decision(p1)
    m = j1.metrics
    assert m.encoded_bytes == sum(info.size for info in p1.chunks.values()) > 0
    assert m.encode_cpu_s > 0
    s["big"][:10] += 1  # one chunk changes: only it is encoded again
    j2 = job_for(snaps, 2, s, seq=1)
    w.write_part(j2, 0)
    assert j2.metrics.chunks_written == 1 and 0 < j2.metrics.encoded_bytes <= CHUNK
    j3 = job_for(snaps, 3, s, seq=2)
    w.write_part(j3, 0)
    assert j3.metrics.encoded_bytes == 0 and j3.metrics.encode_cpu_s == 0.0


def test_a_writer_encodes_at_most_one_chunk_per_usable_core_at_once(monkeypatch):
    """The pool has more threads than cores (fsync-bound writes overlap), but encoding is CPU work: more
    encodes at once than cores only put off each chunk's end, and with it the first write. Two usable
    cores are made to be seen whatever the machine has, so eight threads could exceed them."""
    real, lock = writer_module.encode_chunk, threading.Lock()
    now, most, calls = [0], [0], [0]

    def counting(*args, **kwargs):
        with lock:
            now[0] += 1
            most[0] = max(most[0], now[0])
            calls[0] += 1
        try:
            return real(*args, **kwargs)
        finally:
            with lock:
                now[0] -= 1

    monkeypatch.setattr(writer_module, "encode_chunk", counting)
    monkeypatch.setattr(_cpus, "usable", lambda: 2)
    pool = ThreadPoolExecutor(8)
    try:
        w = Writer(memory_storage(), CodecSpec("auto"), pool)
        snaps = Snapshotter(LocalComm(), 1 << 20, native=False)  # 1 MiB chunks: each encode takes a while
        s = {"noise": torch.randn(16 << 18, generator=torch.Generator().manual_seed(3))}
        job = job_for(snaps, 1, s)
        w.write_part(job, 0)
    finally:
        pool.shutdown()
    assert calls[0] == job.metrics.chunks_written == 16
    assert 1 <= most[0] <= 2
