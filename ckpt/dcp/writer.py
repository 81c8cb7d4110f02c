"""``ckpt.dcp.Writer``: a DCP ``StorageWriter`` that stores a ``dcp.save`` as a ckpt step.

DCP plans (which rank writes which item, replicated items once); ckpt stores. On each rank,
``write_data`` lays the rank's items out in a host buffer (:func:`ckpt.save.buffer_layout.make_layout`,
:class:`ckpt.save.snapshot.HostBuffer`) and hands it to ckpt's writer (:meth:`ckpt.save.writer.Writer.write_part`):
content-addressed, hashed chunks, dedup against what is stored, codecs (XOR deltas against the same
rank's previous save into the same root), durable writes through ``local_dir`` when given, then the
rank's report (``steps/<S>/rank-<r>.json``). All of it runs on the save engine the Checkpointer uses
(:class:`ckpt.save.engine.SaveEngine`), one per root and options in this process, kept across saves
(:mod:`ckpt.dcp.engines`). ``finish``, on the coordinator, reads every rank's report, rebuilds the
nested structure from DCP's metadata and commits ``MANIFEST.json`` create-only
(:func:`ckpt.save.committer.commit_step`); retention follows. Until then no
step is visible: a rank killed midway leaves only chunks and reports, for ``ckpt gc``.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from .. import tree as st
from ..errors import CheckpointError, ConfigError, StepExistsError
from ..flatten import Leaf, piece_key
from ..format import manifest as mf
from ..format import paths
from ..handle import SaveMetrics
from ..options import Options, check_storage
from ..save.buffer_layout import make_layout
from ..save.committer import commit_step
from ..save.job import SaveJob
from ..save.snapshot import HostBuffer, Snapshot
from ..save.writer import STEP_EXISTS_ADVICE
from ..storage.base import Storage
from . import _serial, engines
from ._structure import build_structure, check_keys, tensor_key, value_node
from .stager import DONE, READING, SEQ, Header, release_pending

log = logging.getLogger("ckpt")

# Checkpointer options a DCP save has no use for, and why.
REFUSED = {
    "every": "DCP saves when you call dcp.save", "preemption": "DCP saves when you call dcp.save",
    "mtbf": "DCP saves when you call dcp.save", "max_overhead": "DCP saves when you call dcp.save",
    "preemption_deadline": "DCP saves when you call dcp.save",
    "on_save_error": "dcp.save raises a failed save, and async_save's future",
    "persist_every": "every DCP save goes to the checkpoint path (with local_dir and redundancy, to the local "
                     "directories too)",
    "busy": "ckpt.dcp.Stager decides when the buffer is free",
    "check_finite": "DCP's flat state does not say which tensors are parameters; use the Checkpointer",
    "strict": "it is a load option",
    "shared_root": "each rank of a DCP save holds its own lease, so ckpt.dcp.Writer never refuses a shared root",
    "host_memory": "DCP copies its whole state where it stages it (ckpt.dcp.Stager holds one buffer of its size); "
                   "use the Checkpointer to save within a budget",
}


class Writer(StorageWriter):
    """Stores ``dcp.save`` / ``dcp.async_save`` as committed ckpt steps. Example::

        dcp.save({"model": model.state_dict(), "optim": optim.state_dict()},
                 storage_writer=ckpt.dcp.Writer("s3://bucket/run", step=100, keep_last=3))

    One Writer per save, made in its ``dcp.save`` call: the saves of a process run in the order their
    Writers were made (:mod:`ckpt.dcp._serial`).

    Deltas (``codec="auto"`` or ``"smallest"`` with ``delta_chain`` > 1, the default): successive saves
    of this process into the same root, with the same items and shapes, store chunks as XOR deltas of
    the previous save's where that is smaller, as the Checkpointer does. For that each rank keeps its
    items' host copy between saves, in a pair of buffers that take turns (:mod:`ckpt.dcp.engines`):
    **host memory: twice this rank's items from the second save on** (once until then; one transient
    copy per save without deltas), on top of a ``ckpt.dcp.Stager``'s buffer. A save with other items
    or shapes starts a new pair; ``delta_chain=1`` turns deltas off and frees the pair.

    Local commits: with ``local_dir`` and ``redundancy`` (``failure_domain``, ``keep_local``), every save
    also commits to each rank's ``local_dir``, its chunks protected by peers, as the Checkpointer's do.

    Args:
        url: the checkpoint root (a directory or an fsspec URL).
        step: the step to commit.
        storage: an opened :class:`~ckpt.storage.base.Storage` instead of opening ``url``.
        **options: the Checkpointer's options (:class:`~ckpt.Options`), checked here as the Checkpointer checks
            them, but for those that belong to a training loop (``every``, ``preemption``, ``mtbf``, ...:
            refused, saying why); ``local_dir`` with ``redundancy`` commits every save to each rank's
            local directory too.

    Raises:
        ConfigError: a bad or refused option (it names it).
        StepExistsError: at ``dcp.save``, the step is committed already.
    """

    def __init__(self, url: str | os.PathLike, *, step: int, storage: Storage | None = None, **options: Any):
        if not isinstance(url, (str, os.PathLike)):
            raise ConfigError(f"ckpt.dcp.Writer needs a checkpoint path or URL, got {url!r}")
        if type(step) is not int or not 0 <= step <= mf.MAX_STEP:
            raise ConfigError(f"step must be an integer from 0 to {mf.MAX_STEP}, got {step!r}")
        refused = sorted(set(options) & set(REFUSED))
        if refused:
            raise ConfigError("ckpt.dcp.Writer does not take " + "; ".join(f"{k} ({REFUSED[k]})" for k in refused))
        self.options = Options.build(**options)
        check_storage(storage, self.options)
        self.url = os.fspath(url)
        self.step = step
        self._storage = storage
        self._kept: engines.Kept | None = None
        self._holding = False  # this rank holds the engine's writer lease for this save
        self._rank = 0
        self._coordinator = False
        self._copied = False  # this save copied its staged snapshot out (a failure then releases nothing)
        self._ticket: int | None = _serial.take(self, step)  # its place among this process's saves: the calls' order
        self._used = False  # set up once: a second save through it would have no place in that order

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_kept"], state["_holding"] = None, False  # found again where it is used
        if self._ticket is not None:  # pickled for DCP's process mode: it saves there, never in this process
            _serial.give_up(self._ticket)
        state["_ticket"], state["_used"] = None, False  # the process it saves in gives it a place of its own
        return state

    # -- DCP's calls, in order ------------------------------------------------------------------
    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id is not None and os.fspath(checkpoint_id) != self.url:
            if self._ticket is not None:
                _serial.give_up(self._ticket)  # this save ends here: later ones need not wait for it
            raise ConfigError(f"ckpt.dcp.Writer writes to {self.url!r}; dcp.save's checkpoint_id {checkpoint_id!r} "
                              "names another place: leave checkpoint_id out")

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self._rank = int(kwargs.get("rank", dist.get_rank() if dist.is_available() and dist.is_initialized() else 0))
        self._coordinator = is_coordinator
        try:  # before DCP's first collective of this save: the earlier save's are all issued first
            if self._used:
                raise ConfigError(f"this ckpt.dcp.Writer (step {self.step}) was used for a save already; make a new "
                                  "one for each dcp.save or async_save: the saves of a process run in the order their "
                                  "Writers were made, and a reused one has no place in it")
            self._used = True
            if self._ticket is None:  # unpickled in DCP's checkpoint process: its saves run there one by one
                self._ticket = _serial.take(self, self.step)
            _serial.wait_for_earlier(self._ticket, self.options.timeout, self.step)
        except BaseException:
            release_pending()
            raise
        try:
            self._kept = kept = engines.engine_for(self.url, self._rank, self.options, self._storage)
            storage = kept.engine.storage
            if storage.exists(paths.manifest_key(self.step)):
                raise StepExistsError(f"step {self.step} is already committed in {storage.describe()}; "
                                      f"committed steps are never overwritten. {STEP_EXISTS_ADVICE}")
            kept.engine.leases.hold()  # held until this rank is done: `ckpt gc` beside never deletes what it reuses
            self._holding = True
        except BaseException:
            release_pending()  # the staged snapshot will never be copied out: the next stage need not wait
            raise

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        self._check_keys([plan])
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        self._check_keys(plans)  # items that collide only across ranks
        return plans

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        kept = self._need_engine()
        try:
            results = self._write(kept, plan, planner)
        except BaseException:
            if not self._copied:  # once copied, the Stager may already hold the next call's snapshot
                release_pending()
            self._done()
            raise
        if not self._coordinator:
            self._done()  # the coordinator's lease covers the commit
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        kept = self._need_engine()
        try:
            self._commit(kept, metadata, len(results))
        finally:
            self._done()

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return False  # chosen explicitly (storage_writer=), never guessed from a path

    # -- the work -------------------------------------------------------------------------------
    def _check_keys(self, plans: list[SavePlan]) -> None:
        try:
            check_keys(plans)
        except BaseException:
            release_pending()
            self._done()
            raise

    def _need_engine(self) -> engines.Kept:
        if self._kept is None or not self._holding or self._kept.engine.closed:
            raise CheckpointError("ckpt.dcp.Writer was not set up by DCP (use it once, as dcp.save's storage_writer)")
        return self._kept

    def _done(self) -> None:
        """This rank's part of the save is over: its writer lease goes (the engine stays, for the next save)."""
        if self._kept is not None and self._holding:
            self._holding = False
            self._kept.engine.leases.release()

    def _write(self, kept: engines.Kept, plan: SavePlan, planner: SavePlanner) -> list[WriteResult]:
        mappings = plan.planner_data if isinstance(plan.planner_data, dict) else {}
        tensors: dict[str, torch.Tensor] = {}  # key (or piece key) -> this rank's data
        leaves: dict[str, Leaf] = {}
        held: dict[str, list[str]] = {}  # key -> its piece keys
        values: dict[str, st.Node] = {}
        results = []
        for item in plan.items:
            fqn = item.index.fqn
            if item.type == WriteItemType.BYTE_IO:
                lookup = getattr(planner, "lookup_object", None)
                obj = lookup(item.index) if callable(lookup) else _unsave(planner.resolve_data(item))
                values[fqn] = value_node(fqn, obj, self.options.allow_pickle)
                results.append(WriteResult(item.index, 0, None))
                continue
            td = item.tensor_data
            assert td is not None
            key = tensor_key(mappings.get(fqn, (fqn,)))
            pieces = held.setdefault(key, [])  # a rank may hold several pieces of one tensor (a chunk spec's)
            name = piece_key(key, len(pieces), tensors) if pieces else key
            pieces.append(name)
            t = planner.resolve_data(item)
            assert isinstance(t, torch.Tensor)
            tensors[name] = t.detach()
            leaves[name] = Leaf((tuple(td.chunk.offsets), tuple(td.chunk.sizes)), tuple(td.size), "shard",
                                key if name != key else None)
            results.append(WriteResult(item.index, t.numel() * t.element_size(), None))
        structure = st.dict_node(list(values), list(values.values()))
        engine, chunk_size = kept.engine, self.options.chunk_size
        with kept.lock:
            kept.after_decision()
            sig = self._signature(tensors, leaves)
            buf = engine.snapshots.next_buffer(sig, lambda: make_layout(tensors, chunk_size))
            try:
                kept.pending = self._write_into(kept, buf, engine.snapshots.spare, tensors, leaves, structure)
            except BaseException:
                engine.writer.after_decision(None)  # trust only what was trusted before this save
                raise
            finally:
                if not self.options.deltas:  # delta_chain=1 (or a codec that never deltas): no copy kept
                    engine.snapshots.drop()
        return results

    def _write_into(self, kept: engines.Kept, buf: HostBuffer, other: HostBuffer | None,
                    tensors: dict[str, torch.Tensor], leaves: dict[str, Leaf],
                    structure: dict) -> tuple[int, mf.Manifest, SaveJob]:
        """Copy this rank's items into ``buf`` and write them as this rank's part (deltas against
        ``other`` where the writer's base is there); the buffer is released by ``write_part``."""
        buf.acquire()
        try:
            cuda, hashes = self._copy_in(buf, tensors)
        except BaseException:
            buf.release()
            raise
        snap = Snapshot(buf, leaves, frozenset(), hashes, cuda, [], buf.generation, other)
        engine = kept.engine
        job = SaveJob(step=self.step, seq=0, snapshot=snap, structure=structure, metrics=SaveMetrics(step=self.step),
                      started=time.perf_counter(), storage=engine.storage_for(True))
        local = engine.local  # local commits: the same plug-in calls as the Checkpointer's commit protocol makes
        try:
            if local is not None:
                local.begin(job)
            part = engine.writer.write_part(job, self._rank)
        except BaseException:
            if local is not None:  # the peer exchange: every rank takes part, so nobody waits for this one
                local.protect(job, None)
            raise
        if local is not None:
            error = local.protect(job, part)
            if error is not None:
                raise error
        return self.step, part, job

    @staticmethod
    def _signature(tensors: dict[str, torch.Tensor], leaves: dict[str, Leaf]) -> tuple:
        """What the kept buffers must match to be reused: the items as laid out."""
        return tuple((k, t.dtype, tuple(t.shape), t.device.type, leaves[k]) for k, t in tensors.items())

    def _copy_in(self, buf: HostBuffer, tensors: dict[str, torch.Tensor]) -> tuple[Any, Any]:
        """Copy this rank's items into its buffer. Items staged by a ckpt.dcp.Stager are read under
        its header's seqlock: a snapshot restaged meanwhile fails the save instead of mixing two."""
        seen: dict[int, Header | None] = {}  # per storage: staged tensors share one buffer
        for t in tensors.values():
            ptr = t.untyped_storage().data_ptr()
            if ptr not in seen:
                seen[ptr] = Header.of(t)
        headers = {p: h for p, h in seen.items() if h is not None}
        deadline = time.monotonic() + self.options.timeout
        seqs = {p: h.wait_even(deadline) for p, h in headers.items()}
        for p, h in headers.items():
            h.set(READING, seqs[p])
        self._copied = True
        try:
            cuda, hashes, _ = buf.copy_in(tensors)
            if cuda is not None:
                cuda.synchronize()
            changed = [p for p, h in headers.items() if h.get(SEQ) != seqs[p]]
            if changed:
                raise CheckpointError(f"step {self.step} was not saved: the ckpt.dcp.Stager restaged its buffer while "
                                      "this save copied it. Wait for the previous async_save's future before the next")
            return cuda, hashes
        finally:
            for p, h in headers.items():
                h.set(DONE, seqs[p])

    def _commit(self, kept: engines.Kept, metadata: Metadata, world: int) -> None:
        engine = kept.engine
        parts = [mf.read_rank_part(engine.storage, self.step, r) for r in range(world)]
        values: dict[str, st.Node] = {}
        for p in parts:
            values.update(zip(p.structure["k"], p.structure["v"]))
        keys = {t.key for p in parts for t in p.tensors}
        mappings = metadata.planner_data if isinstance(metadata.planner_data, dict) else {}
        leaves: dict[str, st.Node] = {}
        for fqn, md in metadata.state_dict_metadata.items():
            if isinstance(md, TensorStorageMetadata):
                key = tensor_key(mappings.get(fqn, (fqn,)))
                if key not in keys:
                    raise CheckpointError(f"step {self.step} was not committed: no rank wrote tensor {fqn!r}")
                leaves[fqn] = st.tensor_node(key)
            elif fqn in values:
                leaves[fqn] = values[fqn]
            else:
                raise CheckpointError(f"step {self.step} was not committed: no rank wrote item {fqn!r}")
        bare = [dataclasses.replace(p, structure=st.dict_node([], [])) for p in parts]
        committed = commit_step(engine.storage_for(True), self.step, bare, frozenset(),
                                structure=build_structure(leaves, mappings))
        log.info("committed step %d through DCP (%d ranks, %d tensors)", self.step, world,
                 len(committed.tensors))
        if self.options.keep_last is not None or self.options.keep_every is not None:
            engine.retention.after_commit(committed)


def _unsave(data: Any) -> Any:
    """An item a planner without ``lookup_object`` handed over as ``torch.save`` bytes (weights only: no code runs)."""
    return torch.load(data, weights_only=True)
