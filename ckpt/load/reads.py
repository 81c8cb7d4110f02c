"""A plan's reads (:class:`ckpt.load.plan.BoxPlan`), and :func:`read_boxes`, the one way anything reads
boxes of saved tensors: ``Checkpointer.load`` and ``Reader.load_into`` (through
:func:`ckpt.load.into_state.load_into`), ``Reader.tensors`` and export (:mod:`ckpt.reader.tensors`),
and ``ckpt.dcp.Reader``.

Every chunk a plan names is read once, in parallel, verified (:mod:`.chunk_reads`) and put where it
lands: straight into a destination, or into a CPU stand-in in staging memory (one allocation, or
memory the caller lends) that is copied into its tensor only once every chunk has checked out, so a
damaged chunk changes nothing there.
"""

from __future__ import annotations

import bisect
import itertools
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch

from .._tasks import run_all, threads_of
from ..errors import CheckpointError, ConfigError, StateMismatchError
from ..format import manifest as mf
from ..format.boxes import Box, slices
from ..save.buffer_layout import ALIGN, aligned
from ..storage import Storage
from ..tree import DTYPES, dtype_name
from .apply import copy_back
from .chunk_reads import read_chunk
from .plan import BoxPlan, Request, plan_boxes, shape_str
from .windows import read_in_windows

# Lends staging memory for a load: ``lend(nbytes)`` is a context manager giving a uint8 CPU tensor of
# at least ``nbytes`` bytes (or None: the load allocates its own), held until the load is done.
Lend = Callable[[int], AbstractContextManager["torch.Tensor | None"]]


@dataclass
class LoadStats:
    """What a load read on this rank (``Checkpointer.last_load``). With a local tier (``local_dir``), also
    where the chunks came from.

    Attributes:
        step: the step.
        chunks_read: chunks read (each once).
        bytes_read: bytes read from storage (whole chunk objects, or the spans of them a box needed), over
            every pass.
        chunks: the hashes of the chunks read.
        local_chunks: chunks served by the local tier (None: no local tier).
        remote_chunks: chunks read from the remote tier.
        local_rejected: local copies that failed their check.
        source: "local tiers" (local commits) or "checkpoint" (the checkpoint path).
        peer_chunks: local commits: chunks this rank got from peers' tiers.
        rebuilt_chunks: local commits: chunks this rank rebuilt from parity.
        passes: times the chunks were read: 1, or 2 where staging within ``host_memory`` checked every
            chunk in a first pass before a second copied them out (:mod:`ckpt.load.windows`).
        windows: the windows of staging memory the reads went through (1: all at once).
        staging_bytes: the staging memory the load held (stand-ins and row stages).
        seconds: ``Checkpointer.load``'s whole time on this rank (choosing the step, the rounds with the
            other ranks, values put in place); 0.0 for reads of boxes alone (``Reader``, DCP).
        plan_s: reading the manifest and planning the reads (every check, and where each chunk's bytes
            land) until the first chunk is read; for reads of boxes alone, only the last of these.
        read_s: reading and verifying the chunks on the I/O threads, every pass.
        copy_s: copying the verified bytes from staging memory into the tensors.
        ``plan_s`` and the rest of ``seconds`` (less the three) are what more I/O threads do not
        shorten. The rest: choosing the step (and any step tried before it), rounds with the other
        ranks, chunks fetched for a local tier before the reads, values put in place, the run
        journal's record; for a load from local tiers also the manifest, read before planning.
    """

    step: int
    chunks_read: int = 0
    bytes_read: int = 0
    chunks: list[str] = field(default_factory=list)
    local_chunks: int | None = None
    remote_chunks: int | None = None
    local_rejected: list[str] = field(default_factory=list)
    source: str = "checkpoint"
    peer_chunks: int | None = None
    rebuilt_chunks: int | None = None
    passes: int = 1
    windows: int = 1
    staging_bytes: int = 0
    seconds: float = 0.0
    plan_s: float = 0.0
    read_s: float = 0.0
    copy_s: float = 0.0


