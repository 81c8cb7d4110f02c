"""What a new user meets first: reading checkpoints from Python, loads that fail cleanly, clear logs
and messages, exports that load as they are, and a Lightning fit that never loses its last steps."""

from __future__ import annotations

import logging
import os
import pathlib

import pytest
import torch
from conftest import chunk_files, tensor_entry

import ckpt
from ckpt import cli

ROOT = pathlib.Path(__file__).resolve().parent.parent
CHUNK = 64 * 1024


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


# -- 1, 2. ckpt.open, and exports that load_state_dict takes as they are ------------------------------------

def test_open_reads_steps_tensors_values_and_checks(ckdir, tmp_path):
    from safetensors.torch import load_file

    model = _model()
    with ckpt.Checkpointer(ckdir, allow_pickle=True) as c:
        c.save(1, {"model": model, "step": 1, "cfg": {"lr": 0.1, "when": pathlib.PurePosixPath("/x")}})
        with torch.no_grad():
            model[0].weight.add_(1)
        c.save(2, {"model": model, "step": 2, "cfg": {"lr": 0.05, "when": pathlib.PurePosixPath("/x")}})
    with ckpt.open(ckdir) as ck:
        assert ck.steps() == [1, 2] and ck.latest() == 2 and ck.manifest().step == 2
        weights = ck.tensors(keys="model/")
        assert set(weights) == {f"model/{k}" for k in model.state_dict()}
        assert all(torch.equal(weights[f"model/{k}"], v) for k, v in model.state_dict().items())
        assert set(ck.tensors(1, keys=["model/0.bias"])) == {"model/0.bias"}  # only what was asked is read
        values = ck.values(1)
        assert values["step"] == 1 and values["cfg/lr"] == 0.1
        assert values["cfg/when"] == ckpt.Pickled("cfg/when")  # never unpickled
        assert ck.verify(all=True).ok
        d = ck.diff(1, 2)
        changed = {c.key for c in d.tensors if c.status == "changed"}
        assert changed == {"model/0.weight"} and not d.identical and ("step", "1", "2") in d.values
        out = tmp_path / "model.safetensors"
        res = ck.export(2, out, keys="model/", strip_prefix=True)
        assert set(res.tensors) == set(model.state_dict())
    fresh = _model(seed=5)
    fresh.load_state_dict(load_file(out))  # the names are the module's own
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in model.state_dict().items())
    with pytest.raises(ckpt.NotACheckpointError):
        ckpt.open(tmp_path / "nothing")


def test_values_that_hold_arrays_are_read_with_them(ckdir):
    """numpy's RNG state is a tuple with an array inside; a per-rank value's arrays are its rank's."""
    import numpy as np

    np.random.seed(3)
    with ckpt.Checkpointer(ckdir) as c:
        c.save(1, {"rng": ckpt.RNGState()})
    with ckpt.open(ckdir) as ck:
        for name, values in (("rng[rank 0]/numpy", ck.values(1)), ("rng/numpy", ck.values(1, rank=0))):
            kind, keys, *_ = values[name]
            assert kind == "MT19937" and np.array_equal(keys, np.random.get_state()[1])


def test_export_strip_prefix_on_the_command_line(ckdir, tmp_path, capsys):
    model = _model()
    with ckpt.Checkpointer(ckdir) as c:
        c.save(1, {"model": model, "optim": torch.optim.Adam(model.parameters())})
    out = str(tmp_path / "m.pt")
    assert cli.main(["export", ckdir, "--to", out, "--keys", "model/", "--strip-prefix"]) == 0
    _model(seed=3).load_state_dict(torch.load(out, weights_only=True))
    assert cli.main(["export", ckdir, "--to", str(tmp_path / "x.pt"), "--strip-prefix"]) == 2
    assert "needs --keys" in capsys.readouterr().err


# -- 3. a load that fails midway ---------------------------------------------------------------------------

