"""Issue 35 item 3: the shard tiling check (``ckpt.format.boxes.check_tiles``), one sweep that the
save's plan and every load's manifest check share, exact at every shard count: against brute force,
past 512 shards (where nothing was checked for overlaps before), and on a hostile manifest."""

from __future__ import annotations

import itertools
import json
import os
import random
import time

import pytest
import torch

import ckpt
from ckpt.errors import ConfigError
from ckpt.format import paths
from ckpt.format.boxes import Box, check_tiles, intersect, overlap, volume
from ckpt.format.entries import Shard, TensorEntry, check_tiling
from ckpt.save.planning import Inventory, InventoryRow, assign


def brute(boxes: list[Box], shape: tuple[int, ...]) -> bool:
    """Whether ``boxes`` tile ``shape``: every pair compared, every element counted."""
    full = [b for b in boxes if volume(b[1]) > 0]
    return sum(volume(b[1]) for b in full) == volume(shape) and not any(
        intersect(a, b) for a, b in itertools.combinations(full, 2))


def guillotine(shape: tuple[int, ...], cuts: int, rng: random.Random) -> list[Box]:
    """A random tiling: boxes cut in two along a random dimension, ``cuts`` times."""
    boxes: list[Box] = [((0,) * len(shape), shape)]
    for _ in range(cuts):
        i = rng.randrange(len(boxes))
        o, n = boxes[i]
        dims = [d for d in range(len(n)) if n[d] > 1]
        if not dims:
            continue
        d = rng.choice(dims)
        c = rng.randrange(1, n[d])
        boxes[i:i + 1] = [(o, n[:d] + (c,) + n[d + 1:]),
                          (o[:d] + (o[d] + c,) + o[d + 1:], n[:d] + (n[d] - c,) + n[d + 1:])]
    return boxes


def shifted(boxes: list[Box], i: int, d: int, by: int) -> list[Box]:
    """``boxes`` with box ``i`` moved ``by`` along ``d``: the same total volume, an overlap and a gap."""
    o, n = boxes[i]
    return boxes[:i] + [(o[:d] + (o[d] + by,) + o[d + 1:], n)] + boxes[i + 1:]


def test_check_tiles_agrees_with_brute_force_on_random_tilings_and_near_tilings():
    rng = random.Random(35)
    found = {True: 0, False: 0}
    for _ in range(2000):
        nd = rng.randint(1, 3)
        shape = tuple(rng.randint(1, 6) for _ in range(nd))
        boxes = guillotine(shape, rng.randint(0, 14), rng)
        how = rng.random()
        if how < 0.5:  # a box moved inside the shape: the volume stays right
            i, d = rng.randrange(len(boxes)), rng.randrange(nd)
            o, n = boxes[i]
            lo, hi = -o[d], shape[d] - o[d] - n[d]
            boxes = shifted(boxes, i, d, rng.randint(lo, hi)) if hi > lo else boxes
        elif how < 0.6:  # one box twice, another dropped: the volume may stay right
            boxes = boxes + [boxes[0]] if len(boxes) == 1 else boxes[:-1] + [boxes[0]]
        if rng.random() < 0.1:
            boxes.append(((0,) * nd, (0,) * nd))  # an empty box covers nothing and overlaps nothing
        rng.shuffle(boxes)
        ok = brute(boxes, shape)
        why = check_tiles(boxes, shape)
        assert (why is None) == ok, (shape, boxes, why)
        if not ok and sum(volume(b[1]) for b in boxes) == volume(shape):
            assert "overlap" in why  # the right volume: the first overlap is named
        found[ok] += 1
    assert min(found.values()) > 400  # both answers were exercised


def rows(b: int) -> tuple[list[Box], tuple[int, ...]]:
    return [((4 * i,), (4,)) for i in range(b)], (4 * b,)


