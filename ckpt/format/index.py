"""The step index (format v6): ``MANIFEST.json`` of a step saved by several ranks.

A whole-step manifest grows as tensors × ranks and every loading rank used to read all of it. The
index holds the step's header and structure once, per tensor its key, dtype, shape and a *layout*
(the list of (rank, box) its shards have: tensors sharded alike share one, so a few dozen layouts
serve thousands of tensors), and per rank the key, byte size and xxh3-128 digest of its report
(``steps/<S>/rank-<r>.json``, a version-5 manifest of ``kind: "rank"``, as before). A loading rank
reads the index, works out which saved ranks hold boxes it needs, and reads only their reports,
each checked against the index (:func:`read_reports`, :func:`partial_step`); a tool that needs the
whole step reads every report (:func:`whole_step`, behind :func:`ckpt.format.manifest.read_step`).
The commit point is still ``MANIFEST.json``, written last; the reports it names are part of the
committed step. ``docs/format.md`` is the specification.
"""

from __future__ import annotations

import json
import logging
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import xxhash

from .. import tree as st
from .._gc import paused
from ..errors import CorruptCheckpointError, ManifestTooLargeError
from ..tree import ITEMSIZE
from . import manifest as mf
from . import spans
from .boxes import Box, check_tiles
from .entries import ALIGN, MAX_WORLD, Segment, Shard, TensorEntry, bad, closure, ints, is_int, parse_chunks
from .paths import manifest_key, rank_key
from .tree_check import problem

if TYPE_CHECKING:
    from ..storage.base import Storage

INDEX_VERSION = 6
# A global tensor of at most INLINE_BYTES in at most INLINE_SHARDS shards has its segments in the index:
# small and saved by few ranks (replicated state each rank saves a part of, a 0-d AdamW step), it is
# what every loading rank needs whole, for which it would read a report per shard. (One sharded over
# more ranks is what each rank loads a part of: its own report holds it.)
INLINE_BYTES = 4096
INLINE_SHARDS = 8
_DIGEST = re.compile(r"^[0-9a-f]{32}$")
log = logging.getLogger("ckpt")

Layout = tuple[tuple[int, Box], ...]  # (saved rank, box) of each shard, in order


@dataclass(frozen=True)
class ReportRef:
    """A rank report as the index names it: its key, byte size and xxh3-128 hex digest."""

    key: str
    size: int
    digest: str


def report_ref(step: int, rank: int, data: bytes | bytearray | memoryview) -> ReportRef:
    """How the index names rank ``rank``'s report whose stored bytes are ``data``."""
    return ReportRef(rank_key(step, rank), len(data), xxhash.xxh3_128_hexdigest(data))


@dataclass(frozen=True)
class IndexEntry:
    """A tensor of the step: its layout is ``Index.layouts[layout]``; ``rank`` as in :class:`TensorEntry`."""

    key: str
    dtype: str
    shape: tuple[int, ...]
    layout: int
    rank: int | None = None
    segments: tuple[tuple[Segment, ...], ...] | None = None  # inlined: per shard of its layout, its segments


