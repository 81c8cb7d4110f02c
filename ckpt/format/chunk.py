"""Chunk objects: a fixed 64-byte header followed by the (possibly compressed) payload.

The header makes every chunk checkable on its own, without the manifest:

    offset size  field
    0      8     magic b"CKPTCHNK"
    8      2     chunk format version (1; 2 where a planes/xor section is rANS-coded; 3 with a zero mask)
    10     1     codec id (0 raw, 1 zstd, 2 planes, 3 xor)
    11     1     planes, xor: element width of the byte planes (bits 0-4), zero mask (bit 6, v3),
                 elements rotated (bit 7)
    12     4     xor: low 32 bits of the payload's xxh3-64 (a check that needs no base); 0 otherwise
    16     8     raw length in bytes
    24     16    xxh3-128 digest of the raw bytes (the chunk's name is its hex form)
    40     16    xor: digest of the base chunk (all zero: no base)
    56     8     payload length in bytes

Codecs (their names in manifests carry a version, like ``zstd/1``, so an older reader refuses
clearly what it cannot decode instead of guessing):

* ``raw``: the bytes as they are.
* ``zstd``: one zstd frame.
* ``planes``: the bytes of each w-byte element split into w planes (plane 0 the least significant
  byte of every element), each plane its own zstd frame or stored as it is, whichever is smaller;
  floats compress in their sign/exponent plane, hardly at all in the others.
* ``xor``: the chunk XOR its base (the chunk at the same place in this rank's previous save), then
  planes. Unchanged bits become zero bits; partly frozen or sparsely updated state nearly vanishes.

``planes`` and ``xor`` payloads start with a table of w + 1 little-endian u64 (bit 63: the section is
a zstd frame; bit 62, format v2: a rANS section, :mod:`ckpt.format.rans`; the rest: its stored
length), for the w planes and the n mod w tail bytes (stored as they are), then the sections in that
order. A chunk with a rANS section is written as format v2 and named ``planes/2`` / ``xor/2`` in
manifests, so an older ckpt refuses it by name instead of misreading it; the rest stay v1.

A chunk with a zero mask (format v3, ``planes/3`` / ``xor/3``; :mod:`ckpt.format.mask`) stores only
its nonzero elements in the planes: its table has w + 3 entries, the count k of elements kept, then
the mask's section (one bit per element, ceil((n // w) / 8) bytes, coded like a plane), the w planes
of k bytes each and the tail, then the sections in that order.

Encoding (choosing a codec per chunk) is the writer's business: :mod:`ckpt.save.encode`.
"""

from __future__ import annotations

import re
import struct
import threading
from dataclasses import dataclass

import numpy as np
import xxhash
import zstandard

from .. import _ext
from ..errors import CorruptCheckpointError, IncompatibleFormatError
from . import mask, rans
from .planes import LENGTH_MASK, RANS, RANS_FLAG, ROTATES, STORED, ZSTD, ZSTD_FLAG, scratch, sections, u8, ungroup_parts

_local = threading.local()


MAGIC = b"CKPTCHNK"

CHUNK_VERSION = 3  # the newest this ckpt reads and writes (1: no rANS sections; 2: no zero masks)

HEADER = struct.Struct("<8sHBBIQ16s16sQ")

HEADER_SIZE = HEADER.size  # 64

NO_BASE = bytes(16)

CODEC_IDS = {"raw": 0, "zstd": 1, "planes": 2, "xor": 3}

CODEC_NAMES = {v: k for k, v in CODEC_IDS.items()}

CODEC_VERSIONS = {"raw": 1, "zstd": 1, "planes": 3, "xor": 3}

PLANED = ("planes", "xor")

MAX_WIDTH = 16

ROTATED = 0x80  # header flags bit: the planes are of elements rotated left one bit

MASKED = 0x40  # ... the planes hold the nonzero elements only, after a zero mask (format v3)

MAX_RAW = 1 << 34  # no chunk holds more (manifest.MAX_CHUNK_BYTES): a header that says so is damaged


