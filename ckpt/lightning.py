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
"""

from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta
from typing import Any

from . import manifest as mf
from .checkpointer import Checkpointer, SaveHandle
from .errors import CheckpointError, ConfigError, StepExistsError, UnsupportedValueError
from .retention import committed_steps
from .state import RNGState
from .storage import open_storage


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
_Checkpoint = pl.callbacks.Checkpoint
_CheckpointIO = pl.plugins.CheckpointIO
_TorchCheckpointIO = pl.plugins.TorchCheckpointIO

log = logging.getLogger("ckpt")

__all__ = ["AsyncCheckpoint", "CkptCheckpointIO", "load_checkpoint", "LIGHTNING_PACKAGE"]

_KEY = "lightning"  # the top-level key of a ckpt state that holds Lightning's checkpoint dict
_PICKLE_HINT = (" Lightning's checkpoint dict (often `hyper_parameters`, or something a hook added in "
                "on_save_checkpoint) holds it. Make it a plain value, or pass allow_pickle=True to {who} "
                "(loading will then unpickle: only for checkpoints you trust).")


# -- locating and reading checkpoints ---------------------------------------------------------------
def _locate(path: Any) -> tuple[str, int | None] | None:
    """``(root, step)`` if ``path`` names a ckpt checkpoint: a root (step None: the newest committed)
    or one of its step directories (``<root>/steps/000000000120``). None for anything else."""
    path = os.fspath(path).rstrip("/")
    head, name = os.path.split(path)
    parent, steps = os.path.split(head)
    try:
        if steps == "steps" and name.isdigit() and open_storage(parent).exists(mf.manifest_key(int(name))):
            return parent, int(name)
        storage = open_storage(path)
        if getattr(storage, "root_state", lambda: "nonempty")() == "file":
            return None
        if committed_steps(storage):
            return path, None
    except (CheckpointError, OSError, ValueError):
        return None
    return None


def _read(root: str, step: int | None, *, allow_pickle: bool, who: str, restore_rng: bool = False) -> tuple[dict, int]:
    """Load Lightning's checkpoint dict saved at ``step`` (None: the newest) of ``root``. The random
    generators saved with it (``AsyncCheckpoint(save_rng=True)``) are restored only if asked."""
    with Checkpointer(root, allow_pickle=allow_pickle) as c:
        step = c.latest() if step is None else step
        if step is None:
            raise CheckpointError(f"{root} holds no committed step")
        state: dict[str, Any] = {_KEY: {}}
        if "rng" in c.manifest(step).structure["k"]:
            state["rng"] = RNGState() if restore_rng else _Discard()
        try:
            c.load(step, state)
        except UnsupportedValueError as e:
            raise UnsupportedValueError(f"{e} ({who}(allow_pickle=True) allows it.)") from e
    return state[_KEY], step


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
    """
    where = _locate(path)
    if where is None:
        raise CheckpointError(f"{os.fspath(path)} is not a ckpt checkpoint (a directory with committed steps, "
                              "or one of its steps/<step> directories)")
    return _read(*where, allow_pickle=allow_pickle, who="load_checkpoint")[0]


def _inject(trainer: Any, checkpoint: dict) -> None:
    """Make Lightning restore ``checkpoint`` as if ``fit(ckpt_path=...)`` had loaded it.

    Lightning (2.x) restores in two phases from ``_checkpoint_connector._loaded_checkpoint``: modules
    and callbacks, then (after the strategy set up the optimizers) precision, loops, optimizers and
    schedulers. This runs the first phase here and leaves the dict for the second."""
    conn = trainer._checkpoint_connector
    conn._loaded_checkpoint = checkpoint
    conn.restore_model()
    conn.restore_datamodule()
    conn.restore_callbacks()


