"""The manifest: a typed, plain JSON description of one step (and of one rank's part of it).

A manifest is untrusted input when read back: :func:`parse` checks every field it relies on
(types, hash syntax, dtype names, sizes that add up) and raises
:class:`~ckpt.errors.CorruptCheckpointError` naming the object otherwise. Readers dispatch on
``format_version``; a newer version is refused with :class:`~ckpt.errors.IncompatibleFormatError`.
"""

from __future__ import annotations

import json
import math
import re
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from . import structure as st
from ._version import __version__
from .codec import CODEC_VERSIONS, is_chunk_hash
from .errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    IncompatibleFormatError,
    NotACheckpointError,
    StateMismatchError,
)
from .sharding import intersect, volume
from .structure import DTYPES

if TYPE_CHECKING:
    from .storage import Storage

FORMAT = "ckpt"
FORMAT_VERSION = 2  # 2 adds per-rank entries and per_rank structure nodes; plain saves still write 1
MAX_CHUNK_BYTES = 1 << 34  # 16 GiB: a sanity bound on what a manifest may claim for one chunk


STEP_DIR_RE = re.compile(r"^\d{12}$")


def step_dir(step: int) -> str:
    return f"steps/{step:012d}"


def manifest_key(step: int) -> str:
    return f"{step_dir(step)}/MANIFEST.json"


def rank_key(step: int, rank: int) -> str:
    return f"{step_dir(step)}/rank-{rank:05d}.json"


def chunk_key(h: str) -> str:
    return f"chunks/{h[:2]}/{h}"


@dataclass
class ChunkInfo:
    """One stored chunk: raw size, stored size (header included) and codec descriptor (``zstd/1``)."""

    size: int
    stored: int
    codec: str


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
        return math.prod(self.shape) * DTYPES[self.dtype].itemsize


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
            "chunks": {h: [c.size, c.stored, c.codec] for h, c in self.chunks.items()},
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
        raise CorruptCheckpointError(f"manifest {name} is invalid: {what}", object=name)


def _is_int(v: Any, lo: int = 0) -> bool:
    return type(v) is int and v >= lo


def parse(data: bytes, *, name: str) -> Manifest:
    """Parse and validate a manifest read from storage object ``name``."""
    try:
        doc = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CorruptCheckpointError(
            f"manifest {name} is not valid JSON ({e}); the step is damaged: load another step "
            "(or pass fallback=True to load('latest'))", object=name) from e
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise NotACheckpointError(f"{name} is not a ckpt manifest (no \"format\": \"ckpt\" field)")
    version: Any = doc.get("format_version")  # untrusted JSON until _check says otherwise
    _check(_is_int(version, 1), name, "format_version must be a positive integer")
    if version > FORMAT_VERSION:
        raise IncompatibleFormatError(
            f"{name} was written by {doc.get('writer', 'a newer ckpt')} in format v{version}; this ckpt "
            f"({__version__}) reads up to v{FORMAT_VERSION}. Upgrade: pip install -U ckpt")
    return _PARSERS[version](doc, name)


