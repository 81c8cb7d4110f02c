"""A Checkpointer (or ``ckpt ls`` / ``inspect`` / ``verify``) pointed at the wrong level of a run
(issue 33.3): ``runs/exp1/steps``, a step directory, ``chunks/``, or the parent of several runs.
``load("latest")`` used to start fresh without a word and the next save nested a second checkpoint
inside the first; now the path is refused, naming the root meant, before anything is written."""

from __future__ import annotations

import os

import pytest
import torch

import ckpt
from ckpt import cli
from ckpt.errors import NotARootError
from ckpt.format import paths


def a_run(root: str, *steps: int) -> None:
    with ckpt.Checkpointer(root) as c:
        for s in steps:
            c.save(s, {"w": torch.full((16,), float(s))})


def tree(root: str) -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, n), root) for d, ds, fs in os.walk(root) for n in ds + fs)


@pytest.mark.parametrize("level", ["steps", "step", "chunks"])
def test_a_checkpointer_inside_a_root_is_refused_naming_the_root(tmp_path, level):
    root = str(tmp_path / "runs" / "exp1")
    a_run(root, 1, 2)
    before = tree(root)
    inner = {"steps": os.path.join(root, paths.STEPS), "step": os.path.join(root, paths.step_dir(2)),
             "chunks": os.path.join(root, paths.CHUNKS)}[level]
    with pytest.raises(NotARootError) as e:
        ckpt.Checkpointer(inner)
    assert e.value.roots == [root]
    assert f"pass {root} as the path" in str(e.value)
    assert isinstance(e.value, ckpt.NotACheckpointError)
    assert tree(root) == before  # nothing nested, nothing changed
    with ckpt.Checkpointer(root) as c:
        assert c.load("latest", {"w": torch.zeros(16)}) == 2


def test_the_parent_of_several_runs_is_refused_naming_them(tmp_path):
    runs = str(tmp_path / "runs")
    a_run(os.path.join(runs, "exp1"), 1)
    a_run(os.path.join(runs, "exp2"), 5)
    os.makedirs(os.path.join(runs, "notes"))
    with pytest.raises(NotARootError) as e:
        ckpt.Checkpointer(runs)
    assert e.value.roots == [os.path.join(runs, "exp1"), os.path.join(runs, "exp2")]
    assert "exp1" in str(e.value) and "exp2" in str(e.value) and "notes" not in str(e.value)
    assert sorted(os.listdir(runs)) == ["exp1", "exp2", "notes"]


def test_roots_new_empty_or_beside_other_files_are_accepted(tmp_path):
    a_run(str(tmp_path / "fresh"), 1)  # created by the Checkpointer
    os.makedirs(tmp_path / "mixed" / "logs")
    (tmp_path / "mixed" / "config.yaml").write_text("lr: 0.1\n")
    a_run(str(tmp_path / "mixed"), 1)  # a run directory that holds other things too
    a_run(str(tmp_path / "steps"), 1)  # a root that happens to be called steps
    a_run(str(tmp_path / "steps"), 2)
    assert ckpt.open(str(tmp_path / "steps")).steps() == [1, 2]


def test_an_object_store_url_inside_a_root_names_the_root_url():
    a_run("memory://root-level/exp1", 3)
    with pytest.raises(NotARootError) as e:
        ckpt.Checkpointer("memory://root-level/exp1/steps")
    assert e.value.roots == ["memory://root-level/exp1"]


def test_cli_commands_on_the_wrong_level_name_the_root(tmp_path, capsys):
    root = str(tmp_path / "runs" / "exp1")
    a_run(root, 1)
    for cmd in ("ls", "inspect", "verify"):
        assert cli.main([cmd, os.path.join(root, paths.STEPS)]) == 1
        assert f"pass {root} as the path" in capsys.readouterr().err, cmd
    assert cli.main(["ls", str(tmp_path / "runs")]) == 1
    assert root in capsys.readouterr().err
    with pytest.raises(NotARootError):
        ckpt.open(str(tmp_path / "runs"))
