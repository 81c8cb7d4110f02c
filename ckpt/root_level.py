"""Is a path the checkpoint root, or a level of one (``runs/exp1/steps``, a step directory) or a
directory holding several roots? Pointed at the wrong level, a Checkpointer found no step
(``load("latest")`` started fresh) and its next save nested a second checkpoint inside the first.

Cheap on object storage: one listing of the path, and at most ``PROBES`` listings of its entries
when it holds no ``steps/`` of its own; never a recursive walk.
"""

from __future__ import annotations

import os
import re

from .errors import NotARootError
from .format import paths
from .storage.base import Storage

PROBES = 8  # entries of a directory checked for being roots themselves
_HEX2 = re.compile(r"^[0-9a-f]{2}$")
_RANK = re.compile(r"^rank-\d+\.json$")


def _parent(where: str, levels: int = 1) -> str:
    """``where`` (a local path or a URL) ``levels`` directories up."""
    if "://" not in where:
        return os.path.normpath(os.path.join(os.path.abspath(where), *[".."] * levels))
    out = where.rstrip("/")
    for _ in range(levels):
        out = out.rsplit("/", 1)[0]
    return out


def _join(where: str, name: str) -> str:
    return os.path.join(where, name) if "://" not in where else f"{where.rstrip('/')}/{name}"


def _basename(where: str) -> str:
    return os.path.basename(os.path.normpath(where)) if "://" not in where else where.rstrip("/").rsplit("/", 1)[-1]


def roots_meant(storage: Storage, where: str) -> tuple[str, list[str]] | None:
    """What ``where`` (opened as ``storage``) is, when it is not a checkpoint root but next to one:
    (what it is, the root or roots meant); None when it is a root, empty, or unrelated."""
    names = storage.list("")
    if not names or paths.STEPS in names:
        return None
    base = _basename(where)
    if paths.MANIFEST in names or any(_RANK.match(n) for n in names):
        return "a step directory", [_parent(where, 2)]
    if base == paths.STEPS and all(paths.STEP_DIR_RE.match(n) for n in names):
        return f"the {paths.STEPS}/ directory", [_parent(where)]
    if base == paths.CHUNKS and all(_HEX2.match(n) for n in names):
        return f"the {paths.CHUNKS}/ directory", [_parent(where)]
    if base in (paths.LEASES, paths.RETIRED) and all(n.endswith(".json") for n in names):
        return f"the {base}/ directory", [_parent(where)]
    if base == paths.JOURNAL and all(paths.JOURNAL_START_RE.match(n) for n in names):
        return f"the {base}/ directory", [_parent(where)]
    roots = [n for n in names[:PROBES] if storage.list(f"{n}/{paths.STEPS}")]
    if roots:
        return "a directory of checkpoint roots", [_join(where, n) for n in roots]
    return None


def wrong_level_message(where: str, what: str, roots: list[str]) -> str:
    if what == "a directory of checkpoint roots":
        return (f"{where} is not a checkpoint root but a directory holding checkpoint roots ({', '.join(roots)}"
                f"{', …' if len(roots) >= PROBES else ''}): pass one of them as the path")
    return (f"{where} is not a checkpoint root but {what} of the root {roots[0]}: pass {roots[0]} as the path "
            "(here, load('latest') would find no step and a save would nest a second checkpoint inside the first)")


def check_root_level(storage: Storage, where: str) -> None:
    """Raise :class:`NotARootError` naming the root(s) meant if ``where`` is a level of a root or a
    directory of roots; nothing is changed."""
    found = roots_meant(storage, where)
    if found is not None:
        what, roots = found
        raise NotARootError(wrong_level_message(where, what, roots), roots=roots)
