"""What the design doc and the docstrings say about the package's modules is true: docs/design.md's
module table names every module under ckpt/ and no other, and every `ckpt.something` a docstring or a
doc cites can be imported."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "ckpt"
DESIGN = ROOT / "docs" / "design.md"

# Keys of the safetensors metadata an export writes, spelled like modules in the docs that describe them;
# test_metadata_keys_cited_are_what_export_writes keeps this list to keys the export really writes.
METADATA_KEYS = {"ckpt.values", "ckpt.values.tagged", "ckpt.step", "ckpt.source", "ckpt.rank"}


def module_table() -> dict[str, int]:
    """The entries of design.md's module table (the table under the header ``| layer | module | owns |``):
    each backquoted path in its module column, relative to ckpt/ (``format/chunk.py``, a package as
    ``storage/``), with the line it is on."""
    entries: dict[str, int] = {}
    in_table = False
    for n, line in enumerate(DESIGN.read_text(encoding="utf-8").splitlines(), 1):
        if line.startswith("| layer | module |"):
            in_table = True
            continue
        if in_table and not line.startswith("|"):
            break
        if in_table:
            cells = line.split("|")
            if len(cells) > 2:
                for path in re.findall(r"`([^`]+)`", cells[2]):
                    entries[path] = n
    assert entries, f"{DESIGN} has no module table (a table whose header is '| layer | module | owns |')"
    return entries


def package_modules() -> list[str]:
    """Every module file under ckpt/, relative to it, less the packages' ``__init__.py`` (a package's
    row names it as ``storage/``, or its modules one by one)."""
    return sorted(p.relative_to(PKG).as_posix() for p in PKG.rglob("*.py") if p.name != "__init__.py")


def test_the_module_table_names_every_module_and_no_other():
    table = module_table()
    packages = {p for p in table if p.endswith("/")}
    missing = [m for m in package_modules() if m not in table and not any(m.startswith(p) for p in packages)]
    assert not missing, ("docs/design.md's module table lacks " + ", ".join(f"ckpt/{m}" for m in missing)
                         + ": add each, backquoted as `" + missing[0] + "`, to the module column of its layer's row "
                         "(or a row of its own: | | `" + missing[0] + "` | what it owns |)")
    stale = [f"`{p}` (line {n})" for p, n in table.items() if not (PKG / p).exists()]
    assert not stale, f"docs/design.md's module table names modules that do not exist under ckpt/: {', '.join(stale)}"


CITED = re.compile(r"`(ckpt(?:\.[A-Za-z_]\w*)+)")  # `ckpt.x.y`, ``ckpt.x``, :mod:`ckpt.x`


def cites() -> list[tuple[str, int, str]]:
    """(file, line, dotted name) of every backquoted ``ckpt.…`` in the package's sources (docstrings and
    comments), docs/*.md and README.md."""
    files = [*sorted(PKG.rglob("*.py")), *sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md"]
    out = []
    for f in files:
        for n, line in enumerate(f.read_text(encoding="utf-8").splitlines(), 1):
            out += [(f.relative_to(ROOT).as_posix(), n, m.group(1)) for m in CITED.finditer(line)]
    return out


def resolves(name: str) -> bool:
    """``name`` is a module, or an attribute (chain) of the longest module prefix of it."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        module = ".".join(parts[:i])
        try:
            obj = importlib.import_module(module)
        except ModuleNotFoundError as e:
            if e.name is not None and (module == e.name or module.startswith(e.name + ".")):
                continue  # this prefix is no module: try a shorter one
            raise  # a module that exists and fails to import: not a stale citation, a bug
        for attr in parts[i:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def test_every_cited_module_and_name_exists():
    found = cites()
    assert len(found) > 20  # the scan sees the citations (the package's docstrings cite many)
    stale = [f"{f}:{n}: `{name}`" for f, n, name in found if name not in METADATA_KEYS and not resolves(name)]
    assert not stale, "stale citations (no such module or name):\n" + "\n".join(stale)


def test_metadata_keys_cited_are_what_export_writes():
    written = "".join(p.read_text(encoding="utf-8") for p in (PKG / "reader").glob("export*.py"))
    assert {k for k in METADATA_KEYS if f'"{k}"' not in written} == set()
