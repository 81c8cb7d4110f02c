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


# -- the bandwidth limit of the benchmark's S3 ------------------------------------------------------------

def test_token_bucket_holds_any_pattern_of_takes_to_its_rate():
    from ckpt.testing import TokenBucket

    now = [0.0]
    b = TokenBucket(1000.0, burst=100.0, clock=lambda: now[0])
    assert b.take(100) == 0.0  # the burst passes at once
    assert b.take(500) == pytest.approx(0.5)  # then each byte waits its turn
    assert b.take(250) == pytest.approx(0.75)  # a second sender's wait includes the first one's bytes
    now[0] = 0.75
    assert b.take(0) == 0.0  # paid back
    now[0] = 100.0
    assert b.take(150) == pytest.approx(0.05)  # an idle while banks no more than the burst
    # a sender that waits what it is told: B bytes take (B - burst) / rate, whatever the pieces
    for pieces in ([1] * 3000, [7, 700, 70, 2000, 223], [3000]):
        now[0] = 1000.0 + sum(pieces)
        b = TokenBucket(1000.0, burst=100.0, clock=lambda: now[0])
        start = now[0]
        for n in pieces:
            now[0] += b.take(n)
        assert now[0] - start == pytest.approx((3000 - 100) / 1000)
        assert b.taken == 3000
    with pytest.raises(ValueError, match="positive"):
        TokenBucket(0)


def _serve_once(sock, payload: bytes, got: list) -> None:
    """Upstream: take one connection, read as many bytes as it answers (like a request with its
    length), answer ``payload``, close."""
    c, _ = sock.accept()
    with c:
        n = 0
        while n < len(payload) and (data := c.recv(1 << 16)):
            n += len(data)
        got.append(n)
        c.sendall(payload)


def test_fault_proxy_rate_limits_both_directions_of_a_real_transfer():
    import socket
    import time

    from ckpt.testing import FaultProxy

    rate, size = 8 << 20, 2 << 20
    with socket.socket() as upstream:
        upstream.bind(("127.0.0.1", 0))
        upstream.listen(1)
        got: list[int] = []
        server = threading.Thread(target=_serve_once, args=(upstream, os.urandom(size), got), daemon=True)
        server.start()
        proxy = FaultProxy(upstream.getsockname()[1], rate=rate)
        try:
            t0 = time.perf_counter()
            with socket.create_connection(("127.0.0.1", proxy.port), timeout=30) as c:
                c.sendall(os.urandom(size))
                back = 0
                while data := c.recv(1 << 16):
                    back += len(data)
            elapsed = time.perf_counter() - t0
            server.join(30)
        finally:
            proxy.close()
    assert got == [size] and back == size
    assert proxy.limits["up"].taken == proxy.limits["down"].taken == size
    floor = 2 * (size - proxy.limits["up"].burst) / rate  # up, then down: never faster than the rate
    assert floor <= elapsed < floor + 20, elapsed
