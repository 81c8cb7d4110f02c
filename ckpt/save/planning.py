"""Who writes what in a save: the planner's records and :func:`assign`, a pure function of every
rank's :class:`Inventory` (tested alone, without any process group). The ranks exchange these
records through one coordination round (:func:`exchange_plan`)."""

from __future__ import annotations

import base64
import hashlib
import json
import zlib
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

from .. import tree as st
from ..errors import DistributedSaveError, StateMismatchError
from ..flatten import Flat, tensor_of
from ..format import tree_union
from ..format.boxes import Box, check_tiles

if TYPE_CHECKING:
    from ..ranks import Comm, Gathered

# -- the planner's records -------------------------------------------------------------------------

class InventoryRow(NamedTuple):
    """One tensor of a rank's state, as the planner sees it: or one piece of it, where the rank holds
    several (rows of the same key, each with its own box)."""

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
    between ranks make a key per-rank); ``layouts`` each top-level key not declared per-rank to its
    :func:`ckpt.format.tree_union.layout` (read only where the digests differ: ranks holding different
    keys); ``error`` is set instead when the rank failed before planning."""

    tops: dict[str, str] = field(default_factory=dict)
    per_rank: list[str] = field(default_factory=list)
    tensors: list[InventoryRow] = field(default_factory=list)
    error: str | None = None
    layouts: dict[str, str] = field(default_factory=dict)

    @classmethod
    def of(cls, flat: Flat) -> Inventory:
        rows = []
        for key, t in flat.tensors.items():
            leaf = flat.leaves[key]
            rows.append(InventoryRow(tensor_of(key, leaf), leaf.kind, str(t.dtype).removeprefix("torch."),
                                     list(leaf.global_shape), list(leaf.box[0]), list(leaf.box[1]),
                                     t.numel() * t.element_size()))
        tops = st.top_items(flat.structure)
        return cls({k: st.digest(v) for k, v in tops}, sorted(flat.per_rank), rows,
                   layouts={k: tree_union.layout(v) for k, v in tops if k not in flat.per_rank})

    def to_json(self) -> dict:
        return {"tops": self.tops, "per_rank": self.per_rank, "tensors": [list(r) for r in self.tensors],
                "error": self.error, "layouts": self.layouts}

    @classmethod
    def from_json(cls, doc: dict) -> Inventory:
        return cls(doc["tops"], doc["per_rank"], [InventoryRow(*r) for r in doc["tensors"]], doc.get("error"),
                   doc.get("layouts", {}))


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
    fresh: list[int] = field(default_factory=list)  # of ``write``: where a pack of small replicated ones begins

    def raise_error(self) -> None:
        if self.error is None:
            return
        if self.mismatch:
            raise StateMismatchError(self.error)
        raise DistributedSaveError(self.error, ranks=self.ranks)

    def to_json(self) -> dict:
        return {"write": self.write, "per_rank": self.per_rank, "bytes": self.bytes, "error": self.error,
                "mismatch": self.mismatch, "ranks": self.ranks, "fresh": self.fresh}

    @classmethod
    def from_json(cls, doc: dict) -> WriteAssignment:
        return cls(**doc)


# -- the planner ----------------------------------------------------------------------------------

def top_of(key: str, tops: set[str] | dict[str, str]) -> str | None:
    """The top-level key of ``key`` where it is one of ``tops``, else None."""
    head = key.split("/", 1)[0]
    return head if head in tops else None


PACK_BELOW = 64 * 1024  # a replicated box smaller than this is packed with its like, not balanced alone


def assign(invs: list[Inventory], chunk_size: int = 16 << 20) -> list[WriteAssignment]:
    """Who writes what: one :class:`WriteAssignment` per rank, or the same error for every rank.

    * A top-level key is per-rank when some rank declares it (``PerRank``, ``RNGState``) or its
      plain values differ between ranks; every tensor under it is written by its own rank.
    * A top-level key whose ranks hold different entries, and the same thing where they hold the
      same path (pipeline stages: :mod:`ckpt.format.tree_union`), is one state: their union. A tensor
      under it may be held by some ranks only.
    * Every other tensor must exist on every rank; every tensor has the same dtype and global shape
      wherever it is held. Distinct boxes (a rank may hold several: pieces) must not overlap and
      must cover the tensor. A box held by several ranks (replicated tensors, ``Replicate``
      placements) is written once, by the candidate with the fewest bytes so far, largest boxes
      first, so the bytes to write are balanced across ranks.
    * Small boxes held by several ranks (below :data:`PACK_BELOW` and a quarter chunk: AdamW's 0-d
      ``step`` per parameter) are packed, not spread one per rank: those held by the same ranks go
      together in packs of at most ``chunk_size`` bytes, each pack to the holder with the fewest bytes
      so far, last in its buffer and starting a chunk of its own (``fresh``). A rank loading them then
      reads one chunk per pack it needs, not a chunk of every rank; the balance moves by at most a
      pack per rank.
    """
    world = len(invs)
    bad = [r for r, inv in enumerate(invs) if inv.error is not None]
    if bad:
        msg = "; ".join(f"rank {r}: {invs[r].error}" for r in bad)
        return [WriteAssignment(error=f"save failed on rank(s) {bad}: {msg}", ranks=bad)] * world

    def mismatch(msg: str) -> list[WriteAssignment]:
        return [WriteAssignment(error=msg + MISMATCH_HINT, mismatch=True)] * world

    tops0 = list(invs[0].tops)
    for r, inv in enumerate(invs[1:], 1):
        if sorted(inv.tops) != sorted(tops0):
            return mismatch(f"the state's top-level keys differ between ranks: rank 0 has {sorted(tops0)}, "
                            f"rank {r} has {sorted(inv.tops)}")
    per_rank = set().union(*(set(inv.per_rank) for inv in invs))
    united = set()  # top-level keys whose ranks hold different entries of one state
    for k in tops0:
        if len({inv.tops[k] for inv in invs}) > 1:
            if k not in per_rank and tree_union.unionable([inv.layouts.get(k) for inv in invs]):
                united.add(k)
            else:
                per_rank.add(k)

    loads = [0] * world
    writes: list[list[int]] = [[] for _ in range(world)]
    shared: dict[str, _Shared] = {}
    for r, inv in enumerate(invs):
        for i, row in enumerate(inv.tensors):
            if row.kind == "rank" or top_of(row.key, inv.tops) in per_rank:
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
        if len(ent.ranks) != world and top_of(key, invs[0].tops) not in united:
            lacking = sorted(set(range(world)) - ent.ranks)
            return mismatch(f"tensor {key!r} is missing on rank(s) {lacking}")
        shape = ent.meta[2]
        why = check_tiles(list(ent.boxes), shape)
        if why is not None:
            held = "" if len(ent.ranks) == world else f" among the ranks holding it, {sorted(ent.ranks)}"
            return mismatch(not_tiled(key, shape, list(ent.boxes), why, held))
        for box, holders in ent.boxes.items():
            items.append((holders[0][2], key, box, holders))
    small = min(PACK_BELOW, chunk_size // 4)  # below the layout's "large": packed into shared chunks
    packed = [it for it in items if len(it[3]) > 1 and it[0] < small]
    # Forced items (one holder) first, then the rest, largest first: greedy balancing.
    items = sorted((it for it in items if len(it[3]) == 1 or it[0] >= small),
                   key=lambda it: (len(it[3]) > 1, -it[0], it[1], it[2]))
    for _nbytes, _key, _box, holders in items:
        r, i, nbytes = min(holders, key=lambda h: (loads[h[0]], h[0]))
        writes[r].append(i)
        loads[r] += nbytes
    out = [sorted(w) for w in writes]
    fresh: list[list[int]] = [[] for _ in range(world)]
    for pack in in_packs(packed, chunk_size):
        r = min((h[0] for h in pack[0][3]), key=lambda q: (loads[q], q))
        fresh[r].append(len(out[r]))
        for _nbytes, _key, _box, holders in pack:
            i, nbytes = next((i, n) for q, i, n in holders if q == r)
            out[r].append(i)
            loads[r] += nbytes
    return [WriteAssignment(w, sorted(per_rank), loads[r], fresh=[w[j] for j in fresh[r]])
            for r, w in enumerate(out)]


MISMATCH_HINT = " (every rank must save the same state structure; wrap per-rank state in ckpt.PerRank)"


def not_tiled(key: str, shape: tuple[int, ...], boxes: list[Box], why: str, held: str = "") -> str:
    """What :func:`assign` says when the distinct boxes of ``key`` do not tile its global shape."""
    boxes = sorted(boxes)
    desc = ", ".join(f"{list(o)}+{list(n)}" for o, n in boxes[:6])
    return (f"the shards of {key!r} do not tile its global shape {list(shape)} exactly{held}: {why} "
            f"(boxes {desc}{' …' if len(boxes) > 6 else ''})")


def in_packs(items: list[tuple], chunk_size: int, holders: Callable[[tuple], Hashable] | None = None
           ) -> list[list[tuple]]:
    """Small replicated boxes in packs: those with the same holders together, in key order, each pack
    at most ``chunk_size`` bytes as the layout places them (each on a cache line: 64 bytes at least).
    ``holders``: an item's holding ranks, in order, as a hashable (default: from its holder list)."""
    groups: dict[Hashable, list[tuple]] = {}
    for it in sorted(items, key=lambda it: (it[1], it[2])):
        groups.setdefault(tuple(h[0] for h in it[3]) if holders is None else holders(it), []).append(it)
    out: list[list[tuple]] = []
    for group in groups.values():
        size = chunk_size  # the first item opens a pack
        for it in group:
            room = -(-max(it[0], 1) // 64) * 64
            if size + room > chunk_size:
                out.append([])
                size = 0
            out[-1].append(it)
            size += room
    return out


@dataclass
class _Shared:
    """A tensor that is not per-rank, as every rank holds it: boxes and the (rank, index, bytes) holding each."""

    meta: tuple[str, str, tuple[int, ...]]  # kind, dtype, global shape
    boxes: dict[Box, list[tuple[int, int, int]]] = field(default_factory=dict)
    ranks: set[int] = field(default_factory=set)


# -- the plan round -------------------------------------------------------------------------------
# What crosses the store (issue 35 item 5: 40 MB at 64 ranks for a 70B state, 10 GB at 16,384, when
# every rank sent its whole inventory). Most of an inventory is the same on every rank: per top-level
# key, its layout and each tensor's key, kind, dtype and global shape (a "part"). A rank sends a digest
# of each part and, compressed, what is its own: its distinct boxes (with bytes) and which one each
# tensor is, the per-rank tensors whole, its top-level digests (a few hundred bytes for a 70B state).
# The coordinator knows its own parts; for a digest it has not seen (pipeline stages: a part per stage;
# a key whose plain values differ), a second round asks the first rank holding it for the part.
# Answers travel compressed too. Ranks alike are planned from what is distinct among them
# (planning_alike: ~0.1 ms per rank at 70B, where joining every inventory and planning it cost ~40 ms).

def pack(value: object) -> str:
    """``value`` (JSON) as deflated JSON, base64: how an inventory's own part and an answer travel."""
    return base64.b64encode(zlib.compress(json.dumps(value, separators=(",", ":")).encode(), 6)).decode()


def unpack(text: str) -> Any:
    return json.loads(zlib.decompress(base64.b64decode(text)))


def _digest(part: dict) -> str:
    return hashlib.sha256(json.dumps(part, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def ints(values: Any) -> str:
    """Integers (int32, in order) as deflated bytes, base64: a rank's box of each row, the steps of an
    assignment (a list of thousands decodes in microseconds, not as JSON)."""
    import numpy as np

    return base64.b64encode(zlib.compress(np.asarray(values, dtype="<i4").tobytes(), 6)).decode()


def unints(text: str) -> Any:
    """The int32 array :func:`ints` encoded."""
    import numpy as np

    return np.frombuffer(zlib.decompress(base64.b64decode(text)), dtype="<i4")


def split(inv: Inventory) -> tuple[dict[str, dict], dict]:
    """``inv`` as the parts ranks share, by top-level key (its layout; each tensor's key, kind, dtype,
    global shape), and its own part: top-level digests, per-rank keys, the per-rank rows whole (with
    their index), and for the others, in order, the top-level key of each run of rows (``runs``) and
    each row's box and bytes as an index (``cls``) into the rank's distinct ones (``boxes``: a few
    dozen for a 70B state, whatever its thousands of tensors)."""
    parts: dict[str, dict] = {}
    whole: list[list] = []
    boxes: list[list] = []
    seen: dict[tuple, int] = {}
    cls: list[int] = []
    runs: list[list] = []
    for i, row in enumerate(inv.tensors):
        top = top_of(row.key, inv.tops)
        if row.kind == "rank" or top is None or top in inv.per_rank:
            whole.append([i, *row])
            continue
        part = parts.setdefault(top, {"layout": inv.layouts.get(top), "rows": []})
        part["rows"].append([row.key, row.kind, row.dtype, row.global_shape])
        box = (tuple(row.offsets), tuple(row.lengths), row.nbytes)
        if box not in seen:
            seen[box] = len(boxes)
            boxes.append([row.offsets, row.lengths, row.nbytes])
        cls.append(seen[box])
        if runs and runs[-1][0] == top:
            runs[-1][1] += 1
        else:
            runs.append([top, 1])
    for top in inv.layouts:
        parts.setdefault(top, {"layout": inv.layouts[top], "rows": []})
    return parts, {"tops": inv.tops, "per_rank": inv.per_rank, "rows": whole, "boxes": boxes, "runs": runs,
                   "cls": ints(cls)}


def join(parts: dict[str, dict], own: dict) -> Inventory:
    """The inventory :func:`split` took apart."""
    shared = {top: iter(part["rows"]) for top, part in parts.items()}
    whole = {r[0]: InventoryRow(*r[1:]) for r in own["rows"]}
    cls = unints(own["cls"]).tolist()
    tops = (top for top, n in own["runs"] for _ in range(n))
    rows, boxes = [], iter(cls)
    for i in range(len(whole) + len(cls)):
        if i in whole:
            rows.append(whole[i])
            continue
        key, kind, dtype, shape = next(shared[next(tops)])
        offsets, lengths, nbytes = own["boxes"][next(boxes)]
        rows.append(InventoryRow(key, kind, dtype, shape, list(offsets), list(lengths), nbytes))
    return Inventory(own["tops"], own["per_rank"], rows,
                     layouts={top: p["layout"] for top, p in parts.items() if p["layout"] is not None})


def _answer(a: WriteAssignment) -> dict:
    """An assignment as it travels: the tensors written as deflated differences (runs of 1 mostly)."""
    if a.error is not None:
        return a.to_json()
    return {"w": ints([i - before for before, i in zip([-1, *a.write], a.write)]), "f": a.fresh, "p": a.per_rank,
            "b": a.bytes}


def _assignment(doc: dict) -> WriteAssignment:
    if "w" not in doc:
        return WriteAssignment.from_json(doc)
    return WriteAssignment((unints(doc["w"]).cumsum() - 1).tolist(), doc["p"], doc["b"], fresh=doc["f"])


def plan_posted(posted: dict[int, dict], known: dict[str, dict], world: int, chunk_size: int,
                keep: list | None = None) -> list[dict]:
    """The coordinator's answers, one per rank, to what the ranks posted (``known``: every part by its
    digest). Ranks holding the same structure (the ordinary case: FSDP, TP, replicas) are planned
    from what is distinct among them (:func:`ckpt.save.planning_alike.assign_alike`); any other set of
    inventories is joined whole and planned by :func:`assign`. ``keep``: where the alike plan made is
    appended (rank 0's commit takes the step's layout from it)."""
    from .planning_alike import assign_alike

    fast = assign_alike(posted, known, world, chunk_size, keep)
    if fast is not None:
        return fast
    invs = [join({top: known[d] for top, d in posted[r]["d"].items()}, unpack(posted[r]["p"])) for r in range(world)]
    return [_answer(a) for a in assign(invs, chunk_size)]


def exchange_plan(comm: Comm, seq: int, inventory: Inventory, chunk_size: int = 16 << 20,
                  keep: list | None = None) -> WriteAssignment:
    """Send this rank's inventory (digests of the parts ranks share, its own part compressed); the
    coordinator answers every rank with its assignment, after asking in a second round for the parts
    whose digest it has not seen. Raises the assignment's error (the same on every rank) if the save
    cannot go ahead. ``keep`` (coordinator): where the plan of ranks alike is appended, if it was one."""
    parts, own = split(inventory)
    digests = {top: _digest(part) for top, part in parts.items()}
    known = {digests[top]: part for top, part in parts.items()} if comm.rank == 0 else {}
    posted: dict[int, dict] = {}

    def failed(got: Gathered) -> list[dict] | None:
        if got.missing:
            return [WriteAssignment(error=f"rank(s) {got.missing} did not join the save plan within "
                                          f"{comm.timeout:.0f}s (the state's structure must change on every "
                                          "rank at the same save)", ranks=got.missing).to_json()] * comm.world
        if got.errors:
            return [_answer(a) for a in assign([Inventory(error=got.errors.get(r)) for r in range(comm.world)])]
        return None

    def plan() -> list[dict]:
        return plan_posted(posted, known, comm.world, chunk_size, keep)

    def first(got: Gathered) -> list[dict]:
        if (bad := failed(got)) is not None:
            return bad
        posted.update(got.docs)
        asked: dict[str, tuple[int, str]] = {}  # an unseen digest: the first rank holding it, and its key
        for r in range(comm.world):
            for top, d in posted[r]["d"].items():
                if d not in known:
                    asked.setdefault(d, (r, top))
        if not asked:
            return plan()
        send: list[list[str]] = [[] for _ in range(comm.world)]
        for r, top in asked.values():
            send[r].append(top)
        return [{"send": tops} for tops in send]

    def second(got: Gathered) -> list[dict]:
        if (bad := failed(got)) is not None:
            return bad
        for r, sent in got.docs.items():
            for top, text in (sent or {}).items():
                part = unpack(text)
                if _digest(part) != posted[r]["d"].get(top):
                    raise DistributedSaveError(f"rank {r} sent a part of its inventory ({top!r}) that does not "
                                               "match its digest", ranks=[r])
                known[_digest(part)] = part
        return plan()

    what = f"save {seq}'s plan"
    doc = comm.round("plan", seq).run({"d": digests, "p": pack(own)}, first, what=what, each=True)
    if "send" in doc:  # the coordinator lacks parts: this rank sends those it was asked for
        mine = {top: pack(parts[top]) for top in doc["send"]}
        doc = comm.round("plan-parts", seq).run(mine, second, what=what, each=True)
    answer = _assignment(doc)
    answer.raise_error()
    return answer


def fail_plan(comm: Comm, seq: int, error: BaseException) -> None:
    """This rank failed before or while planning save ``seq``: tell the coordinator at once (the
    coordinator tells every rank waiting for a plan)."""
    rnd = comm.round("plan", seq)
    try:
        if comm.rank != 0:
            rnd.post(error)
        else:
            rnd.run(error, what=f"save {seq}'s plan", each=True)  # raises ``error`` back
    except DistributedSaveError:  # the store is gone: the save's own failure says enough
        pass
    except BaseException as e:
        if e is not error:
            raise
