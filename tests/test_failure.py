"""The moment of failure: exit without close(), preemption signals, poisoned state, the save interval,
elastic restarts under torchrun, and the chaos harness."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
import torch

import ckpt

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def child_env() -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}


# -- exit safety ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("how", ["normal", "exception", "sigint", "dropped"])
def test_a_save_in_flight_at_exit_is_committed(tmp_path, how):
    for attempt in range(3):  # every time, not most of the time
        root = str(tmp_path / f"ck{attempt}")
        r = subprocess.run([sys.executable, os.path.join(HERE, "exit_child.py"), root, how], env=child_env(),
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == {"normal": 0, "dropped": 0, "exception": 1, "sigint": -signal.SIGINT}[how], r.stderr
        assert "cannot schedule" not in r.stderr
        got = {"w": torch.zeros(16 << 20)}
        assert ckpt.Checkpointer(root).load("latest", got) == 1
        assert torch.equal(got["w"], torch.arange(16 << 20, dtype=torch.float32))
