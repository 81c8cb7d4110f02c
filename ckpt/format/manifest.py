"""The manifest: a typed, plain JSON description of one step (and of one rank's part of it).

A manifest is untrusted input when read back: :func:`parse` checks every field it relies on
(types, hash syntax, dtype names, sizes that add up) and raises
:class:`~ckpt.errors.CorruptCheckpointError` naming the object otherwise. Readers dispatch on
``format_version``; a newer version is refused with :class:`~ckpt.errors.IncompatibleFormatError`.
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from .. import tree as st
from .._gc import paused
from .._version import __version__
from ..errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    IncompatibleFormatError,
    ManifestTooLargeError,
    NotACheckpointError,
    StateMismatchError,
)
from . import spans, tree_union
from .entries import MAX_CHAIN as MAX_CHAIN
from .entries import MAX_CHUNK_BYTES as MAX_CHUNK_BYTES
from .entries import (
    MAX_STEP,
    MAX_WORLD,
    ChunkInfo,
    TensorEntry,
    bad,
    check_chunk_sizes,
    check_tiling,
    is_int,
    parse_chunks,
    parse_tensor,
)
from .entries import Segment as Segment
from .entries import Shard as Shard
from .entries import chain as chain
from .entries import check_chains as check_chains
from .entries import closure as closure
from .paths import STEP_DIR_RE, STEPS, manifest_key, rank_key
from .tree_check import newest_feature, problem

if TYPE_CHECKING:
    from ..storage.base import Storage
    from .index import Index


FORMAT = "ckpt"
FORMAT_VERSION = 6  # 2 adds per-rank entries and nodes, 3 numpy values as raw bytes, 4 the planes and xor
# codecs (delta chains), 5 io.BytesIO values, 6 the step index (:mod:`.index`); saves write the lowest that fits
MANIFEST_VERSION = 5  # the newest version of a manifest with tensors and chunks (a rank report, a whole step)
MAX_MANIFEST_BYTES = 1 << 30  # a manifest larger than this is refused before it is parsed


@dataclass
class Manifest:
    step: int
    kind: str  # "step" (the commit point) or "rank" (one rank's report)
    structure: dict
    tensors: list[TensorEntry]
    chunks: dict[str, ChunkInfo]
    world_size: int = 1
    rank: int | None = None
    created: float = field(default_factory=time.time)
    writer: str = f"ckpt {__version__}"
    stats: dict[str, Any] = field(default_factory=dict)
    format_version: int = MANIFEST_VERSION

    def to_json(self) -> bytes:
        with paused():  # see parse()
            return self._to_json()

    def _to_json(self) -> bytes:
        doc = {
            "format": FORMAT,
            "format_version": self.format_version,
            "writer": self.writer,
            "kind": self.kind,
            "step": self.step,
            "world_size": self.world_size,
            "created": self.created,
            "stats": self.stats,
            "structure": self.structure,
            "tensors": [_entry_json(t) for t in self.tensors],
            "chunks": {h: c.to_json() for h, c in self.chunks.items()},
        }
        if self.rank is not None:
            doc["rank"] = self.rank
        if (span_doc := spans.to_json(self.chunks)) is not None:
            doc["spans"] = span_doc
        return json.dumps(doc, separators=(",", ":"), allow_nan=False).encode()

    @property
    def raw_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    @property
    def stored_bytes(self) -> int:
        return sum(c.stored for c in self.chunks.values())

    @property
    def top_keys(self) -> list[str]:
        """The top-level keys of the state this step saved."""
        return [k for k, _ in st.top_items(self.structure)]

    @property
    def per_rank_keys(self) -> list[str]:
        """Top-level state keys saved per rank (loading them on another world size needs a rank_map)."""
        return [k for k, v in st.top_items(self.structure) if st.is_per_rank(v)]


def _entry_json(t: TensorEntry) -> dict:
    doc: dict[str, Any] = {"key": t.key, "dtype": t.dtype, "shape": t.shape, "shards": [
        {"rank": s.rank, "offsets": s.offsets, "lengths": s.lengths,
         "segments": [[g.chunk, g.offset, g.length] for g in s.segments]}
        for s in t.shards]}
    if t.rank is not None:
        doc["rank"] = t.rank
    return doc


def _check(cond: bool, name: str, what: str) -> None:
    if not cond:
        raise bad(name, what)


def _no_constants(name: str) -> None:
    raise ValueError(f"{name} is not a number JSON allows")


def parse(data: bytes | bytearray, *, name: str) -> Manifest:
    """Parse and validate a manifest read from storage object ``name``.

    Whatever the bytes hold, the outcome is a :class:`Manifest` every field of which has been checked,
    or a :class:`CorruptCheckpointError` (:class:`IncompatibleFormatError` for a newer format): never
    a ``RecursionError``, ``ValueError``, ``KeyError`` or ``TypeError`` from deep, huge or
    ill-typed JSON. A step index (format v6) is refused here: :func:`parse_committed` reads both."""
    got = parse_committed(data, name=name)
    if not isinstance(got, Manifest):
        raise bad(name, "it is a step index (format v6) where a manifest with tensors and chunks was expected")
    return got


def parse_committed(data: bytes | bytearray, *, name: str) -> Manifest | Index:
    """:func:`parse` of a step's ``MANIFEST.json``: a :class:`Manifest`, or the step's
    :class:`~ckpt.format.index.Index` (format v6, a step saved by several ranks)."""
    with paused():  # a large state's manifest is millions of containers, none in a cycle (see ckpt._gc)
        return _parse(data, name)


def _parse(data: bytes | bytearray, name: str) -> Manifest | Index:
    try:
        doc = json.loads(data, parse_constant=_no_constants)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:  # JSONDecodeError, ints of 4300+ digits
        raise CorruptCheckpointError(
            f"manifest {name} is not valid JSON ({type(e).__name__}: {str(e)[:200]}); the step is damaged",
            object=name) from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise NotACheckpointError(f"{name} is not a ckpt manifest (no \"format\": \"ckpt\" field)")
    version: Any = doc.get("format_version")  # untrusted JSON until _check says otherwise
    _check(is_int(version, 1), name, "format_version must be a positive integer")
    if version > FORMAT_VERSION:
        raise IncompatibleFormatError(
            f"{name} was written by {str(doc.get('writer', 'a newer ckpt'))[:100]} in format v{version}; this ckpt "
            f"({__version__}) reads up to v{FORMAT_VERSION}. Upgrade: pip install -U ckpt")
    return _PARSERS[version](doc, name)


def _parse_v1(doc: dict, name: str) -> Manifest:
    # Every field is untrusted JSON (Any) until _check has looked at it.
    kind: Any = doc.get("kind")
    _check(kind in ("step", "rank"), name, "kind must be 'step' or 'rank'")
    _check(is_int(doc.get("step")), name, f"step must be an integer from 0 to {MAX_STEP}")
    world: Any = doc.get("world_size")
    _check(is_int(world, 1, MAX_WORLD), name, f"world_size must be an integer from 1 to {MAX_WORLD}")
    rank: Any = doc.get("rank")
    _check(rank is None or is_int(rank, 0, MAX_WORLD), name, "rank must be a non-negative integer")
    created: Any = doc.get("created", 0.0)
    _check(type(created) in (int, float) and 0 <= created < 1e11, name, "created must be a time in seconds")
    writer: Any = doc.get("writer", "")
    _check(isinstance(writer, str) and len(writer) < 1000, name, "writer must be a short string")
    stats: Any = doc.get("stats", {})
    _check(isinstance(stats, dict) and all(isinstance(k, str) and type(v) in (int, float) for k, v in stats.items()),
           name, "stats must map names to numbers")
    structure: Any = doc.get("structure")
    _check(st.kind(structure) == "dict" and isinstance(structure.get("k"), list)
           and isinstance(structure.get("v"), list) and len(structure["k"]) == len(structure["v"])
           and all(isinstance(k, str) for k in structure["k"]) and len(set(structure["k"])) == len(structure["k"]),
           name, "structure must be a dict node of distinct string keys")
    for k, v in st.top_items(structure):
        if st.is_per_rank(v):
            _check(kind == "step" and isinstance(v.get("v"), list) and len(v["v"]) == world,
                   name, f"per-rank key {k!r} must hold one value per rank ({world})")
    chunks = parse_chunks(doc.get("chunks"), name)
    spans.parse(doc.get("spans"), chunks, name)
    tensors: list[TensorEntry] = []
    seen: set[tuple[str, int | None]] = set()  # (key, owning rank)
    raw_tensors: Any = doc.get("tensors")
    _check(isinstance(raw_tensors, list), name, "tensors must be a list")
    top_rank = world - 1 if kind == "step" else MAX_WORLD
    for t in raw_tensors:
        entry = parse_tensor(t, chunks, top_rank, name)
        if (entry.key, entry.rank) in seen:
            raise bad(name, f"tensor {entry.key!r} is listed twice")
        seen.add((entry.key, entry.rank))
        if kind == "step":
            check_tiling(entry, name)
        tensors.append(entry)
    check_chunk_sizes(chunks, tensors, name)
    why = problem(structure, {t.key for t in tensors} if kind == "step" else None)
    _check(why is None, name, f"its structure holds {why}")
    return Manifest(step=doc["step"], kind=kind, structure=structure, tensors=tensors, chunks=chunks, world_size=world,
                    rank=rank, created=float(created), writer=writer, stats=stats, format_version=doc["format_version"])


# One parser per format version: a new version adds an entry instead of growing an if-chain.
# Version 2 only adds optional fields (per-rank entries and nodes) that version 1 never wrote.
# Version 3 only adds numpy values stored as raw bytes (tensor nodes with a numpy dtype string,
# npscalar nodes with "b"), which a version-2 reader would hand back as bytes.
# Version 4 only adds the planes and xor codecs and the base of xor entries in the chunk table.
# Version 5 only adds io.BytesIO values (bytes nodes with "io": true), which a version-4 reader would
# hand back as bytes.
# Version 6 is the step index (:mod:`.index`): MANIFEST.json naming the rank reports, which keep version 5.


def _parse_v6(doc: dict, name: str) -> Index:
    from .index import parse_doc

    return parse_doc(doc, name)


_PARSERS: dict[int, Callable[[dict, str], Manifest | Index]] = {
    1: _parse_v1, 2: _parse_v1, 3: _parse_v1, 4: _parse_v1, 5: _parse_v1, 6: _parse_v6}


def lowest_version(structure: dict, tensors: list[TensorEntry], chunks: dict[str, ChunkInfo]) -> int:
    """The lowest manifest version that holds a step of these tensors, structure and chunks (older
    readers read it)."""
    simple = all(t.rank is None for t in tensors) and not any(st.is_per_rank(v) for _, v in st.top_items(structure))
    return max(1 if simple else 2, newest_feature(structure),
               4 if any(c.codec.split("/")[0] in ("planes", "xor") for c in chunks.values()) else 1)


def merge(step: int, parts: list[Manifest], per_rank: set[str] | frozenset = frozenset()) -> Manifest:
    """The step manifest from every rank's report: tensors' shards and chunk tables combined.

    A top-level key of the state is stored once when every rank's value is the same and it is not
    per-rank state, or as the union of the ranks' values when they differ only in the entries they
    hold (pipeline stages: :func:`ckpt.format.tree_union.unite`); otherwise as a ``per_rank`` node holding
    each rank's value (nothing is dropped)."""
    parts = sorted(parts, key=lambda p: p.rank or 0)
    by_key: dict[tuple[str, int | None], TensorEntry] = {}
    chunks: dict[str, ChunkInfo] = {}
    stats: dict[str, int | float] = {}
    for part in parts:
        for h, info in part.chunks.items():
            have = chunks.get(h)  # a report may lack the span digests another has (of the same raw bytes)
            keep = have is not None and have.spans is not None and info.spans is None
            chunks[h] = replace(info, spans=have.spans) if keep and have is not None else info
        for k, v in part.stats.items():
            if isinstance(v, (int, float)):
                stats[k] = stats.get(k, 0) + v
        for t in part.tensors:
            ent = by_key.get((t.key, t.rank))
            if ent is not None:
                ent.shards.extend(t.shards)
            else:
                by_key[(t.key, t.rank)] = TensorEntry(t.key, t.dtype, list(t.shape), list(t.shards), t.rank)
    tops = [k for k, _ in st.top_items(parts[0].structure)]
    nodes = [dict(st.top_items(p.structure)) for p in parts]
    for p, n in zip(parts, nodes):
        if sorted(n) != sorted(tops):
            raise StateMismatchError(f"step {step}: rank {p.rank} saved top-level keys {sorted(n)}, rank "
                                     f"{parts[0].rank or 0} saved {sorted(tops)}; every rank must save the same keys")
    values = []
    for k in tops:
        per = [n[k] for n in nodes]
        united = None if k in per_rank else tree_union.unite(per)
        values.append(st.per_rank_node(per) if united is None else united)
    tensors = list(by_key.values())
    # Version 1 readers load anything without per-rank parts (they refuse multi-shard tensors clearly).
    structure = st.dict_node(tops, values)
    return Manifest(step=step, kind="step", structure=structure, tensors=tensors, chunks=chunks,
                    world_size=len(parts), stats=stats, format_version=lowest_version(structure, tensors, chunks))


