"""A training script for tests/test_chaos.py with a resume bug ``ckpt chaos`` must catch: its data
stream's position is not in the checkpoint, so a resumed run trains on the first batches again.

    python chaos_child.py DIR STEPS EVERY [PROGRESS]

PROGRESS: a file it appends "pid step time" to at every step (what the goodput test compares the
journal's lost work with).
"""

from __future__ import annotations

import os
import sys
import time

import torch

import ckpt


def main(root: str, steps: int, every: int, progress: str | None = None) -> None:
    out = open(progress, "a", buffering=1) if progress else None
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    data = torch.Generator().manual_seed(1)  # the bug: its state is not saved
    state = {"model": model, "optim": opt, "step": 0}
    with ckpt.Checkpointer(root, every=every) as c:
        c.load("latest", state)
        for step in range(state["step"] + 1, steps + 1):
            x = torch.randn(32, 16, generator=data)
            loss = (model(x) - x[:, :1]).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            state["step"] = step
            if out is not None:
                out.write(f"{os.getpid()} {step} {time.time()}\n")
            if c.should_save(step) or step == steps:
                c.save(step, state)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), *sys.argv[4:5])
