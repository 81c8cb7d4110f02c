"""Saves in flight when the interpreter exits are finished, not lost.

A script that saves and then simply ends (or ends with an exception, or a Ctrl-C) without calling
``close()`` used to lose its last save: at exit ``concurrent.futures`` stops accepting work before
the save's background thread has handed its chunks to the I/O pool ("cannot schedule new futures
after interpreter shutdown"), and the step was never committed.

Python runs ``threading``'s exit hooks before it joins threads and before ``concurrent.futures``
shuts its pools, newest hook first. ckpt registers its hook when the first Checkpointer is made
(after ``concurrent.futures`` registered its own, at import), so at exit it runs first: it closes
every Checkpointer still open, which waits for their saves and commits them. A failure is logged:
there is nobody left to raise it to. A second Ctrl-C while it waits gives up, and says so.
"""

from __future__ import annotations

import logging
import threading
import weakref
from concurrent.futures import Future
from typing import Protocol

log = logging.getLogger("ckpt")


class _Closable(Protocol):
    def close(self) -> None: ...

    def _in_flight(self) -> list[int]: ...


_open: weakref.WeakSet = weakref.WeakSet()  # every Checkpointer not closed (not kept alive by this)
_saving: dict[int, tuple[_Closable, int]] = {}  # those with saves in flight, kept alive until they end
_registered = False
_lock = threading.Lock()


def saving(checkpointer: _Closable, done: Future) -> None:
    """Keep ``checkpointer`` alive until ``done`` resolves: a save in flight is finished at exit even
    if the caller dropped every reference to its Checkpointer (``Checkpointer(path).save(1, state)``)."""
    key = id(checkpointer)
    with _lock:
        _, n = _saving.get(key, (checkpointer, 0))
        _saving[key] = (checkpointer, n + 1)

    def ended(_: Future) -> None:
        with _lock:
            c, n = _saving.pop(key, (checkpointer, 1))
            if n > 1:
                _saving[key] = (c, n - 1)

    done.add_done_callback(ended)


def track(checkpointer: _Closable) -> None:
    """Close ``checkpointer`` at interpreter exit if it is still open then."""
    global _registered
    with _lock:
        _open.add(checkpointer)
        if not _registered:
            register = getattr(threading, "_register_atexit", None)  # CPython 3.9+; private but stable
            if register is None:  # pragma: no cover - other interpreters: the plain atexit hook
                import atexit
                register = atexit.register
            register(_finish)
            _registered = True


def untrack(checkpointer: _Closable) -> None:
    """``checkpointer`` was closed: nothing is left to do for it at exit."""
    with _lock:
        _open.discard(checkpointer)


def _finish() -> None:
    with _lock:
        saving = {id(c) for c, _ in _saving.values()}
        pending = list({id(c): c for c in [*(c for c, _ in _saving.values()), *_open]}.values())
    for c in pending:
        try:
            steps = c._in_flight() if id(c) in saving else []
            if steps:  # said at once (after a Ctrl-C's traceback the wait would be silent); the others: not a word
                what = f"save of step {steps[0]}" if len(steps) == 1 else f"saves of steps {', '.join(map(str, steps))}"
                log.warning("the interpreter is exiting: finishing the %s of %r first (Ctrl-C again gives up on "
                            "it; the steps committed before it are whole)", what, c)
            c.close()
        except KeyboardInterrupt:
            log.error("interrupted while finishing the saves of %r at exit; a save in flight is lost "
                      "(the steps committed before it are whole)", c)
            return
        except Exception as e:
            log.error("a save of %r failed at exit: %s", c, e)
