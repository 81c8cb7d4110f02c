"""Train a small model on CPU, checkpointing asynchronously with ckpt; run it again to resume.

    python examples/train.py                      # trains 300 steps, saving every 50, into runs/example
    python examples/train.py --stop-after 120     # stops early, as if the job was killed
    python examples/train.py                      # resumes from step 100 and finishes

A run that is interrupted and resumed ends with exactly the same weights as one that was not:
the model, optimizer, LR schedule, every RNG and the data position are all in the checkpoint.
SIGTERM (a scheduler preempting the job, ``kill``) makes it save the next step and exit cleanly;
``--every auto`` lets ckpt pick the interval (Young/Daly), ``--every 30s`` saves by time.
"""

from __future__ import annotations

import argparse
import hashlib
import random
import time

import numpy as np
import torch
from torch import nn

import ckpt


class Data:
    """A synthetic regression stream whose position is part of the training state."""

    def __init__(self, seed: int = 0, batch: int = 64):
        self.seed, self.batch, self.position = seed, batch, 0

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.position)
        self.position += 1
        x = torch.randn(self.batch, 32, generator=g)
        return x, torch.sin(x[:, :8]).sum(dim=1, keepdim=True)

    def state_dict(self) -> dict:
        return {"seed": self.seed, "position": self.position}

    def load_state_dict(self, sd: dict) -> None:
        self.seed, self.position = sd["seed"], sd["position"]


def weights_digest(model: nn.Module) -> str:
    h = hashlib.sha256()
    for k, v in sorted(model.state_dict().items()):
        h.update(k.encode())
        h.update(v.detach().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def report_committed(writing: list[ckpt.SaveHandle]) -> None:
    """Say which saves have committed; one that failed is left to raise at the next save() or close()."""
    for h in [h for h in writing if h.stage == "committed"]:
        writing.remove(h)
        print(f"step {h.step:5d}  committed ({h.metrics.duration_s or 0:.2f}s after its save())")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", default="runs/example", help="checkpoint directory (or fsspec URL)")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--every", default="50", help="save every N steps, or a duration ('30s', '5min'), or 'auto'")
    p.add_argument("--stop-after", type=int, default=None, help="exit after this step, as if killed")
    p.add_argument("--keep-last", type=int, default=3)
    args = p.parse_args()

    random.seed(0)  # every generator RNGState saves starts from a seed: a run is reproducible
    np.random.seed(0)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 256), nn.GELU(), nn.Dropout(0.1), nn.Linear(256, 256), nn.GELU(),
                          nn.Linear(256, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.steps)
    data = Data()
    state = {"model": model, "optim": opt, "sched": sched, "data": data, "rng": ckpt.RNGState(), "step": 0}

    every = int(args.every) if args.every.isdigit() else args.every
    ckptr = ckpt.Checkpointer(args.dir, keep_last=args.keep_last, every=every, preemption=True)
    resumed = ckptr.load("latest", state)
    start = state["step"]
    print(f"resumed from step {resumed} in {args.dir}" if resumed is not None else f"new run in {args.dir}")

    if start >= args.steps:
        print(f"already trained to step {start}; weights {weights_digest(model)}. Nothing to do.")
        ckptr.close()
        return
    stalls = []
    writing: list[ckpt.SaveHandle] = []  # saves still in the background: said to be committed once they are
    t0 = time.perf_counter()
    for step in range(start + 1, args.steps + 1):
        x, y = data.next()
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        state["step"] = step
        if ckptr.should_save(step) or step == args.steps:  # the interval, or a preemption signal
            h = ckptr.save(step, state)  # raises the error of an earlier save that failed in the background
            stalls.append(h.metrics.stall_s)
            writing.append(h)
            print(f"step {step:5d}  loss {loss.item():.5f}  snapshot taken (blocked {h.metrics.stall_s * 1e3:.1f} ms), "
                  "writing in the background")
        report_committed(writing)
        if ckptr.preempted:  # the emergency save is committed
            ckptr.close()
            report_committed(writing)
            print(f"preempted: step {step} is committed; run again to resume")
            return
        if args.stop_after is not None and step >= args.stop_after:
            ckptr.close()
            report_committed(writing)
            print(f"stopping after step {step} (--stop-after); run again to resume")
            return
    ckptr.close()  # waits for the last save to be committed; raises its error if it failed
    report_committed(writing)
    print(f"done: {args.steps} steps in {time.perf_counter() - t0:.1f}s, final loss {loss.item():.5f}, "
          f"committed steps {ckptr.steps()}, weights {weights_digest(model)}")
    if stalls:
        print(f"save() blocked the loop {sum(stalls) * 1e3:.1f} ms in total over {len(stalls)} saves")


if __name__ == "__main__":
    main()
