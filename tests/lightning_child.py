"""A tiny Lightning fit with ckpt's AsyncCheckpoint; used by test_lightning.py.

    python lightning_child.py CKDIR OUT MAX_STEPS [--block-at N] [--sigterm-at N]

Trains deterministically (fixed data, seeded shuffling through a resumable loader) and saves every
4 steps into CKDIR. With --block-at N it waits at step N until every save so far is committed,
prints 'committed <step>' and blocks on stdin until killed. Otherwise it writes the final weights
and optimizer state to OUT with torch.save. With --sigterm-at N it sends itself SIGTERM as step N
begins, the way a scheduler preempts a job.
"""

import argparse
import os
import signal
import sys

import lightning as L
import torch
from torch import nn

from ckpt.lightning import AsyncCheckpoint

N, BATCH = 96, 8  # 12 batches per epoch: saves every 4 steps land mid-epoch and at epoch ends


class Batches:
    """Shuffled batches of a fixed dataset, a new order each epoch, resumable mid-epoch.

    Lightning saves its state_dict with the loops (plain values) and hands it back on resume."""

    def __init__(self, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.x, self.y = torch.randn(N, 16, generator=g), torch.randn(N, 4, generator=g)
        self.seed, self.epoch, self.pos = seed, -1, 0
        self._resume: tuple[int, int] | None = None

    def __len__(self) -> int:
        return N // BATCH

    def __iter__(self):
        if self._resume is not None:  # carry on with the epoch the state was saved in
            (self.epoch, start), self._resume = self._resume, None
        else:
            self.epoch, start = self.epoch + 1, 0
        order = torch.randperm(N, generator=torch.Generator().manual_seed(self.seed * 1000 + self.epoch))
        for pos in range(start + 1, len(self) + 1):
            self.pos = pos  # saved by state_dict() between batches
            idx = order[(pos - 1) * BATCH: pos * BATCH]
            yield self.x[idx], self.y[idx]

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "pos": self.pos}

    def load_state_dict(self, sd: dict) -> None:
        self._resume = (sd["epoch"], sd["pos"])


class Tiny(L.LightningModule):
    def __init__(self, hidden: int = 32, extra=None):
        super().__init__()
        self.save_hyperparameters()  # `extra` lets a test put a non-plain object in the hyperparameters
        self.net = nn.Sequential(nn.Linear(16, hidden), nn.Tanh(), nn.Dropout(0.1), nn.Linear(hidden, 4))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.7)}


class BlockAt(L.Callback):
    def __init__(self, step: int, saver: AsyncCheckpoint):
        self.step, self.saver = step, saver

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.step:
            self.saver.wait()
            print(f"committed {self.saver.checkpointer.latest()}", flush=True)
            sys.stdin.readline()  # blocks until the parent kills us
            raise SystemExit("stdin closed before the kill")


class SigtermAt(L.Callback):
    """Sends this process a real SIGTERM as training step N begins (a scheduler preempting the job)."""

    def __init__(self, step: int):
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGTERM)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("ckdir")
    p.add_argument("out")
    p.add_argument("max_steps", type=int)
    p.add_argument("--block-at", type=int, default=None)
    p.add_argument("--sigterm-at", type=int, default=None)
    args = p.parse_args()
    torch.set_num_threads(1)
    L.seed_everything(0, verbose=False)
    saver = AsyncCheckpoint(args.ckdir, every_n_train_steps=4, keep_last=2)
    callbacks = [saver] + ([BlockAt(args.block_at, saver)] if args.block_at else [])
    callbacks += [SigtermAt(args.sigterm_at)] if args.sigterm_at else []
    trainer = L.Trainer(accelerator="cpu", max_steps=args.max_steps, callbacks=callbacks, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    model = Tiny()
    trainer.fit(model, Batches())
    opt = trainer.optimizers[0]
    torch.save({"model": model.state_dict(), "optim": opt.state_dict(), "global_step": trainer.global_step,
                "resumed_step": saver.resumed_step, "sched": trainer.lr_scheduler_configs[0].scheduler.state_dict()},
               args.out)


if __name__ == "__main__":
    main()
