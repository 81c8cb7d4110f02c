"""benchmarks/bandwidth.py's throttled local filesystem: it keeps to its rate (never faster: the bound the
benchmark's 400 MB/s rows rest on), gives back what was written, and ckpt saves and loads through it bit-exact
(the benchmark's ckpt rows use this very path)."""

from __future__ import annotations

import os
import sys
import time

import fsspec
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import bandwidth  # noqa: E402

import ckpt  # noqa: E402


def test_the_throttled_filesystem_never_passes_its_rate_and_keeps_the_bytes(tmp_path):
    rate = 40e6
    bandwidth.ThrottledFS.limit(rate)
    try:
        fs = fsspec.filesystem("throttled")
        data = os.urandom(8 << 20)
        t0 = time.monotonic()
        fs.pipe_file(f"throttled://{tmp_path}/a/x", data)
        wrote = time.monotonic() - t0
        t0 = time.monotonic()
        back = fs.cat_file(f"throttled://{tmp_path}/a/x")
        read = time.monotonic() - t0
        burst = bandwidth.ThrottledFS.buckets["write"].burst
    finally:
        bandwidth.ThrottledFS.limit(None)
    assert back == data
    floor = (len(data) - burst) / rate  # what the bucket lets through at most, its first burst included
    assert wrote >= floor and read >= floor, (wrote, read, floor)
    assert (tmp_path / "a" / "x").read_bytes() == data


def test_ckpt_saves_and_loads_through_the_throttled_filesystem(tmp_path):
    bandwidth.ThrottledFS.limit(400e6)
    try:
        state = {"w": torch.randn(64, 256), "step": 3}
        c = ckpt.Checkpointer(f"throttled://{tmp_path}/run")
        c.save(1, state).wait()
        back = {"w": torch.zeros(64, 256), "step": 0}
        assert c.load("latest", back) == 1
        c.close()
    finally:
        bandwidth.ThrottledFS.limit(None)
    assert torch.equal(back["w"], state["w"]) and back["step"] == 3
