"""The ``ckpt`` command line: look at, check, compare, clean up and export checkpoints.

    ckpt ls      URL [--verify] [--local DIR ...] [--json]
    ckpt inspect URL [--step S] [--keys PATTERN ...] [--tsv] [--json]
    ckpt verify  URL [--step S | --all] [--json]
    ckpt diff    URL A B [--max-diff] [--exit-code] [--json]
    ckpt gc      URL [--dry-run] [--grace 1h] [--keep-last N] [--drop-after STEP] [--local DIR --keep-local N] [--json]
    ckpt export  URL [--step S] --to FILE.safetensors|FILE.pt [--keys PREFIX] [--rank R]
    ckpt export  URL [--step S] --to DIR --format hf|dcp [--max-shard-size 5GB] [--dtype bf16] [--keys P --strip-prefix]
    ckpt import  SRC URL --step N [--key model | --top-level] [--keys PREFIX --strip-prefix]
    ckpt goodput URL [--json] [--plot FILE.png]
    ckpt chaos   [--kills N] [--seed S] [--timeout T] [--workdir DIR] -- COMMAND ... {dir} ...

URL is a directory or any fsspec URL (``--storage-option KEY=VALUE`` passes options). It needs no
process group and never unpickles. Tables are aligned on a terminal and tab-separated (sizes in
bytes) when piped (``inspect``: aligned, at full width, unless ``--tsv``); ``--json`` prints one
document with a ``schema`` field.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from typing import TYPE_CHECKING, Any

from . import cli_parser
from .console import (
    Out,
    Progress,
    fmt_age,
    fmt_base_steps,
    fmt_box,
    fmt_dtype,
    fmt_ratio,
    fmt_shape,
    fmt_steps,
    fmt_time,
    human_bytes,
)
from .errors import CheckpointError, ConfigError
from .reader import Reader
from .reader.collect import GcReport
from .reader.listing import local_tiers, ls
from .reader.verify import VerifyResult
from .tree import preview

if TYPE_CHECKING:
    from .goodput import Goodput

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_DIFFERENT = 0, 1, 2, 3

def _dump(doc: dict) -> None:
    json.dump(doc, sys.stdout, indent=2)
    sys.stdout.write("\n")


def _open(args: argparse.Namespace) -> Reader:
    r = Reader(args.url, dict(args.storage_option or []))
    r.threads = args.jobs
    return r


# -- ls -----------------------------------------------------------------------------------------------

def cmd_ls(args: argparse.Namespace) -> int:
    tiers = local_tiers(args.local or [])
    try:
        reader: Reader | None = _open(args)
    except CheckpointError:
        if not tiers:
            raise
        reader = None  # nothing uploaded yet: the local tiers alone
    bar = Progress(reader.chunk_count(reader.committed) if reader is not None and args.verify else 0, "verify",
                   enabled=None if reader is not None and args.verify else False)
    try:
        res = ls(reader, verify=args.verify, local=args.local or [], tiers=tiers, url=args.url, progress=bar.update)
    finally:
        bar.close()
    if args.json:
        _dump(res.to_json())
        return EXIT_OK if res.ok else EXIT_FAILED
    out = Out()
    rows: list[list[Any]] = []
    for d in res.steps:
        if d.readable:
            status = d.status if d.status != "corrupt" else f"CORRUPT: {d.error}"
            rows.append([d.step, fmt_time(d.created), d.world_size, d.tensors, out.size(d.raw_bytes),
                         out.size(d.stored_bytes), out.size(d.new_bytes), d.tensor_chunks, status])
        elif d.status == "damaged":
            rows.append([d.step] + ["-"] * 7 + [f"DAMAGED: {d.error}"])
        else:
            rows.append([d.step] + ["-"] * 7 + [f"incomplete: {d.rank_files} rank file(s), no manifest"])
        if args.local:
            rows[-1].append(d.where or "-")
    # "tensor chunks": the chunks its tensors reference, not the delta bases a load also reads
    out.table(["step", "created (UTC)", "ranks", "tensors", "raw", "stored", "new", "tensor chunks", "status"] +
              (["where"] if args.local else []), rows, {0, 2, 3, 4, 5, 6, 7}, fit={8: "end", 9: "end"},
              drop=[7, 3, 2])
    for p in res.problems:
        print(f"{p.kind}: {p.object} (step {', '.join(map(str, p.steps))}): {p.message}", file=sys.stderr)
    return EXIT_OK if res.ok else EXIT_FAILED


# -- inspect ------------------------------------------------------------------------------------------

def cmd_inspect(args: argparse.Namespace) -> int:
    reader = _open(args)
    ins = reader.inspect(args.step, keys=args.keys)
    m, step, summary, tensors, values = ins.manifest, ins.manifest.step, ins.summary, ins.tensors, ins.values
    if args.json:
        _dump(ins.to_json())
        return EXIT_OK
    out = Out(aligned=not args.tsv)  # piped too, unless --tsv: a table is what people pipe to less or grep
    out.write(f"{args.url}: {len(reader.committed)} committed step(s); step {step}")
    out.write(f"  created {summary.created}, {m.world_size} rank(s), {len(m.tensors)} tensor(s)")
    out.write(f"  raw {human_bytes(m.raw_bytes)}, stored {human_bytes(m.stored_bytes)}, "
              f"new {human_bytes(summary.new_bytes or 0)} ({summary.new_chunks} of {len(m.chunks)} chunks)")
    if m.per_rank_keys:
        out.write(f"  per-rank keys: {', '.join(m.per_rank_keys)}")
    if ins.damaged:
        out.write(f"  damaged steps: {', '.join(map(str, ins.damaged))} (ckpt ls shows why)")
    if args.keys:
        out.write(f"  --keys {' '.join(args.keys)}: {len(tensors)} of {ins.total_tensors} tensor(s), "
                  f"{len(values)} value(s)")
    if tensors:
        total = sum(t["bytes"] for t in tensors) or 1
        out.write(f"\nstep {step}: size by group")
        out.table(["group", "tensors", "size", "share"],
                  [[g["group"], g["tensors"], out.size(g["bytes"]), f"{g['bytes'] / total:.0%}"] for g in ins.groups],
                  {1, 2, 3})
        named = any(t["param"] for t in tensors)
        out.write(f"\nstep {step}: tensors" + (" (parameter: what an optimizer state entry is for)" if named else ""))
        rows = [[t["key"] + (f" [rank {t['rank']}]" if t["rank"] is not None else "")]
                + ([t["param"] or "-"] if named else [])
                + [t["kind"], fmt_dtype(t["dtype"]), fmt_shape(t["shape"]), out.size(t["bytes"]), len(t["shards"]),
                   t["new_chunks"], t["reused_chunks"], ",".join(sorted({c.split("/")[0] for c in t["codecs"]})) or "-",
                   fmt_ratio(t["ratio"]), fmt_base_steps(t["base_steps"]), t["chain"]]
                for t in tensors]
        header = ["key"] + (["parameter"] if named else []) + ["kind", "dtype", "shape", "size", "shards", "new",
                                                                "reused", "codec", "ratio", "base", "chain"]
        p = 1 if named else 0  # columns after the key move one right with the parameter's
        out.table(header, rows, {4 + p, 5 + p, 6 + p, 7 + p, 9 + p, 11 + p},
                  fit={0: "middle", 8 + p: "end"} | ({1: "middle"} if named else {}),
                  drop=[11 + p, 10 + p, 5 + p, 7 + p, 1 + p] + ([1] if named else []) + [6 + p])
    sharded = [t for t in tensors if t["kind"] == "sharded"]
    if sharded:
        out.write(f"\nstep {step}: shards (box of the global tensor, saving rank, chunks)")
        rows = [[t["key"], fmt_box(s["offsets"], s["lengths"]), s["rank"], len(s["chunks"])]
                for t in sharded for s in t["shards"]]
        out.table(["key", "box", "rank", "chunks"], rows, {2, 3}, fit={0: "middle", 1: "end"})
    if values:
        out.write(f"\nstep {step}: values")
        for path, n in values:
            out.write(f"  {path} = {preview(n)}")
    return EXIT_OK


# -- verify -------------------------------------------------------------------------------------------

def _verify(args: argparse.Namespace, reader: Reader) -> VerifyResult:
    """Reader.verify with a progress bar on stderr when it is a terminal."""
    steps = reader.committed if args.all else [reader.step(args.step)]  # a step not committed is an error
    bar = Progress(reader.chunk_count(steps), "verify")
    try:
        return reader.verify(None if args.all else steps[0], all=args.all, progress=bar.update)
    finally:
        bar.close()


def cmd_verify(args: argparse.Namespace) -> int:
    res = _verify(args, _open(args))
    steps = res.steps
    if args.json:
        _dump(res.to_json(args.url))
        return EXIT_OK if res.ok else EXIT_FAILED
    out = Out()
    if res.ok:
        what = f"step(s) {fmt_steps(steps)}"
        out.write(f"OK: {what}: {res.chunks} chunk(s), {human_bytes(res.bytes)} read and verified")
        return EXIT_OK
    if out.tty:  # one problem a paragraph: its detail is what matters, and would not fit a table cell
        for p in res.problems:
            out.paragraph(f"{p.kind}: {p.object} (step {', '.join(map(str, p.steps))}): {p.message}")
    else:
        out.table(["problem", "object", "steps", "detail"],
                  [[p.kind, p.object, ",".join(map(str, p.steps)), p.message] for p in res.problems])
    bad = sorted({s for p in res.problems for s in p.steps})
    good = [s for s in steps if s not in bad]
    print(f"ckpt: verify: {len(res.problems)} damaged or missing object(s), used by step(s) {fmt_steps(bad)}; "
          + (f"step(s) {fmt_steps(good)} verified clean" if good else "no step verified clean")
          + f" ({res.chunks} chunk(s) checked)", file=sys.stderr)
    return EXIT_FAILED


# -- diff ---------------------------------------------------------------------------------------------

def cmd_diff(args: argparse.Namespace) -> int:
    d = _open(args).diff(args.a, args.b, max_diff=args.max_diff)
    a, b, changes, values = d.a, d.b, d.tensors, d.values
    differ = [c for c in changes if c.status != "same"]
    if args.json:
        _dump(d.to_json(args.url))
    else:
        out = Out()
        same = len(changes) - len(differ)
        out.write(f"step {a} -> step {b}: {len(differ)} tensor(s) differ, {same} unchanged; "
                  f"{len(values)} value(s) differ")
        if differ:
            header = ["tensor", "status", "decided by", "detail"] + (["max abs diff"] if args.max_diff else [])
            rows = [[c.name, c.status, c.how, c.detail or "-"] +
                    ([f"{c.max_abs_diff:.6g}" if c.max_abs_diff is not None else "-"] if args.max_diff else [])
                    for c in differ]
            # the names keep their width while "decided by" and the detail are hidden (--json has them)
            out.table(header, rows, {4}, fit={0: "middle", 3: "end"}, drop=[2, 3], whole={0})
        if values:
            if differ and out.tty:
                out.write()  # the two tables apart
            out.table(["value", f"step {a}", f"step {b}"], [list(v) for v in values],
                      fit={0: "middle", 1: "end", 2: "end"})
    if args.exit_code and (differ or values):
        return EXIT_DIFFERENT
    return EXIT_OK


# -- gc -----------------------------------------------------------------------------------------------


def cmd_gc(args: argparse.Namespace) -> int:
    """``ckpt gc URL``; with ``--local DIR`` also each node's local tier, with its own ``--keep-local``."""
    roots = [(_open(args), args.keep_last)] + [(r, args.keep_local) for r in local_tiers(args.local or [])]
    reports = [r.gc(grace_s=args.grace, keep_last=keep, dry_run=args.dry_run,
                    drop_after=args.drop_after if i == 0 else None) for i, (r, keep) in enumerate(roots)]
    docs = [rep.to_json() for rep in reports]
    if args.json:
        if args.local:
            docs[0]["local"] = docs[1:]
        _dump(docs[0])
    else:
        for rep in reports:
            _print_gc(args, rep)
    return max(d["exit"] for d in docs)


