"""Export to Hugging Face shards and plain DCP directories, and import from safetensors, Hugging Face,
torch.save and DCP: real files read back by their own libraries (safetensors, torch.distributed.checkpoint
with its FileSystemReader, torch.load), and real modules loaded from the imported steps."""

from __future__ import annotations

import json
import os
import re

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn

import ckpt
from ckpt.testing import run_ranks

ROWS, COLS = 48, 200


def full_tensors() -> dict[str, torch.Tensor]:
    """The global tensors the two ranks save (as shards of emb and head, and replicated)."""
    g = torch.Generator().manual_seed(7)
    return {"model/emb.weight": torch.randn(ROWS, COLS, generator=g),
            "model/head.weight": torch.randn(COLS, 30, generator=g).to(torch.bfloat16),
            "model/norm.weight": torch.linspace(0, 1, COLS, dtype=torch.float64),
            "model/pos": torch.arange(64, dtype=torch.int64),
            "optim/exp_avg": torch.full((ROWS,), 0.25)}


def two_rank_body(rank, world, path):
    full = full_tensors()
    r0, n = (0, 30) if rank == 0 else (30, ROWS - 30)
    c0, m = (0, 100) if rank == 0 else (100, COLS - 100)
    emb, head = full["model/emb.weight"][r0:r0 + n].clone(), full["model/head.weight"][c0:c0 + m].clone()
    state = {"model": {"emb.weight": ckpt.LocalShard(emb, (r0, 0), (ROWS, COLS)),
                       "head.weight": ckpt.LocalShard(head, (c0, 0), (COLS, 30)),
                       "norm.weight": full["model/norm.weight"].clone(), "pos": full["model/pos"].clone()},
             "optim": {"exp_avg": full["optim/exp_avg"].clone(), "lr": 0.001, "betas": (0.9, 0.95)},
             "step": 5, "note": "two ranks"}
    with ckpt.Checkpointer(path) as c:
        c.save(5, state)
    return rank


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("hf") / "ck")
    assert run_ranks(2, two_rank_body, path) == [0, 1]
    return path


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


# -- export -------------------------------------------------------------------------------------------

@pytest.mark.multiprocess
def test_hf_export_of_two_ranks_is_sharded_indexed_and_bit_exact(two_ranks, run, tmp_path):
    out = tmp_path / "hf"
    full = full_tensors()
    rc, stdout, _ = run("export", two_ranks, "--to", out, "--format", "hf", "--max-shard-size", "30KB",
                        "--keys", "model/", "--keys", "optim/")
    assert rc == 0 and "file(s)" in stdout
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(f for f in os.listdir(out) if f.endswith(".safetensors"))
    n = len(files)
    assert n == 2 and files == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    assert not [f for f in os.listdir(out) if f.startswith(".")]  # staging directory gone
    got: dict[str, torch.Tensor] = {}
    for f in files:
        shard = load_file(out / f)
        assert not set(shard) & set(got)  # every name in one shard only
        assert all(index["weight_map"][k] == f for k in shard)
        sizes = [t.numel() * t.element_size() for t in shard.values()]
        assert sum(sizes) <= 30_000 or len(shard) == 1  # over the limit only as a tensor alone
        got.update(shard)
        with safe_open(out / f, "pt") as fh:
            meta = fh.metadata()
        assert meta["format"] == "pt" and meta["ckpt.step"] == "5" and meta["ckpt.source"].endswith("ck")
    assert sorted(index["weight_map"]) == sorted(got) == sorted(full)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in full.values())
    assert all(same(got[k], full[k]) for k in full)
    # greedy in key order: emb.weight (38 400 B, over the limit) alone, the other 14 304 B together
    assert [k for k, f in index["weight_map"].items() if f == files[0]] == ["model/emb.weight"]
    rest = sorted(k for k, f in index["weight_map"].items() if f == files[1])
    assert rest == sorted(set(full) - {"model/emb.weight"})


