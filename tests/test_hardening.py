"""Hardening: each test reproduces one way a committed step could be lost or mixed, or bad input
could escape untyped or unbounded, and checks it no longer happens (numbers match the hardening issue's list)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import tracemalloc

import numpy as np
import pytest
import torch
import zstandard
from conftest import chunk_files, tensor_entry

import ckpt
from ckpt.format import paths
from ckpt.format.chunk import HEADER, MAGIC, NO_BASE, chunk_hash, decode
from ckpt.storage.local import LocalStorage
from ckpt.testing import FaultyStorage

HERE = os.path.dirname(os.path.abspath(__file__))
CHUNK = 64 * 1024


def many_chunks(seed: int, n: int = 64) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(n * CHUNK // 4, generator=g), "step": seed}


def blank(n: int = 64) -> dict:
    return {"w": torch.zeros(n * CHUNK // 4), "step": -1}


def flip(path: str, at: int = 100) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0xFF]))


# -- 1. a failed or interrupted load leaves no read running ------------------------------------------------

class ReadWatch(LocalStorage):
    """LocalStorage that counts chunk reads starting after ``load`` has returned (they would write into
    the state); hand it to the loading Checkpointer. Every read but the first waits for ``hold`` (or
    2 s) first, so reads are still queued when the load fails or is interrupted: a load that leaves
    them running is caught every time."""

    def __init__(self, root: str, hold: threading.Event):
        super().__init__(root)
        self.hold = hold
        self.returned = threading.Event()
        self.late = 0
        self.first = threading.Event()
        self.watch_lock = threading.Lock()

    def watch(self, key: str) -> None:
        if key.startswith("chunks/"):
            with self.watch_lock:
                late = self.returned.is_set()
                self.late += late
                first = not self.first.is_set()
                self.first.set()
            if not first and not late:
                self.hold.wait(2)  # bounded: a fixed load waits for this read, a broken one has returned

    def readv(self, key, buffers, offset=0):
        self.watch(key)
        return super().readv(key, buffers, offset)

    def read_object(self, key, limit):
        self.watch(key)
        return super().read_object(key, limit)

    def read_hashed(self, key, out, offset=0, head=None):  # the raw path's one-pass read and hash
        self.watch(key)
        return super().read_hashed(key, out, offset, head)


def test_a_failed_load_finishes_or_cancels_every_read_before_it_returns(ckdir):
    with ckpt.Checkpointer(ckdir, chunk_size=CHUNK, codec="raw") as c:
        c.save(1, many_chunks(1)).wait()
        order = [g.chunk for g in tensor_entry(c.manifest(1), "w").shards[0].segments]
    flip(os.path.join(ckdir, "chunks", order[0][:2], order[0]))  # the first chunk read fails
    hold = threading.Event()
    watch = ReadWatch(ckdir, hold)
    c = ckpt.Checkpointer(ckdir, io_threads=2, storage=watch)
    with pytest.raises(ckpt.CorruptCheckpointError):
        c.load(1, blank())
    watch.returned.set()
    hold.set()
    c.close()  # the I/O pool runs whatever was still queued
    assert watch.late == 0


def test_an_interrupted_load_stops_its_reads_before_the_interrupt_propagates(ckdir):
    with ckpt.Checkpointer(ckdir, chunk_size=CHUNK, codec="raw") as c:
        c.save(1, many_chunks(1))
    interrupted = threading.Event()

    def on_sigint(signum, frame):
        interrupted.set()
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        watch = ReadWatch(ckdir, interrupted)
        c = ckpt.Checkpointer(ckdir, io_threads=2, storage=watch)

        def interrupt():  # a real SIGINT to this process once the first read is under way
            assert watch.first.wait(30)
            os.kill(os.getpid(), signal.SIGINT)

        threading.Thread(target=interrupt, daemon=True).start()
        with pytest.raises(KeyboardInterrupt):
            c.load(1, blank())
        watch.returned.set()
        c.close()
    finally:
        signal.signal(signal.SIGINT, previous)
    assert interrupted.is_set() and watch.late == 0


def test_fallback_never_mixes_two_steps(ckdir):
    with ckpt.Checkpointer(ckdir, chunk_size=CHUNK, codec="raw") as c:
        c.save(1, many_chunks(1))
        c.save(2, many_chunks(2)).wait()
        m2 = c.manifest(2)
    h = tensor_entry(m2, "w").shards[0].segments[0].chunk  # step 2's first chunk read fails, the rest queue
    flip(os.path.join(ckdir, "chunks", h[:2], h))
    want = many_chunks(1)
    for _ in range(10):
        got = blank()
        c = ckpt.Checkpointer(ckdir, io_threads=2)
        assert c.load("latest", got, fallback=True) == 1
        c.close()
        assert torch.equal(got["w"], want["w"]) and got["step"] == 1


# -- 3. any non-negative 64-bit step ----------------------------------------------------------------------

def test_steps_up_to_2_63_are_visible_and_kept(ckdir):
    from ckpt import cli
    from ckpt.reader import Reader, collect

    big = [10**12, 2**63 - 1]
    with ckpt.Checkpointer(ckdir) as c:
        c.save(5, {"w": torch.ones(10)})
        for s in big:
            c.save(s, {"w": torch.full((10,), float(s % 7))})
        with pytest.raises(ckpt.ConfigError, match="2\\*\\*63"):
            c.save(2**63, {"w": torch.ones(10)})
        c.wait()
        assert c.steps() == [5, *big] and c.latest() == 2**63 - 1
    os.makedirs(os.path.join(ckdir, "steps", "0000000000005"))  # not a name ckpt writes: ignored
    assert ckpt.open(ckdir).steps() == [5, *big]
    cat = Reader(LocalStorage(ckdir))
    p = collect.plan(cat, grace_s=0)
    assert not [i for i in p.remove if i.kind == "orphan"]  # their chunks are referenced
    assert cli.main(["ls", ckdir, "--json"]) == 0
    got = {"w": torch.zeros(10)}
    assert ckpt.Checkpointer(ckdir).load("latest", got) == 2**63 - 1 and got["w"][0] == (2**63 - 1) % 7


# -- 4. malformed manifests are corrupt, before anything changes, and fallback goes past them ---------------

def _mangle(doc: dict, how: str) -> bytes:
    if how == "deep":
        return ("[" * 100_000 + "]" * 100_000).encode()
    if how == "huge number":
        return json.dumps(doc).replace('"step": 2', '"step": ' + "9" * 5000).encode()
    if how == "created 400 digits":
        doc["created"] = int("9" * 400)
    elif how == "created NaN":
        return json.dumps(doc).replace(f'"created": {json.dumps(doc["created"])}', '"created": NaN').encode()
    elif how == "segments not a list":
        doc["tensors"][0]["shards"][0]["segments"] = 7
    elif how == "unhashable key":
        doc["structure"]["v"][1] = {"t": "dict", "k": [[1, 2]], "v": [3]}
    elif how == "node without key":
        doc["structure"]["v"][0] = {"t": "tensor"}
    elif how == "unknown node":
        doc["structure"]["v"][1] = {"t": "frobnicate", "v": 1}
    elif how == "key of a list kind":  # an unhashable kind where a dict key's kind is looked up
        doc["structure"]["v"][1] = {"t": "dict", "k": [{"t": [1]}], "v": [3]}
    elif how == "dtype is a list":  # an unhashable dtype name where the known dtypes are looked up
        doc["structure"]["v"][1] = {"t": "dtype", "v": ["float32"]}
    elif how == "owner is a list":
        doc["tensors"][0]["rank"] = [0]
    elif how == "deep structure":
        node: object = 1
        for _ in range(500):
            node = [node]
        doc["structure"]["v"][1] = node
    return json.dumps(doc).encode()


@pytest.mark.parametrize("how", ["deep", "huge number", "created 400 digits", "created NaN", "segments not a list",
                                 "unhashable key", "node without key", "unknown node", "key of a list kind",
                                 "dtype is a list", "owner is a list", "deep structure"])
def test_malformed_manifests_are_corrupt_and_fallback_passes_them(ckdir, how, capsys):
    from ckpt import cli

    with ckpt.Checkpointer(ckdir) as c:
        c.save(1, {"w": torch.ones(100), "cfg": {"a": 1}})
        c.save(2, {"w": torch.full((100,), 2.0), "cfg": {"a": 2}})
    path = os.path.join(ckdir, paths.manifest_key(2))
    with open(path) as f:
        doc = json.load(f)
    with open(path, "wb") as f:
        f.write(_mangle(doc, how))
    state = {"w": torch.zeros(100), "cfg": {"a": 0}}
    with pytest.raises(ckpt.CorruptCheckpointError):
        ckpt.Checkpointer(ckdir).load(2, state)
    assert torch.equal(state["w"], torch.zeros(100)) and state["cfg"] == {"a": 0}  # nothing changed
    assert ckpt.Checkpointer(ckdir).load("latest", state, fallback=True) == 1 and state["cfg"] == {"a": 1}
    for args in (["ls", ckdir], ["inspect", ckdir, "--step", "2"], ["verify", ckdir, "--all"]):
        assert cli.main(args) == 1
        assert "Traceback" not in capsys.readouterr().err


# -- 5. memory is bounded by what the manifest declares --------------------------------------------------------

def test_a_chunk_that_decompresses_to_more_than_declared_is_refused_in_bounded_memory():
    raw = bytes(range(256)) * 4096
    h = chunk_hash(raw)
    bomb = zstandard.ZstdCompressor(level=3).compress(bytes(256 << 20))  # 256 MiB of zeros, ~8 KiB stored
    blob = HEADER.pack(MAGIC, 1, 1, 0, 0, len(raw), bytes.fromhex(h), NO_BASE, len(bomb)) + bomb
    tracemalloc.start()
    try:
        with pytest.raises(ckpt.CorruptCheckpointError, match="more than"):
            decode(blob, name="bomb", expect_hash=h, expect_len=len(raw))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 8 << 20


def test_a_grown_chunk_is_never_read_whole(ckdir):
    with ckpt.Checkpointer(ckdir, chunk_size=CHUNK) as c:
        c.save(1, {"w": torch.arange(1000, dtype=torch.int64)}).wait()  # compressible: read as a whole object
        [h] = c.manifest(1).chunks
    path = os.path.join(ckdir, "chunks", h[:2], h)
    os.truncate(path, 1 << 30)  # 1 GiB, sparse: costs no disk
    tracemalloc.start()
    try:
        with pytest.raises(ckpt.CorruptCheckpointError, match="larger than"):
            ckpt.Checkpointer(ckdir).load(1, {"w": torch.zeros(1000, dtype=torch.int64)})
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 << 20



PADDED_LOAD = """
import resource, sys, torch, ckpt
target = {"w": torch.zeros(1024)}
c = ckpt.Checkpointer(sys.argv[1])
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # the peak RSS from here on
before = int(next(ln for ln in open("/proc/self/status") if ln.startswith("VmRSS")).split()[1])
try:
    c.load(1, target)
    print("loaded", bool(torch.equal(target["w"], torch.arange(1024, dtype=torch.float32))))
