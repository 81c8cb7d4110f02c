"""The public entry point: :class:`Checkpointer`, a thin façade over the stages of a save and a load.

Follow one tensor through a save: :meth:`Checkpointer.save` flattens the state into a structure tree
and tensor leaves (:mod:`ckpt.flatten`), copies the tensors into the host buffer
(:mod:`ckpt.save.snapshot`, laid out by :mod:`ckpt.save.buffer_layout`) and hands the snapshot to the commit
protocol (:mod:`ckpt.save.commit`): stages the save engine (:mod:`ckpt.save.engine`) builds once per root.
On a background thread the writer (:mod:`ckpt.save.writer`) cuts the buffer into chunks, hashes,
encodes (:mod:`ckpt.save.encode`) and stores them (:mod:`ckpt.storage`); the coordinator commits the
step manifest (:mod:`ckpt.format.manifest`) and applies retention (:mod:`ckpt.save.retention`).
Back again: :mod:`ckpt.load` reads the manifest, reads and verifies the chunks it needs, and fills
the caller's tensors in place.
"""

from __future__ import annotations

import logging
import os
import time
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Literal

from . import at_exit, events
from ._args import flag, flags
from ._gc import paused
from .errors import CheckpointError, ConfigError, StorageError
from .flatten import flatten
from .format import manifest as mf
from .handle import REFUSED_FOR_EARLIER, SaveHandle, SaveLedger, SaveMetrics
from .journal import Journal
from .load.step_choice import LoadStats, RankMap, StepChooser
from .options import OptionArgs, Options, check_storage
from .ranks import make_comm
from .root_level import check_root_level
from .save.engine import SaveEngine
from .save.job import SaveJob
from .schedule import Interval, Schedule
from .storage.base import Storage

if TYPE_CHECKING:
    from typing_extensions import Unpack

log = logging.getLogger("ckpt")