def max_stored(raw_len: int) -> int:
    """The most bytes the object of a chunk of ``raw_len`` raw bytes may hold, header included, whatever
    its codec: raw; planes and xor, whose sections are never stored larger than their plane (an encoder
    keeps a plane that would not shrink as it is) behind a table of at most MAX_WIDTH + 1 entries; zstd,
    kept only where smaller, and at worst zstd's own bound (n + n/256 + 64 KiB is above it). A reader
    reads no more than this, whatever a manifest claims: a padded object is refused before it is read."""
    return HEADER_SIZE + raw_len + 8 * (MAX_WIDTH + 1) + raw_len // 128 + (64 << 10)

HASH_RE = re.compile(r"^[0-9a-f]{32}$")

def chunk_hash(data) -> str:
    """xxh3-128 of ``data`` (any buffer) as 32 hex digits: the chunk's content address."""
    return xxhash.xxh3_128_hexdigest(data)


def is_chunk_hash(name: str) -> bool:
    return bool(HASH_RE.match(name))


def _decompressor() -> zstandard.ZstdDecompressor:
    dctx = getattr(_local, "dctx", None)
    if dctx is None:
        dctx = _local.dctx = zstandard.ZstdDecompressor()
    return dctx


@dataclass(frozen=True)
class Base:
    """The raw bytes of a delta's base chunk and their digest (hex); ``room``: the most payload bytes
    a delta on it may take (what is left of the chain's read budget), None for no limit."""

    raw: memoryview
    digest: str
    room: int | None = None


@dataclass(frozen=True)
class ChunkHeader:
    codec: str
    raw_len: int
    digest: str
    payload_len: int
    width: int = 0
    base: str | None = None  # hex digest of the base chunk (xor)
    check: int = 0
    rot: bool = False  # planes, xor: elements rotated left one bit before grouping
    version: int = 1  # chunk format version
    masked: bool = False  # planes, xor: a zero mask, then the nonzero elements' planes (v3)

    @property
    def label(self) -> str:
        """The codec as manifests name it: ``planes/2`` where a section is rANS-coded, ``planes/3``
        with a zero mask."""
        return f"{self.codec}/{max(1, self.version) if self.codec in PLANED else 1}"


def parse_header(blob, *, name: str) -> ChunkHeader:
    """Parse and sanity-check a chunk header; ``name`` is the object for error messages."""
    if len(blob) < HEADER_SIZE:
        raise CorruptCheckpointError(
            f"chunk object {name} is truncated ({len(blob)} bytes, shorter than its header)", object=name)
    magic, version, codec_id, flags, check, raw_len, digest, base, payload_len = HEADER.unpack_from(blob)
    if magic != MAGIC:
        raise CorruptCheckpointError(f"{name} is not a ckpt chunk (bad magic)", object=name)
    if raw_len > MAX_RAW or HEADER_SIZE + payload_len > max_stored(raw_len):
        raise CorruptCheckpointError(f"chunk object {name} claims {raw_len} raw bytes in a payload of {payload_len}: "
                                     "more than any chunk holds, or than any codec stores its raw bytes in; it is "
                                     "damaged", object=name)
    if version > CHUNK_VERSION:
        raise IncompatibleFormatError(
            f"chunk {name} uses chunk format v{version}; this ckpt reads v{CHUNK_VERSION}. "
            "Upgrade ckpt (pip install -U ckpt) to read it.")
    if codec_id not in CODEC_NAMES:
        raise IncompatibleFormatError(
            f"chunk {name} uses codec id {codec_id}, unknown to this ckpt; upgrade ckpt to read it")
    codec = CODEC_NAMES[codec_id]
    rot, masked, width = bool(flags & ROTATED), bool(flags & MASKED), flags & ~(ROTATED | MASKED)
    if codec in PLANED and (not 1 <= width <= MAX_WIDTH or (rot and width not in ROTATES)
                            or (masked and (width not in mask.WIDTHS or version < 3))):
        raise CorruptCheckpointError(f"chunk object {name} declares byte planes of width {width}"
                                     f"{' (rotated)' if rot else ''}{' with a zero mask' if masked else ''}"
                                     f" in format v{version}; it is damaged", object=name)
    if (codec == "xor") != (base != NO_BASE):
        raise CorruptCheckpointError(f"chunk object {name} is stored as {codec} "
                                     f"{'without' if codec == 'xor' else 'with'} a base chunk; it is damaged",
                                     object=name)
    return ChunkHeader(codec, raw_len, digest.hex(), payload_len, width if codec in PLANED else 0,
                       base.hex() if codec == "xor" else None, check, rot and codec in PLANED, version,
                       masked and codec in PLANED)


