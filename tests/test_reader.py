"""``ckpt.open``, the one reader: what the CLI prints is what it returns, it loads a step into a
state with no writer, and neither it nor the CLI imports the writer's side."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch
from test_cli import HOUR, frozen_and_moving, make_garbage, save_steps

import ckpt
from ckpt import cli

WRITER_SIDE = ("ckpt.save.writer", "ckpt.save.commit", "ckpt.peers", "ckpt.checkpointer", "ckpt.ranks",
               "ckpt.save.snapshot")


def cli_json(capsys, *args) -> tuple[int, dict]:
    rc = cli.main([str(a) for a in args] + ["--json"])
    return rc, json.loads(capsys.readouterr().out)


def test_ls_inspect_verify_diff_gc_results_are_the_cli_documents(ckdir, tmp_path, capsys, monkeypatch):
    make_garbage(ckdir)  # steps 1-3, an incomplete step, orphans, temp files
    local = str(tmp_path / "node0")
    save_steps(local, steps=(2, 3, 4))  # a node's tier: one step only it holds
    with ckpt.open(ckdir) as r:
        assert cli_json(capsys, "ls", ckdir) == (0, r.ls().to_json())
        assert cli_json(capsys, "ls", ckdir, "--local", local) == (0, r.ls(local=[local]).to_json())
        assert cli_json(capsys, "ls", ckdir, "--verify") == (0, r.ls(verify=True).to_json())
        assert cli_json(capsys, "inspect", ckdir, "--step", 2) == (0, r.inspect(2).to_json())
        assert cli_json(capsys, "verify", ckdir, "--all") == (0, r.verify(all=True).to_json(ckdir))
        assert cli_json(capsys, "diff", ckdir, 1, 3) == (0, r.diff(1, 3).to_json(ckdir))
        report = r.gc(grace_s=HOUR, keep_last=2)  # a dry run by default
        doc = report.to_json()
        assert doc["would_remove"] and doc["schema"] == "ckpt-gc/1"
    rc, got = cli_json(capsys, "gc", ckdir, "--dry-run", "--keep-last", 2)
    for d in (got, doc):  # ages move on between the two calls
        for item in d["would_remove"] + d["kept_younger_than_grace"]:
            item.pop("age_s")
    assert (rc, got) == (0, doc)
    steps = {d["step"]: d for d in ckpt.open(ckdir).ls(local=[local]).to_json()["steps"]}
    assert steps[4]["where"].startswith("1/1 local") and not steps[4]["remote"] and steps[1]["where"] == "remote"


def test_load_into_a_state_without_a_writer(ckdir):
    want = save_steps(ckdir)
    got = {"frozen": torch.empty(50_000), "moving": torch.empty(30_000),
           "small": {"a": torch.empty(3, dtype=torch.int64), "b": torch.empty(4)}, "step": None, "name": None}
    with ckpt.open(ckdir) as r:
        assert r.load_into(got) == 3  # the newest
        assert torch.equal(got["moving"], want[3]["moving"]) and got["step"] == 3
        assert r.load_into(got, 1) == 1 and torch.equal(got["small"]["b"], want[1]["small"]["b"])


def test_reading_never_imports_the_writer_side(ckdir, tmp_path):
    # Reading tensor bytes (tensors, values, load_into, export, diff by bytes) goes through
    # ckpt.load's plan and reads, which import nothing of the writer's side either.
    save_steps(ckdir, steps=(1, 2))
    code = f"""
import sys
import ckpt.cli
assert ckpt.cli.main(["ls", {ckdir!r}, "--verify"]) == 0
assert ckpt.cli.main(["inspect", {ckdir!r}]) == 0
with ckpt.open({ckdir!r}) as r:
    r.ls(verify=True), r.inspect(), r.gc(grace_s=0)
    assert r.tensors(2)
print(sorted(m for m in {WRITER_SIDE!r} if m in sys.modules))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}).stdout
    assert out.strip().splitlines()[-1] == "[]"
    assert ckpt.Checkpointer.__name__ == "Checkpointer"  # still there, imported when named
    assert frozen_and_moving(1)["step"] == 1


def test_bad_arguments_are_config_errors_with_advice(ckdir, tmp_path):
    """What a user gets wrong, or an attacker passes on, is refused with a ConfigError that says what
    is accepted, before anything is read or written; nothing is silently taken as something else."""
    import numpy as np
    import pytest

    save_steps(ckdir, steps=(1, 2))
    state = {"frozen": torch.empty(50_000)}
    with ckpt.open(ckdir) as r:
        # keys: a str or a list of str
        for keys in (5, b"model/", ["frozen", 3], {"frozen": 1}):
            with pytest.raises(ckpt.ConfigError, match="keys must be a key or key prefix"):
                r.tensors(keys=keys)
        assert set(r.tensors(keys=("frozen", "small/"))) == {"frozen", "small/a", "small/b"}
        assert set(r.tensors(keys={"frozen": 1}.keys())) == {"frozen"}  # any iterable of str
        assert set(r.tensors(keys=(k for k in ["small/"]))) == {"small/a", "small/b"}
        assert set(r.tensors(keys="frozen", rank=np.int64(0))) == {"frozen"}  # numpy ints are ints
        # steps: an int (numpy's too) or "latest"; never a numeric string, a float or a bool
        for step, hint in (("2", "pass 2, not '2'"), (2.0, "pass 2"), (True, "True"), ("x", "'x'"), ([2], "[2]")):
            for call in (lambda s: r.tensors(s), lambda s: r.manifest(s), lambda s: r.diff(1, s),
                         lambda s: r.values(s), lambda s: r.load_into(dict(state), s, strict=False),
                         lambda s: r.export(s, tmp_path / "x.pt")):
                with pytest.raises(ckpt.ConfigError, match="a step is an int or 'latest'") as e:
                    call(step)
                assert hint in str(e.value)
        assert r.manifest(np.int64(2)).step == 2 and r.manifest("latest").step == r.manifest(None).step == 2
        assert r.diff(np.int32(1), "latest").b == 2
        # ranks: a saved rank; per-rank data of a rank that does not exist is not silently left out
        for rank in (1, -1, 5):
            for call in (lambda n: r.tensors(rank=n), lambda n: r.values(rank=n),
                         lambda n: r.export(1, tmp_path / "x.pt", rank=n)):
                with pytest.raises(ckpt.ConfigError, match=f"rank {rank} is out of range: .*rank 0 only"):
                    call(rank)
            with pytest.raises(ckpt.ConfigError, match=f"rank={rank} is not a rank of world=1"):
                r.load_into(dict(state), rank=rank, strict=False)
        for bad in (True, 0.0, "0"):
            with pytest.raises(ckpt.ConfigError, match="must be an int"):
                r.tensors(rank=bad)
            with pytest.raises(ckpt.ConfigError, match="must be an int"):
                r.load_into(dict(state), rank=bad, strict=False)
        assert r.load_into(dict(state), rank=1, world=2, strict=False) == 2  # rank 1 of 2 loading: fine
    assert os.listdir(tmp_path) == ["ck"]