def _values(s: int) -> torch.Tensor:
    return torch.arange(16 * CHUNK // 4, dtype=torch.float32) + 1e6 * s  # every chunk different


def _two_steps(ckdir: str) -> dict:
    with ckpt.Checkpointer(ckdir, chunk_size=CHUNK, codec="raw") as c:
        for s in (1, 2):
            c.save(s, {"w": _values(s), "step": s}).wait()
        h = tensor_entry(c.manifest(2), "w").shards[0].segments[-1].chunk
    with open(os.path.join(ckdir, "chunks", h[:2], h), "r+b") as f:  # step 2's last chunk is damaged
        f.seek(200)
        f.write(b"\xff\xff")
    return {"w": torch.zeros(16 * CHUNK // 4), "step": 0}


@pytest.mark.parametrize("mid_run", [False, True])
def test_a_failed_load_changes_nothing(ckdir, mid_run):
    """Every chunk is read and checked in staging memory before any tensor is written (mid-run: the
    idle host buffer is that memory); the state stays as it was and saving goes on."""
    state = _two_steps(ckdir)
    state["w"] += 7.0
    before = state["w"].clone()
    c = ckpt.Checkpointer(ckdir, chunk_size=CHUNK, io_threads=1)
    if mid_run:
        c.save(3, state).wait()  # its host buffer is the load's staging memory; its delta base is gone
    with pytest.raises(ckpt.CorruptCheckpointError) as e:
        c.load(2, state)
    assert "partly overwritten" not in str(e.value)
    assert torch.equal(state["w"], before) and state["step"] == 0  # not one chunk landed
    state["w"] += 1.0
    c.save(4, state).wait()  # no PartialStateError: the state is whole
    got = {"w": torch.zeros(16 * CHUNK // 4), "step": -1}
    assert c.load(4, got) == 4 and torch.equal(got["w"], before + 1.0) and got["step"] == 0
    assert c.load(1, state) == 1 and torch.equal(state["w"], _values(1)) and state["step"] == 1
    c.close()


def test_strided_targets_are_filled_only_once_every_chunk_checked_out(ckdir):
    """A strided (transposed) target is read through a CPU stand-in like a device tensor: left as it
    was when another tensor's chunk is damaged, filled when all is well."""
    b = torch.arange(32 * 1024, dtype=torch.float32).reshape(256, 128)
    with ckpt.Checkpointer(ckdir, chunk_size=CHUNK, codec="raw") as c:
        c.save(1, {"a": _values(1), "b": b}).wait()
        h = tensor_entry(c.manifest(1), "a").shards[0].segments[-1].chunk
    target = {"a": torch.zeros(16 * CHUNK // 4), "b": torch.zeros(128, 256).t()}
    assert not target["b"].is_contiguous()
    assert ckpt.Checkpointer(ckdir).load(1, target) == 1 and torch.equal(target["b"], b)
    target = {"a": torch.zeros(16 * CHUNK // 4), "b": torch.zeros(128, 256).t()}
    with open(os.path.join(ckdir, "chunks", h[:2], h), "r+b") as f:
        f.seek(200)
        f.write(b"\xff\xff")
    with pytest.raises(ckpt.CorruptCheckpointError):
        ckpt.Checkpointer(ckdir).load(1, target)
    assert not target["a"].any() and not target["b"].any()


def test_a_half_loaded_state_is_never_saved_silently(ckdir):
    state = _two_steps(ckdir)
    c = ckpt.Checkpointer(ckdir, chunk_size=CHUNK, io_threads=1, staged_load=False)
    with pytest.raises(ckpt.CorruptCheckpointError, match="partly overwritten") as e:
        c.load(2, state)
    assert str(e.value).startswith("step 2:")  # the error names the step
    assert (state["w"] == _values(2)).any()  # some chunks landed before the damaged one: a mixture
    with pytest.raises(ckpt.PartialStateError, match="accept_state"):
        c.save(3, state)
    assert c.load(1, state) == 1 and torch.equal(state["w"], _values(1))  # loading again makes it whole
    c.save(3, state).wait()
    c.close()


def test_accept_state_saves_a_half_loaded_state_on_purpose(ckdir):
    state = _two_steps(ckdir)
    c = ckpt.Checkpointer(ckdir, chunk_size=CHUNK, io_threads=1, staged_load=False)
    with pytest.raises(ckpt.CorruptCheckpointError):
        c.load("latest", state)
    c.accept_state()
    c.save(3, state).wait()
    c.close()


def test_a_load_refused_by_its_checks_changes_nothing_and_saving_goes_on(ckdir):
    state = _two_steps(ckdir)
    c = ckpt.Checkpointer(ckdir)
    with pytest.raises(ckpt.StateMismatchError):
        c.load(1, {"w": torch.zeros(3), "step": 0})
    c.save(3, state).wait()  # nothing was changed: no reason to refuse
    c.close()


def _adamw_step(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    net = _model(seed)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    net(torch.randn(4, 8)).sum().backward()
    opt.step()
    return net, opt


def test_strict_refuses_another_kind_of_optimizer_before_changing_anything(ckdir, caplog):
    net, opt = _adamw_step()
    with ckpt.Checkpointer(ckdir) as c:
        c.save(1, {"model": net, "optim": opt}).wait()
    net2 = _model(1)
    sgd = torch.optim.SGD(net2.parameters(), lr=0.1, momentum=0.9)
    before = [p.clone() for p in net2.parameters()]
    with pytest.raises(ckpt.StateMismatchError) as e:
        ckpt.Checkpointer(ckdir).load(1, {"model": net2, "optim": sgd})
    msg = str(e.value)
    assert "torch.optim.adamw.AdamW" in msg and "torch.optim.sgd.SGD" in msg and "momentum" in msg
    assert all(torch.equal(a, b) for a, b in zip(before, net2.parameters()))  # the model was not loaded either
    assert "momentum" in sgd.param_groups[0] and not sgd.state
    # the same kind loads; strict=False loads another kind, with a warning naming both
    adamw = torch.optim.AdamW(net2.parameters())
    assert ckpt.Checkpointer(ckdir).load(1, {"model": net2, "optim": adamw}) == 1
    assert adamw.state_dict()["param_groups"][0]["lr"] == 1e-2
    class MyAdamW(torch.optim.AdamW):  # a subclass takes its base class's state, strict or not
        pass
    mine = MyAdamW(net2.parameters())
    assert ckpt.Checkpointer(ckdir).load(1, {"model": net2, "optim": mine}) == 1 and mine.state
    with caplog.at_level(logging.WARNING, logger="ckpt"):
        adam = torch.optim.Adam(net2.parameters())
        assert ckpt.Checkpointer(ckdir).load(1, {"model": net2, "optim": adam}, strict=False) == 1
    assert "AdamW optimizer, this is a torch.optim.adam.Adam" in caplog.text


def test_another_kind_of_optimizer_loaded_non_strictly_keeps_its_own_hyperparameters(ckdir, caplog):
    """Issue 33 item 10: AdamW's state loaded into SGD with strict=False replaced SGD's param groups
    (lr 0.1 -> 0.01, momentum gone, betas added) with only a log line, and SGD's next step failed or
    trained at AdamW's settings. The target keeps its hyperparameters, and the log says so."""
    net, opt = _adamw_step()
    with ckpt.Checkpointer(ckdir) as c:
        c.save(1, {"model": net, "optim": opt})
    net2 = _model(1)
    sgd = torch.optim.SGD(net2.parameters(), lr=0.1, momentum=0.9, nesterov=True)
    before = [{k: v for k, v in g.items() if k != "params"} for g in sgd.param_groups]
    with caplog.at_level(logging.WARNING, logger="ckpt"):
        assert ckpt.Checkpointer(ckdir).load(1, {"model": net2, "optim": sgd}, strict=False) == 1
    assert [{k: v for k, v in g.items() if k != "params"} for g in sgd.param_groups] == before
    assert sgd.param_groups[0]["params"] == list(net2.parameters())
    assert "keeping this optimizer's own hyperparameters" in caplog.text
    assert all(torch.equal(a, b) for a, b in zip(net.parameters(), net2.parameters()))  # the model loaded
    net2(torch.randn(4, 8)).sum().backward()
    sgd.step()  # trains on with SGD's own settings


def test_the_fallback_hint_is_given_once(ckdir):
    state = _two_steps(ckdir)
    with pytest.raises(ckpt.CorruptCheckpointError) as e:
        ckpt.Checkpointer(ckdir).load("latest", state)
    assert str(e.value).count("fallback=True") == 1 and "step 2" in str(e.value)
    assert ckpt.Checkpointer(ckdir).load("latest", state, fallback=True) == 1


# -- 4. logs that say what happened -----------------------------------------------------------------------

def test_logs_say_fresh_start_and_resume(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="ckpt")
    path = str(tmp_path / "new")
    assert ckpt.Checkpointer(path).load("latest", {"w": torch.zeros(3)}) is None
    # nothing at the path at all: a warning (a typo must not pass for a new run)
    assert f"starting fresh: nothing at {path}" in caplog.text
    assert any(r.levelno == logging.WARNING and "starting fresh" in r.getMessage() for r in caplog.records)
    with ckpt.Checkpointer(path) as c:
        c.save(7, {"w": torch.ones(3)})
    caplog.clear()
    ckpt.Checkpointer(path).load("latest", {"w": torch.zeros(3)})
    assert f"resumed from step 7 of {path} (" in caplog.text and "read and verified" in caplog.text


def test_a_bucket_that_does_not_exist_is_an_error_not_a_new_run(moto_server):
    import time

    from conftest import fast

    t0 = time.monotonic()
    with pytest.raises(ckpt.StorageError, match="bucket 'no-such-bucket' does not exist"):
        ckpt.Checkpointer("s3://no-such-bucket/run", storage_options=fast(moto_server.endpoint)).load(
            "latest", {"w": torch.zeros(3)})
    assert time.monotonic() - t0 < 10


# -- 8. identical chunks of one save are written once -----------------------------------------------------

def test_identical_chunks_of_one_save_are_written_once(ckdir):
    same = torch.full((CHUNK // 4,), 3.0)
    with ckpt.Checkpointer(ckdir, chunk_size=CHUNK, codec="raw") as c:
        h = c.save(1, {"a": same.clone(), "b": same.clone(), "c": same.clone()})
        h.wait()
        assert h.metrics.chunks == 1 and h.metrics.chunks_written == 1
    assert len(chunk_files(ckdir)) == 1
    got = {"a": torch.zeros(CHUNK // 4), "b": torch.zeros(CHUNK // 4), "c": torch.zeros(CHUNK // 4)}
    ckpt.Checkpointer(ckdir).load(1, got)
    assert all(torch.equal(v, same) for v in got.values())


# -- 9. verify names only the steps a damaged object touches ------------------------------------------------

def test_verify_names_only_the_damaged_steps(ckdir, capsys):
    with ckpt.Checkpointer(ckdir, chunk_size=CHUNK, codec="raw") as c:
        c.save(1, {"w": torch.ones(CHUNK // 4)})
        c.save(2, {"w": torch.ones(CHUNK // 4), "x": torch.full((CHUNK // 4,), 2.0)})
        c.save(3, {"w": torch.ones(CHUNK // 4)}).wait()
        h = tensor_entry(c.manifest(2), "x").shards[0].segments[0].chunk
    os.unlink(os.path.join(ckdir, "chunks", h[:2], h))
    assert cli.main(["verify", ckdir, "--all"]) == 1
    err = capsys.readouterr().err
    assert "used by step(s) 2;" in err and "step(s) 1, 3 verified clean" in err
    assert "ckpt verify" not in err


# -- 7. the files a package is expected to carry -------------------------------------------------------------

def test_license_changelog_and_type_marker_ship():
    assert "Apache License" in (ROOT / "LICENSE").read_text() and "Version 2.0" in (ROOT / "LICENSE").read_text()
    assert ckpt.__version__ in (ROOT / "CHANGELOG.md").read_text()
    assert (ROOT / "ckpt" / "py.typed").is_file()
    assert 'ckpt = ["py.typed"]' in (ROOT / "pyproject.toml").read_text()
