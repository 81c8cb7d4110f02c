"""Bringing weights saved elsewhere into a ckpt checkpoint as a committed step: ``ckpt.import_checkpoint``,
``ckpt import SRC URL --step N``.

Sources: a ``.safetensors`` file, a Hugging Face directory (``*.safetensors.index.json`` and its
shards, or one ``model.safetensors``), a ``torch.save`` file (``.pt``/``.pth``/``.bin``, read with
``weights_only=True``: no code from the file runs) and a plain ``torch.distributed.checkpoint``
directory (its ``.metadata`` unpickled with an allow-list of DCP's own classes, its data with DCP's
``FileSystemReader``; its non-tensor items with ``weights_only=True`` too). What a source declares
is checked against what it holds, and what an import builds is bounded (``import_checks``).
The source is read whole and checked before anything is written; the step is then saved by one
``Checkpointer.save`` (verified, deduplicated, loadable by every front end).
"""

from __future__ import annotations

import io
import os
import pickle
import stat
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ._args import flag
from .errors import (
    CheckpointError,
    ConfigError,
    CorruptCheckpointError,
    NotACheckpointError,
    StepExistsError,
    UnsupportedValueError,
)
from .format.manifest import MAX_STEP
from .import_checks import (
    Budget,
    check_dcp,
    damaged,
    parse_max_bytes,
    read_dcp_metadata,
    read_json,
    regular_size,
    safetensors_bytes,
)


class ImportedState:
    """The imported names and tensors under one top-level key, saved as an object with
    ``state_dict()``: ``Checkpointer.load(step, {"model": model})`` then hands them to
    ``model.load_state_dict`` (a plain dict there would not load into a module)."""

    def __init__(self, state: dict[str, Any]):
        self.state = state

    def state_dict(self) -> dict[str, Any]:
        return self.state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.state = dict(state)


@dataclass
class ImportResult:
    source: str
    url: str
    step: int
    format: str  # "safetensors", "hf", "torch" or "dcp"
    key: str | None
    tensors: int = 0
    bytes: int = 0
    values: list[str] = field(default_factory=list)  # names of non-tensor items imported


def source_format(src: str) -> str:
    """What ``src`` is: ``safetensors``, ``hf``, ``torch`` or ``dcp``; refuses anything else."""
    if os.path.isdir(src):
        names = os.listdir(src)
        if ".metadata" in names:
            return "dcp"
        if any(n.endswith(".safetensors.index.json") for n in names) or "model.safetensors" in names:
            return "hf"
        hint = " (pytorch_model.bin shards are pickles: convert them to safetensors)" if any(
            n.endswith(".bin.index.json") for n in names) else ""
        raise ConfigError(f"{src} is neither a Hugging Face directory (model.safetensors or *.safetensors.index.json) "
                          f"nor a DCP checkpoint (.metadata){hint}")
    if not os.path.exists(src):
        raise ConfigError(f"{src}: no such file or directory")
    if not stat.S_ISREG(os.stat(src).st_mode):
        raise ConfigError(f"{src} is not a regular file (a FIFO, device or socket): import a file or a directory")
    ext = os.path.splitext(src)[1].lower()
    if ext == ".safetensors":
        return "safetensors"
    if ext in (".pt", ".pth", ".bin"):
        return "torch"
    raise ConfigError(f"cannot tell what {src} is: name it *.safetensors or *.pt/*.pth/*.bin (torch.save), or "
                      "pass a Hugging Face or DCP directory")


def _read_safetensors(path: str, budget: Budget, names: Sequence[str] | None = None) -> dict[str, torch.Tensor]:
    """The tensors of one safetensors file (``names`` of them, if given), read while it is open."""
    from safetensors import safe_open

    sizes = safetensors_bytes(path)  # a regular file; what it declares taken from the budget before reading
    for n in (names if names is not None else sizes):
        budget.take(sizes.get(n, 0), repr(n))
    try:
        with safe_open(path, framework="pt", device="cpu") as f:
            have = list(f.keys())
            if names is not None:
                missing = sorted(set(names) - set(have))
                if missing:
                    raise CorruptCheckpointError(
                        f"{path} lacks {missing[:5]}, which the index places there; nothing was imported. "
                        "The directory is incomplete or mixes two exports.", object=path)
            return {n: f.get_tensor(n) for n in (names if names is not None else have)}
    except CheckpointError:
        raise
    except Exception as e:  # safetensors' own errors (a truncated file, a bad header) and OSError
        raise damaged(path, e) from e


