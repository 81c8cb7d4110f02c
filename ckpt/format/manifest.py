"""The manifest: a typed, plain JSON description of one step (and of one rank's part of it).

A manifest is untrusted input when read back: :func:`parse` checks every field it relies on
(types, hash syntax, dtype names, sizes that add up) and raises
:class:`~ckpt.errors.CorruptCheckpointError` naming the object otherwise. Readers dispatch on
``format_version``; a newer version is refused with :class:`~ckpt.errors.IncompatibleFormatError`.
"""

from __future__ import annotations

import json
import math
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .. import tree as st
from .._version import __version__
from ..errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    IncompatibleFormatError,
    NotACheckpointError,
    StateMismatchError,
)
from ..tree import ITEMSIZE
from .boxes import intersect, volume
from .chunk import CODEC_VERSIONS, is_chunk_hash
from .paths import STEP_DIR_RE, STEPS, manifest_key, rank_key
from .tree_check import newest_feature, problem

if TYPE_CHECKING:
    from ..storage.base import Storage


FORMAT = "ckpt"
FORMAT_VERSION = 4  # 2 adds per-rank entries and nodes, 3 numpy values as raw bytes, 4 the planes and xor
# codecs (delta chains); saves write the lowest that fits
MAX_CHAIN = 256  # a chain of deltas longer than this is refused as damaged (ckpt writes at most delta_chain)
MAX_CHUNK_BYTES = 1 << 34  # 16 GiB: a sanity bound on what a manifest may claim for one chunk
MAX_MANIFEST_BYTES = 1 << 30  # a manifest larger than this is refused before it is parsed
MAX_STEP = (1 << 63) - 1  # steps are non-negative 64-bit integers
MAX_WORLD = 1 << 24


@dataclass
class ChunkInfo:
    """One stored chunk: raw size, stored size (header included), codec descriptor (``zstd/1``) and,
    for a delta (``xor/1``), the chunk it is a delta of, which is then in the same table."""

    size: int
    stored: int
    codec: str
    base: str | None = None

    def to_json(self) -> list:
        return [self.size, self.stored, self.codec] + ([self.base] if self.base is not None else [])


def chain(chunks: dict[str, ChunkInfo], h: str) -> list[str]:
    """``h`` and its bases, newest first, down to the chunk stored whole. A base the table lacks ends
    the list (and is in it, so callers see it); a table that :func:`parse` checked lacks none."""
    out = [h]
    while out[-1] in chunks and (b := chunks[out[-1]].base) is not None and len(out) <= MAX_CHAIN:
        out.append(b)
    return out


def closure(chunks: dict[str, ChunkInfo], hashes, missing: set[str] | None = None) -> dict[str, ChunkInfo]:
    """The chunks ``hashes`` name and every base they need, from ``chunks``. A chunk the table lacks
    is added to ``missing`` where that is given (else KeyError)."""
    out: dict[str, ChunkInfo] = {}
    for h in hashes:
        for x in chain(chunks, h):
            if x in out:
                break
            if x not in chunks and missing is not None:
                missing.add(x)
                break
            out[x] = chunks[x]
    return out


@dataclass
class Segment:
    """``length`` bytes at ``offset`` of chunk ``chunk``, in order, make up a shard's bytes."""

    chunk: str
    offset: int
    length: int


@dataclass
class Shard:
    """The part of a tensor one rank saved: an N-d box (offsets, lengths) of the global tensor,
    stored row-major as a sequence of segments."""

    rank: int
    offsets: list[int]
    lengths: list[int]
    segments: list[Segment]


@dataclass
class TensorEntry:
    """A tensor of the state. ``rank`` is set for per-rank state (that rank's own tensor, whole);
    None for a global tensor, whose ``shards`` tile its ``shape``."""

    key: str
    dtype: str
    shape: list[int]
    shards: list[Shard]
    rank: int | None = None

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * ITEMSIZE[self.dtype]


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
    format_version: int = FORMAT_VERSION

    def to_json(self) -> bytes:
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
        raise CorruptCheckpointError(f"manifest {name} is invalid: {what}; the step is damaged", object=name)


def _is_int(v: Any, lo: int = 0, hi: int = MAX_STEP) -> bool:
    return type(v) is int and lo <= v <= hi


def _ints(v: Any, n: int | None = None) -> bool:
    return isinstance(v, list) and (n is None or len(v) == n) and all(_is_int(x) for x in v)


