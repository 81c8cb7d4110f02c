"""The buffer layout: where every tensor goes in the host buffer, and how that buffer is cut into chunks.

A layout depends only on the state's structure (keys, dtypes, shapes, devices), so it is computed on
the first save and reused while the structure is unchanged. It is what makes dedup work:
the same tensor lands at the same place in the same chunk on every save, so an unchanged tensor
produces unchanged chunks.

Layout rules:
* every tensor of 64 bytes or more starts at a 64-byte aligned offset, a smaller one at a multiple
  of its element size (thousands of step counters add no padding); padding is zero and stays zero;
* every chunk starts at a 64-byte aligned offset, so elements stay aligned within their chunk (the
  byte planes of the codecs assume it: a misaligned float would spread over the wrong planes);
* a large tensor (at least a quarter chunk) starts a fresh chunk and is cut into ``chunk_size``
  pieces, its last piece ending where it ends, so partial reads of it touch only its own chunks;
* small tensors are packed together into shared chunks of up to ``chunk_size`` bytes, so a
  checkpoint is not thousands of tiny objects; a key of ``fresh`` starts a new one (the planner's
  packs of small replicated tensors, which other ranks read: a pack in one chunk, without this
  rank's own tensors).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..format.entries import ALIGN  # the format bounds a chunk's size by it (entries.check_chunk_sizes)
from ..tree import dtype_name


@dataclass(frozen=True)
class TensorSlot:
    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # in the host buffer
    nbytes: int
    device: str = "cpu"  # device type of the source tensor


@dataclass(frozen=True)
class ChunkSlot:
    offset: int
    length: int
    width: int = 1  # element width of most of its bytes: the byte planes the delta codecs split it into
    rotate: bool = False  # those bytes are floats whose sign the codecs rotate out of the top plane


@dataclass(frozen=True)
class BufferLayout:
    """Tensors laid out in one buffer of ``nbytes`` (``slots``, in state order) and the buffer cut
    into ``chunks`` that tile it without gaps."""

    slots: tuple[TensorSlot, ...]
    chunks: tuple[ChunkSlot, ...]
    nbytes: int

    def segments(self, slot: TensorSlot) -> list[tuple[int, int, int]]:
        """(chunk index, offset in chunk, length) pieces covering ``slot``, in order."""
        out = []
        lo, hi = slot.offset, slot.offset + slot.nbytes
        for i in self._chunk_range(lo, hi):
            c = self.chunks[i]
            a, b = max(lo, c.offset), min(hi, c.offset + c.length)
            if a < b:
                out.append((i, a - c.offset, b - a))
        return out

    def _chunk_range(self, lo: int, hi: int) -> range:
        # chunks are sorted and contiguous: binary search the first one that ends after lo
        left, right = 0, len(self.chunks)
        while left < right:
            mid = (left + right) // 2
            c = self.chunks[mid]
            if c.offset + c.length <= lo:
                left = mid + 1
            else:
                right = mid
        end = left
        while end < len(self.chunks) and self.chunks[end].offset < hi:
            end += 1
        return range(left, end)


def aligned(pos: int, nbytes: int, itemsize: int) -> int:
    """Where a tensor of ``nbytes`` goes at or after ``pos``: on a cache line, but a tensor smaller
    than a line only on its element (an optimizer's per-parameter step counters would otherwise pad
    the buffer by 60 bytes each). Staged loads place their stand-ins by the same rule."""
    align = ALIGN if nbytes >= ALIGN else itemsize
    return -(-pos // align) * align


def make_layout(tensors: dict[str, torch.Tensor], chunk_size: int, fresh: frozenset[str] = frozenset()
                ) -> BufferLayout:
    """Lay out ``tensors`` (in order) in one buffer and cut it into chunks; the first byte of each
    key of ``fresh`` starts a chunk."""
    slots: list[TensorSlot] = []
    chunks: list[ChunkSlot] = []
    large = max(ALIGN, chunk_size // 4)
    pos = 0
    pack_start = 0  # start of the open pack chunk; pack is empty while pack_start == pos
    cut = False  # the next tensor with bytes starts a chunk

    def close_pack(end: int) -> None:
        nonlocal pack_start
        if end > pack_start:
            chunks.append(ChunkSlot(pack_start, end - pack_start))
        pack_start = end

    for key, t in tensors.items():
        dtype_name(t.dtype)
        nbytes = t.numel() * t.element_size()
        cut = cut or key in fresh
        if nbytes == 0:
            slots.append(TensorSlot(key, t.dtype, tuple(t.shape), pos, 0, t.device.type))
            continue
        start = aligned(pos, nbytes, t.element_size())
        if nbytes >= large:
            close_pack(start)
            for off in range(start, start + nbytes, chunk_size):
                chunks.append(ChunkSlot(off, min(chunk_size, start + nbytes - off)))
            pos = start + nbytes
            pack_start = pos
        else:
            opens = pack_start == pos  # the first tensor of a new pack chunk
            if opens or cut or start + nbytes - pack_start > chunk_size:
                start = -(-pos // ALIGN) * ALIGN  # a chunk starts on a cache line
                if opens:
                    pack_start = start
                else:
                    close_pack(start)
            pos = start + nbytes
        cut = False
        slots.append(TensorSlot(key, t.dtype, tuple(t.shape), start, nbytes, t.device.type))
    close_pack(pos)
    # Chunks must tile the buffer without gaps (padding belongs to the chunk before it).
    tiled = []
    for i, c in enumerate(chunks):
        end = chunks[i + 1].offset if i + 1 < len(chunks) else pos
        tiled.append(ChunkSlot(c.offset, end - c.offset))
    if tiled and tiled[0].offset != 0:
        tiled[0] = ChunkSlot(0, tiled[0].offset + tiled[0].length)
    layout = BufferLayout(tuple(slots), tuple(tiled), pos)
    return BufferLayout(layout.slots, _with_widths(layout), pos)


def element_width(dtype: torch.dtype) -> int:
    """The width of the values a dtype's bytes hold (a complex number is two floats)."""
    size = dtype.itemsize
    return size // 2 if dtype.is_complex else size


ROTATED_DTYPES = frozenset({torch.bfloat16, torch.float32, torch.float64})  # 8+ exponent bits after the sign


def _with_widths(layout: BufferLayout) -> tuple[ChunkSlot, ...]:
    """Each chunk with the element width (and kind) most of its bytes have (1 where they are mostly
    padding). Every tensor starts 64-byte aligned, so element boundaries fall on multiples of the width."""
    by_chunk: list[dict[tuple[int, bool], int]] = [{} for _ in layout.chunks]
    for slot in layout.slots:
        kind = (element_width(slot.dtype), slot.dtype in ROTATED_DTYPES)
        for i, _, n in layout.segments(slot):
            by_chunk[i][kind] = by_chunk[i].get(kind, 0) + n
    out = []
    for c, counts in zip(layout.chunks, by_chunk):
        w, rot = max(counts, key=lambda k: (counts[k], k)) if counts else (1, False)
        out.append(ChunkSlot(c.offset, c.length, w, rot))
    return tuple(out)
