"""What ``ckpt import`` checks in a source before it allocates or commits anything.

- Regular files only: a FIFO, a device or a socket in place of a shard, an index or ``.metadata``
  is refused (opened non-blocking, so checking it cannot hang).
- JSON (a Hugging Face index, a safetensors header) is parsed only up to :data:`MAX_JSON_DEPTH`
  levels of nesting.
- A DCP ``.metadata`` is unpickled by an unpickler that builds only DCP's own metadata classes,
  ``torch.Size``, dtypes and plain containers: no code from the checkpoint runs.
- What a DCP directory declares is checked against its files: every chunk of a tensor is inside the
  tensor, the chunks cover it exactly once, each is backed by at least its bytes in a data file
  named inside the directory, and no two entries share bytes.
- :class:`Budget`: the tensors an import builds total at most ``max_bytes``, or by default
  :data:`EXPANSION` times the bytes of the source; and each tensor of a ``torch.save`` file (or a
  DCP value) is backed by its storage (an ``expand``-ed view is refused unless ``max_bytes`` allows it).
"""

from __future__ import annotations

import importlib
import itertools
import json
import math
import os
import pickle
import re
import stat
from typing import Any

import torch

from .errors import CheckpointError, ConfigError, CorruptCheckpointError, UnsupportedValueError

MAX_JSON_DEPTH = 64
EXPANSION = 4  # default bound: the tensors of an import total at most this many times the source's bytes
MAX_VALUE_DEPTH = 200  # nesting of the containers a torch.save file or a DCP value may hold
_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)
_BRACKETS = re.compile(rb"[^\[\]{}]")


def damaged(src: str, e: BaseException) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"{src} cannot be read ({type(e).__name__}: {e}); nothing was imported. "
                                  "Copy or download it again.", object=src)


