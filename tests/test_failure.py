"""The moment of failure: exit without close(), preemption signals, poisoned state, the save interval,
elastic restarts under torchrun, and the chaos harness."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

import ckpt
from ckpt.testing import run_ranks

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def child_env() -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}


# -- exit safety ----------------------------------------------------------------------------------------

@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("how", ["normal", "exception", "sigint", "dropped", "closed"])
def test_a_save_in_flight_at_exit_is_committed(tmp_path, how):
    # every time, not most of the time: three scripts, side by side (each one's start and its save's
    # fsync leave a core idle), each checked alone
    roots = [str(tmp_path / f"ck{attempt}") for attempt in range(3)]
    procs = [subprocess.Popen([sys.executable, os.path.join(HERE, "exit_child.py"), root, how], env=child_env(),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for root in roots]
    try:
        ended = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            p.kill()
    for root, p, (_, stderr) in zip(roots, procs, ended):
        r = subprocess.CompletedProcess(p.args, p.returncode, "", stderr)
        codes = {"normal": 0, "dropped": 0, "closed": 0, "exception": 1, "sigint": -signal.SIGINT}
        assert r.returncode == codes[how], r.stderr
        assert "cannot schedule" not in r.stderr
        if how == "closed":  # closed, nothing in flight: nothing to finish, nothing to say
            assert "interpreter is exiting" not in r.stderr, r.stderr
        if how == "sigint":  # issue 33 item 10: said at once after the traceback, not seconds of silence
            said = r.stderr.find("WARNING:ckpt:the interpreter is exiting: finishing the save of step 1 of ")
            assert 0 < r.stderr.find("KeyboardInterrupt") < said, r.stderr
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
            if "leases" not in d and "journal" not in d}  # who writes, and the run journal: no step's files


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


@pytest.mark.parametrize("setting, value, bad", [
    ("lr", float("nan"), "lr"), ("betas", (0.9, float("inf")), "betas/1"),
    ("weight_decay", float("-inf"), "weight_decay"), ("eps", float("nan"), "eps"), ("lr", "tensor", "lr")])
def test_a_non_finite_optimizer_setting_is_refused(tmp_path, setting, value, bad):
    """Issue 24 item 23: a NaN learning rate (or betas, weight decay, eps) in param_groups turns every
    parameter into NaN at the next step, though each tensor saved now is finite: refused like a NaN
    tensor. A learning rate held as a tensor is checked by the copy pass with the other tensors."""
    net, opt = trained()
    if value == "tensor":
        opt = torch.optim.Adam(net.parameters(), lr=torch.tensor(1e-3), foreach=False)
    state = {"model": net, "optim": opt}
    with ckpt.Checkpointer(tmp_path / "on") as c:
        c.save(1, state).wait()
        before = files_under(tmp_path / "on")
        if value == "tensor":
            opt.param_groups[0]["lr"].fill_(float("nan"))
        else:
            opt.param_groups[0][setting] = value
        with pytest.raises(ckpt.NonFiniteStateError, match="step 2 was not saved.*NaN or Inf in optim/param_groups/0/"
                           + bad) as e:
            c.save(2, state).wait()
        assert e.value.tensors == [f"optim/param_groups/0/{bad}"]
        assert c.steps() == [1] and files_under(tmp_path / "on") == before
    with ckpt.Checkpointer(tmp_path / "off", check_finite=False) as c:
        c.save(1, state).wait()
        assert c.steps() == [1]


def test_an_infinite_limit_in_param_groups_is_a_setting_not_poison(tmp_path):
    """Infinity is a deliberate "no limit" for many optimizer settings (a max_grad_norm, Prodigy's
    growth_rate): saved; NaN there is still refused."""
    net, opt = trained()
    opt.param_groups[0]["max_grad_norm"] = float("inf")
    opt.param_groups[0]["growth_rate"] = float("inf")
    state = {"model": net, "optim": opt}
    with ckpt.Checkpointer(tmp_path / "ck") as c:
        c.save(1, state).wait()
        opt.param_groups[0]["growth_rate"] = float("nan")
        with pytest.raises(ckpt.NonFiniteStateError) as e:
            c.save(2, state).wait()
        assert e.value.tensors == ["optim/param_groups/0/growth_rate"] and c.steps() == [1]


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


@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_poisoned_rank_refuses_the_save_on_every_rank(tmp_path):
    r0, r1 = run_ranks(2, _poisoned_rank, str(tmp_path))
    for r in (r0, r1):
        assert r["error"] is not None and "rank 1's state holds NaN or Inf in model/lin." in r["error"]
        assert r["ranks"] == [1] and r["steps"] == [1]
    assert r1["tensors"] and set(r1["tensors"]) <= {"model/lin.bias", "model/lin.weight"} and r0["tensors"] == []


# -- preemption -------------------------------------------------------------------------------------------

@pytest.mark.multiprocess
@pytest.mark.slow
def test_sigterm_saves_the_next_step_after_the_one_in_flight_and_stops(tmp_path):
    root = str(tmp_path / "ck")
    child = subprocess.Popen([sys.executable, os.path.join(HERE, "preempt_child.py"), root, "--hold-at", "3"],
                             env=child_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True)
    try:
        assert child.stdout.readline().split() == ["holding", "3"]
        child.send_signal(signal.SIGTERM)  # the save of step 3 may still be writing
        child.stdin.write("go\n")
        child.stdin.flush()
        out, err = child.communicate(timeout=120)
    finally:
        child.kill()
    assert child.returncode == 0, err  # the handler kept SIGTERM from killing it
    assert out.split() == ["stopped", "4"], (out, err)
    assert "preemption signal SIGTERM reached rank 0: saving step 4" in err
    assert "emergency save of step 4 committed" in err
    c = ckpt.Checkpointer(root)
    assert c.steps() == [3, 4]  # the save in flight completed first
    got = {"step": -1}
    c.load("latest", got, strict=False)
    assert got["step"] == 4
    c.close()
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # this process never installed one


@pytest.mark.multiprocess
@pytest.mark.slow
def test_sigterm_in_a_loop_that_never_asks_is_said_at_once_and_not_swallowed(tmp_path):
    """Issue 33 item 1: with preemption=True and a loop that never calls should_save(), SIGTERM was
    swallowed: no log line, the job trained on and exited 0 (to be SIGKILLed by the scheduler). Now
    the arrival is logged at once; past preemption_deadline ckpt finishes the save in flight and
    lets SIGTERM end the process."""
    root = str(tmp_path / "ck")
    child = subprocess.Popen([sys.executable, os.path.join(HERE, "preempt_child.py"), root, "--hold-at", "3",
                              "--never-ask", "--deadline", "1"], env=child_env(), stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().split() == ["holding", "3"]
        child.send_signal(signal.SIGTERM)  # the save of step 3 may still be writing
        said = child.stderr.readline()  # before the loop goes on: the child waits for our line below
        try:
            child.stdin.write("go\n")
            child.stdin.flush()
        except BrokenPipeError:  # this process was descheduled past the deadline: the child ended already
            pass
        out, err = child.communicate(timeout=120)
    finally:
        child.kill()
    assert said.startswith("ckpt: SIGTERM received: ckpt saves at the next should_save() call"), said + err
    assert "within 1s, ckpt finishes the saves in flight and lets SIGTERM end the process" in said
    assert "SIGTERM arrived 1s ago and should_save() was not called since" in err
    assert child.returncode == -signal.SIGTERM, (out, err)  # ended as SIGTERM ends it, not trained on to exit 0
    assert "stopped" not in out
    assert ckpt.open(root).steps() == [3]  # the save in flight was finished first


def test_a_signal_nobody_acted_on_is_passed_on_at_close(tmp_path):
    """The loop ended before the deadline without asking should_save(): close() still lets the signal
    reach the handler it would have reached without ckpt, once the saves are finished."""
    seen = []
    old = signal.signal(signal.SIGUSR1, lambda s, f: seen.append(s))
    try:
        c = ckpt.Checkpointer(tmp_path, preemption=[signal.SIGUSR1])
        c.save(1, {"w": torch.ones(4)})
        signal.raise_signal(signal.SIGUSR1)
        assert seen == [] and c.preemption_pending  # ckpt took it
        c.close()
        assert seen == [signal.SIGUSR1] and ckpt.open(tmp_path).steps() == [1]
    finally:
        signal.signal(signal.SIGUSR1, old)


def test_without_a_listener_the_signal_gets_its_old_behaviour(tmp_path):
    """A handler left behind after close() (a framework restoring what it saw) passes signals on."""
    seen = []
    old = signal.signal(signal.SIGUSR1, lambda s, f: seen.append(s))
    try:
        c = ckpt.Checkpointer(tmp_path, preemption=[signal.SIGUSR1])
        ours = signal.getsignal(signal.SIGUSR1)
        c.close()
        assert signal.getsignal(signal.SIGUSR1) is not ours  # restored at close
        signal.signal(signal.SIGUSR1, ours)  # as if a framework put ckpt's handler back
        signal.raise_signal(signal.SIGUSR1)
        assert seen == [signal.SIGUSR1]
    finally:
        signal.signal(signal.SIGUSR1, old)


def test_preemption_options_are_checked(tmp_path):
    for bad in ([signal.SIGKILL], "nope", [999]):
        with pytest.raises(ckpt.ConfigError, match="preemption"):
            ckpt.Checkpointer(tmp_path, preemption=bad)
    for bad in (0, -3, "often", "10 parsecs", 1.5j):
        with pytest.raises(ckpt.ConfigError, match="every"):
            ckpt.Checkpointer(tmp_path, every=bad)
    with pytest.raises(ckpt.ConfigError, match="max_overhead"):
        ckpt.Checkpointer(tmp_path, every="auto", max_overhead=2)
    with pytest.raises(ckpt.ConfigError, match="mtbf"):
        ckpt.Checkpointer(tmp_path, every="auto", mtbf=0)


def _preempted_rank(rank, world, path):
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = {"model": model, "optim": opt, "step": 0}
    c = ckpt.Checkpointer(path, preemption=True, every=4)
    saved, step = [], 0
    for step in range(1, 1000):
        model(torch.randn(4, 64)).sum().backward()
        for p in model.parameters():  # the gradient all-reduce that keeps real ranks in step
            torch.distributed.all_reduce(p.grad)
        opt.step()
        opt.zero_grad()
        state["step"] = step
        if rank == 2 and step == 6:
            os.kill(os.getpid(), signal.SIGTERM)  # only this rank is told
        if c.should_save(step):
            c.save(step, state)
            saved.append(step)
        if c.preempted:
            break
    c.close()
    return {"saved": saved, "stopped": step, "steps": c.steps()}


@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_signal_on_one_rank_makes_every_rank_save_the_same_step_and_stop(tmp_path):
    results = run_ranks(3, _preempted_rank, str(tmp_path))
    assert all(r == results[0] for r in results), results
    r = results[0]
    assert r["saved"] == [4, 8] and r["stopped"] == 8 and r["steps"] == [4, 8]  # 6 + 2: the agreed step


# -- the interval -----------------------------------------------------------------------------------------

def test_young_daly_with_its_bounds():
    from ckpt.schedule import auto_interval, parse_every

    i = auto_interval(0.5, 3600, 0.02, 1.0)
    assert i.young_daly_s == pytest.approx(60.0) and i.seconds == pytest.approx(60.0)
    assert auto_interval(2.0, 3600, 0.02, None).seconds == pytest.approx(120.0)  # 2s stall / 2% budget > √(2·2·3600)
    assert auto_interval(0.01, 100, 0.5, 9.0).seconds == 9.0  # never more often than a save completes
    assert "Young/Daly" in i.describe()
    assert parse_every("1h30min") == 5400.0 and parse_every("90s") == 90.0 and parse_every(" 2 h ") == 7200.0
    assert parse_every(7) == 7 and parse_every("auto") == "auto" and parse_every(0.5) == 0.5


def _loop(c, state, seconds_cap: float, want_saves: int):
    """Train until ``want_saves`` saves were asked for; returns, per save, (time, step, whether the previous
    save had finished, the interval that decided it)."""
    model, opt = state["model"], state["optim"]
    asked, last, t0 = [], None, time.monotonic()
    for step in range(1, 1_000_000):
        model(torch.randn(16, 512)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        if c.should_save(step):
            asked.append((time.monotonic(), step, last is None or last.done(), c.interval.seconds))
            last = c.save(step, state)
        if len(asked) >= want_saves or time.monotonic() - t0 > seconds_cap:
            break
    c.close()
    return asked


def test_a_time_interval_saves_no_more_often_than_asked(tmp_path):
    model = torch.nn.Linear(512, 512)
    state = {"model": model, "optim": torch.optim.SGD(model.parameters(), lr=1e-3)}
    c = ckpt.Checkpointer(tmp_path, every="0.2s")
    assert c.interval.kind == "time" and c.interval.seconds == 0.2
    asked = _loop(c, state, 60, 4)
    assert len(asked) == 4
    gaps = [b[0] - a[0] for a, b in zip(asked, asked[1:])]
    assert min(gaps) >= 0.2, gaps
    assert ckpt.open(tmp_path).steps() == [s for _, s, _, _ in asked]


def test_auto_interval_follows_the_measured_stall_and_waits_for_commits(tmp_path, caplog):
    model = torch.nn.Linear(512, 512)
    state = {"model": model, "optim": torch.optim.Adam(model.parameters()), "pad": torch.randn(4 << 20)}
    c = ckpt.Checkpointer(tmp_path, every="auto", mtbf=1.0, max_overhead=0.5)
    assert c.interval.seconds is None  # nothing measured yet: the first call saves
    with caplog.at_level("INFO", logger="ckpt"):
        asked = _loop(c, state, 120, 5)
    assert asked[0][1] == 1 and len(asked) == 5
    assert all(finished for _, _, finished, _ in asked)  # never more often than saves complete
    i = c.interval
    assert i.kind == "auto" and i.stall_s > 0 and i.commit_s is not None
    assert i.seconds == pytest.approx(max((2 * i.stall_s * 1.0) ** 0.5, i.stall_s / 0.5, i.commit_s))
    for a, b in zip(asked, asked[1:]):  # each save came at least the interval in force after the one before
        assert b[0] - a[0] >= b[3], asked
    assert any("saving auto: every" in r.getMessage() for r in caplog.records)
