"""Loading a committed step into the caller's state, in place, checking every chunk's hash.

Everything that can be checked before reading data is checked first (keys, shapes, dtypes,
pickle), so a mismatch costs no I/O and changes nothing. Then every chunk the state needs is read
once, in parallel, verified and scattered into the destination tensors; a raw chunk that maps onto
one contiguous piece of one CPU tensor is read straight into that tensor (no second copy). Only
when every tensor is filled are ``load_state_dict`` calls made and plain values assigned.

:class:`Loader` picks the step: the one asked for, or the newest committed one every rank sees,
falling back past damaged steps when asked, with every rank agreeing on the outcome.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch

from . import events
from . import tree as st
from ._tasks import run_all
from .commit import LocalCommits
from .dist import Comm
from .errors import (
    CheckpointError,
    CheckpointNotFoundError,
    ConfigError,
    CorruptCheckpointError,
    NotACheckpointError,
    PartialStateError,
    ReshardError,
    StateMismatchError,
    UnsupportedValueError,
)
from .flatten import apply, flatten
from .format import chains, paths
from .format import manifest as mf
from .format.boxes import Box, contiguous_run, intersect, next_needed, volume
from .format.chunk import HEADER_SIZE, check_header, parse_header, verify, verify_object
from .format.planes import trim_scratch
from .sharding import is_dtensor
from .storage import Storage
from .tree import DTYPES

log = logging.getLogger("ckpt")

MiB = 1 << 20
RankMap = Callable[[int], int] | dict[int, int] | list[int]


@dataclass
class LoadStats:
    """What a load read. With a local tier (``local_dir``), also where the chunks came from."""

    step: int
    chunks_read: int = 0
    bytes_read: int = 0
    chunks: list[str] = field(default_factory=list)  # the hashes of the chunks read
    local_chunks: int | None = None  # chunks served by the local tier (None: no local tier)
    remote_chunks: int | None = None  # chunks read from the remote tier
    local_rejected: list[str] = field(default_factory=list)  # local copies that failed their check
    source: str = "checkpoint"  # "local tiers" (local commits) or "checkpoint" (the checkpoint path)
    peer_chunks: int | None = None  # local commits: chunks this rank got from peers' tiers
    rebuilt_chunks: int | None = None  # local commits: chunks this rank rebuilt from parity


def _shape_str(shape: tuple[int, ...] | list[int]) -> str:
    return "(" + ", ".join(map(str, shape)) + ")"


class Loader:
    """Loads committed steps into a state, on every rank of the group, all ending on the same step.

    ``latest`` is the newest step every rank sees; with ``fallback`` a damaged step is reported and
    the newest older step that loads on every rank is used instead."""

    def __init__(self, storage: Storage, comm: Comm, io: Executor, manifests: mf.ManifestCache,
                 tiers: LocalCommits | None = None):
        self.tiers = tiers
        self.storage = storage
        self.comm = comm
        self.io = io
        self.manifests = manifests
        self.partial: int | None = None  # a step whose load failed after it had changed the state

    def check_whole(self, step: int) -> None:
        """Raise :class:`PartialStateError` if a load left the state half-overwritten (saving ``step``
        would commit a mixture of two steps)."""
        if self.partial is not None:
            raise PartialStateError(f"not saving step {step}: the load of step {self.partial} failed after it had "
                                    "changed the state, now a mixture of two. Load a step first, or call "
                                    "ckptr.accept_state() to save it as it is.")

    def steps(self) -> list[int]:
        """The committed steps, ascending (a path that is a file is not a checkpoint)."""
        if self.storage.root_state() == "file":
            raise NotACheckpointError(f"{self.storage.describe()} is a file, not a checkpoint directory")
        if self.tiers is not None:
            tiers = self.tiers.storage
            return sorted(set(mf.committed_steps(tiers.remote)) | set(mf.committed_steps(tiers.local)))
        return mf.committed_steps(self.storage)

    def load(self, step: int | Literal["latest"], state: dict[str, Any], *, strict: bool, allow_pickle: bool,
             fallback: bool = False, rank_map: RankMap | None = None) -> tuple[mf.Manifest, LoadStats] | None:
        """Load ``step`` (or the newest committed one) into ``state``; None when ``"latest"`` finds
        no committed step (a new run)."""
        if step != "latest" and (type(step) is not int or not 0 <= step <= mf.MAX_STEP):
            raise ConfigError(f"step must be 'latest' or an integer from 0 to 2**63 - 1, got {step!r}")
        if self.tiers is not None:
            return self._load_tiered(step, state, strict, allow_pickle, fallback, rank_map)
        if step != "latest":
            if not self.storage.exists(paths.manifest_key(step)):
                steps = self.steps()
                raise CheckpointNotFoundError(
                    f"step {step} is not committed in {self.storage.describe()}; committed steps: "
                    f"{short_list(steps) if steps else 'none'}")
            done, err = self._attempt(step, state, strict, allow_pickle, rank_map)
            if done is None:
                assert err is not None
                raise _advise(err, "Load another step (ckptr.steps() lists them), or load('latest', state, "
                                   "fallback=True) for the newest that verifies.")
            return done
        steps = self.steps()
        if self.comm.world > 1:  # every rank must pick the same step, even if listings lag
            views = [v["latest"] for v in self.comm.agree({"latest": steps[-1] if steps else None})]
            newest = None if any(v is None for v in views) else min(views)
            steps = [s for s in steps if newest is not None and s <= newest]
        if not steps:
            log.info("ckpt: no checkpoint at %s: starting fresh", self.storage.describe())
            events.emit("fresh", self.comm.rank)
            return None
        first_error: CorruptCheckpointError | None = None
        for s in reversed(steps):
            done, err = self._attempt(s, state, strict, allow_pickle, rank_map)
            if done is not None:
                if first_error is not None:
                    log.warning("ckpt: loaded step %d instead of the damaged latest step %d", s, steps[-1])
                return done
            if not isinstance(err, CorruptCheckpointError):
                assert err is not None
                raise err
            if not fallback:
                raise _advise(err, "load('latest', state, fallback=True) loads the newest step that verifies.")
            log.warning("ckpt: %s; falling back to an older step", err)
            first_error = first_error or err
        assert first_error is not None
        raise CorruptCheckpointError(f"no committed step in {self.storage.describe()} loads cleanly; "
                                     f"the newest failed: {first_error}",
                                     object=first_error.object, chunk=first_error.chunk) from first_error

    # -- local commits: the local tiers first ---------------------------------------------------------
    def _load_tiered(self, step: int | Literal["latest"], state: dict[str, Any], strict: bool, allow_pickle: bool,
                     fallback: bool, rank_map: RankMap | None) -> tuple[mf.Manifest, LoadStats] | None:
        """The newest step recoverable from the local tiers and their peers (or ``step``), else the
        newest (or that) step of the checkpoint path."""
        assert self.tiers is not None
        tiers, peers = self.tiers, self.tiers.peers
        remote = tiers.storage.remote
        views = peers.gather({"local": mf.committed_steps(tiers.local), "remote": mf.committed_steps(remote)})
        holder: dict[int, int] = {}
        for r, v in enumerate(views):
            for s in v["local"]:
                holder.setdefault(s, r)
        remote_steps = set.intersection(*(set(v["remote"]) for v in views))  # every rank sees them
        newest_remote = max(remote_steps) if remote_steps else None
        if step == "latest":
            candidates = sorted((s for s in holder if newest_remote is None or s >= newest_remote), reverse=True)
        else:
            candidates = [step] if step in holder else []
            if not candidates and step not in remote_steps:
                raise CheckpointNotFoundError(
                    f"step {step} is committed neither in the local tiers nor in {remote.describe()}; committed "
                    f"steps: {short_list(sorted(set(holder) | remote_steps)) or 'none'}")
        first_error: CorruptCheckpointError | None = None

        def failed(err: CheckpointError) -> None:
            """A candidate that did not load: on to the next with ``fallback``, else raise."""
            nonlocal first_error
            if not isinstance(err, CorruptCheckpointError) or not fallback:
                raise _advise(err, "load('latest', state, fallback=True) loads the newest step that verifies."
                              if step == "latest" else "Load another step (ckptr.steps() lists them).")
            log.warning("ckpt: %s; falling back to an older step", err)
            first_error = first_error or err

        for s in candidates:
            data = peers.broadcast(bytes(tiers.local.read(paths.manifest_key(s))) if peers.rank == holder[s] else None,
                                   holder[s])
            m = mf.parse(data, name=f"{paths.manifest_key(s)} of rank {holder[s]}'s local tier")
            survey = peers.survey(s, m, persisted=s in remote_steps)
            ok, why = peers.recoverable(survey, m)
            if ok:
                lost = len(survey.lost(m.chunks))
                log.info("ckpt: loading step %d from the local tiers (%s%s)", s,
                         "the newest step" if s == max(holder) else "the newest recoverable step",
                         "" if not lost else f"; {lost} chunk(s) lost with their tier are read from {remote.describe()}"
                         if why else f"; {lost} chunk(s) lost with their tier come from peers or parity")
                done, err = self._load_local(s, m, data, survey, state, strict, allow_pickle, rank_map)
                if done is not None:
                    return done
                assert err is not None
                failed(err)
                continue
            if step != "latest":
                raise CorruptCheckpointError(f"step {s} cannot be recovered from the local tiers: {why}")
            log.warning("ckpt: step %d is committed in the local tiers but cannot be recovered from them: %s", s, why)
        targets = sorted(remote_steps, reverse=True) if step == "latest" else [step] if step in remote_steps else []
        if not targets:
            if first_error is not None:
                raise CorruptCheckpointError(f"no committed step loads cleanly from the local tiers, and "
                                             f"{remote.describe()} has none; the newest failed: {first_error}",
                                             object=first_error.object, chunk=first_error.chunk) from first_error
            log.info("ckpt: no checkpoint in the local tiers or at %s: starting fresh", remote.describe())
            events.emit("fresh", self.comm.rank)
            return None
        if step == "latest":
            log.info("ckpt: loading step %d from %s (%s)", targets[0], remote.describe(),
                     "no step of the local tiers is newer and loads" if holder else "the local tiers are empty")
        for s in targets:
            done, err = self._attempt(s, state, strict, allow_pickle, rank_map)
            if done is not None:
                return done
            assert err is not None
            failed(err)
        assert first_error is not None
        raise CorruptCheckpointError(f"no committed step of the local tiers or {remote.describe()} loads cleanly; "
                                     f"the newest failed: {first_error}",
                                     object=first_error.object, chunk=first_error.chunk) from first_error

    def _load_local(self, step: int, m: mf.Manifest, data: bytes, survey: Any, state: dict[str, Any], strict: bool,
                    allow_pickle: bool, rank_map: RankMap | None
                    ) -> tuple[tuple[mf.Manifest, LoadStats] | None, CheckpointError | None]:
        """Load ``step`` from the local tiers. Chunks this rank's tier lacks come from peers (or are
        rebuilt) into memory and are read from there; the tier itself is healed afterwards, in the
        background (``tiers.heal``, run by the Checkpointer on its commit thread), so the load waits
        only for the exchange."""
        assert self.tiers is not None
        tiers = self.tiers
        peers, storage = tiers.peers, tiers.storage
        fetched: list[Any] = []
        held: list[str] = []
        wanted: set[str] = set()

        def keep(key: str, blob: memoryview) -> None:
            storage.hold(key, blob)
            held.append(key)

        def before_read(needed: set[str]) -> None:
            want = mf.closure(m.chunks, needed).keys()
            wanted.update(want)
            fetched.append(peers.fetch(survey, m, want, keep))

        try:
            done, err = self._attempt(step, state, strict, allow_pickle, rank_map, manifest=m,
                                      before_read=before_read)
            if not fetched:  # this rank failed before it could say what it needs: the others wait for that
                try:
                    peers.fetch(survey, m, None, keep)
                except CheckpointError:
                    pass
        except BaseException:
            storage.release(held)
            raise
        if done is None:
            storage.release(held)
            return None, err
        tiers.heal = lambda: self._heal(step, data, held, wanted)
        _, stats = done
        stats.source = "local tiers"
        if fetched:
            got = fetched[0]
            stats.peer_chunks, stats.rebuilt_chunks = got.peer_chunks, got.rebuilt_chunks
            if stats.local_chunks is not None:
                stats.local_chunks = max(0, stats.local_chunks - got.peer_chunks - got.rebuilt_chunks)
        return done, None

    def _heal(self, step: int, data: bytes, held: list[str], wanted: set[str]) -> bool:
        """After a load from the local tiers: write what came from peers (held in memory) and what
        came from the checkpoint path (read again) into this rank's tier, then commit the step there
        if the tier had lost it. A failure costs only the copy: it is logged, nothing else changes."""
        assert self.tiers is not None
        tiers = self.tiers
        local, storage = tiers.local, tiers.storage
        t0 = time.perf_counter()
        wrote = from_remote = 0
        try:
            for key in held:
                blob = storage.held(key)
                if blob is not None and not local.exists(key):
                    local.write(key, [blob])
                    wrote += 1
            for h in sorted(wanted):
                key = paths.chunk_key(h)
                if storage.held(key) is None and not local.exists(key):  # read from the checkpoint path
                    remote = storage.remote.read(key)
                    verify_object(key, [memoryview(remote)])
                    local.write(key, [remote])
                    from_remote += 1
            local.flush()
            if not local.exists(paths.manifest_key(step)):  # a tier that lost the step has it back
                tiers.commit(step, data.decode())
            if wrote or from_remote:
                log.info("ckpt: healed this rank's local tier %s with %d chunk(s) from peers and %d from %s (%.2fs)",
                         local.root, wrote, from_remote, storage.remote.describe(), time.perf_counter() - t0)
            return True
        except Exception as e:
            log.warning("ckpt: this rank's local tier %s was not healed after loading step %d (%s: %s); the next "
                        "saves write their chunks anew", local.root, step, type(e).__name__, e)
            return False
        finally:
            storage.release(held)

    def _attempt(self, step: int, state: dict[str, Any], strict: bool, allow_pickle: bool, rank_map: RankMap | None,
                 manifest: mf.Manifest | None = None, before_read: Callable[[set[str]], None] | None = None
                 ) -> tuple[tuple[mf.Manifest, LoadStats] | None, CheckpointError | None]:
        """Load one step; with several ranks, agree on whether every rank managed."""
        done, err = None, None
        changed = [False]
        try:
            done = self._load_step(step, state, strict, allow_pickle, rank_map, changed, manifest, before_read)
        except CheckpointError as e:
            err = _naming(e, step)
        if err is None:
            self.partial = None
        elif changed[0]:
            self.partial = step
        if self.comm.world > 1:
            views = self.comm.agree({"ok": err is None, "corrupt": isinstance(err, CorruptCheckpointError),
                                     "message": str(err)[:2000] if err is not None else ""})
            bad = [r for r, v in enumerate(views) if not v["ok"]]
            if bad and err is None:
                cls = CorruptCheckpointError if all(views[r]["corrupt"] for r in bad) else CheckpointError
                done, err = None, cls(f"rank(s) {bad} could not load step {step}: {views[bad[0]]['message']}")
        return done, err

    def _load_step(self, step: int, state: dict[str, Any], strict: bool, allow_pickle: bool,
                   rank_map: RankMap | None, changed: list[bool], manifest: mf.Manifest | None = None,
                   before_read: Callable[[set[str]], None] | None = None) -> tuple[mf.Manifest, LoadStats]:
        m = manifest if manifest is not None else mf.read_step(self.storage, step)
        self.storage.reset_tier_counters()
        stats = load_into(self.storage, m, state, strict=strict, allow_pickle=allow_pickle, io=self.io,
                          rank=self.comm.rank, world=self.comm.world, rank_map=rank_map,
                          on_change=lambda: changed.__setitem__(0, True), before_read=before_read)
        self.manifests.put(m)
        trim_scratch()  # decoding chains kept chunk-sized buffers per thread: loads are rare
        tiers = self.storage.tier_counters()
        if tiers is not None:  # which tier each chunk came from; damaged local copies are named
            stats.local_chunks, stats.remote_chunks = tiers.local_hits, tiers.remote_reads
            stats.local_rejected = list(tiers.local_rejected)
        log.info("ckpt: resumed from step %d of %s (%.1f MiB read and verified, %d chunk(s); saved on %d rank(s), "
                 "loaded as %s)", step, self.storage.describe(), stats.bytes_read / MiB, stats.chunks_read,
                 m.world_size, self.comm.describe())
        events.emit("resume", self.comm.rank, step=step)
        return m, stats


def _naming(e: CheckpointError, step: int) -> CheckpointError:
    """``e``, its message starting with the step it is about."""
    if str(e).startswith(f"step {step}"):
        return e
    e.args = (f"step {step}: {e}", *e.args[1:])
    return e


def _advise(e: CheckpointError, advice: str) -> CheckpointError:
    """``e`` with what to do next, said once, at the end (only for damage: other errors say their own)."""
    if isinstance(e, CorruptCheckpointError) and advice not in str(e):
        e.args = (f"{e}. {advice}", *e.args[1:])
    return e


def short_list(steps: list[int]) -> str:
    return ", ".join(map(str, steps)) if len(steps) <= 10 else f"{steps[0]} … {steps[-1]} ({len(steps)} steps)"


def load_into(storage: Storage, m: mf.Manifest, state: dict[str, Any], *, strict: bool, allow_pickle: bool,
              io: Executor, rank: int = 0, world: int = 1, rank_map: RankMap | None = None,
              on_change: Callable[[], None] | None = None,
              before_read: Callable[[set[str]], None] | None = None) -> LoadStats:
    """Load manifest ``m`` into ``state`` as rank ``rank`` of ``world``; returns what was read.

    Every check comes before the first byte lands in the state (keys, shapes, dtypes, devices, the
    layout of modules and optimizers, pickles, the values themselves); then the chunks are read,
    every read finished or cancelled before this returns, and the values put in place. ``on_change``
    is called just before the state is first changed (so a failure after it means a half-loaded state);
    ``before_read(chunks)`` before the first chunk is read, with every chunk the reads need."""
    if _init_optimizers(state, m) and on_change is not None:
        on_change()
    target = flatten(state, for_target=True)
    saved_nodes = dict(st.top_items(m.structure))
    unexpected = [k for k in m.top_keys if k not in state]
    missing_top = [k for k in state if k not in saved_nodes]
    wanted_top = [k for k in m.top_keys if k in state]

    # Per-rank state: which saved rank this rank takes it from.
    per_rank = [k for k in wanted_top if st.is_per_rank(saved_nodes[k])]
    src_rank = _source_rank(m, per_rank, rank, world, rank_map) if per_rank else None
    nodes = {k: saved_nodes[k]["v"][src_rank] if k in per_rank else saved_nodes[k] for k in wanted_top}
    entries = {(t.key, t.rank): t for t in m.tensors}
    # Saved tensors meet the state's by their path in the structure (keys with their types), never
    # by their printed names: {"a/b": x, "a": {"b": y}} or {0: x, "0": y} cannot be swapped.
    target_key = {path: key for key, path in target.paths.items()}
    wanted: list[tuple[str, int | None, str | None]] = []  # (saved key, saved rank, the state's key)
    for top in wanted_top:
        for path, key in st.tensor_paths(nodes[top], (st.path_component(top),)):
            owner = src_rank if top in per_rank and (key, src_rank) in entries else None
            wanted.append((key, owner, target_key.get(path)))
    found = {tk for _, _, tk in wanted if tk is not None}
    missing_tensors = [k for k in target.tensors if k not in found and k.split("/", 1)[0] in saved_nodes]

    if strict and (unexpected or missing_top or missing_tensors):
        parts = []
        if missing_top or missing_tensors:
            miss = missing_top + missing_tensors
            parts.append(f"missing from the checkpoint: {miss[:8]}{' …' if len(miss) > 8 else ''}")
        if unexpected:
            parts.append(f"in the checkpoint but not in the state: {unexpected[:8]}"
                         f"{' …' if len(unexpected) > 8 else ''}")
        raise StateMismatchError(
            f"step {m.step} does not match the state: " + "; ".join(parts) +
            ". Pass strict=False to load what matches and leave the rest as it is.")
    misfits: list[str] = []
    for top in wanted_top:
        _misfits(nodes[top], target_nodes(target, top), state[top], top, strict, misfits)
    if misfits:
        raise StateMismatchError(
            f"step {m.step} does not fit the state: " + "; ".join(misfits[:6]) + (" …" if len(misfits) > 6 else "") +
            ". Build the state as the run that saved it did (or load with strict=False where only nested keys "
            "differ); nothing was changed.")
    if unexpected or missing_top or missing_tensors:
        log.warning("ckpt: loading step %d non-strictly: %d key(s) not in the state, %d missing from the checkpoint",
                    m.step, len(unexpected), len(missing_top) + len(missing_tensors))

    structure = st.dict_node(wanted_top, [nodes[k] for k in wanted_top])
    if st.has_pickle(structure) and not allow_pickle:
        raise UnsupportedValueError(
            f"step {m.step} holds pickled objects, and unpickling can run code from the checkpoint. "
            "Load with allow_pickle=True only if you trust its source.")

    # Destinations: the caller's own (local) tensor when it is on the CPU and contiguous, else a new one.
    dests: dict[str, tuple[torch.Tensor, Box]] = {}
    values: dict[str, Any] = {}
    copy_back: list[tuple[torch.Tensor, torch.Tensor]] = []
    mismatches, on_meta = [], []
    for key, owner, tkey in wanted:
        e = entries.get((key, owner))
        if e is None:
            raise CorruptCheckpointError(f"step {m.step}: structure names tensor {key!r} that has no entry", object=key)
        dtype, shape = DTYPES[e.dtype], tuple(e.shape)
        t = target.tensors.get(tkey) if tkey is not None else None
        if t is None:
            local = torch.empty(shape, dtype=dtype)
            dests[key] = (local, ((0,) * len(shape), shape))
            values[key] = local
            continue
        assert tkey is not None
        leaf = target.leaves[tkey]
        gshape = tuple(t.shape) if owner is not None else tuple(leaf.global_shape)
        if gshape != shape or t.dtype != dtype:
            what = "" if gshape == tuple(t.shape) else " (global)"
            mismatches.append(f"{key}: checkpoint has {e.dtype}{_shape_str(shape)}, state has "
                              f"{str(t.dtype).removeprefix('torch.')}{_shape_str(gshape)}{what}")
            continue
        if t.device.type == "meta":
            on_meta.append(tkey)
            continue
        box = ((0,) * len(shape), shape) if owner is not None else leaf.box
        if t.device.type == "cpu" and t.is_contiguous():
            local = t.detach() if t.requires_grad else t
        else:
            local = torch.empty(tuple(t.shape), dtype=dtype)
            copy_back.append((t, local))
        dests[key] = (local, box)
        values[key] = target.targets[tkey]
    if mismatches:
        raise StateMismatchError(
            f"step {m.step} does not fit the state ({len(mismatches)} tensor(s)): " + "; ".join(mismatches[:6]) +
            (" …" if len(mismatches) > 6 else "") + ". Build the model/optimizer with the same shapes and dtypes "
            "as the run that saved it (cast after loading if you need another dtype).")
    if on_meta:
        raise StateMismatchError(
            f"{len(on_meta)} tensor(s) of the state are on the meta device, which holds no data to load into "
            f"({on_meta[:4]}{' …' if len(on_meta) > 4 else ''}). Materialise the model first, e.g. "
            "model.to_empty(device='cpu'), then load; nothing was changed.")

    # What each chunk feeds: (offset in chunk, length, destination bytes, offset there). Boxes that
    # are not one contiguous run on both sides go through a staging buffer and a strided copy.
    feeds: dict[str, list[tuple[int, int, np.ndarray, int]]] = defaultdict(list)
    strided: list[tuple[torch.Tensor, Box, np.ndarray, tuple, Box]] = []
    for key, owner, _ in wanted:
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
                "needs; the manifest is damaged",
                object=paths.manifest_key(m.step))

    # The values are rebuilt before any read: unpickling, or a node that cannot be rebuilt, fails now.
    try:
        decoded = st.rebuild(structure, values, allow_pickle=allow_pickle)
    except (TypeError, ValueError, KeyError) as e:
        raise CorruptCheckpointError(f"step {m.step}: its values cannot be rebuilt ({type(e).__name__}: {e})",
                                     object=paths.manifest_key(m.step)) from e

    stats = LoadStats(m.step, chunks_read=len(feeds), chunks=sorted(feeds))
    if before_read is not None:
        before_read(set(feeds))
    if on_change is not None:
        on_change()
    reads = run_all(io, lambda item: _read_chunk(storage, m, item[0], item[1]), list(feeds.items()))
    stats.bytes_read = sum(reads)

    with torch.no_grad():
        for local, in_d, stage, rows_shape, in_stage in strided:
            src = torch.from_numpy(stage).view(local.dtype).view(rows_shape)
            local[_slices(in_d)].copy_(src[_slices(in_stage)])
        for t, src in copy_back:
            t.copy_(src)
    apply(state, decoded)
    return stats


def target_nodes(target: Any, top: str) -> Any:
    """The state's own structure node for top-level key ``top``."""
    return dict(st.top_items(target.structure))[top]


