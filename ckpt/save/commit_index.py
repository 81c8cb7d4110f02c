"""Rank 0's step index from the ranks' summaries: a commit that does not read and merge N rank reports.

Every rank, once its rank report is written, sends a summary of it with its commit report
(:func:`summarize`): the report's stored size and digest, the digest of its *layout* (every tensor's
key, dtype, shape, owner and boxes, in order, without segments), the digest of each top-level value of
its structure (the small per-rank values themselves), its stats, its chunk table (a few entries per
rank at scale) and the segments of the small global tensors the index inlines. That is a few hundred
bytes per rank, where a report repeats the whole structure and a segment per tensor.

The coordinator (:class:`IndexBuilder`, one per job) learns the step's layout (which rank holds which
box of which tensor) once per plan: from the plan round (:mod:`ckpt.save.commit_plan`) where every rank's
summarized boxes are what the plan predicts, else by reading the reports one at a time (each checked
to be the bytes and layout its summary names); afterwards each save checks only that every rank's layout
digest is the one it learned, and builds the index from that, the summaries and the structure values
it holds (by digest, in a cache bounded by bytes). What it commits is checked as before: the merged
chunk table's chains, and the index parsed back as every reader parses it (each layout tiling its
tensor's shape, the size cap) by :func:`ckpt.format.index.committable`. Two ranks describing a chunk
differently is the one case it hands back (None): the caller then reads every report (the old path).
"""

from __future__ import annotations

import itertools
import json
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from concurrent.futures import Executor, Future
from typing import Any

import xxhash

from .. import tree as st
from .._version import __version__
from ..errors import DistributedSaveError, StateMismatchError
from ..format import index, paths, tree_union
from ..format import manifest as mf
from ..format.boxes import Box
from ..format.entries import Segment, closure, ints
from ..storage import Storage
from .commit_plan import PlanLayout, boxes_digest
from .committer import check_merged_chunks, commit_bytes
from .planning import MISMATCH_HINT

VALUE_BYTES = 4096  # a per-rank top-level value up to this many JSON bytes travels in the summary itself
CACHE_BYTES = 256 << 20  # the structure values the coordinator keeps, by digest


Row = tuple[str, str, list, Any, list]  # a report's tensor: key, dtype, shape, owner, [[offsets, lengths], ...]


def _rows(part: mf.Manifest) -> list[Row]:
    return [(t.key, t.dtype, t.shape, t.rank, [[s.offsets, s.lengths] for s in t.shards]) for t in part.tensors]


def _digest(rows: list[Row]) -> str:
    h = xxhash.xxh3_128()
    for row in rows:
        h.update(json.dumps(row, separators=(",", ":")).encode())
        h.update(b"\n")
    return h.hexdigest()


def layout_digest(part: mf.Manifest) -> str:
    """The digest of a report's layout: each tensor's key, dtype, shape, owner and boxes, in order."""
    return _digest(_rows(part))


def _lean(data: bytes, step: int, rank: int) -> tuple[list[Row], list[tuple[str, Any]]]:
    """A report's layout rows and top-level structure values, without the checked parse of its
    segments and chunks (every reader checks those; the index built from the rows is parsed back)."""
    try:
        doc = json.loads(data)
        if doc["kind"] != "rank" or doc["rank"] != rank or doc["step"] != step:
            raise ValueError(f"it describes rank {doc['rank']} step {doc['step']}")
        rows: list[Row] = []
        for t in doc["tensors"]:
            boxes = [[s["offsets"], s["lengths"]] for s in t["shards"]]
            if not (isinstance(t["key"], str) and isinstance(t["dtype"], str) and ints(t["shape"])
                    and all(ints(o) and ints(n) for o, n in boxes)):
                raise ValueError(f"tensor entry {str(t['key'])[:80]!r} is malformed")
            rows.append((t["key"], t["dtype"], t["shape"], t.get("rank"), boxes))
        tops = st.top_items(doc["structure"])
    except (ValueError, KeyError, TypeError, IndexError, RecursionError) as e:
        raise DistributedSaveError(f"rank {rank}'s report for step {step} is unreadable: {e}", ranks=[rank]) from e
    return rows, tops


def _inlinable(t: mf.TensorEntry) -> bool:
    """Whether ``t``'s segments may be inlined in the index (:func:`ckpt.format.index.inlined`; its shard
    count across the ranks is the coordinator's to know, so a rank sends those that pass the rest)."""
    return t.rank is None and t.nbytes <= index.INLINE_BYTES


