"""The delta codecs (issue 12): byte planes and XOR against the previous save, chosen per chunk;
chains that stay bounded, load bit-exact (every link verified), survive retention, gc and deletes
by others; the compiled core and numpy write the same bytes; unknown codecs are refused."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys

import numpy as np
import pytest
import torch

import ckpt
from ckpt import CorruptCheckpointError, IncompatibleFormatError, _ext, cli
from ckpt.format import manifest as mf
from ckpt.format import paths, rans
from ckpt.format.chunk import Base, chunk_hash, decode, verify_object
from ckpt.format.planes import RANS, SECTION_FLAGS, group, ungroup
from ckpt.save.committer import commit_step
from ckpt.save.encode import CodecSpec, encode

CHUNK = 64 * 1024


def training(saves: int, seed: int = 0):
    """States like a training run's: an embedding table with a few rows updated per step (sparse),
    dense weights that change a little everywhere, a frozen block, a step counter."""
    g = torch.Generator().manual_seed(seed)
    emb = torch.randn(4096, 64, generator=g)  # 1 MiB
    dense = torch.randn(128 * 1024, generator=g)  # 512 KiB
    frozen = torch.randn(64 * 1024, generator=g).to(torch.bfloat16)
    for s in range(saves):
        rows = torch.randint(0, 4096, (20,), generator=g)
        emb[rows] += 0.01 * torch.randn(20, 64, generator=g)
        dense.mul_(0.9995).add_(torch.randn(dense.shape, generator=g), alpha=1e-4)
        yield s, {"emb": emb.clone(), "dense": dense.clone(), "frozen": frozen.clone(), "step": s}


def empty_like(state: dict) -> dict:
    return {k: torch.empty_like(v) if isinstance(v, torch.Tensor) else -1 for k, v in state.items()}


def same(a: dict, b: dict) -> bool:
    return all(torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k] for k in a)


def data_chunks(m: mf.Manifest, key: str | None = None) -> set[str]:
    return {g.chunk for t in m.tensors if key in (None, t.key) for s in t.shards for g in s.segments}


def save_run(root: str, saves: int, **kw) -> dict[int, dict]:
    """Saves with codec="smallest": auto's choice per chunk, without its raw probes (deterministic)."""
    states = {}
    with ckpt.Checkpointer(root, chunk_size=CHUNK, **{"codec": "smallest", **kw}) as c:
        for s, state in training(saves):
            c.save(s, state).wait()
            states[s] = state
    return states


def test_sparse_and_frozen_state_is_stored_as_small_deltas_in_bounded_chains(tmp_path):
    root = str(tmp_path / "ck")
    states: dict[int, dict] = {}
    written = {}
    with ckpt.Checkpointer(root, chunk_size=CHUNK, delta_chain=4, codec="smallest") as c:
        for s, state in training(10):
            written[s] = c.save(s, state).wait()
            states[s] = state
        assert c.host_buffers == 2  # the previous save stays in the second buffer
        assert written[9].host_bytes == 2 * written[0].host_bytes  # as large as the first
    first = written[0].written_bytes
    longest, whole_again, prev = 0, 0, set()
    for s in range(1, 10):
        m = ckpt.open(root).manifest(s)
        emb = data_chunks(m, "emb")
        new = emb - prev
        prev = emb
        # a chain is at most 4 chunks: a chunk changed a 4th time in a row is stored whole again
        longest = max(longest, max(len(mf.chain(m.chunks, h)) for h in m.chunks))
        assert longest <= 4
        # a load of any chunk reads at most delta_budget (default 1.0) times its size: no more than raw
        assert all(sum(m.chunks[x].stored for x in mf.chain(m.chunks, h)) <= 1.0 * i.size
                   for h, i in m.chunks.items() if i.base is not None)
        whole_again += sum(1 for h in new if m.chunks[h].base is None)
        deltas = {h for h in new if m.chunks[h].codec.startswith("xor/")}
        assert len(deltas) >= len(new) // 2, s
        # 20 of 4096 rows changed: a delta is a few percent of its chunk
        assert sum(m.chunks[h].stored for h in deltas) < 0.1 * CHUNK * len(deltas), s
        assert written[s].written_bytes < 0.6 * first and written[s].chunks_delta == len(deltas | {
            h for h in data_chunks(m, "dense") if m.chunks[h].codec.startswith("xor/") and h not in
            data_chunks(ckpt.open(root).manifest(s - 1))})
    assert longest == 4 and whole_again > 0
    with ckpt.Checkpointer(root) as c:
        for s in range(10):
            got = empty_like(states[s])
            assert c.load(s, got) == s
            assert same(got, states[s]), s
    assert cli.main(["verify", root, "--all"]) == 0


def test_delta_budget_trades_bytes_per_save_against_bytes_per_load(tmp_path):
    stored, reads = {}, {}
    for budget in (1.0, 1.3, 4.0):
        root = str(tmp_path / f"b{budget}")
        save_run(root, 5, delta_budget=budget)
        m = ckpt.open(root).manifest(4)
        dense = data_chunks(m, "dense")
        stored[budget] = sum(m.chunks[h].stored for h in dense)
        reads[budget] = max(sum(m.chunks[x].stored for x in mf.chain(m.chunks, h)) / m.chunks[h].size for h in dense)
        assert all(len(mf.chain(m.chunks, h)) == 1 or reads[budget] <= budget for h in dense)
    # dense float deltas are large: 1.0 leaves no room for them, 4.0 chains them all the way
    assert stored[4.0] < stored[1.3] <= stored[1.0] and reads[4.0] > 1.3
    with pytest.raises(ckpt.ConfigError, match="delta_budget"):
        ckpt.Checkpointer(str(tmp_path / "bad"), delta_budget=0.5)


