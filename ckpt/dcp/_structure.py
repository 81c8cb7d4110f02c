"""Between DCP's flat view of a state and ckpt's structure tree.

DCP's default planner flattens a nested state dict into fully qualified names joined by ``.``
(``model.layer.weight``) and keeps, per name, the path of keys it came from (``("model",
"layer.weight")``: ``metadata.planner_data``). ckpt keeps the nesting: a structure tree whose tensor
nodes carry keys joined by ``/`` (``model/layer.weight``), as :func:`ckpt.flatten.flatten` names
them. The functions here turn one into the other, so a step written through DCP reads like a
``Checkpointer.save`` of the same dicts, and any ckpt step reads through DCP.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.checkpoint._nested_dict import flatten_state_dict

from .. import tree as st
from ..errors import ConfigError, IncompatibleFormatError, UnsupportedValueError
from ..flatten import flatten

Path = Sequence[Any]  # DCP's OBJ_PATH: str dict keys and int list indices


def tensor_key(path: Path) -> str:
    """ckpt's key of the tensor at ``path``: the parts joined by ``/`` (list indices as digits)."""
    return "/".join(p if isinstance(p, str) else repr(p) for p in path)


def check_keys(plans: Sequence[Any]) -> None:
    """Refuse, before anything is written, two tensor items of DCP save plans whose paths join to
    one ckpt key (``{"a/b": t1, "a": {"b": t2}}``: both ``a/b``): their shards would be stored as
    one tensor's, a step that never loads. Raises :class:`UnsupportedValueError` naming both."""
    seen: dict[str, str] = {}
    for plan in plans:
        mappings = plan.planner_data if isinstance(plan.planner_data, dict) else {}
        for item in plan.items:
            if item.tensor_data is None:  # a value (BYTE_IO): stored in the structure tree, not under a key
                continue
            fqn = item.index.fqn
            key = tensor_key(mappings.get(fqn, (fqn,)))
            other = seen.setdefault(key, fqn)
            if other != fqn:
                raise UnsupportedValueError(
                    f"state items {other!r} and {fqn!r} (paths {list(mappings.get(other, (other,)))!r} and "
                    f"{list(mappings.get(fqn, (fqn,)))!r}) both become ckpt key {key!r}: ckpt.dcp.Writer joins key "
                    "paths with '/', so a key holding '/' must not repeat a nested path. Rename one of them; "
                    "nothing was written")


def value_node(fqn: str, obj: Any, allow_pickle: bool) -> st.Node:
    """The structure node of a non-tensor item of DCP's state: a plain value as its node, anything
    else a pickle node with ``allow_pickle`` (else :class:`ConfigError` naming the item)."""
    try:
        flat = flatten({"v": obj})
    except UnsupportedValueError:
        flat = None
    if flat is not None and not flat.tensors and not flat.statefuls:
        return flat.structure["v"][0]
    if not allow_pickle:
        raise ConfigError(
            f"state item {fqn!r} is a {type(obj).__module__}.{type(obj).__qualname__}, not a plain value (numbers, "
            "strings, lists, dicts, bytes, …): ckpt.dcp.Writer stores such objects only with allow_pickle=True "
            "(loading them then needs ckpt.dcp.Reader(..., allow_pickle=True)); or convert it to plain values")
    return st.pickle_node(obj)


def build_structure(leaves: dict[str, st.Node], mappings: dict[str, Path]) -> dict:
    """The structure tree of a state whose items are ``leaves`` (fqn → node), nested along
    ``mappings`` (fqn → path; a name without one is a top-level key of its own)."""
    root: dict[Any, Any] = {}
    for fqn, node in leaves.items():
        path = list(mappings.get(fqn, (fqn,)))
        at = root
        for i, part in enumerate(path):
            if i == len(path) - 1:
                at[part] = _Leaf(node)
            else:
                nxt = at.setdefault(part, {})
                if isinstance(nxt, _Leaf):
                    raise ConfigError(f"state item {fqn!r} lies under {path[:i + 1]!r}, which is itself an item")
                at = nxt
    return _node(root, top=True)


class _Leaf:
    __slots__ = ("node",)

    def __init__(self, node: st.Node):
        self.node = node


