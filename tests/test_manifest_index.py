"""The step index (format v6, issue 35 item 2): a step saved by several ranks commits MANIFEST.json
as an index naming the rank reports with their sizes and digests; a loading rank reads only the
reports holding boxes it needs, each checked against the index; whole-step tools read them all."""

from __future__ import annotations

import json
import os

import pytest
import torch

import ckpt
from ckpt import cli
from ckpt.errors import CorruptCheckpointError
from ckpt.format import index, paths
from ckpt.format import manifest as mf
from ckpt.storage import LocalStorage
from ckpt.testing import FaultyStorage, run_ranks

ROWS, COLS = 12, 100  # w: 4,800 bytes, over what the index inlines


def full(step: int) -> torch.Tensor:
    return torch.arange(float(ROWS * COLS)).reshape(ROWS, COLS) * step


def rows_of(rank: int, world: int) -> tuple[int, int]:
    per = -(-ROWS // world)
    return min(rank * per, ROWS), min((rank + 1) * per, ROWS)


def saved_state(rank: int, world: int, step: int) -> dict:
    a, b = rows_of(rank, world)
    return {"w": ckpt.LocalShard(full(step)[a:b].clone(), (a, 0), (ROWS, COLS)),
            "b": torch.full((4,), float(step)), "step": step}


def save_body(rank: int, world: int, root: str) -> None:
    with ckpt.Checkpointer(root, keep_last=None) as c:
        for step in (1, 2):
            c.save(step, saved_state(rank, world, step)).wait()


def load_body(rank: int, world: int, root: str, keys: tuple[str, ...]) -> dict:
    a, b = rows_of(rank, world)
    state = {"w": ckpt.LocalShard(torch.zeros(b - a, COLS), (a, 0), (ROWS, COLS)), "b": torch.zeros(4), "step": 0}
    state = {k: v for k, v in state.items() if k in keys}
    disk = FaultyStorage(LocalStorage(root))
    assert ckpt.Checkpointer(root, storage=disk).load(2, state, strict=False) == 2
    reports = sorted(k for op, k in disk.log if op == "read_object" and "/rank-" in k)
    out: dict = {"reports": reports, "w": torch.equal(state["w"].tensor, full(2)[a:b]) if "w" in state else None}
    if "b" in state:
        out["b"] = torch.equal(state["b"], torch.full((4,), 2.0)) and state["step"] == 2
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("index") / "ck")
    run_ranks(2, save_body, root, timeout=120)
    return root


def test_a_two_rank_step_commits_an_index_naming_its_reports(saved):
    storage = LocalStorage(saved)
    doc = json.loads(storage.read_object(paths.manifest_key(2), 1 << 20))
    assert doc["format_version"] == 6 and doc["kind"] == "index"
    inlined = [g[0] for t in doc["tensors"] for segs in t.get("segments", ()) for g in segs]
    assert set(doc["chunks"]) == set(inlined)  # only the inlined tensor's chunk: no step-wide chunk table
    assert [r["key"] for r in doc["reports"]] == [paths.rank_key(2, 0), paths.rank_key(2, 1)]
    for r, ref in enumerate(doc["reports"]):
        data = storage.read_object(ref["key"], 1 << 20)
        assert index.report_ref(2, r, data) == index.ReportRef(ref["key"], ref["size"], ref["digest"])
    whole = mf.read_step(storage, 2)  # the whole step, every report read
    assert whole.format_version == 6 and {t.key for t in whole.tensors} == {"w", "b"}
    w = next(t for t in whole.tensors if t.key == "w")
    assert sorted((s.rank, s.offsets[0]) for s in w.shards) == [(0, 0), (1, 6)]


@pytest.mark.multiprocess
@pytest.mark.parametrize("world", [1, 2, 3])
def test_a_two_rank_step_loads_bit_exact_through_the_index(saved, world):
    for got in run_ranks(world, load_body, saved, ("w", "b", "step"), timeout=120):
        assert got["w"] and got["b"], got


@pytest.mark.multiprocess
def test_a_rank_loading_its_own_shard_reads_only_its_own_report(saved):
    """N -> N: each rank reads the index and its own report; the replicated "b", saved whole by one
    rank and small, is inlined in the index (no other rank's report is read for it)."""
    ix = mf.read_committed(LocalStorage(saved), 2)
    assert isinstance(ix, index.Index)
    inlined = {t.key for t in ix.tensors if t.segments is not None}
    assert inlined == {"b"} and ix.chunks
    for keys in (("w",), ("w", "b", "step")):
        got = run_ranks(2, load_body, saved, keys, timeout=120)
        assert [g["reports"] for g in got] == [[paths.rank_key(2, 0)], [paths.rank_key(2, 1)]], keys
        assert all(g["w"] and g.get("b", True) for g in got), got


def test_a_rank_that_needs_only_inlined_tensors_reads_no_report(saved):
    disk = FaultyStorage(LocalStorage(saved))
    state = {"b": torch.zeros(4), "step": 0}
    with ckpt.Checkpointer(saved, storage=disk) as c:  # closed: its journal is done with `saved` (later tests copy it)
        assert c.load(2, state, strict=False) == 2
    assert torch.equal(state["b"], torch.full((4,), 2.0)) and state["step"] == 2
    assert not [k for op, k in disk.log if op == "read_object" and "/rank-" in k]


