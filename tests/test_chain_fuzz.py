"""Differential fuzz of the one-pass chain decode: random chains made by the real encoders (every whole
codec, deltas of widths 1 to 16, rotated or not, with every kind of section), random damage to one or
two links (bytes flipped, tables and flags changed, sections moved, truncated or grown, tails
re-coded, header fields changed; the payload check made to agree or not), each stored object flush
against a page no one may touch. ``decode_chain`` must never read or write outside what it is given,
and where it says yes, its bytes are the link by link decode's; ``resolve`` (which tries it first)
gives exactly what the link by link decode alone gives: the same bytes, or the same error naming the
same link."""

from __future__ import annotations

import ctypes
import mmap
import struct
import threading

import numpy as np
import pytest

from ckpt import _ext
from ckpt.format import chains
from ckpt.format.chain_core import decode_chain, decode_chain_range
from ckpt.format.chunk import (
    CODEC_IDS,
    HEADER,
    HEADER_SIZE,
    MAGIC,
    NO_BASE,
    ROTATED,
    chunk_hash,
    parse_header,
    xor_check,
)
from ckpt.format.entries import ChunkInfo
from ckpt.format.paths import chunk_key
from ckpt.format.planes import LENGTH_MASK, RANS, RANS_FLAG, ROTATES, STORED, ZSTD, ZSTD_FLAG, group
from ckpt.save.encode import CodecSpec, _encode_planes, encode
from ckpt.storage import LocalStorage

pytestmark = pytest.mark.skipif(_ext.cpu() is None, reason="needs the compiled core")

PAGE = mmap.PAGESIZE


class Guarded:
    """Bytes placed flush against a page no one may touch (a read past their end crashes the test
    instead of passing unseen), and a page before them likewise."""

    def __init__(self, data: bytes):
        size = (len(data) + PAGE - 1) // PAGE * PAGE + 2 * PAGE
        self.map = mmap.mmap(-1, size)
        buf = np.frombuffer(self.map, np.uint8)
        start = size - PAGE - len(data)
        buf[start:start + len(data)] = np.frombuffer(data, np.uint8)
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        for addr in (buf.ctypes.data, buf.ctypes.data + size - PAGE):
            assert libc.mprotect(addr, PAGE, 0) == 0  # PROT_NONE
        self.view = buf[start:start + len(data)].data


def planes_link(data: np.ndarray, prev: np.ndarray | None, width: int, rot: bool, rng, keep: int | None = None
                ) -> bytes:
    """A planes chunk (or an xor delta on ``prev``) as the writer stores it, every plane's keeping
    (zstd, rANS or as it is; ``keep``: rANS or as it is) drawn at random, so every kind of section
    turns up."""
    g = group(data, prev, width, None, rot)
    methods = [keep if keep is not None else int(rng.choice([ZSTD, RANS, STORED])) for _ in range(width)]
    parts, payload_len, _ = _encode_planes(g, width, 1, methods)
    table = np.frombuffer(parts[0], "<u8", count=width + 1)
    version = 2 if (table & np.uint64(RANS_FLAG)).any() else 1
    codec = "planes" if prev is None else "xor"
    base = NO_BASE if prev is None else bytes.fromhex(chunk_hash(prev))
    fields = [MAGIC, version, CODEC_IDS[codec], width | (ROTATED if rot else 0), 0, data.size,
              bytes.fromhex(chunk_hash(data)), base, payload_len]
    header = HEADER.pack(*fields)
    if codec == "xor":
        fields[4] = xor_check(header, parts)
        header = HEADER.pack(*fields)
    return header + b"".join(bytes(p) for p in parts)


def whole_link(data: np.ndarray, rng) -> bytes:
    kind = rng.choice(["raw", "zstd", "planes"])
    if kind == "planes":
        w = int(rng.choice([1, 2, 3, 4, 8, 16]))
        return planes_link(data, None, w, w in ROTATES and bool(rng.integers(2)), rng)
    _, parts = encode(memoryview(data), chunk_hash(data), CodecSpec.parse(str(kind)))
    return b"".join(bytes(p) for p in parts)


def next_version(prev: np.ndarray, rng) -> np.ndarray:
    """Small changes to a run of the bytes, a bit pattern XORed over all of them, or a few bytes."""
    out = prev.copy()
    kind = rng.integers(3)
    if kind == 0:
        lo, hi = sorted(rng.integers(0, out.size + 1, 2))
        out[lo:hi] ^= rng.integers(0, 4, hi - lo, dtype=np.uint8)
    elif kind == 1:
        out ^= np.resize(rng.integers(0, 256, int(rng.integers(1, 9)), dtype=np.uint8), out.size)
    out[int(rng.integers(out.size))] ^= 0x80  # never the same bytes as before
    return out


SIZES = [1, 17, 240, 241, 1000, 4099, 65536 + 5, 131072 - 3, 200_000, 262144 + 7, 300_001]