@dataclass
class Index:
    step: int
    world_size: int
    structure: dict
    tensors: list[IndexEntry]
    layouts: list[Layout]
    reports: list[ReportRef]
    created: float
    writer: str
    stats: dict[str, Any]
    chunks: dict[str, mf.ChunkInfo] = field(default_factory=dict)  # the inlined tensors' chunks (and bases)
    format_version: int = INDEX_VERSION
    kind: str = "index"
    _entries: dict[tuple[str, int | None], IndexEntry] | None = field(default=None, repr=False, compare=False)

    def to_json(self) -> bytes:
        doc = {"format": mf.FORMAT, "format_version": self.format_version, "writer": self.writer, "kind": "index",
               "step": self.step, "world_size": self.world_size, "created": self.created, "stats": self.stats,
               "structure": self.structure,
               "tensors": [_entry_json(t) for t in self.tensors],
               "layouts": [[[r, list(o), list(n)] for r, (o, n) in lay] for lay in self.layouts],
               "reports": [{"key": x.key, "size": x.size, "digest": x.digest} for x in self.reports]}
        if self.chunks:
            doc["chunks"] = {h: c.to_json() for h, c in self.chunks.items()}
            if (span_doc := spans.to_json(self.chunks)) is not None:
                doc["spans"] = span_doc
        with paused():
            return json.dumps(doc, separators=(",", ":"), allow_nan=False).encode()

    def entries(self) -> dict[tuple[str, int | None], IndexEntry]:
        """The tensors by (key, owner), built once."""
        if self._entries is None:
            self._entries = {(t.key, t.rank): t for t in self.tensors}
        return self._entries

    def skeleton(self) -> mf.Manifest:
        """The step as boxes without bytes: every tensor with its shards' ranks and boxes, no segments
        and no chunks. What a load plans from to learn which reports it needs (:mod:`ckpt.load.index_reads`)."""
        shards = [[Shard(r, list(o), list(n), []) for r, (o, n) in lay] for lay in self.layouts]
        return self._manifest([TensorEntry(t.key, t.dtype, list(t.shape), shards[t.layout], t.rank)
                               for t in self.tensors], {})

    def _manifest(self, tensors: list[TensorEntry], chunks: dict[str, mf.ChunkInfo]) -> mf.Manifest:
        return mf.Manifest(step=self.step, kind="step", structure=self.structure, tensors=tensors, chunks=chunks,
                           world_size=self.world_size, created=self.created, writer=self.writer, stats=self.stats,
                           format_version=self.format_version)  # the step's format as stored (an index)


def _entry_json(t: IndexEntry) -> dict:
    doc: dict[str, Any] = {"key": t.key, "dtype": t.dtype, "shape": list(t.shape), "layout": t.layout}
    if t.rank is not None:
        doc["rank"] = t.rank
    if t.segments is not None:
        doc["segments"] = [[[g.chunk, g.offset, g.length] for g in segs] for segs in t.segments]
    return doc


def inlined(owner: int | None, dtype: str, shape: Sequence[int], shards: int) -> bool:
    """Is a tensor written into the index itself: a small global tensor (AdamW's 0-d ``step``, a bias
    kept on one rank), which every loading rank needs and would read another rank's report for?
    ``owner``: its per-rank owner (None: global); ``shards``: how many shards its layout has."""
    return owner is None and shards <= INLINE_SHARDS and math.prod(shape) * ITEMSIZE[dtype] <= INLINE_BYTES


def _inline(t: TensorEntry) -> bool:
    return inlined(t.rank, t.dtype, t.shape, len(t.shards))


def _layout_of(t: TensorEntry) -> Layout:
    return tuple((s.rank, (tuple(s.offsets), tuple(s.lengths))) for s in t.shards)


def build(m: mf.Manifest, reports: list[ReportRef]) -> Index:
    """The index of whole-step manifest ``m`` (merged from the rank reports ``reports`` name, in rank order)."""
    ids: dict[Layout, int] = {}
    entries = [IndexEntry(t.key, t.dtype, tuple(t.shape), ids.setdefault(_layout_of(t), len(ids)), t.rank,
                          tuple(tuple(sh.segments) for sh in t.shards) if _inline(t) else None) for t in m.tensors]
    chunks = closure(m.chunks, [g.chunk for t in entries for segs in t.segments or () for g in segs])
    return Index(step=m.step, world_size=m.world_size, structure=m.structure, tensors=entries, layouts=list(ids),
                 reports=list(reports), created=m.created, writer=m.writer, stats=m.stats, chunks=chunks)


# -- reading an untrusted index -------------------------------------------------------------------

