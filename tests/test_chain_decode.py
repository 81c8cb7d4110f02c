"""A delta chain decoded at once (the compiled core's ckpt_chain_decode: one pass over the chunk, every
link's part of a tile XORed in while it is in cache, only the result hashed) gives the bytes the link
by link decode gives, and a chain that does not check out is decoded link by link, whose error names
the damaged link."""

from __future__ import annotations

from unittest import mock

import numpy as np
import pytest

from ckpt import _ext
from ckpt.errors import CorruptCheckpointError
from ckpt.format import chains
from ckpt.format.chain_core import decode_chain
from ckpt.format.chunk import HEADER_SIZE, Base, chunk_hash, decode, parse_header
from ckpt.format.entries import ChunkInfo
from ckpt.format.paths import chunk_key
from ckpt.format.planes import LENGTH_MASK, RANS_FLAG, ZSTD_FLAG
from ckpt.save import encode as encoder
from ckpt.save.encode import CodecSpec, encode
from ckpt.storage import LocalStorage

needs_core = pytest.mark.skipif(_ext.cpu() is None, reason="needs the compiled core")

SIZE = (1 << 20) + 3  # several tiles of every width, and tail bytes past the last whole element


def whole(data: np.ndarray, codec: str, width: int, rotate: bool) -> bytes:
    name, parts = encode(memoryview(data), chunk_hash(data), CodecSpec.parse(codec), width=width, rotate=rotate)
    assert name == {"auto": "planes"}.get(codec, codec)
    return b"".join(bytes(p) for p in parts)


def delta(data: np.ndarray, prev: np.ndarray, width: int, rotate: bool) -> bytes:
    name, parts = encode(memoryview(data), chunk_hash(data), CodecSpec.parse("auto"), width=width, rotate=rotate,
                         base=Base(memoryview(prev), chunk_hash(prev)))
    assert name == "xor"
    return b"".join(bytes(p) for p in parts)


