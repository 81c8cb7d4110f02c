"""A consolidated, unsharded copy of one step (``Reader.export``, ``ckpt export``).

Every tensor is rebuilt whole from its shards (resharding to one process, each chunk verified)
and written as a flat ``key -> tensor`` mapping, keys as in the manifest (``model/0.weight``):

* ``.safetensors``: the tensors, plus the step's plain values in the metadata: ``ckpt.values``
  (key path -> the value as plain JSON) and, for values plain JSON cannot hold (bytes, tuples,
  non-finite floats, dtypes …), ``ckpt.values.tagged`` (key path -> the manifest's typed node).
* ``.pt`` / ``.pth``: ``torch.save`` of the tensors only (loadable with ``weights_only=True``).
* ``format="hf"`` / ``"dcp"``: a directory of Hugging Face shards or a plain DCP checkpoint
  (``export_dirs``), selected and cast the same way.

Per-rank state is exported from one saved rank (``rank``, default 0). Pickled values are never
unpickled: they are left out, and reported.
"""

from __future__ import annotations

import json
import math
import os
import re
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from safetensors import SafetensorError
from safetensors.torch import save_file

from ..errors import ConfigError, StorageError, UnsupportedValueError
from ..format import manifest as mf
from ..tree import DTYPES, dtype_name, has_pickle, strip_pickles, value_nodes
from .core import check_rank
from .tensors import read_tensors

if TYPE_CHECKING:
    from .core import Reader

FORMATS = {".safetensors": "safetensors", ".pt": "torch", ".pth": "torch"}
DIR_FORMATS = ("hf", "dcp")
FORMAT_NAMES = {"safetensors": "safetensors", "torch": "torch", "pt": "torch", "hf": "hf", "dcp": "dcp"}
CASTS = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
         "fp32": torch.float32, "float32": torch.float32}
CASTABLE = {"float64", "float32", "float16", "bfloat16"}  # what --dtype converts; other dtypes stay as saved
RESERVED = "__metadata__"  # a safetensors header's metadata, not a tensor name
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


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
    per_rank_keys: list[str] = field(default_factory=list)  # the step's per-rank keys this export holds
    files: list[str] = field(default_factory=list)  # what a directory export wrote, in its directory
    dtype: str | None = None  # the --dtype floating tensors were cast to
    config: str | None = None  # hf: where config.json came from (a file, a value of the step), if written
    default_keys: str | None = None  # hf without keys: the model's prefix exported (and stripped)


def format_of(path: str, format: str | None = None) -> str:
    """The export format: ``format`` if given (``safetensors``, ``pt``/``torch``, ``hf``, ``dcp``), else
    from the file name's suffix."""
    if format is not None:
        if format not in FORMAT_NAMES:
            raise ConfigError(f"unknown export format {format!r}: use one of safetensors, pt, hf, dcp")
        return FORMAT_NAMES[format]
    ext = os.path.splitext(path)[1].lower()
    if ext not in FORMATS:
        raise ConfigError(f"cannot tell the export format from {path!r}: name it *.safetensors, *.pt or *.pth, "
                          "or pass --format hf|dcp to write a directory")
    return FORMATS[ext]


def parse_size(size: int | str) -> int:
    """Bytes from ``5GB`` (10⁹), ``500MB``, ``2GiB`` (2³⁰), ``1024`` … (Hugging Face's convention)."""
    if isinstance(size, int) and not isinstance(size, bool):
        n = size
    else:
        found = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b|b)?\s*", str(size), re.IGNORECASE)
        if not found:
            raise ConfigError(f"--max-shard-size: expected a size like 5GB, 500MB or 2GiB, got {size!r}")
        n = int(float(found.group(1)) * _UNITS[(found.group(2) or "").lower()])
    if n < 1:
        raise ConfigError(f"--max-shard-size must be at least one byte, got {size!r}")
    return n


def cast_to(dtype: str | None) -> torch.dtype | None:
    if dtype is None:
        return None
    if dtype not in CASTS:
        raise ConfigError(f"--dtype {dtype!r}: use bf16, fp16 or fp32 (floating tensors are cast; others stay)")
    return CASTS[dtype]


def out_dtype(saved: str, cast: torch.dtype | None) -> torch.dtype:
    """The dtype a tensor saved as ``saved`` is exported as: ``cast`` for the usual floating dtypes."""
    return cast if cast is not None and saved in CASTABLE else DTYPES[saved]


