"""DCP's own storage against ckpt's under the same ``dcp.save`` / ``dcp.async_save`` / ``dcp.load`` calls.

    python benchmarks/dcp_backend.py                    # the committed results
    python benchmarks/dcp_backend.py --quick            # a smoke test (< 1 min), results to a temp dir

One process, no process group (DCP plans for one rank). Four parts, each on the same tensors in the
same run; where timed, the contenders take turns within each round (order reversed every other
round), the data changes in place between rounds (untimed, so dedup cannot skip work), ``os.sync()``
runs before every timed save, and every round starts from empty directories (removed untimed):

* **local save**: ``dcp.save`` with DCP's ``FileSystemWriter`` (its defaults: one file per rank,
  fsync) against ``ckpt.dcp.Writer`` (default codec, chunks written durably); time to durable,
  which for ``dcp.save`` is the time the call takes;
* **async save**: ``dcp.async_save`` with the stager 2.13 makes when none is given
  (``DefaultStager(StagingOptions(False, False, False, False))``, a new one per call) and
  ``FileSystemWriter``, against one reused ``ckpt.dcp.Stager()`` with ``FileSystemWriter`` (the
  stager alone) and with ``ckpt.dcp.Writer``: blocked (the call) and durable (until the future's
  result); after each save (sync or async) a hot load, ``dcp.load`` with ``FileSystemReader`` or
  ``ckpt.dcp.Reader`` (every chunk verified) into preallocated tensors, checked equal;
* **bytes over ten saves**: the byte-level GPT of benchmarks/delta.py trained with AdamW (fp32, and
  bf16 weights and optimizer state), ``dcp.save`` of ``{"model", "optim"}`` state dicts every
  ``--every`` steps: DCP's directories summed against ckpt's root (dedup + codecs; the Writer keeps
  no buffer between saves, so no deltas), and, for reference, ``Checkpointer.save`` of the same
  state into its own root (deltas included);
* **S3**: to ``rclone serve s3`` on 127.0.0.1, DCP's ``FsspecWriter`` (8 threads, as in
  benchmarks/s3.py) against ``ckpt.dcp.Writer("s3://…")``, time until ``dcp.save`` returns.

Writes benchmarks/results/dcp_backend.{md,json,png} (``--quick``: a temp dir unless ``--out``).
"""

from __future__ import annotations

import os

# oneDNN's bf16 matmul (the gpt-bf16 training) dies of SIGILL on machines that report AMX/AVX512-BF16
# without enabling it: keep it on AVX2, set before torch loads oneDNN (this process only).
os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX2")

import argparse  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import uuid  # noqa: E402
import warnings  # noqa: E402
from collections.abc import Callable  # noqa: E402

import torch  # noqa: E402

warnings.filterwarnings("ignore")

import torch.distributed.checkpoint as dcp  # noqa: E402
from delta import GPT, corpus, gpt_steps  # noqa: E402  (benchmarks/: the trainings of delta.py)
from harness import (  # noqa: E402  (benchmarks/: the shared harness)
    banner,
    command,
    fmt,
    median,
    pyplot,
    ratio,
    rounds,
    save_figure,
    write_results,
)
from save_load import make_state  # noqa: E402
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter  # noqa: E402
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions  # noqa: E402

import ckpt  # noqa: E402
import ckpt.dcp  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
BUCKET = "ckpt-bench"
SYNC = ("dcp.save, FileSystemWriter", "dcp.save, ckpt.dcp.Writer")
ASYNC = ("dcp.async_save, DefaultStager + FileSystemWriter", "dcp.async_save, ckpt.dcp.Stager + FileSystemWriter",
         "dcp.async_save, ckpt.dcp.Stager + ckpt.dcp.Writer")
S3_DCP, S3_CKPT = "DCP FsspecWriter (8 threads)", "ckpt.dcp.Writer → S3"


def dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def nbytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def paired(runs: dict[str, list], name: str, ref: str, key: str | None = None) -> float:
    """The median over rounds of name's result ÷ ref's in the same round: both ran back to back, so a
    busy patch of the shared machine moves both, which a ratio of two medians would not cancel."""
    def pick(x):
        return x if key is None else x[key]
    return median(pick(a) / pick(b) if pick(b) else None for a, b in zip(runs[name], runs[ref]))


def fresh(path: str) -> str:
    shutil.rmtree(path, ignore_errors=True)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    return path


# -- local saves, sync and async ------------------------------------------------------------------------------

