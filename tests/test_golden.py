"""Checkpoints written by an earlier ckpt (``tests/data/golden/``, made by ``tests/golden.py``) must
keep loading bit-exact, through ``Checkpointer.load``, ``ckpt.open`` and the CLI, on any world size.
If a change to the format makes one of these fail, the format needs a new version and a reader for
the old one, not a new golden file."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
import torch
from golden import DATA, delta_state, digest, masked_state, model_state, plain_state, shard_state

import ckpt
from ckpt import cli
from ckpt.format import manifest as mf
from ckpt.testing import run_ranks

EXPECTED = json.load(open(os.path.join(DATA, "expected.json")))


@pytest.fixture
def golden(tmp_path):
    """A copy (a load may protect a step or write a lease; the files in the repository stay as made)."""
    def copy(name: str) -> str:
        dst = str(tmp_path / name)
        shutil.copytree(os.path.join(DATA, name), dst)
        return dst
    return copy


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8))


@pytest.mark.parametrize("name", ["plain", "model", "sharded", "delta", "index", "masked"])
def test_the_stored_bytes_are_what_they_were(golden, name):
    root = golden(name)
    assert cli.main(["verify", root, "--all"]) == 0
    steps = sorted(int(s) for s in EXPECTED[name] if s.isdigit())
    with ckpt.open(root) as r:
        assert r.steps() == steps
        for s in steps:
            want = EXPECTED[name][str(s)]
            assert r.manifest(s).format_version == want["format"]
            assert digest(r.tensors(s)) == want["tensors"]


def stored(root: str, step: int) -> dict[str, torch.Tensor]:
    """The step's tensors as ``ckpt.open`` reads them (checked against the recorded digests above).
    Loads are compared with these, not with the states recomputed: training on another CPU or torch
    version may round differently, and that is not the format's business."""
    with ckpt.open(root) as r:
        return r.tensors(step)


def test_plain_values_and_tensors_load_in_place(golden):
    root = golden("plain")
    for s in (1, 2):
        want = plain_state(s)
        got = {k: (torch.full_like(v, 7) if isinstance(v, torch.Tensor) else None) for k, v in want.items()}
        got["strided"] = torch.zeros(6, 5)
        assert ckpt.Checkpointer(root).load(s, got) == s
        tensors = stored(root, s)
        for k, v in want.items():
            if isinstance(v, torch.Tensor):
                assert same(got[k], tensors[k]), k
            else:
                assert got[k] == v, k
        assert torch.equal(got["ints"], torch.arange(-50, 50) * s) and torch.equal(got["zeros"], want["zeros"])


def test_a_model_optimizer_scheduler_rng_and_numpy_resume(golden):
    root = golden("model")
    want = model_state(2)  # for the plain values and the generators (seeded, the same everywhere)
    want_rng = (torch.get_rng_state(), np.random.get_state()[1].copy())
    got = model_state(0)  # untrained, other generators
    assert ckpt.Checkpointer(root).load("latest", got) == 2
    tensors = stored(root, 2)
    for k, v in got["model"].state_dict().items():
        assert same(v, tensors[f"model/{k}"]), k
    opt = got["optim"].state_dict()
    assert len(opt["state"]) == 4 and all(set(v) == {"step", "exp_avg", "exp_avg_sq"} for v in opt["state"].values())
    assert opt["param_groups"] == want["optim"].state_dict()["param_groups"]
    for i, st in opt["state"].items():
        for k, v in st.items():
            assert same(v, tensors[f"optim/state/{i}/{k}"]), (i, k)
    assert want["sched"].state_dict() == got["sched"].state_dict()
    assert torch.equal(torch.get_rng_state(), want_rng[0]) and np.array_equal(np.random.get_state()[1], want_rng[1])
    for k, v in want["np"].items():
        g = got["np"][k]
        assert type(g) is type(v) and np.array_equal(g, v) and getattr(g, "dtype", None) == getattr(v, "dtype", None)


