"""Issue 32 item 16: every boolean argument of every public call takes True or False and nothing that
only looks like one. ``load(..., allow_pickle="false")`` used to unpickle (a non-empty string is true):
the option was checked where ``Checkpointer(...)`` takes it, not where ``load()`` does."""

from __future__ import annotations

import datetime

import pytest
import torch

import ckpt
import ckpt.dcp


def pickled_checkpoint(root) -> None:
    with ckpt.Checkpointer(root, allow_pickle=True) as c:
        c.save(0, {"when": datetime.date(2020, 1, 2), "w": torch.ones(4)})


def test_load_refuses_a_string_for_allow_pickle_and_unpickles_nothing(tmp_path):
    root = tmp_path / "ck"
    pickled_checkpoint(root)
    for load in (lambda s, **kw: ckpt.Checkpointer(root).load(0, s, **kw),
                 lambda s, **kw: ckpt.open(root).load_into(s, 0, **kw)):
        target = {"when": None, "w": torch.zeros(4)}
        with pytest.raises(ckpt.ConfigError, match=r"allow_pickle must be True.*'false'.*not False"):
            load(target, allow_pickle="false")
        assert target["when"] is None and torch.equal(target["w"], torch.zeros(4))  # nothing unpickled, nothing changed


def test_every_public_boolean_argument_is_checked_alike(tmp_path):
    root = tmp_path / "ck"
    with ckpt.Checkpointer(root) as c:
        c.save(1, {"w": torch.ones(4)})
        c.save(2, {"w": torch.ones(4) * 2})
        c.wait()
        calls = {
            "strict": lambda: c.load(1, {"w": torch.zeros(4)}, strict="no"),
            "fallback": lambda: c.load(1, {"w": torch.zeros(4)}, fallback=1),
            "persist": lambda: c.save(3, {"w": torch.ones(4)}, persist="yes"),
        }
        for name, call in calls.items():
            with pytest.raises(ckpt.ConfigError, match=f"^{name} must be True"):
                call()
        assert c.steps() == [1, 2]  # the refused save took nothing: step 3 is still free
        c.save(3, {"w": torch.ones(4)})
    with ckpt.open(root) as r:
        calls = {
            "verify": lambda: r.ls(verify="yes"),
            "dry_run": lambda: r.gc(dry_run="false"),  # was taken as true: a dry run when asked to delete
            "all": lambda: r.verify(all="yes"),
            "max_diff": lambda: r.diff(1, 2, max_diff=1),
            "strict": lambda: r.load_into({"w": torch.zeros(4)}, 1, strict="false"),
            "staged": lambda: r.load_into({"w": torch.zeros(4)}, 1, staged="no"),
            "strip_prefix": lambda: r.export(1, str(tmp_path / "w.pt"), keys="w", strip_prefix="true"),
            "overwrite": lambda: r.export(1, str(tmp_path / "w.pt"), overwrite="no"),
        }
        for name, call in calls.items():
            with pytest.raises(ckpt.ConfigError, match=f"^{name} must be True or False"):
                call()
    assert not (tmp_path / "w.pt").exists()
    torch.save({"w": torch.ones(2)}, tmp_path / "src.pt")
    refused = {
        "strip_prefix": lambda: ckpt.import_checkpoint(tmp_path / "src.pt", tmp_path / "imp", 0, keys="w",
                                                       strip_prefix="yes"),
        "allow_pickle": lambda: ckpt.dcp.Reader(root, allow_pickle="false"),
        "native": lambda: ckpt.dcp.Stager(native="no"),
        "shared": lambda: ckpt.dcp.Stager(shared="no"),
        "allow_pickle ": lambda: ckpt.dcp.Writer(root, step=9, allow_pickle="no"),
    }
    for name, call in refused.items():
        with pytest.raises(ckpt.ConfigError, match=f"^{name.strip()} must be"):
            call()
    assert not (tmp_path / "imp").exists() and ckpt.open(root).steps() == [1, 2, 3]


def test_lightning_boolean_options_are_checked(tmp_path):
    from ckpt.lightning import AsyncCheckpoint, CkptCheckpointIO, load_checkpoint

    for name in ("resume", "save_rng", "save_on_train_end", "allow_pickle"):
        with pytest.raises(ckpt.ConfigError, match=f"^{name} must be True or False"):
            AsyncCheckpoint(str(tmp_path / "lit"), **{name: "false"})
    with pytest.raises(ckpt.ConfigError, match="^allow_pickle must be True or False"):
        CkptCheckpointIO(allow_pickle="false")
    pickled_checkpoint(tmp_path / "ck")
    with pytest.raises(ckpt.ConfigError, match="^allow_pickle must be True or False"):
        load_checkpoint(tmp_path / "ck", allow_pickle="false")
