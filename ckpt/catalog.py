"""What a checkpoint directory holds, read from the outside: its steps and their manifests, which
chunks each step shares with earlier ones, the plain values, whole tensors, a full verification
and the difference between two steps.

Everything here reads manifests as JSON and chunks as bytes: it needs no process group and never
unpickles (pickled values are described, never loaded). The ``ckpt`` command line is built on it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field

import torch

from . import tree as st
from .errors import CheckpointNotFoundError, CorruptCheckpointError, NotACheckpointError
from .format import chains, paths
from .format import manifest as mf
from .format.planes import trim_scratch
from .loader import load_into
from .storage import Storage
from .tree import DTYPES


class Catalog:
    """The steps of one checkpoint and their parsed manifests (each read at most once).

    ``committed`` are the steps with a ``MANIFEST.json`` (ascending), ``incomplete`` the step
    directories without one (a save in progress, or one that never committed)."""

    def __init__(self, storage: Storage):
        self.storage = storage
        if storage.root_state() in ("missing", "file"):
            raise NotACheckpointError(f"{storage.describe()}: no such checkpoint directory")
        self.committed = mf.committed_steps(storage)
        self.incomplete = [s for s in mf.step_candidates(storage) if s not in set(self.committed)]
        if not self.committed and not self.incomplete and not storage.list(paths.CHUNKS):
            raise NotACheckpointError(f"{storage.describe()} holds no ckpt checkpoint (no steps, no chunks)")
        self.manifests = mf.ManifestCache(storage)

    @property
    def errors(self) -> dict[int, str]:
        """Committed steps whose manifest cannot be read, and why (filled as manifests are read)."""
        return self.manifests.errors

    def manifest(self, step: int) -> mf.Manifest | None:
        """The parsed manifest of a committed step, or None if it is damaged (see ``errors``)."""
        return self.manifests.find(step)

    def require(self, step: int) -> mf.Manifest:
        """The manifest of ``step``; raises if it is not committed or does not parse."""
        if step not in self.committed:
            raise CheckpointNotFoundError(
                f"step {step} is not committed in {self.storage.describe()}; committed: "
                f"{', '.join(map(str, self.committed)) or 'none'}")
        m = self.manifest(step)
        if m is None:
            raise CorruptCheckpointError(f"step {step} is damaged: {self.errors[step]}",
                                         object=paths.manifest_key(step))
        return m

    def resolve(self, step: int | str | None) -> int:
        """A step number from the command line: an integer, or None / "latest" for the newest."""
        if step is None or step == "latest":
            if not self.committed:
                raise CheckpointNotFoundError(f"{self.storage.describe()} has no committed step")
            return self.committed[-1]
        return int(step)

    def earlier_chunks(self, step: int) -> set[str]:
        """Chunks referenced by committed steps before ``step`` (damaged manifests count for nothing).

        A chunk of ``step`` is *new* if it is not in this set, *reused* otherwise."""
        out: set[str] = set()
        for s in self.committed:
            if s >= step:
                break
            m = self.manifest(s)
            if m is not None:
                out |= m.chunks.keys()
        return out

    def chunk_holders(self, step: int) -> dict[str, int]:
        """For every chunk of the committed steps before ``step``, the newest of them holding it."""
        out: dict[str, int] = {}
        for s in self.committed:
            if s >= step:
                break
            m = self.manifest(s)
            if m is not None:
                out.update(dict.fromkeys(m.chunks, s))
        return out

    def rank_files(self, step: int) -> list[str]:
        return [n for n in self.storage.list(paths.step_dir(step)) if n.startswith("rank-") and n.endswith(".json")]


# -- tensors ------------------------------------------------------------------------------------------

def tensor_kind(t: mf.TensorEntry) -> str:
    """``per-rank`` (one rank's own tensor), ``sharded`` (saved as boxes of the global tensor), or
    ``tensor`` (saved whole, once)."""
    if t.rank is not None:
        return "per-rank"
    boxes = [s for s in t.shards if math.prod(s.lengths) > 0]
    if len(boxes) == 1 and list(boxes[0].lengths) == list(t.shape):
        return "tensor"
    return "sharded" if boxes else "tensor"


def read_tensors(storage: Storage, m: mf.Manifest, entries: list[mf.TensorEntry], io: ThreadPoolExecutor,
                 ) -> list[torch.Tensor]:
    """Whole global tensors for ``entries`` of manifest ``m``: every shard is read, verified and
    placed (resharding to one process). Per-rank entries give that rank's tensor."""
    names = [f"t{i}" for i in range(len(entries))]
    view = mf.Manifest(step=m.step, kind="step", world_size=1, chunks=m.chunks,
                       structure=st.dict_node(list(names), [st.tensor_node(n) for n in names]),
                       tensors=[mf.TensorEntry(n, e.dtype, list(e.shape), e.shards) for n, e in zip(names, entries)])
    state = {n: torch.empty(tuple(e.shape), dtype=DTYPES[e.dtype]) for n, e in zip(names, entries)}
    load_into(storage, view, state, strict=True, allow_pickle=False, io=io)
    return [state[n] for n in names]


# -- verification -------------------------------------------------------------------------------------

@dataclass
class Problem:
    """One damaged or missing object and the committed steps that reference it."""

    object: str
    kind: str  # "missing", "corrupt" or "unreadable"
    message: str
    steps: list[int]
    chunk: str | None = None

    def to_json(self) -> dict:
        return {"object": self.object, "kind": self.kind, "chunk": self.chunk, "steps": self.steps,
                "message": self.message}


@dataclass
class VerifyResult:
    steps: list[int]
    chunks: int = 0
    bytes: int = 0
    problems: list[Problem] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def verify(catalog: Catalog, steps: Iterable[int], *, threads: int = 8,
           progress: Callable[[int, int], None] | None = None) -> VerifyResult:
    """Re-read and re-hash every chunk the given committed steps reference (each chunk once, in
    parallel). ``progress(chunks_done, bytes_done)`` is called from this thread as chunks finish."""
    steps = list(steps)
    result = VerifyResult(steps=steps)
    refs: dict[str, tuple[mf.ChunkInfo, list[int]]] = {}
    for s in steps:
        m = catalog.manifest(s)
        if m is None:
            result.problems.append(Problem(paths.manifest_key(s), "corrupt", catalog.errors[s], [s]))
            continue
        for h, info in m.chunks.items():
            refs.setdefault(h, (info, []))[1].append(s)

    table = {h: info for h, (info, _) in refs.items()}
    roots, children = chains.trees(table, table)

    def problem(h: str, err: Exception) -> Problem:
        key = paths.chunk_key(h)
        if isinstance(err, chains.MissingChunkError):
            return Problem(key, "missing", str(err), [], h)
        if isinstance(err, CorruptCheckpointError):
            return Problem(key, "corrupt", str(err), [], h)
        return Problem(key, "unreadable", str(err), [], h)

    def check(root: str) -> list[tuple[str, int, Problem | None]]:
        # a chunk stored whole and the deltas made on it, each read once, each link verified
        out: list[tuple[str, int, Problem | None]] = []
        chains.walk(catalog.storage, table, root, children,
                    lambda h, n, err: out.append((h, n, problem(h, err) if err is not None else None)))
        return out

    done = 0
    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="ckpt-verify") as pool:
        for fut in as_completed([pool.submit(check, r) for r in roots]):
            for h, n, prob in fut.result():
                done += 1
                result.bytes += n
                if prob is not None:
                    prob.steps = refs[h][1]
                    result.problems.append(prob)
            if progress is not None:
                progress(done, result.bytes)
    trim_scratch()
    result.chunks = len(refs)
    result.problems.sort(key=lambda p: (p.steps[0] if p.steps else -1, p.object))
    return result