def _no_constants(name: str) -> None:
    raise ValueError(f"{name} is not a number JSON allows")


def parse(data: bytes | bytearray, *, name: str) -> Manifest:
    """Parse and validate a manifest read from storage object ``name``.

    Whatever the bytes hold, the outcome is a :class:`Manifest` every field of which has been checked,
    or a :class:`CorruptCheckpointError` (:class:`IncompatibleFormatError` for a newer format): never
    a ``RecursionError``, ``ValueError``, ``KeyError`` or ``TypeError`` from deep, huge or
    ill-typed JSON."""
    try:
        doc = json.loads(data, parse_constant=_no_constants)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:  # JSONDecodeError, ints of 4300+ digits
        raise CorruptCheckpointError(
            f"manifest {name} is not valid JSON ({type(e).__name__}: {str(e)[:200]}); the step is damaged",
            object=name) from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise NotACheckpointError(f"{name} is not a ckpt manifest (no \"format\": \"ckpt\" field)")
    version: Any = doc.get("format_version")  # untrusted JSON until _check says otherwise
    _check(_is_int(version, 1), name, "format_version must be a positive integer")
    if version > FORMAT_VERSION:
        raise IncompatibleFormatError(
            f"{name} was written by {str(doc.get('writer', 'a newer ckpt'))[:100]} in format v{version}; this ckpt "
            f"({__version__}) reads up to v{FORMAT_VERSION}. Upgrade: pip install -U ckpt")
    return _PARSERS[version](doc, name)


def _parse_v1(doc: dict, name: str) -> Manifest:
    # Every field is untrusted JSON (Any) until _check has looked at it.
    kind: Any = doc.get("kind")
    _check(kind in ("step", "rank"), name, "kind must be 'step' or 'rank'")
    _check(_is_int(doc.get("step")), name, f"step must be an integer from 0 to {MAX_STEP}")
    world: Any = doc.get("world_size")
    _check(_is_int(world, 1, MAX_WORLD), name, f"world_size must be an integer from 1 to {MAX_WORLD}")
    rank: Any = doc.get("rank")
    _check(rank is None or _is_int(rank, 0, MAX_WORLD), name, "rank must be a non-negative integer")
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
    raw_chunks: Any = doc.get("chunks")
    _check(isinstance(raw_chunks, dict), name, "chunks must be an object")
    chunks: dict[str, ChunkInfo] = {}
    for h, c in raw_chunks.items():
        _check(is_chunk_hash(h), name, f"chunk name {h[:40]!r} is not a 32-digit hex hash")
        _check(isinstance(c, list) and len(c) in (3, 4) and _is_int(c[0], 0, MAX_CHUNK_BYTES)
               and _is_int(c[1], 0, MAX_CHUNK_BYTES + 4096) and isinstance(c[2], str)
               and (len(c) == 3 or (isinstance(c[3], str) and is_chunk_hash(c[3]))),
               name, f"chunk {h} entry must be [size, stored, codec] or [size, stored, codec, base] within bounds")
        codec, _, cver = c[2].partition("/")
        if codec not in CODEC_VERSIONS or not cver.isdigit() or len(cver) > 4 or int(cver) > CODEC_VERSIONS[codec]:
            raise IncompatibleFormatError(
                f"{name}: chunk {h} uses codec {c[2][:40]!r}, which this ckpt ({__version__}) cannot decode; "
                "upgrade ckpt")
        _check((codec == "xor") == (len(c) == 4), name, f"chunk {h}: a delta (xor) and only a delta names a base")
        chunks[h] = ChunkInfo(c[0], c[1], c[2], c[3] if len(c) == 4 else None)
    check_chains(chunks, name)
    tensors: list[TensorEntry] = []
    seen: set[tuple[str, int | None]] = set()  # (key, owning rank)
    raw_tensors: Any = doc.get("tensors")
    _check(isinstance(raw_tensors, list), name, "tensors must be a list")
    for t in raw_tensors:
        _check(isinstance(t, dict) and isinstance(t.get("key"), str), name, "tensor entry without a key")
        key = t["key"]
        owner = t.get("rank")
        _check(owner is None or _is_int(owner, 0, world - 1 if kind == "step" else MAX_WORLD),
               name, f"tensor {key!r} names rank {str(owner)[:20]} outside the world size")
        _check((key, owner) not in seen, name, f"tensor {key!r} is listed twice")
        seen.add((key, owner))
        _check(t.get("dtype") in ITEMSIZE, name, f"tensor {key!r} has unknown dtype {str(t.get('dtype'))[:40]!r}")
        shape = t.get("shape")
        _check(_ints(shape) and len(shape) <= 64, name, f"tensor {key!r} has a bad shape")
        itemsize = ITEMSIZE[t["dtype"]]
        shards = []
        _check(isinstance(t.get("shards"), list), name, f"tensor {key!r} has no shard list")
        for s in t["shards"]:
            _check(isinstance(s, dict), name, f"tensor {key!r}: shard must be an object")
            offs, lens = s.get("offsets"), s.get("lengths")
            _check(_ints(offs, len(shape)) and _ints(lens, len(shape))
                   and all(o + n <= d for o, n, d in zip(offs, lens, shape)),
                   name, f"tensor {key!r}: a shard box does not fit shape {shape}")
            _check(_is_int(s.get("rank"), 0, MAX_WORLD), name, f"tensor {key!r}: shard rank must be a rank")
            raw_segs = s.get("segments", [])
            _check(isinstance(raw_segs, list), name, f"tensor {key!r}: segments must be a list")
            segs = []
            total = 0
            for g in raw_segs:
                _check(isinstance(g, list) and len(g) == 3 and isinstance(g[0], str) and _is_int(g[1])
                       and _is_int(g[2]), name, f"tensor {key!r}: segment must be [chunk, offset, length]")
                _check(g[0] in chunks, name, f"tensor {key!r} names chunk {g[0][:40]!r} missing from the chunk table")
                _check(g[1] + g[2] <= chunks[g[0]].size, name,
                       f"tensor {key!r}: segment runs past the end of chunk {g[0]}")
                segs.append(Segment(g[0], g[1], g[2]))
                total += g[2]
            _check(total == math.prod(lens) * itemsize, name,
                   f"tensor {key!r}: segments hold {total} bytes, the shard box needs {math.prod(lens) * itemsize}")
            shards.append(Shard(s["rank"], offs, lens, segs))
        if kind == "step":
            boxes = [(tuple(s.offsets), tuple(s.lengths)) for s in shards if volume(s.lengths) > 0]
            _check(sum(volume(b[1]) for b in boxes) == volume(shape) and (
                len(boxes) > 512 or not any(intersect(a, b) for i, a in enumerate(boxes) for b in boxes[i + 1:])),
                name, f"the shards of tensor {key!r} do not tile its shape {shape}")
        tensors.append(TensorEntry(key, t["dtype"], shape, shards, owner))
    why = problem(structure, {t.key for t in tensors} if kind == "step" else None)
    _check(why is None, name, f"its structure holds {why}")
    return Manifest(step=doc["step"], kind=kind, structure=structure, tensors=tensors, chunks=chunks, world_size=world,
                    rank=rank, created=float(created), writer=writer, stats=stats, format_version=doc["format_version"])


