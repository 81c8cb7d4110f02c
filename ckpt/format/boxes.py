"""Boxes: the part of a global tensor a shard covers (offsets and lengths per dimension), and the
pure arithmetic over them that saving, the manifest's checks and resharding loads share."""

from __future__ import annotations

import bisect
import heapq
import math
from collections.abc import Sequence

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, lengths)


def volume(lengths: Sequence[int]) -> int:
    return math.prod(lengths)


def slices(box: Box) -> tuple[slice, ...]:
    """The box as an index: ``t[slices(box)]`` is its part of ``t``."""
    return tuple(slice(o, o + n) for o, n in zip(box[0], box[1]))


def intersect(a: Box, b: Box) -> Box | None:
    """The box common to ``a`` and ``b`` (None if they share no element)."""
    offs, lens = [], []
    for ao, al, bo, bl in zip(a[0], a[1], b[0], b[1]):
        lo, hi = max(ao, bo), min(ao + al, bo + bl)
        if hi <= lo:
            return None
        offs.append(lo)
        lens.append(hi - lo)
    return tuple(offs), tuple(lens)


def contiguous_run(inner: Box, outer_lengths: Sequence[int]) -> tuple[int, int] | None:
    """If box ``inner`` (in the coordinates of a row-major array of shape ``outer_lengths``) is one
    contiguous run of elements, return (first element, count); else None."""
    n = len(outer_lengths)
    if n == 0:
        return 0, 1
    offs, lens = inner
    # Find the first dim, from the inside, that is not taken whole; every dim outside it must be 1.
    k = n - 1
    while k > 0 and offs[k] == 0 and lens[k] == outer_lengths[k]:
        k -= 1
    if any(lens[j] != 1 for j in range(k)):
        return None
    strides = row_major_strides(outer_lengths)
    first = sum(o * s for o, s in zip(offs, strides))
    return first, volume(lens)


def row_major_strides(lengths: Sequence[int]) -> list[int]:
    strides, acc = [0] * len(lengths), 1
    for j in range(len(lengths) - 1, -1, -1):
        strides[j] = acc
        acc *= lengths[j]
    return strides


