"""Other processes deleting beside a live writer, with real processes: ``ckpt gc`` in a loop beside a
training job, and two jobs with retention saving into one root. No save may fail, every committed step
must verify and hold what its writer saved, and once the writers are gone nothing unreferenced stays.
Two jobs creating the same chunk at once, each encoding it its own way, are staged with a gate
between one's probe and its create."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from concurrent_child import CHUNK, digest

import ckpt
from ckpt import cli
from ckpt.format import paths
from ckpt.format.chunk import HEADER_SIZE, parse_header, verify_object
from ckpt.reader import Reader, collect
from ckpt.storage import LocalStorage
from ckpt.storage.tiered import TieredStorage
from ckpt.testing import FaultyStorage

HERE = os.path.dirname(os.path.abspath(__file__))


def child(*args: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(HERE), os.environ.get("PYTHONPATH", "")])}
    return subprocess.Popen([sys.executable, os.path.join(HERE, "concurrent_child.py"), *args], cwd=HERE, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(p: subprocess.Popen, timeout: float = 600) -> dict:
    out, err = p.communicate(timeout=timeout)
    assert p.returncode == 0, f"{out}\n{err[-3000:]}"
    return json.loads(out.strip().splitlines()[-1])


def check_every_step(root: str, logs: list[str]) -> None:
    saved: dict[str, str] = {}
    for log in logs:
        with open(log) as f:
            saved.update(json.load(f))
    assert cli.main(["verify", root, "--all"]) == 0
    steps = ckpt.open(root).steps()
    assert steps
    for s in steps:
        state = {"frozen": torch.zeros(5 * CHUNK // 4), "moving": torch.zeros(3 * CHUNK // 4)}
        ckpt.Checkpointer(root).load(s, state)
        assert digest(state) == saved[str(s)], s


def collect_and_check_clean(root: str) -> None:
    """With no writer left, gc deletes what was parked for one: only referenced chunks remain."""
    cat = Reader(LocalStorage(root))
    p = collect.plan(cat, grace_s=0, keep_last=1)
    assert not p.writers
    collect.run(cat, p)
    cat = Reader(LocalStorage(root))
    referenced = set().union(*(cat.manifest(s).chunks.keys() for s in cat.committed))
    stored = {n for d in os.listdir(os.path.join(root, "chunks")) for n in os.listdir(os.path.join(root, "chunks", d))}
    assert stored == referenced
    for folder in ("leases", "retired"):  # the writers removed their leases; the parked lists are done
        assert not os.path.isdir(os.path.join(root, folder)) or not os.listdir(os.path.join(root, folder))


def test_gc_with_retention_also_deletes_the_chunks_of_parked_lists(tmp_path):
    """Retention that parked a step's chunks (another writer was live), then gc with a step of its
    own to retire: both sets go, and the parked list with them (the flake of the test below: gc took
    the parked chunks for deleted by its own retention and removed their list)."""
    from ckpt.format import manifest as mf
    from ckpt.save.retention import delete_steps

    root = str(tmp_path / "ck")
    with ckpt.Checkpointer(root, chunk_size=CHUNK, codec="raw") as c:
        for step in (1, 2, 3):
            c.save(step, {"w": torch.randn(3 * CHUNK // 4, generator=torch.Generator().manual_seed(step))})
    storage = LocalStorage(root)
    cache = mf.ManifestCache(storage)
    delete_steps(storage, cache, [1], [2, 3], lambda keys: [storage.delete(k) for k in keys], park=True)
    assert os.listdir(os.path.join(root, "retired"))
    collect_and_check_clean(root)  # keep_last=1: step 2 retired by gc itself, step 1's chunks parked


@pytest.mark.multiprocess
@pytest.mark.slow
def test_gc_in_a_loop_beside_a_training_process(tmp_path):
    root, stop, log = str(tmp_path / "ck"), str(tmp_path / "stop"), str(tmp_path / "trainer.json")
    looping = child("gc", root, "1", stop)
    trainer = child("train", root, "0", "1", "150", "0", log)
    try:
        t = finish(trainer)
    finally:
        open(stop, "w").close()
    g = finish(looping, timeout=120)
    assert t["saved"] == 150 and not t["failures"]
    assert g["runs"] >= 5 and g["deferred"] >= 1  # gc ran while the writer was live, and kept out of its way
    check_every_step(root, [log])
    collect_and_check_clean(root)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_two_jobs_with_retention_share_a_root(tmp_path):
    root = str(tmp_path / "ck")
    logs = [str(tmp_path / "a.json"), str(tmp_path / "b.json")]
    a = child("train", root, "0", "2", "80", "2", logs[0])
    b = child("train", root, "1", "2", "80", "2", logs[1])
    ra, rb = finish(a), finish(b)
    assert ra["saved"] == rb["saved"] == 80
    check_every_step(root, logs)
    collect_and_check_clean(root)


def test_a_marker_still_being_written_is_not_taken_for_a_parked_list(tmp_path):
    """Another deleter's marker exists as ``retired/<name>.json.tmp-*`` until it is renamed: a writer
    collecting parked chunks at that moment must leave it alone (it once deleted it, failing the rename)."""
    root = str(tmp_path / "ck")
    c = ckpt.Checkpointer(root, chunk_size=CHUNK, codec="raw")
    c.save(1, {"x": torch.arange(1000.0)}).wait()
    c.close()
    storage = LocalStorage(root)
    storage.write("retired/000000000001-aaaaaaaaaaaa.json", [json.dumps({"steps": [0], "chunks": []}).encode()])
    os.rename(os.path.join(root, "retired", "000000000001-aaaaaaaaaaaa.json"),
              os.path.join(root, "retired", "000000000001-bbbbbbbbbbbb.json.tmp-0123456789ab"))
    from ckpt.save.retention import parked
    assert parked(storage) == {}
    c = ckpt.Checkpointer(root, chunk_size=CHUNK, codec="raw")
    c.save(2, {"x": torch.arange(1000.0)}).wait()  # after the commit, retention collects what is parked
    c.close()
    assert os.listdir(os.path.join(root, "retired")) == ["000000000001-bbbbbbbbbbbb.json.tmp-0123456789ab"]


# -- two jobs creating one chunk at once ------------------------------------------------------------

def one_chunk_moved() -> tuple[torch.Tensor, torch.Tensor]:
    """A one-chunk state and the same with a few values changed: saved after the first, it is stored
    as an XOR delta of it (codec="smallest"); saved first, whole."""
    before = torch.randn(CHUNK // 4, generator=torch.Generator().manual_seed(11))
    after = before.clone()
    after[:8] += 1
    return before, after


def describes_what_is_stored(root: str, step: int) -> None:
    """The step's entry of every chunk is the stored object's own header (codec, base), and the step
    loads bit-exactly."""
    storage = LocalStorage(root)
    for h, info in ckpt.open(root).manifest(step).chunks.items():
        hdr = parse_header(storage.read(paths.chunk_key(h), 0, HEADER_SIZE), name=h)
        assert (info.codec, info.base, info.stored) == (hdr.label, hdr.base, storage.size(paths.chunk_key(h)))


@pytest.mark.parametrize("held", ["delta", "whole"])
def test_two_jobs_creating_one_chunk_at_once_both_commit_steps_that_load(tmp_path, held):
    """Job a stores the new chunk as a delta of its previous save, job b (no previous save) whole. One
    job's create is held between its probe (nothing stored yet) and its write while the other saves:
    the copy created first stays, and the held job's step lists that copy (and its base), so both
    steps load and verify on their own. The later write used to replace the first copy, and the step
    that described the first never loaded again."""
    root = str(tmp_path / "ck")
    before, after = one_chunk_moved()
    disks = {j: FaultyStorage(LocalStorage(root)) for j in "ab"}
    jobs = {j: ckpt.Checkpointer(root, storage=disks[j], chunk_size=CHUNK, codec="smallest") for j in "ab"}
    steps = {"a": 3, "b": 2}
    slow, quick = ("a", "b") if held == "delta" else ("b", "a")
    gate = None
    try:
        jobs["a"].save(1, {"w": before.clone()}).wait()
        gate = disks[slow].gate("create", key=r"^chunks/")
        handle = jobs[slow].save(steps[slow], {"w": after.clone()})
        assert gate.entered.wait(60)  # probed, found nothing, and about to create
        jobs[quick].save(steps[quick], {"w": after.clone()}).wait()
        gate.open()
        handle.wait()
    finally:
        if gate is not None:
            gate.open()
        for c in jobs.values():
            c.close()
    m3 = ckpt.open(root).manifest(3)
    assert any(i.base is not None for i in m3.chunks.values()) == (held == "whole")  # a's delta stayed, or b's whole
    for step, state in ((1, before), (2, after), (3, after)):
        describes_what_is_stored(root, step)
        got = {"w": torch.zeros(CHUNK // 4)}
        ckpt.Checkpointer(root).load(step, got)
        assert torch.equal(got["w"], state)
    assert cli.main(["verify", root, "--all"]) == 0


def test_two_jobs_staging_in_local_tiers_list_the_copy_the_remote_kept(tmp_path):
    """The same race through local tiers: job a's delta is staged and its upload held while job b
    uploads the chunk whole. a's create in the remote finds b's copy, which stands: a's local tier gets
    it too and a's step lists it (the upload used to write over b's copy)."""
    root = str(tmp_path / "ck")
    before, after = one_chunk_moved()
    remote = FaultyStorage(LocalStorage(root))
    tiers = TieredStorage(LocalStorage(str(tmp_path / "nvme-a")), remote, verify=verify_object)
    a = ckpt.Checkpointer(root, storage=tiers, chunk_size=CHUNK, codec="smallest")
    b = ckpt.Checkpointer(root, local_dir=str(tmp_path / "nvme-b"), chunk_size=CHUNK, codec="smallest")
    gate = None
    try:
        a.save(1, {"w": before.clone()}).wait()
        gate = remote.gate("create", key=r"^chunks/")
        handle = a.save(3, {"w": after.clone()})
        assert gate.entered.wait(60)  # staged as a delta; its upload waits
        b.save(2, {"w": after.clone()}).wait()
        gate.open()
        handle.wait()
    finally:
        if gate is not None:
            gate.open()
        a.close()
        b.close()
    for step in (2, 3):
        describes_what_is_stored(root, step)
        assert all(i.base is None for i in ckpt.open(root).manifest(step).chunks.values())
    (x,) = ckpt.open(root).manifest(3).chunks
    with open(os.path.join(root, paths.chunk_key(x)), "rb") as f, \
            open(os.path.join(tmp_path, "nvme-a", paths.chunk_key(x)), "rb") as g:
        assert f.read() == g.read()  # both tiers hold the copy the step describes
    for step, state in ((1, before), (2, after), (3, after)):
        got = {"w": torch.zeros(CHUNK // 4)}
        ckpt.Checkpointer(root).load(step, got)
        assert torch.equal(got["w"], state)
    assert cli.main(["verify", root, "--all"]) == 0
