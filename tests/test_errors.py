"""Damaged checkpoints and bad input give a clear CheckpointError, and never lose committed data."""

from __future__ import annotations

import json
import logging
import os

import pytest
import torch
from conftest import chunk_files, make_state

import ckpt
from ckpt.format import paths
from ckpt.storage.local import LocalStorage
from ckpt.testing import FaultyStorage


def _save_steps(ckdir, steps=(1, 2), **kw):
    """Saves a changing tensor at each step; returns {step: the tensor as saved}."""
    w = torch.randn(64, 1024)
    saved = {}
    with ckpt.Checkpointer(ckdir, chunk_size=64 * 1024, **kw) as c:
        for s in steps:
            w.add_(1)
            saved[s] = w.clone()
            c.save(s, {"w": w, "step": s})
    return saved


def _chunks_of(ckdir, step):
    """The chunks holding the step's tensors (not the delta bases its table also lists)."""
    m = ckpt.open(ckdir).manifest(step)
    return sorted({g.chunk for t in m.tensors for s in t.shards for g in s.segments})


def _chunk_path(ckdir, h):
    return os.path.join(ckdir, paths.chunk_key(h))


@pytest.mark.parametrize("damage", ["bitflip", "truncate", "delete", "header"])
def test_damaged_chunk_is_reported_by_name(ckdir, damage):
    _save_steps(ckdir)
    h = _chunks_of(ckdir, 2)[3]
    path = _chunk_path(ckdir, h)
    if damage == "bitflip":
        with open(path, "r+b") as f:
            f.seek(1000)
            b = f.read(1)
            f.seek(1000)
            f.write(bytes([b[0] ^ 0x10]))
    elif damage == "truncate":
        os.truncate(path, os.path.getsize(path) - 100)
    elif damage == "delete":
        os.unlink(path)
    else:
        with open(path, "r+b") as f:
            f.write(b"NOTCKPT!")
    with pytest.raises(ckpt.CorruptCheckpointError) as ei:
        ckpt.Checkpointer(ckdir).load("latest", {"w": torch.empty(64, 1024), "step": 0})
    assert ei.value.object == paths.chunk_key(h) and h in str(ei.value)
    assert "fallback=True" in str(ei.value)


def test_bitflip_in_compressed_chunk(ckdir):
    state = {"z": torch.arange(1 << 18, dtype=torch.int64)}
    with ckpt.Checkpointer(ckdir, codec="zstd") as c:
        c.save(0, state)
    (h,) = _chunks_of(ckdir, 0)
    path = _chunk_path(ckdir, h)
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2] ^= 0xFF
    open(path, "wb").write(bytes(data))
    with pytest.raises(ckpt.CorruptCheckpointError, match=h):
        ckpt.Checkpointer(ckdir).load(0, {"z": torch.empty(1 << 18, dtype=torch.int64)})


def test_fallback_loads_the_newest_good_step_and_says_so(ckdir, caplog):
    w = _save_steps(ckdir, steps=(1, 2, 3))
    os.unlink(_chunk_path(ckdir, _chunks_of(ckdir, 3)[0]))
    target = {"w": torch.empty(64, 1024), "step": 0}
    with caplog.at_level(logging.WARNING, logger="ckpt"):
        assert ckpt.Checkpointer(ckdir).load("latest", target, fallback=True) == 2
    assert target["step"] == 2 and torch.equal(target["w"], w[2])
    assert any("falling back" in r.message for r in caplog.records)
    assert any("instead of the damaged latest step 3" in r.message for r in caplog.records)


def test_corrupt_manifest(ckdir):
    _save_steps(ckdir)
    key = os.path.join(ckdir, paths.manifest_key(2))
    open(key, "wb").write(open(key, "rb").read()[:-20])
    with pytest.raises(ckpt.CorruptCheckpointError, match="not valid JSON") as ei:
        ckpt.Checkpointer(ckdir).load("latest", {"w": torch.empty(64, 1024), "step": 0})
    assert ei.value.object == paths.manifest_key(2)
    assert ckpt.Checkpointer(ckdir).load("latest", {"w": torch.empty(64, 1024), "step": 0}, fallback=True) == 1


