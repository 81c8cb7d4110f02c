"""GPU snapshot: device-to-host throughput, and per save in a training loop the host time blocked and
the compute stream's stall, against DCP's ``async_save`` with its ``DefaultStager`` in the same run.

    python benchmarks/gpu_snapshot.py --out benchmarks/results        # all three parts (a few minutes)
    python benchmarks/gpu_snapshot.py --quick --out /tmp/gpu           # a smoke test of each part
    python benchmarks/gpu_snapshot.py --parts training                 # one part (throughput,sizes,training)

1. Throughput on ``--gib`` of transformer-like bf16/fp32 parameters: ckpt's snapshot copy (batched
   kernel for small tensors + cudaMemcpyAsync for large ones, chosen per size class), each way alone,
   torch's per-tensor ``copy_(non_blocking=True)``, and the floor: ONE pinned cudaMemcpyAsync of the
   same bytes as a single flat tensor. Timed from the call until the copy's event completes.
2. Per size class (many tensors of one size), kernel vs memcpy vs torch: where the threshold sits.
3. A training loop (a stack of transformer blocks, fused AdamW, bf16 autocast) run with no
   checkpointing, with ``Checkpointer.save`` and with ``dcp.async_save`` + ``DefaultStager`` (pinned,
   non-blocking copies staged in the background) every ``--every`` steps, each twice, interleaved.
   Per save: the host time blocked (ckpt: the call; DCP: draining the compute stream so the staging
   copy reads finished values, the call, and the wait for staging before the next optimizer step);
   the compute stream's stall (GPU time of the steps up to the next save beyond as many steps without
   saving, from CUDA events); and, reported apart, the wait for the previous save's write before it
   and the time from the call until the save was durable (the disk).
Needs CUDA; prints tables, writes gpu_snapshot.{json,md,png} under --out.
"""

from __future__ import annotations

import os

# The training here is on the GPU, but a bf16 op that lands on the CPU would meet oneDNN: on machines
# that report AMX/AVX512-BF16 without enabling it its bf16 matmul dies of SIGILL. Kept on AVX2, set
# before torch loads oneDNN (this process only; ckpt itself never sets it).
os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX2")

import argparse  # noqa: E402
import shutil  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
from harness import median, pyplot, save_figure, write_results  # noqa: E402

import ckpt  # noqa: E402
from ckpt.save import cuda_snapshot  # noqa: E402
from ckpt.save.buffer_layout import make_layout  # noqa: E402
from ckpt.save.snapshot import HostBuffer  # noqa: E402

GiB = 1 << 30


def params(gib: float) -> dict[str, torch.Tensor]:
    """Layers of d=4096 blocks, half the bytes bf16 and half fp32, plus norms and biases."""
    d, out, total, i = 4096, {}, 0, 0
    while total < gib * GiB:
        dt = torch.bfloat16 if i % 2 == 0 else torch.float32
        for name, shape in [("qkv", (3 * d, d)), ("out", (d, d)), ("up", (4 * d, d)), ("down", (d, 4 * d)),
                            ("n1", (d,)), ("n2", (d,)), ("b_up", (4 * d,))]:
            t = torch.randn(shape, device="cuda", dtype=dt)
            out[f"l{i}.{name}"] = t
            total += t.numel() * t.element_size()
        i += 1
    return out


def time_copy(pool: HostBuffer, state: dict, reps: int) -> tuple[float, float]:
    """(median seconds until the copy completed, median host seconds inside copy_in)."""
    total, host = [], []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        snap, _, _ = pool.copy_in(state)
        t1 = time.perf_counter()
        snap.synchronize()
        total.append(time.perf_counter() - t0)
        host.append(t1 - t0)
    return median(total), median(host)


def floor_copy(nbytes: int, reps: int) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    out = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=True)  # one cudaMemcpyAsync
        torch.cuda.synchronize()
        out.append(time.perf_counter() - t0)
    return median(out)


