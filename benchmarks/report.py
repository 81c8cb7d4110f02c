"""Write docs/benchmarks.md and README.md's headline table from the files in benchmarks/results/.

    python benchmarks/report.py          # rewrite both
    python benchmarks/report.py --check  # exit 1, naming the file, if either is not what it would write

Tables are never copied by hand: each benchmark script writes its table to results/<name>.md, this
script puts those files together, each under the command that made it, followed by the reading
written by hand in benchmarks/readings/<name>.md (what the table meets and misses). The README's
headline ratios are cells looked up in the same tables, so rerunning a benchmark and this script
updates every number the docs show. tests/test_docs.py runs --check.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results"
READINGS = HERE / "readings"
DOC = ROOT / "docs" / "benchmarks.md"
README = ROOT / "README.md"
BEGIN, END = "<!-- headline:begin -->", "<!-- headline:end -->"


@dataclass(frozen=True)
class Section:
    name: str  # results/<name>.md, readings/<name>.md, results/<name>.png
    title: str
    # Used only when neither results/<name>.json nor the table's own text names the command.
    command: str


SECTIONS = [
    Section("save_load", "Save and load: torch.save, DCP, safetensors",
            "python benchmarks/save_load.py --size-gib 1 --repeats 3"),
    Section("bandwidth", "At a rank's bandwidth: 400 MB/s and 1 GB/s",
            "python benchmarks/bandwidth.py --size-gib 0.5 --repeats 3"),
    Section("per_core", "Per core: the codec's throughput, 1 and 2 threads",
            "python benchmarks/per_core.py --size-gib 0.5 --repeats 3"),
    Section("host_memory", "Within a host-memory budget: 2 GiB at 512 MiB",
            "python benchmarks/host_memory.py --size-gib 2 --budget-mib 512"),
    Section("snapshot_cpu", "The snapshot with the compiled core (CPU)",
            "python benchmarks/snapshot_cpu.py --size-gib 2 --repeats 5"),
    Section("gpu_snapshot", "The snapshot on GPU",
            "python benchmarks/gpu_snapshot.py --gib 8 --out benchmarks/results"),
    Section("s3", "Object storage", "python benchmarks/s3.py --size-gib 0.5 --repeats 3"),
    Section("failure", "The moment of failure", "python benchmarks/failure.py --size-gib 1 --repeats 3"),
    Section("delta", "Deltas", "python benchmarks/delta.py"),
    Section("distributed", "Several ranks", "python benchmarks/distributed.py"),
    Section("many_keys", "Many small tensors: a state_dict as the state",
            "python benchmarks/many_keys.py"),
    Section("tiling", "The shard tiling check at every shard count", "python benchmarks/tiling.py"),
    Section("nodeloss", "Node loss", "python benchmarks/nodeloss.py"),
    Section("lightning_fit", "A Lightning fit",
            "python benchmarks/lightning_fit.py --steps 40 --every 5 --repeats 5"),
    Section("dcp_backend", "Under DCP's calls: ckpt.dcp against DCP's own storage",
            "python benchmarks/dcp_backend.py"),
    Section("scale", "At the scale people train: 64 to 16,384 ranks, simulated", "python benchmarks/scale.py"),
]


@dataclass(frozen=True)
class Headline:
    what: str
    section: str
    row: str  # first cell of the row
    column: str  # header of the column
    per: tuple[str, str] | None = None  # (row, column) of a divisor: the headline is the ratio of two cells


HEADLINES = [
    Headline("`save()` blocked ÷ a plain memcpy of the state (1 GiB)", "save_load", "ckpt", "blocked ÷ memcpy"),
    Headline("time to durable ÷ DCP `async_save`'s, storage at 400 MB/s, trained fp32 AdamW", "bandwidth",
             "fp32 AdamW, local, 400 MB/s", "durable auto/DCP"),
    Headline("load (every chunk verified) ÷ DCP's load, storage at 400 MB/s, trained fp32 AdamW", "bandwidth",
             "fp32 AdamW, local, 400 MB/s", "load auto/DCP"),
    Headline("time to durable ÷ DCP `async_save`'s, storage at 400 MB/s, trained bf16 AdamW", "bandwidth",
             "bf16 AdamW, local, 400 MB/s", "durable auto/DCP"),
    Headline("GPU snapshot of 8 GiB (H200) ÷ one flat `cudaMemcpyAsync` of the same bytes, in throughput",
             "gpu_snapshot", "ckpt (kernel < 1024 KiB, else memcpy)", "÷ one cudaMemcpyAsync"),
    Headline("a GPU training run saving 4.5 GiB every 40 steps (H200), ckpt ÷ DCP `async_save` "
             "(`BlockingAsyncStager`), in run time", "gpu_snapshot", "ckpt `Checkpointer.save`", "run (s)",
             per=("DCP `async_save`, `BlockingAsyncStager` (cached pinned copies in the call)", "run (s)")),
    Headline("upload throughput to S3 ÷ plain s3fs puts", "s3", "ckpt → S3", "throughput ÷ plain s3fs"),
    Headline("resharding load, 4 ranks → 2, ÷ DCP's", "distributed", "4→2", "ckpt ÷ dcp"),
    Headline("SIGTERM → emergency save durable (1 GiB), share of torchrun's 30 s", "failure", "ckpt",
             "share of torchrun's 30 s"),
    Headline("bytes stored per save ÷ raw over seven saves, sparse embedding updates", "delta", "embedding",
             "ckpt ÷ raw"),
    Headline("Lightning: overhead per checkpoint ÷ `ModelCheckpoint` with `torch.save`", "lightning_fit",
             "ckpt AsyncCheckpoint", "overhead per checkpoint (s)",
             per=("ModelCheckpoint + TorchCheckpointIO", "overhead per checkpoint (s)")),
    Headline("`dcp.async_save` durable, `ckpt.dcp.Stager` + `Writer` ÷ DCP's default stager + `FileSystemWriter`",
             "dcp_backend", "dcp.async_save, ckpt.dcp.Stager + ckpt.dcp.Writer", "durable ÷ DCP"),
    Headline("bytes over ten `dcp.save`s of an fp32 AdamW training, `ckpt.dcp.Writer` ÷ `FileSystemWriter`",
             "dcp_backend", "gpt-fp32", "ckpt ÷ DCP"),
    Headline("metadata each rank GETs and parses at load, Llama-3-70B FSDP2 on 16,384 ranks (extrapolated), "
             "ckpt ÷ DCP's `.metadata`", "scale", "metadata every rank GETs and parses at load (MiB)", "ckpt ÷ DCP"),
]


def slug(title: str) -> str:
    """The anchor GitHub gives a heading."""
    return re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")


def command_of(section: Section, table: str | None) -> str:
    """The command that made a results table: its JSON's, else the one its text quotes, else ours."""
    js = RESULTS / f"{section.name}.json"
    if js.exists():
        cmd = json.loads(js.read_text()).get("command")
        if isinstance(cmd, str) and cmd.strip():
            return cmd.strip()
    if table is not None:
        found = re.search(r"`(python benchmarks/[^`]+)`", table)
        if found:
            return found.group(1).strip()
    return section.command


