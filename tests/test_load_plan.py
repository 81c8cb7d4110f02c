"""The load cut at its plan: ``plan_load`` is pure (a manifest and a state in, which chunk objects and
which bytes of each out; no storage, no process group, the state untouched), and ``read_boxes``, the
one primitive that reads boxes of saved tensors, reads what its plan names and checks its requests
before reading anything."""

from __future__ import annotations

import os
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.distributed as dist

import ckpt
from ckpt import tree as st
from ckpt.format import manifest as mf
from ckpt.load import BoxRequest, plan_boxes, plan_load, read_boxes
from ckpt.load.plan import Request

ROWS, COLS, SAVED, LOADING = 12, 4, 4, 3
ROW = COLS * 4  # bytes of a float32 row


def _chunk(name: str) -> str:
    return (name * 32)[:32]


def four_rank_step() -> mf.Manifest:
    """A step saved on 4 ranks, built as data (its chunk objects exist nowhere): ``w`` (12×4 float32)
    in 3 rows per rank, one chunk each, and a per-rank ``pos`` (2 int64) per rank, one chunk each."""
    w_chunks = [_chunk("abcd"[r]) for r in range(SAVED)]
    pos_chunks = [_chunk("1234"[r]) for r in range(SAVED)]
    rows = ROWS // SAVED
    tensors = [mf.TensorEntry("w", "float32", [ROWS, COLS], [
        mf.Shard(r, [r * rows, 0], [rows, COLS], [mf.Segment(w_chunks[r], 0, rows * ROW)]) for r in range(SAVED)])]
    tensors += [mf.TensorEntry("pos", "int64", [2], [mf.Shard(r, [0], [2], [mf.Segment(pos_chunks[r], 0, 16)])], rank=r)
                for r in range(SAVED)]
    chunks = {h: mf.ChunkInfo(rows * ROW, 64 + rows * ROW, "raw/1") for h in w_chunks}
    chunks |= {h: mf.ChunkInfo(16, 80, "raw/1") for h in pos_chunks}
    structure = st.dict_node(["w", "pos"], [st.tensor_node("w"), st.per_rank_node([st.tensor_node("pos")] * SAVED)])
    m = mf.Manifest(step=7, kind="step", structure=structure, tensors=tensors, chunks=chunks, world_size=SAVED)
    return mf.parse(m.to_json(), name="MANIFEST.json")  # a manifest the validating parser accepts


def test_plan_load_of_a_resharded_step_is_pure_and_names_only_what_each_rank_needs():
    m = four_rank_step()
    assert not dist.is_initialized()
    rows = ROWS // LOADING
    # rank -> {chunk: byte spans}: rank 0 takes saved rows 0-3 (all of saved rank 0's chunk, the first
    # row of rank 1's), rank 1 rows 4-7, rank 2 rows 8-11; pos from the saved rank rank_map names.
    rank_map = {0: 0, 1: 1, 2: 3}
    want = {0: {_chunk("a"): [(0, 48)], _chunk("b"): [(0, 16)], _chunk("1"): [(0, 16)]},
            1: {_chunk("b"): [(16, 48)], _chunk("c"): [(0, 32)], _chunk("2"): [(0, 16)]},
            2: {_chunk("c"): [(32, 48)], _chunk("d"): [(0, 48)], _chunk("4"): [(0, 16)]}}
    for rank in range(LOADING):
        local = torch.full((rows, COLS), -1.0)
        state = {"w": ckpt.LocalShard(local, [rank * rows, 0], [ROWS, COLS]), "pos": torch.full((2,), -1)}
        plan = plan_load(m, state, rank, LOADING, rank_map)
        assert plan.chunks == sorted(want[rank]), rank
        assert {h: plan.boxes.spans(h) for h in plan.chunks} == want[rank], rank
        assert plan.boxes.nbytes == rows * ROW + 16
        assert [r.box for r in plan.boxes.requests] == [((rank * rows, 0), (rows, COLS)), ((0,), (2,))]
        assert plan.into[0] is local and plan.own == [0, 1] and plan.elsewhere == []
        assert bool(local.eq(-1).all()) and bool(state["pos"].eq(-1).all())  # planning changed nothing
    # What a load refuses comes out of the plan, before any read: per-rank state on another world
    # size without a rank_map; a tensor of another dtype.
    state = {"w": ckpt.LocalShard(torch.empty(rows, COLS), [0, 0], [ROWS, COLS]),
             "pos": torch.empty(2, dtype=torch.int64)}
    with pytest.raises(ckpt.ReshardError, match="rank_map"):
        plan_load(m, state, 0, LOADING)
    with pytest.raises(ckpt.StateMismatchError, match="w: checkpoint has float32"):
        plan_load(m, {**state, "w": ckpt.LocalShard(torch.empty(rows, COLS, dtype=torch.float64), [0, 0],
                                                    [ROWS, COLS])}, 0, LOADING, rank_map)
    # A box across columns is not one run in the saved rows: those rows are staged, then copied.
    cols = plan_boxes(m, [Request("w", None, ((0, 1), (ROWS, 2)))])
    assert cols.chunks == sorted(_chunk(c) for c in "abcd") and len(cols.stages) == SAVED


