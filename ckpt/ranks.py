"""The ranks that save together, and the one way they agree on anything: :meth:`Round.run`.

:class:`Comm` is how the ranks of a Checkpointer talk: small JSON documents under keys of a
key-value store. :class:`StoreComm` uses the process group's store (the TCPStore that ``torchrun``
or ``init_process_group`` set up) under a prefix private to one Checkpointer; :class:`LocalComm` is
a process alone with a dictionary for a store. Nothing here issues a collective on the training's
process group (gloo is only for bulk bytes between peers, :mod:`ckpt.peers`), and every wait has a
deadline.

A :class:`Round` is one coordination round, named and numbered alike on every rank (every rank
calls ``save`` and ``load`` in the same order). :meth:`Round.run` holds the whole round in one call,
as DCP's ``reduce_scatter`` does: every rank hands in its value or its error; the coordinator (rank
0) gathers them all, runs the caller's reduction over them (:class:`Gathered`: values, errors, and
the ranks that posted nothing in time) and publishes one answer, the same for everyone or one per
rank; the other ranks post once and wait for their answer. A reduction that raises fails the round
on every rank (a :class:`~ckpt.errors.DistributedSaveError` naming its ranks). The protocols are
short callers: the save plan (:func:`ckpt.save.planning.exchange_plan`), ``go`` and ``commit``
(:mod:`ckpt.save.commit`), load agreement (:meth:`Comm.agree`), the peers' setup.

Cost, in store requests (a TCPStore ``get`` is a wait and a read: two): a non-coordinator posts (1),
waits for its answer (1) and reads it (2): 4 at most; the coordinator waits for and reads each post
(3 per rank) and publishes 1 or N answers: O(N) a round, where every rank reading every post was
O(N²) (an hour for one load of 4,096 ranks at 30k requests/s).

Deadlines follow progress. The coordinator waits for posts until ``timeout`` passes with none taken;
while it waits on a late rank, it looks at the ranks behind it every half timeout (O(N) checks, only
then), and posts that came meanwhile extend the wait: ranks finishing over a long spread (a big job
writing to shared storage) are not cut off, and a rank that died is named ``timeout`` after the last
post. After the first posted failure it waits ``grace`` more at most. A non-coordinator waits twice
the timeout plus :data:`PER_RANK_S` per rank (the coordinator's own work grows with the ranks:
reading their parts, merging), and as long again whenever the coordinator's progress counter moved
(bumped while a long gather progresses); then it names rank 0. Keys of a round:

=============================  =================================================================
``<name>/<seq>/<rank>``        what ``rank`` posted (``{"v": value}`` or ``{"error": message}``)
``<name>/<seq>/answer``        the coordinator's answer to everyone (or the first proposal)
``<name>/<seq>/answer/<rank>`` the coordinator's answer to ``rank``
``<name>/<seq>/progress``      how often the coordinator's gather moved on after a long wait
=============================  =================================================================

The rounds ckpt runs: ``plan`` (and ``plan-parts`` where it asks for them), ``go``, ``commit`` (one
each per save, removed 16 saves later),
``agree`` (numbered per Comm, each removed by the next), ``peers`` (once) and ``save`` (the next save
the schedule asks for: a first-proposal-wins :meth:`Round.propose`, not a gathering).
"""

from __future__ import annotations

import abc
import itertools
import json
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from .errors import DistributedSaveError

# Per group, how many Checkpointers were made on it. Weak: holding the group would keep it alive after
# destroy_process_group(), and with it the backend's worker threads (gloo's), which then meet the
# interpreter's finalization still running; one that drops a finished collective's tensors there
# needs the GIL, cannot have it, and aborts the process ("terminate called without an active exception").
_instances: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_instances_lock = threading.Lock()
KEEP_SEQS = 16  # store keys of the last few saves are kept (slow ranks may still read them)
PER_RANK_S = 0.01  # how much longer a rank waits for the coordinator's answer, per rank of the group


