"""A plan's reads within a host-memory budget (option ``host_memory``): where the staging a load
needs is more than the budget, the staged tensors are cut into windows that each fit it, and the
chunks are read window by window into one reused buffer.

Staged (the default), a load stays atomic in two passes: the first reads and checks every chunk
window by window and keeps nothing (the caller's tensors untouched, so a damaged chunk changes
nothing); the second reads each window again, every chunk checked again, and copies it out. A chunk
that checked out in the first pass and fails in the second (the stored object was damaged or
deleted during the load) fails the load naming it, with the windows before it already copied: the state is then a
mixture of two steps, and saves are refused until a load succeeds (as after a failed
``staged_load=False`` load). Unstaged, one pass reads and copies window by window.

A tensor is cut along its first dimension, whole rows per window; a row larger than the budget, a
0-d tensor, and a tensor filled from saved rows of another layout (its :class:`~.plan.RowStage`s
with it) are staged whole, so such a window may exceed the budget (``LoadStats.staging_bytes``
says what was held).
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from .._tasks import run_all, threads_of
from ..errors import CorruptCheckpointError
from ..format import manifest as mf
from ..format.boxes import slices
from ..save.buffer_layout import aligned
from ..storage import Storage
from .apply import copy_back
from .chunk_reads import read_chunk
from .plan import BoxPlan, Feed

if TYPE_CHECKING:
    from .reads import Lend, LoadStats


@dataclass
class Piece:
    """Rows ``[r0, r1)`` of target ``k`` (a request's stand-in; past the requests, a row stage),
    bytes ``[lo, hi)`` of it, at byte ``at`` of the window."""

    k: int
    r0: int
    r1: int
    lo: int
    hi: int
    at: int = 0


@dataclass
class Window:
    """Pieces read together into the window buffer; ``nbytes``: how much of it they take."""

    pieces: list[Piece] = field(default_factory=list)
    nbytes: int = 0

    def add(self, p: Piece, item: int) -> None:
        p.at = aligned(self.nbytes, p.hi - p.lo, item)
        self.nbytes = p.at + p.hi - p.lo
        self.pieces.append(p)

    def fits(self, size: int, item: int, budget: int) -> bool:
        return not self.pieces or aligned(self.nbytes, size, item) + size <= budget


def windows(plan: BoxPlan, into: Sequence[torch.Tensor], stand_in: Sequence[int], budget: int) -> list[Window]:
    """Cut the staged targets into windows of at most ``budget`` bytes each (whole rows; what cannot
    be cut goes whole, alone where it is over the budget). Pure."""
    n = len(into)
    staged_rows: dict[int, list[int]] = {}
    for j, s in enumerate(plan.stages):
        staged_rows.setdefault(s.request, []).append(n + j)
    out: list[Window] = [Window()]

    def place(pieces: list[tuple[Piece, int]]) -> None:
        size = sum(p.hi - p.lo for p, _ in pieces)
        if not out[-1].fits(size, max(item for _, item in pieces), budget):
            out.append(Window())
        for p, item in pieces:
            out[-1].add(p, item)

    for i in stand_in:
        t = into[i]
        item = t.element_size()
        if i in staged_rows or t.dim() == 0 or t.shape[0] == 0:  # staged whole, with its row stages
            group = [(Piece(i, 0, t.shape[0] if t.dim() else 1, 0, t.nbytes), item)]
            group += [(Piece(k, 0, 1, 0, plan.stages[k - n].nbytes), item) for k in staged_rows.get(i, [])]
            place(group)
            continue
        rows, row = t.shape[0], t.nbytes // t.shape[0]
        r = 0
        while r < rows:
            room = budget - aligned(out[-1].nbytes, budget, item)  # the widest alignment a piece may take
            take = min(rows - r, max(room // row, 0) if row else rows - r)
            if take == 0:
                if out[-1].pieces:
                    out.append(Window())
                    continue
                take = 1  # one row over the budget: alone
            out[-1].add(Piece(i, r, r + take, r * row, (r + take) * row), item)
            r += take
    for k, s in enumerate(plan.stages, start=n):  # row stages of requests read in place (unstaged)
        if s.request not in stand_in:
            place([(Piece(k, 0, 1, 0, s.nbytes), into[s.request].element_size())])
    return [w for w in out if w.pieces]


def read_in_windows(storage: Storage, m: mf.Manifest, plan: BoxPlan, into: list[torch.Tensor], io: Executor, *,
                    stand_in: Sequence[int], staged: bool, budget: int, lend: Lend | None,
                    before_read: Callable[[set[str]], None] | None,
                    before_write: Callable[[], None] | None, stats: LoadStats, began: float) -> None:
    """:func:`ckpt.load.reads.read_planned` within ``budget`` bytes of staging: see the module's
    docstring. Fills ``stats`` (a :class:`~.reads.LoadStats`): bytes read over every pass, the
    passes, the windows, the staging held, and the times (planning from ``began``, a
    ``time.perf_counter()``, to the first read)."""
    from .reads import staging_memory  # the module that calls this one

    cut = windows(plan, into, stand_in, budget)
    held = max(w.nbytes for w in cut)
    stats.passes, stats.windows, stats.staging_bytes = (2 if staged else 1), len(cut), held
    in_place = sorted(set(range(len(into))) - set(stand_in))
    index = feed_index(plan)
    with (lend(held) if lend is not None else nullcontext()) as lent:
        space = lent if lent is not None else staging_memory(held)
        flat = space[:held].numpy()
        stats.plan_s = time.perf_counter() - began
        if before_read is not None:
            before_read(set(plan.reads))
        if staged:
            for w in cut:  # pass 1: every chunk checked, nothing kept
                t0 = time.perf_counter()
                stats.bytes_read += _read_window(storage, m, index, into, io, w, flat, in_place if w is cut[0] else ())
                stats.read_s += time.perf_counter() - t0
        if before_write is not None:
            before_write()
        for w in cut:
            t0 = time.perf_counter()
            try:
                stats.bytes_read += _read_window(storage, m, index, into, io, w, flat,
                                                 () if staged or w is not cut[0] else in_place)
            except CorruptCheckpointError as e:
                if not staged:
                    raise
                done = "nothing was" if w is cut[0] else "part of the state was"
                raise type(e)(  # the same class (a missing chunk stays MissingChunkError)
                    f"{e} (it checked out in this load's first pass and not in its second: the stored object changed "
                    f"or went away while step {m.step} loaded; {done} written before this)",
                    object=e.object, chunk=e.chunk) from e
            t1 = time.perf_counter()
            stats.read_s += t1 - t0
            _copy_out(plan, into, w, space, threads_of(io))
            stats.copy_s += time.perf_counter() - t1


# Per target, its feeds sorted by where they land: (the positions, (position, chunk, feed) each).
FeedIndex = dict[int, tuple[list[int], list[tuple[int, str, Feed]]]]


def feed_index(plan: BoxPlan) -> FeedIndex:
    """``plan``'s feeds by target, sorted by where they land (a window finds its own by bisection)."""
    by: dict[int, list[tuple[int, str, Feed]]] = {}
    for h, fs in plan.reads.items():
        for f in fs:
            by.setdefault(f.into, []).append((f.at, h, f))
    return {k: ([at for at, _, _ in items], items) for k, items in ((k, sorted(v)) for k, v in by.items())}


def _read_window(storage: Storage, m: mf.Manifest, index: FeedIndex, into: list[torch.Tensor], io: Executor,
                 w: Window, flat: np.ndarray, in_place: Any) -> int:
    """Read every chunk that feeds window ``w`` (and the targets ``in_place``, read straight into
    their tensors) into ``flat``, each checked; returns the bytes read."""
    feeds: dict[str, list[tuple[int, int, np.ndarray, int]]] = {}
    for k in in_place:
        dest = into[k].view(-1).view(torch.uint8).numpy()
        for at, h, f in index.get(k, ([], []))[1]:
            feeds.setdefault(h, []).append((f.offset, f.length, dest, at))
    for p in w.pieces:
        ats, items = index.get(p.k, ([], []))
        i = max(bisect.bisect_right(ats, p.lo) - 1, 0)
        while i < len(items) and items[i][0] < p.hi:
            at, h, f = items[i]
            lo, hi = max(at, p.lo), min(at + f.length, p.hi)
            if lo < hi:
                feeds.setdefault(h, []).append((f.offset + lo - at, hi - lo, flat, p.at + lo - p.lo))
            i += 1
    return sum(run_all(io, lambda item: read_chunk(storage, m, item[0], item[1]), list(feeds.items()),
                       width=storage.read_width))


def _copy_out(plan: BoxPlan, into: list[torch.Tensor], w: Window, space: torch.Tensor,
              threads: int | None = None) -> None:
    """Copy window ``w``'s verified pieces to their tensors: row stages into their request's
    stand-in (in the window too, or the tensor itself), then the stand-ins' rows."""
    n = len(into)
    views: dict[int, torch.Tensor] = {}
    for p in w.pieces:
        if p.k < n:
            t = into[p.k]
            shape = (p.r1 - p.r0, *t.shape[1:]) if t.dim() else t.shape
            views[p.k] = space[p.at : p.at + p.hi - p.lo].view(t.dtype).view(shape)
    with torch.no_grad():
        for p in w.pieces:
            if p.k >= n:
                s = plan.stages[p.k - n]
                dest = views.get(s.request, into[s.request])
                t = into[s.request]
                src = space[p.at : p.at + s.nbytes].view(t.dtype).view(s.rows)
                dest[slices(s.in_dest)].copy_(src[slices(s.in_stage)])
        copy_back([(into[p.k][p.r0 : p.r1] if into[p.k].dim() else into[p.k], views[p.k])
                   for p in w.pieces if p.k < n and views[p.k].numel()], threads)

