"""The save engine: everything one rank saves through into one root, built once from the options.

:class:`SaveEngine` opens the storage (with ``local_dir``, staged in front of the checkpoint path),
the I/O pool and the commit thread, the writer lease, the writer (:mod:`ckpt.save.writer`), retention
with its thread and deletion window (:mod:`ckpt.save.retention`, :mod:`ckpt.save.retention_thread`), the
commit protocol (:mod:`ckpt.save.commit`) and the snapshotter (:mod:`ckpt.save.snapshot`), and closes them in
order. ``Checkpointer`` saves through one; ``ckpt.dcp.Writer`` through one per (root, options) in
its process (:func:`ckpt.dcp.engines.engine_for`), kept across saves and closed at exit.

Plug-ins: local commits (``redundancy`` / ``persist_every``: :class:`ckpt.peers.local_commits.LocalCommits`,
one object with the save hooks, the restore side of a load, the persist policy and the heal) and
the run journal (:class:`ckpt.save.run_journal.RunJournal`, the Checkpointer's). The engine asks
the plug-in and knows nothing else of local commits.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch

from .. import events, host_memory
from ..format import manifest as mf
from ..format.chunk import verify_object
from ..lease import Leases
from ..load.reads import staging_memory
from ..options import Options
from ..ranks import Comm
from ..storage import durable_of, open_tiered
from ..storage.base import Storage
from .commit import CommitProtocol
from .retention import Retention
from .retention_thread import DeletionWindow, RetentionThread
from .run_journal import RunJournal
from .snapshot import Snapshotter
from .writer import Writer

if TYPE_CHECKING:
    from ..load.step_choice import LoadResult
    from ..peers.local_commits import LocalCommits
    from ..schedule import Schedule

log = logging.getLogger("ckpt")


class SaveEngine:
    """The stages of a save on one rank, for one root, built once from ``options``.

    Args:
        path: the checkpoint root (a directory or an fsspec URL; with ``storage``, its name in messages).
        options: the options, built.
        comm: the ranks that save together.
        storage: an opened storage instead of opening ``path``.
        process_group: the ranks' process group (local commits' peers use it).
        name: the thread names' prefix.
        exclusive: whether the writer lease refuses a root another process writes into (default: not
            ``shared_root``; ``ckpt.dcp.Writer``'s ranks each hold their own lease, so never).
        closes_storage: whether :meth:`close` closes the storage, one handed in too (``ckpt.dcp.Writer``
            leaves a storage it was given open).
    """

    def __init__(self, path: str, options: Options, comm: Comm, storage: Storage | None = None, *,
                 process_group: Any = None, name: str = "ckpt", exclusive: bool | None = None,
                 closes_storage: bool = True):
        self.path, self.options, self.comm = path, options, comm
        self.closes_storage = closes_storage  # close() closes the storage, one handed in too
        self.storage = storage if storage is not None else open_tiered(
            path, options.local_dir, options.storage_options, verify=verify_object,
            upload_threads=options.threads, local_commits=options.local_commits, direct_io=options.direct_io)
        self.durable = durable_of(self.storage)  # the checkpoint path: leases and the journal live there
        self.io = ThreadPoolExecutor(options.threads, thread_name_prefix=f"{name}-io")
        self.commit_thread = ThreadPoolExecutor(1, thread_name_prefix=f"{name}-commit")
        self.manifests = mf.ManifestCache(self.storage, maxsize=64)
        # Held from the first save to close(), so other processes' deletions keep out of the way.
        alone = not options.shared_root if exclusive is None else exclusive
        self.leases = Leases(self.durable, wait_s=options.timeout, alone=alone)
        self.writer = Writer(self.storage, options.codec, self.io, self.leases, options.delta_chain,
                             options.delta_budget)
        self.local: LocalCommits | None = None
        if options.local_commits:  # imported only then: a plain save or load never loads ckpt.peers
            from ..peers.local_commits import open_local_commits

            self.local = open_local_commits(self.storage, comm, options, process_group, self.io, self.writer.in_use)
        # Retention deletes in bulk, on a thread of its own, paused while a save chooses its chunks;
        # with local commits each local directory keeps its own steps (the plug-in's retention).
        retained = self.durable if self.local is not None else self.storage
        self.window = DeletionWindow(retained.delete_batch)
        self.retention_thread = RetentionThread(lambda step: self.retention.apply_after(step), self.window)
        self.retention = Retention(retained, self.manifests, options.keep_last, options.keep_every,
                                   self.window.gated(retained.delete_many), self.leases,
                                   in_use=self.writer.in_use, shared=options.shared_root,
                                   newest=self.retention_thread.newest)
        self.protocol = CommitProtocol(comm, self.writer, self.io, self.commit_thread, self.after_commit,
                                       self.leases, self.local, self.window)
        self.protocol.log_failures = options.on_save_error == "log"
        # host_memory in bytes per rank (None: no cap): what a save's host buffers and a load's staging hold
        self.budget = host_memory.resolve(options.host_memory, comm)
        self.snapshots = Snapshotter(comm, options.chunk_size, options.native, options.snapshot_threads,
                                     options.check_finite, pair=options.deltas, budget=self.budget)
        self.journal: RunJournal | None = None  # the Checkpointer's run journal (open_journal)
        self.closed = False

    def open_journal(self, schedule: Schedule | None) -> RunJournal | None:
        """The run journal (coordinator only); with ``every="auto"`` it tunes ``schedule``."""
        self.journal = RunJournal.open(self.comm, self.durable, self.options, schedule)
        return self.journal

    # -- saving ---------------------------------------------------------------------------------------
    def persists(self, seq: int, emergency: bool, asked: bool | None) -> bool:
        """Whether save number ``seq`` goes to the checkpoint path (the same answer on every rank)."""
        return True if self.local is None else self.local.persists(seq, emergency, asked)

    def storage_for(self, persist: bool) -> Storage:
        """The storage one save runs over."""
        return self.storage if self.local is None else self.local.storage_for(persist)

    def after_commit(self, committed: mf.Manifest, persisted: bool) -> None:
        """Coordinator, after a commit: the checkpoint path's retention, when the save went there."""
        self.manifests.put(committed)
        if persisted:
            self.retention_thread.request(committed.step)

    # -- after a load ---------------------------------------------------------------------------------
    def loaded(self, done: LoadResult) -> None:
        """A load of ``done.manifest`` succeeded: retention keeps that step, the next save reuses its
        chunks without probing (where it writes to where they were read), and the heal runs before it."""
        m = done.manifest
        self.retention.resumed(m.step)  # retention never deletes the step this run last loaded
        if self.local is None or self.local.reuses_loaded(done.stats):
            self.writer.learn(m.chunks)
        if done.heal is not None:  # in the background, before the next save (the same thread)
            self.commit_thread.submit(self._heal, done.heal)

    def _heal(self, heal: Callable[[], bool]) -> None:
        if not heal():  # some loaded chunks are not where the next save writes: it must not take them as stored
            self.writer.forget_loaded()

    @contextmanager
    def lend_buffer(self, nbytes: int) -> Iterator[torch.Tensor | None]:
        """A load's staging memory. Before the first save: memory kept afterwards as the reserve the
        first save's host buffer takes over when the sizes agree (one process; with several ranks,
        where a rank writes what it loads, as with FSDP), so the load's page faults are not paid
        twice; that save lets it go otherwise, or close() does. Later: the host buffer itself, when it
        is idle and large enough (a load mid-run then needs no memory of its own); its bytes stop
        being the previous save's, so the next save encodes no delta against them."""
        buf = self.snapshots.buffer
        if buf is None:  # before the first save: memory that save's host buffer can take over
            space = self.snapshots.reserve
            if space is None or space.numel() < nbytes:
                space = staging_memory(nbytes)
            self.snapshots.reserve = None
            try:
                yield space
            finally:
                self.snapshots.reserve = space
            return
        if buf.nbytes < nbytes or not buf.acquire(timeout=0):
            yield None
            return
        try:
            buf.generation += 1
            yield buf.buffer[:nbytes]
        finally:
            if not buf.in_pieces:  # the load staged by its own layout (and read chunks' padding across gaps)
                buf.zero_padding()
            buf.release()

    # -- lifetime -------------------------------------------------------------------------------------
    def drain(self) -> None:
        """Wait for every save queued so far and the retention queued behind them."""
        if not self.closed:
            self.protocol.drain()
            self.retention_thread.drain()

    def close(self, clean: bool = True, *, announce: bool = True) -> None:
        """Stop the threads (after the saves queued), then release the leases and the storage.
        ``clean``: the journal's end record says so; ``announce``: emit the ``close`` event (a
        training run's saves are done; ``ckpt.dcp``'s engines, closed between saves, do not)."""
        if self.closed:
            return
        self.closed = True
        self.snapshots.reserve = None
        self.commit_thread.shutdown(wait=True)
        if announce:  # the run's saves are done (a harness kills no run past this)
            events.emit("close", self.comm.rank)
        if self.journal is not None:  # after the commits: their records are queued
            self.journal.close(clean)
        self.retention_thread.close()
        self.io.shutdown(wait=True)
        self.leases.release()
        if self.local is not None:
            self.local.close()
        if self.closes_storage:
            self.storage.close()
