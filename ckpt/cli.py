"""The ``ckpt`` command line: look at, check, compare, clean up and export checkpoints.

    ckpt ls      URL [--verify] [--local DIR ...] [--json]
    ckpt inspect URL [--step S] [--json]
    ckpt verify  URL [--step S | --all] [--json]
    ckpt diff    URL A B [--max-diff] [--exit-code] [--json]
    ckpt gc      URL [--dry-run] [--grace 1h] [--keep-last N] [--local DIR --keep-local N] [--json]
    ckpt export  URL [--step S] --to FILE.safetensors|FILE.pt [--keys PREFIX] [--rank R]
    ckpt chaos   [--kills N] [--seed S] [--timeout T] [--workdir DIR] -- COMMAND ... {dir} ...

URL is a directory or any fsspec URL (``--storage-option KEY=VALUE`` passes options). It needs no
process group and never unpickles. Tables are aligned on a terminal and tab-separated (sizes in
bytes) when piped; ``--json`` prints one document with a ``schema`` field.
"""

from __future__ import annotations

import argparse
import datetime as dt
import io
import json
import os
import re
import shutil
import sys
import time
from typing import Any, TextIO

from rich import box
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, TaskProgressColumn, TextColumn
from rich.progress import Progress as RichProgress
from rich.table import Table
from rich.text import Text

from . import __version__
from .catalog import Catalog, tensor_kind, verify
from .errors import CheckpointError, ConfigError
from .format import manifest as mf
from .format import paths
from .format.chunk import is_chunk_hash
from .reader import Reader
from .tree import preview, strip_pickles, value_nodes

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_DIFFERENT = 0, 1, 2, 3

EXIT_CODES = """exit codes:
  0  success (verify: every object is intact)
  1  the checkpoint is missing, damaged or unreadable, or the operation failed
     (verify/ls --verify: something is corrupt or missing; gc: a damaged manifest stopped it)
  2  usage error (bad arguments or options)
  3  diff --exit-code: the steps differ"""


# -- output -------------------------------------------------------------------------------------------

def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError


def terminal_width(stream: TextIO) -> int:
    """Columns of the terminal ``stream`` is (``COLUMNS`` wins, as for every console program)."""
    try:
        return os.get_terminal_size(stream.fileno()).columns if "COLUMNS" not in os.environ else \
            shutil.get_terminal_size().columns
    except (OSError, AttributeError, ValueError):
        return shutil.get_terminal_size().columns


class Out:
    """Where results go: on a terminal, tables (rich) that fit its width, long cells folded, sizes
    for humans; piped, tab-separated rows with exact byte counts (so ``cut``/``awk`` and
    spreadsheets read them)."""

    def __init__(self, stream: TextIO | None = None, tty: bool | None = None, width: int | None = None):
        self.stream = stream or sys.stdout
        self.tty = self.stream.isatty() if tty is None else tty
        self.width = width or (terminal_width(self.stream) if self.tty else 200)
        real = self.tty and hasattr(self.stream, "fileno") and not isinstance(self.stream, io.StringIO)
        self.console = Console(file=self.stream, width=self.width, highlight=False, soft_wrap=False,
                               color_system="auto" if real else None, emoji=False)

    def write(self, text: str = "") -> None:
        if self.tty:
            self.console.print(text, markup=False)
        else:
            self.stream.write(text + "\n")

    def size(self, n: int | None) -> str:
        if n is None:
            return "-"
        return human_bytes(n) if self.tty else str(n)

    def table(self, header: list[str], rows: list[list[Any]], right: set[int] | frozenset[int] = frozenset()
              ) -> None:
        cells = [[str(c) for c in r] for r in rows]
        if not self.tty:
            for r in [header] + cells:
                self.stream.write("\t".join(c.replace("\t", " ").replace("\n", " ") for c in r) + "\n")
            return
        t = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, header_style="bold", expand=False)
        for i, h in enumerate(header):
            t.add_column(h, justify="right" if i in right else "left", overflow="fold")
        for r in cells:
            t.add_row(*(Text(c) for c in r))
        self.console.print(t)


