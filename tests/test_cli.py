"""The ``ckpt`` command line on real checkpoints, damaged on purpose.

Most commands run in-process through ``ckpt.cli.main`` (a subprocess costs a torch import each);
one test runs the console script through a pipe to check what scripts see.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import time

import fsspec
import pytest
import torch
from conftest import chunk_files, tensor_entry

import ckpt
from ckpt import cli
from ckpt.format import paths
from ckpt.format.chunk import chunk_hash
from ckpt.save.encode import CodecSpec, encode
from ckpt.storage.local import LocalStorage
from ckpt.testing import FaultyStorage, run_ranks

KiB = 1024
CHUNK = 64 * KiB
HOUR = 3600.0


def rows(out: str) -> list[list[str]]:
    return [line.split("\t") for line in out.splitlines() if "\t" in line]


def chunk_path(root: str, h: str) -> str:
    return os.path.join(root, paths.chunk_key(h))


def frozen_and_moving(step: int) -> dict:
    """A state whose "frozen" tensor (several whole chunks) never changes and whose "moving" one does."""
    g = torch.Generator().manual_seed(step)
    return {"frozen": torch.arange(50_000, dtype=torch.float32),
            "moving": torch.randn(30_000, generator=g),
            "small": {"a": torch.tensor([1, 2, 3]), "b": torch.full((4,), float(step))},
            "step": step, "name": "run-x"}


def save_steps(path: str, steps=(1, 2, 3), **kw) -> dict[int, dict]:
    states = {}
    with ckpt.Checkpointer(path, chunk_size=CHUNK, codec="raw", **kw) as c:
        for s in steps:
            states[s] = frozen_and_moving(s)
            c.save(s, states[s]).wait()
    return states


def assert_loads(path: str, step: int, want: dict) -> None:
    got = {"frozen": torch.empty(50_000), "moving": torch.empty(30_000),
           "small": {"a": torch.empty(3, dtype=torch.int64), "b": torch.empty(4)}, "step": None, "name": None}
    with ckpt.open(path) as r:
        assert r.load_into(got, step) == step
    assert torch.equal(got["frozen"], want["frozen"]) and torch.equal(got["moving"], want["moving"])
    assert torch.equal(got["small"]["b"], want["small"]["b"]) and got["step"] == want["step"]


# -- ls -----------------------------------------------------------------------------------------------

def test_ls_reports_sizes_new_bytes_incomplete_and_damaged_steps(ckdir, run, monkeypatch):
    with ckpt.Checkpointer(ckdir, chunk_size=CHUNK, codec="raw") as c:
        c.save(1, frozen_and_moving(1)).wait()
        before = set(chunk_files(ckdir))
        c.save(2, frozen_and_moving(2)).wait()
        new_files = set(chunk_files(ckdir)) - before
        c.save(3, frozen_and_moving(3)).wait()
    # A save whose commit fails leaves its chunks and rank report behind: an incomplete step.
    disk = FaultyStorage(LocalStorage(ckdir))
    disk.fail("commit", exc=OSError("disk gone"))
    with pytest.raises(ckpt.CheckpointError):
        with ckpt.Checkpointer(ckdir, chunk_size=CHUNK, codec="raw", storage=disk) as c:
            c.save(4, frozen_and_moving(4)).wait()

    rc, out, _ = run("ls", ckdir, "--json")
    assert rc == 0
    doc = json.loads(out)
    assert doc["schema"] == "ckpt-ls/1"
    by = {d["step"]: d for d in doc["steps"]}
    assert [by[s]["status"] for s in (1, 2, 3, 4)] == ["committed", "committed", "committed", "incomplete"]
    assert by[4]["rank_files"] == 1
    assert by[1]["new_bytes"] == by[1]["stored_bytes"]  # nothing before it
    # step 2's new bytes are exactly the chunk files its save added to the disk
    assert by[2]["new_bytes"] == sum(os.path.getsize(p) for p in new_files) > 0
    assert by[2]["new_bytes"] < by[2]["stored_bytes"]  # the frozen tensor's chunks are reused
    assert by[2]["raw_bytes"] == (50_000 + 30_000 + 4) * 4 + 3 * 8 and by[2]["world_size"] == 1

    # Piped output is tab-separated with exact byte counts.
    rc, out, _ = run("ls", ckdir)
    table = rows(out)
    assert table[0] == ["step", "created (UTC)", "ranks", "tensors", "raw", "stored", "new", "tensor chunks", "status"]
    assert table[2][0] == "2" and int(table[2][6]) == by[2]["new_bytes"]
    assert int(table[2][7]) == by[2]["tensor_chunks"] == by[2]["chunks"]  # no deltas: the same chunks
    assert table[4][0] == "4" and table[4][8].startswith("incomplete")

    # A manifest that does not parse: the step is damaged, ls says so and exits 1.
    with open(os.path.join(ckdir, paths.manifest_key(2)), "wb") as f:
        f.write(b'{"format": "ckpt", truncated')
    rc, out, _ = run("ls", ckdir)
    assert rc == 1
    assert next(r for r in rows(out) if r[0] == "2")[8].startswith("DAMAGED")
    assert next(r for r in rows(out) if r[0] == "3")[8] == "committed"


def test_ls_counts_the_chunks_a_steps_tensors_use_not_its_delta_bases(ckdir, run):
    w = torch.randn(3 * CHUNK // 4, generator=torch.Generator().manual_seed(0))  # three whole chunks
    with ckpt.Checkpointer(ckdir, chunk_size=CHUNK, codec="auto", delta_chain=8) as c:
        for s in range(1, 9):
            w[::997] += 1.0  # a few elements of every chunk change: each is stored as a delta of the last
            c.save(s, {"w": w}).wait()
    rc, out, _ = run("ls", ckdir, "--json")
    by = {d["step"]: d for d in json.loads(out)["steps"]}
    assert [by[s]["tensor_chunks"] for s in range(1, 9)] == [3] * 8
    assert by[8]["chunks"] > by[2]["chunks"] > 3  # with the bases its deltas need
    rc, out, _ = run("ls", ckdir)
    assert rc == 0 and [r[7] for r in rows(out)[1:]] == ["3"] * 8


def test_ls_verify_marks_the_steps_that_reference_a_bad_chunk(ckdir, run):
    save_steps(ckdir)
    m1 = ckpt.open(ckdir).manifest(1)
    only_1 = tensor_entry(m1, "moving").shards[0].segments[0].chunk
    os.remove(chunk_path(ckdir, only_1))
    rc, out, err = run("ls", ckdir, "--verify")
    assert rc == 1
    status = {r[0]: r[8] for r in rows(out)[1:]}
    assert status["1"].startswith("CORRUPT") and status["2"] == "verified" and status["3"] == "verified"
    assert paths.chunk_key(only_1) in err


# -- inspect and export on a checkpoint saved by two ranks ----------------------------------------------

ROWS, COLS = 64, 1000


def emb_value(step: int) -> torch.Tensor:
    t = torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS)
    if step >= 2:
        t[0] += 1  # rank 0's rows change at step 2, rank 1's do not
    return t


def two_rank_body(rank, world, path):
    r0, n = (0, 40) if rank == 0 else (40, ROWS - 40)
    emb = emb_value(1)[r0:r0 + n].clone()
    state = {"emb": ckpt.LocalShard(emb, (r0, 0), (ROWS, COLS)),
             "head": torch.linspace(-1, 1, 15).to(torch.bfloat16).reshape(5, 3),
             "flag": torch.tensor(True), "scale": torch.tensor(0.5, dtype=torch.float64),
             "pos": ckpt.PerRank({"seed": 10 + rank, "buf": torch.full((rank + 2,), float(rank), dtype=torch.float64)}),
             "step": 1}
    c = ckpt.Checkpointer(path, chunk_size=CHUNK)
    c.save(1, state).wait()
    if rank == 0:
        emb[0] += 1
    state["step"] = 2
    c.save(2, state).wait()
    c.close()
    return rank


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("two") / "ck")
    assert run_ranks(2, two_rank_body, path) == [0, 1]
    return path


@pytest.mark.multiprocess
@pytest.mark.slow
def test_inspect_shows_shards_kinds_codecs_and_new_versus_reused_chunks(two_ranks, run):
    rc, out, _ = run("inspect", two_ranks, "--json")
    assert rc == 0
    doc = json.loads(out)
    assert doc["schema"] == "ckpt-inspect/1" and doc["detail"]["step"] == 2 and doc["detail"]["world_size"] == 2
    t = {(x["key"], x["rank"]): x for x in doc["detail"]["tensors"]}
    emb = t[("emb", None)]
    assert emb["kind"] == "sharded" and emb["shape"] == [ROWS, COLS]
    assert sorted((s["rank"], s["offsets"], s["lengths"]) for s in emb["shards"]) == [
        (0, [0, 0], [40, COLS]), (1, [40, 0], [ROWS - 40, COLS])]
    m1 = ckpt.open(two_ranks).manifest(1)
    rank0 = next(s for s in emb["shards"] if s["rank"] == 0)["chunks"]
    rank1 = next(s for s in emb["shards"] if s["rank"] == 1)["chunks"]
    # only row 0 changed: the first chunk of rank 0's shard is new, every other chunk is reused
    assert rank0[0] not in m1.chunks and set(rank0[1:]) | set(rank1) <= m1.chunks.keys() and len(rank0) == 3
    assert emb["new_chunks"] == 1 and emb["reused_chunks"] == len(rank0) + len(rank1) - 1
    assert t[("head", None)]["kind"] == "tensor" and t[("head", None)]["dtype"] == "bfloat16"
    assert {k for k in t if k[0] == "pos/buf"} == {("pos/buf", 0), ("pos/buf", 1)}
    assert t[("pos/buf", 1)]["kind"] == "per-rank" and t[("pos/buf", 1)]["shape"] == [3]
    known = {"raw/1", "zstd/1", "planes/1", "xor/1", "planes/2", "xor/2", "planes/3", "xor/3"}
    assert all(x["codecs"] and set(x["codecs"]) <= known for x in t.values())
    assert doc["detail"]["per_rank_keys"] == ["pos"]
    assert doc["detail"]["value_nodes"]["step"] == 2 and doc["detail"]["values"]["pos[rank 1]/seed"] == "11"

    rc, out, _ = run("inspect", two_ranks, "--step", 1, "--tsv")
    assert rc == 0 and "step 1" in out
    shards = [r for r in rows(out) if r[0] == "emb"]
    assert ["emb", "[0:40, 0:1000]", "0"] == shards[-2][:3] and ["emb", "[40:64, 0:1000]", "1"] == shards[-1][:3]
    assert "pos[rank 0]/seed = 10" in out


@pytest.mark.multiprocess
@pytest.mark.slow
def test_export_reshards_to_one_file_bit_exactly(two_ranks, run, tmp_path):
    from safetensors import safe_open
    from safetensors.torch import load_file

    out_file = str(tmp_path / "model.safetensors")
    rc, _, err = run("export", two_ranks, "--step", 2, "--to", out_file)
    assert rc == 0 and "per-rank state ['pos'] exported from saved rank 0 of 2" in err
    got = load_file(out_file)
    assert set(got) == {"emb", "head", "flag", "scale", "pos/buf"}
    assert torch.equal(got["emb"], emb_value(2)) and got["emb"].dtype == torch.float32
    head = torch.linspace(-1, 1, 15).to(torch.bfloat16).reshape(5, 3)
    assert got["head"].dtype == torch.bfloat16 and torch.equal(got["head"].view(torch.int16), head.view(torch.int16))
    assert got["flag"].shape == () and got["flag"].item() is True and got["scale"].item() == 0.5
    assert torch.equal(got["pos/buf"], torch.zeros(2, dtype=torch.float64))
    with safe_open(out_file, "pt") as f:
        meta = f.metadata()
    assert meta["ckpt.step"] == "2" and meta["ckpt.rank"] == "0"
    assert json.loads(meta["ckpt.values"]) == {"pos/seed": 10, "step": 2}

    # Another saved rank's per-rank state, a key filter, and the torch.save format.
    pt = str(tmp_path / "model.pt")
    rc, _, err = run("export", two_ranks, "--step", 1, "--to", pt, "--keys", "emb", "--keys", "pos/", "--rank", 1)
    assert rc == 0 and "plain value(s) not written" in err
    got = torch.load(pt, weights_only=True)
    assert set(got) == {"emb", "pos/buf"}
    assert torch.equal(got["emb"], emb_value(1)) and torch.equal(got["pos/buf"], torch.ones(3, dtype=torch.float64))

    assert "per-rank state ['pos'] exported from saved rank 1 of 2" in err
    # per-rank state the keys leave out is not noted as exported
    rc, _, err = run("export", two_ranks, "--to", str(tmp_path / "emb.safetensors"), "--keys", "emb")
    assert rc == 0 and "per-rank" not in err and "pos" not in err

    assert run("export", two_ranks, "--to", pt)[0] == 2  # exists: needs --force
    assert run("export", two_ranks, "--to", str(tmp_path / "m.bin"))[0] == 2  # unknown format
    assert run("export", two_ranks, "--to", str(tmp_path / "x.pt"), "--rank", 5)[0] == 2


def test_export_refuses_what_safetensors_cannot_hold_and_pt_keeps_it(ckdir, run, tmp_path):
    z = torch.complex(torch.randn(6, dtype=torch.float64), torch.randn(6, dtype=torch.float64))
    state = {"z": z, "w": torch.randn(3, 2), "u": torch.arange(5, dtype=torch.uint8), "e": torch.empty(0, 4)}
    with ckpt.Checkpointer(ckdir) as c:
        c.save(7, state)
    rc, _, err = run("export", ckdir, "--to", tmp_path / "a.safetensors")
    assert rc == 1 and "complex128" in err and not (tmp_path / "a.safetensors").exists()
    rc, _, _ = run("export", ckdir, "--to", tmp_path / "a.safetensors", "--keys", "w", "--keys", "u", "--keys", "e")
    assert rc == 0
    rc, _, _ = run("export", ckdir, "--to", tmp_path / "a.pt")
    got = torch.load(tmp_path / "a.pt", weights_only=True)
    assert rc == 0 and all(torch.equal(got[k], v) and got[k].dtype == v.dtype for k, v in state.items())
    assert not [p for p in os.listdir(tmp_path) if ".tmp-" in p]


# -- verify ---------------------------------------------------------------------------------------------

def test_verify_names_each_corrupt_or_missing_object_and_the_steps_using_it(ckdir, run):
    save_steps(ckdir)
    c = ckpt.Checkpointer(ckdir)
    m1, m3 = c.manifest(1), c.manifest(3)
    shared = tensor_entry(m1, "frozen").shards[0].segments[1].chunk  # used by every step
    only_1 = tensor_entry(m1, "moving").shards[0].segments[0].chunk
    latest = tensor_entry(m3, "moving").shards[0].segments[-1].chunk

    rc, out, err = run("verify", ckdir, "--all")
    assert rc == 0 and out.startswith("OK: step(s) 1, 2, 3") and "verify [" not in err

    with open(chunk_path(ckdir, shared), "r+b") as f:  # one bit flipped in the payload
        f.seek(1000)
        b = f.read(1)
        f.seek(1000)
        f.write(bytes([b[0] ^ 0x10]))
    os.remove(chunk_path(ckdir, only_1))
    with open(chunk_path(ckdir, latest), "r+b") as f:
        f.truncate(100)

    rc, out, _ = run("verify", ckdir)  # the latest step only
    assert rc == 1
    found = {r[1]: r for r in rows(out)[1:]}
    assert set(found) == {paths.chunk_key(shared), paths.chunk_key(latest)}
    assert found[paths.chunk_key(shared)][0] == "corrupt" and found[paths.chunk_key(shared)][2] == "3"

    rc, out, _ = run("verify", ckdir, "--all", "--json")
    doc = json.loads(out)
    assert rc == 1 and doc["schema"] == "ckpt-verify/1" and doc["ok"] is False
    probs = {p["object"]: p for p in doc["problems"]}
    assert probs[paths.chunk_key(shared)]["steps"] == [1, 2, 3] and "hash" in probs[paths.chunk_key(shared)]["message"]
    assert probs[paths.chunk_key(only_1)]["kind"] == "missing" and probs[paths.chunk_key(only_1)]["steps"] == [1]
    assert probs[paths.chunk_key(latest)]["kind"] == "corrupt" and probs[paths.chunk_key(latest)]["steps"] == [3]
    assert len(probs) == 3 and doc["chunks"] == len(m1.chunks.keys() | c.manifest(2).chunks.keys() | m3.chunks.keys())

    rc, _, err = run("verify", ckdir, "--step", 9)
    assert rc == 1 and "step 9 is not committed" in err


def test_verify_draws_a_progress_bar_only_on_a_terminal(ckdir, run, monkeypatch):
    save_steps(ckdir, steps=(1,))

    class Tty(io.StringIO):
        def isatty(self):
            return True
    tty = Tty()
    monkeypatch.setattr(sys, "stderr", tty)
    assert cli.main(["verify", ckdir]) == 0
    drawn = tty.getvalue()
    assert "verify" in drawn and "100%" in drawn and "7/7" in drawn and "OK" not in drawn
    monkeypatch.undo()
    rc, out, err = run("verify", ckdir)
    assert rc == 0 and err == "" and "OK" in out


# -- diff -----------------------------------------------------------------------------------------------

def test_diff_by_hashes_and_by_bytes_with_max_abs_difference(ckdir, run):
    a = {"big": torch.zeros(40_000), "same_big": torch.ones(40_000),
         "packed_same": torch.arange(10.0), "packed_moved": torch.zeros(10), "gone": torch.zeros(2),
         "cast": torch.zeros(3), "lr": 0.1, "name": "x"}
    b = dict(a, big=a["big"].clone(), packed_moved=torch.zeros(10), cast=torch.zeros(3, dtype=torch.float64), lr=0.05)
    b["big"][123] = -2.5
    b["packed_moved"][4] = 0.25
    del b["gone"]
    b["new"] = torch.ones(1)
    with ckpt.Checkpointer(ckdir, chunk_size=CHUNK, codec="raw") as c:
        c.save(1, a)
        c.save(2, b)
    rc, out, _ = run("diff", ckdir, 1, 2, "--max-diff", "--json")
    doc = json.loads(out)
    assert rc == 0 and doc["schema"] == "ckpt-diff/1" and doc["identical"] is False
    t = {x["key"]: x for x in doc["tensors"]}
    assert (t["big"]["status"], t["big"]["decided_by"], t["big"]["max_abs_diff"]) == ("changed", "hashes", 2.5)
    assert (t["same_big"]["status"], t["same_big"]["decided_by"]) == ("same", "hashes")
    # small tensors share a chunk, so their hash says nothing: their bytes decide
    assert (t["packed_same"]["status"], t["packed_same"]["decided_by"]) == ("same", "bytes")
    assert (t["packed_moved"]["status"], t["packed_moved"]["max_abs_diff"]) == ("changed", 0.25)
    assert t["gone"]["status"] == "removed" and t["new"]["status"] == "added"
    assert t["cast"]["status"] == "changed" and t["cast"]["decided_by"] == "shape"
    assert doc["values"] == [{"key": "lr", "a": "0.1", "b": "0.05"}]
    # the detail says what changed: elements read, chunks by hash, dtype/shape, added/removed
    assert t["big"]["detail"] == "1 of 40000 element(s) differ, max abs diff 2.5"
    assert t["packed_moved"]["detail"] == "1 of 10 element(s) differ, max abs diff 0.25"
    assert t["cast"]["detail"] == "float32(3,) -> float64(3,)" and t["gone"]["detail"] == "float32(2,)"
    assert t["same_big"]["detail"] == ""

    rc, out, _ = run("diff", ckdir, 1, 2, "--exit-code")
    assert rc == 3 and "5 tensor(s) differ" in out
    detail = {r[0]: r[3] for r in rows(out)[1:] if len(r) == 4}
    assert detail["big"] == "1 of 3 chunk(s) differ"  # decided by hashes: nothing read
    assert detail["packed_moved"] == "1 of 10 element(s) differ"  # read to decide
    assert detail["new"] == "float32(1,)" and "-" not in detail.values()
    assert {r[0] for r in rows(out)[1:]} >= {"big", "packed_moved", "gone", "new", "cast", "lr"}
    rc, out, _ = run("diff", ckdir, 2, "latest", "--exit-code", "--json")
    assert rc == 0 and json.loads(out)["identical"] is True


# -- gc -------------------------------------------------------------------------------------------------

def _orphan(root: str, seed: int) -> str:
    raw = torch.full((1000,), float(seed)).numpy().tobytes()
    h = chunk_hash(raw)
    _, bufs = encode(memoryview(raw), h, CodecSpec("raw"))
    os.makedirs(os.path.dirname(chunk_path(root, h)), exist_ok=True)
    with open(chunk_path(root, h), "wb") as f:
        f.write(b"".join(bytes(b) for b in bufs))
    return paths.chunk_key(h)


def make_garbage(root: str) -> dict[str, set[str]]:
    """Steps 1-3 committed, then what crashes leave: a failed save (step 4: chunks and a rank file),
    temp files, stray chunks. Everything is aged 2 hours except one item of each kind."""
    states = save_steps(root)
    before = set(chunk_files(root))
    disk = FaultyStorage(LocalStorage(root))
    disk.fail("commit", exc=OSError("killed"))
    with pytest.raises(ckpt.CheckpointError):
        with ckpt.Checkpointer(root, chunk_size=CHUNK, codec="raw", storage=disk) as c:
            c.save(4, frozen_and_moving(4)).wait()
    rel = lambda p: os.path.relpath(p, root)  # noqa: E731
    old = {"orphan": {rel(p) for p in set(chunk_files(root)) - before} | {_orphan(root, 1)},
           "incomplete": {paths.step_dir(4)}, "temp": set()}
    young = {"orphan": {_orphan(root, 2)}, "incomplete": set(), "temp": set()}
    for group, name in ((old, "chunks/ab/" + "ab" * 16 + ".tmp-0123456789ab"),
                        (old, paths.manifest_key(3) + ".tmp-aaaaaaaaaaaa"),
                        (young, "chunks/cd/" + "cd" * 16 + ".tmp-ba9876543210")):
        os.makedirs(os.path.dirname(os.path.join(root, name)), exist_ok=True)
        with open(os.path.join(root, name), "wb") as f:
            f.write(b"partial")
        group["temp"].add(name)
    # a second failed save, just now: its step directory is young
    os.makedirs(os.path.join(root, paths.step_dir(5)))
    shutil.copy(os.path.join(root, paths.rank_key(4, 0)), os.path.join(root, paths.rank_key(5, 0)))
    young["incomplete"].add(paths.step_dir(5))
    t = time.time() - 2 * HOUR
    young_paths = {os.path.join(root, k) for ks in young.values() for k in ks}
    for d, _, files in os.walk(root):
        for f in files:
            p = os.path.join(d, f)
            if p not in young_paths and not p.startswith(os.path.join(root, paths.step_dir(5))):
                os.utime(p, (t, t))
    return {"old": old, "young": young, "states": states}


def test_gc_removes_only_old_garbage_and_every_committed_step_still_loads(ckdir, run, monkeypatch):
    g = make_garbage(ckdir)
    every_file = lambda: sorted(os.path.relpath(os.path.join(d, f), ckdir)  # noqa: E731
                                for d, _, fs in os.walk(ckdir) for f in fs)
    files = every_file()

    rc, out, _ = run("gc", ckdir, "--dry-run", "--json")
    doc = json.loads(out)
    assert rc == 0 and every_file() == files  # a dry run touches nothing
    plan = {k: {i["object"] for i in doc["would_remove"] if i["kind"] == k} for k in ("orphan", "temp", "incomplete")}
    assert plan == g["old"]
    kept = {k: {i["object"] for i in doc["kept_younger_than_grace"] if i["kind"] == k} for k in plan}
    assert kept == g["young"]
    assert doc["bytes"] == sum(i["bytes"] for i in doc["would_remove"]) > 0
    assert all(i["age_s"] >= 2 * HOUR - 60 for i in doc["would_remove"])

    rc, out, _ = run("gc", ckdir)
    want = f"removed: {len(g['old']['orphan'])} orphan chunk(s), 2 temp file(s), 1 incomplete step(s)"
    assert rc == 0 and want in out
    gone = {k for ks in g["old"].values() for k in ks}
    assert not [f for f in every_file() if f in gone or f.startswith(paths.step_dir(4))]
    assert set(every_file()) == set(files) - {f for f in files if f in gone or f.startswith(paths.step_dir(4))}
    for s, st in g["states"].items():
        assert_loads(ckdir, s, st)
    assert run("verify", ckdir, "--all")[0] == 0

    rc, out, _ = run("gc", ckdir, "--grace", "0", "--json")  # now the young garbage goes too
    assert {i["object"] for i in json.loads(out)["removed"]} == {k for ks in g["young"].values() for k in ks}
    assert run("ls", ckdir, "--json")[1].count('"incomplete"') == 0

    # steps retention removes show their age: their manifest says when they were committed
    created = {s: ckpt.open(ckdir).manifest(s).created for s in (1, 2)}
    rc, out, _ = run("gc", ckdir, "--keep-last", "1", "--dry-run", "--json")
    ages = {i["step"]: i["age_s"] for i in json.loads(out)["would_remove"] if i["kind"] == "step"}
    assert ages.keys() == {1, 2} and all(abs(ages[s] - (time.time() - created[s])) < 60 for s in ages)
    rc, out, _ = run("gc", ckdir, "--keep-last", "1", "--dry-run")
    step_ages = [r[3] for r in rows(out)[1:] if r[0].startswith("step ")]
    assert len(step_ages) == 2 and all(a[:-1].isdigit() and a.endswith("s") for a in step_ages)  # not "?"
    rc, out, _ = run("gc", ckdir, "--keep-last", "1", "--grace", "0")  # retention, by request
    assert rc == 0 and ckpt.open(ckdir).steps() == [3]
    assert_loads(ckdir, 3, g["states"][3])
    referenced = {paths.chunk_key(h) for h in ckpt.open(ckdir).manifest(3).chunks}
    assert {os.path.relpath(p, ckdir) for p in chunk_files(ckdir)} == referenced


class Killed(BaseException):
    """A gc process dying: not an error anything in ckpt catches."""


def test_gc_killed_at_any_point_leaves_every_committed_step_loadable(ckdir, tmp_path):
    """What ``ckpt gc DIR --keep-last 2 --grace 0`` runs (``Reader.gc``, on a reader opened on a
    faulty disk), killed before each of its deletions in turn."""
    g = make_garbage(ckdir)

    def gc(root: str, killed_after: int | None = None) -> FaultyStorage:
        disk = FaultyStorage(LocalStorage(root))
        if killed_after is not None:
            disk.fail("delete", after=killed_after, exc=Killed)
        ckpt.open(disk).gc(grace_s=0, keep_last=2, dry_run=False)  # a killed process closes nothing
        return disk

    shutil.copytree(ckdir, str(tmp_path / "probe"))
    total = gc(str(tmp_path / "probe")).calls["delete"]
    assert total > 10
    for k in range(total):
        d = str(tmp_path / f"k{k}")
        shutil.copytree(ckdir, d)
        with pytest.raises(Killed):
            gc(d, killed_after=k)
        steps = ckpt.open(d).steps()
        assert steps[-2:] == [2, 3], k
        for s in steps:
            assert_loads(d, s, g["states"][s])
        shutil.rmtree(d)


# -- never unpickles; URLs; output modes; usage errors --------------------------------------------------

class _Payload:
    """Unpickling this creates a file: proof that code from the checkpoint ran."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_no_command_ever_unpickles(ckdir, run, tmp_path):
    marker = tmp_path / "pwned"
    with ckpt.Checkpointer(ckdir, allow_pickle=True) as c:
        c.save(1, {"evil": _Payload(str(marker)), "w": torch.ones(2), "n": 1})
        c.save(2, {"evil": _Payload(str(marker)), "w": torch.ones(2) * 2, "n": 2})
    outs = [run("ls", ckdir, "--verify"), run("inspect", ckdir, "--json"), run("verify", ckdir, "--all"),
            run("diff", ckdir, 1, 2, "--max-diff"), run("gc", ckdir, "--grace", "0"),
            run("export", ckdir, "--to", tmp_path / "e.safetensors"), run("export", ckdir, "--to", tmp_path / "e.pt")]
    assert [rc for rc, _, _ in outs] == [0] * 7
    assert not marker.exists()
    assert json.loads(outs[1][1])["detail"]["values"]["evil"] == "<pickled object: not loaded>"
    assert "1 pickled value(s) left out (never unpickled): evil" in outs[5][2]
    from safetensors import safe_open
    with safe_open(str(tmp_path / "e.safetensors"), "pt") as f:
        assert json.loads(f.metadata()["ckpt.values"]) == {"n": 2}


