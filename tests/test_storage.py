"""One conformance suite for every storage backend: a local directory, memory://, two real S3-compatible
servers (rclone serve s3, moto) and the tiered storage (a local tier staged in front of memory:// and of
rclone). What ckpt relies on from storage is written down here once, and every backend must pass it."""

from __future__ import annotations

import os
import uuid

import pytest
from conftest import MiB, fast, s3_url

from ckpt.format.chunk import chunk_hash, verify_object
from ckpt.save.encode import CodecSpec, encode
from ckpt.storage import LocalStorage, Storage, open_storage, open_tiered, read_counters
from ckpt.storage.s3 import S3Storage
from ckpt.storage.tiered import TieredStorage


@pytest.fixture(params=["local", "local-direct", "memory", "rclone", "moto", "tiered-memory", "tiered-rclone"])
def backend(request, tmp_path):
    kind = request.param
    if kind in ("local", "local-direct"):  # a Checkpointer's saves write with O_DIRECT (direct_io=True)
        st: Storage = LocalStorage(str(tmp_path / "root"), direct_io=kind == "local-direct")
    elif kind == "memory":
        st = open_storage(f"memory://conf-{uuid.uuid4().hex}")
    elif kind == "tiered-memory":
        st = open_tiered(f"memory://conf-{uuid.uuid4().hex}", str(tmp_path / "nvme"), verify=verify_object)
    elif kind == "tiered-rclone":
        srv = request.getfixturevalue("rclone_server")
        st = open_tiered(s3_url(), str(tmp_path / "nvme"), fast(srv.endpoint), verify=verify_object)
    else:
        srv = request.getfixturevalue(f"{kind}_server")
        st = open_storage(s3_url(), fast(srv.endpoint))
    yield st
    st.close()


def chunk(nbytes: int, seed: int = 0) -> tuple[str, bytes]:
    """A real chunk object (64-byte header + raw payload) and its key: tiered storage checks what it serves."""
    raw = os.urandom(nbytes) if seed == 0 else bytes([seed % 251]) * nbytes
    h = chunk_hash(raw)
    _, bufs = encode(memoryview(raw), h, CodecSpec("raw"))
    return f"chunks/{h[:2]}/{h}", b"".join(bytes(b) for b in bufs)


def test_write_read_ranges(backend):
    key, data = chunk(300_000)
    assert backend.write(key, [data[:1000], memoryview(data[1000:])]) == len(data)
    assert backend.read(key) == data
    assert backend.read(key, 10, 5000) == data[10:5000]
    assert backend.size(key) == len(data)
    head, rest = bytearray(64), bytearray(len(data) - 64)
    assert backend.readv(key, [head, rest]) == len(data)
    assert bytes(head) + bytes(rest) == data
    backend.flush()
    assert backend.exists(key)


def test_missing_is_file_not_found(backend):
    assert not backend.exists("chunks/zz/none")
    with pytest.raises(FileNotFoundError):
        backend.read("chunks/zz/none")
    with pytest.raises(FileNotFoundError):
        backend.readv("chunks/zz/none", [bytearray(64)])
    backend.delete("chunks/zz/none")  # not an error
    assert backend.list("nothing-here") == []


def test_list_and_delete(backend):
    for name in ("a", "b", "c"):
        backend.write(f"steps/000000000001/{name}", [name.encode()])
    assert backend.list("steps/000000000001") == ["a", "b", "c"]
    assert backend.list("steps") == ["000000000001"]
    backend.delete("steps/000000000001/b")
    assert backend.list("steps/000000000001") == ["a", "c"]
    assert not backend.exists("steps/000000000001/b")


def test_overwrite_is_whole(backend):
    backend.write("x", [b"1" * 1000])
    backend.write("x", [b"2" * 10])
    assert backend.read("x") == b"2" * 10


def test_commit_is_create_only(backend):
    key, data = chunk(1000, seed=3)
    backend.write(key, [data])
    backend.commit("steps/000000000002/MANIFEST.json", b"{}")  # after every chunk written before it
    assert backend.exists(key)
    with pytest.raises(FileExistsError):
        backend.commit("steps/000000000002/MANIFEST.json", b"{other}")
    assert backend.read("steps/000000000002/MANIFEST.json") == b"{}"


