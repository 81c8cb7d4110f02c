"""Pure pieces, tested without storage or processes: the buffer layout, chunk framing and its one
validity check, manifests, the structure tree's walkers, the planner and box arithmetic (against brute
force), retention rules, options, and the records ranks exchange."""

from __future__ import annotations

import dataclasses
import inspect
import os
import re

import numpy as np
import pytest
import torch

import ckpt
from ckpt import CorruptCheckpointError, IncompatibleFormatError
from ckpt import tree as st
from ckpt.flatten import flatten
from ckpt.format import manifest as mf
from ckpt.format.boxes import contiguous_run, next_needed
from ckpt.format.chunk import chunk_hash, decode, verify, verify_object
from ckpt.options import OptionArgs, Options, RetentionOptions
from ckpt.ranks import LocalComm
from ckpt.save.buffer_layout import ALIGN, make_layout
from ckpt.save.commit import Decision, Report, Status
from ckpt.save.encode import CodecSpec, encode
from ckpt.save.planning import Inventory, InventoryRow, WriteAssignment, assign, exchange_plan
from ckpt.save.retention import to_delete


def _tensors(sizes):
    return {f"t{i}": torch.empty(n, dtype=torch.uint8) for i, n in enumerate(sizes)}


@pytest.mark.parametrize("sizes", [[10], [0, 5, 0], [100] * 50, [1 << 20, 7, 3 << 20, 9, 9], [65, 63, 1, 300000]])
def test_layout_chunks_tile_the_buffer_and_segments_cover_each_tensor(sizes):
    cs = 256 * 1024
    layout = make_layout(_tensors(sizes), cs)
    pos = 0
    for c in layout.chunks:
        assert c.offset == pos and 0 < c.length <= cs + ALIGN
        pos += c.length
    assert pos == layout.nbytes
    for slot in layout.slots:
        # cache-line aligned; a tensor smaller than a line only to its element (no padding per small tensor)
        assert slot.offset % (ALIGN if slot.nbytes >= ALIGN else slot.dtype.itemsize) == 0 or slot.nbytes == 0
        assert sum(n for _, _, n in layout.segments(slot)) == slot.nbytes
        if slot.nbytes >= cs // 4:  # large tensors start their own chunk
            first, off, _ = layout.segments(slot)[0]
            assert off == 0 and layout.chunks[first].offset == slot.offset


def test_every_chunk_starts_on_a_cache_line_with_small_mixed_tensors():
    """Small fp16 and fp32 tensors are aligned to their element only, but a chunk (and so the byte
    planes its elements are split into) always starts 64-byte aligned."""
    g = torch.Generator().manual_seed(3)
    sizes = torch.randint(1, 40, (3000,), generator=g).tolist()
    tensors = {f"t{i}": torch.zeros(n, dtype=torch.float16 if i % 3 else torch.float32) for i, n in enumerate(sizes)}
    tensors["big"] = torch.zeros(70_001, dtype=torch.float32)
    tensors.update({f"u{i}": torch.zeros(n, dtype=torch.float32) for i, n in enumerate(sizes[:500])})
    layout = make_layout(tensors, 64 * 1024)
    assert len(layout.chunks) > 3
    assert all(c.offset % ALIGN == 0 for c in layout.chunks)
    for slot in layout.slots:
        first, off, _ = layout.segments(slot)[0]
        assert off % slot.dtype.itemsize == 0  # elements aligned within their chunk


def test_a_fresh_key_starts_a_chunk_of_its_own():
    """The planner's packs of small replicated tensors: each starts a chunk (an empty tensor first
    passes the cut on), so a rank reading a pack reads none of the writer's own tensors."""
    tensors = {**_tensors([100, 3000, 0, 4, 8]), "t5": torch.zeros((), dtype=torch.float32)}
    plain = make_layout(tensors, 64 * 1024)
    cut = make_layout(tensors, 64 * 1024, frozenset({"t2", "t5"}))
    assert len(plain.chunks) == 1 and len(cut.chunks) == 3
    starts = {c.offset for c in cut.chunks}
    assert {s.key for s in cut.slots if s.offset in starts and s.nbytes} == {"t0", "t3", "t5"}