def test_memory_url_end_to_end(run, tmp_path):
    url = "memory://cli-test/run"
    fs = fsspec.filesystem("memory")
    try:
        states = {}
        with ckpt.Checkpointer(url, chunk_size=CHUNK, codec="raw") as c:
            for s in (1, 2):
                states[s] = frozen_and_moving(s)
                c.save(s, states[s])
        rc, out, _ = run("ls", url, "--json")
        assert rc == 0 and [d["step"] for d in json.loads(out)["steps"]] == [1, 2]
        rc, _, _ = run("export", url, "--to", tmp_path / "m.pt")
        got = torch.load(tmp_path / "m.pt", weights_only=True)
        assert rc == 0 and torch.equal(got["moving"], states[2]["moving"])
        h = next(iter(tensor_entry(ckpt.open(url).manifest(1), "moving").shards[0].segments)).chunk
        fs.rm(f"/cli-test/run/{paths.chunk_key(h)}")
        rc, out, _ = run("verify", url, "--all")
        assert rc == 1 and paths.chunk_key(h) in out and "missing" in out
        fs.pipe_file(f"/cli-test/run/{paths.step_dir(9)}/rank-00000.json", b"{}")
        rc, out, _ = run("gc", url, "--grace", "0", "--json")  # memory:// reports creation times
        assert {i["object"] for i in json.loads(out)["removed"]} == {paths.step_dir(9)}
        rc, out, _ = run("gc", url, "--storage-option", "use_listings_cache=false", "--json")
        assert rc == 0 and json.loads(out)["removed"] == []
    finally:
        fs.rm("/cli-test", recursive=True)


