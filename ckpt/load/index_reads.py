"""Which rank reports a load reads, for a step whose ``MANIFEST.json`` is an index (format v6,
:mod:`ckpt.format.index`): the index gives every tensor's shards as boxes (its layouts), so a rank
matches the step to its state on those boxes alone, finds the saved ranks whose boxes meet a box it
loads (its own shards, every whole tensor it takes, the per-rank state of the saved rank it maps
to), and reads only their reports, each checked against the index. What it builds is the manifest
:func:`ckpt.load.plan.plan_load` takes: every tensor, with the shards of those ranks and their chunks.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from ..errors import CheckpointError
from ..flatten import flatten
from ..format import index as ix_
from ..format import manifest as mf
from ..format.boxes import Box, intersect, volume
from ..storage import Storage
from .match import Match, RankMap, match


def needed_ranks(ix: ix_.Index, state: dict[str, Any], rank: int = 0, world: int = 1,
                 rank_map: RankMap | None = None) -> list[int] | None:
    """The saved ranks whose reports hold a box rank ``rank`` of ``world`` loads of step index ``ix``
    into ``state``; None where the state does not match the step (the load then reads every report,
    and its plan raises the error it would raise on a whole manifest). Pure. (The loader gives an
    optimizer over DTensors without state yet its state first, :func:`ckpt.load.apply.init_optimizers`:
    else its whole tensors would be asked for.)"""
    sk = ix.skeleton()
    try:
        target = flatten(state, for_target=True)
        found = match(sk, state, target, rank, world, rank_map)
    except CheckpointError:
        return None
    need: set[int] = set()
    entries = ix.entries()
    done: set[tuple[int, Box]] = set()  # tensors sharded alike share a layout: each (layout, box) met once
    for key, owner, offs, lens in _boxes(found, target):
        e = entries.get((key, owner))
        if e is None:
            return None  # the structure names a tensor the index lacks: the plan says so
        lay, box = e.layout, (tuple(offs), tuple(lens))
        if volume(lens) == 0 or e.segments is not None or (lay, box) in done:  # inlined: in the index itself
            continue
        done.add((lay, box))
        for r, saved in ix.layouts[lay]:
            if r not in need:
                inter = intersect(box, saved)
                if inter is not None and volume(inter[1]) > 0:
                    need.add(r)
    return sorted(need)


def _boxes(found: Match, target: Any) -> Iterator[tuple[str, int | None, tuple[int, ...], tuple[int, ...]]]:
    """(saved key, owner, offsets, lengths) of each box this rank loads: as :func:`ckpt.load.plan._destinations`
    places them (a rank's pieces of a sharded tensor; per-rank and absent tensors whole), without
    its checks or its allocations (the plan makes them, on the manifest these boxes select)."""
    for key, owner, tkey in found.wanted:
        e = found.entries.get((key, owner))
        shape = tuple(e.shape) if e is not None else ()
        whole = ((0,) * len(shape), shape)
        if tkey is None or target.tensors.get(tkey) is None or owner is not None:
            yield key, owner, *whole
            continue
        for pk in target.piece_keys(tkey):
            offs, lens = target.leaves[pk].box
            yield key, owner, tuple(offs), tuple(lens)


def step_for_load(storage: Storage, ix: ix_.Index, state: dict[str, Any], rank: int = 0, world: int = 1,
                  rank_map: RankMap | None = None) -> mf.Manifest:
    """The manifest a load of ``state`` as rank ``rank`` of ``world`` plans from: the reports of
    :func:`needed_ranks` read and checked against the index (all of them where the state does not fit)."""
    ranks = needed_ranks(ix, state, rank, world, rank_map)
    return ix_.partial_step(ix, ix_.read_reports(storage, ix, list(range(ix.world_size)) if ranks is None else ranks))
