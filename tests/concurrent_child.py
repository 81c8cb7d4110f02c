"""Processes for tests/test_concurrent.py: a trainer that saves into a root shared with others, and a
``ckpt gc`` loop. Each prints one JSON line when it ends; the trainer exits 1 if any save failed."""

from __future__ import annotations

import hashlib
import json
import os
import sys

import torch

import ckpt

CHUNK = 64 * 1024


def digest(state: dict) -> str:
    h = hashlib.sha256()
    for k in sorted(state):
        h.update(k.encode() + state[k].numpy().tobytes())
    return h.hexdigest()


def train(root: str, first: int, stride: int, count: int, keep_last: int | None, log: str) -> int:
    """Save ``count`` steps (first, first+stride, …). Every tensor but one keeps its value, one
    moves, and every third save puts an earlier value back (so chunks are reused by hash, from the
    dedup table and from what is stored), which is what makes a careless deletion bite."""
    frozen = torch.randn(5 * CHUNK // 4, generator=torch.Generator().manual_seed(7))  # the same in every writer
    moving = torch.randn(3 * CHUNK // 4, generator=torch.Generator().manual_seed(first))
    start = moving.clone()
    c = ckpt.Checkpointer(root, chunk_size=CHUNK, codec="raw", keep_last=keep_last, timeout=60, shared_root=True)
    digests = {}
    failures = []
    for i in range(count):
        step = first + i * stride
        if i % 3 == 2:
            moving.copy_(start)
        else:
            moving.add_(0.5)
        state = {"frozen": frozen, "moving": moving}
        try:
            c.save(step, state).wait()
            digests[step] = digest(state)
        except ckpt.CheckpointError as e:
            failures.append(f"step {step}: {e}")
    c.close()
    with open(log, "w") as f:
        json.dump({str(k): v for k, v in digests.items()}, f)
    print(json.dumps({"saved": len(digests), "failures": failures[:5]}), flush=True)
    return 1 if failures else 0


def gc_loop(root: str, keep_last: int, stop_file: str) -> int:
    """``ckpt gc --keep-last N --grace 0``, over and over, until ``stop_file`` exists."""
    from ckpt.reader import Reader, collect
    from ckpt.storage import open_storage

    runs = deferred = 0
    while not os.path.exists(stop_file):
        try:
            cat = Reader(open_storage(root))
        except ckpt.NotACheckpointError:
            continue  # nothing saved yet
        p = collect.plan(cat, grace_s=0, keep_last=keep_last)
        collect.run(cat, p)
        runs += 1
        deferred += bool(p.writers)
    print(json.dumps({"runs": runs, "deferred": deferred}), flush=True)
    return 0


if __name__ == "__main__":
    what, args = sys.argv[1], sys.argv[2:]
    if what == "train":
        sys.exit(train(args[0], int(args[1]), int(args[2]), int(args[3]), int(args[4]) or None, args[5]))
    sys.exit(gc_loop(args[0], int(args[1]), args[2]))
