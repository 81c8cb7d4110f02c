"""ckpt under PyTorch's distributed checkpoint (DCP): the seams ``dcp.save``, ``dcp.async_save`` and
``dcp.load`` already call, so a DCP training script keeps its calls and gets ckpt's steps::

    import torch.distributed.checkpoint as dcp
    import ckpt.dcp

    dcp.save(state, storage_writer=ckpt.dcp.Writer("s3://bucket/run", step=100, keep_last=3))
    fut = dcp.async_save(state, storage_writer=ckpt.dcp.Writer(url, step=200), async_stager=ckpt.dcp.Stager())
    dcp.load(state, storage_reader=ckpt.dcp.Reader(url, step="latest"))     # any world size

A step written here is a step like any other: ``Checkpointer.load``, ``ckpt.open`` and the CLI read it,
and :class:`Reader` reads steps the Checkpointer wrote.
"""

from __future__ import annotations

from .reader import Reader
from .stager import Stager
from .writer import Writer

__all__ = ["Reader", "Stager", "Writer"]
