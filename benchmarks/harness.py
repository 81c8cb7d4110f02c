"""What every benchmark script shares: the machine it ran on, turn-taking rounds, medians and ratios,
and the writer of ``benchmarks/results/<name>.md``, ``.json`` and ``.png``.

Each script keeps its own tables and JSON fields (the docs are generated from them); this module only
holds what they all did the same way, so a fix to, say, how a ratio treats a missing value lands everywhere.
The scripts import it as a sibling (``python benchmarks/x.py`` puts benchmarks/ first on the path)::

    from harness import banner, median, ratio, rounds, write_results

    times = rounds({"memcpy": copy_once, "ckpt": save_once}, n=3, warmup=1)   # name -> [result per round]
    med = {k: median(v) for k, v in times.items()}
    print(banner())
    write_results(out_dir, "snapshot_cpu", markdown, doc, plot=lambda path: draw(med, path))
"""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import sys
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

T = TypeVar("T")

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
DASH = "–"  # what a table shows for a value that is missing or undefined


# -- the machine -------------------------------------------------------------------------------------------
def cpu_model() -> str:
    """The CPU's model name (from /proc/cpuinfo on Linux), else what ``platform`` knows."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def memory_gib() -> float | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError, AttributeError):
        return None


def machine() -> dict[str, Any]:
    """Where and with what a benchmark ran: CPU, cores, memory, versions, date."""
    import torch

    import ckpt

    mem = memory_gib()
    return {"cpu": cpu_model(), "cores": os.cpu_count(), "memory_gib": round(mem, 1) if mem else None,
            "os": f"{platform.system()} {platform.release()}", "python": platform.python_version(),
            "torch": torch.__version__, "ckpt": ckpt.__version__,
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}


def banner(m: dict[str, Any] | None = None) -> str:
    """One line saying where it ran, for the console and for the head of a results page."""
    m = m or machine()
    mem = f"{m['memory_gib']:g} GiB" if m["memory_gib"] else "memory unknown"
    return (f"{m['cpu']}, {m['cores']} CPUs, {mem}; {m['os']}; python {m['python']}, torch {m['torch']}, "
            f"ckpt {m['ckpt']}; {m['date']}")


def command(script: str) -> str:
    """How the script was run, as a reader would type it from the repository root."""
    return f"python benchmarks/{script}.py " + " ".join(sys.argv[1:])


# -- taking turns, medians, ratios ---------------------------------------------------------------------------
def order(names: list[str], round_no: int, alternate: bool = True) -> list[str]:
    """The contenders' order in round ``round_no``: as given in odd rounds, reversed in even ones, so
    neither going first (a cold cache) nor last (a machine already hot) favours one side."""
    return list(names) if not alternate or round_no % 2 else list(reversed(names))


def rounds(contenders: dict[str, Callable[[int], T]], n: int, *, warmup: int = 0, alternate: bool = True,
           before: Callable[[int], None] | None = None,
           report: Callable[[int, str, T], None] | None = None) -> dict[str, list[T]]:
    """Run each contender once per round, ``warmup`` untimed rounds then ``n`` kept ones, and return
    name -> the ``n`` kept results in round order (round numbers count from 1; warm-ups are ``<= 0``).

    ``fn(round_no)`` does one run and returns what to keep (seconds, or a dict of them); ``before``
    runs at the start of each round; ``report(round_no, name, result)`` after each run (printing)."""
    kept: dict[str, list[T]] = {name: [] for name in contenders}
    for r in range(1 - warmup, n + 1):
        if before is not None:
            before(r)
        for name in order(list(contenders), r, alternate):
            result = contenders[name](r)
            if report is not None:
                report(r, name, result)
            if r > 0:
                kept[name].append(result)
    return kept


def _missing(x: Any) -> bool:
    return x is None or (isinstance(x, float) and math.isnan(x))


def median(xs: Iterable[float | None]) -> float:
    """The median of what is there (None and NaN left out); NaN when nothing is."""
    vals = sorted(x for x in xs if not _missing(x))
    if not vals:
        return float("nan")
    mid = len(vals) // 2
    return vals[mid] if len(vals) % 2 else (vals[mid - 1] + vals[mid]) / 2


def medians(runs: dict[str, list[float]]) -> dict[str, float]:
    return {k: median(v) for k, v in runs.items()}


def fmt(x: float | None, digits: int = 3) -> str:
    return DASH if _missing(x) else f"{x:.{digits}f}"


def ratio(a: float | None, b: float | None, digits: int = 2) -> str:
    """``a / b`` for a table, or a dash where either is missing or ``b`` is zero."""
    if _missing(a) or _missing(b) or b == 0:
        return DASH
    assert a is not None and b is not None
    return f"{a / b:.{digits}f}"


def ratios(values: dict[str, float], reference: str) -> dict[str, float]:
    """Every value divided by the one named ``reference`` (NaN where that is undefined)."""
    ref = values.get(reference)
    return {k: (v / ref if not _missing(v) and not _missing(ref) and ref else float("nan"))
            for k, v in values.items()}


# -- results ---------------------------------------------------------------------------------------------------
def pyplot() -> Any:
    """matplotlib's pyplot drawing to files, or None (with a hint) where matplotlib is not installed."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(matplotlib not installed: no plot; pip install 'ckpt[bench]')")
        return None
    return plt


def write_results(out: str, name: str, markdown: str, doc: dict, *, plot: Callable[[str], None] | None = None,
                  indent: int = 2, json_default: Callable[[Any], Any] | None = None) -> dict[str, str]:
    """Write ``<out>/<name>.md`` (``markdown`` exactly as given), ``<name>.json`` (``doc``)
    and, with ``plot(path)``, ``<name>.png``. Returns the paths written, by suffix."""
    os.makedirs(out, exist_ok=True)
    paths = {ext: os.path.join(out, f"{name}.{ext}") for ext in ("md", "json", "png")}
    with open(paths["md"], "w") as f:
        f.write(markdown)
    with open(paths["json"], "w") as f:
        json.dump(doc, f, indent=indent, default=json_default)
    if plot is None:
        del paths["png"]
    else:
        plot(paths["png"])
    return paths


def save_figure(fig: Any, path: str, dpi: int = 110) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    print(f"plot: {path}")
