"""The :class:`AsyncCheckpoint` callback: saves the full trainer state with ckpt, resumes from it."""

from __future__ import annotations

import os
import threading
import time
from datetime import timedelta
from typing import Any

from .._args import flags
from ..checkpointer import Checkpointer
from ..errors import CheckpointError, ConfigError, StepExistsError, UnsupportedValueError
from ..flatten import RNGState
from ..handle import SaveHandle
from ..options import Options
from ..save.cuda_snapshot import guarding
from ._common import KEY, PICKLE_HINT, CheckpointBase, CheckpointIOBase, load_kwargs, locate, log, pl, read
from .io import CkptCheckpointIO

rank_zero_info = pl.utilities.rank_zero.rank_zero_info  # how Lightning reports its own resume


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


class AsyncCheckpoint(CheckpointBase):
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
        resume: at the start of a fit with no ``ckpt_path`` on a fresh trainer (global step 0), load
            the newest committed step. A ``ckpt_path`` given to ``fit`` wins; it may also name a ckpt
            checkpoint (this url, or ``<url>/steps/<step:012d>``).
        save_rng: also save and restore the Python, NumPy and torch random generators (per rank),
            so a resumed run draws the same random numbers (shuffling, dropout) as an uninterrupted one.
        save_on_train_end: when training ends between two saves, save its last step too, so the
            final weights are never lost (``False``: only the steps the triggers chose).
        preemption: when SIGTERM (Lightning's own handler sees it too) or one of the signals given
            (``[signal.SIGTERM, signal.SIGUSR1]``) reaches any rank, save at the end of the current
            batch on every rank, wait until that step is committed and stop the fit (on by default;
            with several ranks this adds one small all-reduce per batch).
        keep_last, local_dir, allow_pickle, **checkpointer_options: the options of ``Checkpointer``
            (:class:`~ckpt.Options`, documented there once: ``every``, ``codec``, ``chunk_size``, ``busy``,
            ``io_threads``, ``storage_options``, ``timeout``, ``keep_every`` …), checked here.
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
        save_on_train_end: bool = True,
        preemption: bool | list[int] = True,
        allow_pickle: bool = False,
        **checkpointer_options: Any,
    ):
        super().__init__()
        flags(resume=resume, save_rng=save_rng, save_on_train_end=save_on_train_end)
        for name, n in (("every_n_train_steps", every_n_train_steps), ("every_n_epochs", every_n_epochs)):
            if n is not None and (type(n) is not int or n < 1):
                raise ConfigError(f"{name} must be a positive integer or None, got {n!r}")
        if isinstance(train_time_interval, timedelta):
            train_time_interval = train_time_interval.total_seconds()
        if train_time_interval is not None and (not isinstance(train_time_interval, (int, float))
                                                or not train_time_interval > 0):
            raise ConfigError(f"train_time_interval must be a positive timedelta or number of seconds, "
                              f"got {train_time_interval!r}")
        if every_n_train_steps is None and every_n_epochs is None and train_time_interval is None \
                and checkpointer_options.get("every") is None:
            every_n_epochs = 1
        # checked now, so a bad option fails where the callback is made, not when fit starts
        self.options = Options.build(keep_last=keep_last, local_dir=local_dir, allow_pickle=allow_pickle,
                                     preemption=preemption, **checkpointer_options)
        self.url = os.fspath(url)
        self.every_n_train_steps = every_n_train_steps
        self.every_n_epochs = every_n_epochs
        self.train_time_interval = train_time_interval
        self.resume = resume
        self.save_rng = save_rng
        self.save_on_train_end = save_on_train_end
        self.allow_pickle = self.options.allow_pickle
        self.checkpointer: Checkpointer | None = None
        self.resumed_step: int | None = None  # the step the last fit resumed from, if any
        self.handles: list[SaveHandle] = []  # this fit's saves (skipped ones excluded)
        self._last_step: int | None = None
        self._asked_step: int | None = None  # the last step should_save was asked about
        self._last_time = time.monotonic()
        self.preempted = False  # the last fit was stopped by a preemption signal, after saving

    @property
    def state_key(self) -> str:
        return self._generate_state_key(url=self.url)

    # -- lifetime ------------------------------------------------------------------------------------
    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage != "fit":
            return
        if self.checkpointer is None:  # a second fit gets a fresh one: the last teardown closed it
            options = self.options
            if threading.current_thread() is not threading.main_thread():  # no handlers there: Lightning's flag only
                options = options.replace(preemption=False)
            self.checkpointer = Checkpointer.from_options(self.url, options)
        self.handles = []
        self.preempted = False
        self._asked_step = None
        self._last_time = time.monotonic()
        _ResumeShim.install(trainer.strategy, self.allow_pickle)

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        self.resumed_step = None
        if not self.resume or trainer.ckpt_path is not None or trainer.global_step != 0:
            # fit(ckpt_path=...) was restored by Lightning, or this trainer has already trained (a
            # second fit continues from memory, as Lightning does)
            return
        assert self.checkpointer is not None
        state: dict[str, Any] = {KEY: {}}
        if self.save_rng:
            state["rng"] = RNGState()  # restored if the step has it (strict=False: left alone if not)
        try:
            # "latest": every rank agrees on the step (with local commits, the newest one the nodes can give back)
            step = self.checkpointer.load("latest", state, strict=False)
        except UnsupportedValueError as e:
            raise UnsupportedValueError(f"{e} (AsyncCheckpoint(allow_pickle=True) allows it.)") from e
        if step is None:
            return
        _inject(trainer, state[KEY])
        self.resumed_step = self._last_step = step
        rank_zero_info(f"Restored all states from the checkpoint at {self.url} (ckpt step {step})")

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
                log.error("%s", e)

    def wait(self) -> None:
        """Block until every save so far is committed; raise the first failure."""
        if self.checkpointer is not None:
            self.checkpointer.wait()

    # -- triggers ------------------------------------------------------------------------------------
    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.checkpointer is None or self._skip_stage(trainer):
            return
        if self.options.preemption and self._preemption(trainer):
            self._emergency(trainer)
            return
        if self._skip(trainer):
            return
        step = trainer.global_step
        due = self.every_n_train_steps is not None and step > 0 and step % self.every_n_train_steps == 0
        if not due and self.train_time_interval is not None:
            elapsed = time.monotonic() - self._last_time >= self.train_time_interval
            due = bool(trainer.strategy.broadcast(elapsed))  # every rank saves, so every rank must agree
        if self.options.every is not None and step != self._asked_step:  # once per optimizer step
            self._asked_step = step
            due = self.checkpointer.should_save(step) or due
        if due:
            self._save(trainer)

    def _preemption(self, trainer: Any) -> bool:
        """Has a preemption signal reached any rank? (The same answer on every rank.)"""
        assert self.checkpointer is not None
        mine = self.checkpointer.preemption_pending or bool(getattr(trainer, "received_sigterm", False))
        if trainer.world_size > 1:
            return bool(trainer.strategy.reduce_boolean_decision(mine, all=False))
        return mine

    def _emergency(self, trainer: Any) -> None:
        """Save this step (unless a trigger just did), wait until it is committed, stop the fit."""
        assert self.checkpointer is not None
        self.checkpointer._take_preemption()  # acted on here: ckpt must not pass the signal on
        started = time.monotonic()
        if self._last_step != trainer.global_step:
            self._save(trainer, persist=True)  # the node may not come back: upload it (persist_every)
        for h in self.handles:
            h.wait()  # raises if the emergency save failed: the last committed step is still whole
        self.preempted = True
        trainer.should_stop = True
        rank_zero_info(f"ckpt: preempted: step {trainer.global_step} committed to {self.url} in "
                       f"{time.monotonic() - started:.2f}s; stopping the fit")

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        if self.save_on_train_end and not self._skip(trainer) and trainer.global_step > 0:
            self._save(trainer, persist=True)  # the last step, unless a trigger just saved it (_skip says so)

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        if self._skip(trainer) or self.every_n_epochs is None:
            return
        if (trainer.current_epoch + 1) % self.every_n_epochs == 0:
            self._save(trainer)

    def _skip_stage(self, trainer: Any) -> bool:
        return bool(trainer.fast_dev_run or trainer.sanity_checking or trainer.state.fn != "fit")

    def _skip(self, trainer: Any) -> bool:
        return bool(self._skip_stage(trainer) or self.checkpointer is None or self._last_step == trainer.global_step)

    def _save(self, trainer: Any, persist: bool | None = None) -> None:
        assert self.checkpointer is not None
        for h in self.handles:  # surface a failed background save on the training thread
            if h.done() and h.exception() is not None:
                h.wait()
        self.handles = [h for h in self.handles if not h.done()]
        step = trainer.global_step
        state: dict[str, Any] = {KEY: trainer._checkpoint_connector.dump_checkpoint(weights_only=False)}
        if self.save_rng:
            state["rng"] = RNGState()
        try:
            # The dict holds state_dict()s, not the optimizers: hand them over, so the saved CUDA
            # parameters and optimizer state are copied behind the pre-step fence (overlapping the
            # next forward and backward) instead of before the compute stream may go on.
            with guarding(trainer.optimizers):
                h = self.checkpointer.save(step, state, persist=persist)
        except UnsupportedValueError as e:
            raise UnsupportedValueError(str(e) + PICKLE_HINT.format(who="AsyncCheckpoint")) from e
        except StepExistsError:
            log.warning("step %d is already committed in %s; not saving it again", step, self.url)
            self._last_step = step
            return
        self._last_step = step
        self._last_time = time.monotonic()
        if not h.skipped:
            self.handles.append(h)


class _ResumeShim(CheckpointIOBase):
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
        where = locate(path)
        if where is None:
            return self.inner.load_checkpoint(path, **load_kwargs(map_location, weights_only))
        # fit(ckpt_path=<a ckpt step>) is a resume: the random generators continue too
        return read(*where, allow_pickle=self.allow_pickle, who="AsyncCheckpoint", restore_rng=True)[0]

    def remove_checkpoint(self, path: Any) -> None:
        self.inner.remove_checkpoint(path)

    def teardown(self) -> None:
        self.inner.teardown()
