"""The public entry point: :class:`Checkpointer` and the :class:`SaveHandle` each save returns."""

from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import Future
from typing import Any, Literal

import torch

from . import manifest as mf
from .codec import CodecSpec
from .dist import assign, inventory, make_comm, node_digest
from .errors import (CheckpointError, CheckpointNotFoundError, ConfigError, CorruptCheckpointError,
                     DistributedSaveError, NotACheckpointError, StateMismatchError, StepExistsError)
from .loader import load_into, load_manifest
from .plan import make_plan
from .retention import ManifestCache, committed_steps, delete_steps, to_delete
from .snapshot import HostPool
from .state import Flat, flatten
from .storage import open_tiered
from .writer import SaveJob, SaveMetrics, Writer, describe_failure

log = logging.getLogger("ckpt")

MiB = 1 << 20


class SaveHandle:
    """The result of :meth:`Checkpointer.save`: the save goes on in the background.

    Example::

        h = ckptr.save(step, state)
        ...                       # train on; the snapshot is already taken
        h.wait()                  # optional: blocks until committed, raises if the save failed
        print(h.metrics.stall_s, h.metrics.written_bytes)

    Stages, in order (``handle.stage`` says which one the save has reached):

    * ``"snapshot"``: ``save()`` returned; the state is copied and may change.
    * ``"local"``: every chunk is durable in the first tier (``local_dir`` when given; otherwise the
      checkpoint storage itself). The step is not committed yet.
    * ``"committed"``: every chunk is durable in the checkpoint storage (remote) and the manifest is
      committed; the step loads from anywhere.

    ``handle.wait("local")`` returns at the second stage, e.g. to let an NVMe-only job move on::

        h = ckptr.save(step, state)          # Checkpointer("s3://b/run", local_dir="/nvme/ckpt")
        h.wait("local")                      # on NVMe; upload to S3 still running
        h.wait()                             # committed on S3
    """

    STAGES = ("snapshot", "local", "committed")

    def __init__(self, step: int, metrics: SaveMetrics, future: Future | None):
        self.step = step
        self.metrics = metrics
        self._future = future
        self._observed = False
        self._local = threading.Event()
        self._settled = threading.Event()  # durable locally, or finished either way: what wait("local") needs
        self._started: float | None = None
        if future is None:
            self._local.set()
            self._settled.set()
        else:
            future.add_done_callback(lambda _: self._settled.set())

    def _mark_local(self) -> None:
        if self._started is not None:
            self.metrics.local_s = time.perf_counter() - self._started
        self._local.set()
        self._settled.set()

    @property
    def stage(self) -> str:
        """``"snapshot"``, ``"local"``, ``"committed"``, ``"failed"`` or ``"skipped"``."""
        if self.skipped:
            return "skipped"
        if self._future is not None and self._future.done():
            return "failed" if self._future.exception() is not None else "committed"
        return "local" if self._local.is_set() else "snapshot"

    def done(self) -> bool:
        """True once the save is committed or has failed (or was skipped)."""
        return self._future is None or self._future.done()

    def wait(self, stage: str = "committed", timeout: float | None = None) -> SaveMetrics:
        """Block until the save reaches ``stage`` (default: committed); raise its
        :class:`CheckpointError` if it failed first.

        Raises ``TimeoutError`` if ``timeout`` seconds pass first (the save goes on)."""
        if isinstance(stage, (int, float)) and not isinstance(stage, bool):  # wait(timeout) as before
            stage, timeout = "committed", stage
        if stage not in self.STAGES:
            raise ConfigError(f"stage must be one of {self.STAGES}, got {stage!r}")
        if stage == "snapshot":
            return self.metrics
        if stage == "local" and self._future is not None:
            if not self._settled.wait(timeout):
                raise TimeoutError(f"save of step {self.step} not durable locally after {timeout}s")
            if self._local.is_set():
                return self.metrics  # else it failed before that stage: raised below
        if self._future is not None:
            try:
                self._future.result(timeout)
            except TimeoutError:
                raise TimeoutError(f"save of step {self.step} not finished after {timeout}s") from None
            except BaseException as e:
                self._observed = True
                err = describe_failure(self.step, e)
                if err is e:
                    raise  # keeps the original traceback and __cause__
                raise err from e
        return self.metrics

    def exception(self) -> CheckpointError | None:
        """The failure of a finished save, or None (also None while it is still running)."""
        if self._future is None or not self._future.done():
            return None
        e = self._future.exception()
        if e is None:
            return None
        self._observed = True
        return describe_failure(self.step, e)

    def _succeeded(self) -> bool:
        # does not count as looking at the error, unlike exception()
        return self._future is None or (self._future.done() and self._future.exception() is None)

    @property
    def skipped(self) -> bool:
        return self.metrics.skipped

    def __repr__(self) -> str:
        state = "skipped" if self.skipped else ("done" if self.done() else "writing")
        return f"<SaveHandle step={self.step} {state}>"


