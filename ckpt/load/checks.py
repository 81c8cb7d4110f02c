"""What a load refuses before it changes anything (:func:`ckpt.load.into_state.load_into`'s check step): keys
missing on either side (``strict``), what a module's or optimizer's ``load_state_dict`` would refuse
or silently get wrong (parameter groups, another kind of optimizer), and destination tensors that
cannot take bytes (expanded, negated or conjugated views). Each names what to do.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from .. import tree as st
from ..errors import StateMismatchError
from ..format import manifest as mf
from ..tied import unresolved

if TYPE_CHECKING:
    from .match import Match

log = logging.getLogger("ckpt")


def check_fit(m: mf.Manifest, match: Match, state: dict[str, Any], target: Any,
              strict: bool) -> list[torch.optim.Optimizer]:
    """The keys (``strict``) and what modules' and optimizers' ``load_state_dict`` would refuse.
    Returns the optimizers that take another kind's state (``strict=False``): they keep their own
    hyperparameters (:func:`keep_hyperparameters`)."""
    unexpected, miss = match.unexpected, match.missing
    if strict and (unexpected or miss):
        parts = []
        if miss:
            parts.append(f"missing from the checkpoint: {miss[:8]}{' …' if len(miss) > 8 else ''}")
        if unexpected:
            parts.append(f"in the checkpoint but not in the state: {unexpected[:8]}"
                         f"{' …' if len(unexpected) > 8 else ''}")
        raise StateMismatchError(
            f"step {m.step} does not match the state: " + "; ".join(parts) +
            ". Pass strict=False to load what matches and leave the rest as it is.")
    misfits: list[str] = []
    foreign: list[torch.optim.Optimizer] = []
    mine = dict(st.top_items(target.structure))  # once: a lookup per key keeps many top-level keys linear
    for top in match.tops:
        _misfits(match.nodes[top], mine[top], state[top], top, strict, misfits, foreign)
    if misfits:
        raise StateMismatchError(
            f"step {m.step} does not fit the state: " + "; ".join(misfits[:6]) + (" …" if len(misfits) > 6 else "") +
            ". Build the state as the run that saved it did (or load with strict=False where only nested keys "
            "differ); nothing was changed.")
    if unexpected or miss:
        log.warning("loading step %d non-strictly: %d key(s) not in the state, %d missing from the checkpoint",
                    m.step, len(unexpected), len(miss))
    return foreign


def keep_hyperparameters(optimizers: list[torch.optim.Optimizer]) -> Callable[[], None]:
    """Before a load: what puts back each optimizer's own hyperparameters (every ``param_groups``
    entry but its parameters) once ``load_state_dict`` has replaced them with another kind's."""
    kept = [(o, [{k: v for k, v in g.items() if k not in ("params", "param_names")} for g in o.param_groups])
            for o in optimizers]

    def restore() -> None:
        for o, groups in kept:
            for g, mine in zip(o.param_groups, groups):
                for k in [k for k in g if k not in ("params", "param_names")]:
                    del g[k]
                g.update(mine)
    return restore


def _unwritable(t: torch.Tensor) -> str | None:
    """Why a load cannot write into target tensor ``t`` (a view that reads other memory, or reads it
    transformed), or None."""
    leave = "or leave it out of the state passed to load (strict=False)"
    if any(st == 0 and n > 1 for st, n in zip(t.stride(), t.shape)):
        return ("the target is an expanded view (stride 0): load into a real tensor, e.g. assign .clone() "
                f"(for a module buffer: model.x = model.x.clone()), {leave}")
    if t.is_neg():
        return ("the target is a negative view (torch._neg_view): load into a real tensor, e.g. assign "
                f".resolve_neg(), {leave}")
    if t.is_conj():
        return ("the target is a conjugate view (.conj() of a complex tensor): load into a real tensor, e.g. "
                f"assign .resolve_conj(), {leave}")
    return None


def check_writable(m: mf.Manifest, match: Match, target: Any) -> None:
    """Every state tensor the load writes into can take the bytes (checked before any tensor is written)."""
    bad = [(pk, why) for _, _, tkey in match.wanted if tkey is not None for pk in target.piece_keys(tkey)
           for why in [_unwritable(target.tensors[pk])] if why is not None]
    if bad:
        raise StateMismatchError(
            f"step {m.step} cannot be loaded into {len(bad)} tensor(s) of the state: " +
            "; ".join(f"{k!r}: {why}" for k, why in bad[:4]) + (" …" if len(bad) > 4 else "") +
            "; nothing was changed.")


