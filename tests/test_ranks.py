"""The coordination round (ckpt.ranks.Round) without processes: ranks sharing one dictionary store."""

from __future__ import annotations

import threading

import pytest

from ckpt.errors import DistributedSaveError
from ckpt.ranks import Comm, LocalComm


class DictComm(Comm):
    """Rank ``rank`` of ``world`` over a dictionary shared by the ranks of one test (no waiting)."""

    def __init__(self, store: dict[str, bytes], rank: int, world: int, timeout: float = 0.01):
        self.rank, self.world, self.timeout = rank, world, timeout
        self._agreed = 0
        self.store = store
        self.lock = threading.Lock()

    def describe(self) -> str:
        return f"rank {self.rank} of {self.world}"

    def _put(self, key: str, value: bytes) -> None:
        self.store[key] = value

    def _get(self, key: str, deadline: float) -> bytes | None:
        return self.store.get(key)

    def _delete(self, key: str) -> bool:
        self.store.pop(key, None)
        return True

    def _compare_set(self, key: str, value: bytes) -> bytes:
        return self.store.setdefault(key, value)


def ranks(world: int) -> list[DictComm]:
    store: dict[str, bytes] = {}
    return [DictComm(store, r, world) for r in range(world)]


def test_a_round_gathers_every_post_and_names_the_missing_ranks():
    comms = ranks(3)
    for c in comms[:2]:
        c.round("x", 7).post({"v": c.rank})
    got = comms[0].round("x", 7).gather(comms[0].deadline())
    assert got.docs == {0: {"v": 0}, 1: {"v": 1}} and got.missing == [2]
    with pytest.raises(DistributedSaveError) as e:
        got.raise_for("x", 1.0, lambda d: "broken" if d["v"] == 1 else None)
    assert e.value.ranks == [1, 2] and "rank 1: broken" in str(e.value) and "rank 2 did not reach x" in str(e.value)


def test_answers_proposals_and_cleanup():
    a, b = ranks(2)
    rnd = a.round("plan", 0)
    rnd.post({"inv": 1})
    rnd.answer({"to": 1}, to=1)
    assert b.round("plan", 0).wait_answer(b.deadline(), to=1) == {"to": 1}
    assert b.round("save", 3).peek() is None
    assert a.round("save", 3).propose({"step": 5}) == {"step": 5}
    assert b.round("save", 3).propose({"step": 9}) == {"step": 5}  # the first proposal wins everywhere
    rnd.cleanup(("posts", "answers"))
    a.round("save", 3).cleanup()
    assert a.store == {}


def test_agreement_rounds_are_counted_per_comm_and_the_previous_one_is_removed():
    a, b = ranks(2)
    for c in (a, b):
        c.round("agree", 0).post({"latest": c.rank})
    assert a.agree({"latest": 0}) == [{"latest": 0}, {"latest": 1}]
    with pytest.raises(DistributedSaveError) as e:  # rank 1 never reaches the second round
        a.agree({"latest": 0})
    assert e.value.ranks == [1]
    alone = LocalComm()
    assert alone.agree({"x": 1}) == [{"x": 1}] and alone.agree({"x": 2}) == [{"x": 2}]
    assert not any(k.startswith("agree/0/") for k in alone._store)  # round 0 removed once round 1 was gathered
