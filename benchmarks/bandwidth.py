"""Saves and loads at a node's bandwidth: storage held to 400 MB/s and 1 GB/s per rank, and unthrottled.

    python benchmarks/bandwidth.py --size-gib 0.5 --repeats 3

On a trained AdamW state (weights and both moments; fp32, and bf16 for everything), in one process
(one rank), the same run measures, taking turns within each repeat:

* ``ckpt auto`` and ``ckpt raw``: a steady ``Checkpointer`` (its first save, untimed, allocates the host
  buffer), time from ``save()`` until the step is committed; ``load`` into the state through a second
  ``Checkpointer`` on the same path, as a restarted job or an evaluator reads it. The saving one is not
  asked to load: a load through it would stage in its idle host buffer, which holds the previous save
  as the next one's delta base, and the timed saves would then never store a delta, which a training
  loop saving every N steps does (with ``auto``, about every other save of these states);
* ``DCP async_save``: ``torch.distributed.checkpoint.async_save`` with its fsspec writer, time until its
  future is done; ``DCP load`` with the fsspec reader;
* ``safetensors``: ``safetensors.torch.save`` of the tensors, written as one object; read back with
  ``safetensors.torch.load``.

Between repeats the state takes one more training step (untimed), as it would between two saves.

How the bandwidth is limited, the same for every method:

* ``local``: a local directory behind an fsspec filesystem (``throttled://``) whose files draw every byte
  written from one token bucket and every byte read from another, each at the rate (shared by all the
  threads of the process, as one rank's share of a node's disks); unthrottled, the same filesystem
  without buckets. Its files are written around the page cache (``O_DIRECT``, for every method), so the
  bucket, not this VM's page-cache copies, limits the writes; reads come from the disk. Every method goes
  through fsspec here (ckpt's fsspec storage, DCP's ``FsspecWriter``/``FsspecReader``, safetensors bytes
  through ``fs.pipe_file``/``cat_file``).
* ``s3``: the local S3 server (``rclone serve s3``) behind a TCP proxy (``ckpt.testing.FaultProxy``) that
  forwards each direction at the rate (one bucket per direction shared by every connection: one rank's
  network share); every method reaches the server through it (s3fs underneath them all).

Reported per method: medians of time to durable (committed) and load time, the bytes a save stored
(ckpt: its ``written_bytes``, median; the others: the state's bytes), and the ratios the issue asks for
(``auto/raw``, ``auto/DCP``). Prints a table, writes benchmarks/results/bandwidth.{json,md}.
"""

from __future__ import annotations

import os

os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX2")  # bf16 matmuls of the training steps (see README)

import argparse  # noqa: E402
import errno  # noqa: E402
import faulthandler  # noqa: E402
import json  # noqa: E402
import mmap  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import uuid  # noqa: E402
import warnings  # noqa: E402
from collections.abc import Callable  # noqa: E402
from typing import Any  # noqa: E402

import fsspec  # noqa: E402
import torch  # noqa: E402
from fsspec.implementations.local import LocalFileSystem  # noqa: E402
from harness import banner, command, fmt, median, ratio, rounds, write_results  # noqa: E402

import ckpt  # noqa: E402
from ckpt.testing.s3 import FaultProxy, RcloneS3, TokenBucket, storage_options  # noqa: E402

warnings.filterwarnings("ignore")
MB = 1_000_000
BUCKET = "ckpt-bw"
PIECE = 1 << 20  # bytes a throttled file passes per bucket draw
WATCH = 300  # seconds one method's save and load may take before every thread's stack is printed