def _print_gc(args: argparse.Namespace, rep: GcReport) -> None:
    plan, removed = rep.plan, rep.removed
    if args.local:
        print(f"{rep.url}:")
    out = Out()
    verb = "would remove" if args.dry_run else "removed"
    if removed:
        out.table(["what", "object", "bytes", "age"],
                  [[i.kind if i.kind != "step" else f"step {i.step} (retention)", i.key, out.size(i.bytes),
                    fmt_age(i.age_s)] for i in removed], {2, 3}, fit={0: "end", 1: "middle"})
    counts: dict[str, int] = {}
    for i in removed:
        counts[i.kind] = counts.get(i.kind, 0) + 1
    names = {"step": "retained-away step(s)", "chunk": "chunk(s) only they used", "orphan": "orphan chunk(s)",
             "temp": "temp file(s)", "incomplete": "incomplete step(s)", "journal": "run journal record(s)"}
    parts = [f"{counts[k]} {names[k]}" for k in names if k in counts]
    out.write(f"{verb}: {', '.join(parts) or 'nothing'}; {human_bytes(rep.bytes)}")
    if plan.young:
        out.write(f"kept: {len(plan.young)} object(s) younger than the grace period ({fmt_age(args.grace)}); "
                  "a running save may still commit them")
    if plan.writers:
        out.write(f"deferred: {plan.writers[0].describe()} is saving into {rep.url}; no chunk, temp file or "
                  "unfinished step was touched, and the chunks of removed steps are left for it (or a later gc) "
                  "to delete")
    for s, e in plan.unreadable.items():
        print(f"ckpt: gc: step {s} has a damaged manifest, so which chunks it needs is unknown: no chunk "
              f"was removed and retention was skipped ({e})", file=sys.stderr)


