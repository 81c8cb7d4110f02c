"""Host memory under a budget, at full size: a 2 GiB state saved and loaded with ``host_memory=512 MiB``.

    python benchmarks/host_memory.py --size-gib 2 --budget-mib 512

Each case runs in a child process of its own, so its peak RSS is its own. A case builds a state of
random float32 bits (one large matrix and a vector, as the state's bulk), saves it with one
``Checkpointer``, overwrites every tensor as soon as ``save()`` returns, then loads it with a fresh
``Checkpointer`` (as a restarted job: no host buffer to borrow) into tensors of its own and compares
every byte with the state of the call.

* **Peak memory.** Linux's peak RSS (``VmHWM``) is reset (``/proc/self/clear_refs``) just before
  ``save()`` and again just before ``load()``; the growth over the RSS at that moment is what the
  save or the load held: the ring of slabs or the host buffer, the storage's write or read scratch,
  and what Python and the allocator take. The state's own tensors and the load's target tensors are
  allocated and touched before the reset. "overhead" is the growth less the budget: the same at 1
  and 2 GiB says it does not grow with the state.
* **Blocked time.** The directory is held to a write bandwidth (``throttled://``, the limiter of
  ``benchmarks/bandwidth.py``: one token bucket for every byte written by the process). Above the
  budget ``save()`` returns once the last piece is copied, which it can only do once every byte
  beyond the ring's has been written: the wait is about (state − budget) ÷ bandwidth.
  ``SaveMetrics.stall_s`` is the time inside ``save()``, ``blocked_s`` the part spent waiting for a
  free slab.
  The throttled cases reach the directory through fsspec (the limiter is an fsspec filesystem), whose
  writes copy each chunk once more (a chunk per writing thread, in the overhead); the unthrottled
  cases use ckpt's local directory storage.
* **Without a budget** the same save and load, for the memory they take instead.
* **The verdicts.** The issue's bound, peak growth ≤ state-independent overhead + budget + 10%, with
  the overhead measured on the half-size state on the same storage in the same run (the larger of its
  save's and its load's growth less the budget) and applied to the full-size one.

``codec="raw"`` throughout, so the bytes written are the state's bytes and the law above is exact
(``auto`` writes fewer bytes, so blocks less). Prints a table, writes benchmarks/results/host_memory.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from harness import DASH, banner, command, fmt, machine, write_results

MiB = 1 << 20
HERE = os.path.dirname(os.path.abspath(__file__))

_CHILD = r"""
import gc, json, os, sys, time
import numpy as np, torch, xxhash
sys.path.insert(0, sys.argv[1])
import bandwidth, ckpt
root, size, budget, rate = sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5])

def status(name):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(name + ":"))

def reset_peak():
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return status("VmRSS")

