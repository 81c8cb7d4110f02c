"""Pure pieces, tested without any I/O: layout layout, codec framing, manifest validation."""

from __future__ import annotations

import pytest
import torch

from ckpt import CorruptCheckpointError, IncompatibleFormatError
from ckpt import codec, manifest as mf
from ckpt.layout import ALIGN, make_layout


def _tensors(sizes):
    return {f"t{i}": torch.empty(n, dtype=torch.uint8) for i, n in enumerate(sizes)}


@pytest.mark.parametrize("sizes", [[10], [0, 5, 0], [100] * 50, [1 << 20, 7, 3 << 20, 9, 9], [65, 63, 1, 300000]])
def test_plan_chunks_tile_the_buffer_and_segments_cover_each_tensor(sizes):
    cs = 256 * 1024
    layout = make_layout(_tensors(sizes), cs)
    pos = 0
    for c in layout.chunks:
        assert c.offset == pos and 0 < c.length <= cs + ALIGN
        pos += c.length
    assert pos == layout.nbytes
    for slot in layout.slots:
        assert slot.offset % ALIGN == 0 or slot.nbytes == 0
        assert sum(n for _, _, n in layout.segments(slot)) == slot.nbytes
        if slot.nbytes >= cs // 4:  # large tensors start their own chunk
            first, off, _ = layout.segments(slot)[0]
            assert off == 0 and layout.chunks[first].offset == slot.offset


def test_plan_is_stable_for_the_same_structure():
    a = make_layout(_tensors([5, 1 << 20, 17]), 1 << 20)
    b = make_layout(_tensors([5, 1 << 20, 17]), 1 << 20)
    assert a == b
    assert make_layout(_tensors([5, 1 << 20, 18]), 1 << 20) != a


def test_codec_roundtrip_and_header_checks():
    raw = memoryview(bytes(range(256)) * 4096)
    h = codec.chunk_hash(raw)
    for spec in (codec.CodecSpec("raw"), codec.CodecSpec("zstd", 3), codec.CodecSpec("auto")):
        name, bufs = codec.encode(raw, h, spec)
        blob = b"".join(bytes(b) for b in bufs)
        assert bytes(codec.decode(blob, name="x", expect_hash=h, expect_len=len(raw))) == bytes(raw)
        assert name == ("raw" if spec.name == "raw" else "zstd")
    with pytest.raises(CorruptCheckpointError, match="header hash"):
        codec.decode(blob, name="x", expect_hash="0" * 32)
    with pytest.raises(CorruptCheckpointError, match="truncated"):
        codec.decode(blob[:10], name="x", expect_hash=h)
    future = bytearray(blob)
    future[8:10] = (9).to_bytes(2, "little")
    with pytest.raises(IncompatibleFormatError, match="pip install -U ckpt"):
        codec.decode(bytes(future), name="x", expect_hash=h)


def test_manifest_json_roundtrip():
    m = mf.Manifest(step=3, kind="step", structure={"t": "dict", "k": ["w"], "v": [{"t": "tensor", "key": "w"}]},
                    tensors=[mf.TensorEntry("w", "float32", [2, 2], [mf.Shard(0, [0, 0], [2, 2], [
                        mf.Segment("a" * 32, 0, 16)])])],
                    chunks={"a" * 32: mf.ChunkInfo(64, 128, "raw/1")})
    back = mf.parse(m.to_json(), name="m")
    assert back.tensors == m.tensors and back.chunks == m.chunks and back.step == 3


def test_merge_combines_rank_reports():
    def part(rank, rows):
        return mf.Manifest(step=1, kind="rank", rank=rank, structure={"t": "dict", "k": [], "v": []},
                           tensors=[mf.TensorEntry("w", "float32", [4, 2], [mf.Shard(rank, [rows[0], 0], [rows[1], 2], [
                               mf.Segment(f"{rank:032x}", 0, rows[1] * 8)])])],
                           chunks={f"{rank:032x}": mf.ChunkInfo(rows[1] * 8, 100, "raw/1")}, stats={"chunks": 1})
    m = mf.merge(1, [part(1, (2, 2)), part(0, (0, 2))])
    assert m.world_size == 2 and m.stats["chunks"] == 2
    assert [s.rank for s in m.tensors[0].shards] == [0, 1] and len(m.chunks) == 2
