"""Span digests: a rank that needs part of a raw chunk reads and verifies only the 1 MiB spans that
part touches (uneven reshards), checked against digests in the manifest."""

from __future__ import annotations

import json
import logging
import os

import numpy as np
import pytest
import torch
import xxhash

import ckpt
from ckpt.format import manifest as mf
from ckpt.format import paths, spans
from ckpt.format.chunk import HEADER_SIZE
from ckpt.save.committer import resolve_conflicts

MiB = 1 << 20
ROWS, COLS = 1024, 2048  # 8 KiB rows: one 8 MiB chunk of 8 spans
ROW = COLS * 4


def full_value() -> torch.Tensor:
    g = torch.Generator().manual_seed(5)  # random bits: stored raw whatever the codec
    return (torch.randint(0, 1 << 23, (ROWS, COLS), generator=g, dtype=torch.int32) | (120 << 23)).view(torch.float32)


def manifest_path(root) -> str:
    return os.path.join(root, paths.manifest_key(1))


@pytest.fixture
def saved(tmp_path):
    with ckpt.Checkpointer(tmp_path, codec="raw") as c:
        c.save(1, {"w": full_value(), "small": torch.arange(10.0)}).wait()
    return tmp_path


def load_rows(root, r0: int, n: int) -> tuple[torch.Tensor, int]:
    """Load rows [r0, r0 + n) of "w" alone; the rows and the bytes the load read."""
    local = torch.zeros(n, COLS)
    with ckpt.Checkpointer(root) as c:
        c.load(1, {"w": ckpt.LocalShard(local, (r0, 0), (ROWS, COLS))}, strict=False)
        return local, c.last_load.bytes_read


def spans_read(r0: int, n: int) -> int:
    return (r0 + n - 1) * ROW // MiB - r0 * ROW // MiB + 1


def test_the_manifest_lists_span_digests_of_raw_chunks_only(saved):
    m = ckpt.Checkpointer(saved).manifest(1)
    (h,) = {g.chunk for t in m.tensors if t.key == "w" for s in t.shards for g in s.segments}
    data = open(os.path.join(saved, paths.chunk_key(h)), "rb").read()[HEADER_SIZE:]
    want = "".join(xxhash.xxh3_128_hexdigest(data[i : i + MiB])[:16] for i in range(0, len(data), MiB))
    assert m.chunks[h].spans == want and len(want) == 16 * 8
    assert all(info.spans is None for k, info in m.chunks.items() if k != h)  # one span or less: none
    # a chunk stored encoded has none: only raw bytes can be read in part
    with ckpt.Checkpointer(saved / "z", codec="zstd") as c:
        c.save(1, {"w": torch.zeros(ROWS, COLS)}).wait()
        assert all(info.spans is None for info in c.manifest(1).chunks.values())
        assert "spans" not in json.load(open(manifest_path(saved / "z")))


@pytest.mark.parametrize("r0,n", [(100, 50), (0, 1), (127, 2), (500, 300), (1023, 1)])
def test_a_part_of_a_chunk_reads_only_the_spans_it_touches(saved, r0, n):
    rows, read = load_rows(saved, r0, n)
    assert torch.equal(rows.view(torch.int32), full_value()[r0 : r0 + n].view(torch.int32))
    assert read == HEADER_SIZE + spans_read(r0, n) * MiB


def test_the_whole_chunk_is_read_once_when_every_span_is_needed(saved):
    rows, read = load_rows(saved, 0, ROWS)
    assert torch.equal(rows, full_value()) and read == HEADER_SIZE + ROWS * ROW


def damage(root, offset: int) -> None:
    m = ckpt.Checkpointer(root).manifest(1)
    (h,) = {h for h, info in m.chunks.items() if info.spans is not None}
    with open(os.path.join(root, paths.chunk_key(h)), "r+b") as f:
        f.seek(HEADER_SIZE + offset)
        b = f.read(1)
        f.seek(HEADER_SIZE + offset)
        f.write(bytes([b[0] ^ 0x10]))


