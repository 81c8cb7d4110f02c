"""The states behind the golden checkpoints in ``tests/data/golden/`` (see ``test_golden.py``).

    python tests/golden.py NAME...   # writes the named ones (plain, model, sharded, delta) again

Write one again only when it is new: the point of the others is that they were written by an
earlier ckpt.

Each state is a pure function of its step, so a test can rebuild what a golden checkpoint must hold.
Together they cover what the on-disk format can express: format v1 (tensors and plain values), v2
(per-rank state, shards of a global tensor saved by two ranks), v3 (numpy values stored as raw
bytes), v4 (planes and xor chunks: deltas in chains three long), v6 (``index``: the sharded state's
MANIFEST.json as an index naming the two rank reports); raw and zstd chunks; chunks reused from an
earlier step; tensors of every dtype family; chunk format v3 (``masked``: zero masks, whole and as
deltas).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys

import numpy as np
import torch

import ckpt

HERE = os.path.dirname(os.path.abspath(__file__))
DATA = os.path.join(HERE, "data", "golden")
CHUNK = 64 * 1024  # the smallest chunk size: several chunks per step, small files


def _g(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def plain_state(step: int) -> dict:
    """Format v1: tensors of many dtypes and plain values. ``frozen`` is the same at both steps (its
    chunks are reused), ``zeros`` compresses (zstd chunks), ``moving`` is random (raw chunks)."""
    return {
        "frozen": torch.randn(3 * CHUNK // 8, generator=_g(1)),
        "moving": torch.randn(CHUNK // 8, generator=_g(100 + step)),
        "zeros": torch.zeros(CHUNK // 8, dtype=torch.float64),
        "half": torch.arange(300, dtype=torch.float16) / 7,
        "bf16": (torch.arange(300, dtype=torch.float32) / 3).to(torch.bfloat16),
        "ints": torch.arange(-50, 50, dtype=torch.int64) * step,
        "mask": torch.arange(64) % 3 == 0,
        "complex": torch.complex(torch.arange(8.0), -torch.arange(8.0)),
        "u8": torch.arange(256, dtype=torch.uint8),
        "strided": torch.arange(60.0).reshape(6, 10)[:, ::2],
        "scalar": torch.tensor(float(step)),
        "empty": torch.empty(0, 3),
        "step": step,
        "config": {"lr": 0.001, "name": "golden", "betas": (0.9, 0.999), "layers": [1, 2, 3], "none": None,
                   "inf": float("inf"), "blob": b"\x00\x01\xff", 7: "int key"},
    }


def model_state(step: int) -> dict:
    """Format v3: a module, an optimizer after ``step`` steps, an LR scheduler, numpy values and the
    RNG states (per rank)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2)
    x = torch.randn(8, 16, generator=_g(5))
    for _ in range(step):
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        sched.step()
    np.random.seed(step)
    torch.manual_seed(step)
    import random
    random.seed(step)
    return {"model": model, "optim": opt, "sched": sched, "rng": ckpt.RNGState(), "step": step,
            "np": {"table": np.arange(12, dtype=np.float32).reshape(3, 4) * step,
                   "big_endian": np.arange(5, dtype=">i4"), "scalar": np.float64(step) / 3, "flag": np.bool_(True)}}


def shard_state(rank: int, step: int) -> dict:
    """Format v2, saved by two ranks: rows of a global (12, 20) tensor, per-rank positions."""
    full = torch.arange(240.0).reshape(12, 20) * step
    rows = slice(0, 5) if rank == 0 else slice(5, 12)
    return {"w": ckpt.LocalShard(full[rows].clone(), (rows.start, 0), (12, 20)), "bias": torch.full((7,), float(step)),
            "pos": ckpt.PerRank({"position": 10 * step + rank}), "step": step}


def delta_state(step: int) -> dict:
    """Format v4: an embedding table with a few rows changed per step (xor chunks in chains), bf16
    weights nudged everywhere (planes or xor), an int table that never changes (reused)."""
    emb = torch.randn(2048, 32, generator=_g(7))
    weights = torch.randn(CHUNK, generator=_g(8))
    for s in range(1, step + 1):
        emb[s::97] += float(s)
        weights.mul_(1.0 - 1e-3)
    return {"emb": emb, "bf16": weights.to(torch.bfloat16), "ints": torch.arange(3 * CHUNK // 4, dtype=torch.int32),
            "step": step}


def masked_state(step: int) -> dict:
    """Chunk format v3 (zero masks): a pruned fp32 layer (90% zeros: ``planes/3``) with a few of its
    weights moved per step (``xor/3`` deltas), and a bf16 tensor with every other column zero."""
    w = torch.randn(CHUNK // 4 * 3, generator=_g(9))
    w[torch.rand(w.numel(), generator=_g(10)) < 0.9] = 0
    for s in range(1, step + 1):
        w[s::7] += torch.randn(w[s::7].numel(), generator=_g(10 + s))  # a seventh of it moves
    half = torch.randn(256, 128, generator=_g(11)).to(torch.bfloat16)
    half[:, ::2] = 0
    return {"pruned": w, "half": half, "step": step}


def digest(tensors: dict) -> dict:
    return {k: hashlib.sha256(v.contiguous().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()
            for k, v in sorted(tensors.items())}


def _sharded_body(rank: int, world: int, root: str) -> None:
    with ckpt.Checkpointer(root, chunk_size=CHUNK) as c:
        for step in (1, 2):
            c.save(step, shard_state(rank, step)).wait()


def main(names: list[str]) -> None:
    from ckpt.testing import run_ranks

    makers = {"plain": (plain_state, (1, 2)), "model": (model_state, (1, 2)), "delta": (delta_state, (1, 2, 3)),
              "sharded": (None, (1, 2)), "index": (None, (1, 2)), "masked": (masked_state, (1, 2))}
    unknown = set(names) - set(makers)
    if not names or unknown:
        sys.exit(f"usage: python tests/golden.py NAME... (names: {', '.join(makers)})")
    path = os.path.join(DATA, "expected.json")
    expected: dict = json.load(open(path)) if os.path.exists(path) else {}
    for name in names:
        root = os.path.join(DATA, name)
        shutil.rmtree(root, ignore_errors=True)
        make, steps = makers[name]
        if make is None:
            run_ranks(2, _sharded_body, root)
        else:
            with ckpt.Checkpointer(root, chunk_size=CHUNK) as c:
                for step in steps:
                    c.save(step, make(step)).wait()
        shutil.rmtree(os.path.join(root, "journal"), ignore_errors=True)  # the run's journal: no step's
        with ckpt.open(root) as r:
            expected[name] = {str(s): {"format": r.manifest(s).format_version, "tensors": digest(r.tensors(s))}
                              for s in r.steps()}
            expected[name]["ckpt"] = ckpt.__version__
    for d, _, files in os.walk(DATA):  # leases and temp files are not part of a checkpoint
        for f in files:
            if f.startswith(".") or ".tmp-" in f:
                os.remove(os.path.join(d, f))
    with open(path, "w") as f:
        json.dump(expected, f, indent=1, sort_keys=True)
    print(json.dumps({k: {s: v["format"] for s, v in d.items() if s != "ckpt"} for k, d in expected.items()
                      if k in names}))


if __name__ == "__main__":
    main(sys.argv[1:])
