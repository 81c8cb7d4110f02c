"""The ranks that save together, and who writes what.

:class:`Comm` is how the ranks of a save talk: small JSON documents under keys of a key-value store.
:class:`StoreComm` uses the process group's store (the TCPStore that ``torchrun`` or
``init_process_group`` set up) under a prefix private to one Checkpointer; :class:`LocalComm` is a
process alone with a dictionary for a store. Both offer the same operations, so a save has one
path whatever the world size. Nothing here issues a collective on the training's process group,
and every wait has a deadline. Keys are namespaced by the save call's sequence number, which is the
same on every rank because every rank calls ``save`` in the same order:

=========================  =====================================================================
``p/<seq>/inv/<rank>``     a rank's tensor inventory, when its state's structure changed
``p/<seq>/plan/<rank>``    the coordinator's answer: which tensors that rank writes
``q/<seq>/r/<rank>``       a rank's report for the save (see :mod:`ckpt.commit`)
``q/<seq>/part/<rank>``    a rank's report itself, when saves commit to local tiers (no shared storage)
``q/<seq>/result``         the coordinator's decision (with the manifest, when saves commit to local tiers)
``q/<seq>/go``             the coordinator holds the lease and finished everything queued before this
                           save (retention): the other ranks may write its chunks
``l/<n>/<rank>``           agreement on which step a ``load`` ends up loading
``s/<round>``              the next save the schedule asks for (a preemption or an interval; see
                           :mod:`ckpt.schedule`): the first proposal wins
=========================  =====================================================================

:func:`assign` (the planner) is a pure function of every rank's :class:`Inventory`, so it is tested
alone.
"""

from __future__ import annotations

import abc
import itertools
import json
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, NamedTuple

from . import tree as st
from .errors import DistributedSaveError, StateMismatchError
from .flatten import Flat
from .format.boxes import Box, intersect, volume

_instances: dict[int, tuple[Any, itertools.count]] = {}
KEEP_SEQS = 16  # store keys of the last few saves are kept (slow ranks may still read them)


# -- the planner's records -------------------------------------------------------------------------

class InventoryRow(NamedTuple):
    """One tensor of a rank's state, as the planner sees it."""

    key: str
    kind: str  # "replicated", "shard" or "rank" (see state.Leaf)
    dtype: str
    global_shape: list[int]
    offsets: list[int]
    lengths: list[int]
    nbytes: int


@dataclass(frozen=True)
class Inventory:
    """What the coordinator needs to know about one rank's state to plan the save.

    ``tops`` maps each top-level key to a digest of its structure node (plain values that differ
    between ranks make a key per-rank); ``error`` is set instead when the rank failed before planning."""

    tops: dict[str, str] = field(default_factory=dict)
    per_rank: list[str] = field(default_factory=list)
    tensors: list[InventoryRow] = field(default_factory=list)
    error: str | None = None

    @classmethod
    def of(cls, flat: Flat) -> Inventory:
        rows = []
        for key, t in flat.tensors.items():
            leaf = flat.leaves[key]
            rows.append(InventoryRow(key, leaf.kind, str(t.dtype).removeprefix("torch."), list(leaf.global_shape),
                                     list(leaf.box[0]), list(leaf.box[1]), t.numel() * t.element_size()))
        return cls({k: st.digest(v) for k, v in st.top_items(flat.structure)}, sorted(flat.per_rank), rows)

    def to_json(self) -> dict:
        return {"tops": self.tops, "per_rank": self.per_rank, "tensors": [list(r) for r in self.tensors],
                "error": self.error}

    @classmethod
    def from_json(cls, doc: dict) -> Inventory:
        return cls(doc["tops"], doc["per_rank"], [InventoryRow(*r) for r in doc["tensors"]], doc.get("error"))


