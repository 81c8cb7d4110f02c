"""CUDA paths. Skipped cleanly on machines without a GPU (CI); run them wherever one is available."""

from __future__ import annotations

import pytest
import torch

import ckpt

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_cuda_tensors_roundtrip_and_snapshot(ckdir):
    model = torch.nn.Linear(256, 256).cuda()
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(8, 256, device="cuda")).sum().backward()
    opt.step()
    want = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    c = ckpt.Checkpointer(ckdir)
    h = c.save(1, {"model": model, "optim": opt})
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1)  # queued right after save() returns: must not reach the snapshot
    h.wait()
    assert c._pool.pinned
    c.close()
    fresh = torch.nn.Linear(256, 256).cuda()
    ckpt.Checkpointer(ckdir).load(1, {"model": fresh, "optim": torch.optim.Adam(fresh.parameters())})
    for k, v in fresh.state_dict().items():
        assert v.is_cuda and torch.equal(v.cpu(), want[k]), k
