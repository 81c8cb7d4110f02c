"""Loading one committed step into the caller's state, in place, checking every chunk's hash.

Everything that can be checked before reading data is checked first (keys, shapes, dtypes,
pickle), so a mismatch costs no I/O and changes nothing. Then every chunk the state needs is read
once, in parallel, verified and scattered into staging memory (``staged``, the default: the
caller's tensors are written only once every chunk has checked out, so a damaged chunk changes
nothing), or straight into the caller's CPU tensors (``staged=False``: one copy and the staging
memory less, but a failure midway leaves a mixture of two steps). A raw chunk that maps onto one
contiguous piece of a destination is read straight into it. Only when every tensor is filled are
``load_state_dict`` calls made and plain values assigned.
:func:`load_into` runs these steps in order: match, check, destinations, stage, feeds, rebuild,
read, copy back, apply.
"""

from __future__ import annotations

import logging
import math
from collections import defaultdict
from collections.abc import Callable, Iterator
from concurrent.futures import Executor
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from .. import _cpus, _ext
from .. import tree as st
from .._tasks import run_all
from ..buffer_layout import aligned
from ..errors import (
    CheckpointError,
    ConfigError,
    CorruptCheckpointError,
    ReshardError,
    StateMismatchError,
    UnsupportedValueError,
)
from ..flatten import apply, flatten
from ..format import manifest as mf
from ..format import paths
from ..format.boxes import Box, contiguous_run, intersect, next_needed, volume
from ..sharding import is_dtensor
from ..storage import Storage
from ..tied import unresolved
from ..tree import DTYPES
from . import held
from .checks import check_fit, check_writable, keep_hyperparameters
from .chunk_reads import read_chunk

log = logging.getLogger("ckpt")

RankMap = Callable[[int], int] | dict[int, int] | list[int]
# Lends staging memory for a load: ``lend(nbytes)`` is a context manager giving a uint8 CPU tensor of
# at least ``nbytes`` bytes (or None: the load allocates its own), held until the load is done.
Lend = Callable[[int], AbstractContextManager["torch.Tensor | None"]]


@dataclass
class LoadStats:
    """What a load read. With a local tier (``local_dir``), also where the chunks came from."""

    step: int
    chunks_read: int = 0
    bytes_read: int = 0
    chunks: list[str] = field(default_factory=list)  # the hashes of the chunks read
    local_chunks: int | None = None  # chunks served by the local tier (None: no local tier)
    remote_chunks: int | None = None  # chunks read from the remote tier
    local_rejected: list[str] = field(default_factory=list)  # local copies that failed their check
    source: str = "checkpoint"  # "local tiers" (local commits) or "checkpoint" (the checkpoint path)
    peer_chunks: int | None = None  # local commits: chunks this rank got from peers' tiers
    rebuilt_chunks: int | None = None  # local commits: chunks this rank rebuilt from parity


def _shape_str(shape: tuple[int, ...] | list[int]) -> str:
    return "(" + ", ".join(map(str, shape)) + ")"


