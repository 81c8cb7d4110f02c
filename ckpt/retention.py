"""Which steps to keep, and deleting the rest without ever breaking a committed step.

Order matters for crash safety: a step's MANIFEST.json goes first (the step stops existing), then
its rank reports, then the chunks that no remaining committed manifest references. A run killed
anywhere in between leaves only unreferenced objects behind; every step still committed is whole.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterable

from . import manifest as mf
from .errors import CheckpointError, CheckpointNotFoundError
from .storage import Storage

log = logging.getLogger("ckpt")

STEP_DIR_RE = re.compile(r"^\d{12}$")


def step_candidates(storage: Storage) -> list[int]:
    """Step numbers that have a directory (committed or not), ascending."""
    return sorted(int(n) for n in storage.list("steps") if STEP_DIR_RE.match(n))


def committed_steps(storage: Storage) -> list[int]:
    """Steps whose MANIFEST.json exists, ascending. (Whether it parses is checked on load.)"""
    return [s for s in step_candidates(storage) if storage.exists(mf.manifest_key(s))]


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


class ManifestCache:
    """Parsed manifests by step, so retention reads each one once per process."""

    def __init__(self, storage: Storage):
        self.storage = storage
        self._by_step: dict[int, mf.Manifest] = {}

    def put(self, m: mf.Manifest) -> None:
        self._by_step[m.step] = m

    def drop(self, step: int) -> None:
        self._by_step.pop(step, None)

    def get(self, step: int) -> mf.Manifest:
        m = self._by_step.get(step)
        if m is None:
            key = mf.manifest_key(step)
            try:
                data = self.storage.read(key)
            except FileNotFoundError:
                raise CheckpointNotFoundError(f"step {step} has no manifest in {self.storage.describe()}") from None
            m = self._by_step[step] = mf.parse(data, name=key)
        return m


def delete_steps(storage: Storage, cache: ManifestCache, victims: list[int], remaining: list[int],
                 delete_many: Callable[[list[str]], None]) -> tuple[int, list[str]]:
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
