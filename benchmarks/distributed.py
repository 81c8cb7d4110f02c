"""Multi-rank save and resharding load: ckpt against torch.distributed.checkpoint (DCP), on real gloo ranks.

    python benchmarks/distributed.py --size-gib 1 --repeats 3
    python benchmarks/distributed.py --quick          # 64 MiB, one repeat: a smoke test (< 1 min)

The state is 8 float32 matrices (row counts divisible by neither 3 nor 4) held as DTensors with a
Shard(0) placement on a 1-D CPU DeviceMesh, `--size-gib` in all, spread over the ranks; the ranks
are processes on this machine talking gloo over 127.0.0.1. Every value's bits are a hash of (seed,
tensor, global element index) with some mantissa bits flipped per version, so any world size can
recompute what any checkpoint holds, and every load is checked bit for bit (the warm-up and the last).

Save, on 2 and 4 ranks. Methods take turns within each repeat (a slow patch of the shared disk hits
all of them alike); the data changes (untimed) before every save so nothing can be deduplicated;
`os.sync()` runs before every timed save. Reported as medians, each the maximum over ranks:

* blocked: how long a rank waited inside the save call;
* durable: from the call until every rank is done (ckpt: `h.wait()`; DCP async: the future), then a
  barrier; for `dcp.save` it equals blocked;
* memcpy (floor): each rank copying its own shard into a preallocated buffer.

Load N→M: the checkpoints written on N ranks (the last ckpt save, the last `dcp.save`) are loaded on
M ranks into zero-filled DTensors sharded over M, by `Checkpointer.load` and `dcp.load`, in place,
from the page cache. For world sizes that did not save (1, 3) as many untimed saves on that world
size as the timed ones (so the last one's chunks are deltas on as many earlier saves) give the
same-size baseline M→M. "reshard ÷ same" divides N→M by M→M (ckpt), "ckpt ÷ dcp" divides
ckpt's time by DCP's for the same pair.

The first rounds warm up and are not reported: two of saves (`--warmup`; ckpt allocates its host
buffer, DCP builds its plans, and the second round is the first to reuse disk space freed by a
deletion, which on some virtual disks is several times faster than writing fresh blocks), one of
loads. Every phase (a save world size, a load world size) runs in freshly spawned
processes with a fresh process group, as a restarted job would. Each rank runs torch with
cores ÷ world intra-op threads (at least 1), as torchrun's OMP_NUM_THREADS=1 would for a full
machine. ckpt's Checkpointer for a load is made outside the timing (a resumed job makes one anyway).
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import shutil
import sys
import tempfile
import time
import warnings

import torch
from harness import banner, fmt, median, pyplot, ratio, save_figure, write_results  # benchmarks/: shared

from ckpt.testing import run_ranks  # noqa: E402  (ranks on a gloo group, each its own process)

warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")

SAVE_METHODS = ["memcpy", "ckpt", "dcp.save", "dcp.async_save"]
SAVE_WORLDS = (2, 4)
N_TENSORS_FACTORS = (1.0, 0.75, 1.25, 1.0, 0.5, 1.5, 1.0, 1.0)  # relative sizes; they sum to 8
SEED = 1234
MASK32 = 0xFFFFFFFF
CODEC: list[str | None] = [None]  # --codec, set in every rank's process by _phase


# ---------------------------------------------------------------------------------------------
# the state: shapes, deterministic values, DTensors

def global_shapes(size_gib: float) -> dict[str, tuple[int, int]]:
    cols = 2048 if size_gib >= 0.5 else 512
    target = size_gib * 2**30
    shapes = {}
    for i, f in enumerate(N_TENSORS_FACTORS):
        rows = max(5, round(target * f / len(N_TENSORS_FACTORS) / (4 * cols)))
        while rows % 3 == 0 or rows % 4 == 0:  # uneven shards on 3 and 4 ranks (and on 2: odd)
            rows += 1
        shapes[f"layers.{i}.weight"] = (rows, cols)
    return shapes


def base_bits(tid: int, first: int, n: int, block: int = 1 << 20) -> torch.Tensor:
    """float32 bit patterns (as int32) for global flat indices first..first+n-1 of tensor tid: a
    32-bit integer hash of (seed, tensor, index) laid out as random sign, an exponent spread over
    2^-7..2^0 and a random mantissa. About as (in)compressible as trained fp32 weights, finite, and
    with no period a chunk could repeat with (nothing deduplicates). In place on two reused
    buffers: temporaries per op would spend most of the time faulting in fresh pages."""
    out = torch.empty(n, dtype=torch.int32)
    x = torch.empty(min(n, block), dtype=torch.int64)
    y = torch.empty_like(x)
    off = tid * 0x9E3779B1 + SEED * 0x85EBCA6B
    for s in range(0, n, block):
        e = min(n, s + block)
        xs, ys = x[: e - s], y[: e - s]
        torch.arange(first + s + off, first + e + off, dtype=torch.int64, out=xs)
        xs.bitwise_and_(MASK32)
        for _ in range(2):
            torch.bitwise_right_shift(xs, 16, out=ys)
            xs.bitwise_xor_(ys).mul_(0x45D9F3B).bitwise_and_(MASK32)
        torch.bitwise_right_shift(xs, 16, out=ys)
        xs.bitwise_xor_(ys)
        torch.bitwise_right_shift(xs, 23, out=ys)
        ys.bitwise_and_(7).add_(120).bitwise_left_shift_(23)  # exponent 120..127
        xs.bitwise_and_(0x807FFFFF).bitwise_or_(ys)  # sign and mantissa from the hash
        out[s:e] = xs  # int64 -> int32 keeps the low 32 bits (two's complement)
    return out


def version_mask(v: int) -> int:
    """Mantissa bits flipped in version v: every version has different bytes in every element."""
    m = (v * 0x9E3779B1 + 0x5BD1E995) & 0x7FFFFF
    return m | 0x10101  # at least one bit in each of the three low bytes


class State:
    """This rank's shards: DTensors Shard(0) over the 1-D mesh, and the version-0 values of its box."""

    def __init__(self, shapes: dict[str, tuple[int, int]], mesh, keep_base: bool = True):
        import torch.distributed.tensor as dt
        from torch.distributed.tensor import Shard
        from torch.distributed.tensor._utils import (
            compute_local_shape_and_global_offset,
        )

        self.model: dict[str, torch.Tensor] = {}
        self.local: dict[str, torch.Tensor] = {}
        self.base: dict[str, torch.Tensor] = {}
        self.version = 0
        for tid, (name, shape) in enumerate(shapes.items()):
            d = dt.zeros(*shape, dtype=torch.float32, device_mesh=mesh, placements=[Shard(0)])
            local = d.to_local()
            lshape, offsets = compute_local_shape_and_global_offset(d.shape, mesh, d.placements)
            assert tuple(local.shape) == tuple(lshape), (local.shape, lshape)
            self.model[name], self.local[name] = d, local
            if keep_base:
                first = min(offsets[0], shape[0]) * shape[1]
                self.base[name] = base_bits(tid, first, local.numel()).view(local.shape)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * 4 for t in self.local.values())

    def set_version(self, v: int) -> None:
        """Values of version v: the base bits with version_mask(v) flipped (one pass; deterministic,
        so any world size can recompute them)."""
        for k, t in self.local.items():
            torch.bitwise_xor(self.base[k], version_mask(v), out=t.view(torch.int32))
        self.version = v

    def zero(self) -> None:
        for t in self.local.values():
            t.zero_()

    def check(self, v: int, what: str) -> None:
        for k, t in self.local.items():
            want = torch.bitwise_xor(self.base[k], version_mask(v))
            got = t.view(torch.int32)
            if not torch.equal(got, want):
                bad = (got != want).nonzero()
                i = tuple(bad[0].tolist())
                raise RuntimeError(f"{what}: {k} on rank {rank_()} differs from version {v} at {len(bad)} of "
                                   f"{got.numel()} elements, first at local index {list(i)}: got "
                                   f"{t[i].item()!r}, want {want.view(torch.float32)[i].item()!r}")


