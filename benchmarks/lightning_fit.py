"""Time of a Lightning fit that checkpoints every N steps: ckpt's callback against Lightning's own.

    python benchmarks/lightning_fit.py --steps 40 --every 5 --repeats 5

One small MLP (about 48 MiB of fp32 parameters, so ~144 MiB of training state with AdamW) is
fitted on CPU for the same number of steps by each method, in one process:

* none: no checkpointing (the baseline);
* ModelCheckpoint + TorchCheckpointIO: Lightning's default (``torch.save`` on the training thread);
* ModelCheckpoint + AsyncCheckpointIO: Lightning's thread-based async IO (clones the state, then
  ``torch.save`` in a thread);
* ModelCheckpoint + CkptCheckpointIO: ckpt as Lightning's IO plugin;
* ckpt AsyncCheckpoint: ckpt's callback.

Every method keeps only the newest checkpoint (``save_top_k=1`` / ``keep_last=1``). Methods take
turns within each repeat (a slow patch of the shared machine hits all alike), `os.sync()` runs
before each fit, and a first untimed round warms everything up. The time is the whole
``trainer.fit`` call, which includes waiting for the last save (every async method waits at
teardown). ckpt also fsyncs every chunk and manifest; ``torch.save`` does not.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
import warnings

import torch
from torch import nn

warnings.filterwarnings("ignore")

import lightning as L  # noqa: E402
from harness import banner, command, median, pyplot, rounds, save_figure, write_results  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from lightning.pytorch.plugins import AsyncCheckpointIO  # noqa: E402

from ckpt.lightning import AsyncCheckpoint, CkptCheckpointIO  # noqa: E402


class MLP(L.LightningModule):
    def __init__(self, width: int, depth: int):
        super().__init__()
        layers = []
        for _ in range(depth):
            layers += [nn.Linear(width, width), nn.ReLU()]
        self.net = nn.Sequential(*layers)

    def training_step(self, batch, batch_idx):
        (x,) = batch
        return self.net(x).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


METHODS = ["none", "ModelCheckpoint + TorchCheckpointIO", "ModelCheckpoint + AsyncCheckpointIO",
           "ModelCheckpoint + CkptCheckpointIO", "ckpt AsyncCheckpoint"]


def fit_once(method: str, root: str, args) -> tuple[float, int]:
    """Seconds for one trainer.fit, and the number of checkpoints written."""
    d = os.path.join(root, method.replace(" ", "_").replace("+", ""))
    shutil.rmtree(d, ignore_errors=True)
    callbacks, plugins, enable = [], None, True
    if method == "none":
        enable = False
    elif method == "ckpt AsyncCheckpoint":
        callbacks = [AsyncCheckpoint(d, every_n_train_steps=args.every, keep_last=1)]
    else:
        callbacks = [ModelCheckpoint(dirpath=d, every_n_train_steps=args.every, save_top_k=1)]
        plugins = {"ModelCheckpoint + TorchCheckpointIO": None,
                   "ModelCheckpoint + AsyncCheckpointIO": [AsyncCheckpointIO()],
                   "ModelCheckpoint + CkptCheckpointIO": [CkptCheckpointIO()]}[method]
    torch.manual_seed(0)
    model = MLP(args.width, args.depth)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(args.batch * 8, args.width)),
                                       batch_size=args.batch)
    trainer = L.Trainer(accelerator="cpu", max_steps=args.steps, callbacks=callbacks, plugins=plugins, logger=False,
                        enable_checkpointing=enable, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0)
    os.sync()
    t = time.perf_counter()
    trainer.fit(model, data)
    dt = time.perf_counter() - t
    saves = args.steps // args.every if method != "none" else 0
    shutil.rmtree(d, ignore_errors=True)
    return dt, saves


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--every", type=int, default=5)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--depth", type=int, default=3)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--dir", default=None, help="scratch directory (default: a new temp dir)")
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    p.add_argument("--quick", action="store_true", help="a tiny model, one repeat: a smoke test")
    args = p.parse_args()
    if args.quick:
        args.width, args.depth, args.steps, args.every, args.repeats, args.batch = 128, 2, 6, 3, 1, 4
    import logging
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    root = args.dir or tempfile.mkdtemp(prefix="ckpt-bench-lightning-")
    os.makedirs(root, exist_ok=True)
    params = sum(p.numel() for p in MLP(args.width, args.depth).parameters())
    print(f"model: {params / 1e6:.1f} M fp32 parameters ({params * 4 / 2**20:.0f} MiB; ~{params * 12 / 2**20:.0f} MiB "
          f"with AdamW state); {args.steps} steps, a checkpoint every {args.every}; lightning {L.__version__}\n"
          + banner())
    print("command: python " + " ".join(sys.argv))
    saves: dict[str, int] = {}

    def contender(m: str):
        def run(rep: int) -> float:
            dt, saves[m] = fit_once(m, root, args)
            return dt
        return run

    def say(rep: int, m: str, dt: float) -> None:
        which = "warm-up " if rep == 0 else f"repeat {rep}/{args.repeats}"
        print(f"  {which} {m:38s} fit {dt:7.2f}s", flush=True)

    try:  # round 0 warms up and is not reported; the order alternates round by round
        times = rounds({m: contender(m) for m in METHODS}, args.repeats, warmup=1, report=say)
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    med = {m: median(v) for m, v in times.items()}
    # Overhead is paired within a repeat (method minus the no-checkpoint fit of the same round), so
    # load from other work on a shared machine that shifts a whole round cancels out.
    over = {m: median(t - b for t, b in zip(v, times["none"])) for m, v in times.items()}
    report(med, over, times, saves, params, args)


def report(med: dict, overhead: dict, times: dict, saves: dict, params: int, args) -> None:
    lines = [
        f"{params / 1e6:.1f} M fp32 parameters (~{params * 12 / 2**20:.0f} MiB of state with AdamW), {args.steps} "
        f"steps, a checkpoint every {args.every} steps keeping the newest, {os.cpu_count()} CPUs, median of "
        f"{args.repeats}.",
        "",
        "| method | fit (s) | overhead over none (s), paired per repeat | overhead per checkpoint (s) |",
        "|---|---:|---:|---:|",
    ]
    for m in METHODS:
        over = overhead[m]
        per = f"{over / saves[m]:.3f}" if saves.get(m) else "–"
        lines.append(f"| {m} | {med[m]:.2f} | {over:+.2f} | {per} |" if m != "none"
                     else f"| {m} | {med[m]:.2f} | – | – |")
    ours = overhead["ckpt AsyncCheckpoint"]
    checks = [(f"ckpt overhead < {m} overhead", ours < overhead[m], overhead[m])
              for m in ("ModelCheckpoint + TorchCheckpointIO", "ModelCheckpoint + AsyncCheckpointIO")]
    lines += [""] + [f"- {'MET' if ok else 'NOT MET'}: {what} ({ours:+.2f}s vs {theirs:+.2f}s)"
                     for what, ok, theirs in checks]
    text = "\n".join(lines)
    print("\n" + text)
    doc = {"params": params, "steps": args.steps, "every": args.every, "repeats": args.repeats,
           "cpus": os.cpu_count(), "torch": torch.__version__, "lightning": L.__version__,
           "median_fit_seconds": med, "median_overhead_seconds": overhead, "fit_seconds": times}
    write_results(args.out, "lightning_fit", f"Command: `{command('lightning_fit')}`\n\n{text}\n", doc,
                  plot=lambda path: plot(overhead, path, args))


def plot(overhead: dict, path: str, args) -> None:
    plt = pyplot()
    if plt is None:
        return
    names = [m for m in METHODS if m != "none"]
    fig, ax = plt.subplots(figsize=(9, 4))
    ax.barh(names, [overhead[m] for m in names])
    ax.set_xlabel(f"fit time over no checkpointing (s, median); {args.steps // args.every} checkpoints")
    ax.invert_yaxis()
    save_figure(fig, path)


if __name__ == "__main__":
    main()
