"""``ckpt chaos``: real runs of a training command, really SIGKILLed and restarted."""

from __future__ import annotations

import json
import os
import sys
import tempfile

import pytest
from conftest import TORCHRUN

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
                    sys.executable, os.path.join(ROOT, "examples", "train.py"), "--dir", "{dir}", "--steps", "240",
                    "--every", "30")
    assert rc == 0 and rep["ok"], json.dumps(rep, indent=1)[-20000:]
    assert rep["reference_step"] == 240
    runs, kills = rep["runs"], rep["kills_done"]
    first, last = runs[0], runs[-1]
    assert "after the save of step" in first["killed"] and first["fresh"]
    # The second kill lands a draw into training; on a machine so loaded that the run is already closing by
    # then, the harness says it ended first (its Checkpointer closed) and kills nothing: one kill, two runs.
    assert len(runs) == kills + 1 and kills in (1, 2) and last["killed"] is None
    if kills == 2:
        assert "into training" in runs[1]["killed"]
    assert all(b["resumed_from"] == a["latest"] for a, b in zip(runs, runs[1:]))
    assert all(r["verified"] for r in runs)
    assert rep["compared"] > 10 and not rep["different"]
    g = rep["goodput"]  # from the chaos runs' journal: each kill a failure, resumed from where the next run did
    assert (g["starts"], g["failures"]) == (len(runs), kills)
    assert [f["resumed_from"] for f in g["failure_list"]] == [r["resumed_from"] for r in runs[1:]]
    assert sorted(os.listdir(work)) == sorted(["chaos", "reference", "reference.events", "reference.log"] + [
        f"chaos-{i}.{ext}" for i in range(1, len(runs) + 1) for ext in ("events", "log")])


def test_a_torchrun_job_is_killed_whole_and_resumes(capsys, monkeypatch):
    """The kill takes torchrun and both workers (one process group); the restarted job resumes on
    every rank from the step that verifies, and the final shards and per-rank state of both ranks match."""
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    rc, rep = chaos(capsys, "--kills", "1", "--", *TORCHRUN, "--standalone",
                    "--nproc-per-node", "2", os.path.join(ROOT, "examples", "train_distributed.py"), "--dir", "{dir}",
                    "--steps", "40", "--every", "10")
    assert rc == 0 and rep["ok"], json.dumps(rep, indent=1)[-20000:]
    killed, last = rep["runs"]
    assert killed["killed"] and last["resumed_from"] == killed["latest"] is not None
    assert rep["compared"] > 20


def test_a_script_that_forgets_its_data_position_is_caught(capsys, tmp_path, tmp_path_factory, monkeypatch):
    """And its goodput is reported from the runs' journal: the kill is a failure there, whose lost work,
    in steps, is what the next run did again."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    progress = tmp_path_factory.mktemp("progress") / "steps"
    rc, rep = chaos(capsys, "--kills", "1", "--", sys.executable, os.path.join(HERE, "chaos_child.py"), "{dir}",
                    "60", "5", str(progress))
    assert rc == 1 and not rep["ok"]
    killed, last = rep["runs"]
    assert killed["latest"] is not None and last["resumed_from"] == killed["latest"]  # the resume itself was right
    assert all(r["verified"] and not r["problems"] for r in rep["runs"])
    assert {"model/weight", "model/bias"} <= set(rep["different"])  # but the weights are not
    assert not os.listdir(tmp_path)  # without --workdir the runs were in a temporary directory, removed
    check_lost_work(rep, [line.split() for line in progress.read_text().splitlines()])


def check_lost_work(rep: dict, progress: list[list[str]]) -> None:
    """The chaos runs' goodput: a failure per kill, each losing the steps the next run did again (the
    journal's last-seen time trails the kill by at most the steps made after it). ``progress``: the
    "pid step time" lines of the reference run, then of each chaos run."""
    runs, g = rep["runs"], rep["goodput"]
    assert g["starts"] == len(runs) and g["failures"] == rep["kills_done"] >= 1, json.dumps(g, indent=1)
    pids = list(dict.fromkeys(p for p, _, _ in progress))[1:]  # each chaos run's, in order
    assert len(pids) == len(runs)
    for killed, after, f in zip(runs, runs[1:], g["failure_list"]):
        assert f["resumed_from"] == after["resumed_from"] and f["at"] <= killed["killed_at"]
        done = [(int(s), float(t)) for p, s, t in progress if p == pids[killed["run"] - 1]]
        redone = max(s for s, _ in done) - (after["resumed_from"] or 0)  # steps the next run did again
        unseen = sum(t > f["at"] for _, t in done)  # steps made after the journal last saw the run
        assert 0 <= redone - f["lost_steps"] <= unseen + 1, (redone, f, unseen)
        assert f["lost_s"] >= 0 and killed["killed_at"] - f["at"] < 2.0  # seen every 0.05 s, not every minute
    assert g["runs"][-1]["ended"] == "closed" and g["goodput_pct"] > 0  # the last run ran to its end
    assert abs(g["goodput_s"] + sum(g["badput"][k] for k in ("checkpoint_stall_s", "lost_work_s", "restart_load_s"))
               - g["wall_s"]) < 0.01


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
