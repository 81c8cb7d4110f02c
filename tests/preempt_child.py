"""A training loop with preemption=True, for tests/test_failure.py.

    python preempt_child.py ROOT [--hold-at N] [--every E] [--never-ask] [--deadline S]

Trains a small model, asking ``should_save`` every step. With --hold-at N it saves step N (a large
state, so the save is still in flight), prints 'holding N' and waits for a line on stdin: the test
sends SIGTERM meanwhile, then the line. It prints 'stopped S' when ``preempted`` ends the loop (S the
last step), and writes nothing else on stdout. With --never-ask the loop never calls ``should_save``
(it saves on ``step % 1000 == 0``, as loops that predate preemption do), with ``preemption_deadline=S``.
"""

import argparse
import sys

import torch

import ckpt

p = argparse.ArgumentParser()
p.add_argument("root")
p.add_argument("--hold-at", type=int, default=None)
p.add_argument("--every", type=int, default=None)
p.add_argument("--steps", type=int, default=10_000)
p.add_argument("--never-ask", action="store_true")
p.add_argument("--deadline", type=float, default=10.0)
args = p.parse_args()

torch.manual_seed(0)
model = torch.nn.Linear(2048, 2048)  # 16 MiB of weights, 48 MiB with Adam's state
opt = torch.optim.Adam(model.parameters(), lr=1e-4)
state = {"model": model, "optim": opt, "step": 0}
ckptr = ckpt.Checkpointer(args.root, preemption=True, every=args.every, preemption_deadline=args.deadline)
step = 0
for step in range(1, args.steps + 1):
    model(torch.randn(8, 2048)).square().mean().backward()
    opt.step()
    opt.zero_grad()
    state["step"] = step
    due = step % 1000 == 0 if args.never_ask else ckptr.should_save(step)
    if due or step == args.hold_at:
        ckptr.save(step, state)
    if step == args.hold_at:
        print(f"holding {step}", flush=True)
        sys.stdin.readline()
    if ckptr.preempted:
        break
ckptr.close()
print(f"stopped {step}", flush=True)
