"""Where checkpoint objects live: a local directory or any fsspec URL, behind one small surface.

:class:`Storage` (``base.py``) is the surface; ``local.py``, ``remote.py`` (any fsspec URL),
``s3.py`` and ``tiered.py`` (a local tier staged in front of a remote one) implement it. This
module is the factory: it picks the backend from the URL.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from urllib.parse import urlparse

from ..errors import ConfigError
from .base import Blob, RootState, Storage, TierCounters
from .local import LocalStorage
from .remote import FsspecStorage

__all__ = ["Storage", "Blob", "RootState", "TierCounters", "LocalStorage", "FsspecStorage", "open_storage",
           "open_tiered", "durable_of", "read_counters"]


def open_storage(url: str, storage_options: dict | None = None, *, direct_io: bool = False) -> Storage:
    """Open a local path, ``file://`` URL, or any fsspec URL (``memory://``, ``s3://`` …). ``direct_io``: a
    local directory writes its large objects around the page cache (a Checkpointer's saves; readers need not)."""
    if not isinstance(url, str) or not url:
        raise ConfigError(f"checkpoint path must be a non-empty string or os.PathLike, got {url!r}")
    scheme = urlparse(url).scheme
    if scheme in ("", "file") or (len(scheme) == 1 and url[1:3] in (":\\", ":/")):  # windows drive
        if storage_options:
            raise ConfigError("storage_options apply to fsspec URLs only, not to a local directory")
        return LocalStorage(url[len("file://"):] if scheme == "file" else url, direct_io=direct_io)
    if scheme in ("s3", "s3a"):
        try:
            from .s3 import S3Storage
        except ImportError as e:
            raise ConfigError(f"{url!r} needs s3fs: pip install 'ckpt[s3]' ({e})") from e
        return S3Storage(url, storage_options or {})
    return FsspecStorage(url, storage_options or {})


def _apart(path: str, local_dir: str, given: str) -> None:
    """Refuse a local_dir that is the checkpoint path, or one of the two inside the other. Both tiers
    list and collect what is under their root: nested, one tier's chunks, manifests and leases would
    be seen by the other as its own objects (orphans ``ckpt gc`` removes, steps it did not commit).
    Compared as real paths, so a symlink or ``..`` does not hide it."""
    a, b = os.path.realpath(path), os.path.realpath(local_dir)
    if a == b:
        raise ConfigError(f"local_dir {given!r} is the checkpoint path itself; leave local_dir out")
    inner = "local_dir is inside the checkpoint path" if os.path.commonpath([a, b]) == a else (
        "the checkpoint path is inside local_dir" if os.path.commonpath([a, b]) == b else None)
    if inner is not None:
        raise ConfigError(
            f"{inner} (checkpoint path {a}, local_dir {b}): each tier lists and collects everything under "
            "its directory, so the other tier's files would be taken for its own checkpoint objects. Put "
            "local_dir beside the checkpoint path, not inside it or around it (e.g. /nvme/ckpt for /mnt/run).")


def durable_of(storage: Storage) -> Storage:
    """The storage that is the truth: the remote behind a ``local_dir`` staging directory
    (:meth:`ckpt.storage.tiered.TieredStorage.durable_tier`, also through a wrapper that passes the
    tiered storage's attributes on), else ``storage`` itself. Small control objects (leases, the run
    journal) go straight there."""
    tier = getattr(storage, "durable_tier", None)
    return tier() if callable(tier) else storage


def read_counters(storage: Storage, reset: bool = False) -> TierCounters | None:
    """Where a storage with a ``local_dir`` in front served chunk reads from since the last reset
    (``reset``: start counting afresh, and return None); None for a single directory or bucket."""
    if reset:
        start = getattr(storage, "reset_tier_counters", None)
        if callable(start):
            start()
        return None
    counters = getattr(storage, "tier_counters", None)
    return counters() if callable(counters) else None


def open_tiered(url: str, local_dir: str | None, storage_options: dict | None = None, *,
                verify: Callable[[str, list[memoryview]], None], upload_threads: int = 8,
                local_commits: bool = False, direct_io: bool = False) -> Storage:
    """The storage of a Checkpointer: ``url`` alone, or ``local_dir`` staged in front of it.

    ``verify(key, parts)`` checks a chunk object (its bytes, in order as read) before the local tier
    serves it, raising a ``CheckpointError`` for a copy that must not be trusted. ``direct_io``: a local
    ``url`` writes its chunks around the page cache (the local tier always does)."""
    from .tiered import TieredStorage

    remote = open_storage(url, storage_options, direct_io=direct_io)
    if local_dir is None:
        return remote
    local = open_storage(local_dir)
    if not isinstance(local, LocalStorage):
        raise ConfigError(f"local_dir must be a local directory, got {local_dir!r}")
    if isinstance(remote, LocalStorage):
        _apart(remote.root, local.root, local_dir)
    return TieredStorage(local, remote, verify=verify, upload_threads=upload_threads, local_commits=local_commits)
