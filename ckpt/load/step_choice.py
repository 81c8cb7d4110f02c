"""Which step a load loads, on every rank: :class:`StepChooser` takes the one asked for, or the newest
committed one every rank sees, falling back past damaged steps when asked, with every rank agreeing
on the outcome (``agree`` rounds, :mod:`ckpt.ranks`). The reading itself, checks first, then
verified reads into place, is :func:`ckpt.load.into_state.load_into`. Local commits plug in through
:class:`Restore` (:mod:`ckpt.peers` implements it); this module imports nothing of them.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from .. import errors, events
from ..errors import (
    CheckpointError,
    CheckpointNotFoundError,
    ConfigError,
    CorruptCheckpointError,
    NotACheckpointError,
    PartialStateError,
    StateMismatchError,
)
from ..format import manifest as mf
from ..format import paths
from ..format.planes import trim_scratch
from ..ranks import Comm
from ..storage import Storage, read_counters
from . import held
from .apply import init_optimizers
from .index_reads import step_for_load
from .into_state import Lend, LoadStats, RankMap, load_into

log = logging.getLogger("ckpt")

MiB = 1 << 20


@dataclass
class LoadResult:
    """A load that succeeded: the step's manifest, what was read, and what must run afterwards to make
    this rank's local tier whole again (``heal``: local commits only; the Checkpointer runs it on its
    commit thread, and False means the tier still lacks some loaded chunks)."""

    manifest: mf.Manifest
    stats: LoadStats
    heal: Callable[[], bool] | None = None


# One load attempt of a step by the loader (checks, then verified reads into place), every rank agreeing
# on the outcome: ``attempt(step, manifest=None, before_read=None)`` -> (result, None) or (None, error).
# ``before_read(chunks)`` runs just before the first read, with every chunk the reads need.
Attempt = Callable[..., "tuple[LoadResult | None, CheckpointError | None]"]


class Restore(Protocol):
    """Where steps come from when not only from the checkpoint path (:mod:`ckpt.peers`: the local
    tiers and their peers). The loader knows only this."""

    def steps(self) -> list[int]:
        """Committed steps, ascending, wherever they are."""

    def load(self, attempt: Attempt, step: int | Literal["latest"], fallback: bool) -> LoadResult | None:
        """Choose the step (and where its chunks come from), fetch what is missing, load it with
        ``attempt``; None for a new run."""


class StepChooser:
    """Loads committed steps into a state, on every rank of the group, all ending on the same step.

    ``latest`` is the newest step every rank sees; with ``fallback`` a damaged step is reported and
    the newest older step that loads on every rank is used instead."""

    def __init__(self, storage: Storage, comm: Comm, io: Executor, manifests: mf.ManifestCache,
                 restore: Restore | None = None, *, staged: bool = True, lend: Lend | None = None,
                 budget: int | None = None):
        self.restore = restore
        self.staged = staged  # reads land in staging memory first: a failed load changes nothing
        self.lend = lend  # where that memory comes from (the Checkpointer's idle host buffer)
        self.budget = budget  # the most staging memory a load holds (host_memory), or None
        self.storage = storage
        self.comm = comm
        self.io = io
        self.manifests = manifests
        self.partial: int | None = None  # a step whose load failed after it had changed the state
        self.hosts: list[str] | None = None  # the ranks' hosts, as the coordinator's listing round gathered them

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
        if self.restore is not None:
            return self.restore.steps()
        return mf.committed_steps(self.storage)

    def load(self, step: int | Literal["latest"], state: dict[str, Any], *, strict: bool, allow_pickle: bool,
             fallback: bool = False, rank_map: RankMap | None = None) -> LoadResult | None:
        """Load ``step`` (or the newest committed one) into ``state``; None when ``"latest"`` finds
        no committed step (a new run)."""
        if step != "latest" and (type(step) is not int or not 0 <= step <= mf.MAX_STEP):
            raise ConfigError(f"step must be 'latest' or an integer from 0 to 2**63 - 1, got {step!r}")

        def attempt(s: int, manifest: mf.Manifest | None = None,
                    before_read: Callable[[set[str]], None] | None = None
                    ) -> tuple[LoadResult | None, CheckpointError | None]:
            return self._attempt(s, state, strict, allow_pickle, rank_map, manifest, before_read)

        if self.restore is not None:
            return self.restore.load(attempt, step, fallback)
        if step != "latest":
            if not self.storage.exists(paths.manifest_key(step)):
                steps = self.steps()
                raise CheckpointNotFoundError(
                    f"step {step} is not committed in {self.storage.describe()}; committed steps: "
                    f"{short_list(steps) if steps else 'none'}")
            done, err = attempt(step)
            if done is None:
                assert err is not None
                raise advise(err, "Load another step (ckptr.steps() lists them), or load('latest', state, "
                                   "fallback=True) for the newest that verifies.")
            return done
        steps, root = self._listing()
        if not steps:
            if root == "missing":  # a typo in the path must not pass for a new run
                log.warning("starting fresh: nothing at %s (if this run should resume, check the path)",
                            self.storage.describe())
            else:
                log.info("no checkpoint at %s: starting fresh", self.storage.describe())
            events.emit("fresh", self.comm.rank)
            return None
        first_error: CorruptCheckpointError | None = None
        for s in reversed(steps):
            done, err = attempt(s)
            if done is not None:
                if first_error is not None:
                    log.warning("loaded step %d instead of the damaged latest step %d", s, steps[-1])
                return done
            if not isinstance(err, CorruptCheckpointError):
                assert err is not None
                raise err
            if not fallback:
                raise advise(err, "load('latest', state, fallback=True) loads the newest step that verifies.")
            log.warning("%s; falling back to an older step", err)
            first_error = first_error or err
        assert first_error is not None
        raise CorruptCheckpointError(f"no committed step in {self.storage.describe()} loads cleanly; "
                                     f"the newest failed: {first_error}",
                                     object=first_error.object, chunk=first_error.chunk) from first_error

    def _listing(self) -> tuple[list[int], str | None]:
        """The committed steps and, when there are none, the root's state (a new run, or a wrong path?).

        With several ranks only the coordinator lists (and HEADs each step's manifest) and hands its
        answer to the others in the first ``agree`` round: a load costs one listing, not one per rank,
        and every rank picks from the same steps. An error of that listing is raised on every rank,
        of the same class."""
        host = socket.gethostname()
        if self.comm.world == 1:
            self.hosts = [host]
            steps = self.steps()
            return steps, None if steps else self.storage.root_state()
        listing: dict = {"host": host}  # the others post their host (for the run journal) and nothing else
        err: CheckpointError | None = None
        if self.comm.rank == 0:
            try:
                steps = self.steps()
                listing.update(steps=steps, root=None if steps else self.storage.root_state())
            except CheckpointError as e:
                listing.update(error=type(e).__name__, message=str(e))
                err = e

        def coordinators(views: list[Any]) -> Any:
            self.hosts = sorted({str(v["host"]) for v in views if isinstance(v, dict) and "host" in v})
            return _coordinators(views)  # the ranks' hosts stay here, on the coordinator

        answer = self.comm.agree(listing, coordinators)
        if "error" in answer:
            if self.comm.rank == 0 and err is not None:
                raise err
            raise _rebuilt(answer["error"], answer["message"])
        return [int(s) for s in answer["steps"]], answer["root"]

    def _attempt(self, step: int, state: dict[str, Any], strict: bool, allow_pickle: bool, rank_map: RankMap | None,
                 manifest: mf.Manifest | None = None, before_read: Callable[[set[str]], None] | None = None
                 ) -> tuple[LoadResult | None, CheckpointError | None]:
        """Load one step; with several ranks, agree on whether every rank managed."""
        done, err = None, None
        changed = [False]
        agreed = [False]

        def ready(note: dict) -> dict:
            """Every chunk this rank needs has checked out (staged), or its reads are about to write into
            the state (in place): with several ranks, nobody changes its state unless every rank got here.
            Returns what the ranks took of the step together (:func:`ckpt.load.held.union` of their notes)."""
            agreed[0] = True
            if self.comm.world == 1:
                return {**note, "ranks": 1}
            answer = self.comm.agree({**_outcome(None), **note}, _ready)
            self._refuse_if_any_failed(step, dict(answer["failures"]))
            return {**answer["held"], "ranks": self.comm.world}

        try:
            done = self._load_step(step, state, strict, allow_pickle, rank_map, changed, manifest, before_read,
                                   ready)
        except CheckpointError as e:
            err = _naming(e, step)
        except Exception as e:  # not ckpt's own (a torch error, memory): still one outcome on every rank
            err = _naming(CheckpointError(f"{type(e).__name__}: {e}"), step)
            err.__cause__ = e
        if self.comm.world > 1 and not agreed[0]:  # failed before the others' first round: answer it
            self.comm.agree(_outcome(err), _ready)  # the same reduction as the others' round
        if err is None:
            self.partial = None
        elif changed[0]:
            self.partial = step
        if self.comm.world > 1:
            views = dict(self.comm.agree(_outcome(err), _failures))
            bad = sorted(views)
            if bad and err is None:
                if changed[0]:  # this rank loaded the step, another failed after changing its state
                    self.partial = step
                done, err = None, _failed_on(step, bad, views)
        return done, err

    def _refuse_if_any_failed(self, step: int, views: dict[int, dict]) -> None:
        bad = sorted(views)
        if bad:
            raise _failed_on(step, bad, views)

    def _load_step(self, step: int, state: dict[str, Any], strict: bool, allow_pickle: bool,
                   rank_map: RankMap | None, changed: list[bool], manifest: mf.Manifest | None = None,
                   before_read: Callable[[set[str]], None] | None = None,
                   ready: Callable[[dict], dict] | None = None) -> LoadResult:
        t0 = time.perf_counter()
        got = manifest if manifest is not None else mf.read_committed(self.storage, step)
        if isinstance(got, mf.Manifest):
            m, whole = got, True
        else:  # a step index: only the rank reports this rank needs (not the whole step: kept out of the cache)
            if init_optimizers(state, got.skeleton()):  # their shards' boxes first (load_into would do it next)
                changed[0] = True
            m, whole = step_for_load(self.storage, got, state, self.comm.rank, self.comm.world, rank_map), False
        read_counters(self.storage, reset=True)
        try:
            stats = load_into(self.storage, m, state, strict=strict, allow_pickle=allow_pickle, io=self.io,
                              rank=self.comm.rank, world=self.comm.world, rank_map=rank_map,
                              on_change=lambda: changed.__setitem__(0, True), before_read=before_read,
                              staged=self.staged, lend=self.lend, ready=ready, budget=self.budget, began=t0)
        finally:
            trim_scratch()  # reads and chains kept chunk-sized buffers per thread: loads are rare
        if whole:
            self.manifests.put(m)
        tiers = read_counters(self.storage)
        if tiers is not None:  # which tier each chunk came from; damaged local copies are named
            stats.local_chunks, stats.remote_chunks = tiers.local_hits, tiers.remote_reads
            stats.local_rejected = list(tiers.local_rejected)
        log.info("resumed from step %d of %s (%.1f MiB read and verified in %.2f s after %.2f s of planning, "
                 "%d chunk(s)%s; saved on %d rank(s), loaded as %s)", step, self.storage.describe(),
                 stats.bytes_read / MiB, stats.read_s, stats.plan_s, stats.chunks_read,
                 f", {stats.passes} passes through {stats.windows} windows of host_memory" if stats.passes > 1 else "",
                 m.world_size, self.comm.describe())
        events.emit("resume", self.comm.rank, step=step)
        return LoadResult(m, stats)


def _outcome(err: CheckpointError | None) -> dict:
    """What a rank tells the others about its load attempt."""
    return {"ok": err is None, "corrupt": isinstance(err, CorruptCheckpointError),
            "mismatch": isinstance(err, StateMismatchError), "message": str(err)[:2000] if err is not None else ""}


def _coordinators(views: list[Any]) -> Any:
    """The coordinator's listing, for every rank (the others' posts carry only their host)."""
    return {k: v for k, v in views[0].items() if k != "host"}


def _rebuilt(name: str, message: str) -> CheckpointError:
    """The coordinator's listing error as this rank raises it: the same class where it is ckpt's."""
    cls = getattr(errors, name, None)
    if not (isinstance(cls, type) and issubclass(cls, CheckpointError)):
        cls = CheckpointError
    return cls(message)


def _failures(views: list[dict]) -> list[tuple[int, dict]]:
    """The outcomes of the ranks that failed, all the others need to know (not N outcomes for each)."""
    return [(r, v) for r, v in enumerate(views) if not v["ok"]]


def _ready(views: list[dict]) -> dict:
    """The answer of the round before a load changes the state: the ranks that failed, and what the
    ranks took of the step together (:func:`ckpt.load.held.union`), one answer for every rank."""
    return {"failures": _failures(views), "held": held.union(views)}


def _failed_on(step: int, bad: list[int], views: dict[int, dict]) -> CheckpointError:
    cls: type[CheckpointError] = CheckpointError
    if all(views[r]["corrupt"] for r in bad):
        cls = CorruptCheckpointError
    elif all(views[r].get("mismatch") for r in bad):  # the state does not fit on some rank: the same on every rank
        cls = StateMismatchError
    return cls(f"rank(s) {bad} could not load step {step}: {views[bad[0]]['message']}")


def _naming(e: CheckpointError, step: int) -> CheckpointError:
    """``e``, its message starting with the step it is about."""
    if str(e).startswith(f"step {step}"):
        return e
    e.args = (f"step {step}: {e}", *e.args[1:])
    return e


def advise(e: CheckpointError, advice: str) -> CheckpointError:
    """``e`` with what to do next, said once, at the end (only for damage: other errors say their own)."""
    if isinstance(e, CorruptCheckpointError) and advice not in str(e):
        e.args = (f"{e}. {advice}", *e.args[1:])
    return e


def short_list(steps: list[int]) -> str:
    return ", ".join(map(str, steps)) if len(steps) <= 10 else f"{steps[0]} … {steps[-1]} ({len(steps)} steps)"