# -- reading manifests from storage ---------------------------------------------------------------

def step_candidates(storage: Storage) -> list[int]:
    """Step numbers that have a directory (committed or not), ascending."""
    steps = (int(n) for n in storage.list(STEPS) if STEP_DIR_RE.match(n) and f"{int(n):012d}" == n)
    return sorted(s for s in steps if s <= MAX_STEP)


def committed_steps(storage: Storage) -> list[int]:
    """Steps whose MANIFEST.json exists, ascending. (Whether it parses is checked when it is read.)"""
    return [s for s in step_candidates(storage) if storage.exists(manifest_key(s))]


def _read_bounded(storage: Storage, key: str) -> bytes | bytearray:
    data = storage.read_object(key, MAX_MANIFEST_BYTES)
    if len(data) > MAX_MANIFEST_BYTES:
        raise CorruptCheckpointError(f"manifest {key} is larger than {MAX_MANIFEST_BYTES:,} bytes; it is damaged",
                                     object=key)
    return data


def read_committed(storage: Storage, step: int) -> Manifest | Index:
    """What ``MANIFEST.json`` of ``step`` holds, parsed and checked to describe that step: the whole
    step's manifest, or its index (format v6: the load path reads only the rank reports it needs).

    Raises :class:`CheckpointNotFoundError` if it does not exist, :class:`CorruptCheckpointError`
    if it does not parse or check."""
    key = manifest_key(step)
    try:
        data = _read_bounded(storage, key)
    except FileNotFoundError:
        raise CheckpointNotFoundError(f"step {step} has no manifest in {storage.describe()}") from None
    m = parse_committed(data, name=key)
    kind = m.kind if isinstance(m, Manifest) else "index"
    if m.step != step or kind not in ("step", "index"):
        raise CorruptCheckpointError(f"manifest {key} describes step {m.step} ({kind}), not step {step}", object=key)
    return m


