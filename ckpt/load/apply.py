"""Putting a loaded step in place, the last step of a load (:func:`ckpt.load.into_state.load_into`):
the verified bytes copied from CPU stand-ins into the state's tensors, then the values applied
(``load_state_dict`` of modules and optimizers, plain values assigned). And the one thing done to
the state before a load is planned: an optimizer over DTensors gets its state created, so the saved
state has sharded tensors to land in.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from .. import _cpus, _ext
from ..flatten import apply
from ..format import manifest as mf
from ..sharding import is_dtensor
from .checks import keep_hyperparameters
from .plan import LoadPlan


def apply_values(state: dict[str, Any], plan: LoadPlan, strict: bool) -> None:
    """Put ``plan``'s values in place in ``state``, once its tensors are filled."""
    restore = keep_hyperparameters(plan.foreign)
    apply(state, plan.values, strict=strict)
    restore()  # AdamW's state into SGD leaves SGD's lr and momentum as they were


def init_optimizers(state: dict[str, Any], m: mf.Manifest) -> bool:
    """An optimizer over DTensor parameters with no state yet gets its state created first, so the
    saved state loads into sharded tensors of the right layout (a step with lr=0 and zero grads).
    Returns whether it changed any optimizer."""
    saved_keys = {t.key for t in m.tensors}
    changed = False
    for top, obj in state.items():
        if not isinstance(obj, torch.optim.Optimizer) or len(obj.state) > 0:
            continue
        params = [p for g in obj.param_groups for p in g["params"]]
        if not any(is_dtensor(p) for p in params):
            continue
        if not any(k.startswith(f"{top}/state/") for k in saved_keys):
            continue
        set_grads, lrs = [], []
        for g in obj.param_groups:
            lrs.append(g["lr"])
            g["lr"] = 0.0 if not isinstance(g["lr"], torch.Tensor) else torch.zeros_like(g["lr"])
            for p in g["params"]:
                if p.requires_grad and p.grad is None:
                    p.grad = torch.zeros_like(p)
                    set_grads.append(p)
        try:
            changed = True
            obj.step()
        finally:
            for g, lr in zip(obj.param_groups, lrs):
                g["lr"] = lr
            for p in set_grads:
                p.grad = None
    return changed



def copy_back(pairs: list[tuple[torch.Tensor, torch.Tensor]], threads: int | None = None) -> None:
    """Copy every verified stand-in into its tensor. CPU tensors that overlap nothing are copied by
    the compiled core, on as many threads as there are cores (at most 8, and at most ``threads``:
    the load's I/O pool), the GIL released; the rest (tensors on a device, strided, or sharing memory
    with another) one by one by torch."""
    core = _ext.cpu()
    plain = [(t, s) for t, s in pairs if t.device.type == "cpu" and t.is_contiguous() and s.is_contiguous()
             and t.dtype == s.dtype and t.nbytes == s.nbytes] if core is not None else []
    spans = sorted((t.data_ptr(), t.data_ptr() + t.nbytes) for t, _ in plain)
    if any(a[1] > b[0] for a, b in zip(spans, spans[1:])):
        plain = []  # tensors sharing memory: copied in order, as torch would
    done = {id(t) for t, _ in plain}
    if plain:
        assert core is not None
        items = np.array([(t.data_ptr(), s.data_ptr(), t.nbytes) for t, s in plain], dtype=_ext.COPY)
        core.copy_many(items, min(8, _cpus.usable(), threads or 8))
    for t, s in pairs:
        if id(t) not in done:
            t.copy_(s)
