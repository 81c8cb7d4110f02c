"""How a saved step meets the state a rank loads it into (the first step of :func:`ckpt.load.plan.plan_load`):
the top-level keys loaded, the saved rank per-rank state comes from, each saved tensor's place in the
state, and what is missing on either side. Pure: it reads the state, changes nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .. import tree as st
from ..errors import ConfigError, ReshardError
from ..format import manifest as mf
from ..tied import unresolved
from . import held

RankMap = Callable[[int], int] | dict[int, int] | list[int]


@dataclass
class Match:
    """How the saved step meets the state: the top-level keys loaded, their saved nodes (per-rank ones
    from the source rank; the others as far as the state holds them: :func:`ckpt.load.held.held_part`),
    and per saved tensor (saved key, saved rank, the state's key or None)."""

    tops: list[str]
    per_rank: list[str]
    nodes: dict[str, Any]
    entries: dict[tuple[str, int | None], mf.TensorEntry]
    wanted: list[tuple[str, int | None, str | None]]
    unexpected: list[str]  # top-level keys in the checkpoint, not in the state
    missing: list[str]  # top-level keys and tensors of the state, not in the checkpoint


def match(m: mf.Manifest, state: dict[str, Any], target: Any, rank: int, world: int,
          rank_map: RankMap | None) -> Match:
    saved_nodes = dict(st.top_items(m.structure))
    wanted_top = [k for k in m.top_keys if k in state]
    # Per-rank state: which saved rank this rank takes it from.
    per_rank = [k for k in wanted_top if st.is_per_rank(saved_nodes[k])]
    src_rank = source_rank(m, per_rank, rank, world, rank_map) if per_rank else None
    nodes = {k: saved_nodes[k]["v"][src_rank] if k in per_rank else saved_nodes[k] for k in wanted_top}
    nodes = {k: _module_states(v, state[k]) for k, v in nodes.items()}
    mine = dict(st.top_items(target.structure))
    nodes = {k: v if k in per_rank else held.held_part(v, mine[k], state[k]) for k, v in nodes.items()}
    entries = {(t.key, t.rank): t for t in m.tensors}
    # Saved tensors meet the state's by their path in the structure (keys with their types), never
    # by their printed names: {"a/b": x, "a": {"b": y}} or {0: x, "0": y} cannot be swapped.
    target_key = {path: key for key, path in target.paths.items()}
    wanted: list[tuple[str, int | None, str | None]] = []
    for top in wanted_top:
        for path, key in st.tensor_paths(nodes[top], (st.path_component(top),)):
            owner = src_rank if top in per_rank and (key, src_rank) in entries else None
            wanted.append((key, owner, target_key.get(path)))
    found = {tk for _, _, tk in wanted if tk is not None}
    missing_top = [k for k in state if k not in saved_nodes]
    missing_tensors = _untied([k for k in target.paths if k not in found and k.split("/", 1)[0] in saved_nodes],
                              found, target)
    return Match(wanted_top, per_rank, nodes, entries, wanted, [k for k in m.top_keys if k not in state],
                  missing_top + missing_tensors)


def _module_states(node: Any, live: Any) -> Any:
    """``node`` with each plain dict saved where the state holds a module read as that module's state:
    a module's ``state_dict()`` saved as a dict (``dcp.save({"model": model.state_dict()})`` through
    ``ckpt.dcp.Writer``) then loads into ``{"model": model}`` with ``load_state_dict``, as the
    Checkpointer's own save of the module does."""
    if isinstance(live, torch.nn.Module):
        if st.kind(node) != "dict":
            return node
        return {"t": "stateful", "type": f"{type(live).__module__}.{type(live).__qualname__}", "v": node}
    if not isinstance(live, dict) or st.kind(node) != "dict":
        return node
    values = [_module_states(v, live[k]) if isinstance(k, str) and k in live else v
              for k, v in zip(node["k"], node["v"])]
    return node if all(a is b for a, b in zip(values, node["v"])) else {**node, "v": values}


def _untied(missing: list[str], found: set[str], target: Any) -> list[str]:
    """``missing`` without the modules' tied keys whose partner the step holds (:mod:`ckpt.tied`)."""
    for where, obj in target.statefuls.items() if missing else ():
        if isinstance(obj, torch.nn.Module):
            mine = {k[len(where) + 1:] for k in missing if k.startswith(where + "/")}
            if mine:
                have = {k[len(where) + 1:] for k in found if k.startswith(where + "/")}
                left = set(unresolved(obj, have, mine))
                missing = [k for k in missing if not k.startswith(where + "/") or k[len(where) + 1:] in left]
    return missing



def source_rank(m: mf.Manifest, keys: list[str], rank: int, world: int, rank_map: RankMap | None) -> int:
    if rank_map is None:
        if world == m.world_size:
            return rank
        raise ReshardError(
            f"step {m.step} was saved on {m.world_size} rank(s) and holds per-rank state under {keys} "
            f"(e.g. RNG or data loader positions); this job has {world}. Say which saved rank each rank takes "
            "it from with load(..., rank_map=lambda rank: rank % saved_world) (or a dict/list), or leave these "
            "keys out of the state passed to load (strict=False).")
    src = rank_map(rank) if callable(rank_map) else rank_map[rank]
    if type(src) is not int or not 0 <= src < m.world_size:
        raise ConfigError(f"rank_map gave {src!r} for rank {rank}; it must be a saved rank, 0 to {m.world_size - 1}")
    return src

