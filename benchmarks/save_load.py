"""Save and load of one training state, ckpt against torch.save, DCP (save, async_save) and safetensors.

    python benchmarks/save_load.py --size-gib 2 --repeats 3

Every method sees the same tensors in the same run. Methods take turns within each repeat (so a
slow patch of the shared disk hits all of them alike), the data is changed in place between repeats
(untimed, so dedup cannot skip work), and `os.sync()` runs before every timed save so no method pays
for another's dirty pages. Reported per method, as medians:

* blocked: how long the caller waited inside the save call;
* durable: from the call until the data is on disk, fsync included;
* load: reading it back into preallocated tensors, from the disk: every method's files are dropped
  from the page cache first (``os.sync()``, then ``POSIX_FADV_DONTNEED`` on each file), as a restore
  after a failure finds them; ckpt writes its chunks around the page cache anyway (``direct_io``).
  ckpt's default load verifies every chunk into staging memory before it writes a tensor (a failed
  load changes nothing); the "load in place" row reads straight into the tensors, for the cost.

A first, untimed round warms every method up (ckpt allocates its host buffer there, DCP builds its
plan); ckpt's first-save stall is printed separately. The "fresh Checkpointer" row builds a new
``Checkpointer`` for every save, into a new directory: its times include the construction, the host
buffer's allocation and nothing stored to reuse. Below the table, whether the writer overlaps coding
with I/O: the default codec's durable time against ``codec="raw"``'s (the I/O alone) and its encoding's
CPU seconds spread over the cores (the coding alone).

The memcpy row is the floor: copying the same bytes into preallocated tensors.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
import warnings
from collections.abc import Callable

import torch
from harness import (  # benchmarks/: the shared harness
    banner,
    fmt,
    median,
    pyplot,
    ratio,
    rounds,
    save_figure,
    write_results,
)

warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")

Timing = dict[str, float]


def make_state(size_gib: float, seed: int = 0) -> dict[str, torch.Tensor]:
    """Transformer-like fp32 weights: per layer four matrices and a few vectors, until size_gib."""
    g = torch.Generator().manual_seed(seed)
    d = 1024 if size_gib < 1 else 2048
    target = int(size_gib * 2**30)
    out: dict[str, torch.Tensor] = {}
    total, layer = 0, 0
    shapes = [("attn.qkv.weight", (3 * d, d)), ("attn.qkv.bias", (3 * d,)), ("attn.out.weight", (d, d)),
              ("norm1.weight", (d,)), ("norm1.bias", (d,)), ("mlp.up.weight", (4 * d, d)), ("mlp.up.bias", (4 * d,)),
              ("mlp.down.weight", (d, 4 * d)), ("norm2.weight", (d,)), ("norm2.bias", (d,))]
    while total < target:
        for name, shape in shapes:
            n = 1
            for s in shape:
                n *= s
            if total + 4 * n > target and len(shape) == 2:
                shape = (max(1, (target - total) // (4 * shape[1])), shape[1])
            t = torch.randn(shape, generator=g)
            out[f"layers.{layer}.{name}"] = t
            total += t.numel() * 4
            if total >= target:
                break
        layer += 1
    return out


def fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def evict(root: str) -> None:
    """Drop every file under ``root`` from the page cache (written back first by the caller's ``os.sync()``)."""
    for d, _, files in os.walk(root):
        for f in files:
            try:
                fd = os.open(os.path.join(d, f), os.O_RDONLY)
            except OSError:
                continue
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def copy_into(dst: dict[str, torch.Tensor], src: dict[str, torch.Tensor]) -> None:
    for k, v in src.items():
        dst[k].copy_(v)


class Method:
    """One way of checkpointing. save() returns (blocked, durable); load() returns seconds."""

    name = ""

    def __init__(self, root: str):
        self.dir = os.path.join(root, self.name.replace(".", "_"))
        os.makedirs(self.dir, exist_ok=True)

    def save(self, state: dict, step: int) -> tuple[float, float]:
        raise NotImplementedError

    def load(self, target: dict, step: int) -> float:
        raise NotImplementedError

    def cleanup(self, step: int) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)
        os.makedirs(self.dir, exist_ok=True)

    def close(self) -> None:
        pass


class Memcpy(Method):
    name = "memcpy (floor)"

    def __init__(self, root, state):
        super().__init__(root)
        self.buf = {k: torch.empty_like(v) for k, v in state.items()}
        copy_into(self.buf, state)  # fault the pages in outside the timing

    def save(self, state, step):
        t = time.perf_counter()
        copy_into(self.buf, state["model"])
        dt = time.perf_counter() - t
        return dt, float("nan")

    def load(self, target, step):
        t = time.perf_counter()
        copy_into(target["model"], self.buf)
        return time.perf_counter() - t


