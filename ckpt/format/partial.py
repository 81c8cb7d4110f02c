"""Decoding part of a ``planes`` chunk: the elements of the spans a reader needs, checked against the
manifest's span digests (:mod:`.spans`), instead of the whole chunk.

A reshard whose shard boundary falls inside an encoded chunk decodes it on both ranks; decoding is
what a load of encoded float state spends its time on, so each rank should decode only its part.
A plane stored as it is gives any element range by slicing; a rANS section is coded in blocks of
2^k symbols, each prefixed by its length, so the blocks covering a range can be found by walking
the prefixes and decoded alone. A zstd section is one frame and would have to be decoded whole: a
chunk with one is not decoded in part (the caller decodes it whole), nor is a delta (``xor``),
whose base would have to be decoded in part too.
"""

from __future__ import annotations

import numpy as np

from . import rans, spans
from .chunk import HEADER_SIZE, ChunkHeader, _section_table, _unpack_section
from .planes import RANS, STORED, scratch, ungroup_parts


class NotPartial(Exception):
    """This object cannot be decoded in part (or a section is damaged): decode it whole, where the
    one validity check of a chunk says what is wrong."""


def decode_spans(hdr: ChunkHeader, blob, runs: list[tuple[int, int]], out: np.ndarray, *, name: str,
                 expect_hash: str) -> list[tuple[int, int, int]]:
    """Decode the byte ranges ``runs`` ((start, end), span-aligned, sorted) of planes object ``blob``
    (header already checked) into ``out``, one after another; returns (start, end, position in
    ``out``) per run. :class:`NotPartial` where it cannot."""
    w, n = hdr.width, hdr.raw_len
    if hdr.codec != "planes" or hdr.base is not None or spans.SPAN % w:
        raise NotPartial
    payload = memoryview(blob).cast("B")[HEADER_SIZE:]
    table = _section_table(hdr, payload, name=name, expect_hash=expect_hash)
    m = n // w
    placed, pos = [], 0
    for lo, hi in runs:
        e0, e1 = lo // w, min(hi, m * w) // w
        parts = [_elements(how, stored, e0, e1, m, p) for p, (how, stored, _) in enumerate(table[:w])]
        tail = np.empty(0, np.uint8)
        if hi > m * w:  # the run ends the chunk: the tail bytes (fewer than w) follow the planes
            how, stored, length = table[w]
            tail = np.frombuffer(stored, np.uint8) if how == STORED else _whole(how, stored, length, name, expect_hash)
        dst = out[pos : pos + hi - lo]
        ungroup_parts(parts + [tail], None, w, dst, hdr.rot)
        placed.append((lo, hi, pos))
        pos += hi - lo
    return placed


def _whole(how: int, stored: memoryview, length: int, name: str, expect_hash: str) -> np.ndarray:
    dst = np.empty(length, np.uint8)
    _unpack_section(how, stored, dst, name=name, expect_hash=expect_hash)
    return dst


def _elements(how: int, stored: memoryview, e0: int, e1: int, m: int, plane: int) -> np.ndarray:
    """Elements [e0, e1) of plane number ``plane``, of ``m`` elements, kept as ``how``."""
    if e1 <= e0:
        return np.empty(0, np.uint8)
    if how == STORED:
        return np.frombuffer(stored, np.uint8, e1 - e0, e0)
    if how != RANS:
        raise NotPartial
    sec = np.frombuffer(stored, np.uint8)
    if sec.size < 2 or not 8 <= sec[1] <= 16:
        raise NotPartial
    k = int(sec[1])
    starts = _block_starts(sec, -(-m >> k))
    b0, b1 = e0 >> k, ((e1 - 1) >> k) + 1
    first = b0 << k
    dst = scratch(f"partial{plane}", min(m, b1 << k) - first)
    try:
        rans.decode_into(np.concatenate([sec[:2], sec[starts[b0] : starts[b1]]]), dst)
    except rans.RansError:
        raise NotPartial from None
    return dst[e0 - first : e1 - first]


def _block_starts(sec: np.ndarray, count: int) -> list[int]:
    """Where each of the ``count`` blocks of a rANS section starts (each is prefixed by the u32 length
    of its rest), and where the last ends, which must be the section's end."""
    starts, pos = [], 2
    for _ in range(count):
        if pos + 4 > sec.size:
            raise NotPartial
        starts.append(pos)
        pos += 4 + int(sec[pos : pos + 4].view("<u4")[0])
    if pos != sec.size:
        raise NotPartial
    return starts + [pos]