except ckpt.CorruptCheckpointError as e:
    print("refused", type(e).__name__, e.chunk, str(e).replace(chr(10), " "))
peak = int(next(ln for ln in open("/proc/self/status") if ln.startswith("VmHWM")).split()[1])
print("grew_kib", peak - before)
"""


def test_a_chunk_padded_far_past_what_its_codec_needs_is_refused_without_reading_it(ckdir):
    """Issue 32 item 15: a 4 KiB tensor's zstd chunk padded to 256 MiB with a skippable zstd frame (its
    header's payload length and the manifest's stored size saying so) loaded at +259 MiB RSS: the
    reader trusted the manifest's claim. What it reads is bounded by what the codec can need for the
    chunk's raw size; the load is refused, typed and naming the chunk, and memory hardly grows."""
    with ckpt.Checkpointer(ckdir, codec="zstd") as c:
        c.save(1, {"w": torch.arange(1024, dtype=torch.float32)}).wait()
        [(h, info)] = c.manifest(1).chunks.items()
    assert info.codec == "zstd/1" and info.size == 4096
    path = os.path.join(ckdir, paths.chunk_key(h))
    with open(path, "rb") as f:
        header, frame = f.read(64), f.read()
    pad = (256 << 20) - len(frame) - 8  # a skippable frame: zstd's own padding, which a decoder passes over
    fields = list(HEADER.unpack(header))
    fields[-1] = len(frame) + 8 + pad
    with open(path, "wb") as f:
        f.write(HEADER.pack(*fields) + frame + (0x184D2A50).to_bytes(4, "little") + pad.to_bytes(4, "little"))
    os.truncate(path, 64 + fields[-1])  # sparse: costs no disk
    mpath = os.path.join(ckdir, paths.manifest_key(1))
    with open(mpath) as f:
        doc = json.load(f)
    doc["chunks"][h][1] = 64 + fields[-1]  # the manifest claims the padded size too
    with open(mpath, "w") as f:
        json.dump(doc, f)
    p = subprocess.run([sys.executable, "-c", PADDED_LOAD, ckdir], capture_output=True, text=True, timeout=120,
                       check=True)
    first, grew = p.stdout.splitlines()[0], int(p.stdout.split("grew_kib")[1])
    assert first.startswith(f"refused CorruptCheckpointError {h}") and "larger than any form" in first, p.stdout
    assert grew < 32 << 10, p.stdout  # KiB: far from the 256 MiB object