def _parse_v1(doc: dict, name: str) -> Manifest:
    _check(doc.get("kind") in ("step", "rank"), name, "kind must be 'step' or 'rank'")
    _check(_is_int(doc.get("step")), name, "step must be a non-negative integer")
    _check(_is_int(doc.get("world_size"), 1), name, "world_size must be a positive integer")
    # Fields of untrusted JSON: Any, each checked by _check before it is used.
    structure: Any = doc.get("structure")
    _check(st.kind(structure) == "dict" and isinstance(structure.get("k"), list)
           and isinstance(structure.get("v"), list) and len(structure["k"]) == len(structure["v"]),
           name, "structure must be a dict node")
    for k, v in st.top_items(structure):
        if st.is_per_rank(v):
            _check(doc.get("kind") == "step" and isinstance(v.get("v"), list) and len(v["v"]) == doc.get("world_size"),
                   name, f"per-rank key {k!r} must hold one value per rank ({doc.get('world_size')})")
    raw_chunks: Any = doc.get("chunks")
    _check(isinstance(raw_chunks, dict), name, "chunks must be an object")
    chunks: dict[str, ChunkInfo] = {}
    for h, c in raw_chunks.items():
        _check(is_chunk_hash(h), name, f"chunk name {h[:40]!r} is not a 32-digit hex hash")
        _check(isinstance(c, list) and len(c) == 3 and _is_int(c[0]) and _is_int(c[1]) and isinstance(c[2], str),
               name, f"chunk {h} entry must be [size, stored, codec]")
        _check(c[0] <= MAX_CHUNK_BYTES and c[1] <= MAX_CHUNK_BYTES + 4096, name, f"chunk {h} claims an absurd size")
        codec, _, cver = c[2].partition("/")
        if codec not in CODEC_VERSIONS or not cver.isdigit() or int(cver) > CODEC_VERSIONS[codec]:
            raise IncompatibleFormatError(
                f"{name}: chunk {h} uses codec {c[2]!r}, which this ckpt ({__version__}) cannot decode; upgrade ckpt")
        chunks[h] = ChunkInfo(c[0], c[1], c[2])
    tensors: list[TensorEntry] = []
    seen: set[tuple[str, int | None]] = set()  # (key, owning rank)
    _check(isinstance(doc.get("tensors"), list), name, "tensors must be a list")
    for t in doc["tensors"]:
        _check(isinstance(t, dict) and isinstance(t.get("key"), str), name, "tensor entry without a key")
        key = t["key"]
        owner = t.get("rank")
        _check(owner is None or (_is_int(owner) and owner < doc["world_size"]) or doc["kind"] == "rank",
               name, f"tensor {key!r} names rank {owner!r} outside the world size")
        _check((key, owner) not in seen, name, f"tensor {key!r} is listed twice")
        seen.add((key, owner))
        _check(t.get("dtype") in DTYPES, name, f"tensor {key!r} has unknown dtype {t.get('dtype')!r}")
        shape = t.get("shape")
        _check(isinstance(shape, list) and all(_is_int(d) for d in shape), name, f"tensor {key!r} has a bad shape")
        itemsize = DTYPES[t["dtype"]].itemsize
        shards = []
        _check(isinstance(t.get("shards"), list), name, f"tensor {key!r} has no shard list")
        for s in t["shards"]:
            _check(isinstance(s, dict), name, f"tensor {key!r}: shard must be an object")
            offs, lens = s.get("offsets"), s.get("lengths")
            _check(isinstance(offs, list) and isinstance(lens, list) and len(offs) == len(shape) == len(lens)
                   and all(_is_int(o) for o in offs) and all(_is_int(n) for n in lens)
                   and all(o + n <= d for o, n, d in zip(offs, lens, shape)),
                   name, f"tensor {key!r}: shard box {offs}+{lens} does not fit shape {shape}")
            _check(_is_int(s.get("rank")), name, f"tensor {key!r}: shard rank must be a non-negative integer")
            segs = []
            total = 0
            for g in s.get("segments", []):
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
        if doc["kind"] == "step":
            boxes = [(tuple(s.offsets), tuple(s.lengths)) for s in shards if volume(s.lengths) > 0]
            _check(sum(volume(b[1]) for b in boxes) == volume(shape) and (
                len(boxes) > 512 or not any(intersect(a, b) for i, a in enumerate(boxes) for b in boxes[i + 1:])),
                name, f"the shards of tensor {key!r} do not tile its shape {shape}")
        tensors.append(TensorEntry(key, t["dtype"], shape, shards, owner))
    created = doc.get("created", 0.0)
    stats = doc.get("stats")
    return Manifest(
        step=doc["step"], kind=doc["kind"], structure=doc["structure"], tensors=tensors, chunks=chunks,
        world_size=doc["world_size"], rank=doc.get("rank"),
        created=float(created) if isinstance(created, (int, float)) else 0.0,
        writer=str(doc.get("writer", "")), stats=stats if isinstance(stats, dict) else {},
        format_version=doc["format_version"],
    )


# One parser per format version: a new version adds an entry instead of growing an if-chain.
# Version 2 only adds optional fields (per-rank entries and nodes) that version 1 never wrote.
_PARSERS = {1: _parse_v1, 2: _parse_v1}


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
    return Manifest(step=step, kind="step", structure=st.dict_node(tops, values), tensors=tensors,
                    chunks=chunks, world_size=len(parts), stats=stats, format_version=1 if simple else FORMAT_VERSION)


# -- reading manifests from storage ---------------------------------------------------------------

def step_candidates(storage: Storage) -> list[int]:
    """Step numbers that have a directory (committed or not), ascending."""
    return sorted(int(n) for n in storage.list("steps") if STEP_DIR_RE.match(n))


def committed_steps(storage: Storage) -> list[int]:
    """Steps whose MANIFEST.json exists, ascending. (Whether it parses is checked when it is read.)"""
    return [s for s in step_candidates(storage) if storage.exists(manifest_key(s))]


def read_step(storage: Storage, step: int) -> Manifest:
    """The committed manifest of ``step``, parsed and checked to describe that step.

    Raises :class:`CheckpointNotFoundError` if it does not exist, :class:`CorruptCheckpointError`
    if it does not parse or check."""
    key = manifest_key(step)
    try:
        data = storage.read(key)
    except FileNotFoundError:
        raise CheckpointNotFoundError(f"step {step} has no manifest in {storage.describe()}") from None
    m = parse(data, name=key)
    if m.step != step or m.kind != "step":
        raise CorruptCheckpointError(f"manifest {key} describes step {m.step} ({m.kind}), not step {step}", object=key)
    return m


def read_rank_part(storage: Storage, step: int, rank: int) -> Manifest:
    """Rank ``rank``'s report for ``step`` (what it wrote), parsed and checked to be that report."""
    key = rank_key(step, rank)
    m = parse(storage.read(key), name=key)
    if m.kind != "rank" or m.rank != rank or m.step != step:
        raise CorruptCheckpointError(f"{key} describes rank {m.rank} step {m.step}, not rank {rank} step {step}",
                                     object=key)
    return m


class ManifestCache:
    """Parsed step manifests by step, each read and checked at most once per process.

    ``get`` raises on a missing or damaged manifest; ``find`` returns None instead and keeps the
    reason in ``errors`` (for tools that report every step, damaged or not)."""

    def __init__(self, storage: Storage):
        self.storage = storage
        self._by_step: dict[int, Manifest] = {}
        self.errors: dict[int, str] = {}
        self._lock = threading.Lock()

    def put(self, m: Manifest) -> None:
        with self._lock:
            self._by_step[m.step] = m
            self.errors.pop(m.step, None)

    def drop(self, step: int) -> None:
        with self._lock:
            self._by_step.pop(step, None)
            self.errors.pop(step, None)

    def get(self, step: int) -> Manifest:
        with self._lock:
            m = self._by_step.get(step)
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