def parse_doc(doc: dict, name: str) -> Index:
    """An index (the JSON object of a version-6 ``MANIFEST.json``), every field checked: the header,
    the structure, each tensor's dtype, shape and layout, each layout's boxes tiling the shape of
    the tensors that name it (once per layout), and each report's key, size and digest."""
    c = _Checker(name)
    c.check(doc.get("kind") == "index", "a version-6 manifest must be of kind 'index'")
    step: Any = doc.get("step")
    c.check(is_int(step), "step must be a non-negative integer")
    world: Any = doc.get("world_size")
    c.check(is_int(world, 1, MAX_WORLD), f"world_size must be an integer from 1 to {MAX_WORLD}")
    created: Any = doc.get("created", 0.0)
    c.check(type(created) in (int, float) and 0 <= created < 1e11, "created must be a time in seconds")
    writer: Any = doc.get("writer", "")
    c.check(isinstance(writer, str) and len(writer) < 1000, "writer must be a short string")
    stats: Any = doc.get("stats", {})
    c.check(isinstance(stats, dict) and all(isinstance(k, str) and type(v) in (int, float) for k, v in stats.items()),
            "stats must map names to numbers")
    structure: Any = doc.get("structure")
    c.check(st.kind(structure) == "dict" and isinstance(structure.get("k"), list)
            and isinstance(structure.get("v"), list) and len(structure["k"]) == len(structure["v"])
            and all(isinstance(k, str) for k in structure["k"]) and len(set(structure["k"])) == len(structure["k"]),
            "structure must be a dict node of distinct string keys")
    for k, v in st.top_items(structure):
        if st.is_per_rank(v):
            c.check(isinstance(v.get("v"), list) and len(v["v"]) == world,
                    f"per-rank key {k!r} must hold one value per rank ({world})")
    layouts = [_parse_layout(x, world, c) for x in _list(doc.get("layouts"), "layouts", c)]
    chunks = parse_chunks(doc.get("chunks", {}), name)
    spans.parse(doc.get("spans"), chunks, name)
    tensors: list[IndexEntry] = []
    seen: set[tuple[str, int | None]] = set()
    shape_of: dict[int, tuple[int, ...]] = {}  # each layout's boxes tile one shape (checked once)
    for t in _list(doc.get("tensors"), "tensors", c):
        e = _parse_entry(t, world, layouts, chunks, c)
        c.check((e.key, e.rank) not in seen, f"tensor {e.key!r} is listed twice")
        seen.add((e.key, e.rank))
        lay = layouts[e.layout]
        if e.layout not in shape_of:
            c.check(all(len(o) == len(e.shape) for _, (o, _) in lay), f"the layout of tensor {e.key!r} has boxes "
                    f"of another dimension than its shape {list(e.shape)}")
            why = check_tiles([b for _, b in lay], e.shape)
            c.check(why is None, f"the shards of tensor {e.key!r} (layout {e.layout}) do not tile its shape "
                    f"{list(e.shape)}: {why}")
            shape_of[e.layout] = e.shape
        c.check(shape_of[e.layout] == e.shape, f"tensor {e.key!r} of shape {list(e.shape)} names layout {e.layout}, "
                f"whose boxes tile shape {list(shape_of[e.layout])}")
        c.check(e.rank is None or all(r == e.rank for r, _ in lay), f"per-rank tensor {e.key!r} of rank {e.rank} "
                "names shards of other ranks")
        tensors.append(e)
    why = problem(structure, {t.key for t in tensors})
    c.check(why is None, f"its structure holds {why}")
    _check_inline_chunks(tensors, layouts, chunks, c)
    raw_reports = _list(doc.get("reports"), "reports", c)
    c.check(len(raw_reports) == world, f"reports must name one report per rank ({world})")
    reports = [_parse_report(x, step, r, c) for r, x in enumerate(raw_reports)]
    return Index(step=step, world_size=world, structure=structure, tensors=tensors, layouts=layouts, reports=reports,
                 created=float(created), writer=writer, stats=stats, chunks=chunks,
                 format_version=doc["format_version"])


class _Checker:
    def __init__(self, name: str):
        self.name = name

    def check(self, cond: bool, what: str) -> None:
        if not cond:
            raise bad(self.name, what)


def _list(v: Any, what: str, c: _Checker) -> list:
    c.check(isinstance(v, list), f"{what} must be a list")
    return v


def _parse_layout(x: Any, world: int, c: _Checker) -> Layout:
    c.check(isinstance(x, list), "a layout must be a list of [rank, offsets, lengths]")
    out = []
    for s in x:
        c.check(isinstance(s, list) and len(s) == 3 and is_int(s[0], 0, world - 1) and ints(s[1]) and ints(s[2])
                and len(s[1]) == len(s[2]) <= 64, "a layout's shard must be [rank, offsets, lengths] of a saved rank")
        out.append((s[0], (tuple(s[1]), tuple(s[2]))))
    return tuple(out)


