"""What a snapshot finds in the state besides its bytes: the tensors a save checks for NaN and Inf, the
optimizer settings that are NaN or infinite, and the CUDA tensors an optimizer's pre-step hook guards
(whose copy may overlap compute); and the save's refusal of a state that holds NaN or Inf."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from .. import _ext
from ..errors import NonFiniteStateError
from ..flatten import Flat, key_component
from ..tree import dtype_name
from .cuda_snapshot import handed_over

CHECKABLE = frozenset(_ext.CHECK_KINDS)  # dtypes whose NaN/Inf are checked (IEEE half, bfloat16, single, double)


def finite_checked(flat: Flat, mode: bool | str) -> frozenset[str]:
    """The keys of ``flat``'s tensors a save checks for NaN and Inf: with ``mode=True`` the floating
    tensors that are model parameters or optimizer state (found by storage address among the
    modules' parameters and the optimizers' parameters and state flatten found); with ``"all"``
    every floating tensor (buffers and loose tensors too: masks holding -inf are common there);
    none with ``False``."""
    if mode is False:
        return frozenset()
    floating = [k for k, t in flat.tensors.items() if t.numel() and dtype_name(t.dtype) in CHECKABLE]
    if mode == "all":
        return frozenset(floating)
    ptrs: set[int] = set()
    for v in flat.statefuls.values():  # the modules and optimizers flatten found: no second walk of the state
        if isinstance(v, torch.nn.Module):
            ptrs.update(_local(p).data_ptr() for p in v.parameters())
        elif isinstance(v, torch.optim.Optimizer):
            ptrs.update(_local(p).data_ptr() for g in v.param_groups for p in g["params"])
            # settings held as tensors (a tensor learning rate, for capturable optimizers)
            ptrs.update(_local(t).data_ptr() for g in v.param_groups for k, x in g.items() if k != "params"
                        for t in (x if isinstance(x, (list, tuple)) else [x]) if isinstance(t, torch.Tensor))
            ptrs.update(_local(t).data_ptr() for pst in v.state.values() for t in pst.values()
                        if isinstance(t, torch.Tensor))
    return frozenset(k for k in floating if flat.tensors[k].data_ptr() in ptrs)


# Settings for which no value but a finite one makes sense. Elsewhere an infinite setting is often a
# deliberate "no limit" (a max_grad_norm, Prodigy's growth_rate), so only NaN is refused there.
_FINITE_ONLY = frozenset({"lr", "betas", "eps", "weight_decay", "momentum", "dampening", "alpha", "rho"})


def nonfinite_settings(flat: Flat) -> list[str]:
    """The key paths (``"optim/param_groups/0/lr"``) of the float settings in the optimizers'
    ``param_groups`` that are NaN, or infinite where no infinite value makes sense (learning rate,
    betas, eps, weight decay, momentum, ...), in state order. A NaN learning rate turns every
    parameter into NaN at the next step: a state holding one is as poisoned as a NaN weight, though
    every tensor in it is still finite. The optimizers are those flatten found (``flat.statefuls``)."""
    bad: list[str] = []

    def settings(path: str, x: Any, finite_only: bool) -> None:
        if isinstance(x, float) and (math.isnan(x) or (finite_only and math.isinf(x))):
            bad.append(path)
        elif isinstance(x, (list, tuple)):  # betas, Adafactor's eps pair
            for i, y in enumerate(x):
                settings(f"{path}/{i}", y, finite_only)

    for where, obj in flat.statefuls.items():
        if isinstance(obj, torch.optim.Optimizer):
            for i, group in enumerate(obj.param_groups):
                for name, x in group.items():
                    if name != "params":
                        settings(f"{where}/param_groups/{i}/{key_component(name)}", x, name in _FINITE_ONLY)
    return bad


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's shard on this rank (what is saved), or ``t`` itself."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


_local = local_tensor


def optimizer_guarded(flat: Flat) -> set[int]:
    """Data pointers of the CUDA tensors that an optimizer in the state (``flat.statefuls``), or handed over with
    :func:`ckpt.save.cuda_snapshot.guarding`, updates (its parameters and its state): the optimizer
    pre-step hook protects those, so their snapshot copy may overlap compute."""
    out: set[int] = set()
    for v in [*flat.statefuls.values(), *handed_over()]:  # as flatten found them, and those handed over
        if isinstance(v, torch.optim.Optimizer):
            for group in v.param_groups:
                for p in group["params"]:
                    if p.is_cuda:
                        out.add(_local(p).data_ptr())  # a DTensor's own data_ptr() is 0
            for pst in v.state.values():
                for t in pst.values():
                    if isinstance(t, torch.Tensor) and t.is_cuda:
                        out.add(_local(t).data_ptr())
    return out


def refuse_poison(step: int, rank: int, bad: list[str], committed: Callable[[], list[int]]) -> None:
    """Refuse the save, before anything of it is written, if a checked tensor holds NaN or Inf
    (``committed()`` lists the committed steps, asked only then)."""
    if not bad:
        return
    names = ", ".join(bad[:5]) + (f" and {len(bad) - 5} more" if len(bad) > 5 else "")
    steps = committed()
    resume = (f"the newest committed step ({steps[-1]}) is the last healthy one: resume from it "
              "(load('latest', state))" if steps else
              "there is no committed step yet to resume from: the state went bad before the first save")
    raise NonFiniteStateError(
        f"step {step} was not saved: rank {rank}'s state holds NaN or Inf in {names}. Nothing was committed; "
        f"{resume}, and find what "
        "diverged (learning rate, loss scale, bad data, a faulty GPU). check_finite=False saves such a state anyway.",
        tensors=bad, ranks=[rank])
