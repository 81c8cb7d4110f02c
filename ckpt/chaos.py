"""Fault injection (``ckpt chaos``): kill a training command at random moments, resume it, and check
that nothing was lost or silently wrong.

The command is the user's own (``python train.py --dir {dir}``, a ``torchrun`` line, …); ``{dir}`` is
replaced by a checkpoint directory this harness owns. It must resume from its latest checkpoint when
started again, as a training job under a scheduler does. The harness

1. runs it once to the end, uninterrupted: the **reference**;
2. runs it again in a fresh directory and ``SIGKILL``\\ s its whole process group ``kills`` times:
   every other kill lands during a save (just after a ``save`` event that follows a commit of this
   run, so each run makes progress), the others at a random moment of training;
3. after each kill, verifies the newest committed step (every chunk re-hashed) and starts the command
   again; the restarted run must resume from exactly that step (or start fresh if none was committed);
4. lets the last run finish, and compares its newest step with the reference's: every tensor of every
   rank bit for bit, and every plain value;
5. reports the goodput of the chaos runs from the run journal they left (:mod:`ckpt.goodput`): each
   kill is a failure there, with the work it lost. The runs write their last-seen time every
   ``CHAOS_SEEN_S`` seconds (not every minute), so that lost work is measured to within that.

It watches the runs through the event record (:mod:`ckpt.events`) the command writes through ckpt, so
the command needs no changes. Randomness comes from ``seed`` alone, so a failure can be replayed.
"""

from __future__ import annotations

import os
import random
import select
import shlex
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from . import events, journal
from .errors import CheckpointError, ConfigError, NotACheckpointError
from .reader import Reader

if TYPE_CHECKING:
    from .goodput import Goodput

PLACEHOLDER = "{dir}"
POLL_S = 0.005  # how often the event record is read while waiting for a moment to kill
CHAOS_SEEN_S = 0.05  # the runs' journal last-seen period


@dataclass
class Attempt:
    """One run of the command in the chaos directory."""

    index: int
    plan: str  # what the harness meant to do: "during a save", "at 1.23 s of training", "to the end"
    killed: str | None = None  # what happened: "4 ms after the save of step 40 began", ...
    killed_at: float | None = None  # when (seconds since the epoch)
    resumed_from: int | None = None  # the step its ranks loaded; None: started fresh
    fresh: bool = False
    rc: int | None = None
    latest: int | None = None  # newest committed step after it ended
    verified: bool | None = None
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_json(self) -> dict:
        return {"run": self.index, "plan": self.plan, "killed": self.killed, "killed_at": self.killed_at,
                "resumed_from": self.resumed_from,
                "fresh": self.fresh, "rc": self.rc, "latest": self.latest, "verified": self.verified,
                "problems": self.problems}


@dataclass
class Report:
    command: list[str]
    seed: int
    kills: int
    reference_s: float
    reference_step: int | None
    attempts: list[Attempt] = field(default_factory=list)
    compared: int = 0  # tensors and values compared with the reference
    different: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)  # of the whole run (reference failed, …)
    goodput: Goodput | None = None  # of the chaos runs, from their journal

    @property
    def kills_done(self) -> int:
        return sum(a.killed is not None for a in self.attempts)

    @property
    def ok(self) -> bool:
        return not self.problems and not self.different and all(a.ok for a in self.attempts)

    def to_json(self) -> dict:
        return {"schema": "ckpt.chaos/1", "ok": self.ok, "command": self.command, "seed": self.seed,
                "kills_asked": self.kills, "kills_done": self.kills_done, "reference_s": round(self.reference_s, 3),
                "reference_step": self.reference_step, "runs": [a.to_json() for a in self.attempts],
                "compared": self.compared, "different": self.different, "problems": self.problems,
                "goodput": None if self.goodput is None else self.goodput.to_json()}


