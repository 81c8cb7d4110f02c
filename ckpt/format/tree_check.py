"""Checking a structure tree read from a manifest (untrusted JSON): every node of a known kind with
well-typed fields, keys hashable, depth bounded, tensor nodes naming the manifest's tensors; and the
lowest format version that can hold a tree. The kinds themselves are :mod:`ckpt.tree`'s."""

from __future__ import annotations

import base64
import binascii
import math
from collections.abc import Callable
from typing import Any

import numpy as np

from ..tree import ITEMSIZE, MAX_DEPTH, Node, kind

_KEY_KINDS = {None, "tuple", "float", "npscalar", "size", "dtype", "device", "bytes", "pickle", "tensor"}  # hashable


def _np_dtype(s: Any) -> np.dtype | None:
    """The numpy dtype a manifest names, if it is one ckpt writes (no objects, no records)."""
    if not isinstance(s, str) or len(s) > 32:
        return None
    try:
        dt = np.dtype(s)
    except (TypeError, ValueError):
        return None
    return None if dt.hasobject or dt.kind == "V" or dt.itemsize == 0 else dt


class _Walk:
    """What :func:`problem`'s checkers share: the manifest's tensor keys and the nodes still to check,
    as (node, depth, is a dict key)."""

    __slots__ = ("tensor_keys", "stack")

    def __init__(self, root: Node, tensor_keys: set[str] | None):
        self.tensor_keys = tensor_keys
        self.stack: list[tuple[Node, int, bool]] = [(root, 0, False)]

    def push(self, nodes: list, depth: int, as_key: bool = False) -> None:
        self.stack.extend((x, depth, as_key) for x in nodes)


# Each checker looks at one object node of its kind (at ``depth``; ``as_key``: it is a dict key) and
# returns what is wrong with it, or None after pushing its children onto the walk.
_Checker = Callable[[dict, int, bool, _Walk], str | None]


def _check_dict(n: dict, depth: int, as_key: bool, walk: _Walk) -> str | None:
    k, v = n.get("k"), n.get("v")
    if not (isinstance(k, list) and isinstance(v, list) and len(k) == len(v)):
        return "a dict node without keys and values of the same length"
    walk.push(k, depth + 1, True)
    walk.push(v, depth + 1)
    return None


def _check_tuple(n: dict, depth: int, as_key: bool, walk: _Walk) -> str | None:
    v = n.get("v")
    if not isinstance(v, list):
        return "a tuple node without a list of values"
    walk.push(v, depth + 1, as_key)  # a tuple key's items are keys too: they must be hashable
    return None


def _check_tensor(n: dict, depth: int, as_key: bool, walk: _Walk) -> str | None:
    key = n.get("key")
    if not isinstance(key, str) or (walk.tensor_keys is not None and key not in walk.tensor_keys):
        return f"a tensor node naming no tensor of the manifest ({str(n.get('key'))[:60]!r})"
    np_dtype = n.get("numpy", False)
    if not isinstance(np_dtype, bool) and _np_dtype(np_dtype) is None:
        return f"a tensor node with an unknown numpy dtype {str(np_dtype)[:40]!r}"
    return None


def _check_float(n: dict, depth: int, as_key: bool, walk: _Walk) -> str | None:
    v: Any = n.get("v")  # untrusted: whatever it is, float() says
    try:
        float(v)
    except (TypeError, ValueError):
        return "a float node that is not a number"
    return None


def _check_npscalar(n: dict, depth: int, as_key: bool, walk: _Walk) -> str | None:
    dt = _np_dtype(n.get("dtype"))
    if dt is None:
        return f"a numpy scalar of unknown dtype {str(n.get('dtype'))[:40]!r}"
    if "b" in n:  # its raw bytes
        try:
            if len(base64.b64decode(n["b"], validate=True)) != dt.itemsize:
                return "a numpy scalar whose bytes do not fit its dtype"
        except (TypeError, ValueError, binascii.Error):
            return "a numpy scalar with bad bytes"
        return None
    v = n.get("v")
    if dt.kind not in "biuf" or not (v is None or isinstance(v, (bool, int, float)) or kind(v) == "float"):
        return "a numpy scalar without a number"
    return None


def _check_size(n: dict, depth: int, as_key: bool, walk: _Walk) -> str | None:
    v = n.get("v")
    if not (isinstance(v, list) and all(type(d) is int and d >= 0 for d in v)):
        return "a size node that is not a list of sizes"
    return None


def _check_dtype(n: dict, depth: int, as_key: bool, walk: _Walk) -> str | None:
    v = n.get("v")
    if not isinstance(v, str) or v not in ITEMSIZE:  # v may be unhashable
        return f"a dtype node naming an unknown dtype {str(v)[:40]!r}"
    return None