def plain_json(node: object) -> tuple[bool, object]:
    """(True, the value as plain JSON) if a structure node holds only what JSON holds as it is
    (dicts with string keys, lists, strings, finite numbers, booleans, None); else (False, None)."""
    if node is None or isinstance(node, (bool, int, str)):
        return True, node
    if isinstance(node, float):
        return True, node  # the manifest keeps non-finite floats as float nodes, so this one is finite
    if isinstance(node, list):
        items = [plain_json(v) for v in node]
        return all(ok for ok, _ in items), [v for _, v in items]
    if isinstance(node, dict) and node.get("t") == "dict" and all(isinstance(k, str) for k in node["k"]):
        items = [plain_json(v) for v in node["v"]]
        return all(ok for ok, _ in items), dict(zip(node["k"], (v for _, v in items)))
    return False, None


def _safetensors_dtypes_refused(dtypes: set[str]) -> set[str]:
    from safetensors.torch import save

    bad = set()
    for d in dtypes:
        try:
            save({"x": torch.zeros(1, dtype=DTYPES[d])})
        except Exception:  # this safetensors cannot hold the dtype
            bad.add(d)
    return bad



@contextmanager
def writing(path: str, nbytes: int, folder: str | None = None) -> Iterator[None]:
    """Turn a failed write of an export (unwritable directory, full disk) into a :class:`StorageError`
    that says which file and what to check. safetensors, ``torch.save`` and DCP each report it in
    their own words (``SafetensorError: … No space left on device``, ``RuntimeError: [enforce fail at
    inline_container.cc:672] . unexpected pos …``, DCP's ``CheckpointException`` around either): the
    first line is kept, cleaned of source locations."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        yield
    except (OSError, SafetensorError, RuntimeError, CheckpointException) as e:
        cause: BaseException = e
        if isinstance(e, CheckpointException) and e.failures:
            cause = next(iter(e.failures.values()))[0]
        text = str(cause).strip()
        reason = re.sub(r"\[enforce fail at [^]]*\]\s*\.?\s*", "", text.splitlines()[0] if text
                        else type(cause).__name__)
        if reason.startswith("unexpected pos"):  # torch.save's zip writer: a write came out short
            reason = f"a write came out short ({reason})"
        where = folder or os.path.dirname(os.path.abspath(path))
        raise StorageError(f"cannot write {path}: {reason}. Check that {where} is writable and has "
                           f"{nbytes / 2**20:.1f} MiB free") from e


def _check_target(path: str, fmt: str, overwrite: bool) -> None:
    """Refuse a target that would be clobbered or cannot be written, before anything is read."""
    if fmt in DIR_FORMATS:
        from .export_dirs import check_target

        check_target(path, overwrite)
    else:
        if os.path.isdir(path):
            raise ConfigError(f"{path} is a directory: name a file (*.safetensors, *.pt), or pass --format hf|dcp")
        if os.path.exists(path) and not overwrite:
            raise ConfigError(f"{path} exists; pass --force to overwrite it")
    folder = os.path.dirname(os.path.abspath(path))
    existing = folder  # missing parent directories are created when the export writes: check where they go
    while not os.path.isdir(existing):
        if os.path.lexists(existing):
            raise ConfigError(f"cannot write {path}: {existing} is not a directory (choose another --to)")
        existing = os.path.dirname(existing)
    if not os.access(existing, os.W_OK):  # as root this passes; the write itself then fails, reported alike
        raise StorageError(f"cannot write {path}: {existing} is not writable (choose another --to, or fix its "
                           "permissions)")


def make_parents(path: str) -> list[str]:
    """Create the missing parent directories of ``path`` (as ``mkdir -p``, modes from the umask);
    the ones created, outermost first, for :func:`remove_parents` to take back if the export fails."""
    created: list[str] = []
    folder = os.path.dirname(os.path.abspath(path))
    while not os.path.isdir(folder):
        created.insert(0, folder)
        folder = os.path.dirname(folder)
    for d in created:
        try:
            os.mkdir(d)
        except FileExistsError:
            pass
        except OSError as e:
            remove_parents(created)
            raise StorageError(f"cannot write {path}: cannot create the directory {d} ({e.strerror})") from e
    return created


def remove_parents(created: list[str]) -> None:
    """Take back the directories :func:`make_parents` created, innermost first, where still empty."""
    for d in reversed(created):
        try:
            os.rmdir(d)
        except OSError:
            return


def _umask() -> int:
    """The process's umask, read without changing it (``os.umask`` sets it, racing other threads)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def follow_umask(path: str) -> None:
    """Give a written file the mode a plain ``open`` gives (0666 less the umask): safetensors
    writes 0600, which other users, and a serving process, cannot read."""
    os.chmod(path, 0o666 & ~_umask())