def next_needed(pos: int, outer_lengths: Sequence[int], inner: Box) -> int | None:
    """The smallest element index ``>= pos`` of a row-major array of shape ``outer_lengths`` that
    lies in box ``inner``; None if there is none. Used to tell which chunks of a saved shard hold
    any element a rank needs, without listing every element."""
    n = len(outer_lengths)
    total = volume(outer_lengths)
    if pos >= total or volume(inner[1]) == 0:
        return None
    if n == 0:
        return 0 if pos == 0 else None
    strides = row_major_strides(outer_lengths)
    idx, rem = [], pos
    for s in strides:
        idx.append(rem // s)
        rem %= s
    lo = list(inner[0])
    hi = [o + ln for o, ln in zip(inner[0], inner[1])]
    # Walk dims from the outside: keep the prefix equal to idx while it is inside the box; at the
    # first dim where idx leaves the box, either jump forward within that dim or carry outwards.
    out = [0] * n
    j = 0
    while j < n:
        if idx[j] < lo[j]:
            out[j] = lo[j]
            for q in range(j + 1, n):
                out[q] = lo[q]
            return sum(o * s for o, s in zip(out, strides))
        if idx[j] >= hi[j]:
            # carry: increment the nearest outer dim that can still grow inside the box
            q = j - 1
            while q >= 0 and out[q] + 1 >= hi[q]:
                q -= 1
            if q < 0:
                return None
            out[q] += 1
            for r in range(q + 1, n):
                out[r] = lo[r]
            return sum(o * s for o, s in zip(out, strides))
        out[j] = idx[j]
        j += 1
    return sum(o * s for o, s in zip(out, strides))


# -- do boxes tile a shape? --------------------------------------------------------------------------

# The sweep's work (box visits over every level) may reach this many per box, plus a constant, before
# the boxes count as too entangled to check: a saved layout (dp × tp grids, FSDP2 over TP blocks)
# needs about one visit per box per dimension, so only a manifest built to be slow reaches it.
WORK_PER_BOX = 32
WORK_FLOOR = 1 << 16


def check_tiles(boxes: Sequence[Box], shape: Sequence[int], work: int | None = None) -> str | None:
    """None if ``boxes`` (those of non-zero volume) tile ``shape`` exactly: each lies inside it, no two
    share an element (:func:`overlap`) and together they hold its volume; else what is wrong, naming the
    first overlap found.

    Example: ``check_tiles([((0,), (2,)), ((2,), (2,))], (4,))`` is None."""
    total = 0
    for offs, lens in boxes:
        n = volume(lens)
        if n == 0:
            continue
        if len(offs) != len(shape) or any(o < 0 or o + ln > d for o, ln, d in zip(offs, lens, shape)):
            return f"box {_show((offs, lens))} does not lie inside shape {list(shape)}"
        total += n
    if total != volume(shape):
        return f"the boxes hold {total} elements, the shape {volume(shape)}"
    return overlap(boxes, work)


def overlap(boxes: Sequence[Box], work: int | None = None) -> str | None:
    """None if no two of ``boxes`` (those of non-zero volume, all of one rank) share an element; else
    the first overlap found, or that the boxes are too entangled to check.

    No two boxes intersect iff, at every distinct start ``x`` along a sweep dimension, the boxes
    crossing ``x`` do not intersect on the other dimensions (two boxes that meet both cross the
    larger of their starts there), checked the same way, down to one dimension, where sorting
    suffices. The sweep dimension is the one where the boxes cross fewest starts (the rows of a
    row-sharded tensor, the columns of a column-sharded one), so a dp × tp grid costs a few visits
    per box and the whole check O(B log B), at every box count. Work is bounded (``WORK_PER_BOX``):
    boxes no saved layout makes, arranged to be slow, are reported as not checkable instead of costing
    time without limit; ``work``: that bound in box visits (default ``WORK_PER_BOX`` per box plus
    ``WORK_FLOOR``).

    Example: ``overlap([((0,), (3,)), ((2,), (2,))])`` is ``"boxes [0]+[3] and [2]+[2] overlap"``."""
    kept = [(tuple(o), tuple(n)) for o, n in boxes if volume(n) > 0]
    if len(kept) < 2:
        return None
    starts = [o for o, _ in kept]
    ends = [tuple(o + n for o, n in zip(offs, lens)) for offs, lens in kept]
    budget = [WORK_PER_BOX * len(starts) + WORK_FLOOR if work is None else work]
    pair = _meeting(list(range(len(starts))), tuple(range(len(starts[0]))), starts, ends, budget)
    if pair is None:
        return None
    if pair == (-1, -1):
        return f"the {len(starts)} boxes are too entangled to check within bounded work"
    a, b = (kept[i] for i in pair)
    return f"boxes {_show(a)} and {_show(b)} overlap"


def _show(box: Box) -> str:
    return f"{list(box[0])}+{list(box[1])}"


def _meeting(idx: list[int], dims: tuple[int, ...], starts: list[tuple[int, ...]], ends: list[tuple[int, ...]],
             budget: list[int]) -> tuple[int, int] | None:
    """Two of the boxes ``idx`` that intersect on ``dims``, None if none do, (-1, -1) once the budget
    is spent."""
    budget[0] -= len(idx)
    if budget[0] < 0:
        return -1, -1
    if len(idx) < 2:
        return None
    if not dims:
        return idx[0], idx[1]
    if len(dims) == 1:
        d = dims[0]
        order = sorted(idx, key=lambda i: starts[i][d])
        far = order[0]  # the box reaching furthest so far
        for i in order[1:]:
            if starts[i][d] < ends[far][d]:
                return far, i
            if ends[i][d] > ends[far][d]:
                far = i
        return None
    d = min(dims, key=lambda k: _crossings(idx, k, starts, ends))
    rest = tuple(k for k in dims if k != d)
    order = sorted(idx, key=lambda i: starts[i][d])
    active: list[tuple[int, int]] = []  # heap of (end on d, box) of the boxes crossing the sweep
    j = 0
    while j < len(order):
        x = starts[order[j]][d]
        while active and active[0][0] <= x:
            heapq.heappop(active)
        while j < len(order) and starts[order[j]][d] == x:
            heapq.heappush(active, (ends[order[j]][d], order[j]))
            j += 1
        found = _meeting([i for _, i in active], rest, starts, ends, budget)
        if found is not None:
            return found
    return None


def _crossings(idx: list[int], d: int, starts: list[tuple[int, ...]], ends: list[tuple[int, ...]]) -> int:
    """How many (box, distinct start) pairs a sweep along ``d`` visits: each box, once per start it spans."""
    xs = sorted({starts[i][d] for i in idx})
    return sum(bisect.bisect_left(xs, ends[i][d]) - bisect.bisect_left(xs, starts[i][d]) for i in idx)