# -- the callback -----------------------------------------------------------------------------------
class AsyncCheckpoint(_Checkpoint):
    """Saves the full trainer state asynchronously with ckpt, and resumes from it.

    Example::

        trainer = Trainer(callbacks=[AsyncCheckpoint("runs/exp1", every_n_train_steps=100, keep_last=3)])
        trainer.fit(model)      # resumes from the newest committed step of runs/exp1, if there is one

    Each save is step ``trainer.global_step`` of the ckpt checkpoint at ``url``: the training loop
    waits only for the snapshot (one copy of the state into ckpt's host buffer); hashing and
    writing go on behind it. A failed save is raised at the next save or when fit ends.

    Args:
        url: a directory or fsspec URL (``file://``, ``memory://``).
        every_n_train_steps: save after every N optimizer steps.
        every_n_epochs: save at the end of every N-th training epoch (the default, with N=1, when
            no trigger is given).
        train_time_interval: save when this much time (``timedelta`` or seconds) has passed since
            the last save, checked after each training batch.
        keep_last: keep only the newest N committed steps (the step a run resumed from is kept too).
        local_dir: a fast local directory staged in front of ``url`` (e.g. NVMe in front of
            ``s3://``): chunks are written there first, uploaded behind, and read from there on
            resume when their hash matches.
        resume: at the start of a fit with no ``ckpt_path`` on a fresh trainer (global step 0), load
            the newest committed step. A ``ckpt_path`` given to ``fit`` wins; it may also name a ckpt
            checkpoint (this url, or ``<url>/steps/<step:012d>``).
        save_rng: also save and restore the Python, NumPy and torch random generators (per rank),
            so a resumed run draws the same random numbers (shuffling, dropout) as an uninterrupted one.
        allow_pickle: store non-plain objects in the checkpoint dict with pickle (off: refused).
        **checkpointer_options: passed to :class:`~ckpt.Checkpointer` (``codec``, ``chunk_size``,
            ``busy``, ``io_threads``, ``storage_options``, ``timeout``).
    """

    best_model_path = ""  # read by Trainer.validate/test(ckpt_path="best") on the first Checkpoint callback

    def __init__(
        self,
        url: str | os.PathLike,
        *,
        every_n_train_steps: int | None = None,
        every_n_epochs: int | None = None,
        train_time_interval: timedelta | float | None = None,
        keep_last: int | None = None,
        local_dir: str | os.PathLike | None = None,
        resume: bool = True,
        save_rng: bool = True,
        allow_pickle: bool = False,
        **checkpointer_options: Any,
    ):
        super().__init__()
        if local_dir is not None and not isinstance(local_dir, (str, os.PathLike)):
            raise ConfigError(f"local_dir must be a local directory path, got {local_dir!r}")
        for name, n in (("every_n_train_steps", every_n_train_steps), ("every_n_epochs", every_n_epochs)):
            if n is not None and (type(n) is not int or n < 1):
                raise ConfigError(f"{name} must be a positive integer or None, got {n!r}")
        if isinstance(train_time_interval, timedelta):
            train_time_interval = train_time_interval.total_seconds()
        if train_time_interval is not None and (not isinstance(train_time_interval, (int, float))
                                                or not train_time_interval > 0):
            raise ConfigError(f"train_time_interval must be a positive timedelta or number of seconds, "
                              f"got {train_time_interval!r}")
        if every_n_train_steps is None and every_n_epochs is None and train_time_interval is None:
            every_n_epochs = 1
        if keep_last is not None and (type(keep_last) is not int or keep_last < 1):
            raise ConfigError(f"keep_last must be a positive integer or None, got {keep_last!r}")
        unknown = set(checkpointer_options) - {"codec", "chunk_size", "busy", "io_threads", "storage_options", "timeout"}
        if unknown:
            raise ConfigError(f"unknown AsyncCheckpoint option(s) {sorted(unknown)}")
        self.url = os.fspath(url)
        self.local_dir = None if local_dir is None else os.fspath(local_dir)
        self.every_n_train_steps = every_n_train_steps
        self.every_n_epochs = every_n_epochs
        self.train_time_interval = train_time_interval
        self.keep_last = keep_last
        self.resume = resume
        self.save_rng = save_rng
        self.allow_pickle = allow_pickle
        self._options = checkpointer_options
        self.checkpointer: Checkpointer | None = None
        self.resumed_step: int | None = None  # the step the last fit resumed from, if any
        self.handles: list[SaveHandle] = []  # this fit's saves (skipped ones excluded)
        self._last_step: int | None = None
        self._last_time = time.monotonic()

    @property
    def state_key(self) -> str:
        return self._generate_state_key(url=self.url)

    # -- lifetime ------------------------------------------------------------------------------------
    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage != "fit":
            return
        if self.checkpointer is None:  # a second fit gets a fresh one: the last teardown closed it
            self.checkpointer = Checkpointer(self.url, keep_last=self.keep_last, allow_pickle=self.allow_pickle,
                                             local_dir=self.local_dir, **self._options)
        self.handles = []
        self._last_time = time.monotonic()
        _ResumeShim.install(trainer.strategy, self.allow_pickle)

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        self.resumed_step = None
        if not self.resume or trainer.ckpt_path is not None or trainer.global_step != 0:
            # fit(ckpt_path=...) was restored by Lightning, or this trainer has already trained (a
            # second fit continues from memory, as Lightning does)
            return
        assert self.checkpointer is not None
        step = self.checkpointer.latest()
        if step is None:
            return
        saved = self.checkpointer.manifest(step).structure["k"]
        state: dict[str, Any] = {_KEY: {}}
        if self.save_rng and "rng" in saved:
            state["rng"] = RNGState()
        try:
            self.checkpointer.load(step, state, strict=False)
        except UnsupportedValueError as e:
            raise UnsupportedValueError(f"{e} (AsyncCheckpoint(allow_pickle=True) allows it.)") from e
        _inject(trainer, state[_KEY])
        self.resumed_step = self._last_step = step
        log.info("ckpt: resumed from step %d of %s", step, self.url)

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage != "fit":
            return
        _ResumeShim.uninstall(trainer.strategy)
        c, self.checkpointer = self.checkpointer, None
        if c is not None:
            c.close()  # waits for in-flight saves; raises one that failed

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        # Whatever was snapshotted becomes durable; a save failure must not hide the training error.
        _ResumeShim.uninstall(trainer.strategy)
        c, self.checkpointer = self.checkpointer, None
        if c is not None:
            try:
                c.close()
            except CheckpointError as e:
                log.error("ckpt: %s", e)

    def wait(self) -> None:
        """Block until every save so far is committed; raise the first failure."""
        if self.checkpointer is not None:
            self.checkpointer.wait()

    # -- triggers ------------------------------------------------------------------------------------
    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self._skip(trainer):
            return
        step = trainer.global_step
        due = self.every_n_train_steps is not None and step > 0 and step % self.every_n_train_steps == 0
        if not due and self.train_time_interval is not None:
            elapsed = time.monotonic() - self._last_time >= self.train_time_interval
            due = bool(trainer.strategy.broadcast(elapsed))  # every rank saves, so every rank must agree
        if due:
            self._save(trainer)

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        if self._skip(trainer) or self.every_n_epochs is None:
            return
        if (trainer.current_epoch + 1) % self.every_n_epochs == 0:
            self._save(trainer)

    def _skip(self, trainer: Any) -> bool:
        return bool(trainer.fast_dev_run or trainer.sanity_checking or trainer.state.fn != "fit"
                    or self.checkpointer is None or self._last_step == trainer.global_step)

    def _save(self, trainer: Any) -> None:
        assert self.checkpointer is not None
        for h in self.handles:  # surface a failed background save on the training thread
            if h.done() and h.exception() is not None:
                h.wait()
        self.handles = [h for h in self.handles if not h.done()]
        step = trainer.global_step
        state: dict[str, Any] = {_KEY: trainer._checkpoint_connector.dump_checkpoint(weights_only=False)}
        if self.save_rng:
            state["rng"] = RNGState()
        try:
            h = self.checkpointer.save(step, state)
        except UnsupportedValueError as e:
            raise UnsupportedValueError(str(e) + _PICKLE_HINT.format(who="AsyncCheckpoint")) from e
        except StepExistsError:
            log.warning("ckpt: step %d is already committed in %s; not saving it again", step, self.url)
            self._last_step = step
            return
        self._last_step = step
        self._last_time = time.monotonic()
        if not h.skipped:
            self.handles.append(h)