class _Run:
    """The command running in its own process group, its output in a file, its events in another."""

    def __init__(self, argv: list[str], log: str, evfile: str):
        self.evfile = evfile
        env = {journal.ENV_SEEN: str(CHAOS_SEEN_S), **os.environ, events.ENV: evfile}
        self._out = open(log, "wb")
        self.started = time.monotonic()
        try:
            self.proc = subprocess.Popen(argv, env=env, stdout=self._out, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
        except OSError as e:
            self._out.close()
            raise ConfigError(f"cannot start {argv[0]!r}: {e}") from e
        self.log = log
        self.timed_out = False
        self.killed_at: float | None = None

    def events(self) -> list[dict]:
        return events.read(self.evfile)

    def wait_for(self, pred: Callable[[list[dict]], float | None], deadline: float) -> float | None:
        """Poll the event record until ``pred`` returns a time (then return it), the command ends or
        the deadline passes (None)."""
        while time.monotonic() < deadline and self.proc.poll() is None:
            t = pred(self.events())
            if t is not None:
                return t
            time.sleep(POLL_S)
        return None

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # the whole job: torchrun and every worker
        except ProcessLookupError:
            pass
        self.proc.wait()
        # torchrun may be reaped before a worker dies: a worker inside a rename finishes it first, so
        # reading the newest step before every worker is gone could miss a commit that still landed
        wait_group_gone(self.proc.pid, time.monotonic() + 60)

    def finish(self, deadline: float) -> int:
        try:
            return self.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.timed_out = True
            self.kill()
            return -signal.SIGKILL
        finally:
            self._out.close()

    def tail(self, n: int = 8000) -> str:
        """The end of the run's output: long enough to hold a worker's own error above torchrun's summary."""
        with open(self.log, "rb") as f:
            data = f.read()
        return data[-n:].decode(errors="replace")


def _group_members(pgid: int) -> list[int]:
    """The live (not zombie) processes of process group ``pgid``, from /proc (Linux)."""
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone meanwhile
        if len(fields) > 2 and fields[2] == str(pgid) and fields[0] not in ("Z", "X"):
            out.append(int(name))
    return out


def wait_group_gone(pgid: int, deadline: float) -> None:
    """Block until no live process of group ``pgid`` is left (each waited for through a pidfd, which
    becomes readable when it exits, reaped or not), or the deadline passes. Without /proc or pidfds
    (not Linux) it returns at once."""
    if not hasattr(os, "pidfd_open") or not os.path.isdir("/proc"):
        return
    while time.monotonic() < deadline:
        live = _group_members(pgid)
        if not live:
            return
        for pid in live:
            try:
                fd = os.pidfd_open(pid)
            except (ProcessLookupError, OSError):
                continue
            try:
                select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
            finally:
                os.close(fd)


def _training_started(ev: list[dict]) -> float | None:
    return next((e["t"] for e in ev if e["event"] in ("fresh", "resume")), None)


def _save_after_commit(ev: list[dict]) -> float | None:
    commit = next((e["t"] for e in ev if e["event"] == "commit"), None)
    if commit is None:
        return None
    return next((e["t"] for e in ev if e["event"] == "save" and e["t"] > commit), None)


def _latest(ckdir: str) -> int | None:
    try:
        with Reader(ckdir) as r:
            return r.latest()
    except NotACheckpointError:
        return None


def _contents(ckdir: str, step: int) -> dict[str, object]:
    """Every tensor of every saved rank and every plain value of ``step``, by a readable name."""
    out: dict[str, object] = {}
    with Reader(ckdir) as r:
        m = r.manifest(step)
        per_rank = {t.key for t in m.tensors if t.rank is not None}
        for rank in sorted({t.rank for t in m.tensors if t.rank is not None}) or [0]:
            for k, v in r.tensors(step, rank=rank).items():
                if k in per_rank:
                    out[f"{k} [rank {rank}]"] = v
                elif rank == 0 or k not in out:
                    out[k] = v
        out.update(r.values(step))
    return out


def _same(a: object, b: object) -> bool:
    """Equal bit for bit (NaN equals the same NaN, -0.0 differs from 0.0), containers element-wise."""
    if isinstance(a, np.ndarray) and isinstance(b, np.ndarray):
        a, b = torch.from_numpy(np.ascontiguousarray(a)), torch.from_numpy(np.ascontiguousarray(b))
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
            a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))
    if type(a) is not type(b):
        return False
    if isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple))
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        assert isinstance(b, dict)
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return bool(a == b)


def compare(reference: str, chaos: str, step: int, ignore: Sequence[str] = ()) -> tuple[int, list[str]]:
    """(how many tensors and values were compared, the names of those that differ); names starting
    with an ``ignore`` prefix are left out."""
    want, got = _contents(reference, step), _contents(chaos, step)
    names = sorted(n for n in want.keys() | got.keys() if not any(n.startswith(p) for p in ignore))
    return len(names), [n for n in names if n not in want or n not in got or not _same(want[n], got[n])]


def expand(command: list[str], ckdir: str) -> list[str]:
    return [a.replace(PLACEHOLDER, ckdir) for a in command]


def _kill(r: _Run, plan: str, rng: random.Random, deadline: float) -> str | None:
    """Kill run ``r`` at the moment ``plan`` says; what happened, or None if it ended first."""
    if plan == "during a save":
        t = r.wait_for(_save_after_commit, deadline)
        if t is None:
            return None
        time.sleep(rng.uniform(0.0, 0.02))
        step = next(e["step"] for e in r.events() if e["event"] == "save" and e["t"] == t)
        what = f"{{:.0f}} ms after the save of step {step} began"
        scale = 1e3
    else:
        t = r.wait_for(_training_started, deadline)
        if t is None:
            return None
        time.sleep(max(0.0, t + float(plan.split()[1]) - time.time()))
        what, scale = "{:.2f} s into training", 1.0
    if r.proc.poll() is not None or any(e["event"] == "close" for e in r.events()):
        return None  # it ended first (or is ending: its Checkpointer closed), so no kill interrupts it
    now = time.time()
    r.kill()
    r.killed_at = now
    return what.format((now - t) * scale)


