"""Node loss (issue 14): frequent local commits protected by replicas or parity on peers.

Four real gloo ranks on 127.0.0.1, each its own failure domain with its own ``local_dir``; the
checkpoint path (the "remote") is a directory beside them. A node is lost by deleting its tier.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import signal

import pytest
import torch

import ckpt
from ckpt.peers import erasure
from ckpt.peers.placement import parity_groups, replica_targets
from ckpt.testing import run_ranks

ROWS, COLS = 1024, 512  # a 2 MiB float32 tensor sharded by rows: 8 chunks of 64 KiB per rank of 4
CHUNK = 64 * 1024


def _global(step: int) -> torch.Tensor:
    return torch.randn(ROWS, COLS, generator=torch.Generator().manual_seed(step))


def _rows(rank: int, world: int) -> slice:
    per = ROWS // world
    return slice(rank * per, (rank + 1) * per)


def _state(rank: int, world: int, step: int) -> dict:
    local = _global(step)[_rows(rank, world)].clone()
    return {"w": ckpt.LocalShard(local, (_rows(rank, world).start, 0), (ROWS, COLS)),
            "bias": torch.full((16,), float(step)), "step": step}


def _empty(rank: int, world: int) -> dict:
    return {"w": ckpt.LocalShard(torch.zeros(ROWS // world, COLS), (_rows(rank, world).start, 0), (ROWS, COLS)),
            "bias": torch.zeros(16), "step": -1}


def _digest(state: dict) -> str:
    return hashlib.sha256(state["w"].tensor.numpy().tobytes() + state["bias"].numpy().tobytes()).hexdigest()


def _expected(rank: int, world: int, step: int) -> str:
    return _digest(_state(rank, world, step))


def _redundancy(kind: str):
    return ckpt.Replicas(2) if kind == "replicas" else ckpt.Parity(data=3, parity=1)


def _ckptr(root: str, rank: int, kind: str, **kw) -> ckpt.Checkpointer:
    kw.setdefault("timeout", 60)
    return ckpt.Checkpointer(os.path.join(root, "remote"), local_dir=os.path.join(root, f"node{rank}"),
                             redundancy=_redundancy(kind), failure_domain=f"node{rank}", chunk_size=CHUNK,
                             codec="raw", **kw)


def _save_body(rank: int, world: int, root: str, kind: str, steps: list[int], persist_every: int) -> dict:
    out = {}
    with _ckptr(root, rank, kind, persist_every=persist_every, keep_local=2, keep_last=1) as c:
        for s in steps:
            state = _state(rank, world, s)
            h = c.save(s, state)
            h.wait()
            out[s] = {"digest": _digest(state), "persisted": h.metrics.persisted,
                      "sent": h.metrics.peer_sent_bytes, "stored": h.metrics.peer_stored_bytes}
    return out


def _load_body(rank: int, world: int, root: str, kind: str) -> dict:
    with _ckptr(root, rank, kind, persist_every=3) as c:
        state = _empty(rank, world)
        step = c.load("latest", state)
        st = c.last_load
        assert st is not None and step is not None
        assert _digest(state) == _expected(rank, world, step), f"rank {rank}: wrong bytes for step {step}"
        return {"step": step, "digest": _digest(state), "source": st.source, "peer": st.peer_chunks,
                "rebuilt": st.rebuilt_chunks, "remote": st.remote_chunks, "local": st.local_chunks,
                "state_step": state["step"]}


def _load_alone(remote: str, local: str, step: int, data_of: int | None = None, source: str = "local tiers",
                remote_chunks: int | None = 0) -> None:
    """One process with local commits loads "latest": ``step``, from ``source``, with ``remote_chunks``
    chunks read remotely (None: any), bit-exact with the state saved as step ``data_of`` (default: step)."""
    with ckpt.Checkpointer(remote, local_dir=local, persist_every=2, chunk_size=CHUNK) as c:
        state = _empty(0, 1)
        assert c.load("latest", state) == step
        st = c.last_load
        assert st is not None and st.source == source
        assert remote_chunks is None or st.remote_chunks == remote_chunks, st
        assert _digest(state) == _expected(0, 1, step if data_of is None else data_of)


def _steps(root: str, tier: str) -> list[int]:
    d = os.path.join(root, tier, "steps")
    if not os.path.isdir(d):
        return []
    return sorted(int(n) for n in os.listdir(d) if os.path.exists(os.path.join(d, n, "MANIFEST.json")))


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("kind", ["replicas", "parity"])
def test_wiped_tier_resumes_newest_local_step_from_peers(tmp_path, kind):
    root = str(tmp_path)
    saved = run_ranks(4, _save_body, root, kind, [1, 2, 3, 4, 5], 3)
    assert [saved[0][s]["persisted"] for s in (1, 2, 3, 4, 5)] == [True, False, False, True, False]
    assert all(saved[r][5]["sent"] > 0 and saved[r][5]["stored"] > 0 for r in range(4))  # every rank protects one
    # retention per tier: keep_last=1 on the checkpoint path, keep_local=2 on every node
    assert _steps(root, "remote") == [4]
    assert all(_steps(root, f"node{r}") == [4, 5] for r in range(4))
    listing = _ls(root, [f"node{r}" for r in range(4)])
    assert listing[4]["remote"] and len(listing[4]["local_tiers"]) == 4
    assert not listing[5]["remote"] and len(listing[5]["local_tiers"]) == 4 and listing[5]["local_chunks_held"] == 1
    shutil.rmtree(os.path.join(root, "node2"))
    loaded = run_ranks(4, _load_body, root, kind)
    for r in range(4):
        assert loaded[r]["step"] == 5, loaded[r]
        assert loaded[r]["state_step"] == 5
        assert loaded[r]["digest"] == saved[r][5]["digest"]
        assert loaded[r]["source"] == "local tiers"
        assert loaded[r]["remote"] == 0  # not one chunk from the checkpoint path
    got = loaded[2]["peer"] if kind == "replicas" else loaded[2]["rebuilt"]
    assert got and got > 0
    # node 2's tier was healed behind the load (close() waited for it): its step and chunks are back
    assert os.path.exists(os.path.join(root, "node2", "steps", f"{5:012d}", "MANIFEST.json"))
    again = run_ranks(4, _load_body, root, kind)
    assert again[2]["step"] == 5 and again[2]["peer"] == 0 and again[2]["rebuilt"] == 0 and again[2]["remote"] == 0
    assert again[2]["local"] > 0


def _ls(root: str, tiers: list[str]) -> dict[int, dict]:
    import contextlib
    import io
    import json

    from ckpt import cli

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert cli.main(["ls", os.path.join(root, "remote"), "--json",
                         *[a for t in tiers for a in ("--local", os.path.join(root, t))]]) == 0
    return {d["step"]: d for d in json.loads(buf.getvalue())["steps"]}


def _load_or_error(rank: int, world: int, root: str, fallback: bool) -> dict:
    with _ckptr(root, rank, "replicas", persist_every=3) as c:
        state = _empty(rank, world)
        try:
            step = c.load("latest", state, fallback=fallback)
        except ckpt.CheckpointError as e:
            return {"error": type(e).__name__, "message": str(e)}
        assert step is not None and _digest(state) == _expected(rank, world, step)
        return {"step": step, "remote": c.last_load.remote_chunks}


@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_damaged_replica_fails_the_load_on_every_rank_and_fallback_passes_it(tmp_path):
    """Node 2 is wiped and node 3's copies of its chunks are damaged: the load of the local step fails
    on every rank (none waits for the others), naming the damage; fallback=True ends at the newest
    uploaded step, rank 2's chunks read from the checkpoint path."""
    root = str(tmp_path)
    run_ranks(4, _save_body, root, "replicas", [1, 2, 3, 4, 5], 3)
    mine = {n for d in os.listdir(os.path.join(root, "node2", "chunks"))
            for n in os.listdir(os.path.join(root, "node2", "chunks", d))}
    shutil.rmtree(os.path.join(root, "node2"))
    damaged = 0
    for d in os.listdir(os.path.join(root, "node3", "chunks")):
        for n in set(os.listdir(os.path.join(root, "node3", "chunks", d))) & mine:
            with open(os.path.join(root, "node3", "chunks", d, n), "r+b") as f:
                f.seek(-8, os.SEEK_END)
                f.write(b"\xff" * 8)
            damaged += 1
    assert damaged
    failed = run_ranks(4, _load_or_error, root, False, timeout=120)
    assert all(x.get("error") == "CorruptCheckpointError" for x in failed), failed
    assert all("fallback=True" in x["message"] for x in failed)
    loaded = run_ranks(4, _load_or_error, root, True, timeout=120)
    assert [x.get("step") for x in loaded] == [4] * 4, loaded
    assert loaded[2]["remote"] > 0


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("wiped,expect", [((0, 2), 5), ((1, 2), 4)])
def test_two_wiped_domains_with_two_replicas_give_a_correct_step(tmp_path, wiped, expect):
    """Replicas(2) puts rank i's copy on node i+1: losing nodes 0 and 2 leaves a copy of everything
    (the local step 5 loads); losing 1 and 2 loses rank 1's chunks, so the newest remote step (4) loads."""
    root = str(tmp_path)
    run_ranks(4, _save_body, root, "replicas", [1, 2, 3, 4, 5], 3)
    for r in wiped:
        shutil.rmtree(os.path.join(root, f"node{r}"))
    loaded = run_ranks(4, _load_body, root, "replicas")
    assert [x["step"] for x in loaded] == [expect] * 4  # and every rank's bytes are checked in _load_body
    if expect == 5:
        assert all(x["source"] == "local tiers" and x["remote"] == 0 for x in loaded)
    else:  # step 4 is still in tiers 0 and 3; rank 1's chunks, gone with both its copies, come from the remote
        # (rank 2's come from node 3's replica)
        assert [x["remote"] > 0 for x in loaded] == [False, True, False, False]


