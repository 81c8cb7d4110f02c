"""A rank holding several pieces of one tensor (issue 39): ShardedTensors whose chunk spec puts two
chunks on one rank, ckpt.LocalShards of 2 and 3 pieces, through ckpt.dcp (DCP's own FileSystemWriter
as the control) and the Checkpointer, loaded onto other layouts bit-exact; io.BytesIO values."""

from __future__ import annotations

import io
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp

import ckpt
import ckpt.dcp
from ckpt import cli
from ckpt.errors import ConfigError, UnsupportedValueError
from ckpt.save.planning import Inventory, InventoryRow, assign
from ckpt.testing import run_ranks

TABLE = torch.arange(10 * 3, dtype=torch.float32).reshape(10, 3) * 0.5 - 7  # the ShardedTensor's global value
ROWS = torch.arange(12 * 4, dtype=torch.int64).reshape(12, 4) * 7919 % 1013  # LocalShards, cut by rows
GRID = torch.randn(6, 6, generator=torch.Generator().manual_seed(3), dtype=torch.float64)  # cut into 2-D boxes

# Boxes per rank (offsets, lengths): 2 pieces on rank 0, 3 on rank 1, none nesting into one box.
SAVE_ROWS = [[((0, 0), (2, 4)), ((8, 0), (2, 4))], [((2, 0), (3, 4)), ((5, 0), (3, 4)), ((10, 0), (2, 4))]]
SAVE_GRID = [[((0, 0), (3, 3)), ((3, 3), (3, 3))], [((0, 3), (3, 3)), ((3, 0), (3, 2)), ((3, 2), (3, 1))]]
# Another layout to load onto: 3 pieces on rank 0, 1 on rank 1.
LOAD_ROWS = [[((0, 0), (1, 4)), ((4, 0), (3, 4)), ((11, 0), (1, 4))], [((1, 0), (3, 4)), ((7, 0), (4, 4))]]
LOAD_GRID = [[((0, 0), (6, 1)), ((0, 4), (6, 2)), ((0, 1), (2, 3))], [((2, 1), (4, 3))]]


def _cut(full: torch.Tensor, boxes, zeros: bool) -> ckpt.LocalShards:
    pieces = []
    for offs, lens in boxes:
        part = full[tuple(slice(o, o + n) for o, n in zip(offs, lens))]
        pieces.append(ckpt.LocalShard(torch.zeros_like(part) if zeros else part.clone(), offs, full.shape))
    return ckpt.LocalShards(pieces)


def _sharded(placements: list[int], zeros: bool = False):
    """TABLE as a ShardedTensor cut in len(placements) row chunks, chunk i on rank placements[i]."""
    from torch.distributed._shard import sharded_tensor
    from torch.distributed._shard.sharding_spec import ChunkShardingSpec

    spec = ChunkShardingSpec(dim=0, placements=[f"rank:{r}/cpu" for r in placements])
    t = sharded_tensor.zeros(spec, *TABLE.shape)
    for s in t.local_shards() if not zeros else ():
        (r, c), (n, m) = s.metadata.shard_offsets, s.metadata.shard_sizes
        s.tensor.copy_(TABLE[r:r + n, c:c + m])
    return t


def _placed(t) -> list[tuple[list[int], list[float]]]:
    """A ShardedTensor's local shards as (offsets, values), by value (tensors would not leave the rank)."""
    return [(list(s.metadata.shard_offsets), s.tensor.flatten().tolist()) for s in t.local_shards()]


def _want(t) -> list[tuple[list[int], list[float]]]:
    out = []
    for s in t.local_shards():
        (r, c), (n, m) = s.metadata.shard_offsets, s.metadata.shard_sizes
        out.append(([r, c], TABLE[r:r + n, c:c + m].flatten().tolist()))
    return out


# -- bodies run on every rank ---------------------------------------------------------------------

def dcp_body(rank: int, world: int, ours: str, theirs: str) -> dict:
    """Save a ShardedTensor holding chunks 0 and 3 on rank 0, 1 and 2 on rank 1, and a BytesIO,
    through ckpt.dcp and through DCP's own FileSystemWriter; load each onto a 3-chunk layout
    (rank 1 holding chunks 0 and 2)."""
    warnings.filterwarnings("ignore", category=FutureWarning)  # ShardedTensor is deprecated in favour of DTensor
    blob = bytes(range(256)) * 3
    state = {"table": _sharded([0, 1, 1, 0]), "blob": io.BytesIO(blob), "step": 7}
    dcp.save(state, storage_writer=ckpt.dcp.Writer(ours, step=1))
    dcp.save(state, storage_writer=dcp.FileSystemWriter(theirs))
    out: dict = {"pieces": len(state["table"].local_shards())}
    for name, reader in (("ckpt", ckpt.dcp.Reader(ours, step=1)), ("dcp", dcp.FileSystemReader(theirs))):
        into = {"table": _sharded([1, 0, 1], zeros=True), "blob": io.BytesIO(), "step": 0}
        dcp.load(into, storage_reader=reader)
        out[name] = {"table": _placed(into["table"]), "want": _want(into["table"]), "step": into["step"],
                     "blob": (type(into["blob"]).__name__, into["blob"].getvalue() == blob)}
    return out