class Progress:
    """A progress bar (rich) on stderr, drawn only when stderr is a terminal."""

    def __init__(self, total: int, what: str, stream: TextIO | None = None, enabled: bool | None = None):
        stream = stream or sys.stderr
        self.enabled = stream.isatty() if enabled is None else enabled
        self.started = time.monotonic()
        self._bar: RichProgress | None = None
        if self.enabled:
            console = Console(file=stream, width=terminal_width(stream), highlight=False, color_system=None)
            self._bar = RichProgress(TextColumn(what), BarColumn(), MofNCompleteColumn(), TaskProgressColumn(),
                                     TextColumn("{task.fields[rate]}"), console=console, auto_refresh=False)
            self._task = self._bar.add_task(what, total=total, rate="")
            self._bar.start()

    def update(self, done: int, nbytes: int) -> None:
        if self._bar is not None:
            rate = nbytes / max(time.monotonic() - self.started, 1e-6)
            self._bar.update(self._task, completed=done, rate=f"{human_bytes(rate)}/s")
            self._bar.refresh()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()


def _iso(ts: float) -> str:
    return dt.datetime.fromtimestamp(ts, dt.timezone.utc).isoformat(timespec="seconds").replace("+00:00", "Z")


def _dump(doc: dict) -> None:
    json.dump(doc, sys.stdout, indent=2)
    sys.stdout.write("\n")


def _open(args: argparse.Namespace) -> Reader:
    r = Reader(args.url, dict(args.storage_option or []))
    r.threads = args.jobs
    return r


def _catalog(args: argparse.Namespace) -> Catalog:
    return _open(args).catalog


def _box(offsets: list[int], lengths: list[int]) -> str:
    return "[" + ", ".join(f"{o}:{o + n}" for o, n in zip(offsets, lengths)) + "]"


def _shape(shape: list[int]) -> str:
    return "(" + ", ".join(map(str, shape)) + ("," if len(shape) == 1 else "") + ")"


# -- ls -----------------------------------------------------------------------------------------------

def _step_doc(cat: Catalog, s: int, earlier: set[str]) -> dict:
    m = cat.manifest(s)
    if m is None:
        return {"step": s, "status": "damaged", "error": cat.errors[s], "rank_files": len(cat.rank_files(s))}
    new = [h for h in m.chunks if h not in earlier]
    return {"step": s, "status": "committed", "created": _iso(m.created), "world_size": m.world_size,
            "tensors": len(m.tensors), "raw_bytes": m.raw_bytes, "stored_bytes": m.stored_bytes,
            "new_bytes": sum(m.chunks[h].stored for h in new), "new_chunks": len(new), "chunks": len(m.chunks),
            "written_bytes": m.stats.get("written_bytes"), "writer": m.writer}


def _local_tiers(dirs: list[str]) -> list[tuple[str, Catalog]]:
    """Each ``--local`` directory with its catalog (an empty tier, a replaced node's, is left out)."""
    from .storage import LocalStorage

    out = []
    for d in dirs:
        if not os.path.isdir(d):
            raise ConfigError(f"--local {d!r}: no such directory (a node's local_dir)")
        try:
            out.append((d, Catalog(LocalStorage(d))))
        except CheckpointError:  # an empty tier holds nothing
            continue
    return out


def _chunks_held(cat: Catalog) -> set[str]:
    """Every chunk a tier holds (one listing per prefix, not a stat per chunk and step)."""
    st = cat.storage
    return {n for p in st.list(paths.CHUNKS) for n in st.list(f"{paths.CHUNKS}/{p}") if is_chunk_hash(n)}