def test_layout_is_stable_for_the_same_structure():
    a = make_layout(_tensors([5, 1 << 20, 17]), 1 << 20)
    b = make_layout(_tensors([5, 1 << 20, 17]), 1 << 20)
    assert a == b
    assert make_layout(_tensors([5, 1 << 20, 18]), 1 << 20) != a


def test_codec_roundtrip_and_header_checks():
    raw = memoryview(bytes(range(256)) * 4096)
    h = chunk_hash(raw)
    for spec in (CodecSpec("raw"), CodecSpec("zstd", 3), CodecSpec("auto")):
        name, bufs = encode(raw, h, spec)
        blob = b"".join(bytes(b) for b in bufs)
        assert bytes(decode(blob, name="x", expect_hash=h, expect_len=len(raw))) == bytes(raw)
        assert name == ("raw" if spec.name == "raw" else "zstd")
    with pytest.raises(CorruptCheckpointError, match="header hash"):
        decode(blob, name="x", expect_hash="0" * 32)
    with pytest.raises(CorruptCheckpointError, match="truncated"):
        decode(blob[:10], name="x", expect_hash=h)
    future = bytearray(blob)
    future[8:10] = (9).to_bytes(2, "little")
    with pytest.raises(IncompatibleFormatError, match="pip install -U ckpt"):
        decode(bytes(future), name="x", expect_hash=h)


def test_one_validity_check_for_stored_chunks():
    """verify is the check every reader uses: in one buffer or as header + payload read in place."""
    raw = memoryview(bytes(range(256)) * 1024)
    h = chunk_hash(raw)
    _, bufs = encode(raw, h, CodecSpec("raw"))
    header, payload = bytes(bufs[0]), bytes(bufs[1])
    assert bytes(verify("k", h, header, payload, expect_len=len(raw), object_len=64 + len(raw))) == bytes(raw)
    with pytest.raises(CorruptCheckpointError, match="raw bytes, the manifest says"):
        verify("k", h, header, payload, expect_len=len(raw) + 1)
    with pytest.raises(CorruptCheckpointError, match="truncated or padded"):
        verify("k", h, header, payload, object_len=64 + len(raw) + 1)
    with pytest.raises(CorruptCheckpointError, match="truncated or padded"):
        verify("k", h, header, payload[:-1])
    flipped = bytearray(payload)
    flipped[7] ^= 1
    with pytest.raises(CorruptCheckpointError, match="hash check"):
        verify("k", h, header, flipped)
    _, zbufs = encode(raw, h, CodecSpec("zstd"))
    with pytest.raises(CorruptCheckpointError, match="stored as zstd"):  # read in place as raw: refused
        verify("k", h, bytes(zbufs[0]), bytes(zbufs[1]), raw_only=True)
    key = f"chunks/{h[:2]}/{h}"
    verify_object(key, [memoryview(header + payload)])
    verify_object(key, [memoryview(header), memoryview(payload)])
    with pytest.raises(CorruptCheckpointError):
        verify_object(f"chunks/00/{'0' * 32}", [memoryview(header + payload)])


def test_manifest_json_roundtrip():
    m = mf.Manifest(step=3, kind="step", structure={"t": "dict", "k": ["w"], "v": [{"t": "tensor", "key": "w"}]},
                    tensors=[mf.TensorEntry("w", "float32", [2, 2], [mf.Shard(0, [0, 0], [2, 2], [
                        mf.Segment("a" * 32, 0, 16)])])],
                    chunks={"a" * 32: mf.ChunkInfo(64, 128, "raw/1")})
    back = mf.parse(m.to_json(), name="m")
    assert back.tensors == m.tensors and back.chunks == m.chunks and back.step == 3


def test_merge_combines_rank_reports():
    def part(rank, rows):
        return mf.Manifest(step=1, kind="rank", rank=rank, structure={"t": "dict", "k": [], "v": []},
                           tensors=[mf.TensorEntry("w", "float32", [4, 2], [mf.Shard(rank, [rows[0], 0], [rows[1], 2], [
                               mf.Segment(f"{rank:032x}", 0, rows[1] * 8)])])],
                           chunks={f"{rank:032x}": mf.ChunkInfo(rows[1] * 8, 100, "raw/1")}, stats={"chunks": 1})
    m = mf.merge(1, [part(1, (2, 2)), part(0, (0, 2))])
    assert m.world_size == 2 and m.stats["chunks"] == 2
    assert [s.rank for s in m.tensors[0].shards] == [0, 1] and len(m.chunks) == 2


