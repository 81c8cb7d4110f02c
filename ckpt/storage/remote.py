"""Any fsspec filesystem (memory://, s3://, gs:// …) as checkpoint storage.

The filesystem is created with ``skip_instance_cache=True`` so two Checkpointers (or two tests)
never share fsspec's cached instance, and listings always ask the backend (``refresh=True``).
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence

import fsspec
from fsspec.implementations.local import LocalFileSystem

from ..errors import ConfigError, StorageError
from .base import RootState, Storage


def _advice(e: BaseException) -> str:
    """What to do about ``e`` or an error it was raised from, where that is known; else ``""``."""
    seen: set[int] = set()
    x: BaseException | None = e
    while x is not None and id(x) not in seen:
        seen.add(id(x))
        if type(x).__name__ in ("NoCredentialsError", "PartialCredentialsError"):  # botocore's, without importing it
            return (". ckpt found no (complete) S3 credentials; it takes them, first found first, from "
                    "storage_options={'key': ..., 'secret': ...} (and 'token' for temporary ones), the "
                    "AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY environment variables, or a profile in "
                    "~/.aws/credentials or ~/.aws/config (AWS_PROFILE or storage_options={'profile': ...} "
                    "picks one); for a public bucket pass storage_options={'anon': True}")
        x = x.__cause__ or x.__context__
    return ""


class FsspecStorage(Storage):
    def __init__(self, url: str, storage_options: dict):
        try:
            fs, root = fsspec.core.url_to_fs(url, skip_instance_cache=True, **storage_options)
        except (ImportError, ValueError) as e:
            raise ConfigError(
                f"cannot open {url!r} with fsspec: {e}. For s3:// install the extra: pip install 'ckpt[s3]'") from e
        self.fs = fs
        self.root = root.rstrip("/")
        self.url = url.rstrip("/")

    def _path(self, key: str) -> str:
        if ".." in key.split("/"):
            raise StorageError(f"refusing to touch {key!r}: it leaves the checkpoint root")
        return f"{self.root}/{key}"

    def _fail(self, what: str, key: str, e: Exception) -> StorageError:
        """The StorageError for ``e`` (callers keep ``e`` as its cause), with what to do about it where known."""
        return StorageError(f"{what} {self.url}/{key} failed: {type(e).__name__}: {e}{_advice(e)}")

    def write(self, key: str, buffers: Sequence) -> int:
        # One copy (join takes the buffers as they are): a copy per buffer first held a chunk twice per
        # writing thread, 256 MiB beside a host_memory budget at 8 threads of 16 MiB chunks.
        data = b"".join(b if isinstance(b, bytes) else memoryview(b).cast("B") for b in buffers)
        path = self._path(key)
        try:
            try:
                self.fs.pipe_file(path, data)
            except FileNotFoundError:
                if not isinstance(self.fs, LocalFileSystem):
                    raise  # an object store's makedirs would create a bucket: a missing one stays an error
                self.fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)  # fsspec's local:// makes none itself
                self.fs.pipe_file(path, data)
        except Exception as e:
            raise self._fail("writing", key, e) from e
        return len(data)

    def commit(self, key: str, data: bytes) -> None:
        # Best effort create-only: a store with conditional writes gets them in the S3 layer.
        if self.exists(key):
            raise FileExistsError(f"{self.url}/{key}")
        self.write(key, [data])

    def read(self, key: str, start: int | None = None, end: int | None = None) -> bytes:
        try:
            return self.fs.cat_file(self._path(key), start=start, end=end)
        except FileNotFoundError:
            raise
        except Exception as e:
            raise self._fail("reading", key, e) from e

    def size(self, key: str) -> int:
        try:
            return int(self.fs.info(self._path(key))["size"])
        except FileNotFoundError:
            raise
        except Exception as e:
            raise self._fail("stat of", key, e) from e

    def mtime(self, key: str) -> float | None:
        try:
            info = self.fs.info(self._path(key))
        except FileNotFoundError:
            raise
        except Exception as e:
            raise self._fail("stat of", key, e) from e
        # Backends name it differently: s3 LastModified, gcs updated, memory created, local mtime.
        for field in ("mtime", "LastModified", "last_modified", "updated", "modified", "created"):
            t = _timestamp(info.get(field))
            if t is not None:
                return t
        return None

    def exists(self, key: str) -> bool:
        try:
            return bool(self.fs.exists(self._path(key)))
        except Exception as e:
            raise self._fail("checking", key, e) from e

    def list(self, prefix: str) -> list[str]:
        path = self._path(prefix).rstrip("/")
        try:
            entries = self.fs.ls(path, detail=False, refresh=True)
        except FileNotFoundError:
            return []
        except TypeError:  # filesystems whose ls() takes no refresh argument
            try:
                entries = self.fs.ls(path, detail=False)
            except FileNotFoundError:
                return []
        except Exception as e:
            raise self._fail("listing", prefix, e) from e
        return sorted({e.rstrip("/").rsplit("/", 1)[-1] for e in entries})

    def delete(self, key: str) -> None:
        try:
            self.fs.rm_file(self._path(key))
        except FileNotFoundError:
            return
        except IsADirectoryError:  # a step's directory, on a file system that has them (``local://``, NFS)
            try:
                self.fs.rmdir(self._path(key))
            except OSError:
                return  # not empty (something new landed in it) or gone: leave it
        except Exception as e:
            raise self._fail("deleting", key, e) from e

    def delete_many(self, keys: Sequence[str]) -> None:
        """fsspec's ``rm`` with the list: backends with a bulk delete (s3fs, gcsfs) send a request per
        batch of keys; a missing key sends the batch back to one delete a key (it is not an error)."""
        if not keys:
            return
        try:
            self.fs.rm([self._path(k) for k in keys])
        except (FileNotFoundError, IsADirectoryError, ValueError):  # ValueError: fsspec's "Cannot delete directory"
            super().delete_many(keys)  # one at a time: a missing key is no error, an empty directory is removed
        except Exception as e:
            raise self._fail("deleting", keys[0], e) from e

    def root_state(self) -> RootState:
        return "nonempty" if self.list("") else "missing"

    def remove_root(self) -> None:
        try:
            if self.fs.exists(self.root):
                self.fs.rm(self.root, recursive=True)
        except FileNotFoundError:
            return
        except Exception as e:
            raise StorageError(f"removing {self.url} failed: {type(e).__name__}: {e}") from e


def _timestamp(v) -> float | None:
    if isinstance(v, datetime.datetime):
        return (v if v.tzinfo else v.replace(tzinfo=datetime.timezone.utc)).timestamp()
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return float(v)
    if isinstance(v, str):
        try:
            return _timestamp(datetime.datetime.fromisoformat(v.replace("Z", "+00:00")))
        except ValueError:
            return None
    return None
