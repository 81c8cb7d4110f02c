"""What node loss is held to besides correctness: the memory a parity holder or rebuilder keeps
(issue 23 item 6), on four real gloo ranks; and the bandwidth limit the node-loss benchmark puts
on S3 (``ckpt.testing.FaultProxy(rate=...)``), by its token bucket's accounting and over a real
transfer."""

from __future__ import annotations

import os
import shutil
import threading
import weakref

import pytest
import torch

import ckpt
from ckpt.testing import run_ranks

ROWS, COLS = 1024, 512  # a 2 MiB float32 tensor sharded by rows: 8 chunks of 64 KiB per rank of 4
CHUNK = 64 * 1024


def _state(rank: int, world: int, step: int, zero: bool = False) -> dict:
    rows = ROWS // world
    t = torch.zeros(rows, COLS) if zero else torch.randn(rows, COLS, generator=torch.Generator().manual_seed(
        step * 100 + rank))
    return {"w": ckpt.LocalShard(t, (rank * rows, 0), (ROWS, COLS)), "step": step}


class _Meter:
    """Bytes of received buffers alive at once: each buffer counts from its arrival until the last
    view of it is gone (whoever holds it), so nothing that keeps a buffer escapes the count."""

    def __init__(self):
        self.live = self.peak = self.largest = 0
        self._lock = threading.Lock()

    def arrived(self, data: memoryview) -> None:
        n = data.nbytes
        with self._lock:
            self.live += n
            self.peak = max(self.peak, self.live)
            self.largest = max(self.largest, n)
        weakref.finalize(data.obj, self._gone, n)  # data.obj: the array that owns the received bytes

    def _gone(self, n: int) -> None:
        with self._lock:
            self.live -= n

    def take(self) -> dict:
        with self._lock:
            out = {"peak": self.peak, "largest": self.largest}
            self.peak = self.live
            self.largest = 0
        return out


def _parity_memory_body(rank: int, world: int, root: str, k: int, m: int, wiped: list[int]) -> dict:
    from ckpt.peers.exchange import Peers

    meter = _Meter()
    original = Peers.exchange

    def exchange(self, plan, read, received, stats, **rounds):
        def counted(src, item, data):
            meter.arrived(data)
            received(src, item, data)

        return original(self, plan, read, counted, stats, **rounds)

    Peers.exchange = exchange  # type: ignore[method-assign]

    def open_ckptr() -> ckpt.Checkpointer:
        return ckpt.Checkpointer(os.path.join(root, "remote"), local_dir=os.path.join(root, f"node{rank}"),
                                 redundancy=ckpt.Parity(data=k, parity=m), failure_domain=f"node{rank}",
                                 chunk_size=CHUNK, codec="raw", persist_every=100, timeout=60)

    with open_ckptr() as c:
        for step in (1, 2):  # 2 is committed only in the local tiers
            c.save(step, _state(rank, world, step)).wait()
    saved = meter.take()
    import torch.distributed as dist

    dist.barrier()
    if rank in wiped:
        shutil.rmtree(os.path.join(root, f"node{rank}"))
    dist.barrier()
    with open_ckptr() as c:
        state = _state(rank, world, 0, zero=True)
        assert c.load("latest", state) == 2
        assert torch.equal(state["w"].tensor, _state(rank, world, 2)["w"].tensor)
        st = c.last_load
        assert st is not None and st.source == "local tiers" and not st.remote_chunks
        rebuilt = st.rebuilt_chunks
    return {"save": saved, "load": meter.take(), "rebuilt": rebuilt}


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("k,m,wiped", [(2, 2, [1, 2]), (3, 1, [2])])
def test_parity_holders_and_rebuilders_keep_one_stripe_at_a_time(tmp_path, k, m, wiped):
    """A holder of parity for m stripes, and a rank rebuilding its data from k stripes of k blocks
    each, hold at most one stripe's k blocks of what they received at any time (before: every
    stripe's, m× and k× the rank's state)."""
    got = run_ranks(4, _parity_memory_body, str(tmp_path), k, m, wiped, timeout=240)
    for r, x in enumerate(got):
        stripe = k * x["save"]["largest"]  # every member's data is the same size: one block length
        assert x["save"]["peak"] == stripe, (r, x)
        if r in wiped:
            assert x["rebuilt"] == 8, (r, x)  # every chunk of its shard, rebuilt
            assert 0 < x["load"]["peak"] <= k * x["load"]["largest"], (r, x)
        else:
            assert not x["rebuilt"] and x["load"]["peak"] == 0, (r, x)
