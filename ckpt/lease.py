"""Leases: who is writing to a checkpoint root, so that deleting chunks never races a writer.

Deleting a chunk is safe only when nobody is about to reference it. Inside one Checkpointer that is
arranged by order (retention runs between saves, and the other ranks wait for it). Between processes
(``ckpt gc`` beside a training job, two jobs saving into one root) it is arranged here:

* a writer holds a *writer lease*, ``leases/<id>.json``, from its first save until ``close()``,
  refreshed by a heartbeat thread;
* whoever wants to delete chunks first writes a *deletion lease*, then lists the leases; while
  another writer's lease is live it deletes no chunk (steps may still be retired: their manifests
  go, and their chunks are listed under ``retired/`` for whoever may delete them later);
* a writer taking its lease lists the leases after writing its own, and waits while another
  holder's deletion lease is live.

Both sides write before they list, and the storage is read-after-write consistent (a local
filesystem; S3 since 2020), so at least one of them sees the other: chunks are never deleted while a
writer that could reuse them is choosing what to write. A lease is live until it expires (plus a
margin for clocks that disagree); a lease of a process on this host that no longer runs is dead at
once, so a killed job's restart is not held up.

A writer lease also says which steps its run resumed from (``protect``): no retention, in any
process, deletes them while the lease is live. A Checkpointer (not ``shared_root``) taking its
writer lease refuses to write beside another job's live writer lease (:class:`~ckpt.errors.RootInUseError`):
two jobs in one root interleave their steps and each one's ``keep_last`` deletes the other's.
Leases of this very process never count against it (two Checkpointers of one program).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from .errors import RootInUseError, StorageError
from .format.paths import LEASES, lease_key
from .storage import Storage

log = logging.getLogger("ckpt")

TTL_S = 60.0  # a lease is renewed every TTL_S / 4 seconds while it is held
SKEW_S = 30.0  # clocks of two hosts may disagree this much
_PROC = uuid.uuid4().hex  # this process, told apart from an earlier one that had its pid (a restarted container)


@dataclass(frozen=True)
class LeaseInfo:
    id: str
    kind: str  # "writer" or "deletion"
    pid: int
    host: str
    expires: float  # seconds since the epoch, on the holder's clock
    since: float | None = None  # when it was first taken (None: written by an older ckpt)
    protect: tuple[int, ...] = ()  # steps its run resumed from: no retention deletes them
    proc: str = ""  # the holder process's token (see ``_PROC``)

    def ours(self) -> bool:
        """Held by this very process."""
        return self.host == socket.gethostname() and self.pid == os.getpid() and self.proc in ("", _PROC)

    def live(self, now: float | None = None) -> bool:
        now = time.time() if now is None else now
        if now > self.expires + SKEW_S:
            return False
        here = self.host == socket.gethostname()
        if here and self.pid == os.getpid() and self.proc not in ("", _PROC):
            return False  # an earlier process with this pid (a restarted container): it is gone
        if here and self.pid != os.getpid():
            try:
                os.kill(self.pid, 0)
            except ProcessLookupError:
                return False  # its process is gone: the lease died with it
            except PermissionError:
                pass  # another user's process: alive
            if _zombie(self.pid):
                return False  # it has exited; only its parent has not reaped it yet
        return True

    def describe(self) -> str:
        return f"{self.kind} lease {self.id} (pid {self.pid} on {self.host})"


def _zombie(pid: int) -> bool:
    """Whether ``pid`` has exited but is not reaped yet (Linux; elsewhere: not known, so False)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rfind(b")") + 2:][:1] == b"Z"


def list_leases(storage: Storage) -> list[LeaseInfo]:
    """Every lease found under the root (live or not); unreadable ones are skipped."""
    out = []
    for name in storage.list(LEASES):
        if not name.endswith(".json"):
            continue
        try:
            doc = json.loads(storage.read(f"{LEASES}/{name}", 0, 4096))
            since = doc.get("since")
            out.append(LeaseInfo(str(doc["id"]), str(doc["kind"]), int(doc["pid"]), str(doc["host"]),
                                 float(doc["expires"]), None if since is None else float(since),
                                 tuple(int(s) for s in doc.get("protect", ())), str(doc.get("proc", ""))))
        except (FileNotFoundError, ValueError, KeyError, TypeError):
            continue  # removed meanwhile, or not one of ours
    return out


