"""Decoding a delta chain with the compiled core (csrc/chain.cpp): the whole chunk in one pass, each
link's part of a tile XORed in while it is in cache and the result hashed against the chunk's name
(:func:`decode_chain`), or only the byte ranges a reshard needs of it (:func:`decode_chain_range`),
checked by the caller against the manifest's span digests. Both say False where they cannot, and the
caller goes on link by link (:mod:`.chains`) or span by span (:mod:`.partial`).
"""

from __future__ import annotations

import math

import numpy as np
import zstandard

from .. import _ext
from ..errors import CorruptCheckpointError, IncompatibleFormatError
from .chunk import (
    HEADER_SIZE,
    PLANED,
    ChunkHeader,
    _decode_masked,
    _decompress_into,
    parse_header,
    section_table,
    unpack_section,
    xor_check,
)
from .planes import RANS, STORED, ZSTD, scratch, u8


def decode_chain(parts: list[tuple[str, str, bytes | bytearray | memoryview]], size: int, out: np.ndarray) -> bool:
    """A delta chain decoded in one pass into ``out`` (uint8, ``size`` bytes) by the compiled core,
    every link's part of a tile XORed in while it is in cache. ``parts``: (object name, chunk hash,
    stored object) per link, the chunk stored whole first, each delta's header already checked to
    name the link before it (:func:`ckpt.format.chains.links`). Only the result is hashed, against the
    last link's name (each delta's payload check is verified as well). False where the chain must be
    decoded link by link instead, which checks every link and says which one is damaged: no compiled
    core, a payload check that fails, a link that does not decode, a wrong result (``out`` may then
    hold anything)."""
    core = _ext.cpu()
    if core is None or size <= 240:
        return False
    out = out[:size]
    try:
        found = [_chain_part(i, name, expect, blob, size) for i, (name, expect, blob) in enumerate(parts)]
        if any(f is None for f in found):
            return False
        needs = [_unpacked_bytes(f) for f in found]
        # zstd sections (and rANS tails) are decoded into scratch before the core runs, one reused
        # buffer of at most one chunk (fresh memory costs a page fault per 4 KiB): a chain of more than
        # that (sparse updates make deltas of zstd frames only) is decoded in as many passes as it takes
        room = scratch("chain-sections", min(size, sum(needs)))
        batch: list[_ext.ChainLink] = []
        used = 0
        for (name, expect, _), part, need in zip(parts, found, needs):
            assert part is not None
            if part[0].masked:  # the links before it decoded, then its kept elements XORed into place
                if not _unhashed_pass(core, batch, out):
                    return False
                _decode_masked(part[0], part[1], out if batch else None, out, name=name, expect_hash=expect)
                batch, used = [_IN_OUT], 0
                continue
            if used + need > room.size:
                if not _unhashed_pass(core, batch, out):
                    return False
                batch, used = [_IN_OUT], 0
            batch.append(_chain_link(part, room[used:used + need], out, name=name, expect_hash=expect))
            used += need
    except (CorruptCheckpointError, IncompatibleFormatError):
        return False
    err, digest = core.chain_decode(batch, out)
    return not err and digest == parts[-1][1]


def _unhashed_pass(core: _ext.CpuCore, batch: list[_ext.ChainLink], out: np.ndarray) -> bool:
    """A pass of the core over ``batch`` that the chain does not end with: every section checked to
    its end, but not hashed (only the result is: a chain with masked links was hashed once a pass).
    Nothing to decode (no links, or only what ``out`` holds already) is no pass."""
    if not batch or len(batch) == 1 and batch[0] is _IN_OUT:
        return True
    return core.chain_decode(batch, out, hashed=False)[0] == 0


def decode_chain_range(parts: list[tuple[str, str, bytes | bytearray | memoryview]], size: int, out: np.ndarray,
                       lo: int, hi: int) -> bool:
    """Bytes [lo, hi) of a chain (``parts`` as :func:`decode_chain` takes them) decoded into
    ``out[lo:hi]``; see :func:`decode_chain_ranges`."""
    return decode_chain_ranges(parts, size, out, [(lo, hi)])


