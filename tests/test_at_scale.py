"""Issue 35 under real gloo ranks, counted on each rank's storage: a load lists the checkpoint once, on
the coordinator (item 7), and a rank reads AdamW's 0-d ``step`` tensors (small, replicated: every
rank holds them) from at most two chunks of other ranks, not one chunk of every rank (item 6)."""

from __future__ import annotations

import pytest
import torch

import ckpt
from ckpt.errors import StorageError
from ckpt.format import paths
from ckpt.storage import LocalStorage
from ckpt.testing import FaultyStorage, run_ranks

pytestmark = pytest.mark.multiprocess

WORLD, PARAMS, ROWS = 4, 40, 1024
READS = ("read", "readv", "read_object")


def _state(rank: int, fill: bool) -> dict:
    """A sharded model and its optimizer state, as FSDP2 and AdamW hold it: per parameter a row shard
    (32 KiB: half a chunk, so it has chunks of its own), its moment and a replicated 0-d ``step``."""
    def shard(i: int, moment: int) -> ckpt.LocalShard:
        value = 1000.0 * rank + 10 * i + moment if fill else 0.0
        return ckpt.LocalShard(torch.full((ROWS, 8), value), offsets=(rank * ROWS, 0), global_shape=(WORLD * ROWS, 8))

    return {"model": {f"w{i}": shard(i, 0) for i in range(PARAMS)},
            "optim": {str(i): {"exp_avg": shard(i, 1), "step": torch.tensor(float(i) if fill else -1.0)}
                      for i in range(PARAMS)}}


def _save_and_load(rank: int, world: int, root: str) -> dict:
    disk = FaultyStorage(LocalStorage(root))
    ckptr = ckpt.Checkpointer(root, storage=disk, chunk_size=64 * 1024, timeout=30)
    ckptr.save(1, _state(rank, True)).wait()
    ckptr.save(2, _state(rank, True)).wait()
    wrote = {k for op, k in disk.log if op in ("create", "write") and paths.is_chunk_key(k)}
    disk.reset_counts()
    back = _state(rank, False)
    assert ckptr.load("latest", back) == 2
    assert all(back["optim"][str(i)]["step"].item() == i for i in range(PARAMS))
    assert back["model"]["w3"].tensor.eq(1000.0 * rank + 30).all()
    log = list(disk.log)
    # The coordinator's listing fails: every rank raises its error, of the same class, and lists nothing.
    broken = FaultyStorage(LocalStorage(root))
    if rank == 0:
        broken.fail("list")
    other = ckpt.Checkpointer(root, storage=broken, timeout=30)
    broken.reset_counts()  # what opening it did (a look at the root's levels) is not the load's
    with pytest.raises(StorageError, match="injected failure: list"):
        other.load("latest", _state(rank, False))
    other.close()
    ckptr.close()
    return {"wrote": wrote, "log": log, "broken": list(broken.log)}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_ranks(WORLD, _save_and_load, str(tmp_path_factory.mktemp("scale") / "ck"))


def test_a_load_lists_the_checkpoint_once_on_the_coordinator(ranks):
    """Item 7: only rank 0 lists ``steps/`` and HEADs the step manifests; the others take its answer
    from the load's first round (O(1) listing requests a load, not O(N))."""
    def listing(log: list[tuple[str, str]]) -> list[tuple[str, str]]:
        return [(op, k) for op, k in log if op in ("list", "root_state") or (op == "exists" and "MANIFEST" in k)]

    assert ("list", paths.STEPS) in listing(ranks[0]["log"])
    for r in range(1, WORLD):
        assert listing(ranks[r]["log"]) == [] and listing(ranks[r]["broken"]) == [], r


def test_a_rank_reads_the_replicated_steps_from_at_most_two_chunks_of_other_ranks(ranks):
    """Item 6: the 0-d steps are packed (one pack, its own chunk) instead of spread one per rank,
    so a rank reads at most two chunks of other ranks for them; its own shards it reads from its own."""
    writer = {k: r for r, got in enumerate(ranks) for k in got["wrote"]}
    for r, got in enumerate(ranks):
        read = {k for op, k in got["log"] if op in READS and paths.is_chunk_key(k)}
        others = {k for k in read if writer[k] != r}
        assert len(others) <= 2, (r, sorted(writer[k] for k in others))
        assert read - others, r  # its shards' chunks, which it wrote
    assert sum(1 for got in ranks for k in got["wrote"]) == len(writer)  # no chunk written by two ranks