def grid(b: int, tp: int = 8) -> tuple[list[Box], tuple[int, ...]]:
    return [((2 * i, 3 * j), (2, 3)) for i in range(b // tp) for j in range(tp)], (2 * (b // tp), 3 * tp)


@pytest.mark.parametrize("layout", [rows, grid])
def test_an_overlap_of_the_right_volume_is_found_at_every_shard_count(layout):
    for b in (64, 513, 4096, 16384):
        boxes, shape = layout(b)
        t0 = time.perf_counter()
        assert check_tiles(boxes, shape) is None
        assert time.perf_counter() - t0 < 5.0  # pairwise would take minutes at 16,384
        i = b * 3 // 4
        bad = shifted(boxes, i, 0, -1)  # into its neighbour, a gap left behind
        why = check_tiles(bad, shape)
        assert why is not None and "overlap" in why
        entry = TensorEntry("w", "float32", list(shape), [Shard(0, list(o), list(n), []) for o, n in bad])
        with pytest.raises(ckpt.CorruptCheckpointError, match="do not tile.*overlap"):
            check_tiling(entry, "steps/x/MANIFEST.json")  # the load's manifest check
    # the save's plan: one rank holding 1,024 pieces, two of them overlapping
    boxes, shape = layout(1024)
    bad = shifted(boxes, 1000, 0, -1)
    pieces = [InventoryRow("m/w", "shard", "float32", list(shape), list(o), list(n), 4 * volume(n)) for o, n in bad]
    plans = assign([Inventory({"m": "same"}, [], pieces)])
    assert plans[0].error is not None and "do not tile" in plans[0].error and "overlap" in plans[0].error
    good = [r._replace(offsets=list(o)) for r, (o, _) in zip(pieces, boxes)]
    assert assign([Inventory({"m": "same"}, [], good)])[0].error is None


def test_overlap_agrees_with_brute_force_on_boxes_that_cover_part_of_a_shape():
    # One rank's pieces: any boxes, a part of the tensor, so only the overlap is checked, not the volume.
    rng = random.Random(36)
    found = {True: 0, False: 0}
    for _ in range(1500):
        nd = rng.randint(1, 3)
        boxes: list[Box] = []
        for _ in range(rng.randint(0, 8)):
            o = tuple(rng.randint(0, 6) for _ in range(nd))
            boxes.append((o, tuple(rng.randint(0, 3) for _ in range(nd))))
        full = [b for b in boxes if volume(b[1]) > 0]
        meets = any(intersect(a, b) for a, b in itertools.combinations(full, 2))
        why = overlap(boxes)
        assert (why is not None) == meets, (boxes, why)
        assert why is None or "overlap" in why
        found[meets] += 1
    assert min(found.values()) > 300  # both answers were exercised


@pytest.mark.parametrize("layout", [rows, grid])
def test_local_shards_refuses_overlapping_pieces_past_512_pieces(layout):
    # LocalShards checked pairs only up to 512 pieces, and nothing above; now the sweep, at every count.
    boxes, shape = layout(1024)
    boxes = boxes[:1000]  # a rank holds part of the tensor: the others hold the rest

    def pieces(bs: list[Box]) -> list[ckpt.LocalShard]:
        return [ckpt.LocalShard(torch.empty(n), o, shape) for o, n in bs]

    assert len(ckpt.LocalShards(pieces(boxes)).pieces) == 1000
    bad = shifted(boxes, 900, 0, -1)
    with pytest.raises(ConfigError, match=r"LocalShards: the pieces' boxes .* overlap"):
        ckpt.LocalShards(pieces(bad))


def test_boxes_too_entangled_for_the_work_bound_are_refused_not_accepted():
    # A brick wall: 16 columns, each cut at its own rows, so every box spans many rows' starts.
    rng = random.Random(7)
    k, h = 16, 256
    boxes: list[Box] = []
    for j in range(k):
        cuts = [0, *sorted(rng.sample(range(1, h), k - 1)), h]
        boxes += [((a, j), (z - a, 1)) for a, z in itertools.pairwise(cuts)]
    assert check_tiles(boxes, (h, k)) is None
    why = check_tiles(boxes, (h, k), work=len(boxes))
    assert why is not None and "too entangled" in why
    assert "inside shape" in check_tiles([((0, 15), (1, 2))], (1, 16))


def test_a_manifest_of_600_overlapping_shards_is_refused_at_load(ckdir):
    """A hostile manifest: 600 shards of 2 elements over one chunk, one moved onto its neighbour (the
    same volume). Pairwise checks stopped at 512 shards, so this loaded, element 1201 never written."""
    with ckpt.Checkpointer(ckdir, codec="raw") as c:
        c.save(1, {"w": torch.arange(1200.0)})
    path = os.path.join(ckdir, paths.manifest_key(1))
    with open(path) as f:
        doc = json.load(f)
    (h, _, _), = doc["tensors"][0]["shards"][0]["segments"]
    shards = [{"rank": 0, "offsets": [2 * i], "lengths": [2], "segments": [[h, 8 * i, 8]]} for i in range(600)]
    shards[300]["offsets"] = [599]  # over elements 599 and 600: 598's and 600's
    doc["tensors"][0]["shards"] = shards
    with open(path, "w") as f:
        json.dump(doc, f)
    state = {"w": torch.zeros(1200)}
    with pytest.raises(ckpt.CorruptCheckpointError, match="do not tile.*overlap"):
        ckpt.Checkpointer(ckdir).load(1, state)
    assert torch.equal(state["w"], torch.zeros(1200))  # refused before anything changed