def _reshard_save(rank: int, world: int, root: str) -> None:
    with _ckptr(root, rank, "replicas", persist_every=10) as c:
        for s in (1, 2):
            c.save(s, _state(rank, world, s)).wait()


@pytest.mark.multiprocess
@pytest.mark.slow
def test_resharding_load_from_local_tiers(tmp_path):
    """Saved on 2 ranks, loaded on 4: the two new ranks' tiers are empty, and they get their rows from
    the tiers of the ranks that saved them; nothing is read from the checkpoint path."""
    root = str(tmp_path)
    run_ranks(2, _reshard_save, root)
    loaded = run_ranks(4, _load_body, root, "replicas")
    assert [x["step"] for x in loaded] == [2] * 4
    assert all(x["source"] == "local tiers" and x["remote"] == 0 for x in loaded)
    assert loaded[2]["peer"] > 0 and loaded[3]["peer"] > 0


_SAVING = [0]  # the step the killed rank is saving (read by its patched exchange)


def _killed_body(rank: int, world: int, root: str, victim: int) -> dict:
    """Saves 1 and 2 commit; during save 3's replication the victim SIGKILLs itself after storing
    one replica chunk (a real kill, mid-transfer); the others see save 3 fail."""
    from ckpt.peers.exchange import Peers

    if rank == victim:
        original = Peers.exchange

        def exchange(self, plan, read, received, stats, **rounds):
            def dying(src, item, data):
                received(src, item, data)
                if _SAVING[0] >= 3:
                    os.kill(os.getpid(), signal.SIGKILL)

            return original(self, plan, read, dying, stats, **rounds)

        Peers.exchange = exchange  # type: ignore[method-assign]
    c = _ckptr(root, rank, "replicas", persist_every=2, timeout=30)
    out = {}
    for s in (1, 2, 3):
        _SAVING[0] = s
        try:
            c.save(s, _state(rank, world, s)).wait()
            out[s] = "ok"
        except ckpt.CheckpointError as e:
            out[s] = type(e).__name__
    return out


