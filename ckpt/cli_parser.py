"""The arguments of the ``ckpt`` command line (``ckpt.cli`` runs the commands): subcommands, options,
their help, and the exit codes ``--help`` documents."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from . import __version__, cli_types
from .console import HelpFormatter

EXIT_CODES = """exit codes:
  0  success (verify: every object is intact)
  1  the checkpoint is missing, damaged or unreadable, or the operation failed (verify, ls --verify: \
something is corrupt or missing; gc: a damaged manifest stopped it; export: the output could not be written)
  2  usage error: bad arguments or options (an export's output exists without --force, --rank out of range)
  3  diff --exit-code: the steps differ"""


def build_parser(commands: dict[str, Callable[[argparse.Namespace], int]]) -> argparse.ArgumentParser:
    """The parser of ``ckpt``; ``commands`` runs each subcommand (``args.func``)."""
    p = argparse.ArgumentParser(
        prog="ckpt", formatter_class=HelpFormatter, epilog=EXIT_CODES,
        description="Look at, check, compare, clean up and export ckpt checkpoints. URL is a directory or "
                    "an fsspec URL. No process group needed; pickled values are never loaded.")
    p.add_argument("--version", action="version", version=f"ckpt {__version__}")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("url", metavar="URL", help="checkpoint directory or fsspec URL (file://, memory://, s3:// …)")
    common.add_argument("--storage-option", action="append", type=cli_types.key_value, metavar="KEY=VALUE",
                        help="fsspec storage option (repeatable); VALUE is parsed as JSON when it can be")
    common.add_argument("--jobs", type=cli_types.positive, default=8, metavar="N", help="parallel reads (default 8)")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(name: str, help: str) -> argparse.ArgumentParser:
        sp = sub.add_parser(name, parents=[common], help=help, description=help, epilog=EXIT_CODES,
                            formatter_class=HelpFormatter)
        sp.set_defaults(func=commands[name])
        return sp

    ls = add("ls", "committed steps with time, world size, raw/stored/new bytes; incomplete and damaged steps")
    ls.add_argument("--verify", action="store_true", help="also re-read and re-hash every chunk")
    ls.add_argument("--local", action="append", metavar="DIR",
                    help="a node's local_dir (repeatable): also list the steps committed only there, and per step "
                         "which tiers hold it and the share of its chunks they hold between them")
    ls.add_argument("--json", action="store_true", help="print one machine-readable JSON document")

    ins = add("inspect", "one step in depth: tensors, shards, codecs, new/reused chunks, values")
    ins.add_argument("--step", type=cli_types.step, help="step to show (default: the latest)")
    ins.add_argument("--keys", action="append", metavar="PATTERN",
                     help="only tensors and values whose key starts with PATTERN, or matches it where it holds * ? "
                          "or [ (repeatable), e.g. --keys model/ --keys '*.bias'; optimizer state matches by its "
                          "parameter's key too")
    ins.add_argument("--tsv", action="store_true",
                     help="tab-separated rows with exact byte counts (default: aligned tables, piped too)")
    ins.add_argument("--json", action="store_true", help="print one machine-readable JSON document")

    ver = add("verify", "re-read and re-hash every chunk of a step; name each corrupt or missing object")
    which = ver.add_mutually_exclusive_group()
    which.add_argument("--step", type=cli_types.step, help="step to verify (default: the latest)")
    which.add_argument("--all", action="store_true", help="verify every committed step")
    ver.add_argument("--json", action="store_true", help="print one machine-readable JSON document")

    dif = add("diff", "which tensors and values changed between two steps")
    dif.add_argument("a", type=cli_types.step, metavar="A", help="first step")
    dif.add_argument("b", type=cli_types.step, metavar="B", help="second step")
    dif.add_argument("--max-diff", action="store_true",
                     help="read changed tensors and report the largest absolute difference")
    dif.add_argument("--exit-code", action="store_true", help="exit 3 when the steps differ")
    dif.add_argument("--json", action="store_true", help="print one machine-readable JSON document")

    gcp = add("gc", "remove orphan chunks, temp files and incomplete steps older than a grace period")
    gcp.add_argument("--dry-run", action="store_true", help="only list what would be removed, with sizes")
    gcp.add_argument("--grace", type=cli_types.duration, default=3600.0, metavar="AGE",
                     help="leave garbage younger than this (a running save may commit it): "
                          "90s, 30m, 1h (default), 2d, 0")
    gcp.add_argument("--keep-last", type=cli_types.positive, metavar="N",
                     help="also delete all but the newest N committed steps (and chunks only they use)")
    gcp.add_argument("--drop-after", type=cli_types.new_step, metavar="STEP",
                     help="also delete every committed step above STEP: those a rollback abandoned (resumed from an "
                          "older step, a run's retention keeps them and names them in a warning)")
    gcp.add_argument("--local", action="append", metavar="DIR",
                     help="also collect a node's local_dir (repeatable), as its own checkpoint: replicas and parity "
                          "blocks of committed steps are kept")
    gcp.add_argument("--keep-local", type=cli_types.positive, metavar="N",
                     help="in each --local tier, keep only the newest N committed steps")
    gcp.add_argument("--json", action="store_true", help="print one machine-readable JSON document")

    gp = add("goodput", "starts, failures, observed MTBF, goodput and badput (stalls, lost work, restart and load), "
                        "from the run journal")
    gp.add_argument("--json", action="store_true", help="print one machine-readable JSON document")
    gp.add_argument("--plot", metavar="FILE.png",
                    help="draw the timeline (each start a bar, saves as ticks, failures and lost work marked) into "
                         "FILE with matplotlib (pip install 'ckpt[plot]'); without it, draw it on the terminal")

    exp = add("export", "write one step as a single unsharded .safetensors or .pt file, Hugging Face shards or a "
                        "plain DCP directory")
    exp.add_argument("--step", type=cli_types.step, help="step to export (default: the latest)")
    exp.add_argument("--to", required=True, metavar="FILE|DIR",
                     help="output file (*.safetensors, *.pt or *.pth) or, with --format hf|dcp, directory")
    exp.add_argument("--format", choices=["safetensors", "pt", "hf", "dcp"],
                     help="hf: model-0000i-of-0000n.safetensors + model.safetensors.index.json (one shard: "
                          "model.safetensors); dcp: a torch.distributed.checkpoint directory; "
                          "default: from FILE's suffix")
    exp.add_argument("--max-shard-size", metavar="SIZE",
                     help="--format hf: largest shard, e.g. 5GB (default), 500MB, 2GiB; a larger tensor gets a "
                          "shard alone")
    exp.add_argument("--dtype", choices=["bf16", "fp16", "fp32"],
                     help="cast floating tensors (float64/32/16, bfloat16) to this dtype; others stay as saved")
    exp.add_argument("--keys", action="append", metavar="PREFIX",
                     help="export only keys starting with PREFIX (repeatable), e.g. --keys model/; --format hf "
                          "without it exports the model's keys (model/, prefix stripped)")
    exp.add_argument("--strip-prefix", action="store_true",
                     help="take the --keys prefix off each name (model/0.weight -> 0.weight), so that "
                          "model.load_state_dict(load_file(FILE)) works as it is")
    exp.add_argument("--config", metavar="FILE|KEY",
                     help="--format hf: the model's config.json to write beside the shards, or the key of the "
                          "model's config saved in the step (default: a 'config' value of the step, if any; "
                          "without one from_pretrained(DIR) would build a default model, and a warning says so)")
    exp.add_argument("--rank", type=int, default=0, metavar="R",
                     help="saved rank whose per-rank state to export (default 0)")
    exp.add_argument("--force", action="store_true",
                     help="overwrite FILE if it exists; write into a non-empty DIR (an earlier export's files are "
                          "replaced, other files kept)")

    imp = sub.add_parser(
        "import", help="bring safetensors, Hugging Face, torch.save or DCP weights in as a committed step",
        description="Import SRC (a .safetensors file, a Hugging Face directory, a torch.save file read with "
                    "weights_only=True, or a plain DCP directory) as step N of the checkpoint at URL, under the "
                    "top-level key --key (default model): a run then loads it with "
                    "ckptr.load(N, {'model': model}, strict=False).", epilog=EXIT_CODES,
        formatter_class=HelpFormatter)
    imp.set_defaults(func=commands["import"])
    imp.add_argument("src", metavar="SRC", help="file or directory to import")
    imp.add_argument("url", metavar="URL", help="checkpoint directory or fsspec URL to save the step into")
    imp.add_argument("--step", type=cli_types.new_step, required=True, metavar="N",
                     help="the step number to commit (must be new)")
    key = imp.add_mutually_exclusive_group()
    key.add_argument("--key", default="model", help="top-level key the imported items go under (default: model)")
    key.add_argument("--top-level", action="store_true",
                     help="keep a torch.save dict's own top-level keys ({'model': ..., 'optim': ...}) as the step's")
    imp.add_argument("--keys", action="append", metavar="PREFIX",
                     help="import only items whose name starts with PREFIX (repeatable), e.g. --keys model.")
    imp.add_argument("--strip-prefix", action="store_true", help="take the --keys prefix off each name")
    imp.add_argument("--max-bytes", metavar="SIZE",
                     help="most bytes of tensors the import may build, e.g. 2GiB (default: 4x the source's bytes, "
                          "and no expand()-ed view larger than its storage)")
    imp.add_argument("--storage-option", action="append", type=cli_types.key_value, metavar="KEY=VALUE",
                     help="fsspec storage option for URL (repeatable)")

    cha = sub.add_parser(
        "chaos", help="kill a training command at random moments, resume it, check nothing was lost",
        description="Run COMMAND once to the end, then again while SIGKILLing it (during saves too) --kills "
                    "times, restarting it after each kill; check that every restart resumed from the newest "
                    "committed step, that this step verifies, and that the final step equals the uninterrupted "
                    "run's bit for bit. {dir} in COMMAND is replaced by the checkpoint directory; COMMAND must "
                    "resume from load('latest') when started again.",
        epilog="example:\n  ckpt chaos --kills 4 -- python examples/train.py --dir {dir} --steps 200\n\n"
               + EXIT_CODES.replace("verify: every object is intact", "chaos: nothing was lost or differs"),
        formatter_class=HelpFormatter)
    cha.set_defaults(func=commands["chaos"])
    cha.add_argument("--kills", type=int, default=3, metavar="N", help="how many times to kill it (default 3)")
    cha.add_argument("--seed", type=int, default=0, help="seed of the kill moments, to replay a run (default 0)")
    cha.add_argument("--timeout", type=cli_types.duration, default=600.0, metavar="T",
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
