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
    parallel). ``progress(chunks_done, bytes_done)`` is called from this thread as chunks finish."""
    steps = list(steps)
    result = VerifyResult(steps=steps)
    refs: dict[str, tuple[mf.ChunkInfo, list[int]]] = {}
    for s in steps:
        m = reader.find(s)
        if m is None:
            result.problems.append(Problem(paths.manifest_key(s), "corrupt", reader.errors[s], [s]))
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
        chains.walk(reader.storage, table, root, children,
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