@pytest.mark.multiprocess
def test_tables_on_a_terminal_and_tsv_through_a_pipe_of_the_console_script(ckdir, monkeypatch, capsys):
    save_steps(ckdir, steps=(1, 2))
    monkeypatch.setenv("COLUMNS", "200")  # a wide terminal: every row on one line

    class Tty(io.StringIO):
        def isatty(self):
            return True
    tty = Tty()
    monkeypatch.setattr(sys, "stdout", tty)
    assert cli.main(["ls", ckdir]) == 0
    lines = tty.getvalue().splitlines()
    assert "\t" not in tty.getvalue() and set(lines[1].strip()) == {"─"} and "KiB" in lines[2]
    assert lines[0].split() == ["step", "created", "(UTC)", "ranks", "tensors", "raw", "stored", "new", "tensor",
                                "chunks", "status"]
    monkeypatch.undo()

    exe = shutil.which("ckpt") or os.path.join(os.path.dirname(sys.executable), "ckpt")
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    p = subprocess.run([exe, "ls", "file://" + ckdir], capture_output=True, text=True, env=env, timeout=120,
                       check=False)
    assert p.returncode == 0 and p.stderr == ""
    table = [line.split("\t") for line in p.stdout.splitlines()]
    assert [r[0] for r in table] == ["step", "1", "2"] and all(len(r) == 9 for r in table)
    assert int(table[1][4]) == (50_000 + 30_000 + 4) * 4 + 3 * 8


