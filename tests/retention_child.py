"""A second job for tests/test_retention.py: opens a Checkpointer on a root, optionally loads a step
and saves one, prints one JSON line (its pid, what it loaded) and keeps the Checkpointer (and its
writer lease) open until a line arrives on stdin; then closes it and exits 0."""

from __future__ import annotations

import json
import os
import sys

import torch

import ckpt


def main(root: str, load: str, save: str, shared: str) -> int:
    c = ckpt.Checkpointer(root, shared_root=shared == "shared", timeout=60)
    state = {"w": torch.zeros(64)}
    loaded = c.load(int(load), state) if load != "-" else None
    if save != "-":
        state["w"].add_(1)
        c.save(int(save), state).wait()
    print(json.dumps({"pid": os.getpid(), "loaded": loaded}), flush=True)
    sys.stdin.readline()
    c.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