def summarize(part: mf.Manifest, data: bytes | bytearray, per_rank: frozenset[str] | set[str]) -> dict:
    """What a rank sends with its commit report about its rank report ``part``, stored as ``data``."""
    tops = st.top_items(part.structure)
    values = {}
    for k, v in tops:
        if k in per_rank and len(text := json.dumps(v, separators=(",", ":"))) <= VALUE_BYTES:
            values[k] = json.loads(text)
    inline = {t.key: [[[g.chunk, g.offset, g.length] for g in s.segments] for s in t.shards]
              for t in part.tensors if _inlinable(t)}
    need = closure(part.chunks, [g[0] for per in inline.values() for segs in per for g in segs])
    return {"size": len(data), "digest": xxhash.xxh3_128_hexdigest(data), "layout": layout_digest(part),
            "boxes": boxes_digest(part),
            "tops": {k: st.digest(v) for k, v in tops}, "values": values, "stats": part.stats,
            "chunks": {h: c.to_json() for h, c in part.chunks.items()},
            "spans": {h: c.spans for h, c in need.items() if c.spans is not None}, "inline": inline}


def _chunk(doc: Any, spans: str | None) -> mf.ChunkInfo:
    size, stored, codec, *base = doc
    return mf.ChunkInfo(size, stored, codec, base[0] if base else None, spans)


class _Values:
    """Structure values by digest, the least recently used dropped past ``max_bytes`` (as weighed)."""

    def __init__(self, max_bytes: int = CACHE_BYTES):
        self.max_bytes, self.bytes = max_bytes, 0
        self._by_digest: OrderedDict[str, tuple[Any, int]] = OrderedDict()

    def get(self, d: str) -> Any | None:
        got = self._by_digest.get(d)
        if got is None:
            return None
        self._by_digest.move_to_end(d)
        return got[0]

    def put(self, d: str, node: Any, size: int) -> None:
        if d in self._by_digest:
            self._by_digest.move_to_end(d)
            return
        self._by_digest[d] = (node, size)
        self.bytes += size
        while self.bytes > self.max_bytes and len(self._by_digest) > 1:
            self.bytes -= self._by_digest.popitem(last=False)[1][1]


def _streamed(io: Executor | None, fn: Callable[[int], Any], items: range, window: int = 8) -> Iterator[Any]:
    """``fn`` of each item, in order, at most ``window`` in flight (not every result held at once).
    A consumer that stops early (an error in what it does with a result) cancels the reads not begun."""
    if io is None:
        yield from map(fn, items)
        return
    it = iter(items)
    pending: list[Future] = [io.submit(fn, x) for _, x in zip(range(window), it)]
    try:
        while pending:
            yield pending.pop(0).result()
            for x in itertools.islice(it, 1):
                pending.append(io.submit(fn, x))
    finally:
        for f in reversed(pending):  # the newest first: a worker freed meanwhile finds the next cancelled
            f.cancel()


