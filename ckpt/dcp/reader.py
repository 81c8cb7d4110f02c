"""``ckpt.dcp.Reader``: a DCP ``StorageReader`` over any committed ckpt step.

``read_metadata`` describes the step as DCP expects (per tensor its dtype, global shape and the
boxes of the saved shards; a bytes entry per plain value), named as DCP's own flattening names the
target state's items, so ``dcp.load`` plans the resharding for any world size and placement.
``read_data`` reads what each rank's plan asks for through ckpt's load path
(:func:`ckpt.load.reads.read_boxes`): every chunk read once and verified by its hash, each
requested box copied out of the shards that hold it. Steps written by ``Checkpointer.save`` and by
:class:`ckpt.dcp.Writer` read alike.
"""

from __future__ import annotations

import io
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from .._args import flag
from ..errors import CheckpointError, CheckpointNotFoundError, ConfigError, UnsupportedValueError
from ..format import manifest as mf
from ..format.planes import trim_scratch
from ..load.reads import BoxRequest, read_boxes
from ..storage import open_storage
from ..storage.base import Storage
from ..tree import DTYPES
from ._structure import Pickled, Value, dcp_view


class Reader(StorageReader):
    """Loads a committed ckpt step with ``dcp.load``, on any world size. Example::

        dcp.load(state, storage_reader=ckpt.dcp.Reader("s3://bucket/run", step="latest"))

    Args:
        url: the checkpoint root (a directory or an fsspec URL).
        step: a step number, or ``"latest"`` (the newest committed step whose manifest parses).
        storage_options: passed to fsspec (and, for ``s3://``, ckpt's S3 options).
        allow_pickle: hand DCP values the step stores pickled (unpickling runs code from the checkpoint: only
            for checkpoints you trust).
        io_threads: threads for reading and checking chunks.
        storage: an opened :class:`~ckpt.storage.base.Storage` instead of opening ``url``.

    Raises:
        ConfigError: a bad argument (it names it).
        CheckpointNotFoundError: at ``dcp.load``, the step is not committed.
    """

    def __init__(self, url: str | os.PathLike, *, step: int | str = "latest", storage_options: dict | None = None,
                 allow_pickle: bool = False, io_threads: int = 8, storage: Storage | None = None):
        if not isinstance(url, (str, os.PathLike)):
            raise ConfigError(f"ckpt.dcp.Reader needs a checkpoint path or URL, got {url!r}")
        if step != "latest" and (type(step) is not int or not 0 <= step <= mf.MAX_STEP):
            raise ConfigError(f"step must be 'latest' or an integer from 0 to {mf.MAX_STEP}, got {step!r}")
        flag("allow_pickle", allow_pickle)
        if type(io_threads) is not int or io_threads < 1:
            raise ConfigError(f"io_threads must be a positive integer, got {io_threads!r}")
        if storage is not None and storage_options is not None:
            raise ConfigError("storage= is an opened storage; storage_options would open another: give one or "
                              "the other")
        self.url, self.want, self.allow_pickle, self.io_threads = os.fspath(url), step, allow_pickle, io_threads
        self.storage_options = storage_options
        self._storage = storage
        self.manifest: mf.Manifest | None = None
        self.skipped: list[str] = []  # top-level keys saved per rank: DCP cannot load them
        self._items: dict[str, Any] = {}  # fqn -> tensor key (str) or Value

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "manifest": None, "_items": {}}

    @property
    def step(self) -> int:
        """The step this Reader reads: the number given, or the one ``"latest"`` resolved to when
        :meth:`read_metadata` ran (resolved now, if it has not). ``CheckpointNotFoundError`` when
        there is none (``dcp.load`` keeps only the text of that error: ask here to tell a new run)."""
        if self.manifest is not None:
            return self.manifest.step
        return self._read_step(self._open()).step

    # -- DCP's calls ----------------------------------------------------------------------------
    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id is not None and os.fspath(checkpoint_id) != self.url:
            raise ConfigError(f"ckpt.dcp.Reader reads {self.url!r}; dcp.load's checkpoint_id {checkpoint_id!r} "
                              "names another place: leave checkpoint_id out")

    # No **kwargs: DCP then never retries with read_metadata(rank=...), which would switch that one rank
    # to loading without collectives while the others use them (a hang after a transient failure).
    def read_metadata(self, *args: Any) -> Metadata:
        storage = self._open()
        m = self._read_step(storage)
        entries = {t.key: t for t in m.tensors if t.rank is None}
        shapes = {k: (DTYPES[t.dtype], list(t.shape)) for k, t in entries.items()}
        items, mappings, self.skipped = dcp_view(m.structure, shapes, self.allow_pickle)
        md: dict[str, Any] = {}
        for fqn, item in items.items():
            if isinstance(item, Value):
                md[fqn] = BytesStorageMetadata()
            else:
                t = entries[item]
                md[fqn] = TensorStorageMetadata(
                    TensorProperties(dtype=DTYPES[t.dtype]), torch.Size(t.shape),
                    [ChunkStorageMetadata(torch.Size(s.offsets), torch.Size(s.lengths)) for s in t.shards])
        self.manifest, self._items = m, items
        return Metadata(md, planner_data={f: mappings[f] for f in items},
                        storage_data={f: (v if isinstance(v, str) else None) for f, v in items.items()},
                        storage_meta=StorageMeta(checkpoint_id=self.url, load_id=str(m.step)))

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if self.manifest is None:  # a copy made after read_metadata (process boundaries)
            self.read_metadata()

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        m = self.manifest
        if m is None:
            raise CheckpointError("ckpt.dcp.Reader was not set up by DCP (use it as dcp.load's storage_reader)")
        tensors = [r for r in plan.items if r.type != LoadItemType.BYTE_IO]
        # every check first, as Checkpointer.load does: a refused value or a damaged chunk changes nothing
        values = [(r, self._value_bytes(r)) for r in plan.items if r.type == LoadItemType.BYTE_IO]
        self._load_tensors(m, tensors, planner)  # the caller's tensors change only once every chunk verified
        for r, data in values:
            planner.load_bytes(r, data)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return False  # chosen explicitly (storage_reader=), never guessed from a path

    # -- the work -------------------------------------------------------------------------------
    def _open(self) -> Storage:
        if self._storage is None:
            self._storage = open_storage(self.url, self.storage_options)
        return self._storage

    def _read_step(self, storage: Storage) -> mf.Manifest:
        if self.want != "latest":
            assert isinstance(self.want, int)
            return mf.read_step(storage, self.want)
        steps = mf.committed_steps(storage)
        errors = []
        for s in reversed(steps):
            try:
                return mf.read_step(storage, s)
            except CheckpointError as e:  # damaged: the next older one
                errors.append(f"step {s}: {e}")
        raise CheckpointNotFoundError(f"{storage.describe()} holds no committed step that reads"
                                      + (f" ({'; '.join(errors[:3])})" if errors else ""))

    def _value_bytes(self, r: ReadItem) -> io.BytesIO:
        """The value DCP asks for, as the ``torch.save`` bytes ``load_bytes`` takes (nothing applied yet)."""
        fqn = r.storage_index.fqn
        item = self._items.get(fqn)
        if not isinstance(item, Value):
            raise CheckpointError(f"step {self.manifest.step if self.manifest else '?'} holds no value {fqn!r}")
        if _has_pickled(item.value):
            raise UnsupportedValueError(
                f"{fqn!r} is stored pickled, and unpickling can run code from the checkpoint; pass "
                "ckpt.dcp.Reader(..., allow_pickle=True) only if you trust where it came from")
        data = io.BytesIO()
        torch.save(item.value, data)  # ours, built from the manifest's JSON values: safe to hand DCP
        data.seek(0)
        return data

    def _load_tensors(self, m: mf.Manifest, reads: list[ReadItem], planner: LoadPlanner) -> None:
        """Fill every requested box in one pass of ckpt's load path (each chunk read once, verified)."""
        if not reads:
            return
        entries = {t.key: t for t in m.tensors if t.rank is None}
        boxes, dests = [], []
        for r in reads:
            key = self._items.get(r.storage_index.fqn)
            if not isinstance(key, str):
                raise CheckpointError(f"step {m.step} holds no tensor {r.storage_index.fqn!r}")
            e = entries[key]
            target = planner.resolve_tensor(r)
            dest = target.detach()
            dtype = DTYPES[e.dtype]
            direct = dest.device.type == "cpu" and dest.is_contiguous() and dest.dtype == dtype
            into = dest if direct else torch.empty(tuple(r.lengths), dtype=dtype)
            base = r.storage_index.offset or (0,) * len(e.shape)
            offsets = tuple(int(a) + int(b) for a, b in zip(base, r.storage_offsets))
            boxes.append(BoxRequest(key, (offsets, tuple(into.shape)), into))
            dests.append((r, target, dest, into))
        with ThreadPoolExecutor(self.io_threads, thread_name_prefix="ckpt-dcp-read") as pool:
            # staged: a damaged chunk leaves the caller's tensors as they were; fresh tensors need no staging
            read_boxes(self._open(), m, boxes, pool, staged=any(into is dest for _, _, dest, into in dests))
        trim_scratch()  # decoding delta chains kept chunk-sized buffers per thread: reads are rare
        for r, target, dest, into in dests:
            if into is not dest:
                dest.copy_(into)
            planner.commit_tensor(r, target)


def _has_pickled(v: Any) -> bool:
    if isinstance(v, Pickled):
        return True
    if isinstance(v, dict):
        return any(_has_pickled(x) for x in (*v.keys(), *v.values()))
    if isinstance(v, (list, tuple)):
        return any(_has_pickled(x) for x in v)
    return False
