"""Issue 35 item 7: deletions in bulk and off the save's critical path. ``Storage.delete_many`` sends
S3's multi-object delete (1,000 keys a request), retention and ``ckpt gc`` delete each phase in one
call (manifests, then rank files, then chunks), and the coordinator's retention runs on a thread of
its own: the next save goes while it works, and it never deletes what that save reused."""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor

import torch
from conftest import fast, s3_url

import ckpt
from ckpt.format import paths
from ckpt.storage import LocalStorage, open_storage
from ckpt.testing import FaultyStorage


def counting(storage) -> list[tuple[str, str]]:
    """Record every S3 request of ``storage`` as (method, key or first key): instrumentation only."""
    call, calls = storage.fs.call_s3, []

    def counted(method, *a, **kw):
        objects = kw.get("Delete", {}).get("Objects") or [{}]
        calls.append((method, kw.get("Key", objects[0].get("Key", ""))))
        return call(method, *a, **kw)

    storage.fs.call_s3 = counted
    return calls


def test_n_keys_cost_ceil_n_over_1000_delete_requests_on_s3(rclone_server):
    st = open_storage(s3_url(), fast(rclone_server.endpoint))
    keys = [f"chunks/{i % 256:02x}/{i:032x}" for i in range(2001)]
    stored = keys[::50] + keys[-1:]  # the others are missing, which is no error
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda k: st.write(k, [b"x"]), stored))
    calls = counting(st)
    st.delete_many(keys)
    assert [m for m, _ in calls] == ["delete_objects"] * math.ceil(2001 / 1000)
    assert all(k.endswith(keys[i]) for (_, k), i in zip(calls, (0, 1000, 2000), strict=True))
    assert not any(st.exists(k) for k in stored)
    st.close()


def test_retention_on_s3_deletes_each_phase_in_one_request(rclone_server):
    url = s3_url()
    with ckpt.Checkpointer(url, storage_options=fast(rclone_server.endpoint), keep_last=1, chunk_size=64 * 1024,
                           codec="raw") as c:
        c.save(1, {"w": torch.full((80_000,), 1.0)}).wait()  # 5 chunks of 64 KiB
        c.wait()
        calls = counting(c.storage)
        c.save(2, {"w": torch.full((80_000,), 2.0)}).wait()
        c.wait()  # and the retention after it
        deletes = [(m, k) for m, k in calls if m.startswith("delete") and "/leases/" not in k]
        assert [m for m, _ in deletes] == ["delete_objects"] * 3, deletes
        manifest, rank_files, chunks = (k for _, k in deletes)  # in this order: the crash-safe one
        assert manifest.endswith(paths.manifest_key(1)) and "/rank-" in rank_files and "/chunks/" in chunks
        assert c.steps() == [2]
        got = {"w": torch.zeros(80_000)}
        assert c.load(2, got) == 2 and torch.equal(got["w"], torch.full((80_000,), 2.0))


def test_the_next_save_goes_while_retention_works_and_keeps_what_it_reused(ckdir):
    """Retention after step 2 is held before it lists the steps (a gate, no sleep); step 3 saves the
    bytes of step 1 meanwhile, reusing step 1's stored chunk. Retention used to run on the commit
    thread before the next save's go: step 3 waited for it. Now step 3 commits, and the retention
    then removes steps 1 and 2 but not the chunk step 3 reuses."""
    disk = FaultyStorage(LocalStorage(ckdir))
    one, two = {"w": torch.full((256,), 1.0)}, {"w": torch.full((256,), 2.0)}
    with ckpt.Checkpointer(ckdir, storage=disk, keep_last=1) as c:
        c.save(1, one).wait()
        c.wait()
        gate = disk.gate("list", key=r"^steps$")
        c.save(2, two).wait()
        assert gate.entered.wait(60)  # retention after step 2 has started and is held
        c.save(3, one).wait(timeout=60)  # committed while retention waits
        gate.open()
        disk.reset_counts()
        c.wait()
        assert c.steps() == [3]
        assert disk.calls["delete_many"] == 3 and disk.calls["delete"] >= 3  # manifests, rank files, chunks
        got = {"w": torch.zeros(256)}
        assert c.load(3, got) == 3 and torch.equal(got["w"], one["w"])
    got = {"w": torch.zeros(256)}
    assert ckpt.Checkpointer(ckdir).load("latest", got) == 3 and torch.equal(got["w"], one["w"])
