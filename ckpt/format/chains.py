"""Reading chunks that may be deltas: a delta chunk (codec ``xor``) is decoded from its base's raw
bytes, so reading it means reading its chain, down to the chunk stored whole.

A manifest's chunk table names every base (``ChunkInfo.base``) and the manifest parser
(:func:`ckpt.format.entries.check_chains`) has checked the chains end within ``MAX_CHAIN`` links;
here each link's header must agree with the table (or say the chunk is stored whole: a copy written
again whole ends the chain early). The compiled core decodes the chain in one pass and checks the
result's hash; where that fails, or without the core, every link is decoded and verified by its own
hash in turn (so an error names the damaged link). Reads stay bounded by what the table declares: at
most the chain's stored sizes, one chain at a time per thread.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Any

import numpy as np

from ..errors import CorruptCheckpointError
from ..storage.base import Storage
from . import manifest as mf
from . import spans
from .chain_core import decode_chain
from .chunk import HEADER_SIZE, Base, check_header, decode, max_stored, parse_header
from .paths import chunk_key
from .planes import scratch

MAX_READ_FACTOR = 64  # a chain may hold at most this times its chunk's size (the largest delta_budget)


def read_limit(info: mf.ChunkInfo) -> int:
    """The most bytes the object of a chunk described by ``info`` may hold: what any codec may need
    for its raw size (:func:`~ckpt.format.chunk.max_stored`; a copy written again by another writer
    may be stored another way than the entry says, as a chunk's name is its raw bytes' hash), never
    the entry's own stored size where that claims more: a manifest cannot make a reader take in a
    padded object."""
    return max_stored(info.size)


class MissingChunkError(CorruptCheckpointError):
    """A chunk object a step references is not stored (damage, told apart from a bad copy by verify)."""


def missing(storage: Storage, h: str, step: int | None, e: Exception) -> MissingChunkError:
    key = chunk_key(h)
    whose = f" referenced by step {step}" if step is not None else ""
    return MissingChunkError(f"chunk object {key}{whose} is missing from {storage.describe()} ({e}); the step is "
                             "damaged", object=key, chunk=h)


def read_object(storage: Storage, chunks: dict[str, mf.ChunkInfo], h: str, step: int | None,
                reuse: bool = False) -> bytes | bytearray | memoryview:
    """Chunk ``h``'s stored object, never more than :func:`read_limit`. A missing object is damage.
    ``reuse``: into this thread's reused memory where the storage can (valid until this thread
    reads the next object that way; never for reads on a shared pool, like a chain's prefetch)."""
    info = chunks[h]
    key = chunk_key(h)
    limit = read_limit(info)
    blob: bytes | bytearray | memoryview | None
    try:
        blob = storage.read_object_into(key, limit) if reuse else None
        if blob is None:
            blob = storage.read_object(key, limit)
    except FileNotFoundError as e:
        raise missing(storage, h, step, e) from None
    if len(blob) > limit:
        raise CorruptCheckpointError(
            f"chunk object {key} is larger than any form of the {info.size}-byte chunk its manifest entry "
            "describes; it is damaged", object=key, chunk=h)
    return blob


def decode_link(blob, chunks: dict[str, mf.ChunkInfo], h: str, base: Base | None, out=None) -> memoryview:
    """Check and decode one stored chunk; a delta's ``base`` must be the verified raw of the base its
    header names. ``out``: where to decode (see codec.verify)."""
    return decode(blob, name=chunk_key(h), expect_hash=h, expect_len=chunks[h].size, base=base, out=out)