@pytest.mark.multiprocess
@pytest.mark.slow
def test_kill_during_replication_leaves_every_committed_local_step_whole(tmp_path):
    root = str(tmp_path)
    got = run_ranks(4, _killed_body, root, 1, may_die=(1,), timeout=240)
    assert got[1] is None  # the victim died
    for r in (0, 2, 3):
        assert got[r][1] == got[r][2] == "ok" and got[r][3] != "ok", got[r]
    from ckpt.format import manifest as mf
    from ckpt.format import paths
    from ckpt.format.chunk import verify_object
    from ckpt.storage import LocalStorage

    for r in range(4):
        tier = LocalStorage(os.path.join(root, f"node{r}"))
        steps = _steps(root, f"node{r}")
        assert 3 not in steps and steps, (r, steps)
        for s in steps:
            m = mf.read_step(tier, s)
            for h in m.chunks:  # every chunk this tier holds verifies; none is torn
                if tier.exists(paths.chunk_key(h)):
                    verify_object(paths.chunk_key(h), [memoryview(tier.read(paths.chunk_key(h)))])
    loaded = run_ranks(4, _load_body, root, "replicas")
    assert [x["step"] for x in loaded] == [2] * 4  # the newest committed step, from the local tiers
    assert all(x["source"] == "local tiers" for x in loaded)


