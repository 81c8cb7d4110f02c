"""Checkpoints on object storage and with a local tier, against real S3-compatible servers on 127.0.0.1.

``rclone serve s3`` (a separate process, killed for real) and moto's ThreadedMotoServer, started by the
fixtures in conftest.py. The storage conformance suite every backend passes is tests/test_storage.py.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time

import pytest
import torch
from conftest import BUCKET, MiB, fast, s3_url

import ckpt
from ckpt.format import paths
from ckpt.format.chunk import verify_object
from ckpt.storage import LocalStorage, open_storage
from ckpt.storage.tiered import TieredStorage
from ckpt.testing import FaultProxy, FaultyStorage, RcloneS3


def state_of(n: int = 3_000_000, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(n, generator=g), "b": torch.randn(1000, generator=g), "step": seed}


def zeros_like(s: dict) -> dict:
    return {"w": torch.zeros_like(s["w"]), "b": torch.zeros_like(s["b"]), "step": -1}


def assert_loaded(c: ckpt.Checkpointer, step, expected: dict) -> None:
    got = zeros_like(expected)
    assert c.load(step, got) == (step if step != "latest" else got["step"])
    assert torch.equal(got["w"], expected["w"]) and torch.equal(got["b"], expected["b"])


def test_which_servers_give_true_create_only(rclone_server, moto_server):
    """Documented in docs/api.md: moto honours If-None-Match (true create-only), rclone serve s3 ignores it
    (ckpt then relies on check-then-put). If rclone learns it, update docs/api.md."""
    assert open_storage(s3_url(), fast(moto_server.endpoint)).conditional_writes() is True
    assert open_storage(s3_url(), fast(rclone_server.endpoint)).conditional_writes() is False


# -- checkpoints on S3, with and without the local tier ---------------------------------------------
@pytest.mark.parametrize("tiered", [False, True], ids=["direct", "local_dir"])
def test_save_load_on_s3(server, tmp_path, tiered):
    url, so = s3_url(), fast(server.endpoint)
    local = str(tmp_path / "nvme") if tiered else None
    s1, s2 = state_of(seed=1), state_of(seed=2)
    with ckpt.Checkpointer(url, local_dir=local, storage_options=so, chunk_size=4 * MiB) as c:
        h = c.save(1, s1)
        assert h.wait("local") is h.metrics and h.stage in ("local", "committed")
        h.wait()
        assert h.stage == "committed" and h.metrics.local_s <= h.metrics.duration_s
        c.save(2, s2).wait()
        assert c.steps() == [1, 2]
    # A fresh process view: the remote alone holds both steps.
    with ckpt.Checkpointer(url, storage_options=so) as c:
        assert_loaded(c, 1, s1)
        assert_loaded(c, "latest", s2)
    if tiered:  # the local tier is a plain checkpoint of the same steps
        assert ckpt.open(local).steps() == [1, 2]


def test_commit_waits_for_uploads_and_stage_order(rclone_server, tmp_path):
    """The manifest PUT comes after every chunk upload: while the uploads are held, the handle already
    reports 'local' and the step is not committed; once they go through, it commits.

    The uploads are held by a gate in this process, not by timing: checking "the manifest is not
    there yet" against a stalled connection raced the commit (the stall could end first). The gate sits
    on the remote tier, so the tiers are built here (what local_dir= would build) and handed in."""
    url, so = s3_url(), fast(rclone_server.endpoint)
    remote = FaultyStorage(open_storage(url, so))
    gate = remote.gate("write", key=r"^chunks/")
    tiers = TieredStorage(LocalStorage(str(tmp_path / "nvme")), remote, verify=verify_object)
    direct = open_storage(url, so)
    try:
        with ckpt.Checkpointer(url, storage=tiers, chunk_size=1 * MiB) as c:
            h = c.save(1, state_of(1_000_000))
            h.wait("local")
            assert gate.entered.wait(60)  # an upload is under way, and held
            assert h.stage == "local" and not h.done()
            assert not direct.exists(paths.manifest_key(1))
            gate.open()
            h.wait()
            assert h.stage == "committed" and direct.exists(paths.manifest_key(1))
            assert h.metrics.local_s < h.metrics.duration_s
    finally:
        gate.open()
        direct.close()


def test_a_staged_chunk_takes_three_requests(rclone_server, tmp_path):
    """Issue 23 item 5: per new chunk a staged save asks whether it is stored (the writer's probe, a
    ranged GET), whether it appeared since (a HEAD: rclone ignores If-None-Match) and PUTs it. A chunk
    of less than two parts' worth went up as a multipart upload of one part: two round trips more, and
    the server put the object together again."""
    with ckpt.Checkpointer(s3_url(), local_dir=str(tmp_path / "nvme"), storage_options=fast(rclone_server.endpoint),
                           chunk_size=12 * MiB, codec="raw") as c:
        c.save(1, {"w": torch.ones(1000)}).wait()  # the lease and the create-only probe are behind us
        remote = c.storage.remote
        call, calls = remote.fs.call_s3, []

        def counted(method, *a, **kw):  # instrumentation: the requests on chunk objects
            if "/chunks/" in kw.get("Key", ""):
                calls.append(method)
            return call(method, *a, **kw)

        remote.fs.call_s3 = counted
        c.save(2, {"w": torch.randn(6 * MiB)}).wait()  # 24 MiB: two chunks of 12 MiB
        assert sorted(calls) == ["get_object"] * 2 + ["head_object"] * 2 + ["put_object"] * 2
        assert remote.counters["multipart"] == 0


# -- faults -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("fault", ["503", "reset", "stall"])
def test_saves_succeed_through_faults(server, tmp_path, fault):
    proxy = FaultProxy(server.port, stall_s=2.0)
    try:
        url = s3_url()
        so = fast(proxy.endpoint, read_timeout=1, multipart_threshold=5 * MiB, multipart_chunksize=5 * MiB)
        s1 = state_of(4_000_000, seed=3)  # 16 MB: a chunk of 12 MiB goes up in two parts, the rest as a PUT
        with ckpt.Checkpointer(url, storage_options=so, chunk_size=12 * MiB, codec="raw") as c:
            proxy.arm(fault, 6)
            c.save(1, s1).wait()
            retries = c.storage.counters["retries"]
        assert proxy.injected[fault] == 6
        assert retries >= 1  # our loop did the retrying (botocore's and s3fs's are off)
        with ckpt.Checkpointer(url, storage_options=fast(server.endpoint)) as c:
            assert_loaded(c, 1, s1)
    finally:
        proxy.close()


def test_failed_multipart_is_aborted(server):
    proxy = FaultProxy(server.port)
    try:
        st = open_storage(s3_url(), fast(proxy.endpoint, max_attempts=1, multipart_chunksize=5 * MiB))
        call = st.fs.call_s3

        def faults_after_create(method, *a, **kw):  # instrumentation: the fault lands between calls
            r = call(method, *a, **kw)
            if method == "create_multipart_upload":
                # Two per part: the body now goes out with the headers, so the proxy's answer-and-close
                # may break the write first, and aiohttp then resends an idempotent PUT once itself.
                # The abort meets what is left over, and has tries enough for it.
                proxy.arm("503", 6)
                proxy.drop_all()  # parts must open new connections, and meet the 503s
            return r

        st.fs.call_s3 = faults_after_create
        with pytest.raises(ckpt.StorageError, match="uploading part"):
            st.write("chunks/aa/big", [os.urandom(15 * MiB)])
        assert st.counters["multipart"] == 1 and st.counters["aborted"] == 1
        assert proxy.injected["503"] >= 1
        direct = open_storage(st.url, fast(server.endpoint))
        assert direct.multipart_uploads() == []  # ListMultipartUploads: no orphan parts
        assert not direct.exists("chunks/aa/big")
    finally:
        proxy.close()


def test_server_killed_mid_upload(tmp_path):
    """kill -9 of the server during a save: StorageError within the retry deadline, the step is not
    committed, and the previous step still loads once a server is back on the same data."""
    root = str(tmp_path / "srv")
    srv = RcloneS3(root).start()
    srv.make_bucket(BUCKET)
    proxy = FaultProxy(srv.port)
    url, deadline = s3_url(), 4.0
    so = fast(proxy.endpoint, retry_deadline=deadline, read_timeout=2)
    try:
        s1, s2 = state_of(1_000_000, seed=1), state_of(8_000_000, seed=2)
        c = ckpt.Checkpointer(url, storage_options=so, chunk_size=2 * MiB, local_dir=str(tmp_path / "nvme"))
        c.save(1, s1).wait()
        started = threading.Event()
        proxy.on_bytes(4 * MiB, started, hold=True)  # requests stop mid-upload until released
        h = c.save(2, s2)
        assert started.wait(60), "the upload never started"
        srv.kill()
        proxy.release()  # the held requests now meet a dead server
        t0 = time.monotonic()
        with pytest.raises(ckpt.StorageError):
            h.wait(timeout=60)
        assert time.monotonic() - t0 < deadline + 2 * 5 + 10  # deadline + in-flight timeouts, bounded
        c.close()  # the failure was seen through the handle; closing does not raise it again
    finally:
        proxy.close()
    srv2 = RcloneS3(root).start()  # same directory, new process
    try:
        with ckpt.Checkpointer(url, storage_options=fast(srv2.endpoint)) as c:
            assert c.steps() == [1]
            assert_loaded(c, "latest", s1)
    finally:
        srv2.kill()


def test_a_dead_server_fails_a_save_of_many_chunks_within_one_deadline(tmp_path):
    """64 chunks against a server that died: the save fails in about one retry_deadline, not in one
    per chunk (queued chunk writes are not started, and requests already retrying give up together)."""
    srv = RcloneS3(str(tmp_path / "srv")).start()
    srv.make_bucket(BUCKET)
    deadline = 3.0
    so = fast(srv.endpoint, retry_deadline=deadline, read_timeout=1)
    c = ckpt.Checkpointer(s3_url(), storage_options=so, chunk_size=64 * 1024, codec="raw", io_threads=8)
    try:
        c.save(1, {"w": torch.ones(1000)}).wait()  # the lease is held: the next save goes straight to chunks
        srv.kill()
        t0 = time.monotonic()
        with pytest.raises(ckpt.StorageError):
            c.save(2, {"w": torch.randn(64 * 16 * 1024)}).wait()
        elapsed = time.monotonic() - t0
    finally:
        srv.kill()
        c.close()  # the lease removal meets the dead server too: logged, bounded
    assert elapsed < 2 * deadline + 2  # before: about 64 / 8 deadlines


def _in_thread(fn, limit: float) -> tuple[BaseException | None, float]:
    """Run ``fn`` in a thread; its error and how long it took. A hang fails the test after ``limit``
    seconds instead of hanging the suite (the thread is a daemon, let go when its sockets close)."""
    out: list[BaseException | None] = [None]

    def run():
        try:
            fn()
        except BaseException as e:  # handed to the test
            out[0] = e
    t0 = time.monotonic()
    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(limit)
    assert not t.is_alive(), f"still waiting on the server after {limit}s"
    return out[0], time.monotonic() - t0


def test_a_server_that_accepts_and_never_answers_fails_a_save_in_bounded_time(rclone_server):
    """Issue 24 item 19: every PUT asked 'Expect: 100-continue' and waited for the answer outside
    read_timeout and retry_deadline, so a server that accepted connections and never answered held
    a save forever. Now it fails within the deadline and commits nothing."""
    url = s3_url()
    with ckpt.Checkpointer(url, storage_options=fast(rclone_server.endpoint)) as c:
        c.save(1, {"w": torch.ones(1000)}).wait()
    proxy = FaultProxy(rclone_server.port, stall_s=600)  # a stalled connection is held until close()
    proxy.arm("stall", 100_000)  # every connection
    c = ckpt.Checkpointer(url, storage_options=fast(proxy.endpoint, read_timeout=1, retry_deadline=4))
    try:
        err, elapsed = _in_thread(lambda: c.save(2, {"w": torch.randn(200_000)}).wait(), 60)
        assert isinstance(err, ckpt.StorageError), err
        assert elapsed < 20  # the 4 s deadline, and the slack of a busy machine; without the fix, never
        assert proxy.injected["stall"] >= 1
        proxy.disarm()  # the server answers again: close() is quick
        c.close()
    finally:
        proxy.close()
    with ckpt.Checkpointer(url, storage_options=fast(rclone_server.endpoint)) as c:
        assert c.steps() == [1]
        assert not c.storage.exists(paths.manifest_key(2))


@pytest.mark.parametrize("how", ["put", "multipart"])
def test_a_body_the_server_never_reads_is_cut_at_the_deadline(rclone_server, how):
    """A body larger than the socket buffers, sent to a server that stops reading, blocks the write,
    where no socket timeout applies: each try is cut when the retry deadline runs out. A multipart
    upload whose parts stall is aborted, leaving no parts behind."""
    proxy = FaultProxy(rclone_server.port, stall_s=600)
    mp = {"multipart_chunksize": 16 * MiB} if how == "multipart" else {"multipart_threshold": 64 * MiB}
    st = open_storage(s3_url(), fast(proxy.endpoint, read_timeout=1, retry_deadline=3, **mp))
    call = st.fs.call_s3

    def stall_parts(method, *a, **kw):  # instrumentation: the stall lands between the calls
        r = call(method, *a, **kw)
        if method == "create_multipart_upload":
            proxy.arm("stall", 2)  # the two parts' connections; the abort goes through
            proxy.drop_all()
        return r

    if how == "multipart":
        st.fs.call_s3 = stall_parts
    else:
        proxy.arm("stall", 100_000)
    try:
        err, elapsed = _in_thread(lambda: st.write("chunks/aa/big", [os.urandom(40 * MiB)]), 60)
        assert isinstance(err, ckpt.StorageError), err
        assert elapsed < 20
        assert proxy.injected["stall"] >= 1
    finally:
        proxy.close()
    direct = open_storage(st.url, fast(rclone_server.endpoint))
    assert not direct.exists("chunks/aa/big")
    if how == "multipart":
        assert st.counters["aborted"] == 1 and direct.multipart_uploads() == []


# -- tier-aware restore -----------------------------------------------------------------------------
def test_restore_prefers_local_and_ignores_damaged_copy(moto_server, tmp_path, caplog):
    url, so, local = s3_url(), fast(moto_server.endpoint), str(tmp_path / "nvme")
    s1 = state_of(seed=5)
    with ckpt.Checkpointer(url, local_dir=local, storage_options=so, chunk_size=4 * MiB, codec="raw") as c:
        c.save(1, s1).wait()
        assert_loaded(c, 1, s1)
        n = c.last_load.chunks_read
        assert c.last_load.local_chunks == n and c.last_load.remote_chunks == 0
    chunks = sorted(os.path.join(d, f) for d, _, fs in os.walk(os.path.join(local, "chunks")) for f in fs)
    with open(chunks[0], "r+b") as f:  # flip a payload byte of one local copy
        f.seek(100)
        b = f.read(1)
        f.seek(100)
        f.write(bytes([b[0] ^ 0xFF]))
    os.unlink(chunks[1])  # and lose another
    with ckpt.Checkpointer(url, local_dir=local, storage_options=so) as c:
        with caplog.at_level(logging.WARNING, logger="ckpt"):
            assert_loaded(c, 1, s1)
        assert c.last_load.local_rejected == [paths.chunk_key(os.path.basename(chunks[0]))]
        assert c.last_load.remote_chunks == 2 and c.last_load.local_chunks == n - 2
        assert "damaged" in caplog.text


def test_staged_chunk_missing_remotely_is_uploaded_before_reuse(moto_server, tmp_path):
    """A chunk staged locally whose upload was lost is not trusted for dedup until it is uploaded."""
    url, so, local = s3_url(), fast(moto_server.endpoint), str(tmp_path / "nvme")
    s1 = state_of(seed=6)
    with ckpt.Checkpointer(url, local_dir=local, storage_options=so, chunk_size=4 * MiB) as c:
        c.save(1, s1).wait()
        remote = c.storage.remote
        victim = sorted(c.manifest(1).chunks)[0]
        remote.delete(paths.chunk_key(victim))
        c.save(2, s1).wait()  # reuses every chunk; the missing one is healed from the local copy
        assert remote.exists(paths.chunk_key(victim))
    with ckpt.Checkpointer(url, storage_options=so) as c:
        assert_loaded(c, 2, s1)


# -- retention on both tiers ------------------------------------------------------------------------
def _chunk_names(storage) -> set[str]:
    return {n for p in storage.list("chunks") for n in storage.list(f"chunks/{p}")}


def test_retention_keep_last_and_keep_every_on_both_tiers(rclone_server, tmp_path):
    url, so, local = s3_url(), fast(rclone_server.endpoint), str(tmp_path / "nvme")
    states = {s: state_of(300_000, seed=s) for s in range(1, 8)}
    with ckpt.Checkpointer(url, local_dir=local, storage_options=so, chunk_size=1 * MiB) as c:
        c.save(1, states[1]).wait()
    with ckpt.Checkpointer(url, local_dir=local, storage_options=so, chunk_size=1 * MiB, keep_last=2,
                           keep_every=3) as c:
        assert_loaded(c, 1, states[1])  # this run loaded step 1: never deleted
        for s in range(2, 8):
            c.save(s, states[s])
        c.wait()
        assert c.steps() == [1, 3, 6, 7]
        remote, tier = c.storage.remote, c.storage.local
        refs = set().union(*(c.manifest(s).chunks.keys() for s in c.steps()))
    assert ckpt.open(local).steps() == [1, 3, 6, 7]
    assert _chunk_names(remote) == refs and _chunk_names(tier) == refs
    with ckpt.Checkpointer(url, storage_options=so) as c:
        for s in (1, 3, 6, 7):
            assert_loaded(c, s, states[s])


RETENTION_CHILD = r"""
import os, signal, sys
from ckpt.format.manifest import ManifestCache, committed_steps
from ckpt.save.retention import delete_steps, to_delete
from ckpt.storage import open_tiered
from ckpt.format.chunk import verify_object
url, local, endpoint, kill_after = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
so = {"key": "ckpttest", "secret": "ckpttestsecret", "client_kwargs": {"endpoint_url": endpoint}}
st = open_tiered(url, local, so, verify=verify_object)
count = [0]
for tier in (st.local, st.remote):
    orig = tier.delete
    def counted(key, orig=orig):
        count[0] += 1
        if count[0] > kill_after:
            os.kill(os.getpid(), signal.SIGKILL)  # a real kill, between two deletes
        orig(key)
    tier.delete = counted