def test_usage_errors_exit_2_and_help_documents_exit_codes(ckdir, run, capsys):
    save_steps(ckdir, steps=(1,))
    for args in (["verify", ckdir, "--step", "1", "--all"], ["gc", ckdir, "--grace", "soon"],
                 ["diff", ckdir, "1"], ["inspect", ckdir, "--step", "-3"], ["export", ckdir],
                 ["ls", ckdir, "--storage-option", "novalue"]):
        with pytest.raises(SystemExit) as e:
            cli.main(args)
        assert e.value.code == 2, args
    capsys.readouterr()
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    out = capsys.readouterr().out
    assert "exit codes:" in out and "3  diff --exit-code" in out
    for cmd in ("ls", "inspect", "verify", "diff", "gc", "export"):
        assert cmd in out
    assert run("ls", ckdir, "--storage-option", "a=1")[0] == 2  # storage options on a local path
    assert run("diff", ckdir, 1, 7)[0] == 1  # a step that does not exist


class Tty(io.StringIO):
    def isatty(self):
        return True


def on_terminal(monkeypatch, width: int, *args) -> tuple[int, list[str]]:
    """cli.main(args) with stdout a terminal ``width`` columns wide: (exit code, lines)."""
    tty = Tty()
    with monkeypatch.context() as m:
        m.setenv("COLUMNS", str(width))
        m.setattr(sys, "stdout", tty)
        rc = cli.main([str(a) for a in args])
    return rc, tty.getvalue().splitlines()


