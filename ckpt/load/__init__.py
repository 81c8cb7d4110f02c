"""The load path, a step into a state, in the order it runs:

* :mod:`~ckpt.load.step_choice`: which step (the one asked for, or the newest every rank sees, with
  fallback past damaged steps), every rank agreeing on the outcome;
* :mod:`~ckpt.load.into_state`: loading that step into a state: plan, reads, apply (:mod:`~ckpt.load.apply`);
* :mod:`~ckpt.load.match`, :mod:`~ckpt.load.checks`, :mod:`~ckpt.load.held`: how the saved
  structure meets the state, and what a load refuses before it reads anything;
* :mod:`~ckpt.load.plan`: ``plan_load`` and ``plan_boxes``, pure: which chunk objects, which byte
  spans of each, into which destination boxes;
* :mod:`~ckpt.load.reads`, :mod:`~ckpt.load.chunk_reads`: a plan's reads, every chunk verified;
  ``read_boxes``, the one way anything reads boxes of saved tensors.

Names are imported when first used: importing a module of the folder loads only what it needs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy_names

if TYPE_CHECKING:
    from .into_state import load_into
    from .plan import BoxPlan, LoadPlan, plan_boxes, plan_load
    from .reads import BoxRequest, LoadStats, read_boxes

_LAZY = {"LoadStats": "reads", "load_into": "into_state", "BoxPlan": "plan", "LoadPlan": "plan", "plan_boxes": "plan",
         "plan_load": "plan", "BoxRequest": "reads", "read_boxes": "reads"}

__getattr__ = lazy_names(__name__, _LAZY)


__all__ = ["BoxPlan", "BoxRequest", "LoadPlan", "LoadStats", "load_into", "plan_boxes", "plan_load", "read_boxes"]