# -- difference between two steps --------------------------------------------------------------------

@dataclass
class TensorChange:
    key: str
    rank: int | None
    status: str  # "added", "removed", "changed", "same"
    how: str  # how it was decided: "hashes", "bytes", "shape" (dtype or shape differ), "-"
    detail: str = ""
    max_abs_diff: float | None = None

    @property
    def name(self) -> str:
        return self.key + (f" [rank {self.rank}]" if self.rank is not None else "")


def _by_hashes(a: mf.TensorEntry, ma: mf.Manifest, b: mf.TensorEntry, mb: mf.Manifest) -> bool | None:
    """True/False when chunk hashes decide whether two saved tensors hold the same bytes, None
    when they cannot (different shard layouts, or chunks shared with other tensors that differ)."""
    def shards(e):
        return sorted((s for s in e.shards if math.prod(s.lengths) > 0), key=lambda s: (s.offsets, s.lengths))
    sa, sb = shards(a), shards(b)
    if [(s.offsets, s.lengths) for s in sa] != [(s.offsets, s.lengths) for s in sb]:
        return None
    undecided = False
    for x, y in zip(sa, sb):
        gx = [(g.chunk, g.offset, g.length) for g in x.segments]
        gy = [(g.chunk, g.offset, g.length) for g in y.segments]
        if gx == gy:
            continue
        # A chunk that holds nothing but this piece of the tensor: equal hash <=> equal bytes.
        whole_x = all(g.offset == 0 and g.length == ma.chunks[g.chunk].size for g in x.segments)
        whole_y = all(g.offset == 0 and g.length == mb.chunks[g.chunk].size for g in y.segments)
        if whole_x and whole_y and [g[2] for g in gx] == [g[2] for g in gy]:
            return False
        undecided = True
    return None if undecided else True


