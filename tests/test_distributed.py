"""Sharded saves on real gloo ranks, and resharding loads onto other world sizes."""

from __future__ import annotations

import errno
import math
import os
import signal
import time

import numpy as np
import pytest
import torch
import torch.distributed as dist
from conftest import tensor_entry

import ckpt
from ckpt.format import manifest as mf
from ckpt.storage.local import LocalStorage
from ckpt.testing import FaultyStorage, run_ranks

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]  # spawns processes and takes more than a few seconds

KiB = 1024
CHUNK = 64 * KiB


# -- a state that can be built for any world size -----------------------------------------------------

def rows_of(n: int, world: int, rank: int) -> tuple[int, int]:
    """Uneven split of n rows: the first n % world ranks get one more (some may get none)."""
    base, extra = divmod(n, world)
    start = rank * base + min(rank, extra)
    return start, base + (rank < extra)


GRIDS = {1: (1, 1), 2: (1, 2), 3: (3, 1), 4: (2, 2)}  # 2 ranks split columns: a strided reshard


def block_of(shape, world: int, rank: int) -> tuple[tuple[int, int], tuple[int, int]]:
    gr, gc = GRIDS[world]
    (r0, nr), (c0, nc) = rows_of(shape[0], gr, rank // gc), rows_of(shape[1], gc, rank % gc)
    return (r0, c0), (nr, nc)


def global_value(name: str, shape, dtype) -> torch.Tensor:
    n = math.prod(shape)
    base = torch.arange(n, dtype=torch.float64).reshape(shape)
    if dtype == torch.bool:
        return (torch.arange(n) % 3 == 0).reshape(shape)
    if dtype.is_floating_point:
        return (base * 0.25 + len(name)).to(dtype)
    return (base * 7 + len(name)).to(dtype)


SHARDED = {  # name -> (global shape, dtype, how it is split)
    "big": ((100, 2000), torch.float32, "rows"),  # 800 KB: several 64 KiB chunks per shard
    "grid": ((6, 9), torch.float64, "grid"),
    "tiny": ((2, 3), torch.int64, "rows"),  # empty shards on 3 and 4 ranks
}
REPLICATED = {"bf": ((7,), torch.bfloat16), "flag": ((), torch.bool), "scalar": ((), torch.float32)}


def box_of(name: str, world: int, rank: int):
    shape, _, how = SHARDED[name]
    if how == "rows":
        r0, nr = rows_of(shape[0], world, rank)
        return (r0, 0), (nr, shape[1])
    return block_of(shape, world, rank)


def build_state(world: int, rank: int, filled: bool) -> dict:
    shards = {}
    for name, (shape, dtype, _) in SHARDED.items():
        offs, lens = box_of(name, world, rank)
        full = global_value(name, shape, dtype)
        local = full[tuple(slice(o, o + n) for o, n in zip(offs, lens))].clone()
        if not filled:
            local.zero_()
        shards[name] = ckpt.LocalShard(local, offs, shape)
    plain = {}
    for name, (shape, dtype) in REPLICATED.items():
        t = global_value(name, shape, dtype)
        plain[name] = t if filled else torch.zeros_like(t)
    pos = {"index": 100 + rank, "buf": torch.full((rank + 1,), float(rank))} if filled else {"index": -1, "buf": None}
    return {"shards": shards, "plain": plain, "meta": {"lr": 0.1, "tag": "x"} if filled else {},
            "pos": ckpt.PerRank(pos)}


def check_state(state: dict, world: int, rank: int, src_rank: int) -> None:
    for name, (shape, dtype, _) in SHARDED.items():
        offs, lens = box_of(name, world, rank)
        want = global_value(name, shape, dtype)[tuple(slice(o, o + n) for o, n in zip(offs, lens))]
        assert torch.equal(state["shards"][name].tensor, want), (name, world, rank)
    for name, (shape, dtype) in REPLICATED.items():
        assert torch.equal(state["plain"][name], global_value(name, shape, dtype)), name
    assert state["meta"] == {"lr": 0.1, "tag": "x"}
    pos = state["pos"].value
    assert pos["index"] == 100 + src_rank
    assert torch.equal(pos["buf"], torch.full((src_rank + 1,), float(src_rank)))


def expected_chunks(m: mf.Manifest, world: int, rank: int, src_rank: int) -> set[str]:
    """Brute force: the chunks holding at least one element this rank needs."""
    need = set()
    for e in m.tensors:
        if e.rank is not None:
            if e.rank == src_rank:
                need |= {g.chunk for s in e.shards for g in s.segments}
            continue
        name = e.key.split("/")[-1]
        if name in SHARDED:
            dbox = box_of(name, world, rank)
        else:
            dbox = ((0,) * len(e.shape), tuple(e.shape))
        item = ckpt.tree.DTYPES[e.dtype].itemsize
        for s in e.shards:
            mask = np.zeros(s.lengths, dtype=bool)
            sl = []
            for do, dn, so, sn in zip(dbox[0], dbox[1], s.offsets, s.lengths):
                lo, hi = max(do, so), min(do + dn, so + sn)
                sl.append(slice(max(lo - so, 0), max(hi - so, 0)))
            mask[tuple(sl)] = True
            flat, pos = mask.reshape(-1), 0
            for g in s.segments:
                if flat[pos // item: -(-(pos + g.length) // item)].any():
                    need.add(g.chunk)
                pos += g.length
    return need


def matrix_body(rank: int, world: int, root: str) -> int:
    """Save on N = 1..4 ranks, then load each checkpoint on M = 1..4 ranks (process subgroups)."""
    checks = 0
    groups = {n: dist.new_group(list(range(n))) for n in range(1, world + 1)}
    for n in range(1, world + 1):
        if rank < n:
            with ckpt.Checkpointer(f"{root}/n{n}", process_group=groups[n], chunk_size=CHUNK, timeout=60) as c:
                assert c.world_size == n
                c.save(7, build_state(n, rank, filled=True)).wait()
        dist.barrier()
    for m in range(1, world + 1):
        for n in range(1, world + 1):
            if rank < m:
                with ckpt.Checkpointer(f"{root}/n{n}", process_group=groups[m], timeout=60) as c:
                    state = build_state(m, rank, filled=False)
                    if m != n:
                        with pytest.raises(ckpt.ReshardError, match="rank_map"):
                            c.load(7, state)
                    assert c.load("latest", state, rank_map=lambda r, n=n: r % n) == 7
                    check_state(state, m, rank, rank % n)
                    want = expected_chunks(c.manifest(7), m, rank, rank % n)
                    assert set(c.last_load.chunks) == want, (n, m, rank)
                    if m > 1:  # a rank of several reads only part of the checkpoint
                        assert want < set(c.manifest(7).chunks), (n, m, rank)
                    checks += 1
            dist.barrier()
    return checks


def test_every_world_size_loads_every_other(tmp_path):
    checks = run_ranks(4, matrix_body, str(tmp_path), timeout=300)
    assert checks == [4 * 4, 3 * 4, 2 * 4, 1 * 4]
    # One process, no process group: the whole checkpoint of any world size, for export.
    for n in range(1, 5):
        c = ckpt.Checkpointer(tmp_path / f"n{n}")
        m = c.manifest(7)
        assert m.world_size == n and set(m.per_rank_keys) == {"pos"}
        state = build_state(1, 0, filled=False)
        c.load(7, state, rank_map=lambda r: 0)
        check_state(state, 1, 0, 0)
        # a sharded tensor is written once: its shards' bytes add up to the tensor
        big = tensor_entry(m, "shards/big")
        assert sum(g.length for s in big.shards for g in s.segments) == 100 * 2000 * 4
        c.close()


# -- DTensor: FSDP2 and 2-D meshes ------------------------------------------------------------------------

def make_mlp(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(10, 13), torch.nn.ReLU(), torch.nn.Linear(13, 5))


def full_values(state: dict) -> dict[str, np.ndarray]:
    from torch.distributed.tensor import DTensor

    out = {}
    for k, v in state["model"].state_dict().items():
        out[f"model/{k}"] = (v.full_tensor() if isinstance(v, DTensor) else v).detach().numpy().copy()
    for pid, st in state["optim"].state_dict()["state"].items():
        for k, v in st.items():
            out[f"optim/{pid}/{k}"] = (v.full_tensor() if isinstance(v, DTensor) else v).detach().numpy().copy()
    for k, v in state["dt"].items():
        out[f"dt/{k}"] = (v.full_tensor() if isinstance(v, DTensor) else v).numpy().copy()
    return out


DT_SHAPES = {"a": (6, 10), "b": (9, 4), "c": (5, 7)}


def dtensor_state(world: int, seed: int, train: bool) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh1 = init_device_mesh("cpu", (world,))
    model = make_mlp(seed)
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh1)
    fully_shard(model, mesh=mesh1)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    if train:
        g = torch.Generator().manual_seed(1)
        for _ in range(3):
            opt.zero_grad()
            model(torch.randn(8, 10, generator=g)).pow(2).mean().backward()
            opt.step()
    if world == 4:
        mesh = init_device_mesh("cpu", (2, 2))
        placements = {"a": [Shard(0), Shard(1)], "b": [Replicate(), Shard(0)], "c": [Shard(1), Replicate()]}
    else:
        mesh = mesh1
        placements = {"a": [Shard(1)], "b": [Shard(0)], "c": [Replicate()]}
    dt = {}
    for k, shape in DT_SHAPES.items():
        full = global_value(k, shape, torch.float32) if train else torch.zeros(shape)
        dt[k] = distribute_tensor(full, mesh, placements[k])
    return {"model": model, "optim": opt, "dt": dt, "rng": ckpt.RNGState()}


def fsdp_save_body(rank: int, world: int, root: str):
    state = dtensor_state(world, seed=0, train=True)
    with ckpt.Checkpointer(root, timeout=60) as c:
        c.save(3, state).wait()
    return full_values(state)


def fsdp_load_body(rank: int, world: int, root: str):
    state = dtensor_state(world, seed=5, train=False)
    with ckpt.Checkpointer(root, timeout=60) as c:
        assert c.load("latest", state, rank_map=lambda r: r) == 3
    from torch.distributed.tensor import DTensor

    assert isinstance(state["model"][0].weight, DTensor)  # still sharded after the load
    # and training goes on from the loaded state
    opt = state["optim"]
    opt.zero_grad()
    state["model"](torch.ones(2, 10)).sum().backward()
    opt.step()
    return full_values(state)


def test_fsdp2_and_2d_mesh_dtensors_reshard(tmp_path):
    saved = run_ranks(4, fsdp_save_body, str(tmp_path), timeout=300)
    want = saved[0]
    for r in range(1, 4):
        assert all(np.array_equal(want[k], saved[r][k]) for k in want)
    m = ckpt.open(tmp_path).manifest(3)
    a = tensor_entry(m, "dt/a")
    assert a.shape == [6, 10] and len(a.shards) == 4  # 2x2 blocks
    assert len(tensor_entry(m, "dt/c").shards) == 2  # replicated on one mesh dim: written once per box
    assert len(tensor_entry(m, "model/0.weight").shards) == 4

    # 4 -> 2 ranks with FSDP2: same values (checked through a step of training on both sides)
    loaded = run_ranks(2, fsdp_load_body, str(tmp_path), timeout=300)
    assert loaded[0].keys() == loaded[1].keys()

    # 4 -> 1 process without a process group, into a plain model and optimizer
    model = make_mlp(seed=9)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    plain = {"model": model, "optim": opt, "dt": {k: torch.zeros(s) for k, s in DT_SHAPES.items()},
             "rng": ckpt.RNGState()}
    with ckpt.Checkpointer(tmp_path) as c:
        with pytest.raises(ckpt.ReshardError, match="rng"):
            c.load(3, plain)
        c.load(3, plain, rank_map=lambda r: 0)
    got = full_values(plain)
    assert got.keys() == want.keys()
    for k in want:
        assert np.array_equal(got[k], want[k]), k

    # the 2-rank run trained one more step from the loaded state: do the same here and compare
    opt.zero_grad()
    model(torch.ones(2, 10)).sum().backward()
    opt.step()
    after = full_values(plain)
    for k in after:
        assert np.allclose(after[k], loaded[0][k], rtol=1e-6, atol=1e-7), k


# -- failures -----------------------------------------------------------------------------------------

def small_state(rank: int, world: int, step: int) -> dict:
    r0, nr = rows_of(30, world, rank)
    local = torch.arange(r0 * 50, (r0 + nr) * 50, dtype=torch.float32).reshape(nr, 50) + step * 1000
    return {"w": ckpt.LocalShard(local, (r0, 0), (30, 50)), "bias": torch.full((40,), float(step)),
            "step": step}


def failure_body(rank: int, world: int, root: str):
    disk = FaultyStorage(LocalStorage(root))
    c = ckpt.Checkpointer(root, timeout=30, chunk_size=CHUNK, storage=disk)
    c.save(1, small_state(rank, world, 1)).wait()
    if rank == 1:  # rank 1's disk fills up: its chunk writes of step 2 fail
        disk.fail("write", key=r"^chunks/", exc=lambda op, key: OSError(errno.ENOSPC, "No space left on device"))
    h = c.save(2, small_state(rank, world, 2))
    with pytest.raises(ckpt.DistributedSaveError) as info:
        h.wait()
    disk.clear()
    assert c.save(3, small_state(rank, world, 3)).wait().step == 3  # the next save works
    assert c.layouts_made == 1  # steady-state saves reuse the plan
    c.close()
    return {"ranks": info.value.ranks, "message": str(info.value)}


def test_a_failure_on_one_rank_reaches_every_rank(tmp_path):
    out = run_ranks(3, failure_body, str(tmp_path))
    for r in out:
        assert r["ranks"] == [1]
        assert "No space left" in r["message"] and "step 2" in r["message"]
    c = ckpt.Checkpointer(tmp_path)
    assert c.steps() == [1, 3]
    state = {"w": ckpt.LocalShard(torch.zeros(30, 50), (0, 0), (30, 50)), "bias": torch.zeros(40), "step": 0}
    c.load(3, state)
    assert torch.equal(state["w"].tensor, torch.arange(1500, dtype=torch.float32).reshape(30, 50) + 3000)
    assert state["step"] == 3


def unseen_failure_body(rank: int, world: int, root: str):
    disk = FaultyStorage(LocalStorage(root))
    c = ckpt.Checkpointer(root, timeout=30, chunk_size=CHUNK, storage=disk)
    c.save(1, small_state(rank, world, 1)).wait()
    if rank == 1:  # rank 1's disk fails one chunk write of step 2
        disk.fail("write", key=r"^chunks/", nth=1, exc=lambda op, key: OSError(errno.ENOSPC, "No space left on device"))
    h2 = c.save(2, small_state(rank, world, 2))  # nobody waits for it
    if rank == 0:
        h2.settle()  # rank 0 knows of the failure at its next save; the others may not yet
    raised = []
    for step in range(3, 9):
        try:
            c.save(step, small_state(rank, world, step))
        except ckpt.CheckpointError as e:
            raised.append((step, str(e)))
    c.wait()
    c.close()
    return {"raised": raised, "steps": ckpt.open(root).steps()}


def test_a_failure_nobody_waited_for_is_raised_once_per_rank_and_the_ranks_agree_again(tmp_path):
    """Issue 33 item 2 with several ranks: the failure is raised at a later save() on each rank (when
    that rank learns of it), a save refused for it fails on the other ranks without being raised again
    there, and the ranks save together again within a few steps (no ping-pong of refusals, no hang)."""
    out = run_ranks(3, unseen_failure_body, str(tmp_path))
    for r in out:
        assert len(r["raised"]) == 1 and "No space left" in r["raised"][0][1], r
        assert set(r["steps"]) >= {1, 7, 8} and 2 not in r["steps"], r


def wide_state(rank: int, world: int, step: int) -> dict:
    """64 x 1024 float32 split by rows: each rank's rows fill chunks of their own."""
    r0, nr = rows_of(64, world, rank)
    local = torch.arange(r0 * 1024, (r0 + nr) * 1024, dtype=torch.float32).reshape(nr, 1024) + step * 1e6
    return {"w": ckpt.LocalShard(local, (r0, 0), (64, 1024)), "step": step}


def damaged_for_one_rank_body(rank: int, world: int, root: str) -> dict:
    with ckpt.Checkpointer(root, chunk_size=CHUNK, codec="raw") as c:
        c.save(1, wide_state(rank, world, 1)).wait()
        c.save(2, wide_state(rank, world, 2)).wait()
        dist.barrier()
        if rank == 0:  # a flipped byte in a chunk only rank 1's rows use
            entry = tensor_entry(c.manifest(2), "w")
            h = next(g.chunk for sh in entry.shards if sh.offsets[0] >= 32 for g in sh.segments)
            with open(os.path.join(root, "chunks", h[:2], h), "r+b") as f:
                f.seek(100)
                f.write(b"\xff")
        dist.barrier()
        state = wide_state(rank, world, 1)
        with pytest.raises(ckpt.CorruptCheckpointError) as info:
            c.load(2, state)
        unchanged = torch.equal(state["w"].tensor, wide_state(rank, world, 1)["w"].tensor) and state["step"] == 1
        c.save(3, state).wait()  # nothing changed on any rank: saving goes on
        return {"unchanged": unchanged, "message": str(info.value)}


def test_a_load_that_fails_on_one_rank_changes_no_rank(tmp_path):
    """Ranks agree that every chunk checked out everywhere before any rank writes its state: rank 0
    read all its chunks cleanly, yet keeps its state because rank 1's chunk was damaged."""
    out = run_ranks(2, damaged_for_one_rank_body, str(tmp_path), timeout=120)
    assert all(r["unchanged"] for r in out), out
    assert "rank(s) [1]" in out[0]["message"]


TIMEOUT = 4.0


class DyingDisk(LocalStorage):
    """A local disk that kills its own process (SIGKILL) at the first chunk write once ``armed``."""

    armed = False

    def create(self, key, buffers):  # how new chunks are written
        if self.armed and key.startswith("chunks/"):
            os.kill(os.getpid(), signal.SIGKILL)
        return super().create(key, buffers)


def killed_body(rank: int, world: int, root: str, victim: int):
    disk = DyingDisk(root)
    c = ckpt.Checkpointer(root, timeout=TIMEOUT, chunk_size=CHUNK, storage=disk)
    c.save(1, small_state(rank, world, 1)).wait()
    dist.barrier()  # every rank has seen step 1 committed (rank 0 hosts the store: its death ends it)
    disk.armed = rank == victim
    started = time.monotonic()
    h = c.save(2, small_state(rank, world, 2))
    with pytest.raises(ckpt.DistributedSaveError) as info:
        h.wait()
    return {"ranks": info.value.ranks, "elapsed": time.monotonic() - started, "message": str(info.value)}


@pytest.mark.parametrize("victim", [2, 0], ids=["rank2", "coordinator"])
def test_a_killed_rank_fails_the_save_on_the_others_in_bounded_time(tmp_path, victim):
    out = run_ranks(3, killed_body, str(tmp_path), victim, may_die=(victim,), timeout=120)
    assert out[victim] is None  # it really died
    for r in (r for i, r in enumerate(out) if i != victim):
        assert r["ranks"] == [victim], r
        assert r["elapsed"] < 3 * TIMEOUT + 5, r
    c = ckpt.Checkpointer(tmp_path)
    assert c.steps() == [1]  # step 2 was not committed
    state = {"w": ckpt.LocalShard(torch.zeros(30, 50), (0, 0), (30, 50)), "bias": torch.zeros(40), "step": 0}
    c.load("latest", state)
    assert state["step"] == 1 and torch.equal(state["bias"], torch.ones(40))


def retention_body(rank: int, world: int, root: str):
    with ckpt.Checkpointer(root, keep_last=2, timeout=60, chunk_size=CHUNK) as c:
        for step in range(1, 7):
            c.save(step, small_state(rank, world, step % 4))  # steps 4 and 5 repeat the values of 0 and 1
        c.wait()
        plans = c.layouts_made
    return plans


def test_retention_across_ranks_keeps_exactly_what_is_referenced(tmp_path):
    assert run_ranks(3, retention_body, str(tmp_path)) == [1, 1, 1]
    c = ckpt.Checkpointer(tmp_path)
    assert c.steps() == [5, 6]
    referenced = set()
    for s in c.steps():
        referenced |= c.manifest(s).chunks.keys()
    stored = {p.name for p in (tmp_path / "chunks").rglob("*") if p.is_file()}
    assert stored == referenced
    for s in c.steps():
        state = {"w": ckpt.LocalShard(torch.zeros(30, 50), (0, 0), (30, 50)), "bias": torch.zeros(40), "step": 0}
        c.load(s, state)
        assert state["step"] == s % 4


def skip_body(rank: int, world: int, root: str):
    disk = FaultyStorage(LocalStorage(root))
    c = ckpt.Checkpointer(root, timeout=30, busy="skip", chunk_size=CHUNK, storage=disk)
    if rank == 1:  # rank 1's first save is held mid-write, so its next save finds the buffer busy
        disk.gate("write", key=r"^chunks/")
    h1 = c.save(1, small_state(rank, world, 1))
    h2 = c.save(2, small_state(rank, world, 2))
    skipped_here = h2.skipped
    disk.clear()  # opens the gate
    h1.wait()
    h2.wait()  # on every rank: no error, just skipped
    c.save(3, small_state(rank, world, 3)).wait()
    c.close()
    return {"skipped_here": skipped_here, "skipped": h2.skipped}


def test_a_rank_that_skips_makes_the_step_skipped_everywhere(tmp_path):
    out = run_ranks(3, skip_body, str(tmp_path))
    assert out[1]["skipped_here"]
    assert all(r["skipped"] for r in out)
    assert ckpt.open(tmp_path).steps() == [1, 3]


def diverging_body(rank: int, world: int, root: str):
    with ckpt.Checkpointer(root, timeout=30) as c:
        c.save(1, {"w": torch.ones(3), "epoch": {"pos": 5}})  # the same everywhere: stored once
        c.save(2, {"w": torch.ones(3), "epoch": {"pos": 10 + rank}})  # now per rank: every value kept
        c.wait()
        mine = {"w": torch.zeros(3), "epoch": {}}
        c.load(2, mine)
    return mine["epoch"]["pos"]


def test_plain_values_that_start_to_differ_between_ranks_are_all_kept(tmp_path):
    assert run_ranks(2, diverging_body, str(tmp_path)) == [10, 11]
    c = ckpt.Checkpointer(tmp_path)
    assert c.manifest(1).per_rank_keys == [] and c.manifest(1).format_version == 6  # saved by 2 ranks: an index
    assert c.manifest(2).per_rank_keys == ["epoch"]
    state = {"w": torch.zeros(3), "epoch": {}}
    with pytest.raises(ckpt.ReshardError, match="epoch"):
        c.load(2, state)
    c.load(2, state, rank_map=[1])
    assert state["epoch"] == {"pos": 11} and torch.equal(state["w"], torch.ones(3))


def reserve_body(rank: int, world: int, root: str) -> bool:
    """A rank that loads what it then writes (its own box of every tensor) keeps the load's staging
    memory for its first save's host buffer: the page faults are paid once."""
    rows = 256
    def state(value):
        return {"w": ckpt.LocalShard(torch.full((rows, 1024), value), (rank * rows, 0), (world * rows, 1024))}
    with ckpt.Checkpointer(root, process_group=dist.group.WORLD) as c:
        c.save(1, state(float(rank))).wait()
    with ckpt.Checkpointer(root, process_group=dist.group.WORLD) as c:
        loaded = state(-1.0)
        c.load(1, loaded)
        assert torch.equal(loaded["w"].tensor, torch.full((rows, 1024), float(rank)))
        staging = c._snapshots.reserve
        assert staging is not None
        c.save(2, loaded).wait()
        return c._snapshots.buffer.buffer.data_ptr() == staging.data_ptr()


def test_a_rank_keeps_its_load_staging_memory_for_its_first_save(tmp_path):
    assert run_ranks(2, reserve_body, str(tmp_path)) == [True, True]
