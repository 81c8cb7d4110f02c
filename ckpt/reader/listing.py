"""What ``ckpt ls`` and ``ckpt inspect`` show, as typed results (``Reader.ls``, ``Reader.inspect``):
every step of a root (and of nodes' local tiers), or one step in depth. Each result's ``to_json()``
is the command's ``--json`` document."""

from __future__ import annotations

import datetime as dt
import fnmatch
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..errors import CheckpointError, ConfigError
from ..format import manifest as mf
from ..format import paths
from ..format.chunk import is_chunk_hash
from ..tree import GROUPS, preview, strip_pickles, tensor_groups, value_nodes
from .verify import Problem

if TYPE_CHECKING:
    from .core import Reader


def _iso(ts: float) -> str:
    return dt.datetime.fromtimestamp(ts, dt.timezone.utc).isoformat(timespec="seconds").replace("+00:00", "Z")


@dataclass
class StepInfo:
    """One step as ``ckpt ls`` shows it. ``status``: committed, verified (``ls --verify`` re-read
    it), corrupt (a chunk it needs is damaged or missing), damaged (its manifest does not parse),
    incomplete (rank files, no manifest). Sizes are None unless the manifest was read. With local
    tiers, ``remote``, ``local_tiers``, ``local_chunks_held`` and ``where`` say where it is held."""

    step: int
    status: str
    created: str | None = None
    world_size: int | None = None
    tensors: int | None = None
    raw_bytes: int | None = None
    stored_bytes: int | None = None
    new_bytes: int | None = None  # stored size of the chunks no earlier step references
    new_chunks: int | None = None
    chunks: int | None = None  # every chunk a load of the step reads: its tensors' and their delta bases
    tensor_chunks: int | None = None  # the chunks its tensors reference directly (bases not counted)
    written_bytes: int | None = None  # what that save itself wrote
    writer: Any = None
    error: str | None = None
    rank_files: int | None = None
    remote: bool | None = None
    local_tiers: list[str] | None = None
    local_chunks_held: float | None = None  # share of its chunks the local tiers hold between them
    where: str | None = None

    @property
    def readable(self) -> bool:
        return self.status in ("committed", "verified", "corrupt")

    def to_json(self) -> dict:
        d: dict[str, Any] = {"step": self.step, "status": self.status}
        if self.status == "incomplete":
            d["rank_files"] = self.rank_files
        elif self.status == "damaged":
            d.update(error=self.error, rank_files=self.rank_files)
        else:
            d.update(created=self.created, world_size=self.world_size, tensors=self.tensors,
                     raw_bytes=self.raw_bytes, stored_bytes=self.stored_bytes, new_bytes=self.new_bytes,
                     new_chunks=self.new_chunks, chunks=self.chunks, tensor_chunks=self.tensor_chunks,
                     written_bytes=self.written_bytes,
                     writer=self.writer)
        if self.where is not None:
            d.update(remote=self.remote, local_tiers=self.local_tiers)
            if self.local_chunks_held is not None:
                d["local_chunks_held"] = self.local_chunks_held
            d["where"] = self.where
        if self.status == "corrupt":
            d["error"] = self.error
        return d


@dataclass
class Listing:
    """What ``ckpt ls`` shows: every step, ascending, and with ``verify`` the damaged objects."""

    url: str
    steps: list[StepInfo] = field(default_factory=list)
    problems: list[Problem] = field(default_factory=list)
    local: bool = False  # listed with local tiers: each step says where it is held

    @property
    def ok(self) -> bool:
        return not any(s.status in ("damaged", "corrupt") for s in self.steps)

    def to_json(self) -> dict:
        return {"schema": "ckpt-ls/1", "url": self.url, "steps": [s.to_json() for s in self.steps],
                "problems": [p.to_json() for p in self.problems]}


def step_info(reader: Reader, s: int, earlier: set[str]) -> StepInfo:
    """A committed step (``earlier``: the chunks of the steps before it, to count its new ones)."""
    m = reader.find(s)
    if m is None:
        return StepInfo(s, "damaged", error=reader.errors[s], rank_files=len(reader.rank_files(s)))
    new = [h for h in m.chunks if h not in earlier]
    direct = {g.chunk for t in m.tensors for sh in t.shards for g in sh.segments}
    return StepInfo(s, "committed", created=_iso(m.created), world_size=m.world_size, tensors=len(m.tensors),
                    raw_bytes=m.raw_bytes, stored_bytes=m.stored_bytes,
                    new_bytes=sum(m.chunks[h].stored for h in new), new_chunks=len(new), chunks=len(m.chunks),
                    tensor_chunks=len(direct), written_bytes=m.stats.get("written_bytes"), writer=m.writer)


