"""Turning a training state into JSON structure plus tensor leaves, and back.

``state`` is a dict of things: objects with ``state_dict()/load_state_dict()`` (modules,
optimizers, schedulers, any ``Stateful``), tensors, numpy arrays and plain Python values, nested in
dicts, lists and tuples. :func:`flatten` walks it once and produces

* a structure tree of JSON nodes that records every plain value exactly (int vs float, tuples,
  non-string dict keys, NaN) and names each tensor by its key path, and
* the tensor leaves, keyed by that path (``"model/layer.weight"``, ``"optim/state/0/exp_avg"``).

No node ever holds code: objects that are not plain values are refused unless the caller opts into
pickle, and a pickle node is refused on load unless the loader opts in too. The node kinds, and
turning nodes back into values, are :mod:`ckpt.tree`; :func:`apply` puts decoded values back
into the caller's state.
"""

from __future__ import annotations

import io
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from . import tree as st
from .errors import CheckpointError, ConfigError, StateMismatchError, UnsupportedValueError
from .format.boxes import Box
from .sharding import LocalShard, LocalShards, dtensor_pieces, is_dtensor, is_sharded_tensor, sharded_tensor_pieces
from .tied import fit_module_state

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor


def is_stateful(obj: Any) -> bool:
    """True for objects following the Stateful protocol (``state_dict`` and ``load_state_dict``)."""
    return (
        not isinstance(obj, (torch.Tensor, dict, type))
        and callable(getattr(obj, "state_dict", None))
        and callable(getattr(obj, "load_state_dict", None))
    )


def _component(k: Any) -> str:
    return k if isinstance(k, str) else repr(k)


key_component = _component  # the public name: snapshot builds key paths the same way


@dataclass(frozen=True)
class Leaf:
    """Where a tensor leaf sits in its global tensor. ``kind`` is ``"replicated"`` (a plain tensor:
    every rank holds all of it), ``"shard"`` (a DTensor's or :class:`LocalShard`'s box) or ``"rank"``
    (per-rank state: this rank's own tensor). ``key``: the tensor this leaf is a piece of, for every
    piece after the first of a tensor the rank holds in several pieces (None: the leaf's own key)."""

    box: Box
    global_shape: tuple[int, ...]
    kind: str
    key: str | None = None


def tensor_of(key: str, leaf: Leaf) -> str:
    """The tensor key a leaf stored under ``key`` belongs to (its own key, or the one it is a piece of)."""
    return key if leaf.key is None else leaf.key


def piece_key(key: str, i: int, taken: dict) -> str:
    """The key piece ``i`` (from 1; piece 0 is ``key`` itself) of tensor ``key`` is held under, not in ``taken``."""
    out, n = f"{key} (piece {i})", 1
    while out in taken:
        n += 1
        out = f"{key} (piece {i}#{n})"
    return out


@dataclass
class Flat:
    """The result of :func:`flatten`."""

    structure: dict
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)  # key (or piece key) -> the local data to copy
    leaves: dict[str, Leaf] = field(default_factory=dict)  # key (or piece key) -> its box in the global tensor
    pieces: dict[str, list[str]] = field(default_factory=dict)  # key -> its piece keys, where a rank holds several
    targets: dict[str, Any] = field(default_factory=dict)  # key -> the object found (DTensor, LocalShard)
    statefuls: dict[str, Any] = field(default_factory=dict)  # key path -> object, for load
    paths: dict[str, tuple[str, ...]] = field(default_factory=dict)  # key -> its typed path (tree.path_component)
    per_rank: set[str] = field(default_factory=set)  # top-level keys holding per-rank state

    def piece_keys(self, key: str) -> list[str]:
        """The keys of tensor ``key``'s pieces on this rank (``[key]`` for a tensor held in one piece)."""
        return self.pieces.get(key) or [key]


