"""Chunk objects: a fixed 64-byte header followed by the (possibly compressed) payload.

The header makes every chunk checkable on its own, without the manifest:

    offset size  field
    0      8     magic b"CKPTCHNK"
    8      2     chunk format version (1)
    10     1     codec id (0 raw, 1 zstd, 2 planes, 3 xor)
    11     1     planes, xor: element width of the byte planes (bits 0-4), elements rotated (bit 7)
    12     4     xor: low 32 bits of the payload's xxh3-64 (a check that needs no base); 0 otherwise
    16     8     raw length in bytes
    24     16    xxh3-128 digest of the raw bytes (the chunk's name is its hex form)
    40     16    xor: digest of the base chunk (all zero: no base)
    56     8     payload length in bytes

Codecs (their names in manifests carry a version, like ``zstd/1``, so an older reader refuses
clearly what it cannot decode instead of guessing):

* ``raw``: the bytes as they are.
* ``zstd``: one zstd frame.
* ``planes``: the bytes of each w-byte element split into w planes (plane 0 the least significant
  byte of every element), each plane its own zstd frame or stored as it is, whichever is smaller;
  floats compress in their sign/exponent plane, hardly at all in the others.
* ``xor``: the chunk XOR its base (the chunk at the same place in this rank's previous save), then
  planes. Unchanged bits become zero bits; partly frozen or sparsely updated state nearly vanishes.

``planes`` and ``xor`` payloads start with a table of w + 1 little-endian u64 (bit 63: the section is
a zstd frame; the rest: its stored length), for the w planes and the n mod w tail bytes (stored as
they are), then the sections in that order.

``auto`` chooses per chunk from a 256 KiB sample taken from the chunk's middle: it encodes the sample
the ways that can win (planes, or zstd for byte-wide data; xor when a base is there) and keeps the
smallest, or raw when none saves 8%; a plane is compressed only where the sample's plane shrank.
Where saves stored raw are measured to go faster than encoded ones (storage faster than compression),
it stores raw (:class:`Pace`): ``auto`` never makes saves slower than ``raw`` to get fewer bytes.
"""

from __future__ import annotations

import os
import re
import struct
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np
import xxhash
import zstandard

from . import _ext
from .errors import ConfigError, CorruptCheckpointError, IncompatibleFormatError

MAGIC = b"CKPTCHNK"
CHUNK_VERSION = 1
HEADER = struct.Struct("<8sHBBIQ16s16sQ")
HEADER_SIZE = HEADER.size  # 64
NO_BASE = bytes(16)

CODEC_IDS = {"raw": 0, "zstd": 1, "planes": 2, "xor": 3}
CODEC_NAMES = {v: k for k, v in CODEC_IDS.items()}
CODEC_VERSIONS = {"raw": 1, "zstd": 1, "planes": 1, "xor": 1}
PLANED = ("planes", "xor")
MAX_WIDTH = 16
_ROTATED = 0x80  # header flags bit: the planes are of elements rotated left one bit
MAX_RAW = 1 << 34  # no chunk holds more (manifest.MAX_CHUNK_BYTES): a header that says so is damaged

HASH_RE = re.compile(r"^[0-9a-f]{32}$")

# "auto" encodes a sample first and keeps an encoding only where it saves at least this fraction.
_AUTO_SAMPLE = 256 * 1024
_AUTO_MIN_SAVING = 0.08
_PLANE_MIN_SAVING = 0.03  # a plane that shrinks less than this is stored as it is (and not compressed again)
_MIN_COMPRESS_SIZE = 4096
_ZSTD_FLAG = 1 << 63


def chunk_hash(data) -> str:
    """xxh3-128 of ``data`` (any buffer) as 32 hex digits: the chunk's content address."""
    return xxhash.xxh3_128_hexdigest(data)


def is_chunk_hash(name: str) -> bool:
    return bool(HASH_RE.match(name))


