"""One save on its way from the snapshot to the commit (:class:`SaveJob`): what ``Checkpointer.save``
and ``ckpt.dcp.Writer`` hand the writer (:mod:`ckpt.save.writer`), the commit protocol (:mod:`ckpt.save.commit`)
and the local commits plug-in."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from ..handle import SaveMetrics
from ..storage import Storage
from .snapshot import Snapshot


@dataclass
class SaveJob:
    """One save on its way from the snapshot to the commit."""

    step: int
    seq: int  # the save() call's number: the same on every rank
    snapshot: Snapshot
    structure: dict
    metrics: SaveMetrics
    started: float  # time.perf_counter() of the save() call
    on_local: Callable[[], None] | None = None  # every chunk durable where it is first written (SaveHandle stage)
    created: list[str] = field(default_factory=list)  # chunks this save wrote where none was stored
    hashes: list[str] = field(default_factory=list)  # per chunk of the buffer, once written
    report: bytes = b""  # this rank's report as written (summarized and indexed from these bytes)
    persist: bool = True  # uploaded to the checkpoint path (else committed to the local directories only)
    committed: bool = False  # set once the step is committed (on every rank)
    storage: Storage | None = None  # the storage this save runs over (``SaveEngine.storage_for``); None: the writer's
