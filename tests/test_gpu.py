"""CUDA paths. Skipped cleanly on machines without a GPU (CI); run them wherever one is available."""

from __future__ import annotations

import pytest
import torch

import ckpt
from ckpt import _ext, snapshot
from ckpt.buffer_layout import make_layout
from ckpt.snapshot import HostBuffer

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _trained(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.BatchNorm1d(512), torch.nn.Linear(512, 64)).cuda()
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(32, 256, device="cuda")).square().mean().backward()
    opt.step()
    return model, opt


def _cpu_copy(model, opt):
    return ({k: v.detach().cpu().clone() for k, v in model.state_dict().items()},
            {i: {k: v.cpu().clone() for k, v in s.items()} for i, s in enumerate(opt.state.values())})


def test_optimizer_step_right_after_save_does_not_reach_the_snapshot(ckdir):
    model, opt = _trained()
    model(torch.randn(32, 256, device="cuda")).square().mean().backward()  # gradients for the next step
    want_model, want_opt = _cpu_copy(model, opt)
    c = ckpt.Checkpointer(ckdir)
    h = c.save(1, {"model": model, "optim": opt})
    opt.step()  # queued at once, no host sync: the pre-step hook orders it after the copy on the device
    model(torch.randn(32, 256, device="cuda"))  # forward in train mode updates BatchNorm stats in place
    h.wait()
    assert c.host_pinned
    after = {k: v.cpu() for k, v in model.state_dict().items()}
    assert any(not torch.equal(after[k], want_model[k]) for k in after)  # the step did change things
    c.close()
    fresh, fopt = _trained(seed=1)
    ckpt.Checkpointer(ckdir).load(1, {"model": fresh, "optim": fopt})
    got_model, got_opt = _cpu_copy(fresh, fopt)
    for k, v in want_model.items():
        assert torch.equal(got_model[k], v), k
    for i, s in want_opt.items():
        for k, v in s.items():
            assert torch.equal(got_opt[i][k], v), (i, k)


def test_save_does_not_block_the_host_and_the_copy_overlaps_a_matmul(ckdir):
    model, opt = _trained()
    big = torch.randn(8192, 8192, device="cuda")
    c = ckpt.Checkpointer(ckdir)
    c.save(1, {"model": model, "optim": opt}).wait()  # first save allocates the buffer
    torch.cuda.synchronize()
    h = c.save(2, {"model": model, "optim": opt})
    pending = snapshot.pending_copies()
    for _ in range(20):  # ~0.1-0.5 s of work queued on the compute stream after save() returned
        big = big @ big
        big = big / big.norm()
    mm_done = torch.cuda.Event()
    mm_done.record()
    assert pending, "parameters an optimizer owns should be guarded by the pre-step hook"
    pending[0].synchronize()  # the snapshot copy finished ...
    assert not mm_done.query()  # ... while the matmuls queued after it were still running: overlap
    h.wait()
    c.close()


@pytest.mark.parametrize("kernel_max", [0, 1 << 40, 1 << 20])  # all memcpy, all kernel, mixed
def test_batched_copy_equals_torch_copy(kernel_max, monkeypatch):
    if _ext.cuda() is None:
        pytest.skip("CUDA core not built")
    monkeypatch.setattr(snapshot, "KERNEL_MAX_BYTES", kernel_max)
    g = torch.Generator(device="cuda").manual_seed(0)
    base = torch.randn(1 << 20, device="cuda", generator=g)
    state = {
        "big": torch.randn(3000, 1001, device="cuda", generator=g),
        "bf16": torch.randn(777, 33, device="cuda", generator=g).bfloat16(),
        "odd_bytes": torch.randint(0, 255, (12345,), dtype=torch.uint8, device="cuda", generator=g),
        "unaligned_view": base[3:100_003],  # storage offset 12 bytes: not 16-byte aligned
        "scalar": torch.tensor(2.5, device="cuda"),
        "empty": torch.empty(0, device="cuda"),
        "strided": base[: 1 << 19].view(512, 1024).t(),
        "int64": torch.arange(5000, device="cuda"),
        "cpu_too": torch.randn(1000),
    }
    layout = make_layout(state, 1 << 20)
    pool = HostBuffer(layout, native=True)
    ref = HostBuffer(layout, native=False)
    pool.buffer.fill_(0x5A)
    ref.buffer.fill_(0x5A)
    snap, _, _ = pool.copy_in(state)
    rsnap, _, _ = ref.copy_in(state)
    snap.synchronize()
    rsnap.synchronize()
    assert pool.last_used["cuda"].startswith("native")
    assert torch.equal(pool.buffer, ref.buffer)
    for slot in layout.slots:
        got = pool.buffer[slot.offset : slot.offset + slot.nbytes].view(slot.dtype).view(slot.shape)
        assert torch.equal(got, state[slot.key].cpu()), slot.key


def test_fence_orders_manual_in_place_updates(ckdir):
    model, opt = _trained()
    want = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    c = ckpt.Checkpointer(ckdir)
    h = c.save(1, {"model": model, "optim": opt})
    ckpt.fence()  # documented: before changing saved parameters outside optimizer.step()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1)
    h.wait()
    c.close()
    fresh, fopt = _trained(seed=2)
    ckpt.Checkpointer(ckdir).load(1, {"model": fresh, "optim": fopt})
    for k, v in fresh.state_dict().items():
        assert v.is_cuda and torch.equal(v.cpu(), want[k]), k