# Values stored by a node of their own with nothing under it: (the types it takes, its constructor).
_VALUE_NODES: tuple[tuple[type | tuple[type, ...], Callable[[Any], dict]], ...] = (
    (torch.Size, st.size_node),
    (torch.dtype, st.dtype_node),
    (torch.device, st.device_node),
    ((bytes, bytearray), st.bytes_node),
    (io.BytesIO, st.bytesio_node),  # DCP's own item type: its bytes, given back as a BytesIO
)


def _text_scalar(obj: np.str_ | np.bytes_) -> dict:
    """A numpy ``str_``/``bytes_`` value as its raw bytes with its dtype, so that it comes back as
    the numpy scalar it was (format version 3 readers already rebuild it so). An empty one is stored
    as one null character (numpy drops trailing nulls, and a dtype of itemsize 0 cannot be read)."""
    dtype = obj.dtype if obj.dtype.itemsize else np.dtype((type(obj), 1))
    return st.npscalar_bytes_node(dtype, np.array(obj, dtype=dtype).tobytes())


def _plain_text(key: Any) -> Any:
    if isinstance(key, np.str_):
        return str(key)
    return bytes(key) if isinstance(key, np.bytes_) else key


class _Flattener:
    def __init__(self, allow_pickle: bool, for_target: bool, reduce_partial: bool = False):
        self.allow_pickle = allow_pickle
        self.reduce_partial = reduce_partial  # a Partial DTensor is summed (redistributed) rather than refused
        self.for_target = for_target  # walking the caller's state on load: never refuse a value
        self.flat = Flat(structure={})
        self.depth = 0
        self.optimizers: list[tuple[dict, dict, Any]] = []  # (node, its state_dict, the optimizer)

    def tensor_key(self, path: tuple) -> str:
        key = "/".join(_component(p) for p in path)
        base, n = key, 1
        while key in self.flat.tensors:  # two paths that print alike (rare): keep keys unique
            n += 1
            key = f"{base}#{n}"
        return key

    def node(self, obj: Any, path: tuple, tpath: tuple[str, ...]) -> Any:
        """The structure node of ``obj`` at ``path`` (printed key path) / ``tpath`` (typed path)."""
        self.depth += 1
        try:
            if self.depth > st.MAX_DEPTH:
                raise UnsupportedValueError(
                    f"{_where(path)}: the state is nested more than {st.MAX_DEPTH} levels deep, more than ckpt "
                    "stores (and than its manifest may hold); flatten that part, or keep it as bytes or a tensor")
            return self._node(obj, path, tpath)
        finally:
            self.depth -= 1

    def _node(self, obj: Any, path: tuple, tpath: tuple[str, ...]) -> Any:
        if isinstance(obj, (np.str_, np.bytes_)):  # before str and bytes, which they also are
            return _text_scalar(obj)
        if obj is None or isinstance(obj, (bool, str)):
            return obj
        if isinstance(obj, np.generic) and not isinstance(obj, (np.bytes_, np.object_, np.void)):
            return self.npscalar(obj, path, tpath)
        if isinstance(obj, int):
            return self.integer(obj, path)
        if isinstance(obj, float):
            return st.float_node(obj) if type(obj) is float else self.other(obj, path)
        if isinstance(obj, torch.Tensor):
            return self.tensor(obj, path, tpath, numpy=False)
        if isinstance(obj, LocalShard):
            return self.tensor(obj.tensor, path, tpath, numpy=False, shard=obj)
        if isinstance(obj, LocalShards):
            return self.tensor(obj.pieces[0].tensor, path, tpath, numpy=False, shard=obj)
        if isinstance(obj, np.ndarray):
            return self.array(obj, path, tpath)
        if isinstance(obj, dict):
            return self.mapping(obj, path, tpath)
        if type(obj) is tuple:  # exactly: a namedtuple is an object
            return st.tuple_node(self.items(obj, path, tpath))
        if type(obj) is list:
            return self.items(obj, path, tpath)
        for types, make in _VALUE_NODES:
            if isinstance(obj, types):
                return make(obj)
        if is_stateful(obj):
            return self.stateful(obj, path, tpath)
        return self.other(obj, path)

    def integer(self, obj: int, path: tuple) -> Any:
        if type(obj) is not int:
            return self.other(obj, path)  # IntEnum etc. are objects
        if obj.bit_length() > 14_000:  # JSON, like str(), refuses ints of more than 4300 digits
            try:
                repr(obj)
            except ValueError:
                raise UnsupportedValueError(
                    f"{_where(path)}: an int of {obj.bit_length()} bits is too long to store as a number; "
                    "store it as a string (str(x)) or bytes") from None
        return obj

    def mapping(self, obj: dict, path: tuple, tpath: tuple[str, ...]) -> dict:
        """A dict node; its keys are nodes too, and each value's typed path holds its key's node."""
        keys = list(obj.keys())
        # numpy text keys stay plain str/bytes keys, as they always were: tensors' typed paths hold key nodes
        knodes = [self.node(_plain_text(k), path + ("<key>",), tpath + ("<key>",)) for k in keys]
        return st.dict_node(knodes, [self.node(obj[k], path + (k,), tpath + (st.path_component(kn),))
                                     for k, kn in zip(keys, knodes)])

    def items(self, obj: list | tuple, path: tuple, tpath: tuple[str, ...]) -> list:
        """The nodes of a list's or tuple's items, each at its index."""
        return [self.node(v, path + (i,), tpath + (st.path_component(i),)) for i, v in enumerate(obj)]

    def stateful(self, obj: Any, path: tuple, tpath: tuple[str, ...]) -> dict:
        """An object with state_dict(): its state's node, and the object kept to load into."""
        if getattr(obj, "ckpt_per_rank", False) and path:
            self.flat.per_rank.add(path[0])
        self.flat.statefuls["/".join(_component(p) for p in path)] = obj
        sd = obj.state_dict()
        node = st.stateful_node(obj, self.node(sd, path, tpath))
        if isinstance(obj, torch.optim.Optimizer) and not self.for_target:
            self.optimizers.append((node, sd, obj))
        return node

    def name_params(self) -> None:
        """Each optimizer's node gets ``params``: its state's parameter indices with the tensor keys of
        the parameters they are, where a module of the same state holds them (so ``ckpt inspect`` can
        say ``optim/state/3`` is ``model/0.weight``). Found by identity, one pass over the modules."""
        if not self.optimizers:
            return
        names: dict[int, str] = {}
        for where, obj in self.flat.statefuls.items():
            if isinstance(obj, torch.nn.Module):
                for name, p in obj.named_parameters():
                    if f"{where}/{name}" in self.flat.tensors:
                        names.setdefault(id(p), f"{where}/{name}")
        for node, sd, opt in self.optimizers:
            saved = sd.get("param_groups") if isinstance(sd, dict) else None
            if not isinstance(saved, list) or len(saved) != len(opt.param_groups):
                continue
            pairs = [[i, names[id(p)]] for g, live in zip(saved, opt.param_groups)
                     for i, p in zip(g.get("params", ()), live["params"]) if id(p) in names and type(i) is int]
            if pairs:
                node["params"] = pairs

    def npscalar(self, obj: np.generic, path: tuple, tpath: tuple[str, ...]) -> Any:
        value = obj.item()
        if type(value) in (bool, int, float):  # stored as the number it is, with its dtype
            return st.npscalar_node(obj.dtype, self.node(value, path, tpath))
        # longdouble, complex, datetime64 …: their exact bytes, with the dtype that reads them back
        return st.npscalar_bytes_node(obj.dtype, obj.tobytes())

    def array(self, arr: np.ndarray, path: tuple, tpath: tuple[str, ...]) -> Any:
        if arr.dtype.hasobject or arr.dtype.fields is not None or arr.dtype.kind == "V":
            return self.other(arr, path)  # objects, structured and void records: no plain layout to restore
        if isinstance(arr, (np.ma.MaskedArray, np.matrix)) and not self.for_target:
            return self.array_subclass(arr, path)
        # Not np.ascontiguousarray: it makes a 0-d array 1-d, and the array would come back with shape (1,).
        arr = arr if arr.flags.c_contiguous else arr.copy(order="C")
        if arr.dtype.isnative:
            try:
                return self.tensor(torch.from_numpy(arr), path, tpath, numpy=True)
            except TypeError:
                pass  # a dtype torch has no tensor for (str, datetime64, longdouble …)
        # Stored as its raw bytes (one trailing axis of itemsize), with the numpy dtype to read them back.
        raw = arr.reshape(-1).view(np.uint8).reshape(arr.shape + (arr.dtype.itemsize,))
        return self.tensor(torch.from_numpy(raw), path, tpath, numpy=arr.dtype.str)

    def array_subclass(self, arr: np.ndarray, path: tuple) -> Any:
        """A masked array or matrix: stored as a plain array it would come back without its mask, or as an
        ndarray, so it is refused unless pickled."""
        if self.allow_pickle:
            return st.pickle_node(arr)
        how = ("Store its data and its mask separately, e.g. {'data': m.data, 'mask': np.ma.getmaskarray(m)}, "
               "and rebuild it with np.ma.masked_array(data, mask=mask)" if isinstance(arr, np.ma.MaskedArray)
               else "Store np.asarray(m) and rebuild it with np.asmatrix(a)")
        raise UnsupportedValueError(
            f"{_where(path)}: a {type(arr).__module__}.{type(arr).__qualname__} cannot be stored as an array: it "
            f"would load as a plain numpy.ndarray, losing what makes it one. {how} "
            "(or pass allow_pickle=True to the Checkpointer to pickle it; loading will need allow_pickle=True too)")

    def tensor(self, t: torch.Tensor, path: tuple, tpath: tuple[str, ...], numpy: bool | str,
               shard: LocalShard | LocalShards | None = None) -> dict:
        where = _where(path)
        if not is_sharded_tensor(t) and t.is_nested:  # a ShardedTensor answers no tensor attribute
            raise UnsupportedValueError(
                f"{where}: nested tensors (torch.nested) are not supported; store their pieces as a list of "
                "tensors (list(t.unbind())), or t.to_padded_tensor(0) with the lengths")
        target: Any = t if shard is None else shard
        if is_dtensor(t) and any(p.is_partial() for p in t.placements):
            t = self.reduced(t, where)
        pieces, gshape, kind = _pieces(t, shard, where)
        if not self.for_target:
            for piece, _ in pieces:
                if piece.layout != torch.strided:
                    raise UnsupportedValueError(
                        f"{where}: {piece.layout} tensors are not supported; convert with .to_dense()")
                if piece.device.type == "meta":
                    raise UnsupportedValueError(f"{where}: meta tensors hold no data to save")
                st.dtype_name(piece.dtype)
        key = self.tensor_key(path)
        names = [key]
        for i, (piece, box) in enumerate(pieces):
            name = key if i == 0 else piece_key(key, i, self.flat.tensors)
            if i:
                names.append(name)
            self.flat.tensors[name] = piece
            self.flat.leaves[name] = Leaf(box, gshape, kind, None if i == 0 else key)
        if len(pieces) > 1:
            self.flat.pieces[key] = names
        self.flat.targets[key] = target
        self.flat.paths[key] = tpath
        return st.tensor_node(key, numpy)

    def reduced(self, t: DTensor, where: str) -> DTensor:
        """``t`` with its Partial placements reduced to Replicate, where the save was asked to."""
        if self.for_target:
            raise UnsupportedValueError(
                f"{where}: cannot load into a DTensor with a Partial placement {list(t.placements)} (its local "
                "tensors are addends of a sum, not its value); load into one with Shard or Replicate placements, "
                "e.g. t.redistribute(t.device_mesh, [Replicate() if p.is_partial() else p for p in t.placements])")
        if not self.reduce_partial:
            return t  # dtensor_pieces refuses it, saying how to reduce it
        from torch.distributed.tensor import Replicate
        return t.redistribute(t.device_mesh, [Replicate() if p.is_partial() else p for p in t.placements])

    def other(self, obj: Any, path: tuple) -> Any:
        if self.for_target:
            return None
        if not self.allow_pickle:
            raise UnsupportedValueError(
                f"cannot store {type(obj).__module__}.{type(obj).__qualname__} at {_where(path)!r} without pickle: "
                "convert it to plain values (numbers, strings, lists, dicts, tensors, numpy arrays of numbers, "
                "text or dates), give it state_dict()/load_state_dict(), or pass allow_pickle=True to the "
                "Checkpointer (loading it will then need allow_pickle=True too)")
        return st.pickle_node(obj)