def make_chain(rng) -> tuple[int, list[tuple[str, bytes]]]:
    size = int(rng.choice(SIZES))
    data = rng.integers(0, 256, size, dtype=np.uint8)
    data[: size // 3] = 0  # runs: one-symbol rANS blocks, zstd's strength
    data[size // 3: size // 2] &= 0x0F
    chain = [(chunk_hash(data), whole_link(data, rng))]
    widths = [int(rng.choice([1, 2, 4, 8, 2, 4, 3, 5, 16])) for _ in range(int(rng.integers(1, 6)))]
    for w in widths:
        nxt = next_version(data, rng)
        while chunk_hash(nxt) in (h for h, _ in chain):  # a byte or two repeat themselves soon
            nxt = next_version(nxt, rng)
        chain.append((chunk_hash(nxt), planes_link(nxt, data, w, w in ROTATES and bool(rng.integers(2)), rng)))
        data = nxt
    return size, chain


def table_of(blob: bytes) -> tuple[int, list[int]]:
    w = parse_header(blob, name="x").width
    return w, np.frombuffer(blob[HEADER_SIZE:HEADER_SIZE + 8 * (w + 1)], "<u8").tolist()


def rebuild(blob: bytes, table: list[int], sections: list[bytes]) -> bytes:
    payload = np.array(table, "<u8").tobytes() + b"".join(sections)
    return blob[:56] + struct.pack("<Q", len(payload)) + payload


def split(blob: bytes) -> tuple[list[int], list[bytes]]:
    _, table = table_of(blob)
    pos, secs = HEADER_SIZE + 8 * len(table), []
    for e in table:
        secs.append(blob[pos:pos + (e & LENGTH_MASK)])
        pos += e & LENGTH_MASK
    return table, secs


def damage(blob: bytes, rng) -> bytes:
    """One kind of damage (drawn at random) to a stored chunk object."""
    b = bytearray(blob)
    planed = parse_header(blob, name="x").codec in ("planes", "xor")
    kind = int(rng.integers(10)) if planed else int(rng.choice([0, 7]))
    if kind == 0:  # bytes of the payload overwritten
        for at in rng.integers(HEADER_SIZE, max(len(b), HEADER_SIZE + 1), int(rng.integers(1, 6))):
            if at < len(b):
                b[at] = int(rng.integers(256))
        return bytes(b)
    if kind == 7:  # header fields no decode reads: the payload check, the format version
        at = int(rng.choice([8, 12, 13, 15]))
        b[at] = (b[at] ^ 1) if at == 8 else int(rng.integers(256))
        return bytes(b)
    table, secs = split(blob)
    k = int(rng.integers(len(table)))
    if kind == 1:  # a table entry's flags changed
        table[k] ^= int(rng.choice([ZSTD_FLAG, RANS_FLAG, ZSTD_FLAG | RANS_FLAG]))
    elif kind == 2:  # a section's bytes given to its neighbour (the total kept)
        j = (k + 1) % len(table)
        d = int(rng.integers(1, 5))
        if len(secs[k]) >= d:
            secs[j] = secs[k][-d:] + secs[j]
            secs[k] = secs[k][:-d]
            table[k] -= d
            table[j] += d
    elif kind == 3:  # the tail re-coded as rANS (as no writer does), correctly or as nothing
        w = len(table) - 1
        coded = _ext.cpu().rans_encode(np.frombuffer(secs[w], np.uint8)) if rng.integers(2) else b""
        secs[w], table[w] = coded, RANS_FLAG | len(coded)
        b[8] = 2
    elif kind == 4:  # a section cut short or grown
        cut = int(rng.integers(1, 8))
        secs[k] = secs[k][:-cut] if rng.integers(2) else secs[k] + bytes(rng.integers(0, 256, cut, dtype=np.uint8))
        table[k] = (table[k] & ~LENGTH_MASK) | len(secs[k])
    elif kind == 5:  # a rANS section's header or a block's length prefix or symbol count
        coded = [i for i, e in enumerate(table) if e & RANS_FLAG and len(secs[i]) > 8]
        if coded:
            k = int(rng.choice(coded))
            s = bytearray(secs[k])
            at = int(rng.choice([1, 2, 3, 5, 6]))
            s[at] = int(rng.integers(8, 17)) if at == 1 else s[at] ^ int(rng.integers(1, 256))
            secs[k] = bytes(s)
    elif kind == 6:  # table entries exchanged
        j = int(rng.integers(len(table)))
        table[k], table[j], secs[k], secs[j] = table[j], table[k], secs[j], secs[k]
    else:  # kind 8, 9: bytes of one section overwritten
        if secs[k]:
            s = bytearray(secs[k])
            for at in rng.integers(0, len(s), int(rng.integers(1, 4))):
                s[at] = int(rng.integers(256))
            secs[k] = bytes(s)
    return rebuild(bytes(b), table, secs)


def recheck(blob: bytes) -> bytes:
    """The payload check made to agree with damaged bytes (a hostile writer's object)."""
    if blob[10] != CODEC_IDS["xor"]:
        return blob
    head = bytearray(blob[:HEADER_SIZE])
    struct.pack_into("<I", head, 12, xor_check(bytes(head), [blob[HEADER_SIZE:]]))
    return bytes(head) + blob[HEADER_SIZE:]


def outcome(fn) -> tuple:
    try:
        raw, _ = fn()
        return ("ok", bytes(raw))
    except Exception as e:  # compared as they are: the type and the message (which names the link)
        return ("error", type(e).__name__, str(e))


def check_case(size: int, chain: list[tuple[str, bytes]], storage, monkeypatch, rng) -> str:
    table: dict[str, ChunkInfo] = {}
    prev = None
    for h, blob in chain:
        storage.write(chunk_key(h), [blob])
        try:
            label = parse_header(blob, name=h).label
        except Exception:
            label = "raw/1"
        table[h] = ChunkInfo(size, len(blob), label, prev)
        prev = h
    last = chain[-1][0]
    with monkeypatch.context() as m:
        m.setattr(chains, "decode_chain", lambda *a: False)  # link by link only, as before the one-pass decode
        want = outcome(lambda: chains.resolve(storage, table, last))
    got = outcome(lambda: chains.resolve(storage, table, last))
    assert got == want
    guarded = [Guarded(blob) for _, blob in chain]
    out = np.full(size + 128, 0x5A, np.uint8)
    ok = decode_chain([(chunk_key(h), h, g.view) for (h, _), g in zip(chain, guarded)], size, out[64:64 + size])
    assert (out[:64] == 0x5A).all() and (out[64 + size:] == 0x5A).all()
    if ok:
        assert want[0] == "ok" and out[64:64 + size].tobytes() == want[1]
    check_range(size, chain, guarded, want, rng)
    return "fused" if ok else want[0]


def check_range(size: int, chain: list[tuple[str, bytes]], guarded: list[Guarded], want: tuple, rng) -> None:
    """A random range decoded alone, into a chunk's place flush against pages no one may touch, writes
    nothing outside the range; where the chain decodes link by link, it gives those bytes there."""
    lo, hi = sorted(int(x) for x in rng.integers(0, size + 1, 2))
    lo, hi = (lo, hi) if lo < hi else (0, size)
    place = Guarded(bytes([0x5A]) * size)
    out = np.frombuffer(place.view, np.uint8)
    ok = decode_chain_range([(chunk_key(h), h, g.view) for (h, _), g in zip(chain, guarded)], size, out, lo, hi)
    assert (out[:lo] == 0x5A).all() and (out[hi:] == 0x5A).all()
    if ok and want[0] == "ok":
        assert out[lo:hi].tobytes() == want[1][lo:hi]
    RANGES[("ok" if ok else "refused", want[0])] = RANGES.get(("ok" if ok else "refused", want[0]), 0) + 1


RANGES: dict[tuple[str, str], int] = {}


def test_damaged_chains_decode_alike_at_once_and_link_by_link(tmp_path, monkeypatch):
    rng = np.random.default_rng(20240611)
    storage = LocalStorage(tmp_path)
    seen: dict[str, int] = {}
    RANGES.clear()
    for case in range(400):
        size, chain = make_chain(rng)
        if case % 8 == 0:  # the chain as written
            kind = check_case(size, chain, storage, monkeypatch, rng)
            assert kind == ("fused" if size > 240 else "ok"), case  # 240 bytes or fewer: link by link
        else:
            bad = list(chain)
            for victim in rng.choice(len(chain), int(rng.integers(1, 3)), replace=False):
                h, blob = bad[victim]
                hurt = damage(blob, rng)
                bad[victim] = (h, recheck(hurt) if rng.integers(4) else hurt)
            kind = check_case(size, bad, storage, monkeypatch, rng)
        seen[kind] = seen.get(kind, 0) + 1
    assert seen.get("fused", 0) > 20 and seen.get("error", 0) > 40, seen
    # every chain as written decodes in range; damaged ones are refused or decode where they are whole
    assert RANGES.get(("refused", "ok"), 0) == 0 and RANGES.get(("ok", "ok"), 0) > 50, RANGES
    assert RANGES.get(("refused", "error"), 0) > 20 and RANGES.get(("ok", "error"), 0) > 5, RANGES


def test_chains_decoded_at_once_on_several_threads_give_each_its_own_bytes():
    """decode_chain holds nothing shared: threads decoding different chains at once each get their own."""
    rng = np.random.default_rng(3)
    cases = []
    for _ in range(6):
        size, chain = make_chain(rng)
        while size <= 240:
            size, chain = make_chain(rng)
        out = np.empty(size, np.uint8)
        assert decode_chain([(h, h, b) for h, b in chain], size, out)
        cases.append((size, chain, out.tobytes()))
    errors: list[str] = []

    def run(i: int) -> None:
        for k in range(12):
            size, chain, want = cases[(i + k) % len(cases)]
            out = np.empty(size, np.uint8)
            if not decode_chain([(h, h, b) for h, b in chain], size, out) or out.tobytes() != want:
                errors.append(f"thread {i}, chain {(i + k) % len(cases)}")

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
