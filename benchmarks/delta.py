"""Delta codecs on real trainings: bytes stored per save, encode speed, time to durable, load with chains.

    python benchmarks/delta.py                 # four trainings, 8 saves each, 10 steps apart
    python benchmarks/delta.py --quick         # a smoke test

Four trainings run on the CPU, in one run, each saved every ``--every`` steps to three Checkpointers
on the same disk: ``codec="smallest"`` (per chunk the smallest encoding, deltas included),
``codec="auto"`` (the default; now the same choice as ``smallest``: it depends on the bytes alone)
and ``codec="raw"``:

* **gpt-fp32**: a byte-level GPT (4 layers, d = 256, 3.3 M parameters) trained with AdamW on the
  Python standard library's own sources (found locally), weights and optimizer state in float32;
* **gpt-bf16**: the same model with bfloat16 weights and optimizer state;
* **embedding**: an ``nn.Embedding(50000, 128)`` table trained with sparse SGD (a logistic model on
  random labels), 1% of its rows per step;
* **frozen-90%**: a fine-tune (lr 3e-5) of the trained gpt-fp32 with 90% of its parameters frozen
  (model and AdamW state), and **frozen-90% weights**: the same fine-tune's model alone.

For every save after the first, on the same tensors in the same run: the bytes ckpt stored with
``smallest`` (what the save wrote: new chunks, headers included) against the raw bytes, zstd level 1
alone, byte grouping + zstd alone (ckpt's ``planes`` codec on every 4 MiB piece) and ZipNN (in the ``bench`` extra; per
tensor, one thread, zstd level 3 as it comes); the encode speed per thread: raw bytes per CPU second,
ckpt's from its saves (``metrics.encoded_bytes`` / ``metrics.encode_cpu_s``: the chunks each save
encoded, trials included), ZipNN's from the process's CPU time around its compress (ZipNN 0.5.4
compresses on a worker thread even with ``threads=1``, so the caller's wall time or thread time
would not count what it costs); the time from ``save()`` to
committed against ``codec="raw"``; and the load of the last step (its chains resolved, every link
verified) against the load of the same state stored raw. Then the same save timing on ``/dev/shm``,
a "disk" faster than compression, where encoding is what a save waits for (the price of choosing
codecs by content alone: reported, not hidden).
"""

from __future__ import annotations

import os

# oneDNN's bf16 matmul (the gpt-bf16 training) dies of SIGILL on machines that report AMX/AVX512-BF16
# without enabling it: keep it on AVX2, set before torch loads oneDNN (this process only; ckpt itself
# never sets it).
os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX2")

import argparse  # noqa: E402
import glob  # noqa: E402
import math  # noqa: E402
import platform  # noqa: E402
import shutil  # noqa: E402
import sys  # noqa: E402
import sysconfig  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
import zstandard  # noqa: E402

warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
HERE = os.path.dirname(os.path.abspath(__file__))

from harness import banner, median, pyplot, save_figure, write_results  # noqa: E402  (benchmarks/: shared)

import ckpt  # noqa: E402
from ckpt.format.chunk import Base  # noqa: E402
from ckpt.save.buffer_layout import element_width  # noqa: E402
from ckpt.save.encode import CodecSpec, encode  # noqa: E402

PIECE = 4 << 20
TARGETS = {"gpt-fp32": "≤ ZipNN (goal 0.95×)", "gpt-bf16": "≤ ZipNN (goal 0.95×)", "embedding": "≤ 5% of raw",
           "frozen-90%": "≤ 12% of its first save", "frozen-90% weights": "≤ 12% of its first save"}
CODECS = ("smallest", "auto", "raw")


# -- data and models -----------------------------------------------------------------------------------

def corpus(limit: int) -> torch.Tensor:
    """Bytes of the Python standard library's .py files (there on every machine that runs this)."""
    out, n = [], 0
    for path in sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "**", "*.py"), recursive=True)):
        try:
            data = open(path, "rb").read()
        except OSError:
            continue
        out.append(data)
        n += len(data)
        if n >= limit:
            break
    return torch.frombuffer(bytearray(b"".join(out)[:limit]), dtype=torch.uint8).long()


