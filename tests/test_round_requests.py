"""What coordination costs the store: requests per rank per round, counted on a real TCPStore under
real gloo ranks, for saves and loads (issue 35: every rank reading every rank's post was N² a round)."""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any

import pytest
import torch

import ckpt
from ckpt.ranks import StoreComm
from ckpt.testing import run_ranks

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]  # spawns processes and takes more than a few seconds

WORLD = 8
# What each call costs the store's server: TCPStore's client sends a get as a wait for the key and a read.
COST = {"get": 2, "multi_get": 2}
CALLS = {"set", "get", "wait", "check", "compare_set", "add", "delete_key", "multi_get", "multi_set"}


class Counted:
    """The real store of one thread, counting its requests by round (``<name>/<seq>``, from the key)."""

    def __init__(self, store: Any, tally: Counter, lock: threading.Lock):
        self._store, self._tally, self._lock = store, tally, lock

    def __getattr__(self, name: str) -> Any:
        call = getattr(self._store, name)
        if name not in CALLS:
            return call

        def counted(keys: str | list[str], *args: Any, **kw: Any) -> Any:
            first = keys if isinstance(keys, str) else keys[0]
            with self._lock:
                self._tally["/".join(first.split("/")[:2])] += COST.get(name, 1)
            return call(keys, *args, **kw)

        return counted


class CountingComm(StoreComm):
    tally: Counter
    lock: threading.Lock

    @property
    def store(self) -> Any:
        return Counted(StoreComm.store.fget(self), self.tally, self.lock)  # type: ignore[attr-defined]


def _saves_and_loads(rank: int, world: int, root: str) -> dict[str, int]:
    torch.manual_seed(0)  # the same replicated module on every rank
    ckptr = ckpt.Checkpointer(root, timeout=60)
    comm = ckptr._comm
    comm.__class__ = CountingComm
    comm.tally, comm.lock = Counter(), threading.Lock()  # type: ignore[attr-defined]
    state = {"m": torch.nn.Linear(3, 2), "mine": ckpt.PerRank(torch.full((2,), float(rank)))}
    ckptr.save(1, state).wait()
    state["mine"] = ckpt.PerRank(torch.full((2,), float(rank + 10)))
    ckptr.save(2, state).wait()  # the plan is cached: a go and a commit round
    back = {"m": torch.nn.Linear(3, 2), "mine": ckpt.PerRank(torch.zeros(2))}
    assert ckptr.load("latest", back) == 2
    assert back["mine"].value.tolist() == [rank + 10.0] * 2
    # Rank 0's state does not fit (checked before its reads): it answers the others' round at once,
    # and every rank fails naming it.
    misfit = {"m": torch.nn.Linear(3, 3 if rank == 0 else 2), "mine": ckpt.PerRank(torch.zeros(2))}
    with pytest.raises(ckpt.CheckpointError) as e:
        ckptr.load("latest", misfit)
    assert rank == 0 or "rank(s) [0] could not load step 2" in str(e.value), e.value
    ckptr.close()
    return dict(comm.tally)  # type: ignore[attr-defined]


def test_each_round_costs_a_rank_at_most_four_requests_and_the_coordinator_o_of_n(tmp_path):
    tallies = run_ranks(WORLD, _saves_and_loads, str(tmp_path / "ck"))
    rounds = sorted(set().union(*tallies))
    kinds = Counter(r.split("/")[0] for r in rounds)
    assert kinds == {"plan": 1, "go": 2, "commit": 2, "agree": 6}, rounds  # a load agrees three times
    for rnd in rounds:
        others = {r: tallies[r].get(rnd, 0) for r in range(1, WORLD)}
        assert max(others.values()) <= 4, (rnd, others)
        coordinator = tallies[0].get(rnd, 0)  # a wait and a get for each rank's post, its answers, cleanup
        assert coordinator <= 5 * WORLD, (rnd, coordinator)
        assert coordinator + sum(others.values()) <= 9 * WORLD, rnd
