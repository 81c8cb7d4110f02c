"""benchmarks/scale.py at a small N (a two-layer Llama shape, 8 and 32 simulated ranks, both layouts):
it runs ckpt's own save and load code, counts the store's and the storage's requests, writes its
table, and the growth laws that hold today hold (:func:`scale.assert_current_laws`).

Issue 35's target laws (:func:`scale.assert_target_laws`: O(N) store requests per round, a rank's
load not reading a manifest that grows with N, ...) are checked as they come to hold: ``HOLDING``
names them."""

from __future__ import annotations

import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import scale  # noqa: E402
import scale_sim  # noqa: E402

from ckpt.flatten import flatten  # noqa: E402
from ckpt.save.planning import Inventory  # noqa: E402

pytestmark = pytest.mark.slow  # about 10 s: 160 simulated saves' worth of planning on threads

# Issue 35's targets (scale.TARGET_LAWS) that hold: switch the others on as the branches fixing them land.
HOLDING = {"rounds", "load_bytes", "commit_bytes", "commit_direct", "commit_first", "plan_bytes", "plan_cpu",
           "replicated"}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("scale")
    res = scale.main(["--models", "tiny", "--ns", "8,32", "--rounds-ns", "8,16,32", "--commit-ns", "256",
                      "--chunk-mib", "0.0625",
                      "--in-process", "--no-plot", "--out", str(out)])
    return res, out


def test_the_scale_benchmark_measures_every_row_and_the_laws_that_hold_today(results):
    res, out = results
    scale.assert_current_laws(res)
    scale.assert_target_laws(res, HOLDING)
    md = (out / "scale.md").read_text()
    for label, *_ in scale.ROWS + scale.ROUND_ROWS:
        assert f"| {label} |" in md, label
    assert "| | N = 64 | N = 512 | N = 4,096 | N = 16,384 |" in md and "~" in md  # 64+ extrapolated from 8, 32
    doc = json.loads((out / "scale.json").read_text())
    assert doc["command"].startswith("python benchmarks/scale.py") and set(doc["cases"]["tiny"]) == {"fsdp",
                                                                                                   "fsdp-tp8"}
    # every request of every round went through the counting store, per rank
    for n in (8, 16, 32):
        load = res["rounds"][str(n)]["load"]
        # 3 agree rounds, each a post per rank and O(N) reads in all (the coordinator's N, one answer each)
        assert load["requests_set"] == 3 * n and 3 * (n - 1) <= load["requests_get"] <= 3 * 2 * n, load
    assert "Rank 0's commit of a later save, run directly" in md
    direct = res["commits"]["tiny"]  # rank 0's commit of a later save at 256 ranks, run directly
    assert set(direct) == {"fsdp", "fsdp-tp8"} and direct["fsdp"]["256"]["chunks"] >= 256
    case = res["cases"]["tiny"]["fsdp"]["32"]
    assert case["plan_store"]["requests_set"] >= 2 * (32 - 1) and case["dcp"]["load_read_items"] > 0


def test_the_simulated_ranks_hold_what_flatten_gives_each_rank():
    """Every rank's flattened state is rank 0's with its own boxes (so one flatten serves N ranks):
    the same leaves and inventory as flatten() of that rank's own state."""
    model = scale_sim.MODELS["tiny"]
    for layout in scale_sim.LAYOUTS:
        ranks = scale_sim.Ranks(model, layout, 16)
        for r in (1, 9, 15):
            real = flatten(scale_sim.state_of(model, layout, r, 16))
            sim = ranks.flat(r)
            assert sim.leaves == real.leaves and sim.structure == real.structure
            assert Inventory.of(sim) == Inventory.of(real)



def test_the_first_commit_takes_the_layout_from_the_plan_where_ranks_share_an_empty_box(tmp_path):
    """More ranks than some tensors have rows (FSDP2 gives every rank past the last row the same empty
    box, which one of them writes): rank 0's first commit still takes the step's layout from the plan,
    with each such tensor's layout built once per distinct set of shared boxes (``from_plan``), reads
    no rank report, and a rank loads the step (``save_and_load`` asserts the plan was used)."""
    model = scale_sim.MODELS["tiny"]
    world = 384  # tiny's 256-row tensors: ranks 256..383 hold the shared empty box
    assert any(scale_sim.box(shape, split, world - 1, world, 1)[1][0] == 0 for _, shape, split in model.params())
    out = scale_sim.save_and_load(model, "fsdp", world, str(tmp_path / "ck"))
    assert out["commit_first_report_reads"] == 0 and out["commit_report_reads"] == 0