def test_read_boxes_reads_the_chunks_its_plan_names_and_checks_requests_first(tmp_path):
    w = torch.arange(256 * 256, dtype=torch.float32).view(256, 256)  # 256 KiB: four 64 KiB chunks
    with ckpt.Checkpointer(tmp_path / "ck", chunk_size=64 * 1024, codec="raw") as c:
        c.save(1, {"w": w, "pos": ckpt.PerRank(torch.tensor([5, 6]))}).wait()
    with ckpt.open(tmp_path / "ck") as r, ThreadPoolExecutor(2) as pool:
        m = r.manifest(1)
        rows = torch.zeros(64, 256)
        cols = torch.zeros(8, 256).t()  # strided: read through a CPU stand-in
        pos = torch.zeros(2, dtype=torch.int64)
        stats = read_boxes(r.storage, m, [("w", ((64, 0), (64, 256)), rows), BoxRequest("pos", ((0,), (2,)), pos, 0),
                                          ("w", ((0, 100), (256, 8)), cols)], pool)
        assert torch.equal(rows, w[64:128]) and pos.tolist() == [5, 6] and torch.equal(cols, w[:, 100:108])
        planned = plan_boxes(m, [Request("w", None, ((64, 0), (64, 256))), Request("pos", 0, ((0,), (2,))),
                                 Request("w", None, ((0, 100), (256, 8)))])
        assert stats.chunks == planned.chunks and stats.chunks_read == len(planned.chunks)
        only_rows = read_boxes(r.storage, m, [("w", ((64, 0), (64, 256)), rows)], pool)
        assert len(only_rows.chunks) == 1 < len(m.chunks)  # rows 64-127 are the second chunk, alone
        into = torch.full((4, 4), -1.0)
        for request, error, match in [
            (("x", ((0, 0), (4, 4)), into), ckpt.StateMismatchError, "holds no tensor 'x'"),
            (("pos", ((0,), (2,)), pos), ckpt.StateMismatchError, r"per-rank state: name one of its ranks \[0\]"),
            (("w", ((254, 0), (4, 4)), into), ckpt.ConfigError, "not inside 'w'"),
            (("w", ((0, 0), (4, 4)), into.double()), ckpt.StateMismatchError, "cannot be read into a tensor float64"),
            (("w", ((0, 0), (4, 2)), into), ckpt.StateMismatchError, r"cannot be read into a tensor float32\(4, 4\)"),
        ]:
            with pytest.raises(error, match=match):
                read_boxes(r.storage, m, [("w", ((0, 0), (4, 4)), into), request], pool)
            assert bool(into.eq(-1).all())  # refused before anything was read