def _where(docs: list[dict], remote: set[int], tiers: list[Catalog], n_dirs: int) -> list[dict]:
    """With ``--local``: for every step, whether the checkpoint path has it, which local tiers
    committed it, and the share of its chunks the local tiers hold between them (what a restore
    without the checkpoint path can get; parity rebuilds more). Steps only the local tiers have are
    added."""
    by_step = {d["step"]: d for d in docs}
    local: dict[int, list[int]] = {}
    for i, cat in enumerate(tiers):
        for s in cat.committed:
            local.setdefault(s, []).append(i)
    for s, holders in local.items():
        if s not in by_step:
            first = tiers[holders[0]]
            by_step[s] = _step_doc(first, s, first.earlier_chunks(s))
    anywhere = set().union(*(_chunks_held(t) for t in tiers)) if tiers else set()
    for s, d in by_step.items():
        d["remote"] = s in remote
        d["local_tiers"] = [tiers[i].storage.describe() for i in local.get(s, [])]
        m = next((m for i in local.get(s, []) if (m := tiers[i].manifest(s)) is not None), None)
        if m is not None and m.chunks:
            held = sum(1 for h in m.chunks if h in anywhere)
            d["local_chunks_held"] = held / len(m.chunks)
        d["where"] = " + ".join(
            x for x in ("remote" if s in remote else "", f"{len(local.get(s, []))}/{n_dirs} local" if s in local
                        else "") if x) or "-"
        if "local_chunks_held" in d and s in local:
            d["where"] += f" ({d['local_chunks_held']:.0%} of chunks)"
    return sorted(by_step.values(), key=lambda d: d["step"])


def cmd_ls(args: argparse.Namespace) -> int:
    tiers = [cat for _, cat in _local_tiers(args.local or [])]
    try:
        cat: Catalog | None = _catalog(args)
    except CheckpointError:
        if not tiers:
            raise
        cat = None  # nothing uploaded yet: the local tiers alone
    docs: list[dict] = []
    earlier: set[str] = set()
    if cat is not None:
        for s in cat.committed:
            docs.append(_step_doc(cat, s, earlier))
            m = cat.manifest(s)
            if m is not None:
                earlier |= m.chunks.keys()
        for s in cat.incomplete:
            docs.append({"step": s, "status": "incomplete", "rank_files": len(cat.rank_files(s))})
    docs.sort(key=lambda d: d["step"])
    if args.local:
        docs = _where(docs, set(cat.committed) if cat is not None else set(), tiers, len(args.local))
    problems = []
    if args.verify and cat is not None:
        res = _verify(args, cat, cat.committed)
        problems = res.problems
        bad: dict[int, int] = {}
        for p in res.problems:
            for s in p.steps:
                bad[s] = bad.get(s, 0) + 1
        for d in docs:
            if d["step"] in bad and d["status"] == "committed":
                d["status"] = "corrupt"
                d["error"] = f"{bad[d['step']]} damaged or missing object(s)"
            elif d["status"] == "committed":
                d["status"] = "verified"
    failed = any(d["status"] in ("damaged", "corrupt") for d in docs)
    if args.json:
        _dump({"schema": "ckpt-ls/1", "url": args.url, "steps": docs,
               "problems": [p.to_json() for p in problems]})
        return EXIT_FAILED if failed else EXIT_OK
    out = Out()
    rows = []
    for d in docs:
        if d["status"] in ("committed", "verified", "corrupt"):
            status = d["status"] if d["status"] != "corrupt" else f"CORRUPT: {d['error']}"
            rows.append([d["step"], d["created"], d["world_size"], d["tensors"], out.size(d["raw_bytes"]),
                         out.size(d["stored_bytes"]), out.size(d["new_bytes"]), status])
        elif d["status"] == "damaged":
            rows.append([d["step"], "-", "-", "-", "-", "-", "-", f"DAMAGED: {d['error']}"])
        else:
            rows.append([d["step"], "-", "-", "-", "-", "-", "-",
                         f"incomplete: {d['rank_files']} rank file(s), no manifest"])
        if args.local:
            rows[-1].append(d.get("where", "-"))
    out.table(["step", "created (UTC)", "ranks", "tensors", "raw", "stored", "new", "status"] +
              (["where"] if args.local else []), rows, {0, 2, 3, 4, 5, 6})
    for p in problems:
        print(f"{p.kind}: {p.object} (step {', '.join(map(str, p.steps))}): {p.message}", file=sys.stderr)
    return EXIT_FAILED if failed else EXIT_OK


# -- inspect ------------------------------------------------------------------------------------------

