"""Garbage collection from outside a run (``Reader.gc``, ``ckpt gc``): what crashes and failed saves leave behind.

Three kinds of garbage, each removed only once it is older than a grace period, because a save
running right now (in another process) may be about to commit it:

* **orphan chunks**: chunk objects no committed manifest references (written by a save that
  never committed). A save that reuses an existing chunk checks that it still exists just before
  committing, and a chunk it is writing is referenced by nothing yet; so only age tells a dead
  save's chunk from a live one's.
* **temp files** (``*.tmp-*``): left by a writer killed between write and rename.
* **incomplete steps**: step directories with rank files but no ``MANIFEST.json``; age is that of
  the youngest file in the directory.

Optionally, retention (``keep_last``) deletes committed steps too, in the crash-safe order of
:func:`ckpt.save.retention.delete_steps`. Nothing referenced by a committed manifest is ever deleted
(except by that retention, manifest first), so a gc killed at any point leaves every committed
step loadable. Chunks that retention elsewhere *parked* (``retired/``) are deleted too, and the run
journal (``journal/``) is pruned past its bound (:func:`ckpt.journal.prune`): the starts before the
newest 200, and past the newest 1,000 save records those of steps no longer committed.

While a writer holds a live lease on the root (:mod:`ckpt.lease`), gc deletes no chunk, temp file
or unfinished step: they may be that writer's, and a chunk it is about to reuse must not go. It
still applies retention, parking the chunks of the steps it removes for the writer (or a later gc).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .. import journal
from ..format import manifest as mf
from ..format import paths
from ..format.chunk import is_chunk_hash
from ..lease import LeaseInfo, Leases, list_leases
from ..save.retention import DeleteMany, delete_steps, parked, to_delete
from ..storage import Storage

if TYPE_CHECKING:
    from .core import Reader

TMP_MARK = ".tmp-"


@dataclass
class Item:
    """One object (or incomplete step directory) gc removes or keeps."""

    kind: str  # "step" (retention), "chunk" (of a retained-away step, or parked), "orphan", "temp", "incomplete",
    # "journal" (a run journal record past its bound)
    key: str
    bytes: int
    age_s: float | None  # None: the backend does not report modification times
    step: int | None = None

    def to_json(self) -> dict:
        return {"kind": self.kind, "object": self.key, "bytes": self.bytes,
                "age_s": None if self.age_s is None else round(self.age_s, 1), "step": self.step}


@dataclass
class GcPlan:
    grace_s: float
    remove: list[Item] = field(default_factory=list)
    young: list[Item] = field(default_factory=list)  # garbage younger than the grace period: kept
    retention: list[int] = field(default_factory=list)  # committed steps keep_last removes
    unreadable: dict[int, str] = field(default_factory=dict)  # committed steps whose manifest is damaged
    writers: list[LeaseInfo] = field(default_factory=list)  # live writers: no chunk is deleted, chunks are parked

    @property
    def bytes(self) -> int:
        return sum(i.bytes for i in self.remove)

    def classify(self, item: Item) -> None:
        """Garbage: removed if older than the grace period, else kept."""
        (self.remove if _old(item.age_s, self.grace_s) else self.young).append(item)


def _age(storage: Storage, key: str, now: float) -> float | None:
    try:
        t = storage.mtime(key)
    except FileNotFoundError:
        return None
    return None if t is None else max(0.0, now - t)


def _size(storage: Storage, key: str) -> int:
    try:
        return storage.size(key)
    except FileNotFoundError:
        return 0


def _old(age: float | None, grace_s: float) -> bool:
    # An unknown age is old only when the caller said there is no grace period.
    return grace_s <= 0 or (age is not None and age >= grace_s)


def plan(reader: Reader, *, grace_s: float, keep_last: int | None = None, now: float | None = None,
         drop_after: int | None = None) -> GcPlan:
    """What :func:`run` would remove (nothing is deleted here). ``drop_after``: also every committed
    step above it (abandoned by a rollback); ``keep_last`` then counts back from it. Steps a live
    writer resumed from (its lease says) are kept."""
    storage = reader.storage
    now = time.time() if now is None else now
    p = GcPlan(grace_s=grace_s, writers=[x for x in list_leases(storage) if x.kind == "writer" and x.live(now)])
    referenced = _retention(reader, p, keep_last, now, drop_after)
    if not p.unreadable:  # journal records past the bound: a live writer's newest start is never among them
        kept = set(reader.committed) - set(p.retention)
        p.remove += [Item("journal", k, _size(storage, k), _age(storage, k, now)) for k in journal.prune(storage, kept)]
    if p.writers:  # a live writer: its chunks and unfinished work are not ours to judge
        return p
    _unfinished(reader, p, now)
    _chunks(storage, p, referenced, now)
    return p


def _retention(reader: Reader, p: GcPlan, keep_last: int | None, now: float, drop_after: int | None) -> set[str]:
    """Plan retention (decided by the committed steps alone) and the chunks it frees, with those of
    lists parked by retention elsewhere; returns every chunk that is not an orphan."""
    storage = reader.storage
    steps = reader.committed
    for s in steps:
        if reader.find(s) is None:
            p.unreadable[s] = reader.errors[s]
    # A damaged manifest hides which chunks its step needs: then neither retention nor orphan removal
    # can tell what is safe, and both are skipped (the report names the step).
    protected = {s for x in p.writers for s in x.protect}  # steps live runs resumed from
    if p.unreadable:
        p.retention = []
    elif drop_after is None:
        p.retention = to_delete(steps, keep_last, protected)
    else:
        older = [s for s in steps if s <= drop_after]
        p.retention = (to_delete(older, keep_last, protected)
                       + [s for s in steps if s > drop_after and s not in protected])
    referenced: set[str] = set()
    for s in steps:
        m = reader.find(s) if s not in p.retention else None
        if m is not None:
            referenced |= m.chunks.keys()
    retired: dict[str, int] = {}
    for s in p.retention:
        m = reader.find(s)
        age = None if m is None else max(0.0, now - m.created)  # its manifest says when it was committed
        p.remove.append(Item("step", paths.step_dir(s), sum(_size(storage, f"{paths.step_dir(s)}/{n}")
                                                       for n in storage.list(paths.step_dir(s))), age, s))
        for h, info in (m.chunks.items() if m is not None else ()):
            if h not in referenced:
                retired[h] = info.stored
    if p.writers:
        return referenced
    if not p.unreadable:
        for chunks in parked(storage).values():
            for h in chunks:
                if h not in referenced and h not in retired:
                    retired[h] = _size(storage, paths.chunk_key(h))
    for h, nbytes in sorted(retired.items()):
        p.remove.append(Item("chunk", paths.chunk_key(h), nbytes, None))
    return referenced | retired.keys()  # removed by retention, not as orphans


def _unfinished(reader: Reader, p: GcPlan, now: float) -> None:
    """Incomplete steps, and temp files in committed step directories."""
    storage = reader.storage
    for s in reader.incomplete:
        d = paths.step_dir(s)
        names = storage.list(d)
        ages = [_age(storage, f"{d}/{n}", now) for n in names] or [_age(storage, d, now)]
        known = [a for a in ages if a is not None]
        youngest = min(known) if len(known) == len(ages) else None  # an unknown age is never old
        p.classify(Item("incomplete", d, sum(_size(storage, f"{d}/{n}") for n in names), youngest, s))
    for s in reader.committed:
        if s in p.retention:
            continue
        d = paths.step_dir(s)
        for n in storage.list(d):
            if TMP_MARK in n:
                key = f"{d}/{n}"
                p.classify(Item("temp", key, _size(storage, key), _age(storage, key, now), s))


def _chunks(storage: Storage, p: GcPlan, referenced: set[str], now: float) -> None:
    """Orphan chunks (no committed manifest names them) and temp files beside them. With a damaged
    committed manifest the references are unknown, so no chunk is an orphan."""
    for prefix in storage.list(paths.CHUNKS):
        if TMP_MARK in prefix:  # not written by ckpt there, but a temp file all the same
            key = f"{paths.CHUNKS}/{prefix}"
            p.classify(Item("temp", key, _size(storage, key), _age(storage, key, now)))
            continue
        for n in storage.list(f"{paths.CHUNKS}/{prefix}"):
            key = f"{paths.CHUNKS}/{prefix}/{n}"
            if TMP_MARK in n:
                p.classify(Item("temp", key, _size(storage, key), _age(storage, key, now)))
            elif is_chunk_hash(n) and n[:2] == prefix and n not in referenced and not p.unreadable:
                p.classify(Item("orphan", key, _size(storage, key), _age(storage, key, now)))


def run(reader: Reader, p: GcPlan, delete_many: DeleteMany | None = None) -> list[Item]:
    """Remove what ``p`` lists, in a crash-safe order: retention (manifests first), parked chunks,
    incomplete steps, temp files, then orphan chunks after re-reading which steps are committed now.
    Under a deletion lease; if a writer holds a live lease by then, only retention runs (its chunks
    parked) and ``p.writers`` names the writers. Returns the items removed."""
    storage = reader.storage
    delete_many = delete_many or storage.delete_many  # bulk where the backend has it: each phase one call
    done: list[Item] = []
    leases = Leases(storage)
    leases.sweep()  # leases of processes that died without removing them
    with leases.deleting() as writers:
        p.writers = writers
        remaining = [s for s in reader.committed if s not in p.retention]
        records = [i for i in p.remove if i.kind == "journal"]
        delete_many([i.key for i in records])
        for d in sorted({i.key.rsplit("/", 1)[0] for i in records}):
            if not storage.list(d):
                storage.delete(d)  # a pruned start's directory (where the backend has directories)
        done += records
        if p.retention:
            _, doomed = delete_steps(storage, reader.manifests, p.retention, remaining, delete_many,
                                     park=bool(writers))
            # only what retention itself deleted is done: the planned chunks of parked lists are
            # deleted below (marking them done here left them on disk once their lists were removed)
            gone = set() if writers else {paths.chunk_key(h) for h in doomed}
            done += [i for i in p.remove if i.kind == "step" or (i.kind == "chunk" and i.key in gone)]
        if writers:
            return done
        lists = list(parked(storage)) if not p.unreadable else []
        # parked chunks a step committed since the plan may use again are spared below
        _delete_unreferenced(storage, reader, [i for i in p.remove if i.kind == "chunk" and i not in done],
                             delete_many, done)
        for key in lists:
            storage.delete(key)
        for item in p.remove:
            if item.kind != "incomplete":
                continue
            d = item.key
            assert item.step is not None
            if storage.exists(paths.manifest_key(item.step)):
                continue  # it committed since the plan was made: it is a step now, not garbage
            names = storage.list(d)
            # rank reports before anything else, so a half-removed step never looks more complete
            delete_many([f"{d}/{n}" for n in sorted(names, key=lambda n: not n.startswith("rank-"))])
            storage.delete(d)
            done.append(item)
        temps = [i for i in p.remove if i.kind == "temp"]
        delete_many([i.key for i in temps])
        done += temps
        _delete_unreferenced(storage, reader, [i for i in p.remove if i.kind == "orphan"], delete_many, done)
        storage.flush()
    return done


def _delete_unreferenced(storage: Storage, reader: Reader, items: list[Item], delete_many: DeleteMany,
                         done: list[Item]) -> None:
    """Delete the chunk ``items`` no step committed since the plan references (a save may have
    committed one that reuses a chunk that looked unreferenced)."""
    if not items:
        return
    referenced: set[str] = set()
    for s in mf.committed_steps(storage):
        if s in reader.committed:
            continue
        try:
            referenced |= mf.read_step(storage, s).chunks.keys()
        except Exception:  # unknown references: delete no chunk at all
            return
    items = [i for i in items if i.key.rsplit("/", 1)[-1] not in referenced]
    delete_many([i.key for i in items])
    done += items


@dataclass
class GcReport:
    """What ``ckpt gc`` did or, with ``dry_run``, would do to one root; ``to_json()`` is its
    ``--json`` document (schema ``ckpt-gc/1``)."""

    url: str
    plan: GcPlan
    removed: list[Item]  # with dry_run: what would be removed
    dry_run: bool

    @property
    def ok(self) -> bool:
        """False when a damaged manifest stopped chunk removal and retention."""
        return not self.plan.unreadable

    @property
    def bytes(self) -> int:
        return sum(i.bytes for i in self.removed)

    def to_json(self) -> dict:
        p = self.plan
        return {"schema": "ckpt-gc/1", "url": self.url, "dry_run": self.dry_run, "grace_s": p.grace_s,
                "retention_steps": p.retention, "would_remove" if self.dry_run else "removed":
                [i.to_json() for i in self.removed], "bytes": self.bytes,
                "kept_younger_than_grace": [i.to_json() for i in p.young],
                "damaged_steps": {str(s): e for s, e in p.unreadable.items()},
                "live_writers": [{"id": w.id, "pid": w.pid, "host": w.host} for w in p.writers],
                "exit": 0 if self.ok else 1}
