"""ckpt.dcp.Stager with async_saves in flight: each save keeps the values of its own call, two ranks
do not deadlock, and the Stager's buffers are known by identity (issue 32.2, 32.3)."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import ckpt
import ckpt.dcp
from ckpt.storage import LocalStorage
from ckpt.testing import run_ranks


def outcomes(futs: list) -> list[str]:
    """Each failed save's error, as "Type: message", waiting for every future."""
    errors = []
    for f in futs:
        try:
            f.result()
        except BaseException as e:
            errors.append(f"{type(e).__name__}: {e}")
    return errors


def unawaited_body(rank: int, world: int, path: str, grow: bool) -> list[str]:
    """Three async_saves through one Stager, none awaited before the next; the state changes right
    after each returns (and, with ``grow``, AdamW-like state appears after the first step)."""
    stager = ckpt.dcp.Stager()
    w = torch.zeros(64)
    state: dict = {"model": {"w": w}}
    futs = []
    for s in (1, 2, 3):
        w.fill_(float(s))
        if grow and s >= 2:
            state.setdefault("optim", {"exp_avg": torch.zeros(32)})["exp_avg"].fill_(10.0 + s)
        futs.append(dcp.async_save(state, storage_writer=ckpt.dcp.Writer(path, step=s), async_stager=stager))
        w.fill_(-1.0)  # changed once async_save returned: must not reach any step
        if "optim" in state:
            state["optim"]["exp_avg"].fill_(-1.0)
    errors = outcomes(futs)
    stager.close()
    return errors


def unawaited_bodies(rank: int, world: int, path: str) -> dict[str, list[str]]:
    """:func:`unawaited_body` with a state that stays the same, then with one that grows, each into a
    root of its own: one group of ranks for both cases."""
    return {case: unawaited_body(rank, world, os.path.join(path, case), case == "grows") for case in ("same", "grows")}


@pytest.mark.multiprocess
def test_unawaited_async_saves_through_one_stager_keep_their_own_values(tmp_path):
    """Each of several async_saves in flight at once commits the values of its own call (they were
    [3.0] [3.0] [3.0]), and two ranks do not deadlock (they hung until the process group's timeout);
    with a state that stays the same, and with one that grows after the first save."""
    out = run_ranks(2, unawaited_bodies, str(tmp_path), timeout=150, pg_timeout=40)
    assert out == [{"same": [], "grows": []}] * 2, out
    for case in ("same", "grows"):
        reader = ckpt.open(str(tmp_path / case))
        assert reader.steps() == [1, 2, 3], case
        for s in (1, 2, 3):
            tensors = reader.tensors(s)
            assert tensors["model/w"].unique().tolist() == [float(s)], (case, s, tensors["model/w"].unique())
            if case == "grows" and s >= 2:
                assert tensors["optim/exp_avg"].unique().tolist() == [10.0 + s], s


_step2_set_up = threading.Event()  # per rank process


class LateFirstWriter(ckpt.dcp.Writer):
    """On rank 1, step 1's save thread reaches DCP only once step 2's has: the saving threads start
    in the other order than the calls, as they may when the scheduler says so."""

    def set_up_storage_writer(self, is_coordinator, *args, **kwargs):
        if self.step == 2:
            _step2_set_up.set()
        elif self._late:
            assert _step2_set_up.wait(30), "step 2's save never reached set_up while step 1's waited"
        super().set_up_storage_writer(is_coordinator, *args, **kwargs)


def late_first_body(rank: int, world: int, path: str) -> list[str]:
    """Two unawaited async_saves; the state grows between them (step 2 has a tensor step 1 lacks)."""
    state: dict = {"model": {"w": torch.full((64,), 1.0)}}
    futs = []
    for s in (1, 2):
        writer = LateFirstWriter(path, step=s)
        writer._late = rank == 1
        futs.append(dcp.async_save(state, storage_writer=writer))
        state = {"model": {"w": torch.full((64,), 2.0)}, "optim": {"exp_avg": torch.full((32,), 12.0)}}
    return outcomes(futs)


