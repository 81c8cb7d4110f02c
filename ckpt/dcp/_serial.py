"""One DCP save at a time per process, for saves through ``ckpt.dcp.Writer``.

``dcp.async_save`` in thread mode runs each save on a thread of its own, and every save talks to
the other ranks over the same process group (gather and scatter the plans, gather the results,
broadcast the metadata). Two saves in flight at once issue those collectives in an order that can
differ between ranks, and the ranks then wait on each other until the group's timeout. So each
save, before its first collective (``set_up_storage_writer`` runs before DCP gathers the plans),
waits until the saves of this process that set up before it have left DCP's save: every rank then
issues one save's collectives before the next one's.

"Left DCP's save" is read off the saving thread's stack (no frame of DCP's ``_save_state_dict``),
not from a callback: DCP calls no ``StorageWriter`` method after ``write_data`` on ranks other than
the coordinator, and a thread that goes on to other work (a training loop calling ``dcp.save``
itself) is not waited for.
"""

from __future__ import annotations

import inspect
import sys
import threading
import time
from types import CodeType

from ..errors import CheckpointError


def _save_code() -> CodeType | None:
    try:
        from torch.distributed.checkpoint import state_dict_saver

        return getattr(inspect.unwrap(state_dict_saver._save_state_dict), "__code__", None)
    except (ImportError, AttributeError):  # another torch: saves are not ordered here
        return None


_SAVE = _save_code()
_saves: dict[int, threading.Thread] = {}  # thread ident -> the thread, in the order their saves set up
_lock = threading.Lock()


def _in_save(thread: threading.Thread) -> bool:
    """Whether ``thread`` is inside DCP's save now."""
    if _SAVE is None or not thread.is_alive() or thread.ident is None:
        return False
    frame = sys._current_frames().get(thread.ident)
    while frame is not None:
        if frame.f_code is _SAVE:
            return True
        frame = frame.f_back
    return False


def wait_for_earlier(timeout: float, step: int) -> None:
    """Register this thread's save, then wait (at most ``timeout`` seconds) until every save that
    registered earlier, on another thread of this process, has left DCP's save."""
    me = threading.current_thread()
    with _lock:
        for ident in [i for i, t in _saves.items() if i == me.ident or not _in_save(t)]:
            del _saves[ident]
        earlier = list(_saves.values())
        _saves[me.ident or 0] = me
    deadline = time.monotonic() + timeout
    for thread in earlier:
        while _in_save(thread):
            if time.monotonic() > deadline:
                raise CheckpointError(
                    f"step {step} was not saved: an earlier dcp.save/async_save of this process (thread "
                    f"{thread.name!r}) was still running after {timeout:.0f}s, and two saves at once would issue "
                    "their collectives out of order between ranks. Wait for the previous async_save's future "
                    "before the next, or raise the Writer's timeout")
            time.sleep(0.002)