# -- export -------------------------------------------------------------------------------------------

def cmd_export(args: argparse.Namespace) -> int:
    from .reader.export import per_rank_note

    reader = _open(args)
    step = reader.step(args.step)
    res = reader.export(step, args.to, keys=args.keys, strip_prefix=args.strip_prefix, rank=args.rank,
                        overwrite=args.force, format=args.format, dtype=args.dtype, max_shard_size=args.max_shard_size,
                        config=args.config)
    if res.default_keys:
        print(f"ckpt: note: --format hf exported the model's tensors ({res.default_keys}, prefix stripped); "
              "pass --keys PREFIX to choose others", file=sys.stderr)
    if res.config:
        print(f"ckpt: note: config.json written from {res.config}", file=sys.stderr)
    note = per_rank_note(reader.manifest(step), args.rank, res)
    if note:
        print(f"ckpt: note: {note}", file=sys.stderr)
    if res.pickled:
        print(f"ckpt: note: {len(res.pickled)} pickled value(s) left out (never unpickled): "
              f"{', '.join(res.pickled[:5])}{' …' if len(res.pickled) > 5 else ''}", file=sys.stderr)
    if res.format == "torch" and res.skipped_values:
        print(f"ckpt: note: {len(res.skipped_values)} plain value(s) not written: a .pt export holds tensors "
              "only (export to .safetensors to keep them as metadata)", file=sys.stderr)
    where = f"{args.to} ({len(res.files)} file(s): {', '.join(res.files[:3])}{' …' if len(res.files) > 3 else ''})" \
        if res.files else args.to
    Out().write(f"wrote {where}: step {step}, {len(res.tensors)} tensor(s), {human_bytes(res.bytes)}"
                + (f", cast to {res.dtype}" if res.dtype else "")
                + (f", {len(res.values)} value(s) in metadata" if res.values and res.format != "dcp" else "")
                + (f", {len(res.values)} value(s)" if res.values and res.format == "dcp" else ""))
    return EXIT_OK


