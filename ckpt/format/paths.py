"""Where every kind of object lives in a checkpoint root: the one place that knows the keys.

A root holds (see docs/format.md)::

    chunks/<h[0:2]>/<h>                  a chunk object, named by the xxh3-128 of its raw bytes
    steps/<step:012d>/rank-<r:05d>.json  what rank r wrote for a step (before the commit)
    steps/<step:012d>/MANIFEST.json      the commit point of a step: written last, once
    steps/<step:012d>/parity-g<g>*       parity layout and blocks of a node's local tier (peers)
    leases/<id>.json                     who is writing into the root, renewed while they are
    retired/<id>.json                    chunks retention left for the last writer to delete
    journal/<start>/start.json           the run journal: one start of the job (rank 0 writes it)
    journal/<start>/seen.json            that start's last-seen time, replaced every minute (journal.SEEN_S)
    journal/<start>/save-<step:012d>.json  a save that start committed: its time and stall

Keys are relative to the root and use ``/``; a storage backend maps them to files or objects.
"""

from __future__ import annotations

import re

STEPS = "steps"
CHUNKS = "chunks"
LEASES = "leases"
RETIRED = "retired"
JOURNAL = "journal"
MANIFEST = "MANIFEST.json"

STEP_DIR_RE = re.compile(r"^\d{12,19}$")  # step_dir's own names: 12 digits, more for steps >= 10**12

def step_dir(step: int) -> str:
    return f"{STEPS}/{step:012d}"


def manifest_key(step: int) -> str:
    return f"{step_dir(step)}/{MANIFEST}"


def rank_key(step: int, rank: int) -> str:
    return f"{step_dir(step)}/rank-{rank:05d}.json"


def chunk_key(h: str) -> str:
    return f"{CHUNKS}/{h[:2]}/{h}"


def is_chunk_key(key: str) -> bool:
    """Is ``key`` the key of a chunk object (not a step's file, a lease or a retired list)?"""
    return key.startswith(CHUNKS + "/")


def lease_key(lease_id: str) -> str:
    return f"{LEASES}/{lease_id}.json"


def retired_key(name: str) -> str:
    return f"{RETIRED}/{name}"


def journal_start_key(start: str) -> str:
    return f"{JOURNAL}/{start}/start.json"


def journal_seen_key(start: str) -> str:
    return f"{JOURNAL}/{start}/seen.json"


def journal_save_key(start: str, step: int) -> str:
    return f"{JOURNAL}/{start}/save-{step:012d}.json"


JOURNAL_START_RE = re.compile(r"^\d{15}-[0-9a-f]{8}$")  # a start's name: its time in ms, then 8 random hex digits
JOURNAL_SAVE_RE = re.compile(r"^save-(\d{12,19})\.json$")


def parity_layout_name(group: int) -> str:
    """File name (in the step's directory of a node's local tier) of a parity group's layout."""
    return f"parity-g{group}.json"


def parity_block_name(group: int, stripe: int, block: int) -> str:
    """File name (in the step's directory) of a stripe's parity block."""
    return f"parity-g{group}-s{stripe}-p{block}"