def _tensor_doc(m: mf.Manifest, t: mf.TensorEntry, earlier: set[str], holder: dict[str, int]) -> dict:
    """One tensor of step ``m``: its chunks, codecs, ratio (raw ÷ stored, for this step's own chunks;
    a delta's base is not counted) and, for deltas, the steps holding their bases (``holder``: the
    newest earlier step that holds each chunk) and the longest chain a load of it resolves."""
    chunks = list(dict.fromkeys(g.chunk for s in t.shards for g in s.segments))
    new = [h for h in chunks if h not in earlier]
    raw = sum(m.chunks[h].size for h in chunks)
    stored = sum(m.chunks[h].stored for h in chunks)
    bases = {m.chunks[h].base for h in chunks} - {None}
    return {"key": t.key, "rank": t.rank, "kind": tensor_kind(t), "dtype": t.dtype, "shape": t.shape,
            "bytes": t.nbytes,
            "shards": [{"rank": s.rank, "offsets": s.offsets, "lengths": s.lengths,
                        "chunks": list(dict.fromkeys(g.chunk for g in s.segments))} for s in t.shards],
            "chunks": len(chunks), "new_chunks": len(new), "reused_chunks": len(chunks) - len(new),
            "codecs": sorted({m.chunks[h].codec for h in chunks}),
            "ratio": round(raw / stored, 3) if stored else None,
            "base_steps": sorted({holder[b] for b in bases if b in holder}),
            "chain": max((len(mf.chain(m.chunks, h)) for h in chunks), default=0)}


def cmd_inspect(args: argparse.Namespace) -> int:
    cat = _catalog(args)
    step = cat.resolve(args.step)
    m = cat.require(step)
    earlier = cat.earlier_chunks(step)
    summary = _step_doc(cat, step, earlier)
    holder = cat.chunk_holders(step)
    tensors = [_tensor_doc(m, t, earlier, holder) for t in m.tensors]
    values = list(value_nodes(m.structure))
    if args.json:
        steps = []
        for s in cat.committed:
            d = _step_doc(cat, s, set())
            d.pop("new_bytes", None), d.pop("new_chunks", None)
            steps.append(d)
        _dump({"schema": "ckpt-inspect/1", "path": args.url, "format_version": m.format_version,
               "steps": [d for d in steps if d["status"] == "committed"],
               "incomplete_steps": cat.incomplete,
               "damaged_steps": {str(s): e for s, e in cat.errors.items()},
               "detail": {**summary, "per_rank_keys": m.per_rank_keys, "tensors": tensors,
                          "values": {p: preview(n) for p, n in values},
                          "value_nodes": {p: strip_pickles(n) for p, n in values}}})
        return EXIT_OK
    out = Out()
    out.write(f"{args.url}: {len(cat.committed)} committed step(s); step {step}")
    out.write(f"  created {summary['created']}, {m.world_size} rank(s), {len(m.tensors)} tensor(s), "
              f"raw {human_bytes(m.raw_bytes)}, stored {human_bytes(m.stored_bytes)}, "
              f"new {human_bytes(summary['new_bytes'])} ({summary['new_chunks']} of {len(m.chunks)} chunks)")
    if m.per_rank_keys:
        out.write(f"  per-rank keys: {', '.join(m.per_rank_keys)}")
    if cat.errors:
        out.write(f"  damaged steps: {', '.join(map(str, cat.errors))} (ckpt ls shows why)")
    if tensors:
        out.write(f"\nstep {step}: tensors")
        rows = [[t["key"] + (f" [rank {t['rank']}]" if t["rank"] is not None else ""), t["kind"], t["dtype"],
                 _shape(t["shape"]), out.size(t["bytes"]), len(t["shards"]), t["new_chunks"], t["reused_chunks"],
                 ",".join(c.removesuffix("/1") for c in t["codecs"]) or "-",
                 f"{t['ratio']:.2f}" if t["ratio"] else "-", _base_steps(t["base_steps"]), t["chain"]] for t in tensors]
        out.table(["key", "kind", "dtype", "shape", "size", "shards", "new", "reused", "codec", "ratio", "base",
                   "chain"], rows, {4, 5, 6, 7, 9, 11})
    sharded = [t for t in tensors if t["kind"] == "sharded"]
    if sharded:
        out.write(f"\nstep {step}: shards (box of the global tensor, saving rank, chunks)")
        rows = [[t["key"], _box(s["offsets"], s["lengths"]), s["rank"], len(s["chunks"])]
                for t in sharded for s in t["shards"]]
        out.table(["key", "box", "rank", "chunks"], rows, {2, 3})
    if values:
        out.write(f"\nstep {step}: values")
        for p, n in values:
            out.write(f"  {p} = {preview(n)}")
    return EXIT_OK