def check_chains(chunks: dict[str, ChunkInfo], name: str) -> None:
    """Every base is in the table and has its delta's size; chains end (no loop) within MAX_CHAIN links."""
    depth: dict[str, int] = {}  # deltas between a chunk and the whole chunk its chain ends in
    for h in chunks:
        path: list[str] = []
        on_path: set[str] = set()
        x: str | None = h
        while x is not None and x not in depth:
            _check(x not in on_path, name, f"the delta chain of chunk {h} loops")
            path.append(x)
            on_path.add(x)
            b = chunks[x].base
            if b is not None:
                _check(b in chunks, name, f"chunk {x} is a delta of {b}, which is not in the chunk table")
                _check(chunks[b].size == chunks[x].size, name, f"chunk {x} is a delta of {b}, which has another size")
            x = b
        d = -1 if x is None else depth[x]
        for p in reversed(path):
            d += 1
            depth[p] = d
        _check(d <= MAX_CHAIN, name, f"the delta chain of chunk {h} is longer than {MAX_CHAIN}")


# One parser per format version: a new version adds an entry instead of growing an if-chain.
# Version 2 only adds optional fields (per-rank entries and nodes) that version 1 never wrote.
# Version 3 only adds numpy values stored as raw bytes (tensor nodes with a numpy dtype string,
# npscalar nodes with "b"), which a version-2 reader would hand back as bytes.
# Version 4 only adds the planes and xor codecs and the base of xor entries in the chunk table.
_PARSERS = {1: _parse_v1, 2: _parse_v1, 3: _parse_v1, 4: _parse_v1}