def _read_hf(src: str, max_bytes: int | None) -> dict[str, torch.Tensor]:
    indexes = sorted(n for n in os.listdir(src) if n.endswith(".safetensors.index.json"))
    if not indexes:
        one = os.path.join(src, "model.safetensors")
        return _read_safetensors(one, Budget(src, regular_size(one), max_bytes))
    if len(indexes) > 1:
        raise ConfigError(f"{src} holds several indexes {indexes}: import the shards of one of them (point at a "
                          "directory holding only that model)")
    where = os.path.join(src, indexes[0])
    try:
        weight_map = read_json(where)["weight_map"]
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise ValueError("weight_map is not a mapping of names to file names")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise damaged(where, e) from e
    files: dict[str, list[str]] = {}
    for name, file in weight_map.items():
        if os.path.basename(file) != file:
            raise CorruptCheckpointError(f"{where} names a shard outside its directory ({file!r})", object=where)
        files.setdefault(file, []).append(name)
    lost = sorted(f for f in files if not os.path.lexists(os.path.join(src, f)))
    if lost:
        raise CorruptCheckpointError(f"{where} names shard(s) {lost[:5]} that are not in {src}; nothing was "
                                     "imported", object=where)
    budget = Budget(src, sum(regular_size(os.path.join(src, f)) for f in files), max_bytes)
    out: dict[str, torch.Tensor] = {}
    for file, names in files.items():  # one file open at a time
        out.update(_read_safetensors(os.path.join(src, file), budget, names))
    return {n: out[n] for n in weight_map}  # the index's order


def _read_torch(src: str, max_bytes: int | None) -> Any:
    def load(mmap: bool) -> Any:
        return torch.load(src, map_location="cpu", weights_only=True, mmap=mmap)

    budget = Budget(src, regular_size(src), max_bytes)
    try:
        try:
            items = load(True)
        except RuntimeError as e:
            if "mmap" not in str(e):  # the legacy (non-zip) format cannot be mapped: read it
                raise
            items = load(False)
    except pickle.UnpicklingError as e:
        raise UnsupportedValueError(
            f"{src} holds objects beyond tensors and plain containers, and torch.load(weights_only=True) refused "
            f"them ({e}). ckpt never runs code from a file: if you trust it, load it yourself and save the "
            "state with ckpt.Checkpointer") from e
    except Exception as e:
        raise damaged(src, e) from e
    budget.check_values(items)  # mapped, not yet copied: an expand()-ed view is refused before save() builds it
    return items


def _read_dcp(src: str, max_bytes: int | None) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.metadata import StorageMeta

    md = read_dcp_metadata(src)  # an allow-list unpickler: never DCP's own pickle.load
    tensors, declared, held = check_dcp(src, md)
    budget = Budget(src, held, max_bytes)
    budget.take(declared, "the tensors its metadata declares")

    class CheckedReader(dcp.FileSystemReader):
        """DCP's reader, handed the metadata read and checked above instead of unpickling it again."""

        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            if md.storage_meta is None:
                md.storage_meta = StorageMeta()
            md.storage_meta.load_id = self.load_id
            return md

    class SafeBytes(DefaultLoadPlanner):
        """DCP's planner, but non-tensor items are unpickled with weights_only=True (DCP's own
        planner runs any code they hold)."""

        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            try:
                self.original_state_dict[read_item.dest_index.fqn] = torch.load(value, weights_only=True)
            except pickle.UnpicklingError as e:
                raise UnsupportedValueError(
                    f"{src}: item {read_item.dest_index.fqn!r} is a pickled object that torch.load(weights_only=True) "
                    f"refused ({e}); ckpt never runs code from a checkpoint") from e

    try:
        reader = CheckedReader(src)
        state: dict[str, Any] = {k: torch.empty(tensors[k][0], dtype=tensors[k][1]) if k in tensors else None
                                 for k in md.state_dict_metadata}
        import warnings

        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.simplefilter("ignore", UserWarning)
            planner = SafeBytes(flatten_state_dict=False, flatten_sharded_tensors=False)
            dcp.load(state, storage_reader=reader, planner=planner, no_dist=True)
    except CheckpointError:
        raise
    except Exception as e:
        cause: BaseException = e
        while cause.__cause__ is not None and not isinstance(cause, CheckpointError):  # DCP wraps rank errors
            cause = cause.__cause__
        if isinstance(cause, CheckpointError):
            raise cause from e
        raise damaged(src, e) from e
    budget.check_values({k: v for k, v in state.items() if k not in tensors})  # values unpickled weights_only
    return state