class TorchSave(Method):
    name = "torch.save"

    def path(self, step):
        return os.path.join(self.dir, f"step{step}.pt")

    def save(self, state, step):
        t = time.perf_counter()
        with open(self.path(step), "wb") as f:
            torch.save(state["model"], f)
            f.flush()
            os.fsync(f.fileno())
        dt = time.perf_counter() - t
        return dt, dt

    def load(self, target, step):
        t = time.perf_counter()
        copy_into(target["model"], torch.load(self.path(step), weights_only=True))
        return time.perf_counter() - t


class Safetensors(Method):
    name = "safetensors"

    def path(self, step):
        return os.path.join(self.dir, f"step{step}.safetensors")

    def save(self, state, step):
        from safetensors.torch import save_file
        t = time.perf_counter()
        save_file(state["model"], self.path(step))
        fsync_path(self.path(step))
        dt = time.perf_counter() - t
        return dt, dt

    def load(self, target, step):
        from safetensors.torch import load_file
        t = time.perf_counter()
        copy_into(target["model"], load_file(self.path(step)))
        return time.perf_counter() - t


class DCPSave(Method):
    name = "dcp.save"

    def ckpt_id(self, step):
        return os.path.join(self.dir, f"step{step}")

    def save(self, state, step):
        import torch.distributed.checkpoint as dcp
        t = time.perf_counter()
        dcp.save(state, checkpoint_id=self.ckpt_id(step))  # FileSystemWriter fsyncs by default
        dt = time.perf_counter() - t
        return dt, dt

    def load(self, target, step):
        import torch.distributed.checkpoint as dcp
        t = time.perf_counter()
        dcp.load(target, checkpoint_id=self.ckpt_id(step))  # in place into the target tensors
        return time.perf_counter() - t


class DCPAsyncSave(DCPSave):
    name = "dcp.async_save"

    def save(self, state, step):
        import torch.distributed.checkpoint as dcp
        t = time.perf_counter()
        fut = dcp.async_save(state, checkpoint_id=self.ckpt_id(step))  # default stager, thread
        blocked = time.perf_counter() - t
        fut.result()
        return blocked, time.perf_counter() - t


class Ckpt(Method):
    name = "ckpt"
    options: dict = {}

    def __init__(self, root):
        super().__init__(root)
        import ckpt
        self.c = ckpt.Checkpointer(self.dir, keep_last=1, **self.options)
        self.first_stall = None

    def save(self, state, step):
        t = time.perf_counter()
        h = self.c.save(step, state)
        blocked = time.perf_counter() - t
        m = h.wait()
        self.encode_cpu, self.written = m.encode_cpu_s, m.written_bytes
        durable = time.perf_counter() - t
        if self.first_stall is None:
            self.first_stall = blocked
        return blocked, durable

    def load(self, target, step):
        t = time.perf_counter()
        self.c.load(step, target)
        return time.perf_counter() - t

    def cleanup(self, step):
        self.c.wait()  # let retention of the older step finish outside any timing

    def close(self):
        self.c.close()


class CkptInPlace(Ckpt):
    """Loads straight into the tensors (``staged_load=False``): what staging a load costs."""
    name = "ckpt (load in place)"
    options = {"staged_load": False}


class CkptRaw(Ckpt):
    """Chunks stored as they are (``codec="raw"``): the load path without decoding, hashes checked."""
    name = "ckpt (codec=raw)"
    options = {"codec": "raw"}


class CkptFresh(Ckpt):
    """A new ``Checkpointer`` for every save, into a new directory: construction, the host buffer's
    allocation and page faults, and nothing stored to reuse are all inside the times."""
    name = "ckpt (fresh Checkpointer)"

    def __init__(self, root):
        Method.__init__(self, root)
        self.c = None
        self.first_stall = None

    def save(self, state, step):
        import ckpt
        t = time.perf_counter()
        self.c = ckpt.Checkpointer(os.path.join(self.dir, f"fresh{step}"), **self.options)
        h = self.c.save(step, state)
        blocked = time.perf_counter() - t
        m = h.wait()
        self.encode_cpu, self.written = m.encode_cpu_s, m.written_bytes
        return blocked, time.perf_counter() - t

    def cleanup(self, step):
        self.close()
        shutil.rmtree(os.path.join(self.dir, f"fresh{step}"), ignore_errors=True)

    def close(self):
        if self.c is not None:
            self.c.close()
            self.c = None