def make_shapes():
    n = size // 4
    rows = (n * 7 // 8) // 4096
    return {"w": torch.empty(rows, 4096), "v": torch.empty(n - rows * 4096)}

def make(seed_base):
    state = make_shapes()
    for i, t in enumerate(state.values()):
        t.view(-1).view(torch.uint8).numpy()[:] = np.random.default_rng(seed_base + i).integers(
            0, 256, t.nbytes, np.uint8)
    return state

def digests(state):
    return {k: xxhash.xxh3_128_hexdigest(t.view(-1).view(torch.uint8).numpy()) for k, t in state.items()}

opts = dict(codec="raw", check_finite=False, **({"host_memory": budget} if budget else {}))
bandwidth.ThrottledFS.limit(rate or None)
url = f"throttled://{root}" if rate else root  # unthrottled: the local directory storage itself
state = make(0)
saved = digests(state)
with ckpt.Checkpointer(url, **opts) as c:
    c.save(0, {"x": torch.zeros(8)}).wait()  # threads and storage started: not counted
    base = reset_peak()
    t = time.perf_counter()
    h = c.save(1, state)
    returned = time.perf_counter() - t
    for x in state.values():
        x.fill_(7.0)  # the caller moves on at once: the saved bytes must be the call's
    m = h.wait()
    durable = time.perf_counter() - t
    save_growth = status("VmHWM") - base
del state, c, h
gc.collect()
bandwidth.ThrottledFS.limit(None)  # loads read at full speed: the memory is what is measured
with ckpt.Checkpointer(url, **opts) as c:
    back = {k: torch.full_like(t, -1.0) for k, t in make_shapes().items()}  # every page touched
    base = reset_peak()
    t = time.perf_counter()
    c.load(1, back)
    load_s = time.perf_counter() - t
    load_growth = status("VmHWM") - base
    s = c.last_load
print(json.dumps({"save_growth": save_growth, "load_growth": load_growth, "returned": returned,
                  "stall": m.stall_s, "blocked": m.blocked_s, "durable": durable, "pieces": m.pieces,
                  "host": m.host_bytes, "load_s": load_s, "passes": s.passes, "windows": s.windows,
                  "staging": s.staging_bytes, "same": digests(back) == saved}))
"""


def run_case(root: str, size: int, budget: int, rate: float) -> dict:
    """One save and load in a child process; what it measured."""
    with tempfile.TemporaryDirectory(prefix="ckpt-hm-", dir=root) as d:
        t = time.perf_counter()
        out = subprocess.run([sys.executable, "-c", _CHILD, HERE, d, str(size), str(budget), str(rate)],
                             capture_output=True, text=True, check=False)
        if out.returncode != 0:
            raise SystemExit(f"case size={size} budget={budget} rate={rate} failed:\n{out.stderr[-3000:]}")
        got = json.loads(out.stdout.strip().splitlines()[-1])
        got["wall"] = time.perf_counter() - t
        return got


def table(cases: list[dict]) -> str:
    head = ("| state | budget | storage | save() s | of it waiting s | (state − budget) ÷ bw s | durable s | pieces "
            "| save peak growth MiB | overhead MiB | load s | passes | load peak growth MiB | overhead MiB "
            "| bit-exact |")
    rows = [head, "|" + "---|" * (head.count("|") - 1)]
    for c in cases:
        b = c["budget"]
        bw = f"{c['rate'] / 1e6:g} MB/s" if c["rate"] else "unthrottled"
        law = (c["size"] - b) / c["rate"] if (b and c["rate"] and c["size"] > b) else None
        rows.append("| " + " | ".join([
            f"{c['size'] / 2**30:g} GiB", f"{b // MiB} MiB" if b else "none", bw, fmt(c["stall"]),
            fmt(c["blocked"]) if b else DASH, fmt(law) if law is not None else DASH, fmt(c["durable"]),
            str(c["pieces"]), f"{c['save_growth'] / MiB:.0f}",
            f"{(c['save_growth'] - b) / MiB:.0f}" if b else DASH, fmt(c["load_s"]), str(c["passes"]),
            f"{c['load_growth'] / MiB:.0f}", f"{(c['load_growth'] - b) / MiB:.0f}" if b else DASH,
            "yes" if c["same"] else "NO"]) + " |")
    return "\n".join(rows)


def verdicts(cases: list[dict]) -> list[str]:
    """The issue's test, case by case: peak growth ≤ overhead + budget + 10%, blocked ≈ the law."""
    out: list[str] = []
    for c in cases:
        half = next((h for h in cases if h["budget"] == c["budget"] and h["rate"] == c["rate"]
                     and h["size"] < c["size"]), None)  # the same storage at half the state
        if not c["budget"] or half is None:
            continue
        fixed = max(half["save_growth"], half["load_growth"]) - half["budget"]
        name = f"{c['size'] / 2**30:g} GiB at {c['budget'] // MiB} MiB"
        for what in ("save", "load"):
            growth = c[f"{what}_growth"]
            bound = 1.1 * (c["budget"] + fixed)
            ok = growth <= bound and c["same"]
            out.append(f"- {'MET' if ok else 'NOT MET'}: {name}, {what} peak growth {growth / MiB:.0f} MiB ≤ "
                       f"1.1 × (budget + the overhead of half the state on the same storage, {fixed / MiB:.0f} MiB) = "
                       f"{bound / MiB:.0f} MiB{'' if c['same'] else ' (and the load was NOT bit-exact)'}")
        if c["rate"] and c["size"] > c["budget"]:
            law = (c["size"] - c["budget"]) / c["rate"]
            out.append(f"- {name}, {c['rate'] / 1e6:g} MB/s: save() took {c['stall']:.2f} s, "
                       f"{c['stall'] / law:.2f} × (state − budget) ÷ bandwidth ({law:.2f} s)")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-gib", type=float, default=2.0, help="the largest state (a half-size one runs too)")
    p.add_argument("--budget-mib", type=int, default=512)
    p.add_argument("--rate-mb", type=float, default=400.0, help="write bandwidth of the throttled cases, MB/s")
    p.add_argument("--dir", default=None, help="scratch directory (default: the system's temp dir)")
    p.add_argument("--out", default=os.path.join(HERE, "results"))
    p.add_argument("--quick", action="store_true", help="256 MiB at 64 MiB: a smoke test")
    args = p.parse_args()
    if not os.path.exists("/proc/self/clear_refs"):
        raise SystemExit("needs Linux's /proc/self/clear_refs to reset the peak RSS")
    if args.quick:
        args.size_gib, args.budget_mib = 0.25, 64
    size, budget, rate = int(args.size_gib * 2**30), args.budget_mib * MiB, args.rate_mb * 1e6
    print(banner())
    print("command: " + command("host_memory"))
    if budget * 2 > size:
        p.error("the budget must be at most half the state (the half-size state must pass it too)")
    plan = [(size // 2, budget, rate), (size, budget, rate), (size // 2, budget, 0.0), (size, budget, 0.0),
            (size, 0, 0.0)]
    cases = []
    for s, b, r in plan:
        got = run_case(args.dir or tempfile.gettempdir(), s, b, r)
        got.update(size=s, budget=b, rate=r)
        cases.append(got)
        print(f"  {s / 2**30:g} GiB, budget {b // MiB if b else 'none'} MiB, {r / 1e6:g} MB/s: save() "
              f"{got['stall']:.2f} s, save peak +{got['save_growth'] / MiB:.0f} MiB, load peak "
              f"+{got['load_growth'] / MiB:.0f} MiB, bit-exact {got['same']}", flush=True)
    tab, says = table(cases), verdicts(cases)
    md = "\n\n".join(['`' + command('host_memory') + '`', banner(),
                      f"Random float32 bits, `codec=\"raw\"`; throttled cases write at {args.rate_mb:g} MB/s "
                      "(loads unthrottled). Growth is the peak RSS over the RSS just before the call.",
                      tab, "\n".join(says)]) + "\n"
    print("\n" + tab + "\n\n" + "\n".join(says))
    write_results(args.out, "host_memory", md, {"command": command("host_memory"), "machine": machine(),
                                                "cases": cases, "verdicts": says})


if __name__ == "__main__":
    main()