@pytest.mark.multiprocess
def test_saves_keep_the_order_of_their_calls_when_their_threads_start_in_the_other(tmp_path):
    """Each async_save's collectives are issued in the order of the calls on every rank, not in the
    order their threads reach DCP: rank 1 running step 2's plan round against rank 0's step 1 put
    step 2's tensors into step 1's metadata ("no rank wrote tensor 'optim.exp_avg'", seen in CI)."""
    path = str(tmp_path / "run")
    out = run_ranks(2, late_first_body, path, timeout=150, pg_timeout=40)
    assert out == [[], []], out
    reader = ckpt.open(path)
    assert reader.steps() == [1, 2]
    one, two = reader.tensors(1), reader.tensors(2)
    assert set(one) == {"model/w"} and one["model/w"].unique().tolist() == [1.0]
    assert two["model/w"].unique().tolist() == [2.0] and two["optim/exp_avg"].unique().tolist() == [12.0]


def test_a_tensor_that_starts_with_the_stagers_magic_is_the_users_tensor(tmp_path):
    """A user's tensor whose first bytes are the Stager's magic is saved as it is: nothing written
    into it, no bytes it never had stored, and an odd value there waits for nothing."""
    from ckpt.dcp.stager import MAGIC

    path = str(tmp_path / "run")
    even = torch.tensor([MAGIC, 4, 0, 0, 7, 8, 9, 10], dtype=torch.int64)
    odd = torch.tensor([MAGIC, 5, 0, 0, 1, 2, 3, 4], dtype=torch.int64)
    want = {"even": even.clone(), "odd": odd.clone()}
    started = time.monotonic()
    dcp.save({"even": even, "odd": odd}, storage_writer=ckpt.dcp.Writer(path, step=1, timeout=20), no_dist=True)
    assert time.monotonic() - started < 10  # not the Writer's 20 s wait for an "odd" snapshot
    assert torch.equal(even, want["even"]) and torch.equal(odd, want["odd"])  # the caller's tensors untouched
    stored = ckpt.open(path).tensors(1)
    assert torch.equal(stored["even"], want["even"]) and torch.equal(stored["odd"], want["odd"])


class BlockingStorage(LocalStorage):
    """A disk whose chunk writes wait for ``go`` and then fail: a save that fails after copying out."""

    def __init__(self, path, go):
        super().__init__(path)
        self.go = go

    def create(self, key, buffers):
        if key.startswith("chunks/"):
            self.go.wait(60)
            raise OSError(28, "No space left on device")
        return super().create(key, buffers)


def test_a_save_failing_after_its_copy_does_not_release_the_next_calls_snapshot(tmp_path):
    """Step 1 fails writing after it copied its snapshot out, while step 2 (staged) waits to start:
    step 3's stage must still wait for step 2's copy, not take step 1's failure as step 2's release."""
    path = str(tmp_path / "run")
    go = threading.Event()
    stager = ckpt.dcp.Stager(wait_s=30)
    w = torch.zeros(16)
    state = {"w": w}
    w.fill_(1.0)
    f1 = dcp.async_save(state, storage_writer=ckpt.dcp.Writer(path, step=1, storage=BlockingStorage(path, go)),
                        async_stager=stager, no_dist=True)
    w.fill_(2.0)
    f2 = dcp.async_save(state, storage_writer=ckpt.dcp.Writer(path, step=2), async_stager=stager, no_dist=True)
    go.set()
    with pytest.raises(CheckpointException):
        f1.result()
    w.fill_(3.0)
    f3 = dcp.async_save(state, storage_writer=ckpt.dcp.Writer(path, step=3), async_stager=stager, no_dist=True)
    f2.result()
    f3.result()
    stager.close()
    reader = ckpt.open(path)
    assert reader.steps() == [2, 3]
    assert reader.tensors(2)["w"].unique().tolist() == [2.0] and reader.tensors(3)["w"].unique().tolist() == [3.0]


@pytest.fixture
def fresh_line(monkeypatch):
    """This test's Writers alone in the line of saves (none kept alive by an earlier test)."""
    from ckpt.dcp import _serial

    monkeypatch.setattr(_serial, "_tickets", {})
    monkeypatch.setattr(_serial, "_current", {})


