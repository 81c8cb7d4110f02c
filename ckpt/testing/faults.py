"""A storage that fails on purpose: wrap any :class:`~ckpt.storage.base.Storage` and say which calls
break, instead of monkeypatching a backend class for the whole process.

    disk = FaultyStorage(LocalStorage(root))
    disk.fail("write", key=r"^chunks/", nth=3)          # the third chunk write fails, once
    disk.fail("commit", exc=OSError("disk gone"))        # every commit fails
    disk.fail("delete", after=10, exc=KeyboardInterrupt)  # killed after ten deletes
    gate = disk.gate("write", key=r"^chunks/")            # chunk writes wait until gate.open()
    ...
    assert disk.calls["write"] == 7 and disk.failed["commit"] == 1

A rule or gate naming ``write`` also matches ``create`` (a create-only write: how new chunk objects
are written), so ``"write"`` means any write of an object; name ``create`` alone to match only those.

Every call is counted (``calls``: per operation; ``log``: (operation, key) in order), whether or not
a rule fired. A rule counts only the calls it matches (its operations and key pattern), so ``nth=2``
with ``key=r"^chunks/"`` means the second chunk write, whatever else was written in between. The
default error is what a backend raises after its own translation: a
:class:`~ckpt.errors.StorageError` whose ``__cause__`` is an ``OSError`` (EIO), so the code above the
storage takes the same path as for a real failure. Anything else behaves exactly as ``inner``.
"""

from __future__ import annotations

import errno
import re
import threading
from collections import Counter
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..errors import StorageError
from ..storage.base import Blob, RootState, Storage

# The operations a rule can name; "key" is the key or prefix, "" for the calls that take none.
OPERATIONS = ("write", "create", "commit", "read", "readv", "read_object", "head", "exists", "size", "mtime", "list",
              "delete", "delete_many", "root_state", "remove_root", "flush", "close")

ErrorSpec = BaseException | type[BaseException] | Callable[[str, str], BaseException] | None


def injected_error(op: str, key: str) -> StorageError:
    """What :class:`FaultyStorage` raises by default: a translated backend error with its OSError cause."""
    err = StorageError(f"injected failure: {op} {key!r}")
    err.__cause__ = OSError(errno.EIO, f"injected I/O error on {key!r}")
    return err


@dataclass
class Rule:
    """One way of failing. ``ops``: the operations it applies to (empty: all). ``key``: a regular
    expression searched in the key (None: any key). Of the calls it matches, it fails the ``nth``
    (1-based) if given, else every call after the first ``after``; ``times`` bounds how often it fires
    (``once=True`` in :meth:`FaultyStorage.fail` is ``times=1``). ``exc``: an exception instance, class
    (built with a message), or ``f(op, key)`` returning one; None for :func:`injected_error`."""

    ops: frozenset[str] = frozenset()
    key: str | None = None
    nth: int | None = None
    after: int = 0
    times: int | None = None
    exc: ErrorSpec = None
    matched: int = 0  # calls this rule matched so far
    fired: int = 0  # failures it raised so far
    _pattern: re.Pattern | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        unknown = set(self.ops) - set(OPERATIONS)
        if unknown:
            raise ValueError(f"unknown storage operation(s) {sorted(unknown)}; known: {', '.join(OPERATIONS)}")
        if self.nth is not None and self.nth < 1:
            raise ValueError(f"nth counts from 1, got {self.nth}")
        self._pattern = re.compile(self.key) if self.key is not None else None

    def matches(self, op: str, key: str) -> bool:
        named = not self.ops or op in self.ops or (op == "create" and "write" in self.ops)
        return named and (self._pattern is None or bool(self._pattern.search(key)))

    def should_fire(self, free: bool = True) -> bool:
        """Called once per matching call, under the storage's lock: counts it and says whether it fails
        (never when not ``free``: an earlier rule already fails this call, and only one error is raised)."""
        self.matched += 1
        if not free or (self.times is not None and self.fired >= self.times):
            return False
        hit = self.matched == self.nth if self.nth is not None else self.matched > self.after
        if hit:
            self.fired += 1
        return hit

    def error(self, op: str, key: str) -> BaseException:
        if self.exc is None:
            return injected_error(op, key)
        if isinstance(self.exc, BaseException):
            return self.exc
        if isinstance(self.exc, type):
            return self.exc(f"injected failure: {op} {key!r}")
        return self.exc(op, key)


class Gate:
    """Holds the calls it matches until :meth:`open` (a save provably in flight, without sleeping).
    ``entered`` is set when the first held call arrives; ``held`` counts the calls that waited."""

    def __init__(self, ops: frozenset[str], key: str | None, timeout: float):
        self.rule = Rule(ops, key)
        self.timeout = timeout
        self.entered = threading.Event()
        self.opened = threading.Event()
        self.held = 0

    def open(self) -> None:
        self.opened.set()

    def wait(self) -> None:
        self.held += 1
        self.entered.set()
        if not self.opened.wait(self.timeout):
            raise TimeoutError(f"gate never opened within {self.timeout}s")


def _ops(op: str | Iterable[str] | None) -> frozenset[str]:
    if op is None or op == "*":
        return frozenset()
    return frozenset([op]) if isinstance(op, str) else frozenset(op)