HUGE = 1 << 34  # 16 GiB: the most a manifest's chunk table may claim for one chunk


def _delta_steps(ckdir: str) -> list[dict]:
    """Three saves of a slowly changing tensor: step 0 stores whole chunks, steps 1 and 2 deltas on them."""
    w = torch.randn(16 * CHUNK // 4, generator=torch.Generator().manual_seed(5))
    states = []
    with ckpt.Checkpointer(ckdir, chunk_size=CHUNK, codec="smallest") as c:
        for s in range(3):
            w[s * 100 : s * 100 + 10] += 1.0
            states.append({"w": w.clone()})
            c.save(s, states[-1]).wait()
    return states


def _claim(ckdir: str, step: int, pick) -> str:
    """Rewrite ``step``'s manifest so the chunk ``pick(manifest)`` chooses, and every chunk of its
    chain (links must share a size), claims HUGE bytes; returns that chunk."""
    m = ckpt.Checkpointer(ckdir).manifest(step)
    h = pick(m)
    path = os.path.join(ckdir, paths.manifest_key(step))
    with open(path) as f:
        doc = json.load(f)
    for x in ckpt.format.manifest.chain(m.chunks, h):
        doc["chunks"][x][0] = HUGE
    with open(path, "w") as f:
        json.dump(doc, f)
    return h


def _peak_of(fn) -> tuple[BaseException, int]:
    tracemalloc.start()
    try:
        with pytest.raises(ckpt.CorruptCheckpointError) as e:
            fn()
        return e.value, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("which", ["delta chain", "whole chunk"])
def test_a_manifest_claiming_a_huge_chunk_is_refused_before_anything_is_allocated(ckdir, which):
    """Issue 24 item 21: a chunk entry claiming 16 GiB made the chain reader allocate that much scratch
    memory before any check; the claim must be refused, naming the chunk, in memory bounded by the data."""
    states = _delta_steps(ckdir)
    if which == "delta chain":
        step, pick = 2, lambda m: next(h for h, i in m.chunks.items() if i.codec.startswith("xor/"))
    else:
        step, pick = 0, lambda m: tensor_entry(m, "w").shards[0].segments[0].chunk
    h = _claim(ckdir, step, pick)
    target = {"w": torch.zeros(16 * CHUNK // 4)}
    err, peak = _peak_of(lambda: ckpt.Checkpointer(ckdir).load(step, target))
    assert err.chunk == h and h in str(err) and str(HUGE) in str(err)
    assert peak < 64 << 20
    assert torch.equal(target["w"], torch.zeros(16 * CHUNK // 4))  # refused before anything changed
    for other in range(3):  # the other steps still load
        if other != step:
            ckpt.Checkpointer(ckdir).load(other, target)
            assert torch.equal(target["w"], states[other]["w"])


def test_a_chain_whose_headers_disagree_with_its_table_is_refused_before_scratch_is_allocated(ckdir):
    """Past the manifest's checks, the chain reader itself allocates for a chunk only the size every
    link's header agrees on with the table (and with the object's real length)."""
    from ckpt.format import chains

    _delta_steps(ckdir)
    c = ckpt.Checkpointer(ckdir)
    m = c.manifest(2)
    h = next(x for x, i in m.chunks.items() if i.codec.startswith("xor/"))
    table = {x: ckpt.format.manifest.ChunkInfo(HUGE, i.stored, i.codec, i.base) for x, i in m.chunks.items()}
    err, peak = _peak_of(lambda: chains.resolve(c.storage, table, h, 2))
    assert err.chunk == h and "the manifest says" in str(err)
    assert peak < 64 << 20


# -- 6. only regular files inside the root are chunks ---------------------------------------------------------

def _raw_step(ckdir: str) -> tuple[str, torch.Tensor]:
    w = torch.randn(CHUNK // 4)
    with ckpt.Checkpointer(ckdir, chunk_size=CHUNK, codec="raw") as c:
        c.save(1, {"w": torch.ones(CHUNK // 4)})
        c.save(2, {"w": w}).wait()
        h = tensor_entry(c.manifest(2), "w").shards[0].segments[0].chunk
    return os.path.join(ckdir, "chunks", h[:2], h), w


def test_a_chunk_replaced_by_a_link_to_outside_is_never_read(ckdir, tmp_path):
    path, _ = _raw_step(ckdir)
    outside = tmp_path / "secret"
    outside.write_bytes(b"S" * os.path.getsize(path))
    os.unlink(path)
    os.symlink(outside, path)
    target = {"w": torch.zeros(CHUNK // 4)}
    with pytest.raises(ckpt.CorruptCheckpointError):
        ckpt.Checkpointer(ckdir).load(2, target)
    assert not (target["w"].view(torch.uint8) == ord("S")).any()  # not a byte of the outside file got in
    assert ckpt.Checkpointer(ckdir).load("latest", target, fallback=True) == 1


def test_a_chunk_directory_replaced_by_a_link_to_outside_is_never_read(ckdir, tmp_path):
    """The directory holding a chunk moved out of the root and a link left in its place: the chunk's
    bytes are right (they would pass the hash check), but they lie outside the root, so the object
    is missing to every reader, and a load fails with the state unchanged."""
    from ckpt.format import paths
    from ckpt.storage import LocalStorage

    path, _ = _raw_step(ckdir)
    directory = os.path.dirname(path)
    moved = tmp_path / "elsewhere"
    shutil.move(directory, moved)
    os.symlink(moved, directory)
    assert os.path.exists(path)  # the bytes are there, through the link
    key = paths.chunk_key(os.path.basename(path))
    storage = LocalStorage(ckdir)
    assert not storage.exists(key)
    with pytest.raises(FileNotFoundError):
        storage.read(key)
    target = {"w": torch.zeros(CHUNK // 4)}
    with pytest.raises(ckpt.CorruptCheckpointError):
        ckpt.Checkpointer(ckdir).load(2, target)
    assert not target["w"].any()  # nothing of the linked chunk got in


@pytest.mark.parametrize("what", ["fifo", "directory"])
def test_a_fifo_or_directory_in_place_of_a_chunk_fails_fast_and_falls_back(ckdir, what):
    from ckpt import cli

    path, _ = _raw_step(ckdir)
    os.unlink(path)
    os.mkfifo(path) if what == "fifo" else os.mkdir(path)
    target = {"w": torch.zeros(CHUNK // 4)}
    with pytest.raises(ckpt.CorruptCheckpointError):
        ckpt.Checkpointer(ckdir).load(2, target)
    assert ckpt.Checkpointer(ckdir).load("latest", target, fallback=True) == 1
    assert torch.equal(target["w"], torch.ones(CHUNK // 4))
    assert cli.main(["verify", ckdir, "--all"]) == 1


# -- 7. a committed step never changes ------------------------------------------------------------------------

def test_saving_a_committed_step_again_changes_nothing_of_it(ckdir):
    with ckpt.Checkpointer(ckdir) as c:
        c.save(3, {"w": torch.ones(10)})
    rank_file = os.path.join(ckdir, paths.rank_key(3, 0))
    before = open(rank_file, "rb").read(), os.stat(rank_file).st_mtime_ns
    c = ckpt.Checkpointer(ckdir)
    with pytest.raises(ckpt.StepExistsError):
        c.save(3, {"w": torch.zeros(10)}).wait()
    c.close()
    assert (open(rank_file, "rb").read(), os.stat(rank_file).st_mtime_ns) == before


# -- 8. deep states: saved and loaded, or refused typed -------------------------------------------------------

def _nested(depth: int) -> dict:
    node: dict = {"leaf": 1}
    for i in range(depth):
        node = {f"k{i}": node}
    return node


def test_deep_states_round_trip_or_are_refused_typed(ckdir):
    with ckpt.Checkpointer(ckdir) as c:
        c.save(1, {"cfg": _nested(60)})
        for depth in (300, 500, 3000):
            with pytest.raises(ckpt.UnsupportedValueError, match="nested more than"):
                c.save(2, {"cfg": _nested(depth)})
        c.wait()
        assert c.steps() == [1]
    got = {"cfg": {}}
    ckpt.Checkpointer(ckdir).load(1, got, strict=False)
    assert got["cfg"] == _nested(60)


# -- 9. a meta-device model ------------------------------------------------------------------------------------

def test_loading_into_a_meta_model_is_refused(ckdir):
    model = torch.nn.Linear(4, 4)
    with ckpt.Checkpointer(ckdir) as c:
        c.save(1, {"model": model})
    with torch.device("meta"):
        meta = torch.nn.Linear(4, 4)
    with pytest.raises(ckpt.StateMismatchError, match="meta device"):
        ckpt.Checkpointer(ckdir).load(1, {"model": meta})


# -- 10. strict checks nested keys and what modules and optimizers will accept, before any change ---------------

def test_strict_refuses_an_extra_nested_key_before_changing_anything(ckdir):
    with ckpt.Checkpointer(ckdir) as c:
        c.save(1, {"w": torch.ones(3), "cfg": {"a": 1}})
    state = {"w": torch.zeros(3), "cfg": {"a": 0, "b": 2}}
    with pytest.raises(ckpt.StateMismatchError, match="'b'"):
        ckpt.Checkpointer(ckdir).load(1, state)
    assert torch.equal(state["w"], torch.zeros(3)) and state["cfg"] == {"a": 0, "b": 2}
    ckpt.Checkpointer(ckdir).load(1, state, strict=False)
    assert state["cfg"] == {"a": 1, "b": 2} and torch.equal(state["w"], torch.ones(3))


def test_a_smaller_model_or_other_param_groups_are_refused_before_any_change(ckdir):
    big = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    opt = torch.optim.SGD([{"params": big[0].parameters()}, {"params": big[1].parameters()}], lr=0.1)
    with ckpt.Checkpointer(ckdir) as c:
        c.save(1, {"model": big, "optim": opt})
    small = torch.nn.Sequential(torch.nn.Linear(4, 4))
    before = {k: v.clone() for k, v in small.state_dict().items()}
    for strict in (True, False):
        with pytest.raises(ckpt.StateMismatchError, match="parameter group"):
            ckpt.Checkpointer(ckdir).load(1, {"model": small, "optim": torch.optim.SGD(small.parameters(), lr=0.1)},
                                          strict=strict)
        assert all(torch.equal(before[k], v) for k, v in small.state_dict().items())
    # the smaller model alone holds some keys of the step (a pipeline stage's, issue 34): strict refuses
    # the keys it leaves unloaded; strict=False loads the keys it holds
    with pytest.raises(ckpt.StateMismatchError, match=r"this process does not hold: \['model/1.weight'"):
        ckpt.Checkpointer(ckdir).load(1, {"model": small, "optim": opt})
    assert all(torch.equal(before[k], v) for k, v in small.state_dict().items())
    ckpt.Checkpointer(ckdir).load(1, {"model": small}, strict=False)
    assert all(torch.equal(big.state_dict()[k], v) for k, v in small.state_dict().items())
    same = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    one_group = torch.optim.SGD(same.parameters(), lr=0.1)
    before = {k: v.clone() for k, v in same.state_dict().items()}
    with pytest.raises(ckpt.StateMismatchError, match="parameter group"):
        ckpt.Checkpointer(ckdir).load(1, {"model": same, "optim": one_group})
    assert all(torch.equal(before[k], v) for k, v in same.state_dict().items())


# -- 11. key paths that print alike are never swapped ---------------------------------------------------------

@pytest.mark.parametrize("make", [
    lambda x, y: {"a/b": x, "a": {"b": y}},
    lambda x, y: {"t": {0: x, "0": y}},
])
def test_colliding_key_paths_come_back_where_they_were(ckdir, make):
    x, y = torch.full((4,), 1.0), torch.full((4,), 2.0)
    with ckpt.Checkpointer(ckdir) as c:
        c.save(1, make(x, y))
    fresh = make(torch.zeros(4), torch.zeros(4))
    reordered = dict(reversed(list(fresh.items())))  # the other insertion order
    for v in reordered.values():
        if isinstance(v, dict) and len(v) == 2:
            items = list(v.items())
            v.clear()
            v.update(reversed(items))
    ckpt.Checkpointer(ckdir).load(1, reordered)
    if "a/b" in reordered:
        assert torch.equal(reordered["a/b"], x) and torch.equal(reordered["a"]["b"], y)
    else:
        assert torch.equal(reordered["t"][0], x) and torch.equal(reordered["t"]["0"], y)


# -- 12. ordinary values: stored exactly, or refused typed ------------------------------------------------------

def test_numpy_values_of_every_kind_round_trip_or_are_refused(ckdir):
    values = {
        "text": np.array(["ab", "cde"]),
        "when": np.array(["2024-01-01T12:00", "1999-12-31T23:59"], dtype="datetime64[m]"),
        "long": np.array([1.5, -2.25], dtype=np.longdouble),
        "big_endian": np.arange(6, dtype=">f4").reshape(2, 3),
        "bytes": np.array([b"x", b"yz"]),
        "f64": np.float64(0.1), "f32": np.float32(0.5), "ld": np.longdouble(1) / 3, "c": np.complex64(1 + 2j),
        "date": np.datetime64("2024-05-06"), "i8": np.int8(-3), "flag": np.bool_(True),
    }
    with ckpt.Checkpointer(ckdir) as c:
        c.save(1, {"v": values})
        with pytest.raises(ckpt.UnsupportedValueError, match="pickle"):
            c.save(2, {"v": np.zeros(2, dtype=[("a", "i4"), ("b", "f8")])})
        with pytest.raises(ckpt.UnsupportedValueError, match="too long"):
            c.save(2, {"n": 10 ** 5000})
        c.save(3, {"n": 10 ** 4000})
    got: dict = {"v": {}}
    ckpt.Checkpointer(ckdir).load(1, got, strict=False)
    for k, want in values.items():
        have = got["v"][k]
        assert type(have) is type(want) and np.asarray(have).dtype == np.asarray(want).dtype, k
        assert np.array_equal(np.asarray(have), np.asarray(want)), k
    n: dict = {"n": 0}
    ckpt.Checkpointer(ckdir).load(3, n)
    assert n["n"] == 10 ** 4000
    assert ckpt.open(ckdir).manifest(1).format_version == 3  # older readers refuse it cleanly


# -- 14. a failed save removes what it alone wrote -------------------------------------------------------------

def test_a_save_that_fills_the_disk_removes_what_it_wrote(ckdir):
    import errno

    with ckpt.Checkpointer(ckdir, chunk_size=CHUNK) as c:
        c.save(1, many_chunks(1, n=8))
    kept = set(chunk_files(ckdir))
    def no_space(op: str, key: str) -> BaseException:  # what LocalStorage raises on a full disk
        err = ckpt.StorageError("writing failed: [Errno 28] No space left on device")
        err.__cause__ = OSError(errno.ENOSPC, "No space left on device")
        return err

    disk = FaultyStorage(LocalStorage(ckdir))
    full = disk.fail("write", key=r"^chunks/", after=5, exc=no_space)  # the disk is full after five new chunks
    c = ckpt.Checkpointer(ckdir, chunk_size=CHUNK, io_threads=1, storage=disk)
    with pytest.raises(ckpt.StorageError, match="No space"):
        c.save(2, many_chunks(2, n=16)).wait()
    c.close()
    assert full.matched > 5 and set(chunk_files(ckdir)) == kept
    assert ckpt.open(ckdir).steps() == [1]


# -- 15. export to a folder that does not exist (issue 33.10: it is created) -------------------------------------

@pytest.mark.multiprocess
def test_export_into_a_missing_folder_creates_it(ckdir, tmp_path):
    with ckpt.Checkpointer(ckdir) as c:
        c.save(1, {"w": torch.ones(3)})
    r = subprocess.run([sys.executable, "-m", "ckpt.cli", "export", ckdir, "--to", str(tmp_path / "no" / "x.pt")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "Traceback" not in r.stderr
    assert torch.equal(torch.load(tmp_path / "no" / "x.pt", weights_only=True)["w"], torch.ones(3))
