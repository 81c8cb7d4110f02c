"""The plan of ranks alike (issue 35 item 5): :func:`ckpt.save.planning_alike.assign_alike`, planning from
what is distinct among the ranks' posts, gives exactly what :func:`ckpt.save.planning.assign` gives for
the same inventories (who writes what, the bytes, the packs, the errors), and declines (None) where
the ranks are not alike, :func:`ckpt.save.planning.plan_posted` then planning them whole."""

from __future__ import annotations

import os
import sys

import pytest
import torch

import ckpt
from ckpt.flatten import flatten
from ckpt.save.planning import (
    Inventory,
    InventoryRow,
    WriteAssignment,
    _assignment,
    _digest,
    assign,
    pack,
    plan_posted,
    split,
)
from ckpt.save.planning_alike import assign_alike

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import scale_sim  # noqa: E402


def posts(invs: list[Inventory]) -> tuple[dict[int, dict], dict[str, dict]]:
    """What each rank posts in the plan round, and every part by digest (what the coordinator knows
    once the round is over)."""
    posted, known = {}, {}
    for r, inv in enumerate(invs):
        parts, own = split(inv)
        digests = {top: _digest(part) for top, part in parts.items()}
        known.update({digests[top]: part for top, part in parts.items()})
        posted[r] = {"d": digests, "p": pack(own)}
    return posted, known


def planned_alike(invs: list[Inventory], chunk: int = 16 << 20) -> list[WriteAssignment]:
    posted, known = posts(invs)
    docs = assign_alike(posted, known, len(invs), chunk)
    assert docs is not None, "these ranks are alike: planned from what is distinct"
    return [_assignment(doc) for doc in docs]


def rows(spec: list[tuple]) -> list[InventoryRow]:
    return [InventoryRow(k, kind, "float32", list(g), list(o), list(n), 4 * _vol(n)) for k, kind, g, o, n in spec]


def _vol(lengths: tuple[int, ...]) -> int:
    out = 1
    for n in lengths:
        out *= n
    return out