class GPT(torch.nn.Module):
    def __init__(self, d: int = 256, layers: int = 4, ctx: int = 128):
        super().__init__()
        self.tok = torch.nn.Embedding(256, d)
        self.pos = torch.nn.Embedding(ctx, d)
        layer = torch.nn.TransformerEncoderLayer(d, 4, 4 * d, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = torch.nn.LayerNorm(d)
        self.head = torch.nn.Linear(d, 256)
        self.register_buffer("mask", torch.nn.Transformer.generate_square_subsequent_mask(ctx), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.tok(x) + self.pos(torch.arange(x.shape[1]))
        h = self.blocks(h, mask=self.mask[: x.shape[1], : x.shape[1]].to(h.dtype), is_causal=True)
        return self.head(self.norm(h))


def gpt_steps(model: GPT, opt: torch.optim.Optimizer, data: torch.Tensor, total: int, lr: float,
              g: torch.Generator, batch: int = 16, ctx: int = 128):
    """A generator: one training step per next(); cosine lr from ``lr`` to lr/10."""
    for i in range(total):
        for group in opt.param_groups:
            group["lr"] = lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * i / max(total, 1))))
        idx = torch.randint(0, data.numel() - ctx - 1, (batch,), generator=g)
        x = torch.stack([data[j:j + ctx] for j in idx])
        y = torch.stack([data[j + 1:j + ctx + 1] for j in idx])
        loss = torch.nn.functional.cross_entropy(model(x).float().reshape(-1, 256), y.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        yield float(loss.detach())


def workloads(args, data: torch.Tensor):
    """(name, state, an iterator of steps) for each training, built when its turn comes."""
    total = args.every * (args.saves - 1)
    g = torch.Generator().manual_seed(0)
    dims = {"d": 64, "layers": 2} if args.quick else {}  # --quick, a smoke test: a GPT a tenth the size

    torch.manual_seed(0)
    model = GPT(**dims)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    yield "gpt-fp32", {"model": model, "optim": opt}, gpt_steps(model, opt, data, total + args.warmup, 1e-3, g), \
        args.warmup
    pretrained = {k: v.clone() for k, v in model.state_dict().items()}

    torch.manual_seed(0)
    m16 = GPT(**dims).to(torch.bfloat16)
    o16 = torch.optim.AdamW(m16.parameters(), lr=1e-3, weight_decay=0.1)
    yield "gpt-bf16", {"model": m16, "optim": o16}, gpt_steps(m16, o16, data, total + args.warmup, 1e-3, g), \
        args.warmup

    emb = torch.nn.Embedding(50000, 128, sparse=True)
    sgd = torch.optim.SGD(emb.parameters(), lr=0.05)
    probe = torch.randn(128, generator=g)

    def sparse_steps():
        for _ in range(total):
            rows = torch.randint(0, 50000, (500,), generator=g)
            labels = torch.randint(0, 2, (500,), generator=g).float()
            torch.nn.functional.binary_cross_entropy_with_logits(emb(rows) @ probe, labels).backward()
            sgd.step()
            sgd.zero_grad(set_to_none=True)
            yield 0.0
    yield "embedding", {"embedding": emb, "optim": sgd}, sparse_steps(), 0

    ft = GPT(**dims)
    ft.load_state_dict(pretrained)
    params = sorted(ft.named_parameters(), key=lambda kv: -kv[1].numel())
    frozen, budget = 0, 0.9 * sum(p.numel() for _, p in params)
    for _, p in params:  # freeze the largest tensors until 90% of the parameters are frozen
        if frozen + p.numel() <= budget + 1:
            p.requires_grad_(False)
            frozen += p.numel()
    ft_opt = torch.optim.AdamW([p for p in ft.parameters() if p.requires_grad], lr=3e-5)
    # one step first: AdamW makes its state at its first step, and the first save should hold it
    yield "frozen-90%", {"model": ft, "optim": ft_opt}, gpt_steps(ft, ft_opt, data, total + 1, 3e-5, g), 1
    yield "frozen-90% weights", {"model": ft}, gpt_steps(ft, ft_opt, data, total, 3e-5, g), 0


# -- comparators on the same tensors ---------------------------------------------------------------------

def tensors_of(state: dict) -> dict[str, torch.Tensor]:
    flat = {}
    for top, obj in state.items():
        sd = obj.state_dict()
        if isinstance(obj, torch.optim.Optimizer):
            for i, st in sd["state"].items():
                flat.update({f"{top}/{i}/{k}": v for k, v in st.items() if isinstance(v, torch.Tensor)})
        else:
            flat.update({f"{top}/{k}": v for k, v in sd.items()})
    return {k: v.detach().contiguous().clone() for k, v in flat.items() if v.numel()}


def as_bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.view(-1).view(torch.uint8).numpy()).cast("B")


