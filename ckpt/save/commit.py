"""The commit protocol: how one save becomes a committed step on every rank, or fails on every rank.

Why it is shaped this way: a step must exist only when every rank's part of it is durable, every
rank must learn the same outcome, and no rank may wait forever on one that died. Collectives on the
training's process group cannot be used from a background thread, so ranks talk through the
group's store (:class:`~ckpt.ranks.Comm`), with deadlines. For one save, on each rank's commit thread:

1. the coordinator (rank 0) holds the job's writer lease (:mod:`ckpt.lease`: no other process
   deletes chunks meanwhile) and publishes ``go``; the other ranks wait for it, so nothing they
   reuse by hash can be deleted under them, by the coordinator's retention of the previous save
   (which ran before ``go``) or by anyone else;
2. write this rank's chunks durably, then its rank report (:meth:`Writer.write_part`);
3. report ``ok`` (with a summary of its rank report, :func:`ckpt.save.commit_index.summarize`), ``fail``,
   ``exists`` or ``nonfinite`` (or ``skip``, from ``save()`` itself) to the coordinator;
4. the coordinator gathers every report, builds the step's index from the summaries and the layout
   the plan round gave (:mod:`ckpt.save.commit_plan`; the rank reports are read only where a rank's boxes
   differ from it, once per plan: :mod:`ckpt.save.commit_index`) and commits
   ``MANIFEST.json`` create-only: that write is the commit point. It publishes a :class:`Decision`
   (ok, fail naming the ranks, skip, or exists) that every other rank waits for;
5. on the coordinator, what comes after a commit (retention) is handed to a thread of its own
   (:mod:`ckpt.save.retention_thread`): the next save's ``go`` waits only for a delete request in flight,
   and deletions pause from that ``go`` to the save's decision (``gate``), so nothing a save reuses
   is deleted under it. A save that was not committed deletes the chunks each rank alone created for it.

``go`` and ``commit`` are rounds (:meth:`ckpt.ranks.Round.run`): ``go`` the coordinator's
announcement, ``commit`` every rank's report in, :meth:`CommitProtocol._coordinate` as the
reduction, the decision out.

A save runs over the storage its job carries (``SaveEngine.storage_for(persist)``). With local commits
(``redundancy`` / ``persist_every``), the protocol is handed :class:`SaveHooks`
(:mod:`ckpt.peers.local_commits`) and knows nothing else of them: between 2 and 3 every rank calls
``protect`` (the peer exchange, also when it failed or skipped, so nobody waits for it); rank
reports travel with the commit round's reports; the decision carries the manifest, which every rank's
``committed`` hook commits to its own local directory; ``after_commit`` applies their retention.

A process saving alone runs exactly this, with a :class:`~ckpt.ranks.LocalComm`; its own error is
then the save's error, instead of a :class:`DistributedSaveError` naming rank 0.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable
from concurrent.futures import Executor, Future
from dataclasses import dataclass
from typing import Protocol

from .. import events
from ..errors import CheckpointError, DistributedSaveError, NonFiniteStateError, StepExistsError
from ..format import index, paths
from ..format import manifest as mf
from ..handle import SaveMetrics
from ..lease import Leases
from ..ranks import KEEP_SEQS, Comm, Gathered
from .commit_index import IndexBuilder, commit_summarized, summarize
from .committer import commit_step
from .job import SaveJob
from .planning import fail_plan
from .retention_thread import DeletionWindow
from .writer import Writer

log = logging.getLogger("ckpt")


class Status(str, enum.Enum):
    OK = "ok"  # committed
    FAIL = "fail"  # some rank failed or did not answer; nothing was committed
    SKIP = "skip"  # some rank skipped the save (busy="skip"); nothing was committed
    EXISTS = "exists"  # the step was already committed; it is left as it is
    NONFINITE = "nonfinite"  # some rank's state held NaN or Inf where it was checked; nothing was committed


@dataclass(frozen=True)
class Decision:
    """The coordinator's verdict on one save, the same on every rank."""

    status: Status
    ranks: tuple[int, ...] = ()  # the ranks that failed, skipped or did not answer
    message: str = ""
    manifest: str = ""  # with local commits: the committed manifest, for every rank's local directory

    def to_json(self) -> dict:
        return {"status": self.status.value, "ranks": list(self.ranks), "message": self.message,
                "manifest": self.manifest}

    @classmethod
    def from_json(cls, doc: dict) -> Decision:
        return cls(Status(doc["status"]), tuple(doc.get("ranks", ())), doc.get("message", ""), doc.get("manifest", ""))