def load_into(storage: Storage, m: mf.Manifest, state: dict[str, Any], *, strict: bool, allow_pickle: bool,
              io: Executor, rank: int = 0, world: int = 1, rank_map: RankMap | None = None,
              on_change: Callable[[], None] | None = None,
              before_read: Callable[[set[str]], None] | None = None,
              staged: bool = True, lend: Lend | None = None,
              ready: Callable[[dict], list[dict]] | None = None) -> LoadStats:
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
    and returns every loading rank's ``note`` (what each took of the step: :mod:`ckpt.load.held`), so
    that ``strict`` refuses a key no rank holds. Alone (``world`` 1) that is checked before any read."""
    if _init_optimizers(state, m) and on_change is not None:
        on_change()
    target = flatten(state, for_target=True)
    match = _match(m, state, target, rank, world, rank_map)
    foreign = check_fit(m, match, state, target, strict)  # optimizers taking another kind's state
    note = held.taken(m, {k: match.nodes[k] for k in match.tops if k not in match.per_rank})
    if strict and world == 1:
        held.check_all_taken(m, [note])
    checked = strict and world > 1 and ready is not None
    check_writable(m, match, target)
    structure = st.dict_node(match.tops, [match.nodes[k] for k in match.tops])
    if st.has_pickle(structure) and not allow_pickle:
        raise UnsupportedValueError(
            f"step {m.step} holds pickled objects, and unpickling can run code from the checkpoint. "
            "Load with allow_pickle=True only if you trust its source.")
    dests = _destinations(m, match, target)
    # The values are rebuilt before any read: unpickling, or a node that cannot be rebuilt, fails now.
    try:
        decoded = st.rebuild(structure, dests.values, allow_pickle=allow_pickle)
    except (TypeError, ValueError, KeyError) as e:
        raise CorruptCheckpointError(f"step {m.step}: its values cannot be rebuilt ({type(e).__name__}: {e})",
                                     object=paths.manifest_key(m.step)) from e
    # Stand-ins: CPU memory the chunks are read into, copied into the tensors once every chunk has
    # checked out; for every destination on a device (or strided), and with ``staged`` for the
    # caller's own CPU tensors too. One allocation for all, or memory ``lend`` gives.
    keys = (dests.own if staged else []) + dests.elsewhere
    places, need = _places([dests.tensors[k][0] for k in keys])
    with (lend(need) if lend is not None and need else nullcontext()) as lent:
        if need:
            _stand_ins(dests, keys, places, lent if lent is not None else staging_memory(need))
        feeds, strided = _feeds(m, match, dests)
        stats = LoadStats(m.step, chunks_read=len(feeds), chunks=sorted(feeds))
        if before_read is not None:
            before_read(set(feeds))
        if not staged:
            _changing(ready, on_change, m, note, checked)
        reads = run_all(io, lambda item: read_chunk(storage, m, item[0], item[1]), list(feeds.items()),
                        width=storage.read_width)
        stats.bytes_read = sum(reads)
        if staged:  # every chunk checked out: from here on the state changes
            _changing(ready, on_change, m, note, checked)
        with torch.no_grad():
            for local, in_d, stage, rows_shape, in_stage in strided:
                src = torch.from_numpy(stage).view(local.dtype).view(rows_shape)
                local[_slices(in_d)].copy_(src[_slices(in_stage)])
            _copy_back(dests.copy_back)
    restore = keep_hyperparameters(foreign)
    apply(state, decoded, strict=strict)
    restore()  # AdamW's state into SGD leaves SGD's lr and momentum as they were
    return stats


@dataclass
class _Match:
    """How the saved step meets the state: the top-level keys loaded, their saved nodes (per-rank ones
    from the source rank; the others as far as the state holds them: :func:`ckpt.load.held.held_part`),
    and per saved tensor (saved key, saved rank, the state's key or None)."""

    tops: list[str]
    per_rank: list[str]
    nodes: dict[str, Any]
    entries: dict[tuple[str, int | None], mf.TensorEntry]
    wanted: list[tuple[str, int | None, str | None]]
    unexpected: list[str]  # top-level keys in the checkpoint, not in the state
    missing: list[str]  # top-level keys and tensors of the state, not in the checkpoint


def _match(m: mf.Manifest, state: dict[str, Any], target: Any, rank: int, world: int,
           rank_map: RankMap | None) -> _Match:
    saved_nodes = dict(st.top_items(m.structure))
    wanted_top = [k for k in m.top_keys if k in state]
    # Per-rank state: which saved rank this rank takes it from.
    per_rank = [k for k in wanted_top if st.is_per_rank(saved_nodes[k])]
    src_rank = _source_rank(m, per_rank, rank, world, rank_map) if per_rank else None
    nodes = {k: saved_nodes[k]["v"][src_rank] if k in per_rank else saved_nodes[k] for k in wanted_top}
    nodes = {k: _module_states(v, state[k]) for k, v in nodes.items()}
    mine = dict(st.top_items(target.structure))
    nodes = {k: v if k in per_rank else held.held_part(v, mine[k], state[k]) for k, v in nodes.items()}
    entries = {(t.key, t.rank): t for t in m.tensors}
    # Saved tensors meet the state's by their path in the structure (keys with their types), never
    # by their printed names: {"a/b": x, "a": {"b": y}} or {0: x, "0": y} cannot be swapped.
    target_key = {path: key for key, path in target.paths.items()}
    wanted: list[tuple[str, int | None, str | None]] = []
    for top in wanted_top:
        for path, key in st.tensor_paths(nodes[top], (st.path_component(top),)):
            owner = src_rank if top in per_rank and (key, src_rank) in entries else None
            wanted.append((key, owner, target_key.get(path)))
    found = {tk for _, _, tk in wanted if tk is not None}
    missing_top = [k for k in state if k not in saved_nodes]
    missing_tensors = _untied([k for k in target.paths if k not in found and k.split("/", 1)[0] in saved_nodes],
                              found, target)
    return _Match(wanted_top, per_rank, nodes, entries, wanted, [k for k in m.top_keys if k not in state],
                  missing_top + missing_tensors)


def _module_states(node: Any, live: Any) -> Any:
    """``node`` with each plain dict saved where the state holds a module read as that module's state:
    a module's ``state_dict()`` saved as a dict (``dcp.save({"model": model.state_dict()})`` through
    ``ckpt.dcp.Writer``) then loads into ``{"model": model}`` with ``load_state_dict``, as the
    Checkpointer's own save of the module does."""
    if isinstance(live, torch.nn.Module):
        if st.kind(node) != "dict":
            return node
        return {"t": "stateful", "type": f"{type(live).__module__}.{type(live).__qualname__}", "v": node}
    if not isinstance(live, dict) or st.kind(node) != "dict":
        return node
    values = [_module_states(v, live[k]) if isinstance(k, str) and k in live else v
              for k, v in zip(node["k"], node["v"])]
    return node if all(a is b for a, b in zip(values, node["v"])) else {**node, "v": values}


def _untied(missing: list[str], found: set[str], target: Any) -> list[str]:
    """``missing`` without the modules' tied keys whose partner the step holds (:mod:`ckpt.tied`)."""
    for where, obj in target.statefuls.items() if missing else ():
        if isinstance(obj, torch.nn.Module):
            mine = {k[len(where) + 1:] for k in missing if k.startswith(where + "/")}
            if mine:
                have = {k[len(where) + 1:] for k in found if k.startswith(where + "/")}
                left = set(unresolved(obj, have, mine))
                missing = [k for k in missing if not k.startswith(where + "/") or k[len(where) + 1:] in left]
    return missing


Piece = tuple[str, int]  # (saved key, piece index): a destination; a rank may hold a tensor in several pieces


@dataclass
class _Dests:
    """Where each saved tensor goes: (tensor, box) by piece of saved key (one piece for most tensors,
    several for a tensor the rank holds in pieces); the values by saved key (for rebuilding the
    structure); (the state's tensor, its CPU stand-in) pairs copied back at the end."""

    tensors: dict[Piece, tuple[torch.Tensor, Box]] = field(default_factory=dict)
    values: dict[str, Any] = field(default_factory=dict)
    copy_back: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    own: list[Piece] = field(default_factory=list)  # pieces whose destination is the caller's CPU tensor
    elsewhere: list[Piece] = field(default_factory=list)  # ... a tensor on a device, or strided: read via the CPU
    pieces: dict[str, int] = field(default_factory=dict)  # saved key -> how many pieces it goes to

    def of(self, key: str) -> list[Piece]:
        return [(key, i) for i in range(self.pieces.get(key, 1))]


def _destinations(m: mf.Manifest, match: _Match, target: Any) -> _Dests:
    """The caller's own (local) tensor when it is on the CPU and contiguous, else a new one; every
    dtype, shape and device checked."""
    out = _Dests()
    mismatches, on_meta = [], []
    for key, owner, tkey in match.wanted:
        e = match.entries.get((key, owner))
        if e is None:
            raise CorruptCheckpointError(f"step {m.step}: structure names tensor {key!r} that has no entry", object=key)
        dtype, shape = DTYPES[e.dtype], tuple(e.shape)
        t = target.tensors.get(tkey) if tkey is not None else None
        if t is None:
            local = torch.empty(shape, dtype=dtype)
            out.tensors[(key, 0)] = (local, ((0,) * len(shape), shape))
            out.values[key] = local
            continue
        assert tkey is not None
        leaf = target.leaves[tkey]
        gshape = tuple(t.shape) if owner is not None else tuple(leaf.global_shape)
        pieces = target.piece_keys(tkey)
        if gshape != shape or any(target.tensors[pk].dtype != dtype for pk in pieces):
            what = "" if gshape == tuple(t.shape) else " (global)"
            mismatches.append(f"{key}: checkpoint has {e.dtype}{_shape_str(shape)}, state has "
                              f"{str(t.dtype).removeprefix('torch.')}{_shape_str(gshape)}{what}")
            continue
        if any(target.tensors[pk].device.type == "meta" for pk in pieces):
            on_meta.append(tkey)
            continue
        for i, pk in enumerate(pieces):
            t = target.tensors[pk]
            box = ((0,) * len(shape), shape) if owner is not None else target.leaves[pk].box
            if t.device.type == "cpu" and t.is_contiguous():
                local = t.detach() if t.requires_grad else t
                out.own.append((key, i))
            else:
                local = t  # given a CPU stand-in before any read (_stand_ins)
                out.elsewhere.append((key, i))
            out.tensors[(key, i)] = (local, box)
        if len(pieces) > 1:
            out.pieces[key] = len(pieces)
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


def staging_memory(nbytes: int) -> torch.Tensor:
    """``nbytes`` of CPU memory for a load to stage into; a typed error saying what to do when the
    machine has not got it."""
    try:
        return torch.empty(nbytes, dtype=torch.uint8)
    except (RuntimeError, MemoryError) as e:
        raise CheckpointError(f"could not allocate {nbytes / 2**20:.0f} MiB of staging memory for the load ({e}); "
                              "load with staged_load=False to read straight into the tensors") from e


def _changing(ready: Callable[[dict], list[dict]] | None, on_change: Callable[[], None] | None,
              m: mf.Manifest, note: dict, strict: bool) -> None:
    if ready is not None:
        notes = ready(note)
        if strict:
            held.check_all_taken(m, notes)
    if on_change is not None:
        on_change()


def _places(tensors: list[torch.Tensor]) -> tuple[list[int], int]:
    """Where each tensor's stand-in goes in staging memory, and the bytes it takes: the host buffer's
    own rule (:func:`ckpt.buffer_layout.aligned`), so a state's staging fits in its host buffer,
    which a load mid-run borrows."""
    places, pos = [], 0
    for t in tensors:
        pos = aligned(pos, t.nbytes, t.element_size())
        places.append(pos)
        pos += t.nbytes
    return places, pos


def _stand_ins(dests: _Dests, keys: list[Piece], places: list[int], space: torch.Tensor) -> None:
    """Point the destinations of ``keys`` at CPU stand-ins in ``space`` (at ``places``), each copied
    into its tensor (``copy_back``) once every chunk has checked out."""
    for key, pos in zip(keys, places):
        t, box = dests.tensors[key]
        n = t.nbytes
        stand_in = space[pos : pos + n].view(t.dtype).view(t.shape) if n else torch.empty(t.shape, dtype=t.dtype)
        dests.tensors[key] = (stand_in, box)
        dests.copy_back.append((t, stand_in))


Feeds = dict[str, list[tuple[int, int, np.ndarray, int]]]
Strided = list[tuple[torch.Tensor, Box, np.ndarray, tuple, Box]]


def _feeds(m: mf.Manifest, match: _Match, dests: _Dests) -> tuple[Feeds, Strided]:
    """What each chunk feeds: (offset in chunk, length, destination bytes, offset there). Boxes that
    are not one contiguous run on both sides go through a staging buffer and a strided copy."""
    feeds: Feeds = defaultdict(list)
    strided: Strided = []
    for key, owner, _ in match.wanted:
        e = match.entries[(key, owner)]
        for piece in dests.of(key):
            local, dbox = dests.tensors[piece]
            need = volume(dbox[1])
            if need == 0:
                continue
            covered = sum(_feed_shard(shard, DTYPES[e.dtype].itemsize, local, dbox, feeds, strided)
                          for shard in e.shards)
            if covered == need:
                continue
            raise CorruptCheckpointError(
                f"step {m.step}: the saved shards of {key!r} cover {covered} of the {need} elements this rank "
                "needs; the manifest is damaged",
                object=paths.manifest_key(m.step))
    return feeds, strided


def _feed_shard(shard: mf.Shard, item: int, local: torch.Tensor, dbox: Box, feeds: Feeds, strided: Strided) -> int:
    """Add what saved ``shard`` gives destination ``local`` (box ``dbox``); the elements it covers."""
    sbox = (tuple(shard.offsets), tuple(shard.lengths))
    inter = intersect(dbox, sbox)
    if inter is None or volume(inter[1]) == 0:
        return 0
    in_s = (tuple(o - so for o, so in zip(inter[0], sbox[0])), inter[1])
    in_d = (tuple(o - do for o, do in zip(inter[0], dbox[0])), inter[1])
    run_s, run_d = contiguous_run(in_s, sbox[1]), contiguous_run(in_d, dbox[1])
    dflat = local.view(-1).view(torch.uint8).numpy()
    if run_s is not None and run_d is not None:
        lo, n = run_s[0] * item, run_s[1] * item
        for chunk, coff, length, spos in _pieces(shard, lo, lo + n):
            feeds[chunk].append((coff, length, dflat, run_d[0] * item + spos - lo))
        return volume(inter[1])
    # Stage the saved rows that hold the box, reading only chunks with a needed element.
    r0, r1 = in_s[0][0], in_s[0][0] + in_s[1][0]
    row = math.prod(sbox[1][1:]) * item
    stage = np.empty((r1 - r0) * row, dtype=np.uint8)
    for chunk, coff, length, spos in _pieces(shard, r0 * row, r1 * row):
        first = next_needed(spos // item, sbox[1], in_s)
        if first is not None and first * item < spos + length:
            feeds[chunk].append((coff, length, stage, spos - r0 * row))
    strided.append((local, in_d, stage, (r1 - r0, *sbox[1][1:]), ((0, *in_s[0][1:]), in_s[1])))
    return volume(inter[1])


def _slices(box: Box) -> tuple:
    return tuple(slice(o, o + n) for o, n in zip(box[0], box[1]))


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


def _source_rank(m: mf.Manifest, keys: list[str], rank: int, world: int, rank_map: RankMap | None) -> int:
    if rank_map is None:
        if world == m.world_size:
            return rank
        raise ReshardError(
            f"step {m.step} was saved on {m.world_size} rank(s) and holds per-rank state under {keys} "
            f"(e.g. RNG or data loader positions); this job has {world}. Say which saved rank each rank takes "
            "it from with load(..., rank_map=lambda rank: rank % saved_world) (or a dict/list), or leave these "
            "keys out of the state passed to load (strict=False).")
    src = rank_map(rank) if callable(rank_map) else rank_map[rank]
    if type(src) is not int or not 0 <= src < m.world_size:
        raise ConfigError(f"rank_map gave {src!r} for rank {rank}; it must be a saved rank, 0 to {m.world_size - 1}")
    return src


def _init_optimizers(state: dict[str, Any], m: mf.Manifest) -> bool:
    """An optimizer over DTensor parameters with no state yet gets its state created first, so the
    saved state loads into sharded tensors of the right layout (a step with lr=0 and zero grads).
    Returns whether it changed any optimizer."""
    saved_keys = {t.key for t in m.tensors}
    changed = False
    for top, obj in state.items():
        if not isinstance(obj, torch.optim.Optimizer) or len(obj.state) > 0:
            continue
        params = [p for g in obj.param_groups for p in g["params"]]
        if not any(is_dtensor(p) for p in params):
            continue
        if not any(k.startswith(f"{top}/state/") for k in saved_keys):
            continue
        set_grads, lrs = [], []
        for g in obj.param_groups:
            lrs.append(g["lr"])
            g["lr"] = 0.0 if not isinstance(g["lr"], torch.Tensor) else torch.zeros_like(g["lr"])
            for p in g["params"]:
                if p.requires_grad and p.grad is None:
                    p.grad = torch.zeros_like(p)
                    set_grads.append(p)
        try:
            changed = True
            obj.step()
        finally:
            for g, lr in zip(obj.param_groups, lrs):
                g["lr"] = lr
            for p in set_grads:
                p.grad = None
    return changed


def _copy_back(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Copy every verified stand-in into its tensor. CPU tensors that overlap nothing are copied by
    the compiled core, on as many threads as there are cores, the GIL released; the rest (tensors
    on a device, strided, or sharing memory with another) one by one by torch."""
    core = _ext.cpu()
    plain = [(t, s) for t, s in pairs if t.device.type == "cpu" and t.is_contiguous() and s.is_contiguous()
             and t.dtype == s.dtype and t.nbytes == s.nbytes] if core is not None else []
    spans = sorted((t.data_ptr(), t.data_ptr() + t.nbytes) for t, _ in plain)
    if any(a[1] > b[0] for a, b in zip(spans, spans[1:])):
        plain = []  # tensors sharing memory: copied in order, as torch would
    done = {id(t) for t, _ in plain}
    if plain:
        assert core is not None
        items = np.array([(t.data_ptr(), s.data_ptr(), t.nbytes) for t, s in plain], dtype=_ext.COPY)
        core.copy_many(items, min(8, _cpus.usable()))
    for t, s in pairs:
        if id(t) not in done:
            t.copy_(s)
