"""How the ``ckpt`` command line draws its results: tables (on a terminal as wide as it is, one
line a row; tab-separated with exact byte counts when piped), human sizes, ``--help`` wrapped to
the terminal, and a progress bar on stderr."""

from __future__ import annotations

import argparse
import io
import os
import re
import shutil
import sys
import textwrap
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TextIO

from rich.cells import cell_len
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, TaskProgressColumn, TextColumn
from rich.progress import Progress as RichProgress
from rich.text import Text


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError


def compact_bytes(n: float) -> str:
    """``du -h``'s sizes: 512B, 9.5K, 250K, 1.2G (powers of 1024)."""
    for unit in ("B", "K", "M", "G", "T"):
        if abs(n) < 1024 or unit == "T":
            return f"{n:.0f}{unit}" if unit == "B" or abs(n) >= 9.95 else f"{n:.1f}{unit}"
        n /= 1024
    raise AssertionError


def terminal_width(stream: TextIO) -> int:
    """Columns of the terminal ``stream`` is (``COLUMNS`` wins, as for every console program)."""
    try:
        return os.get_terminal_size(stream.fileno()).columns if "COLUMNS" not in os.environ else \
            shutil.get_terminal_size().columns
    except (OSError, AttributeError, ValueError):
        return shutil.get_terminal_size().columns


class Cell(str):
    """A table cell with a shorter form (``short``) a narrow terminal shows instead: ``250K`` for
    ``250.0 KiB``, a time without its seconds. Piped output and wide terminals get the full text."""

    short: str

    def __new__(cls, text: str, short: str) -> Cell:
        cell = super().__new__(cls, text)
        cell.short = short
        return cell


GAP = 2  # spaces between columns
PIPED_WIDTH = 1 << 16  # an aligned table piped (to less, grep, a file): as wide as its rows, nothing cut
KEEP = {"middle": 30, "end": 16}  # a shortened column is kept this wide while other columns can be hidden
FLOOR = {"middle": 10, "end": 6}  # ... and never narrower
WHOLE: dict[str, int] = {}  # layout's stage marker: ``whole`` columns untouched, the other ``fit`` ones at KEEP


@dataclass
class Layout:
    lines: list[str]
    header_lines: int
    hidden: list[int]
    shortened: bool


def _text(c: Any, short: bool) -> str:
    s = c.short if short and isinstance(c, Cell) else str(c)
    return s.replace("\t", " ").replace("\n", " ")


def _take(s: str, n: int, from_end: bool = False) -> str:
    """The longest start (or end) of ``s`` at most ``n`` terminal cells wide."""
    if n <= 0:
        return ""
    if s.isascii():  # one cell a character: the common case, and the cheap one
        return s[-n:] if from_end else s[:n]
    out: list[str] = []
    used = 0
    for ch in reversed(s) if from_end else s:
        used += cell_len(ch)
        if used > n:
            break
        out.append(ch)
    return "".join(reversed(out) if from_end else out)


SEPARATORS = "./_-:"


def _middle(c: str, head: int, room: int) -> tuple[str, int]:
    """``c`` in ``room + 1`` cells: ``head`` cells of its start, ``…``, the rest from its end; and how
    clean the cut is: a point for each side that ends at a separator (``model/layers.11…`` is clean,
    ``model/layers.1…`` is not)."""
    start, end = _take(c, head), _take(c, room - head, True)
    cut = c[len(start):len(c) - len(end)]
    clean = (start[-1:] in SEPARATORS or cut[:1] in SEPARATORS) + (end[:1] in SEPARATORS or cut[-1:] in SEPARATORS)
    return start + "…" + end, clean