@dataclass(frozen=True)
class CodecSpec:
    """What the writer should try: ``raw``; ``zstd`` or ``grouped`` (byte planes + zstd) always;
    ``smallest`` (per chunk the smallest of raw, zstd, planes and xor); ``auto`` (the same, but
    saves go raw where that is measured to be faster: :class:`Pace`)."""

    name: str = "auto"
    level: int = 1

    NAMES = ("raw", "zstd", "grouped", "smallest", "auto")
    CHOOSING = ("smallest", "auto")  # the names that choose per chunk (and may store deltas)

    @classmethod
    def parse(cls, codec: str, level: int | None = None) -> CodecSpec:
        """Accept ``"raw"``, or ``"auto"``, ``"smallest"``, ``"zstd"``, ``"grouped"`` with an optional ``:<level>``."""
        name, _, lvl = codec.partition(":")
        if name not in cls.NAMES or (lvl and name == "raw"):
            raise ConfigError(f"unknown codec {codec!r}; use 'auto', 'smallest', 'raw', 'zstd', 'grouped' (byte planes "
                              "+ zstd), optionally with a zstd level, e.g. 'zstd:3'")
        if lvl:
            try:
                level = int(lvl)
            except ValueError:
                raise ConfigError(f"codec {codec!r}: the zstd level must be an integer, e.g. 'zstd:3'") from None
        level = 1 if level is None else level
        if not -7 <= level <= 22:
            raise ConfigError(f"zstd level {level} is out of range; use -7..22 (1 is fast, 3 is zstd's default)")
        return cls(name, level)


_local = threading.local()


def _compressor(level: int) -> zstandard.ZstdCompressor:
    # zstd contexts are not thread-safe; each worker thread keeps its own per level.
    cache = getattr(_local, "cctx", None)
    if cache is None:
        cache = _local.cctx = {}
    cctx = cache.get(level)
    if cctx is None:
        cctx = cache[level] = zstandard.ZstdCompressor(level=level, write_content_size=True)
    return cctx


def _decompressor() -> zstandard.ZstdDecompressor:
    dctx = getattr(_local, "dctx", None)
    if dctx is None:
        dctx = _local.dctx = zstandard.ZstdDecompressor()
    return dctx


# -- byte planes ------------------------------------------------------------------------------------

def trim_scratch() -> None:
    """Let every thread's scratch memory go (after a load or a verify: saves keep theirs). A buffer
    in use stays alive where it is used; only the caches forget it."""
    with _scratch_lock:
        for cache in _scratch_caches:
            cache.clear()

_scratch_caches: list[dict[str, np.ndarray]] = []  # every thread's, so trim_scratch can reach them
_scratch_lock = threading.Lock()


def scratch(name: str, n: int) -> np.ndarray:
    """A per-thread uint8 buffer of ``n`` bytes kept for reuse (fresh memory costs a page fault per
    4 KiB, more than the byte shuffling itself). Valid until this thread asks for ``name`` again.
    A writing thread keeps about one chunk of it; reading keeps about two until :func:`trim_scratch`."""
    cache = getattr(_local, "scratch", None)
    if cache is None:
        cache = _local.scratch = {}
        with _scratch_lock:
            _scratch_caches.append(cache)
    buf = cache.get(name)
    if buf is None or buf.size < n:
        buf = cache[name] = np.empty(max(n, 1), np.uint8)
    return buf[:n]


def _u8(buf) -> np.ndarray:
    return np.frombuffer(buf, dtype=np.uint8)


ROTATES = (2, 4, 8)  # widths whose elements may be rotated (floats: bfloat16, float32, float64)
_WORD: dict[int, np.dtype] = {2: np.dtype("<u2"), 4: np.dtype("<u4"), 8: np.dtype("<u8")}


