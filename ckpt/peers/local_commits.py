"""Local commits: every rank's local tier (``local_dir``) is a committed checkpoint of its own, kept
to ``keep_local`` steps, protected by peers when ``redundancy`` says so; every ``persist_every``-th
save also goes to the checkpoint path.

:class:`LocalCommits` is the one plug-in the save engine (:class:`ckpt.save.engine.SaveEngine`) is
given; the core knows nothing else of local tiers or peers. The commit protocol (:mod:`ckpt.save.commit`)
calls its save hooks (:class:`ckpt.save.commit.SaveHooks`): ``begin`` (the tier's lease), ``protect`` (the
peer exchange, after the rank's chunks are durable), ``absent`` (a rank that takes no part still joins
the exchange), ``committed`` (the step into this rank's tier) and ``after_commit`` (the tier's
retention). The loader (:mod:`ckpt.load.step_choice`) calls its :class:`ckpt.load.step_choice.Restore`
side: ``steps`` and ``load`` (choose the step and where to read, fetch what is missing:
:mod:`ckpt.peers.restore`), whose result carries the tier's ``heal``. The engine asks it which saves go
to the checkpoint path (``persists``: ``persist_every``), the storage each save runs over
(``storage_for``: ``TieredStorage.view(persist)``) and whether a load's chunks are where the next save
writes (``reuses_loaded``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Executor
from typing import Any, Literal

from ..errors import CheckpointError
from ..format import manifest as mf
from ..format import paths
from ..lease import Leases
from ..load.reads import LoadStats
from ..load.step_choice import Attempt, LoadResult
from ..options import Options
from ..ranks import Comm
from ..save.job import SaveJob
from ..save.retention import Retention
from ..storage import LocalStorage, Storage
from ..storage.tiered import TieredStorage
from . import restore
from .exchange import Peers

log = logging.getLogger("ckpt")


class LocalCommits:
    """What local commits add to each save and each load (see the module docstring)."""

    def __init__(self, storage: TieredStorage, comm: Comm, peers: Peers, lease: Leases,
                 retention: Callable[[int], None] | None, persist_every: int | None = None):
        self.storage = storage
        self.persist_every = persist_every
        self.comm = comm  # coordination rounds (which steps each rank holds)
        self.local: LocalStorage = storage.local
        self.peers = peers  # the ranks' failure domains and their own process group (bytes move only with redundancy)
        self.lease = lease  # this rank's writer lease on its tier (`ckpt gc` there keeps out of the way)
        self._retention = retention  # None: another rank sharing this tier applies it

    # -- the persist policy -------------------------------------------------------------------------
    def persists(self, seq: int, emergency: bool, asked: bool | None) -> bool:
        """Whether save number ``seq`` goes to the checkpoint path (the same answer on every rank):
        ``asked`` (save's ``persist=``), else every ``persist_every``-th save and every emergency save."""
        if asked is not None:
            return asked
        every = self.persist_every
        return every is None or emergency or seq % every == 0

    def storage_for(self, persist: bool) -> Storage:
        """The storage one save runs over: the local tier alone, or uploaded too (``persist``)."""
        return self.storage.view(persist)

    def reuses_loaded(self, stats: LoadStats) -> bool:
        """Whether the next save may take a loaded step's chunks as stored without asking: not when they
        came from the checkpoint path (this rank's tier lacks them, and a local-only save's step would
        name chunks no tier holds), so it asks its tier and writes what it lacks."""
        return stats.source != "checkpoint"

    # -- the save hooks ------------------------------------------------------------------------------
    def begin(self, job: SaveJob) -> None:
        """On the commit thread, before the save writes anything."""
        job.metrics.persisted = job.persist
        self.lease.hold()  # cheap while held; renewed when close to lapsing

    def protect(self, job: SaveJob, part: mf.Manifest | None) -> BaseException | None:
        """The peer exchange of one save (every rank takes part, failed or not); its error, if any."""
        if self.peers.redundancy is None:
            return None
        started = time.perf_counter()
        try:
            stats = self.peers.protect(job.step, part)
        except BaseException as e:
            return e
        if stats is not None:
            job.metrics.peer_sent_bytes, job.metrics.peer_stored_bytes = stats.sent_bytes, stats.stored_bytes
            job.metrics.peer_s = time.perf_counter() - started
        return None

    def absent(self) -> None:
        """A rank that takes no part in a save (skipped, or failed before it began) still takes part in
        its peer exchange, so the others do not wait for it."""
        if self.peers.redundancy is not None:
            try:
                self.peers.protect(-1, None)
            except CheckpointError as e:
                log.error("%s", e)

    def committed(self, job: SaveJob, manifest: str) -> None:
        """Step ``job.step`` is committed (the coordinator's tier has it already): into this rank's tier."""
        self.commit(job.step, manifest)

    def after_commit(self, job: SaveJob) -> None:
        """Every rank, after a commit: the tier's retention (by one rank per tier)."""
        if self._retention is not None:
            self._retention(job.step)

    def commit(self, step: int, manifest: str) -> None:
        """Commit ``step`` to this rank's tier."""
        try:
            self.local.commit(paths.manifest_key(step), manifest.encode())
        except FileExistsError:
            pass  # another rank sharing this node's tier committed it first
        except CheckpointError as e:  # committed on the other tiers; this one only lacks the manifest
            log.warning("step %d is committed, but not in this rank's local tier: %s", step, e)

    # -- the load side -------------------------------------------------------------------------------
    def steps(self) -> list[int]:
        return sorted(set(mf.committed_steps(self.storage.remote)) | set(mf.committed_steps(self.local)))

    def load(self, attempt: Attempt, step: int | Literal["latest"], fallback: bool) -> LoadResult | None:
        return restore.load(self, attempt, step, fallback)

    def close(self) -> None:
        self.lease.release()


def open_local_commits(storage: Any, comm: Comm, options: Options, process_group: Any, io: Executor,
                       in_use: Callable[[], set[str]]) -> LocalCommits:
    """Local commits for a save engine: this rank's tier, its lease and retention, and the peers."""
    assert isinstance(storage, TieredStorage)  # Options.build refuses local commits without local_dir
    local = storage.local
    lease = Leases(local, wait_s=options.timeout)
    retention = Retention(local, mf.ManifestCache(local, maxsize=64), options.keep_local, None,
                          local.delete_many, lease, in_use=in_use)
    peers = Peers(comm, options.redundancy, options.failure_domain, local, process_group, options.timeout,
                  lease_id=lease.writer_id)
    if options.redundancy is not None:
        log.info("local tier %s protected by %s", local.root, peers.describe())
    lease.own |= peers.tier_leases  # the ranks sharing this tier write beside us, not in our way
    # the lowest rank sharing a tier applies its retention
    return LocalCommits(storage, comm, peers, lease, retention.apply_after if peers.tier_leader else None,
                        options.persist_every)
