"""What a load reads, as data, before anything is read: pure functions of a manifest and the state.

:func:`plan_boxes` turns boxes of saved tensors into reads: for each chunk object that holds a
needed byte, the byte spans of it that are needed and where each lands (a destination box, or the
rows of a saved shard staged for a strided copy). :func:`plan_load` plans a step into a state: how
the saved structure meets the state (:mod:`.match`), every check that comes before a read (keys,
shapes, dtypes, devices, what ``load_state_dict`` would refuse, pickles, the values rebuilt), the
destination of every box, and their :class:`BoxPlan`. Neither touches storage, a process group or
the state: the reads (:mod:`.reads`) and putting things in place (:mod:`.apply`) come after.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from .. import tree as st
from ..errors import CorruptCheckpointError, StateMismatchError, UnsupportedValueError
from ..flatten import flatten
from ..format import manifest as mf
from ..format import paths
from ..format.boxes import Box, contiguous_run, intersect, next_needed, volume
from ..tree import DTYPES, ITEMSIZE
from . import held
from .checks import check_fit, check_writable
from .match import Match, RankMap, match


class Request(NamedTuple):
    """A box of a saved tensor to read: its key, the saved rank for per-rank state (None for a
    global tensor), and the box (offsets, lengths) in the global tensor."""

    key: str
    owner: int | None
    box: Box


class Feed(NamedTuple):
    """``length`` bytes at ``offset`` of a chunk land at byte ``at`` of target ``into``: a request's
    destination (``into`` < the number of requests: the box's bytes, row-major) or, past them, a
    :class:`RowStage`."""

    offset: int
    length: int
    into: int
    at: int


class RowStage(NamedTuple):
    """The saved rows that hold a box that is not one contiguous run on both sides: read into
    ``nbytes`` of memory shaped ``rows``, then ``in_stage`` of it copied to ``in_dest`` of request
    ``request``'s destination."""

    request: int
    nbytes: int
    rows: tuple[int, ...]
    in_dest: Box
    in_stage: Box


@dataclass
class BoxPlan:
    """The reads of a load: per chunk object, what of it is needed and where it lands."""

    step: int
    requests: list[Request]
    reads: dict[str, list[Feed]] = field(default_factory=dict)
    stages: list[RowStage] = field(default_factory=list)

    @property
    def chunks(self) -> list[str]:
        """The chunk objects read, sorted."""
        return sorted(self.reads)

    @property
    def nbytes(self) -> int:
        """The bytes of chunks that are needed (what lands; a read may fetch more, e.g. a whole
        compressed chunk)."""
        return sum(f.length for feeds in self.reads.values() for f in feeds)

    def spans(self, chunk: str) -> list[tuple[int, int]]:
        """The byte ranges (start, end) of ``chunk`` this plan needs, merged and sorted."""
        out: list[tuple[int, int]] = []
        for a, b in sorted((f.offset, f.offset + f.length) for f in self.reads.get(chunk, ())):
            if out and a <= out[-1][1]:
                out[-1] = (out[-1][0], max(out[-1][1], b))
            else:
                out.append((a, b))
        return out


def plan_boxes(m: mf.Manifest, requests: Sequence[Request],
               entries: dict[tuple[str, int | None], mf.TensorEntry] | None = None) -> BoxPlan:
    """The reads that fill each of ``requests`` (boxes of tensors of manifest ``m``), reading only
    chunks with a needed byte. Raises :class:`CorruptCheckpointError` where the saved shards do not
    cover a box (a damaged manifest). Pure.

    Example::

        plan = plan_boxes(m, [Request("model/w", None, ((0, 0), (4, 8)))])
        plan.chunks, plan.spans(plan.chunks[0])
    """
    if entries is None:
        entries = {(t.key, t.rank): t for t in m.tensors}
    plan = BoxPlan(m.step, list(requests))
    reads: dict[str, list[Feed]] = defaultdict(list)
    for i, (key, owner, box) in enumerate(plan.requests):
        e = entries[(key, owner)]
        need = volume(box[1])
        if need == 0:
            continue
        item = ITEMSIZE[e.dtype]
        covered = sum(_feed_shard(shard, item, i, box, len(plan.requests), reads, plan.stages) for shard in e.shards)
        if covered != need:
            raise CorruptCheckpointError(
                f"step {m.step}: the saved shards of {key!r} cover {covered} of the {need} elements this rank "
                "needs; the manifest is damaged",
                object=paths.manifest_key(m.step))
    plan.reads = dict(reads)
    return plan


def _feed_shard(shard: mf.Shard, item: int, i: int, dbox: Box, n: int, reads: dict[str, list[Feed]],
                stages: list[RowStage]) -> int:
    """Add what saved ``shard`` gives request ``i`` (box ``dbox``; ``n`` requests in all); the
    elements it covers."""
    sbox = (tuple(shard.offsets), tuple(shard.lengths))
    inter = intersect(dbox, sbox)
    if inter is None or volume(inter[1]) == 0:
        return 0
    in_s = (tuple(o - so for o, so in zip(inter[0], sbox[0])), inter[1])
    in_d = (tuple(o - do for o, do in zip(inter[0], dbox[0])), inter[1])
    run_s, run_d = contiguous_run(in_s, sbox[1]), contiguous_run(in_d, dbox[1])
    if run_s is not None and run_d is not None:
        lo, length = run_s[0] * item, run_s[1] * item
        for chunk, coff, size, spos in _pieces(shard, lo, lo + length):
            reads[chunk].append(Feed(coff, size, i, run_d[0] * item + spos - lo))
        return volume(inter[1])
    # Stage the saved rows that hold the box, reading only chunks with a needed element.
    r0, r1 = in_s[0][0], in_s[0][0] + in_s[1][0]
    row = math.prod(sbox[1][1:]) * item
    into = n + len(stages)
    for chunk, coff, size, spos in _pieces(shard, r0 * row, r1 * row):
        first = next_needed(spos // item, sbox[1], in_s)
        if first is not None and first * item < spos + size:
            reads[chunk].append(Feed(coff, size, into, spos - r0 * row))
    stages.append(RowStage(i, (r1 - r0) * row, (r1 - r0, *sbox[1][1:]), in_d, ((0, *in_s[0][1:]), in_s[1])))
    return volume(inter[1])


def _pieces(shard: mf.Shard, lo: int, hi: int) -> Iterator[tuple[str, int, int, int]]:
    """(chunk, offset in chunk, length, offset in the shard) of the shard bytes in [lo, hi)."""
    pos = 0
    for g in shard.segments:
        a, b = max(lo, pos), min(hi, pos + g.length)
        if a < b:
            yield g.chunk, g.offset + a - pos, b - a, a
        pos += g.length
        if pos >= hi:
            break


@dataclass
class LoadPlan:
    """A step planned into a state: the reads (``boxes``), the tensor each request lands in
    (``into``: the state's own, or a new one for a saved tensor the state does not hold), which of
    those are the caller's CPU tensors (``own``) and which are read through CPU memory (``elsewhere``:
    on a device, or strided), the values to put in place once the tensors are filled, the
    optimizers that keep their hyperparameters (``foreign``), and what this rank tells the others
    it takes of the step (``note``, :mod:`.held`)."""

    boxes: BoxPlan
    into: list[torch.Tensor]
    own: list[int]
    elsewhere: list[int]
    values: Any
    match: Match
    foreign: list[torch.optim.Optimizer]
    note: dict

    @property
    def chunks(self) -> list[str]:
        return self.boxes.chunks


def plan_load(m: mf.Manifest, state: dict[str, Any], rank: int = 0, world: int = 1, rank_map: RankMap | None = None,
              *, strict: bool = True, allow_pickle: bool = False) -> LoadPlan:
    """Plan loading manifest ``m`` into ``state`` as rank ``rank`` of ``world``: every check a load
    makes before it reads (raising its typed error, nothing changed), then which chunk objects to
    read, which bytes of each, into which destination box. Touches no storage, no process group, and
    does not change ``state``.

    Example::

        plan = plan_load(manifest, {"w": LocalShard(torch.empty(4, 8), [4, 0], [12, 8])}, rank=1, world=3)
        plan.chunks  # only the chunks holding rows 4 to 7
    """
    target = flatten(state, for_target=True)
    found = match(m, state, target, rank, world, rank_map)
    foreign = check_fit(m, found, state, target, strict)  # optimizers taking another kind's state
    note = held.taken(m, {k: found.nodes[k] for k in found.tops if k not in found.per_rank})
    if strict and world == 1:
        held.check_all_taken(m, {**note, "ranks": 1})
    check_writable(m, found, target)
    structure = st.dict_node(found.tops, [found.nodes[k] for k in found.tops])
    if st.has_pickle(structure) and not allow_pickle:
        raise UnsupportedValueError(
            f"step {m.step} holds pickled objects, and unpickling can run code from the checkpoint. "
            "Load with allow_pickle=True only if you trust its source.")
    dests = _destinations(m, found, target)
    # The values are rebuilt before any read: unpickling, or a node that cannot be rebuilt, fails now.
    try:
        values = st.rebuild(structure, dests.values, allow_pickle=allow_pickle)
    except (TypeError, ValueError, KeyError) as e:
        raise CorruptCheckpointError(f"step {m.step}: its values cannot be rebuilt ({type(e).__name__}: {e})",
                                     object=paths.manifest_key(m.step)) from e
    boxes = plan_boxes(m, dests.requests, found.entries)
    return LoadPlan(boxes, dests.into, dests.own, dests.elsewhere, values, found, foreign, note)


def shape_str(shape: tuple[int, ...] | list[int]) -> str:
    return "(" + ", ".join(map(str, shape)) + ")"


@dataclass
class _Dests:
    """Per request, the tensor it lands in; the values by saved key (for rebuilding the structure)."""

    requests: list[Request] = field(default_factory=list)
    into: list[torch.Tensor] = field(default_factory=list)
    values: dict[str, Any] = field(default_factory=dict)
    own: list[int] = field(default_factory=list)  # requests whose destination is the caller's CPU tensor
    elsewhere: list[int] = field(default_factory=list)  # ... a tensor on a device, or strided: read via the CPU

    def add(self, request: Request, into: torch.Tensor) -> int:
        self.requests.append(request)
        self.into.append(into)
        return len(self.requests) - 1


def _destinations(m: mf.Manifest, found: Match, target: Any) -> _Dests:
    """The caller's own (local) tensor when it is on the CPU and contiguous, else a new one; every
    dtype, shape and device checked. A rank may hold a tensor in several pieces: a request each."""
    out = _Dests()
    mismatches, on_meta = [], []
    for key, owner, tkey in found.wanted:
        e = found.entries.get((key, owner))
        if e is None:
            raise CorruptCheckpointError(f"step {m.step}: structure names tensor {key!r} that has no entry", object=key)
        dtype, shape = DTYPES[e.dtype], tuple(e.shape)
        t = target.tensors.get(tkey) if tkey is not None else None
        if t is None:
            local = torch.empty(shape, dtype=dtype)
            out.add(Request(key, owner, ((0,) * len(shape), shape)), local)
            out.values[key] = local
            continue
        assert tkey is not None
        leaf = target.leaves[tkey]
        gshape = tuple(t.shape) if owner is not None else tuple(leaf.global_shape)
        pieces = target.piece_keys(tkey)
        if gshape != shape or any(target.tensors[pk].dtype != dtype for pk in pieces):
            what = "" if gshape == tuple(t.shape) else " (global)"
            mismatches.append(f"{key}: checkpoint has {e.dtype}{shape_str(shape)}, state has "
                              f"{str(t.dtype).removeprefix('torch.')}{shape_str(gshape)}{what}")
            continue
        if any(target.tensors[pk].device.type == "meta" for pk in pieces):
            on_meta.append(tkey)
            continue
        for pk in pieces:
            t = target.tensors[pk]
            box = ((0,) * len(shape), shape) if owner is not None else target.leaves[pk].box
            if t.device.type == "cpu" and t.is_contiguous():
                out.own.append(out.add(Request(key, owner, box), t.detach() if t.requires_grad else t))
            else:  # given a CPU stand-in before any read (:func:`ckpt.load.reads.read_planned`)
                out.elsewhere.append(out.add(Request(key, owner, box), t))
        out.values[key] = target.targets[tkey]
    if mismatches:
        raise StateMismatchError(
            f"step {m.step} does not fit the state ({len(mismatches)} tensor(s)): " + "; ".join(mismatches[:6]) +
            (" …" if len(mismatches) > 6 else "") + ". Build the model/optimizer with the same shapes and dtypes "
            "as the run that saved it (cast after loading if you need another dtype).")
    if on_meta:
        raise StateMismatchError(
            f"{len(on_meta)} tensor(s) of the state are on the meta device, which holds no data to load into "
            f"({on_meta[:4]}{' …' if len(on_meta) > 4 else ''}). Materialise the model first, e.g. "
            "model.to_empty(device='cpu'), then load; nothing was changed.")
    return out
