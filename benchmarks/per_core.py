"""What the codec costs per core, and how saves and loads scale from 1 to 2 worker threads.

    python benchmarks/per_core.py --size-gib 0.5 --repeats 3

Three states of about ``--size-gib`` each: a trained fp32 AdamW state and a bf16 one (the same model and
training as benchmarks/bandwidth.py), and a sparse one (fp32, 90% zeros: a masked or pruned layer).

* Codec throughput: the state's bytes cut into 16 MiB chunks, each encoded with ``auto`` (as the writer
  does: element width and rotation from the dtype, no delta base) and decoded back, hash checked, on one
  thread; reported in GB of raw state per CPU-second of that thread (``time.thread_time``), with the
  xxh3-128 hash of the same bytes as the floor every save and load pays.
* The machine's floor: the same bytes as plain 16 MiB files, written and fsynced, then read back,
  hashed and copied into the tensors, by 1 and 2 threads with nothing of ckpt's (the "plain files"
  rows): how far 2 cores of this machine scale on that memory and I/O work at all.
* Scaling: a ``Checkpointer`` with ``io_threads=1`` and ``=2`` (and ``snapshot_threads`` the same), time
  from ``save()`` to committed and ``load`` time from the page cache (``direct_io=False``: chunks written
  through it), ``auto`` and ``raw``, on a local directory; the ratio 1 thread / 2 threads (2.0 is perfect
  on 2 cores), and ``auto``'s page-cache load as a multiple of ``raw``'s. A load verifies every chunk.
  Each load is timed only once its save's retention has finished (``Checkpointer.wait()``) and after
  ``os.sync()``, neither timed: retention deleting the save two back (a whole state's chunks with
  ``raw``, little with ``auto``'s sparse deltas) would otherwise run during the load.
* Where each load's time goes (``Checkpointer.last_load``): planning (the manifest read, every check),
  reading and checking the chunks, the copy out of staging memory, and the rest (values put in place);
  the one-thread load's serial share (planning and the rest) bounds what a second thread can give.

Prints a table, writes benchmarks/results/per_core.{json,md}.
"""

from __future__ import annotations

import os

os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX2")  # bf16 matmuls of the training steps (see README)

import argparse  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
from bandwidth import tensors_of, trained_state  # noqa: E402
from harness import DASH, banner, command, fmt, median, ratio, rounds, write_results  # noqa: E402

import ckpt  # noqa: E402
from ckpt.format.chunk import chunk_hash, decode  # noqa: E402
from ckpt.save.encode import CodecSpec, encode  # noqa: E402

CHUNK = 16 << 20
GB = 1e9


def states(size_gib: float) -> dict[str, dict[str, Any]]:
    """name -> state (a dict the Checkpointer saves) of about ``size_gib``."""
    out: dict[str, dict[str, Any]] = {}
    for name, dtype in (("fp32 AdamW", torch.float32), ("bf16 AdamW", torch.bfloat16)):
        out[name] = trained_state(size_gib, dtype)[0]
    g = torch.Generator().manual_seed(1)
    n = int(size_gib * 2**30) // 4 // 1024 * 1024
    dense = torch.randn(n, generator=g)
    dense[torch.rand(n, generator=g) < 0.9] = 0.0
    out["sparse fp32 (90% zeros)"] = {"w": dense.view(-1, 1024)}
    return out


def flat_bytes(state: dict[str, Any]) -> list[tuple[np.ndarray, int]]:
    """(uint8 array, element width) per tensor of ``state``."""
    tensors = tensors_of(state) if "model" in state else state
    return [(t.detach().contiguous().view(-1).view(torch.uint8).numpy(), t.element_size()) for t in tensors.values()]


def codec_speed(state: dict[str, Any]) -> dict[str, float]:
    """GB of raw bytes per thread-CPU-second: encode (auto), decode (with its hash check), hash alone; and the
    stored / raw ratio."""
    spec = CodecSpec.parse("auto")
    for arr, _ in flat_bytes(state):  # touched first, untimed: a state left cold while the others ran may
        chunk_hash(memoryview(arr))  # have been paged out (kdamond runs here), and its faults are not the hash's
    raw_total = stored_total = 0
    t_enc = t_dec = t_hash = 0.0
    for arr, width in flat_bytes(state):
        for i in range(0, len(arr), CHUNK):
            piece = memoryview(arr[i:i + CHUNK])
            if len(piece) == 0:
                continue
            c0 = time.thread_time()
            digest = chunk_hash(piece)
            c1 = time.thread_time()
            _, parts = encode(piece, digest, spec, width=width, rotate=width in (2, 4, 8))
            blob = b"".join(bytes(p) for p in parts)
            c2 = time.thread_time()
            decode(blob, name=digest, expect_hash=digest, expect_len=len(piece))
            c3 = time.thread_time()
            t_hash, t_enc, t_dec = t_hash + (c1 - c0), t_enc + (c2 - c1), t_dec + (c3 - c2)
            raw_total += len(piece)
            stored_total += len(blob)
    return {"encode_gb_per_cpu_s": raw_total / GB / t_enc, "decode_gb_per_cpu_s": raw_total / GB / t_dec,
            "hash_gb_per_cpu_s": raw_total / GB / t_hash, "stored_over_raw": stored_total / raw_total,
            "raw_bytes": raw_total}


