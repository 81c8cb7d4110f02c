"""ckpt.dcp: dcp.save / dcp.async_save / dcp.load over ckpt steps, on real gloo ranks with DTensors."""

from __future__ import annotations

import datetime
import os
import signal

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import ckpt
import ckpt.dcp
from ckpt.errors import CheckpointNotFoundError, ConfigError, CorruptCheckpointError, UnsupportedValueError
from ckpt.format import paths
from ckpt.storage import LocalStorage
from ckpt.testing import run_ranks


def global_tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(8, 6, generator=g), "b": torch.randn(5, generator=g),
            "emb": torch.randint(0, 1000, (7, 3), generator=g), "plain": torch.arange(6, dtype=torch.float64)}


def dtensor_state(world: int, seed: int = 0, zeros: bool = False) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    g = {k: torch.zeros_like(v) if zeros else v for k, v in global_tensors(seed).items()}
    return {"model": {"w": distribute_tensor(g["w"], mesh, [Shard(0)]),
                      "b": distribute_tensor(g["b"], mesh, [Replicate()]),
                      "emb": distribute_tensor(g["emb"], mesh, [Shard(1)]),
                      "plain": g["plain"]},
            "step": -1 if zeros else 3, "meta": {"name": "" if zeros else "run", "lrs": [0.0] if zeros else [0.1, 0.2]}}


def full(state: dict) -> dict:
    out = {}
    for k, v in state["model"].items():
        t = v.full_tensor() if hasattr(v, "full_tensor") else v
        out[k] = t.numpy().copy()  # by value: a tensor would travel to the test as a handle to this process
    return {"model": out, "step": state["step"], "meta": state["meta"]}


def failures(e: BaseException) -> list[BaseException]:
    """The errors inside DCP's CheckpointException (one per failed rank)."""
    if isinstance(e, CheckpointException):
        return [f[0] if isinstance(f, tuple) else f for f in e.failures.values()]
    return [e]


# -- bodies run on every rank (module level: spawned processes import them) --------------------------

def save_body(rank: int, world: int, path: str) -> None:
    state = dtensor_state(world)
    dcp.save(state, storage_writer=ckpt.dcp.Writer(path, step=1))
    dcp.save(state, storage_writer=ckpt.dcp.Writer(path, step=2))  # unchanged: dedup


def load_body(rank: int, world: int, path: str, step) -> dict:
    state = dtensor_state(world, zeros=True)
    dcp.load(state, storage_reader=ckpt.dcp.Reader(path, step=step))
    return full(state)


def checkpointer_save_body(rank: int, world: int, path: str) -> None:
    c = ckpt.Checkpointer(path)
    c.save(5, dtensor_state(world, seed=1)).wait()
    c.close()


def damaged_load_body(rank: int, world: int, path: str) -> list[str]:
    try:
        load_body(rank, world, path, 1)
    except BaseException as e:  # DCP's CheckpointException is a BaseException
        return [type(x).__name__ + ": " + str(x) for x in failures(e) if isinstance(x, CorruptCheckpointError)]
    return []


def both_saves_body(rank: int, world: int, path: str, path2: str) -> None:
    checkpointer_save_body(rank, world, path)
    save_body(rank, world, path2)


def both_loads_body(rank: int, world: int, path: str, path2: str) -> tuple[dict, list[str]]:
    """Step 5 of ``path`` (a Checkpointer's) through dcp.load, then the damaged step 1 of ``path2``."""
    return load_body(rank, world, path, 5), damaged_load_body(rank, world, path2)


class KillingStorage(LocalStorage):
    """A disk whose process dies (SIGKILL) on its first chunk write: a rank killed inside write_data."""

    def create(self, key, buffers):  # how new chunks are written
        if key.startswith("chunks/"):
            os.kill(os.getpid(), signal.SIGKILL)
        return super().create(key, buffers)


def killed_body(rank: int, world: int, path: str) -> str:
    storage = KillingStorage(path) if rank == 1 else None
    try:
        dcp.save(dtensor_state(world), storage_writer=ckpt.dcp.Writer(path, step=1, storage=storage))
    except BaseException as e:
        return type(e).__name__
    return "saved"


