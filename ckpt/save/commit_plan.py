"""The step's layout from the save plan: rank 0's first commit of a plan without reading N rank reports.

Rank 0 already knows, after the plan round of ranks alike (:mod:`ckpt.save.planning_alike`), which rank
writes which box of which tensor: per tensor class, the boxes every rank holds and which of them it
is forced to write, and the rank chosen for each shared box. :func:`from_plan` turns that into the
step's layout in the index's form (one layout per class of tensors, never a Python object per rank
and tensor) and into what each rank's report must then hold: a digest of the multiset of its
(tensor, box) pairs (:func:`boxes_digest`), computed per rank over the classes with numpy. Each
rank sends the digest of its report's pairs in its summary; where every rank's matches, the layout
is taken from the plan and no report is read (:meth:`ckpt.save.commit_index.IndexBuilder.build`); a
mismatch (or a plan not of ranks alike, or a rank writing two boxes of one tensor, whose order only
its report gives) reads the reports as before.

The digest is a sum, modulo 2**64, of ``A(tensor) * B(box)`` (64-bit xxhash of each): a check
against a layout derived wrongly, not a defence against a hostile rank (the index names each report
by its digest, and every reader checks the reports it reads against it).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import xxhash

from ..format import index
from ..format import manifest as mf
from ..format.boxes import Box

MASK = (1 << 64) - 1


def _a(key: str, dtype: str, shape: Any, owner: int | None) -> int:
    return xxhash.xxh64_intdigest(json.dumps([key, dtype, list(shape), owner], separators=(",", ":")).encode())


def _b(offsets: Any, lengths: Any) -> int:
    # packed, not JSON: from_plan hashes every rank's distinct boxes (N per tensor class), 5x faster so
    offsets, lengths = tuple(offsets), tuple(lengths)
    return xxhash.xxh64_intdigest(struct.pack(f"<{len(offsets) + len(lengths)}q", *offsets, *lengths))


def boxes_digest(part: mf.Manifest) -> str:
    """The digest of a rank report's (tensor, box) pairs, in any order (what :func:`from_plan`
    predicts for each rank)."""
    total = 0
    for t in part.tensors:
        a = _a(t.key, t.dtype, t.shape, t.rank)
        for s in t.shards:
            total += a * _b(s.offsets, s.lengths)
    return f"{total & MASK:016x}"


@dataclass
class PlanLayout:
    """The step's layout as the plan gave it, and per rank the :func:`boxes_digest` its report must have."""

    tensors: list[tuple[str, str, tuple[int, ...], int | None, int]]  # key, dtype, shape, owner, layout
    layouts: list[index.Layout]
    digests: list[str]


def from_plan(plan: Any) -> PlanLayout | None:
    """The layout ``plan`` (a :class:`ckpt.save.planning_alike.AlikePlan`, placed) gives, or None where it
    cannot say it alone (a rank writing two boxes of one tensor; per-rank rows not of per-rank tensors)."""
    world = plan.world
    sums = np.zeros(world, np.uint64)
    ids: dict[index.Layout, int] = {}
    tensors: list[tuple[str, str, tuple[int, ...], int | None, int]] = []
    bh: dict[int, int] = {}
    chosen: dict[str, list[tuple[int, Box]]] = {}
    b_of: dict[Box, int] = {}

    def _b_of(box: Box) -> int:  # a box's hash, once per distinct box
        got = b_of.get(box)
        if got is None:
            got = b_of[box] = _b(*box)
        return got

    for key, r, box in plan.chosen:
        chosen.setdefault(key, []).append((r, box))
    with np.errstate(over="ignore"):
        for meta, keys, held, forced in plan.kinds:
            _kind, dtype, shape = meta
            per = forced.sum(axis=0)
            if (per > 1).any():
                return None
            rs = np.nonzero(per)[0]
            gs = held[np.argmax(forced[:, rs], axis=0), rs] if len(rs) else np.zeros(0, np.int64)
            bs = np.fromiter((bh[g] if g in bh else bh.setdefault(g, _b(*plan.gbox[g])) for g in gs.tolist()),
                             np.uint64, len(gs))
            sa = sum(_a(k, dtype, shape, None) for k in keys) & MASK
            sums[rs] += bs * np.uint64(sa)
            base = tuple((r, plan.gbox[g]) for r, g in zip(rs.tolist(), gs.tolist()))
            base_id: int | None = None  # a layout of N entries is hashed once per class, not once per tensor
            # The class's tensors with shared boxes (an empty box many ranks hold, written by one) mostly
            # get the same extras: their layout is built (sorted, checked: N entries) once per distinct set
            # of extras, not once per tensor (N per tensor: a third of from_plan's time at 4,096 ranks, growing as N²).
            with_extra: dict[tuple, int] = {}
            for k in keys:
                extra = chosen.pop(k, [])
                if extra:
                    a = _a(k, dtype, shape, None)
                    for r, box in extra:
                        sums[r] += np.uint64((a * _b_of(box)) & MASK)
                    sig = tuple(extra)
                    got = with_extra.get(sig)
                    if got is None:
                        lay = tuple(sorted(base + sig, key=lambda e: e[0]))
                        if len({r for r, _ in lay}) != len(lay):
                            return None
                        got = with_extra[sig] = ids.setdefault(lay, len(ids))
                    at = got
                else:
                    if base_id is None:
                        base_id = ids.setdefault(base, len(ids))
                    at = base_id
                tensors.append((k, dtype, tuple(shape), None, at))
        if chosen:
            return None
        for r, rows in sorted(plan.rows_of.items()):
            seen = set()
            for _i, key, kind, dtype, shape, offsets, lengths, _nbytes in rows:
                if kind != "rank" or key in seen:
                    return None
                seen.add(key)
                box = (tuple(offsets), tuple(lengths))
                sums[r] += np.uint64((_a(key, dtype, shape, r) * _b(*box)) & MASK)
                tensors.append((key, dtype, tuple(shape), r, ids.setdefault(((r, box),), len(ids))))
    return PlanLayout(tensors, list(ids), [f"{int(x):016x}" for x in sums.tolist()])


def lazily(keep: list) -> Callable[[], PlanLayout | None] | None:
    """What the snapshot carries to rank 0's commit: :func:`from_plan` of the plan kept, computed
    when first asked (on the commit thread, not in ``save()``), or None where no plan was kept."""
    if not keep:
        return None
    plan = keep[-1]
    memo: list[PlanLayout | None] = []

    def get() -> PlanLayout | None:
        nonlocal plan
        if not memo:
            memo.append(from_plan(plan))
            plan = None  # what from_plan made is all a later save asks for: the plan's memory goes
        return memo[0]
    return get
