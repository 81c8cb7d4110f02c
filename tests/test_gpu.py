"""CUDA paths. Skipped cleanly on machines without a GPU (CI); run them wherever one is available."""

from __future__ import annotations

import pytest
import torch

import ckpt
from ckpt import _ext
from ckpt.save import cuda_snapshot
from ckpt.save.buffer_layout import make_layout
from ckpt.save.snapshot import HostBuffer

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _trained(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.BatchNorm1d(512), torch.nn.Linear(512, 64)).cuda()
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(32, 256, device="cuda")).square().mean().backward()
    opt.step()
    return model, opt


def _step_then_reload(c, h, opt, ckdir, as_state_dicts=False):
    """The optimizer steps while save ``h`` may still be copying; then the step is loaded into a
    fresh model and optimizer (their ``state_dict()``s where it saved those) and returned as CPU
    copies (model, optimizer state)."""
    opt.step()
    h.wait()
    c.close()
    fresh, fopt = _trained(seed=1)
    into = ({"model": fresh.state_dict(), "optim": fopt.state_dict()} if as_state_dicts  # loaded in place
            else {"model": fresh, "optim": fopt})
    ckpt.Checkpointer(ckdir).load(1, into)
    return _cpu_copy(fresh, fopt)


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
    pending = cuda_snapshot.pending_copies()
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
    monkeypatch.setattr(cuda_snapshot, "KERNEL_MAX_BYTES", kernel_max)
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


# -- orderings that must hold, made certain: the side stream is held back ~0.5 s before each batch ----
SLOW = 1_000_000_000  # GPU clock cycles (about 0.5-1 s)


def _slow_copies(monkeypatch):
    monkeypatch.setattr(cuda_snapshot, "COPY_DELAY_CYCLES", SLOW)


@pytest.mark.parametrize("fenced", [True, False], ids=["fenced", "unfenced"])
def test_a_step_right_after_save_waits_for_the_guarded_copy(ckdir, monkeypatch, fenced):
    """With the fence, opt.step() queued at once leaves the snapshot alone; without it (the negative
    control) the same step reaches the snapshot, so the test can tell the two apart."""
    _slow_copies(monkeypatch)
    if not fenced:
        monkeypatch.setattr(cuda_snapshot, "fence_optimizers", lambda copy: None)
    model, opt = _trained()
    model(torch.randn(32, 256, device="cuda")).square().mean().backward()
    want_model, want_opt = _cpu_copy(model, opt)
    c = ckpt.Checkpointer(ckdir)
    h = c.save(1, {"model": model, "optim": opt})
    got_model, _ = _step_then_reload(c, h, opt, ckdir)
    same = all(torch.equal(got_model[k], v) for k, v in want_model.items())
    assert same is fenced


def test_buffers_changed_by_a_forward_right_after_save_keep_their_saved_values(ckdir, monkeypatch):
    _slow_copies(monkeypatch)
    model, opt = _trained()
    want, _ = _cpu_copy(model, opt)
    c = ckpt.Checkpointer(ckdir)
    h = c.save(1, {"model": model, "optim": opt})
    model(torch.randn(32, 256, device="cuda"))  # train mode: BatchNorm's running stats change in place
    h.wait()
    c.close()
    fresh, fopt = _trained(seed=1)
    ckpt.Checkpointer(ckdir).load(1, {"model": fresh, "optim": fopt})
    for k, v in fresh.state_dict().items():
        assert torch.equal(v.cpu(), want[k]), k


def test_work_queued_before_save_is_in_the_snapshot_and_a_replaced_tensor_is_not(ckdir):
    t = torch.zeros(1 << 20, device="cuda")
    torch.cuda._sleep(SLOW)  # the add below is still queued when save() is called
    t.add_(1)
    state = {"t": t}
    c = ckpt.Checkpointer(ckdir)
    h = c.save(1, state)
    state["t"] = torch.full_like(t, 7)  # replacing the tensor after save() does not reach the snapshot
    h.wait()
    c.close()
    got = {"t": torch.empty(1 << 20, device="cuda")}
    ckpt.Checkpointer(ckdir).load(1, got)
    assert torch.equal(got["t"].cpu(), torch.ones(1 << 20))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_nan_in_the_last_chunk_of_a_cuda_parameter_is_refused(ckdir, dtype):
    p = torch.nn.Parameter(torch.ones(3 << 20, device="cuda", dtype=dtype))
    opt = torch.optim.SGD([p], lr=0.1)
    with torch.no_grad():
        p[-1] = float("nan")
    c = ckpt.Checkpointer(ckdir, chunk_size=1 << 20)
    with pytest.raises(ckpt.NonFiniteStateError):
        c.save(1, {"p": p, "opt": opt}).wait()
    c.close()  # the failure was seen through its handle: close() does not raise it again (Checkpointer.wait)
    assert ckpt.Checkpointer(ckdir).steps() == []  # ckpt.open refuses a root that holds nothing


