"""A consolidated, unsharded copy of one step in a single file (``Reader.export``, ``ckpt export``).

Every tensor is rebuilt whole from its shards (resharding to one process, each chunk verified)
and written as a flat ``key -> tensor`` mapping, keys as in the manifest (``model/0.weight``):

* ``.safetensors``: the tensors, plus the step's plain values as JSON in the metadata
  (``ckpt.values``: key path -> ckpt's typed JSON node, the manifest's own encoding).
* ``.pt`` / ``.pth``: ``torch.save`` of the tensors only (loadable with ``weights_only=True``).

Per-rank state is exported from one saved rank (``rank``, default 0). Pickled values are never
unpickled: they are left out, and reported.
"""

from __future__ import annotations

import json
import os
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from ..errors import ConfigError, StorageError, UnsupportedValueError
from ..format import manifest as mf
from ..tree import DTYPES, has_pickle, strip_pickles, value_nodes
from .tensors import read_tensors

if TYPE_CHECKING:
    from .core import Reader

FORMATS = {".safetensors": "safetensors", ".pt": "torch", ".pth": "torch"}


@dataclass
class ExportResult:
    path: str
    step: int
    format: str
    tensors: dict[str, tuple[str, list[int]]] = field(default_factory=dict)  # key -> (dtype, shape)
    bytes: int = 0
    values: list[str] = field(default_factory=list)  # value paths written (safetensors metadata)
    skipped_values: list[str] = field(default_factory=list)  # not written (pickles; any value for .pt)
    pickled: list[str] = field(default_factory=list)
    rank: int | None = None  # the saved rank per-rank state came from, if there was any


def format_of(path: str) -> str:
    ext = os.path.splitext(path)[1].lower()
    if ext not in FORMATS:
        raise ConfigError(f"cannot tell the export format from {path!r}: name it *.safetensors, *.pt or *.pth")
    return FORMATS[ext]


def _safetensors_dtypes_refused(dtypes: set[str]) -> set[str]:
    from safetensors.torch import save

    bad = set()
    for d in dtypes:
        try:
            save({"x": torch.zeros(1, dtype=DTYPES[d])})
        except Exception:  # this safetensors cannot hold the dtype
            bad.add(d)
    return bad


def export(reader: Reader, step: int, path: str, *, prefixes: list[str] | None = None, strip_prefix: bool = False,
           rank: int = 0, overwrite: bool = False, threads: int = 8) -> ExportResult:
    """Write step ``step`` to ``path`` as one unsharded file; see the module docstring. With
    ``strip_prefix``, the prefix a key matched is taken off its name (``model/0.weight`` with
    ``--keys model/`` becomes ``0.weight``): what ``model.load_state_dict`` expects."""
    if strip_prefix and not prefixes:
        raise ConfigError("--strip-prefix needs --keys PREFIX: the prefix to take off each name (e.g. --keys model/)")
    fmt = format_of(path)
    if os.path.exists(path) and not overwrite:
        raise ConfigError(f"{path} exists; pass --force to overwrite it")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ConfigError(f"cannot write {path}: the directory {folder} does not exist (create it first)")
    m = reader.manifest(step)
    if m.per_rank_keys and not 0 <= rank < m.world_size:
        raise ConfigError(f"--rank {rank}: step {step} was saved on {m.world_size} rank(s); "
                          f"use 0 to {m.world_size - 1}")

    def wanted(key: str) -> bool:
        return not prefixes or any(key.startswith(p) for p in prefixes)

    def name(key: str) -> str:
        if not strip_prefix:
            return key
        prefix = max((p for p in prefixes or () if key.startswith(p)), key=len)
        return key[len(prefix):].lstrip("/") or key

    entries = [t for t in m.tensors if wanted(t.key) and (t.rank is None or t.rank == rank)]
    result = ExportResult(path=path, step=step, format=fmt, rank=rank if m.per_rank_keys else None)
    if not entries:
        raise ConfigError(f"step {step} has no tensor whose key starts with {' or '.join(map(repr, prefixes or []))}"
                          if prefixes else f"step {step} holds no tensors to export")
    if fmt == "safetensors":
        bad = _safetensors_dtypes_refused({e.dtype for e in entries})
        if bad:
            keys = [e.key for e in entries if e.dtype in bad]
            raise UnsupportedValueError(
                f"safetensors cannot hold dtype(s) {sorted(bad)} (tensors {keys[:5]}{' …' if len(keys) > 5 else ''}); "
                "export to a .pt file instead, or leave them out with --keys")

    values: dict[str, object] = {}
    for p, node in value_nodes(m.structure, rank=rank):
        if not wanted(p):
            continue
        if has_pickle(node):
            result.pickled.append(p)
            result.skipped_values.append(p)
        elif fmt == "safetensors":
            values[p] = strip_pickles(node)
            result.values.append(p)
        else:
            result.skipped_values.append(p)

    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="ckpt-export") as io:
        tensors = read_tensors(reader.storage, m, entries, io)
    names = [name(e.key) for e in entries]
    clashes = sorted({n for n in names if names.count(n) > 1})
    if clashes:
        raise ConfigError(f"with --strip-prefix, several tensors would be named {clashes[:4]}; export them "
                          "separately (one --keys prefix each) or without --strip-prefix")
    out = dict(zip(names, tensors))
    result.tensors = {n: (e.dtype, list(e.shape)) for n, e in zip(names, entries)}
    result.bytes = sum(e.nbytes for e in entries)

    tmp = f"{path}.tmp-{uuid.uuid4().hex[:12]}"
    try:
        _write(fmt, out, tmp, path, step, reader, values, result)
    except OSError as e:
        raise StorageError(f"writing {path} failed: {e}") from e
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return result


def _write(fmt: str, out: dict, tmp: str, path: str, step: int, reader: Reader, values: dict,
           result: ExportResult) -> None:
    """Write the file under a temporary name, then rename it into place (never a half-written file)."""
    if fmt == "safetensors":
        from safetensors.torch import save_file

        meta = {"format": "pt", "ckpt.step": str(step), "ckpt.source": reader.storage.describe(),
                "ckpt.values": json.dumps(values, separators=(",", ":"), allow_nan=False)}
        if result.rank is not None:
            meta["ckpt.rank"] = str(result.rank)
        save_file(out, tmp, metadata=meta)
    else:
        torch.save(out, tmp)
    os.replace(tmp, path)


def per_rank_note(m: mf.Manifest, rank: int) -> str | None:
    if not m.per_rank_keys:
        return None
    return (f"per-rank state {m.per_rank_keys} exported from saved rank {rank} of {m.world_size} "
            "(--rank R for another)")
