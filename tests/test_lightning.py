"""ckpt.lightning with a real lightning.Trainer on CPU: the callback, the CheckpointIO plugin, resume."""

from __future__ import annotations

import logging
import os
import pathlib
import shutil
import signal
import subprocess
import sys

import pytest
import torch

L = pytest.importorskip("lightning")

from conftest import GatedDisk  # noqa: E402
from lightning_child import Batches, Tiny  # noqa: E402

import ckpt  # noqa: E402
from ckpt.lightning import AsyncCheckpoint, CkptCheckpointIO, load_checkpoint  # noqa: E402
from ckpt.save import cuda_snapshot  # noqa: E402
from ckpt.save.snapshot import Snapshotter  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
ModelCheckpoint = L.pytorch.callbacks.ModelCheckpoint


def child_env() -> dict:
    # the child must import this checkout's ckpt, not whatever is installed
    return {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}


def run_child(ckdir: str, out: str, max_steps: int) -> dict:
    subprocess.run([sys.executable, "lightning_child.py", ckdir, out, str(max_steps)], cwd=HERE, env=child_env(),
                   check=True, capture_output=True, timeout=120)
    return torch.load(out)


def trainer(max_steps: int, callbacks=(), plugins=None, **kw) -> L.Trainer:
    return L.Trainer(accelerator="cpu", max_steps=max_steps, callbacks=list(callbacks), plugins=plugins, logger=False,
                     enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, **kw)