def async_body(rank: int, world: int, path: str, process: bool) -> dict:
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    kind = AsyncCheckpointerType.PROCESS if process else AsyncCheckpointerType.THREAD
    stager = ckpt.dcp.Stager()
    # DTensors in both modes: process mode crashed the ranks (SIGSEGV in torch moving the buffer, in use
    # by DTensor views, into shared memory) until the Stager allocated it there up front
    state = dtensor_state(world)
    ptrs, steps, saved = [], [10, 11, 12], []
    for s in steps:
        with torch.no_grad():
            state["model"]["w"].add_(1.0)
        w = state["model"]["w"]
        saved.append((w.full_tensor() if hasattr(w, "full_tensor") else w).numpy().copy())
        fut = dcp.async_save(state, storage_writer=ckpt.dcp.Writer(path, step=s), async_stager=stager,
                             async_checkpointer_type=kind)
        with torch.no_grad():
            state["model"]["w"].mul_(-3.0)  # changed after staging: must not reach the step
        fut.result()
        ptrs.append(stager.buffer.buffer.data_ptr())
    local = sum(_local_bytes(v) for v in state["model"].values())
    out = {"saved": saved, "ptrs": ptrs, "host": stager.buffer.nbytes, "local": local, "tensors": len(state["model"]),
           "layouts": stager.layouts_made}
    stager.close()
    return out


def _local_bytes(t: torch.Tensor) -> int:
    t = t.to_local() if hasattr(t, "to_local") else t
    return t.numel() * t.element_size()


# -- tests ------------------------------------------------------------------------------------------

@pytest.mark.multiprocess
def test_save_on_2_load_on_3_and_through_ckpt(tmp_path):
    path = str(tmp_path / "run")
    run_ranks(2, save_body, path, timeout=120)
    want = global_tensors()
    for got in run_ranks(3, load_body, path, "latest", timeout=120):
        for k, v in want.items():
            assert torch.equal(torch.from_numpy(got["model"][k]), v), k
        assert got["step"] == 3 and got["meta"] == {"name": "run", "lrs": [0.1, 0.2]}
    # the same steps through ckpt's own readers
    reader = ckpt.open(path)
    assert reader.steps() == [1, 2]
    tensors = reader.tensors(1)
    assert sorted(tensors) == [f"model/{k}" for k in sorted(want)]
    assert all(torch.equal(tensors[f"model/{k}"], v) for k, v in want.items())
    assert reader.values(1) == {"step": 3, "meta/name": "run", "meta/lrs": [0.1, 0.2]}
    state = {"model": {k: torch.zeros_like(v) for k, v in want.items()}, "step": 0, "meta": {"name": "", "lrs": []}}
    c = ckpt.Checkpointer(path)
    c.load(2, state)
    c.close()
    assert all(torch.equal(state["model"][k], v) for k, v in want.items()) and state["meta"]["lrs"] == [0.1, 0.2]
    # dedup: the second save of unchanged weights stored no new chunk
    m1, m2 = reader.manifest(1), reader.manifest(2)
    assert m1.stats["written_bytes"] > 0 and m2.stats["written_bytes"] == 0 and m2.stats["chunks_written"] == 0
    assert set(m2.chunks) == set(m1.chunks)
    assert reader.verify(2).ok


@pytest.mark.multiprocess
def test_checkpointer_save_loads_through_dcp_and_damage_is_refused(tmp_path):
    # one group of 2 ranks saves both directories, one of 3 loads both (4 launches of ranks were 2 of each)
    path, path2 = str(tmp_path / "run"), str(tmp_path / "dcp")
    run_ranks(2, both_saves_body, path, path2, timeout=120)
    # a flipped byte in the chunk of the replicated tensor every rank reads
    m = ckpt.open(path2).manifest(1)
    h = next(t for t in m.tensors if t.key == "model/b").shards[0].segments[0].chunk
    chunk = tmp_path / "dcp" / paths.chunk_key(h)
    data = bytearray(chunk.read_bytes())
    data[-1] ^= 0x40
    chunk.write_bytes(bytes(data))
    want = global_tensors(seed=1)
    for got, errors in run_ranks(3, both_loads_body, path, path2, timeout=120):
        assert all(torch.equal(torch.from_numpy(got["model"][k]), v) for k, v in want.items())
        assert got["step"] == 3 and got["meta"]["lrs"] == [0.1, 0.2]
        assert errors and h in errors[0], errors