def group(raw, base, width: int, out: np.ndarray | None = None, rot: bool = False) -> np.ndarray:
    """``raw`` (XOR ``base`` when given, same length) in the grouped layout: ``width`` byte planes,
    then the tail bytes; with ``rot`` every element is first rotated left by one bit (the sign to
    the bottom: a float's top plane then holds exponent bits only). The compiled core does it when
    built; numpy gives the same bytes."""
    src = _u8(raw)
    b = None if base is None else _u8(base)
    out = np.empty(src.size, np.uint8) if out is None else out
    core = _ext.cpu()
    if core is not None and width > 1:
        core.group(src, b, width, out, rot)
        return out
    m = src.size // width
    body = src[: m * width]
    if b is not None:
        body = body ^ b[: m * width]
    if rot:
        v = body.view(_WORD[width])
        body = ((v << 1) | (v >> (8 * width - 1))).view(np.uint8)
    np.copyto(out[: m * width].reshape(width, m), body.reshape(m, width).T)
    if b is None:
        out[m * width:] = src[m * width:]
    else:
        np.bitwise_xor(src[m * width:], b[m * width:], out=out[m * width:])
    return out


def ungroup(planes: np.ndarray, base, width: int, out: np.ndarray, rot: bool = False) -> np.ndarray:
    """The inverse of :func:`group`, into ``out`` (uint8, same length; ``base`` may be ``out``)."""
    m = planes.size // width
    _ungroup([planes[p * m:(p + 1) * m] for p in range(width)] + [planes[m * width:]], base, width, out, rot)
    return out


def _ungroup(planes: list[np.ndarray], base, width: int, out: np.ndarray, rot: bool) -> None:
    """:func:`ungroup` from separate plane buffers (``width`` planes, then the tail)."""
    n = out.size
    b = None if base is None else _u8(base)
    core = _ext.cpu()
    if core is not None:
        core.ungroup_planes(planes[:width], planes[width], b, n, out, rot)
        return
    m = n // width
    word = np.empty((m, width), np.uint8)
    for p in range(width):  # a column at a time: numpy's transposed copy back is several times slower
        word[:, p] = planes[p]
    if rot:
        v = word.reshape(-1).view(_WORD[width])
        word = ((v >> 1) | (v << (8 * width - 1))).view(np.uint8).reshape(m, width)
    if b is None:
        out[: m * width] = word.reshape(-1)
        out[m * width:] = planes[width]
    else:
        np.bitwise_xor(word.reshape(-1), b[: m * width], out=out[: m * width])
        np.bitwise_xor(planes[width], b[m * width:], out=out[m * width:])


def _sections(n: int, width: int) -> list[int]:
    """Lengths of the sections of an ``n``-byte chunk grouped by ``width``: the planes, then the tail."""
    m = n // width
    return [m] * width + [n - m * width]


def _encode_planes(g: np.ndarray, width: int, level: int, try_planes: list[bool] | None
                   ) -> tuple[list, int, list[bool]]:
    """Sections of grouped bytes ``g``: each plane compressed where ``try_planes`` says (all when
    None) and it shrinks. Returns (payload buffers, payload length, which planes shrank)."""
    cctx = _compressor(level)
    table = np.zeros(width + 1, "<u8")
    parts: list = [table.view(np.uint8).data]
    shrank = []
    pos = 0
    for i, n in enumerate(_sections(g.size, width)):
        sec = g[pos:pos + n]
        pos += n
        stored: bytes | memoryview = sec.data
        if i < width and n >= 64 and (try_planes is None or try_planes[i]):
            packed = cctx.compress(sec.data)
            if len(packed) < n * (1 - _PLANE_MIN_SAVING):
                stored = packed
                table[i] = _ZSTD_FLAG
        if i < width:
            shrank.append(bool(table[i]))
        table[i] |= len(stored)
        parts.append(stored)
    return parts, sum(_nbytes(p) for p in parts), shrank


def _nbytes(b) -> int:
    return b.nbytes if isinstance(b, (np.ndarray, memoryview)) else len(b)


# -- choosing and encoding ---------------------------------------------------------------------------

