"""The run journal (ckpt.journal) and what is learnt from it (ckpt.goodput): goodput and badput,
failures and their lost work, the interval of every="auto", ``ckpt goodput``. Analysis on journals
with chosen times (written through ckpt.journal, never by sleeping) and on journals real
Checkpointer runs wrote."""

from __future__ import annotations

import json
import logging
import math
import os
import socket
import sys

import pytest
import torch

import ckpt
from ckpt import cli, journal
from ckpt.format import paths
from ckpt.goodput import analyse, auto_mtbf, blend_mtbf
from ckpt.goodput_chart import FAILED, LOST, SAVE, terminal_chart
from ckpt.journal import SaveRecord, StartRecord
from ckpt.storage.local import LocalStorage
from ckpt.testing import FaultyStorage, run_ranks


def rec(name: str, t: float, ready: float, *, resumed: int | None = None, load_s: float = 0.0,
        saves: tuple = (), seen: float | None = None, step: int | None = None, closed: bool = False) -> StartRecord:
    r = StartRecord(f"{int(t * 1000):015d}-{name:0>8}", t, 1, "vm", resumed, load_s, ready, seen=seen, step=step,
                    closed=closed)
    r.saves = [SaveRecord(s, st, stall) for s, st, stall in saves]
    return r


def four_starts() -> list[StartRecord]:
    """Two failures (A, B), a clean stop (C), and the newest start (D)."""
    return [rec("a", 1000, 1010, saves=[(10, 1100, 1.0), (20, 1200, 1.0)], seen=1250, step=25),
            rec("b", 1300, 1320, resumed=20, load_s=5, saves=[(30, 1400, 2.0)], seen=1500, step=38),
            rec("c", 1600, 1610, resumed=30, load_s=4, saves=[(40, 1700, 1.0)], seen=1800, step=45, closed=True),
            rec("d", 1900, 1905, resumed=40, load_s=3, seen=2000, step=50)]


def test_goodput_and_badput_of_chosen_starts_add_up_to_the_wall_time():
    g = analyse(four_starts())
    assert [s.ended for s in g.starts] == ["failed", "failed", "closed", "last"]
    assert g.wall_s == 1000
    # kept: A to the save of step 20 (B resumed from it), B to step 30's, C and D to their ends
    assert [s.kept_until for s in g.starts] == [1200, 1400, 1800, 2000]
    assert g.good_s == (1200 - 1010 - 2) + (1400 - 1320 - 2) + (1800 - 1610 - 1) + (2000 - 1905) == 550
    assert g.stall_s == 5 and g.lost_s == 50 + 100 and g.load_s == 12
    assert g.restart_s == 10 + (50 + 20) + (100 + 10) + (100 + 5)  # each start-up, and the time down before it
    assert g.good_s + g.stall_s + g.lost_s + g.restart_s == g.wall_s
    doc = g.to_json()
    assert doc["goodput_pct"] == 55.0 and doc["badput"]["lost_work_pct"] == 15.0
    assert doc["goodput_pct"] + sum(doc["badput"][k] for k in ("checkpoint_stall_pct", "lost_work_pct",
                                                              "restart_load_pct")) == pytest.approx(100)
    a, b = g.failures
    def row(f):
        return f.start, f.resumed_from, f.lost_s, f.lost_steps, f.down_s, f.restart_s, f.load_s

    assert row(a) == (1, 20, 50, 5, 50, 20, 5) and row(b) == (2, 30, 100, 8, 100, 10, 4)
    assert g.exposure_s == 250 + 200 + 200 + 100 and g.mtbf_s == 375  # the clean stop is no failure


def test_a_fresh_restart_loses_the_whole_start_and_late_last_seen_times_are_cut_at_the_next_start():
    g = analyse([rec("a", 0, 10, saves=[(5, 50, 0.5)], seen=130, step=9),  # seen after b began: clock skew
                 rec("b", 100, 101, seen=200, step=3)])  # resumed from nothing (the step never committed)
    a = g.failures[0]
    assert a.resumed_from is None and a.lost_s == 100 - 10 and a.lost_steps == 9 and a.down_s == 0
    assert g.starts[0].end == 100 and g.stall_s == 0  # its save was lost with it
    assert g.good_s + g.stall_s + g.lost_s + g.restart_s == g.wall_s == 200
    assert analyse([]).to_json()["starts"] == 0 and analyse([]).mtbf_s is None


def test_the_blended_mtbf_is_the_gamma_poisson_posterior_mean():
    assert blend_mtbf(14400, 0, 0) == 14400  # nothing observed: the prior
    assert blend_mtbf(14400, 2, 750) == (2 * 14400 + 750) / (2 + 2)
    assert blend_mtbf(100, 1000, 1e6) == pytest.approx(1e6 / 1000, rel=0.01)  # much evidence: what was observed
    assert auto_mtbf(14400, four_starts()[:2]) is None  # one failure is not enough
    m, why = auto_mtbf(14400, four_starts())
    assert m == (2 * 14400 + 750) / 4 and "2 failures in 750s up" in why