@pytest.mark.multiprocess
def test_rank_killed_in_write_data_commits_nothing_and_next_save_works(tmp_path):
    path = str(tmp_path / "run")
    out = run_ranks(2, killed_body, path, may_die=(1,), timeout=120, pg_timeout=30)
    assert out[1] is None and out[0] != "saved"
    assert not (tmp_path / "run" / paths.manifest_key(1)).exists()
    with pytest.raises(CheckpointNotFoundError):
        ckpt.dcp.Reader(path, step="latest").read_metadata()
    with pytest.raises(CheckpointNotFoundError):
        ckpt.dcp.Reader(path, step=1).read_metadata()
    state = {"model": {"w": torch.arange(12.0).reshape(3, 4)}}
    dcp.save(state, storage_writer=ckpt.dcp.Writer(path, step=1), no_dist=True)
    assert ckpt.open(path).steps() == [1]
    assert torch.equal(ckpt.open(path).tensors(1)["model/w"], state["model"]["w"])


def local_commits_body(rank: int, world: int, path: str, nvme: str) -> dict:
    from ckpt.format import manifest as mf

    state = dtensor_state(world)
    held = []
    for s in (1, 2):
        with torch.no_grad():
            state["model"]["w"].add_(1.0)
        writer = ckpt.dcp.Writer(path, step=s, local_dir=f"{nvme}/node{rank}", redundancy=ckpt.Replicas(2),
                                 failure_domain=f"node{rank}")
        dcp.async_save(state, storage_writer=writer).result()
        held.append(mf.committed_steps(LocalStorage(f"{nvme}/node{rank}")))
    got = dtensor_state(world, zeros=True)
    dcp.load(got, storage_reader=ckpt.dcp.Reader(path, step=2))
    return {"saved": full(state), "loaded": full(got), "held": held}


@pytest.mark.multiprocess
def test_async_save_with_local_commits_and_redundancy(tmp_path):
    """ckpt.dcp.Writer(local_dir=, redundancy=) on 2 gloo ranks under dcp.async_save: the steps load
    bit-exact, each rank's local directory is a committed checkpoint (the coordinator's at once, the
    other's from its next save, and at exit), and holds a replica of the other rank's chunks."""
    import numpy as np

    from ckpt.format import manifest as mf

    path, nvme = str(tmp_path / "run"), str(tmp_path / "nvme")
    out = run_ranks(2, local_commits_body, path, nvme, timeout=180)
    for r in out:
        for k, v in r["saved"]["model"].items():
            assert np.array_equal(r["loaded"]["model"][k], v), k
        assert r["loaded"]["step"] == 3 and r["loaded"]["meta"] == r["saved"]["meta"]
    assert out[0]["held"] == [[1], [1, 2]] and out[1]["held"] == [[], [1]]
    chunks = set(ckpt.open(path).manifest(2).chunks)
    for node in ("node0", "node1"):  # closed at exit: both steps committed in both local directories
        tier = LocalStorage(f"{nvme}/{node}")
        assert mf.committed_steps(tier) == [1, 2], node
        assert all(tier.exists(paths.chunk_key(h)) for h in chunks), node  # Replicas(2): every chunk on both
    assert ckpt.open(path).steps() == [1, 2] and ckpt.open(path).verify(all=True).ok


