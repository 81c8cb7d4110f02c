"""ckpt: asynchronous, sharded, verified checkpoints for PyTorch training.

    import ckpt
    ckptr = ckpt.Checkpointer("runs/exp1", keep_last=3)
    ckptr.load("latest", state)        # in place; None on a new run
    h = ckptr.save(step, state)        # returns after the snapshot; writing goes on behind
    ckptr.close()                      # waits for in-flight saves, raises if one failed

    with ckpt.open("runs/exp1") as ck:  # read from outside a run: steps, tensors, values, verify …
        weights = ck.tensors(keys="model/")
        ck.export("latest", "hf-out", format="hf", keys="model/", strip_prefix=True)  # or "dcp", "x.safetensors"
    ckpt.import_checkpoint("hf-model/", "runs/ft", step=0)  # then ckptr.load(0, {"model": model}, strict=False)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from . import _log  # noqa: F401  (the logger's name filter, before anything logs)
from ._lazy import lazy_names
from ._version import __version__
from .errors import (
    CheckpointError,
    CheckpointNotFoundError,
    ConfigError,
    CorruptCheckpointError,
    DistributedSaveError,
    IncompatibleFormatError,
    ManifestTooLargeError,
    NonFiniteStateError,
    NotACheckpointError,
    NotARootError,
    PartialStateError,
    ReshardError,
    RootInUseError,
    StateMismatchError,
    StepExistsError,
    StorageError,
    UnsupportedValueError,
)

if TYPE_CHECKING:
    from .checkpointer import Checkpointer
    from .flatten import RNGState
    from .handle import SaveHandle, SaveMetrics
    from .importer import import_checkpoint
    from .load import LoadStats
    from .options import Options
    from .reader import Pickled, Reader, open
    from .redundancy_config import Parity, Replicas
    from .save.cuda_snapshot import fence
    from .sharding import LocalShard, LocalShards, PerRank

# Everything is imported when first named: reading (ckpt.open, the ckpt command line) never imports
# the writer, the commit protocol, the peers or their process groups, and `ckpt --help`, `--version`,
# `ls` and `inspect` never import torch (most of a second, several on a busy machine).
_LAZY = {"RNGState": "flatten", "open": "reader", "Reader": "reader", "Pickled": "reader", "LocalShard": "sharding",
         "LocalShards": "sharding", "PerRank": "sharding",
         "Checkpointer": "checkpointer", "SaveHandle": "handle", "SaveMetrics": "handle", "LoadStats": "load",
         "Options": "options", "Parity": "redundancy_config", "Replicas": "redundancy_config",
         "fence": "save.cuda_snapshot", "import_checkpoint": "importer"}

__getattr__ = lazy_names(__name__, _LAZY)

__all__ = [
    "__version__", "Checkpointer", "Options", "SaveHandle", "SaveMetrics", "LoadStats", "RNGState", "LocalShard",
    "LocalShards", "PerRank", "fence", "open", "import_checkpoint", "Reader", "Pickled", "Replicas", "Parity",
    "CheckpointError", "CheckpointNotFoundError", "ConfigError", "CorruptCheckpointError",
    "DistributedSaveError", "IncompatibleFormatError", "ManifestTooLargeError", "NonFiniteStateError",
    "NotACheckpointError",
    "NotARootError", "PartialStateError", "ReshardError", "RootInUseError", "StateMismatchError", "StepExistsError",
    "StorageError", "UnsupportedValueError",
]