def _pieces(t: torch.Tensor, shard: LocalShard | LocalShards | None, where: str
            ) -> tuple[list[tuple[torch.Tensor, Box]], tuple[int, ...], str]:
    """This rank's share of the tensor found at ``where``: its pieces (local tensor, box in the global
    tensor), the global shape and the leaf kind."""
    if is_dtensor(t):
        pieces, gshape = dtensor_pieces(t, where)
        return pieces, gshape, "shard"
    if is_sharded_tensor(t):
        pieces, gshape = sharded_tensor_pieces(t, where)
        return pieces, gshape, "shard"
    if isinstance(shard, LocalShards):
        return [(p.tensor, p.box) for p in shard.pieces], shard.global_shape, "shard"
    if shard is not None:
        return [(t, shard.box)], shard.global_shape, "shard"
    shape = tuple(t.shape)
    return [(t, ((0,) * len(shape), shape))], shape, "replicated"


def _where(path: tuple) -> str:
    return "/".join(_component(p) for p in path) or "<root>"


def flatten(state: dict, *, allow_pickle: bool = False, for_target: bool = False, reduce_partial: bool = False) -> Flat:
    """Walk ``state`` once; see the module docstring. ``reduce_partial``: sum a DTensor's Partial
    placements (a collective) rather than refuse it."""
    if not isinstance(state, dict):
        raise ConfigError(f"state must be a dict (e.g. {{'model': model, 'optim': opt}}), got {type(state).__name__}")
    bad = [k for k in state if not isinstance(k, str)]
    if bad:
        raise ConfigError(f"state keys must be strings; got {bad[:3]!r}")
    f = _Flattener(allow_pickle, for_target, reduce_partial)
    nodes, spans = [], {}
    for k, v in state.items():
        before = len(f.flat.tensors)
        nodes.append(f.node(v, (k,), (st.path_component(k),)))
        spans[k] = (before, len(f.flat.tensors))  # a span, not a list per key: many top-level keys stay linear
    f.flat.structure = st.dict_node(list(state.keys()), nodes)
    f.name_params()
    order = list(f.flat.tensors) if f.flat.per_rank else []
    for k in f.flat.per_rank:  # every tensor under a per-rank key is this rank's own
        for key in order[spans[k][0]:spans[k][1]]:
            if f.flat.leaves[key].key is not None or key in f.flat.pieces:
                raise UnsupportedValueError(
                    f"{tensor_of(key, f.flat.leaves[key])}: a tensor held in several pieces is a shard of a global "
                    f"tensor, and {k!r} is per-rank state (each rank's own, whole); keep it out of ckpt.PerRank, or "
                    "store each piece as a tensor of its own")
            t = f.flat.tensors[key]
            shape = tuple(t.shape)
            f.flat.leaves[key] = Leaf(((0,) * len(shape), shape), shape, "rank")
    return f.flat