def _decompress_into(payload, out: memoryview, *, name: str, expect_hash: str) -> None:
    """Decompress ``payload`` into exactly ``out``, and no further: a frame that holds more than the
    header says is refused without ever producing it (python-zstandard's one-shot decompress
    trusts a size written in the frame over ``max_output_size``)."""
    raw_len = len(out)
    spare = bytearray(1)  # one spare byte tells "more than declared" from "exactly"
    n = 0
    try:
        with _decompressor().stream_reader(payload, read_across_frames=True) as reader:
            while n < raw_len:
                k = reader.readinto(out[n:])
                if k == 0:
                    break
                n += k
            if n == raw_len and reader.readinto(spare) > 0:
                n += 1
    except zstandard.ZstdError as e:
        raise CorruptCheckpointError(f"chunk object {name} does not decompress: {e}",
                                     object=name, chunk=expect_hash) from e
    if n != raw_len:
        raise CorruptCheckpointError(
            f"chunk object {name} decompresses to {f'more than {raw_len}' if n > raw_len else n} bytes, its header "
            f"says {raw_len}; it is damaged", object=name, chunk=expect_hash)


def _decompress_bounded(payload: memoryview, raw_len: int, *, name: str, expect_hash: str) -> memoryview:
    out = bytearray(raw_len)
    _decompress_into(payload, memoryview(out), name=name, expect_hash=expect_hash)
    return memoryview(out)


def section_table(hdr: ChunkHeader, payload: memoryview, *, name: str, expect_hash: str
                   ) -> list[tuple[int, memoryview, int]]:
    """The sections of a planes/xor payload: (how it is kept: STORED, ZSTD or RANS; stored bytes;
    decoded length), checked to fit the payload and the raw length: the w planes, the tail and, with a
    zero mask, the mask last (the planes then hold the kept elements only: their decoded length)."""
    w = hdr.width
    bad = CorruptCheckpointError(f"chunk object {name} has a damaged section table", object=name, chunk=expect_hash)
    head = w + 3 if hdr.masked else w + 1
    if len(payload) < 8 * head:
        raise bad
    table = np.frombuffer(payload[:8 * head], "<u8").tolist()
    pos = 8 * head
    wants = sections(hdr.raw_len, w)
    if hdr.masked:
        m, k = hdr.raw_len // w, table.pop(0)
        if k > m:
            raise bad
        wants = [mask.mask_bytes(m)] + [k] * w + wants[w:]
    out = []
    for entry, want in zip(table, wants):
        zstd, coded, length = bool(entry & ZSTD_FLAG), bool(entry & RANS_FLAG), entry & LENGTH_MASK
        how = ZSTD if zstd else RANS if coded else STORED
        if (zstd and coded) or (coded and hdr.version < 2) or pos + length > len(payload) \
                or (how == STORED and length != want):
            raise bad
        out.append((how, payload[pos:pos + length], want))
        pos += length
    if pos != len(payload):
        raise bad
    return out[1:] + out[:1] if hdr.masked else out


def unpack_section(how: int, stored: memoryview, dst: np.ndarray, *, name: str, expect_hash: str) -> None:
    """Decode a zstd or rANS section into exactly ``dst``."""
    if how == ZSTD:
        _decompress_into(stored, dst.data, name=name, expect_hash=expect_hash)
        return
    try:
        rans.decode_into(stored, dst)
    except rans.RansError as e:
        raise CorruptCheckpointError(f"chunk object {name} has a rANS section that does not decode: {e}",
                                     object=name, chunk=expect_hash) from None


