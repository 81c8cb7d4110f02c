"""``ckpt inspect`` on a real model and optimizer: filtering by key, bytes per group, the parameter each
optimizer state entry is for, tables when piped; ``ckpt diff``'s names on an 80-column terminal."""

from __future__ import annotations

import json
import os

import torch
from test_cli import on_terminal  # stdout a terminal of a given width

import ckpt


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = torch.nn.MultiheadAttention(8, 2)
        self.mlp = torch.nn.Linear(8, 8)


def model_and_optimizer() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """Blocks with long parameter names, and an optimizer whose two groups (biases apart) do not
    list the parameters in the module's order."""
    torch.manual_seed(0)
    m = torch.nn.Module()
    m.blocks = torch.nn.ModuleList([Block() for _ in range(3)])
    m.head = torch.nn.Linear(8, 2)
    named = list(m.named_parameters())
    opt = torch.optim.AdamW([{"params": [p for n, p in named if not n.endswith("bias")]},
                             {"params": [p for n, p in named if n.endswith("bias")], "weight_decay": 0.0}])
    return m, opt


def train(m: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    loss = sum((p * p + p).sum() for p in m.parameters())  # every parameter moves, zero biases too
    opt.zero_grad()
    loss.backward()
    opt.step()


def saved(ckdir: str, steps=(1, 2)) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    m, opt = model_and_optimizer()
    with ckpt.Checkpointer(ckdir) as c:
        for s in steps:
            train(m, opt)
            c.save(s, {"model": m, "optim": opt, "rng": torch.get_rng_state(), "step": s}).wait()
    return m, opt


def test_inspect_filters_by_key_sums_groups_and_names_each_optimizer_states_parameter(ckdir, run):
    """Issue 33 item 9: inspect of a real model printed every row, showed ``optim/state/3/…`` with no
    parameter name and switched to TSV when piped. Now --keys filters (prefix or glob; optimizer
    state by its parameter too), a size summary per group comes first, each optimizer state entry
    names its parameter (recorded at save, by identity, across parameter groups), and piped output
    stays a table unless --tsv."""
    m, opt = saved(ckdir)
    order = [n for g in opt.param_groups for p in g["params"] for n, q in m.named_parameters() if q is p]
    rc, out, _ = run("inspect", ckdir, "--json")
    assert rc == 0
    detail = json.loads(out)["detail"]
    tensors = {t["key"]: t for t in detail["tensors"]}
    for i, name in enumerate(order):  # index i of the optimizer's state is the i-th parameter it was given
        for what in ("exp_avg", "exp_avg_sq", "step"):
            t = tensors[f"optim/state/{i}/{what}"]
            assert t["group"] == "optimizer" and t["param"] == f"model/{name}", (i, what, t["param"])
    assert all(tensors[f"model/{n}"]["group"] == "model" and tensors[f"model/{n}"]["param"] is None
               for n, _ in m.named_parameters())
    assert tensors["rng"]["group"] == "other"
    n_model, n_params = len(m.state_dict()), len(order)
    assert [(g["group"], g["tensors"]) for g in detail["groups"]] == [
        ("model", n_model), ("optimizer", 3 * n_params), ("other", 1)]
    assert sum(g["bytes"] for g in detail["groups"]) == sum(t["bytes"] for t in tensors.values())

    # --keys: a parameter's own tensor and its optimizer state; a glob; several patterns
    rc, out, _ = run("inspect", ckdir, "--json", "--keys", "model/blocks.1.mlp.weight")
    got = json.loads(out)["detail"]
    i = order.index("blocks.1.mlp.weight")
    assert sorted(t["key"] for t in got["tensors"]) == sorted(
        ["model/blocks.1.mlp.weight"] + [f"optim/state/{i}/{w}" for w in ("exp_avg", "exp_avg_sq", "step")])
    assert got["keys"] == ["model/blocks.1.mlp.weight"] and got["values"] == {}
    rc, out, _ = run("inspect", ckdir, "--json", "--keys", "model/*bias", "--keys", "step")
    got = json.loads(out)["detail"]
    assert {t["key"] for t in got["tensors"] if t["group"] == "model"} == {
        f"model/{n}" for n, _ in m.named_parameters() if n.endswith("bias")}
    assert len(got["tensors"]) == 4 * sum(n.endswith("bias") for n in order) and got["values"] == {"step": "2"}

    # piped: the summary first, then aligned tables at full width, nothing cut; --tsv for scripts
    rc, out, _ = run("inspect", ckdir, "--keys", "model/blocks.2.attn.out_proj")
    lines = out.splitlines()
    assert rc == 0 and "\t" not in out and "…" not in out
    assert lines.index("step 2: size by group") < next(i for i, ln in enumerate(lines) if "step 2: tensors" in ln)
    assert lines[lines.index("step 2: size by group") + 1].split() == ["group", "tensors", "size", "share"]
    row = next(ln for ln in lines if ln.startswith("optim/state/")).split()
    assert row[1] == "model/blocks.2.attn.out_proj.weight" or row[1] == "model/blocks.2.attn.out_proj.bias"
    assert "--keys model/blocks.2.attn.out_proj: 8 of " in out
    rc, out, _ = run("inspect", ckdir, "--keys", "model/blocks.2.attn.out_proj", "--tsv")
    rows = [ln.split("\t") for ln in out.splitlines() if "\t" in ln]
    assert ["group", "tensors", "size", "share"] in rows and any(r[0] == "model/blocks.2.attn.out_proj.bias"
                                                                  for r in rows)

    rc, _, err = run("inspect", ckdir, "--keys", "nothing/")  # a filter that matches nothing says so
    assert rc == 2 and "no tensor or value of step 2 matches" in err


def test_steps_saved_without_parameter_names_inspect_and_load_as_before(ckdir, run):
    """A manifest without the optimizer's ``params`` (written before this change) inspects with no
    parameter names and loads; one with them loads into a fresh model and optimizer."""
    m, opt = saved(ckdir, steps=(1,))
    path = os.path.join(ckdir, ckpt.format.paths.manifest_key(1))
    with open(path) as f:
        doc = json.load(f)
    optim = doc["structure"]["v"][doc["structure"]["k"].index("optim")]
    assert optim["t"] == "stateful" and len(optim["params"]) == len(list(m.parameters()))
    fresh, fresh_opt = model_and_optimizer()
    ckpt.Checkpointer(ckdir).load(1, {"model": fresh, "optim": fresh_opt, "rng": None, "step": None})
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), m.state_dict().values()))
    assert fresh_opt.state_dict()["state"][0]["exp_avg"].equal(opt.state_dict()["state"][0]["exp_avg"])
    del optim["params"]
    with open(path, "w") as f:
        json.dump(doc, f)
    rc, out, _ = run("inspect", ckdir, "--json")
    tensors = json.loads(out)["detail"]["tensors"]
    assert rc == 0 and all(t["param"] is None for t in tensors)
    assert {t["group"] for t in tensors if t["key"].startswith("optim/")} == {"optimizer"}
    rc, out, _ = run("inspect", ckdir)
    assert rc == 0 and "parameter" not in out.split("step 1: tensors")[1].splitlines()[1]


def test_diff_at_80_columns_keeps_the_names_whole(ckdir, monkeypatch):
    """Issue 33 item 9: ``diff`` at 80 columns cut names to ``model/blocks.0…tn.in_proj_bias`` to make
    room for its detail column; the names keep their width and the less useful columns go."""
    from rich.cells import cell_len

    m, _ = saved(ckdir)
    rc, lines = on_terminal(monkeypatch, 80, "diff", ckdir, 1, 2, "--max-diff")
    assert rc == 0 and max(map(cell_len, lines)) <= 80
    names = {ln.split()[0] for ln in lines if ln.startswith("model/")}
    assert names == {f"model/{n}" for n in m.state_dict()}, lines
    assert any(ln.startswith("(hidden: decided by;") for ln in lines), lines