def test_a_writer_made_and_never_used_holds_the_next_save_only_for_its_timeout(tmp_path, caplog, fresh_line):
    """Saves wait for every Writer made before theirs; one that is kept but never handed to DCP
    would hold them for ever, so they go on after ``timeout`` seconds, saying why, and the saves
    after that do not wait for it again."""
    path = str(tmp_path / "run")
    unused = ckpt.dcp.Writer(path, step=1)
    started = time.monotonic()
    with caplog.at_level("WARNING", logger="ckpt"):
        dcp.save({"w": torch.ones(4)}, storage_writer=ckpt.dcp.Writer(path, step=2, timeout=1), no_dist=True)
    assert 1 <= time.monotonic() - started < 20
    assert "step 1" in caplog.text and "has not started its save" in caplog.text
    started = time.monotonic()
    dcp.save({"w": torch.ones(4)}, storage_writer=ckpt.dcp.Writer(path, step=3, timeout=30), no_dist=True)
    assert time.monotonic() - started < 10  # given up for good: not another wait
    assert ckpt.open(path).steps() == [2, 3]
    del unused


def test_a_call_whose_staging_failed_is_not_waited_for(tmp_path, fresh_line):
    """A Stager that fails to stage (as in an async_save whose stage raises) gives up the Writer made
    for that call: the next save does not wait for it, even while the caller keeps it alive."""
    path = str(tmp_path / "run")
    stager = ckpt.dcp.Stager()
    failed = ckpt.dcp.Writer(path, step=1)
    with pytest.raises(ckpt.ConfigError):
        stager.stage(["not", "a", "dict"])
    started = time.monotonic()
    dcp.save({"w": torch.ones(4)}, storage_writer=ckpt.dcp.Writer(path, step=2, timeout=30), no_dist=True)
    assert time.monotonic() - started < 10  # not the 30 s wait for step 1's Writer
    assert ckpt.open(path).steps() == [2]
    del failed
    stager.close()


_main_in_step3 = threading.Event()


class AfterStep3Writer(ckpt.dcp.Writer):
    """Step 2's save (on its own thread) reaches DCP only once the main thread is inside step 3's."""

    def set_up_storage_writer(self, is_coordinator, *args, **kwargs):
        if self.step == 3:
            _main_in_step3.set()
        elif self.step == 2:
            assert _main_in_step3.wait(30)
        super().set_up_storage_writer(is_coordinator, *args, **kwargs)


def test_a_thread_that_went_on_to_the_next_save_is_not_still_in_the_one_it_finished(tmp_path, fresh_line):
    """Step 1 saved on the main thread, step 2 async, step 3 on the main thread again: step 3 waits
    for step 2, and step 2 must not wait for step 1 because the main thread is inside a save (step
    3's): they waited on each other until the timeout."""
    path = str(tmp_path / "run")
    writers = [AfterStep3Writer(path, step=s, timeout=20) for s in (1, 2, 3)]
    started = time.monotonic()
    dcp.save({"w": torch.full((4,), 1.0)}, storage_writer=writers[0], no_dist=True)
    fut = dcp.async_save({"w": torch.full((4,), 2.0)}, storage_writer=writers[1], no_dist=True)
    dcp.save({"w": torch.full((4,), 3.0)}, storage_writer=writers[2], no_dist=True)
    fut.result()
    assert time.monotonic() - started < 15  # not the 20 s timeout
    reader = ckpt.open(path)
    assert reader.steps() == [1, 2, 3]
    assert [reader.tensors(s)["w"].unique().tolist() for s in (1, 2, 3)] == [[1.0], [2.0], [3.0]]


def test_a_writer_saves_once(tmp_path, fresh_line):
    """A second save through the same Writer is refused by name (it would have no place in the
    order of the process's saves), and nothing of it is stored."""
    path = str(tmp_path / "run")
    writer = ckpt.dcp.Writer(path, step=1)
    dcp.save({"w": torch.ones(4)}, storage_writer=writer, no_dist=True)
    with pytest.raises(CheckpointException) as info:
        dcp.save({"w": torch.zeros(4)}, storage_writer=writer, no_dist=True)
    assert "used for a save already" in str(info.value)
    assert ckpt.open(path).tensors(1)["w"].tolist() == [1.0] * 4
