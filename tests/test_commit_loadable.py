"""A step is committed only when it loads (issue 32): keys that collide once joined are refused
before anything is written, the commit runs the parse/tile check every reader runs, and a chunk
found stored under its key (planted, damaged, half-written, another job's) is adopted only once
its content is verified; otherwise the save writes its own copy whole."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import ckpt
import ckpt.dcp
from ckpt.errors import CorruptCheckpointError, UnsupportedValueError
from ckpt.format import manifest as mf
from ckpt.format import paths
from ckpt.format.chunk import HEADER_SIZE, Base, decode, parse_header
from ckpt.save.committer import commit_step
from ckpt.save.encode import CodecSpec, encode
from ckpt.save.writer import Writer
from ckpt.storage import LocalStorage
from ckpt.testing import run_ranks


def colliding(seed: float) -> dict:
    return {"a/b": torch.arange(6.0) + seed, "a": {"b": torch.arange(6.0) * 10 + seed}}


def chunk_files(root: str) -> set[str]:
    base = os.path.join(root, paths.CHUNKS)
    return {os.path.join(d, f) for d, _, fs in os.walk(base) for f in fs} if os.path.isdir(base) else set()


# -- 32.6: keys that collide once joined ------------------------------------------------------------

def dcp_colliding_body(rank: int, world: int, path: str) -> dict:
    dcp.save({"x": torch.arange(4.0)}, storage_writer=ckpt.dcp.Writer(path, step=1, keep_last=1))
    before = chunk_files(path)
    try:
        dcp.save(colliding(0), storage_writer=ckpt.dcp.Writer(path, step=2, keep_last=1))
        errors = []
    except CheckpointException as e:
        errors = [f[0] if isinstance(f, tuple) else f for f in e.failures.values()]
    got = {"x": torch.zeros(4)}
    dcp.load(got, storage_reader=ckpt.dcp.Reader(path, step="latest"))
    return {"errors": [(type(x).__name__, str(x)) for x in errors], "new_chunks": sorted(chunk_files(path) - before),
            "x": got["x"].tolist()}


def test_dcp_keys_that_join_alike_are_refused_before_anything_is_written(tmp_path):
    path = str(tmp_path / "ck")
    out = run_ranks(2, dcp_colliding_body, path, timeout=120)
    for r in out:
        assert r["errors"], "the colliding save went through"
        assert all(name == UnsupportedValueError.__name__ for name, _ in r["errors"]), r["errors"]
        assert all("'a/b'" in msg and "'a.b'" in msg for _, msg in r["errors"]), r["errors"]
        assert r["new_chunks"] == [] and r["x"] == [0.0, 1.0, 2.0, 3.0]
    assert mf.committed_steps(LocalStorage(path)) == [1]  # the good step is still there, and nothing else
    assert not os.path.exists(os.path.join(path, paths.step_dir(2)))


def checkpointer_colliding_body(rank: int, world: int, path: str) -> list:
    with ckpt.Checkpointer(path, keep_last=1) as c:
        c.save(1, colliding(1)).wait()
        c.save(2, colliding(2)).wait()
    got = {"a": {"b": torch.zeros(6)}, "a/b": torch.zeros(6)}  # the other insertion order
    assert ckpt.Checkpointer(path).load("latest", got) == 2
    return [got["a/b"].tolist(), got["a"]["b"].tolist()]


@pytest.mark.parametrize("world", [1, 2])
def test_checkpointer_keys_that_join_alike_come_back_where_they_were(tmp_path, world):
    path = str(tmp_path / "ck")
    want = colliding(2)
    for got in run_ranks(world, checkpointer_colliding_body, path, timeout=120):
        assert got == [want["a/b"].tolist(), want["a"]["b"].tolist()]
    assert mf.committed_steps(LocalStorage(path)) == [2]


def test_a_merged_step_that_would_not_load_is_not_committed(ckdir):
    """Two ranks' reports that each claim all of one tensor (what joined keys used to make): the
    commit runs the reader's checks first, so nothing is committed and the good step stays."""
    with ckpt.Checkpointer(ckdir, keep_last=1) as c:
        c.save(1, {"w": torch.arange(8.0)}).wait()
    storage = LocalStorage(ckdir)
    part = mf.read_rank_part(storage, 1, 0)
    parts = [dataclasses.replace(part, step=2, rank=r) for r in (0, 1)]
    writer = Writer(storage, CodecSpec(), io=None)  # type: ignore[arg-type]  # commit needs no I/O pool
    with pytest.raises(CorruptCheckpointError, match="step 2 was not committed.*do not tile"):
        commit_step(writer.storage, 2, parts, frozenset())
    assert mf.committed_steps(storage) == [1]
    got = {"w": torch.zeros(8)}
    assert ckpt.Checkpointer(ckdir).load("latest", got) == 1 and got["w"].tolist() == list(range(8))


