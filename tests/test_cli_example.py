"""The ckpt console script and the README's example, run as a user runs them."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch

import ckpt

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]  # spawns processes and takes more than a few seconds

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# The example's and the benchmarks' models are tiny: on a busy machine torch's intra-op threads spin against
# each other (examples/train.py: 44 s for 300 steps on 2 loaded cores, 3.4 s on one thread, same weights).
ENV = dict(os.environ, OMP_NUM_THREADS="1")


def run(*args, cwd=ROOT, check=True):
    p = subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=cwd, timeout=300, env=ENV)
    if check:
        assert p.returncode == 0, p.stderr
    return p


def test_inspect_table_and_json(ckdir):
    with ckpt.Checkpointer(ckdir) as c:
        c.save(5, {"model": torch.nn.Linear(3, 2), "lr": 0.5, "name": "run-a"})
        c.save(9, {"model": torch.nn.Linear(3, 2), "lr": 0.25, "name": "run-a"})
    out = run("-m", "ckpt.cli", "inspect", ckdir).stdout
    assert "2 committed step(s)" in out and "model/weight" in out and "float32" in out and "(2, 3)" in out
    assert "lr = 0.25" in out and "name = 'run-a'" in out
    doc = json.loads(run("-m", "ckpt.cli", "inspect", ckdir, "--step", "5", "--json").stdout)
    assert [s["step"] for s in doc["steps"]] == [5, 9]
    assert doc["detail"]["step"] == 5 and doc["detail"]["values"]["lr"] == "0.5"
    w = next(t for t in doc["detail"]["tensors"] if t["key"] == "model/weight")
    assert w["dtype"] == "float32" and w["shape"] == [2, 3] and w["bytes"] == 24


def test_inspect_never_unpickles(ckdir, tmp_path):
    marker = tmp_path / "pwned"
    payload = _Payload(str(marker))
    with ckpt.Checkpointer(ckdir, allow_pickle=True) as c:
        c.save(1, {"evil": payload, "w": torch.ones(2)})
    p = run("-m", "ckpt.cli", "inspect", ckdir)
    assert "<pickled object: not loaded>" in p.stdout
    assert not marker.exists()
    # nor does a plain load
    try:
        ckpt.Checkpointer(ckdir).load(1, {"evil": None, "w": torch.empty(2)})
    except ckpt.UnsupportedValueError:
        pass
    assert not marker.exists()


class _Payload:
    """Unpickling this creates a file: proof that code from the checkpoint ran."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_inspect_errors_exit_nonzero(tmp_path):
    p = run("-m", "ckpt.cli", "inspect", str(tmp_path / "nothing"), check=False)
    assert p.returncode == 1 and "no such checkpoint" in p.stderr
    (tmp_path / "empty").mkdir()
    p = run("-m", "ckpt.cli", "inspect", str(tmp_path / "empty"), check=False)
    assert p.returncode == 1 and "holds no ckpt checkpoint" in p.stderr
    p = run("-m", "ckpt.cli", "bogus", check=False)
    assert p.returncode == 2


def test_console_script_is_installed():
    import shutil
    exe = shutil.which("ckpt") or os.path.join(os.path.dirname(sys.executable), "ckpt")
    p = subprocess.run([exe, "--version"], capture_output=True, text=True)
    assert p.returncode == 0 and p.stdout.strip() == f"ckpt {ckpt.__version__}"


def test_example_trains_and_resumes_identically(tmp_path):
    straight = run("examples/train.py", "--dir", str(tmp_path / "a"), "--steps", "120", "--every", "40").stdout
    assert "new run" in straight
    first = run("examples/train.py", "--dir", str(tmp_path / "b"), "--steps", "120", "--every", "40",
                "--stop-after", "90").stdout
    assert "stopping after step 90" in first
    resumed = run("examples/train.py", "--dir", str(tmp_path / "b"), "--steps", "120", "--every", "40").stdout
    assert "resumed from step 80" in resumed
    digest = lambda out: out.rsplit("weights ", 1)[1].split()[0]  # noqa: E731
    assert digest(straight) == digest(resumed)


def test_example_says_committed_only_for_saves_that_committed(tmp_path):
    """Issue 33 item 2: the example printed "saved" for every save(), including saves that then failed
    in the background, and trained on. Now it says a step is committed only once it is, and a failed
    save stops it at the next save() with the error."""
    ok = run("examples/train.py", "--dir", str(tmp_path / "ok"), "--steps", "30", "--every", "10").stdout
    assert "saved (" not in ok and all(f"step {s:5d}  committed" in ok for s in (10, 20, 30)), ok
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "chunks").write_text("a file where the chunk directory goes: every chunk write fails")
    p = run("examples/train.py", "--dir", str(tmp_path / "bad"), "--steps", "30", "--every", "10", check=False)
    assert p.returncode == 1 and "  committed (" not in p.stdout and "saved (" not in p.stdout, p.stdout
    # the next save() that finds step 10's save already failed raises it: step 20's, or on a loaded machine
    # (step 10 still writing when step 20 is taken into the other host buffer) step 30's
    found = re.search(r"the save of step 10 failed in the background, so step (20|30) was not saved", p.stderr)
    assert "StorageError" in p.stderr and found, p.stderr
    # the error once (its message and its cause), not logged again; where step 20's save was taken, its
    # own failure is said once more, at exit
    assert p.stderr.count("Not a directory") <= (2 if found.group(1) == "20" else 3), p.stderr


def test_benchmark_script_runs_and_checks_what_it_loaded(tmp_path):
    """Smoke test of benchmarks/save_load.py at 64 MiB, so the published table's script stays runnable."""
    p = run("benchmarks/save_load.py", "--quick", "--only", "memcpy,torch.save,dcp.async_save,ckpt",
            "--out", str(tmp_path))
    assert "| ckpt |" in p.stdout and "| dcp.async_save |" in p.stdout
    assert (tmp_path / "save_load.md").exists() and (tmp_path / "save_load.json").exists()


def test_delta_benchmark_script_runs(tmp_path):
    """Smoke test of benchmarks/delta.py (3 saves of each training, no S3), so its table stays runnable.
    ZipNN is not a dependency: without it the ZipNN columns say so."""
    p = run("benchmarks/delta.py", "--quick", "--no-s3", "--out", str(tmp_path))
    for name in ("gpt-fp32", "gpt-bf16", "embedding", "frozen-90%"):
        assert f"| {name} |" in p.stdout
    doc = json.loads((tmp_path / "delta.json").read_text())
    emb = next(s for s in doc["summary"] if s["name"] == "embedding")
    assert emb["stored_raw"] < 0.1  # sparse updates stored as small deltas