def _check_names(fmt: str, entries: list[mf.TensorEntry], names: list[str], values: list[str]) -> None:
    """Refuse names the target format cannot hold, before anything is read or written: safetensors
    reserves ``__metadata__`` (a tensor of that name makes a file nothing reads back), and DCP joins
    nested names with ``.`` (``model/a.b`` and ``model/a/b`` would both be ``model.a.b``)."""
    if fmt in ("safetensors", "hf") and RESERVED in names:
        key = entries[names.index(RESERVED)].key
        raise UnsupportedValueError(
            f"tensor {key!r} would be named {RESERVED!r} in the safetensors file, the name its header keeps "
            "metadata under: the file could not be read back. Leave it out with --keys, or export to a .pt file "
            "(or --format dcp) instead")
    if fmt == "dcp":
        from .export_dirs import check_dcp_names

        check_dcp_names(names, values)


def _values(m: mf.Manifest, rank: int, wanted: Callable[[str], bool], fmt: str, result: ExportResult
            ) -> dict[str, object]:
    """The plain values to write beside the tensors (formats that hold them), noting what is left out."""
    values: dict[str, object] = {}
    for p, node in value_nodes(m.structure, rank=rank):
        if not wanted(p):
            continue
        if has_pickle(node):
            result.pickled.append(p)
            result.skipped_values.append(p)
        elif fmt in ("safetensors", "hf", "dcp"):
            values[p] = strip_pickles(node)
            result.values.append(p)
        else:
            result.skipped_values.append(p)
    return values

def export(reader: Reader, step: int, path: str, *, prefixes: list[str] | None = None, strip_prefix: bool = False,
           rank: int = 0, overwrite: bool = False, threads: int = 8, format: str | None = None,
           dtype: str | None = None, max_shard_size: int | str | None = None, config: str | None = None
           ) -> ExportResult:
    """Write step ``step`` to ``path``; see the module docstring. With ``strip_prefix``, the prefix
    a key matched is taken off its name (``model/0.weight`` with ``--keys model/`` becomes
    ``0.weight``): what ``model.load_state_dict`` expects. ``dtype`` (``bf16``, ``fp16``, ``fp32``)
    casts the floating tensors; ``max_shard_size`` and ``config`` are for ``format="hf"`` only
    (:mod:`.export_hf`: the model's keys by default, and its ``config.json``)."""
    if strip_prefix and not prefixes:
        raise ConfigError("--strip-prefix needs --keys PREFIX: the prefix to take off each name (e.g. --keys model/)")
    fmt = format_of(path, format)
    cast = cast_to(dtype)
    if max_shard_size is not None and fmt != "hf":
        raise ConfigError("--max-shard-size is for --format hf (the single-file and DCP exports are not split)")
    if config is not None and fmt != "hf":
        raise ConfigError("--config is for --format hf: it is written as config.json beside the shards")
    limit = parse_size(max_shard_size if max_shard_size is not None else "5GB")
    _check_target(path, fmt, overwrite)
    m = reader.manifest(step)
    check_rank(m, rank)
    default_keys = None
    if fmt == "hf" and not prefixes:
        from .export_hf import model_prefix

        default_keys = model_prefix(m)
        if default_keys is not None:
            prefixes, strip_prefix = [default_keys], True

    def wanted(key: str) -> bool:
        return not prefixes or any(key.startswith(p) for p in prefixes)

    def name(key: str) -> str:
        if not strip_prefix:
            return key
        prefix = max((p for p in prefixes or () if key.startswith(p)), key=len)
        return key[len(prefix):].lstrip("/") or key

    entries = [t for t in m.tensors if wanted(t.key) and (t.rank is None or t.rank == rank)]
    result = ExportResult(path=path, step=step, format=fmt, rank=rank if m.per_rank_keys else None, dtype=dtype,
                          default_keys=default_keys)
    if not entries:
        raise ConfigError(f"step {step} has no tensor whose key starts with {' or '.join(map(repr, prefixes or []))}"
                          if prefixes else f"step {step} holds no tensors to export")
    if fmt in ("safetensors", "hf"):
        bad = _safetensors_dtypes_refused({dtype_name(out_dtype(e.dtype, cast)) for e in entries})
        if bad:
            keys = [e.key for e in entries if dtype_name(out_dtype(e.dtype, cast)) in bad]
            raise UnsupportedValueError(
                f"safetensors cannot hold dtype(s) {sorted(bad)} (tensors {keys[:5]}{' …' if len(keys) > 5 else ''}); "
                "export to a .pt file (or --format dcp) instead, or leave them out with --keys")

    values = _values(m, rank, wanted, fmt, result)

    names = [name(e.key) for e in entries]
    clashes = sorted({n for n in names if names.count(n) > 1})
    if clashes:
        raise ConfigError(f"with --strip-prefix, several tensors would be named {clashes[:4]}; export them "
                          "separately (one --keys prefix each) or without --strip-prefix")
    _check_names(fmt, entries, names, result.values)
    written = [e.key for e in entries if e.rank is not None] + result.values
    result.per_rank_keys = [k for k in m.per_rank_keys if any(w == k or w.startswith(k + "/") for w in written)]
    dtypes = [out_dtype(e.dtype, cast) for e in entries]
    result.tensors = {n: (dtype_name(d), list(e.shape)) for n, e, d in zip(names, entries, dtypes)}
    result.bytes = sum(math.prod(e.shape) * d.itemsize for e, d in zip(entries, dtypes))
    hf_config = None
    if fmt == "hf":
        from .export_hf import find_config

        hf_config, result.config = find_config(config, m, rank, prefixes or [])
    created = make_parents(path)
    try:
        _export_to(reader, m, fmt, entries, names, dtypes, limit, values, result, overwrite, threads, hf_config)
    except BaseException:
        remove_parents(created)
        raise
    if fmt == "hf" and hf_config is None:
        from .export_hf import warn_without_config

        warn_without_config(path)
    return result


