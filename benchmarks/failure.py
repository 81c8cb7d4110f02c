"""The moment of failure: how fast a preempted job saves, what the NaN check costs, what every="auto" costs.

    python benchmarks/failure.py --size-gib 1 --repeats 3

Three measurements, each in the same run for every method:

* **signal → durable**: a child process trains (every step rewrites all of its ``--size-gib`` of
  float32 weights) after one warm-up save, the way a job that has been saving periodically does.
  SIGTERM arrives at a random moment of a step. With ckpt the loop is ``should_save`` / ``save`` /
  ``preempted`` (``preemption=True``); the others get the usual hand-written handler (a flag, then a
  blocking save of the same tensors at the step end: ``torch.save`` + fsync, ``dcp.save``,
  safetensors + fsync). Reported: signal → the step is durable (ckpt: committed), and signal →
  the process has exited, against torchrun's 30 s between SIGTERM and SIGKILL.
* **finite check**: ckpt saves of the same state with ``check_finite="all"`` (every float element
  tested for NaN/Inf, the most it can be asked) and with ``check_finite=False``, interleaved; the
  difference of the median stalls as a fraction of the stall.
* **every="auto"**: a real training loop (an MLP on CPU, SGD) run for the same number of steps with
  no checkpointing, fixed step intervals and ``every="auto"``. Reported: overhead against the loop
  without checkpointing, the mean interval, and the expected waste per failure-free hour for a mean
  time between failures M: overhead + interval / (2·M) (Young and Daly's objective: the stall paid
  for every save plus half an interval of work redone per failure).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import warnings

import torch

warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
HERE = os.path.dirname(os.path.abspath(__file__))

from harness import median, pyplot, save_figure, write_results  # noqa: E402  (benchmarks/: shared)
from save_load import fsync_path, make_state  # noqa: E402  (the same state as the save/load benchmark)

import ckpt  # noqa: E402

GRACE_S = 30.0  # torchrun: SIGTERM to every worker, SIGKILL this long after
METHODS = ["ckpt", "torch.save", "dcp.save", "safetensors"]


# -- signal -> durable (the child) --------------------------------------------------------------------

def child(method: str, root: str, size_gib: float) -> None:
    """Train until SIGTERM, save once more, exit. Prints 'ready' once warm, then one JSON line."""
    state = make_state(size_gib)
    flag = {"t": None}
    out: dict = {}
    if method == "ckpt":
        c = ckpt.Checkpointer(root, preemption=True, every=None, codec="raw")
        c.save(0, state).wait()  # the periodic save before: the host buffer exists
    else:
        signal.signal(signal.SIGTERM, lambda *_: flag.update(t=time.time()))
        save(method, root, state, 0)
    print("ready", flush=True)
    step = 0
    while True:
        step += 1
        for t in state.values():  # a training step rewrites every weight
            t.mul_(0.999)
        if method == "ckpt":
            if c.should_save(step):
                c.save(step, state)
            if c.preempted:
                out["durable"] = time.time()
                c.close()
                break
        elif flag["t"] is not None:
            save(method, root, state, step)
            out["durable"] = time.time()
            break
    out["exit"] = time.time()
    print(json.dumps(out), flush=True)


def save(method: str, root: str, state: dict, step: int) -> None:
    if method == "torch.save":
        with open(os.path.join(root, f"{step}.pt"), "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
    elif method == "safetensors":
        from safetensors.torch import save_file
        path = os.path.join(root, f"{step}.safetensors")
        save_file(state, path)
        fsync_path(path)
    elif method == "dcp.save":
        import torch.distributed.checkpoint as dcp
        dcp.save(state, checkpoint_id=os.path.join(root, str(step)))
    else:
        raise ValueError(method)


def signal_to_durable(method: str, size_gib: float, work: str, rng: random.Random) -> tuple[float, float]:
    root = tempfile.mkdtemp(dir=work)
    err = open(os.path.join(work, f"{method}.stderr"), "w+")
    p = subprocess.Popen([sys.executable, __file__, "--child", method, root, "--size-gib", str(size_gib)],
                         stdout=subprocess.PIPE, stderr=err, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        assert p.stdout is not None
        assert p.stdout.readline().strip() == "ready", "the child did not start"
        time.sleep(rng.uniform(0.3, 0.8))  # into some training step
        os.sync()
        sent = time.time()
        p.send_signal(signal.SIGTERM)
        line = p.stdout.readline()
        p.wait(timeout=600)
        if p.returncode != 0 or not line:
            err.seek(0)
            raise RuntimeError(f"{method}: the child failed (exit code {p.returncode}): {err.read()[-2000:]}")
        got = json.loads(line)
        return got["durable"] - sent, got["exit"] - sent
    finally:
        if p.poll() is None:
            p.kill()
        err.close()
        shutil.rmtree(root, ignore_errors=True)


# -- finite check ------------------------------------------------------------------------------------

def finite_check(size_gib: float, repeats: int, work: str) -> dict[str, float]:
    state = make_state(size_gib, seed=1)
    cs = {on: ckpt.Checkpointer(os.path.join(work, f"finite-{on}"), check_finite="all" if on else False,
                                codec="raw", keep_last=1) for on in (True, False)}
    stalls: dict[bool, list[float]] = {True: [], False: []}
    for i in range(repeats + 1):
        for on in ((True, False) if i % 2 else (False, True)):
            for t in state.values():
                t.add_(1.0)  # new data each time (untimed)
            h = cs[on].save(i, state)
            h.wait()
            if i:  # the first save of each allocates its buffer
                stalls[on].append(h.metrics.stall_s)
    for c in cs.values():
        c.close()
    on, off = median(stalls[True]), median(stalls[False])
    return {"stall_checked_s": on, "stall_unchecked_s": off, "cost": (on - off) / off}


# -- every="auto" on a training loop -----------------------------------------------------------------

def training(every, seconds: float, width: int, work: str, mtbf: float | None) -> dict:
    """Train for ``seconds``; steps per second while the loop ran, saves made, the interval in force."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(4)])
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    state = {"model": model, "optim": opt, "step": 0}
    c = None
    if every is not False:
        opts = {"mtbf": mtbf} if mtbf else {}
        c = ckpt.Checkpointer(os.path.join(work, f"train-{every}-{mtbf}"), every=every, keep_last=2, codec="raw",
                              **opts)
    x = torch.randn(32, width)
    saves, step, blocked, t0 = 0, 0, 0.0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        step += 1
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        state["step"] = step
        if c is not None:
            t = time.perf_counter()
            if c.should_save(step):
                c.save(step, state)
                saves += 1
            blocked += time.perf_counter() - t
    wall = time.perf_counter() - t0
    out = {"steps": step, "wall_s": wall, "saves": saves, "blocked_s": blocked, "chosen": "-", "interval_s": None}
    if c is not None:
        iv = c.interval
        out["chosen"] = iv.describe()
        out["interval_s"] = iv.seconds if iv.seconds is not None else (
            every * wall / step if isinstance(every, int) else None)
        c.close()
    return out


