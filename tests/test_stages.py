"""Pipeline stages (issue 34 item 2): ranks holding different keys save one state, the union of
theirs, that loads onto another split of the stages and onto one process, bit-exact; ``strict``
refuses a key no loading rank holds and a key a rank holds that the step lacks."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_state_dict,
)

import ckpt
import ckpt.dcp
from ckpt.flatten import flatten
from ckpt.save.planning import Inventory, assign
from ckpt.testing import run_ranks

V, D, LAYERS = 6, 4, 4
SPLITS = {4: [[0], [1], [2], [3]], 2: [[0, 1], [2, 3]]}  # the layers (one stage each) every rank runs
FLAT = StateDictOptions(flatten_optimizer_state_dict=True)  # optimizer state by parameter name, as torchtitan keeps it


class Part(nn.Module):
    """The layers of the stages one rank runs, named as in the whole model. The first and the last
    stage hold the embedding (tied: the last stage's output projection is the embedding's weight)."""

    def __init__(self, layers):
        super().__init__()
        if 0 in layers or LAYERS - 1 in layers:
            self.embed = nn.Embedding(V, D)
        self.layers = nn.ModuleDict({str(i): nn.Linear(D, D) for i in layers})


class Optim:
    """An optimizer's state by parameter name (what pipeline trainings save: ``get_optimizer_state_dict``)."""

    def __init__(self, model, opt):
        self.model, self.opt = model, opt

    def state_dict(self):
        return get_optimizer_state_dict(self.model, self.opt, options=FLAT)

    def load_state_dict(self, sd):
        set_state_dict(self.model, self.opt, model_state_dict={}, optim_state_dict=sd, options=FLAT)


def make(layers, trained: bool):
    """A rank's part and its AdamW: trained, every value a function of the parameter's name and the same
    on every split (so the embedding is the same on the first and last stage); else zeros, no state."""
    part = Part(layers)
    opt = torch.optim.AdamW(part.parameters(), lr=0.01, foreach=False)
    with torch.no_grad():
        for name, p in part.named_parameters():
            p.copy_(torch.arange(p.numel(), dtype=p.dtype).reshape(p.shape) * 0.37 + len(name) if trained else 0)
            p.grad = p * 0.5 + 0.25
    if trained:
        opt.step()
    opt.zero_grad()
    return part, opt


def dcp_state(part, opt) -> dict:
    """The state as DCP users hold it (``get_state_dict``), put back with ``set_state_dict``."""
    return {"model": get_model_state_dict(part), "optim": get_optimizer_state_dict(part, opt, options=FLAT)}


def values(part, opt) -> dict:
    """Every tensor of a part and its optimizer, by name."""
    return {**{f"model/{k}": v for k, v in part.state_dict().items()},
            **{f"optim/{k}": v for k, v in get_optimizer_state_dict(part, opt, options=FLAT).items()
               if isinstance(v, torch.Tensor)}}


def wrong(part, opt, layers) -> list[str]:
    """The names whose values differ from the trained ones (empty: bit-exact)."""
    want, have = values(*make(layers, True)), values(part, opt)
    return sorted(k for k in want.keys() | have.keys()
                  if k not in want or k not in have or not torch.equal(want[k], have[k]))


def stages_body(rank: int, world: int, root: str) -> dict | None:
    """Save on 4 ranks (one stage each) through both front ends, then load on ranks 0 and 1 (two stages each)."""
    part, opt = make(SPLITS[world][rank], True)
    with ckpt.Checkpointer(root, process_group=dist.group.WORLD) as c:
        c.save(1, {"model": part, "optim": Optim(part, opt), "step": 1}).wait()
    sd = dcp_state(part, opt)
    dcp.save(sd, storage_writer=ckpt.dcp.Writer(root, step=2))
    two = dist.new_group([0, 1])  # a job of 2 ranks, without starting another (every rank makes the group)
    return load_on_two(rank, root, two) if rank < 2 else None


