"""Chunk objects: a fixed 64-byte header followed by the (possibly compressed) payload.

The header makes every chunk checkable on its own, without the manifest:

    offset size  field
    0      8     magic b"CKPTCHNK"
    8      2     chunk format version (1)
    10     1     codec id (0 raw, 1 zstd)
    11     1     flags (reserved, 0)
    12     4     reserved (0)
    16     8     raw length in bytes
    24     16    xxh3-128 digest of the raw bytes (the chunk's name is its hex form)
    40     16    digest of the delta base chunk (all zero: no base)
    56     8     payload length in bytes

Codec names in manifests carry a version, like ``zstd/1``, so an older reader refuses clearly what
it cannot decode instead of guessing.
"""

from __future__ import annotations

import re
import struct
import threading
from dataclasses import dataclass

import xxhash
import zstandard

from .errors import ConfigError, CorruptCheckpointError, IncompatibleFormatError

MAGIC = b"CKPTCHNK"
CHUNK_VERSION = 1
HEADER = struct.Struct("<8sHBBIQ16s16sQ")
HEADER_SIZE = HEADER.size  # 64
NO_BASE = bytes(16)

CODEC_IDS = {"raw": 0, "zstd": 1}
CODEC_NAMES = {v: k for k, v in CODEC_IDS.items()}
CODEC_VERSIONS = {"raw": 1, "zstd": 1}

HASH_RE = re.compile(r"^[0-9a-f]{32}$")

# "auto" compresses a sample first and keeps zstd only where it saves at least this fraction.
_AUTO_SAMPLE = 256 * 1024
_AUTO_MIN_SAVING = 0.08
_MIN_COMPRESS_SIZE = 4096


def chunk_hash(data) -> str:
    """xxh3-128 of ``data`` (any buffer) as 32 hex digits: the chunk's content address."""
    return xxhash.xxh3_128_hexdigest(data)


def is_chunk_hash(name: str) -> bool:
    return bool(HASH_RE.match(name))


@dataclass(frozen=True)
class CodecSpec:
    """What the writer should try: ``raw``, ``zstd`` (always) or ``auto`` (zstd where it pays)."""

    name: str = "auto"
    level: int = 1

    @classmethod
    def parse(cls, codec: str, level: int | None = None) -> CodecSpec:
        """Accept ``"raw"``, ``"auto"``, ``"zstd"`` or ``"zstd:<level>"``."""
        name, _, lvl = codec.partition(":")
        if name not in ("raw", "zstd", "auto"):
            raise ConfigError(f"unknown codec {codec!r}; use 'raw', 'zstd', 'zstd:<level>' or 'auto'")
        if lvl:
            try:
                level = int(lvl)
            except ValueError:
                raise ConfigError(f"codec {codec!r}: the zstd level must be an integer, e.g. 'zstd:3'") from None
        level = 1 if level is None else level
        if not -7 <= level <= 22:
            raise ConfigError(f"zstd level {level} is out of range; use -7..22 (1 is fast, 3 is zstd's default)")
        return cls(name, level)


_local = threading.local()


def _compressor(level: int) -> zstandard.ZstdCompressor:
    # zstd contexts are not thread-safe; each worker thread keeps its own per level.
    cache = getattr(_local, "cctx", None)
    if cache is None:
        cache = _local.cctx = {}
    cctx = cache.get(level)
    if cctx is None:
        cctx = cache[level] = zstandard.ZstdCompressor(level=level, write_content_size=True)
    return cctx


def _decompressor() -> zstandard.ZstdDecompressor:
    dctx = getattr(_local, "dctx", None)
    if dctx is None:
        dctx = _local.dctx = zstandard.ZstdDecompressor()
    return dctx