def test_a_damaged_span_a_rank_reads_is_refused_and_one_it_does_not_read_is_no_concern_of_its(saved):
    damage(saved, 3 * MiB + 5)  # in span 3: rows 384..511
    with pytest.raises(ckpt.CorruptCheckpointError, match="hash check"):
        load_rows(saved, 400, 10)
    rows, _ = load_rows(saved, 0, 100)  # spans 0 and 1 only
    assert torch.equal(rows, full_value()[:100])
    with ckpt.Checkpointer(saved) as c:  # a whole load, and verify, still find it
        with pytest.raises(ckpt.CorruptCheckpointError):
            c.load(1, {"w": torch.zeros(ROWS, COLS), "small": torch.zeros(10)})
    assert not ckpt.open(saved).verify().ok


def rewrite(root, change) -> None:
    doc = json.load(open(manifest_path(root)))
    change(doc)
    with open(manifest_path(root), "w") as f:
        json.dump(doc, f)


def test_a_wrong_digest_in_the_manifest_costs_a_whole_read_not_the_load(saved, caplog):
    def wrong(doc):
        (h, d), = doc["spans"]["digests"].items()
        doc["spans"]["digests"][h] = d[:16] + ("0" if d[16] != "0" else "1") + d[17:]  # span 1's digest

    rewrite(saved, wrong)
    with caplog.at_level(logging.WARNING, logger="ckpt"):
        rows, read = load_rows(saved, 130, 10)  # span 1
    assert torch.equal(rows, full_value()[130:140])
    assert read == HEADER_SIZE + ROWS * ROW and "span 1 does not match" in caplog.text
    problems = ckpt.open(saved).verify().problems
    assert len(problems) == 1 and "span 1 does not match the digest the manifest lists" in problems[0].message


