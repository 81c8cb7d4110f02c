"""One DCP save at a time per process, for saves through ``ckpt.dcp.Writer``, in the order of the calls.

``dcp.async_save`` in thread mode runs each save on a thread of its own, and every save talks to
the other ranks over the same process group (gather and scatter the plans, gather the results,
broadcast the metadata). Two saves in flight at once issue those collectives in an order that can
differ between ranks, and the ranks then wait on each other until the group's timeout, or worse,
match one save's plans with another's (a step whose metadata names tensors it never wrote).

So every Writer takes a ticket where it is made (``Writer.__init__``, on the thread that calls
``dcp.save``/``async_save``: the calls' own order, the same on every rank), and each save, before
its first collective (``set_up_storage_writer`` runs before DCP gathers the plans), waits until
every Writer with an earlier ticket is done: its save left DCP's save, or it will never start one
here (garbage-collected, pickled for DCP's process mode, or refused in ``reset``). The order of the
saving threads' start, which no one controls (an async_save's thread can reach DCP before the
previous call's), decides nothing.

"Left DCP's save" is read off the saving thread's stack (no frame of DCP's ``_save_state_dict``),
not from a callback: DCP calls no ``StorageWriter`` method after ``write_data`` on ranks other than
the coordinator, and a thread that goes on to other work (a training loop calling ``dcp.save``
itself) is not waited for.

A Writer made and then kept without being handed to DCP holds the later saves of this process
back: they wait for it ``timeout`` seconds, at most a minute, then go on with a warning.
"""

from __future__ import annotations

import inspect
import itertools
import logging
import sys
import threading
import time
import weakref
from types import CodeType
from typing import Any

from ..errors import CheckpointError

log = logging.getLogger("ckpt")


def _save_code() -> CodeType | None:
    try:
        from torch.distributed.checkpoint import state_dict_saver

        return getattr(inspect.unwrap(state_dict_saver._save_state_dict), "__code__", None)
    except (ImportError, AttributeError):  # another torch: saves are not ordered here
        return None


_SAVE = _save_code()
# How long a save waits for an earlier Writer that has not reached DCP yet (its thread about to start, or a
# Writer kept and never used); a save already in DCP is waited for the whole ``timeout``.
UNSTARTED_S = 60.0


class _Ticket:
    """One Writer's place in line: waiting to set up (``thread`` None), saving on ``thread``, or done."""

    def __init__(self, number: int, writer: Any, step: int):
        self.number = number
        self.writer = weakref.ref(writer)
        self.step = step
        self.thread: threading.Thread | None = None
        self.maker = threading.get_ident()
        self.done = False

    def pending(self) -> bool:
        """Whether this save may still issue collectives here: not yet set up, or its thread is in
        DCP's save for this ticket (a thread that went on to the next save is in that one's)."""
        if self.done or self.writer() is None:
            return False
        if self.thread is None:
            return True
        return _current.get(self.thread.ident) == self.number and _in_save(self.thread)


_tickets: dict[int, _Ticket] = {}  # ticket number -> ticket, in the order the Writers were made
_current: dict[int | None, int] = {}  # thread ident -> the ticket it set up last
_numbers = itertools.count()
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


def take(writer: Any, step: int) -> int:
    """A ticket for ``writer``, made now on the calling thread: its save waits for every earlier one."""
    with _lock:
        for number in [n for n, t in _tickets.items() if not t.pending()]:
            del _tickets[number]
        number = next(_numbers)
        _tickets[number] = _Ticket(number, writer, step)
    return number


def give_up(number: int) -> None:
    """The ticket's Writer will never save here (pickled for another process, or refused): nobody waits for it."""
    with _lock:
        ticket = _tickets.get(number)
        if ticket is not None:
            ticket.done = True


def give_up_newest() -> None:
    """A ``dcp.async_save`` call failed while staging, before its save started: the newest Writer
    made on this thread that has not set up (that call's) will not save, so nobody waits for it
    (a traceback the caller keeps would otherwise keep it alive, and the next saves waiting)."""
    me = threading.get_ident()
    with _lock:
        unstarted = [t for t in _tickets.values() if t.maker == me and t.thread is None and not t.done]
        if unstarted:
            unstarted[-1].done = True


def wait_for_earlier(number: int, timeout: float, step: int) -> None:
    """Mark ticket ``number`` as saving on this thread, then wait (at most ``timeout`` seconds)
    until every earlier ticket is done. A ticket not yet set up is waited for ``UNSTARTED_S`` at
    most, then given up for good (a Writer kept and never used holds no later save back twice)."""
    me = threading.current_thread()
    with _lock:
        ticket = _tickets.get(number)
        if ticket is not None:
            ticket.thread = me
        _current[me.ident] = number
        for ident in [i for i in _current if i != me.ident and not any(t.ident == i for t in threading.enumerate())]:
            del _current[ident]  # threads gone
        earlier = [t for n, t in _tickets.items() if n < number]
    now = time.monotonic()
    deadline, unstarted_deadline = now + timeout, now + min(timeout, UNSTARTED_S)
    for other in earlier:
        while other.pending() and other.thread is not me:
            if time.monotonic() > (deadline if other.thread is not None else unstarted_deadline):
                if other.thread is None:  # made but never handed to DCP: it issues nothing yet
                    log.warning("step %d: a ckpt.dcp.Writer for step %d, made earlier in this process, has not "
                                "started its save after %.0fs; saving without waiting for it, and no later save "
                                "waits for it (make each Writer in its dcp.save call)", step, other.step,
                                min(timeout, UNSTARTED_S))
                    give_up(other.number)
                    break
                raise CheckpointError(
                    f"step {step} was not saved: an earlier dcp.save/async_save of this process (step "
                    f"{other.step}, thread {other.thread.name!r}) was still running after {timeout:.0f}s, and two "
                    "saves at once would issue their collectives out of order between ranks. Wait for the previous "
                    "async_save's future before the next, or raise the Writer's timeout")
            time.sleep(0.002)
