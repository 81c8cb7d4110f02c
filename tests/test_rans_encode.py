"""The rANS encoders write the same bytes: the vector ones (AVX-512, AVX2: those the CPU has), the
compiled scalar one and numpy's, on every shape of block the coder meets. What a save stores, and
so what dedups against earlier saves, must not depend on the machine that wrote it."""

from __future__ import annotations

import numpy as np
import pytest

from ckpt import _ext
from ckpt.format import rans

core = _ext.cpu()
pytestmark = pytest.mark.skipif(core is None, reason="compiled core not built")
BLOCK = 1 << rans.BLOCK_LOG


def _sections(a: np.ndarray) -> list[bytes]:
    """The section of ``a`` from every compiled level (2: AVX-512, 1: AVX2, 0: scalar; a level the
    CPU lacks runs the best one it has)."""
    return [core.rans_encode(a, simd) for simd in (2, 1, 0)]


def _same_everywhere(a: np.ndarray, name: str, numpy_too: bool = True) -> bytes:
    secs = _sections(a)
    assert secs[0] == secs[1] == secs[2], name
    if numpy_too:
        assert rans._encode_numpy(a) == secs[0], name
    out = np.empty_like(a)
    rans.decode_into(secs[0], out)
    assert np.array_equal(out, a), name
    return secs[0]


def _cases() -> list[tuple[str, np.ndarray]]:
    rng = np.random.default_rng(21)
    exps = (126 - np.abs(rng.normal(0, 3, 9 * BLOCK + 1005)).astype(np.int64)).astype(np.uint8)
    two = np.where(rng.random(3 * BLOCK + 11) < 0.3, 17, 250).astype(np.uint8)
    lone = np.zeros(BLOCK, np.uint8)
    lone[5000] = 1  # frequencies 4095 and 1
    # blocks of one byte but the last (where the check for a block of one symbol stops), and of one
    # byte throughout but a short last block with another
    last = np.concatenate([np.full(BLOCK - 1, 4, np.uint8), [5], np.full(BLOCK, 4, np.uint8), np.full(100, 4, np.uint8),
                           [4, 4, 9]]).astype(np.uint8)
    rare = np.concatenate([np.zeros(16_000, np.uint8), np.arange(200, dtype=np.uint8), np.full(184, 9, np.uint8)])
    # two common symbols of equal count and 254 seen once: the frequencies raised to 1 are taken back
    # from the two in turn
    tied = np.concatenate([np.full(8065, 3, np.uint8), np.full(8065, 200, np.uint8),
                           np.setdiff1d(np.arange(256), [3, 200]).astype(np.uint8)])
    uneven = tied.copy()
    uneven[:40] = 200  # 8025 against 8105
    # a block per distribution: a random number of symbols with random weights, many frequencies
    mixed = np.concatenate([rng.choice(256, BLOCK, p=rng.dirichlet(np.full(256, a)) if a else None).astype(np.uint8)
                            for a in (0.01, 0.05, 0.2, 1.0, 5.0, 0)] + [np.full(BLOCK, 9, np.uint8), exps[:777]])
    return [("exponents", exps), ("uniform", rng.integers(0, 256, 5 * BLOCK + 3, dtype=np.uint8)),
            ("skewed", np.where(rng.random(70_000) < 0.0005, 200, 3).astype(np.uint8)),
            ("single", np.full(3 * BLOCK + 5, 7, np.uint8)), ("two symbols", two), ("4095 and 1", lone),
            ("one byte but the last", last),
            ("rare symbols", rare), ("tied", rng.permutation(tied)), ("uneven", rng.permutation(uneven)),
            ("mixed blocks", mixed), ("four whole blocks", exps[:4 * BLOCK]), ("five whole blocks", exps[:5 * BLOCK])]


@pytest.mark.parametrize("name,a", _cases(), ids=[c[0] for c in _cases()])
def test_the_vector_rans_encoders_write_the_scalar_and_numpy_bytes(name, a):
    """Exponent-like, uniform, skewed, one-, two-symbol blocks, a block of frequencies 4095 and 1,
    blocks whose rare symbols take frequency back from the common ones, a block per distribution,
    whole groups of blocks and a short last one."""
    _same_everywhere(a, name)