@pytest.mark.parametrize("tamper", ["traversal", "segment_past_end", "bad_dtype", "sizes_disagree", "neg_shape"])
def test_tampered_manifest_is_refused_before_any_read(ckdir, tamper):
    _save_steps(ckdir, steps=(1,))
    path = os.path.join(ckdir, paths.manifest_key(1))
    doc = json.load(open(path))
    t = next(t for t in doc["tensors"] if t["key"] == "w")
    seg = t["shards"][0]["segments"][0]
    if tamper == "traversal":
        doc["chunks"]["../../../../etc/passwd"] = doc["chunks"][seg[0]]
        seg[0] = "../../../../etc/passwd"
    elif tamper == "segment_past_end":
        seg[1] = 10**9
    elif tamper == "bad_dtype":
        t["dtype"] = "object"
    elif tamper == "sizes_disagree":
        t["shape"][0] += 1
        t["shards"][0]["lengths"][0] += 1
    else:
        t["shape"][0] = -1
    open(path, "w").write(json.dumps(doc))
    with pytest.raises(ckpt.CorruptCheckpointError) as ei:
        ckpt.Checkpointer(ckdir).load(1, {"w": torch.empty(64, 1024), "step": 0})
    assert ei.value.object == paths.manifest_key(1)


def test_newer_format_is_refused_with_upgrade_advice(ckdir):
    _save_steps(ckdir, steps=(1,))
    path = os.path.join(ckdir, paths.manifest_key(1))
    doc = json.load(open(path))
    doc["format_version"] = 99
    open(path, "w").write(json.dumps(doc))
    with pytest.raises(ckpt.IncompatibleFormatError, match="pip install -U ckpt"):
        ckpt.Checkpointer(ckdir).load(1, {"w": torch.empty(64, 1024)})


def test_unknown_codec_is_refused(ckdir):
    _save_steps(ckdir, steps=(1,))
    path = os.path.join(ckdir, paths.manifest_key(1))
    doc = json.load(open(path))
    for v in doc["chunks"].values():
        v[2] = "lz5/1"
    open(path, "w").write(json.dumps(doc))
    with pytest.raises(ckpt.IncompatibleFormatError, match="lz5/1"):
        ckpt.Checkpointer(ckdir).load(1, {"w": torch.empty(64, 1024)})


def test_not_a_checkpoint(tmp_path):
    f = tmp_path / "file.txt"
    f.write_text("hi")
    with pytest.raises(ckpt.NotACheckpointError):
        ckpt.Checkpointer(str(f)).load("latest", {})
    bogus = tmp_path / "bogus" / "steps" / "000000000001"
    bogus.mkdir(parents=True)
    (bogus / "MANIFEST.json").write_text('{"hello": "world"}')
    with pytest.raises(ckpt.NotACheckpointError):
        ckpt.Checkpointer(str(tmp_path / "bogus")).load(1, {})


def test_missing_step_lists_what_exists(ckdir):
    _save_steps(ckdir, steps=(1, 2))
    with pytest.raises(ckpt.CheckpointNotFoundError, match=r"committed steps: 1, 2"):
        ckpt.Checkpointer(ckdir).load(7, {})


def test_empty_run_loads_nothing(ckdir):
    state = make_state()
    assert ckpt.Checkpointer(ckdir).load("latest", state) is None
    assert ckpt.Checkpointer(ckdir).steps() == [] and ckpt.Checkpointer(ckdir).latest() is None


def test_shape_and_dtype_mismatch_name_the_key(ckdir):
    with ckpt.Checkpointer(ckdir) as c:
        c.save(0, {"a": torch.zeros(3, 4), "b": torch.zeros(5)})
    before = torch.full((4, 3), 2.0)
    with pytest.raises(ckpt.StateMismatchError, match=r"a: checkpoint has float32\(3, 4\), state has float32\(4, 3\)"):
        ckpt.Checkpointer(ckdir).load(0, {"a": before, "b": torch.zeros(5)})
    assert torch.equal(before, torch.full((4, 3), 2.0))  # nothing was touched
    with pytest.raises(ckpt.StateMismatchError, match=r"b: checkpoint has float32\(5\), state has float64\(5\)"):
        ckpt.Checkpointer(ckdir).load(0, {"a": torch.zeros(3, 4), "b": torch.zeros(5, dtype=torch.float64)})


def test_strict_and_non_strict_keys(ckdir):
    m = torch.nn.Linear(4, 4)
    with ckpt.Checkpointer(ckdir) as c:
        c.save(0, {"model": m, "extra": 1})
    bigger = torch.nn.Sequential()
    bigger.add_module("weight_holder", torch.nn.Linear(4, 4))
    with pytest.raises(ckpt.StateMismatchError, match="missing from the checkpoint") as ei:
        ckpt.Checkpointer(ckdir).load(0, {"model": torch.nn.Linear(4, 4), "other": torch.zeros(1)})
    assert "in the checkpoint but not in the state: ['extra']" in str(ei.value)
    assert "strict=False" in str(ei.value)
    target = {"model": torch.nn.Linear(4, 4), "other": torch.zeros(1)}
    ckpt.Checkpointer(ckdir).load(0, target, strict=False)
    assert torch.equal(target["model"].weight, m.weight) and "extra" not in target