class FaultyStorage(Storage):
    """``inner`` with failures injected by rule, and every call counted. Thread-safe: ckpt's writer
    and loader call storage from many threads. See the module docstring for an example."""

    def __init__(self, inner: Storage, rules: Iterable[Rule] = ()):
        self.inner = inner
        self.url = inner.url
        self.rules: list[Rule] = list(rules)
        self.gates: list[Gate] = []
        self.calls: Counter[str] = Counter()
        self.failed: Counter[str] = Counter()
        self.log: list[tuple[str, str]] = []
        self._lock = threading.Lock()

    # -- configuring ---------------------------------------------------------------------------------------
    def fail(self, op: str | Iterable[str] | None = None, *, key: str | None = None, nth: int | None = None,
             after: int = 0, times: int | None = None, once: bool = False, exc: ErrorSpec = None) -> Rule:
        """Add a rule (see :class:`Rule`); ``op`` None or ``"*"`` means every operation. Returns the
        rule, whose ``matched`` and ``fired`` say what it saw."""
        rule = Rule(_ops(op), key, nth, after, 1 if once else times, exc)
        with self._lock:
            self.rules.append(rule)
        return rule

    def gate(self, op: str | Iterable[str] | None = None, *, key: str | None = None, timeout: float = 60.0) -> Gate:
        """Hold the matching calls until the returned gate is opened (a TimeoutError after ``timeout``)."""
        g = Gate(_ops(op), key, timeout)
        with self._lock:
            self.gates.append(g)
        return g

    def clear(self) -> None:
        """Drop every rule and open every gate (counters stay)."""
        with self._lock:
            gates, self.gates, self.rules = self.gates, [], []
        for g in gates:
            g.open()

    def reset_counts(self) -> None:
        with self._lock:
            self.calls.clear()
            self.failed.clear()
            self.log.clear()

    # -- the one place a call is counted and perhaps failed ----------------------------------------------
    def _enter(self, op: str, key: str = "") -> None:
        with self._lock:
            self.calls[op] += 1
            self.log.append((op, key))
            gates = [g for g in self.gates if g.rule.matches(op, key)]
            err = None
            for rule in self.rules:
                if rule.matches(op, key) and rule.should_fire(free=err is None):
                    err = rule.error(op, key)
            if err is not None:
                self.failed[op] += 1
        for g in gates:  # outside the lock: other calls go on while this one waits
            g.wait()
        if err is not None:
            raise err

    def write(self, key: str, buffers: Sequence) -> int:
        self._enter("write", key)
        return self.inner.write(key, buffers)

    def create(self, key: str, buffers: Sequence) -> int:
        self._enter("create", key)
        return self.inner.create(key, buffers)

    def commit(self, key: str, data: bytes) -> None:
        self._enter("commit", key)
        self.inner.commit(key, data)

    def read(self, key: str, start: int | None = None, end: int | None = None) -> Blob:
        self._enter("read", key)
        return self.inner.read(key, start, end)

    def readv(self, key: str, buffers: Sequence, offset: int = 0) -> int:
        self._enter("readv", key)
        return self.inner.readv(key, buffers, offset)

    def read_object(self, key: str, limit: int) -> Blob:
        self._enter("read_object", key)
        return self.inner.read_object(key, limit)

    def head(self, key: str, n: int) -> Blob:
        self._enter("head", key)
        return self.inner.head(key, n)

    def exists(self, key: str) -> bool:
        self._enter("exists", key)
        return self.inner.exists(key)

    def size(self, key: str) -> int:
        self._enter("size", key)
        return self.inner.size(key)

    def mtime(self, key: str) -> float | None:
        self._enter("mtime", key)
        return self.inner.mtime(key)

    def list(self, prefix: str) -> list[str]:
        self._enter("list", prefix)
        return self.inner.list(prefix)

    def delete(self, key: str) -> None:
        self._enter("delete", key)
        self.inner.delete(key)

    def delete_many(self, keys: Sequence[str]) -> None:
        """One ``delete_many`` call (its first key matched by rules and gates), then each key through
        :meth:`delete`, so rules on ``delete`` still count single keys (killed after the k-th)."""
        self._enter("delete_many", keys[0] if keys else "")
        for key in keys:
            self.delete(key)

    def root_state(self) -> RootState:
        self._enter("root_state")
        return self.inner.root_state()

    def remove_root(self) -> None:
        self._enter("remove_root")
        self.inner.remove_root()

    def flush(self) -> None:
        self._enter("flush")
        self.inner.flush()

    def close(self) -> None:
        self._enter("close")
        self.inner.close()

    # -- passed through untouched ----------------------------------------------------------------------------
    def finish_creates(self, keys: Collection[str]) -> set[str]:
        return self.inner.finish_creates(keys)

    def describe(self) -> str:
        return self.inner.describe()

    def __getattr__(self, name: str) -> Any:
        # Only reached for what this class lacks (a backend's own attributes such as ``root``).
        if name == "inner":  # not set yet (during unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.inner, name)

    def __repr__(self) -> str:
        return f"FaultyStorage({self.inner!r}, rules={self.rules!r})"
