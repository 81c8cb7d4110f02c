"""Holding off CPython's cyclic garbage collector while ckpt builds or reads large acyclic structures.

A state of many small tensors (a model's ``state_dict()`` with 100,000 keys) makes a save or load
create millions of containers: structure nodes, manifest entries, the JSON document itself. Every
few hundred thousand new containers make CPython walk the *whole* heap (the training process's
model, optimizer and torch internals included): ``json.loads`` of a 100,000-tensor manifest took
3.3 s with the collector running and 0.4 s without, and save and load spent half their time in it.
Nothing these phases build holds a cycle (plain JSON values, dataclasses of them, lists of tensors),
so there is nothing for the collector to find: reference counting frees all of it.

:func:`paused` is scoped to those phases and counted, so nested or concurrent uses (the caller's
``save()`` while the writer thread parses a report) leave the collector off until the last one
ends, then back as it was. Objects are still freed by reference counting meanwhile; only the
search for cycles waits, and it runs at the next allocation after the pause if it is due.
"""

from __future__ import annotations

import gc
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager

_lock = threading.Lock()
_depth = 0
_was_enabled = False


@contextmanager
def paused() -> Iterator[None]:
    """No cyclic collection inside the block (reference counting still frees everything). Only on
    the main thread, the caller's (a save or load it waits for): ckpt's background threads never
    switch the collector, so a training loop that manages it itself (``gc.disable()`` between
    steps) finds it as it left it once ``save()`` returns."""
    global _depth, _was_enabled
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    with _lock:
        if _depth == 0:
            _was_enabled = gc.isenabled()
            gc.disable()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _was_enabled:
                gc.enable()


def _reset_in_child() -> None:
    """A process forked during a pause has none of the threads that would end it: it starts unpaused."""
    global _depth, _lock
    _lock = threading.Lock()
    if _depth > 0:
        _depth = 0
        if _was_enabled:
            gc.enable()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_in_child)
