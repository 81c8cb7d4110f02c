"""Encoding chunks: which codec each chunk is stored with, and the encoders themselves.

The chunk object they produce (header, codec ids, decoding and checks) is the format's:
:mod:`ckpt.format.chunk`.

``auto`` chooses per chunk from a 128 KiB sample (eight pieces spread over the chunk): it encodes the
sample the ways that can win (byte planes, floats rotated and not; zstd for byte-wide data; a delta
when a base is there) and keeps the smallest, or raw when none saves 8%. A trial's rANS sizes are
estimated from the planes' counts, not coded (:func:`ckpt.format.rans.estimate`). Both measured on
trained AdamW states, against a 256 KiB sample coded in full: the same bytes to 0.1%, 25-45% less
encoding CPU (the trials had been half of it with a delta's base). The whole chunk is then
encoded that way, each plane the smaller of rANS (the entropy coder, best on exponent planes) and
zstd (best where bytes repeat in runs), zstd alone where the sample found the plane incompressible,
or as it is where neither saves 3%. A chunk at the same place as one encoded a save earlier reuses
that one's trials for ``_RETRY - 1`` saves (:func:`_auto`): a training step changes a chunk's
statistics little, and the trials were a third of the encoding CPU of trained fp32 state. The choice
depends on the bytes alone, this save's and those before it (no timing, no machine load), so the same
saves of the same states store the same bytes on every machine (without the compiled core too: its
numpy fallback writes the same bytes, slower).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import zstandard

from ..errors import ConfigError
from ..format import mask, rans
from ..format.chunk import (
    CODEC_IDS,
    HEADER,
    HEADER_SIZE,
    MAGIC,
    MASKED,
    MAX_WIDTH,
    NO_BASE,
    PLANED,
    ROTATED,
    Base,
    xor_check,
)
from ..format.planes import RANS, ROTATES, SECTION_FLAGS, STORED, ZSTD, group, scratch, u8

_local = threading.local()


# "auto" encodes a sample first and keeps an encoding only where it saves at least this fraction.
_AUTO_SAMPLE = 128 * 1024

_AUTO_MIN_SAVING = 0.08

_PLANE_MIN_SAVING = 0.03  # a plane of a chunk that shrinks less than this is stored as it is (decoding costs)

_MIN_COMPRESS_SIZE = 4096

_SPARSE_DELTA = 0.5  # a delta under half the whole chunk's size in the sample is tried in full against the budget

_MASK_ZEROS = 0.25  # a zero mask is tried where at least this share of the sample's elements (XOR its base) is zero

# ... and kept where it makes the sample this much smaller than without: at half the elements zero it saves
# nothing (Adam's bf16 second moments) and decodes 1.6x slower, at 90% it saves 45% and decodes 2.9x faster
_MASK_MIN_SAVING = 0.1

# ... or, where at least this share of the sample's elements is zero, unless it adds more than this share of
# the raw bytes: a sparse update's delta (one element in 4097 moved) codes to a few KB either way (the mask's
# section a few bytes more), but without a mask each of its planes is inflated in full on every load (a 16 MiB
# link: about 2 ms, as long as 1 MB takes at 400 MB/s), with one only the mask (a bit an element)
_MASK_SPARSE, _MASK_MAX_EXTRA = 0.9, 0.002

_REPEATS = -1  # a trial's plane method: rANS, the sample's plane being one byte per block (see _encode_planes)

_RETRY = 4  # auto's trials on a chunk run every this many saves; in between, the last ones are reused

_MASKED_ZSTD = 0.08  # behind a zero mask, a plane is zstd-coded only where that is this much smaller than rANS

# ... while a mask with zero runs (a sparse one; decoded whole) is zstd-coded unless that adds more than this share
# of the mask's bytes to rANS's: zstd inflates the runs as matches, several times faster than rANS decodes them
# a byte at a time (1 MiB of a sparse update's mask: about 0.1 ms against 0.7); a mask of nearly random bits
# (a 90%-zero layer's) has no runs and takes the smaller
_MASK_ZSTD_EXTRA = 0.02

Masked = tuple[int, np.ndarray, np.ndarray]  # a zero mask's (elements kept, mask, the chunk's tail bytes)

@dataclass(frozen=True)
class CodecSpec:
    """What the writer should try: ``raw``; ``zstd`` or ``grouped`` (byte planes, each entropy-coded
    or zstd-compressed, whichever is smaller) always; ``auto`` (per chunk the smallest of raw, zstd,
    planes and a delta; the default) and ``smallest`` (its older name: the same)."""

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


def _encode_planes(g: np.ndarray, width: int, level: int, methods: list[int] | None,
                   min_saving: float = 0.0, masked: Masked | None = None,
                   estimate: bool = False, cap: float | None = None) -> tuple[list, int, list[int]]:
    """Sections of grouped bytes ``g`` (with ``masked``: of the kept elements only, the mask coded
    like a plane before them and the chunk's tail after): each plane the smaller of zstd and rANS (a
    trial: ``methods`` None; a mask with zero runs zstd-coded unless rANS saves ``_MASK_ZSTD_EXTRA``),
    or the coder ``methods`` (per plane, from a trial) names, zstd where it says STORED and the plane
    has zero runs, and as it is where that does not shrink it by
    ``min_saving`` (the final encode: ``_PLANE_MIN_SAVING``; a trial keeps any gain, so a plane that
    shrinks a little in the sample is tried on the whole chunk). With ``estimate`` (a trial on a sample,
    whose bytes are not kept) rANS is not run: :func:`rans.estimate` says its size from the plane's
    counts (within 0.1%, a third of the time; the payload buffers are then not the encoding). A trial
    with ``cap`` stops once its length passes it (a delta's that can no longer be kept). Returns
    (payload buffers, payload length, how each section but the tail was kept)."""
    cctx = _compressor(level)
    m = g.size // width
    secs = [g[p * m:(p + 1) * m] for p in range(width)] + [g[m * width:]]
    head = 0
    if masked is not None:
        head, bits, tail = masked
        secs = [bits] + secs[:width] + [tail]
    coders = len(secs) - 1  # the sections that may be coded: all but the tail
    table = np.zeros(len(secs) + (masked is not None), "<u8")
    table[0] = head  # overwritten by the first section's entry without a mask
    first = int(masked is not None)
    parts: list = [table.view(np.uint8).data]
    kept = []
    total = table.nbytes
    for i, sec in enumerate(secs):
        n = sec.size
        stored: Any = sec.data
        how, nbytes = STORED, n
        if i < coders and n >= 64:
            # Where the sample found zstd best, the whole plane is coded both ways only if it has zero runs
            # (3% of its 8-byte words zero): there rANS's blocks of one repeated byte can beat zstd on the
            # whole plane though not on the sample (the top plane of a sparse update's XOR delta: 26.6 KB
            # against zstd's 33.6 KB, and a rANS section decodes in part, tile by tile). Elsewhere (the
            # exponent planes of trained fp32 and bf16) rANS never won and cost a third of `auto`'s
            # encoding: zstd alone (about 1.2x faster on those states, the same bytes to five digits). Planes the sample
            # found incompressible get zstd where the chunk has runs the sample missed (the zero rows of an
            # embedding's moments; a count of zero words: far cheaper than compressing noise).
            # A trial tries rANS first: a plane that is one byte repeated per block (a frozen tensor's zero
            # delta, a fixed bit flip) is kept as rANS whatever zstd would give (a few bytes more per
            # 16 KiB): decoders write it as a run, and a chain decoded in one pass skips a zero one, where a
            # zstd frame must be inflated. Such a sample (_REPEATS) has the whole plane coded both ways: rANS
            # kept where it too is one byte per block, else the smaller (a sparse delta's plane, whose few
            # changes a 128 KiB sample often misses: rANS alone took 29% more bytes on 64 flipped bits a MiB).
            # Behind a zero mask a plane holds the kept elements only, of which the sample held few (a few
            # thousand): its choice of zstd over rANS is checked on the whole plane, which is short.
            zero_runs = methods is not None and methods[i] not in (RANS, _REPEATS) and _runs(sec)
            both = zero_runs or (masked is not None and methods is not None and methods[i] == ZSTD)
            tries = ((RANS, ZSTD) if methods is None or methods[i] == _REPEATS or (methods[i] == ZSTD and both)
                     else (ZSTD,)
                     if methods[i] == ZSTD or zero_runs else (RANS,) if methods[i] == RANS else ())
            for t in tries:
                packed = (cctx.compress(sec.data) if t == ZSTD else rans.estimate(sec) if estimate
                          else rans.encode(sec) if t == RANS else None)
                size = packed if isinstance(packed, int) else None if packed is None else len(packed)
                # behind a mask rANS is kept unless zstd saves _MASKED_ZSTD more: only rANS decodes in part
                # (a sparse update's delta planes: zstd 5% smaller, but a reshard would decode them whole)
                planar = masked is not None and i > 0 and how == RANS  # (the mask itself is decoded whole)
                keep = nbytes * (1 - _MASKED_ZSTD) if planar else nbytes
                if masked is not None and i == 0 and how == RANS and _runs(sec):  # a sparse mask's zero runs
                    keep = nbytes + n * _MASK_ZSTD_EXTRA
                if size is not None and size < min(n * (1 - min_saving), keep):
                    stored, how, nbytes = stored if isinstance(packed, int) else packed, t, size
                    if t == RANS and rans.repeats(size, n):
                        break
        if i < coders:
            kept.append(_REPEATS if methods is None and how == RANS and rans.repeats(nbytes, n) else how)
        table[first + i] = SECTION_FLAGS[how] | nbytes
        parts.append(stored)
        total += nbytes
        if cap is not None and total > cap:
            break
    return parts, total, kept


def _runs(sec: np.ndarray) -> bool:
    """Does a plane the sample found incompressible hold zero runs worth a zstd pass (3% of its
    8-byte words zero; noise has one in 2^64)?"""
    words = sec[: sec.size // 8 * 8].view(np.uint64)  # (counting the nonzero ones makes no temporary array)
    return bool(words.size > 0 and words.size - np.count_nonzero(words) >= _PLANE_MIN_SAVING * words.size)


def _nbytes(b) -> int:
    return b.nbytes if isinstance(b, (np.ndarray, memoryview)) else len(b)


@dataclass
class _Trial:
    codec: str
    size: int  # payload bytes for the sample
    planes: list[int] | None = None  # how each plane was kept (planes, xor)
    parts: list | None = None  # the encoded sample (the whole chunk when the sample is the chunk)
    rot: bool = False  # elements rotated left one bit before grouping (planes, xor)
    masked: bool = False  # a zero mask, then the nonzero elements' planes (planes, xor)
    complete: bool = True  # False: stopped at its cap (a delta that could not be kept): ``size`` is a lower bound
    zeros: float = 0.0  # masked: the share of the sample's elements (XOR the base, for a delta) that is zero


@dataclass(frozen=True)
class Choice:
    """What ``auto``'s trials on a chunk's sample found (each trial without its bytes), ``age`` saves ago.
    The chunk at the same place in the next save reuses them instead of trying again (see :func:`_auto`)."""

    trials: tuple[_Trial, ...]
    age: int


@dataclass(frozen=True)
class Encoded:
    """One chunk encoded: the codec, the buffers (header, then payload), and ``auto``'s choice for the chunk at
    its place in the next save (None: not ``auto``, or a chunk short enough to be tried whole every time)."""

    codec: str
    buffers: list
    choice: Choice | None = None


def _try(codec: str, sample, base_sample, width: int, rot: bool, level: int, masked: bool = False,
         estimate: bool = False, cap: float | None = None) -> _Trial:
    """The sample encoded one way; ``estimate``: rANS sizes estimated, not coded (the sample is not the
    chunk, so its bytes are not kept: ``parts`` is then None); ``cap``: stop once the size passes it
    (the trial is then of no use: its size is only known to be larger)."""
    if codec == "zstd":
        packed = _compressor(level).compress(sample)
        return _Trial(codec, len(packed), None, [packed])
    base = base_sample if codec == "xor" else None
    name = f"trial-{codec}-{int(rot)}{'-mask' if masked else ''}"
    if masked:
        g, spread = _masked_group(sample, base, width, rot, name, True)
        parts, size, kept = _encode_planes(g, width, level, None, masked=spread, estimate=estimate, cap=cap)
    else:
        parts, size, kept = _encode_planes(group(sample, base, width, scratch(name, len(sample)), rot), width, level,
                                           None, estimate=estimate, cap=cap)
    return _Trial(codec, size, kept, None if estimate else parts, rot, masked, cap is None or size <= cap)


def _masked_group(raw, base, width: int, rot: bool, name: str, reuse: bool) -> tuple[np.ndarray, Masked]:
    """The planes of ``raw``'s nonzero elements (XOR ``base``), and (how many, the mask, the tail
    bytes): in this thread's scratch memory with ``reuse``, else fresh (the kept elements are gathered
    in scratch either way, then grouped out of it)."""
    src = u8(raw)
    b = None if base is None else u8(base)
    m = src.size // width
    def buf(key: str, size: int) -> np.ndarray:
        return scratch(f"{name}-{key}", size) if reuse else np.empty(size, np.uint8)
    bits, kept = buf("bits", mask.mask_bytes(m)), scratch(f"{name}-kept", m * width)
    k = mask.compact(src[:m * width], None if b is None else b[:m * width], width, bits, kept)
    g = group(kept[:k * width], None, width, buf("grouped", k * width), rot)
    tail = src[m * width:] if b is None else src[m * width:] ^ b[m * width:]
    return g, (k, bits, tail)


def encode(raw: memoryview, digest_hex: str, spec: CodecSpec, *, width: int = 1, base: Base | None = None,
           rotate: bool = False, reuse: bool = False) -> tuple[str, list]:
    """Encode one chunk. Returns (codec name, list of buffers: header then payload); see :func:`encode_chunk`."""
    out = encode_chunk(raw, digest_hex, spec, width=width, base=base, rotate=rotate, reuse=reuse)
    return out.codec, out.buffers


def encode_chunk(raw: memoryview, digest_hex: str, spec: CodecSpec, *, width: int = 1, base: Base | None = None,
                 rotate: bool = False, reuse: bool = False, hint: Choice | None = None) -> Encoded:
    """Encode one chunk.

    ``width`` is the element width of the chunk's data (byte planes), ``rotate`` whether its
    elements are floats whose sign is best rotated out of the top plane (bfloat16, float32, float64),
    ``base`` the chunk this one may be stored as a delta of (``auto`` and ``smallest`` only). The raw
    codec returns the caller's memoryview as the payload, so no copy is made. With ``reuse``, planes
    stored as they are may view this thread's scratch memory (no page faults on fresh memory for
    every chunk): the caller writes the buffers before this thread encodes again (the writer does). ``hint``:
    ``auto``'s choice for the chunk at this place in the previous save (:attr:`Encoded.choice`), reused where
    it is recent enough (:func:`_auto`)."""
    n = len(raw)
    width = width if 1 <= width <= MAX_WIDTH else 1
    rot = rotate and width in ROTATES
    if base is not None and (len(base.raw) != n or spec.name not in CodecSpec.CHOOSING):
        base = None
    codec = "raw"
    parts: list[Any] = [raw]
    masked = False
    choice = None
    if spec.name == "zstd" or (spec.name == "grouped" and width == 1):
        if n >= _MIN_COMPRESS_SIZE:
            packed = _compressor(spec.level).compress(raw)
            if len(packed) < n:
                codec, parts = "zstd", [packed]
    elif spec.name == "grouped":
        g = group(raw, None, width, scratch("group", n) if reuse else None, rot)
        codec, parts = "planes", _encode_planes(g, width, spec.level, None, _PLANE_MIN_SAVING)[0]
    elif spec.name in CodecSpec.CHOOSING and n >= _MIN_COMPRESS_SIZE:
        codec, parts, rot, masked, choice = _auto(raw, base, width, rot, spec.level, reuse, hint,
                                                  int(digest_hex[:8], 16) % _RETRY)
    payload_len = sum(_nbytes(p) for p in parts)
    version = 3 if masked else 2 if codec in PLANED and _has_rans(parts[0], width) else 1
    base_digest = bytes.fromhex(base.digest) if codec == "xor" and base else NO_BASE
    flags = (width | (ROTATED if rot else 0) | (MASKED if masked else 0)) if codec in PLANED else 0
    fields = (MAGIC, version, CODEC_IDS[codec], flags, 0, n,
              bytes.fromhex(digest_hex), base_digest, payload_len)
    header = HEADER.pack(*fields)
    if codec == "xor":
        header = HEADER.pack(*fields[:4], xor_check(header, parts), *fields[5:])
    return Encoded(codec, [header, *parts], choice)


def _has_rans(table, width: int) -> bool:
    entries = np.frombuffer(table, "<u8", count=width + 1)
    return bool((entries & np.uint64(SECTION_FLAGS[RANS])).any())


_SLICES = 8


def _spread(buf, n: int, name: str) -> memoryview:
    """The sample: ``_SLICES`` pieces spread evenly over the chunk (one piece from its middle misjudged
    chunks that span several tensors: measured up to 1.6% more bytes on trained fp32 state)."""
    piece = _AUTO_SAMPLE // _SLICES
    starts = [(i * (n - piece) // (_SLICES - 1)) & ~63 for i in range(_SLICES)]
    out = scratch(name, _AUTO_SAMPLE)
    src = np.frombuffer(buf, np.uint8)
    for i, start in enumerate(starts):
        out[i * piece:(i + 1) * piece] = src[start:start + piece]
    return out.data


def _auto(raw: memoryview, base: Base | None, width: int, rot: bool, level: int, reuse: bool,
          hint: Choice | None = None, stagger: int = 0) -> tuple[str, list, bool, bool, Choice | None]:
    """(codec, payload buffers, rotated, masked, the choice for the next save). Floats are tried rotated and
    not: the sign in the top plane costs a bit where it varies (weights, momentum) and nothing where it does
    not (Adam's second moments), while rotation moves the exponent's lowest, nearly random bit into that
    plane. Where a quarter of the sample's elements (XOR the base, for a delta) are zero, byte planes are
    also tried behind a zero mask (:mod:`ckpt.format.mask`), kept where that is 10% smaller (90% zeros: 45%
    fewer bytes, decoded about 3x faster), or, where nine in ten are zero, where it adds at most 0.2% of the
    sample's bytes (a sparse update's delta: a load then expands the mask instead of inflating every plane).

    A chunk longer than two samples reuses ``hint``, the trials on the chunk at its place in the previous
    save, for ``_RETRY - 1`` saves after they ran (a training step changes a chunk's statistics little: its
    planes keep their coder), unless it now has a delta's base the hint has no delta trial for, or room for
    a delta whose trial stopped at a smaller room. The trials were most of ``auto``'s encoding CPU on
    trained fp32 state with a base; the choice still depends on nothing but the chunks' bytes, in order, and
    the options. A chunk tried with no hint counts its age from ``stagger`` (from its digest), and one tried
    early (a delta's base or room appeared) keeps its hint's count, so a steady run retries about one chunk
    in ``_RETRY`` each save rather than all of them every ``_RETRY``-th save."""
    n = len(raw)
    whole = n <= 2 * _AUTO_SAMPLE
    k = n if whole else _AUTO_SAMPLE
    room = base.room if base is not None else None
    choice = None if whole else _reuse(hint, base is not None, room, n)
    if choice is not None:
        trials = list(choice.trials)
    else:
        trials = _trials(raw, base, width, rot, level, whole, room)
        if not whole:  # a hint's cycle goes on, tried early or not: its chunks stay spread over the saves
            choice = Choice(tuple(replace(t, parts=None) for t in trials),
                            stagger if hint is None else (hint.age + 1) % _RETRY)
    best = _select([t for t in trials if base is not None or t.codec != "xor"], room, n, k)
    if whole:
        if best is not None and best.codec == "xor" and room is not None and best.size + HEADER_SIZE > room:
            # kept to be measured, and it does not fit: whole, from the whole trials already run (each trial
            # codes into its own scratch memory, so theirs are intact)
            best = _select([t for t in trials if t.codec != "xor"], None, n, k)
        if best is None:
            return "raw", [raw], False, False, None
        assert best.parts is not None  # views of the trial's scratch memory unless compressed
        parts = best.parts if reuse else [bytes(p) if isinstance(p, (memoryview, np.ndarray)) else p
                                          for p in best.parts]
        return best.codec, parts, best.rot, best.masked, None
    out = _final(raw, best, base, width, level, reuse)
    if out is None:  # the sample promised a smaller delta than the chunk's, which does not fit: whole after all
        out = _final(raw, _select([t for t in trials if t.codec != "xor"], None, n, k), None, width, level, reuse)
        assert out is not None
        if choice is not None and choice.age > 0:  # a reused delta trial that misled: the next save tries again
            choice = replace(choice, age=_RETRY - 1)
    return (*out, choice)


def _final(raw: memoryview, best: _Trial | None, base: Base | None, width: int, level: int, reuse: bool
           ) -> tuple[str, list, bool, bool] | None:
    """The chunk encoded the way ``best`` (a trial on its sample; None: raw) says; None: a delta that does not
    fit its base's room."""
    n = len(raw)
    if best is None:
        return "raw", [raw], False, False
    if best.codec == "zstd":
        packed = _compressor(level).compress(raw)
        return ("zstd", [packed], False, False) if len(packed) < n else ("raw", [raw], False, False)
    delta_base = base.raw if best.codec == "xor" and base else None
    if best.masked:
        g, spread = _masked_group(raw, delta_base, width, best.rot, "chunk", reuse)
        parts, size, _ = _encode_planes(g, width, level, best.planes, _PLANE_MIN_SAVING, spread)
    else:
        g = group(raw, delta_base, width, scratch("group", n) if reuse else None, best.rot)
        parts, size, _ = _encode_planes(g, width, level, best.planes, _PLANE_MIN_SAVING)
    if best.codec == "xor" and base is not None and base.room is not None and size + HEADER_SIZE > base.room:
        return None
    if size >= n:
        return "raw", [raw], False, False
    return best.codec, parts, best.rot, best.masked


def _reuse(hint: Choice | None, has_base: bool, room: int | None, n: int) -> Choice | None:
    """``hint`` a save older, if its trials may stand for this chunk's (see :func:`_auto`), else None."""
    if hint is None or hint.age + 1 >= _RETRY:
        return None
    deltas = [t for t in hint.trials if t.codec == "xor"]
    if has_base and not deltas:
        return None  # the hint's chunk had no base: a delta was never tried
    if has_base and any(not t.complete and (room is None or t.size * n / _AUTO_SAMPLE + HEADER_SIZE <= room)
                        for t in deltas):
        return None  # a delta trial stopped at a cap this room no longer sets: its size is unknown
    return replace(hint, age=hint.age + 1)


def _trials(raw: memoryview, base: Base | None, width: int, rot: bool, level: int, whole: bool,
            room: int | None) -> list[_Trial]:
    """The sample (the chunk itself when ``whole``) encoded every way that can win."""
    n = len(raw)
    if whole:
        sample, base_sample = raw, base.raw if base else None
    else:
        sample = _spread(raw, n, "sample")
        base_sample = _spread(base.raw, n, "base-sample") if base else None
    candidates = ["planes" if width > 1 else "zstd"] + (["xor"] if base is not None else [])
    specs = [(c, r, False) for c in candidates for r in ((True, False) if rot and c != "zstd" else (False,))]
    zeros: dict[str, float] = {}
    if width in mask.WIDTHS:
        for c in candidates:
            zeros[c] = mask.zero_share(sample, width, base_sample if c == "xor" else None)
            if zeros[c] >= _MASK_ZEROS:
                specs += [(c, r, True) for r in ((True, False) if rot else (False,))]
    k = len(sample)
    # the whole chunk's ways first: they bound what a delta must beat to be kept (below), and a delta's
    # trial stops as soon as its planes so far pass that (the same choice, its planes not all coded)
    done = {sp: _try(sp[0], sample, base_sample, width, sp[1], level, sp[2], estimate=not whole)
            for sp in specs if sp[0] != "xor"}
    whole_size = min((t.size for t in done.values()), default=k)
    cap = None if room is None else max((room - HEADER_SIZE) * k / n, _SPARSE_DELTA * whole_size) * 1.001 + 8
    for sp in specs:
        if sp[0] == "xor":
            done[sp] = _try("xor", sample, base_sample, width, sp[1], level, sp[2], estimate=not whole, cap=cap)
    return [replace(done[sp], zeros=zeros[sp[0]]) if sp[2] else done[sp] for sp in specs]


def _select(trials: list[_Trial], room: int | None, n: int, k: int) -> _Trial | None:
    """The way to encode the chunk, from its sample's trials (of ``k`` bytes, of a chunk of ``n``); None:
    raw. A delta that would make its chain read more than the budget allows (``room``) is not stored: the
    chunk is stored whole. The sample's estimate decides, except where the delta is far smaller than the
    whole chunk (sparse changes, which a sample of a few pieces over- or underestimates): then the full
    delta is made and measured, and dropped only if it does not fit."""
    whole_size = min((t.size for t in trials if t.codec != "xor"), default=k)
    trials = [t for t in trials if t.codec != "xor" or t.complete and (
        room is None or t.size * (n / k) + HEADER_SIZE <= room or t.size < _SPARSE_DELTA * whole_size)]
    best = min((t for t in trials if not t.masked), key=lambda t: t.size)
    masked = min((t for t in trials if t.masked), key=lambda t: t.size, default=None)
    if masked is not None and (masked.size < best.size * (1 - _MASK_MIN_SAVING) or
                               masked.zeros >= _MASK_SPARSE and masked.size <= best.size + k * _MASK_MAX_EXTRA):
        best = masked
    return None if best.size > k * (1 - _AUTO_MIN_SAVING) else best