@dataclass(frozen=True)
class Gathered:
    """What the coordinator gathered in a round: each rank's value, the errors ranks posted instead,
    and the ranks that posted nothing in time."""

    docs: dict[int, Any]
    errors: dict[int, str]
    missing: list[int]
    timeout: float

    def ordered(self) -> list[Any]:
        """Every rank's value, in rank order (only when every rank posted one)."""
        return [self.docs[r] for r in sorted(self.docs)]

    def raise_for(self, what: str, error: Callable[[Any], str | None] = lambda d: None) -> None:
        """One :class:`DistributedSaveError` naming every rank that posted an error, did not post in
        time, or whose value ``error`` calls a failure."""
        failed = dict(self.errors)
        failed.update({r: msg for r, d in self.docs.items() if (msg := error(d)) is not None})
        if not failed and not self.missing:
            return
        why = [f"rank {r}: {failed[r]}" for r in sorted(failed)]
        why += [f"rank {r} did not reach {what} within {self.timeout:.0f}s" for r in self.missing]
        raise DistributedSaveError("; ".join(why), ranks=sorted([*failed, *self.missing]))


def _wire(value: Any) -> dict:
    """What a rank posts: its value, or the error it failed with."""
    if isinstance(value, BaseException):
        return {"error": f"{type(value).__name__}: {value}"}
    return {"v": value}


