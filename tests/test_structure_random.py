"""Randomised round trips of nested plain values and tensors through the structure encoding."""

from __future__ import annotations

import json
import math
import random

import numpy as np
import pytest
import torch

import ckpt
from ckpt.flatten import flatten
from ckpt.tree import rebuild

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int8, torch.bool, torch.uint8]


def rand_leaf(r: random.Random):
    kind = r.randrange(10)
    if kind == 0:
        return r.randint(-2**80, 2**80)
    if kind == 1:
        return r.choice([0.0, -0.0, 1e-300, -1.5, float("inf"), float("-inf"), float("nan"), r.random()])
    if kind == 2:
        return "".join(r.choice("aZ/.#é π\n\"{}") for _ in range(r.randrange(6)))
    if kind == 3:
        return r.choice([None, True, False])
    if kind == 4:
        return bytes(r.randrange(256) for _ in range(r.randrange(5)))
    if kind == 5:
        shape = tuple(r.randrange(0, 4) for _ in range(r.randrange(0, 3)))
        dtype = r.choice(DTYPES)
        return (torch.rand(shape) * 100).to(dtype) if dtype != torch.bool else torch.rand(shape) > 0.5
    if kind == 6:
        return np.arange(r.randrange(5), dtype=r.choice([np.float64, np.int32]))
    if kind == 7:
        return r.choice([torch.float16, torch.device("cpu"), torch.Size([r.randrange(9)])])
    if kind == 8:
        return r.choice([np.float32(r.random()), np.int16(r.randrange(100))])
    return r.randrange(100)


def rand_key(r: random.Random):
    return r.choice([f"k{r.randrange(50)}", r.randrange(50), (r.randrange(3), "t"), None, 2.5, True])


def rand_value(r: random.Random, depth: int = 0):
    if depth > 3 or r.random() < 0.4:
        return rand_leaf(r)
    kind = r.randrange(3)
    n = r.randrange(4)
    if kind == 0:
        return [rand_value(r, depth + 1) for _ in range(n)]
    if kind == 1:
        return tuple(rand_value(r, depth + 1) for _ in range(n))
    return {rand_key(r): rand_value(r, depth + 1) for _ in range(n)}


def same(a, b) -> bool:
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and np.array_equal(a, b)
    if isinstance(a, float):
        return (math.isnan(a) and math.isnan(b)) or (a == b and math.copysign(1, a) == math.copysign(1, b))
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return list(a.keys()) == list(b.keys()) and all(same(a[k], b[k]) for k in a)
    return a == b


@pytest.mark.parametrize("seed", range(40))
def test_structure_roundtrip_without_io(seed):
    r = random.Random(seed)
    state = {f"top{i}": rand_value(r) for i in range(r.randrange(1, 5))}
    flat = flatten(state)
    structure = json.loads(json.dumps(flat.structure, allow_nan=False))  # what the manifest stores
    tensors = {k: (t.clone() if isinstance(t, torch.Tensor) else t) for k, t in flat.tensors.items()}
    back = rebuild(structure, tensors, allow_pickle=False)
    assert same(back, state)


@pytest.mark.parametrize("seed", range(5))
def test_structure_roundtrip_through_storage(tmp_path, seed):
    r = random.Random(1000 + seed)
    state = {f"top{i}": rand_value(r) for i in range(4)}
    with ckpt.Checkpointer(str(tmp_path / "ck"), chunk_size=64 * 1024) as c:
        c.save(seed, state)
    target = {k: None for k in state}
    ckpt.Checkpointer(str(tmp_path / "ck")).load(seed, target)
    assert same(target, state)