def _misfits(saved: Any, target: Any, live: Any, where: str, strict: bool, out: list[str]) -> None:
    """What would make ``load_state_dict`` fail, or (``strict``) leave nested keys unloaded, found
    by comparing the saved structure with the state's own, before anything is changed."""
    if isinstance(live, torch.nn.Module):
        if st.kind(saved) != "stateful" or st.kind(saved["v"]) != "dict":
            out.append(f"{where}: the checkpoint holds no module state there")
            return
        have, want = set(saved["v"]["k"]), set(target["v"]["k"])
        if have != want:
            miss, extra = sorted(want - have, key=str), sorted(have - want, key=str)
            more = (" …" if len(miss) > 4 else "", " …" if len(extra) > 4 else "")
            out.append(f"{where} ({type(live).__name__}): missing from the checkpoint {miss[:4]}{more[0]}, "
                       f"not in the module {extra[:4]}{more[1]}")
        return
    if isinstance(live, torch.optim.Optimizer):
        groups = _param_groups(saved)
        if groups is None:
            out.append(f"{where}: the checkpoint holds no optimizer state there")
            return
        sizes = [len(g["params"]) for g in live.param_groups]
        if groups != sizes:
            out.append(f"{where} ({type(live).__name__}): the checkpoint has {len(groups)} parameter group(s) of "
                       f"{groups} parameters, the optimizer {len(sizes)} of {sizes}")
        return
    if strict and isinstance(live, dict) and live and st.kind(saved) == "dict" and st.kind(target) == "dict":
        saved_keys = {st.path_component(k): (k, v) for k, v in zip(saved["k"], saved["v"])}
        mine = {st.path_component(k): v for k, v in zip(target["k"], target["v"])}
        missing = [k for k in mine if k not in saved_keys]
        extra = [saved_keys[k][0] for k in saved_keys if k not in mine]
        if missing or extra:
            out.append(f"{where}: keys missing from the checkpoint {[json.loads(k) for k in missing][:4]}, "
                       f"keys not in the state {extra[:4]}")
        for (c, tv), lv in zip(mine.items(), live.values()):
            if c in saved_keys:
                _misfits(saved_keys[c][1], tv, lv, f"{where}/{st.preview(json.loads(c), 40)}", strict, out)