class Round:
    """One coordination round among the ranks of a :class:`Comm` (see the module docstring)."""

    def __init__(self, comm: Comm, name: str, seq: int):
        self.comm = comm
        self.prefix = f"{name}/{seq}"

    def run(self, value: Any, reduce: Callable[[Gathered], Any] | None = None, *, what: str, each: bool = False,
            stop_early: Callable[[Any], bool] | None = None, grace: float = 5.0) -> Any:
        """The whole round, called alike on every rank: this rank's ``value`` (JSON, or an exception:
        its error) in, the coordinator's answer out.

        The coordinator gathers every rank's post, calls ``reduce`` on them and publishes what it
        returns: one answer for everyone, or with ``each`` a list, entry r for rank r. Without
        ``reduce`` the round is an announcement: nobody posts, the coordinator's ``value`` is the
        answer. Once a value satisfies ``stop_early`` (a failure), the rest get ``grace`` seconds more.

        Raises:
            DistributedSaveError: on every rank but the coordinator, when the coordinator's reduction
                raised, its own value was an exception, or no answer came (naming rank 0); the
                coordinator raises the exception itself.

        Example::

            newest = comm.round("agree", n).run(latest, lambda got: min(got.ordered()), what="the load")
        """
        comm = self.comm
        if comm.rank != 0:
            if reduce is not None:
                self.post(value)
            return self._answer(what, each)
        if reduce is None:
            answer = value
            if isinstance(value, BaseException):
                self._publish({"error": f"{what} failed on rank 0: {type(value).__name__}: {value}",
                               "ranks": [0]}, each)
                raise value
        else:
            got = self._gather(value, stop_early, grace)
            try:
                answer = reduce(got)
            except BaseException as e:
                ranks = list(e.ranks) if isinstance(e, DistributedSaveError) and e.ranks else [0]
                self._publish({"error": str(e), "ranks": ranks}, each)
                raise
        # Every rank sees the answer as JSON made it (a tuple is a list, a key a string), the coordinator too.
        if each:
            mine = json.dumps({"v": answer[0]})
            self._publish([{"v": a} for a in answer], each)
        else:
            mine = self._publish({"v": answer}, each)
        return json.loads(mine)["v"]

    def post(self, value: Any) -> None:
        """This rank's value (or error) for the round, for a rank that will not wait for the answer
        (it failed, or skips). The coordinator has nobody to post to: it calls :meth:`run` instead."""
        if self.comm.rank != 0:
            self.comm._put(f"{self.prefix}/{self.comm.rank}", json.dumps(_wire(value)).encode())

    def propose(self, doc: dict) -> dict:
        """Make ``doc`` the round's answer unless some rank did first; the answer (the same everywhere)."""
        return json.loads(self.comm._compare_set(self._answer_key(None), json.dumps(doc).encode()))

    def peek(self) -> dict | None:
        """The round's proposal if there is one now (no waiting)."""
        raw = self.comm._get(self._answer_key(None), time.monotonic())
        return None if raw is None else json.loads(raw)

    def cleanup(self, parts: tuple[str, ...] = ("posts", "answer")) -> None:
        """Remove the round's keys (once no rank reads them any more): of ``parts``, what it used of
        ``posts``, ``answer`` (to everyone) and ``answers`` (to each rank), and the progress counter."""
        ranks = range(1, self.comm.world)
        keys = [f"{self.prefix}/progress"]  # made by the first rank that waited long, if any
        keys += [self._answer_key(None)] if "answer" in parts else []
        keys += [self._answer_key(r) for r in ranks] if "answers" in parts else []
        keys += [f"{self.prefix}/{r}" for r in ranks] if "posts" in parts else []
        for k in keys:
            if not self.comm._delete(k):
                return  # this store cannot delete: keys are small

    # -- the coordinator ---------------------------------------------------------------------------
    def _gather(self, own: Any, stop_early: Callable[[Any], bool] | None, grace: float) -> Gathered:
        """Every rank's post, the coordinator's own ``own`` included, waiting as long as posts keep coming
        (see the module docstring)."""
        comm, timeout = self.comm, self.comm.timeout
        docs: dict[int, Any] = {}
        errors: dict[int, str] = {}
        missing: list[int] = []
        cutoff: list[float] = []  # after the first failure: the end of the grace

        def take(r: int, doc: dict) -> None:
            if "error" in doc:
                errors[r] = str(doc["error"])
            else:
                docs[r] = doc["v"]
                if stop_early is None or not stop_early(docs[r]):
                    return
            if not cutoff:
                cutoff.append(time.monotonic() + min(timeout, grace))

        take(0, _wire(own))
        pending: list[int | None] = list(range(1, comm.world))
        last = bumped = time.monotonic()  # the last progress: a post taken
        looked = False  # the ranks behind the awaited one were looked at once while waiting for it
        expired = False  # waiting is over: the rest are taken if they are there now
        i = 0
        while i < len(pending):
            r = pending[i]
            if r is None:  # a look behind took it
                i += 1
                continue
            until = last + timeout
            if cutoff:
                until = min(until, cutoff[0])
            elif not looked:
                until = min(until, last + timeout / 2)
            raw = comm._get(self._post_key(r), time.monotonic() if expired else until)
            if raw is not None:
                take(r, json.loads(raw))
                pending[i], looked = None, False
                last = time.monotonic()
            elif expired or cutoff:
                expired = True
                missing.append(r)
                pending[i] = None
            elif not looked:  # half way: what is behind it now is the baseline, not progress
                self._look_behind(pending, i, take)
                looked = True
            elif self._look_behind(pending, i, take):  # posts kept coming behind it: still progress
                last = time.monotonic()
            else:
                expired = True
                missing.append(r)
                pending[i] = None
            if last - bumped >= timeout / 4:  # tell the waiting ranks that this long round still moves
                comm._add(f"{self.prefix}/progress", 1)
                bumped = last
        return Gathered(docs, errors, sorted(missing), timeout)

    def _look_behind(self, pending: list[int | None], i: int, take: Callable[[int, dict], None]) -> int:
        """Take the posts now there of the ranks after ``pending[i]``; how many there were."""
        n = 0
        for j in range(i + 1, len(pending)):
            q = pending[j]
            if q is not None and (raw := self.comm._get(self._post_key(q), time.monotonic())) is not None:
                take(q, json.loads(raw))
                pending[j] = None
                n += 1
        return n

    def _publish(self, doc: Any, each: bool) -> str:
        """Write the answer (with ``each``: a list, one for each rank; an error dict: the same to each)."""
        comm = self.comm
        docs = doc if isinstance(doc, list) else [doc] * comm.world
        for r in range(1, comm.world) if each else ():
            comm._put(self._answer_key(r), json.dumps(docs[r]).encode())
        data = json.dumps(docs[0])
        if not each and comm.world > 1:
            comm._put(self._answer_key(None), data.encode())
        return data

    # -- the others --------------------------------------------------------------------------------
    def _answer(self, what: str, each: bool) -> Any:
        comm = self.comm
        key = self._answer_key(comm.rank if each else None)
        started, seen = time.monotonic(), 0
        while (raw := comm._get(key, time.monotonic() + comm.patience())) is None:
            moved = comm._add(f"{self.prefix}/progress", 0)
            if moved == seen:
                raise DistributedSaveError(
                    f"rank {comm.rank}: rank 0 (the coordinator) did not answer {what} within "
                    f"{time.monotonic() - started:.0f}s (still busy, hung, or dead)", ranks=[0])
            seen = moved  # the coordinator's gather moved on meanwhile: wait as long again
        doc = json.loads(raw)
        if "error" in doc:
            raise DistributedSaveError(str(doc["error"]), ranks=list(doc.get("ranks") or [0]))
        return doc["v"]

    def _post_key(self, rank: int) -> str:
        return f"{self.prefix}/{rank}"

    def _answer_key(self, to: int | None) -> str:
        return f"{self.prefix}/answer" if to is None else f"{self.prefix}/answer/{to}"


