"""A manifest's tables: the chunk table and the tensor entries (records, and the checks
:func:`ckpt.format.manifest.parse` runs on them as untrusted JSON).

The checks run once per tensor of the state (100,000 for a large ``state_dict``), so each error
message is formatted only when its check fails. They also bound what a reader may allocate for a
chunk: a chunk is never larger than the bytes the table's own tensors place in it, plus alignment
padding (:func:`check_chunk_sizes`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from .._version import __version__
from ..errors import CorruptCheckpointError, IncompatibleFormatError
from ..tree import ITEMSIZE
from .boxes import check_tiles
from .chunk import CODEC_VERSIONS, is_chunk_hash

MAX_CHAIN = 256  # a chain of deltas longer than this is refused as damaged (ckpt writes at most delta_chain)
MAX_CHUNK_BYTES = 1 << 34  # 16 GiB: a sanity bound on what a manifest may claim for one chunk
MAX_STEP = (1 << 63) - 1  # steps are non-negative 64-bit integers
MAX_WORLD = 1 << 24
# Every tensor starts at most ALIGN-aligned in the buffer its rank's chunks cut (ckpt.save.buffer_layout:
# tensors smaller than ALIGN only to their element), so a chunk holds less than ALIGN bytes of
# padding before each of its segments and after the last.
ALIGN = 64


@dataclass
class ChunkInfo:
    """One stored chunk: raw size, stored size (header included), codec descriptor (``zstd/1``) and,
    for a delta (``xor/1``), the chunk it is a delta of, which is then in the same table. ``spans``:
    the digests of its 1 MiB spans where it is stored raw (:mod:`.spans`; the manifest keeps them in a
    field of their own, and two descriptions of one chunk are the same with or without them)."""

    size: int
    stored: int
    codec: str
    base: str | None = None
    spans: str | None = field(default=None, compare=False)

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


# -- checking the tables of an untrusted manifest ---------------------------------------------------

def bad(name: str, what: str, chunk: str | None = None) -> CorruptCheckpointError:
    """The error for manifest ``name`` (a storage key), naming what is wrong (and the chunk, if one is)."""
    return CorruptCheckpointError(f"manifest {name} is invalid: {what}; the step is damaged", object=name, chunk=chunk)


def is_int(v: Any, lo: int = 0, hi: int = MAX_STEP) -> bool:
    return type(v) is int and lo <= v <= hi


def ints(v: Any, n: int | None = None) -> bool:
    return isinstance(v, list) and (n is None or len(v) == n) and all(is_int(x) for x in v)


def parse_chunks(raw: Any, name: str) -> dict[str, ChunkInfo]:
    """The chunk table, every entry and chain checked (sizes against the tensors: :func:`check_chunk_sizes`)."""
    if not isinstance(raw, dict):
        raise bad(name, "chunks must be an object")
    chunks: dict[str, ChunkInfo] = {}
    for h, c in raw.items():
        if not is_chunk_hash(h):
            raise bad(name, f"chunk name {h[:40]!r} is not a 32-digit hex hash")
        if not (isinstance(c, list) and len(c) in (3, 4) and is_int(c[0], 0, MAX_CHUNK_BYTES)
                and is_int(c[1], 0, MAX_CHUNK_BYTES + 4096) and isinstance(c[2], str)
                and (len(c) == 3 or (isinstance(c[3], str) and is_chunk_hash(c[3])))):
            raise bad(name, f"chunk {h} entry must be [size, stored, codec] or [size, stored, codec, base] "
                      "within bounds", h)
        codec, _, cver = c[2].partition("/")
        if codec not in CODEC_VERSIONS or not cver.isdigit() or len(cver) > 4 or int(cver) > CODEC_VERSIONS[codec]:
            raise IncompatibleFormatError(
                f"{name}: chunk {h} uses codec {c[2][:40]!r}, which this ckpt ({__version__}) cannot decode; "
                "upgrade ckpt")
        if (codec == "xor") != (len(c) == 4):
            raise bad(name, f"chunk {h}: a delta (xor) and only a delta names a base", h)
        chunks[h] = ChunkInfo(c[0], c[1], c[2], c[3] if len(c) == 4 else None)
    check_chains(chunks, name)
    return chunks


def check_chains(chunks: dict[str, ChunkInfo], name: str) -> None:
    """Every base is in the table and has its delta's size; chains end (no loop) within MAX_CHAIN links."""
    depth: dict[str, int] = {}  # deltas between a chunk and the whole chunk its chain ends in
    for h in chunks:
        path: list[str] = []
        on_path: set[str] = set()
        x: str | None = h
        while x is not None and x not in depth:
            if x in on_path:
                raise bad(name, f"the delta chain of chunk {h} loops", h)
            path.append(x)
            on_path.add(x)
            b = chunks[x].base
            if b is not None:
                if b not in chunks:
                    raise bad(name, f"chunk {x} is a delta of {b}, which is not in the chunk table", x)
                if chunks[b].size != chunks[x].size:
                    raise bad(name, f"chunk {x} is a delta of {b}, which has another size", x)
            x = b
        d = -1 if x is None else depth[x]
        for p in reversed(path):
            d += 1
            depth[p] = d
        if d > MAX_CHAIN:
            raise bad(name, f"the delta chain of chunk {h} is longer than {MAX_CHAIN}", h)