class Pace:
    """Whether ``auto`` encodes a save or stores it raw, from what saves measured.

    A save goes at the pace of its slower part, encoding (CPU) or writing (the first tier), both
    running at once on the I/O threads. Raw can only win where encoding held a save up: each save
    reports its chunk phase (raw bytes of the chunks it wrote, seconds) and the CPU time its
    encoding took. An encoded save that kept the cores at least a quarter busy encoding
    (``CPU_BOUND``) for at least ``MIN_SECONDS`` is followed by a probe: one save stored raw
    (the third save at the earliest, then at most one in ``PROBE_EVERY``). While raw saves go more
    than ``MARGIN`` faster than encoded ones, saves are stored raw, with an encoded probe one in
    ``PROBE_EVERY``. Saves that encode quickly or wait on the disk (sparse updates, frozen layers,
    slow storage) never pay for a probe; near a tie the bytes saved win."""

    PROBE_EVERY = 16
    MARGIN = 1.1
    CPU_BOUND = 0.25
    MIN_SECONDS = 0.1

    def __init__(self, cores: int | None = None) -> None:
        if cores is None:
            cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        self.cores = cores
        self.rates: dict[str, float] = {}  # "encode" / "raw": smoothed raw bytes per second of a save's chunk phase
        self.saves = 0
        self.last_probe = -self.PROBE_EVERY
        self.cpu_bound = False  # did the last encoded save keep the cores busy encoding?
        self._lock = threading.Lock()

    def mode(self) -> str:
        """How the next save stores its chunks: ``"encode"`` (auto's choice per chunk) or ``"raw"``."""
        with self._lock:
            n = self.saves
            self.saves += 1
            enc, raw = self.rates.get("encode"), self.rates.get("raw")
            best = "raw" if enc is not None and raw is not None and raw > enc * self.MARGIN else "encode"
            due = n >= 2 and n - self.last_probe >= self.PROBE_EVERY
            if due and (best == "raw" or self.cpu_bound):
                self.last_probe = n
                return "raw" if best == "encode" else "encode"  # a probe of the other way
            return best

    def record(self, mode: str, nbytes: int, seconds: float, encode_cpu_s: float = 0.0) -> None:
        """A save's chunk phase wrote ``nbytes`` (raw bytes of the chunks it wrote) in ``seconds``,
        spending ``encode_cpu_s`` of CPU time (all threads) encoding."""
        if seconds <= 0:
            return
        with self._lock:
            if mode == "encode":
                self.cpu_bound = seconds >= self.MIN_SECONDS and encode_cpu_s >= self.CPU_BOUND * self.cores * seconds
            if nbytes < (1 << 20):
                return  # too little to time
            rate = nbytes / seconds
            old = self.rates.get(mode)
            self.rates[mode] = rate if old is None else 0.5 * old + 0.5 * rate


@dataclass(frozen=True)
class Base:
    """The raw bytes of a delta's base chunk and their digest (hex); ``room``: the most payload bytes
    a delta on it may take (what is left of the chain's read budget), None for no limit."""

    raw: memoryview
    digest: str
    room: int | None = None


@dataclass
class _Trial:
    codec: str
    size: int  # payload bytes for the sample
    planes: list[bool] | None = None
    parts: list | None = None  # the encoded sample (the whole chunk when the sample is the chunk)


def _try(codec: str, sample, base_sample, width: int, rot: bool, level: int) -> _Trial:
    if codec == "zstd":
        packed = _compressor(level).compress(sample)
        return _Trial(codec, len(packed), None, [packed])
    g = group(sample, base_sample if codec == "xor" else None, width, scratch(f"trial-{codec}", len(sample)), rot)
    parts, size, shrank = _encode_planes(g, width, level, None)
    return _Trial(codec, size, shrank, parts)


