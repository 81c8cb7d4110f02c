"""The shard tiling check (:func:`ckpt.format.boxes.check_tiles`), which every save's plan and every
load's manifest check run on each global tensor: microseconds per shard as the number of shards grows.

    python benchmarks/tiling.py            # 64 to 131,072 shards, best of 3
    python benchmarks/tiling.py --quick    # 64 to 4,096, one round

Layouts: 1-D dim-0 shards (``B`` rows of 4), and a 2-D dp × tp grid with tp = 8 (``B / 8`` row blocks,
each cut into 8 column blocks: FSDP's dim 0 over tensor parallel's dim 1), given in rank order.
Prints a table, writes tiling.{json,md} under --out (benchmarks/results: docs/benchmarks.md's table).
"""

from __future__ import annotations

import argparse
import os
import time

from harness import banner, command, machine, write_results  # noqa: I001

from ckpt.format.boxes import Box, check_tiles


def rows(b: int) -> tuple[list[Box], tuple[int, ...]]:
    return [((4 * i,), (4,)) for i in range(b)], (4 * b,)


def grid(b: int, tp: int = 8) -> tuple[list[Box], tuple[int, ...]]:
    dp = b // tp
    return [((2 * i, 3 * j), (2, 3)) for i in range(dp) for j in range(tp)], (2 * dp, 3 * tp)


def us_per_shard(boxes: list[Box], shape: tuple[int, ...], rounds: int) -> float:
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        assert check_tiles(boxes, shape) is None
        best = min(best, time.perf_counter() - t0)
    return best / len(boxes) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = ap.parse_args()
    counts = [64, 512, 4096] if args.quick else [64, 512, 4096, 16384, 131072]
    rounds = 1 if args.quick else 3
    m = machine()
    print(banner(m))
    runs = {b: {"1-D": us_per_shard(*rows(b), rounds), "dp × tp8": us_per_shard(*grid(b), rounds)} for b in counts}
    lines = [f"`{command('tiling')}` (microseconds per shard, best of {rounds}; {banner(m)})", "",
             "| shards | 1-D dim-0 shards | dp × tp8 grid |", "|---:|---:|---:|"]
    lines += [f"| {b:,} | {r['1-D']:.2f} | {r['dp × tp8']:.2f} |" for b, r in runs.items()]
    table = "\n".join(lines) + "\n"
    print(table)
    if not args.quick:
        write_results(args.out, "tiling", table, {"command": command("tiling"), "machine": m, "rounds": rounds,
                                                  "us_per_shard": {str(b): r for b, r in runs.items()}})


if __name__ == "__main__":
    main()