def read_step(storage: Storage, step: int) -> Manifest:
    """The whole committed step ``step`` as one manifest, parsed and checked: what every tool that
    needs all of a step reads (verify, inspect, retention, ``ckpt.open``, export, diff, DCP's
    reader). For a step index (v6), every rank report it names is read, checked against it, and
    joined (:func:`ckpt.format.index.whole_step`); no caller spells the index format.

    Raises :class:`CheckpointNotFoundError` if it does not exist, :class:`CorruptCheckpointError`
    if it (or a report it names) does not parse or check."""
    m = read_committed(storage, step)
    if isinstance(m, Manifest):
        return m
    from .index import whole_step

    return whole_step(storage, m)


def read_rank_bytes(storage: Storage, step: int, rank: int) -> bytes | bytearray:
    """The bytes of rank ``rank``'s report for ``step``, bounded like a manifest."""
    return _read_bounded(storage, rank_key(step, rank))


def read_rank_part(storage: Storage, step: int, rank: int) -> Manifest:
    """Rank ``rank``'s report for ``step`` (what it wrote), parsed and checked to be that report."""
    return parse_rank_part(read_rank_bytes(storage, step, rank), step, rank)


def parse_rank_part(data: bytes | bytearray, step: int, rank: int) -> Manifest:
    """A rank report's bytes (from storage, or sent through the store), checked to be rank ``rank``'s for ``step``."""
    key = rank_key(step, rank)
    m = parse(data, name=key)
    if m.kind != "rank" or m.rank != rank or m.step != step:
        raise CorruptCheckpointError(f"{key} describes rank {m.rank} step {m.step}, not rank {rank} step {step}",
                                     object=key)
    return m