def regular_size(path: str) -> int:
    """The size of ``path`` if it is a regular file (symbolic links followed); opened with
    ``O_NONBLOCK`` so that a FIFO does not block the check. Anything else is refused."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise damaged(path, e) from e
    try:
        st = os.fstat(fd)
    finally:
        os.close(fd)
    if not stat.S_ISREG(st.st_mode):
        kind = "a FIFO" if stat.S_ISFIFO(st.st_mode) else "a directory" if stat.S_ISDIR(st.st_mode) else \
            "a socket" if stat.S_ISSOCK(st.st_mode) else "a device" if stat.S_ISCHR(st.st_mode) or \
            stat.S_ISBLK(st.st_mode) else "not a regular file"
        raise CorruptCheckpointError(f"{path} is {kind}, not a regular file; ckpt imports only regular files "
                                     "(copy the data into a file). Nothing was imported.", object=path)
    return st.st_size


def parse_json(data: bytes, where: str) -> Any:
    """``json.loads`` of ``data``, refusing more than :data:`MAX_JSON_DEPTH` levels of nesting
    (counted outside strings) before parsing, instead of a ``RecursionError``."""
    brackets = _BRACKETS.sub(b"", _STRING.sub(b"", data))
    depth = max(itertools.accumulate(1 if c in b"[{" else -1 for c in brackets), default=0)
    if depth > MAX_JSON_DEPTH:
        raise CorruptCheckpointError(f"{where} nests JSON {depth} levels deep (at most {MAX_JSON_DEPTH} are "
                                     "read); it is not an index or header ckpt imports. Nothing was imported.",
                                     object=where)
    try:
        return json.loads(data)
    except (ValueError, RecursionError) as e:
        raise damaged(where, e) from e


def read_json(path: str) -> Any:
    regular_size(path)
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise damaged(path, e) from e
    return parse_json(data, path)


def safetensors_bytes(path: str) -> dict[str, int]:
    """Name -> bytes of each tensor of a safetensors file, from its header (nothing else read)."""
    size = regular_size(path)
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            n = int.from_bytes(head, "little") if len(head) == 8 else -1
            if not 0 < n <= size - 8:
                raise ValueError(f"header length {n} does not fit a file of {size} bytes")
            header = parse_json(f.read(n), path)
        return {k: int(v["data_offsets"][1]) - int(v["data_offsets"][0])
                for k, v in header.items() if k != "__metadata__"}
    except CheckpointError:
        raise
    except (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError) as e:
        raise damaged(path, e) from e


def parse_max_bytes(max_bytes: int | str | None) -> int | None:
    if max_bytes is None:
        return None
    from .reader.export import parse_size

    try:
        if isinstance(max_bytes, (int, str)) and not isinstance(max_bytes, bool):
            return parse_size(max_bytes)
    except ConfigError:
        pass
    raise ConfigError(f"max_bytes must be a number of bytes of at least 1, or a size such as 2GiB or 500MB, "
                      f"got {max_bytes!r}")


class Budget:
    """The bytes of tensors an import may build: ``max_bytes``, or :data:`EXPANSION` times ``source``."""

    def __init__(self, src: str, source: int, max_bytes: int | None):
        self.src, self.source, self.max_bytes = src, source, max_bytes
        self.limit = max_bytes if max_bytes is not None else EXPANSION * source
        self.used = 0

    def take(self, nbytes: int, what: str) -> None:
        self.used += nbytes
        if self.used <= self.limit:
            return
        if self.max_bytes is not None:
            raise ConfigError(f"importing {self.src} would build more than max_bytes={self.max_bytes} bytes of "
                              f"tensors (at least {self.used}, with {what}); nothing was imported. Raise max_bytes "
                              "(--max-bytes) if you mean it.")
        raise CorruptCheckpointError(
            f"{self.src} holds {self.source} bytes but its tensors would take {self.used} or more (at {what}): more "
            f"than {EXPANSION}x what the source holds. Nothing was imported. If the source is what you expect, "
            "pass max_bytes (--max-bytes) large enough for the imported tensors.", object=self.src)

    def check_values(self, items: Any) -> None:
        """Walk what a ``torch.save`` file or DCP values unpickled to: each tensor's bytes are taken
        from the budget and (unless ``max_bytes`` was given) must be backed by its storage."""
        todo: list[tuple[Any, str, int]] = [(items, "", 0)]
        while todo:
            node, path, depth = todo.pop()
            if depth > MAX_VALUE_DEPTH:
                raise UnsupportedValueError(f"{self.src} nests containers more than {MAX_VALUE_DEPTH} deep (at "
                                            f"{path!r}); nothing was imported")
            if isinstance(node, torch.Tensor):
                self._check_tensor(node, path or "the tensor")
            elif isinstance(node, dict):
                todo.extend((v, f"{path}/{k}" if path else str(k), depth + 1) for k, v in node.items())
            elif isinstance(node, (list, tuple, set, frozenset)):
                todo.extend((v, f"{path}/{i}", depth + 1) for i, v in enumerate(node))

    def _check_tensor(self, t: torch.Tensor, path: str) -> None:
        nbytes = t.numel() * t.element_size()
        if self.max_bytes is None and t.layout == torch.strided:
            held = t.untyped_storage().nbytes()
            if nbytes > held:
                raise CorruptCheckpointError(
                    f"{self.src}: {path!r} is a {tuple(t.shape)} {t.dtype} view of {nbytes} bytes over a storage of "
                    f"{held} bytes (an expand()-ed or overlapping view); importing it would build all {nbytes}. "
                    "Nothing was imported. Pass max_bytes (--max-bytes) to allow it, or save the tensor itself "
                    "(.clone()).", object=self.src)
        self.take(nbytes, repr(path))


# -- DCP .metadata ------------------------------------------------------------------------------------

_DCP_META = "torch.distributed.checkpoint.metadata"
_ALLOWED: dict[str, frozenset[str]] = {
    _DCP_META: frozenset({"Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
                          "BytesStorageMetadata", "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING"}),
    "torch.distributed.checkpoint.filesystem": frozenset({"_StorageInfo"}),
    "torch.serialization": frozenset({"_get_layout"}),  # torch.strided from its name, as DCP pickles it
    "pathlib": frozenset({"PosixPath", "PurePosixPath"}),  # StorageMeta.checkpoint_id
    "collections": frozenset({"OrderedDict"}),
}


class _MetadataUnpickler(pickle.Unpickler):
    """Builds DCP's metadata classes, torch.Size, dtypes and plain containers; any other global
    (``os.system``, ``builtins.eval``, a class of the checkpoint's) is refused before it is looked up."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" and (name == "Size" or isinstance(getattr(torch, name, None), torch.dtype)):
            return getattr(torch, name)
        if name in _ALLOWED.get(module, ()):
            return getattr(importlib.import_module(module), name)
        raise _Forbidden(f"{module}.{name}")


class _Forbidden(pickle.UnpicklingError):
    pass


def read_dcp_metadata(src: str) -> Any:
    """DCP's ``Metadata`` of the directory ``src``, unpickled without running code from it."""
    path = os.path.join(src, ".metadata")
    regular_size(path)
    try:
        with open(path, "rb") as f:
            md = _MetadataUnpickler(f).load()
    except _Forbidden as e:
        raise UnsupportedValueError(
            f"{path} names {e}, which is not one of DCP's metadata classes: unpickling it could run code, and ckpt "
            "never runs code from a checkpoint. Nothing was imported. If you trust the directory, load it with "
            "torch.distributed.checkpoint yourself and save the state with ckpt.Checkpointer.") from None
    except Exception as e:  # a truncated or garbled pickle, or an allowed class given bad arguments
        raise damaged(path, e) from e
    from torch.distributed.checkpoint.metadata import Metadata

    if not isinstance(md, Metadata):
        raise CorruptCheckpointError(f"{path} holds a {type(md).__name__}, not DCP's Metadata", object=path)
    return md


def _ints(x: Any, n: int | None = None) -> tuple[int, ...] | None:
    if not isinstance(x, (tuple, list)) or (n is not None and len(x) != n):
        return None
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in x):
        return None
    return tuple(x)