def local_tiers(dirs: Sequence[str]) -> list[Reader]:
    """Each node's ``local_dir`` opened for reading (an empty tier, a replaced node's, is left out)."""
    from ..storage import LocalStorage
    from .core import Reader

    out = []
    for d in dirs:
        if not os.path.isdir(d):
            raise ConfigError(f"--local {d!r}: no such directory (a node's local_dir)")
        try:
            tier = Reader(LocalStorage(d))
        except CheckpointError:  # an empty tier holds nothing
            continue
        tier.url = d  # named as given
        out.append(tier)
    return out


def ls(reader: Reader | None, *, verify: bool = False, local: Sequence[str] = (), tiers: list[Reader] | None = None,
       url: str | None = None, progress: Callable[[int, int], None] | None = None) -> Listing:
    """:meth:`Reader.ls`; ``reader`` None lists the local tiers alone (nothing uploaded yet).
    ``tiers``: the ``local`` directories already opened with :func:`local_tiers`."""
    tiers = local_tiers(local) if tiers is None else tiers
    out = Listing(url if url is not None else reader.url if reader is not None else "", local=bool(local))
    earlier: set[str] = set()
    if reader is not None:
        for s in reader.committed:
            out.steps.append(step_info(reader, s, earlier))
            m = reader.find(s)
            if m is not None:
                earlier |= m.chunks.keys()
        out.steps += [StepInfo(s, "incomplete", rank_files=len(reader.rank_files(s))) for s in reader.incomplete]
    out.steps.sort(key=lambda d: d.step)
    if local:
        out.steps = _where(out.steps, set(reader.committed) if reader is not None else set(), tiers, len(local))
    if verify and reader is not None:
        out.problems = reader.verify(all=True, progress=progress).problems
        bad: dict[int, int] = {}
        for p in out.problems:
            for s in p.steps:
                bad[s] = bad.get(s, 0) + 1
        for d in out.steps:
            if d.step in bad and d.status == "committed":
                d.status, d.error = "corrupt", f"{bad[d.step]} damaged or missing object(s)"
            elif d.status == "committed":
                d.status = "verified"
    return out


def _chunks_held(reader: Reader) -> set[str]:
    """Every chunk a tier holds (one listing per prefix, not a stat per chunk and step)."""
    st = reader.storage
    return {n for p in st.list(paths.CHUNKS) for n in st.list(f"{paths.CHUNKS}/{p}") if is_chunk_hash(n)}


def _where(infos: list[StepInfo], remote: set[int], tiers: list[Reader], n_dirs: int) -> list[StepInfo]:
    """For every step, whether the checkpoint path has it, which local tiers committed it, and the
    share of its chunks the local tiers hold between them (what a restore without the checkpoint
    path can get; parity rebuilds more). Steps only the local tiers have are added."""
    by_step = {d.step: d for d in infos}
    local: dict[int, list[int]] = {}
    for i, tier in enumerate(tiers):
        for s in tier.committed:
            local.setdefault(s, []).append(i)
    for s, holders in local.items():
        if s not in by_step:
            first = tiers[holders[0]]
            by_step[s] = step_info(first, s, first.earlier_chunks(s))
    anywhere = set().union(*(_chunks_held(t) for t in tiers)) if tiers else set()
    for s, d in by_step.items():
        d.remote = s in remote
        d.local_tiers = [tiers[i].storage.describe() for i in local.get(s, [])]
        m = next((m for i in local.get(s, []) if (m := tiers[i].find(s)) is not None), None)
        if m is not None and m.chunks:
            d.local_chunks_held = sum(1 for h in m.chunks if h in anywhere) / len(m.chunks)
        d.where = " + ".join(
            x for x in ("remote" if s in remote else "", f"{len(local.get(s, []))}/{n_dirs} local" if s in local
                        else "") if x) or "-"
        if d.local_chunks_held is not None and s in local:
            d.where += f" ({d.local_chunks_held:.0%} of chunks)"
    return sorted(by_step.values(), key=lambda d: d.step)


# -- inspect ------------------------------------------------------------------------------------------

def tensor_kind(t: mf.TensorEntry) -> str:
    """``per-rank`` (one rank's own tensor), ``sharded`` (saved as boxes of the global tensor), or
    ``tensor`` (saved whole, once)."""
    if t.rank is not None:
        return "per-rank"
    boxes = [s for s in t.shards if math.prod(s.lengths) > 0]
    if len(boxes) == 1 and list(boxes[0].lengths) == list(t.shape):
        return "tensor"
    return "sharded" if boxes else "tensor"