def _export_to(reader: Reader, m: mf.Manifest, fmt: str, entries: list[mf.TensorEntry], names: list[str],
               dtypes: list[torch.dtype], limit: int, values: dict[str, object], result: ExportResult,
               overwrite: bool, threads: int, hf_config: dict | None = None) -> None:
    path, step = result.path, result.step
    if fmt in DIR_FORMATS:
        from .export_dirs import write_dcp, write_hf

        if fmt == "hf":
            write_hf(reader, m, entries, names, dtypes, limit, values_metadata(step, reader, values, result), result,
                     overwrite=overwrite, threads=threads, config=hf_config)
        else:
            write_dcp(reader, m, entries, names, dtypes, values, result, overwrite=overwrite, threads=threads)
        return

    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="ckpt-export") as io:
        tensors = read_tensors(reader.storage, m, entries, io)
    out = {n: t.to(d) for n, t, d in zip(names, tensors, dtypes)}
    del tensors

    tmp = f"{path}.tmp-{uuid.uuid4().hex[:12]}"
    try:
        with writing(path, result.bytes):
            _write(fmt, out, tmp, path, step, reader, values, result)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _write(fmt: str, out: dict, tmp: str, path: str, step: int, reader: Reader, values: dict,
           result: ExportResult) -> None:
    """Write the file under a temporary name, then rename it into place (never a half-written file)."""
    if fmt == "safetensors":
        save_file(out, tmp, metadata=values_metadata(step, reader, values, result))
    else:
        torch.save(out, tmp)
    follow_umask(tmp)
    os.replace(tmp, path)


def values_metadata(step: int, reader: Reader, values: dict, result: ExportResult) -> dict[str, str]:
    """The safetensors metadata of an export: ``format: pt`` (what transformers checks), the step,
    its source and the plain values (plain JSON where they are plain; the typed nodes of the rest
    under ``ckpt.values.tagged``)."""
    plain: dict[str, object] = {}
    tagged: dict[str, object] = {}
    for p, node in values.items():
        ok, v = plain_json(node)
        if ok:
            plain[p] = v
        else:
            tagged[p] = node
    meta = {"format": "pt", "ckpt.step": str(step), "ckpt.source": reader.storage.describe(),
            "ckpt.values": json.dumps(plain, separators=(",", ":"), allow_nan=False)}
    if tagged:
        meta["ckpt.values.tagged"] = json.dumps(tagged, separators=(",", ":"), allow_nan=False)
    if result.rank is not None:
        meta["ckpt.rank"] = str(result.rank)
    return meta


def per_rank_note(m: mf.Manifest, rank: int, result: ExportResult) -> str | None:
    """What ``ckpt export`` says about per-rank state: only the per-rank keys it exported (from one
    saved rank); nothing when the keys selected left them all out."""
    if not result.per_rank_keys:
        return None
    return (f"per-rank state {result.per_rank_keys} exported from saved rank {rank} of {m.world_size} "
            "(--rank R for another)")
