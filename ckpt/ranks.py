"""The ranks that save together, and the one way they agree on anything: a :class:`Round`.

:class:`Comm` is how the ranks of a Checkpointer talk: small JSON documents under keys of a
key-value store. :class:`StoreComm` uses the process group's store (the TCPStore that ``torchrun``
or ``init_process_group`` set up) under a prefix private to one Checkpointer; :class:`LocalComm` is
a process alone with a dictionary for a store. Nothing here issues a collective on the training's
process group (gloo is only for bulk bytes between peers, :mod:`ckpt.peers`), and every wait has a
deadline.

A :class:`Round` is one coordination round: a name and a sequence number (the same on every rank,
because every rank calls ``save`` and ``load`` in the same order), each rank posting its document,
the coordinator (or everyone) gathering them until a deadline, ranks that did not post named,
failures gathered into one :class:`~ckpt.errors.DistributedSaveError` naming the ranks, and the
round's keys removed once nobody reads them. Its keys:

=============================  =================================================================
``<name>/<seq>/<rank>``        what ``rank`` posted
``<name>/<seq>/raw/<rank>``    bytes ``rank`` posted (a rank's report, with local commits)
``<name>/<seq>/answer``        the coordinator's answer to everyone (or the first proposal)
``<name>/<seq>/answer/<rank>`` the coordinator's answer to ``rank``
=============================  =================================================================

The rounds ckpt runs: ``plan`` (inventories, the coordinator's assignments: :meth:`Comm.exchange_plan`),
``commit`` (reports, the decision: :mod:`ckpt.commit`), ``go`` (the coordinator holds the lease
and finished what was queued before this save), ``agree`` (which step a load ends on, whether
every rank managed) and ``save`` (the next save the schedule asks for: the first proposal wins).
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
from .planning import Inventory, WriteAssignment, assign

# Per group, how many Checkpointers were made on it. Weak: holding the group would keep it alive after
# destroy_process_group(), and with it the backend's worker threads (gloo's), which then meet the
# interpreter's finalization still running; one that drops a finished collective's tensors there
# needs the GIL, cannot have it, and aborts the process ("terminate called without an active exception").
_instances: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_instances_lock = threading.Lock()
KEEP_SEQS = 16  # store keys of the last few saves are kept (slow ranks may still read them)


@dataclass(frozen=True)
class Gathered:
    """What a round gathered: each rank's document, and the ranks that posted none in time."""

    docs: dict[int, dict]
    missing: list[int]

    def ordered(self) -> list[dict]:
        """Every rank's document, in rank order (only when none is missing)."""
        return [self.docs[r] for r in sorted(self.docs)]

    def failed(self, is_failure: Callable[[dict], bool]) -> list[int]:
        return sorted(r for r, d in self.docs.items() if is_failure(d))

    def raise_for(self, what: str, timeout: float, error: Callable[[dict], str | None] = lambda d: None) -> None:
        """One :class:`DistributedSaveError` naming every rank that did not post in time or whose
        document ``error`` calls a failure."""
        failed = {r: msg for r, d in sorted(self.docs.items()) if (msg := error(d)) is not None}
        if not failed and not self.missing:
            return
        why = [f"rank {r}: {msg}" for r, msg in failed.items()]
        why += [f"rank {r} did not reach {what} within {timeout:.0f}s" for r in self.missing]
        raise DistributedSaveError("; ".join(why), ranks=sorted([*failed, *self.missing]))


