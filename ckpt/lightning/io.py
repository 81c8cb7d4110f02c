"""The :class:`CkptCheckpointIO` plugin: every Lightning checkpoint path becomes a ckpt checkpoint."""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from ..checkpointer import Checkpointer
from ..errors import CheckpointError, ConfigError, UnsupportedValueError
from ..handle import SaveHandle
from ..options import Options
from ..save.cuda_snapshot import guarding, stepping_optimizers, track_stepping_optimizers
from ..save.retention import remove_checkpoint
from ..storage import Storage, open_storage
from ._common import KEY, PICKLE_HINT, CheckpointIOBase, TorchCheckpointIO, load_kwargs, locate, log, read


class CkptCheckpointIO(CheckpointIOBase):
    """A ``CheckpointIO`` that writes every Lightning checkpoint as a ckpt checkpoint, asynchronously.

    Example::

        trainer = Trainer(plugins=[CkptCheckpointIO()],
                          callbacks=[ModelCheckpoint(dirpath="ckpts", monitor="val_loss", save_top_k=3,
                                                     save_last=True)])

    Each path ``ModelCheckpoint`` chooses (``ckpts/epoch=3-step=400.ckpt``) becomes a directory
    holding a ckpt checkpoint. ``save_checkpoint`` returns after the snapshot; the write goes on
    behind. Saving again to the same path (``last.ckpt``) commits a new step there and then drops
    the older one, so the path always holds a whole checkpoint. ``remove_checkpoint`` never
    deletes a checkpoint that is still being written (the deletion waits for the write, off the
    training thread) nor the one this run resumed from. ``fit(ckpt_path=...)`` reads these
    directories, and falls back to ``torch.load`` for ordinary ``.ckpt`` files.

    Args:
        allow_pickle: store (and load) non-plain objects in the checkpoint dict with pickle.
        **checkpointer_options: other :class:`~ckpt.Options` (``codec``, ``chunk_size``, ``busy``,
            ``io_threads``, ``storage_options``, ``timeout`` …), checked here. Not ``keep_last``,
            ``keep_every`` or ``local_dir``: each path keeps its newest step only.
        open_storage: ``open_storage(path)`` returns an opened :class:`~ckpt.storage.base.Storage` for a
            checkpoint path (each path is its own root), used to write it (the ``storage=`` of its
            :class:`~ckpt.Checkpointer`) and to remove it, e.g. a test's faulty disk
            (``lambda p: FaultyStorage(LocalStorage(p))``). Not with ``storage_options``.
    """

    def __init__(self, *, allow_pickle: bool = False, open_storage: Callable[[str], Storage] | None = None,
                 **checkpointer_options: Any):
        fixed = sorted(set(checkpointer_options) & {"keep_last", "keep_every", "local_dir"})
        if fixed:
            raise ConfigError(f"CkptCheckpointIO does not take {fixed}: each checkpoint path keeps its newest step "
                              "only, and ModelCheckpoint decides which paths to keep")
        # every path's Checkpointer keeps one step: saving to a path again replaces what it held
        self.options = Options.build(keep_last=1, allow_pickle=allow_pickle, **checkpointer_options)
        if open_storage is not None and self.options.storage_options is not None:
            raise ConfigError("open_storage opens each path's storage; storage_options would open another: give one "
                              "or the other")
        self._open_storage = open_storage
        self.allow_pickle = self.options.allow_pickle
        self._open: dict[str, tuple[Checkpointer, list[SaveHandle]]] = {}  # path -> its writer and saves
        self._next_step: dict[str, int] = {}
        self._removals: dict[str, Future] = {}
        self._remover: ThreadPoolExecutor | None = None
        self.resumed_from: tuple[str, int] | None = None  # (path, step) loaded by load_checkpoint
        self._last: Checkpointer | None = None  # the last writer: its host buffer is handed to the next
        track_stepping_optimizers()  # the optimizers whose tensors a save may copy behind the fence

    @property
    def pending(self) -> int:
        """Saves and removals not yet waited for (a path's saves count until its writer is closed); 0 after teardown."""
        return sum(len(handles) for _, handles in self._open.values()) + len(self._removals)

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
            storage = self._open_storage(key) if self._open_storage is not None else None
            c = Checkpointer.from_options(key, self.options, storage=storage)
            if self.resumed_from is not None and self.resumed_from[0] == key:
                c.protect(self.resumed_from[1])  # retention keeps the step this run resumed from
            if self._last is not None:
                # Every top-k path is its own root, hence its own Checkpointer: without this, each save
                # would allocate and fault in a fresh host buffer.
                c.adopt_buffer(self._last)
            entry = self._open[key] = (c, [])
        c, handles = entry
        known = self._next_step.get(key)
        if known is None:
            latest = c.latest()
            known = 0 if latest is None else latest + 1
        step = max(int(checkpoint.get("global_step", 0) or 0), known)
        try:
            # A CheckpointIO is never shown the trainer: the optimizers that have been stepping (the
            # trainer's) are handed over instead, so the saved CUDA parameters and optimizer state
            # are copied behind the pre-step fence, overlapping the next forward and backward.
            with guarding(stepping_optimizers()):
                h = c.save(step, {KEY: checkpoint})
        except UnsupportedValueError as e:
            raise UnsupportedValueError(str(e) + PICKLE_HINT.format(who="CkptCheckpointIO")) from e
        self._next_step[key] = step + 1
        handles.append(h)
        self._last = c
        if "://" not in key:
            os.makedirs(key, exist_ok=True)  # the path exists once save returns, as with torch.save

    def load_checkpoint(self, path: Any, map_location: Any = None, weights_only: Any = None) -> dict:
        key = self._key(path)
        entry = self._open.get(key)
        if entry is not None:  # reading what this run is still writing: let it finish
            entry[0].wait()
        where = locate(path)
        if where is None:
            return TorchCheckpointIO().load_checkpoint(path, **load_kwargs(map_location, weights_only))
        checkpoint, step = read(*where, allow_pickle=self.allow_pickle, who="CkptCheckpointIO", restore_rng=True)
        root = self._key(where[0])
        self.resumed_from = (root, step)
        return checkpoint

    def remove_checkpoint(self, path: Any) -> None:
        key = self._key(path)
        if self.resumed_from is not None and self.resumed_from[0] == key:
            log.info("not removing %s: this run resumed from it", path)
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
                log.warning("a save to %s failed before it was removed: %s", key, e)
        storage = (self._open_storage(key) if self._open_storage is not None
                   else open_storage(key, self.options.storage_options))  # the credentials the saves used
        try:
            remove_checkpoint(storage)
        finally:
            storage.close()

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
        for _key, (c, _) in list(self._open.items()):
            try:
                c.close()
            except CheckpointError as e:
                first = first or e
        self._open.clear()
        self._next_step.clear()
        for f in list(self._removals.values()):
            try:
                f.result()
            except Exception as e:
                first = first or e
        self._removals.clear()
        if self._remover is not None:
            self._remover.shutdown(wait=True)
            self._remover = None
        self._last = None
        if first is not None:
            raise first