# -- import -------------------------------------------------------------------------------------------

def cmd_import(args: argparse.Namespace) -> int:
    from .importer import import_checkpoint

    options: dict[str, Any] = {}
    if args.storage_option:
        options["storage_options"] = dict(args.storage_option)
    res = import_checkpoint(args.src, args.url, args.step, key=None if args.top_level else args.key,
                            keys=args.keys, strip_prefix=args.strip_prefix, max_bytes=args.max_bytes, **options)
    under = f" under {res.key!r}" if res.key else ""
    Out().write(f"imported {args.src} ({res.format}) as step {res.step} of {args.url}{under}: {res.tensors} tensor(s), "
                f"{human_bytes(res.bytes)}" + (f", {len(res.values)} value(s)" if res.values else ""))
    return EXIT_OK


# -- goodput ------------------------------------------------------------------------------------------

def _utc(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(t))


def print_goodput(g: Goodput, out: Out, where: str) -> None:
    """``ckpt goodput``'s text (``ckpt chaos`` prints it too)."""
    from .goodput_chart import span_text as _secs

    out.write(f"{where}: {len(g.starts)} start(s), {len(g.failures)} failure(s), MTBF observed {_secs(g.mtbf_s)} "
              f"({_secs(g.exposure_s)} up)")
    if not g.starts:
        return
    step = lambda s: "-" if s is None else str(s)  # noqa: E731
    out.table(["start", "began (UTC)", "ranks", "host", "resumed from", "restart", "load", "up", "saves", "stall",
               "ended"],
              [[s.index, _utc(s.begin), s.world_size, s.host, "fresh" if s.resumed_from is None else s.resumed_from,
                _secs(s.ready - s.begin), _secs(s.load_s), _secs(s.end - s.begin), len(s.saves), _secs(s.stall_s),
                s.ended] for s in g.starts], {0, 2, 5, 6, 7, 8, 9}, fit={3: "middle"}, drop=[3, 2, 9])
    out.write(f"goodput {g.share(g.good_s):.1f}% of {_secs(g.wall_s)} from the first start to the last seen")
    out.write(f"badput {g.share(g.wall_s - g.good_s):.1f}%: checkpoint stalls {g.share(g.stall_s):.1f}%, lost work "
              f"{g.share(g.lost_s):.1f}%, restart and load {g.share(g.restart_s):.1f}% (load {g.share(g.load_s):.1f}%)")
    if g.failures:
        out.table(["failed start", "last seen (UTC)", "resumed from", "lost work", "lost steps", "down", "restart",
                   "load"],
                  [[f.start, _utc(f.at), "fresh" if f.resumed_from is None else f.resumed_from, _secs(f.lost_s),
                    step(f.lost_steps), _secs(f.down_s), _secs(f.restart_s), _secs(f.load_s)] for f in g.failures],
                  {0, 2, 3, 4, 5, 6, 7})


