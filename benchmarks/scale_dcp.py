"""DCP's planning on the same shapes, for benchmarks/scale.py: its own planner functions, N ranks in one process.

Each rank's local save plan is the ``WriteItem`` list ``DefaultSavePlanner.create_local_plan`` makes
for its state (a SHARD item per DTensor shard with its chunk's offsets and sizes; a TENSOR item per
plain tensor: AdamW's 0-d ``step`` on every rank), built here from the same boxes as ckpt's
simulated ranks (DTensors need a process group per rank). Then DCP's own code:
``DefaultSavePlanner.create_global_plan`` on rank 0 (dedup of replicated items, the metadata, the
overlap check), the ``.metadata`` file as ``FileSystemWriter.finish`` pickles it (``storage_data``:
one entry per item, in a file per rank), and at load each rank's
``create_read_items_for_chunk_list`` (which saved chunks feed its boxes) after unpickling it.

The bytes of the plan collective are those ``_DistWrapper.reduce_scatter`` pickles: every local plan
gathered to rank 0, a global plan scattered to each rank.
"""

from __future__ import annotations

import pickle
import time
from typing import Any

import torch
from scale_sim import LAYOUTS, Model, box
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list


def _item(fqn: str, offsets: tuple[int, ...], lengths: tuple[int, ...], shape: tuple[int, ...],
          kind: WriteItemType) -> WriteItem:
    chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(lengths))
    return WriteItem(index=MetadataIndex(fqn, torch.Size(offsets)), type=kind,
                     tensor_data=TensorWriteData(chunk=chunk, properties=TensorProperties(dtype=torch.float32),
                                                 size=torch.Size(shape)))


def local_plan(model: Model, layout: str, rank: int, world: int) -> SavePlan:
    """What rank ``rank``'s ``create_local_plan`` returns for the model's and AdamW's state (flattened fqns)."""
    tp = LAYOUTS[layout]
    items = []
    paths: dict[str, tuple[str, ...]] = {}  # planner_data: the flattened fqn's path in the nested state dict
    for name, shape, split in model.params():
        offs, lens = box(shape, split, rank, world, tp)
        for fqn, path in ((f"model.{name}", ("model", name)),
                          (f"optim.state.{name}.exp_avg", ("optim", "state", name, "exp_avg")),
                          (f"optim.state.{name}.exp_avg_sq", ("optim", "state", name, "exp_avg_sq"))):
            items.append(_item(fqn, offs, lens, shape, WriteItemType.SHARD))
            paths[fqn] = path
        items.append(_item(f"optim.state.{name}.step", (), (), (), WriteItemType.TENSOR))
        paths[f"optim.state.{name}.step"] = ("optim", "state", name, "step")
    return SavePlan(items, planner_data=paths)


def save_and_load(model: Model, layout: str, world: int) -> dict[str, Any]:
    """DCP's plan round (bytes gathered and scattered, rank 0's global plan), its metadata file, and
    one rank's load planning, on ``world`` simulated ranks."""
    plans = [local_plan(model, layout, r, world) for r in range(world)]
    gathered = sum(len(pickle.dumps(p)) for p in plans)
    planner = DefaultSavePlanner()
    t = time.thread_time()
    global_plans, metadata = planner.create_global_plan(plans)
    plan_s = time.thread_time() - t
    scattered = sum(len(pickle.dumps(p)) for p in global_plans)
    # FileSystemWriter.finish: where every item went (one file per rank, items one after another)
    storage: dict[MetadataIndex, _StorageInfo] = {}
    for r, p in enumerate(global_plans):
        pos = 0
        for it in p.items:
            n = 4 * (torch.Size(it.tensor_data.chunk.sizes).numel() if it.tensor_data is not None else 0)
            storage[it.index] = _StorageInfo(f"__{r}_0.distcp", pos, n)
            pos += n
    metadata.storage_data = storage
    data = pickle.dumps(metadata)
    del plans, global_plans, metadata, storage
    parse_s = match_s = float("inf")  # best of two: DCP leaves the cyclic collector on, which lands anywhere
    reads = 0
    for _ in range(2):
        t = time.thread_time()
        md = pickle.loads(data)
        parse_s = min(parse_s, time.thread_time() - t)
        t = time.thread_time()
        reads = 0
        for it in local_plan(model, layout, world // 2, world).items:
            fqn = it.index.fqn
            assert it.tensor_data is not None
            reads += len(create_read_items_for_chunk_list(fqn, md.state_dict_metadata[fqn], [it.tensor_data.chunk]))
        match_s = min(match_s, time.thread_time() - t)
        del md
    return {"plan_s": plan_s, "plan_bytes": gathered + scattered, "metadata_bytes": len(data),
            "load_parse_s": parse_s, "load_match_s": match_s, "load_read_items": reads}
