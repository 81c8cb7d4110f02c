"""Reading a checkpoint from Python, without a Checkpointer or a process group: ``ckpt.open``.

    import ckpt
    with ckpt.open("runs/exp1") as ck:            # a directory or any fsspec URL
        ck.steps()                                # [100, 200, 300]
        weights = ck.tensors(keys="model/")       # whole tensors, resharded from any world size
        ck.values()["step"]                       # plain values, as saved
        ck.verify(all=True).ok                    # every chunk re-read and re-hashed
        ck.export(300, "model.safetensors", keys="model/", strip_prefix=True)

The ``ckpt`` command line is built on it. Nothing here unpickles: a value saved with pickle comes
back as a :class:`Pickled` placeholder.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from . import tree as st
from .catalog import Catalog, TensorChange, VerifyResult, diff, read_tensors, verify
from .errors import ConfigError
from .export import ExportResult, export
from .format import manifest as mf
from .storage import open_storage

Step = int | str | None  # a step number, or None / "latest" for the newest committed step


@dataclass(frozen=True)
class Pickled:
    """A value saved with pickle. Readers never unpickle; load it with a Checkpointer and
    ``allow_pickle=True`` if you trust the checkpoint."""

    path: str


@dataclass
class Diff:
    """What differs between two steps: tensors (``status`` added / removed / changed / same, and
    how it was decided) and plain values (path, value in a, value in b, as short previews)."""

    a: int
    b: int
    tensors: list[TensorChange] = field(default_factory=list)
    values: list[tuple[str, str, str]] = field(default_factory=list)

    @property
    def identical(self) -> bool:
        return not self.values and all(c.status == "same" for c in self.tensors)


def _prefixes(keys: str | Sequence[str] | None) -> list[str] | None:
    if keys is None:
        return None
    return [keys] if isinstance(keys, str) else list(keys)


class Reader:
    """A checkpoint root opened for reading. See :func:`open`."""

    def __init__(self, url: str | os.PathLike, storage_options: dict | None = None, *, threads: int = 8):
        if not isinstance(url, (str, os.PathLike)):
            raise ConfigError(f"a checkpoint URL must be a string or os.PathLike, got {url!r}")
        self.url = os.fspath(url)
        self.storage = open_storage(self.url, storage_options)
        self.catalog = Catalog(self.storage)
        self.threads = threads

    # -- what is there -----------------------------------------------------------------------------
    def steps(self) -> list[int]:
        """The committed steps, ascending."""
        return list(self.catalog.committed)

    def latest(self) -> int | None:
        return self.catalog.committed[-1] if self.catalog.committed else None

    def step(self, step: Step = None) -> int:
        """A committed step number: ``step`` itself, or the newest for None / ``"latest"``."""
        s = self.catalog.resolve(step)
        self.catalog.require(s)
        return s

    def manifest(self, step: Step = None) -> mf.Manifest:
        """The parsed, checked manifest of a committed step (default: the newest)."""
        return self.catalog.require(self.catalog.resolve(step))

    # -- contents ----------------------------------------------------------------------------------
    def tensors(self, step: Step = None, keys: str | Sequence[str] | None = None, *, rank: int = 0
                ) -> dict[str, torch.Tensor]:
        """Whole tensors of a step (default: the newest), by key (``"model/0.weight"``), assembled
        from the shards of any world size, every chunk verified. ``keys``: names or key prefixes
        (``"model/"``) to read; only the chunks those need are read. Per-rank tensors are saved
        rank ``rank``'s."""
        m = self.manifest(step)
        wanted = _prefixes(keys)
        entries = [t for t in m.tensors if (t.rank is None or t.rank == rank)
                   and (wanted is None or any(t.key == p or t.key.startswith(p) for p in wanted))]
        if wanted is not None and not entries:
            raise ConfigError(f"step {m.step} has no tensor named or starting with {wanted}; its keys begin "
                              f"{sorted({t.key.split('/', 1)[0] + '/' for t in m.tensors})}")
        with ThreadPoolExecutor(self.threads, thread_name_prefix="ckpt-read") as io:
            return dict(zip([e.key for e in entries], read_tensors(self.storage, m, entries, io)))

    def values(self, step: Step = None, *, rank: int | None = None) -> dict[str, Any]:
        """The plain values of a step by key path (``"step"``, ``"optim/param_groups/0/lr"``).
        Per-rank values come with a ``[rank r]`` suffix, or only rank ``rank``'s when it is given.
        Pickled values are :class:`Pickled` placeholders, never unpickled."""
        m = self.manifest(step)
        nodes = list(st.value_nodes(m.structure, rank=rank))
        # Tensors inside values (numpy's RNG state is a tuple holding an array): read them too,
        # each from the rank whose value it is.
        def rank_of(path: str) -> int:
            found = re.search(r"\[rank (\d+)\]", path)
            return rank if rank is not None else int(found.group(1)) if found else 0
        wanted: dict[int, set[str]] = {}
        for path, node in nodes:
            wanted.setdefault(rank_of(path), set()).update(st.tensor_keys(node))
        tensors = {r: self.tensors(m.step, sorted(keys), rank=r) if keys else {} for r, keys in wanted.items()}
        out: dict[str, Any] = {}
        for path, node in nodes:
            def placeholder(_node: dict, where: str = path) -> Pickled:
                return Pickled(where)
            out[path] = st.rebuild(node, tensors[rank_of(path)], allow_pickle=False, on_pickle=placeholder)
        return out

    # -- checks and tools --------------------------------------------------------------------------
    def verify(self, step: Step = None, *, all: bool = False,
               progress: Callable[[int, int], None] | None = None) -> VerifyResult:
        """Re-read and re-hash every chunk of a step (default: the newest) or of ``all`` committed
        steps; ``result.ok``, and ``result.problems`` name each damaged or missing object."""
        steps = self.steps() if all else [self.step(step)]
        return verify(self.catalog, steps, threads=self.threads, progress=progress)

    def diff(self, a: Step, b: Step, *, max_diff: bool = False) -> Diff:
        """Tensors and values that differ between steps ``a`` and ``b`` (by chunk hashes where they
        decide it, else by bytes; ``max_diff`` reads changed tensors for the largest difference)."""
        sa, sb = self.step(a), self.step(b)
        tensors, values = diff(self.catalog, sa, sb, max_diff=max_diff, threads=self.threads)
        return Diff(sa, sb, tensors, values)

    def export(self, step: Step, path: str | os.PathLike, *, keys: str | Sequence[str] | None = None,
               strip_prefix: bool = False, rank: int = 0, overwrite: bool = False) -> ExportResult:
        """Write one step as a single unsharded ``.safetensors`` or ``.pt`` file. With ``keys`` and
        ``strip_prefix``, the matched prefix is taken off each name, so that
        ``model.load_state_dict(safetensors.torch.load_file(path))`` works as it is."""
        return export(self.catalog, self.step(step), os.fspath(path), prefixes=_prefixes(keys),
                      strip_prefix=strip_prefix, rank=rank, overwrite=overwrite, threads=self.threads)

    def close(self) -> None:
        self.storage.close()

    def __enter__(self) -> Reader:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"ckpt.open({self.url!r}): {len(self.catalog.committed)} committed step(s)"


def open(url: str | os.PathLike, storage_options: dict | None = None) -> Reader:  # only as ckpt.open
    """Open a checkpoint root for reading: steps, manifests, whole tensors, values, verify, diff,
    export. ``url`` is a directory or any fsspec URL; ``storage_options`` go to fsspec (and, for
    ``s3://``, ckpt's S3 options). Raises :class:`~ckpt.NotACheckpointError` if nothing is there."""
    return Reader(url, storage_options)