def throughput(gib: float, reps: int) -> list[dict]:
    state = params(gib)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    layout = make_layout(state, 16 << 20)
    rows = [{"method": "floor: one cudaMemcpyAsync (flat)", "s": floor_copy(nbytes, reps), "host_s": float("nan")}]
    pool = HostBuffer(layout, native=True)
    kmax = cuda_snapshot.KERNEL_MAX_BYTES
    ways = [(f"ckpt (kernel < {kmax >> 10} KiB, else memcpy)", kmax),
            ("ckpt, kernel only", 1 << 62), ("ckpt, cudaMemcpyAsync only", 0)]
    default = cuda_snapshot.KERNEL_MAX_BYTES
    for name, k in ways:
        cuda_snapshot.KERNEL_MAX_BYTES = k
        time_copy(pool, state, 1)
        s, h = time_copy(pool, state, reps)
        rows.append({"method": name, "s": s, "host_s": h})
    cuda_snapshot.KERNEL_MAX_BYTES = default
    plain = HostBuffer(layout, native=False)
    plain.buffer = pool.buffer  # same destination memory
    time_copy(plain, state, 1)
    s, h = time_copy(plain, state, reps)
    rows.append({"method": "torch copy_(non_blocking) per tensor", "s": s, "host_s": h})
    floor = rows[0]["s"]
    for r in rows:
        r["GiB/s"] = nbytes / GiB / r["s"]
        r["vs_floor"] = floor / r["s"]
    del state, pool, plain
    torch.cuda.empty_cache()
    return rows