def tables(lines: list[str]) -> list[list[str]]:
    """The rows of each table drawn on a terminal: the lines under its rule, up to a blank line, a
    note or gc's summary."""
    out, rows = [], None
    for line in lines + [""]:
        if line and set(line) == {"─"}:
            rows = []
        elif rows is not None and (not line.strip() or line.startswith(("(", "would remove:"))):
            out.append(rows)
            rows = None
        elif rows is not None:
            rows.append(line)
    return out


LONG = [f"model.layers.{i}.self_attn.{p}_proj.weight" for i in (0, 11) for p in "qkvo"]


def test_tables_fit_the_terminal_one_line_a_row(ckdir, tmp_path, monkeypatch, capsys):
    """At 80 columns and at 200 no line is wider than the terminal and no row folds onto a second
    line: long keys are cut in the middle (kept distinct), sizes and times get short forms,
    columns are hidden as needed and the note says so; --json keeps every key whole."""
    from rich.cells import cell_len

    with ckpt.Checkpointer(ckdir, chunk_size=CHUNK) as c:
        for s in (1, 2):
            c.save(s, {"model": {k: torch.full((64, 64), float(s + i)) for i, k in enumerate(LONG)},
                       "lr": 0.1 * s, "note": "x" * 150 + str(s)}).wait()
    _orphan(ckdir, 1)
    stray = os.path.join(ckdir, "chunks", "ab", "ab" * 32 + ".tmp-0123456789ab")
    os.makedirs(os.path.dirname(stray), exist_ok=True)
    open(stray, "wb").close()
    keys = ["model/" + k for k in LONG]

    def json_of(*args):
        assert cli.main([str(a) for a in args] + ["--json"]) in (0, 1)
        return json.loads(capsys.readouterr().out)
    ins, diff, gc = json_of("inspect", ckdir), json_of("diff", ckdir, 1, 2), json_of("gc", ckdir, "--dry-run",
                                                                                      "--grace", 0)
    assert [t["key"] for t in ins["detail"]["tensors"]] == keys  # --json: every key whole
    # inspect: the size by group, then the tensors
    expected = {("ls",): [2], ("inspect",): [1, len(keys)], ("diff", 1, 2, "--max-diff"): [len(keys), 2],
                ("gc", "--dry-run", "--grace", 0): [len(gc["would_remove"])]}
    assert len(diff["tensors"]) == len(keys) and expected[("gc", "--dry-run", "--grace", 0)] == [2]

    for width in (80, 200):
        for cmd, counts in expected.items():
            rc, lines = on_terminal(monkeypatch, width, cmd[0], ckdir, *cmd[1:])
            assert rc == 0 and lines, (cmd, width)
            assert max(map(cell_len, lines)) <= width, (cmd, width, lines)
            # one line a row: each table has exactly its rows
            assert [len(t) for t in tables(lines)] == counts, (cmd, width, lines)
        rc, lines = on_terminal(monkeypatch, width, "inspect", ckdir)
        rows = tables(lines)[1]
        names = [r.split()[0] for r in rows]
        assert len(set(names)) == len(keys)  # shortened or not, every key still distinct
        if width == 200:
            assert names == keys and all("…" not in line for line in lines[:-3])
        else:
            assert all("…" in n for n in names) and "model/model.layers.11" in " ".join(names)
            assert "(hidden: kind, shards, reused, base, chain; names cut with …; --json has it all)" in lines
        rc, lines = on_terminal(monkeypatch, width, "ls", ckdir)
        created = json_of("ls", ckdir)["steps"][0]["created"]  # 2024-06-01T12:34:56Z
        assert (created in lines[-2]) == (width == 200) and created[:10] in lines[-2]