def test_unsupported_values_need_pickle_opt_in(ckdir, tmp_path):
    class Custom:
        def __init__(self, x):
            self.x = x

    with pytest.raises(ckpt.UnsupportedValueError, match=r"at 'cfg/obj'.*allow_pickle=True"):
        ckpt.Checkpointer(ckdir).save(0, {"cfg": {"obj": Custom(1)}})

    import datetime
    with ckpt.Checkpointer(ckdir, allow_pickle=True) as c:
        c.save(0, {"when": datetime.date(2020, 1, 2)})
    with pytest.raises(ckpt.UnsupportedValueError, match="allow_pickle=True"):
        ckpt.Checkpointer(ckdir).load(0, {"when": None})
    target = {"when": None}
    ckpt.Checkpointer(ckdir).load(0, target, allow_pickle=True)
    assert target["when"] == datetime.date(2020, 1, 2)


def test_bad_options_fail_before_io(tmp_path):
    for kw in [{"keep_last": 0}, {"chunk_size": 10}, {"busy": "later"}, {"codec": "lz4"}, {"codec": "zstd:99"},
               {"io_threads": 0}]:
        with pytest.raises(ckpt.ConfigError):
            ckpt.Checkpointer(str(tmp_path / "x"), **kw)
    assert not (tmp_path / "x").exists()
    c = ckpt.Checkpointer(str(tmp_path / "x"))
    for bad_step in (-1, 1.5, "3", True):
        with pytest.raises(ckpt.ConfigError):
            c.save(bad_step, {})
    with pytest.raises(ckpt.ConfigError):
        c.save(1, [torch.ones(1)])
    c.close()


def test_committed_steps_are_never_overwritten(ckdir):
    w = _save_steps(ckdir, steps=(1,))[1]
    c = ckpt.Checkpointer(ckdir)
    h = c.save(1, {"w": torch.zeros(64, 1024), "step": 99})
    with pytest.raises(ckpt.StepExistsError, match="never overwritten"):
        h.wait()
    with pytest.raises(ckpt.StepExistsError):
        c.save(1, {"w": w})  # this Checkpointer already tried step 1
    c.close()  # the failure was seen through the handle: close() does not raise it again
    target = {"w": torch.empty(64, 1024), "step": 0}
    ckpt.Checkpointer(ckdir).load(1, target)
    assert torch.equal(target["w"], w) and target["step"] == 1


def test_storage_failure_reaches_handle_and_close(tmp_path):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("x")
    c = ckpt.Checkpointer(str(blocker / "ck"))
    h = c.save(1, {"w": torch.ones(10)})
    err = h.exception() if h.done() else None
    with pytest.raises(ckpt.StorageError) as ei:
        h.wait()
    assert isinstance(ei.value.__cause__, OSError)
    del err


def test_close_raises_a_failure_nobody_looked_at(tmp_path):
    disk = FaultyStorage(LocalStorage(tmp_path / "ck"))
    disk.fail("write", key=r"^chunks/", nth=1)
    c = ckpt.Checkpointer(str(tmp_path / "ck"), storage=disk, on_save_error="log")
    c.save(1, {"w": torch.ones(10)}).settle()  # let save 1 finish (and fail) without looking at its error
    c.save(2, {"w": torch.ones(10) * 2})  # a later save must not swallow the earlier failure (only logged here)
    with pytest.raises(ckpt.StorageError, match="injected"):
        c.close()
    assert ckpt.Checkpointer(str(tmp_path / "ck")).steps() == [2]


def test_a_failed_background_save_is_raised_at_the_next_save_and_said_once(tmp_path, caplog):
    """Issue 33 item 2: a save that failed in the background reached the caller only at close(), days
    later; every save() in between returned as if all was well. Now the next save() raises it (saving
    nothing), the caller retries, and the failure is printed once (raised, not also logged as an error)."""
    disk = FaultyStorage(LocalStorage(tmp_path / "ck"))
    disk.fail("write", key=r"^chunks/", nth=1)
    c = ckpt.Checkpointer(str(tmp_path / "ck"), storage=disk)
    h1 = c.save(1, {"w": torch.ones(10)})
    h1.settle()  # it failed in the background; nobody looked
    assert h1.stage == "failed" and "failed" in repr(h1)
    with caplog.at_level(logging.INFO, logger="ckpt"):
        with pytest.raises(ckpt.StorageError, match=r"injected.*step 1 failed in the background.*step 2 was not saved"):
            c.save(2, {"w": torch.ones(10) * 2})
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text  # raised: not logged too
    h2 = c.save(2, {"w": torch.ones(10) * 2})  # the retry saves
    assert h2.wait().step == 2 and "committed" in repr(h2)
    c.close()  # the failure was seen: nothing left to raise
    assert ckpt.Checkpointer(str(tmp_path / "ck")).steps() == [2]


