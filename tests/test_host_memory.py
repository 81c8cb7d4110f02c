"""The host-memory budget (``host_memory``): the option and its resolution to bytes per rank, and loads
within it (:mod:`ckpt.load.windows`): bit-exact, atomic, with the peak RSS a real process measures."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
import xxhash

import ckpt
from ckpt import host_memory
from ckpt.errors import ConfigError, CorruptCheckpointError
from ckpt.format import manifest as mf
from ckpt.format import paths
from ckpt.format.chains import MissingChunkError
from ckpt.load import into_state, load_into
from ckpt.load import reads as load_reads
from ckpt.load import windows as load_windows
from ckpt.load.plan import BoxPlan, RowStage
from ckpt.load.windows import windows
from ckpt.storage import LocalStorage
from ckpt.testing import run_ranks

MiB = 1 << 20


def test_per_rank_is_bytes_or_a_share_of_the_machine_split_among_the_nodes_ranks():
    assert host_memory.per_rank(None, 64 << 30, 8) is None
    assert host_memory.per_rank(512 * MiB, 64 << 30, 8) == 512 * MiB  # bytes are per rank already
    assert host_memory.per_rank(0.5, 64 << 30, 8) == 4 << 30
    assert host_memory.per_rank(1.0, 64 << 30, 1) == 64 << 30
    assert host_memory.per_rank(1e-9, 64 << 30, 8) == MiB  # never below the least window
    with pytest.raises(ConfigError, match="at least one rank"):
        host_memory.per_rank(0.5, 64 << 30, 0)


@pytest.mark.parametrize("bad, says", [(-1, "from 1 MiB"), (0, "from 1 MiB"), (1 << 60, "from 1 MiB"),
                                       (0.0, r"in \(0, 1\]"), (1.5, r"in \(0, 1\]"), (-0.25, r"in \(0, 1\]"),
                                       (True, "None, a number of bytes"), ("1GiB", "None, a number of bytes")])
def test_bad_host_memory_is_refused_naming_the_option(bad, says):
    with pytest.raises(ConfigError, match=says) as e:
        ckpt.Options.build(host_memory=bad)
    assert "host_memory" in str(e.value)


def test_good_host_memory_is_kept_and_resolved_alone(monkeypatch):
    assert ckpt.Options.build().host_memory is None
    assert ckpt.Options.build(host_memory=64 * MiB).host_memory == 64 * MiB
    assert ckpt.Options.build(host_memory=0.25).host_memory == 0.25
    comm = ckpt.ranks.make_comm(None, 10.0)
    total = host_memory.machine_memory()
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # processes of a node, each with its own Checkpointer
    assert host_memory.resolve(0.5, comm) == int(0.5 * total) // 4
    assert host_memory.resolve(64 * MiB, comm) == 64 * MiB
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert host_memory.resolve(0.5, comm) == int(0.5 * total)


def test_windows_cover_every_staged_byte_once_within_the_budget():
    into = [torch.empty(1000, 300), torch.empty(()), torch.empty(7, 5000, dtype=torch.bfloat16),
            torch.empty(40, 40), torch.empty(0, 3)]
    stage = RowStage(3, 10 * 160, (10, 40), ((0, 0), (10, 40)), ((0, 0), (10, 40)))
    plan = BoxPlan(0, [], stages=[stage])
    budget = 100_000
    cut = windows(plan, into, [0, 1, 2, 3, 4], budget)
    covered: dict[int, list[tuple[int, int]]] = {}
    for w in cut:
        assert w.nbytes <= budget
        ends = sorted((p.at, p.at + p.hi - p.lo) for p in w.pieces)
        assert all(a[1] <= b[0] for a, b in zip(ends, ends[1:]))  # pieces of a window do not overlap
        for p in w.pieces:
            covered.setdefault(p.k, []).append((p.lo, p.hi))
    sizes = [t.nbytes for t in into] + [stage.nbytes]
    for k, size in enumerate(sizes):
        spans = sorted(covered[k])
        assert spans[0][0] == 0 and spans[-1][1] == size
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
    assert len(cut) >= 1_200_000 // budget
    # a tensor filled from row stages goes whole, with them, in one window
    assert any({p.k for p in w.pieces} >= {3, 5} for w in cut)


def _state(mib: int, fill: float | None = None) -> dict:
    """About ``mib`` MiB: a large matrix, a bf16 tensor, an optimizer-like dict and a scalar; random
    bytes (seeded) or filled with ``fill``."""
    n = mib * MiB // 4
    shapes = {"w": ((n // 2) // 1024, 1024), "e": ((n // 4) // 512, 512), "bf": (n // 2,), "s": ()}
    out = {}
    for i, (k, shape) in enumerate(shapes.items()):
        dtype = torch.bfloat16 if k == "bf" else torch.float32
        t = torch.empty(shape, dtype=dtype)
        if fill is None:  # random bits (NaN among them: saved with check_finite=False), fast to make
            t.view(-1).view(torch.uint8).numpy()[:] = np.random.default_rng(i).integers(0, 256, t.nbytes, np.uint8)
        else:
            t.fill_(fill)
        out[k] = t
    return {"model": {"w": out["w"], "s": out["s"]}, "optim": {"e": out["e"], "bf": out["bf"]}}


def _digests(state: dict) -> dict[str, str]:
    return {f"{g}/{k}": xxhash.xxh3_128_hexdigest(t.view(-1).view(torch.uint8).numpy())
            for g, d in state.items() for k, t in d.items()}


_CHILD = r"""
import gc, json, sys, torch, ckpt
sys.path.insert(0, sys.argv[2])
from test_host_memory import _digests, _state
path, budget, mib, codec = sys.argv[1], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]