def parse_tensor(t: Any, chunks: dict[str, ChunkInfo], top_rank: int, name: str) -> TensorEntry:
    """One entry of ``tensors``, every field checked (``top_rank``: the highest rank it may name)."""
    if not (isinstance(t, dict) and isinstance(t.get("key"), str)):
        raise bad(name, "tensor entry without a key")
    key = t["key"]
    owner = t.get("rank")
    if not (owner is None or is_int(owner, 0, top_rank)):
        raise bad(name, f"tensor {key!r} names rank {str(owner)[:20]} outside the world size")
    dtype = t.get("dtype")
    if not (isinstance(dtype, str) and dtype in ITEMSIZE):
        raise bad(name, f"tensor {key!r} has unknown dtype {str(dtype)[:40]!r}")
    shape: Any = t.get("shape")  # untrusted until checked, like every field here
    if not (ints(shape) and len(shape) <= 64):
        raise bad(name, f"tensor {key!r} has a bad shape")
    raw_shards = t.get("shards")
    if not isinstance(raw_shards, list):
        raise bad(name, f"tensor {key!r} has no shard list")
    itemsize = ITEMSIZE[dtype]
    shards = [_parse_shard(s, key, shape, itemsize, chunks, name) for s in raw_shards]
    return TensorEntry(key, dtype, shape, shards, owner)


def _parse_shard(s: Any, key: str, shape: list[int], itemsize: int, chunks: dict[str, ChunkInfo],
                 name: str) -> Shard:
    if not isinstance(s, dict):
        raise bad(name, f"tensor {key!r}: shard must be an object")
    offs: Any = s.get("offsets")
    lens: Any = s.get("lengths")
    if not (ints(offs, len(shape)) and ints(lens, len(shape))
            and all(o + n <= d for o, n, d in zip(offs, lens, shape))):
        raise bad(name, f"tensor {key!r}: a shard box does not fit shape {shape}")
    if not is_int(s.get("rank"), 0, MAX_WORLD):
        raise bad(name, f"tensor {key!r}: shard rank must be a rank")
    raw_segs = s.get("segments", [])
    if not isinstance(raw_segs, list):
        raise bad(name, f"tensor {key!r}: segments must be a list")
    segs = []
    total = 0
    for g in raw_segs:
        if not (isinstance(g, list) and len(g) == 3 and isinstance(g[0], str) and is_int(g[1]) and is_int(g[2])):
            raise bad(name, f"tensor {key!r}: segment must be [chunk, offset, length]")
        info = chunks.get(g[0])
        if info is None:
            raise bad(name, f"tensor {key!r} names chunk {g[0][:40]!r} missing from the chunk table")
        if g[1] + g[2] > info.size:
            raise bad(name, f"tensor {key!r}: segment runs past the end of chunk {g[0]}", g[0])
        segs.append(Segment(g[0], g[1], g[2]))
        total += g[2]
    need = math.prod(lens) * itemsize
    if total != need:
        raise bad(name, f"tensor {key!r}: segments hold {total} bytes, the shard box needs {need}")
    return Shard(s["rank"], offs, lens, segs)


def check_tiling(t: TensorEntry, name: str) -> None:
    """A step's shards of a global tensor cover its shape exactly, none overlapping another
    (:func:`~ckpt.format.boxes.check_tiles`, at every shard count)."""
    why = check_tiles([(tuple(s.offsets), tuple(s.lengths)) for s in t.shards], t.shape)
    if why is not None:
        raise bad(name, f"the shards of tensor {t.key!r} do not tile its shape {t.shape}: {why}")


def check_chunk_sizes(chunks: dict[str, ChunkInfo], tensors: list[TensorEntry], name: str) -> None:
    """No chunk claims more bytes than the tensors place in it, plus the padding around them.

    Readers allocate a chunk's size to decode it (a compressed chunk's size is only known for sure
    once it is decoded), so that size is believed only as far as the step's own tensors account for
    it: at most ALIGN + the sum of (segment length + ALIGN) over the segments in it. A chunk no
    segment names is padding alone (less than ALIGN), or the base of a delta: a base has its delta's
    size (:func:`check_chains`) and every chain ends in a delta no other chunk is based on, which
    this checks."""
    held: dict[str, int] = {}
    for t in tensors:
        for s in t.shards:
            for g in s.segments:
                held[g.chunk] = held.get(g.chunk, ALIGN) + g.length + ALIGN
    bases = {c.base for c in chunks.values() if c.base is not None}
    for h, c in chunks.items():
        if h in bases:
            continue  # a base: the size of its delta, checked where that chain starts
        room = held.get(h, ALIGN)
        if c.size > room:
            raise bad(name, f"chunk {h} claims {c.size} bytes, more than the {room} its tensors' segments and their "
                      "padding account for", h)