def _shared_body(rank: int, world: int, root: str, steps: list[int]) -> dict:
    """Two ranks per node, sharing the node's local_dir (the usual layout: one NVMe per node)."""
    node = rank // 2
    with ckpt.Checkpointer(os.path.join(root, "remote"), local_dir=os.path.join(root, f"node{node}"),
                           redundancy=ckpt.Replicas(2), failure_domain=f"node{node}", chunk_size=CHUNK, codec="raw",
                           persist_every=3, keep_local=2, keep_last=1, timeout=60) as c:
        if not steps:
            state = _empty(rank, world)
            step = c.load("latest", state)
            assert step is not None and _digest(state) == _expected(rank, world, step)
            return {"step": step, "source": c.last_load.source, "remote": c.last_load.remote_chunks}
        for s in steps:
            c.save(s, _state(rank, world, s)).wait()
    return {}


@pytest.mark.multiprocess
@pytest.mark.slow
def test_ranks_sharing_a_node_tier_keep_it_to_keep_local(tmp_path):
    """One rank per tier applies its retention and the others' leases do not stop it: the tier holds
    exactly the chunks of its keep_local steps (not every chunk ever written, parked)."""
    from ckpt.reader import Reader
    from ckpt.storage import LocalStorage

    root = str(tmp_path)
    run_ranks(4, _shared_body, root, [1, 2, 3, 4, 5, 6])
    for node in ("node0", "node1"):
        tier = os.path.join(root, node)
        cat = Reader(LocalStorage(tier))
        assert sorted(cat.committed) == [5, 6]
        referenced = set().union(*(cat.manifest(s).chunks.keys() for s in cat.committed))
        chunks = os.path.join(tier, "chunks")
        stored = {n for d in os.listdir(chunks) for n in os.listdir(os.path.join(chunks, d))}
        assert stored == referenced, (node, len(stored), len(referenced))
    shutil.rmtree(os.path.join(root, "node1"))
    loaded = run_ranks(4, _shared_body, root, [])
    assert [x["step"] for x in loaded] == [6] * 4
    assert all(x["source"] == "local tiers" and x["remote"] == 0 for x in loaded)