def step(prev: np.ndarray, rng: np.random.Generator, kind: str) -> np.ndarray:
    """The next version: small changes to the low bytes of many floats ("dense"), of a run of them
    only ("sparse": a delta of zero runs, whose planes zstd keeps best, and of tiles of zeros), of a
    tenth of them scattered ("scattered": a delta a zero mask keeps best), or the same bits flipped in
    every element ("mask": every plane of the delta one byte repeated)."""
    if kind == "scattered":
        out = prev.copy()
        f = out[:SIZE // 4 * 4].view(np.float32)
        at = rng.random(f.size) < 0.1
        f[at] = rng.standard_normal(int(at.sum())).astype(np.float32)
        return out
    if kind == "mask":
        out = prev.copy()
        out[:SIZE // 4 * 4].view(np.uint32)[:] ^= np.uint32(rng.integers(1, 1 << 23) | 0x10101)
        return out
    f = prev[:SIZE // 4 * 4].view(np.float32).copy()
    lo, hi = (rng.integers(0, f.size // 2), f.size) if kind == "dense" else sorted(rng.integers(0, f.size, 2))
    f[lo:hi] += rng.standard_normal(hi - lo).astype(np.float32) * 1e-5
    out = prev.copy()
    out[:f.size * 4] = f.view(np.uint8)
    return out


# (codec of the whole chunk, width, rotate) then per delta (width, rotate, sparse): widths and rotations
# differ per link, as auto chooses them per chunk
LINKS = [(4, True, "dense"), (2, False, "sparse"), (8, False, "mask"), (1, False, "sparse"), (4, False, "dense"),
         (3, False, "mask"), (2, True, "dense"), (4, True, "mask")]
WHOLE = [("auto", 4, True), ("raw", 1, False), ("zstd", 1, False), ("auto", 8, False)]


def build(count: int, seed: int, zero: bool = False, masks: bool = False) -> list[tuple[str, bytes]]:
    """A chain of ``count`` links, whole first: (hash, stored object) each. ``zero``: the first half of
    the first version is zero (tiles of the whole chunk whose planes are each one byte repeated).
    ``masks``: links that are mostly zero elements get a zero mask where it is smaller, as saves store
    them (such a link is XORed into place between the core's passes); without, every link is
    decoded by the core."""
    with mock.patch.object(encoder, "_MASK_ZEROS", encoder._MASK_ZEROS if masks else 2.0):
        return _build(count, seed, zero, masks)


def _build(count: int, seed: int, zero: bool, masks: bool) -> list[tuple[str, bytes]]:
    rng = np.random.default_rng(seed)
    data = np.concatenate([(rng.standard_normal(SIZE // 4) * 0.02).astype(np.float32).view(np.uint8),
                           rng.integers(0, 256, SIZE % 4, dtype=np.uint8)])
    if zero:
        data[:SIZE // 2] = 0
    if masks:  # a pruned layer: 90% of the floats zero, and sparse updates scattered over it
        data[:SIZE // 4 * 4].view(np.float32)[rng.random(SIZE // 4) < 0.9] = 0
    codec, w, rot = WHOLE[seed % len(WHOLE)]
    out = [(chunk_hash(data), whole(data, codec, w, rot))]
    for i in range(count - 1):
        w, rot, kind = LINKS[(i + seed) % len(LINKS)]
        nxt = step(data, rng, "scattered" if masks and kind == "sparse" else kind)
        out.append((chunk_hash(nxt), delta(nxt, data, w, rot)))
        data = nxt
    return out


def link_by_link(chain: list[tuple[str, bytes]]) -> bytes:
    raw = None
    prev = None
    for h, blob in chain:
        raw = decode(blob, name=h, expect_hash=h, base=None if prev is None else Base(raw, prev))
        prev = h
    return bytes(raw)


def section_kinds(blob: bytes) -> set[str]:
    hdr = parse_header(blob, name="x")
    if hdr.codec not in ("planes", "xor"):
        return {hdr.codec}
    table = np.frombuffer(blob[HEADER_SIZE:HEADER_SIZE + 8 * (hdr.width + 1)], "<u8")
    return {"zstd" if e & ZSTD_FLAG else "rans" if e & RANS_FLAG else "stored" if e & LENGTH_MASK else "empty"
            for e in table.tolist()}


@needs_core
@pytest.mark.parametrize("masks", [False, True], ids=["core", "masks"])
@pytest.mark.parametrize("count", range(1, 9))
def test_a_chain_decoded_at_once_gives_the_link_by_link_bytes(count, masks):
    for seed, zero in ((count, False), (count + 1, False), (count + 2, True)):
        chain = build(count, seed, zero, masks)
        want = link_by_link(chain)
        guard = np.full(SIZE + 64, 0xA5, np.uint8)
        out = guard[32:32 + SIZE]
        assert decode_chain([(h, h, blob) for h, blob in chain], SIZE, out)
        assert out.tobytes() == want
        assert (guard[:32] == 0xA5).all() and (guard[-32:] == 0xA5).all()


def test_the_chains_cover_every_kind_of_link_and_section():
    """The chains above hold every whole codec, rANS, zstd and stored sections, and several widths;
    with masks, zero-masked links both whole and as deltas, amid links the core decodes."""
    kinds, widths = set(), set()
    masked = {"planes": 0, "xor": 0, "other": 0}
    for count in (4, 8):
        for seed in range(len(WHOLE)):
            for _, blob in build(count, seed):
                kinds |= section_kinds(blob)
                widths.add((parse_header(blob, name="x").width, parse_header(blob, name="x").rot))
                assert not parse_header(blob, name="x").masked
            for _, blob in build(count, seed, seed % 2 == 0, masks=True):
                hdr = parse_header(blob, name="x")
                masked[hdr.codec if hdr.masked else "other"] += 1
    assert {"raw", "zstd", "rans", "stored"} <= kinds and "zstd" in kinds
    assert len(widths) >= 5
    assert min(masked.values()) > 0, masked


def stored(tmp_path, chain: list[tuple[str, bytes]]) -> tuple[LocalStorage, dict[str, ChunkInfo]]:
    storage = LocalStorage(tmp_path)
    table: dict[str, ChunkInfo] = {}
    prev = None
    for h, blob in chain:
        storage.write(chunk_key(h), [blob])
        table[h] = ChunkInfo(SIZE, len(blob), parse_header(blob, name=h).label, prev)
        prev = h
    return storage, table


def test_resolve_decodes_a_chain_with_or_without_the_core(tmp_path, monkeypatch):
    chain = build(6, 3)
    storage, table = stored(tmp_path, chain)
    want = link_by_link(chain)
    raw, read = chains.resolve(storage, table, chain[-1][0])
    assert bytes(raw) == want and read == sum(len(b) for _, b in chain)
    out = np.zeros(SIZE, np.uint8)
    chains.resolve(storage, table, chain[-1][0], out=out)
    assert out.tobytes() == want
    monkeypatch.setattr(_ext, "cpu", lambda: None)  # as under CKPT_NO_EXT=1: link by link in numpy
    assert bytes(chains.resolve(storage, table, chain[-1][0])[0]) == want


@needs_core
@pytest.mark.parametrize("where", ["header", "table", "middle", "end"])
def test_a_damaged_link_anywhere_is_refused_naming_it(tmp_path, where):
    chain = build(5, 1)
    for victim in range(len(chain)):
        h, blob = chain[victim]
        hdr = parse_header(blob, name=h)
        damaged = bytearray(blob)
        at = {"header": 20, "table": HEADER_SIZE + 3, "middle": HEADER_SIZE + hdr.payload_len // 2,
              "end": len(blob) - 5}[where]
        damaged[at] ^= 0x10
        bad = chain[:victim] + [(h, bytes(damaged))] + chain[victim + 1:]
        assert not decode_chain([(x, x, b) for x, b in bad], SIZE, np.empty(SIZE, np.uint8))
        storage, table = stored(tmp_path / f"{where}{victim}", chain)
        storage.write(chunk_key(h), [bytes(damaged)])
        with pytest.raises(CorruptCheckpointError) as e:
            chains.resolve(storage, table, chain[-1][0])
        assert h in str(e.value), (victim, str(e.value))


@needs_core
def test_hostile_sections_stay_in_bounds():
    """Bytes flipped all over every link's sections: the decode refuses or gives other bytes (the hash
    tells), and writes nothing outside the chunk."""
    chain = build(4, 2)
    rng = np.random.default_rng(7)
    for _ in range(60):
        victim = int(rng.integers(0, len(chain)))
        h, blob = chain[victim]
        damaged = bytearray(blob)
        for at in rng.integers(HEADER_SIZE, len(blob), int(rng.integers(1, 40))):
            damaged[at] = int(rng.integers(0, 256))
        bad = chain[:victim] + [(h, bytes(damaged))] + chain[victim + 1:]
        guard = np.full(SIZE + 64, 0x5A, np.uint8)
        assert not decode_chain([(x, x, b) for x, b in bad], SIZE, guard[32:32 + SIZE]) or bytes(damaged) == blob
        assert (guard[:32] == 0x5A).all() and (guard[-32:] == 0x5A).all()


@needs_core
def test_widths_too_varied_to_tile_together_are_decoded_link_by_link(tmp_path):
    """Widths 16, 7, 5 and 3 have no common tile small enough: ckpt_chain_decode says 5 before it
    touches anything, and resolve goes link by link and still gives the chunk."""
    from test_chain_fuzz import planes_link

    from ckpt.format.planes import RANS

    rng = np.random.default_rng(5)
    data = (rng.standard_normal(SIZE // 4) * 0.02).astype(np.float32).view(np.uint8)
    data = np.concatenate([data, np.zeros(SIZE - data.size, np.uint8)])
    chain = [(chunk_hash(data), whole(data, "auto", 16, False))]
    for w in (7, 5, 3):
        nxt = step(data, rng, "dense")
        chain.append((chunk_hash(nxt), planes_link(nxt, data, w, False, rng, keep=RANS)))
        data = nxt
    assert all(section_kinds(b) <= {"rans", "stored", "empty"} for _, b in chain)  # all in one pass: no scratch
    out = np.full(SIZE, 9, np.uint8)
    links = [([np.zeros(SIZE // w, np.uint8)] * w, [False] * w, np.zeros(16, np.uint8), False) for w in (16, 7, 5, 3)]
    assert _ext.cpu().chain_decode(links, out) == (5, None) and (out == 9).all()
    assert not decode_chain([(h, h, b) for h, b in chain], SIZE, out)
    storage, table = stored(tmp_path, chain)
    assert bytes(chains.resolve(storage, table, chain[-1][0])[0]) == link_by_link(chain)


@needs_core
def test_a_raw_base_whose_payload_is_short_is_not_read_past(tmp_path):
    """A whole link stored raw with a header that agrees with a payload shorter than the chunk: the
    chain is refused (the core is never handed a plane shorter than its elements)."""
    import struct

    chain = build(3, 1)
    assert parse_header(chain[0][1], name="x").codec == "raw"
    h, blob = chain[0]
    head = bytearray(blob[:HEADER_SIZE])
    struct.pack_into("<Q", head, 56, len(blob) - HEADER_SIZE - 4096)
    short = bytes(head) + blob[HEADER_SIZE:-4096]
    bad = [(h, short)] + chain[1:]
    assert not decode_chain([(x, x, b) for x, b in bad], SIZE, np.empty(SIZE, np.uint8))
    storage, table = stored(tmp_path, chain)
    storage.write(chunk_key(h), [short])
    with pytest.raises(CorruptCheckpointError):
        chains.resolve(storage, table, chain[-1][0])


@needs_core
@pytest.mark.parametrize("w,rot", [(1, False), (2, True), (3, False), (4, True), (5, False), (8, False), (8, True)])
def test_planes_each_one_byte_repeated_decode_as_one_element_repeated(w, rot):
    """Tiles whose rANS planes are each one symbol (a frozen tensor's delta, a fixed bit flip) are
    written as one element repeated, over nothing (the chunk stored whole) or XORed over the links
    before it, with or without tail bytes, whole 8-byte words or not."""
    from ckpt.format.planes import group

    core = _ext.cpu()
    rng = np.random.default_rng(w)
    for n, zero in ((w * 300_001, False), (w * 300_001 + w - 1, False), (w * 7, False), (w * 300_001, True)):
        elem = np.zeros(w, np.uint8) if zero else rng.integers(0, 256, w, dtype=np.uint8)
        x = np.resize(elem, n)
        x[n // w * w:] = rng.integers(0, 256, n % w, dtype=np.uint8)
        g = group(x, None, w, None, rot)
        m = n // w
        planes = [np.frombuffer(core.rans_encode(g[p * m:(p + 1) * m]), np.uint8) for p in range(w)]
        link = (planes, [True] * w, g[m * w:], rot)
        base = rng.integers(0, 256, n, dtype=np.uint8)
        for links, want in (([link], x), ([([base], [False], np.zeros(1, np.uint8), False), link], base ^ x),
                            ([([base], [False], np.zeros(1, np.uint8), False), link, link], base)):
            out = np.full(n, 7, np.uint8)
            err, digest = core.chain_decode(links, out)
            assert err == 0 and out.tobytes() == want.tobytes()
            assert digest == (chunk_hash(want) if n > 240 else None)


def _tail_recoded(blob: bytes, coded: bytes) -> bytes:
    """``blob`` (a delta) with its tail section replaced by the rANS section ``coded`` (as no writer
    stores it, but the format allows, and the link by link decode reads), its checks made to agree."""
    import struct

    from ckpt.format.chunk import xor_check

    hdr = parse_header(blob, name="x")
    w = hdr.width
    table = np.frombuffer(blob[HEADER_SIZE:HEADER_SIZE + 8 * (w + 1)], "<u8").copy()
    tail_len = int(table[w] & LENGTH_MASK)
    table[w] = RANS_FLAG | len(coded)
    payload = table.tobytes() + blob[HEADER_SIZE + 8 * (w + 1):len(blob) - tail_len] + coded
    head = bytearray(blob[:HEADER_SIZE])
    struct.pack_into("<HBBI", head, 8, 2, head[10], head[11], 0)
    struct.pack_into("<Q", head, 56, len(payload))
    struct.pack_into("<I", head, 12, xor_check(bytes(head), [payload]))
    return bytes(head) + payload


@needs_core
def test_a_rans_coded_tail_is_decoded_not_read_as_tail_bytes(tmp_path):
    """A delta whose tail section is rANS-coded: decoded like the link by link decode does, not handed
    to the core as the tail bytes themselves (which read past the object where the section is shorter
    than the tail: here an empty one, whose missing bytes lay past the end of the stored object)."""
    chain = build(3, 1)
    h, blob = chain[1]
    hdr = parse_header(blob, name=h)
    assert hdr.width == 2 and SIZE % 2 == 1
    tail = np.frombuffer(blob[-1:], np.uint8)
    assert tail[0] == 0  # the tail byte is unchanged between versions: an empty read past the end gives it too
    good = _tail_recoded(blob, _ext.cpu().rans_encode(tail))
    out = np.empty(SIZE, np.uint8)
    assert decode_chain([(x, x, b) for x, b in [chain[0], (h, good), chain[2]]], SIZE, out)
    assert out.tobytes() == link_by_link(chain)
    empty = _tail_recoded(blob, b"")
    assert not decode_chain([(x, x, b) for x, b in [chain[0], (h, empty), chain[2]]], SIZE, out)
    storage, table = stored(tmp_path, chain)
    storage.write(chunk_key(h), [empty])
    with pytest.raises(CorruptCheckpointError, match=f"{h}.*rANS"):
        chains.resolve(storage, table, chain[-1][0])


@needs_core
def test_damage_in_a_pass_before_a_masked_link_is_refused_though_that_pass_is_not_hashed(tmp_path):
    """The links before a masked one are decoded in a pass of their own, not hashed (only the result is):
    a damaged link in that pass (a rANS tail that would read past its object) is refused as it is
    without the masked link after it, by the one-pass decode and link by link, naming the link."""
    chain = build(3, 1)
    h, blob = chain[1]
    last = np.frombuffer(link_by_link(chain), np.uint8)
    nxt = last.copy()
    nxt[::4096] ^= 1  # a sparse update: its delta keeps a zero mask
    masked = encode(memoryview(nxt), chunk_hash(nxt), CodecSpec.parse("auto"), width=4, rotate=True,
                    base=Base(memoryview(last), chain[2][0]))[1]
    masked_blob = b"".join(bytes(p) for p in masked)
    assert parse_header(masked_blob, name="x").masked
    whole_chain = chain + [(chunk_hash(nxt), masked_blob)]
    out = np.empty(SIZE, np.uint8)
    assert decode_chain([(x, x, b) for x, b in whole_chain], SIZE, out) and out.tobytes() == nxt.tobytes()
    empty = _tail_recoded(blob, b"")
    bad = [chain[0], (h, empty), chain[2], whole_chain[3]]
    assert not decode_chain([(x, x, b) for x, b in bad], SIZE, out)
    storage, table = stored(tmp_path, whole_chain)
    storage.write(chunk_key(h), [empty])
    with pytest.raises(CorruptCheckpointError, match=f"{h}.*rANS"):
        chains.resolve(storage, table, whole_chain[-1][0])


@needs_core
@pytest.mark.parametrize("at", [12, 15, 8])
def test_a_delta_whose_payload_check_fails_is_refused_as_link_by_link(tmp_path, at):
    """Damage the decode never reads (the payload check field itself; the format version of a link
    with no rANS section) still fails that link's payload check: the chain is refused, naming it, as
    the link by link decode refuses it, not decoded to the right bytes regardless."""
    chain = build(4, 1)
    victim = next(i for i, (_, b) in enumerate(chain) if i and parse_header(b, name="x").version == 1)
    h, blob = chain[victim]
    damaged = bytearray(blob)
    damaged[at] ^= 1
    bad = chain[:victim] + [(h, bytes(damaged))] + chain[victim + 1:]
    assert not decode_chain([(x, x, b) for x, b in bad], SIZE, np.empty(SIZE, np.uint8))
    storage, table = stored(tmp_path, chain)
    storage.write(chunk_key(h), [bytes(damaged)])
    with pytest.raises(CorruptCheckpointError, match=f"{h} failed its payload check"):
        chains.resolve(storage, table, chain[-1][0])


@needs_core
def test_a_chain_of_zstd_deltas_takes_about_one_chunk_of_scratch(tmp_path):
    """Sparse updates make deltas whose planes are all zstd frames, decompressed into scratch before
    the core runs: the chain is decoded in as many passes as it takes to hold at most one chunk of
    them at a time (all at once, a chain of K such links held K - 1 chunks per reading thread until
    the next trim, 63 at the longest delta_chain), and gives the link by link bytes still."""
    import tracemalloc

    from ckpt.format.planes import trim_scratch

    rng = np.random.default_rng(11)
    data = (rng.standard_normal(SIZE // 4) * 0.02).astype(np.float32).view(np.uint8)
    data = np.concatenate([data, rng.integers(0, 256, SIZE % 4, dtype=np.uint8)])
    chain = [(chunk_hash(data), whole(data, "auto", 4, True))]
    with mock.patch.object(encoder, "_MASK_ZEROS", 2.0):  # deltas of planes only (a mask would be XORed in place)
        for _ in range(7):
            nxt = data.copy()
            nxt[rng.integers(0, SIZE, 64)] ^= 1  # a few bytes changed: every plane of the delta a zstd frame
            chain.append((chunk_hash(nxt), delta(nxt, data, 4, False)))
            data = nxt
    assert not any(parse_header(b, name="x").masked for _, b in chain)
    assert all(section_kinds(b) <= {"zstd", "stored", "empty"} for _, b in chain[1:])
    parts = [(h, h, b) for h, b in chain]
    out = np.empty(SIZE, np.uint8)
    trim_scratch()
    tracemalloc.start()
    try:
        assert decode_chain(parts, SIZE, out)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
        trim_scratch()
    assert out.tobytes() == link_by_link(chain)
    assert peak < 1.5 * SIZE, peak / SIZE
