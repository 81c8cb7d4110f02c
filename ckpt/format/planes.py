"""Byte planes: the layout the ``planes`` and ``xor`` codecs store a chunk's bytes in.

The bytes of each w-byte element are split into w planes (plane 0 holds the least significant byte
of every element), followed by the n mod w tail bytes; with rotation every element is first rotated
left one bit, so a float's sign leaves the exponent's plane. ``xor`` groups the chunk XOR its base.
A planes payload starts with a table of w + 1 little-endian u64 (bit 63: the section is a zstd
frame; bit 62: a rANS section; the rest: its stored length), then the sections in order. The compiled core does the
shuffling when built; numpy writes the same bytes.
"""

from __future__ import annotations

import threading

import numpy as np

from .. import _ext

ZSTD_FLAG = 1 << 63  # in a section table entry: the section is a zstd frame
RANS_FLAG = 1 << 62  # ... a rANS section (ckpt/format/rans.py; chunk format v2)
LENGTH_MASK = RANS_FLAG - 1  # ... the rest: its stored length
STORED, ZSTD, RANS = 0, 1, 2  # how a section is kept (the flag it gets: SECTION_FLAGS)
SECTION_FLAGS = {STORED: 0, ZSTD: ZSTD_FLAG, RANS: RANS_FLAG}
_local = threading.local()


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
    A writing thread keeps about one chunk of it; a reading thread up to about four (the object read,
    a chain's result, its sections and a whole zstd base; a range decode's zstd windows stay within one
    more) until :func:`trim_scratch`."""
    cache = getattr(_local, "scratch", None)
    if cache is None:
        cache = _local.scratch = {}
        with _scratch_lock:
            _scratch_caches.append(cache)
    buf = cache.get(name)
    if buf is None or buf.size < n:
        buf = cache[name] = np.empty(max(n, 1), np.uint8)
    return buf[:n]


def u8(buf) -> np.ndarray:
    return np.frombuffer(buf, dtype=np.uint8)


ROTATES = (2, 4, 8)  # widths whose elements may be rotated (floats: bfloat16, float32, float64)

_WORD: dict[int, np.dtype] = {2: np.dtype("<u2"), 4: np.dtype("<u4"), 8: np.dtype("<u8")}

def group(raw, base, width: int, out: np.ndarray | None = None, rot: bool = False) -> np.ndarray:
    """``raw`` (XOR ``base`` when given, same length) in the grouped layout: ``width`` byte planes,
    then the tail bytes; with ``rot`` every element is first rotated left by one bit (the sign to
    the bottom: a float's top plane then holds exponent bits only). The compiled core does it when
    built; numpy gives the same bytes."""
    src = u8(raw)
    b = None if base is None else u8(base)
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
    ungroup_parts([planes[p * m:(p + 1) * m] for p in range(width)] + [planes[m * width:]], base, width, out, rot)
    return out


def ungroup_parts(planes: list[np.ndarray], base, width: int, out: np.ndarray, rot: bool) -> None:
    """:func:`ungroup` from separate plane buffers (``width`` planes, then the tail)."""
    n = out.size
    b = None if base is None else u8(base)
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


def sections(n: int, width: int) -> list[int]:
    """Lengths of the sections of an ``n``-byte chunk grouped by ``width``: the planes, then the tail."""
    m = n // width
    return [m] * width + [n - m * width]
