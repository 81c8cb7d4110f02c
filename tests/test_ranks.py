"""The coordination round (ckpt.ranks.Round.run) without processes: ranks as threads sharing one
in-memory store that waits as a TCPStore does."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from typing import Any

from ckpt.errors import DistributedSaveError
from ckpt.ranks import Comm, Gathered, LocalComm
from ckpt.save.planning import Inventory, InventoryRow, exchange_plan, fail_plan


class Board:
    """One store shared by the threads of a test: keys, and a condition to wait for them."""

    def __init__(self) -> None:
        self.keys: dict[str, bytes] = {}
        self.changed = threading.Condition()


class BoardComm(Comm):
    """Rank ``rank`` of ``world`` over a :class:`Board` (a get waits for its key until the deadline)."""

    def __init__(self, board: Board, rank: int, world: int, timeout: float):
        self.rank, self.world, self.timeout = rank, world, timeout
        self._agreed = 0
        self.board = board

    def describe(self) -> str:
        return f"rank {self.rank} of {self.world}"

    def _put(self, key: str, value: bytes) -> None:
        with self.board.changed:
            self.board.keys[key] = value
            self.board.changed.notify_all()

    def _get(self, key: str, deadline: float) -> bytes | None:
        with self.board.changed:
            self.board.changed.wait_for(lambda: key in self.board.keys, max(0.0, deadline - time.monotonic()))
            return self.board.keys.get(key)

    def _delete(self, key: str) -> bool:
        with self.board.changed:
            self.board.keys.pop(key, None)
        return True

    def _compare_set(self, key: str, value: bytes) -> bytes:
        with self.board.changed:
            return self.board.keys.setdefault(key, value)

    def _add(self, key: str, amount: int) -> int:
        with self.board.changed:
            n = int(self.board.keys.get(key, b"0")) + amount
            self.board.keys[key] = str(n).encode()
            return n


def in_threads(world: int, fn: Callable[[BoardComm], Any], timeout: float = 1.0,
               ranks: range | list[int] | None = None) -> tuple[dict[int, Any], dict[int, BaseException], Board]:
    """``fn(comm)`` on each of ``ranks`` (default: all) of a group of ``world``: what each returned or raised."""
    board = Board()
    out: dict[int, Any] = {}
    raised: dict[int, BaseException] = {}

    def one(r: int) -> None:
        try:
            out[r] = fn(BoardComm(board, r, world, timeout))
        except BaseException as e:
            raised[r] = e

    threads = [threading.Thread(target=one, args=(r,)) for r in (range(world) if ranks is None else ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out, raised, board


def test_one_call_holds_a_round_every_rank_s_value_or_error_in_one_answer_out():
    def tally(got: Gathered) -> dict:
        return {"sum": sum(got.docs.values()), "errors": got.errors, "missing": got.missing}

    def rank(c: BoardComm) -> Any:
        mine = ValueError("no disk") if c.rank == 2 else c.rank * 10
        return c.round("x", 0).run(mine, tally, what="x")

    out, raised, _ = in_threads(4, rank)
    assert not raised
    # the same answer everywhere, as JSON made it (rank numbers as keys become text on every rank alike)
    assert out == {r: {"sum": 40, "errors": {"2": "ValueError: no disk"}, "missing": []} for r in range(4)}

    def each(c: BoardComm) -> Any:
        return c.round("y", 0).run(c.rank, lambda got: [v + 1 for v in got.ordered()], what="y", each=True)

    out, raised, board = in_threads(3, each)
    assert not raised and out == {0: 1, 1: 2, 2: 3}
    BoardComm(board, 0, 3, 1.0).round("y", 0).cleanup(("posts", "answers"))
    assert board.keys == {}


def test_a_failed_reduction_and_the_coordinator_s_own_error_are_raised_on_every_rank():
    def strict(got: Gathered) -> list:
        got.raise_for("the test")
        return got.ordered()

    def rank(c: BoardComm) -> Any:
        return c.round("z", 0).run(ValueError("bad") if c.rank == 1 else c.rank, strict, what="z")

    out, raised, _ = in_threads(4, rank, timeout=0.2, ranks=[0, 1, 2])  # rank 3 never comes
    assert not out and sorted(raised) == [0, 1, 2]
    for e in raised.values():
        assert isinstance(e, DistributedSaveError) and e.ranks == [1, 3]
        assert "rank 1: ValueError: bad" in str(e) and "rank 3 did not reach the test" in str(e)

    def go(c: BoardComm) -> Any:  # an announcement: only the coordinator's value counts
        return c.round("go", 0).run(KeyError("lease") if c.rank == 0 else None, what="the start")

    out, raised, _ = in_threads(3, go)
    assert isinstance(raised[0], KeyError)  # the coordinator raises its own error
    assert all(isinstance(raised[r], DistributedSaveError) and raised[r].ranks == [0]
               and "the start failed on rank 0: KeyError" in str(raised[r]) for r in (1, 2))


def test_a_dead_rank_is_named_within_the_timeout_and_a_dead_coordinator_after_the_patience():
    timeout = 1.0

    def rank(c: BoardComm) -> Any:
        started = time.monotonic()
        try:
            return c.agree(c.rank)
        finally:
            if c.rank == 0:
                took.append(time.monotonic() - started)

    took: list[float] = []
    out, raised, _ = in_threads(5, rank, timeout=timeout, ranks=[0, 1, 2, 4])  # rank 3 is dead
    assert sorted(raised) == [0, 1, 2, 4] and all(e.ranks == [3] for e in raised.values())  # type: ignore[attr-defined]
    # Named one timeout after the last post, not later: the posts behind it (there from the start)
    # are no progress.
    assert timeout <= took[0] < 1.35 * timeout

    started = time.monotonic()
    out, raised, _ = in_threads(3, rank, timeout=0.2, ranks=[1, 2])  # the coordinator is dead
    assert all(isinstance(e, DistributedSaveError) and e.ranks == [0] for e in raised.values())
    assert time.monotonic() - started >= 0.4  # twice the timeout (plus a little per rank)


def test_a_round_waits_as_long_as_posts_keep_coming():
    """Twelve ranks post one after another, 0.25 s apart, over 2.75 s (more than twice the 1 s timeout);
    the coordinator waits for rank 1, the last, because the posts behind it keep coming, and the
    early ranks, waiting twice the timeout, see its progress and wait on."""
    world = 12

    def rank(c: BoardComm) -> Any:
        if c.rank:  # rank 9 first, rank 1 last
            time.sleep(0.25 * (world - c.rank))  # the ranks' own work, of uneven length
        return c.agree(c.rank, sum)

    out, raised, _ = in_threads(world, rank, timeout=1.0)
    assert not raised and out == {r: sum(range(world)) for r in range(world)}


def test_agreement_rounds_are_counted_per_comm_and_the_previous_one_is_removed():
    out, raised, board = in_threads(2, lambda c: [c.agree({"latest": c.rank}), c.agree(c.rank, max)])
    assert not raised and out == {r: [[{"latest": 0}, {"latest": 1}], 1] for r in (0, 1)}
    assert not any(k.startswith("agree/0/") for k in board.keys)  # round 0 removed once round 1 was gathered
    alone = LocalComm()
    assert alone.agree({"x": 1}) == [{"x": 1}] and alone.agree({"x": 2}) == [{"x": 2}]


def test_proposals_the_first_wins():
    board = Board()
    a, b = BoardComm(board, 0, 2, 1.0), BoardComm(board, 1, 2, 1.0)
    assert b.round("save", 3).peek() is None
    assert a.round("save", 3).propose({"step": 5}) == {"step": 5}
    assert b.round("save", 3).propose({"step": 9}) == {"step": 5}  # the first proposal wins everywhere
    assert b.round("save", 3).peek() == {"step": 5}
    a.round("save", 3).cleanup()
    assert board.keys == {}


def test_a_process_alone_answers_itself():
    alone = LocalComm()
    assert alone.round("r", 0).run(7, lambda got: got.ordered(), what="r") == [7]
    assert alone._store == {}  # nobody to answer: nothing written


def test_a_coordinator_that_fails_before_the_plan_tells_the_ranks_waiting_for_one_at_once():
    inv = Inventory({"m": "d"}, [], [InventoryRow("m/w", "replicated", "float32", [4], [0], [4], 16)])

    def rank(c: BoardComm) -> Any:
        if c.rank == 0:
            return fail_plan(c, 3, ValueError("an unsupported value"))
        return exchange_plan(c, 3, inv)

    started = time.monotonic()
    out, raised, _ = in_threads(3, rank, timeout=30.0)  # the others would wait a minute for a plan
    assert out == {0: None} and time.monotonic() - started < 10
    for r in (1, 2):
        assert isinstance(raised[r], DistributedSaveError) and raised[r].ranks == [0]  # type: ignore[attr-defined]
        assert "save 3's plan failed on rank 0: ValueError: an unsupported value" in str(raised[r])


def test_the_plan_round_sends_digests_and_each_part_the_ranks_share_once():
    """Issue 35 item 5: a rank sends digests of the parts of its inventory the ranks share (per
    top-level key: layout, keys, dtypes, shapes) and its own part compressed (boxes, bytes); the
    coordinator asks in a second round for a part it has not seen, from one rank (here the first of
    the second pipeline stage), and answers each rank compactly. The plan is :func:`assign`'s."""
    import torch

    import ckpt
    from ckpt.flatten import flatten
    from ckpt.save.planning import assign

    def inventory(r: int, stages: int) -> Inventory:
        per = 8 // stages
        layers = range(r // per * 64, r // per * 64 + 64) if stages > 1 else range(64)
        shard = lambda: ckpt.LocalShard(torch.zeros(2, 16), offsets=(2 * (r % per), 0),  # noqa: E731
                                        global_shape=(2 * per, 16))
        return Inventory.of(flatten({"model": {f"l{i}": shard() for i in layers},
                                     "optim": {str(i): {"exp_avg": shard(), "step": torch.tensor(1.0)} for i in layers},
                                     "rng": ckpt.PerRank(torch.full((2,), float(r)))}))

    for stages in (1, 2):
        invs = [inventory(r, stages) for r in range(8)]
        out, raised, board = in_threads(8, lambda c, invs=invs: exchange_plan(c, 0, invs[c.rank], 64 * 1024),
                                        timeout=30.0)
        assert not raised, raised
        direct = assign(invs, 64 * 1024)
        assert [out[r] for r in range(8)] == direct and sum(len(a.write) for a in direct) > 8 * 64 * 2
        sent = {r: len(board.keys[f"plan/0/{r}"]) for r in range(1, 8)}
        whole = len(json.dumps(invs[1].to_json()))
        assert max(sent.values()) * 10 < whole, (sent, whole)  # digests and deflated boxes, not the inventory
        assert max(len(board.keys[f"plan{s}/0/answer/{r}"]) for r in range(1, 8) for s in ("", "-parts")
                   if f"plan{s}/0/answer/{r}" in board.keys) < 300
        parts = {r: json.loads(board.keys[f"plan-parts/0/{r}"])["v"] for r in range(1, 8)
                 if f"plan-parts/0/{r}" in board.keys}
        if stages == 1:  # every rank's parts are the coordinator's: one round
            assert parts == {}
        else:  # the second stage's parts, once, from its first rank
            assert [r for r, p in parts.items() if p] == [4] and sorted(parts[4]) == ["model", "optim"]