class Checkpointer:
    """Asynchronous, verified checkpoints of a training state: ``save(step, state)`` returns once the
    state is copied into a host buffer; ``load("latest", state)`` resumes in place. ``path`` is a local
    directory or an fsspec URL (``file://``, ``memory://``, ``s3://`` …). See the README for a loop.

    Args:
        path: the checkpoint root: a local directory or an fsspec URL (with ``storage``, only its name in
            messages).
        storage: an opened :class:`~ckpt.storage.base.Storage` (or one staged behind a ``local_dir``) to use instead
            of opening ``path``, e.g. a test's faulty disk:
            ``ckpt.Checkpointer(str(tmp), storage=ckpt.testing.FaultyStorage(LocalStorage(tmp)))``; not
            together with ``local_dir`` or ``storage_options``.
        process_group: the ranks that save together (default: the default group when ``torch.distributed`` is
            initialised, else this process alone). Every rank calls ``save`` and ``load`` in the same order;
            ranks talk through the group's store, never with collectives from background threads.
        **options: the options of :class:`~ckpt.options.Options` (each documented there once, same names and
            defaults), all checked before anything is opened.

    Raises:
        ConfigError: an option is unknown or has a bad value (it names it).
        NotARootError: ``path`` is a level of a root (its ``steps/``, a step) or holds roots.

    CUDA tensors: ``save()`` only launches their copy and returns. The next ``optimizer.step()`` of
    any optimizer waits for it on the device (a pre-step hook), so the host never blocks; tensors no
    saved optimizer updates are copied first and the current stream waits for them at once. If you
    change saved parameters in place outside ``optimizer.step()``, call :func:`ckpt.fence` first.
    """

    def __init__(self, path: str | os.PathLike, *, storage: Storage | None = None, process_group: Any = None,
                 **options: Unpack[OptionArgs]):
        self._open(path, Options.build(**options), process_group, storage)

    @classmethod
    def from_options(cls, path: str | os.PathLike, options: Options, *, process_group: Any = None,
                     storage: Storage | None = None) -> Checkpointer:
        """A Checkpointer with options already built (and checked) by :meth:`Options.build`.

        Args:
            path, process_group, storage: as for the constructor.
            options: the options, built.

        Returns:
            Checkpointer: open, as ``Checkpointer(path, **options)`` would be.
        """
        self = cls.__new__(cls)
        self._open(path, options, process_group, storage)
        return self

    def _open(self, path: str | os.PathLike, options: Options, process_group: Any,
              storage: Storage | None = None) -> None:
        if not isinstance(path, (str, os.PathLike)):
            raise ConfigError(f"checkpoint path must be a string or os.PathLike, got {path!r}")
        check_storage(storage, options)
        self.path = os.fspath(path)
        self.options = options
        self._comm = make_comm(process_group, options.timeout)
        # Every stage of a save, its threads and plug-ins (local commits), built once for this root.
        self._engine = engine = SaveEngine(self.path, options, self._comm, storage, process_group=process_group)
        self.storage = engine.storage
        try:
            check_root_level(engine.durable, self.path)  # not runs/exp1/steps, nor runs/
        except StorageError as e:  # unreachable now: the first save or load says so, with its own context
            log.warning("could not check that %s is a checkpoint root, not a level of one: %s", self.path, e)
        self._snapshots = engine.snapshots
        self._protocol = engine.protocol
        self._ledger = SaveLedger()  # steps taken, saves in flight, failures nobody has seen yet
        self._schedule = Schedule(self._comm, options.every, options.preemption, options.mtbf, options.max_overhead,
                                  options.preemption_deadline, finish=self._ledger.settle)
        self._run_journal = engine.open_journal(self._schedule)  # the run journal: rank 0 writes it
        if self._run_journal is not None:  # dropped unclosed (a load in a notebook): no heartbeat left writing
            self._run_journal.journal.finalize_with(self)
        self._clean_end = True  # False: closed by __exit__ on an exception (the journal says so)
        self._emergency: SaveHandle | None = None  # the save a preemption asked for
        self._chooser = StepChooser(self.storage, self._comm, engine.io, engine.manifests, engine.local,
                              staged=options.staged_load, lend=engine.lend_buffer,
                              budget=engine.budget)
        self.last_load: LoadStats | None = None  # what the last load read
        self._seq = 0  # save() calls so far: the same on every rank, names the save in the store
        self._closed = False
        at_exit.track(self)

    @property
    def _journal(self) -> Journal | None:
        """The run journal this process writes (rank 0), if any."""
        return self._run_journal.journal if self._run_journal is not None else None

    # -- saving ---------------------------------------------------------------------------------------
    @property
    def rank(self) -> int:
        """This process's rank in the saving group (0 without torch.distributed)."""
        return self._comm.rank

    @property
    def world_size(self) -> int:
        return self._comm.world  # the number of ranks saving together

    @property
    def layouts_made(self) -> int:
        """Host buffer layouts made so far: one on the first save, one more per structure change."""
        return self._snapshots.layouts_made

    @property
    def host_buffers(self) -> int:
        """Host buffers held: 0 before the first save, 1, or 2 while deltas keep the previous save."""
        return sum(b is not None for b in (self._snapshots.buffer, self._snapshots.spare))

    @property
    def host_pinned(self) -> bool:
        """Whether the host buffer is pinned (page-locked) memory, as it is when CUDA is available."""
        buf = self._snapshots.buffer
        return buf is not None and buf.pinned

    def save(self, step: int, state: dict[str, Any], *, persist: bool | None = None) -> SaveHandle:
        """Snapshot ``state`` as step ``step`` and write it in the background.

        Returns once every tensor is copied (later in-place changes are not saved). With several ranks,
        every rank calls it with the same step and writes its own shard; the step commits once all parts
        are durable.

        Args:
            step: the step number, 0 to 2**63 - 1; a committed step is never overwritten.
            state: a dict of tensors, modules, optimizers, ``Stateful`` objects and plain values.
            persist: with ``persist_every``, ``True`` also uploads this save, ``False`` keeps it in the local
                directories (every rank must pass the same); None follows ``persist_every``.

        Returns:
            SaveHandle: ``wait(stage)`` for ``"local"`` or ``"committed"``, ``metrics``, ``exception()``.

        Raises:
            StepExistsError: ``step`` is committed already (or being saved).
            UnsupportedValueError: a value cannot be stored (without ``allow_pickle``).
            PartialStateError: a failed load left the state partly overwritten.
            RootInUseError: another job writes into the root (the first save; see ``shared_root``).
            CheckpointError: with ``on_save_error="raise"`` (the default), the error of an earlier save that
                failed in the background, unseen (nothing is saved then: call again to retry).
        """
        started, wall = time.perf_counter(), time.time()
        flag("persist", persist, none=True)
        self._check_open()
        if self._run_journal is not None:
            self._run_journal.saving(step)
        self._chooser.check_whole(step)
        self._ledger.claim(step)
        events.emit("save", self.rank, step=step)
        seq, self._seq = self._seq, self._seq + 1
        metrics = SaveMetrics(step=step)
        emergency = step == self._schedule.emergency_step  # never skipped
        try:
            if self.options.on_save_error == "raise":
                self._raise_failed_save(step)
            with paused():  # while the caller waits: a state of many small tensors is mostly GC work (ckpt._gc)
                flat = flatten(state, allow_pickle=self.options.allow_pickle,
                               reduce_partial=self.options.reduce_partial)
                snap = self._snapshots.take(seq, flat, state,
                                            skip_if_busy=self.options.busy == "skip" and not emergency)
        except BaseException as e:
            self._ledger.release(step)
            self._protocol.abandon(seq, step, e)
            raise
        metrics.stall_s = time.perf_counter() - started
        metrics.host_bytes = self._snapshots.host_bytes
        if snap is None:
            metrics.skipped = True
            log.info("skipped the save of step %d: the previous save is still writing (busy='skip')", step)
            self._ledger.release(step)
            self._protocol.skip(seq, step)
            return SaveHandle(step, metrics, None)
        future: Future = Future()
        handle = SaveHandle(step, metrics, future, started=started)
        try:
            persists = self._engine.persists(seq, emergency, persist)
            job = SaveJob(step=step, seq=seq, snapshot=snap, structure=flat.structure, metrics=metrics,
                          started=started, on_local=handle.mark_local, persist=persists,
                          storage=self._engine.storage_for(persists))
        except BaseException as e:  # before the writer has the job: nothing else would give the buffer back
            snap.abandon(e)
            self._ledger.release(step)
            self._protocol.abandon(seq, step, e)
            raise
        self._ledger.add(handle)
        if self._run_journal is not None:
            future.add_done_callback(self._run_journal.record(wall, metrics))
        at_exit.saving(self, future)  # finished at interpreter exit, even if nobody closes this
        self._protocol.submit(job, future)
        if snap.rest is not None:  # a state larger than host_memory: the pieces left, as the writer frees slabs
            try:
                metrics.blocked_s = snap.rest()
            except Exception as e:  # the writer fails the save with it (the handle's error): training goes on
                log.error("the snapshot of step %d failed midway: %s; the save fails with this error and commits "
                          "nothing, training goes on and the next save() starts afresh", step, e)
            metrics.pieces = snap.pieces
            metrics.stall_s = time.perf_counter() - started
        self._schedule.saved(handle)
        if emergency:
            self._emergency = handle
        return handle

    def _raise_failed_save(self, step: int) -> None:
        """on_save_error="raise": an earlier save that failed in the background, and whose error nobody
        has seen, fails this one (before it takes anything), so training does not go on unsaved."""
        found = self._ledger.finished_failure()
        if found is None:
            return
        failed, err = found
        err.args = (f"{err} (the save of step {failed.step} {REFUSED_FOR_EARLIER} {step} was not saved either: fix "
                    "the cause and save again, or pass on_save_error='log' to only log such failures)", *err.args[1:])
        raise err

    # -- when to save ---------------------------------------------------------------------------------
    def should_save(self, step: int) -> bool:
        """Whether to save ``step``. Call it on every rank after every step; every rank gets the same answer.

        Args:
            step: the training step just done.

        Returns:
            bool: True if the ``every`` interval says so, or a ``preemption`` signal reached any rank (then
            this is the emergency save).
        """
        self._check_open()
        if self._run_journal is not None:
            self._run_journal.seen(step)
        return self._schedule.should_save(step)

    @property
    def preempted(self) -> bool:
        """True once the emergency save a preemption asked for is committed: leave the loop and
        ``close()``. Waits for that save; raises its error if it failed (the last committed step is
        still whole)."""
        h = self._emergency
        if h is None:
            return False
        h.wait()
        self._schedule.emergency_committed(h.step)
        return True

    @property
    def preemption_pending(self) -> bool:
        """True once a preemption signal reached this process, or another rank agreed an emergency
        save (read-only; ``should_save`` is what acts on it)."""
        return self._schedule.preemption_pending

    def _take_preemption(self) -> None:
        """For a front end that makes the emergency save itself (Lightning's callback): the signal is
        acted on, so it is not passed on after ``preemption_deadline`` or at ``close()``."""
        self._schedule.taken()

    @property
    def interval(self) -> Interval:
        """The save interval in force (for ``every="auto"``: as last chosen, and why)."""
        return self._schedule.interval

    def accept_state(self) -> None:
        """Save the state as it is, although a load failed after it had started changing it."""
        self._chooser.partial = None

    def protect(self, step: int) -> None:
        """Never let retention delete ``step`` (the step this Checkpointer last loaded is protected already,
        while it is the last: a later load lets it go unless it was protected here).

        Args:
            step: a step number, committed or to come.
        """
        self._engine.retention.protect(step)

    def adopt_buffer(self, donor: Checkpointer) -> None:
        """Start from ``donor``'s host buffer instead of allocating one (both single-process).

        For one training job writing to several roots in turn (Lightning's top-k paths): a save
        whose structure matches the donor's last reuses its buffer; the buffer's own lock orders
        the two, so a save waits until the donor's last save has finished reading it.

        Args:
            donor: another Checkpointer of this process.
        """
        self._snapshots.adopt(donor._snapshots)

    # -- loading --------------------------------------------------------------------------------------
    def load(self, step: int | Literal["latest"], state: dict[str, Any], *, strict: bool | None = None,
             fallback: bool = False, allow_pickle: bool | None = None, rank_map: RankMap | None = None) -> int | None:
        """Load a committed step into ``state`` in place, every chunk verified.

        Every rank calls it and reads only what its shards need, whatever world size saved the step.
        Everything checkable is checked before the state changes; a later failure leaves saves refused
        (:class:`~ckpt.PartialStateError`) until a load succeeds or :meth:`accept_state`.

        Args:
            step: a committed step, or ``"latest"`` for the newest.
            state: the state to fill, of the same structure as the one saved.
            strict: refuse keys missing on either side (default: the ``strict`` option).
            fallback: past a damaged latest step, to the newest older one that loads (each one skipped is
                logged).
            allow_pickle: read pickled values (default: the ``allow_pickle`` option).
            rank_map: for per-rank state saved on another world size: this rank -> saved rank
                (e.g. ``lambda r: r % 4``).

        Returns:
            int | None: the step loaded; None when ``"latest"`` finds no step (a new run).

        Raises:
            CheckpointNotFoundError: the step asked for is not committed.
            StateMismatchError: keys, shapes or dtypes of the state do not match the step (with ``strict``).
            CorruptCheckpointError: a chunk or manifest fails its check (the state is unchanged).
            IncompatibleFormatError: the step was written by a newer format or codec.
            ReshardError: per-rank state saved on another world size, without ``rank_map``.
            DistributedSaveError: a rank did not answer within ``timeout``, or failed (named).
        """
        flags(none=True, strict=strict, allow_pickle=allow_pickle)
        flag("fallback", fallback)
        self._check_open()
        self._wait_pending()
        began = time.perf_counter()
        strict = self.options.strict if strict is None else strict
        allow_pickle = self.options.allow_pickle if allow_pickle is None else allow_pickle
        try:
            with paused():  # see save()
                done = self._chooser.load(step, state, strict=strict, allow_pickle=allow_pickle, fallback=fallback,
                                         rank_map=rank_map)
        except CheckpointError as e:
            if self._chooser.partial is not None:
                e.args = (f"{e} (The state was partly overwritten before this failed: load a step before training "
                          "on; saves are refused until then.)", *e.args[1:])
            raise
        took = time.perf_counter() - began
        if self._run_journal is not None:  # the first load of this start: the journal's start record
            self._run_journal.loaded(None if done is None else done.manifest.step, took, self._chooser.hosts)
        if done is None:
            return None
        done.stats.seconds = took
        self.last_load = done.stats
        self._engine.loaded(done)  # retention keeps the step; the next save reuses its chunks (wait() waits for a heal)
        return done.manifest.step

    # -- queries --------------------------------------------------------------------------------------
    def steps(self) -> list[int]:
        """The committed steps.

        Returns:
            list[int]: ascending.
        """
        return self._chooser.steps()

    def latest(self) -> int | None:
        """The newest committed step.

        Returns:
            int | None: None when nothing is committed.
        """
        steps = self.steps()
        return steps[-1] if steps else None

    def manifest(self, step: int) -> mf.Manifest:
        """The parsed manifest of a committed step (what ``ckpt inspect`` shows).

        Args:
            step: a committed step.

        Returns:
            Manifest: its tensors, structure and chunk table.

        Raises:
            CheckpointNotFoundError: the step is not committed.
        """
        return self._engine.manifests.get(step)

    # -- lifetime -------------------------------------------------------------------------------------
    def _wait_pending(self) -> None:
        self._ledger.settle()
        self._engine.drain()  # and the retention queued behind them

    def wait(self) -> None:
        """Wait for every save so far (and the retention after them); raise the first failure not
        yet seen through its handle."""
        self._wait_pending()
        err = self._ledger.unseen_failure()
        if err is not None:
            raise err

    def close(self) -> None:
        """Wait for in-flight saves, stop the background threads, and raise if a save failed. A preemption
        signal that no ``should_save()`` acted on is then passed on (by default it ends the process)."""
        if self._closed:
            return
        try:
            self.wait()
        finally:
            self._closed = True
            at_exit.untrack(self)
            self._schedule.close()
            self._engine.close(self._clean_end)  # the host buffer stays with this object (adopt_buffer)
        self._schedule.pass_on()  # a preemption signal that no should_save() took: the process gets it now

    def _in_flight(self) -> list[int]:
        """The steps whose saves are still being written (what the exit hook finishes)."""
        return self._ledger.in_flight()

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError("this Checkpointer is closed; create a new one")

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.close()
        else:  # don't hide the body's exception behind a save failure
            self._clean_end = False
            try:
                self.close()
            except CheckpointError as e:
                log.error("%s", e)

    def __repr__(self) -> str:
        o = self.options
        extra = f", local_dir={o.local_dir!r}" if o.local_dir else ""
        return f"Checkpointer({self.path!r}{extra}, keep_last={o.keep_last}, codec={o.codec.name!r})"