class SaveHooks(Protocol):
    """What local commits (:class:`ckpt.peers.local_commits.LocalCommits`) add to each save, on the
    commit thread; the protocol knows nothing else of local directories or peers. With hooks, rank reports travel
    through the store and the decision carries the manifest (no storage is shared by every rank)."""

    def begin(self, job: SaveJob) -> None:
        """Before the save writes anything (its error is the save's)."""

    def protect(self, job: SaveJob, part: mf.Manifest | None) -> BaseException | None:
        """After this rank's chunks are durable (``part``: its report; None when it failed): every
        rank, before it reports. Returns its error instead of raising."""

    def absent(self) -> None:
        """This rank takes no part in a save (skipped, or failed before it began)."""

    def committed(self, job: SaveJob, manifest: str) -> None:
        """The step is committed; on every rank but the coordinator (whose storage has it)."""

    def after_commit(self, job: SaveJob) -> None:
        """After a commit, on every rank (retention of the local directories)."""


@dataclass(frozen=True)
class Report:
    """One rank's word on one save: ``ok`` (its chunks and rank report are durable), ``fail`` or ``skip``."""

    status: Status
    step: int
    message: str = ""
    persist: bool = True  # with local commits: this rank's save goes to the checkpoint path too

    def to_json(self) -> dict:
        return {"status": self.status.value, "step": self.step, "message": self.message, "persist": self.persist}

    @classmethod
    def from_json(cls, doc: dict) -> Report:
        return cls(Status(doc["status"]), doc["step"], doc.get("message", ""), bool(doc.get("persist", True)))


