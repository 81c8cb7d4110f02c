"""A plain local directory, written the durable way: temp file, fsync, rename, fsync of the directory."""

from __future__ import annotations

import errno
import os
import shutil
import threading
import uuid
from collections.abc import Sequence

from ..errors import StorageError
from .base import RootState, Storage


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class LocalStorage(Storage):
    def __init__(self, root: str | os.PathLike):
        self.root = os.path.abspath(os.fspath(root))
        self.url = self.root
        self._made_dirs: set[str] = set()
        self._dirty_dirs: set[str] = set()
        self._lock = threading.Lock()

    def _path(self, key: str) -> str:
        # Keys are built by ckpt from validated names; this is the last guard against escaping the root.
        path = os.path.normpath(os.path.join(self.root, key))
        if path != self.root and not path.startswith(self.root + os.sep):
            raise StorageError(f"refusing to touch {key!r}: it resolves outside the checkpoint root {self.root}")
        return path

    def _ensure_dir(self, d: str) -> None:
        if d in self._made_dirs:
            return
        try:
            os.makedirs(d, exist_ok=True)
        except OSError as e:
            raise StorageError(f"cannot create directory {d}: {e}") from e
        with self._lock:
            self._made_dirs.add(d)
            # A new directory's own entry lives in its parent: make both durable at flush time.
            self._dirty_dirs.add(os.path.dirname(d))

    def _write_tmp(self, path: str, buffers: Sequence) -> tuple[str, int]:
        d = os.path.dirname(path)
        self._ensure_dir(d)
        tmp = f"{path}.tmp-{uuid.uuid4().hex[:12]}"
        total = 0
        try:
            try:
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileNotFoundError:  # the directory was removed behind our back: make it again
                with self._lock:
                    self._made_dirs.discard(d)
                self._ensure_dir(d)
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                for buf in buffers:
                    view = memoryview(buf).cast("B")
                    while view:
                        n = os.write(fd, view)
                        total += n
                        view = view[n:]
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError as e:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            hint = " (the disk is full: free space or point ckpt elsewhere)" if e.errno == errno.ENOSPC else ""
            raise StorageError(f"writing {path} failed: {e}{hint}") from e
        return tmp, total

    def write(self, key: str, buffers: Sequence) -> int:
        path = self._path(key)
        tmp, total = self._write_tmp(path, buffers)
        try:
            os.replace(tmp, path)
        except OSError as e:
            raise StorageError(f"renaming {tmp} to {path} failed: {e}") from e
        with self._lock:
            self._dirty_dirs.add(os.path.dirname(path))
        return total

    def commit(self, key: str, data: bytes) -> None:
        path = self._path(key)
        self.flush()  # everything written before must be durable before the commit point exists
        tmp, _ = self._write_tmp(path, [data])
        try:
            # link() is atomic and fails if the target exists: create-only, unlike rename().
            os.link(tmp, path)
        except FileExistsError:
            raise
        except OSError as e:
            raise StorageError(f"committing {path} failed: {e}") from e
        finally:
            try:
                os.unlink(tmp)
            except OSError:
                pass
        try:
            _fsync_dir(os.path.dirname(path))
        except OSError as e:
            raise StorageError(f"fsync of {os.path.dirname(path)} failed: {e}") from e

    def flush(self) -> None:
        with self._lock:
            dirs, self._dirty_dirs = self._dirty_dirs, set()
        for d in sorted(dirs, key=len, reverse=True):
            try:
                _fsync_dir(d)
            except FileNotFoundError:
                continue  # removed since (retention): its parent's entry is what matters, and is dirty
            except OSError as e:
                raise StorageError(f"fsync of directory {d} failed: {e}") from e

    def read(self, key: str, start: int | None = None, end: int | None = None) -> bytes:
        path = self._path(key)
        try:
            with open(path, "rb", buffering=0) as f:
                if start:
                    f.seek(start)
                if end is None:
                    return f.read()
                return f.read(end - (start or 0))
        except FileNotFoundError:
            raise
        except IsADirectoryError as e:
            raise FileNotFoundError(path) from e
        except OSError as e:
            raise StorageError(f"reading {path} failed: {e}") from e

    def readv(self, key: str, buffers: Sequence) -> int:
        path = self._path(key)
        views = [memoryview(b).cast("B") for b in buffers]
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            raise
        except OSError as e:
            raise StorageError(f"reading {path} failed: {e}") from e
        try:
            total, offset = 0, 0
            while views:
                n = os.preadv(fd, views, offset)
                if n == 0:
                    break
                total += n
                offset += n
                while views and n >= len(views[0]):  # drop the buffers that are full
                    n -= len(views[0])
                    views.pop(0)
                if views and n:
                    views[0] = views[0][n:]
            return total
        except OSError as e:
            raise StorageError(f"reading {path} failed: {e}") from e
        finally:
            os.close(fd)

    def _stat(self, key: str) -> os.stat_result:
        try:
            return os.stat(self._path(key))
        except FileNotFoundError:
            raise
        except OSError as e:
            raise StorageError(f"stat of {key} failed: {e}") from e

    def size(self, key: str) -> int:
        return self._stat(key).st_size

    def mtime(self, key: str) -> float | None:
        return self._stat(key).st_mtime

    def exists(self, key: str) -> bool:
        return os.path.exists(self._path(key))

    def list(self, prefix: str) -> list[str]:
        try:
            return sorted(os.listdir(self._path(prefix)))
        except (FileNotFoundError, NotADirectoryError):
            return []
        except OSError as e:
            raise StorageError(f"listing {prefix} failed: {e}") from e

    def delete(self, key: str) -> None:
        path = self._path(key)
        try:
            os.unlink(path)
        except FileNotFoundError:
            return
        except IsADirectoryError:
            try:
                os.rmdir(path)
            except OSError:
                return  # not empty (something new landed in it): leave it
            with self._lock:
                self._made_dirs.discard(path)
        except OSError as e:
            raise StorageError(f"deleting {path} failed: {e}") from e
        with self._lock:
            self._dirty_dirs.add(os.path.dirname(path))

    def root_state(self) -> RootState:
        if not os.path.exists(self.root):
            return "missing"
        if not os.path.isdir(self.root):
            return "file"
        return "nonempty" if os.listdir(self.root) else "empty"

    def remove_root(self) -> None:
        try:
            if os.path.islink(self.root) or os.path.isfile(self.root):
                os.unlink(self.root)  # a link to a checkpoint (Lightning's save_last="link"), not its target
            elif os.path.isdir(self.root):
                shutil.rmtree(self.root)
        except FileNotFoundError:
            pass
        except OSError as e:
            raise StorageError(f"removing {self.root} failed: {e}") from e
        with self._lock:
            self._made_dirs.clear()
            self._dirty_dirs.clear()
