"""ckpt: asynchronous, sharded, verified checkpoints for PyTorch training.

    import ckpt
    ckptr = ckpt.Checkpointer("runs/exp1", keep_last=3)
    ckptr.load("latest", state)        # in place; None on a new run
    h = ckptr.save(step, state)        # returns after the snapshot; writing goes on behind
    ckptr.close()                      # waits for in-flight saves, raises if one failed

    with ckpt.open("runs/exp1") as ck:  # read from outside a run: steps, tensors, values, verify …
        weights = ck.tensors(keys="model/")
"""

from ._version import __version__
from .checkpointer import Checkpointer
from .errors import (
    CheckpointError,
    CheckpointNotFoundError,
    ConfigError,
    CorruptCheckpointError,
    DistributedSaveError,
    IncompatibleFormatError,
    NonFiniteStateError,
    NotACheckpointError,
    PartialStateError,
    ReshardError,
    StateMismatchError,
    StepExistsError,
    StorageError,
    UnsupportedValueError,
)
from .flatten import RNGState
from .handle import SaveHandle, SaveMetrics
from .loader import LoadStats
from .options import Options
from .reader import Pickled, Reader, open
from .redundancy_config import Parity, Replicas
from .sharding import LocalShard, PerRank
from .snapshot import fence

__all__ = [
    "__version__", "Checkpointer", "Options", "SaveHandle", "SaveMetrics", "LoadStats", "RNGState", "LocalShard",
    "PerRank", "fence", "open", "Reader", "Pickled", "Replicas", "Parity",
    "CheckpointError", "CheckpointNotFoundError", "ConfigError", "CorruptCheckpointError",
    "DistributedSaveError", "IncompatibleFormatError", "NonFiniteStateError", "NotACheckpointError",
    "PartialStateError", "ReshardError", "StateMismatchError", "StepExistsError", "StorageError",
    "UnsupportedValueError",
]