def local_part(args, root: str) -> dict:
    model = make_state(args.size_gib)
    state = {"model": model}
    target = {"model": {k: torch.zeros_like(v) for k, v in model.items()}}
    size = nbytes(model)
    print(f"local: {len(model)} float32 tensors, {size / 2**30:.2f} GiB under {root}", flush=True)
    # One Stager per writer: a Stager that once fed a ckpt.dcp.Writer waits (wait_s, 60 s) at its next stage for
    # that Writer's "copied out" mark, which FileSystemWriter never sets (see the reading).
    stagers = {ASYNC[1]: ckpt.dcp.Stager(), ASYNC[2]: ckpt.dcp.Stager()}

    def where(name: str) -> str:
        return os.path.join(root, name.replace(" ", "").replace(",", "-").replace("+", "-"))

    def dcp_writer(name: str, r: int):
        return FileSystemWriter(fresh(os.path.join(where(name), f"step{r}")))

    def dcp_reader(name: str, r: int):
        return FileSystemReader(os.path.join(where(name), f"step{r}"))

    def ckpt_writer(name: str, r: int):
        return ckpt.dcp.Writer(fresh(where(name)), step=r)

    def ckpt_reader(name: str, r: int):
        return ckpt.dcp.Reader(where(name), step=r)

    def contender(name: str, writer, reader, stager_of: Callable[[], object] | None) -> Callable[[int], dict]:
        def run(r: int) -> dict:
            w = writer(name, r)
            os.sync()
            t0 = time.perf_counter()
            if stager_of is None:
                dcp.save(state, storage_writer=w)
                blocked = time.perf_counter() - t0
            else:
                fut = dcp.async_save(state, storage_writer=w, async_stager=stager_of())
                blocked = time.perf_counter() - t0
                fut.result()
            durable = time.perf_counter() - t0
            for t in target["model"].values():  # untimed: a load must fill every byte
                t.zero_()
            t0 = time.perf_counter()
            dcp.load(target, storage_reader=reader(name, r))
            load = time.perf_counter() - t0
            if not all(torch.equal(target["model"][k], v) for k, v in model.items()):
                raise SystemExit(f"{name}: dcp.load gave back other values than were saved")
            shutil.rmtree(where(name), ignore_errors=True)  # untimed: the next round starts empty
            return {"blocked": blocked, "durable": durable, "load": load}
        return run

    def default_stager():  # what dcp.async_save 2.13 builds when no async_stager is given
        return DefaultStager(StagingOptions(False, False, False, False))

    contenders = {
        SYNC[0]: contender(SYNC[0], dcp_writer, dcp_reader, None),
        SYNC[1]: contender(SYNC[1], ckpt_writer, ckpt_reader, None),
        ASYNC[0]: contender(ASYNC[0], dcp_writer, dcp_reader, default_stager),
        ASYNC[1]: contender(ASYNC[1], dcp_writer, dcp_reader, lambda: stagers[ASYNC[1]]),
        ASYNC[2]: contender(ASYNC[2], ckpt_writer, ckpt_reader, lambda: stagers[ASYNC[2]]),
    }

    def before(r: int) -> None:
        with torch.no_grad():
            for t in model.values():
                t.add_(1e-3)

    def say(r: int, name: str, x: dict) -> None:
        which = "warm-up " if r <= 0 else f"round {r}"
        print(f"  {which} {name:52s} blocked {x['blocked']:7.3f}s  durable {x['durable']:7.3f}s  "
              f"load {x['load']:7.3f}s", flush=True)

    runs = rounds(contenders, args.repeats, warmup=1, before=before, report=say)
    for st in stagers.values():
        st.close()
    keys = ("blocked", "durable", "load")
    med = {n: {k: median(x[k] for x in rs) for k in keys} for n, rs in runs.items()}
    rel = {n: {k: paired(runs, n, group[0], k) for k in keys} for group in (SYNC, ASYNC) for n in group}
    return {"bytes": size, "tensors": len(model), "runs": runs, "median": med, "paired_ratio": rel}


# -- bytes over ten saves of a training ------------------------------------------------------------------------

def trainings(args, data: torch.Tensor):
    total = args.warmup + args.every * (args.saves - 1)
    g = torch.Generator().manual_seed(0)
    for name, dtype in (("gpt-fp32", torch.float32), ("gpt-bf16", torch.bfloat16)):
        torch.manual_seed(0)
        model = GPT().to(dtype)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
        yield name, model, opt, gpt_steps(model, opt, data, total, 1e-3, g, batch=args.batch)