def test_an_inlined_tensor_that_differs_from_its_report_is_refused(saved):
    storage = LocalStorage(saved)
    doc = json.loads(storage.read_object(paths.manifest_key(2), 1 << 20))
    entry = next(t for t in doc["tensors"] if "segments" in t)
    segs = entry["segments"][0]
    segs[0][1] += 4  # four bytes further into the chunk: not where its rank saved it
    segs[0][2] -= 4
    segs.append([segs[0][0], 0, 4])
    ix = mf.parse_committed(json.dumps(doc).encode(), name="MANIFEST.json")
    assert isinstance(ix, index.Index)
    owner = ix.layouts[next(t.layout for t in ix.tensors if t.segments is not None)][0][0]
    with pytest.raises(CorruptCheckpointError, match="inlined segments"):
        index.read_reports(storage, ix, [owner])


def tampered_copy(saved: str, tmp_path, edit) -> str:
    import shutil

    root = str(tmp_path / "copy")
    shutil.copytree(saved, root)
    edit(root)
    return root


def test_a_tampered_report_is_refused_naming_it(saved, tmp_path):
    key = paths.rank_key(2, 1)

    def edit(root: str) -> None:
        f = os.path.join(root, key)
        doc = json.loads(open(f).read())
        doc["stats"]["raw_bytes"] += 1  # still a valid report, not the one the index names
        open(f, "w").write(json.dumps(doc, separators=(",", ":")))

    root = tampered_copy(saved, tmp_path, edit)
    with pytest.raises(CorruptCheckpointError, match="rank report .*rank-00001.json is not what its index names") as e:
        mf.read_step(LocalStorage(root), 2)
    assert e.value.object == key
    state = {"w": torch.zeros(ROWS, COLS), "b": torch.zeros(4), "step": 0}
    with pytest.raises(CorruptCheckpointError, match="rank-00001.json"):
        ckpt.Checkpointer(root).load(2, state)
    assert cli.main(["verify", root, "--step", "2"]) != 0


def test_an_index_whose_layout_boxes_overlap_is_refused(saved):
    data = LocalStorage(saved).read_object(paths.manifest_key(2), 1 << 20)
    doc = json.loads(data)
    lay = next(lay for lay in doc["layouts"] if len(lay) == 2)
    lay[1][1][0] -= 1  # rank 1's rows start a row early and end one early: as many elements, two boxes overlap
    with pytest.raises(CorruptCheckpointError, match="do not tile"):
        mf.parse_committed(json.dumps(doc).encode(), name="MANIFEST.json")


def test_verify_and_inspect_read_a_v6_step(saved, capsys):
    assert cli.main(["verify", saved, "--all"]) == 0
    assert cli.main(["inspect", saved, "--step", "2"]) == 0
    out = capsys.readouterr().out
    assert "w" in out
    with ckpt.open(saved) as r:
        t = r.tensors(2)
    assert torch.equal(t["w"], full(2)) and torch.equal(t["b"], torch.full((4,), 2.0))


def test_a_report_whose_boxes_differ_from_its_layout_is_refused(saved):
    data = LocalStorage(saved).read_object(paths.manifest_key(2), 1 << 20)
    doc = json.loads(data)
    lay = next(lay for lay in doc["layouts"] if len(lay) == 2)
    lay[0][0], lay[1][0] = lay[1][0], lay[0][0]  # the ranks' boxes swapped: still a tiling, not what they saved
    ix = mf.parse_committed(json.dumps(doc).encode(), name="MANIFEST.json")
    assert isinstance(ix, index.Index)
    with pytest.raises(CorruptCheckpointError, match="rank-00000.json does not match its index at tensor 'w'"):
        index.read_reports(LocalStorage(saved), ix, [0])


def test_the_commit_refuses_an_index_over_the_readers_cap(saved, monkeypatch):
    storage = LocalStorage(saved)
    ix = mf.read_committed(storage, 2)
    assert isinstance(ix, index.Index)
    parts = list(index.read_reports(storage, ix, [0, 1]).values())
    data = ix.to_json()
    monkeypatch.setattr(mf, "MAX_MANIFEST_BYTES", len(data))
    assert index.committable(2, ix, parts) == data
    monkeypatch.setattr(mf, "MAX_MANIFEST_BYTES", len(data) - 1)
    with pytest.raises(ckpt.ManifestTooLargeError, match="step 2 was not committed"):
        index.committable(2, ix, parts)


def test_an_inlined_chunk_claiming_more_than_its_rank_saved_is_refused(saved):
    doc = json.loads(LocalStorage(saved).read_object(paths.manifest_key(2), 1 << 20))
    h = next(iter(doc["chunks"]))
    doc["chunks"][h][0] = 1 << 33  # a reader would allocate 8 GiB to decode it
    doc.pop("spans", None)
    with pytest.raises(CorruptCheckpointError, match=f"chunk {h} claims {1 << 33} bytes, more than rank"):
        mf.parse_committed(json.dumps(doc).encode(), name="MANIFEST.json")