@pytest.mark.parametrize("name", ["sharded", "index"])
def test_a_two_rank_checkpoint_loads_on_one_process(golden, name):
    root = golden(name)
    state = {"w": torch.zeros(12, 20), "bias": torch.zeros(7), "pos": ckpt.PerRank({"position": 0}), "step": 0}
    assert ckpt.Checkpointer(root).load(2, state, rank_map=[1]) == 2
    assert torch.equal(state["w"], torch.arange(240.0).reshape(12, 20) * 2)
    assert torch.equal(state["bias"], shard_state(0, 2)["bias"]) and state["step"] == 2
    assert state["pos"].value == {"position": 21}


def _load_on_rank(rank: int, world: int, root: str) -> dict:
    want = shard_state(rank, 2)
    state = {"w": ckpt.LocalShard(torch.zeros_like(want["w"].tensor), want["w"].offsets, (12, 20)),
             "bias": torch.zeros(7), "pos": ckpt.PerRank({"position": 0}), "step": 0}
    ckpt.Checkpointer(root).load(2, state)
    return {"w": torch.equal(state["w"].tensor, want["w"].tensor), "pos": state["pos"].value == want["pos"].value}


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("name", ["sharded", "index"])
def test_a_two_rank_checkpoint_loads_on_two_ranks(golden, name):
    assert run_ranks(2, _load_on_rank, golden(name)) == [{"w": True, "pos": True}] * 2


def test_export_of_a_golden_step(golden, tmp_path):
    from safetensors.torch import load_file

    out = str(tmp_path / "m.safetensors")
    root = golden("model")
    assert cli.main(["export", root, "--to", out, "--keys", "model/", "--strip-prefix"]) == 0
    model = model_state(0)["model"]
    model.load_state_dict(load_file(out))
    tensors = stored(root, 2)
    for k, v in model.state_dict().items():
        assert same(v, tensors[f"model/{k}"]), k


def test_delta_chains_load_in_place_link_by_link(golden):
    """Format v4: step 3's changed chunks are deltas of step 2's, which are deltas of step 1's."""
    root = golden("delta")
    with ckpt.Checkpointer(root) as c:
        m = c.manifest(3)
        assert m.format_version == 4
        chains = [mf.chain(m.chunks, g.chunk) for t in m.tensors if t.key == "emb" for g in t.shards[0].segments]
        assert chains and all(len(ch) == 3 for ch in chains)
        for s in (3, 2, 1):
            want = delta_state(s)
            got = {k: (torch.zeros_like(v) if isinstance(v, torch.Tensor) else -1) for k, v in want.items()}
            assert c.load(s, got) == s and got["step"] == s
            tensors = stored(root, s)
            assert all(same(got[k], tensors[k]) for k in tensors)
            assert c.last_load.bytes_read > sum(m.chunks[h].stored for h in c.last_load.chunks) or s == 1


@pytest.mark.parametrize("disabled", ["", "1"], ids=["core", "numpy"])
def test_zero_masked_chunks_load_whole_and_in_part(golden, monkeypatch, disabled):
    """Chunk format v3: a pruned layer's chunks behind zero masks, and step 2's deltas of them, decoded
    with the compiled core and without."""
    root = golden("masked")
    monkeypatch.setenv("CKPT_NO_EXT", disabled)
    with ckpt.Checkpointer(root) as c:
        m = c.manifest(2)
        assert {"planes/3", "xor/3"} <= {info.codec for info in m.chunks.values()}
        for s in (2, 1):
            want = masked_state(s)
            got = {k: (torch.zeros_like(v) if isinstance(v, torch.Tensor) else -1) for k, v in want.items()}
            assert c.load(s, got) == s and got["step"] == s
            tensors = stored(root, s)
            assert all(same(got[k], tensors[k]) for k in tensors)
        n = want["pruned"].numel()
        part = torch.zeros(n // 3)  # a third of the layer, from inside its chunks: decoded in part
        c.load(2, {"pruned": ckpt.LocalShard(part, (n // 3,), (n,))}, strict=False)
        assert same(part, stored(root, 2)["pruned"][n // 3 : 2 * n // 3])