def encode(raw: memoryview, digest_hex: str, spec: CodecSpec) -> tuple[str, list]:
    """Encode one chunk. Returns (codec name, list of buffers: header then payload).

    The raw codec returns the caller's memoryview as the payload, so no copy is made.
    """
    n = len(raw)
    codec = "raw"
    payload: memoryview | bytes = raw
    if spec.name != "raw" and n >= _MIN_COMPRESS_SIZE:
        cctx = _compressor(spec.level)
        worth_trying = True
        if spec.name == "auto" and n > 2 * _AUTO_SAMPLE:
            start = (n // 2) & ~63
            sample = raw[start : start + _AUTO_SAMPLE]
            worth_trying = len(cctx.compress(sample)) <= len(sample) * (1 - _AUTO_MIN_SAVING)
        if worth_trying:
            packed = cctx.compress(raw)
            min_saving = _AUTO_MIN_SAVING if spec.name == "auto" else 0.0
            if len(packed) < n * (1 - min_saving):
                codec, payload = "zstd", packed
    header = HEADER.pack(
        MAGIC, CHUNK_VERSION, CODEC_IDS[codec], 0, 0, n, bytes.fromhex(digest_hex), NO_BASE, len(payload)
    )
    return codec, [header, payload]


@dataclass(frozen=True)
class ChunkHeader:
    codec: str
    raw_len: int
    digest: str
    payload_len: int


def parse_header(blob, *, name: str) -> ChunkHeader:
    """Parse and sanity-check a chunk header; ``name`` is the object for error messages."""
    if len(blob) < HEADER_SIZE:
        raise CorruptCheckpointError(
            f"chunk object {name} is truncated ({len(blob)} bytes, shorter than its header)", object=name)
    magic, version, codec_id, _flags, _res, raw_len, digest, _base, payload_len = HEADER.unpack_from(blob)
    if magic != MAGIC:
        raise CorruptCheckpointError(f"{name} is not a ckpt chunk (bad magic)", object=name)
    if version > CHUNK_VERSION:
        raise IncompatibleFormatError(
            f"chunk {name} uses chunk format v{version}; this ckpt reads v{CHUNK_VERSION}. "
            "Upgrade ckpt (pip install -U ckpt) to read it.")
    if codec_id not in CODEC_NAMES:
        raise IncompatibleFormatError(
            f"chunk {name} uses codec id {codec_id}, unknown to this ckpt; upgrade ckpt to read it")
    return ChunkHeader(CODEC_NAMES[codec_id], raw_len, digest.hex(), payload_len)


def _decompress_bounded(payload: memoryview, raw_len: int, *, name: str, expect_hash: str) -> memoryview:
    """Decompress into a buffer of the declared size, and no further: a frame that holds more than
    the header says is refused without ever producing it (python-zstandard's one-shot decompress
    trusts a size written in the frame over ``max_output_size``)."""
    out = bytearray(raw_len + 1)  # one spare byte tells "more than declared" from "exactly"
    n = 0
    try:
        with _decompressor().stream_reader(payload, read_across_frames=True) as reader, memoryview(out) as view:
            while n < len(out):
                k = reader.readinto(view[n:])
                if k == 0:
                    break
                n += k
    except zstandard.ZstdError as e:
        raise CorruptCheckpointError(f"chunk object {name} does not decompress: {e}",
                                     object=name, chunk=expect_hash) from e
    if n != raw_len:
        raise CorruptCheckpointError(
            f"chunk object {name} decompresses to {f'more than {raw_len}' if n > raw_len else n} bytes, its header "
            f"says {raw_len}; it is damaged", object=name, chunk=expect_hash)
    return memoryview(out)[:raw_len]


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
           object_len: int | None = None, raw_only: bool = False) -> memoryview:
    """The one validity check of a stored chunk; returns its raw bytes.

    ``header`` and ``payload`` are the object's first 64 bytes and the rest (two buffers, so a
    payload read straight into a caller's tensor is checked in place). The header must parse and
    name ``expect_hash``, the sizes must agree, the payload must decode, and the decoded bytes must
    hash to ``expect_hash``. ``raw_only`` refuses a compressed payload (the caller read it in place
    as raw bytes). Raises :class:`CorruptCheckpointError` naming the object."""
    hdr = parse_header(header, name=name)
    check_header(hdr, name=name, expect_hash=expect_hash, expect_len=expect_len, object_len=object_len)
    payload = memoryview(payload).cast("B")
    if len(payload) != hdr.payload_len:
        raise CorruptCheckpointError(
            f"chunk object {name} is truncated or padded: payload is {len(payload)} bytes, header says "
            f"{hdr.payload_len}", object=name, chunk=expect_hash)
    if hdr.codec == "raw":
        raw = payload
    elif raw_only:
        raise CorruptCheckpointError(
            f"chunk object {name} is stored as {hdr.codec}, its manifest entry says raw; it is damaged",
            object=name, chunk=expect_hash)
    else:
        raw = _decompress_bounded(payload, hdr.raw_len, name=name, expect_hash=expect_hash)
    if len(raw) != hdr.raw_len or chunk_hash(raw) != expect_hash:
        raise CorruptCheckpointError(
            f"chunk object {name} failed its hash check (content does not match {expect_hash}); "
            "the stored bytes are damaged", object=name, chunk=expect_hash)
    return raw


def decode(blob, *, name: str, expect_hash: str, expect_len: int | None = None) -> memoryview:
    """Check and decode a whole chunk object (header and payload in one buffer); see :func:`verify`."""
    view = memoryview(blob).cast("B")
    return verify(name, expect_hash, view[:HEADER_SIZE], view[HEADER_SIZE:], expect_len=expect_len)


def verify_object(key: str, parts: list[memoryview]) -> None:
    """:func:`verify` for a chunk object read by its storage key, which ends in its hash: the check
    a storage tier uses before trusting a copy it holds. ``parts`` are the object's bytes in order,
    as read (one buffer, or the header and payload buffers of a read straight into place)."""
    views = [memoryview(p).cast("B") for p in parts]
    if len(views) == 2 and len(views[0]) == HEADER_SIZE:
        header, payload = views
    else:
        whole = views[0] if len(views) == 1 else memoryview(b"".join(views))
        header, payload = whole[:HEADER_SIZE], whole[HEADER_SIZE:]
    verify(key, key.rsplit("/", 1)[-1], header, payload)
