"""Node loss (issue 14): frequent local commits protected by replicas or parity on peers.

Four real gloo ranks on 127.0.0.1, each its own failure domain with its own ``local_dir``; the
checkpoint path (the "remote") is a directory beside them. A node is lost by deleting its tier.
"""

from __future__ import annotations

import hashlib
import os
import shutil

import pytest
import torch

import ckpt
from ckpt import erasure
from ckpt.redundancy import parity_groups, replica_targets
from tests.dist_helpers import run_ranks

ROWS, COLS = 256, 512  # 512 KiB of float32 per rank: 8 chunks of 64 KiB
CHUNK = 64 * 1024


def _state(rank: int, world: int, step: int) -> dict:
    g = torch.Generator().manual_seed(1000 * step + rank)
    local = torch.randn(ROWS, COLS, generator=g)
    return {"w": ckpt.LocalShard(local, (rank * ROWS, 0), (world * ROWS, COLS)),
            "bias": torch.full((16,), float(step)), "step": step}


def _empty(rank: int, world: int) -> dict:
    return {"w": ckpt.LocalShard(torch.zeros(ROWS, COLS), (rank * ROWS, 0), (world * ROWS, COLS)),
            "bias": torch.zeros(16), "step": -1}


def _digest(state: dict) -> str:
    return hashlib.sha256(state["w"].tensor.numpy().tobytes() + state["bias"].numpy().tobytes()).hexdigest()


def _redundancy(kind: str):
    return ckpt.Replicas(2) if kind == "replicas" else ckpt.Parity(data=3, parity=1)


def _ckptr(root: str, rank: int, kind: str, **kw) -> ckpt.Checkpointer:
    return ckpt.Checkpointer(os.path.join(root, "remote"), local_dir=os.path.join(root, f"node{rank}"),
                             redundancy=_redundancy(kind), failure_domain=f"node{rank}", chunk_size=CHUNK,
                             codec="raw", timeout=60, **kw)


def _save_body(rank: int, world: int, root: str, kind: str, steps: list[int], persist_every: int) -> dict:
    out = {}
    with _ckptr(root, rank, kind, persist_every=persist_every, keep_local=2) as c:
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
        assert st is not None
        return {"step": step, "digest": _digest(state), "source": st.source, "peer": st.peer_chunks,
                "rebuilt": st.rebuilt_chunks, "remote": st.remote_chunks, "local": st.local_chunks,
                "state_step": state["step"]}


@pytest.mark.parametrize("kind", ["replicas", "parity"])
def test_wiped_tier_resumes_newest_local_step_from_peers(tmp_path, kind):
    root = str(tmp_path)
    saved = run_ranks(4, _save_body, root, kind, [1, 2, 3, 4, 5], 3)
    assert [saved[0][s]["persisted"] for s in (1, 2, 3, 4, 5)] == [True, False, False, True, False]
    assert all(saved[r][5]["sent"] > 0 for r in range(4))
    committed_remote = sorted(int(n) for n in os.listdir(os.path.join(root, "remote", "steps")))
    assert 5 not in committed_remote or not os.path.exists(
        os.path.join(root, "remote", "steps", f"{5:012d}", "MANIFEST.json"))
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
    assert os.path.exists(os.path.join(root, "node2", "steps", f"{5:012d}", "MANIFEST.json"))  # the tier healed


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
                out = erasure.decode(k, m, have, st.length)
                a, e = members[pos].segment(st.data[mine[0]][1], k)
                rebuilt[a:e] = out[mine[0]][: e - a]
            assert bytes(rebuilt) == datas[pos]