def xor_check(header, parts) -> int:
    """The check a delta carries for readers without its base: the low 32 bits of the xxh3-64 of its
    header (the check field taken as zero) and payload."""
    h = xxhash.xxh3_64()
    head = bytearray(header[:HEADER_SIZE])
    head[12:16] = bytes(4)
    h.update(head)
    for p in parts:
        h.update(p)
    return h.intdigest() & 0xFFFFFFFF


def _decode_planes(hdr: ChunkHeader, payload: memoryview, base, out: np.ndarray | None, *, name: str,
                   expect_hash: str) -> tuple[memoryview, str | None]:
    """Planes (each decompressed into scratch, or read where it lies in the payload) back into
    element order in ``out`` (fresh memory when None), XOR ``base`` for a delta. Returns the bytes and,
    where the compiled core hashed them as it wrote them, their digest (else None). The core decodes
    rANS-coded planes a tile at a time as it interleaves them, instead of into scratch first."""
    n, w = hdr.raw_len, hdr.width
    out = np.empty(n, np.uint8) if out is None else out[:n]
    if hdr.masked:
        return _decode_masked(hdr, payload, None if base is None else u8(base), out, name=name,
                              expect_hash=expect_hash), None
    core = _ext.cpu()
    planes: list[np.ndarray] = []
    coded: list[bool] = []
    for i, (how, stored, length) in enumerate(section_table(hdr, payload, name=name, expect_hash=expect_hash)):
        if how == RANS and core is not None and i < w:
            planes.append(u8(stored))
        elif how != STORED:
            dst = scratch(f"plane{i}", length)
            unpack_section(how, stored, dst, name=name, expect_hash=expect_hash)
            planes.append(dst)
        else:
            planes.append(u8(stored) if length else np.empty(0, np.uint8))
        coded.append(how == RANS and core is not None and i < w)
    if core is None:
        ungroup_parts(planes, base, w, out, hdr.rot)
        return out.data, None
    err, digest = core.planes_decode(planes[:w], coded[:w], planes[w], None if base is None else u8(base), out,
                                     hdr.rot)
    if err:
        raise CorruptCheckpointError(f"chunk object {name} has a rANS section that does not decode: "
                                     f"{rans.error_text(err)}", object=name, chunk=expect_hash)
    return out.data, digest


def _decode_masked(hdr: ChunkHeader, payload: memoryview, base: np.ndarray | None, out: np.ndarray, *, name: str,
                   expect_hash: str) -> memoryview:
    """A chunk with a zero mask into ``out``: its kept elements' planes decoded and put back in element
    order in scratch, then spread over the zeros by the mask, XOR ``base`` (which may be ``out``)."""
    n, w = hdr.raw_len, hdr.width
    m = n // w
    table = section_table(hdr, payload, name=name, expect_hash=expect_hash)
    k = table[0][2]
    parts = [_unpacked(sec, f"plane{i}", name, expect_hash) for i, sec in enumerate(table[:w + 2])]
    kept = scratch("kept", k * w)
    if k:
        ungroup_parts(parts[:w] + [parts[w][:0]], None, w, kept, hdr.rot)
    if not mask.expand(parts[w + 1], kept, k, w, None if base is None else base[:m * w], out[:m * w]):
        raise CorruptCheckpointError(f"chunk object {name} has a zero mask that does not keep the {k} elements its "
                                     "table says; it is damaged", object=name, chunk=expect_hash)
    tail = parts[w]
    if base is None:
        out[m * w:] = tail
    else:
        np.bitwise_xor(tail, base[m * w:n], out=out[m * w:])
    return out.data


