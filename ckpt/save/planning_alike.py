"""The save plan of ranks holding the same structure, from what is distinct among them.

At 16,384 ranks of a 70B state the ranks' inventories hold 47 million rows, but few distinct
things: every rank posts the same parts (same digests), and its own part names a few dozen distinct
boxes (``boxes``) with, per row, which one it is (``cls``). Tensors whose rows are the same box on
every rank (the 80 layers' ``q_proj`` and their two AdamW moments, say) are one *slot class*; tensors
of one dtype and shape with the same slot classes have the same boxes on every rank, so their tiling
is checked once, by the sweep (:func:`ckpt.format.boxes.check_tiles`), and who writes what is
decided with numpy over (slot class × rank), not per row. :func:`assign_alike` gives exactly what
:func:`ckpt.save.planning.assign` gives for the same inventories (the tests compare them), or None where
the inventories are not alike (pipeline stages, keys whose plain values differ between ranks): the
caller then plans them whole. The coordinator's cost per rank is its post's few dozen boxes and its
answer, and its memory what is distinct."""

from __future__ import annotations

import numpy as np

from ..format import tree_union
from ..format.boxes import Box, check_tiles
from .planning import MISMATCH_HINT, PACK_BELOW, WriteAssignment, in_packs, ints, not_tiled, top_of, unints, unpack


class _Holders:
    """The ranks holding one box of the tensors of one class (in rank order, a rank once per row of
    it), and at which position of the class's rows each holds it."""

    __slots__ = ("ranks", "pos", "key", "first")

    def __init__(self, ranks: np.ndarray, pos: np.ndarray):
        self.ranks, self.pos = ranks, pos
        self.key = ranks.tobytes()
        self.first: dict[int, int] = {}  # rank -> the position its first row holding the box is at

    def at(self, r: int) -> int:
        if r not in self.first:
            self.first[r] = int(self.pos[int(np.argmax(self.ranks == r))])
        return self.first[r]


