"""Decoding part of a ``planes`` chunk: the elements of the spans a reader needs, checked against the
manifest's span digests (:mod:`.spans`), instead of the whole chunk.

A reshard whose shard boundary falls inside an encoded chunk decodes it on both ranks; decoding is
what a load of encoded float state spends its time on, so each rank should decode only its part.
A plane stored as it is gives any element range by slicing; a rANS section is coded in blocks of
2^k symbols, each prefixed by its length, so the blocks covering a range can be found by walking
the prefixes and decoded alone. A zstd section is one frame and would have to be decoded whole: a
chunk with one is not decoded in part (the caller decodes it whole). A delta (``xor``) is decoded
in part down its chain: the spans of the chunk stored whole, then each delta's spans XORed in.
"""

from __future__ import annotations

import numpy as np

from ..storage.base import Storage
from . import chains, mask, rans, spans
from . import manifest as mf
from .chunk import HEADER_SIZE, ChunkHeader, check_header, parse_header, section_table, unpack_section
from .paths import chunk_key
from .planes import RANS, STORED, scratch, ungroup_parts


class NotPartial(Exception):
    """This object cannot be decoded in part (or a section is damaged): decode it whole, where the
    one validity check of a chunk says what is wrong."""


def resolve_spans(storage: Storage, chunks: dict[str, mf.ChunkInfo], h: str, blob, runs: list[tuple[int, int]],
                  out: np.ndarray, step: int | None = None) -> tuple[list[tuple[int, int, int]], int]:
    """The byte ranges ``runs`` ((start, end), span-aligned, sorted) of chunk ``h`` (its object
    ``blob`` read already), decoded down its chain into ``out`` one after another; returns (start,
    end, position in ``out``) per run, and the bytes read for the chain's other links. The links'
    headers are checked; their bytes are not (the caller checks the result against the span
    digests). :class:`NotPartial` where it cannot."""
    blobs, read = chains.links(storage, chunks, h, step, blob)
    placed: list[tuple[int, int, int]] = []
    delta: np.ndarray | None = None
    for x, data in reversed(blobs):  # the chunk stored whole first, then each delta on it
        key = chunk_key(x)
        hdr = parse_header(data, name=key)
        check_header(hdr, name=key, expect_hash=x, expect_len=chunks[x].size, object_len=len(data))
        if hdr.base is None:
            placed = _whole_link(hdr, data, runs, out, key, x)
            continue
        if delta is None:
            delta = scratch("partial-delta", out.size)
        decode_spans(hdr, data, runs, delta, name=key, expect_hash=x)
        np.bitwise_xor(out, delta, out=out)
    return placed, read


def _whole_link(hdr: ChunkHeader, data, runs: list[tuple[int, int]], out: np.ndarray, key: str,
                x: str) -> list[tuple[int, int, int]]:
    if hdr.codec == "raw":
        if hdr.payload_len != hdr.raw_len:
            raise NotPartial  # damaged: the whole path says so
        payload = np.frombuffer(memoryview(data).cast("B"), np.uint8)[HEADER_SIZE:]
        placed, pos = [], 0
        for lo, hi in runs:
            out[pos : pos + hi - lo] = payload[lo:hi]
            placed.append((lo, hi, pos))
            pos += hi - lo
        return placed
    return decode_spans(hdr, data, runs, out, name=key, expect_hash=x)


def decode_spans(hdr: ChunkHeader, blob, runs: list[tuple[int, int]], out: np.ndarray, *, name: str,
                 expect_hash: str) -> list[tuple[int, int, int]]:
    """Decode the byte ranges ``runs`` ((start, end), span-aligned, sorted) of planes object ``blob``
    (header already checked) into ``out``, one after another; returns (start, end, position in
    ``out``) per run. For a delta (``xor``), the delta's bytes (the caller XORs its base's in).
    :class:`NotPartial` where it cannot."""
    w, n = hdr.width, hdr.raw_len
    if hdr.codec not in ("planes", "xor") or spans.SPAN % w:
        raise NotPartial
    payload = memoryview(blob).cast("B")[HEADER_SIZE:]
    table = section_table(hdr, payload, name=name, expect_hash=expect_hash)
    if hdr.masked:
        return _masked_spans(hdr, table, runs, out, name, expect_hash)
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


def _masked_spans(hdr: ChunkHeader, table: list, runs: list[tuple[int, int]], out: np.ndarray, name: str,
                  expect_hash: str) -> list[tuple[int, int, int]]:
    """:func:`decode_spans` of a chunk with a zero mask: the mask decoded whole (an eighth of a byte per
    element), then per run the kept elements it covers (counted by the mask) decoded from the planes
    and spread over the run's zeros."""
    w, n = hdr.width, hdr.raw_len
    m, k = n // w, table[0][2]
    how, stored, length = table[w + 1]
    bits = np.frombuffer(stored, np.uint8) if how == STORED else _whole(how, stored, length, name, expect_hash)
    before = np.concatenate([[0], np.cumsum(mask.POPCOUNT[bits], dtype=np.int64)])  # kept before each byte
    if bits.size != mask.mask_bytes(m) or int(before[-1]) != k:
        raise NotPartial  # a mask that does not keep its count: the whole decode says the chunk is damaged

    def kept_before(e: int) -> int:
        return int(before[e // 8]) + (int(bits[e // 8]) & ((1 << e % 8) - 1)).bit_count() if e < m else k

    placed, pos = [], 0
    for lo, hi in runs:
        e0, e1 = lo // w, min(hi, m * w) // w
        c0, c1 = kept_before(e0), kept_before(e1)
        parts = [_elements(how, stored, c0, c1, k, p) for p, (how, stored, _) in enumerate(table[:w])]
        kept = scratch("partial-kept", (c1 - c0) * w)
        if c1 > c0:
            ungroup_parts(parts + [np.empty(0, np.uint8)], None, w, kept, hdr.rot)
        run = np.unpackbits(bits[e0 // 8:(e1 + 7) // 8], bitorder="little")[e0 % 8:e0 % 8 + e1 - e0]
        dst = out[pos : pos + hi - lo]
        if not mask.expand(np.packbits(run, bitorder="little"), kept, c1 - c0, w, None, dst[:(e1 - e0) * w]):
            raise NotPartial
        if hi > m * w:  # the run ends the chunk: the tail bytes (fewer than w)
            how, stored, length = table[w]
            tail = np.frombuffer(stored, np.uint8) if how == STORED else _whole(how, stored, length, name, expect_hash)
            dst[(e1 - e0) * w:] = tail
        placed.append((lo, hi, pos))
        pos += hi - lo
    return placed


def _whole(how: int, stored: memoryview, length: int, name: str, expect_hash: str) -> np.ndarray:
    dst = np.empty(length, np.uint8)
    unpack_section(how, stored, dst, name=name, expect_hash=expect_hash)
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