METHODS: dict[str, Callable] = {
    "memcpy": Memcpy, "torch.save": TorchSave, "dcp.save": DCPSave, "dcp.async_save": DCPAsyncSave,
    "safetensors": Safetensors, "ckpt": Ckpt, "ckpt-in-place": CkptInPlace, "ckpt-raw": CkptRaw,
    "ckpt-fresh": CkptFresh,
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-gib", type=float, default=2.0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dir", default=None, help="scratch directory (default: a new temp dir)")
    p.add_argument("--only", default=",".join(METHODS), help="comma-separated methods")
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    p.add_argument("--quick", action="store_true", help="64 MiB, one repeat: a smoke test")
    args = p.parse_args()
    if args.quick:
        args.size_gib, args.repeats = 1 / 16, 1
    names = [n.strip() for n in args.only.split(",") if n.strip()]
    unknown = [n for n in names if n not in METHODS]
    if unknown:
        p.error(f"unknown method(s) {unknown}; choose from {list(METHODS)}")

    root = args.dir or tempfile.mkdtemp(prefix="ckpt-bench-")
    os.makedirs(root, exist_ok=True)
    torch.manual_seed(0)
    model = make_state(args.size_gib)
    nbytes = sum(t.numel() * t.element_size() for t in model.values())
    state = {"model": model}
    print(f"state: {len(model)} float32 tensors, {nbytes / 2**30:.2f} GiB; scratch {root}\n{banner()}")
    print("command: python " + " ".join(sys.argv))

    methods = [METHODS[n](root, model) if n == "memcpy" else METHODS[n](root) for n in names]
    target = {"model": {k: torch.empty_like(v) for k, v in model.items()}}
    copy_into(target["model"], model)  # fault the target pages in once
    def contender(m: Method) -> Callable[[int], Timing]:
        def run(rep: int) -> Timing:
            with torch.no_grad():
                for t in model.values():  # new values each time: nothing can be deduplicated
                    t.add_(1e-3)
            want = next(iter(model.values()))[0, :4].clone()
            os.sync()
            blocked, durable = m.save(state, rep)
            os.sync()
            evict(m.dir)  # every method loads from the disk, as a restore does
            loaded = m.load(target, rep)
            got = next(iter(target["model"].values()))[0, :4]
            if not torch.equal(got, want):
                raise SystemExit(f"{m.name}: loaded data differs from what was saved")
            m.cleanup(rep)
            out = {"blocked": blocked, "durable": durable, "load": loaded}
            if isinstance(m, Ckpt):
                out["encode_cpu"], out["written"] = m.encode_cpu, m.written
            return out
        return run

    def say(rep: int, name: str, r: Timing) -> None:
        which = "warm-up       " if rep == 0 else f"repeat {rep}/{args.repeats}  "
        print(f"  {which} {name:16s} blocked {r['blocked']:7.3f}s  durable {r['durable']:7.3f}s  "
              f"load {r['load']:7.3f}s", flush=True)

    try:  # round 0 warms every method up and is not reported; the order alternates round by round
        runs = rounds({m.name: contender(m) for m in methods}, args.repeats, warmup=1, report=say)
    finally:
        for m in methods:
            m.close()
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)

    med = {n: {k: median(r[k] for r in rs) for k in ("blocked", "durable", "load", "encode_cpu", "written")
               if k in rs[0]}
           for n, rs in runs.items()}
    first_stall = next((m.first_stall for m in methods if type(m) is Ckpt), None)
    report(med, nbytes, args, first_stall)