class Comm(abc.ABC):
    """The ranks of one Checkpointer, talking through a key-value store (see the module docstring)."""

    rank: int
    world: int
    timeout: float
    _agreed: int  # agreement rounds so far (this Comm's own count; every rank counts alike)

    @abc.abstractmethod
    def _put(self, key: str, value: bytes) -> None: ...

    @abc.abstractmethod
    def _get(self, key: str, deadline: float) -> bytes | None:
        """The value of ``key`` once it is set, or None if ``deadline`` passes first."""

    @abc.abstractmethod
    def _delete(self, key: str) -> bool:
        """Delete ``key``; False if this store cannot delete."""

    @abc.abstractmethod
    def _compare_set(self, key: str, value: bytes) -> bytes:
        """Set ``key`` to ``value`` unless it is set already; return the value it holds then."""

    @abc.abstractmethod
    def _add(self, key: str, amount: int) -> int:
        """Add ``amount`` to the counter ``key`` (0 when unset), without waiting; its new value."""

    @abc.abstractmethod
    def describe(self) -> str: ...

    def round(self, name: str, seq: int) -> Round:
        return Round(self, name, seq)

    def patience(self) -> float:
        """How long a rank waits for the coordinator's answer before it looks for progress."""
        return 2 * self.timeout + PER_RANK_S * self.world

    def agree(self, value: Any, reduce: Callable[[list[Any]], Any] = list) -> Any:
        """``reduce`` over every rank's ``value`` (in rank order), on the coordinator; its answer on
        every rank (all ranks call this in the same order, with the same ``reduce``: whichever rank
        is the coordinator runs it). By default the list of values: give a reduction where every rank
        needs less, so it is not N values read by each of N ranks."""
        n = self._agreed
        self._agreed = n + 1

        def whole(got: Gathered) -> Any:
            got.raise_for("load")
            return reduce(got.ordered())

        answer = self.round("agree", n).run(value, whole, what=f"the load's agreement {n}")
        if n > 0 and self.rank == 0:  # every rank posted round n, so every rank is done reading round n-1
            self.round("agree", n - 1).cleanup(("posts", "answer"))
        return answer


