"""How a load from the local tiers gets what a rank's tier lost (issue 23 item 6): a peer's chunks
are used as they arrive while the rank reads its own (the exchange runs beside the reads, not before
them), and the heal after a load from the checkpoint path writes back the bytes the load already
downloaded instead of downloading them again."""

from __future__ import annotations

import glob
import os
import shutil
import threading
from datetime import timedelta

import pytest
import torch
from conftest import BUCKET, fast
from test_nodeloss_bounds import CHUNK, _state  # the same 4-rank sharded state

import ckpt
from ckpt.errors import CheckpointError, CorruptCheckpointError
from ckpt.storage.held import HeldChunks
from ckpt.testing import FaultProxy, run_ranks


def _ckptr(root: str, rank: int) -> ckpt.Checkpointer:
    return ckpt.Checkpointer(os.path.join(root, "remote"), local_dir=os.path.join(root, f"node{rank}"),
                             redundancy=ckpt.Replicas(2), failure_domain=f"node{rank}", chunk_size=CHUNK,
                             codec="raw", persist_every=100, timeout=60)


def _save_body(rank: int, world: int, root: str) -> None:
    with _ckptr(root, rank) as c:
        c.save(1, _state(rank, world, 1)).wait()
        c.save(2, _state(rank, world, 2)).wait()


def _gated_load_body(rank: int, world: int, root: str, store_port: int) -> dict:
    """Node 3 sends node 2 the chunks node 2's tier lost only once node 2 has read one of the chunks
    it kept (a real TCPStore key between the processes): a load that read nothing before its peer's
    chunks were all in would wait for node 3, and node 3 for it, until node 3 gives up."""
    import torch.distributed as dist

    from ckpt.peers.exchange import Peers
    from ckpt.storage.local import LocalStorage

    store = dist.TCPStore("127.0.0.1", store_port, is_master=False, timeout=timedelta(seconds=60))
    if rank == 2:
        plain_readv = LocalStorage.readv

        def readv(self, key, buffers, offset=0):
            n = plain_readv(self, key, buffers, offset)
            if key.startswith("chunks/"):
                store.set("node2-read-its-own", "1")
            return n

        LocalStorage.readv = readv  # type: ignore[method-assign]
    if rank == 3:
        plain_exchange = Peers.exchange

        def exchange(self, plan, read, received, stats, **rounds):
            def gated(item, out):
                try:
                    store.wait(["node2-read-its-own"], timedelta(seconds=15))
                except Exception as e:  # the store's timeout: this rank's read fails, every rank is told
                    raise CorruptCheckpointError(f"node 2 read nothing of its own while waiting: {e}") from e
                return read(item, out)

            return plain_exchange(self, plan, gated, received, stats, **rounds)

        Peers.exchange = exchange  # type: ignore[method-assign]
    with _ckptr(root, rank) as c:
        state = _state(rank, world, 0, zero=True)
        try:
            step = c.load("latest", state)
        except CheckpointError as e:
            return {"error": f"{type(e).__name__}: {e}"}
        st = c.last_load
        assert st is not None
        exact = torch.equal(state["w"].tensor, _state(rank, world, 2)["w"].tensor)
        return {"step": step, "exact": exact, "peer": st.peer_chunks, "local": st.local_chunks,
                "remote": st.remote_chunks}


@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_rank_reads_its_own_chunks_while_a_peers_are_still_coming(tmp_path):
    root = str(tmp_path)
    run_ranks(4, _save_body, root)
    chunks = sorted(glob.glob(os.path.join(root, "node2", "chunks", "*", "*")))
    for p in chunks[::2]:  # node 2 keeps some of its chunks, loses the others
        os.remove(p)
    store = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    got = run_ranks(4, _gated_load_body, root, store.port, timeout=150)
    assert all("error" not in g for g in got), got
    assert all(g["step"] == 2 and g["exact"] and g["remote"] == 0 for g in got), got
    assert got[2]["peer"] > 0 and got[2]["local"] > 0, got[2]


