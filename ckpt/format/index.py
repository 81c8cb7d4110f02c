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
import re
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import xxhash

from .. import tree as st
from .._gc import paused
from ..errors import CorruptCheckpointError, ManifestTooLargeError
from ..tree import ITEMSIZE
from . import manifest as mf
from .boxes import Box, check_tiles
from .entries import MAX_WORLD, Shard, TensorEntry, bad, ints, is_int
from .paths import manifest_key, rank_key
from .tree_check import problem

if TYPE_CHECKING:
    from ..storage.base import Storage

INDEX_VERSION = 6
_DIGEST = re.compile(r"^[0-9a-f]{32}$")

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
    return doc


def _layout_of(t: TensorEntry) -> Layout:
    return tuple((s.rank, (tuple(s.offsets), tuple(s.lengths))) for s in t.shards)


def build(m: mf.Manifest, reports: list[ReportRef]) -> Index:
    """The index of whole-step manifest ``m`` (merged from the rank reports ``reports`` name, in rank order)."""
    ids: dict[Layout, int] = {}
    entries = [IndexEntry(t.key, t.dtype, tuple(t.shape), ids.setdefault(_layout_of(t), len(ids)), t.rank)
               for t in m.tensors]
    return Index(step=m.step, world_size=m.world_size, structure=m.structure, tensors=entries, layouts=list(ids),
                 reports=list(reports), created=m.created, writer=m.writer, stats=m.stats)


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
    tensors: list[IndexEntry] = []
    seen: set[tuple[str, int | None]] = set()
    shape_of: dict[int, tuple[int, ...]] = {}  # each layout's boxes tile one shape (checked once)
    for t in _list(doc.get("tensors"), "tensors", c):
        e = _parse_entry(t, world, len(layouts), c)
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
    raw_reports = _list(doc.get("reports"), "reports", c)
    c.check(len(raw_reports) == world, f"reports must name one report per rank ({world})")
    reports = [_parse_report(x, step, r, c) for r, x in enumerate(raw_reports)]
    return Index(step=step, world_size=world, structure=structure, tensors=tensors, layouts=layouts, reports=reports,
                 created=float(created), writer=writer, stats=stats, format_version=doc["format_version"])


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


def _parse_entry(t: Any, world: int, n_layouts: int, c: _Checker) -> IndexEntry:
    c.check(isinstance(t, dict) and isinstance(t.get("key"), str), "tensor entry without a key")
    key = t["key"]
    owner = t.get("rank")
    c.check(owner is None or is_int(owner, 0, world - 1), f"tensor {key!r} names a rank outside the world size")
    dtype = t.get("dtype")
    c.check(isinstance(dtype, str) and dtype in ITEMSIZE, f"tensor {key!r} has unknown dtype {str(dtype)[:40]!r}")
    shape: Any = t.get("shape")
    c.check(ints(shape) and len(shape) <= 64, f"tensor {key!r} has a bad shape")
    c.check(is_int(t.get("layout"), 0, n_layouts - 1), f"tensor {key!r} names no layout of the index")
    return IndexEntry(key, dtype, tuple(shape), t["layout"], owner)


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
    boxes = _boxes_by_rank(ix, set(ranks))
    out = {}
    for r in ranks:
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
        check_report(ix, r, part, boxes.get(r, {}))
        out[r] = part
    return out


def _boxes_by_rank(ix: Index, ranks: set[int]) -> dict[int, dict[tuple[str, int | None], list[Box]]]:
    """Per saved rank of ``ranks``, per tensor (key, owner), the boxes the index's layouts give it
    (the layouts' sizes plus tensors × ``ranks``: not tensors × world size)."""
    per_layout: list[dict[int, list[Box]]] = []
    for lay in ix.layouts:
        d: dict[int, list[Box]] = {}
        for r, b in lay:
            if r in ranks:
                d.setdefault(r, []).append(b)
        per_layout.append(d)
    out: dict[int, dict[tuple[str, int | None], list[Box]]] = {}
    for t in ix.tensors:
        for r, bs in per_layout[t.layout].items():
            out.setdefault(r, {})[(t.key, t.rank)] = bs
    return out


def check_report(ix: Index, rank: int, part: mf.Manifest, mine: dict[tuple[str, int | None], list[Box]]) -> None:
    """Rank ``rank``'s report holds exactly the tensors and boxes the index gives that rank."""
    name = rank_key(ix.step, rank)
    dtypes = ix.entries()
    got = set()
    for t in part.tensors:
        e = dtypes.get((t.key, t.rank))
        boxes = [(tuple(s.offsets), tuple(s.lengths)) for s in t.shards]
        if e is None or e.dtype != t.dtype or e.shape != tuple(t.shape) or boxes != mine.get((t.key, t.rank)) \
                or any(s.rank != rank for s in t.shards):
            raise CorruptCheckpointError(f"step {ix.step}: rank report {name} does not match its index at tensor "
                                         f"{t.key!r} (dtype, shape or shard boxes); the step is damaged", object=name)
        got.add((t.key, t.rank))
    lacking = [k for k in mine if k not in got]
    if lacking:
        raise CorruptCheckpointError(f"step {ix.step}: rank report {name} lacks tensor {lacking[0][0]!r} that its "
                                     "index gives that rank; the step is damaged", object=name)


def partial_step(ix: Index, parts: dict[int, mf.Manifest]) -> mf.Manifest:
    """The step as a manifest holding what ``parts`` (rank reports read through :func:`read_reports`)
    say: every tensor, with the shards of those ranks, and their chunks. With every rank's report,
    the whole step."""
    chunks: dict[str, mf.ChunkInfo] = {}
    found: dict[tuple[str, int | None], list[Shard]] = {}
    for r in sorted(parts):
        part = parts[r]
        for h, info in part.chunks.items():
            have = chunks.get(h)  # one report may lack the span digests another has (of the same raw bytes)
            chunks[h] = replace(info, spans=have.spans) if have is not None and info.spans is None else info
        for t in part.tensors:
            found.setdefault((t.key, t.rank), []).extend(t.shards)
    tensors = [TensorEntry(t.key, t.dtype, list(t.shape), found.get((t.key, t.rank), []), t.rank) for t in ix.tensors]
    return ix._manifest(tensors, chunks)


def whole_step(storage: Storage, ix: Index) -> mf.Manifest:
    """The whole step an index names, every report read and checked (what whole-step tools read)."""
    m = partial_step(ix, read_reports(storage, ix, list(range(ix.world_size))))
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
        boxes = _boxes_by_rank(back, {p.rank for p in parts if p.rank is not None})
        for p in parts:
            assert p.rank is not None
            check_report(back, p.rank, p, boxes.get(p.rank, {}))
    except CorruptCheckpointError as e:
        raise CorruptCheckpointError(f"step {step} was not committed: its index would not load ({e}). Nothing was "
                                     "changed; the committed steps are as they were") from e
    return data