def test_feeds_of_tensors_staged_side_by_side_join_only_across_padding_no_tensor_takes():
    """A chunk's feeds into tensors staged next to each other join into one run (the chunk is then
    read or decoded in place), across padding the same width on both sides; never across bytes of
    staging that another tensor stands in, nor between two arrays or unequal gaps."""
    import numpy as np

    from ckpt.load.reads import _FreeGaps, _joined

    staging, other = np.zeros(1 << 14, np.uint8), np.zeros(1 << 14, np.uint8)
    # stand-ins: x at 0 (4100 bytes), z (4 bytes) at 4100 inside x's padding, y at 4160 (4096 bytes), w at 8256
    gaps = _FreeGaps(staging, [(0, 4100), (4100, 4), (4160, 4096), (8256, 64)])
    assert gaps.free(staging, 8256 - 0, 8256) is False  # empty range
    assert not gaps.free(staging, 4100, 4160)  # z is there
    assert gaps.free(staging, 4104, 4160) and not gaps.free(other, 4104, 4160)
    adjacent = [(4096, 64, staging, 8256), (0, 4096, staging, 4160)]
    assert _joined(adjacent, gaps) == [(0, 4160, staging, 4160)]  # sorted by chunk offset, then joined
    over_z = [(0, 4100, staging, 0), (4160, 4096, staging, 4160)]  # a 60-byte gap on both sides, z in it
    assert len(_joined(over_z, gaps)) == 2
    free_gaps = _FreeGaps(staging, [(0, 4100), (4160, 4096)])  # the same without z: padding only
    assert _joined(over_z, free_gaps) == [(0, 8256, staging, 0)]
    assert len(_joined([(0, 4100, staging, 0), (4160, 4096, other, 4160)], free_gaps)) == 2  # two arrays
    assert len(_joined([(0, 4100, staging, 0), (4160, 4096, staging, 4224)], free_gaps)) == 2  # unequal gaps
    assert len(_joined([(0, 4000, staging, 0), (4160, 4096, staging, 4160)], free_gaps)) == 2  # wider than padding


def test_a_chunk_of_tensors_staged_side_by_side_is_read_in_place_and_loads_bit_exact(tmp_path, monkeypatch):
    """Saved as x (odd size: 60 bytes of padding after it), y, a larger tensor over several chunks,
    then z in a chunk of its own: x's and y's feeds join across the padding, so their chunk reaches
    the read as one feed covering all of it (read straight into staging), and every tensor comes
    back exactly."""
    import ckpt.load.reads as reads

    torch.manual_seed(0)
    saved = {"x": torch.randn(1025), "y": torch.randn(1024), "big": torch.randn(1 << 20),
             "z": torch.tensor([7], dtype=torch.int32)}
    root = str(tmp_path / "run")
    seen: dict[str, list] = {}
    real = reads.read_chunk

    def spy(storage, m, h, feeds):
        seen[h] = [(off, length) for off, length, _, _ in feeds]
        return real(storage, m, h, feeds)

    monkeypatch.setattr(reads, "read_chunk", spy)
    with ckpt.Checkpointer(root, codec="raw", io_threads=1, chunk_size=1 << 20) as c:
        c.save(1, saved).wait()
        m = c.manifest(1)
        first = next(t for t in m.tensors if t.key == "x").shards[0].segments[0].chunk
        target = {k: torch.zeros_like(v) for k, v in saved.items()}
        c.load(1, target)
        assert all(torch.equal(target[k], saved[k]) for k in saved)
    assert seen[first] == [(0, m.chunks[first].size)]  # x and y (and the padding between): one feed