def _fsdp(world: int, rows_: int) -> list[Inventory]:
    """Dim-0 shards (ceil-sized: the last short, past the end empty, several ranks holding one empty
    box), replicated norms of two sizes, 0-d steps, and a tensor of one row."""
    size = -(-rows_ // world)
    out = []
    for r in range(world):
        start = min(r * size, rows_)
        n = max(0, min(size, rows_ - start))
        spec = []
        for i in range(6):
            spec += [(f"m/w{i}", "shard", (rows_, 8), (start, 0), (n, 8)),
                     (f"o/{i}/avg", "shard", (rows_, 8), (start, 0), (n, 8)),
                     (f"o/{i}/step", "replicated", (), (), ())]
        spec += [("m/one", "shard", (1, 4), (min(r, 1), 0), (1 if r == 0 else 0, 4)),
                 ("m/norm", "replicated", (300,), (0,), (300,)), ("m/big", "replicated", (40000,), (0,), (40000,))]
        out.append(Inventory({"m": "a", "o": "b"}, [], rows(spec)))
    return out


@pytest.mark.parametrize("world, rows_, chunk", [(1, 8, 1 << 20), (5, 12, 1 << 20), (7, 3, 4096), (16, 100, 1024)])
def test_ranks_alike_are_planned_as_assign_plans_them(world, rows_, chunk):
    invs = _fsdp(world, rows_)
    want = assign(invs, chunk)
    assert want[0].error is None and planned_alike(invs, chunk) == want
    assert world == 1 or sum(len(a.fresh) for a in want) >= 1  # packs were made (0-d steps, empty boxes)


@pytest.mark.parametrize("layout, world", [("fsdp", 8), ("fsdp-tp8", 16), ("fsdp-tp8", 32)])
def test_a_llama_shaped_state_is_planned_as_assign_plans_it(layout, world):
    """Real flattened states (scale_sim's Llama shape, as flatten gives each rank): FSDP2, FSDP2 x TP8
    (norms replicated over TP: boxes held by 8 ranks, packed among them)."""
    ranks = scale_sim.Ranks(scale_sim.MODELS["tiny"], layout, world)
    invs = [Inventory.of(ranks.flat(r)) for r in range(world)]
    for chunk in (1 << 12, 16 << 20):
        want = assign(invs, chunk)
        assert want[0].error is None and planned_alike(invs, chunk) == want


def test_replicas_are_balanced_as_assign_balances_them():
    """Every box held by every rank (DDP; HSDP's replicas): large ones balanced greedily, largest first,
    small ones packed."""
    spec = [(f"m/t{i}", "replicated", (n,), (0,), (n,)) for i, n in enumerate((70000, 90000, 30000, 65536, 100))]
    spec += [(f"m/h{i}", "shard", (4, 20000), (2 * (r % 2), 0), (2, 20000)) for i in range(3) for r in range(1)]
    invs = []
    for r in range(6):  # HSDP: 2-way shards of h*, 3 replicas of each half
        own = [(k, kind, g, (2 * (r % 2), 0) if k.startswith("m/h") else o, n) for k, kind, g, o, n in spec]
        invs.append(Inventory({"m": "a"}, [], rows(own)))
    want = assign(invs, 1 << 20)
    assert want[0].error is None and planned_alike(invs, 1 << 20) == want
    assert len({r for r, a in enumerate(want) if a.write}) >= 4  # spread, not all on rank 0


def test_pieces_and_per_rank_rows_are_planned_as_assign_plans_them():
    """A rank holding several boxes of one tensor (pieces, one of them twice), per-rank rows (a
    declared per-rank key, ``rank`` rows) at different places on different ranks."""
    invs = []
    for r in range(3):
        spec = [("m/p", "shard", (6, 2), (0, 0), (2, 2)), ("m/p", "shard", (6, 2), (2 + 2 * (r % 2), 0), (2, 2))]
        spec += [("m/q", "shard", (2,), (0,), (1,)), ("m/q", "shard", (2,), (1,), (1,)),
                 ("m/q", "shard", (2,), (1,), (1,))]
        mine = rows(spec)
        extra = [InventoryRow("rng/state", "rank", "uint8", [16], [0], [16], 16),
                 InventoryRow(f"own/x{r}", "shard", "float32", [r + 1], [0], [r + 1], 4 * (r + 1))]
        mine = mine[:r] + extra + mine[r:]
        invs.append(Inventory({"m": "a", "rng": "b", "own": f"c{r}"}, ["own", "rng"], mine))
    want = assign(invs)
    assert want[0].error is None and want[0].per_rank == ["own", "rng"]
    assert planned_alike(invs) == want


def test_plain_values_that_differ_make_the_key_per_rank_as_assign_does():
    invs = [Inventory.of(flatten({"model": {"w": ckpt.LocalShard(torch.zeros(2, 3), (2 * r, 0), (4, 3))},
                                  "pos": {"n": r}, "rng": ckpt.RNGState()})) for r in range(2)]
    want = assign(invs)
    assert want[0].per_rank == ["pos", "rng"] and planned_alike(invs) == want


@pytest.mark.parametrize("starts, why", [
    ((0, 2, 6), "overlap"),
    ((0, 3, 3), "hold 24 elements, the shape 36"),  # rank 2 holds rank 1's box again: a gap
    ((0, 3, 7), "does not lie inside"),
])
def test_shards_that_do_not_tile_are_refused_with_assigns_words(starts, why):
    invs = [Inventory({"m": "a"}, [], rows([("m/ok", "shard", (6,), (2 * r,), (2,)),
                                            ("m/w", "shard", (9, 4), (start, 0), (3, 4))]))
            for r, start in enumerate(starts)]
    want = assign(invs)
    assert want[0].mismatch and why in want[0].error and "'m/w'" in want[0].error
    assert planned_alike(invs) == want


def test_ranks_not_alike_are_planned_whole():
    """Pipeline stages (different tensors), a tensor under a key made per-rank by its values, another
    order of rows: assign_alike declines and plan_posted plans them whole, as assign does."""
    stage = [Inventory({"m": "a"}, [], rows([("m/a", "replicated", (2,), (0,), (2,))])),
             Inventory({"m": "b"}, [], rows([("m/b", "replicated", (3,), (0,), (3,))]))]
    valued = [Inventory.of(flatten({"x": {"t": torch.zeros(2), "n": r}})) for r in range(2)]
    two = [("m/a", "replicated", (2,), (0,), (2,)), ("n/b", "replicated", (3,), (0,), (3,))]
    order = [Inventory({"m": "a", "n": "b"}, [], rows(two)), Inventory({"m": "a", "n": "b"}, [], rows(two[::-1]))]
    for invs in (stage, valued, order):
        posted, known = posts(invs)
        assert assign_alike(posted, known, len(invs), 1 << 20) is None
        assert [_assignment(d) for d in plan_posted(posted, known, len(invs), 1 << 20)] == assign(invs, 1 << 20)


def test_the_coordinators_work_follows_what_is_distinct_not_ranks_times_tensors(monkeypatch):
    """A Llama-shaped state of 84 tensors on 64 FSDP2 x TP8 ranks: the overlap check runs once per
    tensor class (same kind, dtype, shape and boxes on every rank), not once per tensor, and every
    rank's post names a handful of distinct boxes, not a box per tensor."""
    import ckpt.save.planning_alike as alike

    calls: list[int] = []
    real = alike.check_tiles
    monkeypatch.setattr(alike, "check_tiles", lambda boxes, shape: calls.append(len(boxes)) or real(boxes, shape))
    ranks = scale_sim.Ranks(scale_sim.MODELS["tiny"], "fsdp-tp8", 64)
    invs = [Inventory.of(ranks.flat(r)) for r in range(64)]
    posted, known = posts(invs)
    assert all(len(split(inv)[1]["boxes"]) <= 12 for inv in invs) and len(invs[0].tensors) == 84
    assert [_assignment(d) for d in assign_alike(posted, known, 64, 1 << 20) or []] == assign(invs, 1 << 20)
    shapes = {(r.kind, r.dtype, tuple(r.global_shape)) for r in invs[0].tensors}
    assert len(calls) <= 2 * len(shapes) < 84 and max(calls) <= 64, calls
