"""examples/train_fsdp2_tp.py under real torchrun (gloo, CPU): a 2-D parallel job (FSDP2 over tensor
parallelism, ``_StridedShard`` weights) saved through ``Checkpointer``, stopped on 4 ranks (dp=2 × tp=2) and
resumed on 2 (dp=1 × tp=2), ends with the weights of a run on 2 ranks from the start, bit for bit. The two
jobs are the README's two torchrun lines, run as written (in a temporary directory).
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
from typing import IO

import pytest
import torch
from conftest import TORCHRUN, finish_job, start_job

import ckpt

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]  # three torchrun jobs, about 30 s on 2 cores

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
EXAMPLE = os.path.join(ROOT, "examples", "train_fsdp2_tp.py")
STEPS, EVERY, STOP = 6, 2, 3  # as the README's lines say


def readme_lines() -> list[list[str]]:
    """The README's torchrun lines for the example, as argument lists (comments dropped)."""
    with open(os.path.join(ROOT, "README.md")) as f:
        lines = [ln.split("  #")[0] for ln in f.read().splitlines()
                 if ln.startswith("torchrun ") and "train_fsdp2_tp.py" in ln]
    return [shlex.split(ln)[1:] for ln in lines]


def start(argv: list[str], ckdir: str, *extra: str) -> tuple[subprocess.Popen, IO[str]]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    argv = [ckdir if a == "runs/2d" else EXAMPLE if a == "examples/train_fsdp2_tp.py" else a for a in argv]
    return start_job([*TORCHRUN, "--standalone", "--monitor-interval", "0.1", *argv, *extra], env)


def torchrun(argv: list[str], ckdir: str, *extra: str) -> str:
    return finish_job(start(argv, ckdir, *extra))


def test_stopped_on_dp2_tp2_resumed_on_dp1_tp2_equals_a_run_on_dp1_tp2_from_the_start(tmp_path):
    stopped, straight = str(tmp_path / "stopped"), str(tmp_path / "straight")
    out, want_out = str(tmp_path / "final.pt"), str(tmp_path / "straight.pt")

    stop_on_4, resume_on_2 = readme_lines()
    assert stop_on_4[:2] == ["--nproc-per-node", "4"] and resume_on_2[:2] == ["--nproc-per-node", "2"]
    # the run on 2 ranks from the start shares nothing with the stopped job: it runs beside it
    straight_job = start(resume_on_2, straight, "--out", want_out)
    try:
        log = torchrun(stop_on_4, stopped)
        assert f"new run in {stopped} on dp=2 x tp=2" in log and f"stopping after step {STOP}" in log, log
        with ckpt.open(stopped) as ck:
            assert ck.steps() == [EVERY, STOP] and ck.manifest(STOP).world_size == 4
        log = torchrun(resume_on_2, stopped, "--out", out)
        assert re.search(rf"^resumed from step {STOP} in .* on dp=1 x tp=2$", log, re.M), log
        assert f"done: step {STEPS} on dp=1 x tp=2" in log, log

        log = finish_job(straight_job)
        assert "new run" in log and f"done: step {STEPS} on dp=1 x tp=2" in log, log
    finally:
        straight_job[0].kill()

    got, want = torch.load(out), torch.load(want_out)
    assert got.keys() == want.keys() and any("wq.weight" in k for k in got)
    for k in want:
        assert torch.equal(got[k], want[k]), k
    with ckpt.open(stopped) as ck:  # and the resume trained on: the weights moved from the saved step's
        assert not torch.equal(got["head.weight"], ck.tensors(STOP)["model/head.weight"])