def _misfits(saved: Any, target: Any, live: Any, where: str, strict: bool, out: list[str],
             foreign: list[torch.optim.Optimizer]) -> None:
    """What would make ``load_state_dict`` fail, or (``strict``) leave nested keys unloaded, found
    by comparing the saved structure with the state's own, before anything is changed."""
    if isinstance(live, torch.nn.Module):
        if st.kind(saved) != "stateful" or st.kind(saved["v"]) != "dict":
            out.append(f"{where}: the checkpoint holds no module state there")
            return
        have, want = set(saved["v"]["k"]), set(target["v"]["k"])
        if have != want:
            # tied weights (lm_head.weight as embed_tokens.weight) are not missing; with strict=False
            # nothing missing is refused (load_state_dict then keeps those as they are)
            miss = sorted(unresolved(live, have, want - have), key=str) if strict else []
            extra = sorted(have - want, key=str)
            if miss or extra:
                more = (" …" if len(miss) > 4 else "", " …" if len(extra) > 4 else "")
                out.append(f"{where} ({type(live).__name__}): missing from the checkpoint {miss[:4]}{more[0]}, "
                           f"not in the module {extra[:4]}{more[1]}")
        return
    if isinstance(live, torch.optim.Optimizer):
        groups = _param_groups(saved)
        if groups is None:
            out.append(f"{where}: the checkpoint holds no optimizer state there")
            return
        sizes = [len(g["params"]) for g in live.param_groups]
        if groups != sizes:
            out.append(f"{where} ({type(live).__name__}): the checkpoint has {len(groups)} parameter group(s) of "
                       f"{groups} parameters, the optimizer {len(sizes)} of {sizes}")
        elif (other := _other_kind(saved, live)) is not None:
            if strict:
                out.append(f"{where}: {other}; load it into the optimizer that saved it, or pass strict=False to "
                           "load it anyway")
            else:
                log.warning("%s: %s; loading its per-parameter state anyway (strict=False), and keeping this "
                            "optimizer's own hyperparameters (param_groups: lr, ...)", where, other)
                foreign.append(live)
        return
    if strict and isinstance(live, dict) and live and st.kind(saved) == "dict" and st.kind(target) == "dict":
        saved_keys = {st.path_component(k): (k, v) for k, v in zip(saved["k"], saved["v"])}
        mine = {st.path_component(k): v for k, v in zip(target["k"], target["v"])}
        missing = [k for k in mine if k not in saved_keys]
        extra = [saved_keys[k][0] for k in saved_keys if k not in mine]
        if missing or extra:
            out.append(f"{where}: keys missing from the checkpoint {[json.loads(k) for k in missing][:4]}, "
                       f"keys not in the state {extra[:4]}")
        for (c, tv), lv in zip(mine.items(), live.values()):
            if c in saved_keys:
                _misfits(saved_keys[c][1], tv, lv, f"{where}/{st.preview(json.loads(c), 40)}", strict, out, foreign)


def _other_kind(saved: Any, live: torch.optim.Optimizer) -> str | None:
    """How a saved optimizer state differs in kind from ``live`` (its class, and the param_groups
    keys one has and the other lacks), or None when the same kind saved it."""
    mine = f"{type(live).__module__}.{type(live).__qualname__}"
    kind = str(saved.get("type"))
    if kind == _IMPORTED or any(_names_class(kind, c) for c in type(live).__mro__):  # its class, or a base
        return None  # (an imported torch.save file names no kind: it is not refused for that)
    sd = dict(zip(saved["v"]["k"], saved["v"]["v"]))
    have = {k for g in sd["param_groups"] for k in g["k"] if isinstance(k, str)} - {"params", "param_names"}
    want = {k for g in live.param_groups for k in g} - {"params", "param_names"}
    keys = []
    if want - have:
        keys.append(f"its param_groups lack {sorted(want - have)[:6]}")
    if have - want:
        keys.append(f"have {sorted(have - want)[:6]} the optimizer does not use")
    return (f"the checkpoint holds the state of a {kind} optimizer, this is a {mine}" +
            (f" ({', '.join(keys)})" if keys else ""))


_IMPORTED = "ckpt.importer.ImportedState"  # what ckpt.import_checkpoint saves a state_dict as


def _names_class(kind: str, c: type) -> bool:
    """Does a saved ``module.qualname`` name class ``c``? Also across ``__main__``: a class saved
    from a script run as ``python train.py`` is ``train.X`` when the next run imports it."""
    if kind == f"{c.__module__}.{c.__qualname__}":
        return True
    return kind.endswith(f".{c.__qualname__}") and "__main__" in (kind[: -len(c.__qualname__) - 1], c.__module__)


def _param_groups(saved: Any) -> list[int] | None:
    """Parameters per group of a saved optimizer state_dict node, or None if it is not one."""
    if st.kind(saved) != "stateful" or st.kind(saved["v"]) != "dict":
        return None
    sd = dict(zip(saved["v"]["k"], saved["v"]["v"]))
    groups = sd.get("param_groups")
    if not isinstance(groups, list):
        return None
    out = []
    for g in groups:
        if st.kind(g) != "dict":
            return None
        params = dict(zip(g["k"], g["v"])).get("params")
        if not isinstance(params, list):
            return None
        out.append(len(params))
    return out
