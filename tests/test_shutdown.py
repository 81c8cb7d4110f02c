"""A distributed job's end: the process group's gloo worker threads must not meet the interpreter's
finalization. A worker running then may drop a finished collective's tensors there, which needs the
GIL; the finalizing interpreter ends the thread instead and the process aborts with SIGABRT
("terminate called without an active exception") after the job printed "done"."""

from __future__ import annotations

import gc
import os
import subprocess
import weakref

import pytest
import torch
import torch.distributed as dist
from conftest import TORCHRUN

import ckpt
from ckpt.testing import run_ranks

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]  # spawns processes and takes more than a few seconds

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def _save_on_a_group_then_destroy_it(rank: int, world: int, path: str) -> bool:
    group = dist.new_group(list(range(world)), backend="gloo")
    with ckpt.Checkpointer(path, process_group=group) as c:
        c.save(1, {"w": torch.full((8,), float(rank)), "rank": ckpt.PerRank(rank)})
    dist.destroy_process_group(group)
    gone = weakref.ref(group)
    del group, c
    gc.collect()
    return gone() is None  # freed, so its worker threads were joined


def test_a_checkpointer_does_not_keep_its_process_group_alive(tmp_path):
    assert run_ranks(2, _save_on_a_group_then_destroy_it, str(tmp_path / "ck")) == [True, True]


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads the process's threads from /proc")
@pytest.mark.parametrize("example,args,done", [
    ("train_distributed.py", ["--steps", "4", "--every", "2"], "done: 4 steps on 2 rank(s)"),
    ("train_fsdp2_dcp.py", ["--steps", "4", "--every", "2"], "done: step 4 on 2 rank(s)"),
])
def test_the_distributed_examples_end_before_the_interpreter_finalizes_with_gloo_threads(tmp_path, example, args,
                                                                                         done):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    cmd = [*TORCHRUN, "--standalone", "--nproc-per-node", "2",
           os.path.join(HERE, "example_exit_child.py"), example, "--dir", str(tmp_path / "ck"), *args]
    p = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300)
    assert p.returncode == 0 and done in p.stdout, p.stdout[-8000:]