class BoxRequest(NamedTuple):
    """A box of a saved tensor and the tensor it is read into (shaped like the box, of the saved
    dtype). ``rank``: the saved rank of a per-rank tensor (None for a global tensor)."""

    key: str
    box: Box
    into: torch.Tensor
    rank: int | None = None


def read_boxes(storage: Storage, m: mf.Manifest, requests: Sequence[BoxRequest | tuple], io: Executor, *,
               staged: bool = True, lend: Lend | None = None, budget: int | None = None) -> LoadStats:
    """Read each of ``requests`` (``(key, box, into)`` or :class:`BoxRequest`: a box (offsets,
    lengths) of tensor ``key`` of manifest ``m``) into its tensor, every chunk verified; returns
    what was read. Each chunk is read once, only chunks with a needed byte.

    Args:
        storage: where the step's chunks are.
        m: the step's manifest.
        requests: the boxes and where each goes: a tensor on any device, of the box's shape and the
            saved dtype.
        io: the threads that read.
        staged: read through staging memory, so that a damaged chunk leaves every ``into`` as it
            was; False reads straight into CPU tensors (fresh ones need no staging).
        lend: where staging memory comes from (else it is allocated).
        budget: the most staging memory to hold (bytes; None: no cap): reads that need more go in
            windows, twice when staged (:mod:`ckpt.load.windows`).

    Raises:
        StateMismatchError: a key the step does not hold, or a tensor of another dtype or shape.
        ConfigError: a box outside the tensor.
        CorruptCheckpointError: a chunk that does not verify.

    Example::

        w = torch.empty(4, 8)
        read_boxes(storage, manifest, [("model/w", ((4, 0), (4, 8)), w)], pool)  # rows 4 to 7
    """
    reqs = [r if isinstance(r, BoxRequest) else BoxRequest(*r) for r in requests]
    entries = {(t.key, t.rank): t for t in m.tensors}
    plan = plan_boxes(m, [_checked(m, entries, r) for r in reqs], entries)
    into = [r.into.detach() for r in reqs]
    own = [i for i, t in enumerate(into) if t.device.type == "cpu" and t.is_contiguous()]
    elsewhere = sorted(set(range(len(into))) - set(own))
    return read_planned(storage, m, plan, into, io, stand_in=(own if staged else []) + elsewhere, staged=staged,
                        lend=lend, budget=budget)


def _checked(m: mf.Manifest, entries: dict[tuple[str, int | None], mf.TensorEntry], r: BoxRequest) -> Request:
    """``r`` as a plan's request, once it is checked against the step (before anything is read)."""
    e = entries.get((r.key, r.rank))
    if e is None:
        ranks = sorted(k[1] for k in entries if k[0] == r.key and k[1] is not None)
        hint = f" (it is per-rank state: name one of its ranks {ranks})" if ranks else ""
        raise StateMismatchError(f"step {m.step} holds no tensor {r.key!r}" +
                                 (f" of rank {r.rank}" if r.rank is not None else "") + hint)
    (offsets, lengths), shape = r.box, tuple(e.shape)
    if len(offsets) != len(shape) or len(lengths) != len(shape) or any(
            o < 0 or n < 0 or o + n > s for o, n, s in zip(offsets, lengths, shape)):
        raise ConfigError(f"box {tuple(offsets)} + {tuple(lengths)} is not inside {r.key!r} of shape "
                          f"{shape_str(shape)} in step {m.step}; give offsets and lengths within it")
    if r.into.dtype != DTYPES[e.dtype] or tuple(r.into.shape) != tuple(lengths):
        raise StateMismatchError(
            f"{r.key!r} of step {m.step} is {e.dtype}: a box {shape_str(list(lengths))} of it cannot be read into "
            f"a tensor {dtype_name(r.into.dtype)}{shape_str(list(r.into.shape))}; read into one of the saved "
            "dtype and the box's shape, and cast after")
    if r.into.device.type == "meta":
        raise StateMismatchError(f"cannot read {r.key!r} into a tensor on the meta device, which holds no data")
    return Request(r.key, r.rank, (tuple(offsets), tuple(lengths)))