def _overlap(boxes: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> bool:
    """Whether two of the (offsets, sizes) boxes share an element: a sweep along the dimension the
    chunks are split most along (rows or columns of a sharded tensor: each box meets its neighbours)."""
    boxes = [b for b in boxes if 0 not in b[1]]
    ndim = len(boxes[0][0]) if boxes else 0
    d = max(range(ndim), key=lambda i: len({b[0][i] for b in boxes}), default=0)
    boxes.sort(key=lambda b: b[0][d] if ndim else 0)
    for i, (off, size) in enumerate(boxes):
        for off2, size2 in boxes[i + 1:]:
            if ndim and off2[d] >= off[d] + size[d]:
                break
            if all(o2 < o + s and o < o2 + s2 for o, s, o2, s2 in zip(off, size, off2, size2)):
                return True
    return False


def check_dcp(src: str, md: Any) -> tuple[dict[str, tuple[torch.Size, torch.dtype]], int, int]:
    """Check DCP metadata against the directory. Returns the tensors (fqn -> shape, dtype), the bytes
    they declare, and the bytes of the files the metadata names (with ``.metadata``)."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    where = os.path.join(src, ".metadata")

    def bad(msg: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"{where}: {msg}; nothing was imported. The directory is not what its "
                                      "metadata says: copy it again from where it was saved.", object=where)

    entries, storage = md.state_dict_metadata, md.storage_data
    if not isinstance(entries, dict) or not isinstance(storage, dict):
        raise bad("state_dict_metadata or storage_data is not a mapping")
    info: dict[tuple[str, tuple[int, ...] | None], Any] = {}
    for k, v in storage.items():
        if not isinstance(k, MetadataIndex) or not isinstance(v, _StorageInfo) or not isinstance(k.fqn, str):
            raise bad(f"storage entry {k!r} is not an index and a file location")
        info[(k.fqn, None if k.offset is None else tuple(k.offset))] = v
    files = _check_locations(src, info.values(), bad)
    tensors: dict[str, tuple[torch.Size, torch.dtype]] = {}
    declared = 0
    for fqn, m in entries.items():
        if not isinstance(fqn, str):
            raise bad(f"item {fqn!r} is not named by a string")
        if isinstance(m, BytesStorageMetadata):
            if (fqn, None) not in info:
                raise bad(f"value {fqn!r} has no storage entry")
            continue
        if not isinstance(m, TensorStorageMetadata) or not isinstance(m.properties, TensorProperties) or \
                not isinstance(m.properties.dtype, torch.dtype) or not isinstance(m.chunks, list):
            raise bad(f"item {fqn!r} is neither a tensor's nor a value's metadata")
        shape = _ints(m.size)
        if shape is None:
            raise bad(f"tensor {fqn!r} has size {m.size!r}, not a tuple of non-negative integers")
        itemsize = m.properties.dtype.itemsize
        boxes, covered = [], 0
        for c in m.chunks:
            off = _ints(getattr(c, "offsets", None), len(shape)) if isinstance(c, ChunkStorageMetadata) else None
            size = _ints(getattr(c, "sizes", None), len(shape)) if off is not None else None
            if off is None or size is None or any(o + s > d for o, s, d in zip(off, size, shape)):
                raise bad(f"a chunk of tensor {fqn!r} {getattr(c, 'offsets', c)!r} is not inside its size {shape}")
            loc = info.get((fqn, off))
            if loc is None:
                raise bad(f"chunk {off} of tensor {fqn!r} has no storage entry")
            n = math.prod(size)
            if not loc.transform_descriptors and n * itemsize > loc.length:
                raise bad(f"chunk {off} of tensor {fqn!r} declares {n * itemsize} bytes but its entry in "
                          f"{loc.relative_path} holds {loc.length}")
            boxes.append((off, size))
            covered += n
        numel = math.prod(shape)
        if covered != numel or _overlap(boxes):
            raise bad(f"the chunks of tensor {fqn!r} ({len(boxes)}) do not cover its {numel} elements exactly once"
                      + (" (it has none)" if not boxes else ""))
        tensors[fqn] = (torch.Size(shape), m.properties.dtype)
        declared += numel * itemsize
    return tensors, declared, files + os.path.getsize(where)


def _check_locations(src: str, locations: Any, bad: Any) -> int:
    """Every entry names a regular file inside ``src`` and a byte range inside it, no two sharing
    bytes; returns the total size of the files named."""
    sizes: dict[str, int] = {}
    ranges: dict[str, list[tuple[int, int]]] = {}
    for loc in locations:
        rel, offset, length = loc.relative_path, loc.offset, loc.length
        if not isinstance(rel, str) or not rel or os.path.isabs(rel) or ".." in re.split(r"[\\/]", rel) or \
                "\0" in rel:
            raise bad(f"a storage entry names {rel!r}, which is not a file inside {src}")
        if not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in (offset, length)):
            raise bad(f"a storage entry of {rel} has offset {offset!r} and length {length!r}")
        td = loc.transform_descriptors
        if td is not None and not (isinstance(td, (list, tuple)) and all(isinstance(s, str) for s in td)):
            raise bad(f"a storage entry of {rel} has transforms {td!r}")
        if rel not in sizes:
            sizes[rel] = regular_size(os.path.join(src, rel))
        if offset + length > sizes[rel]:
            raise bad(f"a storage entry reads bytes {offset}-{offset + length} of {rel}, which has {sizes[rel]}")
        ranges.setdefault(rel, []).append((offset, offset + length))
    for rel, spans in ranges.items():
        spans.sort()
        if any(b[0] < a[1] for a, b in itertools.pairwise(spans)):
            raise bad(f"two storage entries share bytes of {rel}")
    return sum(sizes.values())
