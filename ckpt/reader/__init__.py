"""The one reader: a checkpoint looked at from outside a run, ``ckpt.open(url)`` (:class:`Reader`).

``core`` is the :class:`Reader` (steps, manifests, tensors, values, ``load_into``); each command
of the ``ckpt`` CLI is one of its methods, computed in its own module and returned as a typed
result whose ``to_json()`` is the command's ``--json`` document: ``listing`` (``ls``, ``inspect``),
``verify``, ``diff``, ``collect`` (``gc``), ``export``. ``tensors`` is the reader's only way into the
loader. Nothing here imports the writer, the commit protocol or the peers, and listing, inspecting,
verifying and collecting import no torch (``diff``, ``export`` and tensors do, when first used).
"""

from typing import TYPE_CHECKING, Any

from .collect import GcPlan, GcReport, Item
from .core import Reader, Step, open
from .listing import Inspection, Listing, StepInfo
from .values import Pickled
from .verify import Problem, VerifyResult

if TYPE_CHECKING:
    from .diff import Diff, TensorChange
    from .export import ExportResult

_LAZY = {"Diff": "diff", "TensorChange": "diff", "ExportResult": "export"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["Reader", "open", "Step", "Pickled", "Listing", "StepInfo", "Inspection", "VerifyResult", "Problem",
           "Diff", "TensorChange", "GcReport", "GcPlan", "Item", "ExportResult"]