class Leases:
    """This process's leases on one root. ``own`` holds the ids that count as this job's (the
    coordinator's writer lease, learnt by the other ranks), which never stand in its own way.

    ``alone``: taking the writer lease refuses (:class:`RootInUseError`) while another process holds
    a live writer lease on the root (a Checkpointer without ``shared_root``)."""

    def __init__(self, storage: Storage, *, ttl: float = TTL_S, wait_s: float = 600.0, alone: bool = False):
        self.storage = storage
        self.ttl = ttl
        self.wait_s = wait_s  # the longest a writer waits for another process's deletion
        self.alone = alone
        self.writer_id = uuid.uuid4().hex
        self.own: set[str] = {self.writer_id}
        self.protected: set[int] = set()  # steps this run resumed from, written into the writer lease
        self._since = 0.0  # when the writer lease was taken
        _OPEN.add(self)
        self._held: dict[str, str] = {}  # lease id -> kind, for the heartbeat
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._valid_until = 0.0  # when the writer lease, as last written, expires

    # -- writing and renewing ------------------------------------------------------------------------
    def _write(self, lease_id: str, kind: str) -> float:
        now = time.time()
        expires = now + self.ttl
        doc: dict = {"id": lease_id, "kind": kind, "pid": os.getpid(), "host": socket.gethostname(),
                     "expires": expires, "proc": _PROC}
        if lease_id == self.writer_id:
            doc["since"] = self._since or now
            doc["protect"] = sorted(self.protected)
        self.storage.write(lease_key(lease_id), [json.dumps(doc).encode()])
        return expires

    def _heartbeat(self) -> None:
        while not self._stop.wait(self.ttl / 4):
            with self._lock:
                held = dict(self._held)
            for lease_id, kind in held.items():
                try:
                    expires = self._write(lease_id, kind)
                    if lease_id == self.writer_id:
                        self._valid_until = expires
                except Exception as e:  # the next beat tries again; hold() notices a lapsed lease
                    log.warning("renewing %s lease in %s failed: %s", kind, self.storage.describe(), e)

    def _track(self, lease_id: str, kind: str) -> None:
        with self._lock:
            self._held[lease_id] = kind
            if self._thread is None:
                self._stop.clear()
                self._thread = threading.Thread(target=self._heartbeat, name="ckpt-lease", daemon=True)
                self._thread.start()

    def _untrack(self, lease_id: str) -> None:
        with self._lock:
            self._held.pop(lease_id, None)
            thread = self._thread if not self._held else None
            if thread is not None:
                self._thread = None
                self._stop.set()
        if thread is not None:
            thread.join()

    # -- the writer side -----------------------------------------------------------------------------
    def hold(self) -> bool:
        """Hold the writer lease (write it, or renew it if it is close to lapsing), then wait while
        another process deletes chunks. Cheap when the lease is already held and fresh.

        Returns True when the lease was taken anew: until then another process may have deleted
        chunks this writer believes stored."""
        if self.writer_id in self._held and time.time() < self._valid_until - self.ttl / 2:
            return False
        fresh = self.writer_id not in self._held
        if fresh:
            self._since = time.time()
        self._valid_until = self._write(self.writer_id, "writer")
        self._track(self.writer_id, "writer")
        if fresh and self.alone:
            self._refuse_others()
        deadline = time.monotonic() + self.wait_s
        delay = 0.05
        while True:
            busy = [x for x in self.others() if x.kind == "deletion"]
            if not busy:
                return True
            if time.monotonic() > deadline:
                raise StorageError(
                    f"another process has been deleting chunks in {self.storage.describe()} for more than "
                    f"{self.wait_s:.0f}s ({busy[0].describe()}); if it is dead, delete {lease_key(busy[0].id)}")
            log.info("waiting for %s to finish deleting chunks in %s", busy[0].describe(),
                     self.storage.describe())
            time.sleep(delay)  # polling a lease held by another process: nothing to wait on here
            delay = min(1.0, delay * 2)

    def _refuse_others(self) -> None:
        """Just after writing this writer lease: give it up and raise if another job writes here."""
        other = next((x for x in self.others() if x.kind == "writer" and not x.ours()), None)
        if other is None:
            return
        self._give_up()
        raise RootInUseError(in_use_message(self.storage, other), holder=other)

    def protect(self, step: int) -> None:
        """Record ``step`` (this run resumed from it) in the writer lease, so that no retention of
        another process deletes it while the lease is live; this process's retention asks
        :func:`protected_here`. Written at once if the lease is held, else when it is taken."""
        self.protected.add(step)
        self._record_protected()

    def _record_protected(self) -> None:
        if self.writer_id in self._held:
            try:
                self._valid_until = self._write(self.writer_id, "writer")
            except Exception as e:  # the next heartbeat writes it
                log.warning("recording the protected steps %s in %s failed: %s", sorted(self.protected),
                            self.storage.describe(), e)

    def unprotect(self, step: int) -> None:
        """``step`` is no longer the one this run resumed from (a later load): no longer recorded."""
        if step not in self.protected:
            return
        self.protected.discard(step)
        self._record_protected()

    def release(self) -> None:
        """Drop the writer lease (at close)."""
        _OPEN.discard(self)
        self._give_up()

    def _give_up(self) -> None:
        if self.writer_id not in self._held:
            return
        self._untrack(self.writer_id)
        try:
            self.storage.delete(lease_key(self.writer_id))
        except Exception as e:  # it expires on its own
            log.warning("removing the writer lease from %s failed: %s", self.storage.describe(), e)

    # -- the deleting side ---------------------------------------------------------------------------
    def others(self) -> list[LeaseInfo]:
        """Live leases of other holders (not this job's)."""
        now = time.time()
        return [x for x in list_leases(self.storage) if x.id not in self.own and x.live(now)]

    def exclusive(self) -> bool:
        """No other writer holds a live lease on this root."""
        return not any(x.kind == "writer" for x in self.others())

    @contextmanager
    def deleting(self) -> Iterator[list[LeaseInfo]]:
        """Hold a deletion lease for the block; yields the other live writers (delete chunks only
        if there are none)."""
        lease_id = uuid.uuid4().hex
        self.own.add(lease_id)
        self._write(lease_id, "deletion")
        self._track(lease_id, "deletion")
        try:
            yield [x for x in self.others() if x.kind == "writer"]
        finally:
            self._untrack(lease_id)
            self.own.discard(lease_id)
            try:
                self.storage.delete(lease_key(lease_id))
            except Exception as e:  # it expires on its own
                log.warning("removing a deletion lease from %s failed: %s", self.storage.describe(), e)

    def protected_steps(self) -> set[int]:
        """Steps no retention may delete now: those runs resumed from, by an open Checkpointer of this
        process on this root or by another process's live writer lease."""
        out = protected_here(self.storage)
        for x in list_leases(self.storage):
            if x.protect and x.kind == "writer" and x.live():
                out.update(x.protect)
        return out

    def sweep(self) -> None:
        """Delete leases that are dead (their process ended without removing them)."""
        now = time.time()
        for x in list_leases(self.storage):
            if x.id not in self.own and not x.live(now):
                self.storage.delete(lease_key(x.id))


_OPEN: weakref.WeakSet[Leases] = weakref.WeakSet()  # this process's Leases not yet released


def protected_here(storage: Storage) -> set[int]:
    """Steps an open Checkpointer of this process resumed from, on the root ``storage`` names."""
    root = storage.describe()
    out: set[int] = set()
    for leases in list(_OPEN):
        if leases.protected and leases.storage.describe() == root:
            out |= leases.protected
    return out


def in_use_message(storage: Storage, other: LeaseInfo) -> str:
    """What a job refused beside ``other``'s live writer lease is told: who holds it, and what to do."""
    def utc(t: float) -> str:
        return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(t))

    since = f" since {utc(other.since)}" if other.since is not None else ""
    lapse = other.expires + SKEW_S
    return (f"{storage.describe()} is being written by another job: pid {other.pid} on {other.host} has held a "
            f"writer lease there{since} ({lease_key(other.id)}). Two jobs saving into one root interleave their "
            "steps and each one's keep_last deletes the other's, so this job writes nothing there. Save this run "
            "into another directory; or, if that job is gone (killed on another host), wait until its lease "
            f"lapses at {utc(lapse)} or delete {lease_key(other.id)}; to share the root on purpose, pass "
            "shared_root=True to every Checkpointer writing there.")