def _parse_entry(t: Any, world: int, layouts: list[Layout], chunks: dict[str, mf.ChunkInfo], c: _Checker
                 ) -> IndexEntry:
    c.check(isinstance(t, dict) and isinstance(t.get("key"), str), "tensor entry without a key")
    key = t["key"]
    owner = t.get("rank")
    c.check(owner is None or is_int(owner, 0, world - 1), f"tensor {key!r} names a rank outside the world size")
    dtype = t.get("dtype")
    c.check(isinstance(dtype, str) and dtype in ITEMSIZE, f"tensor {key!r} has unknown dtype {str(dtype)[:40]!r}")
    shape: Any = t.get("shape")
    c.check(ints(shape) and len(shape) <= 64, f"tensor {key!r} has a bad shape")
    c.check(is_int(t.get("layout"), 0, len(layouts) - 1), f"tensor {key!r} names no layout of the index")
    raw: Any = t.get("segments")
    if raw is None:
        return IndexEntry(key, dtype, tuple(shape), t["layout"], owner)
    lay = layouts[t["layout"]]
    c.check(inlined(owner, dtype, shape, len(lay)),
            f"tensor {key!r} is inlined, but is not a global tensor of at most {INLINE_BYTES} bytes in at most "
            f"{INLINE_SHARDS} shards")
    per_shard = _list(raw, f"segments of tensor {key!r}", c)
    c.check(len(per_shard) == len(lay), f"tensor {key!r}: its segments must list one list per shard of its layout")
    out = []
    for (_, (_, lens)), raw_segs in zip(lay, per_shard):
        segs = []
        for g in _list(raw_segs, f"segments of tensor {key!r}", c):
            c.check(isinstance(g, list) and len(g) == 3 and isinstance(g[0], str) and is_int(g[1])
                    and is_int(g[2]), f"tensor {key!r}: segment must be [chunk, offset, length]")
            info = chunks.get(g[0])
            c.check(info is not None and g[1] + g[2] <= info.size,
                    f"tensor {key!r}: a segment is not inside a chunk of the index's chunk table")
            segs.append(Segment(g[0], g[1], g[2]))
        c.check(sum(g.length for g in segs) == math.prod(lens) * ITEMSIZE[dtype],
                f"tensor {key!r}: the segments of a shard do not hold its bytes")
        out.append(tuple(segs))
    return IndexEntry(key, dtype, tuple(shape), t["layout"], owner, tuple(out))


def _check_inline_chunks(tensors: list[IndexEntry], layouts: list[Layout], chunks: dict[str, mf.ChunkInfo],
                         c: _Checker) -> None:
    """The index's chunk table holds only the inlined tensors' chunks and their bases, and no chunk
    claims more bytes than the rank whose inlined tensor names it saved in all, padding included (a
    reader allocates a chunk's size: it is believed as far as the step's tensors account for it)."""
    owner: dict[str, int] = {}  # chunk -> the rank of an inlined shard naming it
    for t in tensors:
        for (r, _), segs in zip(layouts[t.layout], t.segments or ()):
            for g in segs:
                owner[g.chunk] = r
    bases = {x.base for x in chunks.values() if x.base is not None}
    stray = [h for h in chunks if h not in owner and h not in bases]
    c.check(not stray, f"chunk {stray[0] if stray else ''} of the index's table is named by no inlined tensor")
    ranks = set(owner.values())
    if not ranks:
        return
    per_layout_items = [0] * len(layouts)  # sum of item sizes, and count, of the tensors naming each layout
    per_layout_count = [0] * len(layouts)
    for t in tensors:
        per_layout_items[t.layout] += ITEMSIZE[t.dtype]
        per_layout_count[t.layout] += 1
    saved = dict.fromkeys(ranks, ALIGN)  # bytes each such rank saved, every tensor's padding counted
    for i, lay in enumerate(layouts):
        for r, (_, lens) in lay:
            if r in saved:
                saved[r] += math.prod(lens) * per_layout_items[i] + ALIGN * per_layout_count[i]
    for h, r in owner.items():
        c.check(chunks[h].size <= saved[r], f"chunk {h} claims {chunks[h].size} bytes, more than rank {r} saved")


