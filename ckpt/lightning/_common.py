"""What the callback and the IO plugin share: importing Lightning, and reading its checkpoint dict
back from a ckpt checkpoint."""

from __future__ import annotations

import logging
import os
from typing import Any

from .._args import flag
from ..errors import CheckpointError, UnsupportedValueError
from ..flatten import RNGState
from ..format import manifest as mf
from ..format import paths
from ..reader import open as open_reader
from ..storage import open_storage


def _import_lightning() -> tuple[Any, str]:
    errors = []
    for name in ("lightning.pytorch", "pytorch_lightning"):
        try:
            return __import__(name, fromlist=["callbacks", "plugins"]), name
        except ImportError as e:
            errors.append(f"{name}: {e}")
    raise ImportError("ckpt.lightning needs PyTorch Lightning, and neither `lightning` nor `pytorch_lightning` "
                      "could be imported (" + "; ".join(errors) + "). Install it with "
                      "`pip install 'ckpt[lightning]'` (or `pip install lightning`).")


pl, LIGHTNING_PACKAGE = _import_lightning()
CheckpointBase = pl.callbacks.Checkpoint
CheckpointIOBase = pl.plugins.CheckpointIO
TorchCheckpointIO = pl.plugins.TorchCheckpointIO

log = logging.getLogger("ckpt")

KEY = "lightning"  # the top-level key of a ckpt state that holds Lightning's checkpoint dict
PICKLE_HINT = (" Lightning's checkpoint dict (often `hyper_parameters`, or something a hook added in "
                "on_save_checkpoint) holds it. Make it a plain value, or pass allow_pickle=True to {who} "
                "(loading will then unpickle: only for checkpoints you trust).")


# -- locating and reading checkpoints ---------------------------------------------------------------
def locate(path: Any) -> tuple[str, int | None] | None:
    """``(root, step)`` if ``path`` names a ckpt checkpoint: a root (step None: the newest committed)
    or one of its step directories (``<root>/steps/000000000120``). None for anything else."""
    path = os.fspath(path).rstrip("/")
    head, name = os.path.split(path)
    parent, steps = os.path.split(head)
    try:
        if steps == "steps" and name.isdigit() and open_storage(parent).exists(paths.manifest_key(int(name))):
            return parent, int(name)
        storage = open_storage(path)
        if storage.root_state() == "file":
            return None
        if mf.committed_steps(storage):
            return path, None
    except (CheckpointError, OSError, ValueError):
        return None
    return None


def read(root: str, step: int | None, *, allow_pickle: bool, who: str, restore_rng: bool = False) -> tuple[dict, int]:
    """Load Lightning's checkpoint dict saved at ``step`` (None: the newest) of ``root``. The random
    generators saved with it (``AsyncCheckpoint(save_rng=True)``) are restored only if asked."""
    with open_reader(root) as r:
        step = r.latest() if step is None else step
        if step is None:
            raise CheckpointError(f"{root} holds no committed step")
        state: dict[str, Any] = {KEY: {}}
        if "rng" in r.manifest(step).top_keys:
            state["rng"] = RNGState() if restore_rng else _Discard()
        try:
            r.load_into(state, step, allow_pickle=allow_pickle)
        except UnsupportedValueError as e:
            raise UnsupportedValueError(f"{e} ({who}(allow_pickle=True) allows it.)") from e
    return state[KEY], step


class _Discard:
    """Takes a saved state_dict and drops it (the RNG state, when only reading a checkpoint)."""

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, sd: dict) -> None:
        pass


def load_checkpoint(path: str | os.PathLike, *, allow_pickle: bool = False) -> dict:
    """Lightning's checkpoint dict from a ckpt checkpoint (a root: its newest step; or a step
    directory), with CPU tensors: what ``torch.load`` gives for a ``.ckpt`` file. Example::

        sd = ckpt.lightning.load_checkpoint("runs/exp1")["state_dict"]
        model.load_state_dict(sd)

    Args:
        path: a ckpt root (its newest step is read) or one of its ``steps/<step>`` directories.
        allow_pickle: unpickle values stored with pickle (only for checkpoints you trust).

    Returns:
        dict: Lightning's checkpoint dict, tensors on the CPU.

    Raises:
        CheckpointError: ``path`` is not a ckpt checkpoint, or reading it failed (a subclass says how).
    """
    flag("allow_pickle", allow_pickle)
    where = locate(path)
    if where is None:
        raise CheckpointError(f"{os.fspath(path)} is not a ckpt checkpoint (a directory with committed steps, "
                              "or one of its steps/<step> directories)")
    return read(*where, allow_pickle=allow_pickle, who="load_checkpoint")[0]



def load_kwargs(map_location: Any, weights_only: Any) -> dict:
    """The keyword arguments of ``CheckpointIO.load_checkpoint`` that were given."""
    kw: dict[str, Any] = {}
    if map_location is not None:
        kw["map_location"] = map_location
    if weights_only is not None:
        kw["weights_only"] = weights_only
    return kw
