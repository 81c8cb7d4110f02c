"""How many CPUs this process may use, for sizing thread pools.

``os.cpu_count()`` counts the machine's cores. A job pinned to some of them (``taskset``, a cpuset,
a container's CPU set, a scheduler's slot) or capped by a cgroup quota (a container's ``--cpus``, a
Kubernetes limit) runs on fewer, and threads beyond those only take turns: reads from the page
cache then evict each other's pieces before they are hashed, and encoders contend for the same
cores as the training's own threads.
"""

from __future__ import annotations

import functools
import math
import os


@functools.lru_cache(maxsize=1)
def usable() -> int:
    """The CPUs this process may run on (its affinity), at most its cgroup v2 quota, at least 1."""
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        n = os.cpu_count() or 1
    quota = _cgroup_quota()
    if quota is not None:
        n = min(n, quota)
    return max(1, n)


def _cgroup_quota(path: str = "/sys/fs/cgroup/cpu.max") -> int | None:
    """CPUs a cgroup v2 ``cpu.max`` allows (``"<quota> <period>"``, rounded up), None where unlimited
    or not readable."""
    try:
        with open(path) as f:
            quota, period = f.read().split()[:2]
        return None if quota == "max" else max(1, math.ceil(int(quota) / int(period)))
    except (OSError, ValueError):
        return None
