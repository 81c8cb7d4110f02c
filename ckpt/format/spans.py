"""Span digests: a check of each 1 MiB span of a chunk stored raw, so a reader that needs part of
the chunk (a rank whose shard boundary falls inside it) reads and verifies only the spans it needs
instead of the whole chunk.

The chunk's name (the xxh3-128 of all its bytes) can only be checked by reading every byte; a
reshard onto a world size that cuts shards unevenly would read each chunk a boundary falls in twice
(once per rank on either side). The digests live in the manifest, which the reader already trusts
for the chunk's name, so a span checks against the same root of trust. They are optional (a reader
that ignores them reads whole chunks), so a manifest that has them stays readable by older ckpt.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import numpy as np
import xxhash

from .. import _ext
from .entries import ChunkInfo, bad

SPAN = 1 << 20  # bytes per span: a partial read wastes less than two spans per boundary
DIGEST_HEX = 16  # hex digits per span: the first 16 of the span's xxh3-128 hex digest
MIN_SPAN, MAX_SPAN = 1 << 12, 1 << 30


def digest(buf) -> str:
    """The digest of one span: the first 16 hex digits of its xxh3-128 (the compiled core's, the GIL
    released, where it is built and the span is long enough for it)."""
    core = _ext.cpu()
    view = memoryview(buf).cast("B")
    if core is not None and view.c_contiguous and len(view) > 240:
        h = core.xxh3_128(np.frombuffer(view, np.uint8).ctypes.data, len(view))
        if h is not None:
            return h[:DIGEST_HEX]
    return xxhash.xxh3_128_hexdigest(view)[:DIGEST_HEX]


def digests(data, span: int = SPAN) -> str:
    """The digests of every span of ``data``, concatenated (the last span may be shorter)."""
    view = memoryview(data).cast("B")
    return "".join(digest(view[i : i + span]) for i in range(0, len(view), span))


def attach(info: ChunkInfo, data) -> ChunkInfo:
    """``info`` with the span digests of the chunk's raw bytes ``data`` where it gets them: stored raw,
    as planes or as a delta, and longer than a span (a reader needing part of it then reads, or
    decodes, and checks only the spans it needs)."""
    if not (info.codec.startswith(("raw/", "planes/", "xor/")) and worth(info.size)):
        return info
    return dataclasses.replace(info, spans=digests(data))


def worth(size: int, span: int = SPAN) -> bool:
    """Whether a chunk of ``size`` bytes gets span digests: only one of more than one span."""
    return size > span


def count(size: int, span: int) -> int:
    return -(-size // span)


def to_json(chunks: dict[str, ChunkInfo]) -> dict | None:
    """The manifest's ``spans`` field for a chunk table (None when no chunk has digests)."""
    have = {h: c.spans for h, c in chunks.items() if c.spans is not None}
    return {"size": SPAN, "digests": have} if have else None


def parse(raw: Any, chunks: dict[str, ChunkInfo], name: str) -> None:
    """Check a manifest's ``spans`` field (untrusted JSON) and attach the digests to ``chunks``."""
    if raw is None:
        return
    if not isinstance(raw, dict) or not isinstance(raw.get("digests"), dict):
        raise bad(name, "spans must be an object with size and digests")
    size: Any = raw.get("size")
    if type(size) is not int or not MIN_SPAN <= size <= MAX_SPAN or size & (size - 1):
        raise bad(name, f"spans.size must be a power of two from {MIN_SPAN} to {MAX_SPAN}")
    if size != SPAN:
        return  # another span size than this reader's: whole chunks are read (correct, only slower)
    for h, d in raw["digests"].items():
        info = chunks.get(h)
        if info is None:
            raise bad(name, f"spans name chunk {str(h)[:40]!r}, which is not in the chunk table")
        if not (isinstance(d, str) and len(d) == DIGEST_HEX * count(info.size, size) and _is_hex(d)):
            raise bad(name, f"spans of chunk {h} must be {DIGEST_HEX} lowercase hex digits per {size}-byte span", h)
        info.spans = d


_HEX = re.compile("[0-9a-f]*")  # a 1 KiB digest string in 3 µs; a loop per character took 46


def _is_hex(s: str) -> bool:
    return _HEX.fullmatch(s) is not None


def runs(ranges: list[tuple[int, int]], size: int, span: int = SPAN) -> list[tuple[int, int]]:
    """The spans that byte ranges ``(offset, length)`` of a chunk of ``size`` bytes touch, as runs
    ``(first span, end span)`` of consecutive spans."""
    need = sorted({s for off, n in ranges if n > 0 for s in range(off // span, (off + n - 1) // span + 1)})
    out: list[tuple[int, int]] = []
    for s in need:
        if out and out[-1][1] == s:
            out[-1] = (out[-1][0], s + 1)
        else:
            out.append((s, s + 1))
    return [(a, min(b, count(size, span))) for a, b in out]


def mismatch(buf, first: int, expect: str, span: int = SPAN) -> int | None:
    """The first span read into ``buf`` (span ``first`` onwards) whose digest is not the one in
    ``expect`` (the chunk's digests), or None when all match."""
    view = memoryview(buf).cast("B")
    for i in range(0, len(view), span):
        s = first + i // span
        if digest(view[i : i + span]) != expect[DIGEST_HEX * s : DIGEST_HEX * (s + 1)]:
            return s
    return None