def test_verify_problems_on_a_narrow_terminal_keep_their_whole_message(ckdir, monkeypatch, capsys):
    save_steps(ckdir, steps=(1, 2))
    c = ckpt.Checkpointer(ckdir)
    shared = tensor_entry(c.manifest(1), "frozen").shards[0].segments[1].chunk
    c.close()
    with open(chunk_path(ckdir, shared), "r+b") as f:
        f.truncate(100)
    assert cli.main(["verify", ckdir, "--all", "--json"]) == 1
    problems = json.loads(capsys.readouterr().out)["problems"]
    rc, lines = on_terminal(monkeypatch, 80, "verify", ckdir, "--all")
    assert rc == 1 and max(map(len, lines)) <= 80 and problems
    text = " ".join(line.strip() for line in lines)
    for p in problems:  # each problem's detail whole, not cut to a cell nor broken inside a word
        assert f"{p['kind']}: {p['object']} (step 1, 2): {p['message']}" in text


def test_shortened_names_stay_distinct_and_are_cut_at_separators():
    from ckpt.console import layout

    keys = [k.replace("model.", "model/", 1) for k in LONG]  # model/layers.11.self_attn.q_proj.weight
    lay = layout(["key", "n"], [[k, 1] for k in keys], {1}, {0: "middle"}, (), 33)
    names = [line.split()[0] for line in lay.lines[2:]]
    assert lay.shortened and all(len(n) <= 30 for n in names) and len(set(names)) == len(keys)
    assert "model/layers.11….q_proj.weight" in names and "model/layers.0.….q_proj.weight" in names
    # These need 34 cells to stay distinct (the layer and the projection): a column is hidden for it.
    keys = ["model/" + k for k in LONG]
    lay = layout(["key", "kind", "n"], [[k, "tensor", 1] for k in keys], {2}, {0: "middle"}, [1], 40)
    names = [line.split()[0] for line in lay.lines[2:]]
    assert lay.hidden == [1] and len(set(names)) == len(keys) and max(map(len, lay.lines)) <= 40
    # Narrower still: the columns that may go are hidden and names shortened below KEEP.
    lay = layout(["key", "a", "b"], [["x" * 50, "y" * 30, "z"]], frozenset(), {0: "end"}, [1], 20)
    assert lay.hidden == [1] and lay.lines[2] == "x" * 16 + "…  z"