class LocalComm(Comm):
    """A process saving alone: rank 0 of 1, its own coordinator, waiting for nobody."""

    def __init__(self, timeout: float = 600.0):
        self.rank, self.world, self.timeout = 0, 1, timeout
        self._agreed = 0
        self._store: dict[str, bytes] = {}
        self._lock = threading.Lock()

    def describe(self) -> str:
        return "single process"

    def _put(self, key: str, value: bytes) -> None:
        with self._lock:
            self._store[key] = value

    def _get(self, key: str, deadline: float) -> bytes | None:
        with self._lock:  # nobody else could set it: waiting would only delay the answer
            return self._store.get(key)

    def _delete(self, key: str) -> bool:
        with self._lock:
            self._store.pop(key, None)
        return True

    def _compare_set(self, key: str, value: bytes) -> bytes:
        with self._lock:
            return self._store.setdefault(key, value)

    def _add(self, key: str, amount: int) -> int:
        with self._lock:
            n = int(self._store.get(key, b"0")) + amount
            self._store[key] = str(n).encode()
            return n


class StoreComm(Comm):
    """Ranks of a process group, talking through its store."""

    def __init__(self, group: Any, timeout: float):
        import torch.distributed as dist
        from torch.distributed import distributed_c10d as c10d

        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.timeout = timeout
        self._agreed = 0
        base = None
        if group is not None and hasattr(c10d, "_get_process_group_store"):
            try:
                base = c10d._get_process_group_store(group)
            except Exception:
                base = None
        if base is None:
            base = c10d._get_default_store()
        # Every member of a group creates its Checkpointers for that group in the same order, so a
        # per-group counter names the same instance on every rank.
        # Keyed by the group object itself: a group made after destroy_process_group() starts
        # counting again, as it does on a freshly started rank.
        pg = group if group is not None else c10d._get_default_group()
        with _instances_lock:
            n = next(_instances.setdefault(pg, itertools.count()))
        name = getattr(pg, "group_name", None) or "default"
        self._base = base
        self._prefix = f"ckpt/{name}/{n}/"
        self._local = threading.local()

    def describe(self) -> str:
        return f"rank {self.rank} of {self.world}"

    @property
    def store(self) -> Any:
        """This thread's connection to the store (a TCPStore client is not shared between threads)."""
        s = getattr(self._local, "store", None)
        if s is None:
            import torch.distributed as dist

            base = self._base
            try:
                base = base.clone()  # type: ignore[attr-defined]  # in torch, missing from its stubs
            except Exception:  # stores without clone() are shared
                pass
            s = self._local.store = dist.PrefixStore(self._prefix, base)
        return s

    def _unreachable(self, e: Exception) -> DistributedSaveError:
        return DistributedSaveError(f"rank {self.rank}: cannot reach the process group's store ({e}); "
                                    "rank 0 or the launcher may have died", ranks=[0])

    def _put(self, key: str, value: bytes) -> None:
        try:
            self.store.set(key, value)
        except Exception as e:
            raise self._unreachable(e) from e

    def _get(self, key: str, deadline: float) -> bytes | None:
        remaining = deadline - time.monotonic()
        try:
            if remaining <= 0:
                if not self.store.check([key]):
                    return None
            else:
                self.store.wait([key], timedelta(seconds=remaining))
            return bytes(self.store.get(key))
        except Exception as e:
            if "timeout" in str(e).lower() or "timed out" in str(e).lower():
                return None
            raise self._unreachable(e) from e

    def _compare_set(self, key: str, value: bytes) -> bytes:
        try:  # an empty expected value: set it only if the key does not exist
            return bytes(self.store.compare_set(key, "", value))
        except Exception as e:
            raise self._unreachable(e) from e

    def _add(self, key: str, amount: int) -> int:
        try:
            return int(self.store.add(key, amount))
        except Exception as e:
            raise self._unreachable(e) from e

    def _delete(self, key: str) -> bool:
        try:
            self.store.delete_key(key)
            return True
        except Exception:  # not every store can delete; keys are small
            return False


def make_comm(process_group: Any, timeout: float) -> Comm:
    """The group that saves together: ``process_group``, the default group when torch.distributed is
    initialised, or this process alone."""
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover - torch without distributed
        return LocalComm(timeout)
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(process_group) == 1:
        return LocalComm(timeout)
    return StoreComm(process_group, timeout)
