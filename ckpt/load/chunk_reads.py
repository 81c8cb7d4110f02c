"""Reading one chunk into what it feeds (the destinations :mod:`ckpt.load.into_state` maps it to), verified.

A raw chunk is read and hashed in one pass, straight into its destination where it feeds one
contiguous run; an encoded one is decoded (down its delta chain) into its destination or scratch.
Where a rank needs only part of a chunk and the manifest has its span digests
(:mod:`ckpt.format.spans`), only the spans that part touches are read (raw) or decoded (planes and
deltas: the tiles that cover them by the compiled core, :mod:`ckpt.format.chain_core`; without it
:mod:`ckpt.format.partial`) and each is checked against its digest; a span that does not match
sends the chunk down the whole path, where its name tells damaged bytes from wrong digests.
"""

from __future__ import annotations

import bisect
import itertools
import logging

import numpy as np

from .. import _ext
from ..errors import CorruptCheckpointError
from ..format import chains, partial, paths, spans
from ..format import manifest as mf
from ..format.chain_core import decode_chain_ranges
from ..format.chunk import HEADER_SIZE, check_header, chunk_hash, parse_header
from ..format.planes import scratch
from ..storage import Storage

log = logging.getLogger("ckpt")


def read_chunk(storage: Storage, m: mf.Manifest, h: str, feeds: list) -> int:
    """Read chunk ``h``, verify it, and copy it to what it ``feeds``; returns the bytes read."""
    info = m.chunks[h]
    if info.codec.startswith("raw/"):
        try:
            n = _read_raw(storage, paths.chunk_key(h), h, info, feeds)
        except FileNotFoundError as e:
            raise chains.missing(storage, h, m.step, e) from None
        if n is not None:
            return n
        # stored another way than the entry says (another writer's copy of the same bytes): decoded below
    blob = chains.read_object(storage, m.chunks, h, m.step, reuse=True)
    if info.spans is not None and info.codec.startswith(("planes/", "xor/")):
        if _ext.cpu() is not None:
            # The core decodes the tiles this rank's spans cover, every link of a delta's chain at once
            # (16 MiB, six links: 1.8 ms for a third of it where numpy takes 6.0 ms span by span down
            # the links and the whole chain 5.5 ms; a planes chunk's third: 1.05 ms against 1.2).
            more = _decode_ranges(storage, m, blob, h, info, feeds)
            if more is not None:
                return len(blob) + more
        if info.base is not None and _ext.cpu() is not None:
            # Where that fails or a span does not check out, the whole chain in one pass, checked by
            # its name; only where that fails too are the spans decoded link by link (damage where
            # this rank needs nothing does not stop its load).
            try:
                return len(blob) + _resolve(storage, m, h, info, blob, feeds)
            except CorruptCheckpointError as e:
                more = _decode_spans(storage, m, blob, h, info, feeds)
                if more is None:
                    raise
                log.warning("%s; the spans of it this rank needs check out, so the load goes on", e)
                return len(blob) + more
        more = _decode_spans(storage, m, blob, h, info, feeds)
        if more is not None:
            return len(blob) + more
    return len(blob) + _resolve(storage, m, h, info, blob, feeds)


def _resolve(storage: Storage, m: mf.Manifest, h: str, info: mf.ChunkInfo, blob, feeds: list) -> int:
    """Decode chunk ``h`` whole (a delta: its chain, every link verified) and copy it to what it feeds;
    returns the bytes read for the chain's other links. Decoded straight into the destination where
    the whole chunk feeds one contiguous run (staged loads: staging memory, checked before any tensor
    is written), else into scratch and copied."""
    whole = len(feeds) == 1 and feeds[0][0] == 0 and feeds[0][1] == info.size
    out = feeds[0][2][feeds[0][3] : feeds[0][3] + info.size] if whole else None
    raw, more = chains.resolve(storage, m.chunks, h, m.step, blob, out)
    if not whole:
        src = np.frombuffer(raw, dtype=np.uint8)
        for off, length, flat, pos in feeds:
            flat[pos : pos + length] = src[off : off + length]
    return more