def test_deltas_off_with_delta_chain_1_or_another_codec(tmp_path):
    for kw in ({"delta_chain": 1}, {"codec": "smallest", "delta_chain": 1}, {"codec": "zstd"}, {"codec": "grouped"},
               {"codec": "raw"}):
        root = str(tmp_path / json.dumps(kw).replace('"', "").replace(" ", ""))
        with ckpt.Checkpointer(root, chunk_size=CHUNK, **kw) as c:
            for s, state in training(3):
                c.save(s, state).wait()
            assert c.host_buffers == 1
        m = ckpt.open(root).manifest(2)
        assert all(i.base is None and i.codec.split("/")[0] != "xor" for i in m.chunks.values()), kw
        assert m.format_version == (4 if kw.get("codec") in (None, "grouped", "smallest") else 1), kw


def test_keep_last_keeps_the_bases_of_kept_steps_and_gc_removes_only_the_rest(tmp_path):
    root = str(tmp_path / "ck")
    states = save_run(root, 10, keep_last=2, delta_chain=8)
    with ckpt.Checkpointer(root) as c:
        assert c.steps() == [8, 9]
        tables = [c.manifest(s).chunks for s in (8, 9)]
        assert any(i.base is not None for i in tables[1].values())
        # bases from steps retention deleted are still listed, and stored
        needed = set(tables[0]) | set(tables[1])
        assert needed - data_chunks(c.manifest(8)) - data_chunks(c.manifest(9))
        on_disk = {f for _, _, fs in os.walk(os.path.join(root, "chunks")) for f in fs}
        assert on_disk == needed
        for s in (8, 9):
            got = empty_like(states[s])
            c.load(s, got)
            assert same(got, states[s])
    assert cli.main(["gc", root, "--grace", "0"]) == 0
    assert {f for _, _, fs in os.walk(os.path.join(root, "chunks")) for f in fs} == needed
    assert cli.main(["verify", root, "--all"]) == 0


def _retention_killed_after(root: str, kill_after: int) -> int:
    """Run retention (keep the newest 2) on ``root`` in a forked child that SIGKILLs itself before
    delete number ``kill_after + 1``; returns the child's wait status (0: it finished)."""
    from ckpt.format.manifest import ManifestCache, committed_steps
    from ckpt.save.retention import delete_steps, to_delete
    from ckpt.storage import open_storage

    pid = os.fork()
    if pid == 0:  # the child: a real kill, between two deletes
        try:
            st = open_storage(root)
            count = [0]
            orig = st.delete

            def counted(key: str) -> None:
                count[0] += 1
                if count[0] > kill_after:
                    os.kill(os.getpid(), signal.SIGKILL)
                orig(key)
            st.delete = counted  # type: ignore[method-assign]
            steps = committed_steps(st)
            victims = to_delete(steps, 2, ())
            delete_steps(st, ManifestCache(st), victims, [s for s in steps if s not in victims],
                         lambda keys: [st.delete(k) for k in keys])
        finally:
            os._exit(0)
    return os.waitpid(pid, 0)[1]


def test_retention_killed_at_every_delete_count_leaves_every_committed_step_loadable(tmp_path):
    made = str(tmp_path / "made")
    states = save_run(made, 4, delta_chain=2)  # chains restart at save 2: saves 0 and 1 can go
    kill_after, finished = 0, False
    while not finished:
        root = str(tmp_path / f"k{kill_after}")
        shutil.copytree(made, root)
        status = _retention_killed_after(root, kill_after)
        assert status in (0, signal.SIGKILL), status
        finished = status == 0
        with ckpt.Checkpointer(root) as c:
            steps = c.steps()
            assert {2, 3} <= set(steps)
            for s in steps:
                got = empty_like(states[s])
                c.load(s, got)
                assert same(got, states[s]), (kill_after, s)
        kill_after += 1
    assert kill_after > 5  # it was killed after every one of its deletes before it could finish
    chunks = [sum(len(fs) for _, _, fs in os.walk(os.path.join(d, "chunks"))) for d in (made, root)]
    assert chunks[1] < chunks[0]  # and it deleted chunks (not only the manifests of the steps it removed)


def test_a_partial_load_reads_only_the_chunks_it_needs_and_their_bases(tmp_path):
    root = str(tmp_path / "ck")
    states = save_run(root, 4)
    with ckpt.Checkpointer(root) as c:
        m = c.manifest(3)
        got = {"emb": torch.empty(4096, 64)}
        c.load(3, got, strict=False)
        assert torch.equal(got["emb"], states[3]["emb"])
        emb = data_chunks(m, "emb")
        assert set(c.last_load.chunks) == emb
        links = mf.closure(m.chunks, emb)
        assert len(links) > len(emb)  # it had to read bases
        assert c.last_load.bytes_read == sum(i.stored for i in links.values())