def read_planned(storage: Storage, m: mf.Manifest, plan: BoxPlan, into: list[torch.Tensor], io: Executor, *,
                 stand_in: Sequence[int] = (), staged: bool = True, lend: Lend | None = None,
                 before_read: Callable[[set[str]], None] | None = None,
                 before_write: Callable[[], None] | None = None, budget: int | None = None,
                 began: float | None = None) -> LoadStats:
    """Do ``plan``'s reads: request ``i`` lands in ``into[i]`` (its box's shape, the saved dtype; a
    CPU contiguous tensor unless it is in ``stand_in``, the requests read into CPU stand-ins and
    copied to their tensors at the end). ``before_read(chunks)`` runs just before the first read with
    every chunk the reads need; ``before_write()`` just before the reads first write into ``into``
    (``staged``: once every chunk has checked out; else before the first read): it may raise to stop
    there, nothing written. ``budget``: the bytes of staging memory it may hold (``host_memory``);
    where the reads need more they go in windows (:mod:`ckpt.load.windows`). ``began``
    (``time.perf_counter()``): when planning began, for ``plan_s`` (default: now). Every read is
    finished or cancelled before this returns."""
    began = time.perf_counter() if began is None else began  # until the first read: plan_s
    places, need = _places([into[i] for i in stand_in])
    if budget is not None and need + sum(s.nbytes for s in plan.stages) > budget:
        stats = LoadStats(m.step, chunks_read=len(plan.reads), chunks=sorted(plan.reads))
        read_in_windows(storage, m, plan, into, io, stand_in=stand_in, staged=staged, budget=budget, lend=lend,
                        before_read=before_read, before_write=before_write, stats=stats, began=began)
        return stats
    dest = list(into)
    pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
    with (lend(need) if lend is not None and need else nullcontext()) as lent:
        if need:
            space = lent if lent is not None else staging_memory(need)
            for i, pos in zip(stand_in, places):
                t = into[i]
                n = t.nbytes
                dest[i] = space[pos : pos + n].view(t.dtype).view(t.shape) if n else torch.empty(t.shape, dtype=t.dtype)
                pairs.append((t, dest[i]))
        stages = [np.empty(s.nbytes, dtype=np.uint8) for s in plan.stages]
        flats: dict[int, np.ndarray] = {}
        # A stand-in's bytes are addressed in the staging memory as a whole, so that the feeds of one
        # chunk into tensors laid out next to each other there join into one run (below): such a chunk
        # is read or decoded straight into staging, not into scratch memory and then copied.
        staging = space.view(torch.uint8).numpy() if need else None
        at_in_staging = dict(zip(stand_in, places))

        def target(k: int, at: int) -> tuple[np.ndarray, int]:
            """The array request ``k``'s byte ``at`` lands in, and where in it."""
            if k >= len(dest):
                return stages[k - len(dest)], at
            if k in at_in_staging and staging is not None and into[k].nbytes:
                return staging, at_in_staging[k] + at
            if k not in flats:
                flats[k] = dest[k].view(-1).view(torch.uint8).numpy()
            return flats[k], at

        gaps = _FreeGaps(staging, [(p, into[i].nbytes) for i, p in zip(stand_in, places)])
        feeds = {h: _joined([(f.offset, f.length, *target(f.into, f.at)) for f in fs], gaps)
                 for h, fs in plan.reads.items()}
        stats = LoadStats(m.step, chunks_read=len(feeds), chunks=sorted(feeds),
                          staging_bytes=need + sum(s.nbytes for s in plan.stages))
        stats.plan_s = time.perf_counter() - began
        if before_read is not None:
            before_read(set(feeds))
        if not staged and before_write is not None:
            before_write()
        t0 = time.perf_counter()
        reads = run_all(io, lambda item: read_chunk(storage, m, item[0], item[1]), list(feeds.items()),
                        width=storage.read_width)
        stats.read_s = time.perf_counter() - t0
        stats.bytes_read = sum(reads)
        if staged and before_write is not None:  # every chunk checked out: from here on the tensors change
            before_write()
        t0 = time.perf_counter()
        with torch.no_grad():
            for s, rows in zip(plan.stages, stages):
                local = dest[s.request]
                src = torch.from_numpy(rows).view(local.dtype).view(s.rows)
                local[slices(s.in_dest)].copy_(src[slices(s.in_stage)])
            copy_back(pairs, threads_of(io))
        stats.copy_s = time.perf_counter() - t0
    return stats