def _read_raw(storage: Storage, key: str, h: str, info: mf.ChunkInfo, feeds: list) -> int | None:
    """Read a chunk stored raw, hashing each piece as it lands (``Storage.read_hashed``): straight
    into its destination when the whole chunk feeds one contiguous run, else into this thread's
    reused memory, whose verified bytes are then copied where they go; where only part of it is
    needed and the manifest has its span digests, only the spans that part touches. A whole chunk
    is one request, its header with it (one GET on object storage, not two); the header is checked
    before the bytes are used, and a part's header is read first. Reads land in staging memory or
    scratch, or, in an in-place load, in the tensors (as a damaged payload would). None when the
    header says the object is stored another way (the caller decodes it)."""
    size = info.size
    whole = len(feeds) == 1 and feeds[0][0] == 0 and feeds[0][1] == size
    head: bytearray | None = bytearray(HEADER_SIZE)
    runs = None if whole or info.spans is None else spans.runs([(off, n) for off, n, _, _ in feeds], size)
    # Only part of it, where the spans give a part: a storage that does not hash as it reads would
    # read every span needed in one run anyway, so a chunk needed whole is read whole (one request)
    if runs is not None and (storage.hashes_reads or sum(b - a for a, b in runs) < spans.count(size, spans.SPAN)):
        if not _raw_header(storage.read(key, 0, HEADER_SIZE), key, h, size):
            return None
        head = None
        got = _read_spans(storage, key, h, info, feeds, runs)
        if got is not None:
            return got
        # a span differs: the whole chunk is read and checked by its name, which tells damaged bytes
        # (refused below) from wrong digests (a writer's fault: logged, the bytes used)
    if whole:
        _, _, flat, pos = feeds[0]
        target = flat[pos : pos + size]
    else:
        target = scratch("raw", size)
    n, digest = storage.read_hashed(key, target, HEADER_SIZE, head)
    if head is not None and not _raw_header(head[: HEADER_SIZE + min(0, n)], key, h, size):
        return None
    if n != size:
        raise CorruptCheckpointError(f"chunk object {key} is truncated: payload is {n} bytes, header says "
                                     f"{size}", object=key, chunk=h)
    if (digest if digest is not None else chunk_hash(target)) != h:
        raise CorruptCheckpointError(f"chunk object {key} failed its hash check (content does not match {h}); the "
                                     "stored bytes are damaged", object=key, chunk=h)
    if not whole:
        for off, length, flat, pos in feeds:
            flat[pos : pos + length] = target[off : off + length]
    return HEADER_SIZE + n


def _raw_header(header: bytes | bytearray | memoryview, key: str, h: str, size: int) -> bool:
    """Check chunk ``h``'s header (refused where it names other bytes); whether it says stored raw."""
    hdr = parse_header(header, name=key)
    check_header(hdr, name=key, expect_hash=h, expect_len=size)
    return hdr.codec == "raw" and hdr.payload_len == size