def checkpointer_body(rank: int, world: int, path: str) -> dict:
    """LocalShards of 2 and 3 pieces, a ShardedTensor of two local chunks and a BytesIO through the
    Checkpointer, loaded back onto other layouts in the same job."""
    warnings.filterwarnings("ignore", category=FutureWarning)
    state = {"rows": _cut(ROWS, SAVE_ROWS[rank], False), "nested": {"grid": _cut(GRID, SAVE_GRID[rank], False)},
             "table": _sharded([0, 1, 1, 0]), "blob": io.BytesIO(b"\x00raw\xff" * 5), "bias": torch.arange(3.0)}
    c = ckpt.Checkpointer(path)
    c.save(1, state).wait()
    into = {"rows": _cut(ROWS, LOAD_ROWS[rank], True), "nested": {"grid": _cut(GRID, LOAD_GRID[rank], True)},
            "table": _sharded([1, 0, 1], zeros=True), "blob": None, "bias": torch.zeros(3)}
    c.load(1, into)  # strict: every piece is loaded, none is a tensor the step lacks
    c.close()
    got = {"rows": into["rows"], "grid": into["nested"]["grid"]}
    exact = {k: all(torch.equal(p.tensor, full[tuple(slice(o, o + n) for o, n in zip(p.offsets, p.tensor.shape))])
                    for p in got[k].pieces) for k, full in (("rows", ROWS), ("grid", GRID))}
    return {"exact": exact, "pieces": [len(got["rows"].pieces), len(got["grid"].pieces)],
            "table": _placed(into["table"]) == _want(into["table"]), "bias": into["bias"].tolist(),
            "blob": (type(into["blob"]).__name__, into["blob"].getvalue())}


def both_bodies(rank: int, world: int, root: str) -> dict:
    dcp_found = dcp_body(rank, world, f"{root}/ckpt", f"{root}/dcp")
    return {"dcp": dcp_found, "ckptr": checkpointer_body(rank, world, f"{root}/run")}


# -- tests ----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> tuple[str, list[dict]]:
    """One 2-rank job for both front ends (starting ranks is most of the time): the root, and each rank's findings."""
    root = str(tmp_path_factory.mktemp("pieces"))
    return root, run_ranks(2, both_bodies, root, timeout=120)


@pytest.mark.multiprocess
def test_dcp_saves_a_rank_holding_two_chunks_of_a_sharded_tensor_as_its_own_storage_does(two_ranks):
    root, ranks = two_ranks
    got = [r["dcp"] for r in ranks]
    assert [g["pieces"] for g in got] == [2, 2]
    for g in got:  # the control first: DCP's own storage loads the other layout exactly
        assert g["dcp"]["table"] == g["dcp"]["want"] and g["ckpt"]["table"] == g["ckpt"]["want"]
        assert g["ckpt"]["blob"] == g["dcp"]["blob"] == ("BytesIO", True) and g["ckpt"]["step"] == 7
    m = ckpt.open(f"{root}/ckpt").manifest(1)
    (entry,) = [t for t in m.tensors if t.key == "table"]
    assert sorted((s.rank, s.offsets[0]) for s in entry.shards) == [(0, 0), (0, 9), (1, 3), (1, 6)]
    assert torch.equal(ckpt.open(f"{root}/ckpt").tensors(1)["table"], TABLE)


@pytest.mark.multiprocess
def test_checkpointer_saves_2_and_3_pieces_per_rank_and_loads_them_onto_other_layouts(two_ranks, capsys):
    root, ranks = two_ranks
    path = f"{root}/run"
    for g in (r["ckptr"] for r in ranks):
        assert g["exact"] == {"rows": True, "grid": True} and g["table"] and g["bias"] == [0.0, 1.0, 2.0]
        assert g["blob"] == ("BytesIO", b"\x00raw\xff" * 5)
    assert _count_pieces(path) == [3, 3]  # another world size: one process
    tensors = ckpt.open(path).tensors(1)
    assert torch.equal(tensors["rows"], ROWS) and torch.equal(tensors["nested/grid"], GRID)
    assert torch.equal(tensors["table"], TABLE)
    m = ckpt.open(path).manifest(1)
    shards = {t.key: sorted(s.rank for s in t.shards) for t in m.tensors}
    assert shards["rows"] == shards["nested/grid"] == [0, 0, 1, 1, 1] and shards["table"] == [0, 0, 1, 1]
    assert cli.main(["inspect", path]) == 0
    out = capsys.readouterr().out
    assert "blob = <BytesIO of 25 bytes>" in out and "[10:12, 0:4]" in out


