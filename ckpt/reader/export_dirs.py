"""Exports into a directory: Hugging Face safetensors shards (``format="hf"``) and a plain DCP
checkpoint (``format="dcp"``), from a step of any world size, every chunk verified.

* ``hf``: tensors are grouped into shards greedily in key order, each at most ``max_shard_size``
  bytes (a tensor larger than that is a shard of its own), and written one shard at a time: the
  tensors of one shard are read, written and freed before the next, so memory peaks at about one
  shard. Several shards are ``model-00001-of-00003.safetensors`` … with
  ``model.safetensors.index.json`` (``{"metadata": {"total_size": N}, "weight_map": {name: file}}``);
  a single shard is ``model.safetensors`` and no index. That is what transformers'
  ``save_pretrained`` writes and ``from_pretrained`` reads. Every shard's metadata has
  ``format: pt`` (transformers checks it), ``ckpt.step``, ``ckpt.source`` and the plain values.
* ``dcp``: ``torch.distributed.checkpoint.save`` of the tensors and plain values, in one process,
  with DCP's own ``FileSystemWriter``: ``dcp.load`` with a ``FileSystemReader`` reads it without
  ckpt. Keys are nested at ``/``, so DCP names them as it names a nested state dict
  (``model/0.weight`` is ``model.0.weight``): ``dcp.load({"model": model.state_dict()}, ...)``
  fits. The whole selection is held in memory while DCP writes it.

Files are written into a hidden staging directory inside the target and moved into place at the
end; a failure leaves the target as it was. With ``overwrite``, the files of an earlier export of
the same format are replaced and any other file (``config.json``, a tokenizer) is kept.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import save_file

from ..errors import ConfigError, StorageError, UnsupportedValueError
from ..format import manifest as mf
from ..tree import has_pickle
from .export import follow_umask, writing
from .tensors import read_tensors

if TYPE_CHECKING:
    from .core import Reader
    from .export import ExportResult

HF_SINGLE = "model.safetensors"
HF_INDEX = "model.safetensors.index.json"
HF_CONFIG = "config.json"
_HF_FILES = re.compile(r"^(model\.safetensors|model-\d{5}-of-\d{5}\.safetensors|model\.safetensors\.index\.json)$")
_DCP_FILES = re.compile(r"^(\.metadata|.*\.distcp)$")


def check_target(path: str, overwrite: bool) -> None:
    """Refuse a target that is a file, or a non-empty directory without ``overwrite``; before any I/O."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise ConfigError(f"{path} is a file: --format hf and --format dcp write a directory; name a directory")
    if os.path.isdir(path) and os.listdir(path) and not overwrite:
        raise ConfigError(f"{path} is not empty; pass --force to write into it (the files of an earlier export "
                          "are replaced, other files such as config.json are kept), or name a new directory")


def shard_groups(sizes: list[int], limit: int) -> list[list[int]]:
    """Indices grouped greedily in order, each group at most ``limit`` bytes; a larger item alone."""
    groups: list[list[int]] = []
    total = 0
    for i, n in enumerate(sizes):
        if not groups or (groups[-1] and total + n > limit):
            groups.append([])
            total = 0
        groups[-1].append(i)
        total += n
    return groups


