"""Committing a step, on the coordinator: every rank's report merged into the step's manifest (or,
with several ranks, the index naming the reports, format v6), checked as every reader checks it, and
written create-only: ``MANIFEST.json`` is the commit point. A rank's own writing is
:mod:`ckpt.save.writer`'s; when to commit is the commit protocol's (:mod:`ckpt.save.commit`)."""

from __future__ import annotations

import dataclasses
import logging

from ..errors import CorruptCheckpointError, StepExistsError
from ..format import index, paths
from ..format import manifest as mf
from ..format.chunk import HEADER_SIZE, check_header, parse_header
from ..format.index import ReportRef
from ..format.tree_check import newest_feature
from ..storage import Storage
from .writer import STEP_EXISTS_ADVICE

log = logging.getLogger("ckpt")


def commit_step(storage: Storage, step: int, parts: list[mf.Manifest], per_rank: frozenset[str],
                structure: dict | None = None, reports: list[ReportRef] | None = None) -> mf.Manifest:
    """Merge every rank's report into the step manifest and commit it (create-only).

    Two ranks may encode the same chunk (same bytes, same name) differently: as deltas of their
    own bases, or with other byte-plane widths; the copy created first stays and the others
    list it. Where reports still disagree (a whole copy replaced a damaged one meanwhile), the
    stored header decides the entry, and the merged table is checked
    (every base listed, chains bounded) before anything is committed. ``storage``: the save's own
    view. ``structure``: the step's structure tree when the front
    end builds it itself (``ckpt.dcp``: from DCP's metadata), instead of the one merged from the
    parts (whose own structures must then agree, e.g. be empty). ``reports``: how each part is
    stored (key, size and digest, in rank order): with several ranks, MANIFEST.json is then the
    step's index (format v6, :mod:`ckpt.format.index`) naming them, unless two reports listed a
    chunk differently (the stored reports would disagree with the step: the whole manifest is
    written instead). Returns the whole step's manifest."""
    conflicts = resolve_conflicts(parts, storage)
    step_manifest = mf.merge(step, parts, per_rank)
    if structure is not None:
        step_manifest.structure = structure
        step_manifest.format_version = max(step_manifest.format_version, newest_feature(structure))
    check_merged_chunks(step, step_manifest.chunks)
    if reports is not None and len(parts) > 1 and not conflicts:
        data = index.committable(step, index.build(step_manifest, reports), parts)
    else:
        data = mf.committable(step, step_manifest)
    commit_bytes(storage, step, data)
    return step_manifest

def commit_bytes(storage: Storage, step: int, data: bytes) -> None:
    """Write ``MANIFEST.json`` of ``step`` (checked bytes), create-only: the commit point."""
    try:
        storage.commit(paths.manifest_key(step), data)
    except FileExistsError:
        raise StepExistsError(
            f"step {step} is already committed in {storage.describe()}; committed steps are never "
            f"overwritten. {STEP_EXISTS_ADVICE}") from None

def resolve_conflicts(parts: list[mf.Manifest], storage: Storage) -> set[str]:
    """The chunks two reports list differently, each entry replaced by what its stored copy's header says."""
    seen: dict[str, mf.ChunkInfo] = {}
    conflicts: set[str] = set()
    for part in parts:
        for h, info in part.chunks.items():
            if seen.setdefault(h, info) != info:
                conflicts.add(h)
    for h in sorted(conflicts):
        key = paths.chunk_key(h)
        hdr = parse_header(storage.head(key, HEADER_SIZE), name=key)
        stored = storage.size(key)
        check_header(hdr, name=key, expect_hash=h, object_len=stored)
        truth = mf.ChunkInfo(hdr.raw_len, stored, hdr.label, hdr.base)
        log.info("chunk %s was stored differently by two ranks; the step lists the copy that stayed (%s)",
                 h, truth.codec)
        for part in parts:  # its span digests, of its raw bytes, hold whatever copy stayed
            if h in part.chunks:
                part.chunks[h] = dataclasses.replace(truth, spans=part.chunks[h].spans)
    return conflicts


def check_merged_chunks(step: int, chunks: dict[str, mf.ChunkInfo]) -> None:
    """Every base a merged chunk table lists is in it and its chains are bounded, or the step is not committed."""
    try:
        mf.check_chains(chunks, paths.manifest_key(step))
    except CorruptCheckpointError as e:
        raise CorruptCheckpointError(f"step {step} was not committed: its merged chunk table is inconsistent "
                                     f"({e})") from e
