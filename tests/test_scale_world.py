"""Issue 35 item 9 (about 15 s on 2 cores: ranks fork from a warm server): 16 real gloo ranks save a
small state, 8 of them load it, and what they cost the store and the storage, counted there per rank
and round, is what benchmarks/scale.py counts for its simulated ranks. So the benchmark's request and
byte counts are those of the real code at this world size, and its fitted laws extrapolate real
counts."""

from __future__ import annotations

import os
import sys
from collections import Counter

import pytest
import torch

import ckpt
from ckpt.format import manifest as mf
from ckpt.format import paths
from ckpt.load.index_reads import step_for_load
from ckpt.ranks import StoreComm
from ckpt.storage import LocalStorage
from ckpt.testing import FaultyStorage, run_ranks

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

READS = ("read", "readv", "read_object")

BIG, SMALL = 16, 8  # ranks that save, ranks that load


class _Counting(StoreComm):
    """A real rank's Comm counting its requests per round name (``go``, ``commit``, ``agree``, ...) as
    the benchmark's simulated store does (benchmarks/scale_counting.py: a set, get, delete, add is one)."""

    tally: Counter

    def _count(self, key: str) -> None:
        self.tally[key.split("/")[0]] += 1

    def _put(self, key: str, value: bytes) -> None:
        self._count(key)
        super()._put(key, value)

    def _get(self, key: str, deadline: float) -> bytes | None:
        self._count(key)
        return super()._get(key, deadline)

    def _delete(self, key: str) -> bool:
        self._count(key)
        return super()._delete(key)

    def _compare_set(self, key: str, value: bytes) -> bytes:
        self._count(key)
        return super()._compare_set(key, value)

    def _add(self, key: str, amount: int) -> int:
        self._count(key)
        return super()._add(key, amount)


class _Sized(FaultyStorage):
    """Bytes read per key (what a rank GETs of the step's metadata)."""

    def __init__(self, inner):
        super().__init__(inner)
        self.got: Counter = Counter()

    def read_object(self, key: str, limit: int):
        out = super().read_object(key, limit)
        self.got[key] += len(out)
        return out

    def read(self, key: str, start: int | None = None, end: int | None = None):
        out = super().read(key, start, end)
        self.got[key] += len(out)
        return out


def _counted(ckptr: ckpt.Checkpointer) -> Counter:
    comm = ckptr._comm
    comm.__class__ = _Counting
    comm.tally = Counter()  # type: ignore[attr-defined]
    return comm.tally  # type: ignore[attr-defined]


def _shard(rank: int, world: int, fill: float) -> dict:
    rows = 48 // world
    return {"w": ckpt.LocalShard(torch.full((rows, 4), fill + rank), offsets=(rank * rows, 0), global_shape=(48, 4)),
            "step": torch.tensor(3.0)}


def _save_big_load_small(rank: int, world: int, root: str) -> dict:
    import torch.distributed as dist

    ckptr = ckpt.Checkpointer(root, timeout=120)
    saves = _counted(ckptr)
    ckptr.save(1, _shard(rank, world, 0.0)).wait()  # the plan, go and commit rounds
    plan = dict(saves)
    saves.clear()
    ckptr.save(2, _shard(rank, world, 0.0)).wait()  # a steady save: go and commit
    ckptr.close()
    out = {"plan": plan, "save": dict(saves)}
    group = dist.new_group(list(range(SMALL)))  # every rank makes it, the first SMALL load on it
    if rank < SMALL:
        disk = _Sized(LocalStorage(root))
        loader = ckpt.Checkpointer(root, storage=disk, process_group=group, timeout=120)
        loads = _counted(loader)
        disk.reset_counts()
        back = _shard(rank, SMALL, -1.0)
        assert loader.load("latest", back) == 2
        rows, saved = 48 // SMALL, 48 // BIG  # saved rank r's rows hold r
        assert back["w"].tensor[:, 0].tolist() == [float(g // saved) for g in range(rank * rows, (rank + 1) * rows)]
        loader.close()
        out.update(load=dict(loads), meta={k: v for k, v in disk.got.items() if not paths.is_chunk_key(k)},
                   meta_requests=sum(1 for op, k in disk.log if op in READS and not paths.is_chunk_key(k)))
    return out


def test_real_ranks_cost_the_store_and_storage_what_the_scale_benchmark_counts(tmp_path):
    """Item 9: 16 gloo ranks save a small state (its first save plans), 8 of them load it; per rank
    and round, the store requests counted there are those benchmarks/scale.py counts for its
    simulated ranks (``scale_sim.rounds`` and its plan round), and the step metadata each loading
    rank GETs is what the benchmark's one-rank load GETs (``read_step`` on a counting storage)."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
    import scale_counting
    import scale_sim

    root = str(tmp_path / "ck")
    got = run_ranks(BIG, _save_big_load_small, root)
    save, load = scale_sim.rounds(BIG)["save"], scale_sim.rounds(SMALL)["load"]
    sim = scale_sim.save_and_load(scale_sim.MODELS["tiny"], "fsdp", BIG, str(tmp_path / "sim"), 64 * 1024)
    plan = sim["plan_store"]

    def check(which: str, ranks: int, predicted: dict, rounds: set[str]) -> None:
        per_rank = [sum(n for k, n in got[r][which].items() if k in rounds) for r in range(ranks)]
        assert sum(per_rank) == predicted["requests"] and per_rank[0] == predicted["max_requests_one_rank"], (
            which, per_rank, predicted)
        assert len(set(per_rank[1:])) == 1, (which, per_rank)  # every other rank alike

    assert all(set(got[r]["save"]) == {"go", "commit"} and set(got[r]["plan"]) == {"plan", "go", "commit"}
               for r in range(BIG)) and all(set(got[r]["load"]) == {"agree"} for r in range(SMALL))
    check("save", BIG, save, {"go", "commit"})
    check("plan", BIG, plan, {"plan"})
    check("load", SMALL, load, {"agree"})
    for r in range(SMALL):  # what the benchmark's one-rank load reads (scale_sim.load_one_rank's metadata())
        disk = scale_counting.CountingStorage(LocalStorage(root))
        index = mf.read_committed(disk, 2)
        assert not isinstance(index, mf.Manifest)  # a step of several ranks is an index (format v6)
        step_for_load(disk, index, _shard(r, SMALL, -1.0), r, SMALL)
        assert sum(got[r]["meta"].values()) == disk.read_bytes, (r, got[r]["meta"], disk.read_bytes)
        assert got[r]["meta_requests"] == sum(1 for op, _ in disk.log if op in READS), (r, got[r]["meta"])