@pytest.mark.multiprocess
@pytest.mark.parametrize("process", [False, True], ids=["thread", "process"])
def test_async_save_with_stager(tmp_path, process):
    path = str(tmp_path / "run")
    out = run_ranks(2, async_body, path, process, timeout=180, daemon=not process)  # DCP's process mode forks
    reader = ckpt.open(path)
    assert reader.steps() == [10, 11, 12]
    for i, s in enumerate([10, 11, 12]):  # each step holds the state as staged, not the later changes
        assert torch.equal(reader.tensors(s)["model/w"], torch.from_numpy(out[0]["saved"][i])), s
    for r in out:
        assert r["layouts"] == 1
        assert len(set(r["ptrs"])) == 1  # the same buffer every save, in process mode too
        assert r["host"] <= 1.02 * r["local"] + 64 * (r["tensors"] + 2)


def test_writer_checks_its_options_and_values(tmp_path):
    with pytest.raises(ConfigError, match="every"):
        ckpt.dcp.Writer(str(tmp_path), step=1, every=10)
    with pytest.raises(ConfigError, match="keep_last"):
        ckpt.dcp.Writer(str(tmp_path), step=1, keep_last=0)
    with pytest.raises(ConfigError, match="step"):
        ckpt.dcp.Writer(str(tmp_path), step=-1)
    with pytest.raises(CheckpointException) as e:
        dcp.save({"when": datetime.timedelta(1)}, storage_writer=ckpt.dcp.Writer(str(tmp_path), step=1), no_dist=True)
    assert any(isinstance(x, ConfigError) and "'when'" in str(x) for x in failures(e.value))
    assert not (tmp_path / paths.manifest_key(1)).exists()


def test_pickle_needs_opt_in_on_both_sides_and_retention(tmp_path):
    path = str(tmp_path)
    for s in (1, 2, 3):
        dcp.save({"when": datetime.timedelta(s), "w": torch.full((4,), float(s))},
                 storage_writer=ckpt.dcp.Writer(path, step=s, allow_pickle=True, keep_last=2), no_dist=True)
    assert ckpt.open(path).steps() == [2, 3]
    target = {"when": None, "w": torch.zeros(4)}
    with pytest.raises(CheckpointException) as e:
        dcp.load(target, storage_reader=ckpt.dcp.Reader(path), no_dist=True)
    assert any(isinstance(x, UnsupportedValueError) for x in failures(e.value))
    dcp.load(target, storage_reader=ckpt.dcp.Reader(path, allow_pickle=True), no_dist=True)
    assert target["when"] == datetime.timedelta(3) and torch.equal(target["w"], torch.full((4,), 3.0))


def test_stager_buffer_reused_and_sized(tmp_path):
    state = {"a": torch.randn(100, 10), "b": {"c": torch.arange(7, dtype=torch.int16)}, "n": 4}
    stager = ckpt.dcp.Stager()
    staged = stager.stage(state)
    ptr = stager.buffer.buffer.data_ptr()
    assert torch.equal(staged["a"], state["a"]) and staged["n"] == 4
    assert staged["a"].untyped_storage().data_ptr() == ptr
    state["a"].add_(1)
    assert not torch.equal(staged["a"], state["a"])  # a snapshot, not the live tensor
    del staged  # done with it: the next stage would otherwise wait (wait_s) for it to be let go
    again = stager.stage(state)
    assert stager.buffer.buffer.data_ptr() == ptr and torch.equal(again["a"], state["a"]) and stager.layouts_made == 1
    assert stager.buffer.nbytes <= 1.02 * (4000 + 14) + 64 * 3
    stager.stage({**state, "d": torch.zeros(3)})
    assert stager.layouts_made == 2


def test_reader_says_which_step_latest_is_and_takes_no_per_rank_fallback(tmp_path):
    import inspect

    path = str(tmp_path / "run")
    with pytest.raises(CheckpointNotFoundError):
        _ = ckpt.dcp.Reader(path, step="latest").step  # a new run: asked of the Reader, not read from DCP's error
    for s in (3, 7):
        dcp.save({"w": torch.full((4,), float(s))}, storage_writer=ckpt.dcp.Writer(path, step=s), no_dist=True)
    reader = ckpt.dcp.Reader(path, step="latest")
    assert reader.step == 7 and ckpt.dcp.Reader(path, step=3).step == 3
    # DCP retries read_metadata(rank=...) only where it takes keyword arguments; that retry would
    # switch one rank to loading without collectives while the others use them
    assert "kwargs" not in inspect.signature(reader.read_metadata).parameters
    got = {"w": torch.zeros(4)}
    dcp.load(got, storage_reader=reader, no_dist=True)
    assert torch.equal(got["w"], torch.full((4,), 7.0)) and reader.step == 7


