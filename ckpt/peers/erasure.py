"""Reed-Solomon parity over a group of ranks: where each byte of each rank's data goes (pure layout
math, tested without processes), and encoding/decoding one stripe with zfec.

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
from collections.abc import Sequence
from dataclasses import dataclass

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


def encode(k: int, m: int, blocks: Sequence[bytes | bytearray | memoryview], length: int, which: int) -> bytes:
    """Parity block ``which`` (0..m-1) of k data blocks, each zero-padded to ``length``."""
    import zfec

    return zfec.Encoder(k, k + m).encode([_padded(b, length) for b in blocks], (k + which,))[0]


def decode(k: int, m: int, blocks: dict[int, bytes | bytearray | memoryview], length: int) -> list[bytes]:
    """The k data blocks of a stripe from any k of its blocks (block number -> bytes, data blocks
    zero-padded to ``length``)."""
    import zfec

    nums = sorted(blocks)[:k]
    return list(zfec.Decoder(k, k + m).decode([_padded(blocks[b], length) for b in nums], nums))
