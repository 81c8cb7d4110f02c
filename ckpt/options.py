"""A Checkpointer's options: records, each option declared once with its default and its check.

Every option is a field of one of the small frozen records below, grouped as a user thinks of them
(what is kept, how chunks are encoded, when to save, ...); :class:`Options` is all of them at once,
so ``options.keep_last`` reads as before and ``options.retention`` gives the group. A field's check
sits next to its default (``_option(default, check)``) and runs in ``__post_init__``, so a bad value
fails when the record is made, with a :class:`~ckpt.errors.ConfigError` naming the option.

``Checkpointer(path, **options)``, :meth:`Options.build` and the Lightning callback and IO plugin all
take the same keyword names, the fields of :class:`Options`; :class:`OptionArgs` is their typing for
``**options``.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, TypedDict, TypeVar

from . import _cpus
from . import host_memory as _host_memory
from . import option_checks as chk
from . import options_doc as _docs
from .errors import ConfigError
from .redundancy_config import Parity, Replicas
from .save.encode import CodecSpec
from .schedule import (
    DEFAULT_MAX_OVERHEAD,
    DEFAULT_MTBF,
    DEFAULT_PREEMPTION_DEADLINE,
    parse_every,
    parse_signals,
)

if TYPE_CHECKING:
    from .storage.base import Storage
    from .storage.tiered import TieredStorage

MiB = 1 << 20
T = TypeVar("T")
Check = Callable[[str, Any], Any]  # (option name, value as given) -> value as kept, or ConfigError


def _option(default: T, check: Check, doc: str, *, shown: str | None = None) -> T:
    """A field with its default, its check and its meaning (markdown), declared together; ``shown`` is how the
    docs write the default when ``repr`` would not say it well."""
    return field(default=default, metadata={"check": check, "doc": doc, "shown": shown})


@dataclass(frozen=True)
class _Record:
    """Runs every field's check once, when the record is made, and keeps the value it returns."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            check = f.metadata.get("check")
            if check is not None:
                object.__setattr__(self, f.name, check(f.name, getattr(self, f.name)))


# -- the groups: each option's meaning is written once, here, next to its default and check -------------------
# (Options.__doc__ and the option table of docs/api.md are made from these: ``python -m ckpt.options_doc``.)

@dataclass(frozen=True)
class RetentionOptions(_Record):
    """Which committed steps are kept: ``keep_last``, ``keep_every`` (the checkpoint path) and ``keep_local``
    (each node's local tier); ``shared_root``: whether other jobs may save into the same root."""

    keep_last: int | None = _option(
        None, chk.count,
        "keep the newest N committed steps; older steps and chunks only they use are deleted in the background. "
        "Counted back from the step just committed, which is never deleted; nor is the step this run loaded from, "
        "nor one another open Checkpointer (in any process) loaded from. After a rollback (`load(10)` with a step 20 "
        "present, then `save(11)`), steps newer than the one just committed are abandoned: retention keeps them and "
        "names them in a warning, and `load(\"latest\")` would still pick them; remove them with "
        "`ckpt gc URL --drop-after 11`. `None` keeps every step")
    keep_every: int | None = _option(
        None, chk.count,
        "also keep, for good, every step whose number is a multiple of K (alone: the newest step plus the multiples)")
    keep_local: int = _option(
        2, chk.int_in(1, 1 << 30, "of at least 1 (steps each local tier keeps)"),
        "committed steps each local tier keeps (they must fit on the local disk); `keep_last` bounds the "
        "checkpoint path's")
    shared_root: bool = _option(
        False, chk.flag,
        "let other jobs save into the same root at the same time (default `False`: the first save refuses with "
        "`RootInUseError`, naming the other job's host, pid and since when, while another job holds a live writer "
        "lease there). A job killed on this host does not block its restart (its lease dies with its process); one "
        "killed on another host holds its lease until it lapses (at most 90 s). With `True` the jobs' steps "
        "interleave and each one's `keep_last` counts the other's steps too")