def test_conjugated_and_negated_cuda_views_are_saved_as_their_values(ckdir):
    z = torch.randn(1000, dtype=torch.complex64, device="cuda")
    x = torch.randn(1000, device="cuda")
    state = {"conj": z.conj(), "neg": torch._neg_view(x)}
    assert state["conj"].is_conj() and state["neg"].is_neg()
    with ckpt.Checkpointer(ckdir) as c:
        c.save(1, state).wait()
    got = {"conj": torch.empty(1000, dtype=torch.complex64, device="cuda"), "neg": torch.empty(1000, device="cuda")}
    ckpt.Checkpointer(ckdir).load(1, got)
    assert torch.equal(got["conj"], z.conj().resolve_conj()) and torch.equal(got["neg"], -x)


def test_the_compiled_kernel_path_is_taken_and_copies_3_gib_byte_for_byte():
    if _ext.cuda() is None:
        pytest.skip("CUDA core not built")
    free, _ = torch.cuda.mem_get_info()
    if free < (8 << 30):
        pytest.skip("needs 8 GiB of free GPU memory")
    big = torch.randint(0, 255, (3 << 30,), dtype=torch.uint8, device="cuda")
    small = torch.randn(1000, device="cuda")
    state = {"big": big, "small": small}
    pool = HostBuffer(make_layout(state, 64 << 20), native=True)
    snap, _, _ = pool.copy_in(state)
    snap.synchronize()
    assert pool.last_used["cuda"].startswith("native (kernel 1, memcpy 1)")
    slot = {s.key: s for s in pool.layout.slots}["big"]
    assert torch.equal(pool.buffer[slot.offset:slot.offset + slot.nbytes], big.cpu())


