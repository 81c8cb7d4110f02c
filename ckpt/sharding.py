"""Shards as N-d boxes of a global tensor, and the box arithmetic resharding needs.

A saved shard is a box (``offsets``, ``lengths``) of its tensor's global shape, stored row-major.
These things in a state become boxes:

* a ``DTensor`` (what FSDP2's ``fully_shard`` and tensor parallelism produce): its local tensor is
  the box its placements give this rank (``Shard``, ``Replicate`` and the ``_StridedShard`` FSDP2
  over tensor parallelism gives, on meshes of any dimension; :func:`dtensor_pieces` says which
  boxes, and whether the local tensor is one);
* a :class:`LocalShard`: a plain tensor the caller declares to be a box of a global tensor;
* :class:`LocalShards`, or a ``ShardedTensor`` (``torch.distributed._shard``): several pieces of one
  global tensor on one rank, each its own box (a chunk spec placing chunks 0 and 3 on rank 0);
* a plain tensor: the whole tensor, replicated on every rank (written once, by one owner).

A rank's share of a tensor is a list of (local tensor, box) pieces: one for most tensors, several
for these.

:class:`PerRank` marks state that belongs to one rank and cannot be resharded.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, TypeGuard

import torch

from .errors import ConfigError, UnsupportedValueError
from .format.boxes import Box, overlap

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor


class LocalShard:
    """Declares ``tensor`` to be the box of a global tensor starting at ``offsets``.

    Use it for tensors you shard yourself (without DTensor)::

        rows = 10 // world + (rank < 10 % world)
        state = {"table": ckpt.LocalShard(local_rows, offsets=(start_row, 0), global_shape=(10, 64))}

    Loading fills ``tensor`` in place with that box of the saved global tensor, whatever world size
    it was saved with.

    Args:
        tensor: this rank's box (any device), filled in place by a load.
        offsets: where the box starts in the global tensor, one offset per dimension.
        global_shape: the whole tensor's shape.

    Raises:
        ConfigError: the box does not fit the global shape."""

    __slots__ = ("tensor", "offsets", "global_shape")

    def __init__(self, tensor: torch.Tensor, offsets: Sequence[int], global_shape: Sequence[int]):
        if not isinstance(tensor, torch.Tensor):
            raise ConfigError(f"LocalShard needs a tensor, got {type(tensor).__name__}")
        offsets, global_shape = tuple(int(o) for o in offsets), tuple(int(d) for d in global_shape)
        if not (len(offsets) == len(global_shape) == tensor.dim()):
            raise ConfigError(f"LocalShard: a {tensor.dim()}-d tensor needs {tensor.dim()} offsets and a "
                              f"{tensor.dim()}-d global shape, got offsets {offsets} and shape {global_shape}")
        if any(o < 0 or o + n > d for o, n, d in zip(offsets, tensor.shape, global_shape)):
            raise ConfigError(f"LocalShard: a {tuple(tensor.shape)} block at offsets {offsets} does not fit in "
                              f"the global shape {global_shape}")
        self.tensor, self.offsets, self.global_shape = tensor, offsets, global_shape

    @property
    def box(self) -> Box:
        """This piece's box in the global tensor: (offsets, lengths)."""
        return self.offsets, tuple(self.tensor.shape)

    def __repr__(self) -> str:
        return f"LocalShard(shape={tuple(self.tensor.shape)}, offsets={self.offsets}, global_shape={self.global_shape})"