def _parse_report(x: Any, step: int, rank: int, c: _Checker) -> ReportRef:
    key = rank_key(step, rank)
    c.check(isinstance(x, dict) and x.get("key") == key, f"report {rank} must be named {key}")
    c.check(is_int(x.get("size"), 1, mf.MAX_MANIFEST_BYTES), f"report {key} must have a size up to the manifest cap")
    c.check(isinstance(x.get("digest"), str) and _DIGEST.match(x["digest"]) is not None,
            f"report {key} must have a 32-digit lowercase hex digest")
    return ReportRef(key, x["size"], x["digest"])


# -- the reports an index names -------------------------------------------------------------------

def read_reports(storage: Storage, ix: Index, ranks: list[int]) -> dict[int, mf.Manifest]:
    """The reports of ``ranks``, each read, checked to be the bytes the index names (size and
    digest: else :class:`CorruptCheckpointError` naming it) and to hold the boxes the index's
    layouts give that rank."""
    boxes = LayoutBoxes(ix, set(ranks))
    return {r: _read_report(storage, ix, r, boxes) for r in ranks}


def _read_report(storage: Storage, ix: Index, r: int, boxes: LayoutBoxes) -> mf.Manifest:
    ref = ix.reports[r]
    try:
        data = storage.read_object(ref.key, ref.size)
    except FileNotFoundError:
        raise CorruptCheckpointError(f"step {ix.step}: rank report {ref.key}, which its index names, is missing",
                                     object=ref.key) from None
    if len(data) != ref.size or xxhash.xxh3_128_hexdigest(data) != ref.digest:
        raise CorruptCheckpointError(
            f"step {ix.step}: rank report {ref.key} is not what its index names ({len(data)} bytes, digest "
            f"{xxhash.xxh3_128_hexdigest(data)}; the index says {ref.size} bytes, {ref.digest}); the step is "
            "damaged", object=ref.key)
    part = mf.parse_rank_part(data, ix.step, r)
    check_report(ix, r, part, boxes)
    return part


class LayoutBoxes:
    """Per layout of an index, the boxes each saved rank of ``ranks`` (None: every rank) holds, and
    per rank how many tensors the index gives it: the layouts' sizes plus the ranks, never tensors ×
    ranks (2,892 tensors on 16,384 ranks share a few dozen layouts)."""

    def __init__(self, ix: Index, ranks: set[int] | None = None):
        self.per_layout: list[dict[int, list[Box]]] = []
        for lay in ix.layouts:
            d: dict[int, list[Box]] = {}
            for r, b in lay:
                if ranks is None or r in ranks:
                    d.setdefault(r, []).append(b)
            self.per_layout.append(d)
        uses = [0] * len(ix.layouts)
        for t in ix.tensors:
            uses[t.layout] += 1
        self.tensors_of: dict[int, int] = {}
        for i, d in enumerate(self.per_layout):
            for r in d:
                self.tensors_of[r] = self.tensors_of.get(r, 0) + uses[i]


def check_report(ix: Index, rank: int, part: mf.Manifest, boxes: LayoutBoxes) -> None:
    """Rank ``rank``'s report holds exactly the tensors and boxes the index gives that rank."""
    name = rank_key(ix.step, rank)
    entries = ix.entries()
    for t in part.tensors:
        e = entries.get((t.key, t.rank))
        if (e is None or e.dtype != t.dtype or e.shape != tuple(t.shape) or any(s.rank != rank for s in t.shards)
                or [(tuple(s.offsets), tuple(s.lengths)) for s in t.shards] != boxes.per_layout[e.layout].get(rank)
                or (e.segments is not None and not _same_inline(ix, e, rank, t, part))):
            raise CorruptCheckpointError(f"step {ix.step}: rank report {name} does not match its index at tensor "
                                         f"{t.key!r} (dtype, shape, shard boxes or inlined segments); the step is "
                                         "damaged", object=name)
    if len(part.tensors) != boxes.tensors_of.get(rank, 0):  # each listed once (the parse checks): none lacking
        raise CorruptCheckpointError(f"step {ix.step}: rank report {name} lists {len(part.tensors)} tensors, and its "
                                     f"index gives that rank {boxes.tensors_of.get(rank, 0)}; the step is damaged",
                                     object=name)