def _host_state(**modules: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {f"{name}.{k}": v.cpu() for name, m in modules.items() for k, v in m.state_dict().items()}


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_a_model_split_over_two_gpus_is_copied_and_fenced_per_device(ckdir):
    a = torch.nn.Linear(64, 64).to("cuda:0")
    b = torch.nn.Linear(64, 64).to("cuda:1")
    opt = torch.optim.SGD(list(a.parameters()) + list(b.parameters()), lr=0.5)
    for p in opt.param_groups[0]["params"]:
        p.grad = torch.ones_like(p)
    want = _host_state(a=a, b=b)
    c = ckpt.Checkpointer(ckdir)
    h = c.save(1, {"a": a, "b": b, "opt": opt})
    assert {p.device.index for p in cuda_snapshot.pending_copies()} == {0, 1}
    opt.step()
    h.wait()
    c.close()
    fa, fb = torch.nn.Linear(64, 64).to("cuda:0"), torch.nn.Linear(64, 64).to("cuda:1")
    ckpt.Checkpointer(ckdir).load(1, {"a": fa, "b": fb}, strict=False)
    got = _host_state(a=fa, b=fb)
    assert all(torch.equal(got[k], v) for k, v in want.items())


# -- a state of state_dict()s: the optimizers handed over (issue 25 item 5) -----------------------------
@pytest.mark.parametrize("handed", [True, False])
def test_a_state_of_state_dicts_overlaps_only_when_its_optimizer_is_handed_over(ckdir, monkeypatch, handed):
    """Without the handover nothing in the state says which tensors only opt.step() changes, so all
    are copied before the compute stream may go on (correct, no overlap: the negative control); with
    it the fence arms, and a step queued at once still leaves the snapshot alone."""
    _slow_copies(monkeypatch)
    model, opt = _trained()
    model(torch.randn(32, 256, device="cuda")).square().mean().backward()
    want_model, want_opt = _cpu_copy(model, opt)
    torch.cuda.synchronize()
    ckpt.fence()  # forget earlier tests' finished copies
    state = {"model": model.state_dict(), "optim": opt.state_dict()}
    c = ckpt.Checkpointer(ckdir)
    if handed:
        with cuda_snapshot.guarding([opt]):
            h = c.save(1, state)
    else:
        h = c.save(1, state)
    assert bool(cuda_snapshot.pending_copies()) is handed
    got_model, got_opt = _step_then_reload(c, h, opt, ckdir, as_state_dicts=True)
    assert all(torch.equal(got_model[k], v) for k, v in want_model.items())
    assert all(torch.equal(got_opt[i][k], v) for i, s in want_opt.items() for k, v in s.items())


def test_a_lightning_fit_on_the_gpu_arms_the_fence_for_every_save(ckdir, monkeypatch):
    L = pytest.importorskip("lightning")
    from lightning_child import Batches, Tiny

    from ckpt.lightning import AsyncCheckpoint
    from ckpt.save import snapshot
    guarded: list[int] = []
    launch = snapshot.copy_to_host

    def observed(pieces, guard, check, fn):
        guarded.append(len(guard))
        return launch(pieces, guard, check, fn)

    monkeypatch.setattr(snapshot, "copy_to_host", observed)
    t = L.Trainer(accelerator="gpu", devices=1, max_steps=4, logger=False, enable_progress_bar=False,
                  enable_model_summary=False, num_sanity_val_steps=0,
                  callbacks=[AsyncCheckpoint(ckdir, every_n_train_steps=2)])
    t.fit(Tiny(), Batches())
    n_params = sum(1 for g in t.optimizers[0].param_groups for _ in g["params"])
    assert len(guarded) == 2 and all(g >= 3 * n_params for g in guarded)  # parameters, exp_avg, exp_avg_sq


# -- the CUDA library on a real device (issue 25 items 6, 10) -----------------------------------------
def test_the_library_runs_here_and_the_side_stream_is_ckpts_own():
    core = _ext.cuda()
    if core is None:
        pytest.skip("CUDA core not built")
    p = core.probe(torch.cuda.current_device())
    assert p.capability == torch.cuda.get_device_capability() and p.driver // 1000 >= p.runtime // 1000
    assert _ext.cuda_verdict(p) is None and core.usable(torch.cuda.current_device())
    dev = torch.device("cuda", torch.cuda.current_device())
    side = cuda_snapshot._side_stream(dev)
    assert side is cuda_snapshot._side_stream(dev)  # made once
    pool = {torch.cuda.Stream(priority=pr).cuda_stream for pr in (0, -1) for _ in range(80)}
    assert side.cuda_stream not in pool and side.cuda_stream != torch.cuda.current_stream().cuda_stream


def test_the_kernel_copies_every_length_around_its_unrolled_stride(monkeypatch):
    """One block of 512 threads moves 4 x 512 16-byte words per unrolled round: lengths on either
    side of one and two rounds, of one word, and odd tails, all in one launch."""
    if _ext.cuda() is None:
        pytest.skip("CUDA core not built")
    monkeypatch.setattr(cuda_snapshot, "KERNEL_MAX_BYTES", 1 << 40)
    g = torch.Generator(device="cuda").manual_seed(3)
    rounds = 16 * 4 * 512
    lengths = [1, 15, 16, 17, 31, 33, 16 * 512 - 1, 16 * 512, 16 * 512 + 16, rounds - 16, rounds - 1, rounds,
               rounds + 1, rounds + 16, 2 * rounds - 16, 2 * rounds, 2 * rounds + 48 + 7, 3 * rounds + 16 * 3 * 512]
    state = {f"n{n}": torch.randint(0, 255, (n,), dtype=torch.uint8, device="cuda", generator=g) for n in lengths}
    pool = HostBuffer(make_layout(state, 1 << 20), native=True)
    pool.buffer.fill_(0x5A)
    snap, _, _ = pool.copy_in(state)
    snap.synchronize()
    assert pool.last_used["cuda"] == f"native (kernel {len(lengths)}, memcpy 0)"
    for slot in pool.layout.slots:
        assert torch.equal(pool.buffer[slot.offset:slot.offset + slot.nbytes], state[slot.key].cpu()), slot.key


def test_a_load_within_host_memory_fills_cuda_tensors_window_by_window(ckdir):
    """CUDA destinations are staged (CPU stand-ins): under a 1 MiB budget they go through windows of
    rows, each copied to its rows on the device once both passes checked out."""
    torch.manual_seed(0)
    state = {"w": torch.randn(1024, 1024, device="cuda"), "b": torch.randn(3000, device="cuda")}
    with ckpt.Checkpointer(ckdir, host_memory=1 << 20, chunk_size=256 * 1024) as c:
        c.save(1, state).wait()
        target = {k: torch.full_like(v, -1.0) for k, v in state.items()}
        c.load(1, target)
        s = c.last_load
        assert s is not None and s.passes == 2 and s.windows >= 4 and s.staging_bytes <= 1 << 20
    assert all(torch.equal(target[k], state[k]) for k in state)
