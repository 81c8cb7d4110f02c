"""The host-memory budget (option ``host_memory``): how many bytes of host memory one rank may hold
for staging, from what the user gave (bytes, or a share of the machine's memory split among the
node's ranks).

:func:`check` is the option's check (no process group needed); :func:`per_rank` the pure rule
that turns a value into bytes per rank; :func:`resolve` finds the machine's memory and the node's
ranks and applies it. The budget caps a save's snapshot (:mod:`ckpt.save.ring`) and a load's staging
(:mod:`ckpt.load.windows`).
"""

from __future__ import annotations

import os
import socket
from typing import TYPE_CHECKING, Any

from .errors import ConfigError

if TYPE_CHECKING:
    from .ranks import Comm

MiB = 1 << 20
MIN_BUDGET = MiB  # a window must hold at least a few rows; less is a typo, not a budget


def machine_memory() -> int:
    """The bytes of memory this machine gives the process: its physical memory, or the cgroup's
    limit (a container's ``memory.max``) where that is lower."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text.isdigit() and 0 < int(text) < total:
            return int(text)
    return total


def check(name: str, v: Any) -> int | float | None:
    """The option's check: None, bytes (an int from 1 MiB to the machine's memory) or a share of
    the machine's memory (a float in (0, 1]); a :class:`~ckpt.errors.ConfigError` naming ``name``
    otherwise."""
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ConfigError(f"{name} must be None, a number of bytes (an int, e.g. 8 << 30) or a share of the "
                          f"machine's memory (a float in (0, 1], e.g. 0.5), got {v!r}")
    if isinstance(v, float):
        if not 0.0 < v <= 1.0:
            raise ConfigError(f"{name} as a float is a share of the machine's memory and must be in (0, 1], got "
                              f"{v!r}; give bytes as an int (e.g. {int(v) if v > 1 else 8 << 30})")
        return v
    total = machine_memory()
    if v < MIN_BUDGET or v > total:
        raise ConfigError(f"{name} must be from 1 MiB to this machine's {total / 2**30:.1f} GiB of memory, got {v} "
                          "bytes")
    return v


def per_rank(value: int | float | None, total: int, local_ranks: int) -> int | None:
    """Bytes of host memory one rank may hold for staging: ``value`` bytes as given, or a share
    ``value`` of ``total`` bytes split among the node's ``local_ranks``; None (no cap) for None.
    Never under 1 MiB. Pure.

    Args:
        value: the option as checked (None, an int of bytes, or a float in (0, 1]).
        total: the machine's memory in bytes.
        local_ranks: the ranks that share this machine (at least 1).

    Returns:
        int | None: bytes per rank.

    Raises:
        ConfigError: ``local_ranks`` below 1.

    Example::

        per_rank(0.5, 64 << 30, 8)  # 4 GiB: half of 64 GiB shared by 8 ranks
    """
    if local_ranks < 1:
        raise ConfigError(f"a node runs at least one rank, got {local_ranks}")
    if value is None:
        return None
    if isinstance(value, float):
        return max(MIN_BUDGET, int(value * total) // local_ranks)
    return int(value)


def local_ranks(comm: Comm) -> int:
    """The ranks sharing this machine. With a process group of several ranks: those whose host name
    is this one's (one round among the ranks); alone: ``LOCAL_WORLD_SIZE`` (torchrun's; processes of
    a node each with their own Checkpointer) where it is set, else 1."""
    if comm.world > 1:
        host = socket.gethostname()
        return max(1, list(comm.agree(host)).count(host))
    env = os.environ.get("LOCAL_WORLD_SIZE", "")
    return int(env) if env.isdigit() and int(env) > 0 else 1


def resolve(value: int | float | None, comm: Comm) -> int | None:
    """The option as bytes per rank on this machine (None: no cap). With a share and several ranks,
    every rank of ``comm`` must call this (it counts the ranks per host in one round)."""
    if value is None:
        return None
    return per_rank(value, machine_memory(), local_ranks(comm) if isinstance(value, float) else 1)
