"""Zero masks (chunk format v3): a mostly-zero chunk stores one bit per element and its nonzero elements'
planes. The compiled core and numpy write the same bytes, every decode path gives the chunk back, and a
damaged mask or count is refused, never read past."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import ckpt
from ckpt import _ext
from ckpt.errors import CorruptCheckpointError
from ckpt.format import mask
from ckpt.format.chunk import HEADER_SIZE, Base, chunk_hash, decode, parse_header, section_table, unpack_section
from ckpt.save.encode import CodecSpec, encode

core = _ext.cpu()
needs_core = pytest.mark.skipif(core is None, reason="compiled core not built (no C++ compiler, or CKPT_NO_EXT)")


def sparse(n: int, width: int, seed: int, share: float = 0.9) -> np.ndarray:
    """``n`` bytes of ``width``-byte elements, ``share`` of them zero, the rest random bytes (some with a
    zero byte, none all zero), and n mod width tail bytes."""
    rng = np.random.default_rng(seed)
    out = rng.integers(0, 256, n, dtype=np.uint8)
    m = n // width
    words = out[: m * width].reshape(m, width)
    words[:, 0] |= 1  # no kept element is zero by chance
    words[rng.random(m) < share] = 0
    return out


@needs_core
@pytest.mark.parametrize("width", [2, 4, 8])
@pytest.mark.parametrize("n", [0, 5, 64, 8 * 8 * 3 + 5, 100_003 * 8])
@pytest.mark.parametrize("share", [0.0, 0.5, 0.9, 0.999, 1.0])
def test_compiled_masks_write_the_numpy_bytes_and_invert(monkeypatch, width, n, share):
    """Every share of zeros: the core's shuffles place eight or 64 elements at once where enough kept
    ones follow, one at a time near the end, and fill runs of zeros (0.999: runs of hundreds of mask
    bytes, found 32 bytes at a time, between kept elements)."""
    raw = sparse(n, width, n + width, share)
    base = sparse(n, width, n + width + 1, 0.5)
    base[: n // 2] = raw[: n // 2]  # half unchanged: zero elements of the delta there
    m = n // width
    body, b = raw[: m * width], base[: m * width]
    for under in (None, b):
        got = []
        for native in (True, False):
            if not native:
                monkeypatch.setattr(_ext, "cpu", lambda: None)
            bits, kept = np.empty(mask.mask_bytes(m), np.uint8), np.empty(m * width, np.uint8)
            k = mask.compact(body, under, width, bits, kept)
            got.append((k, bits.tobytes(), kept[: k * width].tobytes()))
            for into in ("fresh", "in place"):
                out = np.full(m * width, 0xA5, np.uint8) if into == "fresh" or under is None else under.copy()
                over = out if into == "in place" and under is not None else under
                assert mask.expand(bits, kept, k, width, over, out)
                assert np.array_equal(out, body), (native, into)
            monkeypatch.undo()
        assert got[0] == got[1]
        want = body.reshape(m, width) if under is None else (body ^ under).reshape(m, width)
        assert got[0][0] == int(want.any(axis=1).sum())


@pytest.mark.parametrize("native", [True, False])
def test_a_mask_that_does_not_keep_its_count_is_refused(monkeypatch, native):
    if native and core is None:
        pytest.skip("compiled core not built")
    if not native:
        monkeypatch.setattr(_ext, "cpu", lambda: None)
    width, m = 4, 61  # the last mask byte has three bits past the end
    raw = sparse(m * width, width, 1, 0.5)
    bits, kept = np.empty(mask.mask_bytes(m), np.uint8), np.empty(m * width, np.uint8)
    k = mask.compact(raw, None, width, bits, kept)
    out = np.empty(m * width, np.uint8)
    assert mask.expand(bits, kept[: k * width], k, width, None, out) and np.array_equal(out, raw)
    assert not mask.expand(bits, kept[: (k - 1) * width], k - 1, width, None, out)  # keeps more than given
    assert not mask.expand(bits, kept, k + 1, width, None, out)  # keeps fewer than its count
    past = bits.copy()
    past[-1] |= 0x80  # a bit past the last element
    assert not mask.expand(past, kept, k + 1, width, None, out)
    assert not mask.expand(bits[:-1], kept, k, width, None, out)  # a mask too short for the elements


def masked_chunk(data: np.ndarray, width: int, base: np.ndarray | None = None) -> tuple[bytes, str]:
    h = chunk_hash(data)
    b = None if base is None else Base(memoryview(base), chunk_hash(base))
    name, parts = encode(memoryview(data), h, CodecSpec(), width=width, rotate=width in (2, 4), base=b)
    blob = b"".join(bytes(p) for p in parts)
    hdr = parse_header(blob, name="x")
    assert hdr.masked and hdr.label == f"{name}/3", (name, hdr)
    return blob, h


def test_masked_chunks_and_deltas_decode_exactly(monkeypatch):
    """Whole, as a delta on its base, and as a delta decoded over its base's own bytes; with the
    compiled core and with numpy (the chunks encoded once: numpy's rANS encoder is slow)."""
    cases = []
    n = (1 << 20) + 3
    for width in (2, 4, 8):
        data = sparse(n, width, width)
        blob, h = masked_chunk(data, width)
        assert len(blob) < 0.25 * n
        nxt = data.copy()
        rng = np.random.default_rng(width)
        changed = rng.integers(0, n // width, n // width // 20)
        words = nxt[: n // width * width].reshape(-1, width)  # a sparse update: 5% of the elements move
        words[changed] = rng.integers(1, 256, (changed.size, width), dtype=np.uint8)
        delta, h2 = masked_chunk(nxt, width, data)
        assert parse_header(delta, name="x").codec == "xor" and len(delta) < 0.1 * n
        cases.append((data, blob, h, nxt, delta, h2))
    for disabled in ("", "1"):
        monkeypatch.setenv("CKPT_NO_EXT", disabled)
        for data, blob, h, nxt, delta, h2 in cases:
            assert decode(blob, name="x", expect_hash=h).tobytes() == data.tobytes()
            assert decode(delta, name="x", expect_hash=h2, base=Base(memoryview(data), h)).tobytes() == nxt.tobytes()
            in_place = data.copy()  # a delta decoded over its base's own bytes
            decode(delta, name="x", expect_hash=h2, base=Base(memoryview(in_place), h), out=in_place)
            assert in_place.tobytes() == nxt.tobytes(), disabled


def test_a_damaged_count_or_mask_is_refused_naming_the_object():
    width, n = 4, 1 << 20
    data = sparse(n, width, 3)
    blob, h = masked_chunk(data, width)
    table = HEADER_SIZE  # the first table entry: the count of elements kept
    k = int(np.frombuffer(blob, "<u8", 1, table)[0])
    damage = "zero mask|section table|does not decode"
    for bad, match in ((k - 1, damage), (k + 1, damage), (n // width + 1, "section table")):
        damaged = bytearray(blob)
        damaged[table:table + 8] = np.array([bad], "<u8").tobytes()
        with pytest.raises(CorruptCheckpointError, match=match):
            decode(bytes(damaged), name="chunks/x", expect_hash=h)
    flags = bytearray(blob)
    flags[8] = 2  # a zero mask in a chunk that says format v2
    with pytest.raises(CorruptCheckpointError, match="zero mask in format v2"):
        decode(bytes(flags), name="chunks/x", expect_hash=h)


def test_sparse_state_saves_with_masks_and_loads_exactly_with_and_without_the_core(tmp_path, monkeypatch):
    """A pruned layer and its sparse update saved (``planes/3``, then ``xor/3`` on it), loaded with the
    compiled core and with numpy (saved once: numpy's rANS encoder takes seconds a chunk)."""
    g = torch.Generator().manual_seed(5)
    w = torch.randn(512, 1024, generator=g)
    w[torch.rand(w.shape, generator=g) < 0.9] = 0  # a pruned layer
    half = torch.randn(256, 512, generator=g).to(torch.bfloat16)
    half[:, ::2] = 0
    moved = w + (torch.rand(w.shape, generator=g) < 0.02) * (w != 0) * 1e-3  # a sparse update: 2% of the kept
    states = [{"w": w, "half": half}, {"w": moved, "half": half}]
    with ckpt.Checkpointer(tmp_path) as c:
        for step in (1, 2):
            c.save(step, states[step - 1]).wait()
        codecs = {info.codec for info in c.manifest(2).chunks.values()}
    assert {"planes/3", "xor/3"} <= codecs, codecs
    for disabled in ("", "1"):
        monkeypatch.setenv("CKPT_NO_EXT", disabled)
        for step, want in ((1, states[0]), (2, states[1])):
            out = {k: torch.full_like(v, 7) for k, v in want.items()}
            with ckpt.Checkpointer(tmp_path) as c:
                c.load(step, out)
            assert all(torch.equal(out[k], v) for k, v in want.items()), (disabled, step)


@pytest.mark.parametrize("disabled", ["", "1"], ids=["core", "numpy"])
def test_a_count_below_the_masks_bits_is_refused_in_part_and_whole(monkeypatch, disabled):
    """A damaged table whose count k is below the bits the mask sets (here none kept, every bit set): a
    decode in part (a reshard's run from past the first span to the end) stops before reading a kept
    element that is not there, and the whole decode names the chunk damaged. Found in review: the run's
    count came out negative and the core read past the kept elements."""
    from ckpt.format import partial, spans
    from ckpt.format.chunk import HEADER, MAGIC, MASKED, NO_BASE

    monkeypatch.setenv("CKPT_NO_EXT", disabled)
    width, m = 4, 1 << 20
    n = m * width
    bits = np.full(mask.mask_bytes(m), 0xFF, np.uint8)
    payload = np.array([0, bits.size] + [0] * (width + 1), "<u8").tobytes() + bits.tobytes()
    blob = HEADER.pack(MAGIC, 3, 2, width | MASKED, 0, n, bytes(16), NO_BASE, len(payload)) + payload
    hdr = parse_header(blob, name="x")
    with pytest.raises(partial.NotPartial):
        partial.decode_spans(hdr, blob, [(spans.SPAN, n)], np.zeros(n, np.uint8), name="x", expect_hash="0" * 32)
    with pytest.raises(CorruptCheckpointError, match="zero mask"):
        decode(blob, name="x", expect_hash="0" * 32)
    assert not mask.expand(bits, np.zeros(0, np.uint8), -3, width, None, np.zeros(n, np.uint8))


def test_a_storage_tier_refuses_a_masked_delta_whose_mask_does_not_keep_its_count():
    """``verify_object`` (what a tier checks a copy by, without the delta's base) checks the mask against
    the count too: a delta whose payload check was rewritten to match its damage is still refused."""
    from ckpt.format.chunk import HEADER, MAGIC, MASKED, verify_object, xor_check

    width, m = 4, 4096
    n = m * width
    for bits, ok in ((np.zeros(mask.mask_bytes(m), np.uint8), True), (np.full(mask.mask_bytes(m), 1, np.uint8), False)):
        payload = np.array([0, bits.size] + [0] * (width + 1), "<u8").tobytes() + bits.tobytes()
        fields = [MAGIC, 3, 3, width | MASKED, 0, n, bytes(16), b"\1" * 16, len(payload)]
        fields[4] = xor_check(HEADER.pack(*fields), [payload])
        blob = HEADER.pack(*fields) + payload
        if ok:
            verify_object("chunks/00/" + "0" * 32, [blob])
        else:
            with pytest.raises(CorruptCheckpointError, match="zero mask"):
                verify_object("chunks/00/" + "0" * 32, [blob])


def test_a_sparse_updates_delta_takes_a_mask_even_a_few_bytes_larger():
    """A sparse update's delta sample (the writer's trials on a trained bf16 state, one element in 4097
    moved): 152 bytes without a mask, 171 with (the mask's own section). The mask is kept where nine in ten
    elements are zero and it adds at most 0.2% of the raw bytes: a load then inflates a bit an element, not
    every plane in full. Less sparse, a mask must still save 10%."""
    from ckpt.save.encode import _AUTO_SAMPLE as k
    from ckpt.save.encode import _select, _Trial

    def trials(zeros: float, masked: int) -> list:
        return [_Trial("planes", 82482, [0, 2]), _Trial("xor", 152, [1, 1], rot=True),
                _Trial("xor", masked, [1, 0, 0], rot=True, masked=True, zeros=zeros)]

    n = 14 << 20
    assert _select(trials(0.9997, 171), None, n, k).masked
    assert not _select(trials(0.9997, 152 + int(0.002 * k) + 1), None, n, k).masked
    assert not _select(trials(0.6, 140), None, n, k).masked
    assert _select(trials(0.6, 136), None, n, k).masked


def test_a_chain_of_masked_links_is_hashed_once(monkeypatch):
    """The core decodes the links before a masked one, the masked link is XORed into place, and so on: only
    the last pass hashes the result (each pass hashed its 16 MiB before)."""
    from ckpt.format import chain_core

    base = (torch.randn(1 << 21, generator=torch.Generator().manual_seed(7)) * 0.02).bfloat16()
    links = [base]
    for _ in range(3):
        nxt = links[-1].clone()
        nxt[::4097] += 1.0
        links.append(nxt)
    raws = [memoryview(x.view(torch.uint8).numpy()) for x in links]
    hashes = [chunk_hash(r) for r in raws]
    blobs = [b"".join(bytes(b) for b in encode(raws[0], hashes[0], CodecSpec("auto"), width=2, rotate=True)[1])]
    for prev, raw, h, ph in zip(raws, raws[1:], hashes[1:], hashes):
        codec, parts = encode(raw, h, CodecSpec("auto"), width=2, rotate=True, base=Base(prev, ph))
        blobs.append(b"".join(bytes(b) for b in parts))
        assert codec == "xor" and parse_header(blobs[-1], name="x").masked
    if core is None:
        return
    hashed = []
    real = core.chain_decode
    monkeypatch.setattr(type(core), "chain_decode",
                        lambda self, batch, out, **k: hashed.append(k.get("hashed", True)) or real(batch, out, **k))
    out = np.empty(len(raws[-1]), np.uint8)
    parts = [(f"c{i}", h, b) for i, (h, b) in enumerate(zip(hashes, blobs))]
    assert chain_core.decode_chain(parts, len(raws[-1]), out)
    assert out.tobytes() == bytes(raws[-1]) and hashed == [False, True]


@pytest.mark.parametrize("share", [0.9997, 0.9])
def test_a_sparse_mask_is_zstd_coded_unless_rans_is_much_smaller(share):
    """The mask is decoded whole: zstd inflates a sparse mask's runs of zeros several times faster than rANS
    decodes them, so it is kept unless it adds over 2% of the mask's bytes; a denser one (nine in ten
    elements zero: nearly random bits, no runs) takes the smaller."""
    import zstandard

    from ckpt.format.planes import RANS, ZSTD
    from ckpt.format.rans import encode as rans_encode

    n = 4 << 20
    data = sparse(n, 2, 11, share)
    blob, h = masked_chunk(data, 2)
    hdr = parse_header(blob, name="x")
    table = section_table(hdr, memoryview(blob)[HEADER_SIZE:], name="x", expect_hash=h)
    how, stored, length = table[hdr.width + 1]  # the mask
    bits = np.empty(length, np.uint8)
    unpack_section(how, stored, bits, name="x", expect_hash=h)
    z = len(zstandard.ZstdCompressor(level=1, write_content_size=True).compress(bits.tobytes()))
    r = len(rans_encode(bits))
    if share > 0.999:  # zero runs: zstd, a little larger or not
        assert how == ZSTD and z <= r + 0.02 * length
    else:  # nearly random bits, no runs: the smaller (rANS, by more than 2% of the mask: the rule never applies)
        assert how == RANS and r < z
    assert decode(blob, name="x", expect_hash=h).tobytes() == data.tobytes()