def _tensor_doc(m: mf.Manifest, t: mf.TensorEntry, earlier: set[str], holder: dict[str, int], group: str,
                param: str | None) -> dict:
    """One tensor of step ``m``: its chunks, codecs, ratio (raw ÷ stored, for this step's own chunks;
    a delta's base is not counted) and, for deltas, the steps holding their bases (``holder``: the
    newest earlier step that holds each chunk) and the longest chain a load of it resolves; its
    ``group`` (model, optimizer, other) and, for optimizer state, the key of its ``param``."""
    chunks = list(dict.fromkeys(g.chunk for s in t.shards for g in s.segments))
    new = [h for h in chunks if h not in earlier]
    raw = sum(m.chunks[h].size for h in chunks)
    stored = sum(m.chunks[h].stored for h in chunks)
    bases = {m.chunks[h].base for h in chunks} - {None}
    return {"key": t.key, "rank": t.rank, "group": group, "param": param, "kind": tensor_kind(t), "dtype": t.dtype,
            "shape": t.shape,
            "bytes": t.nbytes,
            "shards": [{"rank": s.rank, "offsets": s.offsets, "lengths": s.lengths,
                        "chunks": list(dict.fromkeys(g.chunk for g in s.segments))} for s in t.shards],
            "chunks": len(chunks), "new_chunks": len(new), "reused_chunks": len(chunks) - len(new),
            "codecs": sorted({m.chunks[h].codec for h in chunks}),
            "ratio": round(raw / stored, 3) if stored else None,
            "base_steps": sorted({holder[b] for b in bases if b in holder}),
            "chain": max((len(mf.chain(m.chunks, h)) for h in chunks), default=0)}


@dataclass
class Inspection:
    """What ``ckpt inspect`` shows of one step: ``summary`` (its ``ls`` row), ``tensors`` (one
    document per tensor: kind, shards, chunks new and reused, codecs, ratio, delta bases, chain),
    ``values`` (key path -> typed JSON node), and the root's other steps for context. ``keys``: the
    patterns they were filtered by (None: all); ``groups``: tensors and bytes of those shown, per
    group (model, optimizer, other), in that order."""

    url: str
    manifest: mf.Manifest
    summary: StepInfo
    tensors: list[dict]
    values: list[tuple[str, Any]]
    committed: list[StepInfo]  # every committed step, without new-byte counts
    incomplete: list[int]
    damaged: dict[int, str]
    keys: list[str] | None = None
    total_tensors: int = 0  # in the step, before the keys filter

    @property
    def groups(self) -> list[dict]:
        out = []
        for g in GROUPS:
            mine = [t for t in self.tensors if t["group"] == g]
            if mine:
                out.append({"group": g, "tensors": len(mine), "bytes": sum(t["bytes"] for t in mine)})
        return out

    def to_json(self) -> dict:
        m = self.manifest
        steps = []
        for d in self.committed:
            doc = d.to_json()
            doc.pop("new_bytes", None), doc.pop("new_chunks", None)
            steps.append(doc)
        return {"schema": "ckpt-inspect/1", "path": self.url, "format_version": m.format_version,
                "steps": [d for d in steps if d["status"] == "committed"],
                "incomplete_steps": self.incomplete,
                "damaged_steps": {str(s): e for s, e in self.damaged.items()},
                "detail": {**self.summary.to_json(), "per_rank_keys": m.per_rank_keys, "keys": self.keys,
                           "groups": self.groups, "tensors": self.tensors,
                           "values": {p: preview(n) for p, n in self.values},
                           "value_nodes": {p: strip_pickles(n) for p, n in self.values}}}


def key_matcher(keys: Sequence[str] | None) -> Callable[[str], bool]:
    """Does a key match any of ``keys``: a glob where it has ``*``, ``?`` or ``[``, else a prefix."""
    if not keys:
        return lambda key: True
    globs = [k for k in keys if any(c in k for c in "*?[")]
    prefixes = tuple(k for k in keys if k not in globs)
    return lambda key: key.startswith(prefixes) or any(fnmatch.fnmatchcase(key, g) for g in globs)


def inspect(reader: Reader, step: int, keys: Sequence[str] | None = None) -> Inspection:
    """:meth:`Reader.inspect`. ``keys``: only the tensors whose key (or, for optimizer state, whose
    parameter's key) and the values whose path match one of them, globs or prefixes."""
    m = reader.manifest(step)
    match = key_matcher(keys)
    groups, params = tensor_groups(m.structure)
    shown = [t for t in m.tensors if match(t.key) or (t.key in params and match(params[t.key]))]
    values = [(p, n) for p, n in value_nodes(m.structure) if match(p)]
    if keys and not shown and not values:
        raise ConfigError(f"--keys {' '.join(keys)}: no tensor or value of step {step} matches (a prefix such as "
                          "model/, or a glob such as '*.bias'; ckpt inspect without --keys lists them all)")
    earlier = reader.earlier_chunks(step)
    summary = step_info(reader, step, earlier)
    holder = reader.chunk_holders(step)
    committed = [step_info(reader, s, set()) for s in reader.committed]
    docs = [_tensor_doc(m, t, earlier, holder, groups.get(t.key, "other"), params.get(t.key)) for t in shown]
    return Inspection(reader.url, m, summary, docs, values, committed, list(reader.incomplete), dict(reader.errors),
                      list(keys) if keys else None, len(m.tensors))