def overheads(seconds: float, width: int, work: str) -> list[dict]:
    settings: list[tuple[str, object, float | None]] = [
        ("every=1", 1, None), ("every=10", 10, None), ("every=100", 100, None),
        ('every="auto" (mtbf 4 h)', "auto", None), ('every="auto", mtbf=600', "auto", 600.0)]
    training(False, min(seconds, 3.0), width, work, None)  # warm up the allocator and the threads
    # A loop without checkpointing before and after each setting: its baseline is the mean of its two
    # neighbours, so the drift of a shared machine over the run cancels out as far as it can.
    base = [training(False, seconds, width, work, None)]
    rows = []
    for name, every, mtbf in settings:
        r = {"setting": name, **training(every, seconds, width, work, mtbf)}
        base.append(training(False, seconds, width, work, None))
        rate = statistics.mean(b["steps"] / b["wall_s"] for b in base[-2:])
        r["overhead"] = max(0.0, rate / (r["steps"] / r["wall_s"]) - 1)
        r["stall_share"] = r["blocked_s"] / r["wall_s"]
        rows.append(r)
    rows.insert(0, {"setting": "no checkpointing", "steps": round(statistics.mean(b["steps"] for b in base)),
                    "wall_s": seconds, "saves": 0, "blocked_s": 0.0, "chosen": "-", "interval_s": None,
                    "overhead": 0.0, "stall_share": 0.0,
                    "rate_spread": (max(b["steps"] / b["wall_s"] for b in base)
                                    / min(b["steps"] / b["wall_s"] for b in base) - 1)})
    return rows


def waste(row: dict, mtbf: float) -> float | None:
    """Expected fraction of time lost on a long run: the stall of saving plus half an interval of
    work redone per failure (Young and Daly's objective)."""
    if row["interval_s"] is None:
        return None
    return row["stall_share"] + row["interval_s"] / (2 * mtbf)


