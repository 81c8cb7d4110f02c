"""A step's plain values for :meth:`Reader.values`, and the checks of the arguments the reader's
methods share (a step number, key prefixes, a saved rank)."""

from __future__ import annotations

import numbers
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .. import tree as st
from ..errors import ConfigError
from ..format import manifest as mf

if TYPE_CHECKING:
    from .core import Reader


@dataclass(frozen=True)
class Pickled:
    """A value saved with pickle. Readers never unpickle; load it with :meth:`Reader.load_into` and
    ``allow_pickle=True`` if you trust the checkpoint.

    Args:
        path: where the value is in the step (the key path :meth:`Reader.values` gives it under)."""

    path: str


def key_prefixes(keys: str | Sequence[str] | None) -> list[str] | None:
    """``keys`` as a list of key prefixes (None: every key), refused unless a str or strs."""
    if keys is None:
        return None
    if isinstance(keys, str):
        return [keys]
    if isinstance(keys, Iterable) and not isinstance(keys, (bytes, dict)):  # a list, a set, dict.keys(), a generator
        listed = list(keys)
        if all(isinstance(k, str) for k in listed):
            return listed
    raise ConfigError(f"keys must be a key or key prefix (a str such as 'model/') or a list of them, got {keys!r}")


def step_number(step: object) -> int:
    """A step given as a number: an int (numpy's too), never a bool, a float or a numeric string."""
    if isinstance(step, numbers.Integral) and not isinstance(step, bool):
        return int(step)
    hint = ""
    if isinstance(step, str) and step.strip().isdigit():
        hint = f" (pass {int(step)}, not {step!r})"
    elif isinstance(step, float) and step.is_integer():
        hint = f" (pass {int(step)})"
    raise ConfigError(f"a step is an int or 'latest' (or None, the newest), got {step!r}{hint}")


def check_rank(m: mf.Manifest, rank: object) -> int:
    """A saved rank of step ``m`` (whose per-rank state to read), refused before anything is read
    or written when it is not one: a rank past the world size would silently leave that state out."""
    if isinstance(rank, bool) or not isinstance(rank, numbers.Integral):
        raise ConfigError(f"rank must be an int (a saved rank), got {rank!r}")
    rank = int(rank)
    if not 0 <= rank < m.world_size:
        saved = "rank 0 only" if m.world_size == 1 else f"ranks 0 to {m.world_size - 1}"
        raise ConfigError(f"rank {rank} is out of range: step {m.step} was saved on {saved}")
    return rank


def read_values(reader: Reader, m: mf.Manifest, rank: int | None) -> dict[str, Any]:
    """:meth:`Reader.values` of step ``m``: its plain values by key path, pickled ones as :class:`Pickled`."""
    if rank is not None:
        check_rank(m, rank)
    nodes = list(st.value_nodes(m.structure, rank=rank))
    # Tensors inside values (numpy's RNG state is a tuple holding an array): read them too,
    # each from the rank whose value it is.
    def rank_of(path: str) -> int:
        found = re.search(r"\[rank (\d+)\]", path)
        return rank if rank is not None else int(found.group(1)) if found else 0
    wanted: dict[int, set[str]] = {}
    for path, node in nodes:
        wanted.setdefault(rank_of(path), set()).update(st.tensor_keys(node))
    tensors = {r: reader.tensors(m.step, sorted(keys), rank=r) if keys else {} for r, keys in wanted.items()}
    out: dict[str, Any] = {}
    for path, node in nodes:
        def placeholder(_node: dict, where: str = path) -> Pickled:
            return Pickled(where)
        out[path] = st.rebuild(node, tensors[rank_of(path)], allow_pickle=False, on_pickle=placeholder)
    return out
