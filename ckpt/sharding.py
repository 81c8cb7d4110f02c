"""Shards as N-d boxes of a global tensor, and the box arithmetic resharding needs.

A saved shard is a box (``offsets``, ``lengths``) of its tensor's global shape, stored row-major.
Three things in a state become boxes:

* a ``DTensor`` (what FSDP2's ``fully_shard`` and tensor parallelism produce): its local tensor is
  the box its placements give this rank (``Shard`` and ``Replicate`` on 1-D and 2-D meshes);
* a :class:`LocalShard`: a plain tensor the caller declares to be a box of a global tensor;
* a plain tensor: the whole tensor, replicated on every rank (written once, by one owner).

:class:`PerRank` marks state that belongs to one rank and cannot be resharded.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, TypeGuard

import torch

from .errors import ConfigError, UnsupportedValueError
from .format.boxes import Box

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

    def __repr__(self) -> str:
        return f"LocalShard(shape={tuple(self.tensor.shape)}, offsets={self.offsets}, global_shape={self.global_shape})"


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
