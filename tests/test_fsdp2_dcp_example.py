"""examples/train_fsdp2_dcp.py under real torchrun (gloo, CPU, 127.0.0.1): an FSDP2 job on DCP's own calls
over ckpt steps, stopped on 4 ranks and resumed on 2: the stopped step holds, bit for bit, what a run
that saved that step and nothing else holds, and the 2 ranks resume from exactly it.

4 ranks and 2 sum gradients in another order, so neither is compared with an uninterrupted run on the
other world size.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
from typing import IO

import pytest
import torch
from conftest import TORCHRUN, finish_job, start_job

import ckpt

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]  # three torchrun jobs, about 30 s on 2 cores

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
EXAMPLE = os.path.join(ROOT, "examples", "train_fsdp2_dcp.py")
STEPS, EVERY, STOP = 12, 4, 6  # the stop is not a multiple of EVERY: --stop-after saves it itself


def start(nproc: int, ckdir: str, *extra: str) -> tuple[subprocess.Popen, IO[str]]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    cmd = [*TORCHRUN, "--standalone", "--nproc-per-node", str(nproc),
           "--monitor-interval", "0.1", EXAMPLE, "--dir", ckdir,
           "--steps", str(STEPS), *extra]
    return start_job(cmd, env)


def torchrun(nproc: int, ckdir: str, *extra: str) -> str:
    return finish_job(start(nproc, ckdir, *extra))


def steps(ckdir: str) -> list[int]:
    with ckpt.open(ckdir) as ck:
        return ck.steps()


def resumed_from(log: str) -> list[tuple[int, str]]:
    """(step, digest of the model and optimizer tensors as loaded) of each resume in ``log``."""
    return [(int(s), d) for s, d in re.findall(r"^resumed from step (\d+) in .* on 2 rank\(s\); state (\w+)$",
                                                log, re.M)]


def _example_module():
    """The example itself, imported from its file: the test checks its digest with the example's own function."""
    spec = importlib.util.spec_from_file_location("train_fsdp2_dcp", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


digest = _example_module().digest  # sha256 of names and bytes in name order, as the example prints it


def test_stopped_on_4_ranks_resumed_on_2_equals_a_resume_from_a_step_saved_on_purpose(tmp_path):
    stopped, ref = str(tmp_path / "stopped"), str(tmp_path / "ref")
    out = str(tmp_path / "final.pt")

    # The reference: 4 ranks save STOP and nothing else; it shares nothing with the job, so runs beside it.
    reference = start(4, ref, "--every", str(STOP), "--stop-after", str(STOP))
    try:
        # The job: async saves every EVERY steps on 4 ranks, stopped after STOP (saved, committed), resumed on 2.
        log = torchrun(4, stopped, "--every", str(EVERY), "--stop-after", str(STOP))
        assert "new run" in log and f"stopping after step {STOP}" in log, log
        assert steps(stopped) == [EVERY, STOP]
        log = torchrun(2, stopped, "--every", str(EVERY), "--out", out)
        [(step, loaded)] = resumed_from(log)
        assert step == STOP, log
        assert f"done: step {STEPS} on 2 rank(s)" in log, log
        assert steps(stopped) == [STOP, 8, STEPS]  # keep_last=3 let step 4 go

        finish_job(reference)
    finally:
        reference[0].kill()
    assert steps(ref) == [STOP]

    # The saved step: the same model and optimizer state, bit for bit (the async save at step 4 and
    # the reused Stager buffer changed nothing), and the same plain values (the step number).
    with ckpt.open(stopped) as a, ckpt.open(ref) as b:
        at_stop, ref_at_stop = a.tensors(STOP), b.tensors(STOP)
        assert a.values(STOP) == b.values(STOP) and a.values(STOP)["step"] == STOP
        assert a.manifest(STOP).world_size == b.manifest(STOP).world_size == 4
    assert at_stop.keys() == ref_at_stop.keys()
    assert any(k.startswith("optim/state/") for k in at_stop)
    for k in at_stop:
        assert torch.equal(at_stop[k], ref_at_stop[k]), k
    # and what the 2 ranks held after dcp.load and set_state_dict, gathered: the saved tensors, every one
    # (model and optimizer), resharded from 4 ranks to 2 without a bit changed. So the resume started
    # from exactly the reference's state; a second resume, from the reference, read the same bytes
    # again and so ended with the same weights (this test ran one until the state itself was compared).
    assert loaded == digest(at_stop) == digest(ref_at_stop)

    # The end: the resume trained on to STEPS, its weights moved from the saved step's.
    got = torch.load(out)
    assert len(got) > 0 and {f"model/{k}" for k in got} <= at_stop.keys()
    assert not torch.equal(got["head.weight"], at_stop["model/head.weight"])