def decode_chain_ranges(parts: list[tuple[str, str, bytes | bytearray | memoryview]], size: int, out: np.ndarray,
                        ranges: list[tuple[int, int]]) -> bool:
    """Byte ranges ``(lo, hi)`` (sorted) of a chain decoded by the compiled core into ``out[lo:hi]``
    (``out``: uint8, the chunk's ``size`` bytes; nothing else of it is written), a reshard's part of a
    chunk. Only the tiles that cover a range are decoded and only their rANS blocks read; stored
    planes are sliced. A zstd section is one frame: it is decompressed up to the range's last tile,
    and only what the tiles need of it kept; where the links' parts do not fit one chunk of scratch
    together, the links go in passes.
    Nothing is hashed and no payload check verified: the caller checks each range against its span
    digests, so damage where the ranges need nothing does not stop them. False where the core
    cannot: none built, a link it does not take, a link or range that does not decode (``out[lo:hi]``
    may then hold anything)."""
    core = _ext.cpu()
    if core is None or not parts or out.size < size or any(not 0 <= lo < hi <= size for lo, hi in ranges):
        return False
    if not ranges:
        return True
    out = out[:size]
    try:
        maybe = [_chain_part(i, name, expect, blob, size, check=False) for i, (name, expect, blob) in enumerate(parts)]
        found = [f for f in maybe if f is not None]
        if len(found) < len(parts):
            return False
        tile = _tile(found)
        # an open frame holds a window of decompression state, up to its plane's length: the frames
        # stay open from one range to the next only where the zstd planes add up to a chunk at most
        keep = sum(size // hdr.width for hdr, _, table in found for k, (how, _, _) in enumerate(table or [])
                   if how == ZSTD and k < hdr.width) <= size
        frames = _Frames(keep)
        try:
            base: np.ndarray | None = None
            if found[0][0].codec == "zstd":  # only the first link can be (the rest are deltas): the base
                base = scratch("chain-base", size)  # only the tiles the ranges cover are read
                start = min(lo for lo, _ in ranges) // tile * tile
                end = min(size, -(-max(hi for _, hi in ranges) // tile) * tile)
                frames.read(found[0][1], start, base[start:end], (0, 0), name=parts[0][0], expect_hash=parts[0][1],
                            last=True)
            for lo, hi in ranges:  # the tiles the core decodes for each
                if not _decode_tiles(core, parts, found, base, out, lo // tile * tile,
                                     min(size, -(-hi // tile) * tile), lo, hi, frames):
                    return False
        finally:
            frames.close()
    except (CorruptCheckpointError, IncompatibleFormatError):
        return False
    return True


def _decode_tiles(core: _ext.CpuCore, parts: list, found: list, base: np.ndarray | None, out: np.ndarray, b0: int,
                  b1: int, lo: int, hi: int, frames: _Frames) -> bool:
    """Tiles [b0, b1) of every link decoded, bytes [lo, hi) of them into ``out``: in as many passes
    as it takes to keep what the links' zstd planes hold for them within one chunk of scratch, each
    later pass XORed over what the one before left in ``out[lo:hi]``."""
    size = out.size
    needs = [_range_bytes(f, size, b0, b1) for f in found]
    room = scratch("chain-sections", min(size, sum(needs)))
    links: list[_ext.ChainLink] = []
    first: list[list[int]] = []
    used = 0
    for i, ((name, expect, blob), part, need) in enumerate(zip(parts, found, needs)):
        if part[0].masked:  # the links before it decoded into out[lo:hi], then its bytes XORed in
            if links and core.chain_decode_range(links, base, out, lo, hi, first):
                return False
            if not _masked_range(part[0], blob, out, lo, hi, xor=bool(links), name=name, expect_hash=expect):
                return False
            links, first, used, base = [_IN_OUT], [[]], 0, out
            continue
        if need > room.size:
            return False
        if used + need > room.size:
            if core.chain_decode_range(links, base, out, lo, hi, first):
                return False
            links, first, used, base = [_IN_OUT], [[]], 0, out  # the chain so far is in out[lo:hi]
        link, starts, _ = _range_link(part, room[used:used + need], size, b0, b1, frames, i, name=name,
                                      expect_hash=expect)
        links.append(link)
        first.append(starts)
        used += need
    return not core.chain_decode_range(links, base, out, lo, hi, first)


def _masked_range(hdr: ChunkHeader, blob, out: np.ndarray, lo: int, hi: int, *, xor: bool, name: str,
                  expect_hash: str) -> bool:
    """Bytes [lo, hi) of a link with a zero mask (its kept elements there found by the mask, their rANS
    blocks decoded: :func:`ckpt.format.partial.decode_spans`) into ``out[lo:hi]``, or XORed over what
    is there. False where it cannot (a zstd plane, a range not on whole elements)."""
    from . import partial  # (partial reads chains through .chains, which imports this module)

    if lo % hdr.width or (hi % hdr.width and hi != hdr.raw_len):
        return False
    dst = scratch("chain-masked", hi - lo) if xor else out[lo:hi]
    try:
        partial.decode_spans(hdr, blob, [(lo, hi)], dst, name=name, expect_hash=expect_hash)
    except partial.NotPartial:
        return False
    if xor:
        np.bitwise_xor(out[lo:hi], dst, out=out[lo:hi])
    return True


def _tile(found: list) -> int:
    """The core's tile for these links (csrc/chain.cpp): a whole number of every link's elements and
    of four of every rANS block. Only what is kept of zstd planes depends on it: where it were
    wrong, the core finds a plane without the elements it needs and says so."""
    widths, unit = 1, 1 << 16
    for hdr, _, table in found:
        w = hdr.width if hdr.codec in PLANED else 1 if hdr.codec == "raw" else 0
        if w:
            widths = widths * w // math.gcd(widths, w)
        for (_, stored, _), core_decodes in zip(table or [], _core_decodes(hdr, table) if table else []):
            if core_decodes and len(stored) >= 2 and 8 <= stored[1] <= 16:
                unit = max(unit, 4 << stored[1])
    return widths * unit


def _elements(hdr: ChunkHeader, size: int, b0: int, b1: int) -> tuple[int, int]:
    """The elements of a link's planes that bytes [b0, b1) (whole tiles) hold."""
    m = size // hdr.width
    return b0 // hdr.width, m if b1 == size else b1 // hdr.width


def _range_bytes(part, size: int, b0: int, b1: int) -> int:
    """The scratch bytes a link's sections take for tiles [b0, b1): what the tiles need of its zstd
    planes, its tail where it is not stored."""
    hdr, _, table = part
    if table is None or hdr.masked:  # decoded by its spans (_masked_range)
        return 0
    j0, j1 = _elements(hdr, size, b0, b1)
    return sum((j1 - j0 if k < hdr.width else length) if how == ZSTD or (how == RANS and k == hdr.width) else 0
               for k, (how, _, length) in enumerate(table))


def _range_link(part, room: np.ndarray, size: int, b0: int, b1: int, frames: _Frames, i: int, *, name: str,
                expect_hash: str) -> tuple[_ext.ChainLink, list[int], np.ndarray]:
    """Link ``i`` as the core takes it for tiles [b0, b1), the element each plane's bytes start at, and
    what is left of ``room`` (its zstd planes' parts, read from ``frames``, and a coded tail are
    decoded there)."""
    hdr, payload, table = part
    if hdr.codec == "raw":
        return ([u8(payload)], [False], _NO_TAIL, False), [0], room
    if hdr.codec == "zstd":
        return _IN_OUT, [], room
    j0, j1 = _elements(hdr, size, b0, b1)
    planes: list[np.ndarray] = []
    starts: list[int] = []
    coded = _core_decodes(hdr, table)
    for k, ((how, stored, length), core_decodes) in enumerate(zip(table, coded)):
        start = 0
        if how == ZSTD and k < hdr.width:
            start, length = j0, j1 - j0
            frames.read(stored, j0, room[:length], (i, k), name=name, expect_hash=expect_hash,
                        last=j1 == size // hdr.width)
        elif how != STORED and not core_decodes:
            unpack_section(how, stored, room[:length], name=name, expect_hash=expect_hash)
        else:
            planes.append(u8(stored) if length else np.empty(0, np.uint8))
            starts.append(start)
            continue
        planes.append(room[:length])
        starts.append(start)
        room = room[length:]
    return (planes[:hdr.width], coded[:hdr.width], planes[hdr.width], hdr.rot), starts[:hdr.width], room


class _Frames:
    """The zstd frames a range decode reads, each open where it stopped so that the next range reads
    on (``keep``), or closed once its part is read: each holds a window of decompression state."""

    def __init__(self, keep: bool):
        self.keep = keep
        self.open: dict[tuple[int, int], list] = {}  # (link, plane): [stream, where it is]

    def read(self, frame, at: int, dst: np.ndarray, key: tuple[int, int], *, name: str, expect_hash: str,
             last: bool = False) -> None:
        """Bytes [at, at + len(dst)) of what zstd ``frame`` decompresses to, into ``dst``. Its stream
        goes on from where it stopped, or starts again where it is past ``at``; the bytes before
        ``at`` are decompressed a piece at a time and dropped, those after the part never
        decompressed. ``last``: the frame is not read again from here on."""
        piece = scratch("frames", 1 << 20)
        try:
            if key not in self.open or self.open[key][1] > at:  # a stream of its own: those of one context clash
                self._close(key)
                self.open[key] = [zstandard.ZstdDecompressor().stream_reader(frame, read_across_frames=True), 0]
            reader, pos = self.open[key]
            while pos < at:
                k = reader.readinto(piece[:min(at - pos, piece.size)].data)
                if k == 0:
                    break
                pos += k
            n = 0
            while pos == at and n < dst.size:
                k = reader.readinto(dst[n:].data)
                if k == 0:
                    break
                n += k
            self.open[key][1] = pos + n
        except zstandard.ZstdError as e:
            raise CorruptCheckpointError(f"chunk object {name} does not decompress: {e}", object=name,
                                         chunk=expect_hash) from e
        finally:
            if last or not self.keep:
                self._close(key)
        if pos != at or n != dst.size:
            raise CorruptCheckpointError(f"chunk object {name} has a section shorter than its table says",
                                         object=name, chunk=expect_hash)

    def _close(self, key: tuple[int, int]) -> None:
        if key in self.open:
            self.open.pop(key)[0].close()

    def close(self) -> None:
        for key in list(self.open):
            self._close(key)


_NO_TAIL = np.zeros(1, np.uint8)

_IN_OUT: _ext.ChainLink = ([], [], _NO_TAIL, False)  # a link whose bytes are in ``out`` already


def _chain_part(i: int, name: str, expect: str, blob, size: int, check: bool = True) -> tuple | None:
    """Link ``i``'s header, payload and section table (None for raw and zstd), checked as the link by
    link decode checks them before decoding (``check``: a delta's payload check too); None where the
    chain is not decoded at once."""
    view = memoryview(blob).cast("B")
    hdr = parse_header(view[:HEADER_SIZE], name=name)
    payload = view[HEADER_SIZE:]
    if hdr.raw_len != size or len(payload) != hdr.payload_len or (hdr.codec == "xor") != (i > 0) \
            or (hdr.codec == "raw" and len(payload) != size):
        return None
    # the link by link decode refuses a delta whose payload check fails, even where the bytes it
    # decodes to are right (damage to the check itself, or to a byte no decode reads)
    if check and i > 0 and xor_check(view[:HEADER_SIZE], [payload]) != hdr.check:
        return None
    return hdr, payload, section_table(hdr, payload, name=name, expect_hash=expect) if hdr.codec in PLANED else None


def _core_decodes(hdr: ChunkHeader, table) -> list[bool]:
    """Which sections the core decodes itself: rANS planes (not a rANS tail, which it takes as bytes)."""
    return [how == RANS and k < hdr.width for k, (how, _, _) in enumerate(table)]


def _unpacked_bytes(part) -> int:
    """The scratch bytes a link's sections take before the core runs: its zstd sections and rANS tail
    (a zero mask's link is decoded into place: none)."""
    hdr, _, table = part
    if table is None or hdr.masked:
        return 0
    return sum(length for (how, _, length), c in zip(table, _core_decodes(hdr, table)) if how != STORED and not c)


def _chain_link(part, room: np.ndarray, out: np.ndarray, *, name: str, expect_hash: str) -> _ext.ChainLink:
    """A link as the core takes it; its sections the core does not decode are decoded into ``room``."""
    hdr, payload, table = part
    if hdr.codec == "raw":  # a plane of one-byte elements: copied a tile at a time
        return [u8(payload)], [False], _NO_TAIL, False
    if hdr.codec == "zstd":  # decompressed into place first, the deltas XORed over it
        _decompress_into(payload, out.data, name=name, expect_hash=expect_hash)
        return _IN_OUT
    planes: list[np.ndarray] = []
    coded = _core_decodes(hdr, table)
    for (how, stored, length), core_decodes in zip(table, coded):
        if how != STORED and not core_decodes:
            planes.append(room[:length])
            room = room[length:]
            unpack_section(how, stored, planes[-1], name=name, expect_hash=expect_hash)
        else:
            planes.append(u8(stored) if length else np.empty(0, np.uint8))
    return planes[:hdr.width], coded[:hdr.width], planes[hdr.width], hdr.rot