class IndexBuilder:
    """The coordinator's half: the layout it learned (per rank, the layout digest it was learned
    from) and the structure values it holds; :meth:`build` makes each save's index from summaries."""

    def __init__(self, cache_bytes: int = CACHE_BYTES):
        self.digests: list[str] | None = None  # per rank, the layout digest the layout was learned from
        self.tensors: list[tuple[str, str, tuple[int, ...], int | None, int]] = []  # key, dtype, shape, owner, layout
        self.layouts: list[index.Layout] = []
        self.values = _Values(cache_bytes)
        self.learned = 0  # times the layout was learned from the reports (once per plan, where the plan did not say it)
        self.planned = 0  # times the layout was taken from the save plan (no report read)

    # -- learning the layout, once per plan ----------------------------------------------------------
    def _learn(self, step: int, own: mf.Manifest, summaries: list[dict], read: Callable[[int], bytes],
               io: Executor | None) -> None:
        nodes: dict[tuple[int, int, tuple], int] = {}  # (parent node, rank, boxes) -> node: layouts hash-consed
        links: list[tuple[int, int, tuple]] = []
        at: dict[tuple[str, int | None], int] = {}  # tensor -> its layout so far (a node)
        meta: dict[tuple[str, int | None], tuple[str, tuple[int, ...], int]] = {}  # dtype, shape, first rank

        def fetch(r: int) -> tuple[list[Row], list[tuple[str, Any]]]:
            if r == 0:
                return _rows(own), st.top_items(own.structure)
            s = summaries[r]
            data = read(r)
            if len(data) != s["size"] or xxhash.xxh3_128_hexdigest(data) != s["digest"]:
                raise DistributedSaveError(f"rank {r}'s report for step {step} is not the one it summarized "
                                           f"({len(data)} bytes stored, {s['size']} summarized)", ranks=[r])
            return _lean(data, step, r)

        for r, (rows, tops) in enumerate(_streamed(io, fetch, range(len(summaries)))):
            if _digest(rows) != summaries[r]["layout"]:
                raise DistributedSaveError(f"rank {r}'s report for step {step} does not hold the layout it "
                                           "summarized (a bug: please report it)", ranks=[r])
            self._keep_values(tops)
            for key, dtype, shape, owner, boxes in rows:
                k = (key, owner)
                have = meta.setdefault(k, (dtype, tuple(shape), r))
                if have[:2] != (dtype, tuple(shape)):
                    raise StateMismatchError(
                        f"step {step} was not committed: rank {r} saved tensor {key!r} as {dtype} of shape "
                        f"{shape}, rank {have[2]} as {have[0]} of shape {list(have[1])}; every rank must hold "
                        "the same tensors" + MISMATCH_HINT)
                link = (at.get(k, -1), r, tuple((tuple(o), tuple(n)) for o, n in boxes))
                at[k] = nodes.setdefault(link, len(links))
                if at[k] == len(links):
                    links.append(link)
        whole: dict[int, index.Layout] = {}

        def unfold(node: int) -> index.Layout:
            out: list[tuple[int, Box]] = []
            while node >= 0:
                parent, r, boxes = links[node]
                out.extend((r, b) for b in reversed(boxes))
                node = parent
            return tuple(reversed(out))

        ids: dict[index.Layout, int] = {}
        self.tensors = []
        for k, node in at.items():
            lay = whole.get(node)
            if lay is None:
                lay = whole[node] = unfold(node)
            dtype, shape, _ = meta[k]
            self.tensors.append((k[0], dtype, shape, k[1], ids.setdefault(lay, len(ids))))
        self.layouts = list(ids)
        self.digests = [s["layout"] for s in summaries]
        self.learned += 1

    def _adopt(self, plan: Callable[[], PlanLayout | None] | None, summaries: list[dict]) -> bool:
        """Take the layout from the save plan if every rank's report holds the (tensor, box) pairs
        the plan says it writes (:mod:`ckpt.save.commit_plan`); False where it cannot say or a rank differs."""
        got = plan() if plan is not None else None
        if got is None or got.digests != [s.get("boxes") for s in summaries]:
            return False
        self.tensors, self.layouts = got.tensors, got.layouts
        self.digests = [s["layout"] for s in summaries]
        self.planned += 1
        return True

    def _keep_values(self, tops: list[tuple[str, Any]]) -> None:
        for _, v in tops:
            self.values.put(st.digest(v), v, 4 * len(json.dumps(v)))  # parsed: about 4x its JSON

    # -- each save -----------------------------------------------------------------------------------
    def build(self, step: int, own: mf.Manifest, summaries: list[dict], per_rank: frozenset[str],
              read: Callable[[int], bytes], io: Executor | None = None,
              plan: Callable[[], PlanLayout | None] | None = None
              ) -> tuple[index.Index, dict[str, mf.ChunkInfo]] | None:
        """The index of ``step`` from every rank's summary (rank 0's report ``own`` in hand; ``read(r)``
        the bytes of rank ``r``'s stored report, for what the summaries do not carry), and the step's
        chunk table (without span digests). None where two ranks list a chunk differently: the
        caller merges the reports themselves. ``plan``: the layout the save plan gives (taken
        instead of reading the reports where every rank's summary matches it)."""
        world = len(summaries)
        chunks: dict[str, mf.ChunkInfo] = {}
        for s in summaries:
            for h, doc in s["chunks"].items():
                info = _chunk(doc, s["spans"].get(h))
                have = chunks.get(h)
                if have is None:
                    chunks[h] = info
                elif have != info:
                    return None
                elif have.spans is None and info.spans is not None:
                    chunks[h] = info
        check_merged_chunks(step, chunks)
        if self.digests != [s["layout"] for s in summaries] and not self._adopt(plan, summaries):
            self._learn(step, own, summaries, read, io)
        self._keep_values(st.top_items(own.structure))
        structure = self._structure(step, own, summaries, per_rank, read)
        stats: dict[str, Any] = {}
        for s in summaries:
            for k, v in s["stats"].items():
                if isinstance(v, (int, float)):
                    stats[k] = stats.get(k, 0) + v
        entries = []
        for key, dtype, shape, owner, lay in self.tensors:
            shards = self.layouts[lay]
            segs = None
            if index.inlined(owner, dtype, shape, len(shards)):
                segs = tuple(self._inline(step, summaries, key, shards))
            entries.append(index.IndexEntry(key, dtype, shape, lay, owner, segs))
        inline_chunks = closure(chunks, [g.chunk for e in entries for per in e.segments or () for g in per])
        refs = [index.ReportRef(paths.rank_key(step, r), s["size"], s["digest"]) for r, s in enumerate(summaries)]
        ix = index.Index(step=step, world_size=world, structure=structure, tensors=entries, layouts=self.layouts,
                         reports=refs, created=time.time(), writer=f"ckpt {__version__}", stats=stats,
                         chunks=inline_chunks)
        return ix, chunks

    @staticmethod
    def _inline(step: int, summaries: list[dict], key: str, shards: index.Layout) -> Iterator[tuple[Segment, ...]]:
        seen: dict[int, int] = {}
        for r, _ in shards:
            i = seen[r] = seen.get(r, -1) + 1
            per = summaries[r]["inline"].get(key)
            if per is None or i >= len(per):
                raise DistributedSaveError(f"rank {r}'s summary for step {step} lacks the segments of tensor "
                                           f"{key!r} (a bug: please report it)", ranks=[r])
            yield tuple(Segment(c, o, n) for c, o, n in per[i])

    def _structure(self, step: int, own: mf.Manifest, summaries: list[dict], per_rank: frozenset[str],
                   read: Callable[[int], bytes]) -> dict:
        """The step's structure as :func:`ckpt.format.manifest.merge` makes it, from the values'
        digests: each distinct value once (from the cache, the summary, or else one report read)."""
        tops = [k for k, _ in st.top_items(own.structure)]
        for r, s in enumerate(summaries):
            if sorted(s["tops"]) != sorted(tops):
                raise StateMismatchError(f"step {step}: rank {r} saved top-level keys {sorted(s['tops'])}, rank 0 "
                                         f"saved {sorted(tops)}; every rank must save the same keys" + MISMATCH_HINT)

        def value(r: int, k: str) -> Any:
            s = summaries[r]
            if k in s["values"]:
                return s["values"][k]
            got = self.values.get(s["tops"][k])
            if got is None:
                tops = dict(_lean(read(r), step, r)[1])
                self._keep_values(list(tops.items()))
                got = tops[k]
                if st.digest(got) != s["tops"][k]:
                    raise DistributedSaveError(f"rank {r}'s report for step {step} does not hold the structure it "
                                               "summarized (a bug: please report it)", ranks=[r])
            return got

        values = []
        for k in tops:
            united = None
            if k not in per_rank:
                distinct: dict[str, Any] = {}
                for r, s in enumerate(summaries):
                    d = s["tops"][k]
                    if d not in distinct:
                        distinct[d] = value(r, k)
                united = tree_union.unite(list(distinct.values()))
            values.append(st.per_rank_node([value(r, k) for r in range(len(summaries))])
                          if united is None else united)
        return st.dict_node(tops, values)


