"""Entropy-coded byte planes: order-0 rANS in blocks, each block with its own frequency table.

The exponent plane of trained float tensors holds a few dozen distinct bytes with a skewed
distribution that changes from tensor to tensor (weights, then Adam's second moments several
binades lower). zstd's Huffman literals with LZ matching get 2.8× on it; order-0 coding with a table
per 16384 symbols gets within 0.1% of the plane's per-tensor entropy (3.1×), because a chunk that
spans several tensors gets a table for each.

Section layout (all little-endian): ``u8`` format (1), ``u8`` log2 of the block length (at most
16), then each block: ``u32`` length of the rest of the block; ``u8`` (symbols present − 1); per
present symbol, in increasing order, ``u8`` symbol and, when more than one is present, ``u16``
frequency (scaled to 4096); then, when more than one is present, eight ``u32`` final states, eight
``u16`` word counts and eight streams of ``u16`` words, each in reading order. Symbol *i* of a block
is coded by state *i* mod 8, which reads its own stream (the compiled decoder's eight states never
wait on each other); a state lives in [2^16, 2^32) and takes a word whenever it drops below 2^16. A
block with one symbol present is that symbol repeated.

The compiled core (csrc/rans.cpp) encodes and decodes. Without it this module does both in numpy,
every block of a section at once, about 20× slower, writing the same bytes: what a save stores does
not depend on the machine.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import numpy as np

from .. import _ext

log = logging.getLogger("ckpt")

FORMAT = 1
SCALE_BITS = 12
LOW = 1 << 16
STATES = 8


class RansError(ValueError):
    """A section that does not decode: the caller names the object and raises its own error."""


def encode(src: np.ndarray) -> bytes:
    """The rANS section of ``src`` (uint8)."""
    core = _ext.cpu()
    if core is not None:
        return core.rans_encode(src)
    global _warned
    if src.size > (1 << 20) and not _warned:
        _warned = True
        log.warning("ckpt's compiled core is not built, so byte planes are entropy-coded in numpy (about 20x "
                    "slower; the same bytes). Reinstall ckpt where a C++ compiler is found to build it, or pass "
                    "codec='zstd' for fast saves without it")
    return _encode_numpy(src)


_warned = False


def estimate(src: np.ndarray) -> int:
    """About the length of :func:`encode`'s section of ``src``, from each block's symbol counts alone
    (no coding: `auto`'s trials compare sizes): every block's header and table exactly, its coded words
    from its symbols' information. A block of one symbol is exact, so :func:`repeats` holds for an
    estimate as for a section. The compiled core and numpy give the same number (integer arithmetic
    on one table of costs), so a choice made from it does not depend on the machine."""
    core = _ext.cpu()
    if core is not None:
        return core.rans_estimate(src, _cost())
    return _estimate_numpy(np.ascontiguousarray(src, np.uint8))


_COST_FRAC = 16  # costs in 1/65536 bits


@functools.lru_cache(None)
def _cost() -> np.ndarray:
    """Per frequency f (1..4096; index 0 unused), -log2(f / 4096) in 1/65536 bits, from log2 f rounded
    down, in integers alone (its bits by repeated squaring): the same table on every machine."""
    out = np.zeros((1 << SCALE_BITS) + 1, np.uint32)
    one = 1 << 62  # fixed point: 1.0
    for f in range(1, (1 << SCALE_BITS) + 1):
        e = f.bit_length() - 1
        x = (f << 62) >> e  # f / 2^e in [1, 2)
        frac = 0
        for _ in range(_COST_FRAC):
            x = (x * x) >> 62
            frac <<= 1
            if x >= 2 * one:
                x >>= 1
                frac |= 1
        out[f] = (SCALE_BITS << _COST_FRAC) - ((e << _COST_FRAC) + frac)  # log2 f = e + frac / 2^16
    out.setflags(write=False)  # cached: shared by every caller
    return out


def _block_counts(src: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per block of ``src`` (k blocks, k > 0): its start, length, symbol counts (k x 256) and the
    frequencies the coder normalises them to."""
    n = src.size
    block = 1 << BLOCK_LOG
    k = -(-n // block)
    starts = np.arange(k) * block
    ms = np.minimum(block, n - starts)
    ids = np.repeat(np.arange(k), ms)
    counts = np.bincount(ids * 256 + src.astype(np.int64), minlength=k * 256).reshape(k, 256)
    return starts, ms, counts, _normalize(counts, ms)


def _estimate_numpy(src: np.ndarray) -> int:
    if src.size == 0:
        return 2
    _, _, counts, f = _block_counts(src)
    present = (f > 0).sum(axis=1)
    bits = (counts.astype(np.uint64) * _cost()[f].astype(np.uint64)).sum(axis=1)
    unit = 16 << _COST_FRAC
    words = (bits + np.uint64(unit - 1)) // np.uint64(unit)
    coded = 4 + 1 + 3 * present + 6 * STATES + 2 * np.maximum(words.astype(np.int64) - 4, 0)
    return int(2 + np.where(present == 1, 6, coded).sum())


def decode_into(section, out: np.ndarray) -> None:
    """Decode ``section`` into exactly ``out`` (uint8); :class:`RansError` if it is damaged."""
    core = _ext.cpu()
    if core is not None:
        err = core.rans_decode(section, out)
        if err:
            raise RansError(error_text(err))
        return
    _decode_numpy(np.frombuffer(section, np.uint8), out)


def error_text(code: int) -> str:
    """What the compiled decoder's error ``code`` says about a section."""
    texts = {1: "it is truncated", 2: "its header or a frequency table is damaged"}
    return texts.get(code, "its coded words are damaged")


def _tables(b: np.ndarray, n: int) -> tuple[list, int]:
    """Parse the blocks: per block (start, length, single symbol or table, states, words)."""
    if b.size < 2 or b[0] != FORMAT or not 8 <= b[1] <= 16:
        raise RansError("its header is damaged")
    block = 1 << int(b[1])
    pos = 2
    blocks: list[tuple[Any, ...]] = []
    for start in range(0, n, block):
        m = min(block, n - start)
        if b.size - pos < 4:
            raise RansError("it is truncated")
        size = int(b[pos:pos + 4].view("<u4")[0])
        pos += 4
        stop = pos + size
        if stop > b.size or size < 2:
            raise RansError("it is truncated")
        present = int(b[pos]) + 1
        pos += 1
        if present == 1:
            if stop != pos + 1:
                raise RansError("its coded words are damaged")
            blocks.append((start, m, int(b[pos]), None, None, None))
            pos = stop
            continue
        if stop - pos < 3 * present + 6 * STATES:
            raise RansError("it is truncated")
        rec = b[pos:pos + 3 * present].reshape(present, 3)
        syms = rec[:, 0].astype(np.int64)
        freqs = rec[:, 1].astype(np.int64) | (rec[:, 2].astype(np.int64) << 8)
        if (np.diff(syms) <= 0).any() or (freqs == 0).any() or int(freqs.sum()) != 1 << SCALE_BITS:
            raise RansError("a frequency table is damaged")
        pos += 3 * present
        states = b[pos:pos + 4 * STATES].view("<u4").astype(np.int64)
        counts = b[pos + 4 * STATES:pos + 6 * STATES].view("<u2").astype(np.int64)
        pos += 6 * STATES
        if (states < LOW).any() or stop - pos != 2 * int(counts.sum()):
            raise RansError("its coded words are damaged")
        blocks.append((start, m, None, (syms, freqs), states, (b[pos:stop].view("<u2"), counts)))
        pos = stop
    if pos != b.size:
        raise RansError("its coded words are damaged")
    return blocks, block


_BATCH = 256  # blocks decoded in step: their slot tables take 5 bytes x 4096 each (5 MiB), whatever the input


def _decode_numpy(b: np.ndarray, out: np.ndarray) -> None:
    blocks, _ = _tables(b, out.size)
    coded = []
    for start, m, single, table, states, words in blocks:
        if single is not None:
            out[start:start + m] = single
        else:
            coded.append((start, m, table, states, words))
    for i in range(0, len(coded), _BATCH):
        _decode_batch(coded[i:i + _BATCH], out)


def _decode_batch(coded: list, out: np.ndarray) -> None:
    k = len(coded)
    scale, mask = 1 << SCALE_BITS, (1 << SCALE_BITS) - 1
    sym = np.empty((k, scale), np.uint8)
    freq = np.empty((k, scale), np.uint16)
    bias = np.empty((k, scale), np.uint16)
    for row, (_, _, (syms, freqs), _, _) in enumerate(coded):  # per 12-bit slot: symbol, frequency, offset
        cum = np.cumsum(freqs) - freqs
        sym[row] = np.repeat(syms, freqs)
        freq[row] = np.repeat(freqs, freqs)
        bias[row] = np.arange(scale) - np.repeat(cum, freqs)
    x = np.stack([c[3] for c in coded])  # (k, STATES)
    counts = np.stack([c[4][1] for c in coded])  # (k, STATES): every block's streams, one per state
    words = np.concatenate([c[4][0] for c in coded] + [np.zeros(1, "<u2")]).astype(np.int64)
    ptr = (np.cumsum(counts.reshape(-1)) - counts.reshape(-1)).reshape(k, STATES)
    end = ptr + counts
    starts = np.array([c[0] for c in coded])
    ms = np.array([c[1] for c in coded])
    rows = np.arange(k)
    for t in range(int(ms.max())):
        live = ms > t  # only the last block is shorter
        r = rows if live.all() else rows[live]
        j = t % STATES
        xs = x[r, j]
        slot = xs & mask
        out[starts[r] + t] = sym[r, slot]
        xs = freq[r, slot].astype(np.int64) * (xs >> SCALE_BITS) + bias[r, slot]
        need = xs < LOW
        if need.any():
            nr = r[need]
            if (ptr[nr, j] >= end[nr, j]).any():
                raise RansError("its coded words are damaged")
            xs[need] = (xs[need] << 16) | words[ptr[nr, j]]
            ptr[nr, j] += 1
        x[r, j] = xs
    if (ptr != end).any() or (x != LOW).any():
        raise RansError("its coded words are damaged")


BLOCK_LOG = 14  # what the encoder writes (csrc/rans.h BLOCK_LOG)


def repeats(section: bytes | int, n: int) -> bool:
    """Is ``section`` (the encoder's, of ``n`` symbols, or its length or :func:`estimate`) one-symbol
    blocks only: a byte repeated per block, which decoders write as such (no arithmetic)? Its length
    says so: every other block is longer than six bytes."""
    size = section if isinstance(section, int) else len(section)
    return size == 2 + 6 * -(-n // (1 << BLOCK_LOG))


def _normalize(counts: np.ndarray, n: np.ndarray) -> np.ndarray:
    """Per block (rows): counts scaled to frequencies summing to 4096, every present symbol at least
    1; the same integer steps as csrc/rans_encode.cpp's normalize()."""
    scale = 1 << SCALE_BITS
    f = np.where(counts > 0, np.maximum(counts * scale // n[:, None], 1), 0)
    top = counts.argmax(axis=1)  # the first of the most frequent
    diff = scale - f.sum(axis=1)
    rows = np.arange(len(f))
    up = diff >= 0
    f[rows[up], top[up]] += diff[up]
    for r in rows[~up]:  # rare symbols raised to 1 took more than the rounding left: take from the largest
        for _ in range(-int(diff[r])):
            big = top[r] if f[r, top[r]] == f[r].max() else int(f[r].argmax())
            f[r, big] -= 1
    return f


def _encode_numpy(src: np.ndarray) -> bytes:
    head = bytes([FORMAT, BLOCK_LOG])
    if src.size == 0:
        return head
    starts, ms, counts, f = _block_counts(src)
    k = starts.size
    cum = np.cumsum(f, axis=1) - f
    multi = (f > 0).sum(axis=1) > 1
    x = np.full((k, STATES), LOW, np.int64)
    emitted: list[tuple[np.ndarray, ...]] = []
    limit = (LOW >> SCALE_BITS) << 16
    for t in range(int(ms.max()) - 1, -1, -1):
        r = np.flatnonzero(multi & (ms > t))
        if not r.size:
            continue
        j = t % STATES
        sym = src[starts[r] + t].astype(np.int64)
        fs, cs = f[r, sym], cum[r, sym]
        v = x[r, j]
        emit = v >= limit * fs
        if emit.any():
            emitted.append((r[emit], np.full(int(emit.sum()), t), v[emit] & 0xFFFF))
            v = np.where(emit, v >> 16, v)
        x[r, j] = ((v // fs) << SCALE_BITS) + v % fs + cs
    if emitted:
        eb, et, ew = (np.concatenate(c) for c in zip(*emitted))
    else:
        eb = et = ew = np.zeros(0, np.int64)
    order = np.lexsort((et, et % STATES, eb))  # by block, then state, then the order the decoder reads
    eb, ej, ew = eb[order], et[order] % STATES, ew[order].astype("<u2")
    bounds = np.searchsorted(eb, np.arange(k + 1))
    out = [head]
    for b in range(k):
        present = np.flatnonzero(f[b])
        if not multi[b]:
            body = bytes([0, int(present[0])])
        else:
            table = np.zeros((present.size, 3), np.uint8)
            table[:, 0] = present
            table[:, 1:] = f[b, present].astype("<u2").view(np.uint8).reshape(-1, 2)
            lo, hi = bounds[b], bounds[b + 1]
            per_state = np.bincount(ej[lo:hi], minlength=STATES).astype("<u2")
            body = (bytes([present.size - 1]) + table.tobytes() + x[b].astype("<u4").tobytes()
                    + per_state.tobytes() + ew[lo:hi].tobytes())
        out.append(np.uint32(len(body)).astype("<u4").tobytes() + body)
    return b"".join(out)
