"""Messages that must point the right way (issue 24): what a log or an error says is what to do."""

from __future__ import annotations

import logging

import torch

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