def size_classes(reps: int) -> list[dict]:
    rows = []
    for size in [4 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 32 << 20]:
        n = max(8, min(20000, (512 << 20) // size))
        state = {f"t{i}": torch.randn(size // 4, device="cuda") for i in range(n)}
        layout = make_layout(state, 16 << 20)
        pool = HostBuffer(layout, native=True)
        row = {"tensor": size, "count": n}
        for name, k in [("kernel", 1 << 62), ("memcpy", 0)]:
            cuda_snapshot.KERNEL_MAX_BYTES = k
            time_copy(pool, state, 1)
            row[name], row[name + "_host"] = time_copy(pool, state, reps)
        plain = HostBuffer(layout, native=False)
        time_copy(plain, state, 1)
        row["torch"], row["torch_host"] = time_copy(plain, state, reps)
        for k in ("kernel", "memcpy", "torch"):
            row[k + "_GiBs"] = n * size / GiB / row[k]
        rows.append(row)
        del state, pool, plain
    cuda_snapshot.KERNEL_MAX_BYTES = 1 << 20
    return rows


class Block(torch.nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.n1, self.n2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
        self.attn = torch.nn.MultiheadAttention(d, d // 128, batch_first=True)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(d, 4 * d), torch.nn.GELU(), torch.nn.Linear(4 * d, d))

    def forward(self, x):
        h = self.n1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.n2(x))


class CkptSaver:
    """``Checkpointer.save`` of the live model and optimizer (the optimizer in the state arms the fence)."""

    name = "ckpt"

    def __init__(self, root: str, model: torch.nn.Module, opt: torch.optim.Optimizer):
        self.c = ckpt.Checkpointer(root, keep_last=2, codec="raw")  # raw: the same bytes to disk as DCP
        self.state = {"model": model, "optim": opt}
        self.handles: list = []

    def warm(self) -> None:
        self.c.save(0, self.state).wait()  # allocates and pins the host buffer: first-save cost, not steady state

    def wait_previous(self) -> None:
        if self.handles:
            self.handles[-1].wait()

    def save(self, step: int) -> float:
        t0 = time.perf_counter()
        self.handles.append(self.c.save(step, self.state))
        return time.perf_counter() - t0

    def before_opt_step(self) -> float:
        return 0.0  # the pre-step fence orders the step after the copy on the device: the host never waits

    def abandon(self) -> None:
        """After a failure: end the background work, so that the process can exit."""
        try:
            self.c.close()
        except Exception as e:  # noqa: BLE001 - the failure is already reported
            print(f"closing the failed saver: {e}", file=sys.stderr)

    def finish(self) -> list[float]:
        self.c.close()
        return [h.metrics.duration_s for h in self.handles]


class DcpSaver:
    """``dcp.async_save`` with ``DefaultStager`` (pinned memory, non-blocking copies on its staging
    stream, staged in a background thread), used the way a snapshot must be: its staging stream does
    not wait for the compute stream, so the queued optimizer step is drained first, and the next
    ``optimizer.step()`` waits on the host for ``staging_completion``. The stager reuses its pinned
    copies, so a save also waits for the previous upload (timed apart, as the disk wait).

    ``blocking=True``: DCP's ``BlockingAsyncStager`` (cached pinned copies made in the call, then
    the write in the background), the stager that does not deep-copy the state; torch 2.11's
    ``DefaultStager`` fails on an optimizer's state_dict (KeyError on a class, first H200 run)."""

    name = "dcp"

    def __init__(self, root: str, model: torch.nn.Module, opt: torch.optim.Optimizer, blocking: bool = False):
        from torch.distributed.checkpoint.staging import BlockingAsyncStager, DefaultStager, StagingOptions
        self.root, self.model, self.opt = root, model, opt
        self.stager = (BlockingAsyncStager(cache_staged_state_dict=True) if blocking else
                       DefaultStager(StagingOptions(use_pinned_memory=True, use_shared_memory=False,
                                                    use_async_staging=True, use_non_blocking_copy=True)))
        self.staging = self.upload = None
        self.durable: dict[int, float] = {}  # step -> seconds from the call until the upload completed
        self.landed: dict[int, threading.Event] = {}
        self.dirs: list[str] = []

    def warm(self) -> None:
        self.save(0)
        self.before_opt_step()
        self.wait_previous()

    def wait_previous(self) -> None:
        if self.upload is not None:
            self.upload.result()
        while len(self.dirs) > 2:  # keep two, as the ckpt side does
            shutil.rmtree(self.dirs.pop(0), ignore_errors=True)

    def save(self, step: int) -> float:
        import torch.distributed.checkpoint as dcp
        t0 = time.perf_counter()
        torch.cuda.current_stream().synchronize()  # else the staging copy may read the step still running
        path = os.path.join(self.root, f"step{step}")
        self.dirs.append(path)
        resp = dcp.async_save({"model": self.model.state_dict(), "optim": self.opt.state_dict()}, checkpoint_id=path,
                              async_stager=self.stager)
        landed = self.landed[step] = threading.Event()

        def done(_f) -> None:  # a future runs its callbacks after waking result(): an Event says it ran
            self.durable[step] = time.perf_counter() - t0
            landed.set()

        if hasattr(resp, "upload_completion"):  # staged in the background
            resp.upload_completion.add_done_callback(done)
            self.staging, self.upload = resp.staging_completion, resp.upload_completion
        else:  # a Future of the write: staged in the call
            resp.add_done_callback(done)
            self.upload = resp
        return time.perf_counter() - t0

    def before_opt_step(self) -> float:
        if self.staging is None:
            return 0.0
        t0 = time.perf_counter()
        self.staging.result()
        self.staging = None
        return time.perf_counter() - t0

    def abandon(self) -> None:
        """After a failure (torch 2.11's DefaultStager, first H200 run, the process then hung at exit):
        let the write in flight end, and stop the stager's threads."""
        for f in (self.staging, self.upload):
            if f is not None:
                try:
                    f.result(timeout=60)
                except Exception:  # noqa: BLE001 - the failure is already reported
                    pass
        self.stager.close()

    def finish(self) -> list[float]:
        self.wait_previous()
        self.stager.close()
        for ev in self.landed.values():
            ev.wait()
        return [t for step, t in sorted(self.durable.items()) if step != 0]  # step 0: the warm-up


def training(steps: int, every: int, layers: int, d: int, root: str) -> dict:
    """The same model and optimizer trained ``steps`` steps with no checkpointing, with ckpt and with
    DCP saving every ``every`` steps, each twice, interleaved. Per save: the host time blocked, the
    wait for the previous save's write before it (the disk, reported apart), the compute stream's
    stall (the GPU time the ``every`` steps after the save took beyond as many steps without saving,
    from events on the compute stream), and the time until the save was durable."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[Block(d) for _ in range(layers)]).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    x = torch.randn(16, 1024, d, device="cuda")

    def step(before_opt_step) -> float:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(x).float().square().mean()
        loss.backward()
        waited = before_opt_step()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return waited

    for _ in range(5):
        step(lambda: 0.0)
    runs: dict[str, list[dict]] = {}
    failed: dict[str, str] = {}  # a saver that raised (DCP's stager on some torch releases): reported, not fatal
    for rnd in range(2):  # interleaved, order reversed in the second round: drift hits every mode alike
        for mode in (("none", "ckpt", "dcp", "dcp_blocking") if rnd == 0 else ("dcp_blocking", "dcp", "ckpt", "none")):
            if mode in failed:
                continue
            where = os.path.join(root, f"{mode}{rnd}")
            saver = {"none": None, "ckpt": CkptSaver, "dcp": DcpSaver,
                     "dcp_blocking": lambda *a: DcpSaver(*a, blocking=True)}[mode]
            made = saver(where, model, opt) if saver else None
            try:
                runs.setdefault(mode, []).append(loop(step, made, steps, every))
            except Exception as e:  # noqa: BLE001 - the other savers' figures still come out
                if made is None:
                    raise
                failed[mode] = f"{type(e).__name__}: {e}"[:300]
                print(f"training with {mode} failed: {failed[mode]}", file=sys.stderr, flush=True)
                runs.pop(mode, None)
                made.abandon()
                torch.cuda.synchronize()
            shutil.rmtree(where, ignore_errors=True)
    base = median(d for r in runs["none"] for d in r["step_ms"])
    out: dict = {"params_GiB": sum(p.numel() * 4 for p in model.parameters()) / GiB, "steps": steps, "every": every,
                 "step_ms": base, "s_none": min(r["s"] for r in runs["none"])}
    out["saved_GiB"] = out["params_GiB"] * 3  # fp32 parameters and AdamW's two moments
    for mode in SAVERS:
        if mode in failed:
            out[mode] = {"failed": failed[mode]}
            continue
        rs = runs[mode]
        # the save after step s: steps s+1 .. s+every, whose GPU times are step_ms[s : s+every]
        stalls = [sum(r["step_ms"][i] - base for i in range(s, min(s + every, steps)))
                  for r in rs for s in r["saved_at"]]
        out[mode] = {"s": min(r["s"] for r in rs), "slowdown": min(r["s"] for r in rs) / out["s_none"] - 1,
                     "host_ms": 1e3 * median(h for r in rs for h in r["host"]),
                     "host_ms_max": 1e3 * max(h for r in rs for h in r["host"]),
                     "disk_wait_ms": 1e3 * median(w for r in rs for w in r["disk_wait"]),
                     "stall_ms": median(stalls), "stall_ms_max": max(stalls),
                     "durable_s": median(t for r in rs for t in r["durable"])}
    return out


def loop(step, saver, steps: int, every: int) -> dict:
    """``steps`` training steps, saving after every ``every``-th; events on the compute stream time each step."""
    if saver is not None:
        saver.warm()
    events = [torch.cuda.Event(enable_timing=True) for _ in range(steps + 1)]
    host = [0.0] * steps  # host time a save blocked, charged to the save it belongs to
    disk_wait, saved_at = [], []
    pending = None  # the save whose staging the next optimizer step may wait for
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    events[0].record()
    for i in range(1, steps + 1):
        waited = step(saver.before_opt_step if saver is not None else lambda: 0.0)
        if pending is not None:
            host[pending] += waited
            pending = None
        events[i].record()
        if saver is not None and i % every == 0 and i < steps:
            w0 = time.perf_counter()
            saver.wait_previous()  # the previous save's write: the disk, reported apart
            disk_wait.append(time.perf_counter() - w0)
            host[len(saved_at)] = saver.save(i)
            pending = len(saved_at)
            saved_at.append(i)  # steps i+1 .. i+every run after this save: events[i] .. events[i+every]
    torch.cuda.synchronize()
    s = time.perf_counter() - t0
    durable = saver.finish() if saver is not None else []
    return {"s": s, "step_ms": [events[i].elapsed_time(events[i + 1]) for i in range(steps)], "saved_at": saved_at,
            "host": host[:len(saved_at)], "disk_wait": disk_wait, "durable": durable}


def _parts(text: str) -> list[str]:
    parts = [p.strip() for p in text.split(",") if p.strip()]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown part(s) {unknown}; choose from {', '.join(PARTS)}")
    return parts


PARTS = ("throughput", "sizes", "training")
SAVERS = ("ckpt", "dcp", "dcp_blocking")
QUICK = {"gib": 1.0, "reps": 2, "steps": 24, "every": 8, "layers": 2, "d": 1024}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=8.0, help="GiB of parameters for the throughput part")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--steps", type=int, default=120, help="training steps per run (each mode runs twice)")
    ap.add_argument("--every", type=int, default=40, help="save every N training steps")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--d", type=int, default=2048)
    ap.add_argument("--parts", type=_parts, default=list(PARTS), help=f"comma-separated, of {', '.join(PARTS)}")
    ap.add_argument("--quick", action="store_true", help="a smoke test of every part (about a minute): " +
                    ", ".join(f"--{k} {v:g}" for k, v in QUICK.items()))
    ap.add_argument("--root", default=None, help="where the training part writes its checkpoints (a disk, not "
                    "tmpfs, for a real disk wait; default: the temp directory)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = ap.parse_args()
    if args.quick:
        for k, v in QUICK.items():
            setattr(args, k, type(getattr(args, k))(v))
    if not torch.cuda.is_available():
        sys.exit("needs CUDA")
    dev = torch.cuda.get_device_name()
    print(f"device: {dev}; torch {torch.__version__}; ckpt core: {ckpt._ext.info()}", flush=True)
    lines: list[str] = []
    doc: dict = {"device": dev, "torch": torch.__version__, "args": vars(args)}
    sc: list[dict] = []
    if "throughput" in args.parts:
        doc["throughput"] = thr = throughput(args.gib, args.reps)
        lines += throughput_table(thr, args.gib, dev)
    if "sizes" in args.parts:
        doc["size_classes"] = sc = size_classes(args.reps)
        lines += size_table(sc)
    if "training" in args.parts:
        with tempfile.TemporaryDirectory(dir=args.root) as root:
            doc["training"] = tr = training(args.steps, args.every, args.layers, args.d, root)
        lines += training_table(tr, args)
    os.makedirs(args.out, exist_ok=True)
    cmd = "python benchmarks/gpu_snapshot.py " + ("--quick" if args.quick else f"--gib {args.gib:g}")
    if list(args.parts) != list(PARTS):
        cmd += " --parts " + ",".join(args.parts)
    md = f"`{cmd}` on {dev}\n\n" + "\n".join(lines) + "\n"
    write_results(args.out, "gpu_snapshot", md, doc, indent=1, plot=(lambda path: plot(sc, dev, path)) if sc else None)


def throughput_table(thr: list[dict], gib: float, dev: str) -> list[str]:
    lines = [f"## Snapshot throughput, {gib:g} GiB bf16/fp32 parameters ({dev})", "",
             "| method | time (s) | GiB/s | ÷ one cudaMemcpyAsync | host time in the call (ms) |",
             "|---|---:|---:|---:|---:|"]
    lines += [f"| {r['method']} | {r['s']:.3f} | {r['GiB/s']:.1f} | {r['vs_floor']:.2f} | {1e3 * r['host_s']:.1f} |"
              for r in thr]
    print("\n".join(lines), flush=True)
    return lines


def size_table(sc: list[dict]) -> list[str]:
    lines = ["", "## Per size class: GiB/s (host ms in the call)", "",
             "| tensor size | tensors | kernel | cudaMemcpyAsync | torch copy_ |", "|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['tensor'] >> 10} KiB | {r['count']} | {r['kernel_GiBs']:.1f} ({1e3 * r['kernel_host']:.1f}) | "
              f"{r['memcpy_GiBs']:.1f} ({1e3 * r['memcpy_host']:.1f}) | "
              f"{r['torch_GiBs']:.1f} ({1e3 * r['torch_host']:.1f}) |"
              for r in sc]
    print("\n".join(lines), flush=True)
    return lines


def training_table(tr: dict, args) -> list[str]:
    lines = ["", f"## Training loop: {args.layers} blocks d={args.d} ({tr['params_GiB']:.2f} GiB fp32 params, "
             f"{tr['saved_GiB']:.2f} GiB saved with AdamW state), save every {args.every} of {args.steps} steps; "
             f"a step without saving: {tr['step_ms']:.1f} ms on the GPU, the whole run {tr['s_none']:.2f} s", "",
             "| saver | run (s) | slowdown | host blocked per save, median / max (ms) | compute stream stall per "
             "save, median / max (ms) | waiting for the previous write (ms) | save to durable (s) |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    names = {"ckpt": "ckpt `Checkpointer.save`", "dcp": "DCP `async_save`, `DefaultStager` (pinned, non-blocking)",
             "dcp_blocking": "DCP `async_save`, `BlockingAsyncStager` (cached pinned copies in the call)"}
    for mode in SAVERS:
        r = tr[mode]
        if "failed" in r:
            lines.append(f"| {names[mode]} | failed on torch {torch.__version__}: {r['failed']} |||||| ")
            continue
        lines.append(f"| {names[mode]} | {r['s']:.2f} | {100 * r['slowdown']:+.1f}% | {r['host_ms']:.2f} / "
                     f"{r['host_ms_max']:.2f} | {r['stall_ms']:.1f} / {r['stall_ms_max']:.1f} | "
                     f"{r['disk_wait_ms']:.1f} | {r['durable_s']:.2f} |")
    print("\n".join(lines), flush=True)
    return lines


def plot(sc: list[dict], dev: str, path: str) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    xs = [r["tensor"] >> 10 for r in sc]
    for k in ("kernel", "memcpy", "torch"):
        ax.plot(xs, [r[k + "_GiBs"] for r in sc], marker="o", label=k)
    ax.set_xscale("log")
    ax.set_xlabel("tensor size (KiB)")
    ax.set_ylabel("GiB/s device→pinned host")
    ax.set_title(f"snapshot copy by size class ({dev})")
    ax.legend()
    save_figure(fig, path)

if __name__ == "__main__":
    main()