class LocalShards:
    """Declares several pieces of one global tensor held by this rank, each a :class:`LocalShard`
    of the same global shape and dtype (pieces that do not nest into one box: rows 0-2 and 9-11 of 12)::

        rows = [(0, 3), (9, 12)] if rank == 0 else [(3, 6), (6, 9)]
        state = {"table": ckpt.LocalShards([ckpt.LocalShard(table[a:b], offsets=(a, 0), global_shape=(12, 64))
                                            for a, b in rows])}

    The pieces of every rank together tile the global tensor; pieces of one rank must not overlap.
    Saving stores each piece as a box of its own; loading fills each piece in place with that box of
    the saved tensor, whatever layout it was saved with. A rank holding none of the tensor passes
    one empty piece (``LocalShard(torch.empty(0, 64), offsets=(0, 0), global_shape=(12, 64))``).

    Args:
        pieces: this rank's pieces, each a :class:`LocalShard` of the same global shape and dtype.

    Raises:
        ConfigError: no pieces, pieces of different global shapes or dtypes, or pieces that overlap."""

    __slots__ = ("pieces", "global_shape")

    def __init__(self, pieces: Sequence[LocalShard]):
        pieces = list(pieces) if isinstance(pieces, (list, tuple)) else pieces
        if not isinstance(pieces, list) or not pieces or not all(isinstance(p, LocalShard) for p in pieces):
            raise ConfigError("LocalShards needs a non-empty list of ckpt.LocalShard pieces, got "
                              f"{pieces!r}"[:200] + "; a rank holding none of the tensor passes one empty piece")
        first = pieces[0]
        for p in pieces[1:]:
            if p.global_shape != first.global_shape or p.tensor.dtype != first.tensor.dtype:
                raise ConfigError(
                    f"LocalShards: every piece must be of the same global tensor; {first!r} ({first.tensor.dtype}) "
                    f"and {p!r} ({p.tensor.dtype}) differ in global shape or dtype")
        why = overlap([p.box for p in pieces])
        if why is not None:
            raise ConfigError(f"LocalShards: the pieces' {why}; each element of the tensor belongs to one piece")
        self.pieces, self.global_shape = pieces, first.global_shape

    def __repr__(self) -> str:
        return f"LocalShards({self.pieces!r})"


class PerRank:
    """State that belongs to one rank (a data loader position, a per-rank buffer).

    Every rank saves its own copy. Loading on the same world size gives each rank its own value
    back; on another world size it raises :class:`~ckpt.ReshardError` unless ``load`` gets a
    ``rank_map`` saying which saved rank each rank takes its value from. ``value`` may be a plain
    value, tensors, or an object with ``state_dict()/load_state_dict()``::

        state = {"model": model, "loader": ckpt.PerRank(loader)}   # loader is Stateful
        state = {"model": model, "pos": ckpt.PerRank({"epoch": 0, "index": 0})}

    Args:
        value: this rank's value: plain values, tensors, or an object with ``state_dict()/load_state_dict()``.
    """

    ckpt_per_rank = True
    __slots__ = ("value",)

    def __init__(self, value: Any):
        self.value = value

    def state_dict(self) -> Any:
        v = self.value
        if callable(getattr(v, "state_dict", None)) and callable(getattr(v, "load_state_dict", None)):
            return v.state_dict()
        return v

    def load_state_dict(self, sd: Any) -> None:
        v = self.value
        if callable(getattr(v, "state_dict", None)) and callable(getattr(v, "load_state_dict", None)):
            v.load_state_dict(sd)
        elif isinstance(v, dict) and isinstance(sd, dict):
            v.clear()
            v.update(sd)
        else:
            self.value = sd

    def __repr__(self) -> str:
        return f"PerRank({self.value!r})"


def is_dtensor(t: Any) -> TypeGuard[DTensor]:
    cls = type(t)
    return cls.__name__ == "DTensor" and cls.__module__.startswith("torch.distributed")


def _placement_name(p: Any) -> str:
    return f"{type(p).__name__}({', '.join(f'{k}={v}' for k, v in _placement_args(p))})"


def _placement_args(p: Any) -> list[tuple[str, Any]]:
    args = [("dim", p.dim)] if hasattr(p, "dim") else []
    return args + ([("split_factor", p.split_factor)] if hasattr(p, "split_factor") else [])


Runs = list[tuple[int, int]]  # (global start, length) of runs of consecutive global indices, in local order


def _take(runs: Runs, lo: int, hi: int) -> Runs:
    """Positions ``lo:hi`` of the indices ``runs`` list, as runs."""
    out, pos = [], 0
    for g, n in runs:
        a, b = max(lo, pos), min(hi, pos + n)
        if a < b:
            out.append((g + a - pos, b - a))
        pos += n
    return out