def plan_cached_body(rank: int, world: int, path: str) -> list[bool]:
    """Three saves with DCP's plan caching (later saves skip the global planning), then each step back."""
    from torch.distributed.checkpoint import DefaultSavePlanner

    same = []
    for s in (1, 2, 3):
        state = dtensor_state(world, seed=s)
        planner = DefaultSavePlanner(enable_plan_caching=True)
        dcp.save(state, storage_writer=ckpt.dcp.Writer(path, step=s), planner=planner)
    for s in (1, 2, 3):
        got = dtensor_state(world, zeros=True)
        dcp.load(got, storage_reader=ckpt.dcp.Reader(path, step=s))
        want, have = full(dtensor_state(world, seed=s)), full(got)
        same.append(all((have["model"][k] == v).all() for k, v in want["model"].items())
                    and (have["step"], have["meta"]) == (want["step"], want["meta"]))
    return same


@pytest.mark.multiprocess
def test_saves_with_dcp_plan_caching_commit_and_load(tmp_path):
    path = str(tmp_path / "run")
    out = run_ranks(2, plan_cached_body, path, timeout=120)
    assert out == [[True, True, True]] * 2
    assert ckpt.open(path).steps() == [1, 2, 3] and ckpt.open(path).verify(all=True).ok


def _new_chunks(reader, steps: list[int]) -> list[dict]:
    """Per step, the chunks it stored first (not listed by an earlier step)."""
    seen: set[str] = set()
    out = []
    for s in steps:
        chunks = reader.manifest(s).chunks
        out.append({h: c for h, c in chunks.items() if h not in seen})
        seen |= set(chunks)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_successive_saves_store_deltas_against_the_previous_one(tmp_path, dtype):
    from ckpt.dcp import engines

    g = torch.Generator().manual_seed(7)
    runs, held = {}, {}
    for chain in (8, 1):
        path = str(tmp_path / f"chain{chain}")
        state = {"model": {"w": (torch.randn(768, 1024, generator=g) * 0.02).to(dtype),
                           "b": torch.randn(1024, generator=g).to(dtype)}, "step": 0}
        saved = []
        for s in (1, 2, 3):
            if s > 1:  # a slowly changing state: small updates to a few rows
                rows = torch.randint(0, 768, (6,), generator=g)
                state["model"]["w"][rows] += (torch.randn(6, 1024, generator=g) * 1e-3).to(dtype)
                state["step"] = s
            dcp.save(state, storage_writer=ckpt.dcp.Writer(path, step=s, chunk_size=256 * 1024, delta_chain=chain),
                     no_dist=True)  # a new Writer per save, as DCP wants
            saved.append({k: v.clone() for k, v in state["model"].items()})
        held[chain] = engines.held_bytes()
        reader = ckpt.open(path)
        for s, want in zip((1, 2, 3), saved):  # bit-exact through both readers
            got = {"model": {k: torch.zeros_like(v) for k, v in want.items()}, "step": -1}
            dcp.load(got, storage_reader=ckpt.dcp.Reader(path, step=s), no_dist=True)
            assert got["step"] == (s if s > 1 else 0)
            for k, v in want.items():
                assert torch.equal(got["model"][k].view(torch.int16), v.view(torch.int16)), (s, k)
                assert torch.equal(reader.tensors(s)[f"model/{k}"].view(torch.int16), v.view(torch.int16)), (s, k)
        assert reader.verify(all=True).ok
        runs[chain] = (reader, path)
        if chain == 8:  # a structure change starts a new pair: whole chunks again, and it loads
            assert engines.roots(0) == [path]  # the engine holding step 3's pair, its base, is still kept
            state["model"]["extra"] = torch.ones(4)
            dcp.save(state, storage_writer=ckpt.dcp.Writer(path, step=4, chunk_size=256 * 1024, delta_chain=chain),
                     no_dist=True)
            after = ckpt.open(path)
            assert not any(c.codec.startswith("xor/") for c in _new_chunks(after, [1, 2, 3, 4])[3].values())
            assert torch.equal(after.tensors(4)["model/extra"], torch.ones(4)) and after.verify(all=True).ok
    reader, path = runs[8]
    new = _new_chunks(reader, [1, 2, 3])
    stored = [sum(c.stored for c in n.values()) for n in new]
    assert not any(c.codec.startswith("xor/") for c in new[0].values())
    for s in (2, 3):  # the changed chunks went in as deltas of the previous save's
        assert any(c.codec.startswith("xor/") for c in reader.manifest(s).chunks.values())
        assert any(c.codec.startswith("xor/") and c.base in new[s - 2] for c in new[s - 1].values())
    # measured (fp32 / bf16): step 1 stores 2.53 / 1.03 MiB, steps 2 and 3 20 / 7.4 KiB (0.008× / 0.007×);
    # with delta_chain=1 the changed 256 KiB chunks go whole: 0.86-1.26 / 0.69 MiB (unchanged ones dedup both ways)
    assert stored[1] < 0.1 * stored[0] and stored[2] < 0.1 * stored[0], stored
    plain = _new_chunks(runs[1][0], [1, 2, 3])
    assert not any(c.codec.startswith("xor/") for n in plain for c in n.values())
    for s in (1, 2):
        assert sum(c.stored for c in plain[s].values()) > 10 * stored[s], (stored, s)
    # the delta root kept its pair (twice the items); delta_chain=1 keeps no buffer
    items = sum(v.numel() * v.element_size() for v in state["model"].values())
    assert 2 * items <= held[8] <= 2.1 * items + 8192 and held[1] == 0, (held, items)
    engines.drop(path, 0)


