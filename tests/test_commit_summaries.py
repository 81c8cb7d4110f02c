"""Rank 0's commit from the ranks' summaries (issue 35 item 4): the step's layout is learned from the
rank reports once, each later save reads none of them, the index it commits is the one merging every
report gives, a step no reader would load still never commits, and the caches are bounded by bytes."""

from __future__ import annotations

import dataclasses
import json
import threading

import pytest
import torch

import ckpt
from ckpt.errors import CorruptCheckpointError
from ckpt.format import index, paths
from ckpt.format import manifest as mf
from ckpt.format.entries import Shard
from ckpt.save.commit_index import IndexBuilder, layout_digest, summarize
from ckpt.save.commit_plan import PlanLayout, boxes_digest
from ckpt.storage import LocalStorage
from ckpt.testing import FaultyStorage, run_ranks

ROWS, COLS = 12, 100


def full(step: int) -> torch.Tensor:
    return torch.arange(float(ROWS * COLS)).reshape(ROWS, COLS) * step


def state(rank: int, world: int, step: int) -> dict:
    per = -(-ROWS // world)
    a, b = min(rank * per, ROWS), min((rank + 1) * per, ROWS)
    return {"w": ckpt.LocalShard(full(step)[a:b].clone(), (a, 0), (ROWS, COLS)),
            "b": torch.full((4,), float(step)), "step": step, "rng": ckpt.PerRank({"seed": rank})}


def save_body(rank: int, world: int, root: str) -> dict:
    disk = FaultyStorage(LocalStorage(root))
    reads = []
    with ckpt.Checkpointer(root, storage=disk, keep_last=2) as c:
        for step in (1, 2, 3, 4):
            before = len(disk.log)
            c.save(step, state(rank, world, step)).wait()
            reads.append(sum(1 for op, k in disk.log[before:] if op == "read_object" and "/rank-" in k))
    got = {"w": ckpt.LocalShard(torch.zeros_like(state(rank, world, 0)["w"].tensor),
                                state(rank, world, 0)["w"].offsets, (ROWS, COLS)),
           "b": torch.zeros(4), "step": 0, "rng": ckpt.PerRank({"seed": -1})}
    assert ckpt.Checkpointer(root).load("latest", got) == 4
    return {"reads": reads, "w": torch.equal(got["w"].tensor, state(rank, world, 4)["w"].tensor),
            "b": got["b"].tolist(), "step": got["step"], "seed": got["rng"].value["seed"]}


def test_rank_0_reads_the_reports_once_per_plan_and_later_saves_read_none(tmp_path):
    root = str(tmp_path / "ck")
    out = run_ranks(3, save_body, root, timeout=150)
    assert out[0]["reads"] == [0, 0, 0, 0]  # the first save takes the layout from the plan round
    for r, got in enumerate(out):
        assert got["w"] and got["b"] == [4.0] * 4 and got["step"] == 4 and got["seed"] == r
    storage = LocalStorage(root)
    assert mf.committed_steps(storage) == [3, 4]  # retention ran from the chunk names the commit kept
    whole = mf.read_step(storage, 4)  # every chunk a kept step names is still there
    assert all(storage.exists(paths.chunk_key(h)) for h in whole.chunks)
    # the layout the plan gave is the one merging the reports gives (each report also checked against it)
    data = [bytes(mf.read_rank_bytes(storage, 4, r)) for r in range(3)]
    parts = [mf.parse_rank_part(d, 4, r) for r, d in enumerate(data)]
    refs = [index.report_ref(4, r, d) for r, d in enumerate(data)]
    merged = index.build(mf.merge(4, parts, frozenset({"rng"})), refs)
    ix = index.parse_doc(json.loads(bytes(storage.read_object(paths.manifest_key(4), 1 << 30))), "MANIFEST.json")
    assert by_tensor(ix) == by_tensor(merged) and len(by_tensor(ix)) == 2
    index.committable(4, ix, parts)


def per_rank_tensor_body(rank: int, world: int, root: str) -> dict:
    disk = FaultyStorage(LocalStorage(root))
    reads = []
    with ckpt.Checkpointer(root, storage=disk, keep_last=None) as c:
        for step in (1, 2):
            before = len(disk.log)
            mine = ckpt.PerRank({"t": torch.full((3,), float(rank + step))})
            c.save(step, {"w": state(rank, world, step)["w"], "mine": mine}).wait()
            reads.append(sum(1 for op, k in disk.log[before:] if op == "read_object" and "/rank-" in k))
    got = {"w": ckpt.LocalShard(torch.zeros_like(state(rank, world, 0)["w"].tensor),
                                state(rank, world, 0)["w"].offsets, (ROWS, COLS)),
           "mine": ckpt.PerRank({"t": torch.zeros(3)})}
    assert ckpt.Checkpointer(root).load("latest", got) == 2
    return {"reads": reads, "t": got["mine"].value["t"].tolist()}


def test_per_rank_tensors_take_their_layout_from_the_plan_too(tmp_path):
    out = run_ranks(2, per_rank_tensor_body, str(tmp_path / "ck"), timeout=120)
    assert out[0]["reads"] == [0, 0] and [o["t"] for o in out] == [[2.0] * 3, [3.0] * 3]
    ix = index.parse_doc(json.loads(bytes(LocalStorage(str(tmp_path / "ck")).read_object(paths.manifest_key(2),
                                                                                          1 << 30))), "MANIFEST.json")
    assert {(k, r) for k, r, *_ in by_tensor(ix)} >= {("mine/t", 0), ("mine/t", 1)}


def by_tensor(ix: index.Index) -> dict:
    return {(e.key, e.rank, e.dtype, e.shape): ix.layouts[e.layout] for e in ix.tensors}


def test_the_layout_from_the_plan_is_taken_only_where_every_rank_summarized_it(saved):
    parts, data = reports(saved)
    per_rank = frozenset({"rng"})
    sums = [summarize(p, d, per_rank) for p, d in zip(parts, data)]
    learner, read = IndexBuilder(), []
    want, _ = learner.build(1, parts[0], sums, per_rank, lambda r: read.append(r) or data[r])
    assert read == [1] and learner.learned == 1
    planned = PlanLayout(learner.tensors, learner.layouts, [s["boxes"] for s in sums])
    builder = IndexBuilder()
    ix, _ = builder.build(1, parts[0], sums, per_rank, lambda r: read.append(r) or data[r], plan=lambda: planned)
    assert read == [1] and (builder.planned, builder.learned) == (1, 0) and by_tensor(ix) == by_tensor(want)
    # a rank whose report does not hold the pairs the plan says it writes: the reports are read
    wrong = dataclasses.replace(planned, digests=[planned.digests[0], "0" * 16])
    builder = IndexBuilder()
    ix, _ = builder.build(1, parts[0], sums, per_rank, lambda r: read.append(r) or data[r], plan=lambda: wrong)
    assert read == [1, 1] and (builder.planned, builder.learned) == (0, 1) and by_tensor(ix) == by_tensor(want)
    # a plan that cannot say the layout (None) reads them too
    builder = IndexBuilder()
    builder.build(1, parts[0], sums, per_rank, lambda r: read.append(r) or data[r], plan=lambda: None)
    assert read == [1, 1, 1] and builder.learned == 1
    assert [s["boxes"] for s in sums] == [boxes_digest(p) for p in parts] and sums[0]["boxes"] != sums[1]["boxes"]


# -- the builder, in one process, on a real saved step ---------------------------------------------------------
def two_rank_body(rank: int, world: int, root: str) -> None:
    with ckpt.Checkpointer(root, keep_last=None) as c:
        c.save(1, state(rank, world, 1)).wait()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("summaries") / "ck")
    run_ranks(2, two_rank_body, root, timeout=120)
    return root