class CommitProtocol:
    """Runs the background half of each save on ``commit_thread`` (one thread: saves commit in order).

    ``after_commit(manifest, persisted)`` runs on the coordinator after a step is committed and its handle has
    resolved, before other ranks may start the next save's writes (retention goes there, or hands its
    work to a thread that deletes through ``gate``: the coordinator shuts it from before each save's
    ``go`` to its decision)."""

    def __init__(self, comm: Comm, writer: Writer, io: Executor, commit_thread: Executor,
                 after_commit: Callable[[mf.Manifest, bool], None], leases: Leases,
                 hooks: SaveHooks | None = None, gate: DeletionWindow | None = None):
        self.hooks = hooks
        self.gate = gate if comm.rank == 0 else None
        self.comm = comm
        self.writer = writer
        self.io = io
        self.commit_thread = commit_thread
        self.after_commit = after_commit
        self.leases = leases
        self._index: IndexBuilder | None = None  # rank 0: the step's layout, learned once per plan
        self.log_failures = True  # a failed save is logged as an error (False: its error reaches the caller)

    # -- entry points, from save() --------------------------------------------------------------------
    def submit(self, job: SaveJob, future: Future) -> None:
        """Queue ``job``; ``future`` resolves with its metrics once committed, or with its error."""
        self.commit_thread.submit(self._run, job, future)

    def skip(self, seq: int, step: int) -> None:
        """This rank skipped save ``seq`` (busy="skip"): tell the coordinator, so every rank skips it."""
        self.comm.round("commit", seq).post(Report(Status.SKIP, step).to_json())
        if self.comm.rank == 0:
            self.commit_thread.submit(self._decide_alone, seq, Decision(Status.SKIP, (0,)))
        else:
            self.commit_thread.submit(self._absent)

    def abandon(self, seq: int, step: int, error: BaseException) -> None:
        """``save()`` failed on this rank before its job existed: tell the others at once."""
        msg = f"{type(error).__name__}: {error}"
        fail_plan(self.comm, seq, error)
        try:
            self.comm.round("commit", seq).post(Report(Status.FAIL, step, msg).to_json())
            if self.comm.rank == 0:
                self.commit_thread.submit(self._decide_alone, seq, Decision(Status.FAIL, (0,), f"rank 0: {msg}"))
            else:
                self.commit_thread.submit(self._absent)
        except DistributedSaveError:
            pass

    def drain(self) -> None:
        """Wait until everything queued so far (saves and what follows their commits) has run."""
        self.commit_thread.submit(lambda: None).result()

    # -- on the commit thread -------------------------------------------------------------------------
    def _run(self, job: SaveJob, future: Future) -> None:
        try:
            committed = self._gated_save(job)
        except BaseException as e:
            if self.log_failures:  # else the error is raised to the caller: said once, not twice
                log.error("saving step %d failed: %s", job.step, e)
            else:
                log.info("saving step %d failed (raised at the next save(), wait() or close()): %s", job.step, e)
            future.set_exception(e)
            return
        finally:
            self._forget(job.seq)
        future.set_result(job.metrics)
        if committed is not None:
            self.after_commit(committed, job.persist)
        if job.committed and self.hooks is not None:
            self.hooks.after_commit(job)

    def _gated_save(self, job: SaveJob) -> mf.Manifest | None:
        """:meth:`_save`, with deletions paused from before its ``go`` to its decision (coordinator)."""
        if self.gate is None:
            return self._save(job)
        self.gate.save_begins()
        committed = None
        try:
            committed = self._save(job)
            return committed
        finally:
            self.gate.save_ends(committed)

    def _go(self, seq: int) -> None:
        """Every rank, before a save writes anything: the coordinator holds the lease and says go;
        the others wait for that."""
        rnd, what = self.comm.round("go", seq), f"the start of save {seq} (after the previous one)"
        if self.comm.rank == 0:
            try:
                self.leases.hold()
            except BaseException as e:  # the others must not wait for a go that never comes
                rnd.run(e, what=what)  # tells them, and raises e
                raise
            rnd.run({"lease": self.leases.writer_id}, what=what)
            return
        doc = rnd.run(None, what=what)
        self.leases.own.add(doc["lease"])  # the job's own lease never stands in its way

    def _save(self, job: SaveJob) -> mf.Manifest | None:
        comm, seq = self.comm, job.seq
        part: mf.Manifest | None = None
        error: BaseException | None = None
        hooks = self.hooks
        try:
            if hooks is not None:
                hooks.begin(job)
            self._go(seq)
            part = self.writer.write_part(job, comm.rank)
        except BaseException as e:
            job.snapshot.release()
            error = e
        if hooks is not None:
            error = hooks.protect(job, part if error is None else None) or error
        if error is None:
            report = Report(Status.OK, job.step, persist=job.persist).to_json()
            if hooks is not None and part is not None:  # its rank report travels with it
                report["part"] = job.report.decode()
            elif part is not None and comm.world > 1:  # what rank 0 builds the step's index from
                report["summary"] = summarize(part, job.report, job.snapshot.per_rank)
        else:
            status = (Status.EXISTS if isinstance(error, StepExistsError) else
                      Status.NONFINITE if isinstance(error, NonFiniteStateError) else Status.FAIL)
            report = Report(status, job.step, f"{type(error).__name__}: {error}").to_json()
        # The commit round: every rank's report in, the coordinator's decision out.
        rnd, what = comm.round("commit", seq), f"the commit of save {seq}"
        done: list[tuple[mf.Manifest | None, BaseException | None]] = []

        def decide(got: Gathered) -> dict:
            decision, committed, commit_error = self._coordinate(job, part, got)
            done.append((committed, commit_error))
            return decision.to_json()

        def failed(d: dict) -> bool:
            return d.get("status") in ("fail", "nonfinite")

        committed = None
        if comm.rank == 0:
            decision = Decision.from_json(rnd.run(report, decide, what=what, stop_early=failed))
            committed, commit_error = done[0]
            error = error or commit_error
        else:
            try:
                decision = Decision.from_json(rnd.run(report, decide, what=what, stop_early=failed))
            except DistributedSaveError as e:  # no decision came: nothing of this save may be kept
                decision = Decision(Status.FAIL, tuple(e.ranks or (0,)), str(e))
        self.writer.after_decision(part if decision.status is Status.OK else None, job)
        if decision.status is not Status.OK:
            self.writer.discard(job)  # this save's own new chunks: nothing committed refers to them
        if decision.status is Status.OK:
            if hooks is not None and comm.rank != 0:
                hooks.committed(job, decision.manifest)
            job.committed = True
            job.metrics.duration_s = time.perf_counter() - job.started
            if committed is not None:
                _log_commit(committed, job.metrics)
                events.emit("commit", comm.rank, step=job.step)
            return committed
        if decision.status is Status.SKIP:
            job.metrics.skipped = True
            log.info("step %d was not saved: rank(s) %s skipped it (busy='skip')", job.step, list(decision.ranks))
            return None
        if comm.world == 1 and error is not None:
            raise error  # alone, this process's own error is the save's error
        message = f"step {job.step} was not committed: {decision.message or 'unknown failure'}"
        if decision.status is Status.EXISTS:
            raise StepExistsError(decision.message or message) from error
        if decision.status is Status.NONFINITE:
            mine = error.tensors if isinstance(error, NonFiniteStateError) else []
            raise NonFiniteStateError(decision.message, ranks=list(decision.ranks), tensors=mine) from error
        raise DistributedSaveError(message, ranks=list(decision.ranks)) from error

    def _coordinate(self, job: SaveJob, part: mf.Manifest | None, got: Gathered
                    ) -> tuple[Decision, mf.Manifest | None, BaseException | None]:
        """Rank 0: from every rank's report, commit the step if all succeeded (the round then tells everyone)."""
        comm = self.comm
        committed: mf.Manifest | None = None
        error: BaseException | None = None
        try:
            docs, missing = got.docs, got.missing
            reports = {r: Report.from_json(d) for r, d in docs.items()}
            failed = sorted(r for r, v in reports.items() if v.status in (Status.FAIL, Status.NONFINITE))
            skipped = sorted(r for r, v in reports.items() if v.status is Status.SKIP)
            exists = sorted(r for r, v in reports.items() if v.status is Status.EXISTS)
            poisoned = sorted(r for r, v in reports.items() if v.status is Status.NONFINITE)
            steps = {v.step for v in reports.values()}
            if exists:
                decision = Decision(Status.EXISTS, tuple(exists), reports[exists[0]].message.partition(": ")[2])
            elif poisoned and poisoned == failed and not missing:
                first = reports[poisoned[0]].message.partition(": ")[2]
                also = f" (Ranks {poisoned} all hold such values.)" if len(poisoned) > 1 else ""
                decision = Decision(Status.NONFINITE, tuple(poisoned), first + also)
            elif failed or missing:
                why = [f"rank {r}: {reports[r].message or 'failed'}" for r in failed]
                why += [f"rank {r} did not report within {comm.timeout:.0f}s of the last report (died or hung?)"
                        for r in missing]
                decision = Decision(Status.FAIL, tuple(failed + missing), "; ".join(why))
            elif skipped:
                decision = Decision(Status.SKIP, tuple(skipped))
            elif len(steps) > 1:
                decision = Decision(Status.FAIL, (), "ranks saved different step numbers in the same save() call: "
                                                     f"{sorted(steps)}")
            elif len({v.persist for v in reports.values()}) > 1:
                up = sorted(r for r, v in reports.items() if v.persist)
                decision = Decision(Status.FAIL, (), f"ranks {up} uploaded this save and the others did not: pass the "
                                                     "same persist= to save() on every rank (or leave it None, and "
                                                     "persist_every decides for all)")
            else:
                assert part is not None  # this rank reported ok
                summaries = [docs[r].get("summary") for r in range(comm.world)] if comm.world > 1 else []
                if self.hooks is None and summaries and all(summaries):  # the index from summaries alone
                    committed = self._commit_summarized(job, part, summaries)
                if committed is None:
                    committed = self._commit_merged(job, part, docs)
                decision = Decision(Status.OK, manifest=committed.to_json().decode() if self.hooks is not None else "")
        except StepExistsError as e:
            decision, error = Decision(Status.EXISTS, (), str(e)), e
        except BaseException as e:
            ranks = tuple(e.ranks) if isinstance(e, DistributedSaveError) and e.ranks else (0,)
            decision, error = Decision(Status.FAIL, ranks, f"rank 0 could not commit: {type(e).__name__}: {e}"), e
        return decision, committed, error

    def _commit_merged(self, job: SaveJob, part: mf.Manifest, docs: dict[int, dict]) -> mf.Manifest:
        """Rank 0: commit the step merged from every rank's report, read from storage (or, with local
        commits, sent with the commit reports)."""
        refs: list[index.ReportRef] | None = None
        world = self.comm.world
        if self.hooks is None:  # the reports as stored: the step's index names them (format v6)
            read = list(self.io.map(lambda r: _read_part(self.writer, job.step, r), range(1, world)))
            parts = [part] + [p for p, _ in read]
            if world > 1:  # its own report: the bytes it wrote
                refs = [index.report_ref(job.step, 0, job.report)] + [ref for _, ref in read]
        else:  # local commits: every tier gets the whole manifest (the reports are not on every tier)
            parts = [part] + [_sent_part(docs[r], job.step, r) for r in range(1, world)]
        return commit_step(self.writer.over(job), job.step, parts, job.snapshot.per_rank, reports=refs)

    def _commit_summarized(self, job: SaveJob, part: mf.Manifest, summaries: list[dict]) -> mf.Manifest | None:
        """Rank 0: commit the step's index built from every rank's summary (:mod:`ckpt.save.commit_index`),
        reading no report unless the layout changed; None where two ranks listed a chunk differently
        (then every report is read and merged, as :func:`~ckpt.save.committer.commit_step` does)."""
        if self._index is None:
            self._index = IndexBuilder()
        built = commit_summarized(self.writer.over(job), self._index, job.step, part, summaries,
                                  job.snapshot.per_rank, self.io, job.snapshot.plan)
        if built is None:
            return None
        ix, chunks = built
        return mf.Outline(step=job.step, kind="step", structure=ix.structure, tensors=[], chunks=chunks,
                          world_size=ix.world_size, created=ix.created, writer=ix.writer, stats=ix.stats,
                          format_version=ix.format_version)

    def _absent(self) -> None:
        if self.hooks is not None:
            self.hooks.absent()

    def _decide_alone(self, seq: int, decision: Decision) -> None:
        """Coordinator, for a save it took no part in: let the others run it, and publish its fate."""
        try:
            try:
                self._go(seq)
            finally:
                self._absent()
            self.comm.round("commit", seq).run(decision.to_json(), what=f"the commit of save {seq}")
        except Exception as e:
            log.error("%s", e)
        self._forget(seq)

    def _forget(self, seq: int) -> None:
        """Coordinator: remove the rounds of save ``seq - KEEP_SEQS`` (slow ranks may still read the last few)."""
        old = seq - KEEP_SEQS
        if self.comm.rank == 0 and old >= 0:
            try:
                self.comm.round("commit", old).cleanup(("posts", "answer"))
                self.comm.round("go", old).cleanup(("answer",))
                self.comm.round("plan", old).cleanup(("posts", "answers"))
                self.comm.round("plan-parts", old).cleanup(("posts", "answers"))  # where the plan asked for parts
            except DistributedSaveError as e:
                log.error("%s", e)


