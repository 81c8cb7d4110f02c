"""Retention off the save's critical path: the coordinator's retention runs on a thread of its own
after each commit, and the next save's ``go`` waits at most for one delete request in flight, not
for every deletion of the step before.

Why that is safe: a save may adopt any chunk stored under its hash (:mod:`ckpt.save.adopt`), so deleting a
chunk while a save chooses what to write could break the step it commits; and a save may write a
step number whose old step retention is removing (after a rollback). So retention deletes through a
:class:`DeletionWindow`, in batches (one bulk request each, :meth:`ckpt.storage.Storage.delete_many`):
the coordinator holds the window shut from just before a save's ``go`` to its decision, a batch
waits for it to open, and a batch in flight when a save begins finishes first. Before each batch,
the keys still to delete lose those a step committed meanwhile names (its chunks, its directory),
so nothing a newer step references is deleted. Batches keep the caller's order, and each call's
keys are gone before the next call starts: retention's crash-safe order (manifests, then rank files,
then chunks) holds as before. A save waiting to begin lets one waiting batch go first, so retention
progresses even when saves follow each other without a gap.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence

from ..format import manifest as mf
from ..format import paths

log = logging.getLogger("ckpt")


class DeletionWindow:
    """Keeps deletions and a save's choosing of chunks apart (see the module docstring)."""

    def __init__(self, batch: int = 1000):
        self.batch = batch
        self._cond = threading.Condition()
        self._saving = False
        self._deleting = False
        self._waiting = 0  # batches waiting for the window
        self._batches = 0  # batches run so far
        self._since: list[mf.Manifest] = []  # steps committed while retention was between batches

    def save_begins(self) -> None:
        """Coordinator, before a save's ``go``: waits for the batch in flight (and for one waiting)."""
        with self._cond:
            mark = self._batches
            self._cond.wait_for(lambda: not self._deleting and (not self._waiting or self._batches != mark))
            self._saving = True

    def save_ends(self, committed: mf.Manifest | None) -> None:
        """Coordinator, once the save is decided (``committed``: its manifest, None if it was not)."""
        with self._cond:
            self._saving = False
            if committed is not None:
                self._since.append(committed)
            self._cond.notify_all()

    def begin_pass(self) -> None:
        """Retention starts afresh: what it reads now already counts the steps committed so far."""
        with self._cond:
            self._since.clear()

    def gated(self, delete_many: Callable[[Sequence[str]], object]) -> Callable[[Sequence[str]], None]:
        """``delete_many`` through the window, in batches, keys a step committed since skipped."""
        def run(keys: Sequence[str]) -> None:
            for i in range(0, len(keys), self.batch):
                with self._cond:
                    self._waiting += 1
                    self._cond.wait_for(lambda: not self._saving)
                    self._waiting -= 1
                    self._deleting = True
                    spared = _named_by(self._since)
                try:
                    batch = [k for k in keys[i:i + self.batch] if not spared(k)]
                    if batch:
                        delete_many(batch)
                finally:
                    with self._cond:
                        self._deleting = False
                        self._batches += 1
                        self._cond.notify_all()
        return run


def _named_by(manifests: list[mf.Manifest]) -> Callable[[str], bool]:
    """Whether a key belongs to one of ``manifests``' steps: a chunk it references, or its directory."""
    if not manifests:
        return lambda key: False
    chunks = {paths.chunk_key(h) for m in manifests for h in m.chunks}
    dirs = {paths.step_dir(m.step) for m in manifests}
    return lambda key: key in chunks or key.rsplit("/", 1)[0] in dirs or key in dirs


class RetentionThread:
    """Runs ``apply(step)`` (:meth:`ckpt.save.retention.Retention.apply_after`) on a thread of its own, for
    the newest step committed when it gets to run: commits that land while it works are one pass."""

    def __init__(self, apply: Callable[[int], None], window: DeletionWindow):
        self._apply = apply  # gets the step; asks :meth:`newest` once it has listed the steps
        self._window = window
        self._cond = threading.Condition()
        self._pending: int | None = None
        self._latest = -1  # the newest step requested so far
        self._busy = False
        self._closed = False
        self._thread: threading.Thread | None = None

    def request(self, step: int) -> None:
        """Apply retention now that ``step`` is committed (in the background)."""
        with self._cond:
            if self._closed:
                return
            self._pending = step if self._pending is None else max(self._pending, step)
            self._latest = max(self._latest, step)
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="ckpt-retention", daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def newest(self, step: int) -> int:
        """The newest step committed by now (for a pass that started with ``step``)."""
        with self._cond:
            return max(step, self._latest)

    def _loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._pending is not None or self._closed)
                if self._pending is None:
                    return
                step, self._pending, self._busy = self._pending, None, True
            try:
                self._window.begin_pass()
                self._apply(step)  # logs its own failures
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def drain(self) -> None:
        """Wait until every retention requested so far has run."""
        with self._cond:
            self._cond.wait_for(lambda: self._pending is None and not self._busy)

    def close(self) -> None:
        """Finish what was requested, then stop the thread."""
        self.drain()
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join()