def reports(root: str, step: int = 1) -> tuple[list[mf.Manifest], list[bytes]]:
    storage = LocalStorage(root)
    data = [bytes(mf.read_rank_bytes(storage, step, r)) for r in (0, 1)]
    return [mf.parse_rank_part(d, step, r) for r, d in enumerate(data)], data


def without_created(data: bytes) -> dict:
    doc = json.loads(data)
    doc.pop("created")
    return doc


def test_the_index_from_summaries_is_the_one_merging_every_report_gives(saved):
    parts, data = reports(saved)
    per_rank = frozenset({"rng"})
    sums = [summarize(p, d, per_rank) for p, d in zip(parts, data)]
    assert all(len(json.dumps(s)) < len(d) for s, d in zip(sums, data))  # a summary is smaller than its report
    builder, read = IndexBuilder(), []
    ix, chunks = builder.build(1, parts[0], sums, per_rank, lambda r: read.append(r) or data[r])
    assert read == [1] and builder.learned == 1
    merged = mf.merge(1, parts, per_rank)
    refs = [index.report_ref(1, r, d) for r, d in enumerate(data)]
    assert without_created(ix.to_json()) == without_created(index.build(merged, refs).to_json())
    assert chunks == merged.chunks and any(e.segments for e in ix.tensors)  # "b" and "step" inlined
    index.committable(1, ix, parts)  # every reader's checks, and each report matching the index
    # the next save of the same layout: no report read, its per-rank value from the summary itself
    again = [dict(s, values={"rng": sums[1 - r]["values"]["rng"]}) for r, s in enumerate(sums)]  # swapped
    ix2, _ = builder.build(1, parts[0], again, per_rank, lambda r: read.append(r) or data[r])
    assert read == [1] and builder.learned == 1
    assert ix2.structure != ix.structure and ix2.layouts == ix.layouts
    # a value neither in the summary (too large to travel) nor held any more: read from that rank's report
    builder.values = type(builder.values)()  # emptied
    bare = [dict(s, values={}) for s in sums]
    ix3, _ = builder.build(1, parts[0], bare, per_rank, lambda r: read.append(r) or data[r])
    assert read == [1, 1] and ix3.structure == ix.structure