def test_a_base_deleted_by_another_process_is_written_again_whole(tmp_path):
    root = str(tmp_path / "ck")
    states = {}
    with ckpt.Checkpointer(root, chunk_size=CHUNK, codec="smallest") as c:
        gen = training(4)
        for _ in range(2):
            s, state = next(gen)
            c.save(s, state).wait()
            states[s] = state
        m1 = c.manifest(1)
        gone = sorted({i.base for i in m1.chunks.values() if i.base is not None})
        assert gone
        for h in gone:  # e.g. a bucket lifecycle rule
            os.unlink(os.path.join(root, paths.chunk_key(h)))
        s, state = next(gen)
        c.save(s, state).wait()
        states[s] = state
        m2 = c.manifest(2)
        assert not set(gone) & set(m2.chunks)
    with ckpt.Checkpointer(root) as c:
        got = empty_like(states[2])
        c.load(2, got)
        assert same(got, states[2])
    assert cli.main(["verify", root, "--step", "2"]) == 0


def test_verify_names_a_damaged_base_and_every_step_and_delta_it_breaks(tmp_path, capsys):
    root = str(tmp_path / "ck")
    save_run(root, 3)
    m2 = ckpt.open(root).manifest(2)
    delta = next(h for h in sorted(data_chunks(m2, "emb")) if m2.chunks[h].codec.startswith("xor/"))
    base = mf.chain(m2.chunks, delta)[-1]
    path = os.path.join(root, paths.chunk_key(base))
    blob = bytearray(open(path, "rb").read())
    blob[-100] ^= 0x40
    open(path, "wb").write(bytes(blob))
    capsys.readouterr()
    assert cli.main(["verify", root, "--all", "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    named = {p["chunk"]: p for p in doc["problems"]}
    assert base in named and delta in named
    holding = [s for s in range(3) if delta in ckpt.open(root).manifest(s).chunks]
    assert named[delta]["steps"] == holding and "base is damaged" in named[delta]["message"]
    assert named[base]["steps"] == [0, 1, 2]  # the whole chunk of save 0 is every step's base
    with pytest.raises(CorruptCheckpointError):
        ckpt.Checkpointer(root).load(2, {"emb": torch.empty(4096, 64)}, strict=False)


def test_verify_checks_each_step_against_its_own_chunk_table(tmp_path, capsys):
    """A step whose chunk is stored as a delta of a base only other steps list cannot load: verify says
    so for that step alone, whether another step listing the base sorts before or after it (it once
    took the base from another step's table and said OK). Such steps are what two jobs racing on one
    chunk committed before chunk objects were create-only; here they are made by copying in the
    steps of another root that stored the chunk whole."""
    from ckpt.reader import Reader
    from ckpt.reader.verify import verify
    from ckpt.storage import LocalStorage

    root, other = str(tmp_path / "ck"), str(tmp_path / "other")
    before = torch.randn(CHUNK // 4, generator=torch.Generator().manual_seed(11))
    after = before.clone()
    after[:8] += 1
    with ckpt.Checkpointer(root, chunk_size=CHUNK, codec="smallest") as c:
        c.save(1, {"w": before})
        c.save(3, {"w": after})  # its chunk: a delta of step 1's
    with ckpt.Checkpointer(other, chunk_size=CHUNK, codec="smallest") as c:
        c.save(2, {"w": after})  # the same chunk, whole
        c.save(4, {"w": after})
    for s in (2, 4):
        shutil.copytree(os.path.join(other, paths.step_dir(s)), os.path.join(root, paths.step_dir(s)))
    (x,) = ckpt.open(root).manifest(3).chunks.keys() - ckpt.open(root).manifest(1).chunks.keys()
    assert ckpt.open(root).manifest(3).chunks[x].base is not None and ckpt.open(root).manifest(4).chunks[x].base is None
    capsys.readouterr()
    assert cli.main(["verify", root, "--all", "--json"]) == 1
    (problem,) = json.loads(capsys.readouterr().out)["problems"]
    assert problem["chunk"] == x and problem["steps"] == [2, 4] and "do not list" in problem["message"]
    reader = Reader(LocalStorage(root))
    assert [p.steps for p in verify(reader, [3, 4]).problems] == [[4]]
    assert verify(reader, [1, 3]).ok
    assert cli.main(["verify", root, "--step", "3"]) == 0 and cli.main(["verify", root, "--step", "4"]) == 1
    with pytest.raises(CorruptCheckpointError, match="which its step does not list"):
        ckpt.Checkpointer(root).load(4, {"w": torch.empty(CHUNK // 4)})


def test_inspect_ls_and_export_understand_deltas(tmp_path, capsys):
    root = str(tmp_path / "ck")
    states = save_run(root, 3)
    capsys.readouterr()
    assert cli.main(["inspect", root, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    emb = next(t for t in doc["detail"]["tensors"] if t["key"] == "emb")
    assert any(c.startswith("xor/") for c in emb["codecs"])
    assert emb["base_steps"] == [1] and emb["chain"] == 3 and emb["ratio"] > 4
    frozen = next(t for t in doc["detail"]["tensors"] if t["key"] == "frozen")
    assert frozen["reused_chunks"] == frozen["chunks"]  # unchanged: the same chunks as before, nothing new
    assert cli.main(["inspect", root]) == 0
    text = capsys.readouterr().out
    assert "xor" in text and "chain" in text
    assert cli.main(["ls", root, "--json"]) == 0
    steps = json.loads(capsys.readouterr().out)["steps"]
    assert steps[2]["new_bytes"] < 0.5 * steps[0]["new_bytes"]  # bytes stored by each step
    out = str(tmp_path / "s2.pt")
    assert cli.main(["export", root, "--step", "2", "--to", out]) == 0
    exported = torch.load(out, weights_only=True)
    assert torch.equal(exported["emb"], states[2]["emb"]) and torch.equal(exported["dense"], states[2]["dense"])


# -- the codecs themselves ---------------------------------------------------------------------------

def _chunk(n: int, dtype=torch.float32, seed: int = 0) -> memoryview:
    t = torch.randn(n // torch.tensor([], dtype=dtype).element_size(), generator=torch.Generator().manual_seed(seed))
    return memoryview(t.to(dtype).numpy().view(np.uint8) if dtype != torch.bfloat16 else
                      t.to(dtype).view(torch.uint8).numpy()).cast("B")


@pytest.mark.parametrize("n", [5000, 65536 + 3, 1 << 20])
@pytest.mark.parametrize("width", [1, 2, 3, 4, 8])
def test_compiled_core_and_numpy_write_the_same_bytes(monkeypatch, n, width):
    raw = _chunk(n)
    near = bytearray(raw)
    near[::97] = bytes(len(near[::97]))  # a related chunk: some bytes differ
    base = Base(memoryview(bytes(near)), chunk_hash(near))
    h = chunk_hash(raw)
    outs = []
    for disabled in ("", "1"):
        monkeypatch.setenv("CKPT_NO_EXT", disabled)
        encs = [encode(raw, h, CodecSpec(name), width=width, base=base) for name in ("grouped", "auto")]
        g = group(raw, base.raw, width)
        back = ungroup(g, base.raw, width, np.empty(len(raw), np.uint8))
        assert bytes(back) == bytes(raw)
        outs.append([b"".join(bytes(b) for b in e[1]) for e in encs] + [g.tobytes()])
        for (name, _), blob in zip(encs, outs[-1]):
            assert bytes(decode(blob, name="x", expect_hash=h, base=base)) == bytes(raw), name
            work = np.frombuffer(bytes(base.raw), np.uint8).copy()  # a delta decoded in place, into its base
            got = decode(blob, name="x", expect_hash=h, base=Base(work.data, base.digest), out=work)
            assert bytes(got) == bytes(raw), name
    assert outs[0] == outs[1]


def test_auto_picks_xor_where_it_pays_and_refuses_bad_deltas():
    base_t = torch.randn(1 << 18)
    new_t = base_t.clone()
    new_t[::1000] += 1.0
    raw, braw = (memoryview(t.numpy().view(np.uint8)).cast("B") for t in (new_t, base_t))
    h, bh = chunk_hash(raw), chunk_hash(braw)
    name, bufs = encode(raw, h, CodecSpec("auto"), width=4, base=Base(braw, bh))
    blob = b"".join(bytes(b) for b in bufs)
    assert name == "xor" and len(blob) < 0.05 * len(raw)
    assert bytes(decode(blob, name="x", expect_hash=h, base=Base(braw, bh))) == bytes(raw)
    verify_object(f"chunks/{h[:2]}/{h}", [memoryview(blob)])  # a tier's check needs no base
    other = Base(memoryview(bytes(len(raw))), "0" * 32)
    with pytest.raises(CorruptCheckpointError, match="base"):
        decode(blob, name="x", expect_hash=h, base=other)
    bad = bytearray(blob)
    bad[-3] ^= 1
    with pytest.raises(CorruptCheckpointError, match="payload check"):
        verify_object(f"chunks/{h[:2]}/{h}", [memoryview(bytes(bad))])
    # unrelated data: no delta; random bytes: raw
    noise = memoryview(np.random.default_rng(0).integers(0, 256, 1 << 20, dtype=np.uint8)).cast("B")
    assert encode(noise, chunk_hash(noise), CodecSpec("auto"), width=4, base=None)[0] == "raw"



@pytest.mark.parametrize("disabled", ["", "1"])
def test_a_plane_that_is_one_byte_repeated_is_kept_as_rans_runs_not_a_zstd_frame(monkeypatch, disabled):
    """A fixed bit flip (or a frozen tensor's zero delta) makes every delta plane one byte repeated:
    stored as one-symbol rANS blocks (written as runs, skipped by a chain decoded in one pass), not as
    the slightly smaller zstd frame that must be inflated; the same bytes with and without the core."""
    monkeypatch.setenv("CKPT_NO_EXT", disabled)
    base_t = torch.randn(1 << 20, generator=torch.Generator().manual_seed(3))
    new_t = (base_t.view(torch.int32) ^ 0x5A0F).view(torch.float32)  # the same low mantissa bits flipped
    raw, braw = (memoryview(t.numpy().view(np.uint8)).cast("B") for t in (new_t, base_t))
    h, base = chunk_hash(raw), Base(braw, chunk_hash(braw))
    name, bufs = encode(raw, h, CodecSpec("auto"), width=4, base=base)
    assert name == "xor"
    table = np.frombuffer(bytes(bufs[1]), "<u8")
    n = len(raw) // 4
    for i, entry in enumerate(table[:4]):
        assert entry & np.uint64(SECTION_FLAGS[RANS]), f"plane {i} is not rANS"
        assert rans.repeats(bytes(bufs[2 + i]), n)
    blob = b"".join(bytes(b) for b in bufs)
    assert bytes(decode(blob, name="x", expect_hash=h, base=base)) == bytes(raw)
    assert len(blob) < 64 + 8 * 5 + 4 * (2 + 6 * (n // 16384)) + 64  # header, table, four runs of blocks


def _stored(root: str, steps: range) -> list[dict[str, tuple[str, int]]]:
    """Per step, every chunk's codec and stored size, and the bytes of the objects themselves."""
    out = []
    for s in steps:
        m = ckpt.open(root).manifest(s)
        out.append({h: (i.codec, i.stored, chunk_hash(open(os.path.join(root, paths.chunk_key(h)), "rb").read()))
                    for h, i in m.chunks.items()})
    return out


def test_auto_stores_the_same_bytes_whatever_else_the_machine_is_doing(tmp_path):
    """No timing decides what ``auto`` writes: the same saves on an idle machine and on one whose
    every core is kept busy by other processes store the same objects, and the sparse table's
    deltas stay small on both."""
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 2)]
    try:
        with ckpt.Checkpointer(str(tmp_path / "busy"), chunk_size=CHUNK) as c:
            written = [c.save(s, state).wait() for s, state in training(4)]
    finally:
        for p in busy:
            p.kill()
            p.wait()
    with ckpt.Checkpointer(str(tmp_path / "idle"), chunk_size=CHUNK) as c:
        for s, state in training(4):
            c.save(s, state).wait()
    assert _stored(str(tmp_path / "busy"), range(4)) == _stored(str(tmp_path / "idle"), range(4))
    m = ckpt.open(str(tmp_path / "busy")).manifest(3)
    emb = data_chunks(m, "emb") - data_chunks(ckpt.open(str(tmp_path / "busy")).manifest(2), "emb")
    assert sum(m.chunks[h].stored for h in emb) <= 0.05 * sum(m.chunks[h].size for h in emb)  # sparse: tiny deltas
    assert all(w.written_bytes < written[0].written_bytes for w in written[1:])


def test_rans_sections_decode_the_same_with_the_compiled_core_and_without(monkeypatch):
    rng = np.random.default_rng(3)
    exps = (126 - np.abs(rng.normal(0, 3, 50_000)).astype(np.int64)).astype(np.uint8)  # float exponents
    cases = [exps, rng.integers(0, 256, 40_000, dtype=np.uint8), np.full(20_000, 7, np.uint8), np.zeros(0, np.uint8),
             # one block of many symbols seen once: frequencies raised to 1 must be taken back from the largest
             np.concatenate([np.zeros(16_000, np.uint8), np.arange(200, dtype=np.uint8), np.full(184, 9, np.uint8)])]
    for a in cases:
        monkeypatch.setenv("CKPT_NO_EXT", "")
        compiled = rans.encode(a)
        monkeypatch.setenv("CKPT_NO_EXT", "1")
        assert rans.encode(a) == compiled  # the numpy fallback writes the same bytes
        for disabled in ("", "1"):
            monkeypatch.setenv("CKPT_NO_EXT", disabled)
            out = np.empty_like(a)
            rans.decode_into(compiled, out)
            assert np.array_equal(out, a)
    assert len(rans.encode(exps)) < 0.4 * exps.size  # ~2.6 bits a symbol


@pytest.mark.parametrize("disabled", ["", "1"])
def test_damaged_rans_sections_are_refused(monkeypatch, disabled):
    monkeypatch.setenv("CKPT_NO_EXT", disabled)
    a = (126 - np.abs(np.random.default_rng(4).normal(0, 3, 40_000)).astype(np.int64)).astype(np.uint8)
    sec = bytearray(rans.encode(a))
    out = np.empty_like(a)
    for damage in (lambda b: b[:-3], lambda b: b + b"\0\0", lambda b: b[:1] + b"\x30" + b[2:],
                   lambda b: b[:7] + bytes([b[7] ^ 0xFF]) + b[8:], lambda b: b[:100] + bytes([b[100] ^ 1]) + b[101:],
                   lambda b: b[:-41] + bytes([b[-41] ^ 4]) + b[-40:]):
        bad = bytes(damage(bytes(sec)))
        try:
            rans.decode_into(bad, out)
        except rans.RansError:
            continue
        assert not np.array_equal(out, a)  # a flipped word can decode to other bytes: the chunk hash refuses those


def _rans_cases() -> list[tuple[str, np.ndarray, int]]:
    """(name, symbols, block log): every shape of input the decoders must agree on."""
    rng = np.random.default_rng(11)
    exps = (126 - np.abs(rng.normal(0, 3, 9 * 16384 + 1005)).astype(np.int64)).astype(np.uint8)
    skewed = np.where(rng.random(70_000) < 0.0005, 200, 3).astype(np.uint8)  # one symbol at 4094/4096
    mixed = np.concatenate([exps[:16384], np.full(16384, 9, np.uint8), exps[:3 * 16384],  # one-symbol block inside
                            rng.integers(0, 256, 16384 + 17, dtype=np.uint8)])
    cases = [("exponents", exps, 14), ("uniform", rng.integers(0, 256, 5 * 16384 + 3, dtype=np.uint8), 14),
             ("skewed", skewed, 14), ("single", np.full(3 * 16384 + 5, 7, np.uint8), 14), ("mixed", mixed, 14),
             ("small blocks", exps[:40_000], 8), ("large blocks", exps[:3 * 65536 + 77], 16)]
    cases += [(f"{n} symbols", exps[:n], 14) for n in (0, 1, 7, 8, 31, 32, 33, 255, 16383, 16384, 16385)]
    return cases


def _rans_encode(a: np.ndarray, block_log: int, monkeypatch) -> bytes:
    if block_log == rans.BLOCK_LOG:
        return rans.encode(a)
    monkeypatch.setattr(rans, "BLOCK_LOG", block_log)  # the format allows 2^8 to 2^16; the numpy encoder writes it
    try:
        return rans._encode_numpy(a)
    finally:
        monkeypatch.undo()


@pytest.mark.skipif(_ext.cpu() is None, reason="compiled core not built")
def test_the_vector_rans_decoder_gives_the_scalar_decoders_bytes(monkeypatch):
    """The vector decoders (AVX-512, AVX2: those the CPU has) against the scalar one and numpy's, on
    random, skewed, one-symbol, mixed and short inputs, blocks of every allowed size; output written
    to the byte."""
    core = _ext.cpu()
    for name, a, block_log in _rans_cases():
        sec = _rans_encode(a, block_log, monkeypatch)
        for simd in (2, 1, 0):
            out = np.full(a.size + 64, 0xA5, np.uint8)  # room after the output: nothing may land there
            assert core.rans_decode(sec, out[:a.size], simd) == 0, (name, simd)
            assert np.array_equal(out[:a.size], a), (name, simd)
            assert (out[a.size:] == 0xA5).all(), (name, simd)
        ref = np.empty_like(a)
        if a.size <= 100_000:
            rans._decode_numpy(np.frombuffer(sec, np.uint8), ref)
            assert np.array_equal(ref, a), name


@pytest.mark.skipif(_ext.cpu() is None, reason="compiled core not built")
def test_planes_decoded_a_tile_at_a_time_match_the_plane_by_plane_decode(monkeypatch):
    """ckpt_planes_decode (rANS planes decoded a tile at a time, interleaved and hashed while in
    cache) against decoding each plane whole, then ungroup, then xxhash: widths 2, 4, 8, rotated or
    not, with a base (also in place), tails, short chunks, several coded planes, blocks of 2^8 and
    2^16 symbols, every vector level."""
    core = _ext.cpu()
    rng = np.random.default_rng(13)
    shapes = [(5 * 65536 * 4 + 3, 4, True, False, 14), (300_001, 2, True, True, 14), (200_000, 8, True, False, 14),
              (70_000, 4, False, True, 8), (3 * 65536 * 2 + 7, 2, False, False, 16), (250, 4, True, False, 14),
              (100, 4, True, True, 14), (3, 4, False, False, 14), (0, 2, True, False, 14)]
    for n, w, rot, with_base, block_log in shapes:
        raw = (rng.normal(0, 1, (n + 3) // 4).astype(np.float32).view(np.uint8)[:n]).copy()
        base = (raw ^ (rng.random(n) < 0.01).astype(np.uint8)) if with_base else None
        g = group(raw, base, w, rot=rot)
        m = n // w
        plane = [g[k * m:(k + 1) * m] for k in range(w)]
        coded = [k >= w - 2 for k in range(w)]  # the top two planes rANS-coded, the rest as they are
        srcs = [np.frombuffer(_rans_encode(plane[k], block_log, monkeypatch), np.uint8) if coded[k] else plane[k]
                for k in range(w)]
        for simd in (2, 1, 0):
            out = np.full(n + 64, 0xA5, np.uint8)
            err, digest = core.planes_decode(srcs, coded, g[m * w:], base, out[:n], rot, simd)
            assert err == 0 and np.array_equal(out[:n], raw) and (out[n:] == 0xA5).all(), (n, w, simd)
            assert digest == (chunk_hash(raw) if n > 240 else None), (n, w)
            if base is not None:  # a delta decoded over its base, in place
                work = base.copy()
                assert core.planes_decode(srcs, coded, g[m * w:], work, work, rot, simd)[0] == 0
                assert np.array_equal(work, raw)
        if n > 1000:
            bad = srcs[w - 1].copy()
            bad[len(bad) // 2] ^= 0x10
            err, digest = core.planes_decode(srcs[:w - 1] + [bad], coded, g[m * w:], base, np.empty(n, np.uint8), rot)
            assert err != 0 or digest != chunk_hash(raw)  # refused, or bytes that the hash refuses


def _guarded(data: bytes, flush_end: bool):
    """``data`` in memory flush against a page no one may touch (after it, or before it): a decoder
    that reads outside the section crashes the test instead of passing unseen. Returns (the view,
    the mapping that must outlive it)."""
    import ctypes
    import mmap
    page = mmap.PAGESIZE
    size = (len(data) + page - 1) // page * page + 2 * page
    m = mmap.mmap(-1, size)
    buf = np.frombuffer(m, np.uint8)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    start = size - page - len(data) if flush_end else page
    buf[start:start + len(data)] = np.frombuffer(data, np.uint8)
    for addr in (buf.ctypes.data, buf.ctypes.data + size - page):
        assert libc.mprotect(addr, page, 0) == 0  # PROT_NONE
    return buf[start:start + len(data)], m


def _rans_damage(sec: bytes, rng) -> list[bytes]:
    """Truncations, flipped bytes (anywhere, and in each block's header), and word counts moved
    between the streams of a block (the total kept, so only the streams' bounds are wrong)."""
    out = [sec[:k] for k in sorted({2, 3, 7, len(sec) // 2, len(sec) - 1, *rng.integers(2, len(sec), 8)})]
    for pos in [*rng.integers(0, len(sec), 40), 0, 1, 2, 5, 6, 7, 8]:
        b = bytearray(sec)
        b[pos] ^= int(rng.integers(1, 256))
        out.append(bytes(b))
    pos = 2
    while pos + 4 <= len(sec):  # every block: its header bytes, and its streams' bounds
        size = int.from_bytes(sec[pos:pos + 4], "little")
        present = sec[pos + 4] + 1
        if present > 1:
            counts = pos + 5 + 3 * present + 32
            for k in (pos, pos + 3, pos + 4, pos + 5, counts - 32, counts - 1):
                b = bytearray(sec)
                b[k] ^= 0x40
                out.append(bytes(b))
            c = np.frombuffer(sec[counts:counts + 16], "<u2").astype(np.int64)
            for moved in (np.r_[c.sum(), [0] * 7], np.r_[[0] * 7, c.sum()], np.roll(c, 1), c + np.r_[1, -1, [0] * 6]):
                if (moved >= 0).all() and (moved < 65536).all() and not np.array_equal(moved, c):
                    out.append(sec[:counts] + moved.astype("<u2").tobytes() + sec[counts + 16:])
        pos += 4 + size
    return out


@pytest.mark.skipif(_ext.cpu() is None, reason="compiled core not built")
@pytest.mark.parametrize("flush_end", [True, False])
def test_damaged_rans_sections_fail_alike_in_both_decoders_and_stay_in_bounds(monkeypatch, flush_end):
    """Every damaged section is refused by the vector decoders whenever the scalar one refuses it
    (or both decode it to the same bytes: a flipped word can decode to other bytes, which the
    chunk hash then refuses), and neither reads outside the section (guard pages) or writes
    outside its output."""
    core = _ext.cpu()
    rng = np.random.default_rng(12)
    for name, a, block_log in _rans_cases():
        if a.size < 1000:
            continue
        for bad in _rans_damage(_rans_encode(a, block_log, monkeypatch), rng):
            view, mapping = _guarded(bad, flush_end)
            results = []
            for simd in (2, 1, 0):
                out = np.full(a.size + 64, 0xA5, np.uint8)
                rc = core.rans_decode(view, out[:a.size], simd)
                assert (out[a.size:] == 0xA5).all(), name
                results.append((rc != 0, None if rc else out[:a.size].tobytes()))
            assert results[0] == results[1] == results[2], name
            del view, mapping


def test_a_damaged_rans_section_fails_the_chunk_clearly():
    """Through the chunk decoder: a rANS section that does not decode is CorruptCheckpointError."""
    raw = memoryview(torch.randn(1 << 18, generator=torch.Generator().manual_seed(3)).numpy()).cast("B")
    h = chunk_hash(raw)
    blob = bytearray(b"".join(bytes(b) for b in encode(raw, h, CodecSpec("auto"), width=4, rotate=True)[1]))
    table = np.frombuffer(bytes(blob[64:64 + 40]), "<u8")
    assert (table & np.uint64(1 << 62)).any()  # the exponent plane is rANS-coded
    at = 64 + 40 + int((table[:3] & np.uint64((1 << 62) - 1)).sum())  # where the fourth section starts
    blob[at + 2] ^= 0x01  # its first block's length
    with pytest.raises(CorruptCheckpointError, match="rANS"):
        decode(bytes(blob), name="x", expect_hash=h)


def test_unknown_codecs_and_formats_are_refused_clearly(tmp_path):
    raw = _chunk(1 << 16)
    h = chunk_hash(raw)
    blob = bytearray(b"".join(bytes(b) for b in encode(raw, h, CodecSpec("grouped"), width=4)[1]))
    blob[10] = 9  # a codec id from a newer ckpt
    with pytest.raises(IncompatibleFormatError, match="codec id 9"):
        decode(bytes(blob), name="x", expect_hash=h)
    root = str(tmp_path / "ck")
    save_run(root, 2)
    path = os.path.join(root, paths.manifest_key(1))
    doc = json.load(open(path))
    assert doc["format_version"] == 4
    h1 = next(k for k, v in doc["chunks"].items() if v[2].startswith("xor/"))
    for change, error in ((lambda d: d["chunks"][h1].__setitem__(2, "xor/4"), IncompatibleFormatError),
                          (lambda d: d.__setitem__("format_version", mf.FORMAT_VERSION + 1), IncompatibleFormatError),
                          (lambda d: d["chunks"][h1].__setitem__(3, h1), CorruptCheckpointError),  # loops
                          (lambda d: d["chunks"][h1].__setitem__(3, "e" * 32), CorruptCheckpointError)):
        d = json.loads(json.dumps(doc))
        change(d)
        with pytest.raises(error):
            mf.parse(json.dumps(d).encode(), name="m")


# -- several ranks --------------------------------------------------------------------------------------

def _sharded_state(rank: int, step: int) -> dict:
    """Rows of a global (4096, 64) table, a few rows changed per step, saved as each rank's box."""
    g = torch.Generator().manual_seed(3)
    full = torch.randn(4096, 64, generator=g)
    for s in range(1, step + 1):
        full[torch.randint(0, 4096, (16,), generator=g)] += 0.01 * s
    rows = slice(0, 1500) if rank == 0 else slice(1500, 4096)
    return {"table": ckpt.LocalShard(full[rows].clone(), (rows.start, 0), (4096, 64)), "step": step}


def _save_sharded(rank: int, world: int, root: str) -> dict:
    with ckpt.Checkpointer(root, chunk_size=CHUNK, codec="smallest") as c:
        deltas = 0
        for s in range(5):
            deltas += c.save(s, _sharded_state(rank, s)).wait().chunks_delta
    return {"deltas": deltas}


def _load_sharded(rank: int, world: int, root: str) -> bool:
    want = _sharded_state(rank, 4)
    got = {"table": ckpt.LocalShard(torch.zeros_like(want["table"].tensor), want["table"].offsets, (4096, 64)),
           "step": -1}
    ckpt.Checkpointer(root).load(4, got)
    return torch.equal(got["table"].tensor, want["table"].tensor) and got["step"] == 4


@pytest.mark.multiprocess
@pytest.mark.slow
def test_two_ranks_write_deltas_of_their_own_shards_and_any_world_size_loads_them(tmp_path):
    from ckpt.testing import run_ranks

    root = str(tmp_path / "ck")
    saved = run_ranks(2, _save_sharded, root)
    assert all(r["deltas"] > 0 for r in saved)  # each rank XORs against its own previous save
    m = ckpt.open(root).manifest(4)
    assert any(i.base is not None for i in m.chunks.values())
    assert run_ranks(2, _load_sharded, root) == [True, True]
    # one process takes the whole table: every shard's chunks and their bases, resolved and verified
    full = {"table": torch.zeros(4096, 64), "step": -1}
    ckpt.Checkpointer(root).load(4, full)
    want = torch.cat([_sharded_state(0, 4)["table"].tensor, _sharded_state(1, 4)["table"].tensor])
    assert torch.equal(full["table"], want)


def test_ranks_that_stored_the_same_chunk_differently_commit_what_stayed(tmp_path):
    """Two ranks hold the same bytes (same chunk name) and store them differently (other widths, other
    bases): the copy written last stays, and the committed entry must describe it."""

    from ckpt.storage import open_storage

    storage = open_storage(str(tmp_path / "ck"))
    raw = _chunk(1 << 18)
    h = chunk_hash(raw)
    kept = encode(raw, h, CodecSpec("grouped"), width=2)  # the copy that stayed: planes of width 2
    stored = storage.write(paths.chunk_key(h), kept[1])
    other = mf.ChunkInfo(len(raw), stored + 1000, "planes/1")  # what the other rank wrote before it
    entries = (other, mf.ChunkInfo(len(raw), stored, "planes/1"))
    n = len(raw)  # each rank's tensor holds the chunk (a chunk no tensor uses would be damage)
    parts = [mf.Manifest(step=1, kind="rank", rank=r, structure=ckpt.tree.dict_node([], []), tensors=[
        mf.TensorEntry("x", "uint8", [n], [mf.Shard(r, [0], [n], [mf.Segment(h, 0, n)])], rank=r)],
        chunks={h: info}) for r, info in enumerate(entries)]
    m = commit_step(storage, 1, parts, frozenset())
    assert m.chunks[h] == mf.ChunkInfo(len(raw), stored, "planes/1")
    assert mf.read_step(storage, 1).chunks[h].stored == stored


def test_the_numpy_rans_decoder_keeps_its_memory_bounded_by_the_input(monkeypatch):
    """Many small blocks (the format allows 256 symbols a block) each bring a 4096-slot table: the
    fallback decoder builds them a batch at a time instead of all at once."""
    import tracemalloc
    monkeypatch.setattr(rans, "BLOCK_LOG", 8)
    a = np.random.default_rng(5).integers(0, 256, 1 << 20, dtype=np.uint8)
    sec = rans._encode_numpy(a)  # 4096 blocks
    out = np.empty_like(a)
    tracemalloc.start()
    try:
        rans._decode_numpy(np.frombuffer(sec, np.uint8), out)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert np.array_equal(out, a)
    assert peak < 64 << 20, peak  # all 4096 tables at once took ~800 MiB


def test_small_chunks_keep_every_chain_within_the_read_budget(tmp_path):
    """Chunks of 512 KiB or less are their own sample: a sparse delta kept to be measured against
    the chain's budget must still be refused when it does not fit (headers counted)."""
    g = torch.Generator().manual_seed(7)
    w = torch.randn(256 * 1024 // 4 * 3, generator=g)
    root = str(tmp_path / "ck")
    with ckpt.Checkpointer(root, chunk_size=256 * 1024, delta_budget=1.0, delta_chain=8) as c:
        for s in range(8):
            idx = torch.randint(0, w.numel(), (w.numel() // 50,), generator=g)
            w[idx] += 0.01
            c.save(s, {"w": w.clone()}).wait()
            m = c.manifest(s)
            for h, info in m.chunks.items():
                assert sum(m.chunks[x].stored for x in mf.chain(m.chunks, h)) <= 1.0 * info.size + 64, (s, h)