def bytes_part(args, root: str) -> list[dict]:
    data = corpus(8 << 20)
    out = []
    for name, model, opt, steps in trainings(args, data):
        for _ in range(args.warmup):
            next(steps)
        dcp_root, ckpt_root, ref_root = (fresh(os.path.join(root, f"{name}-{w}")) for w in ("dcp", "ckpt", "ckpt-ref"))
        ref = ckpt.Checkpointer(ref_root)
        raw, t_dcp, t_ckpt = 0, [], []
        try:
            for s in range(args.saves):
                if s:
                    for _ in range(args.every):
                        next(steps)
                state = {"model": model.state_dict(), "optim": opt.state_dict()}
                raw += sum(t.numel() * t.element_size() for t in _tensors(state))
                t0 = time.perf_counter()
                dcp.save(state, storage_writer=FileSystemWriter(os.path.join(dcp_root, f"step{s}")))
                t_dcp.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                dcp.save(state, storage_writer=ckpt.dcp.Writer(ckpt_root, step=s))
                t_ckpt.append(time.perf_counter() - t0)
                ref.save(s, {"model": model, "optim": opt}).wait()
        finally:
            ref.close()
        row = {"training": name, "saves": args.saves, "every": args.every, "raw": raw, "dcp": dir_bytes(dcp_root),
               "ckpt": dir_bytes(ckpt_root), "checkpointer": dir_bytes(ref_root),
               "dcp_save_s": median(t_dcp), "ckpt_save_s": median(t_ckpt)}
        print(f"bytes: {name}: raw {raw / 2**20:.1f} MiB, DCP {row['dcp'] / 2**20:.1f} MiB, ckpt.dcp.Writer "
              f"{row['ckpt'] / 2**20:.1f} MiB, Checkpointer {row['checkpointer'] / 2**20:.1f} MiB", flush=True)
        out.append(row)
        for p in (dcp_root, ckpt_root, ref_root):
            shutil.rmtree(p, ignore_errors=True)
    return out


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)


# -- S3 ---------------------------------------------------------------------------------------------------------

def s3_part(args, tmp: str) -> dict:
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter  # not public in 2.13

    from ckpt.testing import RcloneS3, storage_options

    srv = RcloneS3(os.path.join(tmp, "server")).start()
    try:
        srv.make_bucket(BUCKET)
        so = storage_options(srv.endpoint)
        model = make_state(args.s3_size_gib, seed=1)
        state = {"model": model}
        size = nbytes(model)
        run = uuid.uuid4().hex[:8]
        print(f"S3: {size / 2**30:.2f} GiB to rclone serve s3 at {srv.endpoint}", flush=True)

        def fsspec(r: int) -> float:
            w = FsspecWriter(f"s3://{BUCKET}/{run}/dcp/{r}", thread_count=8, sync_files=False, **so)
            t0 = time.perf_counter()
            dcp.save(state, storage_writer=w)
            return time.perf_counter() - t0

        def ours(r: int) -> float:
            w = ckpt.dcp.Writer(f"s3://{BUCKET}/{run}/ckpt", step=r, storage_options=so)
            t0 = time.perf_counter()
            dcp.save(state, storage_writer=w)
            return time.perf_counter() - t0

        def before(r: int) -> None:
            with torch.no_grad():
                for t in model.values():
                    t.add_(1.0)

        def say(r: int, name: str, x: float) -> None:
            print(f"  {'warm-up ' if r <= 0 else f'round {r}'} {name:30s} {x:7.3f}s  {size / 2**30 / x:6.3f} GiB/s",
                  flush=True)

        runs = rounds({S3_DCP: fsspec, S3_CKPT: ours}, args.repeats, warmup=1, before=before, report=say)
    finally:
        srv.stop()
    return {"bytes": size, "runs": runs, "median": {n: median(v) for n, v in runs.items()},
            "paired_throughput_ratio": {n: paired(runs, S3_DCP, n) for n in runs}}


# -- the report -------------------------------------------------------------------------------------------------