def _param_groups(saved: Any) -> list[int] | None:
    """Parameters per group of a saved optimizer state_dict node, or None if it is not one."""
    if st.kind(saved) != "stateful" or st.kind(saved["v"]) != "dict":
        return None
    sd = dict(zip(saved["v"]["k"], saved["v"]["v"]))
    groups = sd.get("param_groups")
    if not isinstance(groups, list):
        return None
    out = []
    for g in groups:
        if st.kind(g) != "dict":
            return None
        params = dict(zip(g["k"], g["v"])).get("params")
        if not isinstance(params, list):
            return None
        out.append(len(params))
    return out


def _slices(box: Box) -> tuple:
    return tuple(slice(o, o + n) for o, n in zip(box[0], box[1]))


def _pieces(shard: mf.Shard, lo: int, hi: int) -> Iterator[tuple[str, int, int, int]]:
    """(chunk, offset in chunk, length, offset in the shard) of the shard bytes in [lo, hi)."""
    pos = 0
    for g in shard.segments:
        a, b = max(lo, pos), min(hi, pos + g.length)
        if a < b:
            yield g.chunk, g.offset + a - pos, b - a, a
        pos += g.length
        if pos >= hi:
            break


def _source_rank(m: mf.Manifest, keys: list[str], rank: int, world: int, rank_map: RankMap | None) -> int:
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