def assign_alike(posted: dict[int, dict], known: dict[str, dict], world: int, chunk_size: int,
                 keep: list | None = None) -> list[dict] | None:
    """Every rank's answer (as it travels) when the ranks' posts are alike: the same parts (but where
    a key holds no tensor), per-rank keys and order of rows; else None.

    Args:
        posted: what each rank posted in the plan round: ``{"d": part digests, "p": packed own part}``.
        known: every part the coordinator has, by digest.
        world: the number of ranks.
        chunk_size: the save's chunk size (packs of small replicated boxes are at most this).
        keep: where given, the plan made is appended to it (rank 0's commit takes the step's layout
            from it: :func:`ckpt.save.commit_plan.from_plan`).

    Returns:
        One answer per rank (:func:`ckpt.save.planning._assignment` reads it), or None.
    """
    plan = AlikePlan(world)
    owns = [unpack(posted[r]["p"]) for r in range(world)]
    if not (plan.read(posted, known, owns) and plan.slots(posted[0]["d"], known) and plan.boxes(owns)):
        return None
    bad = plan.classes(min(PACK_BELOW, chunk_size // 4))
    if bad is not None:
        return [WriteAssignment(error=bad + MISMATCH_HINT, mismatch=True).to_json()] * world  # as assign() answers
    plan.place(chunk_size)
    if keep is not None:
        keep.append(plan)
    return plan.answers()


class AlikePlan:
    """:func:`assign_alike`'s work, in the order it runs."""

    def __init__(self, world: int):
        self.world = world
        self.loads = np.zeros(world, np.int64)
        self.whole: dict[int, list[int]] = {}  # rank -> indices of its per-rank rows (written by itself)
        self.rows_of: dict[int, list[list]] = {}  # rank -> its per-rank rows as posted
        self.kinds: list[tuple] = []  # per tensor class: meta, keys, boxes held (positions x ranks), forced
        self.chosen: list[tuple[str, int, Box]] = []  # a shared box of a tensor, and the rank writing it
        self.index_maps: dict[tuple[int, ...], np.ndarray] = {}

    def read(self, posted: dict[int, dict], known: dict[str, dict], owns: list[dict]) -> bool:
        """Whether the posts are alike; which top-level keys are per-rank (as assign() decides)."""
        d0, tops, runs = posted[0]["d"], owns[0]["tops"], owns[0]["runs"]
        declared = set(owns[0]["per_rank"])
        apart: set[str] = set()  # top-level keys whose digest differs between ranks (plain values, say)
        for r, own in enumerate(owns):
            d = posted[r]["d"]
            if own["runs"] != runs or own["per_rank"] != owns[0]["per_rank"] or d.keys() != d0.keys():
                return False
            if own["tops"] != tops:
                if own["tops"].keys() != tops.keys():
                    return False  # assign() names the keys
                apart.update(k for k, v in tops.items() if own["tops"][k] != v)
            if d != d0 and any(d[k] != v and own["tops"].get(k) == tops.get(k) for k, v in d0.items()):
                return False
        # Such a key is one state if its ranks' layouts unite, else per-rank; its parts may differ
        # only where it holds no tensor (the rows planned here are the same on every rank).
        self.per_rank = set(declared)
        for k in apart:
            digests = {posted[r]["d"].get(k) for r in range(self.world)}
            if len(digests) > 1 and any(known[dg]["rows"] for dg in digests if dg is not None):
                return False
            layouts = [None if dg is None else known[dg]["layout"] for dg in digests]
            if k in declared or not tree_union.unionable(layouts):
                self.per_rank.add(k)
        self.tops, self.runs = tops, runs
        return not any(top in self.per_rank and top not in declared for top, _ in runs)

    def slots(self, d0: dict[str, str], known: dict[str, dict]) -> bool:
        """The rows every rank holds (slots), from the shared parts: key, and (kind, dtype, shape) by key."""
        parts = {top: known[d]["rows"] for top, d in d0.items()}
        at = dict.fromkeys(parts, 0)
        self.slot_keys: list[str] = []
        self.metas: dict[str, tuple[str, str, tuple[int, ...]]] = {}
        for top, n in self.runs:
            if top not in parts or at[top] + n > len(parts[top]):
                return False
            for key, kind, dtype, shape in parts[top][at[top]:at[top] + n]:
                meta = (kind, dtype, tuple(shape))
                if self.metas.setdefault(key, meta) != meta:
                    return False  # assign() names the difference
                self.slot_keys.append(key)
            at[top] += n
        self.key_slots: dict[str, list[int]] = {}
        for j, key in enumerate(self.slot_keys):
            self.key_slots.setdefault(key, []).append(j)
        return all(at[top] == len(rows) for top, rows in parts.items())

    def boxes(self, owns: list[dict]) -> bool:
        """Each rank's distinct boxes, interned; ``boxes_of[s, r]``: the box of slot class ``s`` on rank
        ``r`` (a slot class: the rows that are the same box on every rank)."""
        n_slots = len(self.slot_keys)
        gid: dict[Box, int] = {}
        self.gbox: list[Box] = []
        self.gnb: list[int] = []
        tables: list[np.ndarray] = []
        vectors: dict[str, int] = {}  # a rank's row -> box vector, by its text: a few distinct ones
        vecs: list[np.ndarray] = []
        vid = np.empty(self.world, np.int64)
        for r, own in enumerate(owns):
            ids = []
            for offsets, lengths, nbytes in own["boxes"]:
                box = (tuple(offsets), tuple(lengths))
                g = gid.setdefault(box, len(self.gbox))
                if g == len(self.gbox):
                    self.gbox.append(box)
                    self.gnb.append(nbytes)
                elif self.gnb[g] != nbytes:
                    return False
                ids.append(g)
            tables.append(np.asarray(ids, np.int64))
            v = vectors.setdefault(own["cls"], len(vecs))
            if v == len(vecs):
                vecs.append(unints(own["cls"]).astype(np.int64))
                if len(vecs[v]) != n_slots:
                    return False
            vid[r] = v
            if n_slots and (not ids or int(vecs[v].max()) >= len(ids)):
                return False
            if own["rows"]:
                for row in own["rows"]:
                    if row[2] != "rank" and top_of(row[1], self.tops) not in self.per_rank:
                        return False  # a row assign() would plan with the shared ones
                    self.loads[r] += row[-1]
                self.whole[r] = [row[0] for row in own["rows"]]
                self.rows_of[r] = own["rows"]
        self.slot_cls = np.zeros(0, np.int64)
        self.boxes_of = np.zeros((0, self.world), np.int64)
        if n_slots:
            mat = np.stack(vecs)  # vectors x slots
            _, first, inverse = np.unique(mat.T, axis=0, return_index=True, return_inverse=True)
            self.slot_cls = inverse.reshape(-1)
            cols = mat[:, first]
            self.boxes_of = np.empty((len(first), self.world), np.int64)
            for r in range(self.world):
                self.boxes_of[:, r] = tables[r][cols[vid[r]]]
        return True

    def classes(self, small: int) -> str | None:
        """Tensor classes (one kind, dtype and shape, rows of the same slot classes: the same boxes on
        every rank): each checked once, its forced rows (a box one rank holds) given to their rank, its
        shared boxes listed to balance or pack. What assign() says of the first tensor not tiled, if any."""
        classes: dict[tuple, list[str]] = {}
        for key, js in self.key_slots.items():
            classes.setdefault((self.metas[key], tuple(int(self.slot_cls[j]) for j in js)), []).append(key)
        order = {key: n for n, key in enumerate(self.key_slots)}
        nb = np.asarray(self.gnb, np.int64)
        self.groups: list[tuple[list[int], np.ndarray]] = []  # (slots, forced on each rank)
        self.balanced: list[tuple] = []
        self.packed: list[tuple] = []
        bad: tuple[int, str] | None = None
        for (meta, scs), keys in classes.items():
            held = self.boxes_of[list(scs), :]  # positions x ranks
            flat = held.T.reshape(-1)  # rank-major: the order assign() meets the boxes in
            ids, first_at, counts = np.unique(flat, return_index=True, return_counts=True)
            if bad is None or order[keys[0]] < bad[0]:
                why = check_tiles([self.gbox[g] for g in ids[np.argsort(first_at)]], meta[2])
                if why is not None:
                    bad = (order[keys[0]], not_tiled(keys[0], meta[2], [self.gbox[g] for g in ids], why))
                    continue
            forced = counts[np.searchsorted(ids, held)] == 1
            self.kinds.append((meta, keys, held, forced))
            for p in range(len(scs)):
                self.groups.append(([self.key_slots[k][p] for k in keys], forced[p]))
                self.loads += forced[p] * nb[held[p]] * len(keys)
            shared = counts > 1
            sort = np.argsort(flat, kind="stable")
            starts = np.searchsorted(flat[sort], ids[shared])
            for g, s, c in zip(ids[shared].tolist(), starts.tolist(), counts[shared].tolist()):
                occ = sort[s:s + c]
                holders = _Holders(occ // len(scs), occ % len(scs))
                for key in keys:
                    (self.packed if self.gnb[g] < small else self.balanced).append((self.gnb[g], key,
                                                                                     self.gbox[g], holders))
        return None if bad is None else bad[1]

    def index_of(self, r: int) -> np.ndarray:
        """Rank ``r``'s inventory index of each slot (its per-rank rows interleave with them)."""
        mine = tuple(self.whole.get(r, ()))
        if mine not in self.index_maps:
            keep = np.ones(len(self.slot_keys) + len(mine), bool)
            keep[list(mine)] = False
            self.index_maps[mine] = np.nonzero(keep)[0]
        return self.index_maps[mine]

    def _index(self, r: int, key: str, holders: _Holders) -> int:
        j = self.key_slots[key][holders.at(r)]
        return j if not self.whole else int(self.index_of(r)[j])

    def place(self, chunk_size: int) -> None:
        """The shared boxes: the large ones to the least-loaded holder, largest first; the small ones in
        packs, each to its least-loaded holder (assign()'s order and ties)."""
        loads = self.loads
        self.extra: dict[int, list[int]] = {}
        for nbytes, key, box, holders in sorted(self.balanced, key=lambda it: (-it[0], it[1], it[2])):
            r = int(holders.ranks[int(np.argmin(loads[holders.ranks]))])
            self.chosen.append((key, r, box))
            self.extra.setdefault(r, []).append(self._index(r, key, holders))
            loads[r] += nbytes
        self.tail: dict[int, list[int]] = {}
        self.fresh: dict[int, list[int]] = {}
        for pack in in_packs(self.packed, chunk_size, holders=lambda it: it[3].key):
            hr = pack[0][3].ranks
            r = int(hr[int(np.argmin(loads[hr]))])
            mine = self.tail.setdefault(r, [])
            self.fresh.setdefault(r, []).append(len(mine))
            for nbytes, key, box, holders in pack:
                self.chosen.append((key, r, box))
                mine.append(self._index(r, key, holders))
                loads[r] += nbytes

    def answers(self) -> list[dict]:
        """Each rank's answer: the rows it is forced to write (memoised by the pattern), then the rest."""
        slots = [np.asarray(js, np.int64) for js, _ in self.groups]
        pattern = np.stack([f for _, f in self.groups], axis=1) if self.groups else np.zeros((self.world, 0), bool)
        base: dict[tuple[bytes, tuple[int, ...]], np.ndarray] = {}
        texts: dict[bytes, str] = {}
        out = []
        per_rank = sorted(self.per_rank)
        for r in range(self.world):
            mine = tuple(self.whole.get(r, ()))
            memo = (pattern[r].tobytes(), mine)
            if memo not in base:
                chosen = [slots[k] for k in np.nonzero(pattern[r])[0]]
                rows = self.index_of(r)[np.concatenate(chosen)] if chosen else np.zeros(0, np.int64)
                base[memo] = np.sort(np.concatenate([rows, np.asarray(mine, np.int64)]))
            write = base[memo]
            if r in self.extra:
                write = np.sort(np.concatenate([write, np.asarray(self.extra[r], np.int64)]))
            tail = self.tail.get(r, [])
            if tail:
                write = np.concatenate([write, np.asarray(tail, np.int64)])
            raw = write.tobytes()
            if raw not in texts:
                texts[raw] = ints(np.diff(write, prepend=-1))
            fresh = [int(write[len(write) - len(tail) + k]) for k in self.fresh.get(r, [])]
            out.append({"w": texts[raw], "f": fresh, "p": per_rank, "b": int(self.loads[r])})
        return out
