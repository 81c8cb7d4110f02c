"""Real torchrun jobs on 127.0.0.1 (gloo, CPU) that lose a worker or are told to stop, and carry on.

The job is examples/train_distributed.py (FSDP2-sharded model and optimizer, per-rank RNG and data
positions). A job that lost a worker ends with an uninterrupted job's final weights; a stopped job's
emergency save holds, bit for bit, what a save of that step on purpose holds.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time

import numpy as np
import pytest
import torch
from conftest import TORCHRUN

import ckpt
from ckpt import events

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]  # spawns processes and takes more than a few seconds

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
STEPS, EVERY = 60, 10


def torchrun(nproc: int, ckdir: str, out: str, evfile: str, restarts: int = 0, extra: list[str] = (),
             **popen) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", events.ENV: evfile}
    cmd = [*TORCHRUN, "--standalone", "--nproc-per-node", str(nproc),
           "--max-restarts", str(restarts), "--monitor-interval", "0.1",
           os.path.join(ROOT, "examples", "train_distributed.py"), "--dir", ckdir, "--steps", str(STEPS),
           "--every", str(EVERY), "--out", out, *extra]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **popen)


def wait_for(evfile: str, proc: subprocess.Popen, pred, timeout: float = 120.0) -> list[dict]:
    """Follow the job's event record until ``pred(events)`` holds (the job is a separate process
    tree; its record file is the only way to watch it)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ev = events.read(evfile)
        if pred(ev):
            return ev
        if proc.poll() is not None:
            raise AssertionError(f"the job ended first:\n{proc.stdout.read()}")
        time.sleep(0.02)
    raise AssertionError(f"no such event within {timeout}s: {events.read(evfile)}")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted job's final weights, read through a call: the job runs beside the tests until
    they read them (it shares nothing with theirs; a job's start and end leave a core idle)."""
    d = tmp_path_factory.mktemp("ref")
    p = torchrun(3, str(d / "ck"), str(d / "final.pt"), str(d / "events"))
    weights: list[dict] = []

    def final() -> dict:
        if not weights:
            out, _ = p.communicate(timeout=300)
            assert p.returncode == 0, out
            weights.append(torch.load(d / "final.pt"))
        return weights[0]
    yield final
    p.kill()


def comparable(v):
    """``v`` with every numpy array (a saved RNG state) as its dtype, shape and bytes, so ``==`` compares bits."""
    if isinstance(v, dict):
        return {k: comparable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return type(v)(comparable(x) for x in v)
    if isinstance(v, np.ndarray):
        return ("ndarray", v.dtype.str, v.shape, v.tobytes())
    return v


def saved_state(ckdir: str, step: int) -> dict:
    """Everything step ``step`` in ``ckdir`` holds, every saved rank's: its plain values and, per
    rank, its tensors' bytes (a dict that compares equal only when every bit does)."""
    with ckpt.open(ckdir) as ck:
        world = ck.manifest(step).world_size
        tensors = [ck.tensors(step, rank=r) for r in range(world)]
        state = {"world": world, "values": comparable(ck.values(step))}
    assert any(k.startswith("optim/") for k in tensors[0])
    for r, ts in enumerate(tensors):
        state.update({(r, k, t.dtype, tuple(t.shape)): t.reshape(-1).view(torch.uint8).numpy().tobytes()
                      for k, t in ts.items()})
    return state


def test_a_killed_worker_is_restarted_by_torchrun_and_the_job_ends_identical(tmp_path, reference):
    evfile, out = str(tmp_path / "events"), str(tmp_path / "final.pt")
    p = torchrun(3, str(tmp_path / "ck"), out, evfile, restarts=1)
    try:
        ev = wait_for(evfile, p, lambda ev: any(e["event"] == "commit" for e in ev))
        victim = next(e["pid"] for e in ev if e["event"] in ("fresh", "resume") and e["rank"] == 1)
        os.kill(victim, signal.SIGKILL)  # mid-training, possibly mid-save
        killed_at = time.time()
        log, _ = p.communicate(timeout=300)
    finally:
        p.kill()
    assert p.returncode == 0, log
    ev = events.read(evfile)
    resumes = [e for e in ev if e["event"] == "resume"]
    assert sorted(e["rank"] for e in resumes) == [0, 1, 2]  # the restarted group, every rank
    # from the newest step committed before the restart (a save in flight at the kill may still have
    # committed, if rank 1 had reported its part)
    restarted = min(e["t"] for e in resumes)
    newest = max(e["step"] for e in ev if e["event"] == "commit" and e["t"] < restarted)
    assert {e["step"] for e in resumes} == {newest}
    assert newest >= max(e["step"] for e in ev if e["event"] == "commit" and e["t"] < killed_at)
    got, want = torch.load(out), reference()
    assert got.keys() == want.keys()
    for k in got:
        assert torch.equal(got[k], want[k]), k
    assert ckpt.Checkpointer(str(tmp_path / "ck")).latest() == STEPS


def test_a_stopped_job_saves_on_sigterm_and_resumes_on_two_workers(tmp_path, reference):
    evfile, out = str(tmp_path / "events"), str(tmp_path / "final.pt")
    ck = str(tmp_path / "ck")
    p = torchrun(3, ck, out, evfile, start_new_session=True)
    try:
        wait_for(evfile, p, lambda ev: any(e["event"] == "commit" for e in ev))
        p.send_signal(signal.SIGTERM)  # the scheduler stops the job; torchrun forwards it to every worker
        log, _ = p.communicate(timeout=120)
    finally:
        os.killpg(p.pid, signal.SIGKILL) if p.poll() is None else None
    assert "preempted: step" in log, log
    stopped = ckpt.open(ck).latest()
    assert stopped is not None and stopped % EVERY != 0 and stopped < STEPS  # the emergency save, between intervals
    assert not os.path.exists(out)
    emergency = saved_state(ck, stopped)  # before the resume's keep_last=3 lets it go

    # The same job saved and stopped at that step on purpose (its own directory and record: it runs
    # beside the resume below; each prints a few lines, well within a pipe's buffer).
    ck2 = str(tmp_path / "ck2")
    on_purpose = torchrun(3, ck2, str(tmp_path / "final2.pt"), str(tmp_path / "events2"),
                          extra=["--every", str(stopped), "--stop-after", str(stopped)])
    p = torchrun(2, ck, out, evfile)  # the job comes back smaller
    try:
        log, _ = p.communicate(timeout=300)
        assert p.returncode == 0, log
        on_purpose_log, _ = on_purpose.communicate(timeout=300)
        assert on_purpose.returncode == 0, on_purpose_log
    finally:
        p.kill()
        on_purpose.kill()
    assert [e["step"] for e in events.read(evfile) if e["event"] == "resume"] == [stopped, stopped]

    # On purpose, the same state, bit for bit, on every saved rank (shards, per-rank RNG streams and
    # loader positions, the step), so the emergency save held exactly the state of that step, and the
    # resume above read what an on-purpose save holds. (The saved state itself is compared: resuming
    # from it once more on two workers, as this test did, read the same bytes again. Against the
    # uninterrupted run's final weights the resume differs: two workers draw other dropout masks.)
    assert saved_state(ck2, stopped) == emergency
    final = torch.load(out)
    assert final.keys() == reference().keys()
