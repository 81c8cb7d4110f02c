"""When to save: a fixed or adaptive interval, and an emergency save when the job is being preempted.

``Checkpointer(..., every=..., preemption=...)`` hands both to a :class:`Schedule`, and the training
loop asks ``ckptr.should_save(step)`` once per step. Every rank must answer the same, or the ranks
would save different steps; so a decision that depends on something only one rank knows (a signal
that reached it, rank 0's clock) is published through the group's store as a *target step* a
little ahead, and every rank saves when its loop reaches that step:

* a step interval (``every=100``) needs no agreement: ``step % 100 == 0`` is the same everywhere;
* a time interval (``every="30min"``) and the adaptive one (``every="auto"``) are decided on rank 0;
* a preemption signal (SIGTERM by default) only sets a flag in its handler; the next
  ``should_save`` on that rank publishes the target.

Targets are numbered ``save`` rounds (:class:`ckpt.ranks.Round`): the first proposal of a round
wins (compare-and-set), every rank adopts it, and saving at it closes the round. A target is the
proposer's step + 2 with several ranks (ranks that synchronise every step are at most one step
apart, so none has passed it) and the step itself alone.

``every="auto"`` is Young and Daly's first-order optimum τ = √(2·δ·M), where δ is the measured stall
of a save (what the training loop waits for) and M the mean time between failures (``mtbf``),
kept above δ / ``max_overhead`` (the stall budget, 2% of training time by default) and above the
time the last save took to commit (never more often than saves complete). Once the run journal
(:mod:`ckpt.journal`) holds enough failures of earlier starts, M is ``mtbf`` blended with the failure
rate observed (:func:`ckpt.goodput.blend_mtbf`), and the interval says so.
"""

from __future__ import annotations

import logging
import math
import os
import re
import signal
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .errors import ConfigError
from .ranks import KEEP_SEQS, Comm

log = logging.getLogger("ckpt")

DEFAULT_MTBF = 4 * 3600.0  # seconds: a job on a few hundred GPUs sees an interruption every few hours
DEFAULT_MAX_OVERHEAD = 0.02
DEFAULT_PREEMPTION_DEADLINE = 10.0  # seconds: a third of the usual 30 s grace (Kubernetes, SLURM, torchrun)
_UNITS = {"s": 1, "sec": 1, "second": 1, "seconds": 1, "m": 60, "min": 60, "mins": 60, "minute": 60,
          "minutes": 60, "h": 3600, "hr": 3600, "hour": 3600, "hours": 3600}


# -- options -------------------------------------------------------------------------------------------

def parse_every(every: Any) -> int | float | str | None:
    """``every=`` as given to a Checkpointer: None, a number of steps (int), ``"auto"``, or a duration
    such as ``"30min"``, ``"90s"``, ``"2h"``, ``"1h30min"`` or a float of seconds (returned in
    seconds, as a float)."""
    if every is None or every == "auto":
        return every
    if isinstance(every, float):
        return positive("every (seconds)", every)
    if type(every) is int:
        if every < 1:
            raise ConfigError(f"every must be a positive number of steps, got {every}")
        return every
    if isinstance(every, str):
        text = every.replace(" ", "").lower()
        parts = re.findall(r"(\d+(?:\.\d+)?)([a-z]+)", text)
        if parts and "".join(n + u for n, u in parts) == text and all(u in _UNITS for _, u in parts):
            seconds = sum(float(n) * _UNITS[u] for n, u in parts)
            if seconds > 0:
                return seconds
    raise ConfigError(f"every must be a number of steps (every=100), a duration (every='30min', '90s', '2h') "
                      f"or 'auto', got {every!r}")


def parse_signals(preemption: Any) -> tuple[int, ...]:
    """``preemption=``: False (none), True (SIGTERM), or signals (``[signal.SIGTERM, signal.SIGUSR1]``)."""
    if preemption is False or preemption is None:
        return ()
    if preemption is True:
        return (int(signal.SIGTERM),)
    items = preemption if isinstance(preemption, (list, tuple, set, frozenset)) else [preemption]
    out = []
    for s in items:
        if isinstance(s, str):
            s = getattr(signal, s.upper() if s.upper().startswith("SIG") else "SIG" + s.upper(), None)
        if not isinstance(s, int) or isinstance(s, bool) or s not in set(signal.valid_signals()) \
                or s in (getattr(signal, "SIGKILL", -1), getattr(signal, "SIGSTOP", -1)):
            raise ConfigError(f"preemption must be True, False or catchable signals (e.g. [signal.SIGTERM, "
                              f"signal.SIGUSR1]), got {preemption!r}")
        out.append(int(s))
    return tuple(sorted(set(out)))


