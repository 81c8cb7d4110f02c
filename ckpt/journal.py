"""The run journal: what each start of a training job did, kept in the checkpoint root (``journal/``).

ckpt sees every start of a job (the step it resumed from, how long the load took), every save and
its stall; the journal writes that down so that failures, the work they cost and the goodput of a run
can be measured later (:mod:`ckpt.goodput`, ``ckpt goodput``) and ``every="auto"`` can plan for the
failure rate a job really has. Under ``journal/<start>/`` (see docs/format.md):

* ``start.json``: the start's time, world size and host, the step it resumed from (None: fresh), how
  long the load took and when it was done; created once, at the first load or save;
* ``save-<step>.json``: a save this start committed: when ``save()`` was called, and its stall;
* ``seen.json``: the start's last-seen time (with the newest step the loop reported, and its saves
  and stall so far), replaced every ``SEEN_S`` seconds and at ``close()`` (then ``closed: true``).
  A start that died leaves the time it was last seen: it died within ``SEEN_S`` after.

Only the coordinator (rank 0) writes, from a thread of its own (:class:`Journal`): an object per start,
one per save and the one it replaces; nothing grows with the world size. Writing never blocks the
training loop and never fails a save: an error is logged once and counted (``Journal.errors``).
Readers that do not know ``journal/`` never look there; ``ckpt gc`` prunes it past a bound
(:func:`prune`).
"""

from __future__ import annotations

import json
import logging
import os
import queue
import secrets
import socket
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .format import paths
from .storage.base import Storage

log = logging.getLogger("ckpt")

SCHEMA = "ckpt.journal/1"
SEEN_S = 60.0  # how often a start's last-seen time is written
ENV_SEEN = "CKPT_JOURNAL_SEEN_S"  # overrides SEEN_S (ckpt chaos sets it small, for exact lost work)
KEEP_STARTS = 200  # gc keeps the newest starts whole ...
KEEP_SAVES = 1000  # ... and, past this many save records, drops those of steps no longer committed
MAX_RECORD = 1 << 16  # bytes read of a record at most


@dataclass
class SaveRecord:
    step: int
    time: float  # seconds since the epoch when save() was called (the state it saved is of then)
    stall_s: float  # how long save() blocked the training loop


@dataclass
class StartRecord:
    """One start of the job, as its objects say."""

    id: str
    time: float  # when its Checkpointer was created
    world_size: int
    host: str
    resumed_from: int | None  # None: started fresh
    load_s: float  # how long its load took (0 when fresh)
    ready: float  # when the load was done (training could begin)
    seen: float | None = None  # last seen (seen.json)
    step: int | None = None  # the newest step its loop reported, as last seen
    closed: bool = False  # it ended with close()
    saves_seen: int = 0  # saves committed and stall so far, as last seen (kept when gc prunes save records)
    stall_seen_s: float = 0.0
    saves: list[SaveRecord] = field(default_factory=list)
    hosts: list[str] | None = None  # the distinct hosts of its ranks (None: not gathered, e.g. no listing load)

    @property
    def end(self) -> float:
        """The last moment it is known to have run."""
        return max([self.time, self.ready, self.seen or 0.0] + [s.time for s in self.saves])


def new_start_id(t: float) -> str:
    """A start's name: sorts by time, and two starts of one millisecond still differ."""
    return f"{int(t * 1000):015d}-{secrets.token_hex(4)}"


def _doc(**fields: Any) -> list[bytes]:
    return [json.dumps({"schema": SCHEMA, **fields}).encode()]


def write_start(storage: Storage, rec: StartRecord) -> None:
    """Create a start's ``start.json`` (a test writes earlier starts with chosen times through it)."""
    storage.create(paths.journal_start_key(rec.id), _doc(
        start=rec.id, time=rec.time, world_size=rec.world_size, host=rec.host, hosts=rec.hosts,
        resumed_from=rec.resumed_from, load_s=rec.load_s, ready=rec.ready))


def write_save(storage: Storage, start: str, save: SaveRecord) -> None:
    storage.create(paths.journal_save_key(start, save.step), _doc(start=start, step=save.step, time=save.time,
                                                                  stall_s=save.stall_s))


def write_seen(storage: Storage, start: str, t: float, *, step: int | None = None, saves: int = 0,
               stall_s: float = 0.0, closed: bool = False) -> None:
    storage.write(paths.journal_seen_key(start), _doc(start=start, time=t, step=step, saves=saves, stall_s=stall_s,
                                                      closed=closed))