def apply(state: dict, decoded: dict, strict: bool = True) -> None:
    """Put decoded values into ``state`` in place: stateful objects get ``load_state_dict``,
    tensors that were not loaded in place are copied into, everything else is assigned. A module's
    saved state_dict is completed first (:func:`ckpt.tied.fit_module_state`): tied keys from their
    partners, and with ``strict=False`` the keys the step lacks from the module itself."""
    for key, value in decoded.items():
        _apply_into(state, key, value, key, strict)


def _apply_into(container: Any, key: Any, value: Any, where: str, strict: bool = True) -> None:
    current = container[key] if _has(container, key) else None
    if isinstance(value, st.StatefulValue):
        if current is None or not is_stateful(current):
            raise StateMismatchError(
                f"{where!r} was saved from an object with state_dict(); the state passed to load has "
                f"{type(current).__name__} there. Pass the same kind of object (model, optimizer, …).")
        sd = _unwrap(value.state_dict)
        if isinstance(current, torch.nn.Module) and isinstance(sd, dict):
            sd = fit_module_state(current, sd, strict)
        try:
            current.load_state_dict(sd)
        except CheckpointError:
            raise
        except Exception as e:  # the object's own check: typed, with the object named
            raise StateMismatchError(f"{where!r}: {type(current).__name__}.load_state_dict refused the saved state: "
                                     f"{type(e).__name__}: {e}") from e
        return
    if isinstance(current, torch.Tensor) and isinstance(value, torch.Tensor):
        if value is not current:
            with torch.no_grad():
                current.copy_(value)
        return
    if isinstance(current, dict) and isinstance(value, dict) and not is_stateful(current):
        for k, v in value.items():
            _apply_into(current, k, v, f"{where}/{_component(k)}", strict)
        return
    container[key] = _unwrap(value)


