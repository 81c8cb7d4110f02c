"""The moment of failure: exit without close(), preemption signals, poisoned state, the save interval,
elastic restarts under torchrun, and the chaos harness."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
import torch
from dist_helpers import run_ranks

import ckpt

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def child_env() -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}


# -- exit safety ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("how", ["normal", "exception", "sigint", "dropped"])
def test_a_save_in_flight_at_exit_is_committed(tmp_path, how):
    for attempt in range(3):  # every time, not most of the time
        root = str(tmp_path / f"ck{attempt}")
        r = subprocess.run([sys.executable, os.path.join(HERE, "exit_child.py"), root, how], env=child_env(),
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == {"normal": 0, "dropped": 0, "exception": 1, "sigint": -signal.SIGINT}[how], r.stderr
        assert "cannot schedule" not in r.stderr
        got = {"w": torch.zeros(16 << 20)}
        assert ckpt.Checkpointer(root).load("latest", got) == 1
        assert torch.equal(got["w"], torch.arange(16 << 20, dtype=torch.float32))


# -- poisoned state ----------------------------------------------------------------------------------------

class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(300, 200)
        self.register_buffer("mask", torch.triu(torch.full((8, 8), float("-inf")), 1))  # -inf is normal here


def trained(seed: int = 0):
    torch.manual_seed(seed)
    net = Net()
    opt = torch.optim.Adam(net.parameters())
    net.lin(torch.randn(4, 300)).sum().backward()
    opt.step()
    return net, opt


def files_under(root) -> set[str]:
    return {os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs
            if "leases" not in d}


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("where", ["param", "optimizer", "strided"])
def test_a_poisoned_save_is_refused_and_latest_stays_healthy(tmp_path, native, where):
    net, opt = trained()
    state = {"model": net, "optim": opt, "step": 1}
    with ckpt.Checkpointer(tmp_path, native=native, keep_last=2) as c:
        c.save(1, state).wait()
        before = files_under(tmp_path)
        with torch.no_grad():
            if where == "param":
                net.lin.weight[17, 123] = float("nan")
                bad = "model/lin.weight"
            elif where == "optimizer":
                opt.state[net.lin.bias]["exp_avg"][5] = float("inf")
                bad = "exp_avg"
            else:  # a parameter that is a transposed view: copied by torch, checked too
                state["extra"] = torch.nn.ParameterDict({"t": torch.randn(300, 200).t()})
                state["extra"]["t"][0, 0] = float("-inf")
                bad = "extra/t"
        h = c.save(2, state)
        with pytest.raises(ckpt.NonFiniteStateError, match="step 2 was not saved.*NaN or Inf") as e:
            h.wait()
        assert any(bad in t for t in e.value.tensors) and e.value.ranks == [0]
        assert c.steps() == [1] and c.latest() == 1
        assert files_under(tmp_path) == before  # nothing of step 2 was written
        with torch.no_grad():  # healed: the next save goes through
            for p in [*net.parameters(), *state.get("extra", {}).values()]:
                p.nan_to_num_(0.0, 0.0, 0.0)
            for s in opt.state.values():
                s["exp_avg"].nan_to_num_(0.0, 0.0, 0.0)
        c.save(3, state).wait()
        assert c.steps() == [1, 3]


def test_buffers_and_loose_tensors_are_checked_only_when_asked(tmp_path):
    net, opt = trained()
    state = {"model": net, "optim": opt, "scores": torch.tensor([1.0, float("nan")])}
    with ckpt.Checkpointer(tmp_path / "default") as c:
        c.save(1, state).wait()  # the -inf mask buffer and the NaN score are not parameters
    with ckpt.Checkpointer(tmp_path / "all", check_finite="all") as c:
        with pytest.raises(ckpt.NonFiniteStateError) as e:
            c.save(1, state).wait()
        assert e.value.tensors == ["model/mask", "scores"] and c.steps() == []
    with torch.no_grad():
        net.lin.weight.fill_(float("nan"))
    with ckpt.Checkpointer(tmp_path / "off", check_finite=False) as c:
        c.save(1, state).wait()
        assert c.steps() == [1]
    with pytest.raises(ckpt.ConfigError, match="check_finite"):
        ckpt.Checkpointer(tmp_path / "bad", check_finite="some")


def _poisoned_rank(rank, world, path):
    net, opt = trained(seed=rank)
    state = {"model": net, "optim": opt}  # replicated: each tensor is checked by the rank that writes it
    c = ckpt.Checkpointer(path)
    c.save(1, state).wait()
    if rank == 1:  # all its parameters: whichever of them this rank writes holds a NaN
        with torch.no_grad():
            net.lin.bias[3] = net.lin.weight[5, 5] = float("nan")
    try:
        c.save(2, state).wait()
    except ckpt.NonFiniteStateError as e:
        out = {"error": str(e), "ranks": e.ranks, "tensors": e.tensors}
    else:
        out = {"error": None}
    out["steps"] = c.steps()
    c.close()
    return out


def test_a_poisoned_rank_refuses_the_save_on_every_rank(tmp_path):
    r0, r1 = run_ranks(2, _poisoned_rank, str(tmp_path))
    for r in (r0, r1):
        assert r["error"] is not None and "rank 1's state holds NaN or Inf in model/lin." in r["error"]
        assert r["ranks"] == [1] and r["steps"] == [1]
    assert r1["tensors"] and set(r1["tensors"]) <= {"model/lin.bias", "model/lin.weight"} and r0["tensors"] == []