def floor(state: dict[str, Any], root: str, repeats: int) -> dict[str, dict[str, float]]:
    """The machine's own scaling on a save's and a load's bytes, with nothing of ckpt's: the state cut
    into 16 MiB files, new ones each round (as a save's chunks are: the round before last's are
    deleted, untimed, as retention would), written and fsynced one by one, then read back (from the
    page cache) into a scratch buffer per thread, hashed (xxh3-128) and copied into the state's
    tensors, by 1 and by 2 threads taking the files in turn. Medians of seconds for "plain x1" and
    "plain x2"."""
    from concurrent.futures import ThreadPoolExecutor

    import xxhash

    pieces = [(arr[i:i + CHUNK], os.path.join(root, f"{k}-{i}")) for k, (arr, _) in enumerate(flat_bytes(state))
              for i in range(0, len(arr), CHUNK)]
    os.makedirs(root, exist_ok=True)

    def save(piece: tuple[np.ndarray, str]) -> None:
        arr, path = piece
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            view = memoryview(arr)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)

    def method(n: int):
        scratch: dict[int, bytearray] = {}

        def load(piece: tuple[np.ndarray, str]) -> None:
            arr, path = piece
            path = f"{path}.{turn[0]}"
            buf = scratch.get(threading.get_ident())
            if buf is None:  # once per thread: fresh memory per piece would cost its page faults
                buf = scratch[threading.get_ident()] = bytearray(CHUNK)
            view = memoryview(buf)[:len(arr)]
            with open(path, "rb", buffering=0) as f:
                f.readinto(view)
            xxhash.xxh3_128_hexdigest(view)
            np.copyto(arr, np.frombuffer(view, np.uint8))

        def go(r: int) -> dict[str, float]:
            turn[0] += 1
            mine = [(arr, f"{path}.{turn[0]}") for arr, path in pieces]
            with ThreadPoolExecutor(n) as pool:
                t0 = time.perf_counter()
                list(pool.map(save, mine))
                durable = time.perf_counter() - t0
                os.sync()  # untimed, as for ckpt's rows: no writeback under the timed reads
                t1 = time.perf_counter()
                list(pool.map(load, pieces))
                took = {"durable": durable, "load": time.perf_counter() - t1}
            for _, path in pieces:  # the round before last's files go, as retention keeps two saves
                if os.path.exists(old := f"{path}.{turn[0] - 2}"):
                    os.unlink(old)
            return took
        return go

    turn = [0]
    kept = rounds({f"plain x{n}": method(n) for n in (1, 2)}, repeats, warmup=1)
    shutil.rmtree(root, ignore_errors=True)
    return {name: {k: median(r[k] for r in runs) for k in ("durable", "load")} for name, runs in kept.items()}


