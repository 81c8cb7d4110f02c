"""Goodput, badput and failures of a run, from its journal (:mod:`ckpt.journal`): pure functions.

The run's wall time, from its first start to the last moment any start was seen, is cut into parts
that add up to it exactly (docs/api.md defines them):

* **goodput**: training whose progress was kept: from each start's load done to the save the next
  start resumed from (to its end, for a start that ended with ``close()`` and for the newest start),
  less the checkpoint stalls in it;
* **checkpoint stall**: the time ``save()`` blocked the loop, in the kept part;
* **lost work**: from the save the next start resumed from to the failed start's last-seen time
  (all of a failed start's training when the next start resumed from an older start's save);
* **restart and load**: the time between a start's last-seen time and the next start, and each start's
  time from its Checkpointer's creation to its load done (``load`` of it is the load itself).

A *failure* is a start followed by another that did not end with ``close()`` (it was killed, crashed or
lost its node). The time a start was seen up is the exposure; the observed mean time between failures
is exposure ÷ failures. A start's end is its last-seen time, written every ``SEEN_S`` seconds: it died
within that much after, so lost work is a lower bound by as much and the downtime an upper bound.

``every="auto"`` plans with :func:`blend_mtbf`: a Gamma prior on the failure rate of shape ``a0``
and mean ``1 / mtbf`` updated with the failures and exposure observed (Gamma-Poisson), whose mean
time between failures is ``(a0·mtbf + exposure) / (a0 + failures)``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .journal import StartRecord

PRIOR_SHAPE = 2.0  # a0: the prior counts as two failures' worth of evidence
MIN_FAILURES = 2  # every="auto" uses the journal from this many failures on


@dataclass
class StartSummary:
    """One start, on the run's timeline (seconds since the epoch)."""

    index: int  # 1, 2, …
    id: str
    begin: float
    ready: float  # load done
    kept_until: float  # its progress up to here was kept
    end: float  # last seen (clipped at the next start)
    world_size: int
    host: str
    resumed_from: int | None
    load_s: float
    saves: list[tuple[int, float]]  # (step, time) of its committed saves
    stall_s: float  # checkpoint stall in its kept part
    ended: str  # "closed" (by close()), "failed", or "last" (the newest start, not closed: running, or died unseen)
    step: int | None  # the newest step its loop reported, as last seen

    def to_json(self) -> dict:
        return {"start": self.index, "id": self.id, "begin": self.begin, "ready": self.ready,
                "kept_until": self.kept_until, "end": self.end, "world_size": self.world_size, "host": self.host,
                "resumed_from": self.resumed_from, "load_s": round(self.load_s, 3),
                "restart_s": round(self.ready - self.begin, 3), "up_s": round(self.end - self.begin, 3),
                "saves": len(self.saves), "save_steps": [s for s, _ in self.saves],
                "stall_s": round(self.stall_s, 3), "ended": self.ended, "step": self.step}


@dataclass
class Failure:
    start: int  # the index of the start that failed
    at: float  # its last-seen time
    resumed_from: int | None  # the step the next start resumed from (None: it started fresh)
    lost_s: float  # training lost: from that step's save to ``at``
    lost_steps: int | None  # steps to redo: the newest step it reported, less resumed_from
    down_s: float  # from ``at`` to the next start
    restart_s: float  # the next start's creation to its load done
    load_s: float  # of which its load

    def to_json(self) -> dict:
        return {"start": self.start, "at": self.at, "resumed_from": self.resumed_from, "lost_s": round(self.lost_s, 3),
                "lost_steps": self.lost_steps, "down_s": round(self.down_s, 3),
                "restart_s": round(self.restart_s, 3), "load_s": round(self.load_s, 3)}


@dataclass
class Goodput:
    """What :func:`analyse` finds; ``to_json()`` is ``ckpt goodput --json`` (schema ``ckpt-goodput/1``)."""

    starts: list[StartSummary] = field(default_factory=list)
    failures: list[Failure] = field(default_factory=list)
    wall_s: float = 0.0
    good_s: float = 0.0
    stall_s: float = 0.0
    lost_s: float = 0.0
    restart_s: float = 0.0  # restart and load, the load included
    load_s: float = 0.0
    exposure_s: float = 0.0  # time the starts were up

    @property
    def mtbf_s(self) -> float | None:
        """Observed mean time between failures (None before the first)."""
        return self.exposure_s / len(self.failures) if self.failures else None

    def share(self, seconds: float) -> float:
        """``seconds`` as a percentage of the wall time."""
        return 100.0 * seconds / self.wall_s if self.wall_s > 0 else 0.0

    def to_json(self) -> dict:
        r = round
        return {"schema": "ckpt-goodput/1", "starts": len(self.starts), "failures": len(self.failures),
                "wall_s": r(self.wall_s, 3), "exposure_s": r(self.exposure_s, 3),
                "mtbf_s": None if self.mtbf_s is None else r(self.mtbf_s, 3),
                "goodput_s": r(self.good_s, 3), "goodput_pct": r(self.share(self.good_s), 2),
                "badput": {"checkpoint_stall_s": r(self.stall_s, 3), "lost_work_s": r(self.lost_s, 3),
                           "restart_load_s": r(self.restart_s, 3), "load_s": r(self.load_s, 3),
                           "checkpoint_stall_pct": r(self.share(self.stall_s), 2),
                           "lost_work_pct": r(self.share(self.lost_s), 2),
                           "restart_load_pct": r(self.share(self.restart_s), 2)},
                "runs": [s.to_json() for s in self.starts], "failure_list": [f.to_json() for f in self.failures]}