def pieces(t: torch.Tensor):
    b = as_bytes(t)
    for i in range(0, len(b), PIECE):
        yield b[i:i + PIECE]


def zstd_bytes(tensors: dict) -> int:
    cctx = zstandard.ZstdCompressor(level=1)
    return sum(min(len(cctx.compress(p)), len(p)) for t in tensors.values() for p in pieces(t))


def grouped_bytes(tensors: dict) -> int:
    spec = CodecSpec("grouped")
    return sum(sum(len(b) for b in encode(p, "0" * 32, spec, width=element_width(t.dtype))[1][1:])
               for t in tensors.values() for p in pieces(t))


def order0_bound(tensors: dict) -> int:
    """Bytes no coder of one save's floats without context can go below: per tensor and byte plane, the
    order-0 entropy of the plane's bytes (rotated or not, whichever is lower; other dtypes as they are).
    ZipNN and ckpt's whole chunks both code planes this way; only a delta (the previous save as
    context) goes further."""
    total = 0.0
    for t in tensors.values():
        w = t.element_size()
        if not t.is_floating_point() or w not in (2, 4):
            total += t.numel() * w
            continue
        u = t.reshape(-1).view(torch.int16 if w == 2 else torch.int32).numpy().view(np.uint16 if w == 2 else np.uint32)
        best = math.inf
        for rotated in (False, True):
            x = (u << 1) | (u >> (8 * w - 1)) if rotated else u
            bits = 0.0
            for i in range(w):
                counts = np.bincount(((x >> (8 * i)) & 0xFF).astype(np.intp), minlength=256)
                p = counts[counts > 0] / x.size
                bits += min(float(-(p * np.log2(p)).sum()), 8.0) * x.size
            best = min(best, bits / 8)
        total += best
    return int(total)


def ckpt_encode(tensors: dict, prev: dict | None) -> int:
    """Bytes of ckpt's auto choice per 4 MiB piece of each tensor (the previous save's piece as base, no
    read budget): what the codec itself gets, beside what the saves stored."""
    spec = CodecSpec("auto")
    size = 0
    for k, t in tensors.items():
        old = list(pieces(prev[k])) if prev is not None and k in prev and prev[k].shape == t.shape else None
        for i, p in enumerate(pieces(t)):
            base = Base(old[i], "1" * 32) if old is not None else None
            _, bufs = encode(p, "0" * 32, spec, width=element_width(t.dtype), base=base)
            size += sum(len(memoryview(b).cast("B")) for b in bufs[1:])
    return size


_said_no_zipnn: list[bool] = []  # the note is printed once


def zipnn_encode(tensors: dict) -> tuple[int | None, float | None, float | None]:
    """ZipNN's bytes, CPU seconds and wall seconds for ``tensors``."""
    try:
        from zipnn import ZipNN
    except ImportError:
        if not _said_no_zipnn:
            _said_no_zipnn.append(True)
            print("(zipnn is not installed: the table has no ZipNN columns; pip install -e \".[bench]\")", flush=True)
        return None, None, None
    size, seconds, wall = 0, 0.0, 0.0
    for t in tensors.values():
        if t.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            size += t.numel() * t.element_size()
            continue
        z = ZipNN(input_format="torch", threads=1, bytearray_dtype=str(t.dtype).removeprefix("torch."))
        work = t.clone()  # ZipNN 0.5.4 reorders the bytes of the tensor it is given, in place
        t0, w0 = time.process_time(), time.perf_counter()  # process: all threads (ZipNN's worker compresses)
        size += len(z.compress(work))
        seconds += time.process_time() - t0
        wall += time.perf_counter() - w0
    return size, seconds, wall