class Checkpointer:
    """Asynchronous, verified checkpoints of a training state.

    ``path`` is a local directory or an fsspec URL (``file://``, ``memory://`` …). Example::

        ckptr = ckpt.Checkpointer("runs/exp1", keep_last=3)
        state = {"model": model, "optim": opt, "rng": ckpt.RNGState(), "step": 0}
        start = ckptr.load("latest", state) or 0    # resumes in place; None on a new run
        for step in range(start + 1, 1000):
            ...
            if step % 100 == 0:
                state["step"] = step
                ckptr.save(step, state)             # returns after the snapshot
        ckptr.close()                               # waits for the last saves, raises if one failed

    Options:
        keep_last: keep only the newest N committed steps (None keeps all). The step this run
            loaded from is never deleted.
        keep_every: also keep, for good, every step whose number is a multiple of K (with or
            without ``keep_last``). Retention runs after each commit, in the background.
        local_dir: a fast local directory (NVMe) staged in front of ``path``: chunks are written
            and fsynced there first, then uploaded; restores read a chunk there when its hash
            matches. See :class:`SaveHandle` for the stages a save goes through.
        chunk_size: bytes per chunk (default 16 MiB); the unit of dedup, verification and partial reads.
        codec: ``"auto"`` (zstd where it saves ≥8%, else raw), ``"raw"``, ``"zstd"`` or ``"zstd:<level>"``.
        busy: what a save does while the previous one is still writing from the host buffer:
            ``"wait"`` for it, or ``"skip"`` this save (logged; the handle says ``skipped``).
        strict: default for :meth:`load`: refuse keys missing on either side.
        allow_pickle: store objects that are not plain values with pickle (off: they are refused).
            Loading such a checkpoint needs ``allow_pickle=True`` too.
        io_threads: threads for hashing, compression and I/O (default: 2 × cores, 8 to 16;
            fsync-bound writes need several in flight to reach the disk's bandwidth).
        storage_options: passed to fsspec for URLs; for ``s3://`` also ckpt's own S3 options
            (``multipart_threshold``, ``multipart_chunksize``, ``upload_concurrency``,
            ``retry_deadline``, ``max_attempts``, ``connect_timeout``, ``read_timeout``).
        process_group: the ranks that save together (default: the default group, when
            ``torch.distributed`` is initialised; otherwise this process alone). Every rank calls
            ``save`` and ``load`` in the same order. Ranks coordinate through the group's store,
            never with collectives from background threads.
        timeout: seconds a rank waits for the others (plan, reports, the commit) before the save
            fails with :class:`~ckpt.DistributedSaveError` naming the ranks that did not answer.
        native: use the compiled core when it is built (fused multi-threaded copy + hash on CPU,
            batched device-to-host copies on GPU); ``False`` uses torch's copies (same bytes, same hashes).
        snapshot_threads: threads for the CPU copy + hash (default: cores, at most 8).

    CUDA tensors: ``save()`` only launches their copy and returns. The next ``optimizer.step()`` of
    any optimizer waits for it on the device (a pre-step hook), so the host never blocks; tensors no
    saved optimizer updates are copied first and the current stream waits for them at once. If you
    change saved parameters in place outside ``optimizer.step()``, call :func:`ckpt.fence` first.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        keep_last: int | None = None,
        chunk_size: int = 16 * MiB,
        codec: str = "auto",
        busy: Literal["wait", "skip"] = "wait",
        strict: bool = True,
        allow_pickle: bool = False,
        io_threads: int | None = None,
        storage_options: dict | None = None,
        process_group: Any = None,
        timeout: float = 600.0,
        local_dir: str | os.PathLike | None = None,
        keep_every: int | None = None,
        native: bool = True,
        snapshot_threads: int | None = None,
    ):
        if keep_last is not None and (type(keep_last) is not int or keep_last < 1):
            raise ConfigError(f"keep_last must be a positive integer or None, got {keep_last!r}")
        if snapshot_threads is not None and (type(snapshot_threads) is not int or snapshot_threads < 1):
            raise ConfigError(f"snapshot_threads must be a positive integer, got {snapshot_threads!r}")
        self.native = bool(native)
        self.snapshot_threads = snapshot_threads
        if keep_every is not None and (type(keep_every) is not int or keep_every < 1):
            raise ConfigError(f"keep_every must be a positive integer or None, got {keep_every!r}")
        if type(chunk_size) is not int or not (64 * 1024 <= chunk_size <= 1 << 31):
            raise ConfigError(f"chunk_size must be an integer between 64 KiB and 2 GiB, got {chunk_size!r}")
        if busy not in ("wait", "skip"):
            raise ConfigError(f"busy must be 'wait' or 'skip', got {busy!r}")
        if io_threads is not None and (type(io_threads) is not int or io_threads < 1):
            raise ConfigError(f"io_threads must be a positive integer, got {io_threads!r}")
        if not isinstance(timeout, (int, float)) or not timeout > 0:
            raise ConfigError(f"timeout must be a positive number of seconds, got {timeout!r}")
        self.path = os.fspath(path)
        self.timeout = float(timeout)
        self._comm = make_comm(process_group, self.timeout)
        threads = io_threads or min(16, max(8, 2 * (os.cpu_count() or 2)))
        self.local_dir = None if local_dir is None else os.fspath(local_dir)
        self.storage = open_tiered(self.path, self.local_dir, storage_options, upload_threads=threads)
        self.keep_last = keep_last
        self.keep_every = keep_every
        self.chunk_size = chunk_size
        self.codec = CodecSpec.parse(codec)
        self.busy = busy
        self.strict = strict
        self.allow_pickle = allow_pickle
        self._writer = Writer(self.storage, self.codec, threads)
        self._manifests = ManifestCache(self.storage)
        self._pool: HostPool | None = None
        self._sig: tuple | None = None  # structure signature the current plan was made for
        self._layout: dict | None = None  # the coordinator's answer: which tensors this rank writes
        self.plans_made = 0  # save plans computed (the first save, and after each structure change)
        self._seq = 0  # save() calls so far: the same on every rank, names the save in the store
        self._committed_chunks: dict = {}  # this rank's chunks in the last committed step
        self._loaded_chunks: dict = {}
        self.last_load: dict | None = None  # counters of the last load: chunks_read, bytes_read, chunks
        self._handles: list[SaveHandle] = []
        self._submitted: set[int] = set()  # steps saved or being saved by this Checkpointer
        self._protected: set[int] = set()  # steps this run loaded from: retention never deletes them
        self._lock = threading.Lock()
        self._closed = False

    # -- saving ---------------------------------------------------------------------------------
    @property
    def rank(self) -> int:
        """This process's rank in the saving group (0 without torch.distributed)."""
        return self._comm.rank

    @property
    def world_size(self) -> int:
        return self._comm.world

    def save(self, step: int, state: dict[str, Any]) -> SaveHandle:
        """Snapshot ``state`` as step ``step`` and write it in the background.

        Returns once every tensor is copied into the host buffer; later in-place changes to the
        state do not affect what is saved. See :class:`SaveHandle`. With several ranks, every rank
        calls it with the same step; each writes its own shard, and the step is committed once
        every rank's part is durable."""
        started = time.perf_counter()
        self._check_open()
        if type(step) is not int or step < 0:
            raise ConfigError(f"step must be a non-negative integer, got {step!r}")
        if step in self._submitted:
            raise StepExistsError(f"step {step} was already saved by this Checkpointer; use a new step number")
        seq = self._seq
        self._seq += 1
        comm = self._comm
        try:
            flat = flatten(state, allow_pickle=self.allow_pickle)
            sig = _signature(flat)
            metrics = SaveMetrics(step=step)
            pool = self._pool
            if pool is not None and pool.busy and self.busy == "skip" and sig == self._sig:
                metrics.skipped = True
                metrics.stall_s = time.perf_counter() - started
                log.info("ckpt: skipped the save of step %d: the previous save is still writing (busy='skip')", step)
                if comm.distributed:
                    comm.report(seq, "skip", step=step)
                    if comm.rank == 0:
                        self._writer.commit_thread.submit(self._decide_alone, seq, {"status": "skip", "ranks": [0]})
                return SaveHandle(step, metrics, None)
            if pool is None or sig != self._sig:
                self._layout = self._make_layout(seq, flat)
                self.plans_made += 1
                if pool is not None:  # the structure changed: wait for the old buffer, then replace it
                    pool.acquire()
                    pool.release()
                self._pool = pool = None  # let the old buffer go before allocating the new one
                owned = {k: flat.tensors[k] for k in self._layout["write"]}
                pool = self._pool = HostPool(make_plan(owned, self.chunk_size), native=self.native,
                                             threads=self.snapshot_threads)
                self._sig = sig
                log.debug("ckpt: new plan (%s): %d tensors, %d chunks, host buffer %.1f MiB (pinned=%s)",
                          comm.describe(), len(pool.plan.slots), len(pool.plan.chunks), pool.nbytes / MiB, pool.pinned)
            pool.acquire()
            try:
                # CUDA copies are only launched here; the optimizer pre-step hook and the writer wait for them.
                event, hashes = pool.copy_in(flat.tensors, _optimizer_guarded(state) if pool.has_cuda else frozenset())
            except BaseException:
                pool.release()
                raise
        except BaseException as e:
            if comm.distributed:
                self._tell_failure(seq, step, e)
            raise
        metrics.stall_s = time.perf_counter() - started
        job = SaveJob(step=step, plan=pool.plan, pool=pool, structure=flat.structure, metrics=metrics,
                      started=started, leaves={k: flat.leaves[k] for k in self._layout["write"]},
                      per_rank=frozenset(self._layout["per_rank"]), rank=comm.rank, seq=seq, cuda_event=event,
                      hashes=hashes)
        future: Future = Future()
        handle = SaveHandle(step, metrics, future)
        handle._started = started
        job.on_local = handle._mark_local
        self._writer.commit_thread.submit(self._run_save, job, future)
        with self._lock:
            self._submitted.add(step)
            # forget saves that succeeded; keep failures until someone has seen them
            self._handles = [h for h in self._handles if not h._succeeded()] + [handle]
        return handle

    def _make_layout(self, seq: int, flat: Flat) -> dict:
        """The coordinator's plan for this rank: which of its tensors it writes (replicated ones are
        written by one rank each, balancing bytes) and which top-level keys are per-rank."""
        inv = inventory(flat, {k: node_digest(v) for k, v in zip(flat.structure["k"], flat.structure["v"])})
        if self._comm.distributed:
            answer = self._comm.exchange_plan(seq, inv)
        else:
            answer = assign([inv])[0]
            if "error" in answer:
                raise StateMismatchError(answer["error"])
        keys = list(flat.tensors)
        return {"write": [keys[i] for i in answer["write"]], "per_rank": answer["per_rank"]}

    def _tell_failure(self, seq: int, step: int, e: BaseException) -> None:
        """save() failed on this rank before its job started: tell the others at once."""
        comm = self._comm
        msg = f"{type(e).__name__}: {e}"
        comm.fail_plan(seq, msg)
        try:
            comm.report(seq, "fail", step=step, message=msg)
            if comm.rank == 0:
                comm.publish(seq, {"status": "fail", "ranks": [0], "message": f"rank 0: {msg}"})
                self._writer.commit_thread.submit(self._decide_alone, seq, None)
        except DistributedSaveError:
            pass

    def _decide_alone(self, seq: int, result: dict | None) -> None:
        """Coordinator, for a save it took no part in: publish the result, then the go-ahead."""
        comm = self._comm
        try:
            if result is not None:
                comm.publish(seq, result)
            comm.free(seq)
            comm.forget(seq)
        except DistributedSaveError as e:
            log.error("ckpt: %s", e)

    def _run_save(self, job: SaveJob, future: Future) -> None:
        """On the commit thread: the save, then (after its handle resolves) retention. Retention
        runs here, before the next save's chunk writes, so dedup never races deletion."""
        distributed, coordinator = self._comm.distributed, self._comm.rank == 0
        committed = None
        try:
            try:
                if distributed:
                    committed = self._run_save_distributed(job)
                else:
                    part = self._writer.write_part(job)
                    committed = self._writer.commit(job, [part])
            except BaseException as e:
                log.error("ckpt: saving step %d failed: %s", job.step, e)
                if not isinstance(e, StepExistsError):
                    with self._lock:
                        self._submitted.discard(job.step)  # nothing was committed: the step may be saved again
                future.set_exception(e)
                return
            if committed is not None:
                self._manifests.put(committed)
            future.set_result(job.metrics)
            if committed is not None and coordinator and (self.keep_last is not None or self.keep_every is not None):
                self._retain(job.step)
        finally:
            if distributed and coordinator:  # other ranks may now write their next save's chunks
                self._decide_alone(job.seq, None)

    def _run_save_distributed(self, job: SaveJob) -> mf.Manifest | None:
        comm, seq = self._comm, job.seq
        part, local_error = None, None
        try:
            # Rank 0 deletes old steps (retention) between saves; write nothing until it is done.
            if comm.rank != 0 and seq > 0 and not comm.wait_free(seq - 1):
                raise DistributedSaveError(f"rank 0 did not finish the previous save within {2 * self.timeout:.0f}s",
                                           ranks=[0])
            part = self._writer.write_part(job)
        except BaseException as e:  # noqa: BLE001 - reported to the coordinator, raised below
            job.pool.release()
            local_error = e
        if local_error is None:
            comm.report(seq, "ok", step=job.step)
        else:
            comm.report(seq, "fail", step=job.step, message=f"{type(local_error).__name__}: {local_error}")
        committed = None
        if comm.rank == 0:
            result, committed = self._coordinate(job, part)
        else:
            result = comm.result(seq)
            if result is None:
                result = {"status": "fail", "ranks": [0],
                          "message": f"rank 0 (the coordinator) gave no decision within {2 * self.timeout:.0f}s"}
        status = result.get("status")
        if status == "ok" and part is not None:
            self._committed_chunks = dict(part.chunks)
            self._writer.reset_known({**self._loaded_chunks, **self._committed_chunks})
            if job.metrics.duration_s is None:
                job.metrics.duration_s = time.perf_counter() - job.started
            return committed
        self._writer.reset_known({**self._loaded_chunks, **self._committed_chunks})
        if status == "skip":
            job.metrics.skipped = True
            log.info("ckpt: step %d was not saved: rank(s) %s skipped it (busy='skip')", job.step, result.get("ranks"))
            with self._lock:
                self._submitted.discard(job.step)
            return None
        if result.get("kind") != "exists":
            with self._lock:
                self._submitted.discard(job.step)
        message = f"step {job.step} was not committed: {result.get('message', 'unknown failure')}"
        log.error("ckpt: %s", message)
        if result.get("kind") == "exists":
            raise StepExistsError(result.get("message", message)) from local_error
        raise DistributedSaveError(message, ranks=result.get("ranks", [])) from local_error

    def _coordinate(self, job: SaveJob, part: mf.Manifest | None) -> tuple[dict, mf.Manifest | None]:
        """Rank 0: wait for every rank's report, commit the step if all succeeded, tell everyone."""
        comm, seq = self._comm, job.seq
        committed = None
        try:
            reports, missing = comm.gather(seq)
            failed = sorted(r for r, v in reports.items() if v.get("status") == "fail")
            skipped = sorted(r for r, v in reports.items() if v.get("status") == "skip")
            steps = {v.get("step") for v in reports.values()}
            if failed or missing:
                why = [f"rank {r}: {reports[r].get('message', 'failed')}" for r in failed]
                why += [f"rank {r} did not report within {self.timeout:.0f}s (died or hung?)" for r in missing]
                result = {"status": "fail", "ranks": failed + missing, "message": "; ".join(why)}
            elif skipped:
                result = {"status": "skip", "ranks": skipped}
            elif len(steps) > 1:
                result = {"status": "fail", "ranks": [],
                          "message": f"ranks saved different step numbers in the same save() call: {sorted(steps)}"}
            else:
                parts = [part] + list(self._writer.io.map(lambda r: self._read_part(job.step, r), range(1, comm.world)))
                committed = self._writer.commit(job, parts)
                result = {"status": "ok"}
        except StepExistsError as e:
            result = {"status": "fail", "ranks": [], "kind": "exists", "message": str(e)}
        except BaseException as e:  # noqa: BLE001 - every rank must hear about it
            ranks = list(getattr(e, "ranks", None) or [0])
            result = {"status": "fail", "ranks": ranks, "message": f"rank 0 could not commit: {type(e).__name__}: {e}"}
        comm.publish(seq, result)
        return result, committed

    def _read_part(self, step: int, rank: int) -> mf.Manifest:
        key = mf.rank_key(step, rank)
        try:
            part = mf.parse(self.storage.read(key), name=key)
        except (CheckpointError, FileNotFoundError, OSError) as e:
            err = DistributedSaveError(f"rank {rank}'s report {key} is unreadable: {e}", ranks=[rank])
            raise err from e
        if part.kind != "rank" or part.rank != rank or part.step != step:
            raise DistributedSaveError(f"{key} describes rank {part.rank} step {part.step}, not rank {rank} step {step}",
                                       ranks=[rank])
        return part

    def _retain(self, step: int) -> None:
        try:
            self._retain_now()
        except Exception as e:  # the save itself succeeded; retention tries again after the next one
            log.warning("ckpt: retention after step %d failed (nothing committed was lost): %s", step, e)

    def _retain_now(self) -> None:
        if self._comm.rank != 0:
            return
        steps = committed_steps(self.storage)
        victims = to_delete(steps, self.keep_last, self._protected, self.keep_every)
        if not victims:
            return
        remaining = [s for s in steps if s not in victims]
        n, chunks = delete_steps(self.storage, self._manifests, victims, remaining, self._delete_many)
        self._writer.forget(chunks)
        log.info("ckpt: retention removed step(s) %s and %d unreferenced chunk(s)", victims, len(chunks))

    def _delete_many(self, keys: list[str]) -> None:
        list(self._writer.io.map(self.storage.delete, keys))

    # -- loading --------------------------------------------------------------------------------
    def load(self, step: int | Literal["latest"], state: dict[str, Any], *, strict: bool | None = None,
             fallback: bool = False, allow_pickle: bool | None = None, rank_map: Any = None) -> int | None:
        """Load a committed step into ``state`` in place; returns the step loaded.

        ``"latest"`` loads the newest committed step, or returns None when there is none (a new
        run). With ``fallback=True``, a damaged latest step is reported and the newest older step
        that loads cleanly is used instead. Every chunk's hash is checked.

        With several ranks, every rank calls it; each reads only the chunks overlapping the shards
        it needs, whatever world size saved the step, and all ranks end on the same step.
        Per-rank state (:class:`~ckpt.PerRank`, :class:`~ckpt.RNGState`) saved on another world
        size needs ``rank_map``: a function (or dict/list) from this rank to the saved rank whose
        value it takes, e.g. ``rank_map=lambda r: r % 4``.

        On :class:`CorruptCheckpointError` some tensors may already hold new values: load again
        (another step) before training on."""
        self._check_open()
        strict = self.strict if strict is None else strict
        allow_pickle = self.allow_pickle if allow_pickle is None else allow_pickle
        self._wait_pending()
        comm = self._comm
        if step == "latest":
            steps = self._committed_or_raise()
            if comm.distributed:  # every rank must pick the same step, even if listings lag
                views = [v["latest"] for v in comm.agree({"latest": steps[-1] if steps else None})]
                newest = None if any(v is None for v in views) else min(views)
                steps = [s for s in steps if newest is not None and s <= newest]
            if not steps:
                log.info("ckpt: no committed step in %s; starting fresh", self.storage.describe())
                return None
            first_error: CorruptCheckpointError | None = None
            for s in reversed(steps):
                err = self._attempt(s, state, strict, allow_pickle, rank_map)
                if err is None:
                    if first_error is not None:
                        log.warning("ckpt: loaded step %d instead of the damaged latest step %d", s, steps[-1])
                    return s
                if not isinstance(err, CorruptCheckpointError):
                    raise err
                if not fallback:
                    raise CorruptCheckpointError(
                        f"{err} (load('latest', state, fallback=True) would try older steps)",
                        object=err.object, chunk=err.chunk) from err
                log.warning("ckpt: step %d is damaged (%s); falling back to an older step", s, err)
                first_error = first_error or err
            assert first_error is not None
            raise CorruptCheckpointError(f"no committed step in {self.storage.describe()} loads cleanly; "
                                         f"the newest failed with: {first_error}",
                                         object=first_error.object, chunk=first_error.chunk) from first_error
        if type(step) is not int or step < 0:
            raise ConfigError(f"step must be a non-negative integer or 'latest', got {step!r}")
        if not self.storage.exists(mf.manifest_key(step)):
            steps = self._committed_or_raise()
            raise CheckpointNotFoundError(
                f"step {step} is not committed in {self.storage.describe()}; committed steps: "
                f"{_short_list(steps) if steps else 'none'}")
        err = self._attempt(step, state, strict, allow_pickle, rank_map)
        if err is not None:
            raise err
        return step

    def _attempt(self, step: int, state: dict, strict: bool, allow_pickle: bool, rank_map: Any) -> CheckpointError | None:
        """Load one step; with several ranks, agree on whether every rank managed."""
        err: CheckpointError | None = None
        try:
            self._load_step(step, state, strict, allow_pickle, rank_map)
        except CheckpointError as e:
            err = e
        if self._comm.distributed:
            views = self._comm.agree({"ok": err is None, "corrupt": isinstance(err, CorruptCheckpointError),
                                      "message": str(err)[:2000] if err is not None else ""})
            bad = [r for r, v in enumerate(views) if not v["ok"]]
            if bad and err is None:
                cls = CorruptCheckpointError if all(views[r]["corrupt"] for r in bad) else CheckpointError
                err = cls(f"rank(s) {bad} could not load step {step}: {views[bad[0]]['message']}")
        return err

    def _load_step(self, step: int, state: dict, strict: bool, allow_pickle: bool, rank_map: Any = None) -> None:
        try:
            m = load_manifest(self.storage, step)
        except FileNotFoundError:
            raise CheckpointNotFoundError(f"step {step} vanished from {self.storage.describe()} while loading") from None
        tiers = getattr(self.storage, "reset_counters", None)
        if tiers is not None:
            tiers()
        counters = load_into(self.storage, m, state, strict=strict, allow_pickle=allow_pickle, io=self._writer.io,
                             rank=self._comm.rank, world=self._comm.world, rank_map=rank_map)
        self._manifests.put(m)
        self._protected.add(step)
        self._loaded_chunks = dict(m.chunks)
        self._writer.learn(m.chunks)  # lets the next save reuse these chunks without probing
        if tiers is not None:  # which tier each chunk came from; damaged local copies are named
            c = self.storage.counters
            counters.update(local_chunks=c["local_hits"], remote_chunks=c["remote_reads"],
                            local_rejected=list(c["local_rejected"]))
        self.last_load = counters
        log.info("ckpt: loaded step %d (saved on %d rank(s)) from %s as %s: %d chunks, %.1f MiB read",
                 step, m.world_size, self.storage.describe(), self._comm.describe(), counters["chunks_read"],
                 counters["bytes_read"] / MiB)

    # -- queries --------------------------------------------------------------------------------
    def steps(self) -> list[int]:
        """The committed steps, ascending."""
        return self._committed_or_raise()

    def latest(self) -> int | None:
        """The newest committed step, or None."""
        steps = self.steps()
        return steps[-1] if steps else None

    def _committed_or_raise(self) -> list[int]:
        state = getattr(self.storage, "root_state", lambda: "nonempty")()
        if state == "file":
            raise NotACheckpointError(f"{self.path} is a file, not a checkpoint directory")
        return committed_steps(self.storage)

    def manifest(self, step: int) -> mf.Manifest:
        """The parsed manifest of a committed step (what ``ckpt inspect`` shows)."""
        return self._manifests.get(step)

    # -- lifetime -------------------------------------------------------------------------------
    def _wait_pending(self) -> list[SaveHandle]:
        with self._lock:
            handles = list(self._handles)
        for h in handles:
            if h._future is not None:
                try:
                    h._future.result()
                except BaseException:  # noqa: BLE001 - reported by close() or the handle
                    pass
        if not self._closed:  # and the retention queued behind them
            self._writer.commit_thread.submit(lambda: None).result()
        return handles

    def wait(self) -> None:
        """Wait for every save so far (and the retention after them); raise the first failure not
        yet seen through its handle."""
        for h in self._wait_pending():
            if not h._observed:
                err = h.exception()
                if err is not None:
                    raise err

    def close(self) -> None:
        """Wait for in-flight saves, stop the background threads, and raise if a save failed."""
        if self._closed:
            return
        try:
            self.wait()
        finally:
            self._closed = True
            self._writer.shutdown()
            getattr(self.storage, "close", lambda: None)()
            self._pool = None

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError("this Checkpointer is closed; create a new one")

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:  # don't hide the body's exception behind a save failure
            try:
                self.close()
            except CheckpointError as e:
                log.error("ckpt: %s", e)

    def __repr__(self) -> str:
        extra = f", local_dir={self.local_dir!r}" if self.local_dir else ""
        return f"Checkpointer({self.path!r}{extra}, keep_last={self.keep_last}, codec={self.codec.name!r})"


