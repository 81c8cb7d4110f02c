"""Many small tensors: a model's ``state_dict()`` passed as the state itself, one top-level key per
tensor, against ``torch.save`` / ``torch.load`` of the same dict.

    python benchmarks/many_keys.py                       # 1,000 to 100,000 keys of 16 floats, 3 rounds
    python benchmarks/many_keys.py --quick               # a smoke test

Per key count, in each round (the order alternating between rounds), on the same disk:

* torch.save: ``torch.save(state, path)`` (returns once the bytes are in the page cache, no fsync);
* ckpt first save: a new ``Checkpointer`` on a new directory, ``save(1, state)``: blocked = time in
  ``save()`` (the structure walked, the save planned and laid out, the host buffer allocated, the copy),
  durable = until step 1 is committed (chunks and manifest written and fsynced);
* ckpt next save: ``save(2, state)`` with the same structure (the layout is reused): blocked;
* torch.load: ``torch.load(path)`` (new tensors);
* ckpt load: ``load(2, target)`` into a state of zeros of the same structure (in place, every chunk
  verified, the manifest checked).

The times of 40,000 keys ÷ those of 10,000 say whether the work grows linearly (4×).
Prints a table, writes many_keys.{json,md,png} under --out.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
import warnings

import torch

warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")

from harness import DASH, banner, command, fmt, machine, median, pyplot, ratio, save_figure, write_results  # noqa: E402, I001

import ckpt  # noqa: E402

COLUMNS = ("torch.save", "ckpt first save blocked", "ckpt next save blocked", "ckpt durable", "torch.load",
           "ckpt load")


def state_of(keys: int, floats: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"layers.{i}.weight": torch.randn(floats, generator=g) for i in range(keys)}


def one_round(root: str, state: dict[str, torch.Tensor], r: int) -> dict[str, float]:
    """Every method once on ``state``, in an order that alternates with ``r``; seconds by column."""
    path = os.path.join(root, f"torch-{r}.pt")
    out: dict[str, float] = {}

    def torch_side() -> None:
        t = time.perf_counter()
        torch.save(state, path)
        out["torch.save"] = time.perf_counter() - t
        t = time.perf_counter()
        torch.load(path)
        out["torch.load"] = time.perf_counter() - t

    def ckpt_side() -> None:
        target = {k: torch.zeros_like(v) for k, v in state.items()}
        with ckpt.Checkpointer(os.path.join(root, f"ckpt-{r}")) as c:
            t = time.perf_counter()
            h = c.save(1, state)
            out["ckpt first save blocked"] = time.perf_counter() - t
            h.wait()
            out["ckpt durable"] = time.perf_counter() - t
            t = time.perf_counter()
            h = c.save(2, state)
            out["ckpt next save blocked"] = time.perf_counter() - t
            h.wait()
            t = time.perf_counter()
            c.load(2, target)
            out["ckpt load"] = time.perf_counter() - t
        last = next(reversed(state))
        assert torch.equal(target[last], state[last])

    for side in (torch_side, ckpt_side) if r % 2 else (ckpt_side, torch_side):
        side()
    return out


def measure(n: int, floats: int, repeats: int, under: str | None) -> list[dict[str, float]]:
    """``repeats`` rounds of every method on a state of ``n`` keys."""
    state = state_of(n, floats)
    root = tempfile.mkdtemp(prefix="ckpt-keys-", dir=under)
    out = []
    try:
        for r in range(1, repeats + 1):
            out.append(one_round(root, state, r))
            print(f"{n} keys, round {r}: " + ", ".join(f"{k} {v:.3f}s" for k, v in out[-1].items()), flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--keys", default="1000,10000,40000,100000", help="key counts, comma-separated")
    ap.add_argument("--floats", type=int, default=16, help="float32 values per tensor")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="1,000 and 4,000 keys, one round")
    ap.add_argument("--root", default=None, help="directory for the files (default: a temp dir)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = ap.parse_args()
    counts = [1000, 4000] if args.quick else [int(k) for k in args.keys.split(",")]
    repeats = 1 if args.quick else args.repeats
    print(banner())
    runs = {n: measure(n, args.floats, repeats, args.root) for n in counts}
    med = {n: {c: median(x[c] for x in runs[n]) for c in COLUMNS} for n in counts}
    markdown = table(med, counts, args, repeats)
    print(markdown)
    doc = {"command": command("many_keys"), "machine": machine(), "floats": args.floats, "repeats": repeats,
           "runs": {str(n): v for n, v in runs.items()}, "median": {str(n): v for n, v in med.items()}}
    write_results(args.out, "many_keys", markdown, doc, plot=lambda path: plot(med, counts, path))


def table(med: dict[int, dict[str, float]], counts: list[int], args: argparse.Namespace, repeats: int) -> str:
    lines = [f"`{command('many_keys')}` (tensors of {args.floats} float32; medians of {repeats} rounds, seconds)", "",
             "| keys | torch.save | ckpt save() blocked, first | ÷ torch.save | next save | ckpt durable | "
             "torch.load | ckpt load | ÷ torch.load |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for n in counts:
        m = med[n]
        lines.append(f"| {n:,} | {fmt(m['torch.save'])} | {fmt(m['ckpt first save blocked'])} | "
                     f"{ratio(m['ckpt first save blocked'], m['torch.save'])} | {fmt(m['ckpt next save blocked'])} | "
                     f"{fmt(m['ckpt durable'])} | {fmt(m['torch.load'])} | {fmt(m['ckpt load'])} | "
                     f"{ratio(m['ckpt load'], m['torch.load'])} |")
    if 10000 in med and 40000 in med:
        a, b = med[10000], med[40000]
        lines += ["", "| 40,000 keys ÷ 10,000 | torch.save | ckpt save() blocked, first | next save | ckpt durable | "
                  "torch.load | ckpt load |", "|---|---:|---:|---:|---:|---:|---:|",
                  "| time ratio (linear: 4) | " + " | ".join(ratio(b[c], a[c]) for c in COLUMNS) + " |"]
    else:
        lines += ["", f"(40,000 ÷ 10,000 keys: {DASH}, not both measured)"]
    return "\n".join(lines) + "\n"


def plot(med: dict[int, dict[str, float]], counts: list[int], path: str) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(6, 3.8))
    for c in COLUMNS:
        ax.plot(counts, [med[n][c] for n in counts], marker="o", label=c)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("top-level keys (tensors of 16 floats)")
    ax.set_ylabel("seconds")
    ax.legend(fontsize=7)
    save_figure(fig, path)


if __name__ == "__main__":
    main()
