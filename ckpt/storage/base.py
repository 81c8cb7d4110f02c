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
    if scheme in ("s3", "s3a"):
        try:
            from .s3 import S3Storage
        except ImportError as e:
            raise ConfigError(f"{url!r} needs s3fs: pip install 'ckpt[s3]' ({e})") from e
        return S3Storage(url, storage_options or {})
    return FsspecStorage(url, storage_options or {})


def open_tiered(url: str, local_dir: str | None, storage_options: dict | None = None,
                upload_threads: int = 8) -> Storage:
    """The storage of a Checkpointer: ``url`` alone, or ``local_dir`` staged in front of it."""
    remote = open_storage(url, storage_options)
    if local_dir is None:
        return remote
    from .local import LocalStorage
    from .tiered import TieredStorage

    local = open_storage(local_dir)
    if not isinstance(local, LocalStorage):
        raise ConfigError(f"local_dir must be a local directory, got {local_dir!r}")
    if isinstance(remote, LocalStorage) and remote.root == local.root:
        raise ConfigError(f"local_dir {local_dir!r} is the checkpoint path itself; leave local_dir out")
    return TieredStorage(local, remote, upload_threads)
