"""Running one task per item on a pool, so that nothing is still running when the caller moves on.

``Executor.map`` raises at the first failed result and leaves the other tasks running, or queued to
start later. For loads that meant reads still writing into the caller's tensors after ``load`` had
returned (or while it fell back to an older step); for saves, every queued chunk write retrying
against a dead server for its own deadline. :func:`run_all` stops handing out items at the first
failure (or at a ``KeyboardInterrupt`` in the waiting thread), waits for the items in progress, and
only then raises.

It counts items in progress itself instead of waiting on futures: an interrupt can land inside
``Executor.submit`` after the task was queued but before its future was returned, and a task nobody
holds a future for must still not start work once the caller has given up.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Executor
from typing import Generic, TypeVar

T = TypeVar("T")
R = TypeVar("R")


class _Run(Generic[T, R]):
    def __init__(self, fn: Callable[[T], R], items: list[T]):
        self.fn = fn
        self.items = items
        self.results: list[R | None] = [None] * len(items)
        self.cond = threading.Condition()
        self.next = 0  # the next item to hand out
        self.active = 0  # items being worked on
        self.finished = 0
        self.stop = False
        self.error: BaseException | None = None

    def task(self) -> None:
        """One pool task: take the next item unless the run was stopped, and do it; again, until
        none is left (with fewer tasks than items, each does several in turn)."""
        while True:
            with self.cond:
                if self.stop or self.next >= len(self.items):
                    return
                i, self.next, self.active = self.next, self.next + 1, self.active + 1
            try:
                self.results[i] = self.fn(self.items[i])
            except BaseException as e:
                with self.cond:
                    self.error = self.error or e
                    self.stop = True
            finally:
                with self.cond:
                    self.active -= 1
                    self.finished += 1
                    self.cond.notify_all()

    def ended(self) -> bool:
        return self.active == 0 and (self.stop or self.finished == len(self.items))


def run_all(pool: Executor, fn: Callable[[T], R], items: Iterable[T], width: int | None = None) -> list[R]:
    """``[fn(x) for x in items]`` on ``pool``, at most ``width`` at a time (default: as many as
    the pool runs); the first failure is raised once no item is in progress any more (and none
    will start)."""
    run: _Run[T, R] = _Run(fn, list(items))
    if not run.items:
        return []
    interrupted: BaseException | None = None
    try:
        for _ in range(min(len(run.items), width or len(run.items))):
            pool.submit(run.task)
        with run.cond:
            while not run.ended():
                run.cond.wait()
    except BaseException as e:  # KeyboardInterrupt while submitting or waiting: stop, wait, re-raise
        interrupted = e
    if interrupted is not None:
        with run.cond:
            run.stop = True
        while True:  # items in progress cannot be stopped, and must not outlive the caller's frame
            try:
                with run.cond:
                    while run.active:
                        run.cond.wait()
                break
            except BaseException:
                continue
        raise interrupted
    if run.error is not None:
        raise run.error
    return run.results  # type: ignore[return-value]  # every item finished: no None is left


def threads_of(pool: Executor) -> int | None:
    """How many threads ``pool`` runs (a ``ThreadPoolExecutor``'s ``max_workers``); None where it does
    not say. Work done beside the pool (a load's copy-back) keeps to it: ``io_threads=1`` is one thread."""
    n = getattr(pool, "_max_workers", None)
    return n if isinstance(n, int) and n > 0 else None