def _read_spans(storage: Storage, key: str, h: str, info: mf.ChunkInfo, feeds: list,
                runs: list[tuple[int, int]]) -> int | None:
    """Read the spans of raw chunk ``h`` that ``feeds`` touch (``runs`` of them, :func:`spans.runs`),
    check each against the manifest's digest, and
    put what the feeds take where it goes. Where reads are hashed as they land (``Storage.hashes_reads``)
    each span is its own read, straight into the destination when one feed takes all of it; elsewhere
    one read per run of neighbouring spans, into scratch memory. None where a span does not match its
    digest (spans read in place may have landed: the whole read that follows writes over them or fails
    the load)."""
    assert info.spans is not None
    span, size = spans.SPAN, info.size
    if not storage.hashes_reads:
        return _read_runs(storage, key, h, info, feeds, [(a * span, min(size, b * span)) for a, b in runs])
    staged: list[tuple[int, int, int]] = []  # (span start, span end, position in scratch) of spans not read in place
    todo: list[tuple[int, int, np.ndarray | None]] = []
    for s in (s for a, b in runs for s in range(a, b)):
        lo, hi = s * span, min(size, (s + 1) * span)
        takers = [f for f in feeds if f[0] < hi and lo < f[0] + f[1]]
        off, length, flat, dpos = takers[0]
        alone = len(takers) == 1 and off <= lo and hi <= off + length  # in place only where one feed takes it all
        todo.append((lo, hi, flat[dpos + lo - off : dpos + hi - off] if alone else None))
    need = sum(hi - lo for lo, hi, target in todo if target is None)
    buf = scratch("raw", need) if need else None
    pos = 0
    for lo, hi, target in todo:
        if target is None:
            assert buf is not None
            target = buf[pos : pos + hi - lo]
            staged.append((lo, hi, pos))
            pos += hi - lo
        n, got = storage.read_hashed(key, target, HEADER_SIZE + lo)
        _check_span_length(n, hi - lo, key, h, size)
        if (got[: spans.DIGEST_HEX] if got is not None else spans.digest(target)) != info.spans[
                spans.DIGEST_HEX * (lo // span) : spans.DIGEST_HEX * (lo // span + 1)]:
            _wrong_span(key, lo // span)
            return None
    if buf is not None:
        _copy_out(feeds, staged, buf)
    return HEADER_SIZE + sum(hi - lo for lo, hi, _ in todo)


def _read_runs(storage: Storage, key: str, h: str, info: mf.ChunkInfo, feeds: list,
               runs: list[tuple[int, int]]) -> int | None:
    """:func:`_read_spans` for storage that does not hash as it reads: one read per run of spans."""
    assert info.spans is not None
    buf = scratch("raw", sum(hi - lo for lo, hi in runs))
    pos = [0, *itertools.accumulate(hi - lo for lo, hi in runs)]
    staged = [(lo, hi, at) for (lo, hi), at in zip(runs, pos)]
    got = storage.read_parts(key, [(HEADER_SIZE + lo, buf[at : at + hi - lo]) for lo, hi, at in staged])
    for (lo, hi, at), n in zip(staged, got):
        _check_span_length(n, hi - lo, key, h, info.size)
        bad = spans.mismatch(buf[at : at + hi - lo], lo // spans.SPAN, info.spans)
        if bad is not None:
            _wrong_span(key, bad)
            return None
    _copy_out(feeds, staged, buf)
    return HEADER_SIZE + pos[-1]


def _check_span_length(n: int, want: int, key: str, h: str, size: int) -> None:
    if n != want:
        raise CorruptCheckpointError(f"chunk object {key} is truncated: its payload is shorter than the {size} bytes "
                                     "its header says", object=key, chunk=h)


def _copy_out(feeds: list, staged: list[tuple[int, int, int]], buf: np.ndarray) -> None:
    """Copy what each feed takes from the byte ranges ``staged`` ((start, end, position in ``buf``),
    sorted) of the chunk; the rest of each feed was read in place."""
    ends = [hi for _, hi, _ in staged]
    for off, length, flat, dpos in feeds:
        k = bisect.bisect_right(ends, off)
        while k < len(staged) and staged[k][0] < off + length:
            lo, hi, at = staged[k]
            a, b = max(lo, off), min(hi, off + length)
            flat[dpos + a - off : dpos + b - off] = buf[at + a - lo : at + b - lo]
            k += 1


def _decode_spans(storage: Storage, m: mf.Manifest, blob, h: str, info: mf.ChunkInfo, feeds: list) -> int | None:
    """Decode only the spans of chunk ``h`` (planes, or a delta down its chain) that ``feeds``
    touch, check them against the manifest's digests and put what the feeds take where it goes;
    returns the bytes read for the chain's other links. None, nothing written, where it did not: the
    chunk is then decoded whole and checked by its name."""
    lo_hi = _span_ranges(info, feeds)
    if lo_hi is None or info.spans is None:
        return None
    buf = scratch("raw", sum(hi - lo for lo, hi in lo_hi))
    try:
        placed, more = partial.resolve_spans(storage, m.chunks, h, blob, lo_hi, buf, m.step)
    except partial.NotPartial:
        return None
    for lo, hi, at in placed:
        bad = spans.mismatch(buf[at : at + hi - lo], lo // spans.SPAN, info.spans)
        if bad is not None:
            _wrong_span(paths.chunk_key(h), bad)
            return None
    _copy_out(feeds, placed, buf)
    return more


def _decode_ranges(storage: Storage, m: mf.Manifest, blob, h: str, info: mf.ChunkInfo, feeds: list) -> int | None:
    """Decode the runs of spans of chunk ``h`` (a delta) that ``feeds`` touch with the compiled core,
    all of its chain's links at once (:func:`ckpt.format.chain_core.decode_chain_ranges`), check them
    against the manifest's digests and put what the feeds take where it goes; returns the bytes read
    for the chain's other links. None, no feed written, where it did not."""
    lo_hi = _span_ranges(info, feeds)
    if lo_hi is None or info.spans is None:
        return None
    try:
        blobs, more = chains.links(storage, m.chunks, h, m.step, blob)
    except CorruptCheckpointError:
        return None  # the whole path says what is wrong
    buf = scratch("chain", info.size)  # the chunk's place: only the runs are written
    if not decode_chain_ranges([(paths.chunk_key(x), x, data) for x, data in reversed(blobs)], info.size, buf, lo_hi):
        return None
    for lo, hi in lo_hi:
        bad = spans.mismatch(buf[lo:hi], lo // spans.SPAN, info.spans)
        if bad is not None:
            _wrong_span(paths.chunk_key(h), bad)
            return None
    _copy_out(feeds, [(lo, hi, lo) for lo, hi in lo_hi], buf)
    return more


def _span_ranges(info: mf.ChunkInfo, feeds: list) -> list[tuple[int, int]] | None:
    """The byte ranges of the runs of spans ``feeds`` touch; None where they are every span (the
    chunk is then decoded whole and checked by its name)."""
    assert info.spans is not None
    runs = spans.runs([(off, length) for off, length, _, _ in feeds], info.size)
    if sum(b - a for a, b in runs) == spans.count(info.size, spans.SPAN):
        return None
    return [(a * spans.SPAN, min(info.size, b * spans.SPAN)) for a, b in runs]


def _wrong_span(key: str, span: int) -> None:
    """A span that does not match its digest: the caller goes down the whole path (None)."""
    log.warning("chunk object %s: span %d does not match the manifest's digest; reading it whole", key, span)