@dataclass(frozen=True)
class WriteAssignment:
    """The coordinator's answer to one rank: the indices (into that rank's inventory) of the tensors
    it writes, and the top-level keys saved per rank. ``error`` is set, the same on every rank,
    when the save cannot go ahead: ``mismatch`` says the states do not fit together (a
    :class:`StateMismatchError`); otherwise ``ranks`` failed or did not answer."""

    write: list[int] = field(default_factory=list)
    per_rank: list[str] = field(default_factory=list)
    bytes: int = 0
    error: str | None = None
    mismatch: bool = False
    ranks: list[int] = field(default_factory=list)

    def raise_error(self) -> None:
        if self.error is None:
            return
        if self.mismatch:
            raise StateMismatchError(self.error)
        raise DistributedSaveError(self.error, ranks=self.ranks)

    def to_json(self) -> dict:
        return {"write": self.write, "per_rank": self.per_rank, "bytes": self.bytes, "error": self.error,
                "mismatch": self.mismatch, "ranks": self.ranks}

    @classmethod
    def from_json(cls, doc: dict) -> WriteAssignment:
        return cls(**doc)


# -- talking between ranks ------------------------------------------------------------------------

class Comm(abc.ABC):
    """The ranks of one Checkpointer, talking through a key-value store (see the module docstring)."""

    rank: int
    world: int
    timeout: float

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

    def peek(self, key: str) -> dict | None:
        """The value of ``key`` if it is set now (no waiting)."""
        raw = self._get(key, time.monotonic())
        return None if raw is None else json.loads(raw)

    def propose(self, key: str, value: dict) -> dict:
        """Set ``key`` to ``value`` unless some rank set it first; return what it holds (the first
        proposal wins, on every rank)."""
        return json.loads(self._compare_set(key, json.dumps(value).encode()))

    def set(self, key: str, value: dict) -> None:
        self._put(key, json.dumps(value).encode())

    def get(self, key: str, deadline: float) -> dict | None:
        raw = self._get(key, deadline)
        return None if raw is None else json.loads(raw)

    def _deadline(self, factor: float = 1.0) -> float:
        return time.monotonic() + factor * self.timeout

    # -- the plan ----------------------------------------------------------------------------------
    def exchange_plan(self, seq: int, inventory: Inventory) -> WriteAssignment:
        """Send this rank's inventory; the coordinator answers every rank with its assignment.
        Raises the assignment's error (the same on every rank) if the save cannot go ahead."""
        deadline = self._deadline()
        self.set(f"p/{seq}/inv/{self.rank}", inventory.to_json())
        if self.rank == 0:
            invs, missing = [], []
            for r in range(self.world):
                v = self.get(f"p/{seq}/inv/{r}", deadline)
                if v is None:
                    missing.append(r)
                invs.append(Inventory.from_json(v) if v is not None else Inventory())
            if missing:
                answers = [WriteAssignment(error=f"rank(s) {missing} did not join the save plan within "
                                                 f"{self.timeout:.0f}s (the state's structure must change on "
                                                 "every rank at the same save)", ranks=missing)] * self.world
            else:
                answers = assign(invs)
            for r in range(self.world):
                self.set(f"p/{seq}/plan/{r}", answers[r].to_json())
        doc = self.get(f"p/{seq}/plan/{self.rank}", deadline + self.timeout)
        if doc is None:
            raise DistributedSaveError(f"rank {self.rank}: no save plan from rank 0 within {2 * self.timeout:.0f}s",
                                       ranks=[0])
        answer = WriteAssignment.from_json(doc)
        answer.raise_error()
        return answer

    def fail_plan(self, seq: int, message: str) -> None:
        """This rank failed before or while planning: tell the coordinator at once."""
        try:
            self.set(f"p/{seq}/inv/{self.rank}", Inventory(error=message).to_json())
        except DistributedSaveError:
            pass

    # -- reports and decisions ---------------------------------------------------------------------
    def report(self, seq: int, doc: dict) -> None:
        self.set(f"q/{seq}/r/{self.rank}", doc)

    def gather(self, seq: int) -> tuple[dict[int, dict], list[int]]:
        """Coordinator: every rank's report for ``seq``, and the ranks that did not report in time."""
        deadline = self._deadline()
        reports, missing = {}, []
        for r in range(self.world):
            v = self.get(f"q/{seq}/r/{r}", deadline)
            if v is None:
                missing.append(r)
            else:
                reports[r] = v
                if v.get("status") in ("fail", "nonfinite"):  # no need to wait long for the rest once one rank failed
                    deadline = min(deadline, time.monotonic() + min(self.timeout, 5.0))
        return reports, missing

    def send_part(self, seq: int, data: bytes) -> None:
        """A rank's report for save ``seq``, for the coordinator (when reports live in local tiers only)."""
        self._put(f"q/{seq}/part/{self.rank}", data)

    def part(self, seq: int, rank: int) -> bytes | None:
        return self._get(f"q/{seq}/part/{rank}", self._deadline())

    def publish(self, seq: int, doc: dict) -> None:
        self.set(f"q/{seq}/result", doc)

    def decision(self, seq: int) -> dict | None:
        return self.get(f"q/{seq}/result", self._deadline(2))

    def go(self, seq: int, doc: dict) -> None:
        self.set(f"q/{seq}/go", doc)

    def wait_go(self, seq: int) -> dict | None:
        return self.get(f"q/{seq}/go", self._deadline(2))

    def forget(self, seq: int) -> None:
        """Delete the keys of save ``seq - KEEP_SEQS`` (coordinator only)."""
        old = seq - KEEP_SEQS
        if old < 0:
            return
        keys = [f"q/{old}/result", f"q/{old}/go"] + [f"q/{old}/r/{r}" for r in range(self.world)]
        keys += [f"q/{old}/part/{r}" for r in range(self.world)]
        keys += [f"p/{old}/inv/{r}" for r in range(self.world)] + [f"p/{old}/plan/{r}" for r in range(self.world)]
        for k in keys:
            if not self._delete(k):
                return

    # -- load agreement ----------------------------------------------------------------------------
    def agree(self, value: dict) -> list[dict]:
        """Every rank's ``value`` for this round of agreement (all ranks call it in the same order)."""
        n = self._rounds
        self._rounds += 1
        deadline = self._deadline()
        self.set(f"l/{n}/{self.rank}", value)
        out = []
        for r in range(self.world):
            v = self.get(f"l/{n}/{r}", deadline)
            if v is None:
                raise DistributedSaveError(f"rank {r} did not reach load within {self.timeout:.0f}s", ranks=[r])
            out.append(v)
        return out

    _rounds = 0