class Round:
    """One coordination round among the ranks of a :class:`Comm` (see the module docstring)."""

    def __init__(self, comm: Comm, name: str, seq: int):
        self.comm = comm
        self.prefix = f"{name}/{seq}"

    def post(self, doc: dict) -> None:
        """This rank's document for the round."""
        self.comm._put(f"{self.prefix}/{self.comm.rank}", json.dumps(doc).encode())

    def post_raw(self, data: bytes) -> None:
        self.comm._put(f"{self.prefix}/raw/{self.comm.rank}", data)

    def raw(self, rank: int, deadline: float) -> bytes | None:
        return self.comm._get(f"{self.prefix}/raw/{rank}", deadline)

    def gather(self, deadline: float, stop_early: Callable[[dict], bool] | None = None,
               grace: float = 5.0) -> Gathered:
        """Every rank's document, waiting until ``deadline`` at most; once a document satisfies
        ``stop_early`` (a failure), waiting at most ``grace`` seconds more for the rest."""
        docs: dict[int, dict] = {}
        missing = []
        for r in range(self.comm.world):
            raw = self.comm._get(f"{self.prefix}/{r}", deadline)
            if raw is None:
                missing.append(r)
                continue
            docs[r] = json.loads(raw)
            if stop_early is not None and stop_early(docs[r]):
                deadline = min(deadline, time.monotonic() + min(self.comm.timeout, grace))
        return Gathered(docs, missing)

    def answer(self, doc: dict, to: int | None = None) -> None:
        """The coordinator's answer, to everyone or to rank ``to``."""
        self.comm._put(self._answer_key(to), json.dumps(doc).encode())

    def wait_answer(self, deadline: float, to: int | None = None) -> dict | None:
        raw = self.comm._get(self._answer_key(to), deadline)
        return None if raw is None else json.loads(raw)

    def propose(self, doc: dict) -> dict:
        """Make ``doc`` the round's answer unless some rank did first; the answer (the same everywhere)."""
        return json.loads(self.comm._compare_set(self._answer_key(None), json.dumps(doc).encode()))

    def peek(self) -> dict | None:
        """The round's answer if there is one now (no waiting)."""
        return self.wait_answer(time.monotonic())

    def cleanup(self, parts: tuple[str, ...] = ("posts", "answer")) -> None:
        """Remove the round's keys (once no rank reads them any more): of ``parts``, what it used of
        ``posts``, ``raw`` (posted bytes), ``answer`` (to everyone) and ``answers`` (to each rank)."""
        ranks = range(self.comm.world)
        keys = [self._answer_key(None)] if "answer" in parts else []
        keys += [self._answer_key(r) for r in ranks] if "answers" in parts else []
        keys += [f"{self.prefix}/{r}" for r in ranks] if "posts" in parts else []
        keys += [f"{self.prefix}/raw/{r}" for r in ranks] if "raw" in parts else []
        for k in keys:
            if not self.comm._delete(k):
                return  # this store cannot delete: keys are small

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
    def describe(self) -> str: ...

    def round(self, name: str, seq: int) -> Round:
        return Round(self, name, seq)

    def deadline(self, factor: float = 1.0) -> float:
        return time.monotonic() + factor * self.timeout

    # -- the plan ----------------------------------------------------------------------------------
    def exchange_plan(self, seq: int, inventory: Inventory) -> WriteAssignment:
        """Send this rank's inventory; the coordinator answers every rank with its assignment.
        Raises the assignment's error (the same on every rank) if the save cannot go ahead."""
        rnd = self.round("plan", seq)
        rnd.post(inventory.to_json())
        if self.rank == 0:
            got = rnd.gather(self.deadline())
            if got.missing:
                answers = [WriteAssignment(error=f"rank(s) {got.missing} did not join the save plan within "
                                                 f"{self.timeout:.0f}s (the state's structure must change on "
                                                 "every rank at the same save)", ranks=got.missing)] * self.world
            else:
                answers = assign([Inventory.from_json(d) for d in got.ordered()])
            for r in range(self.world):
                rnd.answer(answers[r].to_json(), to=r)
        doc = rnd.wait_answer(self.deadline(2), to=self.rank)
        if doc is None:
            raise DistributedSaveError(f"rank {self.rank}: no save plan from rank 0 within {2 * self.timeout:.0f}s",
                                       ranks=[0])
        answer = WriteAssignment.from_json(doc)
        answer.raise_error()
        return answer

    def fail_plan(self, seq: int, message: str) -> None:
        """This rank failed before or while planning: tell the coordinator at once."""
        try:
            self.round("plan", seq).post(Inventory(error=message).to_json())
        except DistributedSaveError:
            pass

    # -- one save's commit round (see ckpt.commit) -------------------------------------------------
    def report(self, seq: int, doc: dict) -> None:
        self.round("commit", seq).post(doc)

    def gather(self, seq: int) -> tuple[dict[int, dict], list[int]]:
        """Coordinator: every rank's report for ``seq``, and the ranks that did not report in time
        (after the first failure, the rest get a few seconds more)."""
        got = self.round("commit", seq).gather(self.deadline(),
                                               stop_early=lambda d: d.get("status") in ("fail", "nonfinite"))
        return got.docs, got.missing

    def send_part(self, seq: int, data: bytes) -> None:
        """A rank's report for save ``seq``, for the coordinator (when reports live in local tiers only)."""
        self.round("commit", seq).post_raw(data)

    def part(self, seq: int, rank: int) -> bytes | None:
        return self.round("commit", seq).raw(rank, self.deadline())

    def publish(self, seq: int, doc: dict) -> None:
        self.round("commit", seq).answer(doc)

    def decision(self, seq: int) -> dict | None:
        return self.round("commit", seq).wait_answer(self.deadline(2))

    def go(self, seq: int, doc: dict) -> None:
        self.round("go", seq).answer(doc)

    def wait_go(self, seq: int) -> dict | None:
        return self.round("go", seq).wait_answer(self.deadline(2))

    def forget(self, seq: int) -> None:
        """Remove the rounds of save ``seq - KEEP_SEQS`` (coordinator only; slow ranks may still read
        the last few)."""
        old = seq - KEEP_SEQS
        if old >= 0:
            self.round("commit", old).cleanup(("posts", "raw", "answer"))
            self.round("go", old).cleanup(("answer",))
            self.round("plan", old).cleanup(("posts", "answers"))

    # -- load agreement ----------------------------------------------------------------------------
    def agree(self, value: dict) -> list[dict]:
        """Every rank's ``value`` for this round of agreement (all ranks call it in the same order)."""
        n = self._agreed
        self._agreed = n + 1
        rnd = self.round("agree", n)
        rnd.post(value)
        got = rnd.gather(self.deadline())
        got.raise_for("load", self.timeout)
        if n > 0 and self.rank == 0:  # every rank posted round n, so every rank is done reading round n-1
            self.round("agree", n - 1).cleanup(("posts",))
        return got.ordered()


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