def targets(local: dict, trained: list[dict], s3: dict) -> list[dict]:
    rel = local["paired_ratio"]
    out = [
        {"what": "async_save blocked ≤ DCP's (ckpt.dcp.Stager + Writer ÷ DefaultStager + FileSystemWriter)",
         "value": rel[ASYNC[2]]["blocked"], "target": 1.0},
        {"what": "async_save durable ≤ 0.8 × DCP's", "value": rel[ASYNC[2]]["durable"], "target": 0.8},
        {"what": "dcp.save durable ≤ 0.8 × DCP's (ckpt.dcp.Writer ÷ FileSystemWriter)",
         "value": rel[SYNC[1]]["durable"], "target": 0.8},
    ]
    for row in trained:
        out.append({"what": f"bytes over {row['saves']} saves ≤ 0.6 × DCP's, {row['training']}",
                    "value": row["ckpt"] / row["dcp"], "target": 0.6})
    out.append({"what": "S3 throughput ≥ 1.5 × DCP's FsspecWriter", "value": s3["paired_throughput_ratio"][S3_CKPT],
                "target": 1.5, "higher": True})
    for t in out:
        t["met"] = t["value"] >= t["target"] if t.get("higher") else t["value"] <= t["target"]
    return out


def markdown(args, local: dict, trained: list[dict], s3: dict, goals: list[dict]) -> str:
    med = local["median"]
    gib = local["bytes"] / 2**30
    lines = [f"Local disk: {gib:.2f} GiB of float32 tensors ({local['tensors']}), one process, {os.cpu_count()} CPUs, "
             f"median of {args.repeats} rounds; load is `dcp.load` from the page cache (ckpt verifies every chunk). "
             "Ratios are against the DCP row of the same call, each the median of the rounds' own ratios "
             "(both ran back to back in that round).", "",
             "| method | blocked (s) | durable (s) | load (s) | blocked ÷ DCP | durable ÷ DCP | load ÷ DCP |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for group in (SYNC, ASYNC):
        for n in group:
            r, q = med[n], local["paired_ratio"][n]
            lines.append(f"| {n} | {fmt(r['blocked'])} | {fmt(r['durable'])} | {fmt(r['load'])} | "
                         f"{fmt(q['blocked'], 2)} | {fmt(q['durable'], 2)} | {fmt(q['load'], 2)} |")
    saves = trained[0]["saves"] if trained else args.saves
    lines += ["", f"Bytes stored over {saves} `dcp.save`s of a training's model and AdamW state, "
                  f"{args.every} steps apart (delta.py's byte-level GPT, 3.3 M parameters, "
                  f"batch {args.batch}; after {args.warmup} steps):", "",
              "| training | raw, all saves (MiB) | DCP FileSystemWriter (MiB) | ckpt.dcp.Writer (MiB) | ckpt ÷ DCP | "
              "Checkpointer.save, deltas (MiB) | Checkpointer ÷ DCP |",
              "|---|---:|---:|---:|---:|---:|---:|"]
    for row in trained:
        lines.append(f"| {row['training']} | {row['raw'] / 2**20:.1f} | {row['dcp'] / 2**20:.1f} | "
                     f"{row['ckpt'] / 2**20:.1f} | {ratio(row['ckpt'], row['dcp'])} | "
                     f"{row['checkpointer'] / 2**20:.1f} | {ratio(row['checkpointer'], row['dcp'])} |")
    sg = s3["bytes"] / 2**30
    sm = s3["median"]
    lines += ["", f"To `rclone serve s3` on 127.0.0.1: {sg:.2f} GiB of float32 tensors, time until `dcp.save` "
                  f"returns, median of {args.repeats} rounds (the ratio: median of the rounds' own ratios):", "",
              "| writer | time (s) | GiB/s | throughput ÷ DCP fsspec |", "|---|---:|---:|---:|"]
    for n, t in sm.items():
        lines.append(f"| {n} | {fmt(t, 2)} | {fmt(sg / t, 3)} | {fmt(s3['paired_throughput_ratio'][n], 2)} |")
    lines.append("")
    for g in goals:
        lines.append(f"- {'MET' if g['met'] else 'NOT MET'}: {g['what']} (ratio {g['value']:.2f})")
    return "\n".join(lines)


def plot(local: dict, trained: list[dict], s3: dict, path: str) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.8), gridspec_kw={"width_ratios": [2.2, 1.2, 1]})
    med = local["median"]
    names = list(SYNC) + list(ASYNC)
    short = ["save\nFSWriter", "save\nckpt Writer", "async\nDefault+FSW", "async\nckpt Stager+FSW",
             "async\nckpt Stager+Writer"]
    ax = axes[0]
    w = 0.27
    for i, key in enumerate(("blocked", "durable", "load")):
        ax.bar([x + (i - 1) * w for x in range(len(names))], [med[n][key] for n in names], w, label=key)
    ax.set_xticks(range(len(names)), short, fontsize=8)
    ax.set_ylabel("seconds (median)")
    ax.set_title(f"local disk, {local['bytes'] / 2**30:.2f} GiB")
    ax.legend()
    ax = axes[1]
    labels = [r["training"] for r in trained]
    for i, (key, label) in enumerate((("dcp", "DCP"), ("ckpt", "ckpt.dcp.Writer"), ("checkpointer", "Checkpointer"))):
        ax.bar([x + (i - 1) * w for x in range(len(labels))], [r[key] / 2**20 for r in trained], w, label=label)
    ax.set_xticks(range(len(labels)), labels)
    ax.set_ylabel("MiB stored over all saves")
    ax.set_title(f"{trained[0]['saves'] if trained else 0} saves of a training")
    ax.legend(fontsize=8)
    ax = axes[2]
    sg = s3["bytes"] / 2**30
    ax.bar(["DCP fsspec", "ckpt.dcp.Writer"], [sg / s3["median"][S3_DCP], sg / s3["median"][S3_CKPT]],
           color=["#888", "#2a7"])
    ax.set_ylabel("GiB/s")
    ax.set_title("to a local S3 server")
    save_figure(fig, path)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-gib", type=float, default=0.5, help="the local save/load state")
    p.add_argument("--s3-size-gib", type=float, default=0.25, help="the state sent to S3")
    p.add_argument("--repeats", type=int, default=7, help="timed rounds (after one warm-up round)")
    p.add_argument("--saves", type=int, default=10, help="saves of each training")
    p.add_argument("--every", type=int, default=2, help="training steps between saves")
    p.add_argument("--warmup", type=int, default=10, help="training steps before the first save")
    p.add_argument("--batch", type=int, default=4, help="sequences per training step (delta.py: 16)")
    p.add_argument("--dir", default=None, help="scratch directory (default: a new temp dir)")
    p.add_argument("--out", default=None, help="where results go (default benchmarks/results; --quick: a temp dir)")
    p.add_argument("--quick", action="store_true", help="a smoke test: 32 MiB, one round, 3 saves")
    args = p.parse_args()
    if args.quick:
        args.size_gib, args.s3_size_gib, args.repeats, args.saves, args.every, args.warmup = 1 / 32, 1 / 32, 1, 3, 1, 1
        args.batch = 2
    if args.out is None:
        args.out = tempfile.mkdtemp(prefix="ckpt-dcp-bench-out-") if args.quick else os.path.join(HERE, "results")
    # every core, unless OMP_NUM_THREADS says otherwise (the smoke test's: on a busy machine threads spin)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS") or 0) or max(1, os.cpu_count() or 2))
    cmd = command("dcp_backend")
    print(banner(), flush=True)
    print(f"command: {cmd}", flush=True)
    root = args.dir or tempfile.mkdtemp(prefix="ckpt-dcp-bench-")
    os.makedirs(root, exist_ok=True)
    t_start = time.perf_counter()
    parts: dict[str, float] = {}
    try:
        t0 = time.perf_counter()
        local = local_part(args, os.path.join(root, "local"))
        parts["local"], t0 = time.perf_counter() - t0, time.perf_counter()
        trained = bytes_part(args, os.path.join(root, "bytes"))
        parts["bytes"], t0 = time.perf_counter() - t0, time.perf_counter()
        s3 = s3_part(args, os.path.join(root, "s3"))
        parts["s3"] = time.perf_counter() - t0
        print("parts: " + ", ".join(f"{k} {v:.0f}s" for k, v in parts.items()), flush=True)
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    goals = targets(local, trained, s3)
    text = markdown(args, local, trained, s3, goals)
    print("\n" + text)
    md = f"Command: `{cmd.strip()}`\n\n{text}\n"
    doc = {"command": cmd.strip(), "args": vars(args), "banner": banner(),
           "seconds": time.perf_counter() - t_start, "part_seconds": parts,
           "local": local, "bytes_over_saves": trained, "s3": s3, "targets": goals}
    paths = write_results(args.out, "dcp_backend", md, doc, plot=lambda path: plot(local, trained, s3, path))
    print(f"wrote {', '.join(paths.values())} in {doc['seconds']:.0f}s")


if __name__ == "__main__":
    main()
