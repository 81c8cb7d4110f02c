"""Where copies and parity go: pure functions of every rank's failure domain."""

from __future__ import annotations

from ..errors import ConfigError


def _domains_order(domains: list[str]) -> tuple[list[str], dict[str, list[int]]]:
    names = sorted(set(domains))
    members: dict[str, list[int]] = {d: [] for d in names}
    for r, d in enumerate(domains):
        members[d].append(r)
    return names, members


def replica_targets(domains: list[str], copies: int) -> list[list[int]]:
    """For each rank, the ranks holding its copies: one in each of the copies-1 domains after its
    own (in sorted order of domain names), the member at the same position within that domain."""
    names, members = _domains_order(domains)
    if len(names) < copies:
        raise ConfigError(f"Replicas({copies}) needs {copies} failure domains; this job has {len(names)} "
                          f"({', '.join(names[:6])}). Run on more nodes, lower r, or set failure_domain= per rank "
                          "where ranks fail separately (tests, containers).")
    out = []
    for r, d in enumerate(domains):
        pos = members[d].index(r)
        di = names.index(d)
        targets = []
        for j in range(1, copies):
            peers = members[names[(di + j) % len(names)]]
            targets.append(peers[pos % len(peers)])
        out.append(targets)
    return out


def parity_groups(domains: list[str], k: int, m: int) -> list[list[int]]:
    """Ranks dealt round-robin over the domains, cut into groups of k+m in distinct domains."""
    n = k + m
    names, members = _domains_order(domains)
    if len(domains) % n:
        raise ConfigError(f"Parity(data={k}, parity={m}) groups ranks by {n}; this job has {len(domains)} rank(s), "
                          f"not a multiple of {n}. Choose data+parity dividing the world size.")
    dealt: list[int] = []
    depth = max(len(v) for v in members.values())
    for i in range(depth):
        dealt += [members[d][i] for d in names if i < len(members[d])]
    groups = [dealt[i: i + n] for i in range(0, len(dealt), n)]
    for g in groups:
        if len({domains[r] for r in g}) < n:
            raise ConfigError(f"Parity(data={k}, parity={m}) needs each group of {n} ranks in {n} distinct failure "
                              f"domains; this job has {len(names)} domain(s) of sizes "
                              f"{sorted(len(v) for v in members.values())}. Use fewer ranks per group or balance "
                              "the domains (failure_domain= overrides the host name).")
    return groups