def _optimizer_guarded(state: dict) -> set[int]:
    """Data pointers of the CUDA tensors that an optimizer in ``state`` updates (its parameters and its
    state): the optimizer pre-step hook protects those, so their snapshot copy may overlap compute."""
    out: set[int] = set()
    values = list(state.values())
    while values:
        v = values.pop()
        if isinstance(v, (list, tuple)):
            values.extend(v)
        elif isinstance(v, dict):
            values.extend(v.values())
        elif isinstance(v, torch.optim.Optimizer):
            for group in v.param_groups:
                for p in group["params"]:
                    if p.is_cuda:
                        out.add(p.data_ptr())
            for st in v.state.values():
                for t in st.values():
                    if isinstance(t, torch.Tensor) and t.is_cuda:
                        out.add(t.data_ptr())
    return out


def _short_list(steps: list[int]) -> str:
    return ", ".join(map(str, steps)) if len(steps) <= 10 else f"{steps[0]} … {steps[-1]} ({len(steps)} steps)"


def _signature(flat: Flat) -> tuple:
    """Everything the save plan depends on: keys, dtypes, local shapes, devices, boxes, kinds."""
    return (tuple((k, t.dtype, tuple(t.shape), t.device.type, flat.leaves[k]) for k, t in flat.tensors.items()),
            tuple(sorted(flat.per_rank)))
