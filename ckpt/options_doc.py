"""The documentation of the options, made from the fields themselves: each option's meaning is written once,
next to its default and its check in :mod:`ckpt.options`, and both :class:`~ckpt.options.Options`'s docstring
and the option table of docs/api.md are made from there (a test keeps docs/api.md equal to what this makes).

``python -m ckpt.options_doc`` prints the table; ``python -m ckpt.options_doc --write docs/api.md`` puts it in
place, between the two marker lines.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys
import textwrap
from typing import Any

BEGIN = "<!-- options: made by `python -m ckpt.options_doc --write docs/api.md` from ckpt/options.py; do not edit -->"
END = "<!-- end of options -->"


def shown(value: Any) -> str:
    """A default as the docs write it: integral floats without their ``.0``."""
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    if isinstance(value, str):
        return f'"{value}"'
    return repr(value)


def rows() -> list[tuple[str, str, str]]:
    """(name, default as shown, meaning in markdown) of every option, in the order of their groups, then the
    arguments of ``Checkpointer`` that are not options."""
    from .options import CHECKPOINTER_ARGS, Options
    out = []
    for f in dataclasses.fields(Options):
        default = f.metadata["shown"] or shown(f.default)
        out.append((f.name, default, f.metadata["doc"]))
    out.extend((name, default, doc) for name, (default, doc) in CHECKPOINTER_ARGS.items())
    return out


def _plain(markdown: str) -> str:
    """Markdown for a docstring: a link becomes its text; code keeps its backquotes (doubled, as reST writes it)."""
    text = re.sub(r"\[([^\]]+)\]\([^)]*\)", r"\1", markdown)
    return re.sub(r"`([^`]+)`", r"``\1``", text)


def docstring(intro: str, fields: list[dataclasses.Field]) -> str:
    """``intro`` then one paragraph per field, ``name: meaning`` (the form of an Args section)."""
    parts = [intro.rstrip(), "", "    Args:"]
    for f in fields:
        default = f.metadata["shown"] or shown(f.default)
        parts.append(textwrap.fill(f"{f.name}: {_plain(f.metadata['doc'])} (default {default}).",
                                   width=110, initial_indent="        ", subsequent_indent="            "))
    return "\n".join(parts) + "\n"


def table() -> str:
    """The signature line and the option table of docs/api.md, between the markers."""
    rs = rows()
    args = [f"{name}={default}" for name, default, _ in rs]
    lines = [BEGIN, f"**`Checkpointer(path, *, {', '.join(args)})`**", "", "| option | default | meaning |",
             "|---|---|---|"]
    for name, default, doc in rs:
        cell = doc.replace("|", "\\|")
        lines.append(f"| `{name}` | `{default}` | {cell} |")
    lines.append(END)
    return "\n".join(lines) + "\n"


def replace_in(text: str, block: str) -> str:
    """``text`` with what lies between the markers (markers included) replaced by ``block``."""
    try:
        a = text.index(BEGIN)
        b = text.index(END, a) + len(END) + 1
    except ValueError:
        raise SystemExit("the option table's markers are missing: put the two marker lines where the table "
                         "goes") from None
    return text[:a] + block + text[b:]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ckpt.options_doc", description=__doc__.split("\n\n")[0])
    p.add_argument("--write", metavar="FILE.md", help="replace the table between the markers of FILE.md")
    a = p.parse_args(argv)
    block = table()
    if a.write is None:
        sys.stdout.write(block)
        return 0
    with open(a.write, encoding="utf-8") as f:
        text = f.read()
    with open(a.write, "w", encoding="utf-8") as f:
        f.write(replace_in(text, block))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