def _signal_name(signum: int | None) -> str:
    try:
        return signal.Signals(signum).name if signum is not None else "?"
    except ValueError:
        return str(signum)


def positive(name: str, value: Any, upper: float | None = None) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 \
            or (upper is not None and value > upper) or not math.isfinite(value):
        bound = f" and at most {upper}" if upper is not None else ""
        raise ConfigError(f"{name} must be a positive number{bound}, got {value!r}")
    return float(value)


# -- the interval ----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Interval:
    """The save interval in force (``ckptr.interval``). ``steps`` for ``every=N``; ``seconds`` for
    time and ``"auto"`` intervals (None for ``"auto"`` until a save measured its stall). The other
    fields say how ``"auto"`` chose it."""

    kind: str  # "none", "steps", "time" or "auto"
    steps: int | None = None
    seconds: float | None = None
    stall_s: float | None = None  # δ: the last save's stall
    mtbf_s: float | None = None
    young_daly_s: float | None = None  # √(2·δ·M)
    budget_s: float | None = None  # δ / max_overhead
    commit_s: float | None = None  # how long the last save took to commit
    mtbf_why: str | None = None  # where mtbf_s comes from, when not the mtbf option alone (the journal)

    def describe(self) -> str:
        if self.kind == "steps":
            return "every step" if self.steps == 1 else f"every {self.steps} steps"
        if self.kind == "time":
            return f"every {self.seconds:.0f}s"
        if self.kind == "auto":
            if self.seconds is None:
                return "auto: the first save measures the stall"
            why = (f"Young/Daly √(2·{self.stall_s:.3f}s·{self.mtbf_s:.0f}s) = {self.young_daly_s:.1f}s, "
                   f"stall budget needs ≥ {self.budget_s:.1f}s, last save committed in {self.commit_s or 0:.1f}s"
                   + (f"; {self.mtbf_why}" if self.mtbf_why else ""))
            return f"auto: every {self.seconds:.1f}s ({why})"
        return "only when asked"


def auto_interval(stall_s: float, mtbf_s: float, max_overhead: float, commit_s: float | None,
                  mtbf_why: str | None = None) -> Interval:
    """Young/Daly's interval for a save that stalls training ``stall_s``, bounded below by the stall
    budget and by how long a save takes to commit."""
    yd = math.sqrt(2 * stall_s * mtbf_s)
    budget = stall_s / max_overhead
    return Interval("auto", seconds=max(yd, budget, commit_s or 0.0), stall_s=stall_s, mtbf_s=mtbf_s,
                    young_daly_s=yd, budget_s=budget, commit_s=commit_s, mtbf_why=mtbf_why)


# -- signals ---------------------------------------------------------------------------------------------

_listeners: weakref.WeakSet[Schedule] = weakref.WeakSet()
_previous: dict[int, Any] = {}  # the handler each signal had before ckpt's
_wake: tuple[int, int, int] | None = None  # (read fd, write fd, pid): the handler tells the watcher thread


def _on_signal(signum: int, frame: Any) -> None:
    """ckpt's handler: flags every listening Schedule and returns. No I/O, no locks (it runs between
    two bytecodes of the main thread, possibly inside ckpt's own code). With nobody listening any
    more (a handler left behind by a framework that restored it after ckpt closed), the signal gets
    what it would have got without ckpt."""
    listening = [s for s in list(_listeners) if signum in s.signals and not s.gave_up]
    now = time.monotonic()
    for s in listening:
        if s.signalled is None:
            s.signalled, s.signalled_at = signum, now
    if listening:
        wake = _wake
        if wake is not None and wake[2] == os.getpid():  # not a forked child's copy of the pipe
            try:
                os.write(wake[1], bytes([signum]))  # lock-free: the watcher thread logs and keeps the deadline
            except OSError:
                pass
        return
    prev = _previous.get(signum, signal.SIG_DFL)
    if callable(prev):
        prev(signum, frame)
    elif prev != signal.SIG_IGN:
        signal.signal(signum, signal.SIG_DFL)
        signal.raise_signal(signum)


def _watch(fd: int) -> None:
    """The watcher thread: what the handler may not do (log, start the deadline) for each signal it saw."""
    while True:
        try:
            data = os.read(fd, 64)
        except OSError:
            return
        if not data:
            return
        for signum in data:
            for s in list(_listeners):
                if signum in s.signals:
                    s.heard()


