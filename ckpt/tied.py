"""Tied weights, and a module's keys that a step lacks, on load.

A model whose output layer shares its input embedding (GPT-2, Llama-3.2, Qwen: ``lm_head.weight``
is ``embed_tokens.weight``) lists the shared tensor twice in ``state_dict()``, and Hugging Face
files hold it once (``save_pretrained`` leaves the tied name out). Such a key is *tied*, not
missing, when the module shows it: the two names are the same tensor in memory (same storage,
offset, shape and strides), or the module (or one of its submodules) declares it in
``_tied_weights_keys`` (a list of names, or a dict ``{tied name: source name}``, relative to the
module declaring it). A tied key the step lacks resolves to its partner's saved tensor when the
step has one, else it is left as it is (what ``tie_weights()`` would make of it).

:func:`fit_module_state` completes a saved state_dict before ``load_state_dict``: tied keys from
their partners, and with ``strict=False`` every other key the step lacks from the module itself,
so that ``load_state_dict`` leaves those as they are instead of refusing.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class Ties:
    """A module's tied keys: ``partners[k]`` the names ``k`` may take its value from (same tensor, or
    the declared source); ``declared`` the keys ``_tied_weights_keys`` names."""

    partners: dict[str, list[str]] = field(default_factory=dict)
    declared: set[str] = field(default_factory=set)

    def resolved(self, key: str, saved: set[str] | dict[str, Any]) -> bool:
        """Is ``key``, which the step lacks, tied to something it holds (or declared tied)?"""
        return key in self.declared or any(p in saved for p in self.partners.get(key, ()))


def _identity(t: Any) -> tuple | None:
    """What makes two state_dict tensors one tensor in memory; None where that cannot be told."""
    if type(t) is not torch.Tensor or t.device.type == "meta" or t.numel() == 0:
        return None  # a DTensor or other subclass, or no memory: not compared by address
    try:
        ptr = t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return None
    return ptr, t.storage_offset(), tuple(t.shape), t.stride(), t.dtype, t.device


def _name(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def ties(module: torch.nn.Module, own: dict[str, Any] | None = None) -> Ties:
    """The tied keys of ``module`` (``own``: its ``state_dict()``, if already at hand)."""
    own = module.state_dict() if own is None else own
    out = Ties()
    same: dict[tuple, list[str]] = defaultdict(list)
    for k, t in own.items():
        ident = _identity(t)
        if ident is not None:
            same[ident].append(k)
    for keys in same.values():
        for k in keys if len(keys) > 1 else ():
            out.partners[k] = [o for o in keys if o != k]
    for prefix, sub in module.named_modules():
        declared = getattr(sub, "_tied_weights_keys", None)
        if isinstance(declared, dict):
            items = list(declared.items())
        elif isinstance(declared, (list, tuple, set, frozenset)):
            items = [(n, None) for n in declared]
        else:
            continue
        for name, source in items:
            if not isinstance(name, str) or _name(prefix, name) not in own:
                continue  # patterns and names this module does not have are not guessed at
            key = _name(prefix, name)
            out.declared.add(key)
            if isinstance(source, str) and _name(prefix, source) in own:
                out.partners.setdefault(key, [])
                if _name(prefix, source) not in out.partners[key]:
                    out.partners[key].insert(0, _name(prefix, source))
    return out


def unresolved(module: torch.nn.Module, saved: set[str], missing: set[str] | list[str]) -> list[str]:
    """The keys of ``missing`` (the module's keys the step lacks) that are not tied to one it holds."""
    if not missing:
        return []
    t = ties(module)
    return [k for k in missing if not t.resolved(k, saved)]


def fit_module_state(module: torch.nn.Module, sd: dict[str, Any], strict: bool) -> dict[str, Any]:
    """``sd`` (a saved state_dict) completed for ``module.load_state_dict``: each tied key the step
    lacks takes its partner's saved tensor (or the module's own, where the step has no partner);
    with ``strict=False`` every other key it lacks is the module's own, so it stays as it is."""
    own = module.state_dict()
    if all(k in sd for k in own):
        return sd
    t = ties(module, own)
    out = dict(sd)
    for k in own:
        if k in out:
            continue
        partner = next((p for p in t.partners.get(k, ()) if p in sd), None)
        if partner is not None:
            out[k] = sd[partner]
        elif t.resolved(k, sd) or not strict:
            out[k] = own[k]
    return out
