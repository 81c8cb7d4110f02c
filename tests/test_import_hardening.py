"""ckpt import of hostile or inconsistent sources (issue 32): no code from a DCP .metadata runs, what a
source declares is checked against what it holds, what an import builds is bounded by the source (or
max_bytes), and FIFOs or deeply nested JSON are refused instead of hanging or overflowing."""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import subprocess
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

import ckpt
from ckpt.testing import run_ranks


def nothing_committed(url) -> bool:
    return not os.path.exists(os.path.join(url, "steps")) or not os.listdir(os.path.join(url, "steps"))


def dcp_dir(path, n: int = 1024) -> str:
    """A real DCP directory: a tensor of ``n`` float32 (its values 0..n-1) and a step counter."""
    dcp.save({"w": torch.arange(n, dtype=torch.float32), "step": 7},
             storage_writer=dcp.FileSystemWriter(str(path)), no_dist=True)
    return str(path)


def read_md(d):
    with open(os.path.join(d, ".metadata"), "rb") as f:
        return pickle.load(f)  # the test's own directory, written just now


def write_md(d, md) -> None:
    with open(os.path.join(d, ".metadata"), "wb") as f:
        pickle.dump(md, f)


# -- 32.1: a DCP .metadata is never unpickled with pickle.load ---------------------------------------

class RunsShell:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


class OpensFile:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


@pytest.mark.parametrize("how", ["whole", "nested"])
def test_dcp_metadata_that_would_run_code_is_refused_by_api_and_cli(tmp_path, run, how):
    d = dcp_dir(tmp_path / "dcp")
    shell, opened = tmp_path / "ran-shell", tmp_path / "opened"
    if how == "whole":  # .metadata is the payload itself
        write_md(d, [RunsShell(shell), OpensFile(opened)])
    else:  # DCP's real metadata, a payload hidden in a field
        md = read_md(d)
        md.storage_meta.checkpoint_id = (RunsShell(shell), OpensFile(opened))
        write_md(d, md)
    url = tmp_path / "ck"
    with pytest.raises(ckpt.UnsupportedValueError, match="not one of DCP's metadata classes"):
        ckpt.import_checkpoint(d, url, step=0)
    rc, _, err = run("import", d, url, "--step", 0)
    assert rc == 1 and "never runs code" in err
    assert not shell.exists() and not opened.exists() and nothing_committed(url)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_real_dcp_directory_of_two_ranks_still_imports_bit_exact(tmp_path):
    d = str(tmp_path / "dcp2")
    assert run_ranks(2, _save_two_rank_dcp, d) == [0, 1]
    md = read_md(d)
    assert len(md.state_dict_metadata["w"].chunks) == 2
    assert len({i.relative_path for i in md.storage_data.values()}) == 2  # a data file per rank
    res = ckpt.import_checkpoint(d, tmp_path / "ck", step=3)
    assert res.format == "dcp" and res.tensors == 2 and res.values == ["step"]
    with ckpt.open(tmp_path / "ck") as r:
        got, values = r.tensors(3), r.values(3)
    assert torch.equal(got["model/w"], torch.arange(24.).reshape(6, 4)) and values["step"] == 11
    assert torch.equal(got["model/b"], torch.ones(3, dtype=torch.bfloat16))


def _save_two_rank_dcp(rank, world, path):
    # rank r saves rows 3r..3r+2 of w as a chunk of its own (DCP's own sharded-tensor layout)
    from torch.distributed._shard.sharded_tensor import Shard, ShardMetadata, init_from_local_shards

    rows = torch.arange(24.).reshape(6, 4)[3 * rank:3 * rank + 3].clone()
    w = init_from_local_shards([Shard(rows, ShardMetadata([3 * rank, 0], [3, 4], f"rank:{rank}/cpu"))], [6, 4])
    dcp.save({"w": w, "b": torch.ones(3, dtype=torch.bfloat16), "step": 11},
             storage_writer=dcp.FileSystemWriter(path))
    return rank


# -- 32.9: what DCP metadata declares must be what the directory holds -------------------------------

def _declare(md, size, chunks):
    t = md.state_dict_metadata["w"]
    t.size = torch.Size(size)
    t.chunks = [ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s in chunks]


def _no_storage(md):
    md.storage_data = {k: v for k, v in md.storage_data.items() if k.fqn != "w"}


def _outside(md):
    key = next(k for k in md.storage_data if k.fqn == "w")
    md.storage_data[key] = dataclasses.replace(md.storage_data[key], relative_path="../elsewhere/__0_0.distcp")