def test_a_changed_layout_is_learned_again_and_one_no_reader_would_load_is_refused(saved):
    """Rank 1's report rewritten to claim rank 0's rows of ``w`` (overlapping them, leaving its own): its summary's
    layout digest changes, so the coordinator reads the reports again, and the index parsed back as a
    reader parses it refuses the overlap: nothing would be committed."""
    parts, data = reports(saved)
    builder = IndexBuilder()
    sums = [summarize(p, d, frozenset()) for p, d in zip(parts, data)]
    builder.build(1, parts[0], sums, frozenset(), lambda r: data[r])
    bad = dataclasses.replace(parts[1], tensors=[
        dataclasses.replace(t, shards=[Shard(1, [0, 0], list(s.lengths), s.segments) for s in t.shards])
        if t.key == "w" else t for t in parts[1].tensors])
    bad_data = bad.to_json()
    assert layout_digest(bad) != sums[1]["layout"]
    sums[1] = summarize(bad, bad_data, frozenset())
    ix, _ = builder.build(1, parts[0], sums, frozenset(), lambda r: bad_data if r == 1 else data[r])
    assert builder.learned == 2
    with pytest.raises(CorruptCheckpointError, match="step 1 was not committed.*do not tile"):
        index.committable(1, ix, [])


def test_a_report_that_is_not_what_its_rank_summarized_is_refused(saved):
    parts, data = reports(saved)
    sums = [summarize(p, d, frozenset()) for p, d in zip(parts, data)]
    sums[1]["digest"] = "0" * 32
    with pytest.raises(ckpt.DistributedSaveError, match="rank 1's report for step 1 is not the one it summarized"):
        IndexBuilder().build(1, parts[0], sums, frozenset(), lambda r: data[r])


def test_two_ranks_listing_a_chunk_differently_fall_back_to_merging_the_reports(saved):
    parts, data = reports(saved)
    sums = [summarize(p, d, frozenset()) for p, d in zip(parts, data)]
    h, doc = next(iter(sums[0]["chunks"].items()))
    sums[1]["chunks"][h] = [doc[0], doc[1] + 1, doc[2]]  # the same chunk, another stored size
    assert IndexBuilder().build(1, parts[0], sums, frozenset(), lambda r: data[r]) is None


def test_the_manifest_cache_is_bounded_by_bytes_and_keeps_an_outlines_chunk_names(saved):
    storage = FaultyStorage(LocalStorage(saved))
    whole = mf.read_step(storage, 1)
    cache = mf.ManifestCache(storage, max_bytes=int(mf.weight(whole) * 2.5))
    for s in (10, 11, 12):
        cache.put(dataclasses.replace(whole, step=s))
    assert cache.bytes <= cache.max_bytes and cache._held(10) is None and cache._held(12) is not None
    outline = mf.Outline(step=1, kind="step", structure=whole.structure, tensors=[], chunks=whole.chunks)
    cache.put(outline)
    before = storage.calls["read_object"]
    assert cache.chunk_keys(1) == set(whole.chunks) and storage.calls["read_object"] == before  # nothing read
    assert cache.get(1).tensors == whole.tensors  # the step itself is read when asked for


def test_a_whole_step_read_report_by_report_is_the_step_every_report_gives(saved):
    storage = LocalStorage(saved)
    ix = mf.read_committed(storage, 1)
    assert isinstance(ix, index.Index)
    folded = mf.read_step(storage, 1)  # index.whole_step: one report at a time
    at_once = index.partial_step(ix, index.read_reports(storage, ix, [0, 1]))
    assert folded.tensors == at_once.tensors and folded.chunks == at_once.chunks
    merged = mf.merge(1, reports(saved)[0], frozenset({"rng"}))  # the reports merged whole, as before the index
    assert {t.key: t for t in folded.tensors} == {t.key: t for t in merged.tensors} and folded.chunks == merged.chunks
    w = next(t for t in folded.tensors if t.key == "w")
    assert len(w.shards) == 2 and sum(len(s.segments) for s in w.shards) >= 2


def test_the_structure_values_rank_0_holds_are_bounded_by_bytes():
    values = IndexBuilder(cache_bytes=100).values
    values.put("a", {"x": 1}, 60)
    values.put("b", {"x": 2}, 60)  # past 100 bytes: the least recently used goes
    assert values.get("a") is None and values.get("b") == {"x": 2} and values.bytes == 60


def test_report_reads_stream_in_order_and_stop_when_the_commit_gives_up():
    """Rank 0 reads reports a window at a time, in rank order; where the commit fails on one (a
    mismatch), the reads not yet begun are cancelled rather than left running after the error."""
    from concurrent.futures import ThreadPoolExecutor

    from ckpt.save.commit_index import _streamed

    started: list[int] = []
    gate = threading.Event()

    def read(r: int) -> int:
        started.append(r)
        if r > 0:
            assert gate.wait(10)
        return r

    with ThreadPoolExecutor(2) as io:
        gate.set()
        assert list(_streamed(io, read, range(50), window=4)) == list(range(50))
        started.clear()
        gate.clear()
        reads = _streamed(io, read, range(50), window=4)
        assert next(reads) == 0  # reads 1 and 2 now hold both threads until the gate opens; 3 waits
        reads.close()  # the consumer raised: the generator is closed
        gate.set()
    assert 3 not in started and set(started) <= {0, 1, 2}, started
