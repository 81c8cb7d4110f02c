"""Train a small FSDP2 model with PyTorch's distributed checkpoint (DCP) calls over ckpt steps.

    torchrun --nproc-per-node 4 examples/train_fsdp2_dcp.py --dir runs/fsdp2 --steps 40 --every 10 --stop-after 25
    torchrun --nproc-per-node 2 examples/train_fsdp2_dcp.py --dir runs/fsdp2 --steps 40 --every 10  # resumes at 25

The script is an ordinary DCP training loop; only the storage is ckpt's:

- the model is sharded with ``fully_shard`` (FSDP2: parameters and AdamW state are DTensors with a
  ``Shard(0)`` placement), and its state is taken and put back with
  ``torch.distributed.checkpoint.state_dict.get_state_dict`` / ``set_state_dict``;
- at start, ``dcp.load(..., storage_reader=ckpt.dcp.Reader(dir, step=n))`` of the newest committed step
  ``n`` (the Reader's ``"latest"``, resolved once on rank 0) on whatever number of ranks the job now has
  (DCP reshards); a directory with no committed step (the Reader's ``CheckpointNotFoundError``) starts
  a new run;
- every ``--every`` steps, ``dcp.async_save(..., storage_writer=ckpt.dcp.Writer(dir, step=n),
  async_stager=ckpt.dcp.Stager())`` in thread mode: the loop waits only for the copy into the Stager's
  reused host buffer, and DCP's collectives for the save run on a process group of their own, so they
  never interleave with FSDP's all-gathers and reduce-scatters on the training thread.

``--stop-after K`` saves step K (if it is not a save step anyway), waits until it is committed and exits,
as a job stopped on purpose. Each step trains on a global batch generated from the step number alone,
every rank taking its slice, so the arithmetic is the same on any number of ranks up to the order of
float reductions: a run resumed on 2 ranks from a step saved on 4 ends with the same weights, bit for
bit, as any other run resumed on 2 ranks from that same step. Rank 0 prints, on resuming, a digest of
every tensor of the model and optimizer as loaded (``digest`` of the step's tensors, as ``ckpt.open``
reads them, gives the same) and, at the end, the final step and a digest of the full weights;
``--out FILE`` also writes them (``torch.save``).

No dropout and no per-rank random state: the step number is the whole data position. Uses gloo on
CPU, NCCL (with a gloo group for the saves) with CUDA. Needs ``torchrun`` (or its environment variables).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

import ckpt.dcp
from ckpt.errors import CheckpointNotFoundError

D_IN, GLOBAL_BATCH = 16, 64  # the global batch divides evenly on 1, 2 and 4 ranks


class Net(nn.Module):
    def __init__(self, d: int = 64, layers: int = 3):
        super().__init__()
        self.inp = nn.Linear(D_IN, d)
        self.layers = nn.ModuleList(nn.Sequential(nn.LayerNorm(d), nn.Linear(d, d), nn.GELU()) for _ in range(layers))
        self.head = nn.Linear(d, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for layer in self.layers:
            x = x + layer(x)
        return self.head(x)


def batch(step: int, rank: int, world: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's slice of the global batch of ``step``: a function of (seed, step) alone."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    x = torch.randn(GLOBAL_BATCH, D_IN, generator=g)
    y = torch.sin(x[:, :8]).sum(dim=1, keepdim=True) + 0.1 * x[:, 8:].pow(2).sum(dim=1, keepdim=True)
    return x.tensor_split(world)[rank], y.tensor_split(world)[rank]


def setup() -> tuple[int, int, torch.device]:
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise SystemExit("run me under torchrun, e.g. torchrun --nproc-per-node 2 examples/train_fsdp2_dcp.py")
    group: dict = {}
    if "TORCHELASTIC_RESTART_COUNT" in os.environ:
        # A group torchrun restarts gets the store the old one used; a per-attempt prefix keeps the
        # attempts' keys apart (as in examples/train_distributed.py).
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                              timeout=timedelta(minutes=5))
        group = {"store": dist.PrefixStore(f"attempt-{os.environ['TORCHELASTIC_RESTART_COUNT']}/", store),
                 "rank": int(os.environ["RANK"]), "world_size": int(os.environ["WORLD_SIZE"])}
    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        dist.init_process_group("cpu:gloo,cuda:nccl", device_id=torch.device("cuda", local), **group)
        return dist.get_rank(), dist.get_world_size(), torch.device("cuda", local)
    dist.init_process_group("gloo", **group)
    return dist.get_rank(), dist.get_world_size(), torch.device("cpu")


def newest_step(url: str) -> int | None:
    """The step ``ckpt.dcp.Reader(url, step="latest")`` resolves to, or None when ``url`` holds no
    committed step (a new run). Asked on rank 0 and broadcast, so every rank loads the same step.

    Asked of the Reader itself, not read from ``dcp.load``'s exception: torch 2.13's ``dcp.load``
    turns an error of ``read_metadata`` into an ``AssertionError`` that keeps only its text."""
    found: list[int | None] = [None]
    if dist.get_rank() == 0:
        try:
            found[0] = ckpt.dcp.Reader(url, step="latest").step
        except CheckpointNotFoundError:  # "holds no committed step"
            pass
    dist.broadcast_object_list(found, src=0)
    return found[0]


def full_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """The unsharded weights, on rank 0 (empty elsewhere); every rank must call it (it gathers)."""
    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {k: v.detach().clone() for k, v in sd.items() if isinstance(v, torch.Tensor)}


def full_tensors(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every tensor of the unsharded training state on rank 0 (empty elsewhere), named as a ckpt step
    written by this script names them (``model/inp.weight``, ``optim/state/inp.weight/exp_avg``);
    every rank must call it (it gathers)."""
    model_sd, optim_sd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    flat: dict[str, torch.Tensor] = {}

    def walk(prefix: str, v: Any) -> None:
        if isinstance(v, torch.Tensor):
            flat[prefix] = v.detach()
        elif isinstance(v, dict):
            for k, x in v.items():
                walk(f"{prefix}/{k}", x)

    walk("model", model_sd)
    walk("optim/state", optim_sd.get("state", {}))
    return flat


