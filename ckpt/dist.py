"""Coordination between ranks: the save plan, rank reports, the commit decision.

Nothing here issues a collective on the training's process group. Ranks talk through the process
group's key-value store (the TCPStore that ``torchrun``/``init_process_group`` set up), under a
prefix private to one :class:`~ckpt.Checkpointer`, and every wait has a deadline. Keys are
namespaced by the save call's sequence number, which is the same on every rank because every rank
calls ``save`` in the same order:

=========================  =====================================================================
``p/<seq>/inv/<rank>``     a rank's tensor inventory, when its state's structure changed
``p/<seq>/plan/<rank>``    the coordinator's answer: which tensors that rank writes
``q/<seq>/r/<rank>``       a rank's report for the save: ok (chunks and rank file durable), fail, skip
``q/<seq>/result``         the coordinator's decision: committed, failed (naming ranks) or skipped
``q/<seq>/free``           the coordinator finished everything queued up to this save (retention),
                           so other ranks may start writing the next save's chunks
``l/<n>/<rank>``           agreement on which step a ``load`` ends up loading
=========================  =====================================================================

:func:`assign` (the planner) is a pure function of every rank's inventory, so it is tested alone.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import threading
import time
from datetime import timedelta
from typing import Any

from .errors import DistributedSaveError, StateMismatchError
from .sharding import intersect, volume

log = logging.getLogger("ckpt")

_instances: dict[int, tuple[Any, itertools.count]] = {}
KEEP_SEQS = 16  # store keys of the last few saves are kept (slow ranks may still read them)


def node_digest(node: Any) -> str:
    return hashlib.blake2b(json.dumps(node, sort_keys=True).encode(), digest_size=16).hexdigest()


class Comm:
    """One process, no process group: the coordinator is this process and waits for nobody."""

    rank = 0
    world = 1
    distributed = False

    def describe(self) -> str:
        return "single process"


class StoreComm(Comm):
    """Ranks of a process group, talking through its store."""

    distributed = True

    def __init__(self, group, timeout: float):
        import torch.distributed as dist  # noqa: PLC0415
        from torch.distributed import distributed_c10d as c10d  # noqa: PLC0415

        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.timeout = timeout
        base = None
        if group is not None and hasattr(c10d, "_get_process_group_store"):
            try:
                base = c10d._get_process_group_store(group)
            except Exception:  # noqa: BLE001 - fall back to the default store
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
        prefix = f"ckpt/{name}/{next(entry[1])}/"
        self._base = base
        self._prefix = prefix
        self._local = threading.local()
        self._load_n = 0

    def describe(self) -> str:
        return f"rank {self.rank} of {self.world}"

    # -- store access (one connection per thread) -------------------------------------------------
    @property
    def store(self):
        s = getattr(self._local, "store", None)
        if s is None:
            import torch.distributed as dist  # noqa: PLC0415

            base = self._base
            try:
                base = base.clone()
            except Exception:  # noqa: BLE001 - stores without clone() are shared
                pass
            s = self._local.store = dist.PrefixStore(self._prefix, base)
        return s

    def set(self, key: str, value: dict) -> None:
        try:
            self.store.set(key, json.dumps(value).encode())
        except Exception as e:  # noqa: BLE001
            raise DistributedSaveError(f"rank {self.rank}: cannot reach the process group's store ({e}); "
                                       "rank 0 or the launcher may have died", ranks=[0]) from e

    def get(self, key: str, deadline: float) -> dict | None:
        """The value of ``key`` once it is set, or None if ``deadline`` passes first."""
        remaining = deadline - time.monotonic()
        try:
            if remaining <= 0:
                if not self.store.check([key]):
                    return None
            else:
                self.store.wait([key], timedelta(seconds=remaining))
            return json.loads(self.store.get(key))
        except Exception as e:  # noqa: BLE001
            if "timeout" in str(e).lower() or "timed out" in str(e).lower():
                return None
            raise DistributedSaveError(f"rank {self.rank}: cannot reach the process group's store ({e}); "
                                       "rank 0 or the launcher may have died", ranks=[0]) from e

    def forget(self, seq: int) -> None:
        """Delete the keys of save ``seq - KEEP_SEQS`` (coordinator only)."""
        old = seq - KEEP_SEQS
        if old < 0:
            return
        keys = [f"q/{old}/result", f"q/{old}/free"] + [f"q/{old}/r/{r}" for r in range(self.world)]
        keys += [f"p/{old}/inv/{r}" for r in range(self.world)] + [f"p/{old}/plan/{r}" for r in range(self.world)]
        for k in keys:
            try:
                self.store.delete_key(k)
            except Exception:  # noqa: BLE001 - not every store can delete; keys are small
                return

    # -- the plan -------------------------------------------------------------------------------
    def exchange_plan(self, seq: int, inventory: dict) -> dict:
        """Send this rank's inventory; the coordinator answers every rank with its assignment."""
        deadline = time.monotonic() + self.timeout
        self.set(f"p/{seq}/inv/{self.rank}", inventory)
        if self.rank == 0:
            invs, missing = [], []
            for r in range(self.world):
                v = self.get(f"p/{seq}/inv/{r}", deadline)
                if v is None:
                    missing.append(r)
                invs.append(v)
            if missing:
                answers = [{"error": f"rank(s) {missing} did not join the save plan within {self.timeout:.0f}s "
                                     "(the state's structure must change on every rank at the same save)",
                            "ranks": missing}] * self.world
            else:
                answers = assign(invs)
            for r in range(self.world):
                self.set(f"p/{seq}/plan/{r}", answers[r])
        answer = self.get(f"p/{seq}/plan/{self.rank}", deadline + self.timeout)
        if answer is None:
            raise DistributedSaveError(f"rank {self.rank}: no save plan from rank 0 within {2 * self.timeout:.0f}s",
                                       ranks=[0])
        if "error" in answer:
            if answer.get("kind") == "mismatch":
                raise StateMismatchError(answer["error"])
            raise DistributedSaveError(answer["error"], ranks=answer.get("ranks", []))
        return answer

    def fail_plan(self, seq: int, message: str) -> None:
        """This rank failed before or while planning: tell the coordinator at once."""
        try:
            self.set(f"p/{seq}/inv/{self.rank}", {"error": message})
        except DistributedSaveError:
            pass

    # -- reports and results --------------------------------------------------------------------
    def report(self, seq: int, status: str, **info: Any) -> None:
        self.set(f"q/{seq}/r/{self.rank}", {"status": status, **info})

    def gather(self, seq: int) -> tuple[dict[int, dict], list[int]]:
        """Coordinator: every rank's report for ``seq`` (ranks that did not report in time: missing)."""
        deadline = time.monotonic() + self.timeout
        reports, missing = {}, []
        for r in range(self.world):
            v = self.get(f"q/{seq}/r/{r}", deadline)
            if v is None:
                missing.append(r)
            else:
                reports[r] = v
                if v.get("status") == "fail":  # no need to wait for the rest once one rank failed
                    deadline = min(deadline, time.monotonic() + min(self.timeout, 5.0))
        return reports, missing

    def publish(self, seq: int, result: dict) -> None:
        self.set(f"q/{seq}/result", result)

    def result(self, seq: int) -> dict | None:
        return self.get(f"q/{seq}/result", time.monotonic() + 2 * self.timeout)

    def free(self, seq: int) -> None:
        self.set(f"q/{seq}/free", {})

    def wait_free(self, seq: int) -> bool:
        return self.get(f"q/{seq}/free", time.monotonic() + 2 * self.timeout) is not None

    # -- load agreement -------------------------------------------------------------------------
    def agree(self, value: dict) -> list[dict]:
        """Every rank's ``value`` for this round of agreement (all ranks call it in the same order)."""
        n = self._load_n
        self._load_n += 1
        deadline = time.monotonic() + self.timeout
        self.set(f"l/{n}/{self.rank}", value)
        out = []
        for r in range(self.world):
            v = self.get(f"l/{n}/{r}", deadline)
            if v is None:
                raise DistributedSaveError(f"rank {r} did not reach load within {self.timeout:.0f}s", ranks=[r])
            out.append(v)
        return out