class Outline(Manifest):
    """A step its coordinator committed from the ranks' summaries (:mod:`ckpt.save.commit_index`): its
    structure, stats and chunk table (without span digests) and no tensors. A :class:`ManifestCache`
    keeps only its chunk names (what retention needs); ``get`` reads the step itself."""


CACHE_BYTES = 512 << 20  # what a ManifestCache holds at most, by weight()


def weight(m: Manifest | frozenset[str]) -> int:
    """About how much memory a parsed manifest (or a step's chunk names) holds, in bytes."""
    if isinstance(m, frozenset):
        return 120 * len(m)
    shards = sum(len(t.shards) for t in m.tensors)
    segments = sum(len(s.segments) for t in m.tensors for s in t.shards)
    return (300 * len(m.tensors) + 250 * shards + 150 * segments + 250 * len(m.chunks)
            + 4 * len(json.dumps(m.structure)))


class ManifestCache:
    """Parsed step manifests by step, each read and checked once while it stays in the cache.

    ``get`` raises on a missing or damaged manifest; ``find`` returns None instead and keeps the
    reason in ``errors`` (for tools that report every step, damaged or not). What it holds is bounded
    by bytes (``max_bytes``, by :func:`weight`) and, where given, by ``maxsize`` manifests; the least
    recently used go first, so a long run's memory grows neither with its steps nor with its ranks.
    Of a step committed from summaries (an :class:`Outline`) it keeps the chunk names alone
    (:meth:`chunk_keys`)."""

    def __init__(self, storage: Storage, maxsize: int | None = None, max_bytes: int = CACHE_BYTES):
        self.storage = storage
        self.maxsize = maxsize
        self.max_bytes = max_bytes
        self.bytes = 0
        self._by_step: OrderedDict[int, tuple[Manifest | frozenset[str], int]] = OrderedDict()
        self.errors: dict[int, str] = {}
        self._lock = threading.Lock()

    def put(self, m: Manifest) -> None:
        """Keep ``m`` (an :class:`Outline`: its chunk names)."""
        kept: Manifest | frozenset[str] = frozenset(m.chunks) if isinstance(m, Outline) else m
        w = weight(kept)
        with self._lock:
            self._pop(m.step)
            self._by_step[m.step] = (kept, w)
            self.bytes += w
            self.errors.pop(m.step, None)
            while len(self._by_step) > 1 and (self.bytes > self.max_bytes
                                              or (self.maxsize is not None and len(self._by_step) > self.maxsize)):
                self.bytes -= self._by_step.popitem(last=False)[1][1]

    def _pop(self, step: int) -> None:
        got = self._by_step.pop(step, None)
        if got is not None:
            self.bytes -= got[1]

    def drop(self, step: int) -> None:
        with self._lock:
            self._pop(step)
            self.errors.pop(step, None)

    def _held(self, step: int) -> Manifest | frozenset[str] | None:
        with self._lock:
            got = self._by_step.get(step)
            if got is None:
                return None
            self._by_step.move_to_end(step)
            return got[0]

    def get(self, step: int) -> Manifest:
        m = self._held(step)
        if not isinstance(m, Manifest):
            m = read_step(self.storage, step)
            self.put(m)
        return m

    def chunk_keys(self, step: int) -> frozenset[str] | set[str]:
        """The chunks step ``step`` names (what retention keeps or deletes), read only if not held."""
        m = self._held(step)
        if isinstance(m, frozenset):
            return m
        return set((m if m is not None else self.get(step)).chunks)

    def find(self, step: int) -> Manifest | None:
        with self._lock:
            if step in self.errors:
                return None
        try:
            return self.get(step)
        except CheckpointError as e:
            with self._lock:
                self.errors[step] = str(e)
            return None