def _base_steps(steps: list[int]) -> str:
    if not steps:
        return "-"
    return ",".join(map(str, steps)) if len(steps) <= 3 else f"{steps[0]}…{steps[-1]}"


# -- verify -------------------------------------------------------------------------------------------

def _verify(args: argparse.Namespace, cat: Catalog, steps: list[int]):
    """verify() with a progress bar on stderr when it is a terminal."""
    total = len({h for s in steps if (m := cat.manifest(s)) is not None for h in m.chunks})
    bar = Progress(total, "verify")
    try:
        return verify(cat, steps, threads=args.jobs, progress=bar.update)
    finally:
        bar.close()


def cmd_verify(args: argparse.Namespace) -> int:
    reader = _open(args)
    cat = reader.catalog
    steps = cat.committed if args.all else [reader.step(args.step)]  # a step not committed is an error
    res = _verify(args, cat, steps)
    if args.json:
        _dump({"schema": "ckpt-verify/1", "url": args.url, "steps": res.steps, "chunks": res.chunks,
               "bytes": res.bytes, "ok": res.ok, "problems": [p.to_json() for p in res.problems]})
        return EXIT_OK if res.ok else EXIT_FAILED
    out = Out()
    if res.ok:
        what = f"step(s) {_steps(steps)}"
        out.write(f"OK: {what}: {res.chunks} chunk(s), {human_bytes(res.bytes)} read and verified")
        return EXIT_OK
    out.table(["problem", "object", "steps", "detail"],
              [[p.kind, p.object, ",".join(map(str, p.steps)), p.message] for p in res.problems])
    bad = sorted({s for p in res.problems for s in p.steps})
    good = [s for s in steps if s not in bad]
    print(f"ckpt: verify: {len(res.problems)} damaged or missing object(s), used by step(s) {_steps(bad)}; "
          + (f"step(s) {_steps(good)} verified clean" if good else "no step verified clean")
          + f" ({res.chunks} chunk(s) checked)", file=sys.stderr)
    return EXIT_FAILED


def _steps(steps: list[int]) -> str:
    return ", ".join(map(str, steps)) if len(steps) <= 8 else f"{steps[0]} … {steps[-1]} ({len(steps)} steps)"


# -- diff ---------------------------------------------------------------------------------------------

def cmd_diff(args: argparse.Namespace) -> int:
    d = _open(args).diff(args.a, args.b, max_diff=args.max_diff)
    a, b, changes, values = d.a, d.b, d.tensors, d.values
    differ = [c for c in changes if c.status != "same"]
    if args.json:
        _dump({"schema": "ckpt-diff/1", "url": args.url, "a": a, "b": b,
               "tensors": [{"key": c.key, "rank": c.rank, "status": c.status, "decided_by": c.how,
                            "detail": c.detail, "max_abs_diff": c.max_abs_diff} for c in changes],
               "values": [{"key": p, "a": x, "b": y} for p, x, y in values],
               "identical": not differ and not values})
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
            out.table(header, rows)
        if values:
            out.table(["value", f"step {a}", f"step {b}"], [list(v) for v in values])
    if args.exit_code and (differ or values):
        return EXIT_DIFFERENT
    return EXIT_OK


# -- gc -----------------------------------------------------------------------------------------------

_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}