def _check(a: Attempt, r: _Run, expect: int | None, ckdir: str) -> None:
    """Fill in what attempt ``a`` did and what is wrong with it: it must have resumed from ``expect``
    (the newest committed step before it; None: nothing, so it starts fresh), ended well unless
    killed, and left a newest committed step that verifies."""
    starts = [e for e in r.events() if e["event"] in ("fresh", "resume")]
    a.fresh = bool(starts) and all(e["event"] == "fresh" for e in starts)
    steps = sorted({e["step"] for e in starts if e["event"] == "resume"})
    a.resumed_from = steps[-1] if steps else None
    if not starts and a.killed is None:
        a.problems.append("it never loaded a checkpoint (no resume or fresh event)")
    elif starts and expect is None and not a.fresh:
        a.problems.append(f"it resumed from step {steps} though nothing was committed")
    elif starts and expect is not None and (a.fresh or steps != [expect]):
        a.problems.append(f"it resumed from {'nothing' if a.fresh else f'step {steps}'}, "
                          f"not from the newest committed step {expect}")
    if a.killed is None and r.timed_out:
        a.problems.append(f"it did not end within the timeout; killed. Its output ends: {r.tail()}")
    elif a.killed is None and a.rc != 0:
        a.problems.append(f"it failed on its own (exit code {a.rc}): {r.tail()}")
    a.latest = _latest(ckdir)
    if a.latest is not None:
        with Reader(ckdir) as rd:
            result = rd.verify(a.latest)
        a.verified = result.ok
        if not result.ok:
            a.problems.append(f"committed step {a.latest} does not verify: {result.problems[:3]}")


def run(command: list[str], workdir: str, *, kills: int = 3, seed: int = 0, timeout: float = 600.0,
        ignore: Sequence[str] = (), say: Callable[[str], None] = lambda _s: None) -> Report:
    """Run the reference and the chaos run in ``workdir`` (see the module docstring). ``timeout``
    bounds each run of the command; names starting with an ``ignore`` prefix are not compared;
    ``say`` receives a line per thing done."""
    if not command:
        raise ConfigError("no training command given: ckpt chaos [options] -- python train.py --dir {dir}")
    if not any(PLACEHOLDER in a for a in command):
        raise ConfigError(f"the command must contain {PLACEHOLDER} where the checkpoint directory goes, "
                          f"e.g. ckpt chaos -- python train.py --dir {PLACEHOLDER}")
    if kills < 0:
        raise ConfigError(f"--kills must be 0 or more, got {kills}")
    rng = random.Random(seed)
    os.makedirs(workdir, exist_ok=True)
    ref_dir, chaos_dir = os.path.join(workdir, "reference"), os.path.join(workdir, "chaos")

    def start(ckdir: str, name: str) -> _Run:
        return _Run(expand(command, ckdir), os.path.join(workdir, f"{name}.log"),
                    os.path.join(workdir, f"{name}.events"))

    say(f"reference run: {shlex.join(expand(command, ref_dir))}")
    ref = start(ref_dir, "reference")
    rc = ref.finish(time.monotonic() + timeout)
    ref_events = ref.events()
    begun = _training_started(ref_events)
    # How long training (not start-up) took: the window random kills are drawn from.
    train_s = max(0.05, ref_events[-1]["t"] - begun) if begun is not None else 0.0
    report = Report(command, seed, kills, time.monotonic() - ref.started, _latest(ref_dir))
    if rc != 0:
        why = f"did not end within {timeout:g} s" if ref.timed_out else f"failed (exit code {rc})"
        report.problems.append(f"the reference run {why}: {ref.tail()}")
        return report
    if report.reference_step is None or begun is None:
        report.problems.append("the reference run committed no step through ckpt (does it save into {dir}, and "
                               "call load('latest') at start?)")
        return report

    for i in range(kills + 1):
        if i == kills:
            plan = "to the end"
        elif i % 2 == 0:
            plan = "during a save"
        else:
            plan = f"at {rng.uniform(0.0, train_s / (kills + 1)):.2f} s of training"
        expect = report.attempts[-1].latest if report.attempts else None
        a = Attempt(i + 1, plan)
        report.attempts.append(a)
        say(f"run {a.index}: {plan}")
        r = start(chaos_dir, f"chaos-{a.index}")
        deadline = time.monotonic() + timeout
        if i < kills:
            a.killed = _kill(r, plan, rng, deadline)
            a.killed_at = r.killed_at
        a.rc = r.finish(deadline)
        _check(a, r, expect, chaos_dir)
        say(f"run {a.index}: {a.killed or f'ended with exit code {a.rc}'}; newest committed step {a.latest}"
            + ("" if a.ok else f"; PROBLEM: {'; '.join(a.problems)}"))
        if a.killed is None:
            if i < kills:
                say(f"run {a.index} ended before the kill; no more kills")
            break

    try:
        with Reader(chaos_dir) as rd:
            report.goodput = rd.goodput()
    except CheckpointError:  # nothing there (the command never saved): no goodput to report
        pass
    final = report.attempts[-1]
    if final.killed is None and final.rc == 0:
        if final.latest != report.reference_step:
            report.problems.append(f"the chaos run ended at step {final.latest}, the reference at "
                                   f"{report.reference_step}")
        else:
            report.compared, report.different = compare(ref_dir, chaos_dir, final.latest, ignore)
    return report
