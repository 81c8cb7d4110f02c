"""Part of a chain decoded by the compiled core (ckpt_chain_decode_range, :func:`decode_chain_range`): only
the tiles that cover a byte range, every link at once, into that range of the chunk's place and
nowhere else. Its bytes are the whole decode's there; damage where the range needs nothing does not
stop it, and damage where it does is caught by the core or by the span digests; a rank's uneven
part of a delta chunk loads through it."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from test_chain_decode import SIZE, build, link_by_link

import ckpt
from ckpt import _ext
from ckpt.format import manifest as mf
from ckpt.format import spans
from ckpt.format.chain_core import decode_chain, decode_chain_range, decode_chain_ranges
from ckpt.format.chunk import HEADER_SIZE, Base, chunk_hash, parse_header, section_table
from ckpt.format.planes import RANS, ZSTD
from ckpt.load import chunk_reads
from ckpt.save.encode import CodecSpec, encode

pytestmark = pytest.mark.skipif(_ext.cpu() is None, reason="needs the compiled core")

MiB = 1 << 20


def parts_of(chain: list[tuple[str, bytes]]) -> list[tuple[str, str, bytes]]:
    return [(h, h, blob) for h, blob in chain]


def random_range(rng, size: int) -> tuple[int, int]:
    lo, hi = sorted(int(x) for x in rng.integers(0, size + 1, 2))
    return (lo, hi) if lo < hi else (0, size)


@pytest.mark.parametrize("count", range(1, 9))
def test_a_range_holds_the_whole_decodes_bytes_and_nothing_outside_it_is_written(count):
    """Every whole codec (planes, raw, zstd) and deltas of widths 1 to 8, rotated or not; span-aligned
    ranges and any others (a tile of widths 3 and 4 together is not a whole number of spans)."""
    rng = np.random.default_rng(count)
    for seed, zero in ((count, False), (count + 1, False), (count + 2, True)):
        chain = build(count, seed, zero)
        want = np.frombuffer(link_by_link(chain), np.uint8)
        for lo, hi in [(0, MiB), (MiB, SIZE), (0, SIZE)] + [random_range(rng, SIZE) for _ in range(4)]:
            out = np.full(SIZE, 0xA5, np.uint8)
            assert decode_chain_range(parts_of(chain), SIZE, out, lo, hi), (seed, lo, hi)
            assert (out[lo:hi] == want[lo:hi]).all(), (seed, lo, hi)
            assert (out[:lo] == 0xA5).all() and (out[hi:] == 0xA5).all(), (seed, lo, hi)
        # several ranges at once, perhaps sharing a tile (a zstd plane's reader starts again)
        a, b, c, d = sorted(int(x) for x in rng.integers(0, SIZE + 1, 4))
        ranges = [(lo, hi) for lo, hi in [(a, b), (c, d)] if lo < hi]
        assert_ranges(parts_of(chain), SIZE, ranges, want)


@pytest.mark.parametrize("count", range(2, 9))
def test_a_range_of_a_chain_with_zero_masked_links_holds_the_whole_decodes_bytes(count):
    """Links with a zero mask (a pruned layer, then scattered updates) amid links the core decodes: the
    core decodes up to one, its part is XORed in from its spans, and the core goes on. Ranges on whole
    elements (a reshard's) decode; one that cuts a masked link's element is refused, never wrong."""
    rng = np.random.default_rng(count)
    masked = 0
    for seed, zero in ((count, False), (count + 1, False), (count + 2, True), (count + 3, True)):
        chain = build(count, seed, zero, masks=True)
        if not any(parse_header(blob, name="x").masked for _, blob in chain):
            continue  # (a chunk stored raw or zstd whole, and deltas without a mask: the tests above)
        masked += 1
        want = np.frombuffer(link_by_link(chain), np.uint8)
        for lo, hi in [(0, MiB), (MiB, SIZE), (0, SIZE), (8 * 1001, 8 * 50_003)]:  # whole elements of every width
            out = np.full(SIZE, 0xA5, np.uint8)
            assert decode_chain_range(parts_of(chain), SIZE, out, lo, hi), (seed, lo, hi)
            assert (out[lo:hi] == want[lo:hi]).all(), (seed, lo, hi)
            assert (out[:lo] == 0xA5).all() and (out[hi:] == 0xA5).all(), (seed, lo, hi)
        for lo, hi in [random_range(rng, SIZE) for _ in range(4)]:
            out = np.full(SIZE, 0xA5, np.uint8)
            if decode_chain_range(parts_of(chain), SIZE, out, lo, hi):
                assert (out[lo:hi] == want[lo:hi]).all(), (seed, lo, hi)
        assert_ranges(parts_of(chain), SIZE, [(0, 8 * 4096), (8 * 8192, SIZE)], want)
    assert masked  # whole chunks with a mask first, and masked deltas after links without


def assert_ranges(parts, size: int, ranges: list[tuple[int, int]], want: np.ndarray) -> None:
    """The ranges decoded at once hold ``want``'s bytes there, and nothing outside them is written."""
    out = np.full(size, 0xA5, np.uint8)
    assert decode_chain_ranges(parts, size, out, ranges), ranges
    keep = np.ones(size, bool)
    for lo, hi in ranges:
        assert (out[lo:hi] == want[lo:hi]).all(), (lo, hi)
        keep[lo:hi] = False
    assert (out[keep] == 0xA5).all()

def test_ranges_outside_the_chunk_or_without_a_core_are_refused(monkeypatch):
    chain = build(3, 0)
    out = np.zeros(SIZE, np.uint8)
    for lo, hi in [(0, 0), (5, 4), (0, SIZE + 1), (-1, 10)]:
        assert not decode_chain_range(parts_of(chain), SIZE, out, lo, hi)
    assert not decode_chain_range(parts_of(chain), SIZE, out[:-1], 0, 10)  # no room for the chunk
    assert not out.any()
    monkeypatch.setenv("CKPT_NO_EXT", "1")
    assert not decode_chain_range(parts_of(chain), SIZE, out, 0, 10)


BIG = 4 * MiB + 5  # four spans and tail bytes


def dense_chain(links: int, seed: int = 0) -> tuple[np.ndarray, list[tuple[str, bytes]]]:
    """Trained-like floats, then versions with small changes to most of them (deltas with rANS and
    zstd planes), as the writer encodes them."""
    rng = np.random.default_rng(seed)
    data = np.concatenate([(rng.standard_normal(BIG // 4) * 0.02).astype(np.float32).view(np.uint8),
                           rng.integers(0, 256, BIG % 4, dtype=np.uint8)])
    chain = []
    prev = None
    for _ in range(links):
        base = None if prev is None else Base(memoryview(prev), chunk_hash(prev))
        _, parts = encode(memoryview(data), chunk_hash(data), CodecSpec.parse("auto"), width=4, rotate=True, base=base)
        chain.append((chunk_hash(data), b"".join(bytes(p) for p in parts)))
        prev = data
        f = data[:BIG // 4 * 4].view(np.float32).copy()
        f += (rng.standard_normal(f.size) * 1e-4).astype(np.float32) * f
        data = np.concatenate([f.view(np.uint8), data[BIG // 4 * 4:]])
    return prev, chain


def kinds(blob: bytes) -> list[int]:
    hdr = parse_header(blob, name="x")
    return [how for how, _, _ in section_table(hdr, memoryview(blob)[HEADER_SIZE:], name="x", expect_hash="x")]


def test_zstd_planes_are_decompressed_in_passes_that_fit_a_chunk_of_scratch():
    """Six links of zstd planes need more than a chunk of scratch for half of it: the links go in
    passes, each XORed over what the one before left."""
    want, chain = dense_chain(6)
    assert all(ZSTD in kinds(blob) for _, blob in chain[1:]), "the deltas have zstd planes"
    for lo, hi in [(0, BIG), (2 * MiB, BIG), (MiB, 3 * MiB), (3 * MiB, 4 * MiB)]:
        out = np.full(BIG, 0xA5, np.uint8)
        assert decode_chain_range(parts_of(chain), BIG, out, lo, hi)
        assert (out[lo:hi] == want[lo:hi]).all() and (out[:lo] == 0xA5).all() and (out[hi:] == 0xA5).all()


def last_block(blob: bytes) -> int:
    """Where in a stored object the last block of its first rANS plane ends (its bytes: the last
    elements' symbols)."""
    hdr = parse_header(blob, name="x")
    table = section_table(hdr, memoryview(blob)[HEADER_SIZE:], name="x", expect_hash="x")
    k = next(i for i, (how, _, _) in enumerate(table) if how == RANS and i < hdr.width)
    return HEADER_SIZE + 8 * len(table) + sum(len(s) for _, s, _ in table[:k]) + len(table[k][1])


def test_damage_where_a_range_needs_nothing_does_not_stop_it_and_damage_where_it_does_is_caught():
    want, chain = dense_chain(3, seed=1)
    digests = spans.digests(want)
    h, blob = chain[0]
    end = last_block(blob)
    hurt = bytearray(blob)
    hurt[end - 20] ^= 0x5A  # the last block of the whole chunk's exponent plane: its last elements
    bad = [(h, bytes(hurt))] + chain[1:]
    assert not decode_chain(parts_of(bad), BIG, np.empty(BIG, np.uint8))  # the whole chunk fails its name
    out = np.full(BIG, 0xA5, np.uint8)
    assert decode_chain_range(parts_of(bad), BIG, out, 0, 2 * MiB)  # the first half needs none of it
    assert (out[: 2 * MiB] == want[: 2 * MiB]).all() and (out[2 * MiB:] == 0xA5).all()
    out = np.zeros(BIG, np.uint8)
    lo = 4 * MiB - MiB
    ok = decode_chain_range(parts_of(bad), BIG, out, lo, BIG)
    assert not ok or spans.mismatch(out[lo:BIG], lo // MiB, digests) is not None
    # damage in the first block: the first span's range is refused by the core or by its digest
    first = HEADER_SIZE + 8 * (parse_header(blob, name="x").width + 1)
    for at in range(first + 2 + 40, first + 2 + 400, 37):
        hurt = bytearray(blob)
        hurt[at] ^= 0x21
        out = np.zeros(BIG, np.uint8)
        ok = decode_chain_range(parts_of([(h, bytes(hurt))] + chain[1:]), BIG, out, 0, MiB)
        assert not ok or spans.mismatch(out[:MiB], 0, digests) is not None, at


def save_chain(root, rows: int, cols: int, steps: int) -> dict[int, torch.Tensor]:
    """Sparse updates (30% of the elements move): deltas with zero masks."""
    g = torch.Generator().manual_seed(7)
    w = torch.randn(rows, cols, generator=g) * 0.02
    saved = {}
    with ckpt.Checkpointer(root, delta_budget=4.0, chunk_size=4 * MiB) as c:
        for s in range(1, steps + 1):
            w = w + (torch.rand(rows, cols, generator=g) < 0.3) * 1e-4
            saved[s] = w.clone()
            c.save(s, {"w": w}).wait()
    return saved


def test_uneven_parts_of_delta_chunks_load_through_the_range_decode(tmp_path, monkeypatch, caplog):
    """Uneven rows of a tensor: boundaries fall inside delta chunks, whose parts are decoded by the range
    decode (counted) and come out right, with no whole decode failing first (nothing logged)."""
    rows, cols = 3000, 1024  # 12 MiB of float32: three 4 MiB chunks
    saved = save_chain(tmp_path, rows, cols, 3)
    with ckpt.Checkpointer(tmp_path) as c:
        m = c.manifest(3)
    deltas = [h for h, info in m.chunks.items() if info.base is not None and h not in
              {x.base for x in m.chunks.values()}]
    assert deltas and all(len(mf.chain(m.chunks, h)) == 3 and m.chunks[h].spans is not None for h in deltas)
    assert {m.chunks[h].codec for h in deltas} == {"xor/3"}  # zero masks: the core decodes around them
    calls = []
    real = chunk_reads.decode_chain_ranges

    def counted(*a):
        calls.append(a[3])
        return real(*a)

    monkeypatch.setattr(chunk_reads, "decode_chain_ranges", counted)
    caplog.set_level(logging.WARNING, "ckpt")
    for r0, n in [(0, 600), (600, 900), (1500, 1500), (777, 5)]:
        local = torch.zeros(n, cols)
        with ckpt.Checkpointer(tmp_path) as c:
            c.load(3, {"w": ckpt.LocalShard(local, (r0, 0), (rows, cols))})
        assert torch.equal(local, saved[3][r0 : r0 + n]), (r0, n)
    assert len(calls) >= 5 and not caplog.text


def test_where_the_range_decode_fails_the_whole_chain_and_then_its_spans_are_decoded(tmp_path, monkeypatch, caplog):
    rows, cols = 3000, 1024
    saved = save_chain(tmp_path, rows, cols, 3)
    monkeypatch.setattr(chunk_reads, "decode_chain_ranges", lambda *a: False)
    local = torch.zeros(1000, cols)
    with ckpt.Checkpointer(tmp_path) as c:
        c.load(3, {"w": ckpt.LocalShard(local, (1000, 0), (rows, cols))})
    assert torch.equal(local, saved[3][1000:2000])


def test_the_core_refuses_a_range_it_cannot_decode_without_writing():
    """Ranges outside the chunk, a first link of no planes without its base, a stored plane that does
    not hold the elements the range's tiles need: error 4, nothing written."""
    core = _ext.cpu()
    n = 1 << 18
    data = np.arange(n, dtype=np.uint8)
    plane = [data[:n // 2].copy(), data[n // 2:].copy()]  # two planes of a width-2 chunk, stored as they are
    link = (plane, [False, False], np.zeros(1, np.uint8), False)
    out = np.full(n, 7, np.uint8)
    for lo, hi in [(0, 0), (10, 5), (0, n + 1)]:
        assert core.chain_decode_range([link], None, out, lo, hi) == 4
    assert core.chain_decode_range([([], [], np.zeros(1, np.uint8), False)], None, out, 0, 10) == 4
    short = ([plane[0][: n // 4], plane[1]], [False, False], np.zeros(1, np.uint8), False)
    assert core.chain_decode_range([short], None, out, n // 2, n) == 4  # its first half only
    assert core.chain_decode_range([short], None, out, n // 2, n, first=[[n // 4 + 8, 0]]) == 4  # starts too late
    assert (out == 7).all()
    part = ([plane[0][n // 8:], plane[1]], [False, False], np.zeros(1, np.uint8), False)
    assert core.chain_decode_range([part], None, out, n // 2, n, first=[[n // 8, 0]]) == 0  # holds what it needs
    assert (out[: n // 2] == 7).all() and (out[n // 2:] != 7).any()


def test_a_range_takes_no_more_scratch_than_a_chunk_however_many_links_of_zstd_planes(tmp_path):
    """Widths 3 and 16 make a tile (3 MiB) longer than the chunk, so every link of zstd planes needs all
    of its planes for any range: five of them took all five at once, five chunks of scratch per reading
    thread (a hostile chain of 256 links of 16 MiB tiles: 4 GiB). The links go in passes that fit a
    chunk, each XORed over the range the one before left, as the whole decode goes."""
    import threading

    from test_chain_fuzz import next_version, planes_link

    from ckpt.format.planes import STORED, ZSTD, _local

    rng = np.random.default_rng(0)
    size = 3 * MiB // 2 + 7
    data = rng.integers(0, 256, size, dtype=np.uint8)
    chain = [(chunk_hash(data), planes_link(data, None, 16, False, rng, STORED))]
    for w in (3, 16, 3, 16, 3):
        nxt = next_version(data, rng)
        chain.append((chunk_hash(nxt), planes_link(nxt, data, w, False, rng, ZSTD)))
        data = nxt
    assert sum(ZSTD in kinds(blob) for _, blob in chain[1:]) >= 3
    seen: dict[str, int] = {}
    out = np.full(size, 0xA5, np.uint8)

    def run() -> None:  # a thread of its own: its scratch holds only what this decode took
        seen["ok"] = decode_chain_range(parts_of(chain), size, out, MiB + 5, size)
        seen.update({k: v.size for k, v in _local.scratch.items()})

    t = threading.Thread(target=run)
    t.start()
    t.join()
    assert seen.pop("ok") and (out[MiB + 5:] == data[MiB + 5:]).all() and (out[:MiB + 5] == 0xA5).all()
    assert max(seen.values()) <= size, seen


class _Streams:
    """zstandard as chain_core uses it, counting the frames open at once (each holds a window of
    decompression state, as large as its plane)."""

    def __init__(self):
        import zstandard

        self.zstd, self.ZstdError, self.live, self.most = zstandard, zstandard.ZstdError, 0, 0

    def ZstdDecompressor(self):  # noqa: N802 (zstandard's name)
        streams, real = self, self.zstd.ZstdDecompressor()

        class Counted:
            def __init__(self, frame, **kw):
                self.s, self.closed = real.stream_reader(frame, **kw), False
                streams.live += 1
                streams.most = max(streams.most, streams.live)

            def readinto(self, b):
                return self.s.readinto(b)

            def close(self):
                if not self.closed:
                    self.closed = True
                    streams.live -= 1
                self.s.close()

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                self.close()

        return type("D", (), {"stream_reader": staticmethod(lambda frame, **kw: Counted(frame, **kw))})()


def test_a_range_keeps_one_zstd_frame_open_where_all_of_them_would_hold_more_than_a_chunk(monkeypatch):
    """Every zstd plane's frame was kept open to the end of the decode, each holding a window of
    decompression state up to its plane's length: 48 links of sparse deltas (four zstd planes each)
    of a 16 MiB chunk grew the reading thread by 160 MiB, against one chunk's scratch for the whole
    decode. Where the planes add up to more than the chunk, each frame is closed once its part is
    read; where they do not, they stay open for the next range."""
    from test_chain_fuzz import planes_link

    from ckpt.format import chain_core
    from ckpt.format.planes import STORED, ZSTD

    rng = np.random.default_rng(1)
    size = 2 * MiB + 3
    data = rng.integers(0, 256, size, dtype=np.uint8)
    chain = [(chunk_hash(data), planes_link(data, None, 4, False, rng, STORED))]
    for _ in range(6):
        nxt = data.copy()
        nxt[rng.integers(0, size, 500)] ^= 1
        chain.append((chunk_hash(nxt), planes_link(nxt, data, 4, False, rng, ZSTD)))
        data = nxt
    assert all(kinds(blob)[:4] == [ZSTD] * 4 for _, blob in chain[1:])
    streams = _Streams()
    monkeypatch.setattr(chain_core, "zstandard", streams)
    for ranges in ([(MiB + 5, size)], [(3, 100_000), (MiB, MiB + 7), (2 * MiB, size)]):
        assert_ranges(parts_of(chain), size, ranges, data)
        assert streams.most == 1 and streams.live == 0, streams.most
        streams.most = 0
    one = chain[:2]  # one link's planes: a chunk's length at most, kept open from range to range
    out = np.full(size, 0xA5, np.uint8)
    assert decode_chain_ranges(parts_of(one), size, out, [(5, MiB), (MiB + 9, size)])
    assert streams.most == 4 and streams.live == 0