def _duration(s: str) -> float:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*", s)
    if not m:
        raise argparse.ArgumentTypeError(f"expected a duration like 90s, 30m, 1h or 2d, got {s!r}")
    return float(m.group(1)) * _UNITS[m.group(2)]


def _age(s: float | None) -> str:
    if s is None:
        return "?"
    for unit, n in (("d", 86400), ("h", 3600), ("m", 60)):
        if s >= n:
            return f"{s / n:.1f}{unit}"
    return f"{s:.0f}s"


def cmd_gc(args: argparse.Namespace) -> int:
    """``ckpt gc URL``; with ``--local DIR`` also each node's local tier, with its own ``--keep-local``."""
    roots: list[tuple[str, Catalog, int | None]] = [(args.url, _catalog(args), args.keep_last)]
    roots += [(d, cat, args.keep_local) for d, cat in _local_tiers(args.local or [])]
    results = [_gc_one(args, url, cat, keep) for url, cat, keep in roots]
    if args.json:
        doc = results[0]
        if args.local:
            doc["local"] = results[1:]
        _dump(doc)
    return max(r["exit"] for r in results)


def _gc_one(args: argparse.Namespace, url: str, cat: Catalog, keep_last: int | None) -> dict:
    from . import gc

    plan = gc.plan(cat, grace_s=args.grace, keep_last=keep_last)
    removed = plan.remove if args.dry_run else gc.run(cat, plan)
    status = EXIT_FAILED if plan.unreadable else EXIT_OK
    doc = {"schema": "ckpt-gc/1", "url": url, "dry_run": args.dry_run, "grace_s": args.grace,
           "retention_steps": plan.retention, "removed" if not args.dry_run else "would_remove":
           [i.to_json() for i in removed], "bytes": sum(i.bytes for i in removed),
           "kept_younger_than_grace": [i.to_json() for i in plan.young],
           "damaged_steps": {str(s): e for s, e in plan.unreadable.items()},
           "live_writers": [{"id": w.id, "pid": w.pid, "host": w.host} for w in plan.writers], "exit": status}
    if args.json:
        return doc
    if args.local:
        print(f"{url}:")
    out = Out()
    verb = "would remove" if args.dry_run else "removed"
    if removed:
        out.table(["what", "object", "bytes", "age"],
                  [[i.kind if i.kind != "step" else f"step {i.step} (retention)", i.key, out.size(i.bytes),
                    _age(i.age_s)] for i in removed], {2, 3})
    counts: dict[str, int] = {}
    for i in removed:
        counts[i.kind] = counts.get(i.kind, 0) + 1
    names = {"step": "retained-away step(s)", "chunk": "chunk(s) only they used", "orphan": "orphan chunk(s)",
             "temp": "temp file(s)", "incomplete": "incomplete step(s)"}
    parts = [f"{counts[k]} {names[k]}" for k in names if k in counts]
    out.write(f"{verb}: {', '.join(parts) or 'nothing'}; {human_bytes(sum(i.bytes for i in removed))}")
    if plan.young:
        out.write(f"kept: {len(plan.young)} object(s) younger than the grace period ({_age(args.grace)}); "
                  "a running save may still commit them")
    if plan.writers:
        out.write(f"deferred: {plan.writers[0].describe()} is saving into {url}; no chunk, temp file or "
                  "unfinished step was touched, and the chunks of removed steps are left for it (or a later gc) "
                  "to delete")
    for s, e in plan.unreadable.items():
        print(f"ckpt: gc: step {s} has a damaged manifest, so which chunks it needs is unknown: no chunk "
              f"was removed and retention was skipped ({e})", file=sys.stderr)
    return doc


# -- export -------------------------------------------------------------------------------------------