def test_create_is_create_only_and_the_first_copy_stays(backend):
    """Chunk objects are created, never written over: two writers' copies of one chunk (the same raw
    bytes, encoded differently) leave the first. A tiered storage creates in the remote behind its
    local tier: the second create's copy is replaced in the local tier by the first, and
    finish_creates names it, so its writer describes the copy that stayed."""
    key, whole = chunk(200_000, seed=5)
    h = key.rsplit("/", 1)[-1]
    _, bufs = encode(memoryview(whole[64:]), h, CodecSpec("zstd"))
    other = b"".join(bytes(b) for b in bufs)
    assert other != whole
    assert backend.create(key, [whole]) == len(whole)
    assert backend.finish_creates([key]) == set()
    if isinstance(backend, TieredStorage):
        backend.create(key, [other])  # staged, then created in the remote: where the first stands
        assert backend.finish_creates([key]) == {key}
        assert backend.local.read(key) == whole
    else:
        with pytest.raises(FileExistsError):
            backend.create(key, [other])
    assert backend.read(key) == whole
    big = os.urandom(17 * MiB)  # a multipart upload on S3 (two parts): its completion is the create
    backend.create("big", [big])
    with pytest.raises(FileExistsError):
        backend.create("big", [os.urandom(17 * MiB)])
    assert backend.read("big") == big
    s3 = backend.remote if isinstance(backend, TieredStorage) else backend
    if isinstance(s3, S3Storage):
        assert s3.multipart_uploads() == []  # the refused upload was aborted


def test_mtime_is_recent_or_unknown(backend):
    import time

    backend.write("steps/000000000003/rank-00000.json", [b"{}"])
    t = backend.mtime("steps/000000000003/rank-00000.json")
    assert t is None or abs(time.time() - t) < 600
    with pytest.raises(FileNotFoundError):
        backend.mtime("steps/000000000003/none")


def test_root_state_and_remove_root(backend):
    assert backend.root_state() in ("missing", "empty")
    key, data = chunk(5000, seed=4)
    backend.write(key, [data])
    backend.commit("steps/000000000001/MANIFEST.json", b"{}")
    assert backend.root_state() == "nonempty"
    backend.remove_root()
    assert backend.root_state() in ("missing", "empty")
    assert not backend.exists(key) and backend.list("steps") == []
    with pytest.raises(FileNotFoundError):
        backend.read(key)


def test_multipart_object(backend):
    """On S3, an object of two parts or more (8 MiB parts by default) goes up as a multipart upload;
    one of a single part's worth is one PUT: a multipart upload of one part was two more round trips
    for the same bytes (issue 23 item 5)."""
    data, one_part = os.urandom(17 * MiB), os.urandom(11 * MiB)
    backend.write("big", [data[:100], memoryview(data)[100:]])
    backend.write("one-part", [one_part])
    assert backend.read("big") == data and backend.read("one-part") == one_part
    s3 = backend.remote if isinstance(backend, TieredStorage) else backend
    if isinstance(s3, S3Storage):
        assert s3.counters["multipart"] == 1
        assert s3.multipart_uploads() == []