def _has(container: Any, key: Any) -> bool:
    if isinstance(container, dict):
        return key in container
    return False


def _unwrap(value: Any) -> Any:
    """Stateful markers nested inside a plain value (never produced by flatten) are resolved to dicts."""
    if isinstance(value, st.StatefulValue):
        return _unwrap(value.state_dict)
    if isinstance(value, dict):
        return {k: _unwrap(v) for k, v in value.items()}
    return value


class RNGState:
    """A ``Stateful`` holding every random number generator a training run draws from.

    It is per-rank state (each rank has its own generators): on another world size, loading it
    needs a ``rank_map`` (see :class:`~ckpt.PerRank`).

    Put it in the state so a resumed run continues with the same random stream::

        state = {"model": model, "optim": opt, "rng": ckpt.RNGState()}
        ckptr.save(step, state)      # captures python, numpy, torch (CPU) and CUDA generators
        ckptr.load("latest", state)  # restores them
    """

    ckpt_per_rank = True

    def state_dict(self) -> dict:
        sd = {
            "python": random.getstate(),
            "numpy": np.random.get_state(),
            "torch": torch.get_rng_state(),
        }
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            sd["cuda"] = torch.cuda.get_rng_state_all()
        return sd

    def load_state_dict(self, sd: dict) -> None:
        random.setstate(_as_tuples(sd["python"]))
        np.random.set_state(sd["numpy"])
        torch.set_rng_state(sd["torch"].clone())
        if "cuda" in sd and torch.cuda.is_available():
            states = sd["cuda"]
            if len(states) != torch.cuda.device_count():
                raise StateMismatchError(
                    f"the checkpoint holds RNG states for {len(states)} CUDA devices, this process sees "
                    f"{torch.cuda.device_count()}; restore on the same device count or drop 'cuda' from the RNG state")
            torch.cuda.set_rng_state_all([s.clone() for s in states])


def _as_tuples(v: Any) -> Any:
    return tuple(_as_tuples(x) for x in v) if isinstance(v, (list, tuple)) else v