def base_of(blob, chunks: dict[str, mf.ChunkInfo], h: str) -> str | None:
    """The base chunk ``h``'s stored header names (None: stored whole). It must be in the table, so
    the step keeps it (usually it is the entry's own base; where several writers stored the same
    chunk differently, the copy that stayed may be another rank's delta, whose base that rank's
    part of the table lists). The header must describe the chunk the table does, with the object's
    real length: nothing is allocated for a chain until every link of it agrees on its size."""
    key = chunk_key(h)
    hdr = parse_header(memoryview(blob)[:HEADER_SIZE], name=key)
    check_header(hdr, name=key, expect_hash=h, expect_len=chunks[h].size, object_len=len(blob))
    if hdr.base is not None and hdr.base not in chunks:
        raise CorruptCheckpointError(
            f"chunk object {key} is a delta of {hdr.base}, which its step does not list; it is damaged",
            object=key, chunk=h)
    return hdr.base


_prefetch: ThreadPoolExecutor | None = None
_prefetch_lock = threading.Lock()


def _pool() -> ThreadPoolExecutor:
    """Threads that read a chain's links at once (its own pool: the caller runs on the I/O pool)."""
    global _prefetch
    with _prefetch_lock:
        if _prefetch is None:
            _prefetch = ThreadPoolExecutor(16, thread_name_prefix="ckpt-links")
        return _prefetch


def _forget_pool() -> None:
    global _prefetch
    _prefetch = None  # a forked child has none of its parent's threads: it makes its own


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool)


def resolve(storage: Storage, chunks: dict[str, mf.ChunkInfo], h: str, step: int | None = None,
            blob: bytes | bytearray | memoryview | None = None, out: np.ndarray | None = None
            ) -> tuple[memoryview, int]:
    """The raw bytes of chunk ``h`` (its chain read, decoded and verified) and the bytes read.
    ``blob`` is ``h``'s object when the caller has read it already. Once its header says it is a
    delta, the rest of the chain the table names is read at once (two round trips of latency, not
    one per link); each header must then name the next, or say the chunk is whole (the chain ends
    there). At most MAX_CHAIN links and MAX_READ_FACTOR times the chunk's size are read. The bytes
    may lie in this thread's scratch memory: use them before this thread resolves another chunk.
    ``out`` (uint8, the chunk's size): decode there instead (a load's destination: no copy after)."""
    blobs, read = links(storage, chunks, h, step, blob)
    size = chunks[h].size
    work = scratch("chain", size) if out is None else out
    # At once where the compiled core can: one pass over the chunk, only the result hashed. Where that
    # fails, link by link, each link verified, so the error names the damaged one.
    if len(blobs) > 1 and decode_chain([(chunk_key(x), x, data) for x, data in reversed(blobs)], size, work):
        return work[:size].data, read
    # The whole chunk is decoded into scratch memory, then each delta XORs into those same bytes in
    # place (where a delta is zero, its base's bytes are left as they are); each link's hash is checked.
    # Its size is what the table, the parsed manifest's tensors and every link's header agree on.
    (x, data), rest = blobs[-1], blobs[-2::-1]
    raw = decode_link(data, chunks, x, None, work)
    if (rest or out is not None) and not np.shares_memory(np.frombuffer(raw, np.uint8), work):
        work[:] = np.frombuffer(raw, np.uint8)  # stored raw: the payload itself came back
        raw = work.data
    prev = x
    for x, data in rest:
        raw = decode_link(data, chunks, x, Base(raw, prev) if base_of(data, chunks, x) is not None else None, work)
        prev = x
    assert raw is not None
    return raw, read


def links(storage: Storage, chunks: dict[str, mf.ChunkInfo], h: str, step: int | None = None,
          blob: bytes | bytearray | memoryview | None = None) -> tuple[list[tuple[str, Any]], int]:
    """The stored objects of chunk ``h``'s chain, ``h`` first, down to the one stored whole, each
    header checked against the table (see :func:`resolve`), and the bytes read."""
    size = chunks[h].size
    budget = MAX_READ_FACTOR * size + (1 << 20)
    first = blob if blob is not None else read_object(storage, chunks, h, step)
    blobs = [(h, first)]
    read = len(first) if blob is None else 0
    b = base_of(first, chunks, h)
    ahead = {x: _pool().submit(read_object, storage, chunks, x, step) for x in (mf.chain(chunks, b) if b else ())}
    try:
        while b is not None:
            if len(blobs) > mf.MAX_CHAIN or read > budget:
                raise CorruptCheckpointError(f"the delta chain of chunk {h} is longer than any step may hold",
                                             object=chunk_key(h), chunk=h)
            data = ahead[b].result() if b in ahead else read_object(storage, chunks, b, step)
            blobs.append((b, data))
            read += len(data)
            b = base_of(data, chunks, b)
    finally:
        running = [f for f in ahead.values() if not f.cancel()]
        wait(running)  # nothing of this chain is read after it returns
    return blobs, read