def _clip(x: float, lo: float, hi: float) -> float:
    return max(lo, min(hi, x))


def _summary(i: int, rec: StartRecord, nxt: StartRecord | None) -> StartSummary:
    """Start ``rec`` on the timeline, ``nxt`` the start after it (None for the newest)."""
    end = rec.end if nxt is None else max(rec.time, min(rec.end, nxt.time))
    ready = _clip(rec.ready, rec.time, end)
    saves = [(s.step, s.time) for s in rec.saves if s.time <= end]
    if nxt is None or rec.closed:
        kept, ended = end, "closed" if rec.closed else "last"
    else:
        at = [t for s, t in saves if s == nxt.resumed_from]
        kept, ended = (_clip(at[-1], ready, end) if at else ready), "failed"
    stall = sum(s.stall_s for s in rec.saves if s.time <= kept)  # kept <= end
    stall += max(0.0, rec.stall_seen_s - sum(s.stall_s for s in rec.saves))  # records gc pruned: older saves
    stall = _clip(stall, 0.0, kept - ready)
    return StartSummary(i + 1, rec.id, rec.time, ready, kept, end, rec.world_size, rec.host, rec.resumed_from,
                        _clip(rec.load_s, 0.0, ready - rec.time), saves, stall, ended, rec.step)


def analyse(records: list[StartRecord]) -> Goodput:
    """Starts, failures, goodput and badput of the run whose journal holds ``records``."""
    recs = sorted(records, key=lambda r: (r.time, r.id))
    g = Goodput()
    if not recs:
        return g
    starts = [_summary(i, r, recs[i + 1] if i + 1 < len(recs) else None) for i, r in enumerate(recs)]
    g.starts = starts
    g.wall_s = starts[-1].end - starts[0].begin
    for i, s in enumerate(starts):
        down = max(0.0, s.begin - starts[i - 1].end) if i else 0.0
        g.restart_s += down + (s.ready - s.begin)
        g.load_s += s.load_s
        g.stall_s += s.stall_s
        g.good_s += s.kept_until - s.ready - s.stall_s
        g.lost_s += s.end - s.kept_until
        g.exposure_s += s.end - s.begin
        if s.ended == "failed":
            n = starts[i + 1]
            lost_steps = s.step - n.resumed_from if s.step is not None and n.resumed_from is not None else s.step
            g.failures.append(Failure(s.index, s.end, n.resumed_from, s.end - s.kept_until,
                                      None if lost_steps is None else max(0, lost_steps), max(0.0, n.begin - s.end),
                                      n.ready - n.begin, n.load_s))
    return g


def blend_mtbf(prior_s: float, failures: int, exposure_s: float, a0: float = PRIOR_SHAPE) -> float:
    """The posterior mean time between failures: a Gamma(a0, a0·prior_s) prior on the failure rate,
    ``failures`` observed in ``exposure_s`` seconds up (Gamma-Poisson)."""
    return (a0 * prior_s + exposure_s) / (a0 + failures)


def auto_mtbf(prior_s: float, records: list[StartRecord], min_failures: int = MIN_FAILURES
              ) -> tuple[float, str] | None:
    """What ``every="auto"`` plans with once the journal holds ``min_failures`` failures: (the blended
    mean time between failures, why); None before."""
    g = analyse(records)
    k, t = len(g.failures), g.exposure_s
    if k < min_failures:
        return None
    m = blend_mtbf(prior_s, k, t)
    why = (f"mtbf {prior_s:.0f}s blended with {k} failures in {t:.0f}s up observed: "
           f"({PRIOR_SHAPE:g}·{prior_s:.0f}s + {t:.0f}s) / ({PRIOR_SHAPE:g} + {k}) = {m:.0f}s")
    return m, why