# -- 32.7 / 32.8: a chunk found under its key is adopted only when verified ------------------------

STATE1 = {"w": torch.arange(4096, dtype=torch.float32)}
STATE2 = {"w": torch.arange(4096, dtype=torch.float32) * 3 + 1}


def the_chunk(tmp_path, state: dict, name: str) -> tuple[str, bytes]:
    """Save ``state`` into a root of its own: its one chunk's hash and raw bytes."""
    root = str(tmp_path / name)
    with ckpt.Checkpointer(root) as c:
        c.save(1, state).wait()
    (f,) = chunk_files(root)
    h = os.path.basename(f)
    with open(f, "rb") as fh:
        return h, bytes(decode(fh.read(), name=f, expect_hash=h))


def plant(root: str, h: str, blob: bytes) -> str:
    f = os.path.join(root, paths.chunk_key(h))
    os.makedirs(os.path.dirname(f), exist_ok=True)
    with open(f, "wb") as fh:
        fh.write(blob)
    return f


def random_payload(h: str, raw: bytes, base: tuple[str, bytes]) -> bytes:
    """A valid header for chunk ``h`` over a random payload of the length it declares."""
    codec, (header, *parts) = encode(memoryview(raw), h, CodecSpec())
    n = sum(len(memoryview(p).cast("B")) for p in parts)
    return bytes(header) + os.urandom(n)


def fake_delta(h: str, raw: bytes, base: tuple[str, bytes]) -> bytes:
    """An XOR delta named ``h`` on a good stored base, its 32-bit check right, decoding to other bytes."""
    other = bytearray(base[1])
    other[100] ^= 0xFF
    codec, buffers = encode(memoryview(bytes(other)), h, CodecSpec(), width=4, base=Base(memoryview(base[1]), base[0]))
    assert codec == "xor"
    return b"".join(bytes(memoryview(b).cast("B")) for b in buffers)


@pytest.mark.parametrize("make", [random_payload, fake_delta])
def test_a_planted_chunk_is_not_adopted(tmp_path, make):
    h1, raw1 = the_chunk(tmp_path, STATE1, "a")
    h2, raw2 = the_chunk(tmp_path, STATE2, "b")
    root = str(tmp_path / "ck")
    with ckpt.Checkpointer(root, keep_last=1) as c:
        c.save(1, STATE1).wait()
        plant(root, h2, make(h2, raw2, (h1, raw1)))
        c.save(2, STATE2).wait()
    got = {"w": torch.zeros(4096)}
    assert ckpt.Checkpointer(root).load("latest", got) == 2
    assert torch.equal(got["w"], STATE2["w"])
    assert ckpt.open(root).verify(2).ok


def damage(f: str, how: str) -> None:
    with open(f, "r+b") as fh:
        if how == "half-written":
            fh.truncate(HEADER_SIZE + 100)
        else:  # a flipped bit in the payload: the header still says all is well
            fh.seek(-7, os.SEEK_END)
            b = fh.read(1)
            fh.seek(-7, os.SEEK_END)
            fh.write(bytes([b[0] ^ 0x10]))


@pytest.mark.parametrize("how", ["damaged", "half-written"])
def test_a_chunk_another_job_stored_badly_is_not_adopted_blindly(tmp_path, how):
    root = str(tmp_path / "ck")
    with ckpt.Checkpointer(root) as other_job:  # another job in the same root, before this one
        other_job.save(100, STATE2).wait()
    (f,) = chunk_files(root)
    parse_header(open(f, "rb").read(HEADER_SIZE), name=f)
    damage(f, how)
    with ckpt.Checkpointer(root) as c:
        c.save(1, STATE1).wait()
        c.save(2, STATE2).wait()  # the same bytes as the other job's damaged chunk
    got = {"w": torch.zeros(4096)}
    assert ckpt.Checkpointer(root).load(2, got) == 2
    assert torch.equal(got["w"], STATE2["w"])
    assert ckpt.open(root).verify(2).ok