def _shorten(cells: list[str], w: int, how: str) -> list[str]:
    """Cells cut to ``w``: at the end, or in the middle, all at the same place: where the most of
    them stay distinct, then where the most cuts fall at separators (``model/layers.0.…q_proj.weight``,
    ``model/layers.11…q_proj.weight``), then a little before the middle (names differ at their end)."""
    long = list(dict.fromkeys(c for c in cells if cell_len(c) > w))
    if not long:
        return cells
    if how != "middle" or w < 3:
        cut = {c: _take(c, w - 1) + "…" for c in long}
    else:
        room = w - 1
        best: tuple[int, int, float, int] | None = None
        for head in range(max(1, room // 4), room * 3 // 4 + 1):
            results = [_middle(c, head, room) for c in long]
            score = (len({r for r, _ in results}), sum(k for _, k in results), -abs(head - room * 0.4), head)
            best = score if best is None or score > best else best
        assert best is not None
        cut = {c: _middle(c, best[3], room)[0] for c in long}
    return [cut.get(c, c) for c in cells]


def _distinct_width(cells: list[str], least: int) -> int:
    """The narrowest width from ``least`` up at which names cut in the middle all stay distinct
    (``model.layers.0.…q_proj.weight`` needs both the layer and the projection): columns are hidden
    to make room for it before names start to look alike."""
    distinct = len(set(cells))
    lo, hi = least, max([least, *map(cell_len, cells)])
    while lo < hi:
        mid = (lo + hi) // 2
        if len(set(_shorten(cells, mid, "middle"))) == distinct:
            hi = mid
        else:
            lo = mid + 1
    return lo


def _widths(shown: list[int], natural: dict[int, int], least: dict[int, int], width: int) -> dict[int, int] | None:
    """Each shown column's width, ``least`` at the least, growing towards ``natural`` while there is room."""
    spare = width - sum(least[i] for i in shown) - GAP * (len(shown) - 1)
    if spare < 0:
        return None
    w = {i: least[i] for i in shown}
    while spare > 0:
        i = max(shown, key=lambda i: natural[i] - w[i])
        if natural[i] <= w[i]:
            break
        w[i] += 1
        spare -= 1
    return w


def layout(header: list[str], rows: list[list[Any]], right: set[int] | frozenset[int], fit: dict[int, str],
           drop: Sequence[int], width: int, whole: set[int] | frozenset[int] = frozenset()) -> Layout:
    """Lines of a table at most ``width`` cells wide, each row on one line. Relaxed step by step until
    it fits: headers wrapped at spaces, short forms of :class:`Cell` cells, ``fit`` columns shortened
    to ``KEEP``, ``drop`` columns hidden one by one, ``fit`` columns down to ``FLOOR``; past that
    (a very narrow terminal) the lines are cropped. ``whole``: ``fit`` columns (names) that keep their
    full width while other columns are shortened and ``drop`` columns hidden, before they are cut."""
    n = len(header)
    stages: list[tuple[bool, bool, dict[str, int] | None, int]] = [
        (False, False, None, 0), (True, False, None, 0), (True, True, None, 0)]
    if whole:
        stages += [(True, True, WHOLE, k) for k in range(len(drop) + 1)]
    stages += [(True, True, KEEP, k) for k in range(len(drop) + 1)] + [(True, True, FLOOR, len(drop))]
    kept: dict[int, int] = {}
    for wrap, short, floor, k in stages:
        if floor is WHOLE:
            floor = KEEP
            kept = {i: 1 << 30 if i in whole else KEEP[how] for i, how in fit.items()}  # names at their natural width
        elif floor is KEEP and (not kept or any(kept[i] >= 1 << 30 for i in kept)):
            # only once the table does not fit with every name whole
            kept = {i: _distinct_width([_text(r[i], True) for r in rows], KEEP[how]) if how == "middle"
                    else KEEP[how] for i, how in fit.items()}
        texts = [[_text(r[i], short) for r in rows] for i in range(n)]
        shown = [i for i in range(n) if i not in drop[:k]]
        heads = {i: max(map(cell_len, header[i].split())) if wrap and header[i].strip() else cell_len(header[i])
                 for i in shown}
        natural = {i: max([heads[i], *map(cell_len, texts[i])]) for i in shown}
        least = {i: max(heads[i], min(natural[i], kept[i] if floor is KEEP else floor[fit[i]])) if floor and i in fit
                 else natural[i] for i in shown}
        w = _widths(shown, natural, least, width)
        if w is not None:
            break
    else:
        w = least  # nothing fits: each column at its least, the lines cropped
    cols = {i: _shorten(texts[i], w[i], fit.get(i, "end")) for i in shown}
    head_cells = {i: textwrap.wrap(header[i], w[i]) or [""] if cell_len(header[i]) > w[i] else [header[i]]
                  for i in shown}
    depth = max(len(h) for h in head_cells.values())

    def line(cells: dict[int, str]) -> str:
        parts = [" " * (w[i] - cell_len(c)) + c if i in right else c + " " * (w[i] - cell_len(c))
                 for i, c in cells.items()]
        return (" " * GAP).join(parts).rstrip()
    lines = [line({i: ([""] * (depth - len(h)) + h)[d] for i, h in head_cells.items()}) for d in range(depth)]
    lines.append("─" * (sum(w.values()) + GAP * (len(shown) - 1)))
    lines += [line({i: cols[i][r] for i in shown}) for r in range(len(rows))]
    shortened = any(cols[i][r] != texts[i][r] for i in shown if i in fit for r in range(len(rows)))
    return Layout(lines, depth, [i for i in range(n) if i not in shown], shortened)


class Out:
    """Where results go: on a terminal, tables that fit its width one line a row (:func:`layout`),
    sizes for humans; piped, tab-separated rows with exact byte counts (so ``cut``/``awk`` and
    spreadsheets read them)."""

    def __init__(self, stream: TextIO | None = None, tty: bool | None = None, width: int | None = None,
                 aligned: bool | None = None):
        self.stream = stream or sys.stdout
        self.tty = self.stream.isatty() if tty is None else tty
        self.aligned = self.tty if aligned is None else aligned  # piped and aligned: tables for people, full width
        self.width = width or (terminal_width(self.stream) if self.tty else PIPED_WIDTH if self.aligned else 200)
        real = self.tty and hasattr(self.stream, "fileno") and not isinstance(self.stream, io.StringIO)
        self.console = Console(file=self.stream, width=self.width, highlight=False, soft_wrap=False,
                               color_system="auto" if real else None, emoji=False)

    def write(self, text: str = "") -> None:
        if self.tty:
            self.console.print(text, markup=False)
        else:
            self.stream.write(text + "\n")

    def paragraph(self, text: str) -> None:
        """One item as lines of the terminal's width, the lines after the first indented under it."""
        for line in textwrap.wrap(text, self.width, subsequent_indent="    ", break_long_words=False,
                                  break_on_hyphens=False) if self.tty else [text]:
            self.write(line)

    def size(self, n: int | None) -> str:
        """A size cell: exact bytes in TSV, ``250.0 KiB`` (or ``250K`` if narrow) in an aligned table."""
        if n is None:
            return "-"
        return Cell(human_bytes(n), compact_bytes(n)) if self.aligned else str(n)

    def table(self, header: list[str], rows: list[list[Any]], right: set[int] | frozenset[int] = frozenset(), *,
              fit: dict[int, str] | None = None, drop: Sequence[int] = (),
              whole: set[int] | frozenset[int] = frozenset()) -> None:
        """One row per line, always. ``fit``: columns that may be shortened on a narrow terminal,
        ``"middle"`` (names: ``model/layers.11.…q_proj.weight``, kept distinct) or ``"end"`` (prose);
        ``drop``: columns to hide, first ones first, before a name would get too short to read.
        Cells that are :class:`Cell` show their short form when the full one does not fit. ``whole``:
        name columns that keep their width while ``drop`` columns are hidden, before they are cut.
        Piped: tab-separated, or (``aligned``) the table at its full width."""
        if not self.aligned:
            for r in [header] + [[str(c) for c in r] for r in rows]:
                self.stream.write("\t".join(c.replace("\t", " ").replace("\n", " ") for c in r) + "\n")
            return
        lay = layout(header, rows, right, fit or {}, drop, self.width, whole)
        for i, line in enumerate(lay.lines):
            if not self.tty:
                self.stream.write(line + "\n")
                continue
            self.console.print(Text(line, style="bold" if i < lay.header_lines else ""), no_wrap=True,
                               overflow="crop", crop=True, markup=False)
        notes = ([f"hidden: {', '.join(header[i] for i in lay.hidden)}"] if lay.hidden else []) + (
            ["names cut with …"] if lay.shortened else [])
        if notes:  # what this width left out, and where to see it
            self.write(f"({'; '.join(notes)}; --json has it all)")


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """``--help`` as wide as the terminal (argparse reads ``COLUMNS``): descriptions and epilogs are
    re-wrapped paragraph by paragraph, never inside a word. A line that starts with spaces (an
    exit code, an example) is wrapped on its own, its continuation lines hanging under its text."""

    def _split_lines(self, text: str, width: int) -> list[str]:  # an option's help: no word cut, not at hyphens
        return textwrap.wrap(" ".join(text.split()), width, break_long_words=False, break_on_hyphens=False)

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        out: list[str] = []
        para: list[str] = []

        def wrap(words: str, first: str, rest: str) -> list[str]:
            return textwrap.wrap(words, width, initial_indent=first, subsequent_indent=rest,
                                 break_long_words=False, break_on_hyphens=False) or [first.rstrip()]

        def flush() -> None:
            if para:
                out.extend(wrap(" ".join(para), indent, indent))
                para.clear()
        for line in text.splitlines():
            if not line.strip():
                flush()
                out.append("")
            elif not line[0].isspace():
                para.append(line.strip())
            else:
                flush()
                lead = line[:len(line) - len(line.lstrip())]
                hang = re.match(r"\s+(\S+\s{2,})?", line)
                out.extend(wrap(line.strip(), indent + lead, indent + " " * (hang.end() if hang else len(lead))))
        flush()
        return "\n".join(out)


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


def fmt_shape(shape: list[int]) -> Cell:
    return Cell("(" + ", ".join(map(str, shape)) + ("," if len(shape) == 1 else "") + ")",
                "x".join(map(str, shape)) if shape else "()")


SHORT_DTYPES = {"float64": "fp64", "float32": "fp32", "float16": "fp16", "bfloat16": "bf16", "complex128": "c128",
                "complex64": "c64", "int64": "i64", "int32": "i32", "int16": "i16", "int8": "i8", "uint8": "u8"}


def fmt_dtype(dtype: str) -> Cell:
    return Cell(dtype, SHORT_DTYPES.get(dtype, dtype.replace("float", "f")))


def fmt_ratio(ratio: float | None) -> Cell:
    if not ratio:
        return Cell("-", "-")
    return Cell(f"{ratio:.2f}", f"{ratio:.3g}" if ratio < 1000 else f"{ratio:.0f}")


def fmt_time(iso: str | None) -> Cell | str:
    """``2024-06-01T12:34:56Z``; narrow: ``2024-06-01 12:34`` (UTC, as the column says)."""
    return Cell(iso, iso[:16].replace("T", " ")) if iso else "-"


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
