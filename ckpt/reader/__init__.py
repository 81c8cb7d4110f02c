"""The one reader: a checkpoint looked at from outside a run, ``ckpt.open(url)`` (:class:`Reader`).

``core`` is the :class:`Reader` (steps, manifests, tensors, values, ``load_into``); each command
of the ``ckpt`` CLI is one of its methods, computed in its own module and returned as a typed
result whose ``to_json()`` is the command's ``--json`` document: ``listing`` (``ls``, ``inspect``),
``verify``, ``diff``, ``collect`` (``gc``), ``export``. ``tensors`` is the reader's only way into the
loader. Nothing here imports the writer, the commit protocol or the peers.
"""

from .collect import GcPlan, GcReport, Item
from .core import Pickled, Reader, Step, open
from .diff import Diff, TensorChange
from .export import ExportResult
from .listing import Inspection, Listing, StepInfo
from .verify import Problem, VerifyResult

__all__ = ["Reader", "open", "Step", "Pickled", "Listing", "StepInfo", "Inspection", "VerifyResult", "Problem",
           "Diff", "TensorChange", "GcReport", "GcPlan", "Item", "ExportResult"]