def _select(items: dict, prefixes: list[str] | None, strip: bool, src: str) -> dict:
    if not prefixes:
        return items
    out: dict = {}
    for k, v in items.items():
        hit = max((p for p in prefixes if isinstance(k, str) and k.startswith(p)), key=len, default=None)
        if hit is None:
            continue
        name = (k[len(hit):].lstrip("./") or k) if strip else k
        if name in out:
            raise ConfigError(f"with --strip-prefix, several items of {src} would be named {name!r}; import "
                              "them separately or without --strip-prefix")
        out[name] = v
    if not out:
        raise ConfigError(f"{src} has nothing whose name starts with {' or '.join(map(repr, prefixes))}; its "
                          f"names begin {sorted({str(k).split('.', 1)[0] for k in items})[:8]}")
    return out


def _check_top(items: dict, src: str, what: str, reserved: str | None = None) -> None:
    bad = [k for k in items if not isinstance(k, str) or not k or "/" in k or k == reserved]
    if bad:
        raise ConfigError(f"{what}the items {bad[:5]} of {src} would be top-level keys of the step, and a key is a "
                          f"non-empty string without '/'{f' other than {reserved!r}' if reserved else ''}. Import "
                          "a torch.save dict of dicts with key=None (--top-level), or select items with keys=")


def _committed(url: str, storage_options: dict | None) -> list[int]:
    from .reader import Reader

    try:
        return Reader(url, storage_options).steps()
    except NotACheckpointError:
        return []  # a new checkpoint