class LocalComm(Comm):
    """A process saving alone: rank 0 of 1, its own coordinator, waiting for nobody."""

    def __init__(self, timeout: float = 600.0):
        self.rank, self.world, self.timeout = 0, 1, timeout
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
        # Keyed by the group object (kept alive here, so its id is never reused): a group made after
        # destroy_process_group() starts counting again, as it does on a freshly started rank.
        pg = group if group is not None else c10d._get_default_group()
        entry = _instances.setdefault(id(pg), (pg, itertools.count()))
        name = getattr(pg, "group_name", None) or "default"
        self._base = base
        self._prefix = f"ckpt/{name}/{next(entry[1])}/"
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


# -- the planner ----------------------------------------------------------------------------------

def _top(key: str, tops: list[str]) -> str | None:
    head = key.split("/", 1)[0]
    return head if head in tops else None


def assign(invs: list[Inventory]) -> list[WriteAssignment]:
    """Who writes what: one :class:`WriteAssignment` per rank, or the same error for every rank.

    * A top-level key is per-rank when some rank declares it (``PerRank``, ``RNGState``) or its
      plain values differ between ranks; every tensor under it is written by its own rank.
    * Every other tensor must exist on every rank with the same dtype and global shape. Distinct
      boxes must not overlap and must cover the tensor. A box held by several ranks (replicated
      tensors, ``Replicate`` placements) is written once, by the candidate with the fewest bytes so
      far, largest boxes first, so the bytes to write are balanced across ranks.
    """
    world = len(invs)
    bad = [r for r, inv in enumerate(invs) if inv.error is not None]
    if bad:
        msg = "; ".join(f"rank {r}: {invs[r].error}" for r in bad)
        return [WriteAssignment(error=f"save failed on rank(s) {bad}: {msg}", ranks=bad)] * world

    def mismatch(msg: str) -> list[WriteAssignment]:
        return [WriteAssignment(error=msg + " (every rank must save the same state structure; wrap per-rank "
                                "state in ckpt.PerRank)", mismatch=True)] * world

    tops0 = list(invs[0].tops)
    for r, inv in enumerate(invs[1:], 1):
        if sorted(inv.tops) != sorted(tops0):
            return mismatch(f"the state's top-level keys differ between ranks: rank 0 has {sorted(tops0)}, "
                            f"rank {r} has {sorted(inv.tops)}")
    per_rank = set().union(*(set(inv.per_rank) for inv in invs))
    for k in tops0:
        if len({inv.tops[k] for inv in invs}) > 1:
            per_rank.add(k)

    loads = [0] * world
    writes: list[list[int]] = [[] for _ in range(world)]
    shared: dict[str, _Shared] = {}
    for r, inv in enumerate(invs):
        for i, row in enumerate(inv.tensors):
            if row.kind == "rank" or _top(row.key, tops0) in per_rank:
                writes[r].append(i)
                loads[r] += row.nbytes
                continue
            meta = (row.kind, row.dtype, tuple(row.global_shape))
            ent = shared.setdefault(row.key, _Shared(meta))
            if ent.meta != meta:
                k0, d0, s0 = ent.meta
                return mismatch(f"tensor {row.key!r} differs between ranks: {k0} {d0}{list(s0)} on one, "
                                f"{row.kind} {row.dtype}{list(row.global_shape)} on rank {r}")
            ent.ranks.add(r)
            ent.boxes.setdefault((tuple(row.offsets), tuple(row.lengths)), []).append((r, i, row.nbytes))

    items = []
    for key, ent in shared.items():
        if len(ent.ranks) != world:
            lacking = sorted(set(range(world)) - ent.ranks)
            return mismatch(f"tensor {key!r} is missing on rank(s) {lacking}")
        boxes = [b for b in ent.boxes if volume(b[1]) > 0]
        shape = ent.meta[2]
        if sum(volume(b[1]) for b in boxes) != volume(shape) or (
                len(boxes) <= 512 and any(intersect(a, b) for a, b in itertools.combinations(boxes, 2))):
            desc = ", ".join(f"{list(o)}+{list(n)}" for o, n in sorted(boxes)[:6])
            return mismatch(f"the shards of {key!r} do not tile its global shape {list(shape)} exactly "
                            f"(boxes {desc}{' …' if len(boxes) > 6 else ''})")
        for box, holders in ent.boxes.items():
            items.append((holders[0][2], key, box, holders))
    # Forced items (one holder) first, then the rest, largest first: greedy balancing.
    items.sort(key=lambda it: (len(it[3]) > 1, -it[0], it[1], it[2]))
    for _nbytes, _key, _box, holders in items:
        r, i, nbytes = min(holders, key=lambda h: (loads[h[0]], h[0]))
        writes[r].append(i)
        loads[r] += nbytes
    return [WriteAssignment(sorted(w), sorted(per_rank), loads[r]) for r, w in enumerate(writes)]


@dataclass
class _Shared:
    """A tensor that is not per-rank, as every rank holds it: boxes and the (rank, index, bytes) holding each."""

    meta: tuple[str, str, tuple[int, ...]]  # kind, dtype, global shape
    boxes: dict[Box, list[tuple[int, int, int]]] = field(default_factory=dict)
    ranks: set[int] = field(default_factory=set)