def _count_pieces(path: str) -> list[int]:
    """This process alone loads the 2-rank step into 3 pieces per tensor, and checks them."""
    into = {"rows": _cut(ROWS, [((0, 0), (5, 4)), ((5, 0), (1, 4)), ((6, 0), (6, 4))], True),
            "nested": {"grid": _cut(GRID, [((0, 0), (6, 3)), ((0, 3), (4, 3)), ((4, 3), (2, 3))], True)}}
    c = ckpt.Checkpointer(path)
    c.load(1, into, strict=False)
    c.close()
    got = {"rows": into["rows"], "grid": into["nested"]["grid"]}
    for k, full in (("rows", ROWS), ("grid", GRID)):
        for p in got[k].pieces:
            assert torch.equal(p.tensor, full[tuple(slice(o, o + n) for o, n in zip(p.offsets, p.tensor.shape))]), k
    return [len(got["rows"].pieces), len(got["grid"].pieces)]


def test_bytesio_saves_through_dcp_without_pickle_as_dcps_own_storage_does(tmp_path):
    got = {}
    for name, writer, reader in (
            ("dcp", dcp.FileSystemWriter(str(tmp_path / "dcp")), lambda: dcp.FileSystemReader(str(tmp_path / "dcp"))),
            ("ckpt", ckpt.dcp.Writer(str(tmp_path / "ckpt"), step=0), lambda: ckpt.dcp.Reader(str(tmp_path / "ckpt")))):
        dcp.save({"b": io.BytesIO(b"x"), "w": torch.arange(4.0)}, storage_writer=writer, no_dist=True)
        into = {"b": io.BytesIO(), "w": torch.zeros(4)}
        dcp.load(into, storage_reader=reader(), no_dist=True)
        got[name] = (type(into["b"]).__name__, into["b"].getvalue(), into["w"].tolist())
    assert got["ckpt"] == got["dcp"] == ("BytesIO", b"x", [0.0, 1.0, 2.0, 3.0])
    # stored as its bytes, not pickled: it loads without allow_pickle, and only steps holding one need format 5
    assert ckpt.open(str(tmp_path / "ckpt")).manifest(0).format_version == 5
    state = {"b": None}
    c = ckpt.Checkpointer(str(tmp_path / "ckpt"))
    c.load(0, state, strict=False)
    c.close()
    assert isinstance(state["b"], io.BytesIO) and state["b"].getvalue() == b"x"
    c = ckpt.Checkpointer(str(tmp_path / "plain"))
    c.save(1, {"b": b"x"}).wait()
    c.close()
    assert ckpt.open(str(tmp_path / "plain")).manifest(1).format_version < 5


def test_pieces_are_checked_where_they_are_declared_and_tile_or_are_refused(tmp_path):
    a = ckpt.LocalShard(torch.zeros(2, 4), (0, 0), (4, 4))
    with pytest.raises(ConfigError, match="overlap"):
        ckpt.LocalShards([a, ckpt.LocalShard(torch.zeros(2, 4), (1, 0), (4, 4))])
    with pytest.raises(ConfigError, match="same global tensor"):
        ckpt.LocalShards([a, ckpt.LocalShard(torch.zeros(2, 4), (2, 0), (5, 4))])
    with pytest.raises(ConfigError, match="non-empty list"):
        ckpt.LocalShards([])
    two = ckpt.LocalShards([a, ckpt.LocalShard(torch.ones(2, 4), (2, 0), (4, 4))])
    with pytest.raises(UnsupportedValueError, match="several pieces"):
        ckpt.Checkpointer(str(tmp_path / "r")).save(1, {"mine": ckpt.PerRank({"t": two})})

    def inv(*boxes) -> Inventory:
        rows = [InventoryRow("t", "shard", "float32", [4, 4], list(o), list(n), 4 * n[0] * n[1]) for o, n in boxes]
        return Inventory({"t": "x"}, [], rows)
    top, mid, low = ((0, 0), (1, 4)), ((1, 0), (2, 4)), ((3, 0), (1, 4))
    plan = assign([inv(top, low), inv(mid)])  # rank 0 holds two pieces: each written, by rank 0
    assert plan[0].error is None and plan[0].write == [0, 1] and plan[1].write == [0]
    assert "do not tile" in assign([inv(top, mid), inv(mid)])[0].error  # a piece held twice leaves row 3 out
