"""What ``Checkpointer.save`` returns: a :class:`SaveHandle` on a save going on in the background."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Literal

from .errors import CheckpointError, ConfigError, StepExistsError, StorageError
from .format.manifest import MAX_STEP

Stage = Literal["snapshot", "local", "committed"]
REFUSED_FOR_EARLIER = "failed in the background, so step"  # in the error of a save refused for an earlier failure


@dataclass
class SaveMetrics:
    """What one save cost on this rank (``handle.metrics``).

    Attributes:
        step: the step.
        stall_s: seconds the caller was blocked inside ``save()``.
        raw_bytes: bytes of the state this rank saved.
        written_bytes: bytes this save put in storage (new chunks, headers included).
        chunks: chunks of this rank's part of the step.
        chunks_written: chunks this save stored (the others were there already).
        chunks_reused: chunks already stored (dedup): not written again.
        chunks_delta: chunks written as a delta of the chunk at their place in the previous save.
        host_bytes: host memory the snapshot buffers hold (twice the state with deltas; with a state larger
            than ``host_memory``, the two slabs the pieces go through).
        blocked_s: of ``stall_s``, seconds ``save()`` waited for the writer to free a slab (a state larger
            than ``host_memory``, saved in pieces; 0 otherwise).
        pieces: the pieces the state was copied in (0: one host buffer, the state's size).
        duration_s: from the save() call until the step was committed.
        skipped: busy="skip" dropped this save.
        local_s: from the save() call until every chunk was durable in the first tier.
        persisted: uploaded to the checkpoint path (persist_every); False: committed to the local tiers only.
        peer_sent_bytes: redundancy: bytes this rank sent to peers (replicas, parity segments).
        peer_stored_bytes: redundancy: bytes this rank stored for its peers (replicas, parity blocks).
        peer_s: redundancy: seconds the exchange with peers took (after the snapshot).
        encoded_bytes: raw bytes of the chunks this rank encoded (new chunks: codec choice and encode).
        encode_cpu_s: CPU seconds the writer threads spent on them: what the codec costs the machine.
    """

    step: int
    stall_s: float = 0.0
    raw_bytes: int = 0
    written_bytes: int = 0
    chunks: int = 0
    chunks_written: int = 0
    chunks_reused: int = 0
    chunks_delta: int = 0
    host_bytes: int = 0
    duration_s: float | None = None
    skipped: bool = False
    local_s: float | None = None
    persisted: bool = True
    peer_sent_bytes: int = 0
    peer_stored_bytes: int = 0
    peer_s: float | None = None
    encoded_bytes: int = 0
    encode_cpu_s: float = 0.0
    blocked_s: float = 0.0
    pieces: int = 0


def as_checkpoint_error(step: int, e: BaseException) -> CheckpointError:
    """Background failures reach the caller as CheckpointErrors that keep the original cause."""
    if isinstance(e, CheckpointError):
        return e
    err = StorageError(f"saving step {step} failed: {type(e).__name__}: {e}")
    err.__cause__ = e
    return err


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

    Attributes:
        step: the step saved.
        metrics: what the save cost (:class:`SaveMetrics`), filled in as it goes.
    """

    STAGES: tuple[Stage, ...] = ("snapshot", "local", "committed")

    def __init__(self, step: int, metrics: SaveMetrics, future: Future | None = None, *,
                 started: float | None = None):
        """``future`` resolves when the save is committed (or fails); None for a save that was
        skipped before it started. ``started`` is the ``time.perf_counter()`` of the ``save()``
        call: stage times count from it."""
        self.step = step
        self._started = time.perf_counter() if started is None else started
        self.metrics = metrics
        self._future = future
        self._observed = False  # the caller has seen the failure (through wait() or exception())
        self._local = threading.Event()
        self._settled = threading.Event()  # durable locally, or finished either way: what wait("local") needs
        if future is None:
            self._local.set()
            self._settled.set()
        else:
            future.add_done_callback(lambda _: self._settled.set())

    def mark_local(self) -> None:
        """Called by the writer once every chunk is durable in the first tier."""
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
        """Whether the save has finished.

        Returns:
            bool: True once the save is committed or has failed (or was skipped).
        """
        return self._future is None or self._future.done()

    def wait(self, stage: Stage = "committed", timeout: float | None = None) -> SaveMetrics:
        """Block until the save reaches ``stage``.

        Args:
            stage: ``"snapshot"`` (already reached when ``save()`` returns), ``"local"`` (every chunk durable in
                the first tier) or ``"committed"``.
            timeout: seconds to wait at most; None waits as long as it takes.

        Returns:
            SaveMetrics: what the save cost so far.

        Raises:
            CheckpointError: the save failed before reaching ``stage`` (its own error).
            TimeoutError: ``timeout`` passed first (the save goes on).
            ConfigError: ``stage`` is not one of the stages.
        """
        if stage not in self.STAGES:
            raise ConfigError(f"stage must be one of {self.STAGES}, got {stage!r}")
        if stage == "snapshot" or self._future is None:
            return self.metrics
        if stage == "local":
            if not self._settled.wait(timeout):
                raise TimeoutError(f"save of step {self.step} not durable locally after {timeout}s")
            if self._local.is_set():
                return self.metrics  # else it failed before that stage: raised below
        try:
            self._future.result(timeout)
        except TimeoutError:
            raise TimeoutError(f"save of step {self.step} not finished after {timeout}s") from None
        except BaseException as e:
            self._observed = True
            err = as_checkpoint_error(self.step, e)
            if err is e:
                raise  # keeps the original traceback and __cause__
            raise err from e
        return self.metrics

    def exception(self) -> CheckpointError | None:
        """The failure of a finished save.

        Returns:
            CheckpointError | None: None if it succeeded or is still running.
        """
        if self._future is None or not self._future.done():
            return None
        e = self._future.exception()
        if e is None:
            return None
        self._observed = True
        return as_checkpoint_error(self.step, e)

    def failure_unseen(self) -> CheckpointError | None:
        """The failure of a finished save that nobody has looked at yet (marks it seen).

        Returns:
            CheckpointError | None: None if there is none, or it was seen already.
        """
        return None if self._observed else self.exception()

    def succeeded(self) -> bool:
        """Whether the save committed (or was skipped) without error; does not count as looking at an error.

        Returns:
            bool: False while it runs and when it failed.
        """
        return self._future is None or (self._future.done() and self._future.exception() is None)

    def settle(self) -> None:
        """Wait until the save has finished either way, without raising."""
        if self._future is not None:
            try:
                self._future.result()
            except BaseException:
                pass

    @property
    def skipped(self) -> bool:
        return self.metrics.skipped

    def __repr__(self) -> str:
        stage = self.stage  # "failed" and "committed" say how it ended
        return f"<SaveHandle step={self.step} {'writing' if stage in ('snapshot', 'local') else stage}>"


class SaveLedger:
    """The saves of one Checkpointer: which step numbers are taken, and the handles still in flight
    or whose failure nobody has looked at yet (so ``wait``/``close`` can raise it)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._handles: list[SaveHandle] = []
        self._steps: set[int] = set()

    def claim(self, step: int) -> None:
        """Take ``step`` for a save, or raise if it is no step number or this Checkpointer has saved
        (or is saving) it."""
        if type(step) is not int or not 0 <= step <= MAX_STEP:
            raise ConfigError(f"step must be an integer from 0 to 2**63 - 1, got {step!r}")
        with self._lock:
            if step in self._steps:
                raise StepExistsError(f"step {step} was already saved by this Checkpointer; use a new step number")
            self._steps.add(step)

    def release(self, step: int) -> None:
        """The save of ``step`` never started: the number may be used again."""
        with self._lock:
            self._steps.discard(step)

    def add(self, handle: SaveHandle) -> None:
        """Track ``handle``; when its save ends without committing (other than finding the step
        already committed) or is skipped, its step may be saved again."""
        from .errors import StepExistsError

        def settled(f: Future) -> None:
            e = f.exception()
            if handle.metrics.skipped or (e is not None and not isinstance(e, StepExistsError)):
                self.release(handle.step)

        if handle._future is not None:
            handle._future.add_done_callback(settled)
        with self._lock:  # forget saves that succeeded; keep failures until someone has seen them
            self._handles = [h for h in self._handles if not h.succeeded()] + [handle]

    def settle(self) -> list[SaveHandle]:
        """Wait until every save so far has finished either way; returns their handles."""
        with self._lock:
            handles = list(self._handles)
        for h in handles:
            h.settle()
        return handles

    def finished_failure(self) -> tuple[SaveHandle, CheckpointError] | None:
        """The first save that has already failed and whose failure nobody has looked at, with its
        error (marked seen now); never waits for a save still running."""
        with self._lock:
            handles = list(self._handles)
        for h in handles:
            err = h.failure_unseen() if h.done() else None
            if err is not None and REFUSED_FOR_EARLIER not in str(err):
                return h, err
            # (one that only says another rank refused it for an earlier failure is not raised again: this
            # rank raises that failure itself, and raising each refusal would make the ranks refuse in turn)
        return None

    def in_flight(self) -> list[int]:
        """The steps of the saves still being written."""
        with self._lock:
            return [h.step for h in self._handles if not h.done()]

    def unseen_failure(self) -> CheckpointError | None:
        """The first failure of a finished save nobody has looked at (marked seen now)."""
        for h in self.settle():
            err = h.failure_unseen()
            if err is not None:
                return err
        return None
