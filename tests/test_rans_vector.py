"""The rANS decoders (csrc/rans.cpp: scalar, AVX2, AVX-512; ckpt/format/rans.py: numpy) on sections
whose frequency tables ckpt's encoder never writes but the format allows: coded blocks of fewer
symbols than states, symbols with a frequency that never occur, one symbol at 4095 of 4096 with
the other occurring throughout (the most words a state can take), all 256 symbols. Other writers
(or a future encoder) may write these; every decoder must give the same bytes and verdicts."""

from __future__ import annotations

import numpy as np
import pytest

from ckpt import _ext
from ckpt.format import rans

pytestmark = pytest.mark.skipif(_ext.cpu() is None, reason="compiled core not built")


def _table(kind: str):
    """A stand-in for rans._normalize: per block, frequencies of the kind named, summing to 4096."""
    def norm(counts: np.ndarray, n: np.ndarray) -> np.ndarray:
        f = np.zeros(counts.shape, np.int64)
        for r, row in enumerate(counts):
            present = np.flatnonzero(row)
            if kind == "unused symbols":  # every occurring symbol plus 0 and 255, which never occur
                syms = np.union1d(present, [0, 255])
                f[r, syms] = 1
                f[r, present[0]] += 4096 - syms.size
            elif kind == "rare symbol everywhere":  # the symbol that occurs most gets a frequency of 1
                syms = np.union1d(present, [0, 255])
                f[r, syms] = 1
                f[r, syms[syms != row.argmax()][0]] += 4096 - syms.size
            else:  # "every symbol": 16 each
                f[r] = 16
        return f
    return norm


def _encode(a: np.ndarray, block_log: int, kind: str, monkeypatch) -> bytes:
    monkeypatch.setattr(rans, "BLOCK_LOG", block_log)
    monkeypatch.setattr(rans, "_normalize", _table(kind))
    try:
        return rans._encode_numpy(a)
    finally:
        monkeypatch.undo()


def _decodes(core, sec: bytes, n: int) -> list:
    """(refused, bytes) from every compiled level and numpy's decoder."""
    got = []
    for simd in (2, 1, 0):
        out = np.full(n + 64, 0xA5, np.uint8)
        rc = core.rans_decode(sec, out[:n], simd)
        assert (out[n:] == 0xA5).all(), simd
        got.append((rc != 0, None if rc else out[:n].tobytes()))
    out = np.empty(n, np.uint8)
    try:
        rans._decode_numpy(np.frombuffer(sec, np.uint8), out)
        got.append((False, out.tobytes()))
    except rans.RansError:
        got.append((True, None))
    return got


@pytest.mark.parametrize("kind", ["unused symbols", "rare symbol everywhere", "every symbol"])
@pytest.mark.parametrize("block_log", [8, 16])
def test_tables_the_encoder_never_writes_decode_alike(monkeypatch, kind, block_log):
    core = _ext.cpu()
    rng = np.random.default_rng(block_log)
    block = 1 << block_log
    sizes = [1, 5, 7, 9, 33, block + 7] + ([3 * block + 40] if block_log == 8 else [])  # coded blocks of 1 to 7 symbols
    for n in sizes:
        a = np.where(rng.random(n) < 0.1, 255, 200).astype(np.uint8) if kind != "every symbol" else \
            rng.integers(0, 256, n, dtype=np.uint8)
        sec = _encode(a, block_log, kind, monkeypatch)
        assert sec[6] > 0  # the first block is coded, not one symbol repeated
        assert _decodes(core, sec, n) == [(False, a.tobytes())] * 4, (kind, n)
        for _ in range(4):  # damaged: all refuse, or all give the same bytes
            bad = bytearray(sec)
            bad[int(rng.integers(2, len(bad)))] ^= 1 << int(rng.integers(0, 8))
            got = _decodes(core, bytes(bad), n)
            assert got[1:] == got[:-1], (kind, n)
