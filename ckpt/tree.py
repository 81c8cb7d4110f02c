"""The structure tree: the JSON that describes a state's shape and plain values.

A manifest's ``structure`` is a tree of JSON nodes. Plain JSON values (``None``, booleans, ints,
finite floats, strings, lists) stand for themselves; everything else is an object with a ``"t"``
field naming its kind:

==============  ======================================================================
``dict``        ``{"t": "dict", "k": [key nodes], "v": [value nodes]}`` (keys of any type)
``tuple``       ``{"t": "tuple", "v": [nodes]}``
``tensor``      ``{"t": "tensor", "key": "model/0.weight"}`` (``"numpy": true`` for arrays)
``float``       ``{"t": "float", "v": "nan"}``: a non-finite float, by its ``repr``
``npscalar``    ``{"t": "npscalar", "dtype": "<f8", "v": node}``
``size``        ``{"t": "size", "v": [ints]}`` (``torch.Size``)
``dtype``       ``{"t": "dtype", "v": "float32"}``
``device``      ``{"t": "device", "v": "cuda:0"}``
``bytes``       ``{"t": "bytes", "v": base64}``; ``"io": true`` for an ``io.BytesIO`` (its bytes,
                given back as a new ``BytesIO`` at its start)
``stateful``    ``{"t": "stateful", "type": "pkg.Class", "v": node}``: ``state_dict()`` of an
                object; the type name is informational only, nothing is ever built from it.
                An optimizer's may hold ``"params": [[index, "model/0.weight"], ...]``: which
                parameter each index of its state is (informational: for ``ckpt inspect``)
``pickle``      ``{"t": "pickle", "v": base64}``: only with ``allow_pickle`` on both sides
``per_rank``    ``{"t": "per_rank", "v": [node per rank]}``: a top-level key saved per rank
==============  ======================================================================

This module is the one place that knows these kinds: the constructors the flattener uses, and
every walker over the tree (rebuilding the values, finding its tensors, previews).
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import math
import pickle
import re
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

from .errors import UnsupportedValueError

if TYPE_CHECKING:
    import torch

Node = Any  # a JSON value: None, bool, int, float, str, list, or a dict with a "t" kind

# dtypes a checkpoint may name, with their bytes per element; a manifest naming anything else is
# refused. A table of its own, without torch: reading a manifest (ckpt ls, inspect) needs no torch.
ITEMSIZE: dict[str, int] = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "complex64": 8, "complex128": 16,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "uint16": 2, "uint32": 4, "uint64": 8, "bool": 1,
    "float8_e4m3fn": 1, "float8_e5m2": 1, "float8_e4m3fnuz": 1, "float8_e5m2fnuz": 1,
}


_torch_dtypes: dict[str, torch.dtype] = {}


def torch_dtypes() -> dict[str, torch.dtype]:
    """Name -> torch dtype for the names in ``ITEMSIZE`` (imports torch on first use)."""
    if not _torch_dtypes:
        import torch
        _torch_dtypes.update({n: getattr(torch, n) for n in ITEMSIZE
                              if isinstance(getattr(torch, n, None), torch.dtype)})
    return _torch_dtypes


def __getattr__(name: str) -> Any:
    """``DTYPES``, the same as :func:`torch_dtypes`, for ``from ckpt.tree import DTYPES`` (which then imports torch)."""
    if name == "DTYPES":
        return torch_dtypes()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def dtype_name(dtype: torch.dtype) -> str:
    """The manifest's name for ``dtype``; refuses dtypes a checkpoint cannot hold."""
    name = str(dtype).removeprefix("torch.")
    if name not in ITEMSIZE:
        raise UnsupportedValueError(f"tensors of dtype {dtype} are not supported by ckpt")
    return name


# -- constructors ----------------------------------------------------------------------------------

def dict_node(keys: list[Node], values: list[Node]) -> dict:
    return {"t": "dict", "k": keys, "v": values}


def tuple_node(values: list[Node]) -> dict:
    return {"t": "tuple", "v": values}


def tensor_node(key: str, numpy: bool | str = False) -> dict:
    """``numpy``: True for a numpy array stored as a tensor of its own dtype; a numpy dtype string
    (``"<U5"``, ``">f4"``, ``"<M8[ns]"`` …) for one stored as raw bytes (a trailing axis of itemsize)."""
    node: dict[str, Any] = {"t": "tensor", "key": key}
    if numpy:
        node["numpy"] = numpy
    return node


