"""``ckpt chaos``: real runs of a training command, really SIGKILLed and restarted."""

from __future__ import annotations

import json
import os
import sys
import tempfile

import pytest

from ckpt import cli

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]  # spawns processes and takes more than a few seconds

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


@pytest.fixture(autouse=True)
def _importable(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))


def chaos(capsys, *argv: str) -> tuple[int, dict]:
    rc = cli.main(["chaos", "--json", *argv])
    return rc, json.loads(capsys.readouterr().out)


def test_a_correct_training_script_survives_kills_during_saves_and_training(capsys, tmp_path):
    work = tmp_path / "work"
    rc, rep = chaos(capsys, "--kills", "2", "--seed", "3", "--workdir", str(work), "--",
                    sys.executable, os.path.join(ROOT, "examples", "train.py"), "--dir", "{dir}", "--steps", "80",
                    "--every", "10")
    assert rc == 0 and rep["ok"], json.dumps(rep, indent=1)[-20000:]
    assert rep["kills_done"] == 2 and rep["reference_step"] == 80
    first, second, last = rep["runs"]
    assert "after the save of step" in first["killed"] and "into training" in second["killed"]
    assert first["fresh"] and second["resumed_from"] == first["latest"] and last["resumed_from"] == second["latest"]
    assert all(r["verified"] for r in rep["runs"])
    assert rep["compared"] > 10 and not rep["different"]
    assert sorted(os.listdir(work)) == ["chaos", "chaos-1.events", "chaos-1.log", "chaos-2.events", "chaos-2.log",
                                        "chaos-3.events", "chaos-3.log", "reference", "reference.events",
                                        "reference.log"]


def test_a_torchrun_job_is_killed_whole_and_resumes(capsys, monkeypatch):
    """The kill takes torchrun and both workers (one process group); the restarted job resumes on
    every rank from the step that verifies, and the final shards and per-rank state of both ranks match."""
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    rc, rep = chaos(capsys, "--kills", "1", "--", sys.executable, "-m", "torch.distributed.run", "--standalone",
                    "--nproc-per-node", "2", os.path.join(ROOT, "examples", "train_distributed.py"), "--dir", "{dir}",
                    "--steps", "40", "--every", "10")
    assert rc == 0 and rep["ok"], json.dumps(rep, indent=1)[-20000:]
    killed, last = rep["runs"]
    assert killed["killed"] and last["resumed_from"] == killed["latest"] is not None
    assert rep["compared"] > 20


def test_a_script_that_forgets_its_data_position_is_caught(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    rc, rep = chaos(capsys, "--kills", "1", "--", sys.executable, os.path.join(HERE, "chaos_child.py"), "{dir}",
                    "60", "5")
    assert rc == 1 and not rep["ok"]
    killed, last = rep["runs"]
    assert killed["latest"] is not None and last["resumed_from"] == killed["latest"]  # the resume itself was right
    assert all(r["verified"] and not r["problems"] for r in rep["runs"])
    assert {"model/weight", "model/bias"} <= set(rep["different"])  # but the weights are not
    assert not os.listdir(tmp_path)  # without --workdir the runs were in a temporary directory, removed


def test_usage_errors(capsys):
    assert cli.main(["chaos", "--", sys.executable, "-c", "pass"]) == 2
    assert "{dir}" in capsys.readouterr().err
    assert cli.main(["chaos"]) == 2
    assert "no training command" in capsys.readouterr().err


def test_a_command_that_fails_on_its_own_is_reported(capsys):
    rc, rep = chaos(capsys, "--kills", "1", "--", sys.executable, "-c", "import sys; sys.exit(4)", "{dir}")
    assert rc == 1 and "exit code 4" in rep["problems"][0]
    rc, rep = chaos(capsys, "--timeout", "1", "--", sys.executable, "-c", "import time; time.sleep(60)", "{dir}")
    assert rc == 1 and "did not end within 1 s" in rep["problems"][0]


def test_a_kill_waits_until_every_process_of_the_job_is_gone(tmp_path):
    """The harness reads the newest step after a kill: the leader (torchrun) can be reaped while a
    worker is still finishing a rename, so it waits for every process of the group, not the leader."""
    import subprocess
    import time

    from ckpt.chaos import _group_members, wait_group_gone

    done = tmp_path / "straggler-done"
    straggler = f"import time; time.sleep(2); open({str(done)!r}, 'w').close()"  # outlives its leader
    leader = subprocess.Popen(["sh", "-c", f"{sys.executable} -c \"{straggler}\" & exit 0"], start_new_session=True)
    leader.wait()
    assert _group_members(leader.pid) and not done.exists()  # the straggler still runs
    wait_group_gone(leader.pid, time.monotonic() + 30)
    assert done.exists() and not _group_members(leader.pid)