@dataclass(frozen=True)
class EncodingOptions(_Record):
    """How the host buffer becomes stored chunks: ``codec``, ``chunk_size``, ``delta_chain``, ``delta_budget``."""

    codec: CodecSpec = _option(
        CodecSpec(), chk.codec,
        "`\"auto\"`: per chunk the smallest of raw, zstd, byte planes (each entropy-coded or zstd; behind a zero mask "
        "where most elements are zero) and an XOR delta against the previous save, chosen from a 128 KiB sample by "
        "content alone (see [Deltas](#deltas-fewer-bytes-per-save)); `\"smallest\"`: the same; `\"raw\"`; "
        "`\"zstd\"` or `\"grouped\"` "
        "(byte planes) always; all but raw optionally `\":<level>\"` (zstd's level, e.g. `\"zstd:3\"`)",
        shown='"auto"')
    chunk_size: int = _option(
        16 * MiB, chk.int_in(64 * 1024, 1 << 31, "between 64 KiB and 2 GiB"),
        "bytes per chunk (64 KiB to 2 GiB): the unit of dedup, hashing and partial reads", shown="16 MiB")
    delta_chain: int = _option(
        8, chk.int_in(1, 64, "from 1 (no deltas) to 64"),
        "with `codec=\"auto\"` or `\"smallest\"`: the most chunks a load resolves for one chunk (one stored whole, "
        "then deltas of the chunk at its place in the previous save). Deltas keep the previous save in a second "
        "host buffer (the state's size once more); `1` turns both off")
    delta_budget: float = _option(
        1.0, chk.number_in(1.0, 64.0, "from 1 (no deltas on whole chunks that shrank little) to 64"),
        "the most bytes a load reads for one chunk, as a multiple of its size (the whole chunk and its deltas); a "
        "delta that would pass it is stored whole instead. The default: a load never reads more than a raw load "
        "would; raise it for fewer bytes per save on dense training (`1.3`: about 15% fewer on trained fp32, "
        "loads reading up to 1.3x)")


@dataclass(frozen=True)
class ScheduleOptions(_Record):
    """When to save: ``every``, ``preemption``, ``mtbf``, ``max_overhead``, ``preemption_deadline``."""

    every: int | float | str | None = _option(
        None, lambda _, v: parse_every(v),
        "the interval `should_save(step)` follows: N steps (an int), a duration (`\"30s\"`, `\"30min\"`, "
        "`\"1h30min\"`, seconds as a float) or `\"auto\"` (Young/Daly from the measured stall, `mtbf` and "
        "`max_overhead`); `None`: `should_save` answers only for preemption")
    preemption: tuple[int, ...] = _option(
        (), lambda _, v: parse_signals(v),
        "`True` installs handlers for SIGTERM, or a list of signals (`[signal.SIGUSR1]` for SLURM), that make "
        "`should_save` ask every rank for an emergency save; the handlers only set a flag, and that the signal "
        "arrived is logged at once", shown="False")
    mtbf: float = _option(
        DEFAULT_MTBF, chk.seconds,
        "mean time between failures in seconds that `every=\"auto\"` plans for (default 4 h); once the run journal "
        "holds two failures, blended with the rate observed ([Goodput](#goodput-what-failures-cost-a-run))")
    max_overhead: float = _option(
        DEFAULT_MAX_OVERHEAD, chk.share,
        "the share of training time saves may stall it under `every=\"auto\"`")
    preemption_deadline: float = _option(
        DEFAULT_PREEMPTION_DEADLINE, chk.seconds,
        "seconds after a preemption signal for the loop to reach `should_save()` (default 10, a third of the usual "
        "30 s grace); past it ckpt finishes the saves in flight and passes the signal on to the handler it would "
        "have had without ckpt (by default the process ends), rather than keep the job running until the "
        "scheduler's SIGKILL. See [When things go wrong](#when-things-go-wrong)")


@dataclass(frozen=True)
class RedundancyOptions(_Record):
    """Surviving node loss with local commits: ``redundancy``, ``persist_every``, ``failure_domain``."""

    redundancy: Replicas | Parity | None = _option(
        None, chk.redundancy,
        "protect the local tiers against node loss: `ckpt.Replicas(r)` (each rank's chunks also on r−1 ranks in "
        "other failure domains) or `ckpt.Parity(data=k, parity=m)` (Reed–Solomon over groups of k+m ranks; any m "
        "lost domains of a group are rebuilt); needs `local_dir`, and every save commits to the local tiers")
    persist_every: int | None = _option(
        None, chk.count,
        "upload every N-th save to `path` (the first and emergency saves always are); the others commit only to "
        "the local tiers. Needs `local_dir`; with `redundancy` and no `persist_every`, every save is uploaded")
    failure_domain: str | None = _option(
        None, chk.domain,
        "what this rank fails together with (default: its host name, shared through the process group's store); "
        "replicas and parity never share a domain with what they protect")