def test_every_length_up_to_a_block_and_one_encodes_alike():
    """Lengths 0 to 16385 (every tail of 0 to 7 symbols, every round count) at every level; numpy's
    too on the short ones and those around a block's end."""
    rng = np.random.default_rng(22)
    a = (126 - np.abs(rng.normal(0, 3, BLOCK + 1)).astype(np.int64)).astype(np.uint8)
    for n in range(BLOCK + 2):
        secs = _sections(a[:n])
        assert secs[0] == secs[1] == secs[2], n
        if n < 80 or n > BLOCK - 10 or n % 4099 == 0:
            assert rans._encode_numpy(a[:n]) == secs[0], n


def test_many_sections_of_random_distributions_encode_alike():
    """Random lengths (a few blocks and a short one) of random distributions, compiled levels
    against each other; a state's every frequency and divisor range comes by."""
    rng = np.random.default_rng(23)
    for k in range(60):
        n = int(rng.integers(1, 6 * BLOCK))
        p = rng.dirichlet(np.full(256, float(rng.choice([0.01, 0.1, 1.0, 10.0]))))
        a = rng.choice(256, n, p=p).astype(np.uint8)
        _same_everywhere(a, f"section {k}", numpy_too=k < 6)


def test_the_vector_encoders_reciprocal_divides_exactly_for_every_frequency():
    """csrc/rans_encode.cpp recip33's claim, for every frequency 1..4096: with l = ceil(log2 f) and
    m' = ceil(2^(32+l) / f) - 2^32, ((v * m' >> 32) + v) >> l == v // f for every v below 2^20 * f
    (the condition its comment derives, exact, and the values nearest to failing it)."""
    for f in range(1, 4097):
        shift = (f - 1).bit_length()
        m = -(-(1 << (32 + shift)) // f)
        mp = m - (1 << 32)
        assert 0 <= mp < 1 << 32, f
        assert (f * 2**20 - 1) * (m * f - (1 << (32 + shift))) < 1 << (32 + shift), f  # iff exact for all such v
        for v in (f * 2**20 - 1, f * 2**20 - f, f * 2**19 - 1, 1 << 16, 16 * f, f - 1, 0):
            assert (((v * mp) >> 32) + v) >> shift == v // f, (f, v)


def test_a_level_above_the_cpus_runs_the_best_it_has():
    """simd beyond what the CPU has (or below 0) is clamped, never refused: the bytes are the same."""
    a = np.random.default_rng(24).integers(0, 40, 3 * BLOCK, dtype=np.uint8)
    assert core.rans_encode(a, 7) == core.rans_encode(a, -1) == core.rans_encode(a, core.rans_simd)


@pytest.mark.parametrize("name,a", _cases(), ids=[c[0] for c in _cases()])
def test_the_size_estimate_is_the_same_everywhere_and_close_to_the_section(name, a):
    """``auto``'s trials compare rANS sizes estimated from counts: the compiled core and numpy give the
    same number (a choice made from it must not depend on the machine), within 1% and 8 bytes a block
    of the section's length, and a section of one-symbol blocks only is recognised from either."""
    est = core.rans_estimate(a, rans._cost())
    assert est == rans._estimate_numpy(a), name
    real = len(core.rans_encode(a))
    blocks = -(-a.size // BLOCK)
    assert abs(est - real) <= 0.01 * real + 8 * blocks, (name, est, real)
    assert rans.repeats(est, a.size) == rans.repeats(core.rans_encode(a), a.size), name


def test_the_cost_table_is_the_information_of_each_frequency():
    """-log2(f / 4096) in 1/65536 bits, from log2 f rounded down (integers only): exact at powers of
    two, within one unit of the real value elsewhere, decreasing in f."""
    import math

    cost = rans._cost()
    assert cost[1] == 12 << 16 and cost[2048] == 1 << 16 and cost[4096] == 0
    assert all(cost[f] > cost[f + 1] for f in range(1, 4096))
    for f in range(1, 4097):
        assert 0 <= int(cost[f]) - (12 - math.log2(f)) * 65536 < 1 + 1e-6, f