def _persist_differs_body(rank: int, world: int, root: str) -> str:
    with _ckptr(root, rank, "replicas", persist_every=5) as c:
        c.save(1, _state(rank, world, 1)).wait()
        try:
            c.save(2, _state(rank, world, 2), persist=rank == 0).wait()
        except ckpt.DistributedSaveError as e:
            return str(e)
        return "committed"


@pytest.mark.multiprocess
@pytest.mark.slow
def test_ranks_that_disagree_on_persist_commit_nothing(tmp_path):
    got = run_ranks(4, _persist_differs_body, str(tmp_path))
    assert all("pass the same persist=" in g for g in got), got
    assert _steps(str(tmp_path), "remote") == [1] and all(_steps(str(tmp_path), f"node{r}") == [1] for r in range(4))


def test_options_are_checked_before_anything_is_opened(tmp_path):
    with pytest.raises(ckpt.ConfigError, match="local_dir"):
        ckpt.Checkpointer(str(tmp_path / "r"), redundancy=ckpt.Replicas(2))
    with pytest.raises(ckpt.ConfigError, match="persist_every"):
        ckpt.Checkpointer(str(tmp_path / "r"), persist_every=0, local_dir=str(tmp_path / "l"))
    with pytest.raises(ckpt.ConfigError, match="Replicas"):
        ckpt.Replicas(1)
    with pytest.raises(ckpt.ConfigError, match="Parity"):
        ckpt.Parity(data=0, parity=1)
    with pytest.raises(ckpt.ConfigError, match="redundancy must be"):
        ckpt.Checkpointer(str(tmp_path / "r"), local_dir=str(tmp_path / "l"), redundancy=2)
    with pytest.raises(ckpt.ConfigError, match="2 failure domains"):  # one process is one domain
        ckpt.Checkpointer(str(tmp_path / "r"), local_dir=str(tmp_path / "l"), redundancy=ckpt.Replicas(2))
    assert not os.path.exists(tmp_path / "r") and not os.path.exists(tmp_path / "l")


def test_persist_every_alone_commits_locally_and_uploads_every_nth(tmp_path):
    remote, local = str(tmp_path / "remote"), str(tmp_path / "local")
    with ckpt.Checkpointer(remote, local_dir=local, persist_every=2, keep_local=3, chunk_size=CHUNK) as c:
        handles = [c.save(s, _state(0, 1, s)) for s in (1, 2, 3, 4)]
        c.wait()
        assert [h.metrics.persisted for h in handles] == [True, False, True, False]
        assert c.steps() == [1, 2, 3, 4]
    assert _steps(str(tmp_path), "remote") == [1, 3]
    assert _steps(str(tmp_path), "local") == [2, 3, 4]
    with ckpt.Checkpointer(remote, local_dir=local, persist_every=2, chunk_size=CHUNK) as c:
        assert c.manifest(4).step == 4  # committed in the local tier only, read from there
    _load_alone(remote, local, 4)
    from ckpt import cli

    assert cli.main(["gc", remote, "--local", local, "--keep-local", "1", "--grace", "0"]) == 0
    assert _steps(str(tmp_path), "local") == [4] and _steps(str(tmp_path), "remote") == [1, 3]
    listing = _ls(str(tmp_path), ["local"])
    assert sorted(listing) == [1, 3, 4] and listing[4]["where"].startswith("1/1 local")
    shutil.rmtree(local)  # the node is gone: the newest uploaded step
    with ckpt.Checkpointer(remote, local_dir=local, persist_every=2, chunk_size=CHUNK) as c:
        state = _empty(0, 1)
        assert c.load("latest", state) == 3
        assert c.last_load is not None and c.last_load.source == "checkpoint"
        assert _digest(state) == _expected(0, 1, 3)
        # the next saves, the same data (the first is uploaded, the second is not): the chunks go to the
        # empty tier, not taken as known from the load or the checkpoint path (the tier would hold steps
        # naming chunks it lacks), and nothing is uploaded twice
        first, second = c.save(5, _state(0, 1, 3)), c.save(6, _state(0, 1, 3))
        c.wait()
        assert first.metrics.persisted and not second.metrics.persisted
        assert c.storage.tier_counters().uploaded == 0  # no chunk went to the checkpoint path again
    _load_alone(remote, local, 6, data_of=3)