steps = committed_steps(st)
victims = to_delete(steps, 1, ())
delete_steps(st, ManifestCache(st), victims, [s for s in steps if s not in victims],
             lambda keys: [st.delete(k) for k in keys])
print("finished", count[0])
"""


@pytest.mark.multiprocess
@pytest.mark.slow
def test_retention_killed_anywhere_leaves_committed_steps_loadable(rclone_server, tmp_path):
    so = fast(rclone_server.endpoint)
    states = {s: state_of(200_000, seed=s) for s in range(1, 4)}
    finished = False
    for kill_after in (0, 2, 5, 9, 14, 1000):
        url, local = s3_url(), str(tmp_path / f"nvme{kill_after}")
        with ckpt.Checkpointer(url, local_dir=local, storage_options=so, chunk_size=256 * 1024) as c:
            for s in range(1, 4):
                c.save(s, {"w": states[s]["w"], "b": states[s]["b"], "step": s})
        r = subprocess.run([sys.executable, "-c", RETENTION_CHILD, url, local, rclone_server.endpoint,
                            str(kill_after)], capture_output=True, text=True, timeout=120)
        finished = finished or r.returncode == 0
        assert r.returncode in (0, -9), r.stderr
        with ckpt.Checkpointer(url, local_dir=local, storage_options=so) as c:
            steps = c.steps()
            assert 3 in steps
            for s in steps:
                assert_loaded(c, s, {**states[s], "step": s})
        assert ckpt.open(local).steps() in ([3], steps, [1, 2, 3], [2, 3])
    assert finished  # the largest budget let retention run to the end


def test_gc_cli_on_s3(moto_server, tmp_path):
    """`ckpt gc` works on the remote tier (orphans found by listing, ages from LastModified)."""
    from ckpt.reader import Reader, collect

    url, so = s3_url(), fast(moto_server.endpoint)
    s1 = state_of(200_000, seed=1)
    with ckpt.Checkpointer(url, storage_options=so, chunk_size=256 * 1024) as c:
        c.save(1, s1).wait()
        c.storage.write("chunks/ff/" + "f" * 32, [b"orphan"])
    cat = Reader(open_storage(url, so))
    p = collect.plan(cat, grace_s=0)
    assert [i.kind for i in p.remove] == ["orphan"]
    collect.run(cat, p)
    with ckpt.Checkpointer(url, storage_options=so) as c:
        assert_loaded(c, 1, s1)
        assert not c.storage.exists("chunks/ff/" + "f" * 32)


def test_stages_on_a_local_checkpoint_with_a_local_tier(tmp_path):
    """local_dir also works in front of a plain directory (e.g. NVMe in front of a network mount)."""
    s1 = state_of(500_000, seed=9)
    with ckpt.Checkpointer(str(tmp_path / "remote"), local_dir=str(tmp_path / "nvme"), chunk_size=256 * 1024) as c:
        h = c.save(1, s1)
        with pytest.raises(ckpt.ConfigError, match="stage"):
            h.wait("uploaded")
        h.wait("local")
        assert h.stage in ("local", "committed") and h.metrics.local_s is not None
        h.wait()
        assert h.stage == "committed"
    with pytest.raises(ckpt.ConfigError, match="local_dir"):
        ckpt.Checkpointer(str(tmp_path / "remote"), local_dir=str(tmp_path / "remote"))
    with ckpt.Checkpointer(str(tmp_path / "remote")) as c:
        assert_loaded(c, 1, s1)
