"""A Checkpointer's options: one record, validated once, before anything is opened or written.

:class:`Options` is what ``Checkpointer(path, **options)`` accepts; the Lightning callback and IO
plugin build one from their own arguments too, so a bad option fails when the callback is created,
with the same message.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, Literal

from .encode import CodecSpec
from .errors import ConfigError
from .redundancy_config import Parity, Replicas
from .schedule import DEFAULT_MAX_OVERHEAD, DEFAULT_MTBF, parse_every, parse_signals, positive

MiB = 1 << 20


@dataclass(frozen=True)
class Options:
    """How a Checkpointer saves, loads and keeps checkpoints.

    keep_last: keep only the newest N committed steps (None keeps all). The step this run loaded
        from is never deleted.
    keep_every: also keep, for good, every step whose number is a multiple of K (with or without
        ``keep_last``). Retention runs after each commit, in the background.
    local_dir: a fast local directory (NVMe) staged in front of the checkpoint path: chunks are
        written and fsynced there first, then uploaded; restores read a chunk there when its hash
        matches.
    chunk_size: bytes per chunk (default 16 MiB); the unit of dedup, verification and partial reads.
    codec: ``"auto"`` (per chunk the smallest of raw, zstd, byte planes + zstd and an XOR delta
        against the previous save, from a sample; whole saves raw where that is measured to be
        faster), ``"smallest"`` (the same choice, never raw for speed: where bytes cost more than
        time), ``"raw"``, ``"zstd"`` or ``"grouped"`` (byte planes + zstd, always); all but raw
        optionally with a zstd level (``"zstd:3"``).
    delta_chain: with ``codec="auto"`` or ``"smallest"``, the longest chain of chunks a load resolves: a chunk is a
        delta of the one at its place in the previous save, at most ``delta_chain - 1`` deltas in
        a row, then stored whole again (default 8). Deltas keep the previous save in a second host
        buffer (memory: the state's size once more); ``1`` turns both off.
    delta_budget: the most bytes a load reads for one chunk, as a multiple of its raw size (its
        chain: the whole chunk and the deltas on it); a delta that would pass it is stored whole
        instead (default 1.3). Raise it for fewer bytes per save, lower it for faster loads.
    busy: what a save does while the previous one is still writing from the host buffer: ``"wait"``
        for it, or ``"skip"`` this save (logged; the handle says ``skipped``).
    strict: default for ``load``: refuse keys missing on either side.
    allow_pickle: store objects that are not plain values with pickle (off: they are refused).
        Loading such a checkpoint needs ``allow_pickle=True`` too.
    io_threads: threads for hashing, compression and I/O (default: 2 × cores, 8 to 16;
        fsync-bound writes need several in flight to reach the disk's bandwidth).
    storage_options: passed to fsspec for URLs; for ``s3://`` also ckpt's own S3 options
        (``multipart_threshold``, ``multipart_chunksize``, ``upload_concurrency``, ``retry_deadline``,
        ``max_attempts``, ``connect_timeout``, ``read_timeout``).
    timeout: seconds a rank waits for the others (plan, reports, the commit) before the save fails
        with :class:`~ckpt.DistributedSaveError` naming the ranks that did not answer.
    native: use the compiled core when it is built (fused multi-threaded copy + hash on CPU, batched
        device-to-host copies on GPU); ``False`` uses torch's copies (same bytes, same hashes).
    snapshot_threads: threads for the CPU copy + hash (default: cores, at most 8).
    check_finite: refuse a save whose model parameters or optimizer state hold NaN or Inf
        (:class:`~ckpt.NonFiniteStateError`; nothing is committed). ``"all"`` checks every floating
        tensor (buffers and loose tensors too), ``False`` nothing.
    every: the save interval ``should_save(step)`` follows: N steps (an int), a duration
        (``"30min"``, ``"90s"``, ``"2h"``, or a float of seconds) or ``"auto"`` (Young/Daly from the
        measured stall and ``mtbf``, within ``max_overhead``). None: ``should_save`` answers only
        for preemption.
    preemption: install handlers that make ``should_save`` ask for an emergency save when the job is
        told to stop: ``True`` for SIGTERM, or a list of signals (e.g. ``[signal.SIGTERM,
        signal.SIGUSR1]`` on SLURM). The handlers only set a flag.
    mtbf: the mean time between failures, in seconds, ``every="auto"`` plans for (default 4 hours).
    max_overhead: the share of training time saves may stall it under ``every="auto"`` (default 0.02).
    redundancy: protect the local tiers against node loss: :class:`~ckpt.Replicas` ``(r)`` (each
        rank's chunks also go to r-1 ranks in other failure domains) or :class:`~ckpt.Parity`
        ``(data=k, parity=m)`` (Reed-Solomon over groups of k+m ranks; any m lost domains of a group
        are rebuilt). Needs ``local_dir``; every save commits to the local tiers.
    persist_every: upload every N-th save to the checkpoint path (the first save and emergency saves
        always are); the others commit only to the local tiers. Needs ``local_dir``. With
        ``redundancy`` and no ``persist_every``, every save is uploaded.
    failure_domain: what this rank fails together with (default: its host name, shared through the
        process group's store). Replicas and parity never share a domain with what they protect.
    keep_local: how many committed steps each local tier keeps (default 2; it must fit on the local
        disk). ``keep_last`` bounds the checkpoint path's steps.
    """

    keep_last: int | None = None
    keep_every: int | None = None
    local_dir: str | None = None
    chunk_size: int = 16 * MiB
    codec: CodecSpec = field(default_factory=CodecSpec)
    delta_chain: int = 8
    delta_budget: float = 1.3
    busy: Literal["wait", "skip"] = "wait"
    strict: bool = True
    allow_pickle: bool = False
    io_threads: int | None = None
    storage_options: dict[str, Any] | None = None
    timeout: float = 600.0
    native: bool = True
    snapshot_threads: int | None = None
    check_finite: bool | Literal["all"] = True
    every: int | float | str | None = None  # steps (int), seconds (float) or "auto", once built
    preemption: tuple[int, ...] = ()  # signal numbers, once built
    mtbf: float = DEFAULT_MTBF
    max_overhead: float = DEFAULT_MAX_OVERHEAD
    redundancy: Replicas | Parity | None = None
    persist_every: int | None = None
    failure_domain: str | None = None
    keep_local: int = 2

    @classmethod
    def build(cls, **options: Any) -> Options:
        """Check every option (raising :class:`ConfigError` naming the bad one) and normalise them:
        ``codec`` strings are parsed, paths become strings. Example::

            opts = ckpt.Options.build(keep_last=3, codec="zstd:3")     # ConfigError here if one is bad
            ckptr = ckpt.Checkpointer.from_options("runs/exp1", opts)
        """
        unknown = sorted(set(options) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise ConfigError(f"unknown option(s) {unknown}; the options are "
                              f"{', '.join(f.name for f in dataclasses.fields(cls))}")
        o = dict(options)
        db = o.get("delta_budget", 1.3)
        if isinstance(db, bool) or not isinstance(db, (int, float)) or not 1.0 <= db <= 64:
            raise ConfigError(f"delta_budget must be a number from 1 (no deltas on whole chunks that shrank "
                              f"little) to 64, got {db!r}")
        o["delta_budget"] = float(db)
        dc = o.get("delta_chain", 8)
        if type(dc) is not int or not 1 <= dc <= 64:
            raise ConfigError(f"delta_chain must be an integer from 1 (no deltas) to 64, got {dc!r}")
        for name in ("keep_last", "keep_every", "io_threads", "snapshot_threads", "persist_every"):
            v = o.get(name)
            if v is not None and (type(v) is not int or v < 1):
                raise ConfigError(f"{name} must be a positive integer or None, got {v!r}")
        chunk = o.get("chunk_size", 16 * MiB)
        if type(chunk) is not int or not (64 * 1024 <= chunk <= 1 << 31):
            raise ConfigError(f"chunk_size must be an integer between 64 KiB and 2 GiB, got {chunk!r}")
        if o.get("busy", "wait") not in ("wait", "skip"):
            raise ConfigError(f"busy must be 'wait' or 'skip', got {o['busy']!r}")
        timeout = o.get("timeout", 600.0)
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
            raise ConfigError(f"timeout must be a positive number of seconds, got {timeout!r}")
        o["timeout"] = float(timeout)
        codec = o.get("codec", "auto")
        if not isinstance(codec, CodecSpec):
            if not isinstance(codec, str):
                raise ConfigError(f"codec must be a string such as 'auto' or 'zstd:3', got {codec!r}")
            o["codec"] = CodecSpec.parse(codec)
        local_dir = o.get("local_dir")
        if local_dir is not None:
            if not isinstance(local_dir, (str, os.PathLike)):
                raise ConfigError(f"local_dir must be a local directory path, got {local_dir!r}")
            o["local_dir"] = os.fspath(local_dir)
        so = o.get("storage_options")
        if so is not None and not isinstance(so, dict):
            raise ConfigError(f"storage_options must be a dict, got {type(so).__name__}")
        for name in ("strict", "allow_pickle", "native"):
            if name in o:
                o[name] = bool(o[name])
        if o.get("check_finite", True) not in (True, False, "all"):
            raise ConfigError(f"check_finite must be True, False or 'all', got {o['check_finite']!r}")
        if "every" in o:
            o["every"] = parse_every(o["every"])
        if "preemption" in o:
            o["preemption"] = parse_signals(o["preemption"])
        if "mtbf" in o:
            o["mtbf"] = positive("mtbf (seconds)", o["mtbf"])
        if "max_overhead" in o:
            o["max_overhead"] = positive("max_overhead", o["max_overhead"], upper=1.0)
        red = o.get("redundancy")
        if red is not None and not isinstance(red, (Replicas, Parity)):
            raise ConfigError(f"redundancy must be ckpt.Replicas(r) or ckpt.Parity(data=k, parity=m), got {red!r}")
        kl = o.get("keep_local", 2)
        if type(kl) is not int or kl < 1:
            raise ConfigError(f"keep_local must be a positive integer (steps each local tier keeps), got {kl!r}")
        fd = o.get("failure_domain")
        if fd is not None and (not isinstance(fd, str) or not fd):
            raise ConfigError(f"failure_domain must be a non-empty string (e.g. the node's name), got {fd!r}")
        if (red is not None or o.get("persist_every") is not None) and o.get("local_dir") is None:
            what = "redundancy" if red is not None else "persist_every"
            raise ConfigError(f"{what} needs local_dir: every save commits to a local directory (NVMe) on each node, "
                              "and only some are uploaded to the checkpoint path")
        return cls(**o)

    def replace(self, **changes: Any) -> Options:
        """A copy with ``changes`` applied (and checked)."""
        return Options.build(**{**self.as_dict(), **changes})

    def as_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @property
    def tiered_commits(self) -> bool:
        """Whether saves commit to each node's local tier (and only some go to the checkpoint path)."""
        return self.redundancy is not None or self.persist_every is not None

    @property
    def deltas(self) -> bool:
        """Whether saves may store chunks as deltas of the previous save (and keep it in memory)."""
        return self.codec.name in CodecSpec.CHOOSING and self.delta_chain > 1

    @property
    def threads(self) -> int:
        """I/O threads: ``io_threads``, else twice the cores within 8..16."""
        return self.io_threads or min(16, max(8, 2 * (os.cpu_count() or 2)))
