"""Train a small FSDP2-sharded model on several ranks, checkpointing with ckpt; resume on any number of ranks.

    torchrun --nproc-per-node 4 examples/train_distributed.py --dir runs/dist --steps 40 --every 10 --stop-after 20
    torchrun --nproc-per-node 4 examples/train_distributed.py --dir runs/dist --steps 40 --every 10   # resumes at 20
    torchrun --nproc-per-node 2 examples/train_distributed.py --dir runs/dist --steps 60 --every 10   # 4 ranks → 2
    python examples/train_distributed.py --dir runs/dist --steps 80                                   # one process

Every rank holds a shard of each parameter and of the AdamW state (``fully_shard`` per block and at
the root: DTensors with a Shard(0) placement). ``ckptr.save`` is called by every rank; each writes its
own shards, and the step is committed once all ranks' parts are durable. ``ckptr.load`` fills the
state in place on whatever number of ranks the job now has: parameters and optimizer state are
resharded, the per-rank RNG streams and loader positions are taken from saved rank ``r % saved
world size`` (the ``rank_map``).

Each step trains on a global batch generated from the step number alone and split across the ranks,
so a run that is interrupted and resumed on the same number of ranks ends with exactly the same
weights as one that was not: compare the ``weights`` digest rank 0 prints at the end. (Resuming on
another number of ranks continues correctly but sums gradients in another order, so its digest
differs in the last bits.)

SIGTERM on any rank (torchrun forwards it to every worker when it is told to stop) makes every rank
save the same step a moment later and exit cleanly. ``--out FILE`` writes the final full weights
(rank 0, ``torch.save``) for comparisons.

Without ``torchrun`` it runs as one process with no process group and a plain (unsharded) model,
and can still resume from a checkpoint saved by several ranks. Uses gloo on CPU, NCCL with CUDA.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import random
import sys
import time
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

import ckpt


class Block(nn.Module):
    def __init__(self, d: int, p: float):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)
        self.drop = nn.Dropout(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.down(nn.functional.gelu(self.up(self.norm(x)))))


class Net(nn.Module):
    def __init__(self, d_in: int = 32, d: int = 96, layers: int = 4, p: float = 0.1):
        super().__init__()
        self.inp = nn.Linear(d_in, d)
        self.blocks = nn.ModuleList(Block(d, p) for _ in range(layers))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, 1)  # a 1-row weight: most ranks hold an empty shard of it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for b in self.blocks:
            x = b(x)
        return self.head(self.norm(x))


class Loader:
    """This rank's view of a synthetic regression stream. Batch ``position`` of the stream is a
    function of (seed, position) only; each rank takes its slice of it. The position is per-rank
    state (every rank has its own loader), saved with ``ckpt.PerRank``."""

    def __init__(self, rank: int, world: int, seed: int = 0, global_batch: int = 96, d_in: int = 32):
        self.rank, self.world, self.seed, self.global_batch, self.d_in = rank, world, seed, global_batch, d_in
        self.position = 0  # global batches consumed
        self.samples = 0  # samples this rank has trained on (informational)

    def next(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.position)
        x = torch.randn(self.global_batch, self.d_in, generator=g)
        y = torch.sin(x[:, :8]).sum(dim=1, keepdim=True) + 0.1 * x[:, 8:16].pow(2).sum(dim=1, keepdim=True)
        x, y = x.tensor_split(self.world)[self.rank], y.tensor_split(self.world)[self.rank]
        self.position += 1
        self.samples += len(x)
        return x.to(device), y.to(device)

    def state_dict(self) -> dict:
        return {"seed": self.seed, "position": self.position, "samples": self.samples}

    def load_state_dict(self, sd: dict) -> None:
        self.seed, self.position, self.samples = sd["seed"], sd["position"], sd["samples"]


def setup() -> tuple[int, int, torch.device]:
    """(rank, world, device); a process group only when started by torchrun (or with its env vars)."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return 0, 1, torch.device("cuda" if torch.cuda.is_available() else "cpu")
    group: dict = {}
    if "TORCHELASTIC_RESTART_COUNT" in os.environ:
        # torchrun restarting a failed group hands the new workers the same store the old ones used,
        # and the new group then finds the dead workers' addresses there (torch 2.13: the restarted
        # group fails with "connection refused"). Keys under a per-attempt prefix keep the attempts apart.
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                              timeout=timedelta(minutes=5))
        group = {"store": dist.PrefixStore(f"attempt-{os.environ['TORCHELASTIC_RESTART_COUNT']}/", store),
                 "rank": int(os.environ["RANK"]), "world_size": int(os.environ["WORLD_SIZE"])}
    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        dist.init_process_group("nccl", device_id=torch.device("cuda", local), **group)
        return dist.get_rank(), dist.get_world_size(), torch.device("cuda", local)
    dist.init_process_group("gloo", **group)
    return dist.get_rank(), dist.get_world_size(), torch.device("cpu")


def weights_digest(model: nn.Module) -> str | None:
    """sha256 of the full (unsharded) weights, on rank 0; every rank must call it (it gathers)."""
    h = hashlib.sha256()
    for k, v in sorted(model.state_dict().items()):
        if hasattr(v, "full_tensor"):  # a DTensor shard: gather the whole tensor (a collective)
            v = v.full_tensor()
        h.update(k.encode())
        h.update(v.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16] if not dist.is_initialized() or dist.get_rank() == 0 else None