@dataclass(frozen=True)
class IOOptions(_Record):
    """Where and how bytes move: ``local_dir``, ``storage_options``, ``io_threads``, ``timeout``, ``host_memory``,
    ``direct_io``."""

    local_dir: str | None = _option(
        None, chk.directory,
        "a fast local directory (NVMe) staged in front of `path`: chunks are written and fsynced there first, then "
        "uploaded; restores read a chunk there when its hash matches. Beside `path`: a `local_dir` that is `path`, "
        "lies inside it or holds it is a `ConfigError` (each tier would take the other's files for its own); see "
        "[Object storage and tiers](#object-storage-and-tiers)")
    storage_options: dict[str, Any] | None = _option(
        None, chk.mapping,
        "passed to fsspec/s3fs (credentials, `client_kwargs={\"endpoint_url\": …}`), plus ckpt's own S3 options "
        "(`multipart_threshold`, `multipart_chunksize`, `upload_concurrency`, `retry_deadline`, `max_attempts`, "
        "`connect_timeout`, `read_timeout`: see [Object storage and tiers](#object-storage-and-tiers))")
    io_threads: int | None = _option(
        None, chk.count,
        "threads for hashing, compression and I/O (default: 2 × cores, 8 to 16; fsync-bound writes need several "
        "in flight to reach the disk's bandwidth)")
    timeout: float = _option(
        600.0, chk.seconds,
        "seconds without progress after which the coordinator gives up on the ranks that did not answer (plan, "
        "reports, load agreement): the save or load fails on every rank with `DistributedSaveError` naming them; a "
        "wait is extended while other ranks' answers keep arriving, and the other ranks wait for the coordinator "
        "twice this plus 10 ms per rank (longer while it makes progress) before naming rank 0", shown="600")
    host_memory: int | float | None = _option(
        None, _host_memory.check,
        "the host memory one rank may hold for staging: bytes (an int, at least 1 MiB) or a share of the machine's "
        "memory (a float in (0, 1]) split among the node's ranks. It caps a save's snapshot (a larger state is "
        "copied in pieces through two slabs of half of it) and a load's staging (a load that needs more reads in "
        "windows, in two passes, still atomic): [Host memory](#host-memory); `None`: no cap")
    direct_io: bool = _option(
        True, chk.flag,
        "write chunk objects of 1 MiB or more to a local directory (the checkpoint path or `local_dir`) with "
        "`O_DIRECT`, around the page cache: a save then costs the kernel little CPU beside training and evicts "
        "none of its page cache (through the page cache, the same bytes cost 7-40x the CPU on the machine "
        "measured: [Durable writes](#durable-writes-around-the-page-cache)). A file system that refuses `O_DIRECT` "
        "is written through the page cache. `False`: always through it, so a load straight after a save reads "
        "from memory. `local_dir` is always written around it")


@dataclass(frozen=True)
class SnapshotOptions(_Record):
    """The copy into the host buffer and what a save does when it cannot go on: ``busy``, ``native``,
    ``snapshot_threads``, ``check_finite``, ``on_save_error``."""

    busy: Literal["wait", "skip"] = _option(
        "wait", chk.one_of("wait", "skip"),
        "a save asked while the previous one is still writing from the buffer: `\"wait\"` for it, or `\"skip\"` "
        "it (logged; `handle.skipped`)")
    on_save_error: Literal["raise", "log"] = _option(
        "raise", chk.one_of("raise", "log"),
        "a save that failed in the background: `\"raise\"` its error at the next `save()` (which saves nothing; "
        "call it again to retry), or at `wait()`/`close()` if they come first, and said once (raised, not also "
        "logged as an error); `\"log\"`: logged when it happens, training goes on, `close()` raises the first one "
        "nobody looked at through its handle")
    native: bool = _option(
        True, chk.flag,
        "use the compiled core when it is built (fused multi-threaded copy + hash on CPU, batched device-to-host "
        "copies on GPU; see [Compiled core](#compiled-core-and-gpu-snapshots)); `False` uses torch's copies: same "
        "bytes, same hashes")
    snapshot_threads: int | None = _option(
        None, chk.count, "threads for the CPU copy + hash inside `save()` (default: cores, at most 8)")
    check_finite: bool | Literal["all"] = _option(
        True, chk.one_of(True, False, "all"),
        "refuse a save whose model parameters, optimizer state or optimizer settings (`lr`, `betas`, … in "
        "`param_groups`) hold NaN or Inf (`NonFiniteStateError`, nothing committed); `\"all\"` checks every "
        "floating tensor (buffers and loose tensors too), `False` nothing. See "
        "[When things go wrong](#when-things-go-wrong)")