def assert_equal_nested(a, b, where="") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            assert_equal_nested(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_equal_nested(x, y, f"{where}/{i}")
    else:
        assert a == b, where


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An uninterrupted 30-step run (2.5 epochs, saving every 4 steps)."""
    d = tmp_path_factory.mktemp("ref")
    return run_child(str(d / "ck"), str(d / "final.pt"), 30)


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("block_at", [10, 14])  # newest commit mid-epoch (8), or at the epoch's last batch (12)
def test_killed_fit_resumes_bit_exact(tmp_path, reference, block_at):
    ck = str(tmp_path / "ck")
    proc = subprocess.Popen([sys.executable, "lightning_child.py", ck, str(tmp_path / "unused.pt"), "30",
                             "--block-at", str(block_at)], cwd=HERE, env=child_env(), stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        line = proc.stdout.readline()  # the child waits for its saves to commit, says so, then blocks
        kind, _, step = line.partition(" ")
        assert kind == "committed", f"child died early: {line!r}"
        committed = int(step)
        assert os.path.exists(os.path.join(ck, "steps", f"{committed:012d}", "MANIFEST.json"))
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    assert proc.returncode == -signal.SIGKILL
    assert committed == block_at // 4 * 4

    resumed = run_child(ck, str(tmp_path / "final.pt"), 30)
    assert resumed["resumed_step"] == committed
    assert resumed["global_step"] == reference["global_step"] == 30
    assert_equal_nested(reference["model"], resumed["model"], "model")
    assert_equal_nested(reference["optim"], resumed["optim"], "optim")
    assert_equal_nested(reference["sched"], resumed["sched"], "sched")
    assert reference["optim"]["state"][0]["step"].item() == 30  # the comparison covers the whole run


@pytest.mark.multiprocess
@pytest.mark.slow
def test_sigterm_saves_at_the_batch_end_stops_the_fit_and_resumes_bit_exact(tmp_path, reference):
    ck = str(tmp_path / "ck")
    r = subprocess.run([sys.executable, "lightning_child.py", ck, str(tmp_path / "unused.pt"), "30",
                        "--sigterm-at", "9"], cwd=HERE, env=child_env(), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr  # stopped, not killed by the signal
    assert "ckpt: preempted: step 10 committed" in r.stderr + r.stdout
    assert not os.path.exists(tmp_path / "unused.pt")  # Lightning ended the fit (its SIGTERMException)
    assert ckpt.open(ck).steps() == [8, 10]  # every 4, plus the batch the signal arrived in

    resumed = run_child(ck, str(tmp_path / "final.pt"), 30)
    assert resumed["resumed_step"] == 10
    assert_equal_nested(reference["model"], resumed["model"], "model")
    assert_equal_nested(reference["optim"], resumed["optim"], "optim")


def test_fit_twice_resume_in_new_trainer_and_teardown_waits(tmp_path):
    url = str(tmp_path / "ck")
    torch.manual_seed(0)
    saver = AsyncCheckpoint(url, every_n_train_steps=2, keep_last=2)
    t = trainer(6, [saver])
    model = Tiny()
    t.fit(model, Batches())
    assert saver.checkpointer is None and all(h.done() for h in saver.handles)  # teardown waited, then closed
    assert ckpt.open(url).steps() == [4, 6]

    t.fit_loop.epoch_loop.max_steps = 10  # the same trainer again: carries on from memory, saves the next steps
    t.fit(model, Batches())
    assert saver.resumed_step is None and t.global_step == 10
    assert ckpt.open(url).steps() == [8, 10]

    # a new process would do this: a fresh trainer and model resume from step 10 on their own
    saver2 = AsyncCheckpoint(url, every_n_train_steps=2)
    model2 = Tiny()
    assert not torch.equal(model2.net[0].weight, model.net[0].weight)
    t2 = trainer(10, [saver2])
    t2.fit(model2, Batches())
    assert saver2.resumed_step == 10 and t2.global_step == 10
    assert_equal_nested(model.state_dict(), model2.state_dict())
    assert_equal_nested(t.optimizers[0].state_dict(), t2.optimizers[0].state_dict())
    assert ckpt.open(url).steps() == [8, 10]  # nothing saved twice


def test_fit_ckpt_path_may_name_a_ckpt_step(tmp_path):
    url = str(tmp_path / "ck")
    t = trainer(8, [AsyncCheckpoint(url, every_n_train_steps=4)])
    t.fit(Tiny(), Batches())
    at4 = load_checkpoint(os.path.join(url, "steps", f"{4:012d}"))
    assert at4["global_step"] == 4 and load_checkpoint(url)["global_step"] == 8

    model = Tiny()
    saver = AsyncCheckpoint(url, every_n_train_steps=4)
    t2 = trainer(4, [saver])  # max_steps reached at once: the model keeps what was restored
    t2.fit(model, Batches(), ckpt_path=os.path.join(url, "steps", f"{4:012d}"))
    assert saver.resumed_step is None and t2.global_step == 4  # restored by Lightning from ckpt_path
    assert_equal_nested(at4["state_dict"], model.state_dict())
    assert type(t2.strategy.checkpoint_io).__name__ == "TorchCheckpointIO"  # the resume shim is gone


def test_non_plain_values_need_allow_pickle(tmp_path):
    url = str(tmp_path / "ck")
    with pytest.raises(ckpt.UnsupportedValueError, match="allow_pickle=True to AsyncCheckpoint"):
        trainer(2, [AsyncCheckpoint(url, every_n_train_steps=2)]).fit(Tiny(extra=pathlib.PurePosixPath("/a")),
                                                                       Batches())
    assert ckpt.Checkpointer(url).steps() == []  # ckpt.open refuses a root that holds nothing
    trainer(2, [AsyncCheckpoint(url, every_n_train_steps=2, allow_pickle=True)]).fit(
        Tiny(extra=pathlib.PurePosixPath("/a")), Batches())
    with pytest.raises(ckpt.UnsupportedValueError, match="allow_pickle"):
        load_checkpoint(url)
    assert load_checkpoint(url, allow_pickle=True)["hyper_parameters"]["extra"] == pathlib.PurePosixPath("/a")


def test_options_are_checked():
    with pytest.raises(ckpt.ConfigError, match="local_dir"):
        AsyncCheckpoint("x", local_dir=3)
    with pytest.raises(ckpt.ConfigError, match="every_n_train_steps"):
        AsyncCheckpoint("x", every_n_train_steps=0)
    with pytest.raises(ckpt.ConfigError, match="does not take .'keep_last'"):
        CkptCheckpointIO(keep_last=3)
    with pytest.raises(ckpt.ConfigError, match="unknown option.*'chunksize'"):
        CkptCheckpointIO(chunksize=3)
    with pytest.raises(ckpt.ConfigError, match="chunk_size"):
        AsyncCheckpoint("x", chunk_size=3)  # every Checkpointer option is checked when the callback is made


def _fit_with_model_checkpoint(dirpath: str, plugins) -> tuple[ModelCheckpoint, L.Trainer, Tiny]:
    torch.manual_seed(0)
    mc = ModelCheckpoint(dirpath=dirpath, monitor="train_loss", save_top_k=2, every_n_train_steps=2, save_last=True)
    t = trainer(16, [mc], plugins=plugins)
    model = Tiny()
    t.fit(model, Batches())
    return mc, t, model


def test_model_checkpoint_top_k_as_with_lightnings_io(tmp_path):
    mc_ref, _, _ = _fit_with_model_checkpoint(str(tmp_path / "torch"), None)
    io = CkptCheckpointIO()
    mc, t, model = _fit_with_model_checkpoint(str(tmp_path / "ckpt"), [io])
    names = sorted(os.listdir(tmp_path / "ckpt"))
    assert names == sorted(os.listdir(tmp_path / "torch")) and len(names) == 3  # top 2 and last.ckpt
    assert os.path.basename(mc.best_model_path) == os.path.basename(mc_ref.best_model_path)
    assert sorted(map(os.path.basename, mc.best_k_models)) == sorted(map(os.path.basename, mc_ref.best_k_models))
    for name in names:  # each kept checkpoint holds what Lightning's own file holds, tensors bit-exact
        mine = load_checkpoint(tmp_path / "ckpt" / name)
        theirs = torch.load(tmp_path / "torch" / name, weights_only=False)
        for key in ("state_dict", "optimizer_states", "lr_schedulers", "loops", "global_step", "epoch"):
            assert_equal_nested(theirs[key], mine[key], key)
    assert io.pending == 0  # teardown waited for every save and removal

    # resume through the plugin; the checkpoint resumed from is never removed, even when asked
    last = mc.last_model_path
    io2 = CkptCheckpointIO()
    t2 = trainer(20, [ModelCheckpoint(dirpath=str(tmp_path / "ckpt2"), every_n_train_steps=2)], plugins=[io2])
    model2 = Tiny()
    t2.fit(model2, Batches(), ckpt_path=last)
    assert io2.resumed_from == (os.path.abspath(last), 16) and t2.global_step == 20
    io2.remove_checkpoint(last)
    io2.teardown()
    assert load_checkpoint(last)["global_step"] == 16


def test_remove_waits_for_the_save_still_being_written(tmp_path):
    disks: list[GatedDisk] = []  # every storage the plugin opens holds its chunk writes until opened

    def gated_disk(path: str) -> GatedDisk:
        disks.append(GatedDisk(path))
        return disks[-1]

    io = CkptCheckpointIO(open_storage=gated_disk)
    path = str(tmp_path / "epoch=0-step=2.ckpt")
    state = {"state_dict": {"w": torch.randn(256, 256)}, "global_step": 2}
    try:
        io.save_checkpoint(state, path)  # returns after the snapshot; the chunk write is held by the gate
        gate = disks[0]
        assert gate.entered.wait(30)
        io.remove_checkpoint(path)  # must not delete under the writer, nor block the training thread
        assert os.path.isdir(path) and not gate.chunk_gate.opened.is_set()
        gate.open()
        io.teardown()  # raises if the save failed: the write completed before the deletion
        assert not os.path.exists(path)
    finally:
        for d in disks:  # a failed test leaves no writer waiting
            d.open()


def test_saving_the_same_path_again_keeps_a_whole_checkpoint(tmp_path):
    io = CkptCheckpointIO()
    path = str(tmp_path / "last.ckpt")
    for step in (2, 2, 4):  # a repeated global step still gets its own ckpt step
        io.save_checkpoint({"state_dict": {"w": torch.full((8,), float(step))}, "global_step": step}, path)
    io.teardown()
    assert ckpt.open(path).steps() == [4]  # the older ones went only after the newest committed
    assert torch.equal(load_checkpoint(path)["state_dict"]["w"], torch.full((8,), 4.0))
    # the plugin still reads Lightning's own files
    torch.save({"global_step": 1}, tmp_path / "plain.ckpt")
    assert io.load_checkpoint(tmp_path / "plain.ckpt") == {"global_step": 1}


@pytest.mark.multiprocess
@pytest.mark.slow
def test_import_picks_lightning_then_pytorch_lightning_then_explains(tmp_path):
    code = ("import sys\n"
            "for name in sys.argv[1:]: sys.modules[name] = None\n"
            "try:\n"
            "    import ckpt.lightning as m\n"
            "    print('ok', m.LIGHTNING_PACKAGE, m.AsyncCheckpoint.__mro__[1].__module__)\n"
            "except ImportError as e: print('ImportError', e)\n")

    def run(*blocked):
        return subprocess.run([sys.executable, "-c", code, *blocked], cwd=ROOT, env=child_env(), capture_output=True,
                              text=True, timeout=120).stdout.strip()

    assert run().startswith("ok lightning.pytorch lightning.pytorch.callbacks")
    try:
        import pytorch_lightning  # noqa: F401
        assert run("lightning", "lightning.pytorch").startswith("ok pytorch_lightning pytorch_lightning.callbacks")
    except ImportError:
        pass
    out = run("lightning", "lightning.pytorch", "pytorch_lightning")
    assert out.startswith("ImportError") and "pip install" in out and "pytorch_lightning" in out


def test_a_fit_that_ends_between_saves_keeps_its_last_step_and_reports_resume(tmp_path, caplog):
    url, url2 = str(tmp_path / "ck"), str(tmp_path / "ck2")
    trainer(7, [AsyncCheckpoint(url, every_n_train_steps=3)]).fit(Tiny(), Batches())
    assert ckpt.open(url).steps() == [3, 6, 7]  # the final weights are never lost
    trainer(7, [AsyncCheckpoint(url2, every_n_train_steps=3, save_on_train_end=False)]).fit(Tiny(), Batches())
    assert ckpt.open(url2).steps() == [3, 6]
    with caplog.at_level(logging.INFO, logger="lightning.pytorch"):
        trainer(9, [AsyncCheckpoint(url, every_n_train_steps=3)]).fit(Tiny(), Batches())
    assert f"Restored all states from the checkpoint at {url} (ckpt step 7)" in caplog.text
    assert ckpt.open(url).steps() == [3, 6, 7, 9]


def test_local_commits_upload_the_last_step(tmp_path):
    """With persist_every, the callback's saves commit to local_dir; the one at the end of the fit is
    uploaded too (the node may not come back), so a resume from the checkpoint path alone gets it."""
    remote, local = str(tmp_path / "remote"), str(tmp_path / "local")
    cb = AsyncCheckpoint(remote, local_dir=local, every_n_train_steps=2, persist_every=100, keep_local=5)
    trainer(7, [cb]).fit(Tiny(), Batches())
    assert ckpt.open(remote).steps() == [2, 7]  # the first save (as every first save) and the last step
    assert ckpt.open(local).steps() == [2, 4, 6, 7]
    shutil.rmtree(local)  # the node is gone: the checkpoint path alone has the fit's last step
    assert load_checkpoint(remote)["global_step"] == 7


def test_no_modelcheckpoint_by_default_and_the_documented_line_for_enable_checkpointing_false(tmp_path):
    # the default trainer: AsyncCheckpoint is its checkpoint callback, so Lightning adds no ModelCheckpoint
    root = tmp_path / "default"
    saver = AsyncCheckpoint(str(root / "ck"), every_n_train_steps=2)
    t = trainer(4, [saver], default_root_dir=str(root))
    assert t.checkpoint_callbacks == [saver] and t.checkpoint_callback is saver
    t.fit(Tiny(), Batches())
    assert ckpt.open(str(root / "ck")).steps() == [2, 4]
    assert not list(root.rglob("*.ckpt"))  # no .ckpt files written beside it

    # enable_checkpointing=False refuses any Checkpoint in callbacks=[...] (Lightning's own check) ...
    with pytest.raises(L.pytorch.utilities.exceptions.MisconfigurationException):
        trainer(4, [AsyncCheckpoint(str(tmp_path / "x"))], enable_checkpointing=False)
    # ... and the line docs/lightning.md gives for it works: a fit that saves and resumes
    doc = (pathlib.Path(ROOT) / "docs" / "lightning.md").read_text()
    [line] = [ln for ln in doc.splitlines() if ln.startswith("trainer.callbacks.append(AsyncCheckpoint(")]
    url = str(tmp_path / "off" / "ck")
    made: list[AsyncCheckpoint] = []

    def here(_url, **kw):  # the documented call, saving under tmp_path every 2 steps
        made.append(AsyncCheckpoint(url, **{**kw, "every_n_train_steps": 2}))
        return made[-1]
    for max_steps in (4, 6):  # the second fit resumes from step 4
        made.clear()
        t = trainer(max_steps, default_root_dir=str(tmp_path / "off"), enable_checkpointing=False)
        exec(line, {"trainer": t, "AsyncCheckpoint": here})
        assert t.checkpoint_callbacks == made
        t.fit(Tiny(), Batches())
    assert made[0].resumed_step == 4 and t.global_step == 6
    assert ckpt.open(url).steps() == [2, 4, 6]  # keep_last=3, as the documented line says


# -- the optimizers handed to each save (issue 25 item 5) ---------------------------------------------
def _record_handovers(monkeypatch) -> list[tuple[set[int], tuple]]:
    """Per save: the storage addresses of the tensors it snapshots, and the optimizers handed over
    to it (ckpt.save.cuda_snapshot.guarding) while it snapshots them."""
    seen: list[tuple[set[int], tuple]] = []
    take = Snapshotter.take

    def observed(self, seq, flat, state, **kw):
        seen.append(({t.data_ptr() for t in flat.tensors.values()}, cuda_snapshot.handed_over()))
        return take(self, seq, flat, state, **kw)

    monkeypatch.setattr(Snapshotter, "take", observed)
    return seen


def _optimizer_tensors(opt: torch.optim.Optimizer) -> set[int]:
    return ({p.data_ptr() for g in opt.param_groups for p in g["params"]}
            | {t.data_ptr() for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)})


def _assert_handed_over(seen, opt) -> None:
    """Lightning's checkpoint dict holds state_dict()s, not optimizers: without the handover a save
    cannot tell which CUDA tensors only optimizer.step() changes, and the fence never arms. The
    guard keeps, of the handed-over optimizers' parameters and state, the CUDA ones (none here, on
    CPU): what it is made from must include every tensor of the trainer's optimizer, and those must
    be the very tensors the save snapshots (matched by address)."""
    assert seen
    for saved, handed in seen:
        assert any(o is opt for o in handed)
        assert _optimizer_tensors(opt) <= saved
    assert cuda_snapshot.handed_over() == ()  # only while saving


def test_async_checkpoint_hands_the_trainers_optimizers_to_each_save(tmp_path, monkeypatch):
    seen = _record_handovers(monkeypatch)
    t = trainer(4, [AsyncCheckpoint(str(tmp_path / "ck"), every_n_train_steps=2)])
    t.fit(Tiny(), Batches())
    assert len(seen) == 2
    _assert_handed_over(seen, t.optimizers[0])


def test_checkpoint_io_hands_the_stepping_optimizers_to_each_save(tmp_path, monkeypatch):
    seen = _record_handovers(monkeypatch)
    t = trainer(4, [ModelCheckpoint(dirpath=str(tmp_path / "ck"), every_n_train_steps=2)],
                plugins=[CkptCheckpointIO()])
    t.fit(Tiny(), Batches())
    _assert_handed_over(seen, t.optimizers[0])