def _shared_bytes(md):  # two chunks of 512 read the same 1024 elements' bytes
    _declare(md, [1024], [([0], [512]), ([512], [512])])
    key = next(k for k in md.storage_data if k.fqn == "w")
    md.storage_data[MetadataIndex("w", torch.Size([512]))] = md.storage_data[key]
    md.storage_data[MetadataIndex("w", torch.Size([0]))] = md.storage_data.pop(key)


CASES = {
    "declares 4096, chunk of 1024": (lambda md: _declare(md, [4096], [([0], [1024])]), "do not cover"),
    "chunk declares 4096 over 1024 on disk": (lambda md: _declare(md, [4096], [([0], [4096])]), "declares 16384 bytes"),
    "no chunks": (lambda md: _declare(md, [4096], []), "it has none"),
    "1 GiB from 12 KB": (lambda md: _declare(md, [2 ** 28], [([0], [2 ** 28])]), "declares 1073741824 bytes"),
    "chunk outside the tensor": (lambda md: _declare(md, [1024], [([512], [1024])]), "not inside its size"),
    "no storage entries": (_no_storage, "has no storage entry"),
    "a path out of the directory": (_outside, "not a file inside"),
    "two chunks, the same bytes": (_shared_bytes, "share bytes"),
}


@pytest.mark.parametrize("case", CASES)
def test_dcp_metadata_that_does_not_match_its_data_is_refused_before_commit(tmp_path, case):
    d = dcp_dir(tmp_path / "src" / "dcp")
    elsewhere = tmp_path / "src" / "elsewhere"  # a real DCP data file outside the source directory
    dcp_dir(elsewhere)
    change, message = CASES[case]
    md = read_md(d)
    change(md)
    write_md(d, md)
    url = tmp_path / "ck"
    with pytest.raises(ckpt.CorruptCheckpointError, match=message) as e:
        ckpt.import_checkpoint(d, url, step=0)
    assert e.value.object == os.path.join(d, ".metadata") and nothing_committed(url)
    ckpt.import_checkpoint(dcp_dir(tmp_path / "good"), url, step=0)  # the untouched directory imports
    assert torch.equal(ckpt.open(url).tensors(0)["model/w"], torch.arange(1024.))


# -- 32.10: an import builds no more than its source holds (or max_bytes) -----------------------------

def test_an_expanded_torch_save_tensor_is_refused_unless_max_bytes_allows_it(tmp_path, run):
    src = tmp_path / "expanded.pt"
    torch.save({"w": torch.ones(1).expand(2 ** 20), "b": torch.zeros(3)}, src)
    assert os.path.getsize(src) < 4096
    url = tmp_path / "ck"
    with pytest.raises(ckpt.CorruptCheckpointError, match=r"expand\(\)-ed or overlapping view"):
        ckpt.import_checkpoint(src, url, step=0)
    rc, _, err = run("import", src, url, "--step", 0)
    assert rc == 1 and "--max-bytes" in err and nothing_committed(url)
    with pytest.raises(ckpt.ConfigError, match="max_bytes=1048576"):  # allowed views, still over the limit
        ckpt.import_checkpoint(src, url, step=0, max_bytes="1MiB")
    assert nothing_committed(url)
    rc, out, _ = run("import", src, url, "--step", 0, "--max-bytes", "8MiB")
    assert rc == 0 and "imported" in out
    assert torch.equal(ckpt.open(url).tensors(0)["model/w"], torch.ones(2 ** 20))


def test_an_expanded_tensor_inside_a_dcp_value_is_refused_too(tmp_path):
    d = str(tmp_path / "dcp")
    dcp.save({"w": torch.ones(2), "v": (torch.ones(1).expand(2 ** 20), 3)},  # a tuple: one pickled value
             storage_writer=dcp.FileSystemWriter(d), no_dist=True)
    with pytest.raises(ckpt.CorruptCheckpointError, match=r"'v/0' is a \(1048576,\) torch.float32 view"):
        ckpt.import_checkpoint(d, tmp_path / "ck", step=0)
    assert nothing_committed(tmp_path / "ck")
    ckpt.import_checkpoint(d, tmp_path / "ck", step=0, max_bytes="5MiB")
    assert ckpt.open(tmp_path / "ck").steps() == [0]


def test_a_torch_save_tensor_of_2_32_elements_gives_a_typed_error_not_an_allocator_one(tmp_path):
    src = tmp_path / "huge.pt"
    torch.save({"w": torch.ones(1).expand(2 ** 32)}, src)
    with pytest.raises(ckpt.CorruptCheckpointError, match="17179869184 bytes"):
        ckpt.import_checkpoint(src, tmp_path / "ck", step=0)
    with pytest.raises(ckpt.ConfigError, match="max_bytes"):
        ckpt.import_checkpoint(src, tmp_path / "ck", step=0, max_bytes=2 ** 30)
    for bad in (0, -1, "lots", 1.5):
        with pytest.raises(ckpt.ConfigError, match="max_bytes must be"):
            ckpt.import_checkpoint(src, tmp_path / "ck", step=0, max_bytes=bad)
    assert nothing_committed(tmp_path / "ck")


