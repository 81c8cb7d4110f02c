"""Boxes: the part of a global tensor a shard covers (offsets and lengths per dimension), and the
pure arithmetic over them that saving, the manifest's checks and resharding loads share."""

from __future__ import annotations

import math
from collections.abc import Sequence

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, lengths)


def volume(lengths: Sequence[int]) -> int:
    return math.prod(lengths)


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