# -- the planner, against what every rank holds --------------------------------------------------------

def inv(tensors, tops=None, per_rank=()):
    return Inventory(tops or {"m": "same"}, list(per_rank), [InventoryRow(*t) for t in tensors])


def test_replicated_tensors_are_written_once_with_balanced_bytes():
    tensors = [[f"m/t{i}", "replicated", "float32", [n], [0], [n], 4 * n]  # 1.2-4 MB each: balanced, not packed
               for i, n in enumerate([n * 1000 for n in (1000, 900, 800, 700, 600, 500, 400, 300)])]
    plans = assign([inv(tensors) for _ in range(3)])
    writes = [p.write for p in plans]
    assert sorted(i for w in writes for i in w) == list(range(8))  # each written exactly once
    loads = [p.bytes for p in plans]
    assert max(loads) - min(loads) <= 4 * 1000 * 1000 and not any(p.fresh for p in plans)
    # shards with one holder are forced, and a Replicate placement's duplicate boxes written once
    sh = [[["m/s", "shard", "float32", [10, 4], [r * 5, 0], [5, 4], 80]] for r in (0, 1, 0, 1)]
    plans = assign([inv(t) for t in sh])
    assert sum(len(p.write) for p in plans) == 2


def test_small_replicated_tensors_are_packed_on_few_ranks_each_pack_a_chunk_of_its_own():
    """Issue 35 item 6: AdamW's 0-d steps (one per parameter) and other small replicated boxes go in
    packs, not one per rank: a load then reads one chunk per pack, not a chunk of every rank."""
    world, chunk = 8, 64 * 1024
    shard = [[f"m/w{i}", "shard", "float32", [world * 4096], [0], [4096], 16384] for i in range(40)]
    steps = [[f"o/{i}/step", "replicated", "float32", [], [], [], 4] for i in range(40)]
    norms = [[f"m/n{i}", "replicated", "float32", [2048], [0], [2048], 8192] for i in range(20)]  # 160 KiB
    big = [["m/big", "replicated", "float32", [65536], [0], [65536], 262144]]  # not small: balanced alone

    def rows(r):  # the shards interleaved with the small ones, as a flattened optimizer state is
        own = [[k, kind, dt, g, [r * 4096], n, b] for k, kind, dt, g, _, n, b in shard]
        return [x for pair in zip(own, steps) for x in pair] + norms + big

    invs = [inv(rows(r), tops={"m": "same", "o": "same"}) for r in range(world)]
    plans = assign(invs, chunk)
    keys = [[invs[r].tensors[i].key for i in p.write] for r, p in enumerate(plans)]
    small = {k for k, *_ in steps + norms}
    packs = [[k for k in ks if k in small] for ks in keys]
    assert sum(map(len, packs)) == len(small) and len([p for p in packs if p]) <= 3, packs  # 3 packs
    for p, ks, pack in zip(plans, keys, packs):
        if pack:  # last in the rank's buffer, each pack starting a chunk: 40 steps + 160 KiB of norms, two packs
            assert ks[-len(pack):] == pack and len(p.fresh) >= 1 and p.fresh[0] == p.write[len(ks) - len(pack)]
    assert sum(len(p.fresh) for p in plans) == 3  # 40·64 + 160 KiB in 64 KiB chunks: 3 packs
    assert sum(len(k) for k in keys) == 40 * world + len(small) + 1
    loads = [p.bytes for p in plans]
    assert max(loads) - min(loads) <= 262144 + chunk  # the balance moves by a pack at most
    # a small box held by some ranks only (tensor parallel's replicas) is packed among those ranks
    tp = [inv([[f"m/ln{i}", "shard", "float32", [16], [r // 4 * 8], [8], 32] for i in range(3)])
          for r in range(world)]
    plans = assign(tp, chunk)
    writers = [r for r, p in enumerate(plans) if p.write]
    assert len(writers) == 2 and writers[0] < 4 <= writers[1] and all(len(plans[r].write) == 3 for r in writers)


@pytest.mark.parametrize("bad, match", [
    ([["m/x", "replicated", "float32", [3], [0], [3], 12]], "differs between ranks"),
    ([["m/y", "replicated", "float32", [4], [0], [4], 16]], "missing on rank"),
    ([["m/x", "shard", "float32", [4], [1], [3], 12]], "differs between ranks"),
])
def test_inconsistent_states_are_refused_with_the_key(bad, match):
    good = [["m/x", "replicated", "float32", [4], [0], [4], 16]]
    plans = assign([inv(good), inv(bad)])
    assert all(p.error for p in plans) and match in plans[0].error


def test_shards_must_tile_the_tensor():
    a = [["m/s", "shard", "float32", [10], [0], [6], 24]]
    b = [["m/s", "shard", "float32", [10], [5], [5], 20]]  # overlaps a
    plans = assign([inv(a), inv(b)])
    assert "do not tile" in plans[0].error


def test_plain_values_that_differ_make_the_key_per_rank():
    a = inv([], tops={"m": "1", "pos": "x"})
    b = inv([], tops={"m": "1", "pos": "y"})
    assert assign([a, b])[0].per_rank == ["pos"]


def test_next_needed_and_contiguous_run_match_brute_force():
    g = torch.Generator().manual_seed(0)
    for _ in range(400):
        nd = int(torch.randint(1, 4, (1,), generator=g))
        outer = [int(torch.randint(1, 6, (1,), generator=g)) for _ in range(nd)]
        offs = [int(torch.randint(0, d, (1,), generator=g)) for d in outer]
        lens = [int(torch.randint(0, d - o + 1, (1,), generator=g)) for o, d in zip(offs, outer)]
        mask = np.zeros(outer, dtype=bool)
        mask[tuple(slice(o, o + n) for o, n in zip(offs, lens))] = True
        flat = mask.reshape(-1)
        idx = np.flatnonzero(flat)
        for pos in range(flat.size + 1):
            later = idx[idx >= pos]
            assert next_needed(pos, outer, (tuple(offs), tuple(lens))) == (int(later[0]) if later.size else None)
        run = contiguous_run((tuple(offs), tuple(lens)), outer)
        if idx.size:
            is_run = idx[-1] - idx[0] + 1 == idx.size
            assert (run is not None) == is_run, (outer, offs, lens)
            if run is not None:
                assert run == (int(idx[0]), int(idx.size))


# -- retention rules -----------------------------------------------------------------------------------

def test_to_delete_keep_every_rules():
    steps = list(range(1, 11))
    assert to_delete(steps, 2, (), 4) == [1, 2, 3, 5, 6, 7]
    assert to_delete(steps, None, (), 5) == [1, 2, 3, 4, 6, 7, 8, 9]
    assert to_delete(steps, 3, (2,), None) == [1, 3, 4, 5, 6, 7]
    with pytest.raises(ckpt.ConfigError, match="keep_every"):
        ckpt.Checkpointer("x", keep_every=0)


# -- the structure tree ------------------------------------------------------------------------------

def test_structure_walkers():
    state = {"model": torch.nn.Linear(2, 3), "step": 7, "cfg": {"lr": float("nan"), 3: (1, "a")},
             "blob": b"xyz", "pos": ckpt.PerRank({"i": 4})}
    flat = flatten(state)
    s = flat.structure
    assert st.kind(s) == "dict" and [k for k, _ in st.top_items(s)] == list(state)
    assert st.tensor_keys(s) == ["model/weight", "model/bias"] == list(flat.tensors)
    values = dict(st.value_nodes(s))
    assert values["step"] == 7 and values["cfg/3"] == st.tuple_node([1, "a"]) and values["pos/i"] == 4
    assert st.preview(values["cfg/lr"]) == "nan" and st.preview(values["blob"]) == "<3 bytes>"
    assert not st.has_pickle(s)
    assert st.digest(s) == st.digest(flatten(state).structure)
    pickled = st.dict_node(["x"], [st.pickle_node({1, 2})])
    assert st.has_pickle(pickled) and st.strip_pickles(pickled) == st.dict_node(["x"], [{"t": "pickle"}])
    assert st.preview(pickled) == "{'x': <pickled object: not loaded>}"
    with pytest.raises(ckpt.UnsupportedValueError, match="allow_pickle=True"):
        st.rebuild(pickled, {}, allow_pickle=False)
    assert st.rebuild(pickled, {}, allow_pickle=True) == {"x": {1, 2}}
    back = st.rebuild(s, flat.tensors, allow_pickle=False)
    assert back["cfg"][3] == (1, "a") and back["blob"] == b"xyz" and back["model"].state_dict["weight"] is not None
    per = st.dict_node(["pos"], [st.per_rank_node([{"t": "tuple", "v": [1]}, 2])])
    assert st.is_per_rank(per["v"][0])
    assert list(st.value_nodes(per)) == [("pos[rank 0]", {"t": "tuple", "v": [1]}), ("pos[rank 1]", 2)]
    assert list(st.value_nodes(per, rank=1)) == [("pos", 2)]


# -- options ---------------------------------------------------------------------------------------------

def test_options_are_checked_once_and_normalised():
    o = Options.build(codec="zstd:3", local_dir=__import__("pathlib").Path("/tmp/x"), timeout=5)
    assert o.codec == CodecSpec("zstd", 3) and o.local_dir == "/tmp/x" and o.timeout == 5.0
    assert o.replace(keep_last=2).keep_last == 2 and o.keep_last is None
    for bad, match in [({"keep_last": 0}, "keep_last"), ({"chunk_size": 10}, "chunk_size"),
                       ({"busy": "later"}, "busy"), ({"timeout": -1}, "timeout"), ({"codec": "lz4"}, "codec"),
                       ({"storage_options": "x"}, "storage_options"), ({"io_thread": 2}, "unknown option.*io_thread"),
                       ({"local_dir": 3}, "local_dir"), ({"snapshot_threads": 0}, "snapshot_threads")]:
        with pytest.raises(ckpt.ConfigError, match=match):
            Options.build(**bad)



def test_every_option_is_type_checked_where_it_is_declared():
    for bad in [{"allow_pickle": "no"}, {"strict": 1}, {"native": None}, {"check_finite": 1}, {"keep_local": 0},
                {"delta_chain": 2.0}, {"failure_domain": ""}, {"redundancy": 2}, {"mtbf": True}]:
        with pytest.raises(ckpt.ConfigError, match=next(iter(bad))):
            Options.build(**bad)
    with pytest.raises(ckpt.ConfigError, match="persist_every needs local_dir"):
        Options(persist_every=2)  # the record itself checks, not only build()
    o = Options.build(keep_last=3, delta_chain=4, every="90s")
    assert o.retention == RetentionOptions(keep_last=3) and o.encoding.delta_chain == 4 and o.schedule.every == 90.0


def test_the_keyword_typing_and_the_defaults_name_the_same_options():
    fields = {f.name for f in dataclasses.fields(Options)}
    assert set(OptionArgs.__annotations__) == fields
    sig = inspect.signature(ckpt.Checkpointer.__init__)
    assert {"storage", "process_group"} <= set(sig.parameters) and not fields & set(sig.parameters)


def _option_table() -> tuple[str, set[str]]:
    """The documented option table: the markdown table whose header starts ``| option`` and that names
    ``keep_last`` (docs/api.md once it holds it, else README.md)."""
    root = os.path.join(os.path.dirname(__file__), os.pardir)
    for doc in ("docs/api.md", "README.md"):
        path = os.path.join(root, doc)
        if not os.path.exists(path):
            continue
        tables, rows = [], None
        for line in open(path, encoding="utf-8"):
            if line.startswith("| option"):
                rows = set()
                tables.append(rows)
            elif rows is not None and line.startswith("|"):
                rows.update(re.findall(r"^\|\s*`([a-z_]+)`", line))
            else:
                rows = None
        for names in tables:
            if "keep_last" in names:
                return doc, names
    raise AssertionError("no option table (| option ...) naming keep_last in docs/api.md or README.md")


def test_the_docs_option_table_names_every_option_and_no_other():
    doc, documented = _option_table()
    fields = {f.name for f in dataclasses.fields(Options)} | {"storage", "process_group"}
    assert not fields - documented, f"{doc}'s option table lacks {sorted(fields - documented)}"
    assert not documented - fields, f"{doc}'s option table names unknown options {sorted(documented - fields)}"


def test_the_option_docs_are_made_from_the_fields_and_docs_api_md_holds_what_they_make():
    """Each option's meaning is written once, next to its field; docs/api.md's table and Options' docstring are
    made from there, so neither can drift from the code (regenerate with ``python -m ckpt.options_doc --write
    docs/api.md``)."""
    from ckpt import options_doc
    path = os.path.join(os.path.dirname(__file__), os.pardir, "docs", "api.md")
    text = open(path, encoding="utf-8").read()
    assert options_doc.replace_in(text, options_doc.table()) == text, (
        "docs/api.md's option table differs from ckpt/options.py: run python -m ckpt.options_doc --write docs/api.md")
    for f in dataclasses.fields(Options):
        assert f.metadata.get("doc"), f"option {f.name} has no doc next to its field"
        assert f"    {f.name}: " in (Options.__doc__ or ""), f"Options' docstring lacks {f.name}"
    sig = inspect.signature(ckpt.Checkpointer.__init__)
    line = next(ln for ln in text.splitlines() if ln.startswith("**`Checkpointer(path, *"))
    for name in set(sig.parameters) - {"self", "path", "options"}:
        assert f" {name}=" in line, f"docs/api.md's Checkpointer signature lacks {name}"


# -- what ranks tell each other ----------------------------------------------------------------------------

def test_records_survive_the_store():
    d = Decision(Status.FAIL, (1, 3), "rank 1: boom")
    assert Decision.from_json(d.to_json()) == d
    r = Report(Status.SKIP, 12)
    assert Report.from_json(r.to_json()) == r
    inv = Inventory({"m": "d"}, ["pos"], [InventoryRow("m/w", "shard", "float32", [4, 2], [0, 0], [2, 2], 16)])
    assert Inventory.from_json(inv.to_json()) == inv
    w = WriteAssignment([0, 2], ["pos"], 16)
    assert WriteAssignment.from_json(w.to_json()) == w
    w.raise_error()  # no error: nothing raised
    with pytest.raises(ckpt.StateMismatchError):
        WriteAssignment(error="shapes differ", mismatch=True).raise_error()
    with pytest.raises(ckpt.DistributedSaveError) as e:
        WriteAssignment(error="rank 2 died", ranks=[2]).raise_error()
    assert e.value.ranks == [2]


def test_a_process_alone_is_its_own_coordinator():
    comm = LocalComm()
    inv = Inventory({"m": "d"}, [], [InventoryRow("m/w", "replicated", "float32", [4], [0], [4], 16)])
    assert exchange_plan(comm, 0, inv).write == [0]
    got = comm.round("commit", 0).run(Report(Status.OK, 5).to_json(), lambda g: [g.ordered(), g.missing], what="x")
    assert got[1] == [] and Report.from_json(got[0][0]).step == 5  # its own report, no waiting
    assert comm.agree({"latest": 5}) == [{"latest": 5}]
    bad = Inventory({"m": "d"}, [], [InventoryRow("m/w", "shard", "float32", [4], [1], [2], 8)])
    with pytest.raises(ckpt.StateMismatchError, match="do not tile"):
        exchange_plan(comm, 1, bad)


def test_a_path_component_is_the_canonical_json_of_its_key():
    """The fast path for plain strings and ints writes exactly what the JSON encoder writes, for every
    character class the encoder escapes (quotes, backslashes, controls, DEL, non-ASCII) and for keys
    that are not plain (bools, typed key nodes)."""
    import json
    import random

    rng = random.Random(7)
    alphabet = [chr(c) for c in range(0, 0x80)] + ["é", "\u2028", "𝔸"]
    keys: list = ["", "w", "model.layers.0.w", 0, 7, -3, True, False, {"t": "int", "v": 1}, ["a", 1]]
    keys += ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 6))) for _ in range(5000)]
    for key in keys:
        assert st.path_component(key) == json.dumps(key, sort_keys=True, separators=(",", ":")), repr(key)
    assert st.path_component(0) != st.path_component("0") and st.path_component(True) != st.path_component(1)
