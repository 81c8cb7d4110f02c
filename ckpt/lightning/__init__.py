"""ckpt for PyTorch Lightning: an asynchronous checkpoint callback and a ``CheckpointIO`` plugin.

The two-line change::

    from ckpt.lightning import AsyncCheckpoint
    trainer = Trainer(callbacks=[AsyncCheckpoint("runs/exp1", every_n_train_steps=100, keep_last=3)])

``trainer.fit(model)`` then resumes from the newest committed step of ``runs/exp1`` (if any), saves
the full trainer state every 100 steps without waiting for the disk, and waits for the last saves
when fit ends. Or keep ``ModelCheckpoint`` (top-k, ``save_last``) and let ckpt write its files::

    trainer = Trainer(plugins=[CkptCheckpointIO()], callbacks=[ModelCheckpoint(monitor="val_loss", save_top_k=3)])

Works with ``lightning`` (``lightning.pytorch``) or, if that is not installed, ``pytorch_lightning``.

What is stored: Lightning's own checkpoint dict (model weights, optimizers, LR schedulers, loops,
callbacks' state, precision plugin state, epoch and global step, hyperparameters) through ckpt's
structure: tensors become verified chunks, plain values JSON. Nothing is pickled unless you pass
``allow_pickle=True`` (needed only if the dict holds objects that are not plain values, e.g.
hyperparameters holding a custom class).

The callback lives in ``callback.py``, the plugin in ``io.py``; both write with the public
:class:`~ckpt.Checkpointer` API and read with ``ckpt.open`` (no writer to read one step).
"""

from ._common import LIGHTNING_PACKAGE, load_checkpoint
from .callback import AsyncCheckpoint
from .io import CkptCheckpointIO

__all__ = ["AsyncCheckpoint", "CkptCheckpointIO", "load_checkpoint", "LIGHTNING_PACKAGE"]
