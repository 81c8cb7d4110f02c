"""Whole tensors of a step, read from outside a run, and loading a step into a state: the reader's
one way into the load path (``ckpt.load``), imported only when something is read, so that opening
a checkpoint, listing it or verifying it never imports the writer's side."""

from __future__ import annotations

from concurrent.futures import Executor
from typing import Any

import torch

from ..format import manifest as mf
from ..format.planes import trim_scratch
from ..storage import Storage
from ..tree import DTYPES


def load_into(storage: Storage, m: mf.Manifest, state: dict[str, Any], *, strict: bool, allow_pickle: bool,
              io: Executor, rank: int = 0, world: int = 1, staged: bool = True) -> Any:
    """Load manifest ``m`` into ``state`` in place, as rank ``rank`` of ``world``, every chunk verified;
    returns the loader's ``LoadStats``. The only call into ``ckpt.load`` from the reader."""
    from ..load.into_state import load_into as load  # the loader module imports the commit side: only when reading

    stats = load(storage, m, state, strict=strict, allow_pickle=allow_pickle, io=io, rank=rank, world=world,
                 staged=staged)
    trim_scratch()  # decoding delta chains kept chunk-sized buffers per thread: reads are rare
    return stats


def read_tensors(storage: Storage, m: mf.Manifest, entries: list[mf.TensorEntry], io: Executor,
                 ) -> list[torch.Tensor]:
    """Whole global tensors for ``entries`` of manifest ``m``: every shard is read, verified and
    placed (resharding to one process). Per-rank entries give that rank's tensor."""
    from ..load.reads import BoxRequest, read_boxes  # the load path: only when reading

    out = [torch.empty(tuple(e.shape), dtype=DTYPES[e.dtype]) for e in entries]
    boxes = [BoxRequest(e.key, ((0,) * len(e.shape), tuple(e.shape)), t, e.rank) for e, t in zip(entries, out)]
    # fresh tensors, nobody else's: no staging needed for a failed read to change nothing
    read_boxes(storage, m, boxes, io, staged=False)
    trim_scratch()  # decoding delta chains kept chunk-sized buffers per thread: reads are rare
    return out