def test_a_local_only_save_writes_what_only_the_checkpoint_path_has(tmp_path):
    """A chunk the remote has and the tier lacks (the node was replaced) is written into the tier by a
    local-only save that needs it: the step stays loadable from the tier alone."""
    remote, local = str(tmp_path / "remote"), str(tmp_path / "local")
    with ckpt.Checkpointer(remote, local_dir=local, persist_every=2, chunk_size=CHUNK) as c:
        c.save(1, _state(0, 1, 1))
    shutil.rmtree(local)
    with ckpt.Checkpointer(remote, local_dir=local, persist_every=2, chunk_size=CHUNK) as c:
        first, second = c.save(2, _state(0, 1, 2)), c.save(3, _state(0, 1, 1))  # step 3: step 1's data again
        c.wait()
        assert first.metrics.persisted and not second.metrics.persisted
    _load_alone(remote, local, 3, data_of=1)


def test_fallback_past_a_damaged_local_step(tmp_path):
    """A local-only step whose chunk is damaged (and not held elsewhere) fails the load with advice;
    fallback=True loads the newest step that verifies (here the uploaded one)."""
    import glob

    remote, local = str(tmp_path / "remote"), str(tmp_path / "local")
    with ckpt.Checkpointer(remote, local_dir=local, persist_every=2, chunk_size=CHUNK) as c:
        c.save(1, _state(0, 1, 1))
        c.save(2, _state(0, 1, 2))
    old = {os.path.basename(p) for p in glob.glob(os.path.join(remote, "chunks", "*", "*"))}
    victim = next(p for p in sorted(glob.glob(os.path.join(local, "chunks", "*", "*")))
                  if os.path.basename(p) not in old)  # a chunk of step 2 alone
    with open(victim, "r+b") as f:
        f.seek(-8, os.SEEK_END)
        f.write(b"\xff" * 8)
    with ckpt.Checkpointer(remote, local_dir=local, persist_every=2, chunk_size=CHUNK) as c:
        with pytest.raises(ckpt.CorruptCheckpointError, match="fallback=True"):
            c.load("latest", _empty(0, 1))
        state = _empty(0, 1)
        assert c.load("latest", state, fallback=True) == 1
        assert _digest(state) == _expected(0, 1, 1)


def test_chunks_read_from_the_checkpoint_path_heal_the_tier(tmp_path):
    """A tier that lost chunks of an uploaded step loads them from the checkpoint path, and gets them
    back behind the load: the next load reads nothing remotely."""
    import glob

    remote, local = str(tmp_path / "remote"), str(tmp_path / "local")
    with ckpt.Checkpointer(remote, local_dir=local, persist_every=2, chunk_size=CHUNK) as c:
        c.save(1, _state(0, 1, 1))
    chunks = sorted(glob.glob(os.path.join(local, "chunks", "*", "*")))
    lost = chunks[::2]
    assert len(chunks) > 4
    for p in lost:
        os.remove(p)
    for again in (False, True):
        _load_alone(remote, local, 1, remote_chunks=0 if again else len(lost))
        assert all(os.path.exists(p) for p in chunks)  # close() waited for the heal


# -- pure placement and layout -------------------------------------------------------------------

def test_replica_targets_never_share_a_domain():
    domains = ["a", "a", "b", "b", "c", "c"]
    for copies in (2, 3):
        for r, ts in enumerate(replica_targets(domains, copies)):
            assert len(ts) == copies - 1
            assert len({domains[r], *(domains[t] for t in ts)}) == copies
    with pytest.raises(ckpt.ConfigError, match="failure domains"):
        replica_targets(["a", "a"], 2)