def import_checkpoint(src: str | os.PathLike, url: str | os.PathLike, step: int, *, key: str | None = "model",
                      keys: str | Sequence[str] | None = None, strip_prefix: bool = False,
                      max_bytes: int | str | None = None, **options: Any) -> ImportResult:
    """Import weights saved elsewhere as committed step ``step`` of the checkpoint at ``url``.

    ``src`` is a ``.safetensors`` file, a Hugging Face directory (index and shards, or one
    ``model.safetensors``), a ``torch.save`` file (read with ``weights_only=True``, memory-mapped) or
    a plain DCP directory. Its tensors (name -> tensor) are saved under the top-level ``key``
    (default ``"model"``), its other items (plain values of a ``torch.save`` dict or a DCP
    checkpoint) beside it under their own names, so that a fine-tuning run does::

        ckpt.import_checkpoint("Llama-3-8B/", "runs/ft", step=0)
        ckptr = ckpt.Checkpointer("runs/ft")
        ckptr.load(0, {"model": model}, strict=False)    # model.load_state_dict(the imported weights)

    ``key=None`` keeps the top-level keys of a ``torch.save`` dict (``{"model": ..., "optim": ...}``),
    each dict among them loadable into its object. ``keys`` (name prefixes) selects items;
    ``strip_prefix`` takes the matched prefix off their names (``model.layers.0`` with
    ``keys="model."`` becomes ``layers.0``). ``options`` go to :class:`ckpt.Checkpointer`.

    ``max_bytes`` (bytes, or a size such as ``"2GiB"``) bounds the tensors the import builds; by
    default they may total 4x the bytes of the source, and a tensor of a ``torch.save`` file must be
    backed by its storage (an ``expand()``-ed view is refused). A source whose metadata does not
    match its data, a name leading out of the directory, a FIFO or other non-regular file, JSON
    nested over 64 deep, or a DCP ``.metadata`` naming anything but DCP's own classes is refused.

    Refuses a step that is already committed (:class:`~ckpt.StepExistsError`) and a damaged source
    (:class:`~ckpt.CorruptCheckpointError`), before anything is written. Memory: safetensors files
    are read one at a time, but the whole step is held in memory for its one ``save()``.

    Args:
        src: the weights: a ``.safetensors`` file, a Hugging Face directory, a ``torch.save`` file or a DCP
            directory.
        url: the ckpt root to import into.
        step: the step to commit.
        key: the top-level key the tensors go under (None: keep a ``torch.save`` dict's own keys).
        keys: name prefixes of the items to import (default: all).
        strip_prefix: take the matched prefix off each name.
        max_bytes: the most bytes the tensors the import builds may total (bytes or ``"2GiB"``; default 4x
            the source's bytes).
        **options: options of :class:`ckpt.Checkpointer`.

    Returns:
        ImportResult: the step committed, the source's format, how many tensors and bytes, and the names of
        the values imported beside them.

    Raises:
        ConfigError: ``src`` is not a format the import reads, an argument is bad (it says which), or the
            tensors would pass ``max_bytes``.
        StepExistsError: the step is committed already.
        CorruptCheckpointError: the source is damaged, or its metadata does not match its data.
        UnsupportedValueError: the source holds objects the import refuses (pickled objects, containers nested
            too deep, a DCP ``.metadata`` naming other classes).
    """
    flag("strip_prefix", strip_prefix)
    src, url = os.fspath(src), os.fspath(url)
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= MAX_STEP:
        raise ConfigError(f"step must be an integer from 0 to {MAX_STEP}, got {step!r}")
    if key is not None and (not isinstance(key, str) or not key or "/" in key):
        raise ConfigError(f"key must be a non-empty name without '/', or None, got {key!r}")
    prefixes = [keys] if isinstance(keys, str) else list(keys) if keys is not None else None
    if strip_prefix and not prefixes:
        raise ConfigError("strip_prefix needs keys: the prefix to take off each name (e.g. keys='model.')")
    limit = parse_max_bytes(max_bytes)
    fmt = source_format(src)
    storage_options = options.get("storage_options")
    if step in _committed(url, storage_options):
        raise StepExistsError(f"step {step} is already committed in {url}, and committed steps are never "
                              "overwritten: import as another --step, or into another checkpoint")

    items: Any
    if fmt == "safetensors":
        items = _read_safetensors(src, Budget(src, regular_size(src), limit))
    elif fmt == "hf":
        items = _read_hf(src, limit)
    elif fmt == "dcp":
        items = _read_dcp(src, limit)
    else:
        items = _read_torch(src, limit)
    if not isinstance(items, dict):
        if key is None or prefixes:
            raise ConfigError(f"{src} holds a {type(items).__name__}, not a dict: import it under a key "
                              "(key='model'), without keys=")
        state: dict[str, Any] = {key: items}
    else:
        items = _select(items, prefixes, strip_prefix, src)
        if key is not None:  # tensors under the key; other items (DCP's "step", an epoch) beside it
            others = {k: v for k, v in items.items() if not isinstance(v, torch.Tensor)}
            _check_top(others, src, f"besides the tensors under {key!r}, ", reserved=key)
            state = {key: ImportedState({k: v for k, v in items.items() if k not in others}), **others}
        else:
            _check_top(items, src, "with key=None, ")
            state = {k: ImportedState(v) if isinstance(v, dict) else v for k, v in items.items()}

    result = ImportResult(source=src, url=url, step=step, format=fmt, key=key)
    _count(items, result, "")
    from .checkpointer import Checkpointer

    with Checkpointer(url, **options) as c:
        c._run_journal = c._engine.journal = None  # an import is no start of a training job: no run journal
        c.save(step, state).wait()
    return result


def _count(node: Any, result: ImportResult, path: str) -> None:
    if isinstance(node, torch.Tensor):
        result.tensors += 1
        result.bytes += node.numel() * node.element_size()
    elif isinstance(node, dict):
        for k, v in node.items():
            _count(v, result, f"{path}/{k}" if path else str(k))
    else:
        result.values.append(path)
