"""The storage surface every backend provides.

Keys are '/'-separated paths relative to the checkpoint root. Every method translates backend
errors once: a missing object is a plain ``FileNotFoundError`` (callers know whether that means
"no such step" or "a chunk is missing"), anything else becomes :class:`~ckpt.errors.StorageError`
with the backend's error kept as ``__cause__``.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from urllib.parse import urlparse

from ..errors import ConfigError


class Storage(abc.ABC):
    """Abstract storage rooted at ``url``."""

    url: str

    @abc.abstractmethod
    def write(self, key: str, buffers: Sequence) -> int:
        """Write the concatenation of ``buffers`` to ``key`` durably; the object appears whole or not
        at all. Returns the number of bytes written."""

    @abc.abstractmethod
    def commit(self, key: str, data: bytes) -> None:
        """Create ``key`` atomically and durably, only if it does not exist yet.

        Raises ``FileExistsError`` if it does. This is the commit point of a step."""

    @abc.abstractmethod
    def read(self, key: str, start: int | None = None, end: int | None = None) -> bytes:
        """Bytes ``[start, end)`` of ``key`` (the whole object by default)."""

    @abc.abstractmethod
    def exists(self, key: str) -> bool: ...

    @abc.abstractmethod
    def list(self, prefix: str) -> list[str]:
        """Names directly under the directory ``prefix`` (no listing cache); empty if it is absent."""

    @abc.abstractmethod
    def delete(self, key: str) -> None:
        """Delete ``key``; a missing key is not an error."""

    def size(self, key: str) -> int:
        return len(self.read(key))

    def mtime(self, key: str) -> float | None:
        """When ``key`` was last written (seconds since the epoch), or None where the backend does not
        say. ``ckpt gc`` uses it so it never deletes what a running save may be about to commit."""
        return None

    def readv(self, key: str, buffers: Sequence) -> int:
        """Fill ``buffers`` in order from the start of ``key``; returns the bytes filled.

        Backends that can read straight into caller memory override this to skip a copy."""
        data = memoryview(self.read(key))
        pos = 0
        for buf in buffers:
            view = memoryview(buf).cast("B")
            n = min(len(view), len(data) - pos)
            view[:n] = data[pos : pos + n]
            pos += n
        return pos

    def flush(self) -> None:
        """Make directory entries created by :meth:`write` durable (a no-op where that is implied)."""

    def describe(self) -> str:
        return self.url


def open_storage(url: str, storage_options: dict | None = None) -> Storage:
    """Open a local path, ``file://`` URL, or any fsspec URL (``memory://``, ``s3://`` …)."""
    from .local import LocalStorage
    from .remote import FsspecStorage

    if not isinstance(url, str) or not url:
        raise ConfigError(f"checkpoint path must be a non-empty string or os.PathLike, got {url!r}")
    scheme = urlparse(url).scheme
    if scheme in ("", "file") or (len(scheme) == 1 and url[1:3] in (":\\", ":/")):  # windows drive
        if storage_options:
            raise ConfigError("storage_options apply to fsspec URLs only, not to a local directory")
        return LocalStorage(url[len("file://"):] if scheme == "file" else url)
    return FsspecStorage(url, storage_options or {})