# -- report ------------------------------------------------------------------------------------------

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-gib", type=float, default=1.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=30.0, help="training time per setting (every= part)")
    ap.add_argument("--width", type=int, default=2048, help="MLP width (4 layers; 2048: 192 MiB with Adam)")
    ap.add_argument("--only", default="signal,finite,auto", help="which parts to run")
    ap.add_argument("--quick", action="store_true", help="64 MiB, 1 repeat, 40 steps: a smoke test")
    ap.add_argument("--out", default=os.path.join(HERE, "results"), help="where the table, JSON and plot go")
    ap.add_argument("--child", nargs=2, metavar=("METHOD", "ROOT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child[0], args.child[1], args.size_gib)
        return
    if args.quick:
        args.size_gib, args.repeats, args.seconds, args.width = 1 / 16, 1, 2.0, 512
    parts = set(args.only.split(","))
    rng = random.Random(0)
    work = tempfile.mkdtemp(prefix="ckpt-bench-failure-")
    doc: dict = {"command": "python benchmarks/failure.py " + " ".join(sys.argv[1:]), "size_gib": args.size_gib,
                 "repeats": args.repeats, "cpus": os.cpu_count(), "machine": platform.machine()}
    lines = [f"Command: `{doc['command']}`", ""]
    try:
        if "signal" in parts:
            times: dict[str, list[tuple[float, float]]] = {m: [] for m in METHODS}
            for _ in range(args.repeats):
                for m in METHODS:  # methods take turns within each repeat
                    times[m].append(signal_to_durable(m, args.size_gib, work, rng))
            med = {m: (median(d for d, _ in v), median(e for _, e in v))
                   for m, v in times.items()}
            doc["signal"] = {m: {"durable_s": d, "exit_s": e} for m, (d, e) in med.items()}
            lines += [f"**SIGTERM → durable**, {args.size_gib:g} GiB of float32 weights (every step rewrites all of "
                      f"them), {os.cpu_count()} CPUs, median of {args.repeats}:", "",
                      "| method | signal → durable (s) | signal → exit (s) | ÷ ckpt | share of torchrun's 30 s |",
                      "|---|---:|---:|---:|---:|"]
            for m in METHODS:
                d, e = med[m]
                lines.append(f"| {m} | {d:.2f} | {e:.2f} | {d / med['ckpt'][0]:.2f} | {e / GRACE_S:.0%} |")
            lines.append("")
        if "finite" in parts:
            f = finite_check(args.size_gib, max(5, args.repeats), work)
            doc["finite"] = f
            lines += [f"**NaN/Inf check**, {args.size_gib:g} GiB, every element checked (`check_finite=\"all\"`): "
                      f"stall {f['stall_checked_s'] * 1e3:.1f} ms against {f['stall_unchecked_s'] * 1e3:.1f} ms "
                      f"unchecked, a cost of {f['cost']:+.1%} of the stall (medians; within noise when near 0).", ""]
        if "auto" in parts:
            rows = overheads(args.seconds, args.width, work)
            doc["auto"] = rows
            nbytes = 3 * 4 * args.width * (args.width + 1) * 4
            lines += [f"**Save interval**: a 4-layer MLP with Adam ({nbytes / 2**20:.0f} MiB of state) trained "
                      f"for {args.seconds:g} s per setting on CPU. *Blocked*: the share of the loop spent inside "
                      f"`should_save` and `save`. *Overhead*: steps per second lost against the same loop without "
                      f"checkpointing run just before and just after (it includes the background writing competing "
                      f"for the CPUs; the loops without checkpointing varied by "
                      f"{rows[0]['rate_spread']:.0%} among themselves, which bounds what it can resolve).", "",
                      "| setting | saves | interval (s) | blocked | overhead | waste, M = 1 h | waste, M = 4 h | "
                      "interval chosen |", "|---|---:|---:|---:|---:|---:|---:|---|"]
            for r in rows:
                iv = "–" if r["interval_s"] is None else f"{r['interval_s']:.2f}"
                w1, w4 = waste(r, 3600), waste(r, 4 * 3600)
                lines.append(f"| {r['setting']} | {r['saves']} | {iv} | {r['stall_share']:.2%} | {r['overhead']:.1%} | "
                             f"{'–' if w1 is None else f'{w1:.2%}'} | {'–' if w4 is None else f'{w4:.2%}'} | "
                             f"{r['chosen']} |")
            lines += ["", "waste = blocked + interval / (2·M): the stall saving costs plus the work redone after a "
                          "failure, as a fraction of the run, for a mean time between failures M (Young/Daly; the "
                          "background cost is left out, as it depends on how many cores the training leaves free). "
                          "Without checkpointing a failure loses everything since the start."]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    text = "\n".join(lines)
    print(text)
    write_results(args.out, "failure", text + "\n", doc, indent=1, json_default=str,
                  plot=lambda path: plot(doc, path))


def plot(doc: dict, path: str) -> None:
    plt = pyplot()
    if plt is None:
        return
    panels = [k for k in ("signal", "auto") if k in doc]
    if not panels:
        return
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 3.6), squeeze=False)
    for ax, k in zip(axes[0], panels):
        if k == "signal":
            names = list(doc["signal"])
            ax.barh(names, [doc["signal"][m]["durable_s"] for m in names], color="tab:blue", label="durable")
            ax.barh(names, [doc["signal"][m]["exit_s"] - doc["signal"][m]["durable_s"] for m in names],
                    left=[doc["signal"][m]["durable_s"] for m in names], color="tab:gray", label="until exit")
            ax.set_xlabel(f"seconds after SIGTERM ({doc['size_gib']:g} GiB)")
            ax.invert_yaxis()
            ax.legend(loc="lower right")
        else:
            rows = doc["auto"]
            y = range(len(rows))
            ax.barh([i - 0.2 for i in y], [100 * r["stall_share"] for r in rows], height=0.4, color="tab:orange",
                    label="blocked")
            ax.barh([i + 0.2 for i in y], [100 * r["overhead"] for r in rows], height=0.4, color="tab:gray",
                    label="throughput lost")
            ax.set_yticks(list(y), [r["setting"] for r in rows])
            ax.set_xscale("symlog", linthresh=1.0)
            ax.set_xlabel("% of the training loop")
            ax.legend(loc="lower right")
            ax.invert_yaxis()
    save_figure(fig, path, dpi=120)


if __name__ == "__main__":
    main()