def commit_summarized(storage: Storage, builder: IndexBuilder, step: int, own: mf.Manifest, summaries: list[dict],
                      per_rank: frozenset[str], io: Executor | None = None,
                      plan: Callable[[], PlanLayout | None] | None = None
                      ) -> tuple[index.Index, dict[str, mf.ChunkInfo]] | None:
    """Rank 0's commit of ``step`` from every rank's summary: the index :meth:`IndexBuilder.build`
    makes (reading a rank's stored report only where the summaries do not carry what it needs),
    written create-only as the step's manifest. None, nothing written, where two ranks list a chunk
    differently (the caller then reads and merges every report). The Checkpointer's and ckpt.dcp's
    commit (:class:`ckpt.save.commit.CommitProtocol`), and what benchmarks/scale_sim.py runs."""
    built = builder.build(step, own, summaries, per_rank,
                          lambda r: read_report(storage, step, r, summaries[r]["size"]), io, plan)
    if built is not None:
        commit_bytes(storage, step, index.committable(step, built[0], []))
    return built


def read_report(storage: Storage, step: int, rank: int, size: int) -> bytes:
    """Rank ``rank``'s report as stored (``size`` bytes, as it summarized it)."""
    try:
        return bytes(storage.read_object(paths.rank_key(step, rank), size))
    except (FileNotFoundError, OSError) as e:
        key = paths.rank_key(step, rank)
        raise DistributedSaveError(f"rank {rank}'s report {key} is unreadable: {e}", ranks=[rank]) from e