class _ResumeShim(_CheckpointIO):
    """Wraps the strategy's CheckpointIO during fit so ``fit(ckpt_path=...)`` may name a ckpt
    checkpoint; every other path, and all saving, goes to the wrapped plugin unchanged."""

    def __init__(self, inner: Any, allow_pickle: bool):
        self.inner = inner
        self.allow_pickle = allow_pickle

    @classmethod
    def install(cls, strategy: Any, allow_pickle: bool) -> None:
        io = strategy.checkpoint_io
        if not isinstance(io, (cls, CkptCheckpointIO)):
            strategy.checkpoint_io = cls(io, allow_pickle)

    @staticmethod
    def uninstall(strategy: Any) -> None:
        io = strategy.checkpoint_io
        if isinstance(io, _ResumeShim):
            strategy.checkpoint_io = io.inner

    def save_checkpoint(self, checkpoint: dict, path: Any, storage_options: Any = None) -> None:
        self.inner.save_checkpoint(checkpoint, path, storage_options=storage_options)

    def load_checkpoint(self, path: Any, map_location: Any = None, weights_only: Any = None) -> dict:
        where = _locate(path)
        if where is None:
            return self.inner.load_checkpoint(path, **_load_kwargs(map_location, weights_only))
        # fit(ckpt_path=<a ckpt step>) is a resume: the random generators continue too
        return _read(*where, allow_pickle=self.allow_pickle, who="AsyncCheckpoint", restore_rng=True)[0]

    def remove_checkpoint(self, path: Any) -> None:
        self.inner.remove_checkpoint(path)

    def teardown(self) -> None:
        self.inner.teardown()