@pytest.mark.multiprocess
def test_hf_export_single_shard_dtype_cast_keys_and_strip_prefix(two_ranks, run, tmp_path):
    full = full_tensors()
    out = tmp_path / "hf1"
    rc, _, _ = run("export", two_ranks, "--to", out, "--format", "hf", "--dtype", "bf16",
                   "--keys", "model/", "--strip-prefix")
    assert rc == 0
    assert sorted(os.listdir(out)) == ["model.safetensors"]  # one shard: no index, as transformers writes it
    got = load_file(out / "model.safetensors")
    assert sorted(got) == ["emb.weight", "head.weight", "norm.weight", "pos"]
    assert same(got["emb.weight"], full["model/emb.weight"].to(torch.bfloat16))
    assert same(got["norm.weight"], full["model/norm.weight"].to(torch.bfloat16))
    assert same(got["head.weight"], full["model/head.weight"])
    assert same(got["pos"], full["model/pos"])  # integers are not cast
    # it loads into a module as it is
    m = nn.Module()
    m.emb = nn.Embedding(ROWS, COLS, dtype=torch.bfloat16)
    m.load_state_dict({"emb.weight": got["emb.weight"]})
    assert same(m.emb.weight.detach(), got["emb.weight"])

    # a non-empty directory is refused without --force; with it, the old export's shards are replaced
    (out / "config.json").write_text("{}")
    assert run("export", two_ranks, "--to", out, "--format", "hf", "--max-shard-size", "40KB")[0] == 2
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]
    assert run("export", two_ranks, "--to", out, "--format", "hf", "--max-shard-size", "40KB", "--force")[0] == 0
    names = os.listdir(out)
    assert "config.json" in names and "model.safetensors" not in names and "model.safetensors.index.json" in names


@pytest.mark.multiprocess
def test_dcp_export_loads_with_dcp_own_reader_bit_exact(two_ranks, run, tmp_path):
    full = full_tensors()
    out = tmp_path / "dcp"
    rc, _, _ = run("export", two_ranks, "--to", out, "--format", "dcp")
    assert rc == 0 and (out / ".metadata").exists()
    meta = dcp.FileSystemReader(str(out)).read_metadata().state_dict_metadata
    assert {"model.emb.weight", "model.head.weight", "optim.exp_avg", "step", "note", "optim.lr"} <= set(meta)
    fresh = {"model": {k.split("/", 1)[1]: torch.empty_like(v) for k, v in full.items() if k.startswith("model/")},
             "optim": {"exp_avg": torch.empty(ROWS), "lr": 0.0}, "step": 0, "note": ""}
    dcp.load(fresh, storage_reader=dcp.FileSystemReader(str(out)), no_dist=True)
    assert all(same(fresh["model"][k.split("/", 1)[1]], v) for k, v in full.items() if k.startswith("model/"))
    assert same(fresh["optim"]["exp_avg"], full["optim/exp_avg"])
    assert fresh["step"] == 5 and fresh["note"] == "two ranks" and fresh["optim"]["lr"] == 0.001

    # stripped names load into a module's own state_dict
    out2 = tmp_path / "dcp2"
    assert run("export", two_ranks, "--to", out2, "--format", "dcp", "--keys", "model/", "--strip-prefix")[0] == 0
    sd = {k.split("/", 1)[1]: torch.zeros_like(v) for k, v in full.items() if k.startswith("model/")}
    dcp.load(sd, storage_reader=dcp.FileSystemReader(str(out2)), no_dist=True)
    assert same(sd["emb.weight"], full["model/emb.weight"])


