"""The one exception family of ckpt.

Every error a user can get from ckpt is a :class:`CheckpointError`. Subclasses say what kind of
problem it is, and each message says what was wrong and what to do about it. Where another error
caused ours (an ``OSError`` from the disk, a backend error from fsspec), it is kept as ``__cause__``.
"""

from __future__ import annotations


class CheckpointError(Exception):
    """Base class of every error raised by ckpt."""


class ConfigError(CheckpointError, ValueError):
    """An argument or option is invalid; raised before any I/O happens."""


class UnsupportedValueError(CheckpointError, TypeError):
    """The state holds an object that ckpt cannot store without pickle."""


class CheckpointNotFoundError(CheckpointError, LookupError):
    """The requested step (or any committed step) does not exist."""


class NotACheckpointError(CheckpointError):
    """The path exists but does not hold a ckpt checkpoint."""


class StepExistsError(CheckpointError):
    """A save was asked for a step that is already committed; committed steps are never overwritten."""


class IncompatibleFormatError(CheckpointError):
    """The checkpoint uses a format (or codec) this version of ckpt cannot read."""


class CorruptCheckpointError(CheckpointError):
    """An object of the checkpoint failed its checks (hash, size, header or JSON).

    ``object`` names the storage object; ``chunk`` is the chunk hash when a chunk is at fault.
    """

    def __init__(self, message: str, *, object: str | None = None, chunk: str | None = None):
        super().__init__(message)
        self.object = object
        self.chunk = chunk


class ManifestTooLargeError(CheckpointError):
    """A save was refused because its step's manifest would be larger than a reader accepts
    (``limit`` bytes; it would be ``size``): such a step could be committed but never loaded. Nothing
    was committed; the previous steps are as they were. Save fewer tensors per step (or on fewer
    ranks), or upgrade to a ckpt whose manifest is an index (format v6)."""

    def __init__(self, message: str, *, size: int = 0, limit: int = 0):
        super().__init__(message)
        self.size = size
        self.limit = limit


class StateMismatchError(CheckpointError):
    """The checkpoint does not fit the state it is loaded into (keys, shapes or dtypes)."""


class StorageError(CheckpointError):
    """The storage backend failed; the original error is kept as ``__cause__``."""


class RootInUseError(CheckpointError):
    """Another job holds a live writer lease on the checkpoint root this one was about to save into.
    ``holder`` is that lease (:class:`ckpt.lease.LeaseInfo`: host, pid, since when). Save into another
    root, or pass ``shared_root=True`` to every Checkpointer that writes there on purpose."""

    def __init__(self, message: str, *, holder: object = None):
        super().__init__(message)
        self.holder = holder


class NotARootError(NotACheckpointError):
    """The path is a level of a checkpoint root (its ``steps/``, a step directory, …) or a directory
    holding several roots, not a root. ``roots`` names the root(s) probably meant."""

    def __init__(self, message: str, *, roots: list[str] | None = None):
        super().__init__(message)
        self.roots = list(roots or [])


class DistributedSaveError(CheckpointError):
    """A save failed on one or more ranks; ``ranks`` lists them."""

    def __init__(self, message: str, *, ranks: list[int] | None = None):
        super().__init__(message)
        self.ranks = list(ranks or [])


class ReshardError(CheckpointError):
    """State saved per rank cannot be mapped onto the requested world size."""


class PartialStateError(CheckpointError):
    """A save was refused because a load failed after it had started changing the state: the
    state is a mixture of what it was and the step that failed to load. Load a step (again), or
    call ``Checkpointer.accept_state()`` if the state is what you want to save."""


class NonFiniteStateError(CheckpointError):
    """A save was refused because the state holds NaN or Inf where it must not (model parameters or
    optimizer state by default, and the optimizers' settings such as the learning rate; see the
    ``check_finite`` option). Nothing was committed: ``latest`` is still the last healthy step.
    ``tensors`` names the offending tensors (and settings, by key path) this process knows of,
    ``ranks`` the ranks whose state held them."""

    def __init__(self, message: str, *, tensors: list[str] | None = None, ranks: list[int] | None = None):
        super().__init__(message)
        self.tensors = list(tensors or [])
        self.ranks = list(ranks or [])