def _node(level: dict[Any, Any] | _Leaf, top: bool = False) -> st.Node:
    if isinstance(level, _Leaf):
        return level.node
    if not top and level and all(type(k) is int for k in level):  # a list DCP walked by index
        out: list[st.Node] = [None] * (max(level) + 1)
        for k, v in level.items():
            out[k] = _node(v)
        return out
    return st.dict_node([str(k) for k in level], [_node(v) for v in level.values()])


class Pickled:
    """Stands for a pickled value a Reader was not allowed to unpickle (refused if DCP asks for it)."""

    __slots__ = ()


def dcp_view(structure: dict, shapes: dict[str, tuple[torch.dtype, list[int]]], allow_pickle: bool
             ) -> tuple[dict[str, Any], dict[str, tuple[Any, ...]], list[str]]:
    """What DCP sees of a ckpt step: fqn → tensor key (``str``) or plain value, DCP's fqn → path
    mapping, and the top-level keys left out (saved per rank: DCP has no such notion).

    The names are made by DCP's own ``flatten_state_dict`` over the step's values with a meta
    tensor where each tensor is, so they are exactly the ones ``dcp.load`` looks up."""
    keyed: dict[int, str] = {}
    skipped: list[str] = []

    def go(n: st.Node) -> Any:
        t = st.kind(n)
        if t == "tensor":
            dtype, shape = shapes[n["key"]]
            ref = torch.empty(shape, dtype=dtype, device="meta")
            keyed[id(ref)] = n["key"]
            return ref
        if t == "dict":
            return {st.rebuild(k, {}, allow_pickle=False, on_pickle=lambda _: Pickled()): go(v)
                    for k, v in zip(n["k"], n["v"])}
        if t == "stateful":
            return go(n["v"])
        if t == "tuple":
            return tuple(go(v) for v in n["v"])
        if isinstance(n, list):
            return [go(v) for v in n]
        return st.rebuild(n, {}, allow_pickle=allow_pickle, on_pickle=lambda _: Pickled())

    state: dict[str, Any] = {}
    for k, v in st.top_items(structure):
        if st.is_per_rank(v):
            skipped.append(k)
        else:
            state[k] = go(v)
    try:
        flat, mappings = flatten_state_dict(state)
    except ValueError as e:  # two key paths DCP joins into one name
        raise _collision(state) from e
    out: dict[str, Any] = {}
    for fqn, v in flat.items():
        if isinstance(v, torch.Tensor):
            out[fqn] = keyed[id(v)]
        elif not _holds_tensor(v):  # DCP keeps tuples whole: one holding tensors is not a value it can load
            out[fqn] = Value(v)
    return out, dict(mappings), skipped


def _collision(state: dict[str, Any]) -> IncompatibleFormatError:
    """The error for a step DCP cannot name: two key paths that join (with ``.``) into one DCP name."""
    from torch.distributed.checkpoint._traverse import traverse_state_dict

    seen: dict[str, tuple[Any, ...]] = {}
    clash: list[tuple[Any, ...]] = []

    def visit(path: Any, value: Any) -> None:
        fqn = ".".join(map(str, path))
        if fqn in seen and not clash:
            clash.extend([seen[fqn], tuple(path)])
        seen.setdefault(fqn, tuple(path))

    traverse_state_dict(state, visit)
    if not clash:
        return IncompatibleFormatError("DCP cannot name this step's items: two key paths join into one DCP name")
    a, b = clash
    return IncompatibleFormatError(
        f"DCP cannot read this step: the key paths {tensor_key(a)!r} and {tensor_key(b)!r} both become DCP's name "
        f"{'.'.join(map(str, a))!r} (DCP joins keys with '.'). Read the step with ckpt instead "
        "(ckpt.Checkpointer(url).load(step, state) or ckpt.open(url).tensors(step)), or rename one of "
        "the keys so that no two join into the same dotted name")


class Value:
    """A plain value of the step (told apart from a tensor key, which is a str)."""

    __slots__ = ("value",)

    def __init__(self, value: Any):
        self.value = value


def _holds_tensor(v: Any) -> bool:
    if isinstance(v, torch.Tensor):
        return True
    if isinstance(v, dict):
        return any(_holds_tensor(x) for x in v.values())
    if isinstance(v, (list, tuple)):
        return any(_holds_tensor(x) for x in v)
    return False
