"""Real kill -9 of a process in the middle of saving: every committed step stays whole and loadable."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
import torch
from crash_child import expected

import ckpt

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]  # spawns processes and takes more than a few seconds

HERE = os.path.dirname(__file__)


def _run_and_kill(path: str, keep_last: int, after_lines: int) -> tuple[int, int]:
    """Start the saving child and kill -9 it after it printed ``after_lines`` lines.

    Returns (last step it snapshotted, last step it reported committed)."""
    proc = subprocess.Popen([sys.executable, os.path.join(HERE, "crash_child.py"), path, str(keep_last)],
                            stdout=subprocess.PIPE, text=True, cwd=HERE)
    saved = committed = 0
    try:
        for _ in range(after_lines):
            line = proc.stdout.readline()
            kind, _, n = line.partition(" ")
            assert kind in ("saved", "committed"), f"child died early: {line!r}"
            if kind == "saved":
                saved = int(n)
            else:
                committed = int(n)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    assert proc.returncode == -signal.SIGKILL
    return saved, committed


def _check_all_committed(path: str, last_reported: int, last_committed: int) -> list[int]:
    c = ckpt.Checkpointer(path)
    steps = c.steps()
    if last_committed:
        assert steps and steps[-1] >= last_committed, f"step {last_committed} was reported durable, found {steps}"
    # every step that exists is whole: it loads, hash-checked, with exactly the values saved
    for s in steps:
        want = expected(s)
        target = {"w": torch.empty(64, 8192), "b": torch.empty(100), "step": -1}
        assert c.load(s, target) == s
        assert torch.equal(target["w"], want["w"]) and torch.equal(target["b"], want["b"]) and target["step"] == s
    assert not steps or steps[-1] <= last_reported  # never a step the process had not snapshotted
    c.close()
    return steps


@pytest.mark.parametrize("keep_last", [2, 1000])
def test_kill_during_saves_leaves_every_committed_step_loadable(tmp_path, keep_last):
    path = str(tmp_path / "ck")
    newest = []
    for after in [2, 9, 4, 13, 6, 11]:  # kill at different points across restarts
        saved, committed = _run_and_kill(path, keep_last, after)
        steps = _check_all_committed(path, saved, committed)
        newest.append(steps[-1] if steps else 0)
    assert newest == sorted(newest) and newest[-1] > 0  # each restart carried on from what it found
    # a fresh writer carries on after all those crashes
    with ckpt.Checkpointer(path, chunk_size=64 * 1024) as c:
        nxt = c.latest() + 1
        c.save(nxt, expected(nxt))
    assert ckpt.open(path).latest() == nxt
