"""The run journal wired to the saves (:mod:`ckpt.journal` writes it): the coordinator records this
start once (at its first load or save), every committed save, how far the loop got, and the end."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING

from ..journal import Journal

if TYPE_CHECKING:
    from ..handle import SaveMetrics
    from ..options import Options
    from ..ranks import Comm
    from ..schedule import Schedule
    from ..storage.base import Storage


class RunJournal:
    """The coordinator's side of the run journal: what a save or load tells it."""

    def __init__(self, journal: Journal):
        self.journal = journal
        self._started = False

    @classmethod
    def open(cls, comm: Comm, durable: Storage, options: Options, schedule: Schedule | None) -> RunJournal | None:
        """The coordinator's journal in ``durable`` (None on other ranks); with ``every="auto"``, the
        failures of earlier starts it holds tune ``schedule``'s interval (read on the journal's thread)."""
        if comm.rank != 0:
            return None
        history = None
        if options.every == "auto" and schedule is not None:
            from ..goodput import auto_mtbf

            prior, tuned = options.mtbf, schedule

            def history(records: list) -> None:
                found = auto_mtbf(prior, records)
                if found is not None:
                    tuned.observe(*found)
        return cls(Journal(durable, comm.world, history=history))

    def loaded(self, step: int | None, load_s: float, hosts: list[str] | None) -> None:
        """The first load of this start (``step`` None: nothing to resume: written at the first save)."""
        self.journal.started(step, load_s, defer=step is None, hosts=hosts)

    def saving(self, step: int) -> None:
        """A save of ``step`` begins: a start without a load is written now (once)."""
        if not self._started:
            self._started = True
            self.journal.started(None, 0.0)  # fresh: written now (as loaded, or without a load)
        self.journal.step = step

    def record(self, wall: float, metrics: SaveMetrics) -> Callable[[Future], None]:
        """The callback a save's future gets (the save was called at ``wall``, seconds since the
        epoch): the save's record once it is committed."""
        journal = self.journal

        def committed(f: Future) -> None:  # on the commit thread: only queues
            if not f.cancelled() and f.exception() is None:
                journal.saved(metrics.step, wall, metrics.stall_s)
        return committed

    def seen(self, step: int) -> None:
        """The loop reached ``step`` (the last-seen record says how far it got)."""
        self.journal.step = step

    def close(self, clean: bool) -> None:
        """After the last commit (their records are queued): the end record."""
        self.journal.close(clean=clean)