def test_a_load_that_borrows_the_host_buffer_leaves_its_padding_zero(tmp_path):
    """A load mid-run stages in the idle host buffer, by its own layout and reading chunks' padding
    across the gaps between stand-ins; the buffer's padding is part of the next save's chunk hashes,
    so it is zero again when the load gives the buffer back: the same state saved again stores
    nothing new."""
    torch.manual_seed(0)
    # x's padding ends its chunk (the large tensor starts one of its own): no feed crosses it
    state = {"x": torch.randn(1025), "big": torch.randn(1 << 14), "z": torch.randn(3), "w": torch.randn(4, 33)}
    with ckpt.Checkpointer(str(tmp_path), codec="raw", chunk_size=1 << 16) as c:
        c.save(1, state).wait()
        buf = c._snapshots.buffer
        covered = torch.zeros(buf.nbytes, dtype=torch.bool)
        for s in buf.layout.slots:
            covered[s.offset : s.offset + s.nbytes] = True
        assert (~covered).any()  # the layout has padding
        buf.buffer[~covered] = 0xAB  # what a load staged by another layout leaves there
        back = {k: torch.zeros_like(v) for k, v in state.items()}
        c.load(1, back)  # staged in the idle host buffer, lent (the padding is zero only if it went there)
        assert all(torch.equal(back[k], state[k]) for k in state)
        assert not buf.buffer[~covered].any()
        again = c.save(2, state).wait()
        assert again.chunks_written == 0 and again.chunks_reused == again.chunks


# -- a raw chunk is one request, its header with it --------------------------------------------------------

def _raw_root(root, state, codec="raw", chunk_size=256 * 1024):
    with ckpt.Checkpointer(root, codec=codec, chunk_size=chunk_size) as c:
        c.save(1, state).wait()
        return sorted(c.manifest(1).chunks)


@pytest.mark.parametrize("staged", [True, False])
def test_a_raw_chunk_is_read_in_one_request_with_its_header(tmp_path, staged):
    """On object storage a request is a GET: the header and the payload come in one (they took two),
    also for a chunk that feeds several tensors (in place: the feeds do not join into one run)."""
    from ckpt.storage.local import LocalStorage
    from ckpt.testing import FaultyStorage
    state = {"w": torch.randn(4, 512 * 1024), "b": torch.randn(7),  # 8 MiB in 4 MiB chunks, and a small one
             **{f"p{i}": torch.randn(25 * 1024) for i in range(60)}}  # 100 KiB each: packed, chunks with spans
    names = _raw_root(tmp_path, state, chunk_size=4 << 20)
    with ckpt.Checkpointer(tmp_path) as c:  # a chunk that feeds several tensors, with span digests
        m = c.manifest(1)
    feeds = Counter(g.chunk for t in m.tensors for s in t.shards for g in s.segments)
    assert any(n > 1 and m.chunks[h].spans is not None for h, n in feeds.items())
    disk = FaultyStorage(LocalStorage(tmp_path))
    got = {k: torch.zeros_like(v) for k, v in state.items()}
    with ckpt.Checkpointer(tmp_path, storage=disk, staged_load=staged) as c:
        c.load(1, got)
    assert all(torch.equal(got[k], v) for k, v in state.items())
    reads = [(op, k) for op, k in disk.log if k.startswith("chunks/")]
    assert sorted(k.rsplit("/", 1)[1] for _, k in reads) == names  # one request per chunk
    assert {op for op, _ in reads} == {"readv"}


@pytest.mark.parametrize("staged", [True, False])
def test_a_raw_entry_whose_object_is_stored_encoded_still_loads(tmp_path, staged):
    """A chunk's name is its raw bytes' hash, so another writer may have stored the same bytes
    encoded: the header read with the payload says so, and the chunk is decoded instead."""
    import shutil
    state = {"w": torch.zeros(4, 64 * 1024)}  # compressible: "auto" stores every chunk encoded
    raw_names = _raw_root(tmp_path / "raw", state)
    assert _raw_root(tmp_path / "auto", state, codec="auto") == raw_names
    for name in raw_names:
        rel = os.path.join("chunks", name[:2], name)
        assert os.path.getsize(tmp_path / "auto" / rel) < os.path.getsize(tmp_path / "raw" / rel)
        shutil.copyfile(tmp_path / "auto" / rel, tmp_path / "raw" / rel)
    got = {"w": torch.full((4, 64 * 1024), 7.0)}
    with ckpt.Checkpointer(tmp_path / "raw", staged_load=staged) as c:
        assert all(e.codec.startswith("raw/") for e in c.manifest(1).chunks.values())
        c.load(1, got)
    assert torch.equal(got["w"], state["w"])