def test_a_save_that_fails_before_copying_does_not_hold_the_next_stage(tmp_path):
    """The Stager waits for a ckpt save to copy its snapshot out before staging over it; a save that
    fails first (here: its step is already committed) releases it instead of leaving the next
    async_save blocked for wait_s."""
    import time

    path = str(tmp_path / "run")
    stager = ckpt.dcp.Stager(wait_s=30)
    state = {"w": torch.arange(8.0)}
    dcp.async_save(state, storage_writer=ckpt.dcp.Writer(path, step=1), async_stager=stager, no_dist=True).result()
    with pytest.raises(CheckpointException) as info:  # DCP plans before async_save returns: it raises there
        dcp.async_save(state, storage_writer=ckpt.dcp.Writer(path, step=1), async_stager=stager, no_dist=True).result()
    assert any(isinstance(e, ckpt.StepExistsError) for e in failures(info.value))
    state["w"] += 1
    started = time.monotonic()
    dcp.async_save(state, storage_writer=ckpt.dcp.Writer(path, step=2), async_stager=stager, no_dist=True).result()
    assert time.monotonic() - started < 10  # not the 30 s wait
    assert torch.equal(ckpt.open(path).tensors(2)["w"], torch.arange(8.0) + 1)


def test_reader_names_both_keys_that_dcp_would_join_into_one_name(tmp_path):
    """A legitimate Checkpointer step whose key paths ``a/b.c`` and ``a.b/c`` are both DCP's ``a.b.c``."""
    from ckpt.errors import IncompatibleFormatError

    path = str(tmp_path / "run")
    c = ckpt.Checkpointer(path)
    c.save(1, {"a": {"b.c": torch.ones(2)}, "a.b": {"c": torch.zeros(2)}}).wait()
    c.close()
    with pytest.raises(IncompatibleFormatError) as e:
        ckpt.dcp.Reader(path, step=1).read_metadata()
    assert "'a/b.c'" in str(e.value) and "'a.b/c'" in str(e.value) and "'a.b.c'" in str(e.value)
    assert "ckpt.open" in str(e.value)
    assert ckpt.open(path).tensors(1)["a.b/c"].tolist() == [0.0, 0.0]  # the step itself is fine


