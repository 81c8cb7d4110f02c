"""A distributed job's end: the process group's gloo worker threads must not meet the interpreter's
finalization. A worker running then may drop a finished collective's tensors there, which needs the
GIL; the finalizing interpreter ends the thread instead and the process aborts with SIGABRT
("terminate called without an active exception") after the job printed "done"."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
import torch.distributed as dist

import ckpt
from ckpt.testing import run_ranks

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]  # spawns processes and takes more than a few seconds


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