# -- the throttled local filesystem ---------------------------------------------------------------------------
class _Throttled:
    """A file object whose reads and writes draw from the filesystem's buckets."""

    def __init__(self, f: Any, fs: ThrottledFS):
        self._f, self._fs = f, fs

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        for i in range(0, len(view), PIECE):
            part = view[i:i + PIECE]
            self._fs.draw("write", len(part))
            self._f.write(part)
        return len(view)

    def read(self, n: int = -1) -> bytes:
        data = self._f.read(n)
        self._fs.draw("read", len(data))
        return data

    def readinto(self, b: Any) -> int:
        n = self._f.readinto(b)
        self._fs.draw("read", n or 0)
        return n

    def __enter__(self) -> _Throttled:
        return self

    def __exit__(self, *exc: Any) -> None:
        self._f.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._f, name)


class _DirectWrite:
    """A file being written (``wb``) through the write bucket and around the page cache (``O_DIRECT``): bytes
    gather in a page-aligned buffer written in aligned pieces, the last padded and the file cut back on close.
    Every method's files are written this way, so the bucket's rate is what limits them, not the CPU this VM's
    kernel spends copying into the page cache (0.2-1.3 s per 528 MB measured, with the two cores also
    encoding; see docs/api.md, "Durable writes around the page cache"). Where the file system refuses
    ``O_DIRECT``, an ordinary file. The aligned buffers are kept for the next file (a fresh one per file cost
    this VM a page fault per 4 KiB written: 0.4-0.7 s of kernel CPU per 529 MB save, more for a method that
    writes many files than for one that writes one; storage does not charge that)."""

    BUF = 4 << 20
    _free: list[memoryview] = []  # buffers of closed files (list.append and pop are atomic)

    def __init__(self, path: str, fs: ThrottledFS):
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
        try:
            self._fd = os.open(path, flags | getattr(os, "O_DIRECT", 0), 0o644)
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
            self._fd = os.open(path, flags, 0o644)
        try:
            buf = self._free.pop()
        except IndexError:
            buf = memoryview(mmap.mmap(-1, self.BUF))
        self._fs, self._buf, self._fill, self._done, self.closed = fs, buf, 0, 0, False

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        for i in range(0, len(view), PIECE):
            part = view[i:i + PIECE]
            self._fs.draw("write", len(part))
            while part:
                k = min(len(part), self.BUF - self._fill)
                self._buf[self._fill:self._fill + k] = part[:k]
                self._fill, part = self._fill + k, part[k:]
                if self._fill == self.BUF:
                    self._flush(self.BUF)
        return len(view)

    def _flush(self, n: int) -> None:
        view, at = self._buf[:n], self._done
        while view:
            k = os.pwrite(self._fd, view, at)
            view, at = view[k:], at + k
        self._done, self._fill = self._done + self._fill, 0  # the bytes written, not the padding

    def tell(self) -> int:
        return self._done + self._fill

    def fileno(self) -> int:
        return self._fd

    def flush(self) -> None:
        pass

    def writable(self) -> bool:
        return True

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            if self._fill:
                padded = -(-self._fill // 4096) * 4096
                self._buf[self._fill:padded] = bytes(padded - self._fill)
                self._flush(padded)
                os.ftruncate(self._fd, self._done)
        finally:
            os.close(self._fd)
            self._free.append(self._buf)

    def __enter__(self) -> _DirectWrite:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class ThrottledFS(LocalFileSystem):
    """A local directory at ``rate`` bytes/s each way (``throttled:///path``); ``rate`` None: as fast as
    the disk. Set the rate with :meth:`limit` (fsspec caches instances; the buckets are class-wide, one
    rank's share)."""

    protocol = "throttled"
    buckets: dict[str, TokenBucket] = {}

    @classmethod
    def limit(cls, rate: float | None) -> None:
        cls.buckets = {} if rate is None else {"write": TokenBucket(rate), "read": TokenBucket(rate)}

    @classmethod
    def draw(cls, direction: str, n: int) -> None:
        bucket = cls.buckets.get(direction)
        if bucket is not None and n:
            wait = bucket.take(n)
            if wait > 0:
                time.sleep(wait)  # the bandwidth being modelled, not a synchronisation

    @classmethod
    def _strip_protocol(cls, path: Any) -> str:
        path = str(path)
        if path.startswith("throttled://"):
            path = path[len("throttled://"):]
        return super()._strip_protocol(path)

    def _open(self, path: str, mode: str = "rb", *args: Any, **kwargs: Any) -> Any:
        if mode == "wb":
            return _DirectWrite(self._strip_protocol(path), self)
        return _Throttled(super()._open(path, mode, *args, **kwargs), self)

    def cat_file(self, path: str, start: int | None = None, end: int | None = None, **kwargs: Any) -> bytes:
        with self._open(self._strip_protocol(path), "rb") as f:
            if start:
                f.seek(start)
            return f.read(-1 if end is None else end - (start or 0))

    def pipe_file(self, path: str, value: bytes, mode: str = "overwrite", **kwargs: Any) -> None:
        p = self._strip_protocol(path)
        self.makedirs(self._parent(p), exist_ok=True)
        with self._open(p, "wb") as f:
            f.write(value)


fsspec.register_implementation("throttled", ThrottledFS, clobber=True)


# -- the state: a trained model and its AdamW moments -----------------------------------------------------------
def trained_state(size_gib: float, dtype: torch.dtype, steps: int = 12, seed: int = 0) -> tuple[dict, Callable]:
    """An MLP of square layers trained ``steps`` AdamW steps on a fixed regression, sized so weights and both
    moments hold about ``size_gib``; returns its state (``model``, ``optim``) and a function that trains one
    more step."""
    torch.manual_seed(seed)
    d = 1024
    per_layer = d * d * torch.tensor([], dtype=dtype).element_size() * 3  # weight, exp_avg, exp_avg_sq
    layers = max(2, int(size_gib * 2**30 // per_layer))
    model = torch.nn.Sequential(*[m for _ in range(layers) for m in (torch.nn.Linear(d, d), torch.nn.GELU())])
    model = model.to(dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    x = torch.randn(32, d, dtype=dtype)
    y = torch.randn(32, d, dtype=dtype)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()

    for _ in range(steps):
        step()
    return {"model": model, "optim": opt}, step


def tensors_of(state: dict) -> dict[str, torch.Tensor]:
    """The state's tensors by flat name (what DCP and safetensors are given)."""
    out = {f"model/{k}": v for k, v in state["model"].state_dict().items()}
    for i, s in state["optim"].state_dict()["state"].items():
        for k, v in s.items():
            if isinstance(v, torch.Tensor) and v.dim() > 0:
                out[f"optim/{i}/{k}"] = v
    return out


def nbytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def plain_s3(so: dict) -> dict:
    """s3fs options for the methods that use s3fs directly: checksums only where required, as ckpt's S3
    storage asks too (rclone answers a ranged GET with the whole object's checksum, which botocore's default
    validation refuses)."""
    return {**so, "config_kwargs": {"request_checksum_calculation": "when_required",
                                    "response_checksum_validation": "when_required"}}


# -- one target at one rate ---------------------------------------------------------------------------------------
def run_target(url: str, so: dict | None, state: dict, train: Callable[[], None], repeats: int,
               fs: Any) -> dict[str, dict[str, float]]:
    """Every method's (durable, load) seconds per repeat into ``url``; medians by method."""
    from safetensors.torch import load as st_load
    from safetensors.torch import save as st_save
    from torch.distributed.checkpoint import async_save as dcp_async_save
    from torch.distributed.checkpoint import load as dcp_load
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

    run = uuid.uuid4().hex[:8]
    kw = {"storage_options": so} if so else {}
    cps = {codec: ckpt.Checkpointer(f"{url}/{run}-{codec}", codec=codec, keep_last=2, **kw)
           for codec in ("auto", "raw")}
    readers = {codec: ckpt.Checkpointer(f"{url}/{run}-{codec}", **kw) for codec in ("auto", "raw")}
    dcp_kw = plain_s3(so) if so else {}
    times: dict[str, dict[str, list[float]]] = {}
    step_no = [0]

    def keep(name: str, what: str, t: float) -> None:
        times.setdefault(name, {}).setdefault(what, []).append(t)

    def ckpt_method(codec: str) -> Callable[[int], None]:
        def go(r: int) -> None:
            c = cps[codec]
            t0 = time.perf_counter()
            h = c.save(step_no[0], state)
            h.wait()
            t1 = time.perf_counter()
            c.wait()  # untimed: the writer's retention after the commit, not to run beside the timed load
            t2 = time.perf_counter()
            readers[codec].load(step_no[0], state)
            t3 = time.perf_counter()
            if r > 0:
                keep(f"ckpt {codec}", "durable", t1 - t0)
                keep(f"ckpt {codec}", "load", t3 - t2)
                keep(f"ckpt {codec}", "stored_mb", h.metrics.written_bytes / MB)
        return go

    def dcp(r: int) -> None:
        flat = tensors_of(state)
        where = f"{url}/{run}-dcp/{step_no[0]}"
        t0 = time.perf_counter()
        dcp_async_save(flat, storage_writer=FsspecWriter(where, **dcp_kw)).result()
        t1 = time.perf_counter()
        dcp_load(flat, storage_reader=FsspecReader(where, **dcp_kw))
        t2 = time.perf_counter()
        fs.rm(where, recursive=True)  # untimed: a round's copy is not kept (0.5 GiB a round fills a disk)
        if r > 0:
            keep("DCP async_save / load", "durable", t1 - t0)
            keep("DCP async_save / load", "load", t2 - t1)

    def safetensors(r: int) -> None:
        flat = {k: v.contiguous() for k, v in tensors_of(state).items()}
        where = f"{url}/{run}-st/{step_no[0]}.safetensors"
        t0 = time.perf_counter()
        fs.pipe_file(where, st_save(flat))
        t1 = time.perf_counter()
        back = st_load(fs.cat_file(where))
        t2 = time.perf_counter()
        fs.rm(where)
        assert back.keys() == flat.keys()
        if r > 0:
            keep("safetensors", "durable", t1 - t0)
            keep("safetensors", "load", t2 - t1)

    def before(r: int) -> None:
        train()
        step_no[0] += 1

    def watched(fn: Callable[[int], None]) -> Callable[[int], None]:
        """A method's save and load that take longer than WATCH seconds print every thread's stack,
        every WATCH seconds (a run once hung here with no CPU used, and left nothing saying where)."""
        def go(r: int) -> None:
            faulthandler.dump_traceback_later(WATCH, repeat=True)
            try:
                fn(r)
            finally:
                faulthandler.cancel_dump_traceback_later()
        return go

    contenders = {name: watched(fn) for name, fn in (("ckpt auto", ckpt_method("auto")),
                                                           ("ckpt raw", ckpt_method("raw")), ("DCP", dcp),
                                                           ("safetensors", safetensors))}
    rounds(contenders, repeats, warmup=1, before=before,
           report=lambda r, name, _: print(f"    round {r} {name} done", flush=True))
    for c in [*cps.values(), *readers.values()]:
        c.close()
    return {name: {what: median(ts) for what, ts in d.items()} for name, d in times.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size-gib", type=float, default=0.5, help="weights + both moments (default 0.5)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--rates", default="400,1000,0", help="MB/s, comma-separated; 0: unthrottled")
    p.add_argument("--targets", default="local,s3")
    p.add_argument("--dtypes", default="fp32,bf16")
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    p.add_argument("--from-json", default=None, help="measure nothing: write the tables of a results JSON")
    args = p.parse_args()
    if args.from_json:
        with open(args.from_json) as f:
            doc = json.load(f)
        md = markdown(doc["results"], doc["command"], doc["machine"])
        if doc.get("note"):
            md += f"\n{doc['note']}\n"
        print(md)
        write_results(args.out, "bandwidth", md, doc)
        return
    print(banner(), flush=True)
    rates = [float(r) for r in args.rates.split(",")]
    tmp = tempfile.mkdtemp(prefix="ckpt-bw-")
    srv = None
    results: list[dict[str, Any]] = []
    try:
        if "s3" in args.targets:
            srv = RcloneS3(os.path.join(tmp, "server")).start()
            srv.make_bucket(BUCKET)
        for dname in args.dtypes.split(","):
            dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dname]
            state, train = trained_state(args.size_gib, dtype)
            size = nbytes(tensors_of(state))
            for target in args.targets.split(","):
                for rate in rates:
                    label = f"{dname} {target} {'unthrottled' if not rate else f'{rate:g} MB/s'}"
                    print(f"== {label} ({size / 2**30:.2f} GiB)", flush=True)
                    proxy = None
                    if target == "local":
                        ThrottledFS.limit(rate * MB if rate else None)
                        root = os.path.join(tmp, "local", uuid.uuid4().hex[:6])
                        os.makedirs(root)
                        url, so = f"throttled://{root}", None
                        fs = fsspec.filesystem("throttled")
                    else:
                        assert srv is not None
                        proxy = FaultProxy(srv.port, rate=rate * MB if rate else None)
                        so = storage_options(proxy.endpoint)
                        url = f"s3://{BUCKET}"
                        fs = fsspec.filesystem("s3", skip_instance_cache=True, **plain_s3(so))
                    try:
                        med = run_target(url, so, state, train, args.repeats, fs)
                    finally:
                        if proxy is not None:
                            proxy.close()
                        ThrottledFS.limit(None)
                    results.append({"dtype": dname, "target": target, "rate_mb_s": rate or None, "bytes": size,
                                    "methods": med})
                    for name, m in med.items():
                        print(f"   {name:24s} durable {fmt(m['durable'])} s   load {fmt(m['load'])} s", flush=True)
                    # written as it goes: a run stopped part-way keeps what it measured
                    write_results(args.out, "bandwidth", markdown(results, command("bandwidth"), banner()),
                                  {"command": command("bandwidth"), "machine": banner(), "size_gib": args.size_gib,
                                   "repeats": args.repeats, "results": results})
    finally:
        if srv is not None:
            srv.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    md = markdown(results, command("bandwidth"), banner())
    print(md)
    write_results(args.out, "bandwidth", md, {"command": command("bandwidth"), "machine": banner(),
                                              "size_gib": args.size_gib, "repeats": args.repeats,
                                              "results": results})


def markdown(results: list[dict[str, Any]], cmd: str, machine: str) -> str:
    lines = [f"`{cmd}`", "", machine, "",
             "Seconds (medians); ratios below 1 favour ckpt auto.", "",
             "| state | storage | bandwidth | method | durable s | load s | stored MB |",
             "|---|---|---|---|---:|---:|---:|"]
    for r in results:
        bw = "unthrottled" if not r["rate_mb_s"] else f"{r['rate_mb_s']:g} MB/s"
        for name, m in r["methods"].items():
            stored = m.get("stored_mb", r["bytes"] / MB if name.startswith(("DCP", "safetensors")) else None)
            lines.append(f"| {r['dtype']} | {r['target']} | {bw} | {name} | {fmt(m['durable'])} | {fmt(m['load'])} | "
                         f"{'' if stored is None else f'{stored:.0f}'} |")
    lines += ["", "| state, storage, bandwidth | durable auto/raw | durable auto/DCP | load auto/raw | "
              "load auto/DCP |", "|---|---:|---:|---:|---:|"]
    for r in results:
        bw = "unthrottled" if not r["rate_mb_s"] else f"{r['rate_mb_s']:g} MB/s"
        m = r["methods"]
        a, w, d = m["ckpt auto"], m["ckpt raw"], m["DCP async_save / load"]
        lines.append(f"| {r['dtype']} AdamW, {r['target']}, {bw} | {ratio(a['durable'], w['durable'])} | "
                     f"{ratio(a['durable'], d['durable'])} | {ratio(a['load'], w['load'])} | "
                     f"{ratio(a['load'], d['load'])} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
