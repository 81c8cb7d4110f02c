"""Train a small transformer-like model with FSDP2 over tensor parallelism, checkpointing with ckpt;
stop on 4 ranks (dp=2 × tp=2) and resume on 2 (dp=1 × tp=2).

    torchrun --nproc-per-node 4 examples/train_fsdp2_tp.py --dir runs/2d --tp 2 --steps 6 --every 2 --stop-after 3
    torchrun --nproc-per-node 2 examples/train_fsdp2_tp.py --dir runs/2d --tp 2 --steps 6 --every 2  # resumes at 3

The model is parallelised as torchtitan does it: each block's projections with ``ColwiseParallel`` /
``RowwiseParallel`` on the ``tp`` dimension of a ``dp × tp`` mesh, then ``fully_shard`` on ``dp``. Its
column-parallel weights and their AdamW state are DTensors with ``_StridedShard`` placements, and
``ckptr.save`` / ``ckptr.load`` take the model and optimizer as they are; a step saved on one layout
loads onto any other (here from dp=2 to dp=1, tp unchanged).

Each step trains on a global batch generated from the step number alone, cut in two halves; with dp=2
each dp rank takes one half, with dp=1 a rank runs both halves one after the other (gradient
accumulation) at half the loss scale. FSDP2's reduction then adds the same two half-gradients,
halved, as the accumulation does: a run stopped on 4 ranks and resumed on 2 ends with the same weights,
bit for bit, as a run on 2 ranks from the start. Rank 0 prints a digest of the full weights at the end;
``--out FILE`` also writes them (``torch.save``). Needs ``torchrun``; gloo on CPU.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import ckpt

D_IN, D, HIDDEN, GLOBAL_BATCH, HALVES = 8, 16, 32, 32, 2


class Block(nn.Module):
    """A transformer block's projections (attention reduced to elementwise products of q, k and v)."""

    def __init__(self) -> None:
        super().__init__()
        self.attention_norm, self.ffn_norm = nn.LayerNorm(D), nn.LayerNorm(D)
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(D, D) for _ in range(4))
        self.w1, self.w3, self.w2 = nn.Linear(D, HIDDEN), nn.Linear(D, HIDDEN), nn.Linear(HIDDEN, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.attention_norm(x)
        x = x + self.wo(F.silu(self.wq(h)) * self.wk(h) + self.wv(h))
        h = self.ffn_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class Net(nn.Module):
    def __init__(self, layers: int = 2) -> None:
        super().__init__()
        self.inp = nn.Linear(D_IN, D)
        self.blocks = nn.ModuleList(Block() for _ in range(layers))
        self.head = nn.Linear(D, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


TP_PLAN = {**{k: ColwiseParallel() for k in ("wq", "wk", "wv", "w1", "w3")}, "wo": RowwiseParallel(),
           "w2": RowwiseParallel()}


def parallelize(model: Net, dp: int, tp: int) -> None:
    """Tensor parallel inside each block on ``tp``, then FSDP2 on ``dp`` (per block and at the root)."""
    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    for block in model.blocks:
        parallelize_module(block, mesh["tp"], TP_PLAN)
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])


def half_batch(step: int, half: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Half ``half`` of the global batch of ``step``: a function of the step alone."""
    g = torch.Generator().manual_seed(step)
    x = torch.randn(GLOBAL_BATCH, D_IN, generator=g)
    y = torch.sin(x).sum(dim=1, keepdim=True)
    return x.chunk(HALVES)[half], y.chunk(HALVES)[half]


def train_step(model: Net, opt: torch.optim.Optimizer, step: int, dp_rank: int, dp: int) -> None:
    # dp ranks share out the halves; FSDP2 averages over dp, so each half's loss is scaled by dp / HALVES
    # (a power of two: the gradients scale exactly, and the sum over halves is the same on any dp).
    for half in range(dp_rank * HALVES // dp, (dp_rank + 1) * HALVES // dp):
        x, y = half_batch(step, half)
        ((model(x) - y).pow(2).sum() / GLOBAL_BATCH * (dp / HALVES)).backward()
    opt.step()
    opt.zero_grad()


def full_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """The whole weights by name (gathers every DTensor: every rank must call it)."""
    return {k: v.full_tensor() if hasattr(v, "full_tensor") else v.detach().clone()
            for k, v in sorted(model.state_dict().items())}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", default="runs/2d", help="checkpoint directory, shared by all ranks")
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel degree; dp is the world size over it")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--every", type=int, default=2, help="save every N steps")
    p.add_argument("--stop-after", type=int, default=None, help="save this step and exit, as a stopped job")
    p.add_argument("--out", default=None, help="write the final full weights here (rank 0, torch.save)")
    args = p.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if world % args.tp or HALVES % (world // args.tp):
        raise SystemExit(f"{world} ranks: --tp must divide it, leaving a dp of 1 or 2 (got --tp {args.tp})")
    dp = world // args.tp
    log = print if rank == 0 else (lambda *a, **k: None)
    torch.manual_seed(0)  # the same initial weights on every rank, before sharding
    model = Net()
    parallelize(model, dp, args.tp)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    state = {"model": model, "optim": opt, "step": 0}

    with ckpt.Checkpointer(args.dir, keep_last=3) as ckptr:
        resumed = ckptr.load("latest", state)
        where = f"new run in {args.dir}" if resumed is None else f"resumed from step {resumed} in {args.dir}"
        log(f"{where} on dp={dp} x tp={args.tp}")  # one string, one write: other ranks' logs share the pipe
        for step in range(state["step"] + 1, args.steps + 1):
            train_step(model, opt, step, rank // args.tp, dp)
            state["step"] = step
            if step % args.every == 0 or step == args.stop_after:
                ckptr.save(step, state)
            if step == args.stop_after:
                ckptr.wait()
                log(f"stopping after step {step}")
                break
        weights = full_weights(model)
    digest = hashlib.sha256(b"".join(k.encode() + v.numpy().tobytes() for k, v in weights.items())).hexdigest()
    log(f"done: step {state['step']} on dp={dp} x tp={args.tp}; weights {digest[:16]}")
    if args.out and rank == 0:
        torch.save(weights, args.out)


def shutdown() -> None:
    """Leave the process group together, then end the process without finalizing the interpreter:
    the DeviceMesh and DTensor's caches keep the group, and so gloo's worker threads, alive past
    destroy_process_group(), and a worker that drops a finished collective's tensors while the
    interpreter finalizes can abort the process (see examples/train_distributed.py's shutdown).
    The Checkpointer is closed, its saves committed, so nothing is left to finalize (which took each
    rank 1-4 s after its last step, too)."""
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
    shutdown()
