"""How the local tiers are protected against losing a node: the two choices a user writes.

``Replicas(r)``: every chunk a rank holds is also held by r-1 ranks in other failure domains
(storage r×). ``Parity(data=k, parity=m)``: ranks form groups of k+m in distinct failure domains,
and each group's chunks are covered by m Reed-Solomon parity blocks (storage (k+m)/k), so any m
lost domains of a group are rebuilt. The machinery is :mod:`ckpt.peers`.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import ConfigError


@dataclass(frozen=True)
class Replicas:
    """``r`` copies of every chunk in ``r`` failure domains (the rank's own and r-1 peers'). Example::

        ckpt.Checkpointer("s3://b/run", local_dir="/nvme/ckpt", redundancy=ckpt.Replicas(2), persist_every=10)

    Args:
        copies: how many copies, the rank's own included: 2 to 16.

    Raises:
        ConfigError: ``copies`` out of range.
    """

    copies: int = 2

    def __post_init__(self) -> None:
        if type(self.copies) is not int or not 2 <= self.copies <= 16:
            raise ConfigError(f"Replicas(r) needs r from 2 (one copy on a peer) to 16, got {self.copies!r}")


@dataclass(frozen=True)
class Parity:
    """Reed-Solomon parity: groups of ``data + parity`` ranks in distinct failure domains, any
    ``parity`` of which may be lost. Storage ``(data + parity) / data`` of the state. Example::

        ckpt.Checkpointer("s3://b/run", local_dir="/nvme/ckpt", redundancy=ckpt.Parity(data=3, parity=1))

    Args:
        data: ranks of data per group.
        parity: ranks of parity per group: how many of a group's failure domains may be lost.

    Raises:
        ConfigError: either is not a positive integer, or a group would pass 256 ranks.
    """

    data: int
    parity: int = 1

    def __post_init__(self) -> None:
        for name, v in (("data", self.data), ("parity", self.parity)):
            if type(v) is not int or v < 1:
                raise ConfigError(f"Parity({name}=...) must be a positive integer, got {v!r}")
        if self.data + self.parity > 256:
            raise ConfigError(f"Parity(data={self.data}, parity={self.parity}): at most 256 ranks per group")