def test_parity_groups_span_distinct_domains():
    domains = [f"n{r // 2}" for r in range(8)]  # 4 nodes, 2 ranks each
    groups = parity_groups(domains, 3, 1)
    assert sorted(r for g in groups for r in g) == list(range(8))
    assert all(len({domains[r] for r in g}) == 4 for g in groups)
    with pytest.raises(ckpt.ConfigError, match="multiple"):
        parity_groups(domains[:6], 3, 1)
    with pytest.raises(ckpt.ConfigError, match="distinct"):
        parity_groups(["a"] * 4, 3, 1)


@pytest.mark.parametrize("k,m", [(3, 1), (2, 2), (4, 2)])
def test_parity_layout_rebuilds_any_m_lost_members(k, m):
    import itertools
    import random

    rnd = random.Random(k * 10 + m)
    n = k + m
    datas = [bytes(rnd.getrandbits(8) for _ in range(rnd.randint(0, 3000))) for _ in range(n)]
    members = [erasure.Member(r, [(f"{r:02x}" * 16, len(datas[r]))]) for r in range(n)]
    lay = erasure.GroupLayout.build(0, k, m, members)
    assert all(sum(1 for st in lay.stripes if p in st.parity) == m for p in range(n))
    stored = {}
    for st in lay.stripes:
        blocks = [datas[p][slice(*members[p].segment(q, k))] for p, q in st.data]
        for j in range(m):
            stored[(st.index, j)] = erasure.encode(k, m, blocks, st.length, j) if st.length else b""
    parity_total = sum(len(b) for b in stored.values())
    longest = max(-(-len(d) // k) for d in datas)
    assert parity_total == sum(m * st.length for st in lay.stripes) <= n * m * longest
    equal = erasure.GroupLayout.build(0, k, m, [erasure.Member(r, [("ab" * 16, 3000)]) for r in range(n)])
    assert sum(m * st.length for st in equal.stripes) == 3000 * n * m // k  # storage (k+m)/k of the data
    for lost in itertools.combinations(range(n), m):
        for pos in lost:
            rebuilt = bytearray(len(datas[pos]))
            for st in lay.stripes:
                mine = [b for b, (p, _) in enumerate(st.data) if p == pos]
                if not mine or st.length == 0:
                    continue
                have = {b: datas[p][slice(*members[p].segment(q, k))] for b, (p, q) in enumerate(st.data)
                        if p not in lost}
                have.update({k + j: stored[(st.index, j)] for j, h in enumerate(st.parity) if h not in lost})
                out = erasure.decode(k, m, have, st.length, mine[0])
                a, e = members[pos].segment(st.data[mine[0]][1], k)
                rebuilt[a:e] = out[: e - a]
            assert bytes(rebuilt) == datas[pos]


def test_parity_coded_in_pieces_on_threads_is_the_whole_blocks_code():
    import random

    import zfec

    rnd = random.Random(7)
    k, m, length = 3, 2, 1000
    blocks = [rnd.randbytes(length) for _ in range(k)]
    whole = zfec.Encoder(k, k + m).encode(blocks, (k, k + 1))
    for piece, threads in ((length, 4), (300, 1), (300, 4), (7, 3)):  # one piece, a few (the last short), many
        assert [bytes(erasure.encode(k, m, blocks, length, j, piece, threads)) for j in range(m)] == whole
        have = {0: blocks[0], k: whole[0], k + 1: whole[1]}
        assert bytes(erasure.decode(k, m, have, length, 2, piece, threads)) == blocks[2]
        assert bytes(erasure.decode(k, m, have, length, 1, piece, threads)) == blocks[1]
        assert erasure.decode(k, m, have, length, 0, piece, threads) is blocks[0]  # given: no decoding
