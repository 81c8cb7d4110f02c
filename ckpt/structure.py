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
``bytes``       ``{"t": "bytes", "v": base64}``
``stateful``    ``{"t": "stateful", "type": "pkg.Class", "v": node}``: ``state_dict()`` of an
                object; the type name is informational only, nothing is ever built from it
``pickle``      ``{"t": "pickle", "v": base64}``: only with ``allow_pickle`` on both sides
``per_rank``    ``{"t": "per_rank", "v": [node per rank]}``: a top-level key saved per rank
==============  ======================================================================

This module is the one place that knows these kinds: the constructors the flattener uses, and
every walker over the tree (rebuilding the values, finding its tensors, previews).
"""

from __future__ import annotations

import base64
import hashlib
import json
import math
import pickle
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from .errors import UnsupportedValueError

Node = Any  # a JSON value: None, bool, int, float, str, list, or a dict with a "t" kind

# dtypes a checkpoint may name; a manifest naming anything else is refused.
DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name)
    for name in (
        "float64", "float32", "float16", "bfloat16", "complex64", "complex128",
        "int64", "int32", "int16", "int8", "uint8", "uint16", "uint32", "uint64", "bool",
        "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
    )
    if isinstance(getattr(torch, name, None), torch.dtype)
}


def dtype_name(dtype: torch.dtype) -> str:
    """The manifest's name for ``dtype``; refuses dtypes a checkpoint cannot hold."""
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise UnsupportedValueError(f"tensors of dtype {dtype} are not supported by ckpt")
    return name


# -- constructors ----------------------------------------------------------------------------------

def dict_node(keys: list[Node], values: list[Node]) -> dict:
    return {"t": "dict", "k": keys, "v": values}


def tuple_node(values: list[Node]) -> dict:
    return {"t": "tuple", "v": values}


def tensor_node(key: str, numpy: bool = False) -> dict:
    node: dict[str, Any] = {"t": "tensor", "key": key}
    if numpy:
        node["numpy"] = True
    return node


def float_node(x: float) -> Node:
    return x if math.isfinite(x) else {"t": "float", "v": repr(x)}


def npscalar_node(dtype: np.dtype, value: Node) -> dict:
    return {"t": "npscalar", "dtype": dtype.str, "v": value}


def size_node(size: torch.Size) -> dict:
    return {"t": "size", "v": list(size)}


def dtype_node(dtype: torch.dtype) -> dict:
    return {"t": "dtype", "v": dtype_name(dtype)}


def device_node(device: torch.device) -> dict:
    return {"t": "device", "v": str(device)}


def bytes_node(data: bytes | bytearray) -> dict:
    return {"t": "bytes", "v": base64.b64encode(bytes(data)).decode("ascii")}


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


def rebuild(node: Node, tensors: dict[str, Any], *, allow_pickle: bool) -> Any:
    """Rebuild the value a node describes, taking tensors from ``tensors`` by key."""
    if node is None or isinstance(node, (bool, int, float, str)):
        return node
    if isinstance(node, list):
        return [rebuild(v, tensors, allow_pickle=allow_pickle) for v in node]
    t = kind(node)
    if t == "dict":
        return {rebuild(k, tensors, allow_pickle=allow_pickle): rebuild(v, tensors, allow_pickle=allow_pickle)
                for k, v in zip(node["k"], node["v"])}
    if t == "tensor":
        value = tensors[node["key"]]
        return value.numpy() if node.get("numpy") else value
    if t == "tuple":
        return tuple(rebuild(v, tensors, allow_pickle=allow_pickle) for v in node["v"])
    if t == "float":
        return float(node["v"])
    if t == "npscalar":
        return np.dtype(node["dtype"]).type(rebuild(node["v"], tensors, allow_pickle=allow_pickle))
    if t == "size":
        return torch.Size(node["v"])
    if t == "dtype":
        return DTYPES[node["v"]]
    if t == "device":
        return torch.device(node["v"])
    if t == "bytes":
        return base64.b64decode(node["v"])
    if t == "stateful":
        return StatefulValue(rebuild(node["v"], tensors, allow_pickle=allow_pickle))
    if t == "pickle":
        if not allow_pickle:
            raise UnsupportedValueError(
                "this checkpoint holds pickled objects, and unpickling can run code from the file. "
                "Load it with allow_pickle=True only if you trust where it came from.")
        return pickle.loads(base64.b64decode(node["v"]))
    raise ValueError(f"unknown node type {t!r}")


# -- walkers ---------------------------------------------------------------------------------------

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
            return f"<{len(n['v']) * 3 // 4} bytes>"
        return f"<{t}>"
    s = render(node)
    return s if len(s) <= limit else s[: limit - 1] + "…"
