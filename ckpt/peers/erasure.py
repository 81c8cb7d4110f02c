"""Reed-Solomon parity over a group of ranks: where each byte of each rank's data goes (pure layout
math, tested without processes), and encoding/decoding one stripe with zfec (a large block in
pieces, on threads).

A group has ``n = k + m`` members in distinct failure domains. Member ``i``'s data for a step is its
chunk objects, concatenated in hash order (``D_i``), cut into ``k`` segments of ``ceil(|D_i| / k)``
bytes. There are ``n`` stripes; stripe ``t`` takes its parity holders in rotation (members
``t, t+1, … t+m-1`` mod n) and one segment from each of the other ``k`` members, so every member
gives data to exactly k stripes (one segment each) and holds parity in exactly m of them (blocks of
one segment's size). Every member stores its own data whole and ``m/k`` of it in parity: the
group's storage is ``(k+m)/k`` of its data (segments of unequal members are padded with zeros in
the code, never stored). Losing any m members leaves every stripe with at least k of its k+m
blocks, enough to decode the lost segments.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from .. import _cpus
from ..errors import CorruptCheckpointError
from ..format.paths import parity_block_name, parity_layout_name


@dataclass(frozen=True)
class Member:
    rank: int  # the rank that saved this data
    objects: list[tuple[str, int]]  # (chunk hash, stored size), in hash order

    @functools.cached_property
    def size(self) -> int:
        return sum(n for _, n in self.objects)

    def segment(self, q: int, k: int) -> tuple[int, int]:
        """Byte range [start, end) of segment ``q`` of this member's data."""
        seg = -(-self.size // k)
        return min(self.size, q * seg), min(self.size, (q + 1) * seg)

    def pieces(self, start: int, end: int) -> list[tuple[str, int, int]]:
        """(hash, offset in object, length) of the objects holding bytes [start, end) of the data."""
        out, pos = [], 0
        for h, n in self.objects:
            a, b = max(start, pos), min(end, pos + n)
            if a < b:
                out.append((h, a - pos, b - a))
            pos += n
            if pos >= end:
                break
        return out


@dataclass(frozen=True)
class Stripe:
    index: int
    data: list[tuple[int, int]]  # (member position, its segment number), k of them: blocks 0..k-1
    parity: list[int]  # member positions holding parity blocks k..k+m-1
    length: int  # block length: the longest segment in it


@dataclass(frozen=True)
class GroupLayout:
    """One group's parity layout for one step (every member computes the same one)."""

    group: int
    k: int
    m: int
    members: list[Member]
    stripes: list[Stripe]

    @classmethod
    def build(cls, group: int, k: int, m: int, members: list[Member]) -> GroupLayout:
        n = k + m
        if len(members) != n:
            raise ValueError(f"a parity group has {n} members, got {len(members)}")
        given = [0] * n
        stripes = []
        for t in range(n):
            holders = [(t + j) % n for j in range(m)]
            data = []
            for i in range(n):
                if i not in holders:
                    data.append((i, given[i]))
                    given[i] += 1
            length = max(members[i].segment(q, k)[1] - members[i].segment(q, k)[0] for i, q in data)
            stripes.append(Stripe(t, data, holders, length))
        return cls(group, k, m, members, stripes)

    def parity_name(self, t: int, j: int) -> str:
        """File name (in the step's directory) of stripe t's parity block j."""
        return parity_block_name(self.group, t, j)

    @property
    def name(self) -> str:
        return parity_layout_name(self.group)

    def member_of(self, h: str) -> int | None:
        for pos, mem in enumerate(self.members):
            if any(x == h for x, _ in mem.objects):
                return pos
        return None

    def to_json(self) -> dict:
        return {"group": self.group, "k": self.k, "m": self.m,
                "members": [{"rank": mem.rank, "objects": [list(o) for o in mem.objects]} for mem in self.members]}

    @classmethod
    def from_json(cls, doc: dict, name: str) -> GroupLayout:
        try:
            members = [Member(int(d["rank"]), [(str(h), int(n)) for h, n in d["objects"]]) for d in doc["members"]]
            return cls.build(int(doc["group"]), int(doc["k"]), int(doc["m"]), members)
        except (KeyError, TypeError, ValueError) as e:
            raise CorruptCheckpointError(f"parity layout {name} is damaged ({e})", object=name) from e


def _padded(b: bytes | bytearray | memoryview, length: int) -> bytes | bytearray | memoryview:
    """``b`` zero-padded to ``length`` (itself, not a copy, when it is that long: zfec reads any buffer)."""
    if len(b) == length:
        return b
    out = bytearray(length)
    out[: len(b)] = b
    return out


# Bytes of a block coded as one piece. zfec lets go of the GIL while it codes, and coding is byte-position
# wise, so a rebuild decodes a large block's pieces on threads at once: training waits for a restore, and
# on one core decoding took about as long as moving the blocks. A save's encoding stays on one thread:
# it runs behind training, whose own threads want the cores.
PIECE = 8 << 20
THREADS = min(8, _cpus.usable())


def _by_piece(length: int, code: Callable[[int, int], None], piece: int, threads: int) -> None:
    """``code(start, end)`` for every piece of [0, length), on up to ``threads`` threads."""
    spans = [(a, min(length, a + piece)) for a in range(0, length, piece)]
    if len(spans) <= 1 or threads <= 1:
        for a, e in spans:
            code(a, e)
        return
    with ThreadPoolExecutor(min(threads, len(spans)), thread_name_prefix="ckpt-parity") as pool:
        for f in [pool.submit(code, a, e) for a, e in spans]:
            f.result()


def encode(k: int, m: int, blocks: Sequence[bytes | bytearray | memoryview], length: int, which: int,
           piece: int = PIECE, threads: int = 1) -> bytearray:
    """Parity block ``which`` (0..m-1) of k data blocks, each zero-padded to ``length``."""
    import zfec

    coder = zfec.Encoder(k, k + m)
    data = [memoryview(_padded(b, length)) for b in blocks]
    out = bytearray(length)

    def code(a: int, e: int) -> None:
        out[a:e] = coder.encode([d[a:e] for d in data], (k + which,))[0]

    _by_piece(length, code, piece, threads)
    return out


def decode(k: int, m: int, blocks: dict[int, bytes | bytearray | memoryview], length: int, want: int,
           piece: int = PIECE, threads: int = THREADS) -> bytes | bytearray | memoryview:
    """Data block ``want`` (0..k-1) of a stripe from any k of its blocks (block number -> bytes,
    data blocks zero-padded to ``length``)."""
    import zfec

    if want in blocks:
        return _padded(blocks[want], length)
    coder = zfec.Decoder(k, k + m)
    nums = sorted(blocks)[:k]
    data = [memoryview(_padded(blocks[b], length)) for b in nums]
    out = bytearray(length)

    def code(a: int, e: int) -> None:
        # fresh lists each call: zfec reorders the list of blocks it is given
        out[a:e] = coder.decode([d[a:e] for d in data], list(nums))[want]

    _by_piece(length, code, piece, threads)
    return out