def strip_command_line(table: str, command: str) -> str:
    """Drop the command from the table's first line: the section shows it in a block of its own."""
    first, _, rest = table.partition("\n")
    found = re.match(rf"(Command: )?`{re.escape(command)}\s*`", first)
    if not found:
        return table
    remainder = first[found.end():].strip()
    return f"{remainder}\n{rest}" if remainder else rest.lstrip("\n")


def tables(text: str) -> list[list[list[str]]]:
    """Every Markdown table in text, as rows of cells (header first, the --- row left out)."""
    found: list[list[list[str]]] = []
    current: list[list[str]] = []
    for line in text.splitlines() + [""]:
        if line.startswith("|"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if not all(re.fullmatch(r":?-+:?", c) for c in cells):
                current.append(cells)
        elif current:
            found.append(current)
            current = []
    return found


def cell(section: str, row: str, column: str) -> str:
    """The one cell of results/<section>.md in the row starting with `row`, under header `column`."""
    hits = []
    for table in tables((RESULTS / f"{section}.md").read_text()):
        header = table[0]
        if column in header:
            hits += [r[header.index(column)] for r in table[1:] if r and r[0] == row]
    if len(hits) != 1:
        raise SystemExit(f"report.py: results/{section}.md has {len(hits)} cells in row {row!r}, column "
                         f"{column!r} (one expected): update HEADLINES in benchmarks/report.py")
    return hits[0]


def headline_table() -> str:
    lines = ["| measured | ratio | from |", "|---|---:|---|"]
    titles = {s.name: s.title for s in SECTIONS}
    for h in HEADLINES:
        value = cell(h.section, h.row, h.column)
        if h.per is not None:
            value = f"{float(value) / float(cell(h.section, *h.per)):.2f}"
        link = f"[{titles[h.section]}](docs/benchmarks.md#{slug(titles[h.section])})"
        lines.append(f"| {h.what} | {value} | {link} |")
    return "\n".join(lines) + "\n"


def benchmarks_doc() -> str:
    out = [
        "# Benchmarks",
        "",
        "<!-- Generated by `python benchmarks/report.py` from benchmarks/results/ and benchmarks/readings/:",
        "     edit those and rerun it, not this file. -->",
        "",
        "Every table below is the file a benchmark script wrote into `benchmarks/results/`, under the",
        "command that made it; the reading after it is written by hand. Most ran on a shared 2-core",
        "CI-class machine whose disk and load vary from run to run: compare methods within one table,",
        "as ratios, and rerun on your machine. The scripts need the `bench` extra",
        "(`pip install -e \".[bench]\"`).",
        "",
    ]
    out += [f"- [{s.title}](#{slug(s.title)})" for s in SECTIONS]
    for s in SECTIONS:
        md = RESULTS / f"{s.name}.md"
        table = md.read_text().strip() if md.exists() else None
        command = command_of(s, table)
        out += ["", f"## {s.title}", "", "```bash", command, "```", ""]
        out.append(strip_command_line(table, command) if table is not None
                   else f"No results yet: `benchmarks/results/{s.name}.md` does not exist.")
        reading = READINGS / f"{s.name}.md"
        if reading.exists():
            out += ["", reading.read_text().strip()]
        if (RESULTS / f"{s.name}.png").exists():
            out += ["", f"![{s.title}](../benchmarks/results/{s.name}.png)"]
    return "\n".join(out) + "\n"


def readme_with_headline(readme: str) -> str:
    start, end = readme.find(BEGIN), readme.find(END)
    if start < 0 or end < start:
        raise SystemExit(f"report.py: README.md lacks the markers {BEGIN} … {END}")
    return readme[: start + len(BEGIN)] + "\n" + headline_table() + readme[end:]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 if a file is out of date")
    args = ap.parse_args()
    wanted = {DOC: benchmarks_doc(), README: readme_with_headline(README.read_text())}
    stale = [p for p, text in wanted.items() if not p.exists() or p.read_text() != text]
    if args.check:
        for p in stale:
            print(f"{p.relative_to(ROOT)} is not what benchmarks/report.py writes: run it", file=sys.stderr)
        return 1 if stale else 0
    for p in stale:
        p.write_text(wanted[p])
        print(f"wrote {p.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