def _resident_pages(path: str) -> int:
    """How many of the file's pages are in the page cache (mincore(2) over a private mapping)."""
    import ctypes
    import mmap

    size = os.path.getsize(path)
    libc = ctypes.CDLL(None, use_errno=True)
    with open(path, "rb") as f:
        m = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY)  # writable, so ctypes can take its address
    try:
        base = ctypes.c_char.from_buffer(m)
        vec = (ctypes.c_ubyte * (-(-size // mmap.PAGESIZE)))()
        ok = libc.mincore(ctypes.c_void_p(ctypes.addressof(base)), ctypes.c_size_t(size), vec)
        del base
        assert ok == 0, os.strerror(ctypes.get_errno())
        return sum(v & 1 for v in vec)
    finally:
        m.close()


def _direct_io_works(d: str) -> bool:
    try:
        os.close(os.open(os.path.join(d, "probe"), os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o644))
        return True
    except (AttributeError, OSError):
        return False


@pytest.mark.skipif(not hasattr(os, "O_DIRECT"), reason="no O_DIRECT on this platform")
def test_direct_io_writes_exact_objects_around_the_page_cache(tmp_path):
    """A local tier writes objects of 1 MiB or more with O_DIRECT, in aligned pieces of 4 MiB, the
    last padded and cut back: the bytes come back exact whatever the sizes and buffer boundaries, and
    the written pages are not left in the page cache (copying them there cost the staged upload more
    CPU than the upload itself: issue 23 item 5)."""
    if not _direct_io_works(str(tmp_path)):
        pytest.skip("this file system refuses O_DIRECT")
    st = LocalStorage(str(tmp_path / "root"), direct_io=True)
    for i, size in enumerate([1 * MiB, 1 * MiB + 1, 4 * MiB, 4 * MiB + 4095, 8 * MiB, 9 * MiB + 123]):
        key, data = f"chunks/ab/obj{i}", os.urandom(size)
        cut = [0, 64, 64 + 4093, size // 2, size]  # a header-sized piece, then odd boundaries
        parts = [memoryview(data)[a:b] for a, b in zip(cut, cut[1:])]
        assert (st.create if i % 2 else st.write)(key, parts) == size
        path = os.path.join(st.root, key)
        assert st.direct_io and _resident_pages(path) <= 1  # at most the last page, zeroed past the end by the cut
        assert os.path.getsize(path) == size and st.read(key) == data
    st.write("steps/000000000001/rank-00000.json", [b"{}"])  # small: through the page cache
    st.commit("steps/000000000001/MANIFEST.json", b"{}")
    assert st.read("steps/000000000001/MANIFEST.json") == b"{}"
    assert not [f for _, _, fs in os.walk(st.root) for f in fs if ".tmp-" in f]


@pytest.mark.skipif(not hasattr(os, "O_DIRECT"), reason="no O_DIRECT on this platform")
@pytest.mark.parametrize("direct_io", [True, False])
def test_checkpointer_writes_chunks_around_the_page_cache_unless_told(tmp_path, direct_io):
    """A Checkpointer's saves into a local directory write their chunks with O_DIRECT by default (a
    buffered write's page-cache copy cost 7-40x the CPU on the benchmark machine, taken from training):
    none of a chunk's pages is left cached, and the step loads back exact. ``direct_io=False`` writes
    through the page cache, which then holds the chunks (a load straight after reads from memory)."""
    import mmap

    import torch

    import ckpt

    if not _direct_io_works(str(tmp_path)):
        pytest.skip("this file system refuses O_DIRECT")
    root = tmp_path / "run"
    state = {"w": torch.randn(3 * MiB // 4 + 5), "b": torch.arange(1000.0)}
    with ckpt.Checkpointer(str(root), codec="raw", chunk_size=2 * MiB, direct_io=direct_io) as c:
        c.save(1, state).wait()
        big = [os.path.join(d, f) for d, _, fs in os.walk(root / "chunks") for f in fs
               if os.path.getsize(os.path.join(d, f)) >= MiB]
        assert big  # the state's 3 MiB made 2 MiB chunks and a remainder
        resident = [_resident_pages(p) for p in big]
        if direct_io:
            assert all(r <= 1 for r in resident), resident  # at most the last page, zeroed past the end by the cut
        else:
            assert all(r >= os.path.getsize(p) // mmap.PAGESIZE for r, p in zip(resident, big)), resident
        back = {"w": torch.zeros_like(state["w"]), "b": torch.zeros_like(state["b"])}
        c.load(1, back)
    assert all(torch.equal(back[k], state[k]) for k in state)


@pytest.mark.skipif(not hasattr(os, "O_DIRECT"), reason="no O_DIRECT on this platform")
def test_direct_io_refused_falls_back_to_the_page_cache(tmp_path, monkeypatch, caplog):
    """A file system that refuses O_DIRECT (EINVAL, as some do) gets the same objects through the page
    cache, from the first refusal on, with no temp file left behind."""
    import errno

    real_open = os.open

    def refusing(path, flags, *a, **kw):  # the file system's answer, not ckpt's code
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument", path)
        return real_open(path, flags, *a, **kw)

    monkeypatch.setattr(os, "open", refusing)
    st = LocalStorage(str(tmp_path / "root"), direct_io=True)
    data = os.urandom(3 * MiB + 5)
    with caplog.at_level("INFO", logger="ckpt"):
        assert st.create("chunks/ab/x", [data[:64], data[64:]]) == len(data)
    assert st.read("chunks/ab/x") == data and not st.direct_io
    assert "refuses O_DIRECT" in caplog.text
    assert os.listdir(os.path.join(st.root, "chunks", "ab")) == ["x"]


def test_tiered_uploads_the_staged_bytes_from_memory_up_to_a_bound(tmp_path):
    """An upload sends the copy of the chunk held in memory since it was staged, not the local copy
    read back from the disk (issue 23 item 5), while less than HOLD_BYTES wait; beyond that it
    reads the local copy back. Shown with the local copies removed before the uploads start (the
    one upload thread is held by a first chunk): the held chunk still goes up, the other fails."""
    from ckpt.errors import StorageError
    from ckpt.testing import FaultyStorage

    remote = FaultyStorage(open_storage(f"memory://conf-{uuid.uuid4().hex}"))
    st = TieredStorage(LocalStorage(str(tmp_path / "nvme")), remote, verify=verify_object, upload_threads=1)
    (k0, d0), (k1, d1), (k2, d2) = chunk(300_000), chunk(300_000), chunk(300_000)
    st.HOLD_BYTES = len(d0) + len(d1)  # room for the first two only
    gate = remote.gate("create", key=k0)
    st.create(k0, [d0])
    assert gate.entered.wait(60)  # the one upload thread is busy: the next uploads wait
    st.create(k1, [d1])
    st.create(k2, [d2])
    for k in (k1, k2):
        os.unlink(os.path.join(st.local.root, k))
    gate.open()
    with pytest.raises(StorageError, match="uploading"):
        st.finish_creates([k0, k1, k2])
    assert remote.inner.read(k0) == d0 and remote.inner.read(k1) == d1 and not remote.inner.exists(k2)
    assert st._held_bytes == 0  # every held copy given back, the failed upload's too
    st.close()


def test_tiered_serves_only_verified_local_copies(tmp_path):
    """A local copy that fails its check is rejected, counted, and read from the remote instead."""
    st = open_tiered(f"memory://conf-{uuid.uuid4().hex}", str(tmp_path / "nvme"), verify=verify_object)
    assert isinstance(st, TieredStorage)
    key, data = chunk(100_000)
    st.write(key, [data])
    st.drain()  # uploaded
    st.reset_tier_counters()
    assert st.read(key) == data
    path = os.path.join(st.local.root, key)
    with open(path, "r+b") as f:  # damage the local copy's payload
        f.seek(1000)
        f.write(b"\x00" * 8)
    head, rest = bytearray(64), bytearray(len(data) - 64)
    assert st.readv(key, [head, rest]) == len(data) and bytes(head) + bytes(rest) == data
    c = st.tier_counters()
    assert c.local_hits == 1 and c.remote_reads == 1 and c.local_rejected == [key]
    assert read_counters(open_storage(str(tmp_path / "plain"))) is None  # a single tier has no counters
    assert read_counters(st) == c
    st.close()


def test_the_durable_tier_is_found_through_a_wrapper_and_the_surface_has_no_tier_methods(tmp_path):
    """Leases and the run journal go to the checkpoint path itself, behind a local_dir and through a
    test's FaultyStorage around either; the Storage surface every backend implements knows no tiers."""
    from ckpt.storage import durable_of
    from ckpt.testing import FaultyStorage

    tiered = open_tiered(str(tmp_path / "remote"), str(tmp_path / "nvme"), verify=verify_object)
    plain = LocalStorage(tmp_path / "plain")
    assert durable_of(tiered) is tiered.remote and durable_of(FaultyStorage(tiered)) is tiered.remote
    faulty = FaultyStorage(plain)
    assert durable_of(plain) is plain and durable_of(faulty) is faulty  # the faults stay on a single tier
    assert not {"view", "durable_tier", "tier_counters", "reset_tier_counters"} & set(vars(Storage))
    tiered.close()


def test_retention_through_fsspec_removes_step_directories(tmp_path, caplog):
    """Through an fsspec file system that has directories (``local://``: fsspec's own local file system,
    as NFS or a mounted bucket would be reached), retention deletes an old step's files and then its
    directory, which fsspec's bulk ``rm`` refuses ("Cannot delete directory"): the directory goes one key
    at a time, with no warning, and the kept steps load."""
    import torch

    import ckpt

    root = tmp_path / "run"
    state = {"w": torch.arange(1000.0)}
    with caplog.at_level("WARNING", logger="ckpt"), ckpt.Checkpointer(f"local://{root}", keep_last=1) as c:
        for step in range(3):
            state["w"] += 1
            c.save(step, state).wait()
        c.wait()  # retention runs in the background
        assert sorted(os.listdir(root / "steps")) == ["000000000002"]
        back = {"w": torch.zeros(1000)}
        c.load(2, back)
    assert torch.equal(back["w"], state["w"])
    assert "retention" not in caplog.text, caplog.text