def load_on_two(rank: int, root: str, group) -> dict:
    layers = SPLITS[2][rank]
    out: dict = {}
    with ckpt.Checkpointer(root, process_group=group) as c:
        part, opt = make(layers, False)
        c.load(1, {"model": part, "optim": Optim(part, opt), "step": 0})
        out["checkpointer"] = wrong(part, opt, layers)
        part, opt = make(layers, False)  # the step DCP wrote, loaded as DCP users hold their state
        sd = dcp_state(part, opt)
        c.load(2, sd)
        set_state_dict(part, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"], options=FLAT)
        out["dcp_written"] = wrong(part, opt, layers)
        # layer 3 held by no rank: refused on every rank, nothing changed; strict=False loads the rest
        fewer = [2] if rank == 1 else layers
        part, opt = make(fewer, False)
        state = {"model": part, "optim": Optim(part, opt), "step": 0}
        with pytest.raises(ckpt.StateMismatchError, match="none of the 2 loading ranks holds") as e:
            c.load(1, state)
        out["nobody"] = str(e.value)
        out["unchanged"] = all(not p.any() for p in part.parameters()) and state["step"] == 0
        c.load(1, state, strict=False)
        out["non_strict"] = wrong(part, opt, fewer)
        # layer 4 held by rank 1, in no saved rank: refused on every rank
        more = [2, 3, 4] if rank == 1 else layers
        part, opt = make(more, False)
        with pytest.raises(ckpt.StateMismatchError) as e:
            c.load(1, {"model": part, "optim": Optim(part, opt), "step": 0})
        out["extra"] = str(e.value)
    for step in (1, 2):  # dcp.load through ckpt.dcp.Reader, of the step either front end wrote
        part, opt = make(layers, False)
        sd = dcp_state(part, opt)
        dcp.load(sd, storage_reader=ckpt.dcp.Reader(root, step=step), process_group=group)
        set_state_dict(part, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"], options=FLAT)
        out[f"dcp_load_{step}"] = wrong(part, opt, layers)
    return out


@pytest.mark.multiprocess
@pytest.mark.slow  # spawns processes and takes more than a few seconds
def test_pipeline_stages_save_one_state_that_loads_on_another_split_and_one_process(tmp_path):
    root = str(tmp_path / "ck")
    results = run_ranks(4, stages_body, root)
    whole = list(range(LAYERS))
    want = values(*make(whole, True))
    for step in (1, 2):  # one state: every stage's keys, the embedding of two stages written once
        m = ckpt.open(root).manifest(step)
        assert m.per_rank_keys == [] and m.world_size == 4
        assert [len(t.shards) for t in m.tensors if t.key == "model/embed.weight"] == [1]
        got = ckpt.open(root).tensors(step)
        assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)

    for rank, out in enumerate(results[:2]):
        for what in ("checkpointer", "dcp_written", "non_strict", "dcp_load_1", "dcp_load_2"):
            assert out[what] == [], (rank, what, out[what])
        assert out["unchanged"], rank
        assert "model/layers.3.weight" in out["nobody"] and "layers.2" not in out["nobody"]
        assert "model/layers.4.weight" in out["extra"] and "missing from the checkpoint" in out["extra"]

    with ckpt.Checkpointer(root) as c:  # one process: every key
        part, opt = make(whole, False)
        c.load(1, {"model": part, "optim": Optim(part, opt), "step": 0})
        assert wrong(part, opt, whole) == []
        part, opt = make(whole, False)
        sd = dcp_state(part, opt)
        c.load(2, sd)
        set_state_dict(part, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"], options=FLAT)
        assert wrong(part, opt, whole) == []
        for step in (1, 2):  # a process without layer 3 leaves keys unloaded: refused, nothing changed
            part, opt = make([0, 1, 2], False)
            state = {"model": part, "optim": Optim(part, opt), "step": 0} if step == 1 else dcp_state(part, opt)
            with pytest.raises(ckpt.StateMismatchError, match=r"this process does not hold: \['model/layers.3"):
                c.load(step, state)
            assert all(not p.any() for p in part.parameters())


def test_the_plan_unites_different_keys_and_keeps_differing_values_per_rank():
    """Without processes: each of 4 stages' inventory, planned as the coordinator plans them."""
    parts = [make(layers, True) for layers in SPLITS[4]]
    invs = [Inventory.of(flatten({"model": p, "optim": Optim(p, o), "pos": {"n": r}, "rng": ckpt.RNGState()}))
            for r, (p, o) in enumerate(parts)]
    plans = assign(invs)
    assert plans[0].error is None and plans[0].per_rank == ["pos", "rng"]  # a value differs; declared per-rank
    written = [invs[r].tensors[i].key for r, p in enumerate(plans) for i in p.write]
    shared = [k for k in written if k.startswith(("model/", "optim/"))]
    assert sorted(shared) == sorted(set(shared)) and "model/embed.weight" in shared  # each once, the tied one too
    assert len(shared) == len({k for inv in invs for k in (r.key for r in inv.tensors)
                               if k.startswith(("model/", "optim/"))})
    # where two stages hold the same key, they must hold the same thing there
    other = make([3], True)[0]
    other.embed = nn.Embedding(V + 1, D)
    bad = Inventory.of(flatten({"model": other, "optim": Optim(*parts[3]), "pos": {"n": 3},
                                "rng": ckpt.RNGState()}))
    plans = assign(invs[:3] + [bad])
    assert plans[0].mismatch and "'model/embed.weight' differs between ranks" in plans[0].error
    # a key held by some ranks only must tile its shape among them (two halves of one tensor held by one rank)
    half = [Inventory.of(flatten({"model": {"a": ckpt.LocalShard(torch.zeros(2), (0,), (4,))}})),
            Inventory.of(flatten({"model": {"b": torch.zeros(1)}}))]
    plans = assign(half)
    assert plans[0].mismatch and "among the ranks holding it, [0]" in plans[0].error
