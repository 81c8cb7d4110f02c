"""Which steps to keep, and deleting the rest without ever breaking a committed step.

Order matters for crash safety: the victims' MANIFEST.json files go first (the steps stop existing),
then their rank reports, then the chunks that no remaining committed manifest references, each
group in bulk (:meth:`ckpt.storage.Storage.delete_many`: S3 deletes 1,000 keys a request) and gone
before the next starts. A run killed anywhere in between leaves only unreferenced objects behind;
every step still committed is whole.

Chunks are deleted only by a deleter that holds a deletion lease and sees no other live writer
(:mod:`ckpt.lease`). Otherwise a retired step's chunks are *parked*: listed in
``retired/<step>-<id>.json``, so whoever may delete chunks later (the writer once it is alone,
``ckpt gc`` once no writer is live) deletes those still unreferenced, without listing every chunk.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Callable, Iterable
from typing import Any

from ..errors import CheckpointError
from ..format import manifest as mf
from ..format import paths
from ..format.chunk import is_chunk_hash
from ..format.paths import RETIRED, retired_key
from ..lease import Leases
from ..storage import Storage

log = logging.getLogger("ckpt")

# Deletes every key given, in order, all of them before it returns (Storage.delete_many: bulk requests
# where the backend has them); what it returns is ignored. Each phase of a deletion is one call.
DeleteMany = Callable[[list[str]], Any]


def to_delete(steps: list[int], keep_last: int | None, protected: Iterable[int],
              keep_every: int | None = None, newest: int | None = None) -> list[int]:
    """The committed steps retention removes: all but the newest ``keep_last``, the protected, and
    (with ``keep_every=K``) every step whose number is a multiple of K. Without ``keep_last`` only
    ``keep_every`` decides, and then every step but the newest that is not a multiple is removed.

    ``newest``: the step just committed. Steps above it (abandoned by a rollback, or another
    writer's) are never removed here, and the newest ``keep_last`` are counted back from it, so the
    step just committed is always kept."""
    if newest is not None:
        steps = [s for s in steps if s <= newest]
    if not steps or (keep_last is None and keep_every is None):
        return []
    n = keep_last if keep_last is not None else 1
    if keep_every is None and len(steps) <= n:
        return []
    keep = set(steps[-n:]) | set(protected)
    if newest is not None:
        keep.add(newest)
    if keep_every is not None:
        keep |= {s for s in steps if s % keep_every == 0}
    return [s for s in steps if s not in keep]


def abandoned(steps: list[int], newest: int) -> list[int]:
    """Committed steps above the one just committed: after a rollback, the run's abandoned future."""
    return [s for s in steps if s > newest]


def _references(cache: mf.ManifestCache, steps: Iterable[int]) -> set[str]:
    out: set[str] = set()
    for s in steps:
        out |= cache.chunk_keys(s)
    return out


def delete_steps(storage: Storage, cache: mf.ManifestCache, victims: list[int], remaining: list[int],
                 delete_many: DeleteMany, *, keep: Iterable[str] = (), park: bool = False) -> tuple[int, list[str]]:
    """Delete ``victims`` and the chunks only they reference (never those in ``keep``); with
    ``park``, list those chunks under ``retired/`` instead of deleting them. Returns (steps
    deleted, chunk hashes deleted or parked)."""
    if not victims:
        return 0, []
    garbage: set[str] = set()
    for s in victims:
        try:
            garbage |= cache.chunk_keys(s)
        except CheckpointError as e:  # unreadable manifest: drop the step, leave its chunks to `ckpt gc`
            log.warning("retention: step %d has an unreadable manifest (%s); its chunks are left for gc", s, e)
    doomed = sorted(garbage - _references(cache, remaining) - set(keep))
    delete_many([paths.manifest_key(s) for s in victims])  # the steps stop existing here
    for s in victims:
        cache.drop(s)
    storage.flush()
    # then their rank files (and what else the directories hold), the directories after them
    files = [f"{paths.step_dir(s)}/{name}" for s in victims for name in storage.list(paths.step_dir(s))]
    delete_many(files + [paths.step_dir(s) for s in victims])
    storage.flush()
    if park:
        if doomed:
            doc = {"steps": victims, "chunks": doomed}
            storage.write(retired_key(f"{victims[0]:012d}-{uuid.uuid4().hex[:12]}.json"), [json.dumps(doc).encode()])
    else:
        delete_many([paths.chunk_key(h) for h in doomed])
    storage.flush()
    return len(victims), doomed


def parked(storage: Storage) -> dict[str, list[str]]:
    """The retired-chunk lists waiting for a deleter: marker key -> chunk hashes (bad markers: [])."""
    out: dict[str, list[str]] = {}
    for name in storage.list(RETIRED):
        if not name.endswith(".json"):  # e.g. another deleter's marker still being written (``*.tmp-*``)
            continue
        key = retired_key(name)
        try:
            doc = json.loads(storage.read(key))
            chunks = [h for h in doc["chunks"] if isinstance(h, str) and is_chunk_hash(h)]
        except (FileNotFoundError, ValueError, KeyError, TypeError):
            chunks = []
        out[key] = chunks
    return out


def collect_parked(storage: Storage, cache: mf.ManifestCache, committed: list[int], delete_many: DeleteMany,
                   *, keep: Iterable[str] = ()) -> list[str]:
    """Delete the parked chunks that no committed step references (and not in ``keep``), then the
    lists. Returns the chunk hashes deleted. Only for a deleter that is alone (see the module docstring)."""
    lists = parked(storage)
    if not lists:
        return []
    candidates = set().union(*lists.values()) - _references(cache, committed) - set(keep)
    doomed = sorted(candidates)
    delete_many([paths.chunk_key(h) for h in doomed])
    storage.flush()
    for key in lists:
        storage.delete(key)
    return doomed


def remove_checkpoint(storage: Storage) -> None:
    """Delete a whole checkpoint: every step's manifest first (so a removal cut short leaves no step
    that looks committed but lacks its chunks), then everything else, root included."""
    for s in mf.committed_steps(storage):
        storage.delete(paths.manifest_key(s))
    storage.flush()
    storage.remove_root()


class Retention:
    """What follows each commit on the coordinator: ``keep_last`` / ``keep_every``, and deleting
    chunks that other processes retired while this writer held its lease.

    Never deleted: the step just committed; steps above it (after a rollback, the abandoned ones:
    kept, and named in a warning, until ``ckpt gc`` or the user removes them); steps passed to
    :meth:`protect` (the step a run resumed from), and those other open runs resumed from (their
    writer leases say: :meth:`ckpt.lease.Leases.protected_steps`); chunks ``in_use()`` returns
    (what the writer may reuse without asking storage). ``shared``: the root is shared on purpose,
    so newer steps are another job's, not abandoned (no warning)."""

    def __init__(self, storage: Storage, manifests: mf.ManifestCache, keep_last: int | None,
                 keep_every: int | None, delete_many: DeleteMany, leases: Leases,
                 in_use: Callable[[], Iterable[str]] = frozenset, shared: bool = False,
                 newest: Callable[[int], int] | None = None):
        self.storage = storage
        # the newest step this writer committed, at least the given one (retention running behind
        # the saves, on a thread of its own, may find newer steps of this writer: not abandoned ones)
        self._newest = newest or (lambda step: step)
        self.manifests = manifests
        self.keep_last = keep_last
        self.keep_every = keep_every
        self._asked: set[int] = set()  # protect()'s
        self._resumed: int | None = None  # the step last loaded
        self.leases = leases
        self._delete_many = delete_many
        self._in_use = in_use
        self.shared = shared
        self._warned: set[int] = set()  # abandoned steps already named in a warning

    @property
    def protected(self) -> set[int]:
        """Never deleted: what protect() asked for, and the step last loaded."""
        return self._asked | ({self._resumed} if self._resumed is not None else set())

    def protect(self, step: int) -> None:
        """Keep ``step`` for good (``Checkpointer.protect``)."""
        self._asked.add(step)
        self.leases.protect(step)  # other processes' retention, and this process's other writers, keep it too

    def resumed(self, step: int) -> None:
        """A load of ``step``: kept while it is the step this run last loaded. The step an earlier load
        protected is let go (unless :meth:`protect` was asked for it): an evaluator loading each new step
        would otherwise keep every one it ever loaded from this process's retention."""
        before, self._resumed = self._resumed, step
        if before is not None and before != step and before not in self._asked:
            self.leases.unprotect(before)
        self.leases.protect(step)

    def after_commit(self, committed: mf.Manifest) -> None:
        """Apply retention now that ``committed`` is; a failure is logged, never raised (the save
        itself succeeded, and retention tries again after the next one)."""
        self.manifests.put(committed)
        self.apply_after(committed.step)

    def apply_after(self, step: int) -> None:
        """Apply retention now that ``step`` is committed (logged, never raised)."""
        try:
            self._apply(step)
        except Exception as e:
            log.warning("retention in %s after step %d failed (nothing committed was lost): %s",
                        self.storage.describe(), step, e)

    def _apply(self, step: int) -> None:
        retains = self.keep_last is not None or self.keep_every is not None
        steps = mf.committed_steps(self.storage) if retains else []
        step = self._newest(step)
        self._warn_abandoned(abandoned(steps, step), step)
        victims = to_delete(steps, self.keep_last, self.protected, self.keep_every, newest=step)
        if not victims and not self.storage.list(RETIRED):
            return
        with self.leases.deleting() as writers:
            steps = mf.committed_steps(self.storage)
            spared = self.leases.protected_steps() if victims else set()  # steps open runs resumed from
            victims = [s for s in victims if s in steps and s not in spared]
            remaining = [s for s in steps if s not in victims]
            keep = set(self._in_use())
            _, chunks = delete_steps(self.storage, self.manifests, victims, remaining, self._delete_many,
                                     keep=keep, park=bool(writers))
            if writers:
                if victims:
                    log.info("retention removed step(s) %s; their %d chunk(s) are left to delete until %s "
                             "stops writing here", victims, len(chunks), writers[0].describe())
                return
            collected = collect_parked(self.storage, self.manifests, remaining, self._delete_many, keep=keep)
            if victims or collected:
                log.info("retention removed step(s) %s and %d unreferenced chunk(s)", victims,
                         len(chunks) + len(collected))

    def _warn_abandoned(self, newer: list[int], step: int) -> None:
        fresh = [s for s in newer if s not in self._warned]
        if not fresh or self.shared:
            return
        self._warned.update(fresh)
        log.warning("%s holds step(s) %s, newer than step %d just committed (abandoned by a rollback?): retention "
                    "counts keep_last back from the step just committed and leaves these alone, but "
                    "load('latest') would pick them; remove them with `ckpt gc --drop-after %d` when sure",
                    self.storage.describe(), fresh, step, step)