@dataclass(frozen=True)
class ValueOptions(_Record):
    """What a save may store and a load expects: ``allow_pickle``, ``reduce_partial``, ``strict``,
    ``staged_load``."""

    allow_pickle: bool = _option(
        False, chk.flag,
        "store objects that are not plain values with pickle (off: they are refused with "
        "`UnsupportedValueError`); loading them then needs `allow_pickle=True` too")
    reduce_partial: bool = _option(
        False, chk.flag,
        "a save reduces a DTensor with a `Partial` placement (a pending sum) to `Replicate` on that mesh dimension "
        "first (a collective: every rank of the mesh saves); off: it is refused before anything is written, saying "
        "how to reduce it ([layouts](#dtensor-placements-and-layouts))")
    strict: bool = _option(
        True, chk.flag,
        "default for `load`: refuse keys missing on either side, and optimizer state saved by another kind of "
        "optimizer (AdamW into SGD). With `strict=False` such an optimizer takes the saved per-parameter state and "
        "keeps its own hyperparameters (`param_groups`: `lr`, `momentum`, …; set them from "
        "`ckpt.open(path).values(step)` to take the saved ones)")
    staged_load: bool = _option(
        True, chk.flag,
        "a load reads and verifies every chunk into staging memory (the idle host buffer when it is large enough, "
        "else memory held for the load) before it writes any tensor: a load that fails changes nothing. `False` "
        "reads straight into the CPU tensors (one copy and that memory less; a damaged chunk then leaves a mixture "
        "of two steps, and saves are refused until a load succeeds: `PartialStateError`)")


# The arguments of ``Checkpointer(path, ...)`` that are not options (they are objects, not settings), documented
# here so the option table lists them too: (shown default, meaning).
CHECKPOINTER_ARGS: dict[str, tuple[str, str]] = {
    "process_group": (
        "None",
        "the ranks that save together; default: the default group when `torch.distributed` is initialised, else "
        "this process alone"),
    "storage": (
        "None",
        "an opened storage (`ckpt.storage.base.Storage`, or a tiered one) used instead of opening `path`, e.g. "
        "`ckpt.testing.FaultyStorage` in a test; not together with `local_dir` or `storage_options`"),
}


_GROUPS: tuple[type[_Record], ...] = (RetentionOptions, EncodingOptions, ScheduleOptions, RedundancyOptions,
                                      IOOptions, SnapshotOptions, ValueOptions)
G = TypeVar("G", bound=_Record)


