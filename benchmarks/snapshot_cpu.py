"""CPU snapshot: save() with the compiled core (fused copy + hash) versus the pure-Python path.

    python benchmarks/snapshot_cpu.py --size-gib 2 --repeats 5

Same state, same run, methods taking turns in each repeat; the data changes in place between repeats
(untimed) so no chunk can be skipped by dedup, and ``os.sync()`` runs before each timed save.

* memcpy floor: the same tensors copied into preallocated tensors (torch ``copy_``), nothing else;
* ckpt native / ckpt fallback: ``Checkpointer.save`` with ``native=True`` / ``False`` (default codec):
  blocked = time inside ``save()`` (the copy, and with the core also every chunk's hash),
  durable = from the call until the step is committed (hash, encode, write, fsync, manifest).
Prints a table, writes snapshot_cpu.{json,md,png} under --out.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time

import torch
from harness import median, pyplot, save_figure, write_results
from save_load import copy_into, make_state

import ckpt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-gib", type=float, default=2.0)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--root", default=None, help="directory for the checkpoints (default: a temp dir)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = ap.parse_args()
    info = ckpt._ext.info()
    if info["cpu"] is None:
        sys.exit("the compiled core is not built: pip install -e . with a C++ compiler (and without CKPT_NO_EXT)")
    state = make_state(args.size_gib)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    root = tempfile.mkdtemp(prefix="ckpt-snap-", dir=args.root)
    floor_buf = {k: torch.empty_like(v) for k, v in state.items()}
    copy_into(floor_buf, state)
    ckptrs = {"ckpt native": ckpt.Checkpointer(os.path.join(root, "native"), native=True, keep_last=1),
              "ckpt fallback": ckpt.Checkpointer(os.path.join(root, "fallback"), native=False, keep_last=1)}
    for c in ckptrs.values():  # warm-up: host buffer allocation and layout are first-save costs
        c.save(0, {"model": state}).wait()
    times: dict[str, dict[str, list[float]]] = {n: {"blocked": [], "durable": []} for n in ["memcpy floor", *ckptrs]}
    try:
        for r in range(1, args.repeats + 1):
            with torch.no_grad():
                for t in state.values():
                    t.add_(1e-3)
            os.sync()
            t0 = time.perf_counter()
            copy_into(floor_buf, state)
            times["memcpy floor"]["blocked"].append(time.perf_counter() - t0)
            order = list(ckptrs) if r % 2 else list(reversed(ckptrs))
            for name in order:
                os.sync()
                h = ckptrs[name].save(r, {"model": state})
                m = h.wait()
                times[name]["blocked"].append(m.stall_s)
                times[name]["durable"].append(m.duration_s)
            print(f"repeat {r}: " + ", ".join(f"{n} {statistics.median(v['blocked']):.3f}s" for n, v in times.items()),
                  flush=True)
    finally:
        for c in ckptrs.values():
            c.close()
        shutil.rmtree(root, ignore_errors=True)
    med = {n: {k: median(v) for k, v in d.items()} for n, d in times.items()}
    floor = med["memcpy floor"]["blocked"]
    fb = med["ckpt fallback"]["durable"]
    cpu = platform.processor() or platform.machine()
    lines = [f"`python benchmarks/snapshot_cpu.py --size-gib {args.size_gib:g} --repeats {args.repeats}` "
             f"({os.cpu_count()} cores, {cpu}, SIMD {info['simd']}; medians)", "",
             "| method | blocked (s) | blocked ÷ memcpy | durable (s) | durable ÷ fallback |",
             "|---|---:|---:|---:|---:|"]
    for n, d in med.items():
        durable = f"{d['durable']:.3f} | {d['durable'] / fb:.2f} |" if d["durable"] == d["durable"] else "– | – |"
        lines.append(f"| {n} | {d['blocked']:.3f} | {d['blocked'] / floor:.2f} | " + durable)
    nat = med["ckpt native"]
    lines += ["", f"Targets: native blocked ≤ 1.2 × memcpy (hashing included): {nat['blocked'] / floor:.2f} "
              f"({'met' if nat['blocked'] <= 1.2 * floor else 'NOT met'}); native durable < fallback durable: "
              f"{nat['durable'] / fb:.2f} ({'met' if nat['durable'] < fb else 'NOT met'})"]
    print("\n".join(lines))
    write_results(args.out, "snapshot_cpu", "\n".join(lines) + "\n",
                  {"bytes": nbytes, "ext": info, "times": times, "median": med}, indent=1,
                  plot=lambda path: plot(med, path, nbytes))


def plot(med: dict, path: str, nbytes: int) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(6, 3.5))
    names = list(med)
    ax.barh(names, [med[n]["blocked"] for n in names], label="blocked in save()")
    ax.barh(names, [med[n]["durable"] - med[n]["blocked"] if med[n]["durable"] == med[n]["durable"] else 0
                    for n in names], left=[med[n]["blocked"] for n in names], label="background until durable")
    ax.set_xlabel(f"seconds for {nbytes / 2**30:.1f} GiB")
    ax.legend()
    save_figure(fig, path)

if __name__ == "__main__":
    main()
