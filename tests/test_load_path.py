"""The load path for chunks stored raw: the read fused with its hash, reads bounded by the storage's
width, the staged copy-back on every core, and resharding loads that read chunks only partly needed."""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
import torch.distributed as dist
import xxhash

import ckpt
from ckpt import _ext
from ckpt._tasks import run_all, threads_of
from ckpt.format import paths
from ckpt.load.apply import copy_back as _copy_back
from ckpt.testing import run_ranks

CORE = _ext.cpu()
needs_core = pytest.mark.skipif(CORE is None, reason="the compiled core is not built")


@needs_core
@pytest.mark.parametrize("length", [1, 240, 241, 1024, 1025, 256 * 1024, 256 * 1024 + 1, 3 * 256 * 1024 + 999])
@pytest.mark.parametrize("offset", [0, 7, 4096])
def test_pread_hash_reads_and_hashes_like_xxhash(tmp_path, length, offset):
    data = np.random.default_rng(length).integers(0, 256, offset + length + 5, dtype=np.uint8)
    path = tmp_path / "f"
    data.tofile(path)
    out = np.zeros(length, np.uint8)
    fd = os.open(path, os.O_RDONLY)
    try:
        n, digest = CORE.pread_hash(fd, offset, out.ctypes.data, length)
        want = data[offset:offset + length]
        assert n == length and np.array_equal(out, want)
        assert digest == (xxhash.xxh3_128_hexdigest(want.tobytes()) if length > 240 else None)
        # past the end of the file: what is there, and no hash (the caller reports the short read)
        n, digest = CORE.pread_hash(fd, offset + 6, out.ctypes.data, length)
        assert n == length - 1 and digest is None
    finally:
        os.close(fd)


@needs_core
@pytest.mark.parametrize("threads", [1, 3])
def test_copy_many_copies_every_byte_of_every_item(threads):
    rng = np.random.default_rng(threads)
    sizes = [0, 1, 63, (1 << 20) + 17, 3 << 20, 5]
    srcs = [rng.integers(0, 256, n, dtype=np.uint8) for n in sizes]
    dsts = [np.zeros(n + 8, np.uint8) for n in sizes]
    items = np.array([(d.ctypes.data + 3, s.ctypes.data, s.nbytes) for d, s in zip(dsts, srcs)], dtype=_ext.COPY)
    CORE.copy_many(items, threads)
    for d, s in zip(dsts, srcs):
        assert np.array_equal(d[3:3 + s.size], s) and not d[:3].any() and not d[3 + s.size:].any()


def test_copy_back_copies_into_tensors_that_share_memory_in_order():
    base = torch.zeros(10)
    view = base[2:6]  # overlaps base: copied one by one, in order, as torch would
    other = torch.zeros(3, dtype=torch.float64)
    pairs = [(base, torch.arange(10.0)), (view, torch.full((4,), -1.0)), (other, torch.ones(3, dtype=torch.float64))]
    _copy_back(pairs)
    assert base.tolist() == [0, 1, -1, -1, -1, -1, 6, 7, 8, 9] and other.tolist() == [1, 1, 1]


@needs_core
def test_copy_back_keeps_to_the_load_pools_threads(monkeypatch):
    """io_threads=1 is one thread: the copy-back after a load's reads uses no more threads than the
    load's I/O pool (it took every core whatever the pool)."""
    asked: list[int] = []
    real = type(CORE).copy_many
    monkeypatch.setattr(type(CORE), "copy_many", lambda self, items, n: (asked.append(n), real(self, items, n))[1])
    src = torch.arange(1 << 16, dtype=torch.float32)
    for workers in (1, 3):
        dst = torch.zeros_like(src)
        with ThreadPoolExecutor(workers) as pool:
            assert threads_of(pool) == workers
            _copy_back([(dst, src)], threads_of(pool))
        assert torch.equal(dst, src)
    assert asked[0] == 1 and 1 <= asked[1] <= 3, asked


def test_run_all_runs_at_most_width_items_at_once():
    running, most = [0], [0]
    lock = threading.Lock()
    both = threading.Barrier(2, timeout=10)

    def work(i: int) -> int:
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        if i < 2:
            both.wait()  # the first two overlap for certain: width 2 is reached, not only allowed
        time.sleep(0.001)
        with lock:
            running[0] -= 1
        return i * i

    with ThreadPoolExecutor(8) as pool:
        assert run_all(pool, work, range(20), width=2) == [i * i for i in range(20)]
    assert most[0] == 2