def digest(tensors: dict[str, torch.Tensor]) -> str:
    """sha256 of names and bytes, in name order (16 hex digits)."""
    h = hashlib.sha256()
    for k, v in sorted(tensors.items()):
        h.update(k.encode())
        h.update(v.contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", default="runs/fsdp2", help="checkpoint directory (or fsspec URL), shared by all ranks")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--every", type=int, default=10, help="save every N steps (and always the last one)")
    p.add_argument("--stop-after", type=int, default=None, help="save this step, wait for its commit and exit")
    p.add_argument("--keep-last", type=int, default=3)
    p.add_argument("--out", default=None, help="write the final full weights here (rank 0, torch.save)")
    args = p.parse_args()

    rank, world, device = setup()
    log = print if rank == 0 else (lambda *a, **k: None)
    # DCP's async save runs its collectives on a thread beside training: give it a group of its own.
    save_group = dist.new_group(backend="gloo")

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)  # the same initial weights on every rank, before sharding
    model = Net().to(device)
    mesh = init_device_mesh(device.type, (world,))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)  # the root: inp and head
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)

    def training_state(step: int) -> dict[str, Any]:
        model_sd, optim_sd = get_state_dict(model, opt)  # DTensor shards, by parameter name
        return {"model": model_sd, "optim": optim_sd, "step": step}

    # get_state_dict gives a fresh AdamW its state with one zero-lr step (DCP's way to have tensors to
    # load into), so AdamW's own step counter runs one ahead of ours: the same on every run, resumed or not.
    state = training_state(0)
    saved = newest_step(args.dir)
    if saved is None:
        log(f"new run in {args.dir} on {world} rank(s)")
    else:  # DCP reshards the saved DTensors onto this run's ranks
        dcp.load(state, storage_reader=ckpt.dcp.Reader(args.dir, step=saved))
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        loaded = full_tensors(model, opt)  # what the model and optimizer hold now, unsharded
        log(f"resumed from step {state['step']} in {args.dir} on {world} rank(s); state {digest(loaded)}",
            flush=True)
    start = int(state["step"])

    stager = ckpt.dcp.Stager()  # one host buffer for the whole run
    pending: Any = None  # the future of the save in flight
    stalls: list[float] = []

    def save(step: int) -> None:
        nonlocal pending
        if pending is not None:
            pending.result()  # one save in flight at a time (raises if the previous one failed)
        t = time.perf_counter()
        pending = dcp.async_save(training_state(step), storage_writer=ckpt.dcp.Writer(args.dir, step=step,
                                 keep_last=args.keep_last), async_stager=stager, process_group=save_group,
                                 async_checkpointer_type=AsyncCheckpointerType.THREAD)
        stalls.append(time.perf_counter() - t)

    def drain() -> None:
        if pending is not None:
            pending.result()  # DCP returns on every rank only after the coordinator committed
        stager.close()

    t0 = time.perf_counter()
    step = start
    for step in range(start + 1, args.steps + 1):
        x, y = batch(step, rank, world)
        sq_err = (model(x.to(device)) - y.to(device)).pow(2).sum()
        # FSDP averages gradients over ranks; scaled by world / global batch that is the mean over the
        # whole global batch, however it is split.
        (sq_err * world / GLOBAL_BATCH).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % args.every == 0 or step == args.steps or step == args.stop_after:
            save(step)
            log(f"step {step:4d}  saving (blocked {stalls[-1] * 1e3:.1f} ms)", flush=True)
        if args.stop_after is not None and step >= args.stop_after:
            drain()
            log(f"stopping after step {step} (--stop-after): committed; run again to resume", flush=True)
            shutdown()
            return
    drain()
    weights = full_weights(model)
    if rank == 0:
        if args.out:
            torch.save(weights, args.out)
        log(f"done: step {step} on {world} rank(s) in {time.perf_counter() - t0:.1f}s, weights {digest(weights)}; "
            f"async_save blocked {sum(stalls) * 1e3:.1f} ms over {len(stalls)} saves", flush=True)
    shutdown()


def shutdown() -> None:
    """Leave the process group together, then end the process without finalizing the interpreter:
    DTensor's caches keep the group, and so gloo's worker threads, alive past destroy_process_group(),
    and a worker that drops a finished collective's tensors while the interpreter finalizes aborts the
    process (see examples/train_distributed.py's shutdown). Every save has been waited for (drain), so
    nothing is left to finalize; a DCP Writer's lease left behind names this process, which a later
    run on this host sees is gone."""
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