def _chunk(m: int, k: int, i: int) -> tuple[int, int]:
    """Positions (lo, hi) of the ``i``-th of ``torch.chunk`` of ``m`` items into ``k`` (empty past the last)."""
    c = -(-m // k) if m else 0
    return min(m, i * c), min(m, (i + 1) * c)


def _shard_runs(n: int, placements: Sequence[tuple[Any, int, int]]) -> list[tuple[int, int, int]]:
    """(local start, global start, length) of each run of consecutive global indices that the given
    (placement, mesh size, coordinate) shardings of one tensor dimension of size ``n`` leave on a rank,
    in local order, applied left to right as DTensor does; an empty list for an empty shard.

    ``Shard`` keeps the ``coord``-th of ``torch.chunk(..., size)`` (nothing past the last chunk);
    ``_StridedShard(split_factor=f)`` first chunks into ``f`` pieces, chunks each into ``size`` and keeps
    the ``coord``-th of every one, concatenated: the right-to-left sharding FSDP2 over tensor
    parallelism does (torch's ``_StridedShard._split_tensor``). Works on runs, never on indices: a save
    calls it per DTensor dimension, and dimensions reach 10^5."""
    runs: Runs = [(0, n)] if n else []
    for p, size, coord in placements:
        m = sum(r[1] for r in runs)
        f = int(getattr(p, "split_factor", 1))
        kept: Runs = []
        for j in range(f):
            g0, g1 = _chunk(m, f, j)
            lo, hi = _chunk(g1 - g0, size, coord)
            kept += _take(runs, g0 + lo, g0 + hi)
        runs = []
        for g, k in kept:  # join runs that continue one another
            if runs and runs[-1][0] + runs[-1][1] == g:
                runs[-1] = (runs[-1][0], runs[-1][1] + k)
            else:
                runs.append((g, k))
    out, pos = [], 0
    for g, k in runs:
        out.append((pos, g, k))
        pos += k
    return out


def layout_pieces(global_shape: Sequence[int], mesh_shape: Sequence[int], coordinate: Sequence[int],
                  placements: Sequence[Any]) -> list[tuple[tuple[slice, ...], Box]]:
    """The pieces of the local tensor a rank at mesh ``coordinate`` holds: (slices of the local
    tensor, its box in the global tensor), row-major over the pieces. Pure: no process group.

    One piece when the placements nest into one box (``Shard``/``Replicate`` always; ``_StridedShard``
    as torchtitan's FSDP2 over tensor parallelism makes it); several where the rank holds rows that are
    not next to each other (e.g. ``_StridedShard`` alone). ``Replicate`` and ``Partial`` keep every index.
    Cross-checked against torch's own ``compute_local_shape_and_global_offset``."""
    return list(_layout_pieces(tuple(int(d) for d in global_shape), tuple(int(d) for d in mesh_shape),
                               tuple(int(c) for c in coordinate), tuple(placements)))


@functools.lru_cache(maxsize=4096)  # a save asks again for every DTensor; torch's check costs ms for _StridedShard
def _layout_pieces(gshape: tuple[int, ...], mesh_shape: tuple[int, ...], coordinate: tuple[int, ...],
                   placements: tuple[Any, ...]) -> tuple[tuple[tuple[slice, ...], Box], ...]:
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
    from torch.distributed.tensor.placement_types import _StridedShard

    per_dim: dict[int, list[tuple[Any, int, int]]] = {}
    for p, size, coord in zip(placements, mesh_shape, coordinate):
        if isinstance(p, (Shard, _StridedShard)):
            per_dim.setdefault(p.dim, []).append((p, int(size), int(coord)))
    runs = [_shard_runs(n, per_dim.get(d, ())) for d, n in enumerate(gshape)]
    shape = tuple(sum(r[2] for r in dim) for dim in runs)
    firsts = tuple(dim[0][1] if dim else n for dim, n in zip(runs, gshape))  # torch's offset of an empty shard: n
    want_shape, want_offsets = _compute_local_shape_and_global_offset(gshape, list(mesh_shape), list(coordinate),
                                                                      list(placements))
    if shape != tuple(want_shape) or any(dim and f != o for dim, f, o in zip(runs, firsts, want_offsets)):
        raise UnsupportedValueError(
            f"DTensor placements {[_placement_name(p) for p in placements]} on a {tuple(mesh_shape)} mesh: the "
            f"local shape and offsets ckpt computes ({shape}, first indices {firsts}) differ from torch's "
            f"({tuple(want_shape)}, {tuple(want_offsets)}); redistribute to Shard/Replicate placements before saving")
    if 0 in shape:  # an empty shard: one empty box, kept inside the tensor
        return ((tuple(slice(0, n) for n in shape), (firsts, shape)),)
    pieces: list[tuple[tuple[slice, ...], Box]] = [((), ((), ()))]
    for dim in runs:  # the cartesian product of each dimension's runs
        pieces = [((*sl, slice(lo, lo + n)), ((*offs, g), (*lens, n)))
                  for sl, (offs, lens) in pieces for lo, g, n in dim]
    return tuple(pieces)


def _refuse_partial(t: DTensor, where: str) -> None:
    if any(p.is_partial() for p in t.placements):
        names = [_placement_name(p) for p in t.placements]
        raise UnsupportedValueError(
            f"{where}: DTensor placements {names} hold a pending reduction (Partial): its local tensors are "
            "addends, not the value. Reduce it first with t = t.redistribute(t.device_mesh, "
            "[Replicate() if p.is_partial() else p for p in t.placements]) (or to a Shard), or pass "
            "Options(reduce_partial=True) to let the save do that reduction (a collective on the mesh)")


def dtensor_pieces(t: DTensor, where: str) -> tuple[list[tuple[torch.Tensor, Box]], tuple[int, ...]]:
    """The pieces of a DTensor's local tensor (views of it), each with its box of the global tensor,
    and the global shape; see :func:`layout_pieces`. One piece for ``Shard``/``Replicate`` placements
    and for torchtitan's FSDP2 over tensor parallelism (``_StridedShard``).

    Raises UnsupportedValueError for a ``Partial`` placement, a placement of an unknown kind, or a
    local tensor whose shape is not the one its placements give (a padded local tensor)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    _refuse_partial(t, where)
    for p in t.placements:
        if not isinstance(p, (Shard, _StridedShard, Replicate)):
            raise UnsupportedValueError(
                f"{where}: DTensor placement {_placement_name(p)} is not supported (Shard, _StridedShard, "
                "Replicate are); redistribute it first, e.g. t.redistribute(placements=[Shard(0)]) or "
                "t.full_tensor()")
    mesh = t.device_mesh
    coordinate = mesh.get_coordinate()
    gshape = tuple(t.shape)
    local = t.to_local()
    if coordinate is None:  # this rank is outside the mesh: it holds nothing of the tensor
        return [(local.reshape((0,) * len(gshape)), ((0,) * len(gshape), (0,) * len(gshape)))], gshape
    try:
        slices = layout_pieces(gshape, tuple(mesh.shape), coordinate, t.placements)
    except UnsupportedValueError as e:
        raise UnsupportedValueError(f"{where}: {e}") from None
    shape = tuple(max(sl[d].stop for sl, _ in slices) for d in range(len(gshape)))
    if tuple(local.shape) != shape:
        raise UnsupportedValueError(f"{where}: DTensor local shape {tuple(local.shape)} does not match its "
                                    f"placements (expected {shape}); padded DTensors are not supported")
    return [(local[sl], box) for sl, box in slices], gshape


def is_sharded_tensor(t: Any) -> bool:
    """A ``torch.distributed._shard`` ``ShardedTensor`` (told by its class, without importing it)."""
    cls = type(t)
    return cls.__name__ == "ShardedTensor" and cls.__module__.startswith("torch.distributed")


def sharded_tensor_pieces(t: Any, where: str) -> tuple[list[tuple[torch.Tensor, Box]], tuple[int, ...]]:
    """(local tensors with their boxes, global shape) of a ``ShardedTensor``: each local shard is a
    piece as its metadata places it. A rank holding no shard gives one empty piece."""
    md = t.metadata()
    gshape = tuple(int(d) for d in md.size)
    pieces: list[tuple[torch.Tensor, Box]] = []
    for s in t.local_shards():
        offs = tuple(int(o) for o in s.metadata.shard_offsets)
        lens = tuple(int(n) for n in s.metadata.shard_sizes)
        if tuple(s.tensor.shape) != lens:
            raise UnsupportedValueError(f"{where}: a ShardedTensor shard of shape {tuple(s.tensor.shape)} whose "
                                        f"metadata says {lens}; the ShardedTensor is inconsistent")
        pieces.append((s.tensor, (offs, lens)))
    if not pieces:
        empty = (0,) * len(gshape)
        pieces.append((torch.empty(empty, dtype=md.tensor_properties.dtype), (empty, empty)))
    return pieces, gshape