def committable(step: int, m: Manifest) -> bytes:
    """The manifest's bytes, once they pass the parse every reader runs on them (every field
    checked, each tensor's shards tiling its shape, chunk sizes bounded) and the reader's size cap
    (:data:`MAX_MANIFEST_BYTES`, else :class:`ManifestTooLargeError`): a step that could never load is
    not committed, so retention never drops a good step for it."""
    data = m.to_json()
    if len(data) > MAX_MANIFEST_BYTES:  # read at call time: a test lowers it to try the limit
        raise ManifestTooLargeError(
            f"step {step} was not committed: its manifest would be {len(data):,} bytes, and a reader refuses a "
            f"manifest over {MAX_MANIFEST_BYTES:,} bytes, so the step could never be loaded. Nothing was changed; "
            "the committed steps are as they were. Save fewer tensors per step (or on fewer ranks)",
            size=len(data), limit=MAX_MANIFEST_BYTES)
    try:
        back = parse(data, name=manifest_key(step))
    except CheckpointError as e:
        raise CorruptCheckpointError(f"step {step} was not committed: its manifest would not load ({e}). Nothing "
                                     "was changed; the committed steps are as they were") from e
    if back.step != step or back.kind != "step":  # what read_step checks too
        raise CorruptCheckpointError(f"step {step} was not committed: its manifest describes step {back.step} "
                                     f"({back.kind}). This is a bug: please report it")
    return data
