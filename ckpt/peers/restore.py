"""Loading from the local tiers and their peers: the newest step recoverable from them (or the one
asked for), else the checkpoint path's. The loader's own attempt (checks, verified reads into place)
does the loading; this module chooses the step and, just before the reads, gets every rank the
chunks its tier lacks from peers or parity (:mod:`ckpt.peers.recovery`), held in memory. The tier
is healed afterwards: the result's ``heal``, run by the Checkpointer on its commit thread."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Literal

from .. import events
from ..errors import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError
from ..format import manifest as mf
from ..format import paths
from ..format.chunk import verify_object
from ..load.step_choice import Attempt, LoadResult, advise, short_list
from . import recovery
from .exchange import PeerStats
from .recovery import Survey

if TYPE_CHECKING:
    from ..storage.base import Blob
    from ..storage.held import HeldChunks
    from .local_commits import LocalCommits

log = logging.getLogger("ckpt")


def load(tiers: LocalCommits, attempt: Attempt, step: int | Literal["latest"], fallback: bool) -> LoadResult | None:
    """The newest step recoverable from the local tiers and their peers (or ``step``), else the
    newest (or that) step of the checkpoint path."""
    peers = tiers.peers
    remote = tiers.storage.remote
    # which steps each rank's tier holds, and (rank 0 lists it alone) the checkpoint path: a coordination round
    # (gloo moves bytes only)
    held = tiers.comm.agree({"local": mf.committed_steps(tiers.local),
                             "remote": mf.committed_steps(remote) if tiers.comm.rank == 0 else None}, _where_held)
    holder: dict[int, int] = {s: r for s, r in held["holder"]}
    remote_steps = set(held["remote"])  # as rank 0 listed them
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
            raise advise(err, "load('latest', state, fallback=True) loads the newest step that verifies."
                          if step == "latest" else "Load another step (ckptr.steps() lists them).")
        log.warning("%s; falling back to an older step", err)
        first_error = first_error or err

    for s in candidates:
        data = peers.broadcast(bytes(tiers.local.read(paths.manifest_key(s))) if peers.rank == holder[s] else None,
                               holder[s])
        m = mf.parse(data, name=f"{paths.manifest_key(s)} of rank {holder[s]}'s local tier")
        survey = recovery.survey(peers, s, m, persisted=s in remote_steps)
        ok, why = recovery.recoverable(peers, survey, m)
        if ok:
            lost = len(survey.lost(m.chunks))
            log.info("loading step %d from the local tiers (%s%s)", s,
                     "the newest step" if s == max(holder) else "the newest recoverable step",
                     "" if not lost else f"; {lost} chunk(s) lost with their tier are read from {remote.describe()}"
                     if why else f"; {lost} chunk(s) lost with their tier come from peers or parity")
            done, err = _load_local(tiers, attempt, s, m, data, survey)
            if done is not None:
                return done
            assert err is not None
            failed(err)
            continue
        if step != "latest":
            raise CorruptCheckpointError(f"step {s} cannot be recovered from the local tiers: {why}")
        log.warning("step %d is committed in the local tiers but cannot be recovered from them: %s", s, why)
    targets = sorted(remote_steps, reverse=True) if step == "latest" else [step] if step in remote_steps else []
    if not targets:
        if first_error is not None:
            raise CorruptCheckpointError(f"no committed step loads cleanly from the local tiers, and "
                                         f"{remote.describe()} has none; the newest failed: {first_error}",
                                         object=first_error.object, chunk=first_error.chunk) from first_error
        if remote.root_state() == "missing":  # a typo in the path must not pass for a new run
            log.warning("starting fresh: nothing in the local tiers or at %s (if this run should resume, "
                        "check the path)", remote.describe())
        else:
            log.info("no checkpoint in the local tiers or at %s: starting fresh", remote.describe())
        events.emit("fresh", peers.rank)
        return None
    if step == "latest":
        log.info("loading step %d from %s (%s)", targets[0], remote.describe(),
                 "no step of the local tiers is newer and loads" if holder else "the local tiers are empty")
    for s in targets:
        done, err = attempt(s)
        if done is not None:
            return done
        assert err is not None
        failed(err)
    assert first_error is not None
    raise CorruptCheckpointError(f"no committed step of the local tiers or {remote.describe()} loads cleanly; "
                                 f"the newest failed: {first_error}",
                                 object=first_error.object, chunk=first_error.chunk) from first_error


def _where_held(views: list[dict]) -> dict:
    """The coordinator's summary of every rank's steps: the lowest rank holding each step in its tier,
    and the steps of the checkpoint path (the coordinator's listing: one a load, not one per rank)."""
    holder: dict[int, int] = {}
    for r, v in enumerate(views):
        for s in v["local"]:
            holder.setdefault(s, r)
    return {"holder": sorted(holder.items()), "remote": sorted(views[0]["remote"])}


def _load_local(tiers: LocalCommits, attempt: Attempt, step: int, m: mf.Manifest, data: bytes, survey: Survey
                ) -> tuple[LoadResult | None, CheckpointError | None]:
    """Load ``step`` from the local tiers. Chunks this rank's tier lacks come from peers (or are
    rebuilt) into memory, on a thread of their own while the loader reads: a read of such a chunk
    waits for it, every other read goes ahead, so the load takes about as long as the longer of the
    two instead of their sum. The tier itself is healed afterwards, in the background (the result's
    ``heal``, run by the Checkpointer on its commit thread)."""
    peers, storage = tiers.peers, tiers.storage
    memory = storage.memory
    fetch = _Fetch()
    held: list[str] = []
    wanted: set[str] = set()
    lacking: list[str] = []  # storage keys of the chunks this rank's tier lacks

    def keep(key: str, blob: memoryview) -> None:
        held.append(key)
        memory.hold(key, blob)

    def coming(hashes: set[str]) -> None:
        memory.not_coming(set(lacking) - {paths.chunk_key(h) for h in hashes})  # read from the checkpoint path

    def before_read(needed: set[str]) -> None:
        want = mf.closure(m.chunks, needed).keys()
        wanted.update(want)
        lacking.extend(paths.chunk_key(h) for h in want if peers.rank not in survey.holders.get(h, []))
        memory.capture(lacking)  # what is read remotely is kept for the heal
        memory.expect(lacking)
        fetch.start(lambda: recovery.fetch(peers, survey, m, want, keep, coming), memory, lacking)

    try:
        done, err = attempt(step, manifest=m, before_read=before_read)
        if fetch.thread is None:  # this rank failed before it could say what it needs: the others wait for that
            try:
                recovery.fetch(peers, survey, m, None, keep)
            except CheckpointError:
                pass
        got, fetch_err = fetch.result()
    except BaseException:
        fetch.abandoned = True  # a fetch still running drops what it brings when it ends
        memory.release(held + lacking)
        raise
    if done is None:
        memory.release(held + lacking)
        return None, fetch_err if isinstance(fetch_err, CheckpointError) else err
    if fetch_err is not None:  # every chunk this rank needed came and checked out, then the exchange broke
        log.warning("the exchange with peers failed after this rank had every chunk it needed: %s", fetch_err)
    done.heal = lambda: _heal(tiers, step, data, held, wanted, lacking)
    stats = done.stats
    stats.source = "local tiers"
    if got is not None:
        stats.peer_chunks, stats.rebuilt_chunks = got.peer_chunks, got.rebuilt_chunks
        if stats.local_chunks is not None:
            stats.local_chunks = max(0, stats.local_chunks - got.peer_chunks - got.rebuilt_chunks)
    return done, None


class _Fetch:
    """:func:`recovery.fetch` on a thread of its own (it talks only on the peers' group, which nothing
    else uses during a load); whatever it did not bring when it ends is marked not coming in ``memory``, so no
    read waits for it any longer."""

    def __init__(self) -> None:
        self.thread: threading.Thread | None = None
        self.stats: PeerStats | None = None
        self.error: BaseException | None = None
        self.abandoned = False  # the load is gone (interrupted): nobody will release what the fetch holds

    def start(self, run: Callable[[], PeerStats], memory: HeldChunks, keys: list[str]) -> None:
        """Run ``run`` on the thread; ``keys``: those it may bring."""
        def body() -> None:
            try:
                self.stats = run()
                memory.not_coming(keys)
            except BaseException as e:
                self.error = e
                memory.not_coming(keys, e if isinstance(e, CheckpointError) else
                              CheckpointError(f"{type(e).__name__}: {e}"))
            if self.abandoned:
                memory.release(keys)

        self.thread = threading.Thread(target=body, name="ckpt-peer-fetch", daemon=True)
        self.thread.start()

    def result(self) -> tuple[PeerStats | None, BaseException | None]:
        if self.thread is not None:
            self.thread.join()
        return self.stats, self.error


def _heal(tiers: LocalCommits, step: int, data: bytes, held: list[str], wanted: set[str], lacking: list[str]
          ) -> bool:
    """After a load from the local tiers: write what came from peers (held in memory) and what
    came from the checkpoint path (the bytes the load read, kept, checked again here; read anew only
    where the load did not read a chunk whole) into this rank's tier, then commit the step there if
    the tier had lost it. A failure costs only the copy: it is logged, nothing else changes."""
    local, storage = tiers.local, tiers.storage
    memory = storage.memory
    t0 = time.perf_counter()
    wrote = from_remote = fetched = 0
    try:
        for key in held:
            blob = memory.get(key)
            if blob is not None and not local.exists(key):
                local.write(key, [blob])
                wrote += 1
        for h in sorted(wanted):
            key = paths.chunk_key(h)
            if memory.get(key) is None and not local.exists(key):  # read from the checkpoint path
                obj = _checked(key, memory.captured(key))
                if obj is None:
                    obj = storage.remote.read(key)
                    verify_object(key, [memoryview(obj)])
                    fetched += 1
                local.write(key, [obj])
                from_remote += 1
        local.flush()
        if not local.exists(paths.manifest_key(step)):  # a tier that lost the step has it back
            tiers.commit(step, data.decode())
        if wrote or from_remote:
            log.info("healed this rank's local tier %s with %d chunk(s) from peers and %d from %s (%d of them "
                     "downloaded again) (%.2fs)", local.root, wrote, from_remote, storage.remote.describe(), fetched,
                     time.perf_counter() - t0)
        return True
    except Exception as e:
        log.warning("this rank's local tier %s was not healed after loading step %d (%s: %s); the next "
                    "saves write their chunks anew", local.root, step, type(e).__name__, e)
        return False
    finally:
        memory.release(held + lacking)


def _checked(key: str, blob: bytes | None) -> Blob | None:
    """``blob`` if it is chunk ``key`` whole and sound, else None."""
    if blob is None:
        return None
    try:
        verify_object(key, [memoryview(blob)])
    except CheckpointError:
        return None
    return blob
