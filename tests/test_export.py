"""Exports as a user meets them (issues 32 and 33): the files they write are readable as any file the
user writes, missing folders are made, and names the target format cannot hold are refused with
the real reason. Real checkpoints, real files, read back by safetensors, torch and DCP."""

from __future__ import annotations

import os
import stat

import pytest
import torch
from safetensors.torch import load_file

import ckpt

EXPORTS = [("model.safetensors", {}), ("model.pt", {}), ("hf", {"format": "hf"}),
           ("hf-sharded", {"format": "hf", "max_shard_size": "100B"}), ("dcp", {"format": "dcp"})]


def small_step(ckdir: str) -> None:
    with ckpt.Checkpointer(ckdir) as c:
        c.save(1, {"model": {"a.weight": torch.arange(40.0), "b.weight": torch.ones(30)},
                   "optim": {"exp_avg": torch.zeros(40)}, "step": 1})


def written_files(path: str) -> list[str]:
    if os.path.isdir(path):
        return [os.path.join(path, f) for f in os.listdir(path)]
    return [path]


@pytest.fixture
def umask_027():
    old = os.umask(0o027)
    yield
    os.umask(old)


def test_exported_files_follow_the_umask(ckdir, tmp_path, umask_027):
    """Issue 33.7: safetensors wrote 0600 files (the index 0644): a serving user could not read them."""
    small_step(ckdir)
    r = ckpt.open(ckdir)
    for name, kw in EXPORTS:
        r.export(1, tmp_path / name, **kw)
        files = written_files(str(tmp_path / name))
        assert files
        for f in files:
            assert stat.S_IMODE(os.stat(f).st_mode) == 0o640, (f, oct(os.stat(f).st_mode))
    os.umask(0o022)
    r.export(1, tmp_path / "open.safetensors")
    assert stat.S_IMODE(os.stat(tmp_path / "open.safetensors").st_mode) == 0o644


def test_export_creates_missing_parent_directories(ckdir, run, tmp_path):
    """Issue 33.10: --to a/b/model.safetensors made the user create a/b/ first."""
    small_step(ckdir)
    for name, kw in EXPORTS:
        to = tmp_path / "a" / name / "b" / name
        args = ["--format", kw["format"]] if "format" in kw else []
        rc, out, err = run("export", ckdir, "--to", to, *args)
        assert rc == 0 and out.startswith(f"wrote {to}"), err
        got = written_files(str(to))
        assert got and all(os.path.isfile(f) for f in got)
    assert set(load_file(tmp_path / "a" / "model.safetensors" / "b" / "model.safetensors")) == {
        "model/a.weight", "model/b.weight", "optim/exp_avg"}

    # a parent that is a file is refused before anything is made; a failed export leaves no new folder
    (tmp_path / "plain").write_text("x")
    rc, _, err = run("export", ckdir, "--to", tmp_path / "plain" / "sub" / "m.pt")
    assert rc == 2 and "plain is not a directory" in err
    rc, _, err = run("export", ckdir, "--to", tmp_path / "new" / "deeper" / "m.pt", "--keys", "nothing/")
    assert rc == 2 and not (tmp_path / "new").exists()


def test_names_the_target_format_cannot_hold_are_refused_with_the_reason(ckdir, run, tmp_path):
    """Issue 32.13: a tensor named __metadata__ made a safetensors file nothing reads back, and a
    dotted-name clash on DCP export was reported as a full or unwritable disk."""
    with ckpt.Checkpointer(ckdir) as c:
        c.save(1, {"__metadata__": torch.ones(2), "model": {"a.b": torch.ones(3), "a": {"b": torch.zeros(3)}},
                   "cfg": {"x.y": 1, "w": torch.ones(1)}, "cfg.x": {"y": 2}})
    for name, fmt in (("m.safetensors", []), ("hf", ["--format", "hf", "--keys", "__metadata__"])):
        rc, _, err = run("export", ckdir, "--to", tmp_path / name, *fmt)
        assert rc == 1 and "'__metadata__'" in err and "header" in err and "writable" not in err, err
        assert not (tmp_path / name).exists()
    rc, _, err = run("export", ckdir, "--to", tmp_path / "dcp", "--format", "dcp", "--keys", "model/")
    assert rc == 1 and "'model/a.b' and 'model/a/b'" in err and "'model.a.b'" in err and "MiB free" not in err, err
    rc, _, err = run("export", ckdir, "--to", tmp_path / "dcp", "--format", "dcp", "--keys", "cfg")
    assert rc == 1 and "'cfg/x.y' and 'cfg.x/y'" in err, err
    assert not (tmp_path / "dcp").exists()

    # what the format can hold still exports, and reads back
    assert run("export", ckdir, "--to", tmp_path / "m.pt")[0] == 0
    assert set(torch.load(tmp_path / "m.pt", weights_only=True)) == {"__metadata__", "model/a.b", "model/a/b", "cfg/w"}
    assert run("export", ckdir, "--to", tmp_path / "ok.safetensors", "--keys", "model/")[0] == 0
    assert set(load_file(tmp_path / "ok.safetensors")) == {"model/a.b", "model/a/b"}
