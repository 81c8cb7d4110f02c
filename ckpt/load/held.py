"""What each loading rank holds of a step, and whether the loading ranks together hold all of it.

A step saved by ranks that held different keys (pipeline stages) is one state, the union of theirs
(:mod:`ckpt.format.tree_union`). A rank that loads it takes only the entries its own state holds
(:func:`held_part`): a module's keys, a non-empty dict's or ``Stateful``'s entries; an optimizer's
state is taken whole (one without state yet holds nothing to compare with), and so is an empty dict.
The ``strict`` check of what the rank asks for that the step lacks stays on the rank
(:mod:`ckpt.load.checks`); what the step holds that no rank asks for is found across the ranks:
each sends which of the step's entries it took (:func:`taken`, nothing when it took all), in the
load's agreement round, whose coordinator joins them (:func:`union`): every rank reads that one
answer (:func:`check_all_taken`).
"""

from __future__ import annotations

import base64
import json
import zlib
from typing import Any

import numpy as np
import torch

from .. import tree as st
from ..errors import StateMismatchError
from ..format import manifest as mf

Path = tuple[str, ...]


def held_part(saved: st.Node, mine: st.Node, live: Any) -> st.Node:
    """``saved`` without the dict entries that ``mine`` (the state's own node there, of object
    ``live``) lacks: what this rank loads of a step whose ranks held different keys."""
    if isinstance(live, torch.optim.Optimizer):
        return saved  # its state has only the parameters that have stepped: never a list of what it holds
    if st.kind(saved) == "stateful" and st.kind(mine) == "stateful":
        inner = held_part(saved["v"], mine["v"], None)
        return saved if inner is saved["v"] else {**saved, "v": inner}
    if st.kind(saved) != "dict" or st.kind(mine) != "dict" or not mine["k"]:
        return saved  # an empty dict of the state takes whatever the step holds there
    lives = list(live.values()) if isinstance(live, dict) and len(live) == len(mine["k"]) else [None] * len(mine["k"])
    have = {st.path_component(k): (v, lv) for k, v, lv in zip(mine["k"], mine["v"], lives)}
    keys, values = [], []
    for k, v in zip(saved["k"], saved["v"]):
        if (got := have.get(st.path_component(k))) is not None:
            keys.append(k)
            values.append(held_part(v, *got))
    if len(keys) == len(saved["k"]) and all(a is b for a, b in zip(values, saved["v"])):
        return saved
    return st.dict_node(keys, values)


def _leaves(node: st.Node, path: Path, out: list[Path]) -> None:
    """The paths of a node's leaves: whatever is not a dict entry to take or leave."""
    k = st.kind(node)
    if k == "stateful":
        _leaves(node["v"], path, out)
    elif k == "dict" and node["k"]:
        for key, v in zip(node["k"], node["v"]):
            _leaves(v, path + (st.path_component(key),), out)
    else:
        out.append(path)


def leaves(tops: list[tuple[str, st.Node]]) -> list[Path]:
    out: list[Path] = []
    for top, node in tops:
        _leaves(node, (st.path_component(top),), out)
    return out


def shared_tops(m: mf.Manifest) -> list[tuple[str, st.Node]]:
    """The step's top-level keys that are one state for every rank (not per-rank), with their nodes."""
    return [(k, v) for k, v in st.top_items(m.structure) if not st.is_per_rank(v)]


def taken(m: mf.Manifest, loaded: dict[str, st.Node]) -> dict:
    """What this rank tells the others it took of the step (``loaded``: the parts it loads, by
    top-level key, per-rank ones left out): nothing when it took every entry, else a bitmap over
    the step's leaves."""
    everything = leaves(shared_tops(m))
    mine = set(leaves(list(loaded.items())))
    bits = np.fromiter((p in mine for p in everything), dtype=bool, count=len(everything))
    if bits.all():
        return {}
    return {"held": base64.b64encode(zlib.compress(np.packbits(bits).tobytes())).decode("ascii")}


def union(notes: list[dict]) -> dict:
    """What the ranks whose :func:`taken` notes are ``notes`` took together: nothing (they took every
    entry) when some rank took all, else the bitwise OR of their bitmaps. Pure: the coordinator of the
    load's round runs it, so each rank reads one answer, not every rank's note."""
    maps = [n.get("held") for n in notes]
    if not maps or not all(isinstance(b, str) for b in maps):
        return {}
    packed = [np.frombuffer(zlib.decompress(base64.b64decode(str(b))), dtype=np.uint8) for b in maps]
    if len({p.size for p in packed}) != 1:
        return {}  # notes of different steps cannot be joined: let each rank's own check stand
    both = np.bitwise_or.reduce(np.stack(packed), axis=0)
    return {"held": base64.b64encode(zlib.compress(both.tobytes())).decode("ascii")}


def check_all_taken(m: mf.Manifest, together: dict) -> None:
    """With ``strict``: raise :class:`StateMismatchError` (the same on every rank) if some entry of
    the step is taken by none of the loading ranks; ``together`` is their :func:`union`, with
    ``ranks`` their number."""
    if "held" not in together:
        return  # some rank took everything
    everything = leaves(shared_tops(m))
    got = np.unpackbits(np.frombuffer(zlib.decompress(base64.b64decode(together["held"])), dtype=np.uint8),
                        count=len(everything)).astype(bool)
    left = [_printed(p) for p, g in zip(everything, got) if not g]
    if left:
        ranks = int(together.get("ranks", 1))
        who = "this process does not hold" if ranks == 1 else f"none of the {ranks} loading ranks holds"
        raise StateMismatchError(
            f"step {m.step} holds {len(left)} key(s) {who}: {left[:8]}{' …' if len(left) > 8 else ''}. Every "
            "key of the step must be loaded by some rank: give the ranks together the whole state (e.g. every "
            "pipeline stage), or pass strict=False to load what they hold; nothing was changed.")


def _printed(path: Path) -> str:
    return "/".join(str(json.loads(c)) for c in path)