# -- resharding raw chunks on real ranks ---------------------------------------------------------------

CHUNK = 64 * 1024
SHAPE = (101, 3000)  # 12 000-byte rows: 64 KiB chunks end mid-row, and no split below is even
ROW = SHAPE[1] * 4


def full_value(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)  # random bits, finite: stored raw whatever the codec
    bits = torch.randint(0, 1 << 23, SHAPE, generator=g, dtype=torch.int32) | (120 << 23)
    return bits.view(torch.float32)


def sharded(seed: int | None, group) -> dict:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = DeviceMesh.from_group(group, "cpu")
    full = full_value(seed) if seed is not None else torch.zeros(SHAPE)
    return {"w": distribute_tensor(full, mesh, [Shard(0)])}


def partial_chunks(m, world: int, rank: int) -> set[str]:
    """Chunks this rank of ``world`` needs only part of (Shard(0) of SHAPE's rows)."""
    base, extra = divmod(SHAPE[0], world)
    r0 = rank * base + min(rank, extra)
    lo, hi = r0 * ROW, (r0 + base + (rank < extra)) * ROW
    out = set()
    for e in m.tensors:
        for s in e.shards:
            pos = s.offsets[0] * ROW
            for g in s.segments:
                a, b = pos, pos + g.length
                if a < hi and lo < b and not (lo <= a and b <= hi):
                    out.add(g.chunk)
                pos = b
    return out


def reshard_body(rank: int, world: int, root: str) -> dict:
    groups = {n: dist.new_group(list(range(n))) for n in (2, 3, 4)}
    for n in (2, 3, 4):
        if rank < n:
            with ckpt.Checkpointer(f"{root}/n{n}", process_group=groups[n], chunk_size=CHUNK, codec="raw",
                                   timeout=60) as c:
                c.save(1, sharded(seed=n, group=groups[n])).wait()
        dist.barrier()
    partial = {}
    for n, m in ((2, 3), (4, 3), (3, 2)):
        if rank < m:
            with ckpt.Checkpointer(f"{root}/n{n}", process_group=groups[m], timeout=60) as c:
                state = sharded(seed=None, group=groups[m])
                c.load(1, state)
                assert torch.equal(state["w"].full_tensor().view(torch.int32), full_value(n).view(torch.int32)), (n, m)
                partial[f"{n}->{m}"] = len(partial_chunks(c.manifest(1), m, rank) & set(c.last_load.chunks))
        dist.barrier()
    # A flipped byte in a chunk rank 1 of 3 needs only part of: refused on every rank, no state changed.
    if rank == 0:
        with ckpt.Checkpointer(f"{root}/n2") as c:
            h = sorted(partial_chunks(c.manifest(1), 3, 1))[0]
        with open(os.path.join(f"{root}/n2", paths.chunk_key(h)), "r+b") as f:
            f.seek(f.seek(0, os.SEEK_END) - 1)  # the payload's last byte: past any piece rank 1 copies
            last = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([last[0] ^ 1]))
    dist.barrier()
    refused = unchanged = None
    if rank < 3:
        with ckpt.Checkpointer(f"{root}/n2", process_group=groups[3], timeout=60) as c:
            state = sharded(seed=None, group=groups[3])
            with pytest.raises(ckpt.CorruptCheckpointError) as info:
                c.load(1, state)
            refused = str(info.value)
            unchanged = not state["w"].to_local().any()
    dist.barrier()
    return {"partial": partial, "refused": refused, "unchanged": unchanged}


@pytest.mark.multiprocess
@pytest.mark.slow
def test_uneven_reshards_of_raw_chunks_are_bit_exact_and_refuse_a_damaged_partial_chunk(tmp_path):
    out = run_ranks(4, reshard_body, str(tmp_path), timeout=300)
    # every rank of every uneven reshard read chunks it needed only part of, and got exact bytes
    for r in out[:2]:
        assert set(r["partial"]) == {"2->3", "4->3", "3->2"} and all(v > 0 for v in r["partial"].values()), r
    assert all(r["refused"] is not None and r["unchanged"] for r in out[:3]), out
    assert "hash check" in out[1]["refused"], out
