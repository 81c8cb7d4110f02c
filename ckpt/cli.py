"""The ``ckpt`` command line. It reads manifests as JSON only: no process group, no unpickling.

    ckpt inspect PATH [--step S] [--json]

Exit codes: 0 success, 1 the checkpoint is damaged or the step is missing, 2 usage error.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import sys
from typing import Any

from . import __version__
from . import manifest as mf
from .errors import CheckpointError, CheckpointNotFoundError, NotACheckpointError
from .retention import ManifestCache, committed_steps, step_candidates
from .state import DTYPES
from .storage import open_storage


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError


def _table(rows: list[list[str]], header: list[str], right: set[int] = frozenset()) -> str:
    widths = [max(len(str(r[i])) for r in rows + [header]) for i in range(len(header))]
    def line(r):
        return "  ".join(str(c).rjust(w) if i in right else str(c).ljust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip()
    return "\n".join([line(header), line(["-" * w for w in widths])] + [line(r) for r in rows])


def _value_preview(node: Any, limit: int = 80) -> str:
    """A short, safe rendering of a structure node (tensors and pickles are described, not loaded)."""
    def render(n: Any) -> str:
        if isinstance(n, list):
            return "[" + ", ".join(render(v) for v in n) + "]"
        if isinstance(n, dict):
            t = n.get("t")
            if t == "dict":
                return "{" + ", ".join(f"{render(k)}: {render(v)}" for k, v in zip(n["k"], n["v"])) + "}"
            if t == "tuple":
                return "(" + ", ".join(render(v) for v in n["v"]) + ("," if len(n["v"]) == 1 else "") + ")"
            if t == "tensor":
                return f"<tensor {n['key']}>"
            if t == "stateful":
                return f"<{n.get('type', 'object')}>"
            if t == "pickle":
                return "<pickled object: not loaded>"
            if t in ("float", "dtype", "device"):
                return str(n["v"])
            if t == "bytes":
                return f"<{len(n['v']) * 3 // 4} bytes>"
            return f"<{t}>"
        return repr(n)
    s = render(node)
    return s if len(s) <= limit else s[: limit - 1] + "…"


def _plain_values(node: Any, path: str, out: list[tuple[str, str]]) -> None:
    """Leaves of the structure that are plain values, with their key paths."""
    if isinstance(node, dict) and node.get("t") == "dict":
        for k, v in zip(node["k"], node["v"]):
            _plain_values(v, f"{path}/{k}" if path else str(k), out)
    elif isinstance(node, dict) and node.get("t") == "stateful":
        _plain_values(node["v"], path, out)
    elif isinstance(node, dict) and node.get("t") == "tensor":
        return
    elif mf.is_per_rank(node):
        for r, v in enumerate(node["v"]):
            _plain_values(v, f"{path}[rank {r}]", out)
    else:
        out.append((path, _value_preview(node)))


def _step_summary(m: mf.Manifest) -> dict:
    return {
        "step": m.step,
        "created": dt.datetime.fromtimestamp(m.created, dt.timezone.utc).isoformat(timespec="seconds"),
        "world_size": m.world_size,
        "tensors": len(m.tensors),
        "raw_bytes": m.raw_bytes,
        "stored_bytes": m.stored_bytes,
        "written_bytes": m.stats.get("written_bytes"),
        "chunks": len(m.chunks),
        "writer": m.writer,
    }


def _tensor_doc(m: mf.Manifest, t: mf.TensorEntry) -> dict:
    chunks = [g.chunk for s in t.shards for g in s.segments]
    codecs = sorted({m.chunks[h].codec for h in chunks})
    raw = sum(m.chunks[h].size for h in set(chunks))
    stored = sum(m.chunks[h].stored for h in set(chunks))
    return {"key": t.key, "rank": t.rank, "dtype": t.dtype, "shape": t.shape,
            "bytes": math.prod(t.shape) * DTYPES[t.dtype].itemsize,
            "shards": [{"rank": s.rank, "offsets": s.offsets, "lengths": s.lengths} for s in t.shards],
            "chunks": len(set(chunks)), "codecs": codecs,
            "ratio": round(raw / stored, 3) if stored else None}


def cmd_inspect(args: argparse.Namespace) -> int:
    storage = open_storage(args.path, dict(args.storage_option or []))
    if getattr(storage, "root_state", lambda: "nonempty")() in ("missing", "file"):
        raise NotACheckpointError(f"{args.path}: no such checkpoint directory")
    steps = committed_steps(storage)
    incomplete = [s for s in step_candidates(storage) if s not in steps]
    if not steps and not storage.list("chunks"):
        raise NotACheckpointError(f"{args.path} holds no ckpt checkpoint (no committed steps, no chunks)")
    cache = ManifestCache(storage)
    summaries, damaged = [], {}
    for s in steps:
        try:
            summaries.append(_step_summary(cache.get(s)))
        except CheckpointError as e:
            damaged[s] = str(e)
    show = args.step if args.step is not None else (summaries[-1]["step"] if summaries else None)
    if args.step is not None and args.step not in steps:
        raise CheckpointNotFoundError(f"step {args.step} is not committed in {args.path}; committed: {steps or 'none'}")
    detail = None
    if show is not None and show not in damaged:
        m = cache.get(show)
        values: list[tuple[str, str]] = []
        _plain_values(m.structure, "", values)
        detail = {"step": show, "tensors": [_tensor_doc(m, t) for t in m.tensors],
                  "values": {k: v for k, v in values}}

    if args.json:
        doc = {"path": args.path, "format_version": mf.FORMAT_VERSION, "steps": summaries,
               "incomplete_steps": incomplete, "damaged_steps": damaged, "detail": detail}
        json.dump(doc, sys.stdout, indent=2)
        sys.stdout.write("\n")
        return 1 if damaged else 0

    out = sys.stdout
    out.write(f"{args.path}: {len(steps)} committed step(s)\n\n")
    if summaries:
        rows = [[str(s["step"]), s["created"].replace("+00:00", "Z"), str(s["world_size"]), str(s["tensors"]),
                 human_bytes(s["raw_bytes"]), human_bytes(s["stored_bytes"]),
                 human_bytes(s["written_bytes"]) if s["written_bytes"] is not None else "?"] for s in summaries]
        out.write(_table(rows, ["step", "created (UTC)", "ranks", "tensors", "raw", "stored", "new"], {0, 2, 3, 4, 5, 6}) + "\n")
    for s, err in damaged.items():
        out.write(f"step {s}: DAMAGED: {err}\n")
    if incomplete:
        out.write(f"incomplete (never committed): {', '.join(map(str, incomplete))}\n")
    if detail is not None:
        out.write(f"\nstep {detail['step']}: tensors\n")
        rows = [[t["key"] + (f" [rank {t['rank']}]" if t["rank"] is not None else ""), t["dtype"],
                 "(" + ", ".join(map(str, t["shape"])) + ")", human_bytes(t["bytes"]), str(len(t["shards"])),
                 str(t["chunks"]), ",".join(t["codecs"]), f"{t['ratio']:.2f}" if t["ratio"] else "-"]
                for t in detail["tensors"]]
        if rows:
            out.write(_table(rows, ["key", "dtype", "shape", "size", "shards", "chunks", "codec", "ratio"],
                             {3, 4, 5, 7}) + "\n")
        if detail["values"]:
            out.write(f"\nstep {detail['step']}: values\n")
            for k, v in detail["values"].items():
                out.write(f"  {k} = {v}\n")
    return 1 if damaged else 0


def _kv(s: str) -> tuple[str, Any]:
    if "=" not in s:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {s!r}")
    k, v = s.split("=", 1)
    try:
        return k, json.loads(v)
    except json.JSONDecodeError:
        return k, v


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ckpt", description="Inspect ckpt checkpoints (no process group needed; never unpickles).")
    p.add_argument("--version", action="version", version=f"ckpt {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    ins = sub.add_parser("inspect", help="committed steps, sizes, and one step's tensors and values")
    ins.add_argument("path", help="checkpoint directory or fsspec URL")
    ins.add_argument("--step", type=int, help="step to show in detail (default: the latest)")
    ins.add_argument("--json", action="store_true", help="print one machine-readable JSON document")
    ins.add_argument("--storage-option", action="append", type=_kv, metavar="KEY=VALUE",
                     help="fsspec storage option (repeatable); VALUE is parsed as JSON when it can be")
    ins.set_defaults(func=cmd_inspect)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except CheckpointError as e:
        print(f"ckpt: error: {e}", file=sys.stderr)
        return 1
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