def report(med: dict, nbytes: int, args, first_stall: float | None) -> None:
    floor = med.get("memcpy (floor)", {}).get("blocked")
    dcp_async = med.get("dcp.async_save", {})
    dcp_load = dcp_async.get("load") or med.get("dcp.save", {}).get("load")
    st_load = med.get("safetensors", {}).get("load")
    lines = [
        f"{nbytes / 2**30:.2f} GiB of float32 tensors, {os.cpu_count()} CPUs, median of {args.repeats}; "
        "load is from the disk (every method's files dropped from the page cache first).",
        "",
        "| method | blocked (s) | durable (s) | load (s) | blocked ÷ memcpy | durable ÷ DCP async | load ÷ DCP load "
        "| load ÷ safetensors |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, r in med.items():
        lines.append(f"| {name} | {fmt(r['blocked'])} | {fmt(r['durable'])} | {fmt(r['load'])} | "
                     f"{ratio(r['blocked'], floor)} | {ratio(r['durable'], dcp_async.get('durable'))} | "
                     f"{ratio(r['load'], dcp_load)} | {ratio(r['load'], st_load)} |")
    if first_stall is not None:
        lines += ["", f"ckpt's first save blocked {first_stall:.3f}s: it allocates and faults in the host buffer "
                      "once; the table shows steady-state saves."]
    if "ckpt" in med:
        c = med["ckpt"]
        checks = []
        if floor:
            checks.append(("blocked ≤ 1.5 × memcpy", c["blocked"] <= 1.5 * floor, c["blocked"] / floor))
        if dcp_async:
            checks.append(("blocked ≤ DCP async_save blocked", c["blocked"] <= dcp_async["blocked"],
                           c["blocked"] / dcp_async["blocked"]))
            checks.append(("durable ≤ DCP async_save durable", c["durable"] <= dcp_async["durable"],
                           c["durable"] / dcp_async["durable"]))
        if dcp_load:
            checks.append(("load ≤ DCP load", c["load"] <= dcp_load, c["load"] / dcp_load))
        for name in ("ckpt", "ckpt (codec=raw)"):  # issue 23 item 1: hashes checked, staged
            r, which = med.get(name), (name.removeprefix("ckpt").strip() + " load").strip()
            if r and dcp_load:
                checks.append((f"{which} ≤ 0.3 × DCP load", r["load"] <= 0.3 * dcp_load, r["load"] / dcp_load))
            if r and st_load:
                checks.append((f"{which} ≤ safetensors load", r["load"] <= st_load, r["load"] / st_load))
        fresh = med.get("ckpt (fresh Checkpointer)")
        if fresh and dcp_async:  # issue 37 item 4
            checks.append(("(fresh Checkpointer) durable ≤ DCP async_save durable",
                           fresh["durable"] <= dcp_async["durable"], fresh["durable"] / dcp_async["durable"]))
        lines += [""] + [f"- {'MET' if ok else 'NOT MET'}: ckpt {what} (ratio {ratio:.2f})"
                         for what, ok, ratio in checks]
        lines += overlap(med)
    text = "\n".join(lines)
    print("\n" + text)
    md = (f"Command: `python benchmarks/save_load.py --size-gib {args.size_gib:g} --repeats {args.repeats}`\n\n"
          + text + "\n")
    doc = {"bytes": nbytes, "repeats": args.repeats, "cpus": os.cpu_count(), "torch": torch.__version__,
           "median_seconds": med, "ckpt_first_stall": first_stall}
    write_results(args.out, "save_load", md, doc, plot=lambda path: plot(med, path, nbytes))


def overlap(med: dict) -> list[str]:
    """Does the writer overlap coding with I/O? The default codec's durable time against the I/O alone
    (``codec="raw"``'s durable, scaled to the bytes the default codec wrote: the same writes and
    fsyncs, no coding) and the coding alone (its encode CPU seconds spread over the cores the writer's
    threads can use): overlapped, the slower of the two sets the pace; one after the other, their sum."""
    from ckpt import _cpus
    from ckpt.options import Options

    auto, raw = med.get("ckpt"), med.get("ckpt (codec=raw)")
    if not auto or not raw or not auto.get("encode_cpu") or not raw.get("written"):
        return []
    cores = min(_cpus.usable(), Options().threads)  # the default writer's threads
    coding, io = auto["encode_cpu"] / cores, raw["durable"] * auto["written"] / raw["written"]
    slower, both = max(coding, io), coding + io
    ok = auto["durable"] <= slower + 0.25 * min(coding, io)
    return ["", f"- {'MET' if ok else 'NOT MET'}: coding overlaps I/O: ckpt durable {auto['durable']:.3f} s, "
                f"{auto['durable'] / slower:.2f} × the slower of coding alone ({coding:.3f} s: "
                f"{auto['encode_cpu']:.2f} CPU s over {cores} cores) and I/O alone (codec=raw's durable for the "
                f"bytes it wrote, {io:.3f} s), {auto['durable'] / both:.2f} × their sum (the target: at most a "
                "quarter of the faster one above the slower)"]


def plot(med: dict, path: str, nbytes: int) -> None:
    plt = pyplot()
    if plt is None:
        return
    names = list(med)
    fig, ax = plt.subplots(figsize=(9, 4.5))
    width = 0.27
    for i, (key, label) in enumerate([("blocked", "blocked"), ("durable", "durable (fsync)"), ("load", "load")]):
        vals = [med[n][key] if med[n][key] == med[n][key] else 0 for n in names]
        ax.bar([x + (i - 1) * width for x in range(len(names))], vals, width, label=label)
    ax.set_xticks(range(len(names)), names, rotation=15)
    ax.set_ylabel("seconds (median)")
    ax.set_title(f"Checkpoint of {nbytes / 2**30:.1f} GiB fp32, {os.cpu_count()} CPUs")
    ax.legend()
    save_figure(fig, path)


if __name__ == "__main__":
    main()