def _check_device(n: dict, depth: int, as_key: bool, walk: _Walk) -> str | None:
    import torch  # only a structure that holds a torch.device needs torch to check it

    v = n.get("v")
    try:
        if not isinstance(v, str) or len(v) > 64:
            raise TypeError(v)
        torch.device(v)
    except (TypeError, RuntimeError, ValueError):
        return f"a device node naming no device ({str(v)[:40]!r})"
    return None


def _check_bytes(n: dict, depth: int, as_key: bool, walk: _Walk) -> str | None:
    v: Any = n.get("v")  # untrusted: whatever it is, b64decode says
    if n.get("io", False) is not True and "io" in n:
        return "a bytes node whose io flag is not true"
    try:
        base64.b64decode(v, validate=True)
    except (TypeError, ValueError, binascii.Error):
        return "a bytes node that is not base64"
    return None


def _check_stateful(n: dict, depth: int, as_key: bool, walk: _Walk) -> str | None:
    if "v" not in n:
        return "a stateful node without its state"
    walk.push([n["v"]], depth + 1)
    return None


def _check_pickle(n: dict, depth: int, as_key: bool, walk: _Walk) -> str | None:
    if not isinstance(n.get("v"), str):
        return "a pickle node without its payload"
    return None


def _check_per_rank(n: dict, depth: int, as_key: bool, walk: _Walk) -> str | None:
    v = n.get("v")
    if depth != 1 or not isinstance(v, list):
        return "a per-rank node that is not a top-level value"
    walk.push(v, depth + 1)
    return None


_CHECKERS: dict[str, _Checker] = {
    "dict": _check_dict, "tuple": _check_tuple, "tensor": _check_tensor, "float": _check_float,
    "npscalar": _check_npscalar, "size": _check_size, "dtype": _check_dtype, "device": _check_device,
    "bytes": _check_bytes, "stateful": _check_stateful, "pickle": _check_pickle, "per_rank": _check_per_rank,
}


def _plain_problem(n: Node, depth: int, as_key: bool, walk: _Walk) -> str | None:
    """What is wrong with a node that is not an object node (a JSON scalar or list), or None."""
    if n is None or isinstance(n, (bool, int, str)):
        return None
    if isinstance(n, float):
        return None if math.isfinite(n) else "a non-finite number outside a float node"
    if isinstance(n, list):
        if as_key:
            return "a list used as a dict key"
        walk.push(n, depth + 1)
        return None
    return f"a value of type {type(n).__name__}"


def _object_problem(n: dict, depth: int, as_key: bool, walk: _Walk) -> str | None:
    """What is wrong with an object node, by its kind's checker, or None."""
    t = n.get("t")
    if as_key and not ((t is None or isinstance(t, str)) and t in _KEY_KINDS):  # t may be unhashable
        return f"a {str(t)[:40]!r} node used as a dict key"
    check = _CHECKERS.get(t) if isinstance(t, str) else None
    if check is None:
        return f"a node of unknown kind {str(t)[:40]!r}"
    return check(n, depth, as_key, walk)


def problem(root: Node, tensor_keys: set[str] | None, *, max_depth: int = MAX_DEPTH + 2) -> str | None:
    """What is wrong with a structure tree read from a manifest, or None. Checked without recursion
    (a tree may be arbitrarily deep) before anything is rebuilt from it, so rebuilding cannot fail
    halfway with a KeyError or TypeError: every node has the fields its kind needs, every tensor
    node names a tensor of the manifest (of ``tensor_keys``; None: any string, for a rank's report,
    whose structure also names tensors other ranks wrote), every dict key rebuilds to something hashable."""
    walk = _Walk(root, tensor_keys)
    while walk.stack:
        n, depth, as_key = walk.stack.pop()
        if depth > max_depth:
            return f"nested deeper than {max_depth} levels"
        check = _object_problem if isinstance(n, dict) else _plain_problem
        why = check(n, depth, as_key, walk)
        if why is not None:
            return why
    return None


def newest_feature(node: Node) -> int:
    """The lowest manifest format version that can hold ``node``: 5 for ``io.BytesIO`` values, 3 for
    numpy values stored as raw bytes (older readers would return those bytes as they are, not as
    what was saved), else 1."""
    stack = [node]
    version = 1
    while stack:
        n = stack.pop()
        if isinstance(n, list):
            stack.extend(n)
        elif isinstance(n, dict):
            t = n.get("t")
            if t == "bytes" and n.get("io") is True:
                return 5
            if (t == "tensor" and isinstance(n.get("numpy"), str)) or (t == "npscalar" and "b" in n):
                version = 3
            stack.extend(n.values())
    return version