def test_the_terminal_chart_marks_saves_failures_and_lost_work():
    g = analyse(four_starts())
    lines = terminal_chart(g, 60)
    assert len(lines) == 4 + 2 and all(len(line) <= 60 for line in lines[:5])
    assert [line.count(FAILED) for line in lines[:4]] == [1, 1, 0, 0]
    assert [line.count(SAVE) for line in lines[:4]] == [2, 1, 1, 0]
    assert LOST in lines[0] and LOST in lines[1] and LOST not in lines[2] + lines[3]
    assert lines[0].index(LOST) < lines[0].index(FAILED) and lines[3].rstrip().endswith("█")
    assert lines[4].strip().startswith("0") and lines[4].rstrip().endswith("16.7min")  # 1000 s


# -- journals written by real Checkpointer runs ---------------------------------------------------------

def train(root, steps: range, *, crash_at: int | None = None, **options) -> list[ckpt.SaveHandle]:
    """A run that resumes, saves each step, and (``crash_at``) dies on an exception at that step."""
    handles = []
    with pytest.raises(RuntimeError) if crash_at is not None else _nothing():
        with ckpt.Checkpointer(root, **options) as c:
            state = {"w": torch.zeros(4), "step": 0}
            c.load("latest", state)
            for step in steps:
                state["w"] += 1
                state["step"] = step
                if crash_at == step:
                    c.should_save(step)  # reported, then it dies before saving
                    raise RuntimeError("the job dies")
                handles.append(c.save(step, state))
    return handles


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_real_runs_leave_a_start_per_run_a_record_per_save_and_a_failure_for_a_crash(tmp_path, capsys):
    first = train(tmp_path, range(1, 4), crash_at=3)  # saves 1 and 2, reports 3, dies on an exception
    second = train(tmp_path, range(3, 6))  # resumes from 2, closes cleanly
    g = ckpt.open(tmp_path).goodput()
    assert [(s.resumed_from, s.ended, s.world_size) for s in g.starts] == [(None, "failed", 1), (2, "closed", 1)]
    assert [step for step, _ in g.starts[0].saves] == [1, 2] and [s for s, _ in g.starts[1].saves] == [3, 4, 5]
    recs = journal.read(LocalStorage(tmp_path))
    assert [s.stall_s for s in recs[0].saves + recs[1].saves] == [h.metrics.stall_s for h in first + second]
    assert recs[0].step == 3 and not recs[0].closed and recs[1].closed and recs[1].step == 5
    (f,) = g.failures
    assert f.resumed_from == 2 and f.lost_steps == 1  # step 3 is done again
    assert 0 <= f.lost_s == recs[0].end - recs[0].saves[-1].time
    assert g.good_s + g.stall_s + g.lost_s + g.restart_s == pytest.approx(g.wall_s)
    assert cli.main(["goodput", str(tmp_path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == g.to_json()
    # the root's other readers do not trip on journal/
    assert cli.main(["verify", str(tmp_path), "--all"]) == 0 and cli.main(["ls", str(tmp_path)]) == 0
    assert cli.main(["inspect", str(tmp_path)]) == 0 and ckpt.open(tmp_path).steps() == [1, 2, 3, 4, 5]
    with pytest.raises(ckpt.NotARootError, match=str(tmp_path)):
        ckpt.Checkpointer(tmp_path / paths.JOURNAL)


def test_goodput_command_prints_the_table_and_draws_the_timeline_on_the_terminal_without_matplotlib(
        tmp_path, capsys, monkeypatch):
    st = LocalStorage(tmp_path)
    for r in four_starts():
        journal.write_start(st, r)
        for s in r.saves:
            journal.write_save(st, r.id, s)
        journal.write_seen(st, r.id, r.seen, step=r.step, closed=r.closed)
    assert cli.main(["goodput", str(tmp_path)]) == 0  # a root with a journal and no step yet is readable
    out = capsys.readouterr().out
    assert "4 start(s), 2 failure(s), MTBF observed 6.2min (12.5min up)" in out
    assert "goodput 55.0% of 16.7min" in out
    assert "badput 45.0%: checkpoint stalls 0.5%, lost work 15.0%, restart and load 29.5% (load 1.2%)" in out
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
    png = tmp_path / "t.png"
    assert cli.main(["goodput", str(tmp_path), "--plot", str(png)]) == 0
    out, err = capsys.readouterr()
    assert not png.exists() and "matplotlib is not installed" in err
    assert "\n".join(terminal_chart(ckpt.open(tmp_path).goodput(), 100)) in out


def test_goodput_plot_writes_a_png_with_matplotlib(tmp_path):
    pytest.importorskip("matplotlib")
    st = LocalStorage(tmp_path)
    for r in four_starts():
        journal.write_start(st, r)
    assert cli.main(["goodput", str(tmp_path), "--plot", str(tmp_path / "t.png")]) == 0
    assert (tmp_path / "t.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# -- every="auto" ---------------------------------------------------------------------------------------

def auto_interval_after_one_save(root) -> ckpt.Checkpointer:
    c = ckpt.Checkpointer(root, every="auto", mtbf=14400, max_overhead=1.0)
    c.load("latest", {"w": torch.zeros(4)})
    c.save(1, {"w": torch.zeros(4)}).wait()
    c._journal.flush()  # the journal's thread has read the earlier starts
    c.should_save(2)  # rank 0 chooses the interval
    return c


def test_every_auto_plans_for_the_failure_rate_the_journal_observed(tmp_path, caplog):
    c = auto_interval_after_one_save(tmp_path / "calm")
    assert c.interval.mtbf_s == 14400 and c.interval.mtbf_why is None
    c.close()
    root = tmp_path / "flaky"
    st = LocalStorage(root)
    for r in four_starts():  # written by earlier starts: two failures in 750 s up
        journal.write_start(st, r)
        for s in r.saves:
            journal.write_save(st, r.id, s)
        journal.write_seen(st, r.id, r.seen, step=r.step, closed=r.closed)
    with caplog.at_level(logging.INFO, logger="ckpt"):
        c = auto_interval_after_one_save(root)
    iv = c.interval
    assert iv.mtbf_s == (2 * 14400 + 750) / 4 < 14400
    assert iv.young_daly_s == pytest.approx(math.sqrt(2 * iv.stall_s * iv.mtbf_s))
    assert iv.young_daly_s < 0.72 * math.sqrt(2 * iv.stall_s * 14400)  # shorter by √(14400 / 7387.5) ≈ 1.4
    assert "2 failures in 750s up" in iv.describe() and "plans for a failure every 7388s" in caplog.text
    c.close()


# -- failures of the journal itself, ranks, gc ------------------------------------------------------------

def test_a_journal_that_cannot_be_written_fails_no_save(tmp_path, caplog):
    disk = FaultyStorage(LocalStorage(tmp_path))
    disk.fail(("write", "create"), key=r"^journal/")
    with caplog.at_level(logging.WARNING, logger="ckpt"):
        c = ckpt.Checkpointer(tmp_path, storage=disk)
        for step in (1, 2, 3):
            c.save(step, {"w": torch.ones(2)}).wait()
        c.close()
    assert c._journal.errors >= 4 and caplog.text.count("writing the run journal") == 1  # logged once
    assert ckpt.open(tmp_path).steps() == [1, 2, 3] and not os.path.exists(tmp_path / "journal")


def test_a_checkpointer_dropped_unclosed_stops_its_journal_thread(tmp_path):
    """A load in a notebook or an eval script often drops its Checkpointer without close(): its
    journal's heartbeat must not go on rewriting seen.json in the checkpoint until the process ends
    (a CI flake: a test copied a directory while such a thread replaced a file in it)."""
    import gc
    with ckpt.Checkpointer(tmp_path) as c:
        c.save(1, {"w": torch.ones(2)})
    c = ckpt.Checkpointer(tmp_path)
    c.load(1, {"w": torch.zeros(2)})
    j = c._journal
    assert j._thread.is_alive()
    del c
    gc.collect()
    j._thread.join(30)
    assert not j._thread.is_alive()
    g = ckpt.open(tmp_path).goodput()
    assert [s.ended for s in g.starts] == ["closed", "last"]  # the dropped start: last seen, not a clean close
    assert not [f for f in os.listdir(tmp_path / "journal" / j.id) if ".tmp" in f]


@pytest.mark.parametrize("every", [None, "auto"])
def test_a_closed_checkpointer_is_freed(tmp_path, every):
    """Nothing the journal leaves behind (its finalizer; with every="auto" the schedule its history
    tunes) keeps a closed Checkpointer, its engine and its host buffer alive."""
    import gc
    import weakref
    c = ckpt.Checkpointer(tmp_path, **({} if every is None else {"every": every}))
    c.save(1, {"w": torch.ones(2)}).wait()
    c.load(1, {"w": torch.zeros(2)})
    c.close()
    gone = weakref.ref(c)
    del c
    gc.collect()
    assert gone() is None


def two_ranks_body(rank: int, world: int, root: str) -> int:
    socket.gethostname = lambda: f"node-{rank}"  # type: ignore[assignment]  # two ranks as if on two hosts
    for _ in range(2):  # two starts of the job (one process group, to spawn the ranks once)
        with ckpt.Checkpointer(root, timeout=30) as c:
            state = {"w": ckpt.PerRank(torch.full((2,), float(rank))), "step": 0}
            c.load("latest", state)
            for step in (state["step"] + 1, state["step"] + 2):
                state["step"] = step
                c.save(step, state)
    return c.rank


@pytest.mark.multiprocess
def test_under_two_ranks_only_the_coordinator_writes_one_start_per_start(tmp_path):
    assert run_ranks(2, two_ranks_body, str(tmp_path)) == [0, 1]
    names = sorted(os.listdir(tmp_path / "journal"))
    assert len(names) == 2
    assert [sorted(os.listdir(tmp_path / "journal" / n)) for n in names] == [
        ["save-000000000001.json", "save-000000000002.json", "seen.json", "start.json"],
        ["save-000000000003.json", "save-000000000004.json", "seen.json", "start.json"]]
    g = ckpt.open(tmp_path).goodput()
    assert [(s.world_size, s.resumed_from, s.ended) for s in g.starts] == [(2, None, "closed"), (2, 2, "closed")]
    # every rank's host, gathered by the load's first round (the coordinator's alone in "host")
    starts = journal.read(LocalStorage(tmp_path))
    assert [(r.host, r.hosts) for r in starts] == [("node-0", ["node-0", "node-1"])] * 2


def test_gc_prunes_the_journal_past_its_bound(tmp_path, monkeypatch):
    st = LocalStorage(tmp_path)
    for i in range(4):
        c = ckpt.Checkpointer(tmp_path, keep_last=1)
        c.load("latest", {"w": torch.zeros(1)})
        for step in (2 * i + 1, 2 * i + 2):
            c.save(step, {"w": torch.zeros(1)})
        c.close()
    starts = [r.id for r in journal.read(st)]
    monkeypatch.setattr(journal, "KEEP_STARTS", 3)
    monkeypatch.setattr(journal, "KEEP_SAVES", 2)
    rep = ckpt.open(tmp_path).gc(dry_run=False)
    gone = sorted(i.key for i in rep.removed if i.kind == "journal")
    # the oldest start whole; of the other 6 save records the 4 oldest, but step 4 and 6 (resumed from) stay
    assert gone == sorted([f"journal/{starts[0]}/{n}" for n in ("save-000000000001.json", "save-000000000002.json",
                                                              "seen.json", "start.json")]
                          + [paths.journal_save_key(starts[1], 3), paths.journal_save_key(starts[2], 5)])
    assert sorted(os.listdir(tmp_path / "journal")) == starts[1:]
    assert [r.id for r in journal.read(st)] == starts[1:]
    assert ckpt.open(tmp_path).steps() == [6, 8]  # 6: the last run resumed from it
    assert ckpt.open(tmp_path).gc(dry_run=True).removed == []  # within the bound now


def test_readme_sample_is_what_ckpt_goodput_prints(tmp_path):
    """README's sample of `ckpt goodput` (a chaos run's, on a 92-column terminal) has the headers, lines
    and legend it prints today."""
    import io
    import re
    from pathlib import Path

    from ckpt.console import Out
    from ckpt.goodput_chart import LEGEND

    readme = (Path(__file__).parent.parent / "README.md").read_text()
    sample = re.search(r"^```text\n\$ ckpt goodput .*?\n(.*?)^```$", readme, re.M | re.S).group(1).splitlines()
    buf = io.StringIO()
    cli.print_goodput(analyse(four_starts()), Out(buf, tty=True, width=200), "w/chaos")
    printed = buf.getvalue().splitlines()

    def summary(lines):  # numbers and their units as N
        return [re.sub(r"[\d.]+(min|s|h)?", "N", x) for x in lines if x.startswith(("w/", "goodput", "badput"))]

    def headers(lines):  # the words above each table's rule (a narrow terminal wraps them)
        rules = [i for i, line in enumerate(lines) if line.startswith("───")]
        return [sorted(" ".join(lines[max(0, i - 2):i]).split()[-n:]) for i, n in zip(rules, (13, 14))]

    assert summary(sample) == summary(printed) and len(summary(sample)) == 3
    assert headers(sample) == headers(printed)
    assert sample[-1] == LEGEND and re.fullmatch(r" +0 +[\d.]+s", sample[-2])


def test_an_import_is_no_start_of_the_job(tmp_path):
    from safetensors.torch import save_file

    save_file({"w": torch.ones(3)}, str(tmp_path / "w.safetensors"))
    ckpt.import_checkpoint(str(tmp_path / "w.safetensors"), str(tmp_path / "ck"), step=0)
    assert ckpt.open(tmp_path / "ck").steps() == [0] and not (tmp_path / "ck" / "journal").exists()