def merge(step: int, parts: list[Manifest], per_rank: set[str] | frozenset = frozenset()) -> Manifest:
    """The step manifest from every rank's report: tensors' shards and chunk tables combined.

    A top-level key of the state is stored once when every rank's value is the same and it is not
    per-rank state; otherwise as a ``per_rank`` node holding each rank's value (nothing is dropped)."""
    parts = sorted(parts, key=lambda p: p.rank or 0)
    by_key: dict[tuple[str, int | None], TensorEntry] = {}
    chunks: dict[str, ChunkInfo] = {}
    stats: dict[str, int | float] = {}
    for part in parts:
        chunks.update(part.chunks)
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
        if k in per_rank or any(v != per[0] for v in per[1:]):
            values.append(st.per_rank_node(per))
        else:
            values.append(per[0])
    tensors = list(by_key.values())
    # Version 1 readers load anything without per-rank parts (they refuse multi-shard tensors clearly).
    simple = all(t.rank is None for t in tensors) and not any(st.is_per_rank(v) for v in values)
    structure = st.dict_node(tops, values)
    version = max(1 if simple else 2, newest_feature(structure),  # the lowest that holds it: older readers read it
                  4 if any(c.codec.split("/")[0] in ("planes", "xor") for c in chunks.values()) else 1)
    return Manifest(step=step, kind="step", structure=structure, tensors=tensors,
                    chunks=chunks, world_size=len(parts), stats=stats, format_version=version)


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
        raise CorruptCheckpointError(f"manifest {key} is larger than {MAX_MANIFEST_BYTES >> 20} MiB; it is damaged",
                                     object=key)
    return data


def read_step(storage: Storage, step: int) -> Manifest:
    """The committed manifest of ``step``, parsed and checked to describe that step.

    Raises :class:`CheckpointNotFoundError` if it does not exist, :class:`CorruptCheckpointError`
    if it does not parse or check."""
    key = manifest_key(step)
    try:
        data = _read_bounded(storage, key)
    except FileNotFoundError:
        raise CheckpointNotFoundError(f"step {step} has no manifest in {storage.describe()}") from None
    m = parse(data, name=key)
    if m.step != step or m.kind != "step":
        raise CorruptCheckpointError(f"manifest {key} describes step {m.step} ({m.kind}), not step {step}", object=key)
    return m


def read_rank_part(storage: Storage, step: int, rank: int) -> Manifest:
    """Rank ``rank``'s report for ``step`` (what it wrote), parsed and checked to be that report."""
    key = rank_key(step, rank)
    return parse_rank_part(_read_bounded(storage, key), step, rank)


def parse_rank_part(data: bytes | bytearray, step: int, rank: int) -> Manifest:
    """A rank report's bytes (from storage, or sent through the store), checked to be rank ``rank``'s for ``step``."""
    key = rank_key(step, rank)
    m = parse(data, name=key)
    if m.kind != "rank" or m.rank != rank or m.step != step:
        raise CorruptCheckpointError(f"{key} describes rank {m.rank} step {m.step}, not rank {rank} step {step}",
                                     object=key)
    return m


class ManifestCache:
    """Parsed step manifests by step, each read and checked once while it stays in the cache.

    ``get`` raises on a missing or damaged manifest; ``find`` returns None instead and keeps the
    reason in ``errors`` (for tools that report every step, damaged or not). ``maxsize`` bounds how
    many manifests are kept (the least recently used go first; None keeps all), so a long run's
    memory does not grow with its number of steps."""

    def __init__(self, storage: Storage, maxsize: int | None = None):
        self.storage = storage
        self.maxsize = maxsize
        self._by_step: OrderedDict[int, Manifest] = OrderedDict()
        self.errors: dict[int, str] = {}
        self._lock = threading.Lock()

    def put(self, m: Manifest) -> None:
        with self._lock:
            self._by_step[m.step] = m
            self._by_step.move_to_end(m.step)
            self.errors.pop(m.step, None)
            while self.maxsize is not None and len(self._by_step) > self.maxsize:
                self._by_step.popitem(last=False)

    def drop(self, step: int) -> None:
        with self._lock:
            self._by_step.pop(step, None)
            self.errors.pop(step, None)

    def get(self, step: int) -> Manifest:
        with self._lock:
            m = self._by_step.get(step)
            if m is not None:
                self._by_step.move_to_end(step)
        if m is None:
            m = read_step(self.storage, step)
            self.put(m)
        return m

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
