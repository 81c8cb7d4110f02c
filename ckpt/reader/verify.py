"""Re-reading and re-hashing every chunk of committed steps (``Reader.verify``, ``ckpt verify``)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..errors import CorruptCheckpointError
from ..format import chains, paths
from ..format import manifest as mf
from ..format.planes import trim_scratch

if TYPE_CHECKING:
    from .core import Reader


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

    def to_json(self, url: str) -> dict:
        """The ``ckpt verify --json`` document (schema ``ckpt-verify/1``)."""
        return {"schema": "ckpt-verify/1", "url": url, "steps": self.steps, "chunks": self.chunks,
                "bytes": self.bytes, "ok": self.ok, "problems": [p.to_json() for p in self.problems]}


def verify(reader: Reader, steps: Iterable[int], *, threads: int = 8,
           progress: Callable[[int, int], None] | None = None) -> VerifyResult:
    """Re-read and re-hash every chunk the given committed steps reference (each chunk once, in
    parallel), then check each step on its own terms: a chunk stored as a delta needs its base in
    that step's own table, as a load of the step does (another step listing it is no help), and
    the span digests each step lists for a chunk must match its bytes.
    ``progress(chunks_done, bytes_done)`` is called from this thread as chunks finish."""
    steps = list(steps)
    result = VerifyResult(steps=steps)
    tables: dict[int, dict[str, mf.ChunkInfo]] = {}
    users: dict[str, list[int]] = {}
    table: dict[str, mf.ChunkInfo] = {}  # every step's chunks; an entry naming a base where steps differ
    digests: dict[str, dict[str, list[int]]] = {}  # per chunk, each span digest string steps list, and theirs
    for s in steps:
        m = reader.find(s)
        if m is None:
            result.problems.append(Problem(paths.manifest_key(s), "corrupt", reader.errors[s], [s]))
            continue
        tables[s] = m.chunks
        for h, info in m.chunks.items():
            users.setdefault(h, []).append(s)
            if info.spans is not None:
                digests.setdefault(h, {}).setdefault(info.spans, []).append(s)
            if h not in table or (table[h].base is None and info.base is not None):
                table[h] = info
    roots, children = chains.trees(table, table)

    def check(root: str, below: dict[str, list[str]]) -> list[tuple[str, int, Problem | None, str | None]]:
        # a chunk stored whole and the deltas made on it, each read once, each link verified
        out: list[tuple[str, int, Problem | None, str | None]] = []
        chains.walk(reader.storage, table, root, below,
                    lambda h, n, err, base: out.append((h, n, _problem(h, err) if err is not None else None, base)),
                    lambda h, raw: chains.span_error(h, raw, digests.get(h, {}), digests.get(h)))
        return out

    named: dict[str, str | None] = {}  # per chunk read: the base its stored header names
    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="ckpt-verify") as pool:
        _collect(pool, [(r, children) for r in roots], check, named, users, result, progress)
        # entries of different steps that make a loop of deltas: no tree holds them; each on its own
        _collect(pool, [(h, {}) for h in sorted(set(table) - set(named))], check, named, users, result, progress)
    trim_scratch()
    result.chunks = len(table)
    result.problems.extend(_unlisted_bases(tables, named))
    result.problems.sort(key=lambda p: (p.steps[0] if p.steps else -1, p.object))
    return result


def _problem(h: str, err: Exception) -> Problem:
    key = paths.chunk_key(h)
    if isinstance(err, chains.MissingChunkError):
        return Problem(key, "missing", str(err), [], h)
    if isinstance(err, CorruptCheckpointError):
        return Problem(key, "corrupt", str(err), [], h)
    return Problem(key, "unreadable", str(err), [], h)


def _collect(pool: ThreadPoolExecutor, work: list, check: Callable, named: dict[str, str | None],
             users: dict[str, list[int]], result: VerifyResult, progress: Callable[[int, int], None] | None) -> None:
    for fut in as_completed([pool.submit(check, *w) for w in work]):
        for h, n, prob, base in fut.result():
            named[h] = base
            result.bytes += n
            if prob is not None:
                prob.steps = users[h]
                result.problems.append(prob)
        if progress is not None:
            progress(len(named), result.bytes)


def _unlisted_bases(tables: dict[int, dict[str, mf.ChunkInfo]], named: dict[str, str | None]) -> list[Problem]:
    """Chunks stored as deltas of a base their step's table lacks: that step cannot load them,
    whatever other steps list (another writer's copy stands where the step describes its own)."""
    lacking: dict[tuple[str, str], list[int]] = {}
    for s, chunks in tables.items():
        for h in chunks:
            b = named.get(h)
            if b is not None and b not in chunks:
                lacking.setdefault((h, b), []).append(s)
    out = []
    for (h, b), steps in sorted(lacking.items()):
        key = paths.chunk_key(h)
        which = f"step {steps[0]}" if len(steps) == 1 else f"steps {', '.join(map(str, steps))}"
        out.append(Problem(key, "corrupt", f"chunk object {key} is stored as a delta of {b}, which {which} "
                           f"{'does' if len(steps) == 1 else 'do'} not list, so {which} cannot load it (the stored "
                           "copy is not the one the step describes)", steps, h))
    return out