def float_node(x: float) -> Node:
    return x if math.isfinite(x) else {"t": "float", "v": repr(x)}


def npscalar_node(dtype: np.dtype, value: Node) -> dict:
    return {"t": "npscalar", "dtype": dtype.str, "v": value}


def npscalar_bytes_node(dtype: np.dtype, data: bytes) -> dict:
    """A numpy scalar with no exact Python number (longdouble, complex, datetime64 …): its bytes."""
    return {"t": "npscalar", "dtype": dtype.str, "b": base64.b64encode(data).decode("ascii")}


def size_node(size: torch.Size) -> dict:
    return {"t": "size", "v": list(size)}


def dtype_node(dtype: torch.dtype) -> dict:
    return {"t": "dtype", "v": dtype_name(dtype)}


def device_node(device: torch.device) -> dict:
    return {"t": "device", "v": str(device)}


def bytes_node(data: bytes | bytearray) -> dict:
    return {"t": "bytes", "v": base64.b64encode(bytes(data)).decode("ascii")}


def bytesio_node(data: io.BytesIO) -> dict:
    """An ``io.BytesIO`` (one of DCP's own item types): its whole buffer, never pickled."""
    return {"t": "bytes", "v": base64.b64encode(data.getvalue()).decode("ascii"), "io": True}


def stateful_node(obj: Any, state: Node) -> dict:
    return {"t": "stateful", "type": f"{type(obj).__module__}.{type(obj).__qualname__}", "v": state}


def pickle_node(obj: Any) -> dict:
    return {"t": "pickle", "v": base64.b64encode(pickle.dumps(obj)).decode("ascii")}


def per_rank_node(values: list[Node]) -> dict:
    return {"t": "per_rank", "v": values}


def kind(node: Node) -> str | None:
    """The ``"t"`` of an object node; None for plain JSON values."""
    return node.get("t") if isinstance(node, dict) else None


def is_per_rank(node: Node) -> bool:
    return kind(node) == "per_rank"


def top_items(structure: dict) -> list[tuple[str, Node]]:
    """(key, node) for each top-level key of a state's structure (a ``dict`` node with str keys)."""
    return list(zip(structure["k"], structure["v"]))


def digest(node: Node) -> str:
    """A short digest of a node: equal values on two ranks give equal digests."""
    return hashlib.blake2b(json.dumps(node, sort_keys=True).encode(), digest_size=16).hexdigest()


# -- rebuilding values --------------------------------------------------------------------------------------

class StatefulValue:
    """A rebuilt ``stateful`` node: the saved state_dict, to hand to ``load_state_dict``."""

    __slots__ = ("state_dict",)

    def __init__(self, sd: Any):
        self.state_dict = sd


def rebuild(node: Node, tensors: dict[str, Any], *, allow_pickle: bool,
            on_pickle: Callable[[dict], Any] | None = None) -> Any:
    """Rebuild the value a node describes, taking tensors from ``tensors`` by key. A pickle node is
    unpickled only with ``allow_pickle``; else ``on_pickle(node)`` stands in for it, if given, or
    :class:`UnsupportedValueError` is raised."""
    def go(n: Node) -> Any:
        return rebuild(n, tensors, allow_pickle=allow_pickle, on_pickle=on_pickle)

    if node is None or isinstance(node, (bool, int, float, str)):
        return node
    if isinstance(node, list):
        return [go(v) for v in node]
    t = kind(node)
    if t == "dict":
        return {go(k): go(v) for k, v in zip(node["k"], node["v"])}
    if t == "tensor":
        value = tensors[node["key"]]
        np_dtype = node.get("numpy")
        if isinstance(np_dtype, str):  # raw bytes with a trailing axis of itemsize
            return value.numpy().reshape(-1).view(np.dtype(np_dtype)).reshape(tuple(value.shape[:-1]))
        return value.numpy() if np_dtype else value
    if t == "tuple":
        return tuple(go(v) for v in node["v"])
    if t == "float":
        return float(node["v"])
    if t == "npscalar":
        if "b" in node:
            return np.frombuffer(base64.b64decode(node["b"]), dtype=np.dtype(node["dtype"]))[0]
        return np.dtype(node["dtype"]).type(go(node["v"]))
    if t == "size":
        import torch
        return torch.Size(node["v"])
    if t == "dtype":
        return torch_dtypes()[node["v"]]
    if t == "device":
        import torch
        return torch.device(node["v"])
    if t == "bytes":
        data = base64.b64decode(node["v"])
        return io.BytesIO(data) if node.get("io") is True else data
    if t == "stateful":
        return StatefulValue(go(node["v"]))
    if t == "pickle":
        if allow_pickle:
            return pickle.loads(base64.b64decode(node["v"]))
        if on_pickle is not None:
            return on_pickle(node)
        raise UnsupportedValueError(
            "this checkpoint holds pickled objects, and unpickling can run code from the file. "
            "Load it with allow_pickle=True only if you trust where it came from.")
    raise ValueError(f"unknown node type {t!r}")