def _load_kwargs(map_location: Any, weights_only: Any) -> dict:
    kw: dict[str, Any] = {}
    if map_location is not None:
        kw["map_location"] = map_location
    if weights_only is not None:
        kw["weights_only"] = weights_only
    return kw


# -- the CheckpointIO plugin ------------------------------------------------------------------------
class CkptCheckpointIO(_CheckpointIO):
    """A ``CheckpointIO`` that writes every Lightning checkpoint as a ckpt checkpoint, asynchronously.

    Example::

        trainer = Trainer(plugins=[CkptCheckpointIO()],
                          callbacks=[ModelCheckpoint(dirpath="ckpts", monitor="val_loss", save_top_k=3, save_last=True)])

    Each path ``ModelCheckpoint`` chooses (``ckpts/epoch=3-step=400.ckpt``) becomes a directory
    holding a ckpt checkpoint. ``save_checkpoint`` returns after the snapshot; the write goes on
    behind. Saving again to the same path (``last.ckpt``) commits a new step there and then drops
    the older one, so the path always holds a whole checkpoint. ``remove_checkpoint`` never
    deletes a checkpoint that is still being written (the deletion waits for the write, off the
    training thread) nor the one this run resumed from. ``fit(ckpt_path=...)`` reads these
    directories, and falls back to ``torch.load`` for ordinary ``.ckpt`` files.

    Args:
        allow_pickle: store (and load) non-plain objects in the checkpoint dict with pickle.
        **checkpointer_options: passed to :class:`~ckpt.Checkpointer` (``codec``, ``chunk_size``,
            ``busy``, ``io_threads``, ``storage_options``, ``timeout``).
    """

    def __init__(self, *, allow_pickle: bool = False, **checkpointer_options: Any):
        unknown = set(checkpointer_options) - {"codec", "chunk_size", "busy", "io_threads", "storage_options", "timeout"}
        if unknown:
            raise ConfigError(f"unknown CkptCheckpointIO option(s) {sorted(unknown)}")
        self.allow_pickle = allow_pickle
        self._options = checkpointer_options
        self._lock = threading.Lock()
        self._open: dict[str, tuple[Checkpointer, list[SaveHandle]]] = {}  # path -> its writer and saves
        self._next_step: dict[str, int] = {}
        self._removals: dict[str, Future] = {}
        self._remover: ThreadPoolExecutor | None = None
        self.resumed_from: tuple[str, int] | None = None  # (path, step) loaded by load_checkpoint
        self._buffer: tuple | None = None  # the last writer's host buffer and plan, passed on to the next

    @staticmethod
    def _key(path: Any) -> str:
        p = os.fspath(path)
        return os.path.abspath(p) if "://" not in p else p.rstrip("/")

    def save_checkpoint(self, checkpoint: dict, path: Any, storage_options: Any = None) -> None:
        if storage_options is not None:
            raise TypeError("CkptCheckpointIO.save_checkpoint takes no storage_options; pass Checkpointer options "
                            "to CkptCheckpointIO(...) instead")
        key = self._key(path)
        self._reap(raise_failures=True)
        pending = self._removals.pop(key, None)
        if pending is not None:  # this name is being deleted: let that finish before reusing it
            pending.result()
        entry = self._open.get(key)
        if entry is None:
            c = Checkpointer(key, keep_last=1, allow_pickle=self.allow_pickle, **self._options)
            if self.resumed_from is not None and self.resumed_from[0] == key:
                c._protected.add(self.resumed_from[1])  # retention keeps the step this run resumed from
            _adopt_buffer(c, self._buffer)
            entry = self._open[key] = (c, [])
        c, handles = entry
        known = self._next_step.get(key)
        if known is None:
            latest = c.latest()
            known = 0 if latest is None else latest + 1
        step = max(int(checkpoint.get("global_step", 0) or 0), known)
        try:
            h = c.save(step, {_KEY: checkpoint})
        except UnsupportedValueError as e:
            raise UnsupportedValueError(str(e) + _PICKLE_HINT.format(who="CkptCheckpointIO")) from e
        self._next_step[key] = step + 1
        handles.append(h)
        if not c._comm.distributed:
            self._buffer = (c._pool, c._sig, c._layout)
        if "://" not in key:
            os.makedirs(key, exist_ok=True)  # the path exists once save returns, as with torch.save

    def load_checkpoint(self, path: Any, map_location: Any = None, weights_only: Any = None) -> dict:
        key = self._key(path)
        entry = self._open.get(key)
        if entry is not None:  # reading what this run is still writing: let it finish
            entry[0].wait()
        where = _locate(path)
        if where is None:
            return _TorchCheckpointIO().load_checkpoint(path, **_load_kwargs(map_location, weights_only))
        checkpoint, step = _read(*where, allow_pickle=self.allow_pickle, who="CkptCheckpointIO", restore_rng=True)
        root = self._key(where[0])
        self.resumed_from = (root, step)
        return checkpoint

    def remove_checkpoint(self, path: Any) -> None:
        key = self._key(path)
        if self.resumed_from is not None and self.resumed_from[0] == key:
            log.info("ckpt: not removing %s: this run resumed from it", path)
            return
        entry = self._open.pop(key, None)
        self._next_step.pop(key, None)
        if self._remover is None:
            self._remover = ThreadPoolExecutor(1, thread_name_prefix="ckpt-lightning-remove")
        prior = self._removals.get(key)
        self._removals[key] = self._remover.submit(self._remove, key, entry, prior)

    def _remove(self, key: str, entry: tuple[Checkpointer, list[SaveHandle]] | None, prior: Future | None) -> None:
        """Off the training thread: wait for the path's saves, then delete it, manifests first (a
        deletion cut short leaves no step that looks committed but lacks its chunks)."""
        if prior is not None:
            prior.result()
        if entry is not None:
            try:
                entry[0].close()
            except CheckpointError as e:
                log.warning("ckpt: a save to %s failed before it was removed: %s", key, e)
        storage = open_storage(key)
        for s in committed_steps(storage):
            storage.delete(mf.manifest_key(s))
        if "://" in key:
            import fsspec
            fs, p = fsspec.core.url_to_fs(key)
            if fs.exists(p):
                fs.rm(p, recursive=True)
        else:
            import shutil
            shutil.rmtree(key, ignore_errors=True)
            if os.path.lexists(key):
                os.remove(key)  # a symlink (save_last="link") or a file

    def _reap(self, raise_failures: bool) -> None:
        """Close the writers whose saves are all done (releasing their threads; the newest keeps its
        host buffer for the next save); raise the first failed save."""
        first: BaseException | None = None
        for key, (c, handles) in list(self._open.items()):
            if all(h.done() for h in handles):
                del self._open[key]
                try:
                    c.close()
                except CheckpointError as e:
                    first = first or e
        if first is not None and raise_failures:
            raise first

    def teardown(self) -> None:
        """Wait for every save and removal (Lightning calls this when fit ends); raise a failure."""
        first: BaseException | None = None
        for key, (c, _) in list(self._open.items()):
            try:
                c.close()
            except CheckpointError as e:
                first = first or e
        self._open.clear()
        self._next_step.clear()
        for f in list(self._removals.values()):
            try:
                f.result()
            except Exception as e:  # noqa: BLE001
                first = first or e
        self._removals.clear()
        if self._remover is not None:
            self._remover.shutdown(wait=True)
            self._remover = None
        self._buffer = None
        if first is not None:
            raise first


def _adopt_buffer(new: Checkpointer, buffer: tuple | None) -> None:
    """Let a new writer start with the previous writer's host buffer and plan.

    Every top-k path is its own ckpt root, hence its own Checkpointer; without this each save would
    allocate and fault in a fresh buffer. The buffer's own lock orders the two writers: the new
    save waits until the old one has finished reading it. If the state's structure changed, the new
    save makes a plan of its own as usual."""
    if buffer is None or buffer[0] is None or new._comm.distributed:
        return
    new._pool, new._sig, new._layout = buffer