def _same_inline(ix: Index, e: IndexEntry, rank: int, t: TensorEntry, part: mf.Manifest) -> bool:
    """An inlined tensor's segments on ``rank``, and the chunk entries they need, are the ones its
    report ``part`` lists (entry ``t``)."""
    assert e.segments is not None
    mine = [segs for (r, _), segs in zip(ix.layouts[e.layout], e.segments) if r == rank]
    if mine != [tuple(s.segments) for s in t.shards]:
        return False
    need = closure(ix.chunks, [g.chunk for segs in mine for g in segs])
    return all(part.chunks.get(h) == info for h, info in need.items())


def partial_step(ix: Index, parts: dict[int, mf.Manifest]) -> mf.Manifest:
    """The step as a manifest holding what ``parts`` (rank reports read through :func:`read_reports`)
    say: every tensor, with the shards of those ranks, and their chunks. With every rank's report,
    the whole step."""
    fold = _Fold()
    for r in sorted(parts):
        fold.add(parts[r])
    return fold.step(ix)


class _Fold:
    """Rank reports folded in one at a time, in rank order (each can be dropped once added)."""

    def __init__(self) -> None:
        self.chunks: dict[str, mf.ChunkInfo] = {}
        self.found: dict[tuple[str, int | None], list[Shard]] = {}

    def add(self, part: mf.Manifest) -> None:
        chunks = self.chunks
        for h, info in part.chunks.items():
            have = chunks.get(h)  # one report may lack the span digests another has (of the same raw bytes)
            chunks[h] = replace(info, spans=have.spans) if have is not None and info.spans is None else info
        for t in part.tensors:
            self.found.setdefault((t.key, t.rank), []).extend(t.shards)

    def step(self, ix: Index) -> mf.Manifest:
        tensors = []
        for e in ix.tensors:
            if e.segments is not None:  # inlined: from the index (the reports read were checked to agree)
                shards = [Shard(r, list(offs), list(lens), list(segs))
                          for (r, (offs, lens)), segs in zip(ix.layouts[e.layout], e.segments)]
            else:
                shards = self.found.get((e.key, e.rank), [])
            tensors.append(TensorEntry(e.key, e.dtype, list(e.shape), shards, e.rank))
        chunks = self.chunks
        for h, info in ix.chunks.items():
            have = chunks.get(h)
            chunks[h] = info if have is None else replace(have, spans=have.spans or info.spans)
        return ix._manifest(tensors, chunks)


def whole_step(storage: Storage, ix: Index) -> mf.Manifest:
    """The whole step an index names, every report read and checked (what whole-step tools read):
    one report at a time, folded in and dropped (never N parsed reports at once), with progress
    logged on a step of many ranks."""
    boxes, fold = LayoutBoxes(ix), _Fold()
    every = max(256, ix.world_size // 10)
    for r in range(ix.world_size):
        fold.add(_read_report(storage, ix, r, boxes))
        if ix.world_size >= 1024 and (r + 1) % every == 0:
            log.info("step %d: read and checked %d of %d rank reports", ix.step, r + 1, ix.world_size)
    m = fold.step(ix)
    mf.check_chains(m.chunks, manifest_key(ix.step))
    return m


def committable(step: int, ix: Index, parts: list[mf.Manifest]) -> bytes:
    """The index's bytes, once they pass what every reader checks (:func:`parse_doc`, the size cap)
    and every report ``parts`` holds what the index gives its rank: as
    :func:`ckpt.format.manifest.committable`, for a step index."""
    data = ix.to_json()
    if len(data) > mf.MAX_MANIFEST_BYTES:
        raise ManifestTooLargeError(
            f"step {step} was not committed: its index would be {len(data):,} bytes, and a reader refuses one over "
            f"{mf.MAX_MANIFEST_BYTES:,} bytes. Nothing was changed; the committed steps are as they were",
            size=len(data), limit=mf.MAX_MANIFEST_BYTES)
    try:
        back = mf.parse_committed(data, name=manifest_key(step))
        if not isinstance(back, Index) or back.step != step:
            raise CorruptCheckpointError(f"it describes step {back.step}")
        if parts:  # the reports to check against it (none where the commit built it from summaries)
            boxes = LayoutBoxes(back)
            for p in parts:
                assert p.rank is not None
                check_report(back, p.rank, p, boxes)
    except CorruptCheckpointError as e:
        raise CorruptCheckpointError(f"step {step} was not committed: its index would not load ({e}). Nothing was "
                                     "changed; the committed steps are as they were") from e
    return data