def test_a_load_that_fails_on_a_damaged_chunk_changes_no_value_either(tmp_path):
    """dcp.load of a step with a damaged chunk: the error, and the param group's lr (a plain value) is
    still the caller's, as the tensors are: everything is verified before anything is applied."""
    path = str(tmp_path / "run")
    saved = {"model": {"w": torch.arange(16.0)}, "optim": {"param_groups": [{"lr": 0.5, "params": [0]}]}}
    dcp.save(saved, storage_writer=ckpt.dcp.Writer(path, step=1), no_dist=True)
    h = next(t for t in ckpt.open(path).manifest(1).tensors if t.key == "model/w").shards[0].segments[0].chunk
    chunk = tmp_path / "run" / paths.chunk_key(h)
    data = bytearray(chunk.read_bytes())
    data[-1] ^= 0x40
    chunk.write_bytes(bytes(data))
    target = {"model": {"w": torch.zeros(16)}, "optim": {"param_groups": [{"lr": 0.1, "params": [0]}]}}
    with pytest.raises(CheckpointException) as e:
        dcp.load(target, storage_reader=ckpt.dcp.Reader(path, step=1), no_dist=True)
    assert any(isinstance(x, CorruptCheckpointError) and h in str(x) for x in failures(e.value))
    assert target["optim"]["param_groups"][0]["lr"] == 0.1
    assert torch.equal(target["model"]["w"], torch.zeros(16))


def test_saves_into_a_new_directory_each_keep_only_the_newest_roots_buffers(tmp_path):
    """DCP's usual convention, a new directory per checkpoint: what is kept for deltas stays at one
    root's worth (it grew by the state's size with every save)."""
    from ckpt.dcp import engines

    state = {"w": torch.randn(256, 1024)}  # 1 MiB
    size = state["w"].numel() * 4
    for s in range(1, 6):
        state["w"].add_(1.0)
        dcp.save(state, storage_writer=ckpt.dcp.Writer(str(tmp_path / f"ckpt-{s}"), step=s), no_dist=True)
        assert engines.held_bytes() <= 1.05 * size + 4096, (s, engines.held_bytes())
    assert engines.roots(0) == [str(tmp_path / "ckpt-5")]
    # the newest root still stores deltas against its previous save
    state["w"][:4].add_(1e-3)
    dcp.save(state, storage_writer=ckpt.dcp.Writer(str(tmp_path / "ckpt-5"), step=6), no_dist=True)
    assert engines.held_bytes() <= 2.1 * size + 8192
    assert torch.equal(ckpt.open(str(tmp_path / "ckpt-5")).tensors(6)["w"], state["w"])
    engines.drop(str(tmp_path / "ckpt-5"), 0)


def test_a_module_state_dict_written_through_dcp_loads_into_the_module(tmp_path):
    """dcp.save({"model": model.state_dict()}) through ckpt.dcp.Writer, then
    Checkpointer.load(step, {"model": model}) as for the Checkpointer's own save of a module."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    path = str(tmp_path / "run")
    dcp.save({"model": model.state_dict(), "step": 7}, storage_writer=ckpt.dcp.Writer(path, step=1), no_dist=True)
    fresh = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    state = {"model": fresh, "step": 0}
    c = ckpt.Checkpointer(path)
    c.load(1, state)
    assert state["step"] == 7
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), model.state_dict().values()))
    # nested under a dict too, and a module that does not fit is refused before anything changes
    dcp.save({"train": {"model": model.state_dict()}}, storage_writer=ckpt.dcp.Writer(path, step=2), no_dist=True)
    nested = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    c.load(2, {"train": {"model": nested}})
    assert torch.equal(nested[0].weight, model[0].weight)
    other = torch.nn.Linear(4, 3)
    before = other.weight.clone()
    with pytest.raises(ckpt.errors.StateMismatchError, match="missing from the checkpoint"):
        c.load(1, {"model": other, "step": 0})
    assert torch.equal(other.weight, before)
    c.close()