def encode(raw: memoryview, digest_hex: str, spec: CodecSpec, *, width: int = 1, base: Base | None = None,
           rotate: bool = False, reuse: bool = False) -> tuple[str, list]:
    """Encode one chunk. Returns (codec name, list of buffers: header then payload).

    ``width`` is the element width of the chunk's data (byte planes), ``rotate`` whether its
    elements are floats whose sign is best rotated out of the top plane (bfloat16, float32, float64),
    ``base`` the chunk this one may be stored as a delta of (``auto`` and ``smallest`` only). The raw
    codec returns the caller's memoryview as the payload, so no copy is made. With ``reuse``, planes
    stored as they are may view this thread's scratch memory (no page faults on fresh memory for
    every chunk): the caller writes the buffers before this thread encodes again (the writer does)."""
    n = len(raw)
    width = width if 1 <= width <= MAX_WIDTH else 1
    rot = rotate and width in ROTATES
    if base is not None and (len(base.raw) != n or spec.name not in CodecSpec.CHOOSING):
        base = None
    codec = "raw"
    parts: list[Any] = [raw]
    if spec.name == "zstd" or (spec.name == "grouped" and width == 1):
        if n >= _MIN_COMPRESS_SIZE:
            packed = _compressor(spec.level).compress(raw)
            if len(packed) < n:
                codec, parts = "zstd", [packed]
    elif spec.name == "grouped":
        g = group(raw, None, width, scratch("group", n) if reuse else None, rot)
        codec, parts = "planes", _encode_planes(g, width, spec.level, None)[0]
    elif spec.name in CodecSpec.CHOOSING and n >= _MIN_COMPRESS_SIZE:
        codec, parts = _auto(raw, base, width, rot, spec.level, reuse)
    payload_len = sum(_nbytes(p) for p in parts)
    base_digest = bytes.fromhex(base.digest) if codec == "xor" and base else NO_BASE
    flags = (width | (_ROTATED if rot else 0)) if codec in PLANED else 0
    fields = (MAGIC, CHUNK_VERSION, CODEC_IDS[codec], flags, 0, n,
              bytes.fromhex(digest_hex), base_digest, payload_len)
    header = HEADER.pack(*fields)
    if codec == "xor":
        header = HEADER.pack(*fields[:4], _xor_check(header, parts), *fields[5:])
    return codec, [header, *parts]