def global_loss(local_sq_err_sum: torch.Tensor, global_batch: int) -> float:
    t = local_sq_err_sum.detach().clone()
    if dist.is_initialized():
        dist.all_reduce(t)
    return t.item() / global_batch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", default="runs/dist", help="checkpoint directory (or fsspec URL), shared by all ranks")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--every", default="50", help="save every N steps, or a duration ('30s', '5min'), or 'auto'")
    p.add_argument("--out", default=None, help="write the final full weights here (rank 0, torch.save)")
    p.add_argument("--stop-after", type=int, default=None, help="exit after this step, as if killed")
    p.add_argument("--keep-last", type=int, default=3)
    args = p.parse_args()

    rank, world, device = setup()
    log = print if rank == 0 else (lambda *a, **k: None)

    torch.manual_seed(0)  # the same initial weights on every rank, before sharding
    model = Net().to(device)
    if dist.is_initialized():
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(device.type, (world,))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)  # the root: inp, norm, head
    torch.manual_seed(1 + rank)  # each rank's own dropout stream (saved per rank by ckpt.RNGState)
    random.seed(1 + rank)  # and the other generators RNGState saves: a run is reproducible
    np.random.seed(1 + rank)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=max(1, args.steps))
    loader = Loader(rank, world)
    state = {"model": model, "optim": opt, "sched": sched, "rng": ckpt.RNGState(),
             "loader": ckpt.PerRank(loader), "step": 0}

    every = int(args.every) if args.every.isdigit() else args.every
    ckptr = ckpt.Checkpointer(args.dir, keep_last=args.keep_last, every=every, preemption=True)
    latest = ckptr.latest()
    saved_world = ckptr.manifest(latest).world_size if latest is not None else world
    # Per-rank state (RNG streams, loader positions) saved on another number of ranks: rank r takes
    # saved rank r % saved_world's. Model and optimizer shards are resharded whatever the world size.
    resumed = ckptr.load("latest", state, rank_map=lambda r: r % saved_world)
    start = state["step"]
    if resumed is None:
        log(f"new run in {args.dir} on {world} rank(s)")
    else:
        log(f"resumed from step {resumed} in {args.dir} (saved on {saved_world} rank(s)) on {world} rank(s)")

    if start >= args.steps:
        digest = weights_digest(model)
        log(f"already trained to step {start}; weights {digest}. Nothing to do.")
        ckptr.close()
        return
    if loader.position != start:  # the loader's position is saved with the step; they move together
        raise SystemExit(f"rank {rank}: loader position {loader.position} does not match step {start}")
    stalls = []
    t0 = time.perf_counter()
    loss = float("nan")
    for step in range(start + 1, args.steps + 1):
        model.train()
        x, y = loader.next(device)
        sq_err = (model(x) - y).pow(2).sum()
        # Gradients are averaged over ranks; scaling by world / global batch makes that the mean
        # over the whole global batch, however it is split.
        (sq_err * world / loader.global_batch).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        state["step"] = step
        if ckptr.should_save(step) or step == args.steps:  # the same answer on every rank
            loss = global_loss(sq_err, loader.global_batch)
            h = ckptr.save(step, state)
            stalls.append(h.metrics.stall_s)
            log(f"step {step:5d}  loss {loss:.5f}  saved (blocked {h.metrics.stall_s * 1e3:.1f} ms)", flush=True)
        if ckptr.preempted:  # the emergency save is committed on every rank
            ckptr.close()
            log(f"preempted: step {step} is committed; run again to resume", flush=True)
            return
        if args.stop_after is not None and step >= args.stop_after:
            ckptr.close()  # waits until the saves are committed on every rank
            log(f"stopping after step {step} (--stop-after); run again to resume")
            return
    ckptr.close()
    digest = weights_digest(model)
    if args.out:
        full = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().cpu()
                for k, v in model.state_dict().items()}  # every rank gathers; rank 0 writes
        if rank == 0:
            torch.save(full, args.out)
    log(f"done: {args.steps} steps on {world} rank(s) in {time.perf_counter() - t0:.1f}s, final loss {loss:.5f}, "
        f"committed steps {ckptr.steps()}, weights {digest}")
    if stalls:
        log(f"save() blocked the loop {sum(stalls) * 1e3:.1f} ms in total over {len(stalls)} saves (rank 0)")


def shutdown() -> None:
    """Leave the process group together, then end the process without finalizing the interpreter.

    Finalizing it with gloo's worker threads still running can abort the process after it printed
    "done" (SIGABRT, "terminate called without an active exception"): a worker may drop its last
    reference to a finished collective (a DTensor gather) only then, those tensors need the GIL to
    go, and the finalizing interpreter ends the thread instead, through C++ code that may not unwind.
    Freeing the group would join the workers first, but destroy_process_group() only unregisters it:
    with torch 2.13 the DeviceMesh keeps it, and DTensor's caches of sharding decisions keep the mesh
    (so does torch.distributed.nn.functional, whose default arguments took the group when
    torch._dynamo imported it). Nothing is left to finalize: the Checkpointer is closed (its saves
    committed) and the ranks have met here, so the process ends as it is, its output flushed.
    """
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
    if dist.is_initialized():
        shutdown()