def test_single_file_export_keeps_plain_values_plain_and_tags_only_the_rest(ckdir, tmp_path):
    with ckpt.Checkpointer(ckdir) as c:
        c.save(1, {"w": torch.ones(3), "cfg": {"lr": 0.1, "layers": [1, 2]}, "betas": (0.9, 0.95),
                   "blob": b"\x00\x01", "worst": float("inf"), "step": 1})
    out = tmp_path / "w.safetensors"
    ckpt.open(ckdir).export(1, out)
    with safe_open(out, "pt") as f:
        meta = f.metadata()
    assert json.loads(meta["ckpt.values"]) == {"cfg/lr": 0.1, "cfg/layers": [1, 2], "step": 1}
    tagged = json.loads(meta["ckpt.values.tagged"])
    assert sorted(tagged) == ["betas", "blob", "worst"] and tagged["betas"]["t"] == "tuple"


def test_export_arguments_are_checked_before_anything_is_written(ckdir, tmp_path):
    with ckpt.Checkpointer(ckdir) as c:
        c.save(1, {"w": torch.ones(3), "z": torch.zeros(2, dtype=torch.complex128)})
    r = ckpt.open(ckdir)
    cases = [dict(format="hf", max_shard_size="5 parsecs", keys="w"), dict(format="hf", dtype="int3", keys="w"),
             dict(format="xyz"), dict(format="hf", keys="z"),  # complex128: safetensors cannot hold it
             dict(format="safetensors", max_shard_size="1GB", keys="w")]
    for i, kw in enumerate(cases):
        with pytest.raises(ckpt.CheckpointError) as e:
            r.export(1, tmp_path / f"out{i}", **kw)
        assert str(e.value) and not (tmp_path / f"out{i}").exists()
    (tmp_path / "afile").write_text("x")
    with pytest.raises(ckpt.ConfigError, match="is a file"):
        r.export(1, tmp_path / "afile", format="dcp")


def test_hf_export_holds_the_model_and_its_config_json(ckdir, run, tmp_path, caplog):
    """Issue 33.6: an hf export held the optimizer's state too and no config.json, so that
    from_pretrained(dir) built a default model; now the model's keys and its config, or a warning."""
    net = make_net(3)
    opt = torch.optim.AdamW(net.parameters())
    net(torch.randn(2, 8)).sum().backward()
    opt.step()
    cfg = {"model_type": "tiny", "hidden_size": 16, "layers": [8, 16, 4], "tie_word_embeddings": False}
    with ckpt.Checkpointer(ckdir) as c:
        c.save(1, {"model": net, "optim": opt, "config": cfg, "meta": {"hf": {"model_type": "other"}}})
    rc, _, err = run("export", ckdir, "--to", tmp_path / "hf", "--format", "hf")
    assert rc == 0 and "model's tensors (model/, prefix stripped)" in err and "config.json written" in err
    assert sorted(os.listdir(tmp_path / "hf")) == ["config.json", "model.safetensors"]
    assert json.loads((tmp_path / "hf" / "config.json").read_text()) == cfg
    got = load_file(tmp_path / "hf" / "model.safetensors")
    assert sorted(got) == sorted(net.state_dict())  # no optimizer state, names as the model has them
    fresh = make_net(4)
    fresh.load_state_dict(got)
    assert all(same(fresh.state_dict()[k], v) for k, v in net.state_dict().items())

    # --config: a file, or the key of a config saved in the step; either replaces one kept with --force
    (tmp_path / "given.json").write_text(json.dumps({"model_type": "given"}))
    assert run("export", ckdir, "--to", tmp_path / "hf", "--format", "hf", "--force",
               "--config", tmp_path / "given.json")[0] == 0
    assert json.loads((tmp_path / "hf" / "config.json").read_text()) == {"model_type": "given"}
    assert run("export", ckdir, "--to", tmp_path / "hf2", "--format", "hf", "--config", "meta/hf")[0] == 0
    assert json.loads((tmp_path / "hf2" / "config.json").read_text()) == {"model_type": "other"}
    for bad in ("no/such/value", "model", tmp_path / "given.json.missing"):
        rc, _, err = run("export", ckdir, "--to", tmp_path / "bad", "--format", "hf", "--config", bad)
        assert rc == 2 and "--config" in err and not (tmp_path / "bad").exists(), err
    (tmp_path / "list.json").write_text("[1, 2]")
    rc, _, err = run("export", ckdir, "--to", tmp_path / "bad", "--format", "hf", "--config", tmp_path / "list.json")
    assert rc == 2 and "JSON object" in err and not (tmp_path / "bad").exists()
    rc, _, err = run("export", ckdir, "--to", tmp_path / "x.safetensors", "--config", tmp_path / "given.json")
    assert rc == 2 and "--config is for --format hf" in err

    # no config anywhere: exported, and a warning says what from_pretrained would do
    other = tmp_path / "ck2"
    with ckpt.Checkpointer(other) as c:
        c.save(1, {"model": net, "optim": opt})
    with caplog.at_level("WARNING", logger="ckpt"):
        assert run("export", other, "--to", tmp_path / "noconf", "--format", "hf")[0] == 0
    assert "no config.json written" in caplog.text and "from_pretrained" in caplog.text
    assert os.listdir(tmp_path / "noconf") == ["model.safetensors"]

    # several candidates, none named model: refused, not guessed
    with ckpt.Checkpointer(tmp_path / "ck3") as c:
        c.save(1, {"net": net, "optim": opt})
    rc, _, err = run("export", tmp_path / "ck3", "--to", tmp_path / "guess", "--format", "hf")
    assert rc == 2 and "--keys net/ --strip-prefix" in err and not (tmp_path / "guess").exists()
    assert run("export", tmp_path / "ck3", "--to", tmp_path / "guess", "--format", "hf", "--keys", "net/",
               "--strip-prefix", "--config", tmp_path / "given.json")[0] == 0


