"""Adopting a chunk someone else stored: only once its content is known good.

Chunks are created, never written over, and named by their raw bytes' hash, so a writer that finds
an object under a chunk's key already (stored by an earlier run, another rank, or another job in the
same root) may list it instead of writing its own copy. The name alone proves nothing: a copy may be
half-written by a writer that died, damaged since, or planted (a valid header over any payload, or a
delta whose 32-bit check is right but whose base or bytes are not). A step that listed such a copy
would commit and never load. So a writer adopts a stored chunk only after reading it, its delta
chain with it, decoding every link and checking each one's hash (the check every reader runs on
them); where that fails it writes its own copy whole over it, which every manifest naming the chunk
can read (a whole copy ends a chain).

Chunks the writer itself wrote in this process, or verified, or loaded (its dedup table) are
trusted without a read: the cost falls only on chunks this process has never seen good.
"""

from __future__ import annotations

from collections.abc import Callable

from ..errors import CorruptCheckpointError
from ..format import chains
from ..format import manifest as mf
from ..format.chunk import HEADER_SIZE, Base, check_header, parse_header
from ..format.paths import chunk_key
from ..storage.base import Storage

Known = Callable[[str], "dict[str, mf.ChunkInfo] | None"]  # a trusted chunk's chain as the writer knows it


def describe(storage: Storage, h: str, size: int, known: Known) -> dict[str, mf.ChunkInfo]:
    """The chunk table of the stored object of chunk ``h`` and of its delta chain, from their headers
    (each must describe the chunk its key names, ``size`` raw bytes, with the object's real length),
    down to a chunk stored whole or one the writer trusts (``known``: its chain as the writer knows
    it, or None). Raises FileNotFoundError where ``h`` is not stored, and
    :class:`CorruptCheckpointError` where a header is damaged, a base is missing or the chain loops."""
    table: dict[str, mf.ChunkInfo] = {}
    x = h
    while True:
        key = chunk_key(x)
        try:
            hdr = parse_header(storage.head(key, HEADER_SIZE), name=key)
            stored = storage.size(key)
        except FileNotFoundError:
            if x == h:
                raise
            raise CorruptCheckpointError(f"chunk object {chunk_key(h)} is a delta whose chain needs {key}, which is "
                                         "not stored", object=key, chunk=x) from None
        check_header(hdr, name=key, expect_hash=x, expect_len=size, object_len=stored)
        table[x] = mf.ChunkInfo(size, stored, hdr.label, hdr.base)
        b = hdr.base
        if b is None:
            return table
        trusted = known(b)
        if trusted is not None:
            for y, info in trusted.items():
                table.setdefault(y, info)
            return table
        if b in table or len(table) > mf.MAX_CHAIN:
            raise CorruptCheckpointError(f"the delta chain of chunk object {chunk_key(h)} loops or is longer than "
                                         "any step may hold", object=chunk_key(h), chunk=h)
        x = b


def verify(storage: Storage, table: dict[str, mf.ChunkInfo], h: str) -> None:
    """Read chunk ``h`` and its chain (as its stored headers name it, within ``table``), decode each
    link and check its hash: every link is then known good, not only the chunk the chain ends in.
    Raises :class:`CorruptCheckpointError` (a missing link included) where one is not."""
    blobs, _ = chains.links(storage, table, h)
    raw: memoryview | None = None
    prev = ""
    for x, data in reversed(blobs):  # the chunk stored whole first, then each delta on it
        delta = chains.base_of(data, table, x) is not None
        raw = chains.decode_link(data, table, x, Base(raw, prev) if delta and raw is not None else None)
        prev = x


def adoptable(storage: Storage, h: str, size: int, known: Known) -> tuple[dict[str, mf.ChunkInfo] | None, bool]:
    """Whether the object stored under chunk ``h`` (``size`` raw bytes) may be adopted: (its chain's
    table, every link read and verified, False), (None, False) where nothing is stored, or (None,
    True) where what is stored is damaged or its chain broken (write a whole copy over it)."""
    try:
        table = describe(storage, h, size, known)
        verify(storage, table, h)
    except FileNotFoundError:
        return None, False
    except CorruptCheckpointError:
        return None, True
    return table, False