def _max_abs_diff(x: torch.Tensor, y: torch.Tensor) -> float:
    if x.numel() == 0:
        return 0.0
    if x.is_complex():
        d = (x.to(torch.complex128) - y.to(torch.complex128)).abs()
    else:
        d = (x.to(torch.float64) - y.to(torch.float64)).abs()
    return float(d.max())


def _same_bytes(x: torch.Tensor, y: torch.Tensor) -> bool:
    return torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8))


def diff(catalog: Catalog, a: int, b: int, *, max_diff: bool = False, threads: int = 8
         ) -> tuple[list[TensorChange], list[tuple[str, str, str]]]:
    """Tensors and plain values that differ between steps ``a`` and ``b``.

    Tensors are compared by chunk hashes where those decide it, else by reading their bytes
    (small tensors packed with others, or a different shard layout). With ``max_diff`` every
    changed tensor of the same shape and dtype is read to report its largest absolute difference.
    Returns (tensor changes, [(value path, preview in a, preview in b)] for values that differ)."""
    ma, mb = catalog.require(a), catalog.require(b)
    ea = {(t.key, t.rank): t for t in ma.tensors}
    eb = {(t.key, t.rank): t for t in mb.tensors}
    changes: list[TensorChange] = []
    to_read: list[TensorChange] = []
    for k in sorted(ea.keys() | eb.keys(), key=lambda k: (k[0], -1 if k[1] is None else k[1])):
        x, y = ea.get(k), eb.get(k)
        if x is None or y is None:
            t = x or y
            assert t is not None  # k is a key of ea or of eb
            changes.append(TensorChange(k[0], k[1], "removed" if y is None else "added", "-",
                                        f"{t.dtype}{tuple(t.shape)}"))
            continue
        if x.dtype != y.dtype or x.shape != y.shape:
            changes.append(TensorChange(k[0], k[1], "changed", "shape",
                                        f"{x.dtype}{tuple(x.shape)} -> {y.dtype}{tuple(y.shape)}"))
            continue
        same = _by_hashes(x, ma, y, mb)
        c = TensorChange(k[0], k[1], "same" if same else "changed", "hashes")
        if same is None:
            c.how = "bytes"
            to_read.append(c)
        elif not same and max_diff:
            to_read.append(c)
        changes.append(c)
    if to_read:
        with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="ckpt-diff") as io:
            for c in to_read:
                [ta] = read_tensors(catalog.storage, ma, [ea[(c.key, c.rank)]], io)
                [tb] = read_tensors(catalog.storage, mb, [eb[(c.key, c.rank)]], io)
                if c.how == "bytes":
                    c.status = "same" if _same_bytes(ta, tb) else "changed"
                if c.status == "changed" and max_diff:
                    c.max_abs_diff = _max_abs_diff(ta, tb)
    va = dict(st.value_nodes(ma.structure))
    vb = dict(st.value_nodes(mb.structure))
    values = [(p, st.preview(va[p]) if p in va else "(absent)", st.preview(vb[p]) if p in vb else "(absent)")
              for p in sorted(va.keys() | vb.keys()) if va.get(p, ...) != vb.get(p, ...)]
    return changes, values