# -- import -------------------------------------------------------------------------------------------

def make_net(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def write_sources(tmp_path, sd: dict[str, torch.Tensor]) -> dict[str, str]:
    save_file(sd, tmp_path / "w.safetensors")
    torch.save(sd, tmp_path / "w.pt")
    hf = tmp_path / "hf"
    hf.mkdir()
    names = list(sd)
    shards = {"model-00001-of-00002.safetensors": names[:2], "model-00002-of-00002.safetensors": names[2:]}
    for f, keys in shards.items():
        save_file({k: sd[k] for k in keys}, hf / f, metadata={"format": "pt"})
    (hf / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": 0}, "weight_map": {k: f for f, keys in shards.items() for k in keys}}))
    dcp.save(dict(sd), storage_writer=dcp.FileSystemWriter(str(tmp_path / "dcp")), no_dist=True)
    return {"safetensors": str(tmp_path / "w.safetensors"), "torch": str(tmp_path / "w.pt"), "hf": str(hf),
            "dcp": str(tmp_path / "dcp")}


def test_import_from_each_source_loads_into_a_module_bit_exact(ckdir, tmp_path):
    sd = {k: v.detach().clone() for k, v in make_net(1).state_dict().items()}
    sources = write_sources(tmp_path, sd)
    for step, (fmt, src) in enumerate(sources.items()):
        res = ckpt.import_checkpoint(src, ckdir, step=step)
        assert res.format == fmt and res.tensors == len(sd) and res.key == "model"
        net = make_net(2)
        assert not all(torch.equal(net.state_dict()[k], v) for k, v in sd.items())
        with ckpt.Checkpointer(ckdir) as c:
            assert c.load(step, {"model": net}, strict=False) == step
        assert all(same(net.state_dict()[k], v) for k, v in sd.items()), fmt
    r = ckpt.open(ckdir)
    assert r.steps() == [0, 1, 2, 3] and r.verify(all=True).ok
    assert all(sorted(r.tensors(s)) == sorted(f"model/{k}" for k in sd) for s in r.steps())


def test_hf_export_imports_back_under_the_cli(run, ckdir, tmp_path):
    net = make_net(3)
    with ckpt.Checkpointer(ckdir) as c:
        c.save(10, {"model": net, "step": 10})
    out = tmp_path / "hf"
    assert run("export", ckdir, "--to", out, "--format", "hf", "--keys", "model/", "--strip-prefix",
               "--max-shard-size", "300B")[0] == 0
    assert len([f for f in os.listdir(out) if re.fullmatch(r"model-\d{5}-of-\d{5}\.safetensors", f)]) >= 2
    other = tmp_path / "ft"
    rc, stdout, _ = run("import", out, other, "--step", 0)
    assert rc == 0 and "imported" in stdout and "under 'model'" in stdout
    fresh = make_net(4)
    with ckpt.Checkpointer(other) as c:
        c.load(0, {"model": fresh}, strict=False)
    assert all(same(fresh.state_dict()[k], v) for k, v in net.state_dict().items())
    rc, _, err = run("import", out, other, "--step", 0)  # onto an existing step
    assert rc == 1 and "step 0 is already committed" in err


def test_damaged_or_unsafe_sources_are_refused_and_nothing_is_committed(ckdir, tmp_path):
    sd = {k: v.detach().clone() for k, v in make_net(1).state_dict().items()}
    sources = write_sources(tmp_path, sd)
    data = open(sources["safetensors"], "rb").read()
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(data[:-20])
    with pytest.raises(ckpt.CorruptCheckpointError, match="cut.safetensors cannot be read"):
        ckpt.import_checkpoint(cut, ckdir, step=1)
    shard = os.path.join(sources["hf"], "model-00002-of-00002.safetensors")
    with open(shard, "r+b") as f:
        f.truncate(os.path.getsize(shard) - 8)
    with pytest.raises(ckpt.CorruptCheckpointError, match="model-00002-of-00002"):
        ckpt.import_checkpoint(sources["hf"], ckdir, step=1)

    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned",))

    torch.save({"w": torch.ones(2), "x": Evil()}, tmp_path / "evil.pt")
    with pytest.raises(ckpt.UnsupportedValueError, match="weights_only=True"):
        ckpt.import_checkpoint(tmp_path / "evil.pt", ckdir, step=1)
    with pytest.raises(ckpt.ConfigError):
        ckpt.import_checkpoint(tmp_path / "nothing.pt", ckdir, step=1)
    assert not os.path.exists(os.path.join(ckdir, "steps")) or not os.listdir(os.path.join(ckdir, "steps"))

    ckpt.import_checkpoint(sources["torch"], ckdir, step=1)
    with pytest.raises(ckpt.StepExistsError, match="already committed"):
        ckpt.import_checkpoint(sources["safetensors"], ckdir, step=1)


def test_import_top_level_torch_save_and_key_prefix_selection(ckdir, tmp_path):
    net = make_net(5)
    opt = torch.optim.AdamW(net.parameters())
    net(torch.randn(2, 8)).sum().backward()
    opt.step()
    torch.save({"model": net.state_dict(), "optim": opt.state_dict(), "epoch": 3}, tmp_path / "train.pt")
    with pytest.raises(ckpt.ConfigError, match="--top-level"):  # a dict of dicts under one key: say how
        ckpt.import_checkpoint(tmp_path / "train.pt", ckdir, step=0)
    ckpt.import_checkpoint(tmp_path / "train.pt", ckdir, step=0, key=None)
    net2, opt2 = make_net(6), None
    opt2 = torch.optim.AdamW(net2.parameters())
    state = {"model": net2, "optim": opt2, "epoch": 0}
    with ckpt.Checkpointer(ckdir) as c:
        c.load(0, state)
    assert state["epoch"] == 3 and all(same(net2.state_dict()[k], v) for k, v in net.state_dict().items())
    assert same(opt2.state_dict()["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])

    # HF names with a prefix: select and strip it
    sd = {f"transformer.{k}": v for k, v in net.state_dict().items()} | {"lm_head.weight": torch.ones(2)}
    save_file(sd, tmp_path / "p.safetensors")
    ckpt.import_checkpoint(tmp_path / "p.safetensors", ckdir, step=1, keys="transformer.", strip_prefix=True)
    assert sorted(ckpt.open(ckdir).tensors(1)) == sorted(f"model/{k}" for k in net.state_dict())


# -- tied weights and strict=False (issue 33.5) ---------------------------------------------------------

class TiedLM(nn.Module):
    """What GPT-2, Llama-3.2 and small Qwen models are to a load: an output layer that is the input
    embedding (one Parameter), declared in ``_tied_weights_keys``; ``save_pretrained`` leaves it out."""

    _tied_weights_keys = ["lm_head.weight"]

    def __init__(self, seed: int, tie: bool = True, extra: bool = False):
        super().__init__()
        torch.manual_seed(seed)
        self.embed_tokens = nn.Embedding(16, 8)
        self.norm = nn.LayerNorm(8)
        self.lm_head = nn.Linear(8, 16, bias=False)
        if tie:
            self.lm_head.weight = self.embed_tokens.weight
        if extra:
            self.adapter = nn.Linear(8, 8)  # in the module, in no checkpoint


def save_pretrained_like(model: nn.Module, folder) -> dict[str, torch.Tensor]:
    """A Hugging Face model directory as save_pretrained writes it: the tied name left out."""
    sd = {k: v.detach().clone() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    folder.mkdir()
    save_file(sd, folder / "model.safetensors", metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps({"tie_word_embeddings": True}))
    return sd


def test_tied_embedding_models_load_from_a_hugging_face_import(ckdir, tmp_path, run):
    saved = save_pretrained_like(TiedLM(1), tmp_path / "hf")
    assert run("import", tmp_path / "hf", ckdir, "--step", 0)[0] == 0
    for strict in (True, False):
        model = TiedLM(2)
        with ckpt.Checkpointer(ckdir) as c:
            c.load(0, {"model": model}, strict=strict)  # raised: missing from the checkpoint ['lm_head.weight']
        assert model.lm_head.weight is model.embed_tokens.weight  # still tied
        assert same(model.lm_head.weight.detach(), saved["embed_tokens.weight"])
        assert all(same(model.state_dict()[k], v) for k, v in saved.items())

    # tied by the same tensor only (nothing declared), and declared only ({tied: source}, untied in memory)
    class Undeclared(TiedLM):
        _tied_weights_keys: list[str] = []

    class Declared(TiedLM):
        _tied_weights_keys = {"lm_head.weight": "embed_tokens.weight"}  # type: ignore[assignment]

    for model in (Undeclared(3), Declared(3, tie=False)):
        with ckpt.Checkpointer(ckdir) as c:
            c.load(0, {"model": model})
        assert same(model.lm_head.weight.detach(), saved["embed_tokens.weight"]), type(model).__name__


def test_strict_false_loads_what_the_step_has_and_leaves_the_rest(ckdir, tmp_path):
    saved = save_pretrained_like(TiedLM(1), tmp_path / "hf")
    ckpt.import_checkpoint(tmp_path / "hf", ckdir, step=0)
    model = TiedLM(4, extra=True)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ckpt.StateMismatchError, match=r"missing from the checkpoint.*adapter\.weight") as e:
        with ckpt.Checkpointer(ckdir) as c:
            c.load(0, {"model": model})  # strict: a key that is really missing is refused, before any change
    assert "lm_head" not in str(e.value)
    assert all(same(model.state_dict()[k], v) for k, v in before.items())
    with ckpt.Checkpointer(ckdir) as c:
        c.load(0, {"model": model}, strict=False)  # raised the same, though strict=False was passed
    assert all(same(model.state_dict()[k], v) for k, v in saved.items())
    assert same(model.lm_head.weight.detach(), saved["embed_tokens.weight"])
    assert same(model.adapter.weight.detach(), before["adapter.weight"])  # left as it was
    assert same(model.adapter.bias.detach(), before["adapter.bias"])