def make_comm(process_group, timeout: float) -> Comm:
    try:
        import torch.distributed as dist  # noqa: PLC0415
    except ImportError:  # pragma: no cover - torch without distributed
        return Comm()
    if not (dist.is_available() and dist.is_initialized()):
        return Comm()
    if dist.get_world_size(process_group) == 1:
        return Comm()
    return StoreComm(process_group, timeout)


# -- the planner ------------------------------------------------------------------------------------

def inventory(flat, tops_digest: dict[str, str]) -> dict:
    """What the coordinator needs to know about one rank's state to plan the save."""
    tensors = []
    for key, t in flat.tensors.items():
        leaf = flat.leaves[key]
        tensors.append([key, leaf.kind, str(t.dtype).removeprefix("torch."), list(leaf.global_shape),
                        list(leaf.box[0]), list(leaf.box[1]), t.numel() * t.element_size()])
    return {"tops": tops_digest, "per_rank": sorted(flat.per_rank), "tensors": tensors}


def _top(key: str, tops: list[str]) -> str | None:
    head = key.split("/", 1)[0]
    return head if head in tops else None


def assign(invs: list[dict]) -> list[dict]:
    """Who writes what. Every rank gets ``{"write": [tensor indices], "per_rank": [top keys]}``, or
    every rank gets the same ``{"error": ...}``.

    * A top-level key is per-rank when some rank declares it (``PerRank``, ``RNGState``) or its
      plain values differ between ranks; every tensor under it is written by its own rank.
    * Every other tensor must exist on every rank with the same dtype and global shape. Distinct
      boxes must not overlap and must cover the tensor. A box held by several ranks (replicated
      tensors, ``Replicate`` placements) is written once, by the candidate with the fewest bytes so
      far, largest boxes first, so the bytes to write are balanced across ranks.
    """
    world = len(invs)
    bad = [r for r, inv in enumerate(invs) if "error" in inv]
    if bad:
        msg = "; ".join(f"rank {r}: {invs[r]['error']}" for r in bad)
        return [{"error": f"save failed on rank(s) {bad}: {msg}", "ranks": bad}] * world

    def mismatch(msg: str) -> list[dict]:
        return [{"error": msg + " (every rank must save the same state structure; wrap per-rank state in "
                        "ckpt.PerRank)", "kind": "mismatch"}] * world

    tops0 = list(invs[0]["tops"])
    for r, inv in enumerate(invs[1:], 1):
        if sorted(inv["tops"]) != sorted(tops0):
            return mismatch(f"the state's top-level keys differ between ranks: rank 0 has {sorted(tops0)}, "
                            f"rank {r} has {sorted(inv['tops'])}")
    per_rank = set().union(*(set(inv["per_rank"]) for inv in invs))
    for k in tops0:
        if len({inv["tops"][k] for inv in invs}) > 1:
            per_rank.add(k)

    loads = [0] * world
    writes: list[list[int]] = [[] for _ in range(world)]
    # key -> {"meta": (kind, dtype, shape), "boxes": {box: [(rank, index)]}}
    shared: dict[str, dict] = {}
    order: list[str] = []
    for r, inv in enumerate(invs):
        for i, (key, kind, dtype, gshape, offs, lens, nbytes) in enumerate(inv["tensors"]):
            top = _top(key, tops0)
            if kind == "rank" or top in per_rank:
                writes[r].append(i)
                loads[r] += nbytes
                continue
            ent = shared.get(key)
            if ent is None:
                ent = shared[key] = {"meta": (kind, dtype, tuple(gshape)), "boxes": {}, "ranks": set()}
                order.append(key)
            elif ent["meta"] != (kind, dtype, tuple(gshape)):
                k0, d0, s0 = ent["meta"]
                return mismatch(f"tensor {key!r} differs between ranks: {k0} {d0}{list(s0)} on one, "
                                f"{kind} {dtype}{list(gshape)} on rank {r}")
            ent["ranks"].add(r)
            ent["boxes"].setdefault((tuple(offs), tuple(lens)), []).append((r, i, nbytes))

    items = []
    for key in order:
        ent = shared[key]
        if len(ent["ranks"]) != world:
            lacking = sorted(set(range(world)) - ent["ranks"])
            return mismatch(f"tensor {key!r} is missing on rank(s) {lacking}")
        boxes = [b for b in ent["boxes"] if volume(b[1]) > 0]
        shape = ent["meta"][2]
        if sum(volume(b[1]) for b in boxes) != volume(shape) or (
                len(boxes) <= 512 and any(intersect(a, b) for a, b in itertools.combinations(boxes, 2))):
            desc = ", ".join(f"{list(o)}+{list(n)}" for o, n in sorted(boxes)[:6])
            return mismatch(f"the shards of {key!r} do not tile its global shape {list(shape)} exactly "
                            f"(boxes {desc}{' …' if len(boxes) > 6 else ''})")
        for box, holders in ent["boxes"].items():
            items.append((holders[0][2], key, box, holders))
    # Forced items (one holder) first, then the rest, largest first: greedy balancing.
    items.sort(key=lambda it: (len(it[3]) > 1, -it[0], it[1], it[2]))
    for nbytes, _key, _box, holders in items:
        r, i, _ = min(holders, key=lambda h: (loads[h[0]], h[0]))
        writes[r].append(i)
        loads[r] += nbytes
    return [{"write": sorted(w), "per_rank": sorted(per_rank), "bytes": loads[r]} for r, w in enumerate(writes)]
