"""Restore from peers: which rank's tier holds what of a step (:func:`survey`), whether the step can
be recovered from the tiers (:func:`recoverable`), and getting every rank the chunks it needs from a
peer or rebuilt from parity (:func:`fetch`). Each call is a collective over the peers' own group."""

from __future__ import annotations

import json
import logging
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import numpy as np

from ..errors import CheckpointError, CorruptCheckpointError
from ..format import manifest as mf
from ..format import paths
from ..redundancy_config import Parity
from . import erasure
from .exchange import Item, Peers, PeerStats, Transfer

log = logging.getLogger("ckpt")


@dataclass
class Survey:
    """Which rank's tier holds what of one step (the same on every rank)."""

    step: int
    holders: dict[str, list[int]] = field(default_factory=dict)  # chunk -> ranks holding it
    parity: dict[str, list[int]] = field(default_factory=dict)  # parity file name -> ranks holding it
    layouts: dict[int, erasure.GroupLayout] = field(default_factory=dict)
    persisted: bool = False  # the step is committed remotely too

    def lost(self, hashes: Iterable[str]) -> list[str]:
        return sorted(h for h in hashes if not self.holders.get(h))


def survey(peers: Peers, step: int, m: mf.Manifest, persisted: bool) -> Survey:
    """Every rank's holdings of step ``step`` (one gather)."""
    hashes = sorted(m.chunks)
    held = bytearray((len(hashes) + 7) // 8)
    for i, h in enumerate(hashes):
        if peers.local.exists(paths.chunk_key(h)):
            held[i // 8] |= 1 << (i % 8)
    d = paths.step_dir(step)
    names = [n for n in peers.local.list(d) if n.startswith("parity-")]
    layouts = {}
    for n in names:
        if n.endswith(".json"):
            try:
                layouts[n] = json.loads(peers.local.read(f"{d}/{n}", 0, mf.MAX_MANIFEST_BYTES))
            except (ValueError, FileNotFoundError):
                pass
    docs = peers.gather({"held": bytes(held), "parity": [n for n in names if not n.endswith(".json")],
                        "layouts": layouts})
    s = Survey(step, persisted=persisted)
    for r, doc in enumerate(docs):
        bits = np.unpackbits(np.frombuffer(doc["held"], np.uint8), bitorder="little")[: len(hashes)]
        for i in np.flatnonzero(bits).tolist():
            s.holders.setdefault(hashes[i], []).append(r)
        for n in doc["parity"]:
            s.parity.setdefault(n, []).append(r)
        for n, lay in doc["layouts"].items():
            if n not in {x.name for x in s.layouts.values()}:
                parsed = erasure.GroupLayout.from_json(lay, f"{paths.step_dir(step)}/{n}")
                s.layouts[parsed.group] = parsed
    return s


# How one member is rebuilt: per stripe, (stripe number, k blocks as (block number, source rank, item, size))
RebuildPlan = list[tuple[int, list[tuple[int, int, Item, int]]]]


def _rebuild_plan(peers: Peers, s: Survey, group: int, pos: int, dst: int) -> RebuildPlan:
    """How ``dst`` rebuilds member ``pos`` of ``group``: per stripe holding its data, k blocks as
    (block number, source rank, item, size). Raises CorruptCheckpointError if a stripe has fewer."""
    lay = s.layouts[group]
    out = []
    for st in lay.stripes:
        mine = [q for p, q in st.data if p == pos]
        if not mine or st.length == 0:  # nothing of the member here, or no bytes at all (no parity files)
            continue
        blocks: list[tuple[int, int, Item, int]] = []
        for b, (p, q) in enumerate(st.data):
            if p == pos:
                continue
            mem = lay.members[p]
            a, e = mem.segment(q, lay.k)
            pieces = mem.pieces(a, e)
            holders = set.intersection(*[set(s.holders.get(h, [])) for h, _, _ in pieces]) if pieces else {dst}
            if holders:
                src = dst if dst in holders else min(holders)
                blocks.append((b, src, ("seg", group, p, q), e - a))
        for j in range(lay.m):
            name = lay.parity_name(st.index, j)
            holders_p = s.parity.get(name, [])
            if holders_p:
                src = dst if dst in holders_p else min(holders_p)
                blocks.append((lay.k + j, src, ("par", group, name), st.length))
        if len(blocks) < lay.k:
            raise CorruptCheckpointError(
                f"step {s.step}: rank {lay.members[pos].rank}'s chunks are gone from every local tier, and stripe "
                f"{st.index} of parity group {group} has {len(blocks)} of the {lay.k} blocks needed to rebuild "
                "them (more failure domains were lost than the parity covers)")
        out.append((st.index, blocks[: lay.k]))
    return out


def _unrecoverable(peers: Peers, s: Survey, hashes: Iterable[str]
                   ) -> tuple[dict[tuple[int, int], list[str]], str | None]:
    """Lost chunks by the (group, member) that rebuilds them, and why some cannot be (None: all can)."""
    by_member: dict[tuple[int, int], list[str]] = defaultdict(list)
    for h in s.lost(hashes):
        where = next(((g, p) for g, lay in s.layouts.items() if (p := lay.member_of(h)) is not None), None)
        if where is None:
            return by_member, (f"chunk {h} is held by no surviving local tier" +
                               (" and no parity layout covers it" if isinstance(peers.redundancy, Parity) else ""))
        by_member[where].append(h)
    for g, p in by_member:
        try:
            _rebuild_plan(peers, s, g, p, peers.rank)
        except CorruptCheckpointError as e:
            return by_member, str(e)
    return by_member, None


def recoverable(peers: Peers, s: Survey, m: mf.Manifest) -> tuple[bool, str]:
    """Whether every chunk of the step can be had from the local tiers (a peer's, or rebuilt)."""
    _, why = _unrecoverable(peers, s, m.chunks)
    if why is None:
        return True, ""
    return s.persisted, why


def fetch(peers: Peers, s: Survey, m: mf.Manifest, needed: Iterable[str] | None,
          keep: Callable[[str, memoryview], None], coming: Callable[[set[str]], None] | None = None
          ) -> PeerStats:
    """Collective: every rank gets the chunks it ``needed`` (None: it failed before it could say,
    and every rank raises) from peers or rebuilt from parity, each verified, then handed to
    ``keep(storage key, bytes)``. ``coming(hashes)``: once planned, before any bytes move, the
    chunks this rank will be given (the others it lacks are read from the checkpoint path)."""
    order = _read_order(m)
    mine = None if needed is None else sorted((h for h in set(needed) if peers.rank not in s.holders.get(h, [])),
                                              key=lambda h: (order.get(h, len(order)), h))
    every = peers.gather({"ok": needed is not None, "needs": mine or []})
    bad = [r for r, d in enumerate(every) if not d["ok"]]
    if bad:
        raise CheckpointError(f"rank(s) {bad} could not plan the load of step {s.step} (their own errors say "
                              "why); load again once that is mended")
    plan: list[Transfer] = []
    load = [0] * peers.world
    # This rank's rebuild, one stripe per round: (group, member, stripe, its k blocks); a member's chunks.
    decodes: list[tuple[int, int, int, list[tuple[int, int, Item, int]]]] = []
    members: dict[tuple[int, int], list[str]] = {}
    rounds = 1
    for dst, doc in enumerate(every):
        lost = []
        for h in doc["needs"]:
            holders = [r for r in s.holders.get(h, []) if r != dst]
            if not holders:
                lost.append(h)
                continue
            src = min(holders, key=lambda r: (load[r], r))
            size = m.chunks[h].stored
            load[src] += size
            plan.append(Transfer(src, dst, ("chunk", h), size))
        by_member, why = _unrecoverable(peers, s, lost)
        if why is not None and not s.persisted:
            raise CorruptCheckpointError(f"step {s.step} cannot be recovered from the local tiers: {why}")
        n = 0  # the rebuilder decodes stripe n as soon as round n brought its blocks, then drops them
        for (g, p), hashes in sorted((by_member if why is None else {}).items()):
            if dst == peers.rank:
                members[(g, p)] = hashes
            for t, blocks in _rebuild_plan(peers, s, g, p, dst):
                length = s.layouts[g].stripes[t].length  # segments arrive padded to it, as zfec wants them
                plan += [Transfer(src, dst, item, size, length, round=n) for _, src, item, size in blocks
                         if src != dst]
                if dst == peers.rank:
                    decodes.append((g, p, t, blocks))
                n += 1
        rounds = max(rounds, n)
    if coming is not None:
        coming({t.item[1] for t in plan if t.dst == peers.rank and t.item[0] == "chunk"} |
               {h for hashes in members.values() for h in hashes})
    stats = PeerStats()
    got: dict[Item, bytes | memoryview] = {}
    segs: dict[tuple[int, int], list[tuple[int, int, memoryview]]] = defaultdict(list)

    def read(item: Item, out: memoryview) -> int:
        return _read_item(peers, s, item, out)

    def received(src: int, item: Item, data: memoryview) -> None:
        if item[0] == "chunk":
            peers.store_chunk(item[1], data, keep)
            stats.peer_chunks += 1
        else:
            got[item] = data  # the received buffer itself, alive as long as this view

    def decode(n: int) -> None:
        """Round n's stripe of this rank's rebuild: its member's segment decoded, the blocks dropped."""
        if n < len(decodes):
            g, p, t, blocks = decodes[n]
            try:
                have: dict[int, bytes | bytearray | memoryview] = {
                    b: got[item] if item in got else _read_own(peers, s, item, size) for b, _, item, size in blocks}
                segs[(g, p)].append(_decode(s, g, p, t, have))
            finally:
                got.clear()

    peers.exchange(plan, read, received, stats, rounds=rounds, after_round=decode)
    for (g, p), hashes in members.items():
        stats.rebuilt_chunks += _keep_rebuilt(peers, s, g, p, segs[(g, p)], hashes, keep)
    return stats


def _read_order(m: mf.Manifest) -> dict[str, int]:
    """Each chunk's place in the manifest's tensors, shards and segments: the order a loader's feeds
    take them in. A rank's chunks travel in that order, so the loader's threads (fewer than the
    chunks) wait for the ones that come first instead of holding out for the last ones while the
    first sit in memory."""
    out: dict[str, int] = {}
    for t in m.tensors:
        for shard in t.shards:
            for g in shard.segments:
                out.setdefault(g.chunk, len(out))
    return out


def _read_item(peers: Peers, s: Survey, item: Item, out: memoryview) -> int:
    """Item ``item`` of this rank's tier into ``out``; its length."""
    if item[0] == "chunk":
        return peers.read_whole(paths.chunk_key(item[1]), out)
    if item[0] == "par":
        return peers.read_whole(f"{paths.step_dir(s.step)}/{item[2]}", out)
    _, g, p, q = item
    mem = s.layouts[g].members[p]
    a, e = mem.segment(q, s.layouts[g].k)
    return peers.read_range(mem, a, e, out)


def _read_own(peers: Peers, s: Survey, item: Item, size: int) -> memoryview:
    """A block of this rank's own rebuild that its tier holds."""
    out = memoryview(bytearray(size))
    if _read_item(peers, s, item, out) != size:
        raise CorruptCheckpointError(f"{item[0]} {item[1:]} in this rank's local tier {peers.local.root} is not "
                                     f"{size} bytes: the tier is damaged (delete that step there, or the whole "
                                     "tier: peers rebuild it on the next load)")
    return out


def _decode(s: Survey, g: int, pos: int, t: int, have: dict[int, bytes | bytearray | memoryview]
            ) -> tuple[int, int, memoryview]:
    """Member ``pos``'s segment in stripe ``t`` of group ``g``, decoded from k of the stripe's blocks:
    (start, end) of the member's data, and its bytes."""
    lay = s.layouts[g]
    st = lay.stripes[t]
    b = next(i for i, (p, _) in enumerate(st.data) if p == pos)
    a, e = lay.members[pos].segment(st.data[b][1], lay.k)
    return a, e, memoryview(erasure.decode(lay.k, lay.m, have, st.length, b))[: e - a]


def _keep_rebuilt(peers: Peers, s: Survey, g: int, pos: int, segs: list[tuple[int, int, memoryview]],
                  wanted: list[str], keep: Callable[[str, memoryview], None]) -> int:
    """Member ``pos`` of group ``g``, rebuilt (its decoded segments): its chunks in ``wanted``
    verified and kept."""
    mem = s.layouts[g].members[pos]
    segs = sorted((x for x in segs if x[1] > x[0]), key=lambda x: x[0])

    def span(start: int, end: int) -> memoryview:
        """Bytes [start, end) of the member: a view when one segment holds them, else joined."""
        parts = [v[max(start, a) - a: min(end, e) - a] for a, e, v in segs if a < end and e > start]
        if len(parts) == 1:
            return parts[0]
        out = bytearray()
        for part in parts:
            out += part
        return memoryview(out)

    off, n, want = 0, 0, set(wanted)
    for h, size in mem.objects:
        if h in want:
            try:
                peers.store_chunk(h, span(off, off + size), keep)
            except CorruptCheckpointError as e:
                raise CorruptCheckpointError(f"step {s.step}: chunk {h} rebuilt from parity group {g} does not "
                                             f"verify ({e}); the parity blocks are damaged", chunk=h) from e
            n += 1
        off += size
    log.info("rebuilt %d chunk(s) (%.1f MiB) of rank %d's tier from parity group %d", n, mem.size / 2**20,
             mem.rank, g)
    return n