def scaling(state: dict[str, Any], root: str, repeats: int) -> dict[str, dict[str, float]]:
    """Medians for (codec, threads) of the durable and load seconds and of the load's parts
    (``last_load``: plan, read, copy, and the rest)."""
    cps = {(codec, n): ckpt.Checkpointer(os.path.join(root, f"{codec}-{n}"), codec=codec, io_threads=n,
                                         snapshot_threads=n, keep_last=2, direct_io=False)  # page-cache loads
           for codec in ("auto", "raw") for n in (1, 2)}
    step = [0]

    def method(key: tuple[str, int]):
        def go(r: int) -> dict[str, float]:
            c = cps[key]
            t0 = time.perf_counter()
            c.save(step[0], state).wait()
            took = time.perf_counter() - t0
            c.wait()  # untimed: retention's deletions, and the page cache's writeback, end before the load
            os.sync()
            t1 = time.perf_counter()
            c.load(step[0], state)
            done = time.perf_counter() - t1
            s = c.last_load
            assert s is not None
            return {"durable": took, "load": done, "plan": s.plan_s, "read": s.read_s, "copy": s.copy_s,
                    "rest": s.seconds - s.plan_s - s.read_s - s.copy_s}
        return go

    def before(r: int) -> None:
        step[0] += 1
        with torch.no_grad():  # a change everywhere, untimed, so no chunk is reused from the last save
            for t in (tensors_of(state) if "model" in state else state).values():
                t.view(-1)[::4097].add_(1)

    kept = rounds({f"{c} x{n}": method((c, n)) for c, n in cps}, repeats, warmup=1, before=before)
    for c in cps.values():
        c.close()
    return {name: {k: median(r[k] for r in runs) for k in runs[0]} for name, runs in kept.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size-gib", type=float, default=0.5)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = p.parse_args()
    print(banner(), flush=True)
    tmp = tempfile.mkdtemp(prefix="ckpt-percore-")
    results: dict[str, Any] = {}
    try:
        for name, state in states(args.size_gib).items():
            print(f"== {name}", flush=True)
            speed = codec_speed(state)
            print(f"   encode {speed['encode_gb_per_cpu_s']:.2f}  decode {speed['decode_gb_per_cpu_s']:.2f}  "
                  f"hash {speed['hash_gb_per_cpu_s']:.2f} GB/CPU-s, stored {speed['stored_over_raw']:.3f}", flush=True)
            scale = scaling(state, os.path.join(tmp, name.split()[0]), args.repeats)
            scale.update(floor(state, os.path.join(tmp, "plain-" + name.split()[0]), args.repeats))
            results[name] = {"codec": speed, "scaling": scale}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    md = markdown(results)
    print(md)
    write_results(args.out, "per_core", md, {"command": command("per_core"), "machine": banner(),
                                             "size_gib": args.size_gib, "repeats": args.repeats, "results": results})


def markdown(results: dict[str, Any]) -> str:
    lines = [f"`{command('per_core')}`", "", banner(), "",
             "Codec throughput, one thread, GB of raw state per CPU-second:", "",
             "| state | stored / raw | encode (auto) | decode + check | hash alone |", "|---|---:|---:|---:|---:|"]
    for name, r in results.items():
        c = r["codec"]
        lines.append(f"| {name} | {c['stored_over_raw']:.3f} | {c['encode_gb_per_cpu_s']:.2f} | "
                     f"{c['decode_gb_per_cpu_s']:.2f} | {c['hash_gb_per_cpu_s']:.2f} |")
    lines += ["", "Saves and loads (local directory, loads from the page cache), seconds (medians) and ratios:", "",
              "| state | codec | durable 1 thr | durable 2 thr | speed-up | load 1 thr | load 2 thr | speed-up | "
              "load / raw's (2 thr) |", "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name, r in results.items():
        s = r["scaling"]
        for codec in ("auto", "raw", "plain"):
            if f"{codec} x1" not in s:
                continue
            one, two = s[f"{codec} x1"], s[f"{codec} x2"]
            label = codec if codec != "plain" else "plain files (floor)"
            over_raw = ratio(two["load"], s["raw x2"]["load"]) if codec != "plain" else DASH
            lines.append(f"| {name} | {label} | {fmt(one['durable'])} | {fmt(two['durable'])} | "
                         f"{ratio(one['durable'], two['durable'])} | {fmt(one['load'])} | {fmt(two['load'])} | "
                         f"{ratio(one['load'], two['load'])} | {over_raw} |")
    lines += ["", "Where a load's time goes (`Checkpointer.last_load`), milliseconds (medians), 1 → 2 threads; the "
              "serial share is plan + rest of the one-thread load, and the bound is the most 2 threads could give "
              "with it (Amdahl: 1 ÷ (serial + parallel ÷ 2)):", "",
              "| state | codec | plan | read + check | copy back | rest | serial share | bound |",
              "|---|---|---:|---:|---:|---:|---:|---:|"]
    for name, r in results.items():
        s = r["scaling"]
        for codec in ("auto", "raw"):
            one, two = s.get(f"{codec} x1", {}), s.get(f"{codec} x2", {})
            if "plan" not in one:
                continue
            whole = one["plan"] + one["read"] + one["copy"] + one["rest"]
            serial = (one["plan"] + one["rest"]) / whole
            cells = " | ".join(f"{one[k] * 1e3:.1f} → {two[k] * 1e3:.1f}" for k in ("plan", "read", "copy", "rest"))
            lines.append(f"| {name} | {codec} | {cells} | {serial:.2f} | {1 / (serial + (1 - serial) / 2):.2f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
