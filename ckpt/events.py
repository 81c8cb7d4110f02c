"""A machine-readable record of what ckpt did, for fault-injection harnesses (``ckpt chaos``).

When the environment variable ``CKPT_EVENTS`` names a file, every process appends one JSON line per
event to it: ``{"t": <unix time>, "pid": ..., "rank": ..., "event": ..., "step": ...}`` with events

* ``save``: ``save()`` was called for ``step`` (the snapshot begins);
* ``commit``: ``step`` was committed (rank 0, the coordinator);
* ``resume``: a load filled the state from ``step``; ``fresh``: ``load("latest")`` found nothing.

Each line is one ``write`` to a file opened for appending, so lines of concurrent processes do not
interleave. Unset, this costs one dictionary lookup per event.
"""

from __future__ import annotations

import json
import os
import time

ENV = "CKPT_EVENTS"


def emit(event: str, rank: int = 0, **fields: object) -> None:
    path = os.environ.get(ENV)
    if not path:
        return
    line = json.dumps({"t": time.time(), "pid": os.getpid(), "rank": rank, "event": event, **fields}) + "\n"
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)
    except OSError:  # a record for a harness must never fail a save
        pass


def read(path: str) -> list[dict]:
    """Every complete event in ``path`` (a line cut short by a kill is skipped)."""
    out = []
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                try:
                    out.append(json.loads(line))
                except ValueError:
                    continue
    except FileNotFoundError:
        pass
    return out
