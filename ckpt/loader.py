"""Loading a committed step into the caller's state, in place, checking every chunk's hash.

Everything that can be checked before reading data is checked first (keys, shapes, dtypes,
pickle), so a mismatch costs no I/O and changes nothing. Then every chunk the state needs is read
once, in parallel, verified and scattered into the destination tensors; a raw chunk that maps onto
one contiguous piece of one CPU tensor is read straight into that tensor (no second copy). Only
when every tensor is filled are ``load_state_dict`` calls made and plain values assigned.
"""

from __future__ import annotations

import logging
import math
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from . import manifest as mf
from .codec import HEADER_SIZE, chunk_hash, decode as decode_chunk, parse_header
from .errors import ConfigError, CorruptCheckpointError, ReshardError, StateMismatchError, UnsupportedValueError
from .sharding import Box, contiguous_run, intersect, is_dtensor, next_needed, volume
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
              io: ThreadPoolExecutor, rank: int = 0, world: int = 1, rank_map: Any = None) -> dict[str, Any]:
    """Load manifest ``m`` into ``state`` as rank ``rank`` of ``world``. Returns counters (bytes
    read, chunks read and which)."""
    _init_optimizers(state, m)
    target = flatten(state, for_target=True)
    saved_top = m.structure["k"]
    saved_nodes = dict(zip(saved_top, m.structure["v"]))
    unexpected = [k for k in saved_top if k not in state]
    missing_top = [k for k in state if k not in saved_nodes]
    wanted_top = [k for k in saved_top if k in state]

    # Per-rank state: which saved rank this rank takes it from.
    per_rank = [k for k in wanted_top if mf.is_per_rank(saved_nodes[k])]
    src_rank = None
    if per_rank:
        src_rank = _source_rank(m, per_rank, rank, world, rank_map)
    nodes = {k: saved_nodes[k]["v"][src_rank] if k in per_rank else saved_nodes[k] for k in wanted_top}
    entries = {(t.key, t.rank): t for t in m.tensors}
    wanted: list[tuple[str, int | None]] = []
    for top in wanted_top:
        for key in tensor_keys(nodes[top]):
            owner = src_rank if top in per_rank and (key, src_rank) in entries else None
            wanted.append((key, owner))
    wanted_set = {k for k, _ in wanted}
    missing_tensors = [k for k in target.tensors if k not in wanted_set and k.split("/", 1)[0] in saved_nodes]

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

    structure = {"t": "dict", "k": wanted_top, "v": [nodes[k] for k in wanted_top]}
    if structure_has_pickle(structure) and not allow_pickle:
        raise UnsupportedValueError(
            f"step {m.step} holds pickled objects, and unpickling can run code from the checkpoint. "
            "Load with allow_pickle=True only if you trust its source.")

    # Destinations: the caller's own (local) tensor when it is on the CPU and contiguous, else a new one.
    dests: dict[str, tuple[torch.Tensor, Box]] = {}
    values: dict[str, Any] = {}
    copy_back: list[tuple[torch.Tensor, torch.Tensor]] = []
    mismatches = []
    for key, owner in wanted:
        e = entries.get((key, owner))
        if e is None:
            raise CorruptCheckpointError(f"step {m.step}: structure names tensor {key!r} that has no entry", object=key)
        dtype, shape = DTYPES[e.dtype], tuple(e.shape)
        t = target.tensors.get(key)
        if t is None:
            local = torch.empty(shape, dtype=dtype)
            dests[key] = (local, ((0,) * len(shape), shape))
            values[key] = local
            continue
        leaf = target.leaves[key]
        gshape = tuple(t.shape) if owner is not None else tuple(leaf.global_shape)
        if gshape != shape or t.dtype != dtype:
            what = "" if gshape == tuple(t.shape) else " (global)"
            mismatches.append(f"{key}: checkpoint has {e.dtype}{_shape_str(shape)}, state has "
                              f"{str(t.dtype).removeprefix('torch.')}{_shape_str(gshape)}{what}")
            continue
        box = ((0,) * len(shape), shape) if owner is not None else leaf.box
        if t.device.type == "cpu" and t.is_contiguous():
            local = t.detach() if t.requires_grad else t
        else:
            local = torch.empty(tuple(t.shape), dtype=dtype)
            copy_back.append((t, local))
        dests[key] = (local, box)
        values[key] = target.targets[key]
    if mismatches:
        raise StateMismatchError(
            f"step {m.step} does not fit the state ({len(mismatches)} tensor(s)): " + "; ".join(mismatches[:6]) +
            (" …" if len(mismatches) > 6 else "") + ". Build the model/optimizer with the same shapes and dtypes "
            "as the run that saved it (cast after loading if you need another dtype).")

    # What each chunk feeds: (offset in chunk, length, destination bytes, offset there). Boxes that
    # are not one contiguous run on both sides go through a staging buffer and a strided copy.
    feeds: dict[str, list[tuple[int, int, np.ndarray, int]]] = defaultdict(list)
    strided: list[tuple[torch.Tensor, Box, np.ndarray, tuple, Box]] = []
    for key, owner in wanted:
        e = entries[(key, owner)]
        local, dbox = dests[key]
        need = volume(dbox[1])
        if need == 0:
            continue
        item = DTYPES[e.dtype].itemsize
        dflat = local.view(-1).view(torch.uint8).numpy()
        covered = 0
        for shard in e.shards:
            sbox = (tuple(shard.offsets), tuple(shard.lengths))
            inter = intersect(dbox, sbox)
            if inter is None or volume(inter[1]) == 0:
                continue
            covered += volume(inter[1])
            in_s = (tuple(o - so for o, so in zip(inter[0], sbox[0])), inter[1])
            in_d = (tuple(o - do for o, do in zip(inter[0], dbox[0])), inter[1])
            run_s, run_d = contiguous_run(in_s, sbox[1]), contiguous_run(in_d, dbox[1])
            if run_s is not None and run_d is not None:
                lo, n = run_s[0] * item, run_s[1] * item
                for chunk, coff, length, spos in _pieces(shard, lo, lo + n):
                    feeds[chunk].append((coff, length, dflat, run_d[0] * item + spos - lo))
                continue
            # Stage the saved rows that hold the box, reading only chunks with a needed element.
            r0, r1 = in_s[0][0], in_s[0][0] + in_s[1][0]
            row = math.prod(sbox[1][1:]) * item
            stage = np.empty((r1 - r0) * row, dtype=np.uint8)
            for chunk, coff, length, spos in _pieces(shard, r0 * row, r1 * row):
                first = next_needed(spos // item, sbox[1], in_s)
                if first is not None and first * item < spos + length:
                    feeds[chunk].append((coff, length, stage, spos - r0 * row))
            strided.append((local, in_d, stage, (r1 - r0, *sbox[1][1:]), ((0, *in_s[0][1:]), in_s[1])))
        if covered != need:
            raise CorruptCheckpointError(
                f"step {m.step}: the saved shards of {key!r} cover {covered} of the {need} elements this rank "
                "needs; the manifest is damaged. Load another step (or pass fallback=True to load('latest'))",
                object=mf.manifest_key(m.step))

    counters: dict[str, Any] = {"chunks_read": len(feeds), "bytes_read": 0, "chunks": sorted(feeds)}
    results = io.map(lambda item: _read_chunk(storage, m, item[0], item[1]), feeds.items())
    for n in results:
        counters["bytes_read"] += n

    with torch.no_grad():
        for local, in_d, stage, rows_shape, in_stage in strided:
            src = torch.from_numpy(stage).view(local.dtype).view(rows_shape)
            local[_slices(in_d)].copy_(src[_slices(in_stage)])
        for t, src in copy_back:
            t.copy_(src)
    decoded = decode(structure, values, allow_pickle=allow_pickle)
    apply(state, decoded)
    return counters


def _slices(box: Box) -> tuple:
    return tuple(slice(o, o + n) for o, n in zip(box[0], box[1]))


def _pieces(shard: mf.Shard, lo: int, hi: int):
    """(chunk, offset in chunk, length, offset in the shard) of the shard bytes in [lo, hi)."""
    pos = 0
    for g in shard.segments:
        a, b = max(lo, pos), min(hi, pos + g.length)
        if a < b:
            yield g.chunk, g.offset + a - pos, b - a, a
        pos += g.length
        if pos >= hi:
            break


def _source_rank(m: mf.Manifest, keys: list[str], rank: int, world: int, rank_map: Any) -> int:
    if rank_map is None:
        if world == m.world_size:
            return rank
        raise ReshardError(
            f"step {m.step} was saved on {m.world_size} rank(s) and holds per-rank state under {keys} "
            f"(e.g. RNG or data loader positions); this job has {world}. Say which saved rank each rank takes "
            "it from with load(..., rank_map=lambda rank: rank % saved_world) (or a dict/list), or leave these "
            "keys out of the state passed to load (strict=False).")
    src = rank_map(rank) if callable(rank_map) else rank_map[rank]
    if type(src) is not int or not 0 <= src < m.world_size:
        raise ConfigError(f"rank_map gave {src!r} for rank {rank}; it must be a saved rank, 0 to {m.world_size - 1}")
    return src


def _init_optimizers(state: dict, m: mf.Manifest) -> None:
    """An optimizer over DTensor parameters with no state yet gets its state created first, so the
    saved state loads into sharded tensors of the right layout (a step with lr=0 and zero grads)."""
    saved_keys = {t.key for t in m.tensors}
    for top, obj in state.items():
        if not isinstance(obj, torch.optim.Optimizer) or len(obj.state) > 0:
            continue
        params = [p for g in obj.param_groups for p in g["params"]]
        if not any(is_dtensor(p) for p in params):
            continue
        if not any(k.startswith(f"{top}/state/") for k in saved_keys):
            continue
        set_grads, lrs = [], []
        for g in obj.param_groups:
            lrs.append(g["lr"])
            g["lr"] = 0.0 if not isinstance(g["lr"], torch.Tensor) else torch.zeros_like(g["lr"])
            for p in g["params"]:
                if p.requires_grad and p.grad is None:
                    p.grad = torch.zeros_like(p)
                    set_grads.append(p)
        try:
            obj.step()
        finally:
            for g, lr in zip(obj.param_groups, lrs):
                g["lr"] = lr
            for p in set_grads:
                p.grad = None


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

