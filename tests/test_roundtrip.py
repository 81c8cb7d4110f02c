"""Save → load gives back exactly what was saved, for every kind of state ckpt accepts."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch
from conftest import assert_same_tensors, clone_tensors, make_model, make_state, train_steps

import ckpt


def test_model_optimizer_scheduler_roundtrip(ckdir):
    state = make_state(seed=1, steps=5)
    want_model = clone_tensors(state["model"].state_dict())
    want_opt = state["optim"].state_dict()
    want_sched = state["sched"].state_dict()
    with ckpt.Checkpointer(ckdir) as c:
        h = c.save(5, state)
        m = h.wait()
    assert m.raw_bytes > 0 and m.chunks >= 1 and m.duration_s is not None and m.duration_s >= m.stall_s

    fresh = make_state(seed=99, steps=0)
    assert ckpt.Checkpointer(ckdir).load("latest", fresh) == 5
    assert_same_tensors(want_model, fresh["model"].state_dict())
    got_opt = fresh["optim"].state_dict()
    assert got_opt["param_groups"] == want_opt["param_groups"]
    for pid, s in want_opt["state"].items():
        for name, v in s.items():
            assert torch.equal(got_opt["state"][pid][name], v), (pid, name)
    assert fresh["sched"].state_dict() == want_sched
    assert fresh["step"] == 5


def test_loaded_training_continues_identically(ckdir):
    """Train 6 steps straight vs 3 steps, save, restore into new objects, 3 more steps."""
    torch.manual_seed(7)
    straight = make_state(seed=3, steps=0)
    rng = ckpt.RNGState()
    train_steps(straight["model"], straight["optim"], 3, straight["sched"])
    c = ckpt.Checkpointer(ckdir)
    c.save(3, {**straight, "rng": rng}).wait()
    train_steps(straight["model"], straight["optim"], 3, straight["sched"])
    c.close()

    resumed = make_state(seed=50, steps=0)
    torch.manual_seed(999)  # a different stream: only the checkpoint's RNG state can fix it
    ckpt.Checkpointer(ckdir).load("latest", {**resumed, "rng": ckpt.RNGState()})
    train_steps(resumed["model"], resumed["optim"], 3, resumed["sched"])
    assert_same_tensors(straight["model"].state_dict(), resumed["model"].state_dict())


def test_rng_state_restores_every_generator(ckdir):
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    with ckpt.Checkpointer(ckdir) as c:
        c.save(0, {"rng": ckpt.RNGState()})
    want = (random.random(), np.random.rand(), torch.rand(3))
    random.seed(10), np.random.seed(20), torch.manual_seed(30)
    with ckpt.Checkpointer(ckdir) as c:
        c.load(0, {"rng": ckpt.RNGState()})
    got = (random.random(), np.random.rand(), torch.rand(3))
    assert got[0] == want[0] and got[1] == want[1] and torch.equal(got[2], want[2])


def test_plain_values_keep_their_types(ckdir):
    values = {
        "int": 3, "float": 2.5, "big": 2**70, "neg": -1, "nan": float("nan"), "inf": float("-inf"),
        "str": "héllo/π", "none": None, "bool": True, "list": [1, 2.0, "x", [None]],
        "tuple": (1, (2, 3)), "intkeys": {0: "a", 1: {2: (3,)}}, "bytes": b"\x00\xff",
        "dtype": torch.bfloat16, "device": torch.device("cpu"), "size": torch.Size([2, 3]),
        "npscalar": np.float32(1.5), "npint": np.int64(-7), "empty": {},
    }
    with ckpt.Checkpointer(ckdir) as c:
        c.save(1, {"v": values})
    got = {"v": {}}
    ckpt.Checkpointer(ckdir).load(1, got)
    got = got["v"]
    assert got.keys() == values.keys()
    for k, v in values.items():
        if k == "nan":
            assert math.isnan(got[k])
        else:
            assert got[k] == v and type(got[k]) is type(v), k


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8,
                                   torch.int64, torch.uint8, torch.bool, torch.complex64, torch.float8_e4m3fn])
def test_tensor_dtypes_bit_exact(ckdir, dtype):
    g = torch.Generator().manual_seed(0)
    raw = torch.randint(0, 256, (7, 13, 3), dtype=torch.uint8, generator=g)
    if dtype == torch.bool:
        raw = raw % 2  # only 0 and 1 are valid bools
    t = raw.view(dtype) if dtype.itemsize == 1 else torch.randn(7, 13, 3, generator=g).to(dtype)
    state = {"t": t, "scalar": t.flatten()[0].clone().reshape(()), "empty": t.new_empty((0, 4))}
    with ckpt.Checkpointer(ckdir) as c:
        c.save(0, state)
    target = {k: torch.zeros_like(v) for k, v in state.items()}
    ckpt.Checkpointer(ckdir).load(0, target)
    for k in state:
        assert target[k].shape == state[k].shape and target[k].dtype == state[k].dtype
        assert target[k].reshape(-1).view(torch.uint8).equal(state[k].reshape(-1).view(torch.uint8)), k


def test_noncontiguous_sources_and_targets(ckdir):
    base = torch.randn(64, 32)
    state = {"t": base.t(), "strided": base[::2, 1::3]}
    want = clone_tensors(state)
    with ckpt.Checkpointer(ckdir) as c:
        c.save(0, state)
    target_base = torch.zeros(64, 32)
    target = {"t": target_base.t(), "strided": torch.zeros(32, 11)}  # a transposed, non-contiguous view
    ckpt.Checkpointer(ckdir).load(0, target)
    assert torch.equal(target["t"], want["t"]) and torch.equal(target["strided"], want["strided"])
    assert torch.equal(target_base.t(), want["t"])  # loaded in place through the view


def test_numpy_arrays_and_new_keys(ckdir):
    arr = np.arange(12, dtype=np.float32).reshape(3, 4)
    with ckpt.Checkpointer(ckdir) as c:
        c.save(0, {"a": arr, "nested": {"w": torch.ones(3), "k": [torch.zeros(2)]}})
    target = {"a": np.zeros((3, 4), np.float32), "nested": {}}
    ckpt.Checkpointer(ckdir).load(0, target)
    assert isinstance(target["a"], np.ndarray) and (target["a"] == arr).all()
    assert torch.equal(target["nested"]["w"], torch.ones(3))  # not in the target: created
    assert torch.equal(target["nested"]["k"][0], torch.zeros(2))


def test_many_small_tensors_are_packed(ckdir):
    state = {f"b{i}": torch.full((10,), float(i)) for i in range(500)}
    with ckpt.Checkpointer(ckdir, chunk_size=1 << 20) as c:
        m = c.save(0, state).wait()
    assert m.chunks == 1  # 500 tiny tensors, one chunk object
    target = {k: torch.empty(10) for k in state}
    ckpt.Checkpointer(ckdir).load(0, target)
    assert all(torch.equal(target[k], state[k]) for k in state)


def test_large_tensor_split_into_chunks(ckdir):
    t = torch.randn(1024, 1024)  # 4 MiB
    with ckpt.Checkpointer(ckdir, chunk_size=1 << 20) as c:
        m = c.save(0, {"t": t, "small": torch.ones(3)}).wait()
    assert m.chunks == 5
    target = {"t": torch.empty(1024, 1024), "small": torch.empty(3)}
    ckpt.Checkpointer(ckdir).load(0, target)
    assert torch.equal(target["t"], t)


def test_memory_url(tmp_path):
    url = f"memory://ckpt-test-{tmp_path.name}"
    state = make_state()
    want = clone_tensors(state["model"].state_dict())
    with ckpt.Checkpointer(url) as c:
        c.save(1, state)
        c.save(2, state)
    fresh = make_state(seed=5, steps=0)
    c2 = ckpt.Checkpointer(url)
    assert c2.steps() == [1, 2]
    assert c2.load("latest", fresh) == 2
    assert_same_tensors(want, fresh["model"].state_dict())
    c2.close()


def test_save_into_new_model_loads_into_parameters(ckdir):
    m = make_model(0)
    with ckpt.Checkpointer(ckdir) as c:
        c.save(0, {"model": m})
    m2 = make_model(1)
    params = list(m2.parameters())
    ckpt.Checkpointer(ckdir).load(0, {"model": m2})
    assert all(p is q for p, q in zip(params, m2.parameters()))  # same Parameter objects, new values
    assert_same_tensors(m.state_dict(), m2.state_dict())


def test_file_url_is_the_local_directory(tmp_path):
    state = {"w": torch.randn(100)}
    with ckpt.Checkpointer(f"file://{tmp_path}/ck") as c:
        c.save(3, state)
    assert (tmp_path / "ck" / "steps" / "000000000003" / "MANIFEST.json").exists()
    target = {"w": torch.empty(100)}
    assert ckpt.Checkpointer(str(tmp_path / "ck")).load("latest", target) == 3
    assert torch.equal(target["w"], state["w"])