def test_max_bytes_bounds_safetensors_and_dcp_before_they_are_read(tmp_path):
    save_file({"a": torch.ones(1000), "b": torch.ones(1000)}, tmp_path / "w.safetensors")
    d = dcp_dir(tmp_path / "dcp")
    for src in (tmp_path / "w.safetensors", d):
        with pytest.raises(ckpt.ConfigError, match="max_bytes=4000"):
            ckpt.import_checkpoint(src, tmp_path / "ck", step=0, max_bytes=4000)
    assert nothing_committed(tmp_path / "ck")
    ckpt.import_checkpoint(tmp_path / "w.safetensors", tmp_path / "ck", step=0, max_bytes=8000)


# -- 32.11: regular files only, JSON depth-limited ---------------------------------------------------

def _hf_dir(path):
    path.mkdir()
    save_file({"a": torch.ones(2)}, path / "model-00001-of-00001.safetensors")
    (path / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"a": "model-00001-of-00001.safetensors"}}))
    return path


def _fifo(path):
    os.unlink(path) if os.path.lexists(path) else None
    os.mkfifo(path)


IMPORT_EACH = """
import json, sys
import ckpt
from ckpt import cli
url, sources = sys.argv[1], sys.argv[2:]
for src in sources:
    try:
        ckpt.import_checkpoint(src, url, step=0)
        print(json.dumps(["imported", src]), flush=True)
    except Exception as e:
        print(json.dumps([type(e).__name__, str(e)]), flush=True)
print(json.dumps(["cli", cli.main(["import", sources[-2], url, "--step", "0"])]), flush=True)
"""


@pytest.mark.multiprocess
def test_fifos_in_place_of_source_files_are_refused_without_hanging(tmp_path):
    url = tmp_path / "ck"
    single = tmp_path / "single"
    single.mkdir()
    _fifo(single / "model.safetensors")
    index = _hf_dir(tmp_path / "index")
    _fifo(index / "model.safetensors.index.json")
    shard = _hf_dir(tmp_path / "shard")
    _fifo(shard / "model-00001-of-00001.safetensors")
    data = dcp_dir(tmp_path / "data")
    _fifo(os.path.join(data, "__0_0.distcp"))
    meta = dcp_dir(tmp_path / "meta")
    _fifo(os.path.join(meta, ".metadata"))
    _fifo(tmp_path / "w.pt")
    sources = [single, index, shard, data, meta, tmp_path / "w.pt"]
    # in a child: before the fix open() blocked forever in safetensors' Rust, holding the GIL, where
    # no timeout inside the process can end it; here the child is killed and the test fails
    p = subprocess.run([sys.executable, "-c", IMPORT_EACH, str(url), *map(str, sources)], capture_output=True,
                       text=True, timeout=120)
    got = [json.loads(line) for line in p.stdout.splitlines()]
    assert len(got) == len(sources) + 1, p.stderr[-2000:]
    for (kind, message), src in zip(got[:-2], sources):
        assert kind == "CorruptCheckpointError" and "is a FIFO, not a regular file" in message, (src, message)
    assert got[-2][0] == "ConfigError" and "not a regular file" in got[-2][1]  # the source itself
    assert got[-1] == ["cli", 1] and "is a FIFO" in p.stderr  # the CLI, on the DCP directory
    assert nothing_committed(url)


def test_a_deeply_nested_json_index_is_refused_not_a_recursion_error(tmp_path):
    hf = _hf_dir(tmp_path / "hf")
    (hf / "model.safetensors.index.json").write_text('{"weight_map": ' + "[" * 200_000 + "]" * 200_000 + "}")
    with pytest.raises(ckpt.CorruptCheckpointError, match="nests JSON 200001 levels deep"):
        ckpt.import_checkpoint(hf, tmp_path / "ck", step=0)
    # a safetensors header is JSON too
    header = b'{"a": ' + b"[" * 200_000 + b"]" * 200_000 + b"}"
    (tmp_path / "deep.safetensors").write_bytes(len(header).to_bytes(8, "little") + header)
    with pytest.raises(ckpt.CorruptCheckpointError, match="nests JSON"):
        ckpt.import_checkpoint(tmp_path / "deep.safetensors", tmp_path / "ck", step=0)
    assert nothing_committed(tmp_path / "ck")