def trees(chunks: dict[str, mf.ChunkInfo], hashes) -> tuple[list[str], dict[str, list[str]]]:
    """The chunks ``hashes`` (a closed set: every base included) as trees: the chunks stored whole
    (roots) and, per chunk, the deltas made on it."""
    roots: list[str] = []
    children: dict[str, list[str]] = {}
    for h in hashes:
        b = chunks[h].base
        if b is None:
            roots.append(h)
        else:
            children.setdefault(b, []).append(h)
    return roots, children


def walk(storage: Storage, chunks: dict[str, mf.ChunkInfo], root: str, children: dict[str, list[str]],
         visit: Callable[[str, int, Exception | None, str | None], None],
         span_check: Callable[[str, Any], Exception | None] | None = None) -> None:
    """Read and verify ``root`` and every delta made on it, depth first (memory: one raw chunk per
    level), calling ``visit(hash, bytes read, error or None, the base its stored header names or
    None)`` for each; a chunk that checks out is then checked by ``span_check(hash, raw bytes)``
    (default: against the span digests ``chunks`` lists). A delta whose base failed is reported with
    that failure (it cannot be decoded). A chunk stored as a delta of another base than the one the
    tree hands it (another writer's copy) is decoded down its own chain, as a load would."""
    check = span_check or (lambda h, raw: span_error(h, raw, (chunks[h].spans,) if h in chunks else ()))
    stack: list[tuple[str, Base | None, Exception | None]] = [(root, None, None)]
    while stack:
        h, base, inherited = stack.pop()
        named: str | None = None
        raw: memoryview | None = None
        if inherited is not None:
            visit(h, 0, CorruptCheckpointError(f"chunk {h} cannot be decoded: its base is damaged ({inherited})",
                                               object=chunk_key(h), chunk=h), None)
            err: Exception | None = inherited
        else:
            n = 0
            try:
                blob = read_object(storage, chunks, h, None)
                n = len(blob)
                named = base_of(blob, chunks, h)
                if named is not None and (base is None or base.digest != named):
                    own, more = resolve(storage, chunks, h, None, blob)
                    raw, n = memoryview(bytes(own)), n + more  # resolve's bytes are scratch memory
                else:
                    raw = decode_link(blob, chunks, h, base if named is not None else None)
                err = None
            except Exception as e:  # reported per chunk; the walk goes on
                raw, err = None, e
            visit(h, n, err if raw is None else check(h, raw), named)
        for c in children.get(h, ()):
            stack.append((c, Base(raw, h) if raw is not None else None, err))


def span_error(h: str, raw, listed, steps: dict[str, list[int]] | None = None) -> CorruptCheckpointError | None:
    """A chunk whose bytes check out against its name but not against span digests a manifest lists
    for it (``listed``: each distinct digest string; ``steps``: the steps listing each, for the
    message): a load needing part of it would find a span wrong and read it whole; the manifest is at
    fault."""
    for digests in listed:
        if digests is None or (bad := spans.mismatch(raw, 0, digests)) is None:
            continue
        which = f" in step(s) {steps[digests]}" if steps and digests in steps else ""
        return CorruptCheckpointError(
            f"chunk {h} matches its name, but span {bad} does not match the digest the manifest lists for it{which} "
            "(the manifest's span digests are wrong; loads still read the chunk whole and use it)",
            object=chunk_key(h), chunk=h)
    return None
