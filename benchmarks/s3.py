"""Saving to and restoring from a local S3-compatible server: ckpt against plain s3fs and DCP.

    python benchmarks/s3.py --size-gib 0.5 --repeats 3

Starts ``rclone serve s3`` (default; ``--server moto`` for moto's server) on 127.0.0.1 over a
temporary directory, then, on the same tensors, taking turns within each repeat:

* ``s3fs put, one object per tensor``: the plain upload, every tensor's bytes as one object, all
  sent at once by s3fs's concurrent ``pipe``;
* ``ckpt → S3``: ``Checkpointer("s3://…")``, time until the step is committed (straight from the
  host buffer);
* ``ckpt → local_dir → S3``: ``Checkpointer("s3://…", local_dir=…)``: time until durable locally,
  and until committed on S3;
* ``DCP FsspecWriter``: ``torch.distributed.checkpoint.save`` with its fsspec writer (8 threads);
* restores into preallocated tensors: ckpt from the local tier, ckpt from S3, DCP FsspecReader, all
  cold: the server's files and the local tier's are dropped from the page cache first (untimed), as
  after a restart (the local tier writes around the page cache, the server through it).

The data changes in place between repeats (untimed), so dedup cannot skip uploads. Prints a
table, writes benchmarks/results/s3.{json,md,png}.
"""

from __future__ import annotations

import argparse
import logging
import os
import platform
import shutil
import tempfile
import time
import uuid
import warnings

import torch

warnings.filterwarnings("ignore")
logging.getLogger("werkzeug").setLevel(logging.ERROR)

from harness import banner, median, pyplot, save_figure, write_results  # noqa: E402  (benchmarks/: shared)

import ckpt  # noqa: E402
from ckpt.testing import MotoS3, RcloneS3, storage_options  # noqa: E402

BUCKET = "ckpt-bench"


