"""Ranks that hold different keys of one state (pipeline stages): the union of their structure trees.

A top-level key whose structure differs between ranks is one global state when the ranks differ
only in which dict entries they hold: where two ranks hold the same path, they hold the same kind of
node there, and the same plain value, tensor key or object type. Its trees then unite into one
(:func:`unite`) that holds every rank's entries, and one process can load all of it. Anything else
(a plain value that differs, a list of another length) leaves the key per-rank state, as before.

The planner decides before anything is written, from each rank's :func:`layout` (a digest per path,
small enough to travel in a save plan); :func:`ckpt.format.manifest.merge` unites the trees at
commit. Pure functions of JSON nodes: tested without any process group or torch.
"""

from __future__ import annotations

import base64
import hashlib
import json
import zlib
from typing import Any

from .. import tree as st


def _describe(node: st.Node) -> str:
    """What must agree where two ranks hold one path: a dict is a dict whatever it holds (its entries
    are compared path by path), an object is its type (and, for an optimizer, which parameter each
    index of its state is), anything else is its whole value."""
    k = st.kind(node)
    if k == "dict":
        return "dict"
    if k == "stateful":
        return "stateful " + json.dumps({n: v for n, v in node.items() if n != "v"}, sort_keys=True)
    return hashlib.blake2b(json.dumps(node, sort_keys=True).encode(), digest_size=8).hexdigest()


def _paths(node: st.Node, path: str, out: dict[str, str]) -> None:
    out[path] = _describe(node)
    k = st.kind(node)
    if k == "dict":
        for key, v in zip(node["k"], node["v"]):
            _paths(v, path + "/" + st.path_component(key), out)
    elif k == "stateful":
        _paths(node["v"], path + "/", out)


def layout(node: st.Node) -> str:
    """A rank's top-level node as path -> what must agree there, compressed (it travels in the plan)."""
    out: dict[str, str] = {}
    _paths(node, "", out)
    return base64.b64encode(zlib.compress(json.dumps(out, separators=(",", ":")).encode())).decode("ascii")


def unionable(layouts: list[str | None]) -> bool:
    """Whether ranks' top-level nodes (their :func:`layout`; None: not sent) unite: every path held
    by several ranks holds the same thing on each."""
    if any(lay is None for lay in layouts):
        return False
    seen: dict[str, str] = {}
    for lay in layouts:
        assert lay is not None
        for path, what in json.loads(zlib.decompress(base64.b64decode(lay))).items():
            if seen.setdefault(path, what) != what:
                return False
    return True


class _Apart(Exception):
    """The nodes differ other than in the entries they hold."""


def unite(nodes: list[st.Node]) -> st.Node | None:
    """One node holding every node's dict entries (in the order the nodes first hold them), or None
    where the nodes differ other than in the entries they hold."""
    try:
        return _unite(nodes)
    except _Apart:
        return None


def _unite(nodes: list[st.Node]) -> st.Node:
    first = nodes[0]
    if all(n == first for n in nodes[1:]):
        return first
    kinds = {st.kind(n) for n in nodes}
    if kinds == {"stateful"}:
        if len({json.dumps({k: v for k, v in n.items() if k != "v"}, sort_keys=True) for n in nodes}) > 1:
            raise _Apart
        return {**first, "v": _unite([n["v"] for n in nodes])}
    if kinds != {"dict"}:
        raise _Apart
    keys: dict[str, Any] = {}
    values: dict[str, list[st.Node]] = {}
    for n in nodes:
        for key, v in zip(n["k"], n["v"]):
            c = st.path_component(key)
            keys.setdefault(c, key)
            values.setdefault(c, []).append(v)
    return st.dict_node(list(keys.values()), [_unite(values[c]) for c in keys])