def _unpacked(section: tuple[int, memoryview, int], key: str, name: str, expect_hash: str) -> np.ndarray:
    """A section's decoded bytes: where they lie when stored as they are, else decoded into scratch."""
    how, stored, length = section
    if how == STORED:
        return u8(stored) if length else np.empty(0, np.uint8)
    dst = scratch(key, length)
    unpack_section(how, stored, dst, name=name, expect_hash=expect_hash)
    return dst


def check_header(hdr: ChunkHeader, *, name: str, expect_hash: str, expect_len: int | None = None,
                 object_len: int | None = None) -> None:
    """Does a parsed header describe the chunk a manifest names? ``object_len`` is the stored
    object's size where the caller knows it (header + payload must add up to it)."""
    if hdr.digest != expect_hash:
        raise CorruptCheckpointError(
            f"chunk object {name} has header hash {hdr.digest}, expected {expect_hash}", object=name, chunk=expect_hash)
    if expect_len is not None and hdr.raw_len != expect_len:
        raise CorruptCheckpointError(
            f"chunk object {name} holds {hdr.raw_len} raw bytes, the manifest says {expect_len}",
            object=name, chunk=expect_hash)
    if object_len is not None and object_len != HEADER_SIZE + hdr.payload_len:
        raise CorruptCheckpointError(
            f"chunk object {name} is truncated or padded: {object_len} bytes stored, its header says "
            f"{HEADER_SIZE + hdr.payload_len}", object=name, chunk=expect_hash)


def verify(name: str, expect_hash: str, header, payload, *, expect_len: int | None = None,
           object_len: int | None = None, raw_only: bool = False, base: Base | None = None,
           out: np.ndarray | None = None) -> memoryview:
    """The one validity check of a stored chunk; returns its raw bytes.

    ``header`` and ``payload`` are the object's first 64 bytes and the rest (two buffers, so a
    payload read straight into a caller's tensor is checked in place). The header must parse and
    name ``expect_hash``, the sizes must agree, the payload must decode, and the decoded bytes must
    hash to ``expect_hash``. A delta (``xor``) needs its ``base``, already verified, whose digest
    its header must name. ``raw_only`` refuses a compressed payload (the caller read it in place
    as raw bytes). ``out`` (uint8, at least the raw length) receives decoded bytes where given; a
    delta's ``out`` may be its base's own bytes (decoded in place). Raises
    :class:`CorruptCheckpointError` naming the object."""
    hdr = parse_header(header, name=name)
    check_header(hdr, name=name, expect_hash=expect_hash, expect_len=expect_len, object_len=object_len)
    payload = memoryview(payload).cast("B")
    if len(payload) != hdr.payload_len:
        raise CorruptCheckpointError(
            f"chunk object {name} is truncated or padded: payload is {len(payload)} bytes, header says "
            f"{hdr.payload_len}", object=name, chunk=expect_hash)
    digest = None  # where decoding hashed the bytes as it wrote them
    if hdr.codec == "raw":
        raw = payload
    elif raw_only:
        raise CorruptCheckpointError(
            f"chunk object {name} is stored as {hdr.codec}, its manifest entry says raw; it is damaged",
            object=name, chunk=expect_hash)
    elif hdr.codec == "zstd":
        if out is None:
            raw = _decompress_bounded(payload, hdr.raw_len, name=name, expect_hash=expect_hash)
        else:
            raw = out[:hdr.raw_len].data
            _decompress_into(payload, raw, name=name, expect_hash=expect_hash)
    elif hdr.codec == "planes":
        raw, digest = _decode_planes(hdr, payload, None, out, name=name, expect_hash=expect_hash)
    else:
        if base is None or base.digest != hdr.base or len(base.raw) != hdr.raw_len:
            raise CorruptCheckpointError(
                f"chunk object {name} is a delta of chunk {hdr.base}, which its manifest does not give it as its "
                "base; it is damaged", object=name, chunk=expect_hash)
        if xor_check(header, [payload]) != hdr.check:
            raise CorruptCheckpointError(f"chunk object {name} failed its payload check; the stored bytes are damaged",
                                         object=name, chunk=expect_hash)
        raw, digest = _decode_planes(hdr, payload, base.raw, out, name=name, expect_hash=expect_hash)
    if len(raw) != hdr.raw_len or (digest if digest is not None else chunk_hash(raw)) != expect_hash:
        raise CorruptCheckpointError(
            f"chunk object {name} failed its hash check (content does not match {expect_hash}); "
            "the stored bytes are damaged", object=name, chunk=expect_hash)
    return raw


