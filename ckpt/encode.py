"""Encoding chunks: which codec each chunk is stored with, and the encoders themselves.

The chunk object they produce (header, codec ids, decoding and checks) is the format's:
:mod:`ckpt.format.chunk`.

``auto`` chooses per chunk from a 256 KiB sample taken from the chunk's middle: it encodes the sample
the ways that can win (planes, or zstd for byte-wide data; xor when a base is there) and keeps the
smallest, or raw when none saves 8%; a plane is compressed only where the sample's plane shrank.
Where saves stored raw are measured to go faster than encoded ones (storage faster than compression),
it stores raw (:class:`Pace`): ``auto`` never makes saves slower than ``raw`` to get fewer bytes.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np
import zstandard

from .errors import ConfigError
from .format.chunk import (
    CHUNK_VERSION,
    CODEC_IDS,
    HEADER,
    MAGIC,
    MAX_WIDTH,
    NO_BASE,
    PLANED,
    ROTATED,
    Base,
    xor_check,
)
from .format.planes import ROTATES, ZSTD_FLAG, group, scratch, sections

_local = threading.local()


# "auto" encodes a sample first and keeps an encoding only where it saves at least this fraction.
_AUTO_SAMPLE = 256 * 1024

_AUTO_MIN_SAVING = 0.08

_PLANE_MIN_SAVING = 0.03  # a plane that shrinks less than this is stored as it is (and not compressed again)

_MIN_COMPRESS_SIZE = 4096

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


def _compressor(level: int) -> zstandard.ZstdCompressor:
    # zstd contexts are not thread-safe; each worker thread keeps its own per level.
    cache = getattr(_local, "cctx", None)
    if cache is None:
        cache = _local.cctx = {}
    cctx = cache.get(level)
    if cctx is None:
        cctx = cache[level] = zstandard.ZstdCompressor(level=level, write_content_size=True)
    return cctx


def _encode_planes(g: np.ndarray, width: int, level: int, try_planes: list[bool] | None
                   ) -> tuple[list, int, list[bool]]:
    """Sections of grouped bytes ``g``: each plane compressed where ``try_planes`` says (all when
    None) and it shrinks. Returns (payload buffers, payload length, which planes shrank)."""
    cctx = _compressor(level)
    table = np.zeros(width + 1, "<u8")
    parts: list = [table.view(np.uint8).data]
    shrank = []
    pos = 0
    for i, n in enumerate(sections(g.size, width)):
        sec = g[pos:pos + n]
        pos += n
        stored: bytes | memoryview = sec.data
        if i < width and n >= 64 and (try_planes is None or try_planes[i]):
            packed = cctx.compress(sec.data)
            if len(packed) < n * (1 - _PLANE_MIN_SAVING):
                stored = packed
                table[i] = ZSTD_FLAG
        if i < width:
            shrank.append(bool(table[i]))
        table[i] |= len(stored)
        parts.append(stored)
    return parts, sum(_nbytes(p) for p in parts), shrank


def _nbytes(b) -> int:
    return b.nbytes if isinstance(b, (np.ndarray, memoryview)) else len(b)


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
    flags = (width | (ROTATED if rot else 0)) if codec in PLANED else 0
    fields = (MAGIC, CHUNK_VERSION, CODEC_IDS[codec], flags, 0, n,
              bytes.fromhex(digest_hex), base_digest, payload_len)
    header = HEADER.pack(*fields)
    if codec == "xor":
        header = HEADER.pack(*fields[:4], xor_check(header, parts), *fields[5:])
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