def test_a_manifest_without_spans_or_with_another_span_size_reads_whole_chunks(saved):
    rewrite(saved, lambda doc: doc["spans"].update(size=2 * MiB, digests={h: d[: len(d) // 2] for h, d in
                                                                            doc["spans"]["digests"].items()}))
    rows, read = load_rows(saved, 100, 10)
    assert torch.equal(rows, full_value()[100:110]) and read == HEADER_SIZE + ROWS * ROW
    rewrite(saved, lambda doc: doc.pop("spans"))  # as an older ckpt wrote it
    rows, read = load_rows(saved, 100, 10)
    assert torch.equal(rows, full_value()[100:110]) and read == HEADER_SIZE + ROWS * ROW
    # the next save lists the chunks it reuses with their digests again
    with ckpt.Checkpointer(saved) as c:
        c.load(1, {"w": torch.zeros(ROWS, COLS), "small": torch.zeros(10)})
        assert c.save(2, {"w": full_value(), "small": torch.arange(10.0)}).wait().chunks_written == 0
        assert sum(info.spans is not None for info in c.manifest(2).chunks.values()) == 1


@pytest.mark.parametrize("change,what", [
    (lambda h, d: [], "spans must be an object"),
    (lambda h, d: {"size": 3 * MiB, "digests": {h: d}}, "power of two"),
    (lambda h, d: {"size": MiB, "digests": {"0" * 32: d}}, "not in the chunk table"),
    (lambda h, d: {"size": MiB, "digests": {h: d[:-16]}}, "lowercase hex"),
    (lambda h, d: {"size": MiB, "digests": {h: d.upper()}}, "lowercase hex"),
    (lambda h, d: {"size": MiB, "digests": {h: 7}}, "lowercase hex"),
])
def test_a_malformed_spans_field_is_refused_before_anything_is_read(saved, change, what):
    doc = json.load(open(manifest_path(saved)))
    ((h, d),) = doc["spans"]["digests"].items()
    doc["spans"] = change(h, d)
    with pytest.raises(ckpt.CorruptCheckpointError, match=what):
        mf.parse(json.dumps(doc).encode(), name="m")


def test_runs_merge_neighbouring_spans_and_stop_at_the_last():
    assert spans.runs([(0, 1)], 8 * MiB) == [(0, 1)]
    assert spans.runs([(MiB - 1, 2), (3 * MiB, MiB)], 8 * MiB) == [(0, 2), (3, 4)]
    assert spans.runs([(2 * MiB, 10), (0, 5), (MiB, 1)], 8 * MiB) == [(0, 3)]
    assert spans.runs([(7 * MiB + 5, 99)], 7 * MiB + 200) == [(7, 8)]
    assert spans.runs([(0, 0)], MiB) == []


def test_span_digests_are_the_same_with_and_without_the_compiled_core():
    data = np.random.default_rng(1).integers(0, 256, 3 * MiB + 17, dtype=np.uint8)
    want = "".join(xxhash.xxh3_128_hexdigest(data[i : i + MiB].tobytes())[:16] for i in range(0, data.size, MiB))
    assert spans.digests(data) == want
    assert spans.digests(bytes(data[:100])) == xxhash.xxh3_128_hexdigest(bytes(data[:100]))[:16]


def test_a_chunk_feeding_several_tensors_is_read_span_by_span_in_place_where_one_takes_a_span(tmp_path):
    a = full_value()[:300]  # 2.3 MiB, then 3.1 MiB, packed in one chunk (each < a quarter chunk): span 2
    b = full_value()[300:700].clone()  # holds the end of one and the start of the other
    with ckpt.Checkpointer(tmp_path, codec="raw") as c:
        c.save(1, {"a": a, "b": b}).wait()
        assert len(c.manifest(1).chunks) == 1
        state = {"a": torch.zeros_like(a), "b": torch.zeros_like(b)}
        c.load(1, state)
        assert torch.equal(state["a"], a) and torch.equal(state["b"], b)
        assert c.last_load.bytes_read == HEADER_SIZE + a.nbytes + b.nbytes
    for at in (2 * MiB + 100, a.nbytes + 7, 4 * MiB):  # a span shared by both, then one of b's own
        damage(tmp_path, at)
        with ckpt.Checkpointer(tmp_path) as c:
            state = {"a": torch.zeros_like(a), "b": torch.zeros_like(b)}
            with pytest.raises(ckpt.CorruptCheckpointError, match="hash check"):
                c.load(1, state)
            assert not state["a"].any() and not state["b"].any()  # staged: nothing was written
        damage(tmp_path, at)  # flipped back


def test_storage_that_does_not_hash_as_it_reads_reads_runs_of_spans(tmp_path):
    url = f"memory://spans-{os.getpid()}-{tmp_path.name}"
    with ckpt.Checkpointer(url, codec="raw") as c:
        c.save(1, {"w": full_value()}).wait()
        assert not c.storage.hashes_reads
    for r0, n in [(100, 50), (127, 2), (500, 300)]:
        local = torch.zeros(n, COLS)
        with ckpt.Checkpointer(url) as c:
            c.load(1, {"w": ckpt.LocalShard(local, (r0, 0), (ROWS, COLS))})
            assert torch.equal(local, full_value()[r0 : r0 + n])
            assert c.last_load.bytes_read == HEADER_SIZE + spans_read(r0, n) * MiB


# -- chunks stored as byte planes: only the needed spans are decoded ------------------------------------

def planes_object(data: np.ndarray, width: int, rotate: bool, codec: str = "auto") -> tuple[bytes, str]:
    from ckpt.format.chunk import chunk_hash
    from ckpt.save.encode import CodecSpec, encode

    h = chunk_hash(data)
    name, parts = encode(memoryview(data), h, CodecSpec.parse(codec), width=width, rotate=rotate)
    return b"".join(bytes(p) for p in parts), name


def float_bytes(dtype: torch.dtype, n: int, seed: int) -> np.ndarray:
    g = torch.Generator().manual_seed(seed)
    if not dtype.is_floating_point:  # small integers: planes of zeros, stored as one symbol repeated
        return torch.randint(0, 1000, (n,), generator=g, dtype=dtype).view(torch.uint8).numpy()
    return (torch.randn(n, generator=g) * 0.02).to(dtype).view(torch.uint8).numpy()


@pytest.mark.parametrize("dtype,width,rotate", [(torch.float32, 4, True), (torch.float32, 4, False),
                                               (torch.bfloat16, 2, True), (torch.int64, 8, False)])
@pytest.mark.parametrize("extra", [0, 3])  # bytes past the last whole element: the tail section
def test_decoding_spans_of_a_planes_object_gives_the_bytes_of_those_spans(dtype, width, rotate, extra):
    from ckpt.format import partial
    from ckpt.format.chunk import decode, parse_header

    data = np.concatenate([float_bytes(dtype, (5 * MiB + 3000) // width, 1), np.arange(extra, dtype=np.uint8)])
    blob, name = planes_object(data, width, rotate)
    hdr = parse_header(blob, name="x")
    assert name == "planes" and (rotate or not hdr.rot)  # auto rotates where that is smaller
    assert decode(blob, name="x", expect_hash=hdr.digest).tobytes() == data.tobytes()
    size = data.size
    for runs in ([(0, MiB)], [(MiB, 3 * MiB)], [(0, MiB), (4 * MiB, size)], [(5 * MiB, size)]):
        out = np.zeros(sum(b - a for a, b in runs), np.uint8)
        placed = partial.decode_spans(hdr, blob, runs, out, name="x", expect_hash=hdr.digest)
        assert [(a, b) for a, b, _ in placed] == runs
        for a, b, at in placed:
            assert np.array_equal(out[at : at + b - a], data[a:b]), (runs, a, b)


def test_objects_that_cannot_be_decoded_in_part_say_so(monkeypatch):
    from ckpt.format import partial
    from ckpt.format.chunk import parse_header
    from ckpt.save import encode

    monkeypatch.setattr(encode, "_MASK_ZEROS", 2.0)  # no zero masks (one decodes in part: the test below)

    data = float_bytes(torch.float32, MiB, 2)
    for codec in ("zstd", "raw"):
        blob, _ = planes_object(data, 4, True, codec)
        with pytest.raises(partial.NotPartial):
            partial.decode_spans(parse_header(blob, name="x"), blob, [(0, MiB)], np.zeros(MiB, np.uint8), name="x",
                                 expect_hash="0" * 32)
    sparse = np.zeros(4 * MiB, np.uint8)  # runs of zeros: zstd sections, one frame each
    sparse[::4096] = 7
    blob, name = planes_object(sparse, 4, False)
    hdr = parse_header(blob, name="x")
    assert name == "planes"
    with pytest.raises(partial.NotPartial):
        partial.decode_spans(hdr, blob, [(0, MiB)], np.zeros(MiB, np.uint8), name="x", expect_hash=hdr.digest)


@pytest.mark.parametrize("width,extra", [(4, 0), (2, 1), (4, 3)])
def test_a_chunk_with_a_zero_mask_is_decoded_in_part(width, extra):
    """A mostly-zero chunk stores a zero mask and its nonzero elements' planes; the kept elements a run
    needs are counted from the mask and only their rANS blocks decoded, the zeros written around them."""
    from ckpt.format import partial
    from ckpt.format.chunk import decode, parse_header

    dtype = {2: torch.bfloat16, 4: torch.float32}[width]
    g = torch.Generator().manual_seed(width)
    values = torch.randn((5 * MiB + 3000) // width, generator=g).to(dtype)
    values[torch.rand(values.numel(), generator=g) < 0.9] = 0  # a pruned layer: 90% zeros
    values[: MiB // width] = 0  # and a first MiB with no element kept at all
    data = np.concatenate([values.view(torch.uint8).numpy(), np.arange(1, extra + 1, dtype=np.uint8)])
    blob, name = planes_object(data, width, True)
    hdr = parse_header(blob, name="x")
    assert name == "planes" and hdr.masked and hdr.label == "planes/3"
    assert len(blob) < 0.2 * data.size  # a mask and the kept tenth: smaller than every plane coded
    assert decode(blob, name="x", expect_hash=hdr.digest).tobytes() == data.tobytes()
    size = data.size
    for runs in ([(0, MiB)], [(MiB, 3 * MiB)], [(0, MiB), (4 * MiB, size)], [(5 * MiB, size)], [(0, size)]):
        out = np.full(sum(b - a for a, b in runs), 0xA5, np.uint8)
        placed = partial.decode_spans(hdr, blob, runs, out, name="x", expect_hash=hdr.digest)
        assert [(a, b) for a, b, _ in placed] == runs
        for a, b, at in placed:
            assert np.array_equal(out[at : at + b - a], data[a:b]), (runs, a, b)


@pytest.fixture
def saved_planes(tmp_path):
    w = (torch.randn(ROWS, COLS, generator=torch.Generator().manual_seed(3)) * 0.02)
    with ckpt.Checkpointer(tmp_path) as c:  # the default codec: trained-like floats as byte planes
        c.save(1, {"w": w}).wait()
        (info,) = c.manifest(1).chunks.values()
        assert info.codec.startswith("planes/") and info.spans is not None
    return tmp_path, w


def test_a_rank_needing_part_of_a_planes_chunk_decodes_only_its_spans(saved_planes):
    root, w = saved_planes
    for r0, n in [(100, 50), (127, 2), (500, 300), (0, ROWS)]:
        rows, _ = load_rows(root, r0, n)
        assert torch.equal(rows, w[r0 : r0 + n])
    # damage in a block of the exponent plane that rows 0-99 do not need: their load does not decode
    # it (a whole decode would fail the chunk's hash), a load of the rows it holds is refused
    from ckpt.format.chunk import parse_header, section_table

    m = ckpt.Checkpointer(root).manifest(1)
    (h,) = m.chunks
    path = os.path.join(root, paths.chunk_key(h))
    blob = open(path, "rb").read()
    hdr = parse_header(blob, name="x")
    table = section_table(hdr, memoryview(blob)[HEADER_SIZE:], name="x", expect_hash=h)
    coded = [i for i, (how, _, _) in enumerate(table) if how == 2]
    assert coded, "the exponent plane is rANS-coded"
    start = HEADER_SIZE + 8 * len(table) + sum(len(stored) for _, stored, _ in table[: coded[0]])
    at = start + len(table[coded[0]][1]) - 100  # in the last block: the last rows' exponents
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0x55]))
    rows, _ = load_rows(root, 0, 100)
    assert torch.equal(rows, w[:100])
    with pytest.raises(ckpt.CorruptCheckpointError):
        load_rows(root, ROWS - 10, 10)


def test_a_local_tier_serves_spans_without_rejecting_its_copy(tmp_path, caplog):
    remote = f"memory://spans-tier-{os.getpid()}-{tmp_path.name}"
    with ckpt.Checkpointer(remote, local_dir=str(tmp_path / "nvme"), codec="raw") as c:
        c.save(1, {"w": full_value()}).wait()
    for r0, n in [(100, 50), (1000, 24)]:  # the second ends with the chunk's last span
        local = torch.zeros(n, COLS)
        with ckpt.Checkpointer(remote, local_dir=str(tmp_path / "nvme")) as c, \
                caplog.at_level(logging.WARNING, logger="ckpt"):
            c.load(1, {"w": ckpt.LocalShard(local, (r0, 0), (ROWS, COLS))})
            assert torch.equal(local, full_value()[r0 : r0 + n])
            assert c.last_load.local_rejected == [] and "damaged" not in caplog.text
            assert c.last_load.remote_chunks == 0 and c.last_load.bytes_read == HEADER_SIZE + spans_read(r0, n) * MiB
    # a local copy cut short is read from the remote, the copy reported
    (path,) = [os.path.join(d, f) for d, _, fs in os.walk(tmp_path / "nvme" / "chunks") for f in fs]
    os.truncate(path, HEADER_SIZE + 3 * MiB)
    local = torch.zeros(10, COLS)
    with ckpt.Checkpointer(remote, local_dir=str(tmp_path / "nvme")) as c:
        c.load(1, {"w": ckpt.LocalShard(local, (700, 0), (ROWS, COLS))})
        assert torch.equal(local, full_value()[700:710])
        assert len(c.last_load.local_rejected) == 1 and c.last_load.remote_chunks == 1


def test_a_save_after_loading_a_step_with_wrong_digests_lists_the_right_ones(saved):
    def wrong(doc):
        (h, d), = doc["spans"]["digests"].items()
        doc["spans"]["digests"][h] = d[:16] + ("0" if d[16] != "0" else "1") + d[17:]

    rewrite(saved, wrong)
    with ckpt.Checkpointer(saved) as c:  # the digests came from the manifest, not from the bytes
        c.load(1, {"w": torch.zeros(ROWS, COLS), "small": torch.zeros(10)})
        assert c.save(2, {"w": full_value(), "small": torch.arange(10.0)}).wait().chunks_written == 0
    assert ckpt.open(saved).verify(2).ok


def test_parts_of_a_chunk_held_in_memory_count_as_one_local_read(tmp_path):
    from ckpt.format.chunk import verify_object
    from ckpt.storage import open_tiered

    st = open_tiered(f"memory://spans-held-{os.getpid()}-{tmp_path.name}", str(tmp_path / "nvme"),
                     verify=verify_object)
    key, data = paths.chunk_key("0" * 32), bytes(range(256)) * 64
    st.memory.hold(key, memoryview(data))
    a, b = bytearray(100), bytearray(50)
    assert list(st.read_parts(key, [(10, a), (1000, b)])) == [100, 50]
    assert bytes(a) == data[10:110] and bytes(b) == data[1000:1050]
    assert st.tier_counters().local_hits == 1
    st.close()


def test_merging_rank_reports_keeps_a_chunks_digests_where_any_report_has_them(saved):
    import dataclasses

    m = ckpt.Checkpointer(saved).manifest(1)
    (h,) = {h for h, info in m.chunks.items() if info.spans is not None}
    # rank 1 lists the chunk without digests (e.g. as the base of one of its deltas, known only by its header)
    bare = {k: dataclasses.replace(info, spans=None) for k, info in m.chunks.items()}
    parts = [dataclasses.replace(m, kind="rank", rank=0, tensors=m.tensors),
             dataclasses.replace(m, kind="rank", rank=1, tensors=[], chunks=bare)]
    assert mf.merge(1, parts).chunks[h].spans == m.chunks[h].spans


def test_a_chunk_two_ranks_stored_differently_keeps_its_digests_in_the_step(saved):
    import dataclasses

    from ckpt.storage import LocalStorage

    m = ckpt.Checkpointer(saved).manifest(1)
    (h,) = {h for h, info in m.chunks.items() if info.spans is not None}
    theirs = dict(m.chunks)  # rank 1 describes its own copy, which lost the race to rank 0's
    theirs[h] = dataclasses.replace(m.chunks[h], stored=m.chunks[h].stored - 1000, codec="planes/2")
    parts = [dataclasses.replace(m, kind="rank", rank=0, chunks=dict(m.chunks)),
             dataclasses.replace(m, kind="rank", rank=1, tensors=[], chunks=theirs)]
    resolve_conflicts(parts, LocalStorage(saved))
    assert parts[1].chunks[h] == m.chunks[h]  # the copy that stayed
    assert mf.merge(1, parts).chunks[h].spans == m.chunks[h].spans


@pytest.mark.parametrize("disabled", ["", "1"])
def test_a_delta_is_decoded_in_part_down_its_chain(tmp_path, monkeypatch, caplog, disabled):
    """With the compiled core the tiles of a delta's chain a rank's spans cover are decoded, every link at
    once; without it, its spans down the links. Either way damage where a rank needs nothing does not
    stop its load (nor costs a whole decode that fails first), and damage where it does is refused."""
    g = torch.Generator().manual_seed(4)
    w = torch.randn(ROWS, COLS, generator=g) * 0.02
    steps = {}
    with ckpt.Checkpointer(tmp_path, delta_budget=3.0) as c:  # room for a chain of dense deltas
        for s in (1, 2, 3):
            w = w + (torch.rand(ROWS, COLS, generator=g) < 0.3) * 1e-4  # a sparse update: a small delta
            steps[s] = w.clone()
            c.save(s, {"w": w}).wait()
        m = c.manifest(3)
    (h,) = {g.chunk for t in m.tensors for s in t.shards for g in s.segments}
    assert m.chunks[h].codec.startswith("xor/") and m.chunks[h].spans is not None
    assert len(mf.chain(m.chunks, h)) == 3  # two deltas on the chunk stored whole
    monkeypatch.setenv("CKPT_NO_EXT", disabled)  # the loads only (the bytes saved are the same either way)
    for r0, n in [(100, 50), (500, 300)] + ([] if disabled else [(0, ROWS)]):  # numpy decodes a whole chain slowly
        local = torch.zeros(n, COLS)
        with ckpt.Checkpointer(tmp_path) as c:
            c.load(3, {"w": ckpt.LocalShard(local, (r0, 0), (ROWS, COLS))})
        assert torch.equal(local, steps[3][r0 : r0 + n]), (r0, n)
    # damage the chunk stored whole where rows 0-99 do not reach: their load decodes none of it (a whole
    # decode would fail its hash), the last rows' load is refused
    base = mf.chain(m.chunks, h)[-1]
    path = os.path.join(tmp_path, paths.chunk_key(base))
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.seek(size - 50)
        b = f.read(1)
        f.seek(size - 50)
        f.write(bytes([b[0] ^ 0x55]))
    for r0, n, ok in [(0, 100, True), (ROWS - 10, 10, False)]:
        local = torch.zeros(n, COLS)
        with ckpt.Checkpointer(tmp_path) as c:
            if ok:
                caplog.clear()
                c.load(3, {"w": ckpt.LocalShard(local, (r0, 0), (ROWS, COLS))})
                assert torch.equal(local, steps[3][r0 : r0 + n])
                # decoded in part from the start: no whole decode failed first
                assert "spans of it this rank needs check out" not in caplog.text
            else:
                with pytest.raises(ckpt.CorruptCheckpointError):
                    c.load(3, {"w": ckpt.LocalShard(local, (r0, 0), (ROWS, COLS))})


def test_a_delta_on_a_raw_chunk_whose_payload_is_cut_short_is_refused_not_misread(tmp_path):
    import struct

    g = torch.Generator().manual_seed(6)
    w = torch.randint(-(1 << 31), (1 << 31) - 1, (ROWS, COLS), generator=g, dtype=torch.int32)  # stored raw
    with ckpt.Checkpointer(tmp_path, delta_budget=1.3) as c:  # room for a delta on a raw chunk
        c.save(1, {"w": w}).wait()
        w.view(-1)[::97] ^= 1  # a sparse change: the second save is a delta on it
        c.save(2, {"w": w}).wait()
        m = c.manifest(2)
    (h,) = m.chunks.keys() - {m.chunks[x].base for x in m.chunks}
    base = m.chunks[h].base
    assert m.chunks[h].codec.startswith("xor/") and m.chunks[base].codec.startswith("raw/")
    path = os.path.join(tmp_path, paths.chunk_key(base))
    with open(path, "r+b") as f:  # a header that agrees with a payload 4 KiB short: damaged all the same
        head = bytearray(f.read(HEADER_SIZE))
        struct.pack_into("<Q", head, 56, struct.unpack_from("<Q", head, 56)[0] - 4096)
        f.seek(0)
        f.write(head)
        f.truncate(os.path.getsize(path) - 4096)
    local = torch.zeros(10, COLS, dtype=torch.int32)
    with ckpt.Checkpointer(tmp_path) as c:
        with pytest.raises(ckpt.CorruptCheckpointError):
            c.load(2, {"w": ckpt.LocalShard(local, (ROWS - 10, 0), (ROWS, COLS))})  # the rows cut off
    assert not local.any()


def test_verify_checks_the_span_digests_every_step_lists_for_a_chunk(saved):
    with ckpt.Checkpointer(saved, codec="raw") as c:  # step 2 reuses step 1's chunks, digests and all
        c.save(2, {"w": full_value(), "small": torch.arange(10.0)}).wait()
    path = os.path.join(saved, paths.manifest_key(2))
    doc = json.load(open(path))
    (h, d), = doc["spans"]["digests"].items()
    doc["spans"]["digests"][h] = d[:32] + ("0" if d[32] != "0" else "1") + d[33:]  # span 2's digest, step 2 only
    with open(path, "w") as f:
        json.dump(doc, f)
    assert ckpt.open(saved).verify(1).ok
    problems = ckpt.open(saved).verify().problems  # step 1's entry is right: step 2's must be checked too
    assert len(problems) == 1 and "span 2 does not match" in problems[0].message
    assert "step(s) [2]" in problems[0].message