# -- one training --------------------------------------------------------------------------------------

def run_workload(name: str, state: dict, steps, warmup: int, args, root: str, s3=None) -> dict:
    for _ in range(warmup):
        next(steps)
    dirs = {c: os.path.join(root, f"{name.replace(' ', '-')}-{c}") for c in CODECS}
    budget = {} if args.delta_budget is None else {"delta_budget": args.delta_budget}
    ckptrs = {c: ckpt.Checkpointer(d, codec=c, delta_chain=args.delta_chain, **budget) for c, d in dirs.items()}
    saves, prev = [], None
    try:
        for s in range(args.saves):
            if s:
                for _ in range(args.every):
                    next(steps)
            row: dict = {"save": s}
            for c, ck in ckptrs.items():  # one after the other: each save has the disk to itself
                m = ck.save(s, state).wait()
                row[f"{c}_stored"], row[f"{c}_durable_s"] = m.written_bytes, m.duration_s
                row[f"{c}_encoded"], row[f"{c}_encode_cpu_s"] = m.encoded_bytes, m.encode_cpu_s
            tensors = tensors_of(state)
            row["raw"] = sum(t.numel() * t.element_size() for t in tensors.values())
            if s or args.first:
                row["zstd"], row["grouped"] = zstd_bytes(tensors), grouped_bytes(tensors)
                row["ckpt_codec"] = ckpt_encode(tensors, prev)
                row["bound"] = order0_bound(tensors)
                row["zipnn"], row["zipnn_s"], row["zipnn_wall_s"] = zipnn_encode(tensors)
            saves.append(row)
            prev = tensors
            print(f"  {name} save {s}: raw {row['raw'] / 2**20:.1f} MiB, stored {row['smallest_stored'] / 2**20:.2f} "
                  f"MiB (auto {row['auto_stored'] / 2**20:.2f}), durable auto {row['auto_durable_s']:.2f}s, "
                  f"raw codec {row['raw_durable_s']:.2f}s", flush=True)
        loads: dict[str, list[float]] = {f"{c}_{how}": [] for c in ("smallest", "raw") for how in ("cold", "warm")}
        for _ in range(args.load_repeats):
            for c in ("smallest", "raw"):  # the codecs take turns
                for how in ("cold", "warm"):
                    if how == "cold":
                        evict(dirs[c])
                    t0 = time.perf_counter()
                    ckptrs[c].load(args.saves - 1, state)
                    loads[f"{c}_{how}"].append(time.perf_counter() - t0)
        if s3 is not None:  # the same objects served over S3 (rclone serve s3 on 127.0.0.1)
            _, so = s3
            for c in ("smallest", "raw"):
                prefix = f"{name.replace(' ', '-').replace('%', '')}-{c}"
                s3_upload(so, dirs[c], f"{S3_BUCKET}/{prefix}")
                loads[f"{c}_s3"] = []
                with ckpt.Checkpointer(f"s3://{S3_BUCKET}/{prefix}", storage_options=so) as remote:
                    for _ in range(args.load_repeats):
                        t0 = time.perf_counter()
                        remote.load(args.saves - 1, state)
                        loads[f"{c}_s3"].append(time.perf_counter() - t0)
    finally:
        for ck in ckptrs.values():
            ck.close()
    return {"name": name, "saves": saves, **{f"load_{k}_s": median(v) for k, v in loads.items()}}


S3_BUCKET = "ckpt-delta"


def s3_upload(so: dict, local: str, dest: str) -> None:
    """Every file of a local checkpoint to ``dest`` (bucket/prefix), through the server."""
    import s3fs
    fs = s3fs.S3FileSystem(key=so["key"], secret=so["secret"], client_kwargs=so["client_kwargs"])
    for d, _, files in os.walk(local):
        for f in files:
            path = os.path.join(d, f)
            fs.put_file(path, f"{dest}/{os.path.relpath(path, local)}")