def test_a_load_from_the_checkpoint_path_is_not_downloaded_again_to_heal_the_tier(tmp_path, rclone_server):
    """A tier that lost chunks of an uploaded step loads them from S3 (a real local server, reached
    through a proxy that counts the bytes), and the heal behind the load writes those same bytes
    back: what comes down is what the load needed once, not twice."""
    proxy = FaultProxy(rclone_server.port, rate=1e12)  # counts, never limits
    url = f"s3://{BUCKET}/heal-{os.urandom(4).hex()}"
    local = str(tmp_path / "local")
    try:
        opts = fast(proxy.endpoint)
        with ckpt.Checkpointer(url, storage_options=opts, local_dir=local, persist_every=2, chunk_size=CHUNK,
                               codec="raw") as c:
            c.save(1, _state(0, 1, 1))
        chunks = sorted(glob.glob(os.path.join(local, "chunks", "*", "*")))
        lost = chunks[::2]
        lost_bytes = sum(os.path.getsize(p) for p in lost)
        for p in lost:
            os.remove(p)
        before = proxy.limits["down"].taken
        with ckpt.Checkpointer(url, storage_options=opts, local_dir=local, persist_every=2, chunk_size=CHUNK,
                               codec="raw") as c:
            state = _state(0, 1, 0, zero=True)
            assert c.load("latest", state) == 1
            assert c.last_load is not None and c.last_load.remote_chunks == len(lost)
            c.wait()  # the heal
            down = proxy.limits["down"].taken - before
        assert torch.equal(state["w"].tensor, _state(0, 1, 1)["w"].tensor)
        assert all(os.path.exists(p) for p in chunks)
        # the lost chunks once, plus manifests, listings and HTTP headers: well under twice
        assert lost_bytes <= down < 1.3 * lost_bytes, (down, lost_bytes)
    finally:
        proxy.close()


# -- HeldChunks: the memory in front of the tiers --------------------------------------------------

def test_a_read_of_a_coming_chunk_waits_for_it():
    held = HeldChunks()
    held.expect(["chunks/ab/x"])
    got: list = []
    reader = threading.Thread(target=lambda: got.append(held.get("chunks/ab/x")))
    reader.start()
    held.hold("chunks/ab/x", memoryview(b"bytes"))
    reader.join()
    assert bytes(got[0]) == b"bytes"
    assert held.get("chunks/cd/y") is None  # never expected: the tiers answer


def test_a_chunk_the_fetch_gives_up_on_goes_to_the_tiers_or_raises_its_error():
    held = HeldChunks()
    held.expect(["chunks/ab/x", "chunks/ab/y"])
    results: list = []

    def read(key: str) -> None:
        try:
            results.append(held.get(key))
        except CheckpointError as e:
            results.append(e)

    readers = [threading.Thread(target=read, args=(k,)) for k in ("chunks/ab/x", "chunks/ab/y")]
    for t in readers:
        t.start()
    held.not_coming(["chunks/ab/x"])  # read from the checkpoint path instead
    held.not_coming(error=CorruptCheckpointError("node 3's copy is damaged"))
    for t in readers:
        t.join()
    assert None in results
    err = next(r for r in results if r is not None)
    assert isinstance(err, CorruptCheckpointError) and "chunks/ab/y" in str(err) and "damaged" in str(err)
    held.release(["chunks/ab/y"])
    assert held.get("chunks/ab/y") is None


def test_captured_remote_reads_make_the_object_only_when_they_cover_it():
    held = HeldChunks()
    held.capture(["chunks/ab/x"])
    held.read_remotely("chunks/cd/y", 0, [b"not captured"], 12)
    assert held.captured("chunks/cd/y") is None
    held.read_remotely("chunks/ab/x", 4, [bytearray(b"4567"), bytearray(b"89zz")], 6)  # a short read
    assert held.captured("chunks/ab/x") is None  # bytes 0..4 were never read
    held.read_remotely("chunks/ab/x", 0, [b"0123"], 4)
    assert held.captured("chunks/ab/x") == b"0123456789"
    held.release(["chunks/ab/x"])
    assert held.captured("chunks/ab/x") is None


def _load_or_error(rank: int, world: int, root: str) -> dict:
    with _ckptr(root, rank) as c:
        try:
            return {"step": c.load("latest", _state(rank, world, 0, zero=True))}
        except CheckpointError as e:
            return {"error": type(e).__name__, "message": str(e)}


@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_replica_longer_than_its_chunk_fails_the_load_naming_its_length(tmp_path):
    """The holder reads what it sends into a buffer of the manifest's size: a copy with bytes
    appended would fit it and check out, so one byte past is read to tell."""
    root = str(tmp_path)
    run_ranks(4, _save_body, root)
    mine = {os.path.basename(p) for p in glob.glob(os.path.join(root, "node2", "chunks", "*", "*"))}
    shutil.rmtree(os.path.join(root, "node2"))
    grown = 0
    for p in glob.glob(os.path.join(root, "node3", "chunks", "*", "*")):
        if os.path.basename(p) in mine:
            with open(p, "ab") as f:
                f.write(b"\0" * 16)
            grown += 1
    assert grown
    got = run_ranks(4, _load_or_error, root, timeout=120)
    assert all(g.get("error") == "CorruptCheckpointError" for g in got), got
    assert any("more than" in g["message"] for g in got), got
