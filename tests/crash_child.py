"""Saves steps in a loop until killed; used by test_crash.py.

Prints 'saved N' once save(N) returned (snapshot taken) and, for every third step, 'committed N'
once it waited for that step to be durable."""

import sys

import torch

import ckpt


def expected(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(64, 8192, generator=g), "b": torch.full((100,), float(step)), "step": step}


def main() -> None:
    path, keep_last = sys.argv[1], int(sys.argv[2])
    c = ckpt.Checkpointer(path, keep_last=keep_last, chunk_size=64 * 1024)
    start = (c.latest() or 0) + 1
    for step in range(start, start + 10_000):
        h = c.save(step, expected(step))
        print(f"saved {step}", flush=True)
        if step % 3 == 0:
            h.wait()
            print(f"committed {step}", flush=True)


if __name__ == "__main__":
    main()