def make_state(size_gib: float, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    d = 1024
    target, total, out, i = int(size_gib * 2**30), 0, {}, 0
    while total < target:
        rows = min(4 * d, max(1, (target - total) // (4 * d)))
        out[f"layers.{i}.weight"] = torch.randn(rows, d, generator=g)
        out[f"layers.{i}.bias"] = torch.randn(d, generator=g)
        total += rows * d * 4 + d * 4
        i += 1
    return out


def evict(*roots: str) -> None:
    """Drop every file under ``roots`` from the page cache (fsynced first, so its pages are clean)."""
    for root in roots:
        for d, _, files in os.walk(root):
            for f in files:
                fd = os.open(os.path.join(d, f), os.O_RDONLY)
                try:
                    os.fsync(fd)
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)


def nbytes(state) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size-gib", type=float, default=0.5)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--server", choices=["rclone", "moto"], default="rclone")
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = p.parse_args()
    print(banner(), flush=True)
    load_before = os.getloadavg()[0]

    tmp = tempfile.mkdtemp(prefix="ckpt-s3-bench-")
    srv = (RcloneS3(os.path.join(tmp, "server")) if args.server == "rclone" else MotoS3()).start()
    srv.make_bucket(BUCKET)
    so = storage_options(srv.endpoint)
    state = make_state(args.size_gib)
    target = {k: torch.empty_like(v) for k, v in state.items()}
    size = nbytes(state)
    import s3fs
    from torch.distributed.checkpoint import load as dcp_load
    from torch.distributed.checkpoint import save as dcp_save
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

    fs = s3fs.S3FileSystem(key=so["key"], secret=so["secret"], client_kwargs=so["client_kwargs"],
                           skip_instance_cache=True)
    times: dict[str, list[float]] = {}

    def record(name: str, t: float) -> None:
        times.setdefault(name, []).append(t)

    run = uuid.uuid4().hex[:8]
    direct = ckpt.Checkpointer(f"s3://{BUCKET}/{run}/ckpt", storage_options=so)
    local_dir = os.path.join(tmp, "nvme")
    tiered = ckpt.Checkpointer(f"s3://{BUCKET}/{run}/ckpt-tiered", local_dir=local_dir, storage_options=so)
    first = True
    for rep in range(args.repeats + 1):  # round 0 warms every method up and is not reported
        with torch.no_grad():
            for t in state.values():
                t.add_(1.0)
        step = rep + 1

        t0 = time.perf_counter()
        fs.pipe({f"{BUCKET}/{run}/plain/{step}/{k}": t.numpy().tobytes() for k, t in state.items()})
        t_plain = time.perf_counter() - t0

        t0 = time.perf_counter()
        direct.save(step, state).wait()
        t_direct = time.perf_counter() - t0

        t0 = time.perf_counter()
        h = tiered.save(step, state)
        h.wait("local")
        t_local = time.perf_counter() - t0
        h.wait()
        t_tiered = time.perf_counter() - t0

        t0 = time.perf_counter()
        dcp_save(state, storage_writer=FsspecWriter(f"s3://{BUCKET}/{run}/dcp/{step}", thread_count=8,
                                                    sync_files=False, **so))
        t_dcp = time.perf_counter() - t0

        # restores, cold
        evict(os.path.join(tmp, "server"), local_dir)
        t0 = time.perf_counter()
        tiered.load(step, target)
        t_rl = time.perf_counter() - t0
        assert tiered.last_load.remote_chunks == 0
        t0 = time.perf_counter()
        direct.load(step, target)
        t_rr = time.perf_counter() - t0
        assert all(torch.equal(target[k], state[k]) for k in state)
        t0 = time.perf_counter()
        dcp_load(target, storage_reader=FsspecReader(f"s3://{BUCKET}/{run}/dcp/{step}", **so))
        t_dl = time.perf_counter() - t0
        if first:
            first = False
            continue
        record("s3fs put, one object per tensor", t_plain)
        record("ckpt → S3", t_direct)
        record("ckpt → local_dir (durable locally)", t_local)
        record("ckpt → local_dir → S3", t_tiered)
        record("DCP FsspecWriter (8 threads)", t_dcp)
        record("restore: ckpt from local_dir", t_rl)
        record("restore: ckpt from S3", t_rr)
        record("restore: DCP FsspecReader", t_dl)
        print(f"repeat {rep}: " + ", ".join(f"{n.split(' ')[0]}={v[-1]:.2f}s" for n, v in times.items()), flush=True)
    direct.close()
    tiered.close()
    srv.stop()
    shutil.rmtree(tmp, ignore_errors=True)

    load_after = os.getloadavg()[0]
    med = {n: median(v) for n, v in times.items()}
    gib = size / 2**30
    plain = med["s3fs put, one object per tensor"]
    dcp = med["DCP FsspecWriter (8 threads)"]
    lines = [f"{gib:.2f} GiB of float32 tensors ({len(state)} tensors), {args.server} serve s3 on 127.0.0.1, "
             f"{os.cpu_count()} CPUs, median of {args.repeats}; restores read cold files (dropped from the page "
             f"cache first); 1-minute load average {load_before:.1f} before and "
             f"{load_after:.1f} after (other work on the machine shows up here: compare ratios within one run).", "",
             "| method | time (s) | GiB/s | throughput ÷ plain s3fs | throughput ÷ DCP |", "|---|---:|---:|---:|---:|"]
    for n, t in med.items():
        lines.append(f"| {n} | {t:.2f} | {gib / t:.2f} | {plain / t:.2f} | {dcp / t:.2f} |")
    r_direct, r_tiered = plain / med["ckpt → S3"], plain / med["ckpt → local_dir → S3"]
    lines += ["", f"- {'MET' if r_direct >= 0.9 else 'NOT MET'}: ckpt → S3 upload throughput ≥ 0.9 × plain s3fs "
                  f"(ratio {r_direct:.2f})",
              f"- {'MET' if r_tiered >= 1.0 else 'NOT MET'}: ckpt → local_dir → S3, save to committed, ≥ 1.0 × "
              f"plain s3fs's throughput (ratio {r_tiered:.2f})",
              f"- {'MET' if med['ckpt → S3'] < dcp else 'NOT MET'}: ckpt → S3 ahead of DCP's fsspec writer "
              f"({dcp / med['ckpt → S3']:.2f} × its throughput)",
              f"- restore from local_dir is {med['restore: ckpt from S3'] / med['restore: ckpt from local_dir']:.2f} × "
              "as fast as from S3"]
    table = "\n".join(lines)
    print(table)
    md = (f"`python benchmarks/s3.py --size-gib {args.size_gib} --repeats {args.repeats} "
          f"--server {args.server}`\n\n" + table + "\n")
    doc = {"args": vars(args), "bytes": size, "times": times, "median": med,
           "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__}}

    def plot(path: str) -> None:
        plt = pyplot()
        if plt is None:
            return
        fig, ax = plt.subplots(figsize=(9, 4.5))
        names = list(med)
        ax.barh(names, [gib / med[n] for n in names],
                color=["#888" if "s3fs" in n or "DCP" in n else "#2a7" for n in names])
        ax.invert_yaxis()
        ax.set_xlabel("GiB/s (higher is better)")
        ax.set_title(f"{gib:.2f} GiB to/from a local S3 server ({args.server}), median of {args.repeats}")
        save_figure(fig, path)

    write_results(args.out, "s3", md, doc, indent=1, plot=plot)

if __name__ == "__main__":
    main()