def cmd_export(args: argparse.Namespace) -> int:
    from .export import per_rank_note

    reader = _open(args)
    step = reader.step(args.step)
    res = reader.export(step, args.to, keys=args.keys, strip_prefix=args.strip_prefix, rank=args.rank,
                        overwrite=args.force)
    note = per_rank_note(reader.manifest(step), args.rank)
    if note:
        print(f"ckpt: note: {note}", file=sys.stderr)
    if res.pickled:
        print(f"ckpt: note: {len(res.pickled)} pickled value(s) left out (never unpickled): "
              f"{', '.join(res.pickled[:5])}{' …' if len(res.pickled) > 5 else ''}", file=sys.stderr)
    if res.format == "torch" and res.skipped_values:
        print(f"ckpt: note: {len(res.skipped_values)} plain value(s) not written: a .pt export holds tensors "
              "only (export to .safetensors to keep them as metadata)", file=sys.stderr)
    Out().write(f"wrote {args.to}: step {step}, {len(res.tensors)} tensor(s), {human_bytes(res.bytes)}"
                + (f", {len(res.values)} value(s) in metadata" if res.values else ""))
    return EXIT_OK


# -- parser -------------------------------------------------------------------------------------------

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
    out.table(["run", "ended", "resumed from", "newest committed", "verifies", "result"], rows, right={0})
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
    out.write(f"{report.kills_done} of {report.kills} kill(s) done, seed {report.seed}: "
              + ("every resume came from a committed step that verifies, and nothing differs" if report.ok
                 else "FAILED") + ("" if args.workdir or not args.keep else f" (runs kept in {workdir})"))
    return EXIT_OK if report.ok else EXIT_FAILED


def _kv(s: str) -> tuple[str, Any]:
    if "=" not in s:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {s!r}")
    k, v = s.split("=", 1)
    try:
        return k, json.loads(v)
    except json.JSONDecodeError:
        return k, v


def _step(s: str) -> int | str:
    if s == "latest":
        return s
    try:
        n = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a step is a non-negative integer or 'latest', got {s!r}") from None
    if not 0 <= n <= mf.MAX_STEP:
        raise argparse.ArgumentTypeError(f"a step is an integer from 0 to 2**63 - 1, got {s!r}")
    return n


