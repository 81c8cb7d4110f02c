"""Messages that must point the right way (issue 24): what a log or an error says is what to do."""

from __future__ import annotations

import logging
import os

import pytest
import torch
from conftest import s3_url

import ckpt


def test_a_path_that_does_not_exist_warns_that_it_starts_fresh(tmp_path, caplog):
    typo = str(tmp_path / "runs" / "basci")
    with caplog.at_level(logging.INFO, logger="ckpt"), ckpt.Checkpointer(typo) as c:
        assert c.load("latest", {"w": torch.zeros(4)}) is None
    [r] = [r for r in caplog.records if "starting fresh" in r.getMessage()]
    assert r.levelno == logging.WARNING and f"nothing at {typo}" in r.getMessage()


def test_an_empty_root_starts_fresh_quietly(tmp_path, caplog):
    (tmp_path / "run").mkdir()
    with caplog.at_level(logging.INFO, logger="ckpt"), ckpt.Checkpointer(str(tmp_path / "run")) as c:
        assert c.load("latest", {"w": torch.zeros(4)}) is None
    [r] = [r for r in caplog.records if "starting fresh" in r.getMessage()]
    assert r.levelno == logging.INFO


def test_a_missing_path_warns_with_local_tiers_too(tmp_path, caplog):
    typo = str(tmp_path / "runs" / "basci")
    with caplog.at_level(logging.INFO, logger="ckpt"), \
            ckpt.Checkpointer(typo, local_dir=str(tmp_path / "nvme"), persist_every=2) as c:
        assert c.load("latest", {"w": torch.zeros(4)}) is None
    [r] = [r for r in caplog.records if "starting fresh" in r.getMessage()]
    assert r.levelno == logging.WARNING and f"at {typo}" in r.getMessage()


def test_no_s3_credentials_says_where_ckpt_takes_them(rclone_server, tmp_path, monkeypatch):
    for name in [n for n in os.environ if n.startswith("AWS_")]:
        monkeypatch.delenv(name)
    for name in ("AWS_SHARED_CREDENTIALS_FILE", "AWS_CONFIG_FILE"):
        empty = tmp_path / name
        empty.write_text("")
        monkeypatch.setenv(name, str(empty))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # no instance metadata service to wait for
    options = {"client_kwargs": {"endpoint_url": rclone_server.endpoint}, "retry_deadline": 5, "connect_timeout": 2}
    with pytest.raises(ckpt.StorageError) as e, ckpt.Checkpointer(s3_url(), storage_options=options) as c:
        c.load("latest", {"w": torch.zeros(4)})
    message = str(e.value)
    assert type(e.value.__cause__).__name__ == "NoCredentialsError"
    for way in ("storage_options={'key': ..., 'secret': ...}", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
                "AWS_PROFILE"):
        assert way in message


def test_step_exists_says_how_to_make_room(tmp_path):
    root = str(tmp_path / "run")
    with ckpt.Checkpointer(root) as c:
        c.save(1, {"w": torch.zeros(4)}).wait()
    with ckpt.Checkpointer(root) as c:
        with pytest.raises(ckpt.StepExistsError) as e:
            c.save(1, {"w": torch.ones(4)}).wait()
    message = str(e.value)
    assert "ckpt gc" not in message  # gc never deletes a committed step
    assert "new step number" in message and "by hand" in message and "keep_last" in message


def test_a_non_finite_first_save_does_not_promise_a_healthy_step(tmp_path):
    with ckpt.Checkpointer(str(tmp_path / "run"), check_finite="all") as c:  # plain tensors, not only parameters
        with pytest.raises(ckpt.NonFiniteStateError) as first:
            c.save(1, {"w": torch.tensor([1.0, float("nan")])}).wait()
        c.save(2, {"w": torch.zeros(2)}).wait()
        with pytest.raises(ckpt.NonFiniteStateError) as later:
            c.save(3, {"w": torch.tensor([float("inf")])}).wait()
    assert "no committed step yet" in str(first.value) and "last healthy" not in str(first.value)
    assert "newest committed step (2) is the last healthy one" in str(later.value)


@pytest.mark.parametrize("configured", [True, False])
def test_log_lines_name_ckpt_once(tmp_path, configured):
    """Under logging.basicConfig the format names the logger ("WARNING:ckpt:…", never "ckpt:ckpt:");
    with nothing configured, Python prints the bare message, and ckpt's name is put in front."""
    import subprocess
    import sys
    setup = "import logging; logging.basicConfig()\n" if configured else ""
    script = setup + (f"import torch, ckpt\nckpt.Checkpointer({str(tmp_path / 'basci')!r}).load('latest', "
                      "{'w': torch.zeros(1)})\n"
                      f"with ckpt.Checkpointer({str(tmp_path / 'run')!r}) as c:\n"
                      "    c.save(1, {'w': torch.zeros(1)}).wait()\n"
                      "    c.load(1, {'w': torch.zeros(1), 'x': torch.zeros(1)}, strict=False)\n")
    err = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}).stderr
    lines = [line for line in err.splitlines() if "starting fresh" in line]
    assert len(lines) == 1, err
    assert lines[0].startswith("WARNING:ckpt:starting fresh" if configured else "ckpt: starting fresh"), err
    [line] = [line for line in err.splitlines() if "non-strictly" in line]
    assert line.startswith("WARNING:ckpt:loading step 1" if configured else "ckpt: loading step 1"), err
    assert "ckpt:ckpt" not in err and "ckpt: ckpt:" not in err