def _install(sched: Schedule) -> None:
    global _wake
    if sched.signals and threading.current_thread() is not threading.main_thread():
        raise ConfigError("preemption=... installs signal handlers, which Python allows only in the main thread; "
                          "create this Checkpointer there (or pass preemption=False)")
    if sched.signals and (_wake is None or _wake[2] != os.getpid()):
        r, w = os.pipe()
        os.set_blocking(w, False)  # a full pipe never blocks the handler
        _wake = (r, w, os.getpid())
        threading.Thread(target=_watch, args=(r,), name="ckpt-signals", daemon=True).start()
    for s in sched.signals:
        current = signal.getsignal(s)
        if current is not _on_signal:
            _previous[s] = current
            signal.signal(s, _on_signal)
    _listeners.add(sched)


def _uninstall(sched: Schedule) -> None:
    _listeners.discard(sched)
    if threading.current_thread() is not threading.main_thread():
        return  # _on_signal passes signals on to the previous handler while nobody listens
    still = {s for other in _listeners for s in other.signals}
    for s in sched.signals:
        if s not in still and signal.getsignal(s) is _on_signal:
            signal.signal(s, _previous.get(s, signal.SIG_DFL))  # kept: a left-behind handler forwards to it


# -- the schedule ----------------------------------------------------------------------------------------