def _load(storage: Storage, key: str) -> dict | None:
    try:
        doc = json.loads(bytes(storage.read(key, 0, MAX_RECORD)))
    except (FileNotFoundError, ValueError):
        return None
    return doc if isinstance(doc, dict) and doc.get("schema") == SCHEMA else None


def _opt_int(v: Any) -> int | None:
    return None if v is None else int(v)


def _read_start(storage: Storage, name: str) -> StartRecord | None:
    d = f"{paths.JOURNAL}/{name}"
    doc = _load(storage, paths.journal_start_key(name))
    if doc is None:
        return None
    try:
        rec = StartRecord(name, float(doc["time"]), int(doc["world_size"]), str(doc["host"]),
                          _opt_int(doc.get("resumed_from")), float(doc.get("load_s") or 0.0), float(doc["ready"]))
        hosts = doc.get("hosts")
        rec.hosts = [str(h) for h in hosts] if isinstance(hosts, list) else None
        seen = _load(storage, paths.journal_seen_key(name))
        if seen is not None:
            rec.seen, rec.step, rec.closed = float(seen["time"]), _opt_int(seen.get("step")), bool(seen.get("closed"))
            rec.saves_seen, rec.stall_seen_s = int(seen.get("saves") or 0), float(seen.get("stall_s") or 0.0)
        for n in storage.list(d):
            if paths.JOURNAL_SAVE_RE.match(n) and (s := _load(storage, f"{d}/{n}")) is not None:
                rec.saves.append(SaveRecord(int(s["step"]), float(s["time"]), float(s.get("stall_s") or 0.0)))
    except (KeyError, TypeError, ValueError):
        return None  # not one ckpt wrote
    rec.saves.sort(key=lambda s: s.time)
    return rec


def read(storage: Storage) -> list[StartRecord]:
    """Every start the journal holds, oldest first (objects that do not parse are skipped)."""
    names = [n for n in storage.list(paths.JOURNAL) if paths.JOURNAL_START_RE.match(n)]
    out = [r for n in names if (r := _read_start(storage, n)) is not None]
    return sorted(out, key=lambda r: (r.time, r.id))


def prune(storage: Storage, committed: set[int], *, keep_starts: int | None = None,
          keep_saves: int | None = None) -> list[str]:
    """The journal objects ``gc`` removes: every object of the starts older than the newest
    ``keep_starts``, and past the newest ``keep_saves`` save records, those of steps no longer
    committed (except the steps a start resumed from: the lost work of a failure is measured from
    them). A start's saves and stall so far stay in its ``seen.json``. (Defaults: ``KEEP_STARTS``,
    ``KEEP_SAVES``.)"""
    keep_starts = KEEP_STARTS if keep_starts is None else keep_starts
    keep_saves = KEEP_SAVES if keep_saves is None else keep_saves
    names = sorted(n for n in storage.list(paths.JOURNAL) if paths.JOURNAL_START_RE.match(n))
    old, kept = names[:max(0, len(names) - keep_starts)], names[max(0, len(names) - keep_starts):]
    out = [f"{paths.JOURNAL}/{n}/{f}" for n in old for f in storage.list(f"{paths.JOURNAL}/{n}")]
    resumed = set()
    saves: list[tuple[str, int]] = []  # (name of the start, step), oldest start first
    for n in kept:
        doc = _load(storage, paths.journal_start_key(n))
        if doc is not None and doc.get("resumed_from") is not None:
            resumed.add(int(doc["resumed_from"]))
        saves += [(n, int(m.group(1))) for f in storage.list(f"{paths.JOURNAL}/{n}")
                  if (m := paths.JOURNAL_SAVE_RE.match(f))]
    older = saves[:max(0, len(saves) - keep_saves)]
    out += [paths.journal_save_key(n, s) for n, s in older if s not in committed and s not in resumed]
    return out


def seen_period() -> float:
    try:
        return max(0.0, float(os.environ.get(ENV_SEEN, SEEN_S)))
    except ValueError:
        return SEEN_S