def status(name):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(name + ":"))

opts = dict(host_memory=budget, codec=codec, check_finite=False)
state = _state(mib)
saved = _digests(state)
with ckpt.Checkpointer(path, **opts) as c:  # today's save path, the budget set
    c.save(1, state).wait()
del state, c
gc.collect()
with ckpt.Checkpointer(path, **opts) as c:  # as a restarted job: no host buffer to borrow
    state = _state(mib, fill=-1.0)  # the caller's tensors, every page touched
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak starts again from here
    base = status("VmRSS")
    c.load(1, state)
    peak = status("VmHWM")
    s = c.last_load
    print(json.dumps({"growth": peak - base, "same": _digests(state) == saved, "passes": s.passes,
                      "windows": s.windows, "staging": s.staging_bytes, "chunk_size": c.options.chunk_size,
                      "width": c.storage.read_width}))
"""


def _child(path, budget: int, mib: int, codec: str = "raw") -> dict:
    out = subprocess.run([sys.executable, "-c", _CHILD, str(path), os.path.dirname(__file__), str(budget), str(mib),
                          codec], capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux's /proc peak-RSS reset")
def test_a_load_four_times_the_budget_is_bit_exact_within_budget_plus_fixed_overhead(tmp_path):
    """256 MiB saved (today's save path, the budget set) and loaded by a fresh Checkpointer with
    host_memory = 64 MiB: the bytes are the saved ones, the load went in two passes through
    windows, and the peak RSS grew by at most the budget plus a fixed overhead + 10%. The overhead:
    each reading thread's chunk of scratch (a chunk crossing a window's edge is read whole into it),
    the local storage's 4 MiB read piece per thread, and 16 MiB for what Python, the manifest and
    the allocator take; none of it grows with the state (staging it whole would add 256 MiB)."""
    mib, budget = 256, 64 * MiB
    got = _child(tmp_path, budget, mib)
    assert got["same"]
    assert got["passes"] == 2 and got["windows"] >= mib * MiB // budget
    assert got["staging"] <= budget
    overhead = got["width"] * (got["chunk_size"] + 4 * MiB) + 16 * MiB
    assert got["growth"] <= 1.1 * (budget + overhead), got


def _damage(root, h: str) -> None:
    with open(os.path.join(root, paths.chunk_key(h)), "r+b") as f:
        f.seek(-100, os.SEEK_END)
        b = f.read(1)
        f.seek(-100, os.SEEK_END)
        f.write(bytes([b[0] ^ 0xFF]))


def _last_chunk(m: mf.Manifest, key: str) -> str:
    entry = next(t for t in m.tensors if t.key == key)
    return entry.shards[-1].segments[-1].chunk


def test_a_damaged_chunk_found_in_the_first_pass_leaves_every_tensor_unchanged(tmp_path):
    with ckpt.Checkpointer(tmp_path, host_memory=MiB, chunk_size=256 * 1024, codec="raw", check_finite=False) as c:
        c.save(1, _state(6)).wait()
        target = _state(6, fill=-1.0)
        c.load(1, target)
        assert c.last_load is not None and c.last_load.passes == 2 and c.last_load.windows > 4
        m = mf.read_committed(c.storage, 1)
        assert isinstance(m, mf.Manifest)
        h = _last_chunk(m, "optim/bf")  # in the last window: every window before it checked out
        _damage(tmp_path, h)
        target = _state(6, fill=-1.0)
        with pytest.raises(CorruptCheckpointError) as e:
            c.load(1, target)
        assert e.value.chunk == h
        assert _digests(target) == _digests(_state(6, fill=-1.0))
        c.save(2, _state(6)).wait()  # nothing changed: saves go on


@pytest.mark.parametrize("budget", [None, MiB])
def test_last_load_says_where_its_time_went(tmp_path, monkeypatch, budget):
    """Planning, reads and the copy out of staging are timed apart (over every window and pass): a
    planning made 0.2 s slower shows in plan_s, reads made 10 ms slower each in read_s (one I/O
    thread), and none of it is counted twice (they fit in the load's whole time)."""
    real_plan, real_read, reads = into_state.plan_load, load_reads.read_chunk, [0]

    def slow_plan(*args, **kwargs):
        time.sleep(0.2)
        return real_plan(*args, **kwargs)

    def slow_read(*args, **kwargs):
        reads[0] += 1
        time.sleep(0.01)
        return real_read(*args, **kwargs)

    with ckpt.Checkpointer(tmp_path, host_memory=budget, chunk_size=256 * 1024, codec="raw", check_finite=False,
                           io_threads=1) as c:
        c.save(1, _state(6)).wait()
        monkeypatch.setattr(into_state, "plan_load", slow_plan)
        monkeypatch.setattr(load_reads, "read_chunk", slow_read)
        monkeypatch.setattr(load_windows, "read_chunk", slow_read)
        c.load(1, _state(6, fill=-1.0))
        s = c.last_load
        assert s is not None and s.passes == (1 if budget is None else 2)
        assert reads[0] >= s.chunks_read * s.passes
        assert s.plan_s >= 0.2 and s.read_s >= 0.01 * reads[0] and s.copy_s > 0
        assert s.plan_s < 0.4  # the 0.2 s counted once
        assert s.plan_s + s.read_s + s.copy_s <= s.seconds


@pytest.mark.parametrize("where", ["last window, damaged", "first window, deleted"])
def test_a_chunk_that_changes_between_the_passes_fails_the_load_naming_it(tmp_path, where):
    with ckpt.Checkpointer(tmp_path, chunk_size=256 * 1024, codec="raw", check_finite=False) as c:
        c.save(1, _state(6)).wait()
    storage = LocalStorage(str(tmp_path))
    m = mf.read_committed(storage, 1)
    assert isinstance(m, mf.Manifest)
    first = where.startswith("first")
    h = next(t for t in m.tensors if t.key == "model/w").shards[0].segments[0].chunk if first else \
        _last_chunk(m, "optim/bf")

    def change() -> None:  # runs once every chunk checked out, before the second pass
        if first:
            os.remove(os.path.join(tmp_path, paths.chunk_key(h)))
        else:
            _damage(tmp_path, h)

    target = _state(6, fill=-1.0)
    with ThreadPoolExecutor(4) as io, pytest.raises(CorruptCheckpointError, match="first pass") as e:
        load_into(storage, m, target, strict=True, allow_pickle=False, io=io, on_change=change, budget=MiB)
    assert e.value.chunk == h
    if first:  # still the class a missing chunk raises; nothing copied yet
        assert isinstance(e.value, MissingChunkError) and "nothing was written" in str(e.value)
        assert _digests(target) == _digests(_state(6, fill=-1.0))
    else:  # the windows before it were copied out: the state is partial, and the error says so
        assert "part of the state was written" in str(e.value)
        assert _digests(target)["model/w"] == _digests(_state(6))["model/w"]


def test_boxes_of_other_layouts_read_within_the_budget_are_bit_exact(tmp_path):
    """Column boxes (row stages, staged whole with their tensor) and row boxes (cut into windows)
    read through a 1 MiB budget: the same bytes as without one."""
    state = _state(6)
    with ckpt.Checkpointer(tmp_path, chunk_size=256 * 1024, codec="raw", check_finite=False) as c:
        c.save(1, state).wait()
    storage = LocalStorage(str(tmp_path))
    m = mf.read_committed(storage, 1)
    assert isinstance(m, mf.Manifest)
    rows, cols = state["model"]["w"].shape
    boxes = [("model/w", ((0, 100), (rows, 300)), torch.empty(rows, 300)),
             ("model/w", ((7, 0), (rows - 7, cols)), torch.empty(rows - 7, cols)),
             ("optim/bf", ((1000,), (600_000,)), torch.empty(600_000, dtype=torch.bfloat16))]
    with ThreadPoolExecutor(4) as io:
        got = ckpt.load.read_boxes(storage, m, boxes, io, budget=MiB)
    # the column box goes whole with the saved rows it is cut from (over the budget, and said); the rest fit it
    assert got.passes == 2 and got.windows > 3 and got.staging_bytes <= rows * 300 * 4 + rows * cols * 4 + 128
    w, bf = state["model"]["w"], state["optim"]["bf"]
    for (_, _, into), want in zip(boxes, [w[:, 100:400], w[7:], bf[1000:601_000]]):
        assert torch.equal(into.view(torch.uint8), want.contiguous().view(torch.uint8))


def _two_ranks_body(rank: int, world: int, root: str) -> dict:
    with ckpt.Checkpointer(root, host_memory=0.5) as c:  # the share is split between the two ranks of this host
        share = c._chooser.budget
    with ckpt.Checkpointer(root, host_memory=MiB, chunk_size=256 * 1024, codec="raw", check_finite=False) as c:
        c.save(1, _state(4)).wait()
        target = _state(4, fill=-1.0)
        c.load(1, target)  # both ranks agree after their first pass, before either writes
        s = c.last_load
        assert s is not None
        return {"share": share, "same": _digests(target) == _digests(_state(4)), "passes": s.passes,
                "windows": s.windows}


@pytest.mark.multiprocess
def test_ranks_of_a_node_split_a_share_and_load_within_their_budget(tmp_path):
    out = run_ranks(2, _two_ranks_body, str(tmp_path), timeout=120)
    want = host_memory.per_rank(0.5, host_memory.machine_memory(), 2)
    assert [r["share"] for r in out] == [want, want]
    assert all(r["same"] and r["passes"] == 2 and r["windows"] > 2 for r in out), out


def test_an_unstaged_load_reads_strided_tensors_through_windows_in_one_pass(tmp_path):
    state = _state(6)
    with ckpt.Checkpointer(tmp_path, host_memory=MiB, chunk_size=256 * 1024, codec="raw", check_finite=False,
                           staged_load=False) as c:
        c.save(1, state).wait()
        target = _state(6, fill=-1.0)
        w = target["model"]["w"]
        target["model"]["w"] = torch.full((w.shape[1], w.shape[0]), -1.0).t()  # strided: read via CPU stand-ins
        c.load(1, target)
        s = c.last_load
        assert s is not None and s.passes == 1 and s.windows > 2 and s.staging_bytes <= MiB
        assert torch.equal(target["model"]["w"].contiguous().view(torch.uint8), state["model"]["w"].view(torch.uint8))
        assert _digests({"o": target["optim"]}) == _digests({"o": state["optim"]})
