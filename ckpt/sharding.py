"""Shards as N-d boxes of a global tensor, and the box arithmetic resharding needs.

A saved shard is a box (``offsets``, ``lengths``) of its tensor's global shape, stored row-major.
These things in a state become boxes:

* a ``DTensor`` (what FSDP2's ``fully_shard`` and tensor parallelism produce): its local tensor is
  the box its placements give this rank (``Shard`` and ``Replicate`` on 1-D and 2-D meshes);
* a :class:`LocalShard`: a plain tensor the caller declares to be a box of a global tensor;
* :class:`LocalShards`, or a ``ShardedTensor`` (``torch.distributed._shard``): several pieces of one
  global tensor on one rank, each its own box (a chunk spec placing chunks 0 and 3 on rank 0);
* a plain tensor: the whole tensor, replicated on every rank (written once, by one owner).

A rank's share of a tensor is a list of (local tensor, box) pieces: one for most tensors, several
for these.

:class:`PerRank` marks state that belongs to one rank and cannot be resharded.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, TypeGuard

import torch

from .errors import ConfigError, UnsupportedValueError
from .format.boxes import Box, intersect, volume

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor


class LocalShard:
    """Declares ``tensor`` to be the box of a global tensor starting at ``offsets``.

    Use it for tensors you shard yourself (without DTensor)::

        rows = 10 // world + (rank < 10 % world)
        state = {"table": ckpt.LocalShard(local_rows, offsets=(start_row, 0), global_shape=(10, 64))}

    Loading fills ``tensor`` in place with that box of the saved global tensor, whatever world size
    it was saved with."""

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
    one empty piece (``LocalShard(torch.empty(0, 64), offsets=(0, 0), global_shape=(12, 64))``)."""

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
        boxes = [p.box for p in pieces if volume(p.box[1]) > 0]
        if len(boxes) <= 512:
            for i, a in enumerate(boxes):
                for b in boxes[i + 1:]:
                    if intersect(a, b) is not None:
                        raise ConfigError(f"LocalShards: pieces {list(a[0])}+{list(a[1])} and {list(b[0])}+"
                                          f"{list(b[1])} overlap; each element of the tensor belongs to one piece")
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


def dtensor_box(t: DTensor, where: str) -> tuple[torch.Tensor, Box, tuple[int, ...]]:
    """(local tensor, box of it in the global tensor, global shape) of a DTensor."""
    from torch.distributed.tensor import Replicate, Shard  # only when DTensors are used
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    for p in t.placements:
        if type(p) not in (Shard, Replicate):
            raise UnsupportedValueError(
                f"{where}: DTensor placement {p} is not supported (only Shard and Replicate); "
                "redistribute it first, e.g. t.redistribute(placements=[Shard(0)]) or t.full_tensor()")
    local = t.to_local()
    shape, offsets = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    if tuple(local.shape) != tuple(shape):
        raise UnsupportedValueError(f"{where}: DTensor local shape {tuple(local.shape)} does not match its "
                                    f"placements (expected {tuple(shape)}); padded DTensors are not supported")
    # An empty shard may report an offset past the end; clamp so the box stays inside the tensor.
    gshape = tuple(t.shape)
    offsets = tuple(min(o, d) for o, d in zip(offsets, gshape))
    return local, (offsets, tuple(shape)), gshape


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
