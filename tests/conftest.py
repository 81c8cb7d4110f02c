from __future__ import annotations

import os
import threading

import pytest
import torch
from torch import nn

from ckpt.storage.local import LocalStorage


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.LayerNorm(64), nn.Linear(64, 8))


def train_steps(model: nn.Module, opt: torch.optim.Optimizer, n: int, sched=None) -> None:
    for _ in range(n):
        loss = model(torch.randn(4, 16)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if sched is not None:
            sched.step()


def make_state(seed: int = 0, steps: int = 2) -> dict:
    model = make_model(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    train_steps(model, opt, steps, sched)
    return {"model": model, "optim": opt, "sched": sched, "step": steps}


def clone_tensors(sd: dict) -> dict:
    return {k: v.detach().clone() for k, v in sd.items()}


def assert_same_tensors(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.equal(a[k], b[k]), k


@pytest.fixture
def ckdir(tmp_path):
    return str(tmp_path / "ck")


class Gate:
    """Holds every chunk write of LocalStorage until opened: lets a test act while a save is
    provably still in flight, without sleeping."""

    def __init__(self, monkeypatch):
        self.open_event = threading.Event()
        self.entered = threading.Event()
        original = LocalStorage.write

        def gated(storage, key, buffers):
            if key.startswith("chunks/"):
                self.entered.set()
                assert self.open_event.wait(60), "gate never opened"
            return original(storage, key, buffers)

        monkeypatch.setattr(LocalStorage, "write", gated)

    def open(self) -> None:
        self.open_event.set()


@pytest.fixture
def gate(monkeypatch):
    g = Gate(monkeypatch)
    yield g
    g.open()


def chunk_files(root: str) -> list[str]:
    out = []
    for dirpath, _, files in os.walk(os.path.join(root, "chunks")):
        out += [os.path.join(dirpath, f) for f in files if ".tmp-" not in f]
    return sorted(out)


@pytest.fixture(autouse=True)
def _fresh_rng():
    torch.manual_seed(1234)
    yield


def tensor_entry(m, key: str, rank: int | None = None):
    """The manifest entry of tensor ``key`` (``rank``: that rank's per-rank tensor)."""
    return next(t for t in m.tensors if t.key == key and t.rank == rank)