def test_on_save_error_log_goes_on_and_logs_each_failure_once(tmp_path, caplog):
    with pytest.raises(ckpt.ConfigError, match="on_save_error"):
        ckpt.Checkpointer(str(tmp_path / "x"), on_save_error="ignore")
    disk = FaultyStorage(LocalStorage(tmp_path / "ck"))
    disk.fail("write", key=r"^chunks/", nth=1)
    c = ckpt.Checkpointer(str(tmp_path / "ck"), storage=disk, on_save_error="log")
    with caplog.at_level(logging.INFO, logger="ckpt"):
        c.save(1, {"w": torch.ones(10)}).settle()
        c.save(2, {"w": torch.ones(10) * 2}).wait()  # goes on
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and errors[0].startswith("saving step 1 failed"), errors
    with pytest.raises(ckpt.StorageError, match="injected"):
        c.close()


def test_a_failed_save_does_not_block_the_next(tmp_path):
    disk = FaultyStorage(LocalStorage(tmp_path / "ck"))
    disk.fail("write", key=r"^chunks/", nth=1)
    c = ckpt.Checkpointer(str(tmp_path / "ck"), storage=disk)
    h1 = c.save(1, {"w": torch.ones(10)})
    with pytest.raises(ckpt.StorageError, match="injected"):
        h1.wait()
    h2 = c.save(2, {"w": torch.ones(10)})
    h2.wait()
    assert c.steps() == [2]
    assert disk.failed["create"] == 1  # new chunks are created (a "write" rule matches creates too)
    c.save(1, {"w": torch.ones(10) * 3}).wait()  # the failed step can be retried under its own number
    assert c.steps() == [1, 2]
    c.close()
    assert chunk_files(str(tmp_path / "ck"))


def test_storage_is_injected_instead_of_opened(tmp_path):
    with pytest.raises(ckpt.ConfigError, match="local_dir"):
        ckpt.Checkpointer(str(tmp_path), storage=LocalStorage(tmp_path), local_dir=str(tmp_path / "nvme"))
    with pytest.raises(ckpt.ConfigError, match="storage_options"):
        ckpt.Checkpointer(str(tmp_path), storage=LocalStorage(tmp_path), storage_options={})


@pytest.mark.parametrize("layout", ["local_dir inside", "path inside", "through a symlink", "file URL"])
def test_a_local_dir_nested_with_the_checkpoint_path_is_refused(tmp_path, layout):
    """Issue 24 item 23: each tier lists and collects everything under its directory, so a local_dir
    inside the checkpoint path (or around it) had one tier's files taken for the other's checkpoint
    objects. Refused at construction, before anything is created; real paths are compared."""
    run = tmp_path / "run"
    path, local, why = str(run), str(run / "stage"), "local_dir is inside the checkpoint path"
    if layout == "path inside":
        path, local, why = str(tmp_path / "nvme" / "run"), str(tmp_path / "nvme"), "checkpoint path is inside local_dir"
    elif layout == "through a symlink":  # the link hides that the stage is under the run
        run.mkdir()
        os.symlink(run, tmp_path / "link")
        local = str(tmp_path / "link" / "stage")
    elif layout == "file URL":
        path = f"file://{run}"
    with pytest.raises(ckpt.ConfigError, match=why + r".*beside the checkpoint path"):
        ckpt.Checkpointer(path, local_dir=local)
    assert not os.path.exists(run / "stage") and not os.path.exists(tmp_path / "nvme")
    ckpt.Checkpointer(str(run), local_dir=str(tmp_path / "run-stage")).close()  # a sibling sharing a prefix is fine


def test_chunk_directory_removed_between_saves(ckdir):
    import shutil
    c = ckpt.Checkpointer(ckdir)
    c.save(1, {"w": torch.randn(1000)}).wait()
    shutil.rmtree(os.path.join(ckdir, "chunks"))  # e.g. an operator cleaning up by hand
    c.save(2, {"w": torch.randn(1000)}).wait()  # new data: written again, directories recreated
    c.close()
    assert ckpt.Checkpointer(ckdir).load(2, {"w": torch.empty(1000)}) == 2