def s3_server(root: str):
    """``rclone serve s3`` on 127.0.0.1 (installed by the project's setup), or None without it."""
    try:
        from ckpt.testing import RcloneS3, storage_options
        srv = RcloneS3(os.path.join(root, "s3")).start()
    except Exception as e:  # noqa: BLE001 - the S3 column is optional
        print(f"(no S3 server: {e}; the S3 load column is left out)")
        return None
    srv.make_bucket(S3_BUCKET)
    return srv, storage_options(srv.endpoint)


def evict(root: str) -> None:
    """Drop a checkpoint's files from the page cache (they are fsynced, so clean): a cold read."""
    for d, _, files in os.walk(root):
        for f in files:
            fd = os.open(os.path.join(d, f), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def summarize(w: dict) -> dict:
    later = [r for r in w["saves"] if r["save"] > 0]
    tot = lambda k: sum(r[k] for r in later)  # noqa: E731
    first = w["saves"][0]["smallest_stored"]
    out = {"name": w["name"], "raw_mib": later[0]["raw"] / 2**20, "stored_raw": tot("smallest_stored") / tot("raw"),
           "auto_raw": tot("auto_stored") / tot("raw"),
           "vs_zstd": tot("smallest_stored") / tot("zstd"), "vs_grouped": tot("smallest_stored") / tot("grouped"),
           "vs_first": tot("smallest_stored") / len(later) / first,
           "durable_ratio": median(r["auto_durable_s"] for r in later) /
           median(r["raw_durable_s"] for r in later),
           "load_cold_ratio": w["load_smallest_cold_s"] / w["load_raw_cold_s"],
           "load_warm_ratio": w["load_smallest_warm_s"] / w["load_raw_warm_s"],
           "load_s3_ratio": (w["load_smallest_s3_s"] / w["load_raw_s3_s"]) if "load_raw_s3_s" in w else None,
           "ckpt_gibs": tot("smallest_encoded") / max(tot("smallest_encode_cpu_s"), 1e-9) / 2**30}
    if all(r.get("zipnn") for r in later):
        out["vs_zipnn"] = tot("smallest_stored") / tot("zipnn")
        out["codec_vs_zipnn"] = tot("ckpt_codec") / tot("zipnn")
        out["bound_vs_zipnn"] = tot("bound") / tot("zipnn")
        out["zipnn_gibs"] = tot("raw") / tot("zipnn_s") / 2**30
        out["zipnn_wall_gibs"] = tot("raw") / tot("zipnn_wall_s") / 2**30
    return out


def fast_disk(args, data: torch.Tensor) -> dict | None:
    """auto against raw where the "disk" is memory (/dev/shm): what encoding costs a save where
    nothing else is slow. A 4-layer MLP (``--fast-width``; 2048: 192 MiB with Adam) trained with
    Adam, so saves take long enough to be judged."""
    if not os.path.isdir("/dev/shm"):
        return None
    root = tempfile.mkdtemp(prefix="ckpt-bench-delta-", dir="/dev/shm")
    try:
        torch.manual_seed(1)
        w = args.fast_width
        model = torch.nn.Sequential(*[torch.nn.Linear(w, w) for _ in range(4)])
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        g = torch.Generator().manual_seed(1)

        def mlp_steps():
            while True:
                model(torch.randn(64, w, generator=g)).square().mean().backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                yield 0.0
        steps = mlp_steps()
        next(steps)
        times: dict[str, list[float]] = {"auto": [], "raw": []}
        codecs: dict[str, int] = {}
        cks = {c: ckpt.Checkpointer(os.path.join(root, c), codec=c) for c in times}
        try:
            for s in range(max(args.saves, 8)):
                for _ in range(2):
                    next(steps)
                for c, ck in cks.items():
                    times[c].append(ck.save(s, {"model": model, "optim": opt}).wait().duration_s)
            m = cks["auto"].manifest(max(args.saves, 8) - 1)
            for info in m.chunks.values():
                codecs[info.codec] = codecs.get(info.codec, 0) + 1
        finally:
            for ck in cks.values():
                ck.close()
        return {"auto_s": median(times["auto"][3:]), "raw_s": median(times["raw"][3:]),
                "codecs_last_save": codecs,
                "state_mib": sum(t.numel() * t.element_size() for t in tensors_of({"m": model, "o": opt}).values())
                / 2**20}
    finally:
        shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--saves", type=int, default=8)
    ap.add_argument("--every", type=int, default=10, help="training steps between saves")
    ap.add_argument("--warmup", type=int, default=100, help="GPT steps before the first save (past the first drop)")
    ap.add_argument("--delta-chain", type=int, default=8)
    ap.add_argument("--delta-budget", type=float, default=None, help="default: the Checkpointer's")
    ap.add_argument("--load-repeats", type=int, default=3)
    ap.add_argument("--first", action="store_true", help="also compare codecs on the first save")
    ap.add_argument("--fast-width", type=int, default=2048, help="the /dev/shm run's MLP width")
    ap.add_argument("--no-s3", action="store_true", help="leave out the loads over S3 (rclone serve s3)")
    ap.add_argument("--quick", action="store_true",
                    help="a smoke test: 3 saves, 2 steps apart, 2 warm-up steps, a smaller GPT (d 64, 2 layers)")
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    args = ap.parse_args()
    print(banner(), flush=True)
    if args.quick:
        args.saves, args.every, args.warmup, args.load_repeats, args.fast_width = 3, 2, 2, 1, 512
    # every core, unless OMP_NUM_THREADS says otherwise (the smoke test's: on a busy machine threads spin)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS") or 0) or max(1, (os.cpu_count() or 2)))
    data = corpus(8 << 20)
    root = tempfile.mkdtemp(prefix="ckpt-bench-delta-")
    doc: dict = {"command": "python benchmarks/delta.py " + " ".join(sys.argv[1:]), "cpus": os.cpu_count(),
                 "machine": platform.machine(), "corpus_mib": data.numel() / 2**20, "saves": args.saves,
                 "every": args.every, "delta_chain": args.delta_chain, "workloads": []}
    s3root = tempfile.mkdtemp(prefix="ckpt-bench-delta-s3-")
    s3 = None if args.no_s3 else s3_server(s3root)
    try:
        for name, state, steps, warmup in workloads(args, data):
            doc["workloads"].append(run_workload(name, state, steps, warmup, args, root, s3))
            shutil.rmtree(root, ignore_errors=True)
            os.makedirs(root, exist_ok=True)
        doc["fast_disk"] = fast_disk(args, data)
    finally:
        if s3 is not None:
            s3[0].stop()
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(s3root, ignore_errors=True)
    doc["summary"] = [summarize(w) for w in doc["workloads"]]
    text = table(doc)
    print(text)
    write_results(args.out, "delta", text + "\n", doc, indent=1, plot=lambda path: plot(doc, path))


def table(doc: dict) -> str:
    f2 = lambda v: "–" if v is None else f"{v:.2f}"  # noqa: E731
    lines = [f"Command: `{doc['command']}` ({doc['cpus']} CPUs, {doc['machine']}; saves {doc['every']} steps apart, "
             f"{doc['saves']} per training, delta_chain={doc['delta_chain']}). Bytes are summed over the saves after "
             "the first; ratios below 1 mean ckpt stored less.", "",
             "| training | state (MiB) | ckpt ÷ raw | ÷ zstd-1 | ÷ grouped | ÷ ZipNN | ÷ its first save | target | "
             "auto ÷ raw | encode GiB/s (ckpt / ZipNN) | durable, auto ÷ raw codec | load ÷ raw codec, S3 / cold / "
             "warm |", "|---|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|"]
    for s in doc["summary"]:
        zipnn = f"{s['ckpt_gibs']:.2f} / {s['zipnn_gibs']:.2f}" if "zipnn_gibs" in s else f"{s['ckpt_gibs']:.2f} / –"
        lines.append(f"| {s['name']} | {s['raw_mib']:.1f} | {s['stored_raw']:.3f} | {s['vs_zstd']:.2f} | "
                     f"{s['vs_grouped']:.2f} | {f2(s.get('vs_zipnn'))} | {s['vs_first']:.3f} | {TARGETS[s['name']]} | "
                     f"{s['auto_raw']:.3f} | "
                     f"{zipnn} | {s['durable_ratio']:.2f} | {f2(s['load_s3_ratio'])} / {s['load_cold_ratio']:.2f} / "
                     f"{s['load_warm_ratio']:.2f} |")
    bounds = [s for s in doc["summary"] if "bound_vs_zipnn" in s]
    if bounds:
        lines += ["", "| training | ckpt's saves ÷ ZipNN | ckpt's codec, deltas without a read budget ÷ ZipNN | "
                      "order-0 bound without the previous save ÷ ZipNN |", "|---|---:|---:|---:|"]
        lines += [f"| {s['name']} | {s['vs_zipnn']:.3f} | {s['codec_vs_zipnn']:.3f} | {s['bound_vs_zipnn']:.3f} |"
                  for s in bounds]
    fd = doc.get("fast_disk")
    lines += ["", "ckpt ÷ X: bytes ckpt stored (`codec=\"smallest\"`: deltas against the previous save, byte planes, "
                  "dedup of unchanged chunks) ÷ the bytes X needs for the same tensors. auto ÷ raw: the same for the "
                  "default `codec=\"auto\"` (the same choice, by content alone). "
                  "encode: raw bytes per CPU second (ckpt: the chunks its saves encoded, trials included, "
                  "`metrics.encode_cpu_s`; ZipNN: its compress, the process's CPU time; its wall-clock speed is in "
                  "the JSON, `zipnn_wall_gibs`). "
                  "durable: median time from "
                  "`save()` to committed, auto ÷ raw codec, on this machine's disk. load: the last save, chains "
                  "resolved and every link verified, ÷ the same state stored raw; S3: the same objects served by "
                  "`rclone serve s3` on 127.0.0.1; cold: its files dropped from the page cache first (read from "
                  "the disk), warm: read from memory. The bound: per tensor and byte plane (rotated or not), "
                  "the order-0 entropy of its bytes, what any coder of one save's planes without context gets at "
                  "best; below it only a delta (the previous save as context), whose chain a load must read."]
    if fd:
        lines += ["", "On /dev/shm (memory: faster than any compression; a 4-layer MLP with Adam, "
                      f"{fd['state_mib']:.0f} MiB), auto's median save from the fourth on took {fd['auto_s']:.3f} s "
                      f"against {fd['raw_s']:.3f} s raw ({fd['auto_s'] / fd['raw_s']:.2f}×); codecs of the last "
                      f"save: {fd['codecs_last_save']}."]
    return "\n".join(lines)


def plot(doc: dict, path: str) -> None:
    plt = pyplot()
    if plt is None:
        return
    names = [w["name"] for w in doc["workloads"]]
    fig, axes = plt.subplots(1, 2, figsize=(12, 3.8))
    ax = axes[0]
    series = [("zstd", "zstd-1"), ("grouped", "grouped"), ("zipnn", "ZipNN"), ("smallest_stored", "ckpt")]
    width = 0.2
    for i, (k, label) in enumerate(series):
        vals = []
        for w in doc["workloads"]:
            later = [r for r in w["saves"] if r["save"] > 0]
            vals.append(100 * sum(r.get(k) or 0 for r in later) / sum(r["raw"] for r in later))
        ax.bar([j + (i - 1.5) * width for j in range(len(names))], vals, width, label=label)
    ax.set_xticks(range(len(names)), names)
    ax.set_ylabel("% of raw bytes stored per save")
    ax.set_yscale("log")
    ax.legend(fontsize=8)
    ax = axes[1]
    for w in doc["workloads"]:
        ax.plot([r["save"] for r in w["saves"]], [100 * r["smallest_stored"] / r["raw"] for r in w["saves"]],
                marker="o", label=w["name"])
    ax.set_xlabel("save")
    ax.set_ylabel("% of raw stored (ckpt)")
    ax.set_yscale("log")
    ax.legend(fontsize=8)
    save_figure(fig, path, dpi=120)


if __name__ == "__main__":
    main()