class Schedule:
    """Decides, the same on every rank, which steps are saved (see the module docstring)."""

    def __init__(self, comm: Comm, every: int | float | str | None, signals: tuple[int, ...],
                 mtbf: float = DEFAULT_MTBF, max_overhead: float = DEFAULT_MAX_OVERHEAD,
                 deadline: float = DEFAULT_PREEMPTION_DEADLINE, finish: Callable[[], Any] = lambda: None):
        self.comm = comm
        self.deadline = deadline  # seconds after a signal for the loop to reach should_save()
        self._finish = finish  # waits for the saves in flight, before a signal nobody asked for is passed on
        self.gave_up = False  # the deadline passed: the signal was passed on to the handler before ckpt's
        self.closed = False
        self._timer: threading.Timer | None = None
        self.every = every
        self.signals = signals
        self.mtbf = mtbf
        self.mtbf_why: str | None = None  # set with mtbf by observe()
        self.max_overhead = max_overhead
        self.signalled: int | None = None  # set by the signal handler
        self.signalled_at: float | None = None  # time.monotonic() when it was
        self.preempting = False  # an emergency save was agreed on (further signals change nothing)
        self.emergency_step: int | None = None  # the step of the agreed emergency save, once reached
        self._round = 0
        self._target: dict | None = None
        self._last_save = time.monotonic()  # time intervals count from here (rank 0 decides)
        self._stall: float | None = None
        self._commit_s: float | None = None
        self._pending: Any = None  # the handle of the last save, until its commit time is known
        if isinstance(every, float):
            self.interval = Interval("time", seconds=every)
        elif isinstance(every, int):
            self.interval = Interval("steps", steps=every)
        else:
            self.interval = Interval("auto" if every == "auto" else "none", mtbf_s=mtbf)
        if every is not None:
            log.info("saving %s", self.interval.describe())
        _install(self)

    def close(self) -> None:
        self.closed = True
        if self._timer is not None:
            self._timer.cancel()
        _uninstall(self)

    def taken(self) -> None:
        """The caller acts on the signal itself (an emergency save of its own, as the Lightning callback
        makes): neither the deadline nor close() passes it on."""
        self.preempting = True
        if self._timer is not None:
            self._timer.cancel()

    def heard(self) -> None:
        """On the watcher thread, at once after the handler: say that the signal arrived and what ckpt
        does, and start the deadline for the loop to reach should_save()."""
        signum = self.signalled
        if signum is None or self._timer is not None or self.preempting or self.closed:
            return  # not this process's, said already, or should_save() took it (and said so)
        name = _signal_name(signum)
        log.warning("%s received: ckpt saves at the next should_save() call, and `preempted` then ends the loop; "
                    "if should_save() is not called within %gs, ckpt finishes the saves in flight and lets %s end "
                    "the process", name, self.deadline, name)
        left = self.deadline - (time.monotonic() - (self.signalled_at or time.monotonic()))
        self._timer = threading.Timer(max(0.0, left), self._unheard)
        self._timer.daemon = True
        self._timer.start()

    def _unheard(self) -> None:
        """The deadline passed and no should_save() took the signal: finish the saves in flight, then
        pass the signal on (its default ends the process, as it would have without ckpt)."""
        signum = self.signalled
        if signum is None or self.preempting or self.closed:
            return
        name = _signal_name(signum)
        log.error("%s arrived %gs ago and should_save() was not called since, so no emergency save is made "
                  "(call ckptr.should_save(step) at every step for one); finishing the saves in flight, then "
                  "passing %s on", name, self.deadline, name)
        try:
            self._finish()
        except BaseException:  # a failed save says so itself; the signal goes on regardless
            pass
        if self.preempting or self.closed:
            return
        self.gave_up = True
        os.kill(os.getpid(), signum)  # ckpt's handler, on the main thread, passes it to the previous one

    def pass_on(self) -> None:
        """After close(): a signal that arrived and that no should_save() acted on is not kept from the
        process; it goes to the handler it would have reached without ckpt (by default: the process ends)."""
        signum = self.signalled
        if signum is None or self.preempting or self.gave_up or \
                threading.current_thread() is not threading.main_thread():
            return
        self.gave_up = True
        log.warning("%s arrived and no should_save() acted on it: passing it on now that the saves are finished",
                    _signal_name(signum))
        signal.raise_signal(signum)

    @property
    def preemption_pending(self) -> bool:
        """A preemption signal reached this process (or another rank agreed an emergency save)."""
        return self.signalled is not None or self.preempting

    def should_save(self, step: int) -> bool:
        """True when ``step`` must be saved; call it on every rank at every step, in order."""
        if self._target is None:
            rnd = self.comm.round("save", self._round)
            doc = rnd.peek()
            if doc is None:
                why = self._want()
                if why is not None:
                    ahead = 0 if self.comm.world == 1 else 2
                    doc = rnd.propose({"step": step + ahead, "why": why, "rank": self.comm.rank,
                                       "signal": self.signalled})
            self._target = doc
            if doc is not None and doc["why"] == "preemption" and not self.preempting:
                self.preempting = True
                log.warning("preemption signal %s reached rank %d: saving step %d, then stopping",
                            _signal_name(doc.get("signal")), doc["rank"], doc["step"])
        hit = isinstance(self.every, int) and step % self.every == 0
        target = self._target
        if target is not None and step >= target["step"]:
            if step > target["step"]:
                log.error("this rank reached the agreed save step %d late (at %d): ranks more than two steps "
                          "apart, or should_save() not called at every step; saving now", target["step"], step)
            if target["why"] == "preemption":
                self.emergency_step = step
            self._target = None
            self._round += 1
            if self.comm.rank == 0 and self._round > KEEP_SEQS:  # long closed on every rank: its key goes
                self.comm.round("save", self._round - 1 - KEEP_SEQS).cleanup(("answer",))
            hit = True
        return hit

    def _want(self) -> str | None:
        """Why this rank would propose a save now, if at all."""
        if self.signalled is not None and not self.preempting:
            return "preemption"
        if self.comm.rank != 0 or self.every is None or isinstance(self.every, int):
            return None
        if self._pending is not None and not self._pending.done():
            return None  # never more often than saves complete
        self._learn_commit()
        seconds = self.interval.seconds if self.every != "auto" else self._auto()
        if seconds is None or time.monotonic() - self._last_save >= seconds:
            return "interval"
        return None

    def observe(self, mtbf: float, why: str) -> None:
        """Plan ``every="auto"`` for a mean time between failures of ``mtbf`` seconds from now on
        (learnt from the run journal, on its thread; ``why`` says how)."""
        if mtbf != self.mtbf:
            log.info("every='auto' plans for a failure every %.0fs: %s", mtbf, why)
        self.mtbf_why = why
        self.mtbf = mtbf

    def _auto(self) -> float | None:
        if self._stall is None:
            return None  # no save measured yet: save now, to measure one
        new = auto_interval(self._stall, self.mtbf, self.max_overhead, self._commit_s, self.mtbf_why)
        old = self.interval.seconds
        self.interval = new
        if old is None or abs(new.seconds - old) > 0.2 * old:  # type: ignore[operator]
            log.info("saving %s", new.describe())
        return new.seconds

    def _learn_commit(self) -> None:
        h, self._pending = self._pending, None
        if h is not None and h.metrics.duration_s is not None:
            self._commit_s = h.metrics.duration_s

    def emergency_committed(self, step: int) -> None:
        since, self.signalled_at = self.signalled_at, None
        if since is not None:  # said once
            log.warning("emergency save of step %d committed %.2fs after the preemption signal", step,
                        time.monotonic() - since)

    def saved(self, handle: Any) -> None:
        """A save was made (any save, asked for by the schedule or not): intervals count from it."""
        self._last_save = time.monotonic()
        if not handle.skipped:
            self._stall = handle.metrics.stall_s
            self._pending = handle
