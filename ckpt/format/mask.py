"""Zero masks (chunk format v3): a ``planes`` or ``xor`` chunk that is mostly zero elements (a pruned
layer, the delta of a sparse update) stores one bit per element and the byte planes of its nonzero
elements only.

Bit i % 8 of mask byte i // 8 (least significant first) says whether element i (its w bytes, XOR the
base for a delta) has any bit set; the bits past the last element are zero. The kept elements, in
order, are then grouped into planes as a whole chunk is. Decoding writes the zero elements as runs
instead of entropy-decoding every byte of them: a 90%-zero fp32 chunk decodes about 3x faster, and
takes fewer bytes, than with every plane rANS-coded.

The compiled core (csrc/mask.cpp) does both directions when built; numpy writes the same bytes.
"""

from __future__ import annotations

import numpy as np

from .. import _ext

WIDTHS = (2, 4, 8)  # element widths a mask is made for (16-, 32- and 64-bit elements)

_WORD: dict[int, np.dtype] = {2: np.dtype("<u2"), 4: np.dtype("<u4"), 8: np.dtype("<u8")}

POPCOUNT = np.array([bin(i).count("1") for i in range(256)], np.uint8)  # bits set per mask byte (numpy 1.26 has no
# bitwise_count)


def mask_bytes(m: int) -> int:
    """Bytes of the mask of ``m`` elements."""
    return (m + 7) // 8


def zero_share(buf, width: int, base=None) -> float:
    """The share of ``buf``'s ``width``-byte elements (XOR ``base``) that are zero: what decides whether a
    mask is tried."""
    src = np.frombuffer(buf, np.uint8)
    m = src.size // width
    if m == 0 or width not in WIDTHS:
        return 0.0
    words = src[: m * width].view(_WORD[width])
    if base is not None:
        words = words ^ np.frombuffer(base, np.uint8)[: m * width].view(_WORD[width])
    return float(np.count_nonzero(words == 0)) / m


def compact(src: np.ndarray, base: np.ndarray | None, width: int, mask: np.ndarray, out: np.ndarray) -> int:
    """The ``width``-byte elements of ``src`` (uint8, whole elements; XOR ``base``) that are nonzero, in
    order, into ``out`` (uint8, room for all of ``src``), and their mask into ``mask``
    (:func:`mask_bytes` of them). Returns how many were kept."""
    core = _ext.cpu()
    if core is not None:
        return core.mask_compact(src, base, width, mask, out)
    words = src.view(_WORD[width])
    if base is not None:
        words = words ^ base.view(_WORD[width])
    keep = words != 0
    mask[:] = np.packbits(keep, bitorder="little")
    kept = words[keep]
    out[: kept.nbytes] = kept.view(np.uint8)
    return int(kept.size)


def expand(mask: np.ndarray, kept: np.ndarray, k: int, width: int, base: np.ndarray | None, out: np.ndarray) -> bool:
    """The inverse of :func:`compact` into ``out`` (uint8, whole elements): each element ``base``'s
    (zero without one; ``base`` may be ``out``) XOR, where its bit is set, the next of the ``k``
    elements ``kept`` holds. False, with ``out`` holding anything, where the mask does not keep
    exactly ``k`` elements or sets a bit past the last element (a damaged chunk)."""
    m = out.size // width
    if k < 0 or mask.size != mask_bytes(m) or kept.size < k * width or (base is not None and base.size < out.size):
        return False  # (the core would read past a buffer: a count from a damaged table)
    if m % 8 and int(mask[-1]) >> (m % 8):
        return False
    core = _ext.cpu()
    if core is not None:
        return core.mask_expand(mask, kept, k, width, base, out) == k
    bits = np.unpackbits(mask, count=m, bitorder="little").view(bool)
    if int(np.count_nonzero(bits)) != k:
        return False
    words = out.view(_WORD[width])
    vals = kept[: k * width].view(_WORD[width])
    if base is None:
        words[:] = 0
        words[bits] = vals
        return True
    if base is not out:
        words[:] = base.view(_WORD[width])
    words[bits] ^= vals
    return True