def _help(monkeypatch, capsys, width: int, *args) -> list[str]:
    monkeypatch.setenv("COLUMNS", str(width))
    with pytest.raises(SystemExit) as e:
        cli.main([*args, "--help"])
    assert e.value.code == 0
    return capsys.readouterr().out.splitlines()


def test_help_wraps_to_the_terminal_without_breaking_words(monkeypatch, capsys):
    commands = list(cli.build_parser()._subparsers._group_actions[0].choices)  # type: ignore[union-attr]
    assert {"ls", "inspect", "verify", "diff", "gc", "export", "import", "chaos"} <= set(commands)
    for args in [()] + [(c,) for c in commands]:
        narrow = _help(monkeypatch, capsys, 80, *args)
        assert max(map(len, narrow)) <= 80, (args, [line for line in narrow if len(line) > 80])
        wide = _help(monkeypatch, capsys, 1000, *args)
        # the same words, only the line breaks moved: no word was cut in two (nor at a hyphen)
        assert sorted(" ".join(narrow).split()) == sorted(" ".join(wide).split()), args
    text = "\n".join(_help(monkeypatch, capsys, 80, "chaos"))
    assert "exit codes:" in text and "  1  the checkpoint is missing" in text


# -- export: where it cannot write, and ranks that were not saved ----------------------------------------

