"""The public entry point: :class:`Checkpointer` and the :class:`SaveHandle` each save returns."""

from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import Future
from typing import Any, Literal

from . import manifest as mf
from .codec import CodecSpec
from .errors import (CheckpointError, CheckpointNotFoundError, ConfigError, CorruptCheckpointError,
                     NotACheckpointError, StepExistsError)
from .loader import load_into, load_manifest
from .plan import make_plan, signature
from .retention import ManifestCache, committed_steps, delete_steps, to_delete
from .snapshot import HostPool
from .state import flatten
from .storage import open_storage
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
    """

    def __init__(self, step: int, metrics: SaveMetrics, future: Future | None):
        self.step = step
        self.metrics = metrics
        self._future = future
        self._observed = False

    def done(self) -> bool:
        """True once the save is committed or has failed (or was skipped)."""
        return self._future is None or self._future.done()

    def wait(self, timeout: float | None = None) -> SaveMetrics:
        """Block until the step is committed; raise its :class:`CheckpointError` if it failed.

        Raises ``TimeoutError`` if ``timeout`` seconds pass first (the save goes on)."""
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
        chunk_size: bytes per chunk (default 16 MiB); the unit of dedup, verification and partial reads.
        codec: ``"auto"`` (zstd where it saves ≥8%, else raw), ``"raw"``, ``"zstd"`` or ``"zstd:<level>"``.
        busy: what a save does while the previous one is still writing from the host buffer:
            ``"wait"`` for it, or ``"skip"`` this save (logged; the handle says ``skipped``).
        strict: default for :meth:`load`: refuse keys missing on either side.
        allow_pickle: store objects that are not plain values with pickle (off: they are refused).
            Loading such a checkpoint needs ``allow_pickle=True`` too.
        io_threads: threads for hashing, compression and I/O (default: 2 × cores, 8 to 16;
            fsync-bound writes need several in flight to reach the disk's bandwidth).
        storage_options: passed to fsspec for URLs.
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
    ):
        if keep_last is not None and (type(keep_last) is not int or keep_last < 1):
            raise ConfigError(f"keep_last must be a positive integer or None, got {keep_last!r}")
        if type(chunk_size) is not int or not (64 * 1024 <= chunk_size <= 1 << 31):
            raise ConfigError(f"chunk_size must be an integer between 64 KiB and 2 GiB, got {chunk_size!r}")
        if busy not in ("wait", "skip"):
            raise ConfigError(f"busy must be 'wait' or 'skip', got {busy!r}")
        if io_threads is not None and (type(io_threads) is not int or io_threads < 1):
            raise ConfigError(f"io_threads must be a positive integer, got {io_threads!r}")
        self.path = os.fspath(path)
        self.storage = open_storage(self.path, storage_options)
        self.keep_last = keep_last
        self.chunk_size = chunk_size
        self.codec = CodecSpec.parse(codec)
        self.busy = busy
        self.strict = strict
        self.allow_pickle = allow_pickle
        threads = io_threads or min(16, max(8, 2 * (os.cpu_count() or 2)))
        self._writer = Writer(self.storage, self.codec, threads)
        self._manifests = ManifestCache(self.storage)
        self._pool: HostPool | None = None
        self._handles: list[SaveHandle] = []
        self._submitted: set[int] = set()  # steps saved or being saved by this Checkpointer
        self._protected: set[int] = set()  # steps this run loaded from: retention never deletes them
        self._lock = threading.Lock()
        self._closed = False

    # -- saving ---------------------------------------------------------------------------------
    def save(self, step: int, state: dict[str, Any]) -> SaveHandle:
        """Snapshot ``state`` as step ``step`` and write it in the background.

        Returns once every tensor is copied into the host buffer; later in-place changes to the
        state do not affect what is saved. See :class:`SaveHandle`."""
        started = time.perf_counter()
        self._check_open()
        if type(step) is not int or step < 0:
            raise ConfigError(f"step must be a non-negative integer, got {step!r}")
        if step in self._submitted:
            raise StepExistsError(f"step {step} was already saved by this Checkpointer; use a new step number")
        flat = flatten(state, allow_pickle=self.allow_pickle)
        sig = signature(flat.tensors)
        metrics = SaveMetrics(step=step)
        pool = self._pool
        if pool is not None and pool.busy and self.busy == "skip":
            metrics.skipped = True
            metrics.stall_s = time.perf_counter() - started
            log.info("ckpt: skipped the save of step %d: the previous save is still writing (busy='skip')", step)
            return SaveHandle(step, metrics, None)
        if pool is None or pool.plan.signature != sig:
            if pool is not None:  # the state's structure changed: wait for the old buffer, then replace it
                pool.acquire()
                pool.release()
            self._pool = pool = None  # let the old buffer go before allocating the new one
            pool = self._pool = HostPool(make_plan(flat.tensors, self.chunk_size))
            log.debug("ckpt: new plan: %d tensors, %d chunks, host buffer %.1f MiB (pinned=%s)",
                      len(pool.plan.slots), len(pool.plan.chunks), pool.nbytes / MiB, pool.pinned)
        pool.acquire()
        try:
            event = pool.copy_in(flat.tensors)
            if event is not None:
                # Until the optimizer pre-step hook exists (it makes the compute stream wait on this
                # event on the device), the host waits here so no in-place update can race the copy.
                event.synchronize()
                event = None
        except BaseException:
            pool.release()
            raise
        metrics.stall_s = time.perf_counter() - started
        job = SaveJob(step=step, plan=pool.plan, pool=pool, structure=flat.structure, metrics=metrics,
                      started=started, cuda_event=event)
        future = self._writer.commit_thread.submit(self._run_save, job)
        handle = SaveHandle(step, metrics, future)
        with self._lock:
            self._submitted.add(step)
            # forget saves that succeeded; keep failures until someone has seen them
            self._handles = [h for h in self._handles if not h._succeeded()] + [handle]
        return handle

    def _run_save(self, job: SaveJob) -> SaveMetrics:
        try:
            committed = self._writer.run(job)
        except BaseException as e:
            log.error("ckpt: saving step %d failed: %s", job.step, e)
            if not isinstance(e, StepExistsError):
                with self._lock:
                    self._submitted.discard(job.step)  # nothing was committed: the step may be saved again
            raise
        self._manifests.put(committed)
        if self.keep_last is not None:
            # Queued behind this save on the same thread: the handle resolves at the commit, and the
            # next save's chunk writes still run after the deletions (dedup never races GC).
            self._writer.commit_thread.submit(self._retain, job.step)
        return job.metrics

    def _retain(self, step: int) -> None:
        try:
            self._retain_now()
        except Exception as e:  # the save itself succeeded; retention tries again after the next one
            log.warning("ckpt: retention after step %d failed (nothing committed was lost): %s", step, e)

    def _retain_now(self) -> None:
        steps = committed_steps(self.storage)
        victims = to_delete(steps, self.keep_last, self._protected)
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
             fallback: bool = False, allow_pickle: bool | None = None) -> int | None:
        """Load a committed step into ``state`` in place; returns the step loaded.

        ``"latest"`` loads the newest committed step, or returns None when there is none (a new
        run). With ``fallback=True``, a damaged latest step is reported and the newest older step
        that loads cleanly is used instead. Every chunk's hash is checked.

        On :class:`CorruptCheckpointError` some tensors may already hold new values: load again
        (another step) before training on."""
        self._check_open()
        strict = self.strict if strict is None else strict
        allow_pickle = self.allow_pickle if allow_pickle is None else allow_pickle
        self._wait_pending()
        if step == "latest":
            steps = self._committed_or_raise()
            if not steps:
                log.info("ckpt: no committed step in %s; starting fresh", self.storage.describe())
                return None
            first_error: CorruptCheckpointError | None = None
            for s in reversed(steps):
                try:
                    self._load_step(s, state, strict, allow_pickle)
                except CorruptCheckpointError as e:
                    if not fallback:
                        raise CorruptCheckpointError(
                            f"{e} (load('latest', state, fallback=True) would try older steps)",
                            object=e.object, chunk=e.chunk) from e
                    log.warning("ckpt: step %d is damaged (%s); falling back to an older step", s, e)
                    first_error = first_error or e
                    continue
                if first_error is not None:
                    log.warning("ckpt: loaded step %d instead of the damaged latest step %d", s, steps[-1])
                return s
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
        self._load_step(step, state, strict, allow_pickle)
        return step

    def _load_step(self, step: int, state: dict, strict: bool, allow_pickle: bool) -> None:
        try:
            m = load_manifest(self.storage, step)
        except FileNotFoundError:
            raise CheckpointNotFoundError(f"step {step} vanished from {self.storage.describe()} while loading") from None
        counters = load_into(self.storage, m, state, strict=strict, allow_pickle=allow_pickle, io=self._writer.io)
        self._manifests.put(m)
        self._protected.add(step)
        self._writer.learn(m.chunks)  # lets the next save reuse these chunks without probing
        log.info("ckpt: loaded step %d from %s (%d chunks, %.1f MiB read)",
                 step, self.storage.describe(), counters["chunks_read"], counters["bytes_read"] / MiB)

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
        return f"Checkpointer({self.path!r}, keep_last={self.keep_last}, codec={self.codec.name!r})"


def _short_list(steps: list[int]) -> str:
    return ", ".join(map(str, steps)) if len(steps) <= 10 else f"{steps[0]} … {steps[-1]} ({len(steps)} steps)"
