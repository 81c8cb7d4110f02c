"""Loading one committed step into the caller's state, in place, checking every chunk's hash.

Everything that can be checked before reading data is checked first (keys, shapes, dtypes,
pickle), so a mismatch costs no I/O and changes nothing. Then every chunk the state needs is read
once, in parallel, verified and scattered into staging memory (``staged``, the default: the
caller's tensors are written only once every chunk has checked out, so a damaged chunk changes
nothing), or straight into the caller's CPU tensors (``staged=False``: one copy and the staging
memory less, but a failure midway leaves a mixture of two steps). A chunk that maps onto one
contiguous piece of a destination (or of the staging memory, several stand-ins side by side) is read
or decoded straight into it. Only when every tensor is filled are
``load_state_dict`` calls made and plain values assigned.
:func:`load_into` runs three steps: the plan (:func:`ckpt.load.plan.plan_load`: match, checks,
destinations, values rebuilt, the reads), the reads (:func:`ckpt.load.reads.read_planned`: stage,
read, copy back), apply (:mod:`ckpt.load.apply`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Executor
from typing import Any

from ..format import manifest as mf
from ..storage import Storage
from . import held
from .apply import apply_values, init_optimizers
from .match import RankMap
from .plan import plan_load
from .reads import Lend, LoadStats, read_planned

__all__ = ["Lend", "LoadStats", "RankMap", "load_into"]


def load_into(storage: Storage, m: mf.Manifest, state: dict[str, Any], *, strict: bool, allow_pickle: bool,
              io: Executor, rank: int = 0, world: int = 1, rank_map: RankMap | None = None,
              on_change: Callable[[], None] | None = None,
              before_read: Callable[[set[str]], None] | None = None,
              staged: bool = True, lend: Lend | None = None,
              ready: Callable[[dict], dict] | None = None, budget: int | None = None,
              began: float | None = None) -> LoadStats:
    """Load manifest ``m`` into ``state`` as rank ``rank`` of ``world``; returns what was read.

    Every check comes before the first byte lands in the state (keys, shapes, dtypes, devices, the
    layout of modules and optimizers, pickles, the values themselves); then the chunks are read,
    every read finished or cancelled before this returns, and the values put in place. ``staged``:
    the reads land in staging memory (``lend``'s, else allocated here) and reach the caller's tensors
    only once every chunk has checked out. ``on_change`` is called just before the state is first
    changed (so a failure after it means a half-loaded state); ``before_read(chunks)`` before the
    first chunk is read, with every chunk the reads need; ``ready(note)`` once, just before the reads
    first write into the state (staged: after every chunk checked out; in place: before the
    reads): it may raise to stop the load there (other ranks failed), the state still unchanged,
    and returns what the loading ranks took together (their notes' :func:`ckpt.load.held.union`), so
    that ``strict`` refuses a key no rank holds. Alone (``world`` 1) that is checked before any read.
    ``budget``: the staging memory it may hold (``host_memory``; :mod:`ckpt.load.windows`). ``began``
    (``time.perf_counter()``): when the load began, for ``LoadStats.plan_s`` (default: now)."""
    began = time.perf_counter() if began is None else began
    if init_optimizers(state, m) and on_change is not None:
        on_change()
    plan = plan_load(m, state, rank, world, rank_map, strict=strict, allow_pickle=allow_pickle)
    checked = strict and world > 1 and ready is not None

    def changing() -> None:
        if ready is not None:
            together = ready(plan.note)
            if checked:
                held.check_all_taken(m, together)
        if on_change is not None:
            on_change()

    # Stand-ins: CPU memory the chunks are read into, copied into the tensors once every chunk has
    # checked out; for every destination on a device (or strided), and with ``staged`` for the
    # caller's own CPU tensors too. One allocation for all, or memory ``lend`` gives.
    stats = read_planned(storage, m, plan.boxes, plan.into, io, stand_in=(plan.own if staged else []) + plan.elsewhere,
                         staged=staged, lend=lend, before_read=before_read, before_write=changing, budget=budget,
                         began=began)
    apply_values(state, plan, strict)
    return stats