def rank_() -> int:
    import torch.distributed as dist
    return dist.get_rank() if dist.is_initialized() else 0


def maxall(*xs: float) -> list[float]:
    """Element-wise maximum over ranks."""
    import torch.distributed as dist
    t = torch.tensor(xs, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def synced() -> None:
    """Every rank's dirty pages flushed (one os.sync is machine-wide), then everyone starts together."""
    import torch.distributed as dist
    dist.barrier()
    if dist.get_rank() == 0:
        os.sync()
    dist.barrier()


# ---------------------------------------------------------------------------------------------
# save methods (one rank's view; every rank calls them together)

def _dcp_dir(root: str, tag: str, v: int) -> str:
    return os.path.join(root, tag, f"v{v}")


class SaveMemcpy:
    def __init__(self, st: State, root: str):
        self.buf = {k: torch.empty_like(t) for k, t in st.local.items()}
        for k, t in st.local.items():
            self.buf[k].copy_(t)  # fault the pages in outside the timing

    def save(self, st: State):
        t0 = time.perf_counter()
        for k, t in st.local.items():
            self.buf[k].copy_(t)
        return time.perf_counter() - t0, float("nan")

    def close(self):
        self.buf = {}


class SaveCkpt:
    def __init__(self, st: State, root: str):
        import ckpt
        self.dir = os.path.join(root, "ckpt")
        self.c = ckpt.Checkpointer(self.dir, keep_last=1, **_ckpt_options(CODEC[0]))
        self.last: tuple[str, int, int] | None = None  # (dir, step, version)
        self.first_stall: float | None = None

    def save(self, st: State):
        import torch.distributed as dist
        step = st.version
        t0 = time.perf_counter()
        h = self.c.save(step, {"model": st.model})
        blocked = time.perf_counter() - t0
        h.wait()
        dist.barrier()
        durable = time.perf_counter() - t0
        self.c.wait()  # retention of the older step, outside the timing
        if self.first_stall is None:
            self.first_stall = blocked
        self.last = (self.dir, step, st.version)
        return blocked, durable

    def close(self):
        self.c.close()


class SaveDCP:
    tag = "dcp_save"

    def __init__(self, st: State, root: str):
        self.root = root
        self.last: tuple[str, int, int] | None = None

    def _call(self, st: State, path: str):
        import torch.distributed.checkpoint as dcp
        t0 = time.perf_counter()
        dcp.save({"model": st.model}, checkpoint_id=path)  # FileSystemWriter fsyncs by default
        dt = time.perf_counter() - t0
        return dt, dt

    def save(self, st: State):
        import torch.distributed as dist
        path = _dcp_dir(self.root, self.tag, st.version)
        blocked, durable = self._call(st, path)
        dist.barrier()
        if self.last is not None and dist.get_rank() == 0:
            shutil.rmtree(self.last[0], ignore_errors=True)  # untimed; keeps the newest for the load phase
        self.last = (path, 0, st.version)
        return blocked, durable

    def close(self):
        pass


class SaveDCPAsync(SaveDCP):
    tag = "dcp_async_save"

    def _call(self, st: State, path: str):
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp
        t0 = time.perf_counter()
        fut = dcp.async_save({"model": st.model}, checkpoint_id=path)  # default stager, thread executor
        blocked = time.perf_counter() - t0
        fut = getattr(fut, "upload_completion", fut)  # AsyncSaveResponse (with a custom stager) or Future
        fut.result()
        dist.barrier()
        return blocked, time.perf_counter() - t0


SAVERS = {"memcpy": SaveMemcpy, "ckpt": SaveCkpt, "dcp.save": SaveDCP, "dcp.async_save": SaveDCPAsync}


def phase_save(rank: int, world: int, shapes, root: str, methods: list[str], repeats: int, warmup: int) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    st = State(shapes, mesh)
    st.set_version(0)
    root = os.path.join(root, f"save-{world}")
    if rank == 0:
        os.makedirs(root, exist_ok=True)
    dist.barrier()
    savers = {m: SAVERS[m](st, root) for m in methods}
    times = {m: {"blocked": [], "durable": []} for m in methods}
    warm: dict[str, list] = {m: [] for m in methods}
    v = 0
    try:
        for rnd in range(warmup + repeats):  # the first `warmup` rounds are not reported
            rep = rnd - warmup + 1  # 1.. for reported rounds
            for m, s in savers.items():
                v += 1
                st.set_version(v)  # new values for every save: nothing can be deduplicated
                synced()
                blocked, durable = s.save(st)
                blocked, durable = maxall(blocked, durable)
                if rep <= 0:
                    warm[m].append((blocked, durable))
                else:
                    times[m]["blocked"].append(blocked)
                    times[m]["durable"].append(durable)
                if rank == 0:
                    label = f"warm-up {rnd + 1}/{warmup}" if rep <= 0 else f"repeat {rep}/{repeats}"
                    print(f"  save  world {world}  {label}  {m:15s} blocked {blocked:7.3f}s  "
                          f"durable {fmt(durable):>7s}s", flush=True)
    finally:
        for s in savers.values():
            s.close()
    sources = {}
    if "ckpt" in savers:
        sources["ckpt"] = savers["ckpt"].last
    for m in ("dcp.save", "dcp.async_save"):  # the load phase reads dcp.save's checkpoint, else async's
        if m in savers and "dcp" not in sources:
            sources["dcp"] = savers[m].last
    first_stall = maxall(savers["ckpt"].first_stall)[0] if "ckpt" in savers else None
    dist.barrier()
    return {"times": times, "warm": warm, "sources": sources, "shard_bytes_max": maxall(st.nbytes)[0],
            "ckpt_first_stall": first_stall}


# ---------------------------------------------------------------------------------------------
# load

def load_ckpt(st: State, src) -> float:
    import ckpt
    path, step, _ = src
    c = ckpt.Checkpointer(path)  # construction is not timed: a resumed job makes one anyway
    try:
        t0 = time.perf_counter()
        c.load(step, {"model": st.model})
        return time.perf_counter() - t0
    finally:
        c.close()


def load_dcp(st: State, src) -> float:
    import torch.distributed.checkpoint as dcp
    path, _, _ = src
    t0 = time.perf_counter()
    dcp.load({"model": st.model}, checkpoint_id=path)  # in place into the DTensors' local shards
    return time.perf_counter() - t0


LOADERS = {"ckpt": load_ckpt, "dcp": load_dcp}


def phase_load(rank: int, world: int, shapes, root: str, sources: dict, methods: list[str], repeats: int,
               saves: int) -> dict:
    """Load every source checkpoint (saved on N ranks) onto this world of M ranks."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    st = State(shapes, mesh)
    sources = {int(n): dict(s) for n, s in sources.items()}
    if world not in sources:
        # The same-size baseline M→M: untimed saves on this world size, as many as the timed ones.
        sources[world] = seed_saves(st, root, world, methods, saves)
    order = sorted(sources, key=lambda n: (n != world, n))  # same size first, then the others
    times = {n: {m: [] for m in methods} for n in order}
    warm = {}
    for rep in range(repeats + 1):
        for n in order:
            for m in methods:
                src = sources[n][m]
                st.zero()  # untimed; the pages stay faulted in
                dist.barrier()
                dt = maxall(LOADERS[m](st, src))[0]
                if rep in (0, repeats):  # bit-exact check of the warm-up and the last load
                    st.check(src[2], f"{m} load {n}→{world}")
                if rep == 0:
                    warm[(n, m)] = dt
                else:
                    times[n][m].append(dt)
                if rank == 0:
                    label = "warm-up      " if rep == 0 else f"repeat {rep}/{repeats}"
                    print(f"  load  {n}→{world}  {label}  {m:5s} {dt:7.3f}s", flush=True)
    dist.barrier()
    return {"times": times, "checked": True}


def phase_seed(rank: int, world: int, shapes, root: str, methods: list[str], saves: int) -> dict:
    """Untimed saves on a world size whose saves are not timed (3, for the 3→2 load): the
    checkpoints that loads onto other world sizes read."""
    from torch.distributed.device_mesh import init_device_mesh

    st = State(shapes, init_device_mesh("cpu", (world,)))
    return {"sources": seed_saves(st, root, world, methods, saves)}


def seed_saves(st: State, root: str, world: int, methods: list[str], saves: int) -> dict:
    """The checkpoints a world size that was not timed is loaded from, with the timed saves' history:
    ckpt saves ``saves`` versions in a row with the same options (so the last one's chunks are deltas
    on as many earlier saves as the timed checkpoints' are), DCP the last version once."""
    import torch.distributed as dist

    base = os.path.join(root, f"save-{world}")
    sources = {}
    first = 10_000 + 100 * world
    if "ckpt" in methods:
        import ckpt
        c = ckpt.Checkpointer(os.path.join(base, "ckpt"), keep_last=1, **_ckpt_options(CODEC[0]))
        for v in range(first, first + saves):
            st.set_version(v)
            c.save(v, {"model": st.model}).wait()
        c.close()
        sources["ckpt"] = (os.path.join(base, "ckpt"), st.version, st.version)
    st.set_version(first + saves - 1)
    if "dcp" in methods:
        import torch.distributed.checkpoint as dcp
        path = _dcp_dir(base, "dcp_save", st.version)
        dcp.save({"model": st.model}, checkpoint_id=path)
        sources["dcp"] = (path, 0, st.version)
    dist.barrier()
    return sources


def _ckpt_options(codec: str | None) -> dict:
    return {"codec": codec} if codec else {}


PHASES = {"save": phase_save, "load": phase_load, "seed": phase_seed}


# ---------------------------------------------------------------------------------------------
# a pool of worker processes; each phase makes a fresh gloo group of the first M workers

def _phase(rank: int, world: int, phase: str, kwargs: dict, codec: str | None = None):
    warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
    warnings.filterwarnings("ignore", category=FutureWarning)
    import torch.distributed.checkpoint  # noqa: F401  (imported before any timing)
    import torch.distributed.tensor  # noqa: F401

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    CODEC[0] = codec
    return PHASES[phase](rank, world, **kwargs)


def run_phase(phase: str, world: int, timeout: float = 900.0, codec: str | None = None, **kwargs) -> dict:
    """Run a phase on a fresh gloo group of `world` new processes; rank 0's result (phases reduce
    over ranks themselves). Fresh processes per world size: nothing carries over between groups."""
    t0 = time.perf_counter()
    got = run_ranks(world, _phase, phase, kwargs, codec, timeout=timeout, pg_timeout=300.0)[0]
    print(f"  ({phase} on {world} ranks: {time.perf_counter() - t0:.1f}s with process start-up)", flush=True)
    return got


# ---------------------------------------------------------------------------------------------

def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-gib", type=float, default=1.0, help="global state size (all ranks together)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--warmup", type=int, default=2, help="save rounds before the reported ones (loads: 1)")
    p.add_argument("--dir", default=None, help="scratch directory (default: a new temp dir, removed after)")
    p.add_argument("--only", default=",".join(SAVE_METHODS),
                   help=f"comma-separated save methods from {SAVE_METHODS}; loads compare ckpt and DCP when saved")
    p.add_argument("--loads", default="2:2,2:4,4:2,4:4,2:3,4:3,3:2,4:1,2:1",
                   help="N:M pairs: load a checkpoint saved on N ranks onto M ranks (saves on N other than 2 and "
                   "4 are made once, untimed)")
    p.add_argument("--codec", default=None, help="ckpt's codec option for every ckpt save (default: ckpt's default)")
    p.add_argument("--out", default=None, help="where the .md/.json/.png go (default: benchmarks/results; with "
                   "--quick: a temp dir, so a smoke run never overwrites the recorded results)")
    p.add_argument("--name", default="distributed", help="results file name (without extension)")
    p.add_argument("--quick", action="store_true", help="64 MiB, one repeat: a smoke test")
    args = p.parse_args()
    print(banner(), flush=True)
    if args.quick:
        args.size_gib, args.repeats, args.warmup = 1 / 16, 1, 1
    if args.out is None:
        args.out = (os.path.join(tempfile.gettempdir(), "ckpt-bench-results") if args.quick
                    else os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    methods = [m.strip() for m in args.only.split(",") if m.strip()]
    unknown = [m for m in methods if m not in SAVE_METHODS]
    if unknown:
        p.error(f"unknown method(s) {unknown}; choose from {SAVE_METHODS}")
    load_methods = [m for m in ("ckpt", "dcp") if m == "ckpt" and "ckpt" in methods
                    or m == "dcp" and ({"dcp.save", "dcp.async_save"} & set(methods))]
    pairs = []
    for pair in args.loads.split(","):
        if pair.strip():
            n, m = (int(x) for x in pair.split(":"))
            if n < 1 or m < 1:
                p.error(f"--loads: {pair}: N and M must be at least 1")
            pairs.append((n, m))

    shapes = global_shapes(args.size_gib)
    nbytes = sum(r * c * 4 for r, c in shapes.values())
    root = args.dir or tempfile.mkdtemp(prefix="ckpt-dist-bench-")
    os.makedirs(root, exist_ok=True)
    cmd = " ".join(["python benchmarks/distributed.py", *sys.argv[1:]])
    cols = next(iter(shapes.values()))[1]
    print(f"state: {len(shapes)} float32 DTensors Shard(0), rows {[r for r, _ in shapes.values()]} x {cols}, "
          f"{nbytes / 2**30:.3f} GiB; {os.cpu_count()} CPUs; torch {torch.__version__}; python "
          f"{platform.python_version()}; scratch {root}")
    print(f"command: {cmd}", flush=True)

    t_start = time.perf_counter()
    load_before = os.getloadavg()[0]
    targets = sorted({m for _, m in pairs}, key=lambda m: (m not in SAVE_WORLDS, m))
    saves, loads = {}, {}
    try:
        for n in SAVE_WORLDS:
            saves[n] = run_phase("save", n, codec=args.codec, shapes=shapes, root=root, methods=methods,
                                 repeats=args.repeats, warmup=args.warmup)
        seeded = {}
        if load_methods:
            for n in sorted({n for n, _ in pairs if n not in SAVE_WORLDS}):
                seeded[n] = run_phase("seed", n, codec=args.codec, shapes=shapes, root=root, methods=load_methods,
                                      saves=args.warmup + args.repeats)
            for m in targets:
                srcs = {n: (saves[n] if n in saves else seeded[n])["sources"] for n, mm in pairs if mm == m}
                if m in seeded:  # the same-size baseline M→M reads the seeded save
                    srcs.setdefault(m, seeded[m]["sources"])
                loads[m] = run_phase("load", m, codec=args.codec, shapes=shapes, root=root, sources=srcs,
                                     methods=load_methods, repeats=args.repeats, saves=args.warmup + args.repeats)
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    elapsed = time.perf_counter() - t_start
    loadavg = (load_before, os.getloadavg()[0])
    report(args, cmd, shapes, nbytes, saves, loads, pairs, load_methods, elapsed, loadavg)


def report(args, cmd, shapes, nbytes, saves, loads, pairs, load_methods, elapsed, loadavg) -> None:
    save_med = {n: {m: {k: median(v) for k, v in r.items()} for m, r in s["times"].items()} for n, s in saves.items()}
    load_med: dict[tuple[int, int], dict[str, float]] = {}
    for m, res in loads.items():
        for n, per in res["times"].items():
            load_med[(int(n), m)] = {meth: median(v) for meth, v in per.items()}

    lines = [
        f"Command: `{cmd}`",
        "",
        (f"Machine: {os.cpu_count()} CPUs ({platform.machine()}, {platform.system()}), torch {torch.__version__}, "
        f"gloo over 127.0.0.1, every rank a process on this machine. State: {nbytes / 2**30:.3f} GiB of float32 in "
        f"{len(shapes)} DTensors sharded Shard(0) over the ranks (rows "
        f"{', '.join(str(r) for r, _ in shapes.values())}; "
        f"{next(iter(shapes.values()))[1]} columns). Median of {args.repeats} after {args.warmup} warm-up "
        f"round(s) of saves and one of loads, each the "
        f"maximum over ranks; loads are from the page cache and every load was checked bit for bit. "
        f"Wall time of the whole run: {elapsed:.0f}s; 1-minute load average {loadavg[0]:.1f} before and "
        f"{loadavg[1]:.1f} after (other work on the machine shows up here: compare ratios within one run)."),
        "",
        "### Save",
        "",
        "| method | world | blocked (s) | durable (s) | blocked ÷ memcpy | durable ÷ DCP async |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for n in sorted(save_med):
        floor = save_med[n].get("memcpy", {}).get("blocked")
        dasync = save_med[n].get("dcp.async_save", {}).get("durable")
        for meth, r in save_med[n].items():
            name = "memcpy (floor)" if meth == "memcpy" else meth
            lines.append(f"| {name} | {n} | {fmt(r['blocked'])} | {fmt(r['durable'])} | "
                         f"{ratio(r['blocked'], floor)} | {ratio(r['durable'], dasync)} |")
    stalls = {n: s["ckpt_first_stall"] for n, s in saves.items() if s.get("ckpt_first_stall") is not None}
    if stalls:
        lines += ["", "ckpt's first save blocked "
                  + ", ".join(f"{v:.3f}s on {n} ranks" for n, v in sorted(stalls.items()))
                  + " (it allocates and faults in the host buffer and agrees a plan once); the table shows "
                  "steady-state saves."]
    if load_med:
        lines += ["", "### Load N→M", "",
                  "| N→M | ckpt (s) | dcp (s) | ckpt reshard ÷ ckpt same-size (M→M) | ckpt ÷ dcp |",
                  "|---|---:|---:|---:|---:|"]
        shown = sorted(load_med, key=lambda k: (k[1], k[0] != k[1], k[0]))
        for (n, m) in shown:
            r = load_med[(n, m)]
            same = load_med.get((m, m), {}).get("ckpt")
            c, d = r.get("ckpt"), r.get("dcp")
            lines.append(f"| {n}→{m}{' (same size)' if n == m else ''} | {fmt(c)} | {fmt(d)} | "
                         f"{'1.00' if n == m and c is not None else ratio(c, same)} | {ratio(c, d)} |")
        extra = sorted({m for (_, m) in load_med if m not in SAVE_WORLDS})
        if extra:
            lines += ["", "The same-size rows for " + ", ".join(f"{m}→{m}" for m in extra) +
                      " load a checkpoint saved (untimed) on that many ranks as many times as the timed saves "
                      "(the same delta chains), as the baseline for the reshard ratio."]
    text = "\n".join(lines)
    print("\n" + text)
    doc = {
        "command": cmd, "bytes": nbytes, "shapes": shapes, "repeats": args.repeats, "cpus": os.cpu_count(),
        "torch": torch.__version__, "elapsed_s": elapsed, "loadavg_before_after": loadavg,
        "save": {str(n): {"median_seconds": save_med[n], "seconds": s["times"], "warmup": s["warm"],
                          "shard_bytes_max": s["shard_bytes_max"], "ckpt_first_stall": s["ckpt_first_stall"]}
                 for n, s in saves.items()},
        "load": {f"{n}->{m}": {"median_seconds": r, "seconds": loads[m]["times"][n]}
                 for (n, m), r in load_med.items()},
    }
    write_results(args.out, args.name, text + "\n", doc, json_default=str,
                  plot=lambda path: plot(save_med, load_med, path, nbytes))

def plot(save_med: dict, load_med: dict, path: str, nbytes: int) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.8), gridspec_kw={"width_ratios": [1, 1.4]})
    labels, blocked, durable = [], [], []
    for n in sorted(save_med):
        for meth, r in save_med[n].items():
            labels.append(f"{'memcpy' if meth == 'memcpy' else meth}\n{n} ranks")
            blocked.append(r["blocked"])
            durable.append(0 if math.isnan(r["durable"]) else r["durable"])
    x = range(len(labels))
    ax1.bar([i - 0.2 for i in x], blocked, 0.4, label="blocked")
    ax1.bar([i + 0.2 for i in x], durable, 0.4, label="durable (fsync)")
    ax1.set_xticks(list(x), labels, rotation=45, ha="right", fontsize=8)
    ax1.set_ylabel("seconds (median, max over ranks)")
    ax1.set_title("save")
    ax1.legend()
    keys = sorted(load_med, key=lambda k: (k[1], k[0] != k[1], k[0]))
    meths = sorted({m for r in load_med.values() for m in r}, key=lambda m: m != "ckpt")
    w = 0.8 / max(1, len(meths))
    for j, meth in enumerate(meths):
        ax2.bar([i + (j - (len(meths) - 1) / 2) * w for i in range(len(keys))],
                [load_med[k].get(meth, 0) for k in keys], w, label=meth)
    ax2.set_xticks(range(len(keys)), [f"{n}→{m}" for n, m in keys])
    ax2.set_xlabel("saved on N ranks → loaded on M ranks")
    ax2.set_title("load (resharding), page cache")
    ax2.legend()
    fig.suptitle(f"{nbytes / 2**30:.2f} GiB fp32 DTensors, gloo ranks on {os.cpu_count()} CPUs")
    save_figure(fig, path)


if __name__ == "__main__":
    main()
