"""Which steps to keep, and deleting the rest without ever breaking a committed step.

Order matters for crash safety: a step's MANIFEST.json goes first (the step stops existing), then
its rank reports, then the chunks that no remaining committed manifest references. A run killed
anywhere in between leaves only unreferenced objects behind; every step still committed is whole.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

from . import manifest as mf
from .errors import CheckpointError
from .storage import Storage

log = logging.getLogger("ckpt")

DeleteMany = Callable[[list[str]], object]  # deletes the keys; what it returns is ignored


def to_delete(steps: list[int], keep_last: int | None, protected: Iterable[int],
              keep_every: int | None = None) -> list[int]:
    """The committed steps retention removes: all but the newest ``keep_last``, the protected, and
    (with ``keep_every=K``) every step whose number is a multiple of K. Without ``keep_last`` only
    ``keep_every`` decides, and then every step but the newest that is not a multiple is removed."""
    if not steps or (keep_last is None and keep_every is None):
        return []
    n = keep_last if keep_last is not None else 1
    if keep_every is None and len(steps) <= n:
        return []
    keep = set(steps[-n:]) | set(protected)
    if keep_every is not None:
        keep |= {s for s in steps if s % keep_every == 0}
    return [s for s in steps if s not in keep]


def delete_steps(storage: Storage, cache: mf.ManifestCache, victims: list[int], remaining: list[int],
                 delete_many: DeleteMany) -> tuple[int, list[str]]:
    """Delete ``victims`` and the chunks only they reference. Returns (steps deleted, chunk hashes deleted)."""
    if not victims:
        return 0, []
    garbage: set[str] = set()
    for s in victims:
        try:
            garbage |= cache.get(s).chunks.keys()
        except CheckpointError as e:  # unreadable manifest: drop the step, leave its chunks to `ckpt gc`
            log.warning("ckpt: retention: step %d has an unreadable manifest (%s); its chunks are left for gc", s, e)
    for s in victims:
        storage.delete(mf.manifest_key(s))  # the step stops existing here
        cache.drop(s)
        for name in storage.list(mf.step_dir(s)):
            storage.delete(f"{mf.step_dir(s)}/{name}")
        storage.delete(mf.step_dir(s))
    storage.flush()
    for s in remaining:
        garbage -= cache.get(s).chunks.keys()
    doomed = sorted(garbage)
    delete_many([mf.chunk_key(h) for h in doomed])
    storage.flush()
    return len(victims), doomed


def remove_checkpoint(storage: Storage) -> None:
    """Delete a whole checkpoint: every step's manifest first (so a removal cut short leaves no step
    that looks committed but lacks its chunks), then everything else, root included."""
    for s in mf.committed_steps(storage):
        storage.delete(mf.manifest_key(s))
    storage.flush()
    storage.remove_root()


class Retention:
    """``keep_last`` / ``keep_every`` for one Checkpointer, applied by the coordinator after each commit.

    Steps passed to :meth:`protect` (the step a run resumed from) are never deleted."""

    def __init__(self, storage: Storage, manifests: mf.ManifestCache, keep_last: int | None,
                 keep_every: int | None, delete_many: DeleteMany):
        self.storage = storage
        self.manifests = manifests
        self.keep_last = keep_last
        self.keep_every = keep_every
        self.protected: set[int] = set()
        self._delete_many = delete_many

    def protect(self, step: int) -> None:
        self.protected.add(step)

    def after_commit(self, committed: mf.Manifest) -> None:
        """Apply retention now that ``committed`` is; a failure is logged, never raised (the save
        itself succeeded, and retention tries again after the next one)."""
        self.manifests.put(committed)
        if self.keep_last is None and self.keep_every is None:
            return
        try:
            steps = mf.committed_steps(self.storage)
            victims = to_delete(steps, self.keep_last, self.protected, self.keep_every)
            if not victims:
                return
            remaining = [s for s in steps if s not in victims]
            _, chunks = delete_steps(self.storage, self.manifests, victims, remaining, self._delete_many)
            log.info("ckpt: retention removed step(s) %s and %d unreferenced chunk(s)", victims, len(chunks))
        except Exception as e:
            log.warning("ckpt: retention after step %d failed (nothing committed was lost): %s", committed.step, e)