def _positive(s: str) -> int:
    try:
        n = int(s)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {s!r}")
    return n


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ckpt", formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EXIT_CODES,
        description="Look at, check, compare, clean up and export ckpt checkpoints. URL is a directory or "
                    "an fsspec URL. No process group needed; pickled values are never loaded.")
    p.add_argument("--version", action="version", version=f"ckpt {__version__}")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("url", metavar="URL", help="checkpoint directory or fsspec URL (file://, memory://, s3:// …)")
    common.add_argument("--storage-option", action="append", type=_kv, metavar="KEY=VALUE",
                        help="fsspec storage option (repeatable); VALUE is parsed as JSON when it can be")
    common.add_argument("--jobs", type=_positive, default=8, metavar="N", help="parallel reads (default 8)")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(name: str, help: str, func) -> argparse.ArgumentParser:
        sp = sub.add_parser(name, parents=[common], help=help, description=help, epilog=EXIT_CODES,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
        sp.set_defaults(func=func)
        return sp

    ls = add("ls", "committed steps with time, world size, raw/stored/new bytes; incomplete and damaged steps", cmd_ls)
    ls.add_argument("--verify", action="store_true", help="also re-read and re-hash every chunk")
    ls.add_argument("--local", action="append", metavar="DIR",
                    help="a node's local_dir (repeatable): also list the steps committed only there, and per step "
                         "which tiers hold it and the share of its chunks they hold between them")
    ls.add_argument("--json", action="store_true", help="print one machine-readable JSON document")

    ins = add("inspect", "one step in depth: tensors, shards, codecs, new/reused chunks, values", cmd_inspect)
    ins.add_argument("--step", type=_step, help="step to show (default: the latest)")
    ins.add_argument("--json", action="store_true", help="print one machine-readable JSON document")

    ver = add("verify", "re-read and re-hash every chunk of a step; name each corrupt or missing object", cmd_verify)
    which = ver.add_mutually_exclusive_group()
    which.add_argument("--step", type=_step, help="step to verify (default: the latest)")
    which.add_argument("--all", action="store_true", help="verify every committed step")
    ver.add_argument("--json", action="store_true", help="print one machine-readable JSON document")

    dif = add("diff", "which tensors and values changed between two steps", cmd_diff)
    dif.add_argument("a", type=_step, metavar="A", help="first step")
    dif.add_argument("b", type=_step, metavar="B", help="second step")
    dif.add_argument("--max-diff", action="store_true",
                     help="read changed tensors and report the largest absolute difference")
    dif.add_argument("--exit-code", action="store_true", help="exit 3 when the steps differ")
    dif.add_argument("--json", action="store_true", help="print one machine-readable JSON document")

    gcp = add("gc", "remove orphan chunks, temp files and incomplete steps older than a grace period", cmd_gc)
    gcp.add_argument("--dry-run", action="store_true", help="only list what would be removed, with sizes")
    gcp.add_argument("--grace", type=_duration, default=3600.0, metavar="AGE",
                     help="leave garbage younger than this (a running save may commit it): "
                          "90s, 30m, 1h (default), 2d, 0")
    gcp.add_argument("--keep-last", type=_positive, metavar="N",
                     help="also delete all but the newest N committed steps (and chunks only they use)")
    gcp.add_argument("--local", action="append", metavar="DIR",
                     help="also collect a node's local_dir (repeatable), as its own checkpoint: replicas and parity "
                          "blocks of committed steps are kept")
    gcp.add_argument("--keep-local", type=_positive, metavar="N",
                     help="in each --local tier, keep only the newest N committed steps")
    gcp.add_argument("--json", action="store_true", help="print one machine-readable JSON document")

    exp = add("export", "write one step as a single unsharded .safetensors or .pt file", cmd_export)
    exp.add_argument("--step", type=_step, help="step to export (default: the latest)")
    exp.add_argument("--to", required=True, metavar="FILE", help="output file: *.safetensors, *.pt or *.pth")
    exp.add_argument("--keys", action="append", metavar="PREFIX",
                     help="export only keys starting with PREFIX (repeatable), e.g. --keys model/")
    exp.add_argument("--strip-prefix", action="store_true",
                     help="take the --keys prefix off each name (model/0.weight -> 0.weight), so that "
                          "model.load_state_dict(load_file(FILE)) works as it is")
    exp.add_argument("--rank", type=int, default=0, metavar="R",
                     help="saved rank whose per-rank state to export (default 0)")
    exp.add_argument("--force", action="store_true", help="overwrite FILE if it exists")

    cha = sub.add_parser(
        "chaos", help="kill a training command at random moments, resume it, check nothing was lost",
        description="Run COMMAND once to the end, then again while SIGKILLing it (during saves too) --kills "
                    "times, restarting it after each kill; check that every restart resumed from the newest "
                    "committed step, that this step verifies, and that the final step equals the uninterrupted "
                    "run's bit for bit. {dir} in COMMAND is replaced by the checkpoint directory; COMMAND must "
                    "resume from load('latest') when started again.",
        epilog="example:\n  ckpt chaos --kills 4 -- python examples/train.py --dir {dir} --steps 200 --every 20\n\n"
               + EXIT_CODES.replace("verify: every object is intact", "chaos: nothing was lost or differs"),
        formatter_class=argparse.RawDescriptionHelpFormatter)
    cha.set_defaults(func=cmd_chaos)
    cha.add_argument("--kills", type=int, default=3, metavar="N", help="how many times to kill it (default 3)")
    cha.add_argument("--seed", type=int, default=0, help="seed of the kill moments, to replay a run (default 0)")
    cha.add_argument("--timeout", type=_duration, default=600.0, metavar="T",
                     help="longest one run of COMMAND may take (default 10m)")
    cha.add_argument("--workdir", metavar="DIR", help="keep the runs' checkpoints and logs here (default: a temporary "
                     "directory, removed at the end)")
    cha.add_argument("--keep", action="store_true", help="keep the temporary directory and say where it is")
    cha.add_argument("--ignore", action="append", metavar="PREFIX",
                     help="do not compare tensors and values whose name starts with PREFIX (repeatable), e.g. "
                          "rng/ for random states the command never seeds")
    cha.add_argument("--json", action="store_true", help="print one machine-readable JSON document")
    cha.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- COMMAND", help="the training command, with {dir}")
    return p


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
