"""Loading a committed step into the caller's state, in place, checking every chunk's hash.

Everything that can be checked before reading data is checked first (keys, shapes, dtypes,
pickle), so a mismatch costs no I/O and changes nothing. Then every chunk the state needs is read
once, in parallel, verified and scattered into the destination tensors; a raw chunk that maps onto
one contiguous piece of one CPU tensor is read straight into that tensor (no second copy). Only
when every tensor is filled are ``load_state_dict`` calls made and plain values assigned.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from . import manifest as mf
from .codec import HEADER_SIZE, chunk_hash, decode as decode_chunk, parse_header
from .errors import CorruptCheckpointError, StateMismatchError, UnsupportedValueError
from .state import DTYPES, apply, decode, flatten, structure_has_pickle
from .storage import Storage

log = logging.getLogger("ckpt")


def tensor_keys(node: Any) -> list[str]:
    """Keys of the tensors a structure node refers to."""
    if isinstance(node, list):
        return [k for v in node for k in tensor_keys(v)]
    if isinstance(node, dict):
        if node.get("t") == "tensor":
            return [node["key"]]
        return [k for v in node.values() for k in tensor_keys(v)]
    return []


def _shape_str(shape) -> str:
    return "(" + ", ".join(map(str, shape)) + ")"


def load_manifest(storage: Storage, step: int) -> mf.Manifest:
    key = mf.manifest_key(step)
    data = storage.read(key)
    m = mf.parse(data, name=key)
    if m.step != step or m.kind != "step":
        raise CorruptCheckpointError(f"manifest {key} describes step {m.step} ({m.kind}), not step {step}", object=key)
    return m


def load_into(storage: Storage, m: mf.Manifest, state: dict, *, strict: bool, allow_pickle: bool,
              io: ThreadPoolExecutor) -> dict[str, int]:
    """Load manifest ``m`` into ``state``. Returns counters (bytes read, chunks read)."""
    target = flatten(state, for_target=True)
    saved_top = m.structure["k"]
    saved_nodes = dict(zip(saved_top, m.structure["v"]))
    unexpected = [k for k in saved_top if k not in state]
    missing_top = [k for k in state if k not in saved_nodes]
    entries = {t.key: t for t in m.tensors}
    wanted_top = [k for k in saved_top if k in state]
    wanted = [k for top in wanted_top for k in tensor_keys(saved_nodes[top])]
    wanted_set = set(wanted)
    missing_tensors = [k for k, t in target.tensors.items()
                       if k not in wanted_set and k.split("/", 1)[0] in saved_nodes]

    if strict and (unexpected or missing_top or missing_tensors):
        parts = []
        if missing_top or missing_tensors:
            miss = missing_top + missing_tensors
            parts.append(f"missing from the checkpoint: {miss[:8]}{' …' if len(miss) > 8 else ''}")
        if unexpected:
            parts.append(f"in the checkpoint but not in the state: {unexpected[:8]}{' …' if len(unexpected) > 8 else ''}")
        raise StateMismatchError(
            f"step {m.step} does not match the state: " + "; ".join(parts) +
            ". Pass strict=False to load what matches and leave the rest as it is.")
    if unexpected or missing_top or missing_tensors:
        log.warning("ckpt: loading step %d non-strictly: %d key(s) not in the state, %d missing from the checkpoint",
                    m.step, len(unexpected), len(missing_top) + len(missing_tensors))

    structure = {"t": "dict", "k": wanted_top, "v": [saved_nodes[k] for k in wanted_top]}
    if structure_has_pickle(structure) and not allow_pickle:
        raise UnsupportedValueError(
            f"step {m.step} holds pickled objects, and unpickling can run code from the checkpoint. "
            "Load with allow_pickle=True only if you trust its source.")

    # Destinations: the caller's own tensor when it is on the CPU and contiguous, else a new one.
    dest: dict[str, torch.Tensor] = {}
    copy_back: list[tuple[torch.Tensor, torch.Tensor]] = []
    mismatches = []
    for key in wanted:
        e = entries.get(key)
        if e is None:
            raise CorruptCheckpointError(f"step {m.step}: structure names tensor {key!r} that has no entry", object=key)
        dtype, shape = DTYPES[e.dtype], tuple(e.shape)
        t = target.tensors.get(key)
        if t is not None and (tuple(t.shape) != shape or t.dtype != dtype):
            mismatches.append(f"{key}: checkpoint has {e.dtype}{_shape_str(shape)}, state has "
                              f"{str(t.dtype).removeprefix('torch.')}{_shape_str(t.shape)}")
            continue
        if t is not None and t.device.type == "cpu" and t.is_contiguous() and not t.requires_grad:
            dest[key] = t
        elif t is not None and t.device.type == "cpu" and t.is_contiguous():
            dest[key] = t.detach()
        else:
            dest[key] = torch.empty(shape, dtype=dtype)
            if t is not None:
                copy_back.append((t, dest[key]))
    if mismatches:
        raise StateMismatchError(
            f"step {m.step} does not fit the state ({len(mismatches)} tensor(s)): " + "; ".join(mismatches[:6]) +
            (" …" if len(mismatches) > 6 else "") + ". Build the model/optimizer with the same shapes and dtypes "
            "as the run that saved it (cast after loading if you need another dtype).")

    # Group what each chunk feeds: (offset in chunk, length, destination bytes, offset there).
    feeds: dict[str, list[tuple[int, int, np.ndarray, int]]] = defaultdict(list)
    for key in wanted:
        e = entries[key]
        t = dest[key]
        if t.numel() == 0:
            continue
        flat = t.view(-1).view(torch.uint8).numpy()
        for shard in e.shards:
            if shard.offsets != [0] * len(e.shape) or shard.lengths != list(e.shape):
                raise CorruptCheckpointError(
                    f"step {m.step}: tensor {key!r} is sharded; loading shards needs the distributed loader", object=key)
            pos = 0
            for g in shard.segments:
                feeds[g.chunk].append((g.offset, g.length, flat, pos))
                pos += g.length

    counters = {"chunks_read": len(feeds), "bytes_read": 0}
    results = io.map(lambda item: _read_chunk(storage, m, item[0], item[1]), feeds.items())
    for n in results:
        counters["bytes_read"] += n

    for t, src in copy_back:
        with torch.no_grad():
            t.copy_(src)
    decoded = decode(structure, dest, allow_pickle=allow_pickle)
    apply(state, decoded)
    return counters


def _read_chunk(storage: Storage, m: mf.Manifest, h: str, feeds: list) -> int:
    info = m.chunks[h]
    key = mf.chunk_key(h)
    try:
        if info.codec.startswith("raw/") and len(feeds) == 1 and feeds[0][0] == 0 and feeds[0][1] == info.size:
            _, length, flat, pos = feeds[0]
            target = memoryview(flat)[pos : pos + length]
            header = bytearray(HEADER_SIZE)
            n = storage.readv(key, [header, target])
            hdr = parse_header(header, name=key)
            if (hdr.codec != "raw" or hdr.digest != h or hdr.raw_len != info.size or hdr.payload_len != info.size
                    or n != HEADER_SIZE + info.size or storage.size(key) != n):
                raise CorruptCheckpointError(
                    f"chunk object {key} does not match its manifest entry (header, codec or size differ); "
                    "it is damaged. Run `ckpt verify` and load an older step.", object=key, chunk=h)
            if chunk_hash(target) != h:
                raise CorruptCheckpointError(
                    f"chunk object {key} failed its hash check; the stored bytes are damaged. "
                    "Load an older step (or pass fallback=True to load('latest')).", object=key, chunk=h)
            return n
        blob = storage.read(key)
    except FileNotFoundError:
        raise CorruptCheckpointError(
            f"chunk object {key} referenced by step {m.step} is missing from {storage.describe()}; "
            "the step is damaged. Load an older step (or pass fallback=True to load('latest')).",
            object=key, chunk=h) from None
    raw = decode_chunk(blob, name=key, expect_hash=h, expect_len=info.size)
    src = np.frombuffer(raw, dtype=np.uint8)
    for off, length, flat, pos in feeds:
        flat[pos : pos + length] = src[off : off + length]
    return len(blob)