def _sent_part(report: dict, step: int, rank: int) -> mf.Manifest:
    """Rank ``rank``'s rank report, sent with its commit report (its local directory is not readable here)."""
    key = paths.rank_key(step, rank)
    if "part" not in report:
        raise DistributedSaveError(f"rank {rank}'s report for step {step} did not arrive", ranks=[rank])
    try:
        return mf.parse_rank_part(str(report["part"]).encode(), step, rank)
    except CheckpointError as e:
        raise DistributedSaveError(f"rank {rank}'s report {key} is unreadable: {e}", ranks=[rank]) from e


def _read_part(writer: Writer, step: int, rank: int) -> tuple[mf.Manifest, index.ReportRef]:
    """Rank ``rank``'s report as stored, and how the step's index names those bytes."""
    try:
        data = mf.read_rank_bytes(writer.storage, step, rank)
        return mf.parse_rank_part(data, step, rank), index.report_ref(step, rank, data)
    except (CheckpointError, FileNotFoundError, OSError) as e:
        key = paths.rank_key(step, rank)
        raise DistributedSaveError(f"rank {rank}'s report {key} is unreadable: {e}", ranks=[rank]) from e


def _log_commit(m: mf.Manifest, metrics: SaveMetrics) -> None:
    log.info("step %d committed in %.2fs: %.1f MiB state, %.1f MiB written (%d new chunks, %d reused) "
             "by %d rank(s); save() blocked %.3fs", m.step, metrics.duration_s or 0.0,
             m.stats.get("raw_bytes", 0) / 2**20, m.stats.get("written_bytes", 0) / 2**20,
             m.stats.get("chunks_written", 0), m.stats.get("chunks_reused", 0), m.world_size, metrics.stall_s)