def unwritable_dir(tmp_path) -> str:
    """A directory this process cannot create files in: a read-only one, or (as root, whom file
    modes do not stop) sysfs, which refuses new files to everyone."""
    d = tmp_path / "read-only"
    d.mkdir()
    d.chmod(0o555)
    try:
        (d / "probe").touch()
    except OSError:
        return str(d)
    (d / "probe").unlink()
    try:
        open("/sys/ckpt-probe", "wb").close()
    except OSError:
        return "/sys"
    pytest.skip("no directory here refuses this process's writes")


EXPORTS = [("model.safetensors",), ("model.pt",), ("hf", "--format", "hf"), ("dcp", "--format", "dcp")]


def test_export_where_it_cannot_write_is_a_clear_error_exit_1(ckdir, run, tmp_path):
    save_steps(ckdir, steps=(1,))
    where = unwritable_dir(tmp_path)
    for name, *fmt in EXPORTS:
        to = os.path.join(where, name)
        rc, out, err = run("export", ckdir, "--to", to, *fmt)
        assert rc == 1 and out == "" and "Traceback" not in err, (name, err)
        assert err.startswith("ckpt: error: cannot ") and to in err, err
        assert not os.path.exists(to)


FULL_DISK = """
import json, os, sys
from ckpt import cli
for args in json.loads(sys.argv[1]):
    rc = cli.main(args)
    print(json.dumps({"rc": rc}), flush=True)
"""


def test_export_onto_a_full_disk_is_a_clear_error_and_leaves_nothing(ckdir, tmp_path):
    """A disk that fills up mid-write, as the file size limit makes one (EFBIG instead of ENOSPC,
    from the same write calls): each format says which file failed and what to check, exits 1,
    and leaves no partial file behind."""
    resource = pytest.importorskip("resource")
    import signal

    save_steps(ckdir, steps=(1,))  # a 320 KiB export
    out = tmp_path / "out"
    out.mkdir()
    runs = [["export", ckdir, "--to", str(out / name), *fmt] for name, *fmt in EXPORTS]

    def small_disk():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails instead of killing
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 * KiB, 64 * KiB))
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    p = subprocess.run([sys.executable, "-c", FULL_DISK, json.dumps(runs)], capture_output=True, text=True,
                       env=env, timeout=300, preexec_fn=small_disk, check=False)
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr
    assert [json.loads(line)["rc"] for line in p.stdout.splitlines()] == [1] * len(EXPORTS), p.stderr
    errors = [line for line in p.stderr.splitlines() if line.startswith("ckpt: error:")]
    assert len(errors) == len(EXPORTS)
    for (name, *_), err in zip(EXPORTS, errors):
        assert f"cannot write {out / name}: " in err and "is writable and has 0.3 MiB free" in err, err
        assert "enforce fail" not in err and "inline_container" not in err
        assert ("File too large" in err) if name.endswith(("safetensors", "hf")) else ("came out short" in err)
    assert os.listdir(out) == []  # no partial file, no staging directory


def test_export_refuses_a_rank_that_was_not_saved(ckdir, run, tmp_path):
    save_steps(ckdir, steps=(1,))  # one rank, no per-rank state: a wrong --rank used to pass unnoticed
    for rank in (5, -5, 1):
        rc, _, err = run("export", ckdir, "--to", tmp_path / "m.safetensors", "--rank", rank)
        assert rc == 2 and f"rank {rank} is out of range: step 1 was saved on rank 0 only" in err
    assert os.listdir(tmp_path) == ["ck"]
    assert run("export", ckdir, "--to", tmp_path / "m.safetensors", "--rank", 0)[0] == 0