@dataclass(frozen=True)
class Options(ValueOptions, SnapshotOptions, IOOptions, RedundancyOptions, ScheduleOptions, EncodingOptions,
              RetentionOptions):
    """How a Checkpointer saves, loads and keeps checkpoints (the meaning of each option: below, made from
    the fields' own documentation by :mod:`ckpt.options_doc`)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.local_commits and self.local_dir is None:
            what = "redundancy" if self.redundancy is not None else "persist_every"
            raise ConfigError(f"{what} needs local_dir: every save commits to a local directory (NVMe) on each node, "
                              "and only some are uploaded to the checkpoint path")

    @classmethod
    def build(cls, **options: Any) -> Options:
        """Check every option and normalise them: ``codec`` strings are parsed, paths become strings. Example::

            opts = ckpt.Options.build(keep_last=3, codec="zstd:3")     # ConfigError here if one is bad
            ckptr = ckpt.Checkpointer.from_options("runs/exp1", opts)

        Args:
            **options: options by name (the fields of :class:`Options`).

        Returns:
            Options: checked.

        Raises:
            ConfigError: an unknown option, or a bad value (it names the option).
        """
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(options) - set(names))
        if unknown:
            raise ConfigError(f"unknown option(s) {unknown}; the options are {', '.join(names)}")
        return cls(**options)

    def replace(self, **changes: Any) -> Options:
        """A copy with ``changes`` applied.

        Args:
            **changes: options by name.

        Returns:
            Options: checked, as :meth:`build` checks.
        """
        return Options.build(**{**self.as_dict(), **changes})

    def as_dict(self) -> dict[str, Any]:
        """Every option by name.

        Returns:
            dict[str, Any]: what ``Options.build(**d)`` takes back.
        """
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def _group(self, kind: type[G]) -> G:
        return kind(**{f.name: getattr(self, f.name) for f in dataclasses.fields(kind)})

    @property
    def retention(self) -> RetentionOptions:
        """``keep_last``, ``keep_every``, ``keep_local``."""
        return self._group(RetentionOptions)

    @property
    def encoding(self) -> EncodingOptions:
        """``codec``, ``chunk_size``, ``delta_chain``, ``delta_budget``."""
        return self._group(EncodingOptions)

    @property
    def schedule(self) -> ScheduleOptions:
        """``every``, ``preemption``, ``mtbf``, ``max_overhead``, ``preemption_deadline``."""
        return self._group(ScheduleOptions)

    @property
    def node_loss(self) -> RedundancyOptions:
        """``redundancy``, ``persist_every``, ``failure_domain``."""
        return self._group(RedundancyOptions)

    @property
    def io(self) -> IOOptions:
        """``local_dir``, ``storage_options``, ``io_threads``, ``timeout``, ``host_memory``, ``direct_io``."""
        return self._group(IOOptions)

    @property
    def snapshot(self) -> SnapshotOptions:
        """``busy``, ``native``, ``snapshot_threads``, ``check_finite``, ``on_save_error``."""
        return self._group(SnapshotOptions)

    @property
    def values(self) -> ValueOptions:
        """``allow_pickle``, ``strict``, ``staged_load``."""
        return self._group(ValueOptions)

    @property
    def local_commits(self) -> bool:
        """Whether saves commit to each node's local tier (and only some go to the checkpoint path)."""
        return self.redundancy is not None or self.persist_every is not None

    @property
    def deltas(self) -> bool:
        """Whether saves may store chunks as deltas of the previous save (and keep it in memory)."""
        return self.codec.name in CodecSpec.CHOOSING and self.delta_chain > 1

    @property
    def threads(self) -> int:
        """I/O threads: ``io_threads``, else twice the cores within 8..16."""
        return self.io_threads or min(16, max(8, 2 * _cpus.usable()))


Options.__doc__ = _docs.docstring(Options.__doc__ or "", list(dataclasses.fields(Options)))


class OptionArgs(TypedDict, total=False):
    """The keyword arguments of ``Checkpointer(path, **options)`` as a caller writes them (the fields of
    :class:`Options`, before their checks normalise them); a test keeps the two lists equal."""

    keep_last: int | None
    keep_every: int | None
    keep_local: int
    shared_root: bool
    codec: str | CodecSpec
    chunk_size: int
    delta_chain: int
    delta_budget: float
    every: int | float | str | None
    preemption: bool | Sequence[int]
    mtbf: float
    max_overhead: float
    preemption_deadline: float
    redundancy: Replicas | Parity | None
    persist_every: int | None
    failure_domain: str | None
    local_dir: str | os.PathLike | None
    storage_options: dict[str, Any] | None
    io_threads: int | None
    timeout: float
    host_memory: int | float | None
    direct_io: bool
    busy: Literal["wait", "skip"]
    on_save_error: Literal["raise", "log"]
    native: bool
    snapshot_threads: int | None
    check_finite: bool | Literal["all"]
    allow_pickle: bool
    reduce_partial: bool
    strict: bool
    staged_load: bool


def check_storage(storage: Storage | TieredStorage | None, options: Options) -> None:
    """``storage=`` replaces opening one from the path, so the options that say how to open it must not be given."""
    if storage is None:
        return
    given = [name for name in ("local_dir", "storage_options") if getattr(options, name) is not None]
    if given:
        raise ConfigError(f"storage= is an opened storage; {' and '.join(given)} would open another: give one or "
                          "the other")