def cmd_goodput(args: argparse.Namespace) -> int:
    g = _open(args).goodput()
    if args.json:
        _dump(g.to_json())
    else:
        print_goodput(g, Out(), args.url)
    if args.plot:
        from .goodput_chart import plot, terminal_chart

        try:
            plot(g, args.plot)
        except ImportError:
            print(f"ckpt: note: matplotlib is not installed (pip install 'ckpt[plot]'), so {args.plot} was not "
                  "written; the timeline here instead:", file=sys.stderr)
            out = Out(sys.stderr if args.json else sys.stdout)  # --json: stdout holds the document alone
            for line in terminal_chart(g, out.width if out.tty else 100):
                out.write(line)
        else:
            print(f"ckpt: wrote the timeline to {args.plot}", file=sys.stderr)
    return EXIT_OK


# -- chaos --------------------------------------------------------------------------------------------

def cmd_chaos(args: argparse.Namespace) -> int:
    import tempfile

    from . import chaos

    command = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    out = Out()
    say = (lambda line: print(f"ckpt chaos: {line}", file=sys.stderr, flush=True)) if not args.json else (
        lambda _line: None)
    workdir = args.workdir or tempfile.mkdtemp(prefix="ckpt-chaos-")
    try:
        report = chaos.run(command, workdir, kills=args.kills, seed=args.seed, timeout=args.timeout,
                             ignore=args.ignore or (), say=say)
    finally:
        if not args.workdir and not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    if args.json:
        _dump(report.to_json())
        return EXIT_OK if report.ok else EXIT_FAILED
    def step(s: int | None) -> str:
        return "-" if s is None else str(s)
    rows = [[a.index, a.killed or f"exit {a.rc}", "fresh" if a.fresh else step(a.resumed_from), step(a.latest),
             {True: "yes", False: "NO", None: "-"}[a.verified], "ok" if a.ok else "; ".join(a.problems)[:300]]
            for a in report.attempts]
    out.table(["run", "ended", "resumed from", "newest committed", "verifies", "result"], rows, right={0},
              fit={1: "end", 5: "end"})
    for p in report.problems:
        out.write(f"PROBLEM: {p}")
    if report.compared:
        same = report.compared - len(report.different)
        out.write(f"final step {report.reference_step}: {same} of {report.compared} tensors and values equal the "
                  f"uninterrupted run's bit for bit" + (f"; different: {', '.join(report.different[:10])}"
                                                        + (" …" if len(report.different) > 10 else "")
                                                        if report.different else ""))
        if any("rng" in n for n in report.different):
            out.write("(random states that differ: does the command seed Python's, numpy's and torch's "
                      "generators? If it need not, leave them out with --ignore PREFIX)")
    if report.goodput is not None:
        print_goodput(report.goodput, out, "the chaos runs")
    out.write(f"{report.kills_done} of {report.kills} kill(s) done, seed {report.seed}: "
              + ("every resume came from a committed step that verifies, and nothing differs" if report.ok
                 else "FAILED") + ("" if args.workdir or not args.keep else f" (runs kept in {workdir})"))
    return EXIT_OK if report.ok else EXIT_FAILED


def build_parser() -> argparse.ArgumentParser:
    return cli_parser.build_parser({"ls": cmd_ls, "inspect": cmd_inspect, "verify": cmd_verify, "diff": cmd_diff,
                                    "gc": cmd_gc, "export": cmd_export, "import": cmd_import, "chaos": cmd_chaos,
                                    "goodput": cmd_goodput})


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ConfigError as e:
        print(f"ckpt: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except CheckpointError as e:
        print(f"ckpt: error: {e}", file=sys.stderr)
        return EXIT_FAILED
    except BrokenPipeError:
        return EXIT_OK
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
