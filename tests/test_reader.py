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

WRITER_SIDE = ("ckpt.writer", "ckpt.commit", "ckpt.peers", "ckpt.checkpointer", "ckpt.ranks", "ckpt.snapshot")


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
    # ckpt.loader, which still imports the commit side; everything else stays off it.
    save_steps(ckdir, steps=(1, 2))
    code = f"""
import sys
import ckpt.cli
assert ckpt.cli.main(["ls", {ckdir!r}, "--verify"]) == 0
assert ckpt.cli.main(["inspect", {ckdir!r}]) == 0
with ckpt.open({ckdir!r}) as r:
    r.ls(verify=True), r.inspect(), r.gc(grace_s=0)
print(sorted(m for m in {WRITER_SIDE!r} if m in sys.modules))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}).stdout
    assert out.strip().splitlines()[-1] == "[]"
    assert ckpt.Checkpointer.__name__ == "Checkpointer"  # still there, imported when named
    assert frozen_and_moving(1)["step"] == 1
