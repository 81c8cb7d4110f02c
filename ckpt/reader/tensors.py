"""Whole tensors of a step, read from outside a run, and loading a step into a state: the reader's
one way into the load path (``ckpt.load``), imported only when something is read, so that opening
a checkpoint, listing it or verifying it never imports the writer's side."""

from __future__ import annotations

from concurrent.futures import Executor
from typing import Any

import torch

from .. import tree as st
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
    names = [f"t{i}" for i in range(len(entries))]
    view = mf.Manifest(step=m.step, kind="step", world_size=1, chunks=m.chunks,
                       structure=st.dict_node(list(names), [st.tensor_node(n) for n in names]),
                       tensors=[mf.TensorEntry(n, e.dtype, list(e.shape), e.shards) for n, e in zip(names, entries)])
    state = {n: torch.empty(tuple(e.shape), dtype=DTYPES[e.dtype]) for n, e in zip(names, entries)}
    # fresh tensors, nobody else's: no staging needed for a failed read to change nothing
    load_into(storage, view, state, strict=True, allow_pickle=False, io=io, staged=False)
    return [state[n] for n in names]


