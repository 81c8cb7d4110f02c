"""The writer never commits a step a reader would refuse (issue 35, item 2): a manifest over the
reader's size cap is refused at the commit, nothing is committed and the previous step is kept; one
exactly at the cap commits and loads. The cap is a module constant, lowered here so the limit is
tried without writing 1 GiB."""

from __future__ import annotations

import os

import pytest
import torch

import ckpt
from ckpt.errors import CorruptCheckpointError, ManifestTooLargeError
from ckpt.format import manifest as mf
from ckpt.format import paths
from ckpt.storage import LocalStorage


def state(seed: float) -> dict:
    return {"w": torch.arange(64.0) + seed, "b": torch.ones(3) * seed}


def manifest_size(root: str, step: int) -> int:
    return os.path.getsize(os.path.join(root, paths.manifest_key(step)))


def test_a_manifest_over_the_readers_cap_is_not_committed_and_one_at_the_cap_loads(ckdir, monkeypatch):
    with ckpt.Checkpointer(ckdir) as c:
        c.save(1, state(1)).wait()
        monkeypatch.setattr(mf, "MAX_MANIFEST_BYTES", manifest_size(ckdir, 1) // 2)
        with pytest.raises(ManifestTooLargeError, match="step 2 was not committed.*could never be loaded") as e:
            c.save(2, state(2)).wait()
        assert e.value.limit == mf.MAX_MANIFEST_BYTES and e.value.size > e.value.limit
        assert c.steps() == [1]
        assert not os.path.exists(os.path.join(ckdir, paths.manifest_key(2)))
        # At the cap: the size the refused manifest would have had (its time stamp may print a digit
        # shorter or longer on the next try: then that try is refused, or commits under the cap, and
        # the next step tries the cap again at the new size).
        cap, step = e.value.size, 3
        while True:
            monkeypatch.setattr(mf, "MAX_MANIFEST_BYTES", cap)
            try:
                c.save(step, state(step)).wait()
            except ManifestTooLargeError as again:
                assert again.size > cap and c.steps()[-1] < step
                cap = again.size
            else:
                if manifest_size(ckdir, step) == cap:
                    break
                cap = manifest_size(ckdir, step)
            step += 1
            assert step < 12, "the manifest's size never came out at the cap"
    got = state(0)
    assert ckpt.Checkpointer(ckdir).load(step, got) == step  # read under the same cap: exactly at it loads
    assert torch.equal(got["w"], state(step)["w"]) and torch.equal(got["b"], state(step)["b"])
    monkeypatch.setattr(mf, "MAX_MANIFEST_BYTES", cap - 1)  # and a reader with a byte less refuses it
    with pytest.raises(CorruptCheckpointError, match="larger than"):
        mf.read_step(LocalStorage(ckdir), step)


def test_committable_refuses_one_byte_over_the_cap(monkeypatch):
    m = mf.Manifest(step=5, kind="step", structure={"t": "dict", "k": [], "v": []}, tensors=[], chunks={})
    data = m.to_json()
    monkeypatch.setattr(mf, "MAX_MANIFEST_BYTES", len(data))
    assert mf.committable(5, m) == data
    monkeypatch.setattr(mf, "MAX_MANIFEST_BYTES", len(data) - 1)
    with pytest.raises(ManifestTooLargeError) as e:
        mf.committable(5, m)
    assert (e.value.size, e.value.limit) == (len(data), len(data) - 1)