# -- walkers ---------------------------------------------------------------------------------------

MAX_DEPTH = 100  # containers nested deeper than this are refused at save (and in a manifest)


_PLAIN_JSON = re.compile(r'[ !#-\[\]-~]*')  # printable ASCII but '"' and '\\': JSON writes such a string as it is


def path_component(key: Node) -> str:
    """One step of a tensor's path: a dict key's node, or a list index, as canonical JSON. Unlike
    the printed key path, it keeps types apart: 0 and "0", "a/b" and "a" then "b"."""
    if type(key) is str and _PLAIN_JSON.fullmatch(key):  # the common case, without the encoder (a load's planning)
        return f'"{key}"'
    if type(key) is int:
        return str(key)
    return json.dumps(key, sort_keys=True, separators=(",", ":"))


def tensor_paths(node: Node, prefix: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], str]]:
    """(path, key) of every tensor a node refers to, in order; paths as :func:`path_component` makes them."""
    out: list[tuple[tuple[str, ...], str]] = []
    stack: list[tuple[Node, tuple[str, ...]]] = [(node, prefix)]
    while stack:
        n, path = stack.pop()
        t = kind(n)
        if t == "tensor":
            out.append((path, n["key"]))
        elif t == "dict":
            stack.extend((v, path + (path_component(k),)) for k, v in reversed(list(zip(n["k"], n["v"]))))
        elif t == "stateful":
            stack.append((n["v"], path))
        elif t == "tuple" or isinstance(n, list):
            items = n["v"] if t == "tuple" else n
            stack.extend((v, path + (path_component(i),)) for i, v in reversed(list(enumerate(items))))
    return out


def tensor_keys(node: Node) -> list[str]:
    """Keys of the tensors a node refers to, in order."""
    if isinstance(node, list):
        return [k for v in node for k in tensor_keys(v)]
    if isinstance(node, dict):
        if kind(node) == "tensor":
            return [node["key"]]
        return [k for v in node.values() for k in tensor_keys(v)]
    return []


def has_pickle(node: Node) -> bool:
    """True if any node of the tree is a pickle node (checked before any chunk is read)."""
    if isinstance(node, list):
        return any(has_pickle(v) for v in node)
    if isinstance(node, dict):
        return kind(node) == "pickle" or any(has_pickle(v) for v in node.values())
    return False


def strip_pickles(node: Node) -> Node:
    """The node with pickle payloads removed (only their presence is reported)."""
    if isinstance(node, list):
        return [strip_pickles(v) for v in node]
    if isinstance(node, dict):
        if kind(node) == "pickle":
            return {"t": "pickle"}
        return {k: strip_pickles(v) for k, v in node.items()}
    return node


def value_nodes(node: Node, path: str = "", rank: int | None = None) -> Iterator[tuple[str, Node]]:
    """The plain values of a tree as (key path, node), tensors left out.

    Per-rank keys yield every rank's value with a ``[rank r]`` suffix, or only rank ``rank``'s
    (no suffix) when it is given."""
    t = kind(node)
    if t == "dict":
        for k, v in zip(node["k"], node["v"]):
            yield from value_nodes(v, f"{path}/{k}" if path else str(k), rank)
    elif t == "stateful":
        yield from value_nodes(node["v"], path, rank)
    elif t == "tensor":
        return
    elif t == "per_rank":
        for r, v in enumerate(node["v"]):
            if rank is None:
                yield from value_nodes(v, f"{path}[rank {r}]", None)
            elif r == rank:
                yield from value_nodes(v, path, None)
    else:
        yield path, node