def _auto(raw: memoryview, base: Base | None, width: int, rot: bool, level: int, reuse: bool) -> tuple[str, list]:
    n = len(raw)
    whole = n <= 2 * _AUTO_SAMPLE
    if whole:
        sample, base_sample = raw, base.raw if base else None
    else:
        start = (n // 2) & ~63
        sample = raw[start:start + _AUTO_SAMPLE]
        base_sample = base.raw[start:start + _AUTO_SAMPLE] if base else None
    candidates = ["planes" if width > 1 else "zstd"] + (["xor"] if base is not None else [])
    trials = [_try(c, sample, base_sample, width, rot, level) for c in candidates]
    k = len(sample)
    if base is not None and base.room is not None and trials[-1].size * (n / k) > base.room:
        trials.pop()  # the delta would make its chain read more than the budget allows: stored whole
    best = min(trials, key=lambda t: t.size)
    if best.size > k * (1 - _AUTO_MIN_SAVING):
        return "raw", [raw]
    if whole:
        assert best.parts is not None  # views of the trial's scratch memory unless compressed
        return best.codec, best.parts if reuse else [bytes(p) if isinstance(p, memoryview) else p for p in best.parts]
    if best.codec == "zstd":
        packed = _compressor(level).compress(raw)
        return ("zstd", [packed]) if len(packed) < n else ("raw", [raw])
    g = group(raw, base.raw if best.codec == "xor" and base else None, width, scratch("group", n) if reuse else None,
              rot)
    parts, size, _ = _encode_planes(g, width, level, best.planes)
    if best.codec == "xor" and base is not None and base.room is not None and size > base.room:
        return _auto(raw, None, width, rot, level, reuse)  # the sample promised less: whole after all
    if size >= n:
        return "raw", [raw]
    return best.codec, parts


@dataclass(frozen=True)
class ChunkHeader:
    codec: str
    raw_len: int
    digest: str
    payload_len: int
    width: int = 0
    base: str | None = None  # hex digest of the base chunk (xor)
    check: int = 0
    rot: bool = False  # planes, xor: elements rotated left one bit before grouping


def parse_header(blob, *, name: str) -> ChunkHeader:
    """Parse and sanity-check a chunk header; ``name`` is the object for error messages."""
    if len(blob) < HEADER_SIZE:
        raise CorruptCheckpointError(
            f"chunk object {name} is truncated ({len(blob)} bytes, shorter than its header)", object=name)
    magic, version, codec_id, flags, check, raw_len, digest, base, payload_len = HEADER.unpack_from(blob)
    if magic != MAGIC:
        raise CorruptCheckpointError(f"{name} is not a ckpt chunk (bad magic)", object=name)
    if raw_len > MAX_RAW or payload_len > MAX_RAW + (1 << 20):
        raise CorruptCheckpointError(f"chunk object {name} claims {raw_len} raw bytes in a payload of {payload_len}: "
                                     "more than any chunk holds; it is damaged", object=name)
    if version > CHUNK_VERSION:
        raise IncompatibleFormatError(
            f"chunk {name} uses chunk format v{version}; this ckpt reads v{CHUNK_VERSION}. "
            "Upgrade ckpt (pip install -U ckpt) to read it.")
    if codec_id not in CODEC_NAMES:
        raise IncompatibleFormatError(
            f"chunk {name} uses codec id {codec_id}, unknown to this ckpt; upgrade ckpt to read it")
    codec = CODEC_NAMES[codec_id]
    rot, width = bool(flags & _ROTATED), flags & ~_ROTATED
    if codec in PLANED and (not 1 <= width <= MAX_WIDTH or (rot and width not in ROTATES)):
        raise CorruptCheckpointError(f"chunk object {name} declares byte planes of width {width}"
                                     f"{' (rotated)' if rot else ''}; it is damaged", object=name)
    if (codec == "xor") != (base != NO_BASE):
        raise CorruptCheckpointError(f"chunk object {name} is stored as {codec} "
                                     f"{'without' if codec == 'xor' else 'with'} a base chunk; it is damaged",
                                     object=name)
    return ChunkHeader(codec, raw_len, digest.hex(), payload_len, width if codec in PLANED else 0,
                       base.hex() if codec == "xor" else None, check, rot and codec in PLANED)


def _decompress_into(payload, out: memoryview, *, name: str, expect_hash: str) -> None:
    """Decompress ``payload`` into exactly ``out``, and no further: a frame that holds more than the
    header says is refused without ever producing it (python-zstandard's one-shot decompress
    trusts a size written in the frame over ``max_output_size``)."""
    raw_len = len(out)
    spare = bytearray(1)  # one spare byte tells "more than declared" from "exactly"
    n = 0
    try:
        with _decompressor().stream_reader(payload, read_across_frames=True) as reader:
            while n < raw_len:
                k = reader.readinto(out[n:])
                if k == 0:
                    break
                n += k
            if n == raw_len and reader.readinto(spare) > 0:
                n += 1
    except zstandard.ZstdError as e:
        raise CorruptCheckpointError(f"chunk object {name} does not decompress: {e}",
                                     object=name, chunk=expect_hash) from e
    if n != raw_len:
        raise CorruptCheckpointError(
            f"chunk object {name} decompresses to {f'more than {raw_len}' if n > raw_len else n} bytes, its header "
            f"says {raw_len}; it is damaged", object=name, chunk=expect_hash)


def _decompress_bounded(payload: memoryview, raw_len: int, *, name: str, expect_hash: str) -> memoryview:
    out = bytearray(raw_len)
    _decompress_into(payload, memoryview(out), name=name, expect_hash=expect_hash)
    return memoryview(out)


def _section_table(hdr: ChunkHeader, payload: memoryview, *, name: str, expect_hash: str
                   ) -> list[tuple[bool, memoryview, int]]:
    """The sections of a planes/xor payload: (compressed, stored bytes, decoded length), checked to
    fit the payload and the raw length."""
    w = hdr.width
    bad = CorruptCheckpointError(f"chunk object {name} has a damaged section table", object=name, chunk=expect_hash)
    if len(payload) < 8 * (w + 1):
        raise bad
    table = np.frombuffer(payload[:8 * (w + 1)], "<u8").tolist()
    pos = 8 * (w + 1)
    out = []
    for entry, want in zip(table, _sections(hdr.raw_len, w)):
        packed, length = bool(entry & _ZSTD_FLAG), entry & ~_ZSTD_FLAG
        if pos + length > len(payload) or (not packed and length != want):
            raise bad
        out.append((packed, payload[pos:pos + length], want))
        pos += length
    if pos != len(payload):
        raise bad
    return out


def _xor_check(header, parts) -> int:
    """The check a delta carries for readers without its base: the low 32 bits of the xxh3-64 of its
    header (the check field taken as zero) and payload."""
    h = xxhash.xxh3_64()
    head = bytearray(header[:HEADER_SIZE])
    head[12:16] = bytes(4)
    h.update(head)
    for p in parts:
        h.update(p)
    return h.intdigest() & 0xFFFFFFFF


def _decode_planes(hdr: ChunkHeader, payload: memoryview, base, out: np.ndarray | None, *, name: str,
                   expect_hash: str) -> memoryview:
    """Planes (each decompressed into scratch, or read where it lies in the payload) back into
    element order in ``out`` (fresh memory when None), XOR ``base`` for a delta."""
    n, w = hdr.raw_len, hdr.width
    planes: list[np.ndarray] = []
    for i, (packed, stored, length) in enumerate(_section_table(hdr, payload, name=name, expect_hash=expect_hash)):
        if packed:
            dst = scratch(f"plane{i}", length)
            _decompress_into(stored, dst.data, name=name, expect_hash=expect_hash)
            planes.append(dst)
        else:
            planes.append(_u8(stored) if length else np.empty(0, np.uint8))
    out = np.empty(n, np.uint8) if out is None else out[:n]
    _ungroup(planes, base, w, out, hdr.rot)
    return out.data


def check_header(hdr: ChunkHeader, *, name: str, expect_hash: str, expect_len: int | None = None,
                 object_len: int | None = None) -> None:
    """Does a parsed header describe the chunk a manifest names? ``object_len`` is the stored
    object's size where the caller knows it (header + payload must add up to it)."""
    if hdr.digest != expect_hash:
        raise CorruptCheckpointError(
            f"chunk object {name} has header hash {hdr.digest}, expected {expect_hash}", object=name, chunk=expect_hash)
    if expect_len is not None and hdr.raw_len != expect_len:
        raise CorruptCheckpointError(
            f"chunk object {name} holds {hdr.raw_len} raw bytes, the manifest says {expect_len}",
            object=name, chunk=expect_hash)
    if object_len is not None and object_len != HEADER_SIZE + hdr.payload_len:
        raise CorruptCheckpointError(
            f"chunk object {name} is truncated or padded: {object_len} bytes stored, its header says "
            f"{HEADER_SIZE + hdr.payload_len}", object=name, chunk=expect_hash)


def verify(name: str, expect_hash: str, header, payload, *, expect_len: int | None = None,
           object_len: int | None = None, raw_only: bool = False, base: Base | None = None,
           out: np.ndarray | None = None) -> memoryview:
    """The one validity check of a stored chunk; returns its raw bytes.

    ``header`` and ``payload`` are the object's first 64 bytes and the rest (two buffers, so a
    payload read straight into a caller's tensor is checked in place). The header must parse and
    name ``expect_hash``, the sizes must agree, the payload must decode, and the decoded bytes must
    hash to ``expect_hash``. A delta (``xor``) needs its ``base``, already verified, whose digest
    its header must name. ``raw_only`` refuses a compressed payload (the caller read it in place
    as raw bytes). ``out`` (uint8, at least the raw length) receives decoded bytes where given; a
    delta's ``out`` may be its base's own bytes (decoded in place). Raises
    :class:`CorruptCheckpointError` naming the object."""
    hdr = parse_header(header, name=name)
    check_header(hdr, name=name, expect_hash=expect_hash, expect_len=expect_len, object_len=object_len)
    payload = memoryview(payload).cast("B")
    if len(payload) != hdr.payload_len:
        raise CorruptCheckpointError(
            f"chunk object {name} is truncated or padded: payload is {len(payload)} bytes, header says "
            f"{hdr.payload_len}", object=name, chunk=expect_hash)
    if hdr.codec == "raw":
        raw = payload
    elif raw_only:
        raise CorruptCheckpointError(
            f"chunk object {name} is stored as {hdr.codec}, its manifest entry says raw; it is damaged",
            object=name, chunk=expect_hash)
    elif hdr.codec == "zstd":
        if out is None:
            raw = _decompress_bounded(payload, hdr.raw_len, name=name, expect_hash=expect_hash)
        else:
            raw = out[:hdr.raw_len].data
            _decompress_into(payload, raw, name=name, expect_hash=expect_hash)
    elif hdr.codec == "planes":
        raw = _decode_planes(hdr, payload, None, out, name=name, expect_hash=expect_hash)
    else:
        if base is None or base.digest != hdr.base or len(base.raw) != hdr.raw_len:
            raise CorruptCheckpointError(
                f"chunk object {name} is a delta of chunk {hdr.base}, which its manifest does not give it as its "
                "base; it is damaged", object=name, chunk=expect_hash)
        if _xor_check(header, [payload]) != hdr.check:
            raise CorruptCheckpointError(f"chunk object {name} failed its payload check; the stored bytes are damaged",
                                         object=name, chunk=expect_hash)
        raw = _decode_planes(hdr, payload, base.raw, out, name=name, expect_hash=expect_hash)
    if len(raw) != hdr.raw_len or chunk_hash(raw) != expect_hash:
        raise CorruptCheckpointError(
            f"chunk object {name} failed its hash check (content does not match {expect_hash}); "
            "the stored bytes are damaged", object=name, chunk=expect_hash)
    return raw


def decode(blob, *, name: str, expect_hash: str, expect_len: int | None = None, base: Base | None = None,
           out: np.ndarray | None = None) -> memoryview:
    """Check and decode a whole chunk object (header and payload in one buffer); see :func:`verify`."""
    view = memoryview(blob).cast("B")
    return verify(name, expect_hash, view[:HEADER_SIZE], view[HEADER_SIZE:], expect_len=expect_len, base=base,
                  out=out)


def verify_object(key: str, parts: list[memoryview]) -> None:
    """The check a storage tier uses before trusting a copy of a chunk object it holds, read by its
    storage key (which ends in its hash). ``parts`` are the object's bytes in order, as read (one
    buffer, or the header and payload buffers of a read straight into place). A delta cannot be
    decoded without its base: its payload checksum, section table and frames are checked instead
    (the reader checks the decoded chunk's hash once its chain is resolved)."""
    views = [memoryview(p).cast("B") for p in parts]
    if len(views) == 2 and len(views[0]) == HEADER_SIZE:
        header, payload = views
    else:
        whole = views[0] if len(views) == 1 else memoryview(b"".join(views))
        header, payload = whole[:HEADER_SIZE], whole[HEADER_SIZE:]
    expect = key.rsplit("/", 1)[-1]
    hdr = parse_header(header, name=key)
    if hdr.codec != "xor":
        verify(key, expect, header, payload)
        return
    check_header(hdr, name=key, expect_hash=expect, object_len=HEADER_SIZE + len(payload))
    if _xor_check(header, [payload]) != hdr.check:
        raise CorruptCheckpointError(f"chunk object {key} failed its payload check; the stored bytes are damaged",
                                     object=key, chunk=expect)
    for packed, stored, length in _section_table(hdr, payload, name=key, expect_hash=expect):
        if packed:
            _check_frames(stored, length, name=key, expect_hash=expect)


def _check_frames(payload, length: int, *, name: str, expect_hash: str) -> None:
    """Do ``payload``'s zstd frames decompress to exactly ``length`` bytes? Checked in 1 MiB pieces,
    so a header that claims a huge size costs no memory."""
    piece = scratch("frames", 1 << 20)
    n = 0
    try:
        with _decompressor().stream_reader(payload, read_across_frames=True) as reader:
            while n <= length:
                k = reader.readinto(piece.data)
                if k == 0:
                    break
                n += k
    except zstandard.ZstdError as e:
        raise CorruptCheckpointError(f"chunk object {name} does not decompress: {e}", object=name,
                                     chunk=expect_hash) from e
    if n != length:
        raise CorruptCheckpointError(f"chunk object {name} has a section that decompresses to "
                                     f"{f'more than {length}' if n > length else n} bytes, its table says {length}",
                                     object=name, chunk=expect_hash)