def hf_names(count: int) -> list[str]:
    if count == 1:
        return [HF_SINGLE]
    return [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


def write_hf(reader: Reader, m: mf.Manifest, entries: list[mf.TensorEntry], names: list[str],
             dtypes: list[torch.dtype], limit: int, metadata: dict[str, str], result: ExportResult, *,
             overwrite: bool, threads: int, config: dict | None = None) -> None:
    sizes = [int(torch.Size(e.shape).numel()) * d.itemsize for e, d in zip(entries, dtypes)]
    groups = shard_groups(sizes, limit)
    files = hf_names(len(groups))

    def write(stage: str) -> list[str]:
        with ThreadPoolExecutor(threads, thread_name_prefix="ckpt-export") as io:
            for file, group in zip(files, groups):  # one shard in memory at a time
                tensors = read_tensors(reader.storage, m, [entries[i] for i in group], io)
                out = {names[i]: t.to(dtypes[i]) for i, t in zip(group, tensors)}
                del tensors
                with writing(result.path, result.bytes, result.path):
                    save_file(out, os.path.join(stage, file), metadata=metadata)
                del out
        extra = []
        if config is not None:  # what from_pretrained builds the model from
            with open(os.path.join(stage, HF_CONFIG), "w") as f:
                json.dump(config, f, indent=2, allow_nan=False)
                f.write("\n")
            extra.append(HF_CONFIG)
        if len(files) == 1:
            return files + extra
        index = {"metadata": {"total_size": sum(sizes), "ckpt.step": m.step, "ckpt.source": metadata["ckpt.source"]},
                 "weight_map": {names[i]: file for file, group in zip(files, groups) for i in sorted(group)}}
        with open(os.path.join(stage, HF_INDEX), "w") as f:
            json.dump(index, f, indent=2, sort_keys=False)
            f.write("\n")
        return [*files, HF_INDEX, *extra]

    result.files = _staged(result.path, overwrite, _HF_FILES, write)


def _nest(items: dict[str, Any]) -> dict[str, Any]:
    """``{"a/b": x}`` -> ``{"a": {"b": x}}`` (what DCP flattens back to ``a.b``)."""
    out: dict[str, Any] = {}
    for key, value in items.items():
        parts = key.split("/")
        node = out
        for p in parts[:-1]:
            child = node.setdefault(p, {})
            if not isinstance(child, dict):
                raise UnsupportedValueError(f"cannot export {key!r} to DCP: {p!r} is also a tensor or value of its "
                                            "own. Export them separately (one --keys prefix each), or to a "
                                            ".safetensors or .pt file")
            node = child
        if parts[-1] in node:
            raise UnsupportedValueError(f"cannot export {key!r} to DCP: another name nests under it. Export them "
                                        "separately (one --keys prefix each), or to a .safetensors or .pt file")
        node[parts[-1]] = value
    return out


def check_dcp_names(tensors: list[str], values: list[str]) -> None:
    """Refuse names DCP cannot keep apart, before anything is read: DCP names a nested item by its
    path joined with ``.``, so ``model/a.b`` and ``model/a/b`` would both be ``model.a.b``; and a
    name cannot be an item and hold others (``a`` and ``a/b``)."""
    seen: dict[str, str] = {}
    for name in [*tensors, *values]:
        dotted = name.replace("/", ".")
        if dotted in seen:
            raise UnsupportedValueError(
                f"cannot export {seen[dotted]!r} and {name!r} to DCP: DCP joins nested names with '.', so both "
                f"would be {dotted!r}. Export them separately (one --keys prefix each), or to a .safetensors or .pt "
                "file, which keep the names as they are")
        seen[dotted] = name
    _nest(dict.fromkeys([*tensors, *values]))


def write_dcp(reader: Reader, m: mf.Manifest, entries: list[mf.TensorEntry], names: list[str],
              dtypes: list[torch.dtype], values: dict[str, Any], result: ExportResult, *,
              overwrite: bool, threads: int) -> None:
    import torch.distributed.checkpoint as dcp

    def write(stage: str) -> list[str]:
        with ThreadPoolExecutor(threads, thread_name_prefix="ckpt-export") as io:
            tensors = read_tensors(reader.storage, m, entries, io)
        flat: dict[str, Any] = {n: t.to(d) for n, t, d in zip(names, tensors, dtypes)}
        del tensors
        rebuilt = reader.values(m.step, rank=result.rank or 0) if values else {}
        for p, node in values.items():
            if has_pickle(node):
                continue
            if p in flat:
                raise ConfigError(f"cannot export value {p!r} to DCP: a tensor has the same name")
            flat[p] = rebuilt[p]
        with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
            warnings.simplefilter("ignore", UserWarning)
            with writing(result.path, result.bytes, result.path):
                dcp.save(_nest(flat), storage_writer=dcp.FileSystemWriter(stage), no_dist=True)
        return sorted(os.listdir(stage))

    result.files = _staged(result.path, overwrite, _DCP_FILES, write)


def _staged(path: str, overwrite: bool, ours: re.Pattern, write: Callable[[str], list[str]]) -> list[str]:
    """Run ``write(stage)`` in a staging directory inside ``path``, then move its files into ``path``
    (replacing an earlier export's files matching ``ours`` when ``overwrite``)."""
    created = not os.path.isdir(path)
    try:
        os.makedirs(path, exist_ok=True)
        stage = tempfile.mkdtemp(prefix=".ckpt-export-", dir=path)
    except OSError as e:
        raise StorageError(f"cannot create {path}: {e}") from e
    try:
        files = write(stage)
        if overwrite:
            for old in os.listdir(path):
                if ours.match(old) and os.path.isfile(os.path.join(path, old)):
                    os.unlink(os.path.join(path, old))
        for f in files:
            follow_umask(os.path.join(stage, f))
            os.replace(os.path.join(stage, f), os.path.join(path, f))
        return files
    except OSError as e:
        raise StorageError(f"writing into {path} failed: {e}. Check that it is writable and has room") from e
    finally:
        shutil.rmtree(stage, ignore_errors=True)
        if created and os.path.isdir(path) and not os.listdir(path):
            os.rmdir(path)