def decode(blob, *, name: str, expect_hash: str, expect_len: int | None = None, base: Base | None = None,
           out: np.ndarray | None = None) -> memoryview:
    """Check and decode a whole chunk object (header and payload in one buffer); see :func:`verify`."""
    view = memoryview(blob).cast("B")
    return verify(name, expect_hash, view[:HEADER_SIZE], view[HEADER_SIZE:], expect_len=expect_len, base=base,
                  out=out)


def verify_object(key: str, parts: list[memoryview]) -> None:
    """The check a storage tier uses before trusting a copy of a chunk object it holds, read by its
    storage key (which ends in its hash). ``parts`` are the object's bytes in order, as read (one
    buffer, or the header and payload buffers of a read straight into place). A delta cannot be
    decoded without its base: its payload checksum, section table and frames are checked instead
    (the reader checks the decoded chunk's hash once its chain is resolved)."""
    views = [memoryview(p).cast("B") for p in parts]
    if len(views) == 2 and len(views[0]) == HEADER_SIZE:
        header, payload = views
    else:
        whole = views[0] if len(views) == 1 else memoryview(b"".join(views))
        header, payload = whole[:HEADER_SIZE], whole[HEADER_SIZE:]
    expect = key.rsplit("/", 1)[-1]
    hdr = parse_header(header, name=key)
    if hdr.codec != "xor":
        verify(key, expect, header, payload)
        return
    check_header(hdr, name=key, expect_hash=expect, object_len=HEADER_SIZE + len(payload))
    if xor_check(header, [payload]) != hdr.check:
        raise CorruptCheckpointError(f"chunk object {key} failed its payload check; the stored bytes are damaged",
                                     object=key, chunk=expect)
    table = section_table(hdr, payload, name=key, expect_hash=expect)
    for how, stored, length in table:
        if how == ZSTD:
            _check_frames(stored, length, name=key, expect_hash=expect)
        elif how == RANS:  # bounded: a section decodes to its plane's length, at most the chunk's
            unpack_section(how, stored, scratch("frames", length), name=key, expect_hash=expect)
    if hdr.masked:  # the mask must keep exactly the count its table gives, and no element past the last
        bits = _unpacked(table[-1], "frames", key, expect)
        m = hdr.raw_len // hdr.width
        if int(mask.POPCOUNT[bits].sum(dtype=np.int64)) != table[0][2] or (m % 8 and int(bits[-1]) >> m % 8):
            raise CorruptCheckpointError(f"chunk object {key} has a zero mask that does not keep the "
                                         f"{table[0][2]} elements its table says; it is damaged", object=key,
                                         chunk=expect)


def _check_frames(payload, length: int, *, name: str, expect_hash: str) -> None:
    """Do ``payload``'s zstd frames decompress to exactly ``length`` bytes? Checked in 1 MiB pieces,
    so a header that claims a huge size costs no memory."""
    piece = scratch("frames", 1 << 20)
    n = 0
    try:
        with _decompressor().stream_reader(payload, read_across_frames=True) as reader:
            while n <= length:
                k = reader.readinto(piece.data)
                if k == 0:
                    break
                n += k
    except zstandard.ZstdError as e:
        raise CorruptCheckpointError(f"chunk object {name} does not decompress: {e}", object=name,
                                     chunk=expect_hash) from e
    if n != length:
        raise CorruptCheckpointError(f"chunk object {name} has a section that decompresses to "
                                     f"{f'more than {length}' if n > length else n} bytes, its table says {length}",
                                     object=name, chunk=expect_hash)