class Journal:
    """The coordinator's writer of this start's journal objects, on its own thread (``ckpt-journal``).

    The Checkpointer tells it: :meth:`started` after the first load (or at the first save),
    :meth:`saved` when a save committed, ``step`` as the loop reports steps; :meth:`close` at the
    end. Each call only queues (or sets an attribute): nothing here waits on storage. ``history``:
    called on that thread first, with every earlier start (for ``every="auto"``)."""

    def __init__(self, storage: Storage, world_size: int, *, history: Callable[[list[StartRecord]], None] | None = None,
                 period: float | None = None, clock: Callable[[], float] = time.time):
        self.storage = storage
        self.world_size = world_size
        self.clock = clock
        self.period = seen_period() if period is None else period
        self.begin = clock()
        self.id = new_start_id(self.begin)
        self.step: int | None = None  # the newest step the loop reported (should_save, save)
        self.errors = 0  # writes that failed (the first one logged)
        self._history = history
        self._started = False
        self._deferred: StartRecord | None = None  # a fresh start's record, until its first save
        self._saves = 0
        self._stall = 0.0
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None  # started with the start record: no load nor save, no thread

    # -- from the Checkpointer ----------------------------------------------------------------------
    def started(self, resumed_from: int | None, load_s: float, *, defer: bool = False,
                hosts: list[str] | None = None) -> None:
        """This start is under way (once): resumed from a step (None: fresh) after a load of ``load_s``.
        ``defer``: written only when the first save comes (a fresh start in a root that may not exist
        yet writes nothing there before its first save). ``hosts``: its ranks' hosts, where gathered."""
        if self._started:
            return
        rec = self._deferred or StartRecord(self.id, self.begin, self.world_size, socket.gethostname(),
                                            resumed_from, load_s, self.clock(), hosts=hosts)
        if defer:
            self._deferred = rec
            return
        self._started = True
        self._queue.put(("start", rec))
        self._thread = threading.Thread(target=self._run, name="ckpt-journal", daemon=True)
        self._thread.start()

    def saved(self, step: int, t: float, stall_s: float) -> None:
        """A save called at ``t`` (seconds since the epoch) committed; it stalled the loop ``stall_s``."""
        self._queue.put(("save", SaveRecord(step, t, stall_s)))

    def flush(self, timeout: float = 30.0) -> None:
        """Wait until everything queued so far is written (or failed)."""
        if self._thread is None:
            return
        done = threading.Event()
        self._queue.put(("flush", done))
        done.wait(timeout)

    def close(self, clean: bool = True, timeout: float = 10.0) -> None:
        """Write the last-seen time, as a clean end unless ``clean`` is False (the job is ending on an
        exception), and stop the thread (waits ``timeout`` at most)."""
        if self._thread is None:
            return
        self._queue.put(("stop", clean))
        self._thread.join(timeout)

    def finalize_with(self, owner: object) -> None:
        """When ``owner`` (its Checkpointer) is garbage-collected without ``close()``, the thread
        writes the last-seen time once more (not a clean end) and stops. The finalizer holds only the
        queue (what it holds must not lead back to ``owner``, or ``owner`` would never be freed) and
        only puts on it: a finalizer may run on any thread. Not at exit, where ckpt.at_exit closes."""
        weakref.finalize(owner, self._queue.put, ("stop", False)).atexit = False

    # -- on the journal's thread ---------------------------------------------------------------------
    def _failed(self, what: str, e: BaseException) -> None:
        self.errors += 1
        if self.errors == 1:
            log.warning("writing the run journal (%s) in %s failed: %s; training and saves go on, later journal "
                        "errors are not logged", what, self.storage.describe(), e)

    def _seen(self, closed: bool = False) -> None:
        try:
            write_seen(self.storage, self.id, self.clock(), step=self.step, saves=self._saves, stall_s=self._stall,
                       closed=closed)
        except Exception as e:
            self._failed("last seen", e)

    def _write(self, kind: str, item: Any) -> None:
        try:
            if kind == "start":
                write_start(self.storage, item)
            else:
                self._saves += 1
                self._stall += item.stall_s
                write_save(self.storage, self.id, item)
        except Exception as e:
            self._failed(kind, e)

    def _run(self) -> None:
        if self._history is not None:
            try:
                self._history(read(self.storage))
            except Exception as e:
                self._failed("reading earlier starts", e)
            self._history = None  # it holds the schedule (every="auto"): nothing here keeps it alive after
        due: float | None = None  # when the last-seen time is written next (None: until the start record)
        while True:
            wait = None if due is None else max(0.0, due - time.monotonic())
            try:
                kind, item = self._queue.get(timeout=wait)
            except queue.Empty:
                self._seen()
                due = time.monotonic() + self.period
                continue
            if kind == "flush":
                item.set()
            elif kind == "stop":
                self._seen(closed=item)
                return
            else:
                self._write(kind, item)
                if kind == "start":  # the first thing queued
                    self._seen()
                    due = time.monotonic() + self.period
