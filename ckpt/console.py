"""How the ``ckpt`` command line draws its results: tables (rich on a terminal, as wide as it is;
tab-separated with exact byte counts when piped), human sizes, and a progress bar on stderr."""

from __future__ import annotations

import io
import os
import shutil
import sys
import time
from typing import Any, TextIO

from rich import box
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, TaskProgressColumn, TextColumn
from rich.progress import Progress as RichProgress
from rich.table import Table
from rich.text import Text


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError


def terminal_width(stream: TextIO) -> int:
    """Columns of the terminal ``stream`` is (``COLUMNS`` wins, as for every console program)."""
    try:
        return os.get_terminal_size(stream.fileno()).columns if "COLUMNS" not in os.environ else \
            shutil.get_terminal_size().columns
    except (OSError, AttributeError, ValueError):
        return shutil.get_terminal_size().columns


class Out:
    """Where results go: on a terminal, tables (rich) that fit its width, long cells folded, sizes
    for humans; piped, tab-separated rows with exact byte counts (so ``cut``/``awk`` and
    spreadsheets read them)."""

    def __init__(self, stream: TextIO | None = None, tty: bool | None = None, width: int | None = None):
        self.stream = stream or sys.stdout
        self.tty = self.stream.isatty() if tty is None else tty
        self.width = width or (terminal_width(self.stream) if self.tty else 200)
        real = self.tty and hasattr(self.stream, "fileno") and not isinstance(self.stream, io.StringIO)
        self.console = Console(file=self.stream, width=self.width, highlight=False, soft_wrap=False,
                               color_system="auto" if real else None, emoji=False)

    def write(self, text: str = "") -> None:
        if self.tty:
            self.console.print(text, markup=False)
        else:
            self.stream.write(text + "\n")

    def size(self, n: int | None) -> str:
        if n is None:
            return "-"
        return human_bytes(n) if self.tty else str(n)

    def table(self, header: list[str], rows: list[list[Any]], right: set[int] | frozenset[int] = frozenset()
              ) -> None:
        cells = [[str(c) for c in r] for r in rows]
        if not self.tty:
            for r in [header] + cells:
                self.stream.write("\t".join(c.replace("\t", " ").replace("\n", " ") for c in r) + "\n")
            return
        t = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, header_style="bold", expand=False)
        for i, h in enumerate(header):
            t.add_column(h, justify="right" if i in right else "left", overflow="fold")
        for r in cells:
            t.add_row(*(Text(c) for c in r))
        self.console.print(t)


class Progress:
    """A progress bar (rich) on stderr, drawn only when stderr is a terminal."""

    def __init__(self, total: int, what: str, stream: TextIO | None = None, enabled: bool | None = None):
        stream = stream or sys.stderr
        self.enabled = stream.isatty() if enabled is None else enabled
        self.started = time.monotonic()
        self._bar: RichProgress | None = None
        if self.enabled:
            console = Console(file=stream, width=terminal_width(stream), highlight=False, color_system=None)
            self._bar = RichProgress(TextColumn(what), BarColumn(), MofNCompleteColumn(), TaskProgressColumn(),
                                     TextColumn("{task.fields[rate]}"), console=console, auto_refresh=False)
            self._task = self._bar.add_task(what, total=total, rate="")
            self._bar.start()

    def update(self, done: int, nbytes: int) -> None:
        if self._bar is not None:
            rate = nbytes / max(time.monotonic() - self.started, 1e-6)
            self._bar.update(self._task, completed=done, rate=f"{human_bytes(rate)}/s")
            self._bar.refresh()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()


def fmt_box(offsets: list[int], lengths: list[int]) -> str:
    return "[" + ", ".join(f"{o}:{o + n}" for o, n in zip(offsets, lengths)) + "]"


def fmt_shape(shape: list[int]) -> str:
    return "(" + ", ".join(map(str, shape)) + ("," if len(shape) == 1 else "") + ")"


def fmt_base_steps(steps: list[int]) -> str:
    if not steps:
        return "-"
    return ",".join(map(str, steps)) if len(steps) <= 3 else f"{steps[0]}…{steps[-1]}"


def fmt_steps(steps: list[int]) -> str:
    return ", ".join(map(str, steps)) if len(steps) <= 8 else f"{steps[0]} … {steps[-1]} ({len(steps)} steps)"


def fmt_age(s: float | None) -> str:
    if s is None:
        return "?"
    for unit, n in (("d", 86400), ("h", 3600), ("m", 60)):
        if s >= n:
            return f"{s / n:.1f}{unit}"
    return f"{s:.0f}s"
