"""What a Hugging Face export (``format="hf"``) needs beyond its shards, so that
``from_pretrained(dir)`` builds the model that was saved:

* the model's keys only: without ``keys``, the tensors under the top-level key ``model``, that
  prefix taken off their names; a step without one that holds optimizer state is refused rather
  than guessed at (an optimizer's state in a model directory is not a model), and a step with
  neither is exported whole, as it is named;
* its ``config.json``: from ``config``, a JSON file or the key path of a value of the step (the
  model's config saved in the state, ``{"model": m, "config": m.config.to_dict()}``); without it,
  a top-level ``config`` value (or one under the exported prefix) if the step has one. Where
  there is none (nor a ``config.json`` already in the directory), a warning says so once the
  export is written: ``from_pretrained`` would otherwise build a default model.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

from .. import tree as st
from ..errors import ConfigError
from ..format import manifest as mf

log = logging.getLogger("ckpt")


def model_prefix(m: mf.Manifest) -> str | None:
    """The prefix of the model's tensors in step ``m`` (``model/``); None where every tensor may go
    (no optimizer state to keep out); :class:`ConfigError` where the model cannot be told apart."""
    tops = sorted({t.key.split("/", 1)[0] for t in m.tensors})
    if any(t.key.startswith("model/") for t in m.tensors):
        return "model/"
    optimizers = [k for k, node in st.top_items(m.structure) if _holds_optimizer(node)]
    if not optimizers:
        return None
    example = next((k for k in tops if k not in optimizers), "model")
    raise ConfigError(
        f"--format hf writes one model's weights, and step {m.step} holds optimizer state ({optimizers[:4]}) beside "
        f"tensors under {tops[:8]}{' …' if len(tops) > 8 else ''}, none named 'model': pass --keys PREFIX "
        f"--strip-prefix for the model's (e.g. --keys {example}/ --strip-prefix), or --keys '' to export every "
        "tensor as it is named")


def _holds_optimizer(node: Any) -> bool:
    """Is this top-level node an optimizer's state (``param_groups`` and ``state``)?"""
    nodes = node["v"] if st.kind(node) == "per_rank" else [node]
    for n in nodes:
        if st.kind(n) == "stateful":
            n = n["v"]
        if st.kind(n) == "dict" and {"param_groups", "state"} <= {k for k in n["k"] if isinstance(k, str)}:
            return True
    return False


def _node_at(m: mf.Manifest, path: str, rank: int) -> Any:
    """The structure node at key path ``path`` (``config``, ``model/config``), or None."""
    node: Any = m.structure
    for part in path.strip("/").split("/"):
        if st.kind(node) == "per_rank":
            node = node["v"][rank] if rank < len(node["v"]) else None
        if st.kind(node) == "stateful":
            node = node["v"]
        if st.kind(node) != "dict" or part not in node["k"]:
            return None
        node = node["v"][node["k"].index(part)]
    return node["v"][rank] if st.kind(node) == "per_rank" and rank < len(node["v"]) else node


def _as_config(node: Any) -> dict | None:
    """A value node as a JSON object (a dict of plain values), or None if it is not one."""
    if node is None or st.kind(node) != "dict" or st.tensor_keys(node) or st.has_pickle(node):
        return None
    try:
        value = st.rebuild(node, {}, allow_pickle=False)
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError, KeyError):
        return None
    return value if isinstance(value, dict) and all(isinstance(k, str) for k in value) else None


def find_config(config: str | os.PathLike | None, m: mf.Manifest, rank: int, prefixes: list[str]
                ) -> tuple[dict | None, str | None]:
    """(the config to write as ``config.json``, where it came from); checked before any write."""
    if config is not None:
        where = os.fspath(config)
        if os.path.isfile(where):
            try:
                with open(where, encoding="utf-8") as f:
                    value = json.load(f)
            except (OSError, UnicodeDecodeError, ValueError) as e:
                raise ConfigError(f"--config {where}: cannot read it as JSON ({e}); pass the model's config.json") \
                    from e
            if not isinstance(value, dict):
                raise ConfigError(f"--config {where}: a config.json holds a JSON object, this holds a "
                                  f"{type(value).__name__}")
            return value, where
        found = _as_config(_node_at(m, where, rank))
        if found is None:
            raise ConfigError(f"--config {where!r} is neither a file nor a dict of plain values in step {m.step}: "
                              "pass the model's config.json, or the key of its config saved in the state "
                              "(e.g. --config config)")
        return found, f"step value {where!r}"
    for key in ["config", *(p.rstrip("/") + "/config" for p in prefixes if p.strip("/"))]:
        found = _as_config(_node_at(m, key, rank))
        if found is not None:
            return found, f"step value {key!r}"
    return None, None


def warn_without_config(path: str) -> None:
    """After an export that wrote no config.json: say so, unless the directory has one already."""
    if not os.path.isfile(os.path.join(path, "config.json")):
        log.warning("no config.json written to %s: the step holds no 'config' value and no --config was given, so "
                    "from_pretrained(%s) would build a default model; pass --config with the model's config.json "
                    "(or the key of its config in the state)", path, path)
