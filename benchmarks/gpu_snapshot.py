"""GPU snapshot: device-to-host throughput, host time blocked in save(), and training-loop slowdown.

    python benchmarks/gpu_snapshot.py --gib 8 --out benchmarks/results

1. Throughput on ``--gib`` of transformer-like bf16/fp32 parameters: ckpt's snapshot copy (batched
   kernel for small tensors + cudaMemcpyAsync for large ones, chosen per size class), each way alone,
   torch's per-tensor ``copy_(non_blocking=True)``, and the floor: ONE pinned cudaMemcpyAsync of the
   same bytes as a single flat tensor. Timed from the call until the copy's event completes.
2. Per size class (many tensors of one size), kernel vs memcpy vs torch: where the threshold sits.
3. A training loop (a stack of transformer blocks, AdamW): steps/s with no checkpointing versus
   ``Checkpointer.save`` every N steps, and the host time each steady-state save() blocked.
Needs CUDA; prints tables, writes gpu_snapshot.{json,md,png} under --out.
"""

from __future__ import annotations

import os

# The training here is on the GPU, but a bf16 op that lands on the CPU would meet oneDNN: on machines
# that report AMX/AVX512-BF16 without enabling it its bf16 matmul dies of SIGILL. Kept on AVX2, set
# before torch loads oneDNN (this process only; ckpt itself never sets it).
os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX2")

import argparse  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
from harness import median, pyplot, save_figure, write_results  # noqa: E402

import ckpt  # noqa: E402
from ckpt import cuda_snapshot  # noqa: E402
from ckpt.buffer_layout import make_layout  # noqa: E402
from ckpt.snapshot import HostBuffer  # noqa: E402

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


def training(steps: int, every: int, layers: int, d: int, root: str) -> dict:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[Block(d) for _ in range(layers)]).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    x = torch.randn(16, 1024, d, device="cuda")

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(x).float().square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(5):
        step()
    state = {"model": model, "optim": opt}
    out = {"params_GiB": sum(p.numel() * 4 for p in model.parameters()) / GiB}
    results = {}
    for mode in ("none", "ckpt", "none2", "ckpt2"):  # interleaved twice: drift hits both alike
        c = ckpt.Checkpointer(os.path.join(root, mode), keep_last=2, codec="raw") if "ckpt" in mode else None
        if c is not None:
            c.save(0, state).wait()  # allocates the pinned buffer (first-save cost, not steady state)
        stalls = []
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for i in range(1, steps + 1):
            step()
            if c is not None and i % every == 0:
                h = c.save(i, state)
                stalls.append(h.metrics.stall_s)
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        if c is not None:
            c.close()
        results.setdefault(mode.rstrip("2"), []).append(dt)
        if stalls:
            results.setdefault("stalls", []).extend(stalls)
    base, ck = min(results["none"]), min(results["ckpt"])
    st = sorted(results["stalls"])
    out.update({"steps": steps, "every": every, "s_none": base, "s_ckpt": ck, "slowdown": ck / base - 1,
                "stall_ms_median": 1e3 * median(st), "stall_ms_max": 1e3 * st[-1],
                "saved_GiB": out["params_GiB"] * 3})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=8.0)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--every", type=int, default=20)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--d", type=int, default=2048)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs CUDA")
    dev = torch.cuda.get_device_name()
    print(f"device: {dev}; torch {torch.__version__}; ckpt core: {ckpt._ext.info()}", flush=True)
    thr = throughput(args.gib, args.reps)
    lines = [f"## Snapshot throughput, {args.gib:g} GiB bf16/fp32 parameters ({dev})", "",
             "| method | time (s) | GiB/s | ÷ one cudaMemcpyAsync | host time in the call (ms) |",
             "|---|---:|---:|---:|---:|"]
    lines += [f"| {r['method']} | {r['s']:.3f} | {r['GiB/s']:.1f} | {r['vs_floor']:.2f} | {1e3 * r['host_s']:.1f} |"
              for r in thr]
    print("\n".join(lines), flush=True)
    sc = size_classes(args.reps)
    lines2 = ["", "## Per size class: GiB/s (host ms in the call)", "",
              "| tensor size | tensors | kernel | cudaMemcpyAsync | torch copy_ |", "|---:|---:|---:|---:|---:|"]
    lines2 += [f"| {r['tensor'] >> 10} KiB | {r['count']} | {r['kernel_GiBs']:.1f} ({1e3 * r['kernel_host']:.1f}) | "
               f"{r['memcpy_GiBs']:.1f} ({1e3 * r['memcpy_host']:.1f}) | "
               f"{r['torch_GiBs']:.1f} ({1e3 * r['torch_host']:.1f}) |"
               for r in sc]
    print("\n".join(lines2), flush=True)
    with tempfile.TemporaryDirectory() as root:
        tr = training(args.steps, args.every, args.layers, args.d, root)
    lines3 = ["", f"## Training loop: {args.layers} blocks d={args.d} ({tr['params_GiB']:.2f} GiB fp32 params, "
              f"{tr['saved_GiB']:.2f} GiB saved with AdamW state), save every {args.every} of {args.steps} steps", "",
              "| no checkpointing (s) | with ckpt (s) | slowdown | save() host blocked, median / max (ms) |",
              "|---:|---:|---:|---:|",
              f"| {tr['s_none']:.2f} | {tr['s_ckpt']:.2f} | {100 * tr['slowdown']:+.1f}% | "
              f"{tr['stall_ms_median']:.2f} / {tr['stall_ms_max']:.2f} |"]
    print("\n".join(lines3), flush=True)
    os.makedirs(args.out, exist_ok=True)
    md = (f"`python benchmarks/gpu_snapshot.py --gib {args.gib:g}` on {dev}\n\n"
          + "\n".join(lines + lines2 + lines3) + "\n")
    doc = {"device": dev, "torch": torch.__version__, "throughput": thr, "size_classes": sc, "training": tr,
           "args": vars(args)}
    write_results(args.out, "gpu_snapshot", md, doc, indent=1, plot=lambda path: plot(sc, dev, path))


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