def _init_optimizers(state: dict[str, Any], m: mf.Manifest) -> bool:
    """An optimizer over DTensor parameters with no state yet gets its state created first, so the
    saved state loads into sharded tensors of the right layout (a step with lr=0 and zero grads).
    Returns whether it changed any optimizer."""
    saved_keys = {t.key for t in m.tensors}
    changed = False
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
            changed = True
            obj.step()
        finally:
            for g, lr in zip(obj.param_groups, lrs):
                g["lr"] = lr
            for p in set_grads:
                p.grad = None
    return changed


def _read_chunk(storage: Storage, m: mf.Manifest, h: str, feeds: list) -> int:
    info = m.chunks[h]
    key = paths.chunk_key(h)
    try:
        if info.codec.startswith("raw/") and len(feeds) == 1 and feeds[0][0] == 0 and feeds[0][1] == info.size:
            # The whole chunk feeds one contiguous run: its payload is read straight into the tensor,
            # but only after its header was read and checked (a wrong object never reaches the tensor).
            _, length, flat, pos = feeds[0]
            header = storage.read(key, 0, HEADER_SIZE)
            hdr = parse_header(header, name=key)
            check_header(hdr, name=key, expect_hash=h, expect_len=info.size)
            if hdr.codec == "raw" and hdr.payload_len == info.size:
                target = memoryview(flat)[pos : pos + length]
                n = storage.readv(key, [target], offset=HEADER_SIZE)
                verify(key, h, header, target[:n], expect_len=info.size, raw_only=True)
                return HEADER_SIZE + n
            # stored another way than the entry says (another writer's copy of the same bytes): decoded below
    except FileNotFoundError as e:
        raise chains.missing(storage, h, m.step, e) from None
    blob = chains.read_object(storage, m.chunks, h, m.step)
    raw, more = chains.resolve(storage, m.chunks, h, m.step, blob)  # a delta: its chain, every link verified
    src = np.frombuffer(raw, dtype=np.uint8)
    for off, length, flat, pos in feeds:
        flat[pos : pos + length] = src[off : off + length]
    return len(blob) + more