def preview(node: Node, limit: int = 80) -> str:
    """A short, safe rendering of a node (tensors and pickles are described, never loaded)."""
    def render(n: Node) -> str:
        if isinstance(n, list):
            return "[" + ", ".join(render(v) for v in n) + "]"
        t = kind(n)
        if t is None:
            return repr(n)
        if t == "dict":
            return "{" + ", ".join(f"{render(k)}: {render(v)}" for k, v in zip(n["k"], n["v"])) + "}"
        if t == "tuple":
            return "(" + ", ".join(render(v) for v in n["v"]) + ("," if len(n["v"]) == 1 else "") + ")"
        if t == "tensor":
            return f"<tensor {n['key']}>"
        if t == "stateful":
            return f"<{n.get('type', 'object')}>"
        if t == "pickle":
            return "<pickled object: not loaded>"
        if t in ("float", "dtype", "device"):
            return str(n["v"])
        if t == "bytes":
            size = len(n["v"]) * 3 // 4 - n["v"][-2:].count("=")  # base64: exact, without decoding
            return f"<BytesIO of {size} bytes>" if n.get("io") is True else f"<{size} bytes>"
        return f"<{t}>"
    s = render(node)
    return s if len(s) <= limit else s[: limit - 1] + "…"


# -- what a tensor is: model, optimizer state, other -----------------------------------------------------

GROUPS = ("model", "optimizer", "other")
MODEL_KEYS = ("model", "module", "state_dict")  # top-level keys that hold a model's tensors (Lightning: state_dict)


def _is_optimizer_state(n: Node) -> bool:
    """A dict node holding an optimizer's ``state_dict()``: ``state`` and ``param_groups``."""
    return kind(n) == "dict" and {"state", "param_groups"} <= {k for k in n["k"] if isinstance(k, str)}


def _is_module_state(n: Node) -> bool:
    """A dict node shaped like a module's ``state_dict()``: tensors by name (and extra states)."""
    return kind(n) == "dict" and bool(n["v"]) and all(
        kind(v) == "tensor" or (isinstance(k, str) and k.endswith("_extra_state")) for k, v in zip(n["k"], n["v"]))


def tensor_groups(root: Node) -> tuple[dict[str, str], dict[str, str]]:
    """For each tensor key of a structure tree, its group (``optimizer``: in an optimizer's state;
    ``model``: in a module's ``state_dict()`` (tensors by name) or under a top-level key of MODEL_KEYS;
    ``other``: the rest, random states included),
    and for optimizer state the tensor key of its parameter where the step recorded it (the
    optimizer node's ``params``; a state entry is ``<optimizer>/state/<index>/...``)."""
    groups: dict[str, str] = {}
    params: dict[str, str] = {}
    stack: list[tuple[Node, tuple[str, ...], str]] = [(root, (), "other")]
    while stack:
        n, path, group = stack.pop()
        t = kind(n)
        if t == "stateful":
            v = n.get("v")
            opt = _is_optimizer_state(v)
            if opt and isinstance(n.get("params"), list):
                names = {i: name for i, name in (x for x in n["params"] if isinstance(x, list) and len(x) == 2)
                         if type(i) is int and isinstance(name, str)}
                for tpath, key in tensor_paths(v):
                    if len(tpath) >= 2 and tpath[0] == '"state"':
                        idx = json.loads(tpath[1])
                        if type(idx) is int and idx in names:
                            params[key] = names[idx]
            module = group == "other" and _is_module_state(v)
            stack.append((v, path, "optimizer" if opt else "model" if module else group))
        elif t == "dict":
            opt = _is_optimizer_state(n)
            for k, v in zip(n["k"], n["v"]):
                g = "optimizer" if opt else "model" if not path and k in MODEL_KEYS and group == "other" else group
                stack.append((v, path + (str(k),), g))
        elif t == "tuple" or t == "per_rank" or isinstance(n, list):
            stack.extend((v, path + (str(i),), group) for i, v in enumerate(n["v"] if t else n))
        elif t == "tensor":
            groups[n["key"]] = group
    return groups, params

