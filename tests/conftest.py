from __future__ import annotations

import os

# oneDNN's bf16 matmul dies of SIGILL (exit -4) on machines that report AMX/AVX512-BF16 without
# enabling it, so the suite's result depended on the machine it ran on. Tests that train in bf16, and
# every process they start (all inherit this environment), stay on AVX2. Set before torch loads
# oneDNN; the test process's choice, never ckpt's (tests/test_onednn_isa.py checks the scripts too).
os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX2")

import logging  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import uuid  # noqa: E402
from typing import IO  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

from ckpt.storage.local import LocalStorage  # noqa: E402
from ckpt.testing import FaultyStorage, MotoS3, RcloneS3, storage_options  # noqa: E402

# ``python -m torch.distributed.run`` less most of the finalization of torchrun's own interpreter, which
# collected the garbage of everything torch had imported after the job's last worker had ended: 2.5 s
# on the loaded machine after torchrun's main returned (a process that imported torch: 2.3-3 s, 0.5-0.9 s
# frozen), in every torchrun job of the suite. Its exit hooks still run (gc.freeze is the first
# registered, so the last to run); the workers are the job's, untouched.
TORCHRUN = [sys.executable, "-c", "import atexit, gc, runpy; atexit.register(gc.freeze); "
            "runpy.run_module('torch.distributed.run', run_name='__main__', alter_sys=True)"]


def start_job(cmd: list[str], env: dict[str, str]) -> tuple[subprocess.Popen, IO[str]]:
    """``cmd`` (a torchrun job) running, its output going to a file: a test runs another job beside it
    (a job's start, rendezvous and end leave a core idle) and reads this one's output with :func:`finish_job`."""
    log = tempfile.TemporaryFile("w+")
    return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, text=True), log


def finish_job(job: tuple[subprocess.Popen, IO[str]], timeout: float = 300) -> str:
    """The output of a job from :func:`start_job`, once it ended with exit code 0 (killed if it did not
    end within ``timeout``)."""
    p, log = job
    try:
        p.wait(timeout=timeout)
    finally:
        p.kill()
    with log:
        log.seek(0)
        out = log.read()
    assert p.returncode == 0, out[-6000:]
    return out


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


class GatedDisk(FaultyStorage):
    """LocalStorage at ``root`` whose chunk writes wait until :meth:`open`: hand it to the
    Checkpointer (``storage=``) to act while a save is provably still in flight, without sleeping.
    ``entered`` is set when the first chunk write waits."""

    def __init__(self, root: str):
        super().__init__(LocalStorage(root))
        self.chunk_gate = self.gate("write", key=r"^chunks/")
        self.entered = self.chunk_gate.entered

    def open(self) -> None:
        self.chunk_gate.open()


@pytest.fixture
def gate(ckdir):
    """A :class:`GatedDisk` over ``ckdir``; opened at teardown, so a failed test leaves no writer waiting."""
    g = GatedDisk(ckdir)
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


# -- real S3-compatible servers on 127.0.0.1, one of each per test session -------------------------------
BUCKET = "ckpt-test"
MiB = 1 << 20


@pytest.fixture(scope="session")
def rclone_server(tmp_path_factory):
    srv = RcloneS3(str(tmp_path_factory.mktemp("rclone"))).start()
    srv.make_bucket(BUCKET)
    yield srv
    srv.kill()


@pytest.fixture(scope="session")
def moto_server():
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    srv = MotoS3().start()
    srv.make_bucket(BUCKET)
    yield srv
    srv.stop()


@pytest.fixture(params=["rclone", "moto"])
def server(request):
    return request.getfixturevalue(f"{request.param}_server")


def s3_url() -> str:
    return f"s3://{BUCKET}/{uuid.uuid4().hex[:10]}"


def fast(endpoint: str, **extra) -> dict:
    """Storage options with short timeouts so failures surface quickly in tests."""
    return storage_options(endpoint, retry_deadline=extra.pop("retry_deadline", 20), connect_timeout=2,
                           read_timeout=extra.pop("read_timeout", 5), **extra)


@pytest.fixture
def run(capsys):
    """The command line in this process: ``run(*args) -> (exit code, stdout, stderr)``; stdout is a
    pipe here, not a terminal (tables come out as such; see test_inspect's ``on_terminal``)."""
    from ckpt import cli

    def call(*args):
        rc = cli.main([str(a) for a in args])
        out, err = capsys.readouterr()
        return rc, out, err
    return call