def _joined(feeds: list[tuple[int, int, np.ndarray, int]], gaps: _FreeGaps) -> list[tuple[int, int, np.ndarray, int]]:
    """A chunk's feeds, those that continue one another on both sides joined into one: the next feed
    starts in the same array as many bytes after the last one as it does in the chunk, with nothing
    between them on either side but padding (at most ``_PAD`` bytes, and in staging memory bytes no
    tensor stands in). A chunk of several whole tensors staged as the host buffer lays them out is
    then one feed, read or decoded in place instead of through scratch memory."""
    out: list[tuple[int, int, np.ndarray, int]] = []
    for off, length, flat, at in sorted(feeds, key=lambda f: f[0]):
        if out:
            o, n, f, a = out[-1]
            gap = off - (o + n)
            if f is flat and 0 <= gap <= _PAD and at - (a + n) == gap and (gap == 0 or gaps.free(f, a + n, at)):
                out[-1] = (o, off + length - o, f, a)
                continue
        out.append((off, length, flat, at))
    return out


_PAD = ALIGN  # padding between two tensors a save lays out is less (ckpt.save.buffer_layout.aligned)


class _FreeGaps:
    """Which byte ranges of staging memory no stand-in takes (the padding between them)."""

    def __init__(self, staging: np.ndarray | None, spans: list[tuple[int, int]]):
        self.staging = staging
        spans = sorted(spans)
        self.starts = [p for p, _ in spans]
        self.ends = list(itertools.accumulate((p + n for p, n in spans), max))  # furthest end so far

    def free(self, array: np.ndarray, lo: int, hi: int) -> bool:
        if array is not self.staging or lo >= hi:
            return False
        k = bisect.bisect_left(self.starts, hi)  # spans starting before hi: starts[:k]
        return k == 0 or (self.ends[k - 1] <= lo)


def staging_memory(nbytes: int) -> torch.Tensor:
    """``nbytes`` of CPU memory for a load to stage into; a typed error saying what to do when the
    machine has not got it."""
    try:
        return torch.empty(nbytes, dtype=torch.uint8)
    except (RuntimeError, MemoryError) as e:
        raise CheckpointError(f"could not allocate {nbytes / 2**20:.0f} MiB of staging memory for the load ({e}); "
                              "set host_memory= to a budget the machine has (the load then reads in windows "
                              "of that size, still changing nothing unless every chunk checks out), or load "
                              "with staged_load=False to read straight into the tensors") from e


def _places(tensors: list[torch.Tensor]) -> tuple[list[int], int]:
    """Where each tensor's stand-in goes in staging memory, and the bytes it takes: the host buffer's
    own rule (:func:`ckpt.save.buffer_layout.aligned`), so a state's staging fits in its host buffer,
    which a load mid-run borrows."""
    places, pos = [], 0
    for t in tensors:
        pos = aligned(pos, t.nbytes, t.element_size())
        places.append(pos)
        pos += t.nbytes
    return places, pos

