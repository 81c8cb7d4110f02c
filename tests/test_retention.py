"""Retention after a rollback, and two jobs in one root (issues 32.5, 33.4), with real processes for
the second job: retention never deletes the step just committed nor a step a live run resumed from
(in this process or another), abandoned newer steps are kept and named, and a second job saving into
a root another live job writes is refused unless both share it on purpose."""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp

import ckpt
import ckpt.dcp
from ckpt import cli
from ckpt.errors import CheckpointError, RootInUseError
from ckpt.format import paths
from ckpt.testing import run_ranks

HERE = os.path.dirname(os.path.abspath(__file__))


def second_job(root: str, load: int | None, save: int | None, shared: bool = False) -> tuple[subprocess.Popen, dict]:
    """Start tests/retention_child.py; return it once it has loaded and saved, and what it printed."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(HERE), os.environ.get("PYTHONPATH", "")])}
    args = ["-" if load is None else str(load), "-" if save is None else str(save), "shared" if shared else "alone"]
    p = subprocess.Popen([sys.executable, os.path.join(HERE, "retention_child.py"), root, *args], cwd=HERE,
                         env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert p.stdout is not None
    line = p.stdout.readline()
    if not line:
        p.kill()
        raise AssertionError(p.communicate()[1][-3000:])
    return p, json.loads(line)


def end(p: subprocess.Popen) -> None:
    out, err = p.communicate("close\n", timeout=120)
    assert p.returncode == 0, err[-3000:]


def saved(root: str, *steps: int) -> None:
    with ckpt.Checkpointer(root) as c:
        for s in steps:
            c.save(s, {"w": torch.full((64,), float(s))})


def loads(root: str, step: int) -> torch.Tensor:
    got = {"w": torch.zeros(64)}
    with ckpt.Checkpointer(root) as c:  # closed: an open Checkpointer keeps the step it loaded
        assert c.load(step, got) == step
    return got["w"]


# -- 32.5: retention after a rollback ------------------------------------------------------------------

def test_a_save_after_a_rollback_keeps_its_step_and_names_the_abandoned_newer_one(tmp_path, caplog):
    """Resumed from 10 with an abandoned 20 present, save(11, keep_last=1) used to delete 11 itself
    (keeping 20): keep_last now counts back from the step just committed, and 20 is kept and named."""
    root = str(tmp_path / "ck")
    saved(root, 10, 20)
    c = ckpt.Checkpointer(root, keep_last=1)
    state = {"w": torch.zeros(64)}
    assert c.load(10, state) == 10  # the rollback
    with caplog.at_level(logging.WARNING, logger="ckpt"):
        c.save(11, state).wait()
        c.wait()  # and the retention after it
    assert c.steps() == [10, 11, 20]  # 11 just committed, 10 resumed from, 20 abandoned: all kept
    assert any("[20]" in r.getMessage() and "step 11" in r.getMessage() and "gc" in r.getMessage()
               for r in caplog.records if r.levelno == logging.WARNING)
    c.save(12, state).wait()
    c.close()
    assert ckpt.open(root).steps() == [10, 12, 20]  # this run's newest counts: 11 goes, 20 stays
    assert cli.main(["gc", root, "--drop-after", "12"]) == 0  # what the warning says to do
    assert ckpt.open(root).steps() == [10, 12]
    assert torch.equal(loads(root, 12), torch.full((64,), 10.0))
    assert ckpt.Checkpointer(root).latest() == 12


def test_dcp_save_after_a_rollback_keeps_the_step_it_committed(tmp_path):
    root = str(tmp_path / "ck")
    for s in (10, 20):
        dcp.save({"w": torch.full((64,), float(s))}, storage_writer=ckpt.dcp.Writer(root, step=s), no_dist=True)
    dcp.save({"w": torch.full((64,), 11.0)}, storage_writer=ckpt.dcp.Writer(root, step=11, keep_last=1),
             no_dist=True)
    assert ckpt.open(root).steps() == [11, 20]  # its own retention used to delete 11 (keeping 20)
    assert torch.equal(loads(root, 11), torch.full((64,), 11.0))


def test_a_dcp_writer_keeps_the_step_an_open_checkpointer_of_this_process_loaded(tmp_path):
    root = str(tmp_path / "ck")
    saved(root, 9, 10)
    c = ckpt.Checkpointer(root)
    c.load(10, {"w": torch.zeros(64)})
    dcp.save({"w": torch.full((64,), 11.0)}, storage_writer=ckpt.dcp.Writer(root, step=11, keep_last=1),
             no_dist=True)
    assert ckpt.open(root).steps() == [10, 11]  # 9 goes; 10, which the open Checkpointer resumed from, stays
    c.close()
    dcp.save({"w": torch.full((64,), 12.0)}, storage_writer=ckpt.dcp.Writer(root, step=12, keep_last=1),
             no_dist=True)
    assert ckpt.open(root).steps() == [12]  # closed: nobody resumed from 10 any more


def test_a_reader_loading_each_new_step_keeps_only_the_last_it_loaded(tmp_path):
    """An evaluator's Checkpointer loads each step a training Checkpointer of the same process commits: the
    trainer's keep_last=1 removes the steps the evaluator has moved past (each load protected its step,
    and every one had stayed), keeps the one it last loaded, and a step protect() was asked for stays."""
    root = str(tmp_path / "ck")
    w = {"w": torch.zeros(64)}
    with ckpt.Checkpointer(root, keep_last=1) as trainer, ckpt.Checkpointer(root) as reader:
        trainer.save(1, {"w": torch.full((64,), 1.0)}).wait()
        reader.load(1, w)
        reader.protect(1)
        for step in (2, 3, 4):
            trainer.save(step, {"w": torch.full((64,), float(step))}).wait()
            reader.load(step, w)
            assert torch.equal(w["w"], torch.full((64,), float(step)))
        trainer.save(5, {"w": torch.full((64,), 5.0)}).wait()
        trainer.wait()  # retention after 5's commit
        assert ckpt.open(root).steps() == [1, 4, 5]  # 1 asked for, 4 last loaded, 5 newest; 2 and 3 gone


@pytest.mark.multiprocess
def test_retention_keeps_the_step_another_live_job_resumed_from(tmp_path):
    """A job sharing the root on purpose resumed from 10 and saved 11; this job's keep_last=1 removes
    11 but not 10 while that job runs (its writer lease names 10), and removes it once it has ended."""
    root = str(tmp_path / "ck")
    saved(root, 10)
    other, info = second_job(root, load=10, save=11, shared=True)
    try:
        assert info["loaded"] == 10
        with ckpt.Checkpointer(root, keep_last=1, shared_root=True) as c:
            c.save(12, {"w": torch.ones(64)})
        assert ckpt.open(root).steps() == [10, 12]
        assert cli.main(["gc", root, "--keep-last", "1", "--grace", "0"]) == 0  # nor does gc, from outside
        assert ckpt.open(root).steps() == [10, 12]
        assert torch.equal(loads(root, 10), torch.full((64,), 10.0))
    finally:
        end(other)
    with ckpt.Checkpointer(root, keep_last=1) as c:
        c.save(13, {"w": torch.ones(64)})
    assert ckpt.open(root).steps() == [13]


# -- 33.4: two jobs in one root ------------------------------------------------------------------------

@pytest.mark.multiprocess
def test_a_second_job_saving_into_a_live_jobs_root_is_refused_naming_the_holder(tmp_path):
    root = str(tmp_path / "ck")
    other, info = second_job(root, load=None, save=1)
    try:
        c = ckpt.Checkpointer(root, keep_last=1)
        handle = c.save(2, {"w": torch.ones(64)})
        with pytest.raises(RootInUseError) as e:
            handle.wait()
        msg = str(e.value)
        assert f"pid {info['pid']} on {socket.gethostname()}" in msg and " since " in msg and "UTC" in msg
        assert "shared_root=True" in msg and "another directory" in msg
        assert e.value.holder.pid == info["pid"]
        c.close()
        assert ckpt.open(root).steps() == [1]  # nothing written, the other job's step untouched
        assert not os.path.exists(os.path.join(root, paths.step_dir(2)))
        assert len(os.listdir(os.path.join(root, "leases"))) == 1  # only the other job's lease is left
        with ckpt.Checkpointer(root, shared_root=True) as shared:  # on purpose
            shared.save(3, {"w": torch.ones(64)})
        assert ckpt.open(root).steps() == [1, 3]
    finally:
        end(other)
    with ckpt.Checkpointer(root) as c:  # the other job closed: the root is free again
        c.save(4, {"w": torch.ones(64)})
    assert ckpt.open(root).steps() == [1, 3, 4]


def refused_body(rank: int, world: int, root: str) -> tuple[str, str]:
    c = ckpt.Checkpointer(root, timeout=60)
    try:
        c.save(2, {"w": torch.ones(64)}).wait()
    except CheckpointError as e:
        return type(e).__name__, str(e)
    finally:
        c.close()
    return "saved", ""


@pytest.mark.multiprocess
def test_every_rank_of_a_job_beside_a_live_job_is_refused_before_writing(tmp_path):
    """The coordinator's refusal reaches every rank (through its go), so no rank writes a chunk; a
    job of two ranks in its own root is no second job to itself (test_distributed saves many)."""
    root = str(tmp_path / "ck")
    other, info = second_job(root, load=None, save=1)
    try:
        chunks = set(os.listdir(os.path.join(root, "chunks")))
        (k0, m0), (k1, m1) = run_ranks(2, refused_body, root)
        for kind, msg in ((k0, m0), (k1, m1)):  # several ranks: the save's error names rank 0's
            assert kind == "DistributedSaveError" and "RootInUseError" in msg and f"pid {info['pid']}" in msg
        assert set(os.listdir(os.path.join(root, "chunks"))) == chunks
        assert not os.path.exists(os.path.join(root, paths.step_dir(2)))
    finally:
        end(other)


@pytest.mark.multiprocess
@pytest.mark.parametrize("reaped", [True, False])
def test_a_job_killed_while_holding_its_lease_does_not_block_its_restart(tmp_path, reaped):
    """Killed on this host, its lease dies with it: also while its parent has not reaped it yet (a
    zombie still answers kill(pid, 0))."""
    root = str(tmp_path / "ck")
    other, _ = second_job(root, load=None, save=1)
    other.send_signal(signal.SIGKILL)
    if reaped:
        other.communicate(timeout=60)
    else:
        os.waitid(os.P_PID, other.pid, os.WEXITED | os.WNOWAIT)  # exited, and left unreaped
    assert os.listdir(os.path.join(root, "leases"))  # the dead job's lease is still there
    with ckpt.Checkpointer(root, keep_last=1) as c:
        state = {"w": torch.zeros(64)}
        assert c.load("latest", state) == 1
        c.save(2, state)
    assert ckpt.open(root).steps() == [1, 2]  # 1: resumed from, so retention keeps it
    other.communicate(timeout=60)


def test_a_lease_left_by_an_earlier_process_with_this_pid_does_not_block(tmp_path):
    """A restarted container often gets the same pid on the same host name: the lease its previous
    life left (another process token) is dead, not this process's own."""
    root = str(tmp_path / "ck")
    saved(root, 1)
    doc = {"id": "e" * 32, "kind": "writer", "pid": os.getpid(), "host": socket.gethostname(),
           "expires": 4e9, "since": 1.0, "proc": "0" * 32}
    with open(os.path.join(root, paths.lease_key("e" * 32)), "w") as f:
        json.dump(doc, f)
    with ckpt.Checkpointer(root) as c:
        c.save(2, {"w": torch.ones(64)})
    assert ckpt.open(root).steps() == [1, 2]
