"""A plain local directory, written the durable way: temp file, fsync, rename, fsync of the directory.

With ``direct_io`` (a local tier staged in front of object storage turns it on), objects of 1 MiB or
more are written with ``O_DIRECT``, around the page cache, from a page-aligned scratch buffer per
thread: a staged chunk is read back at most once (by its upload, when too many wait to be held in
memory), and copying it into the page cache cost more CPU than its upload (issue 23 item 5). Where
the file system refuses ``O_DIRECT`` (``EINVAL``), the storage writes through the page cache from then on.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import shutil
import stat
import threading
import uuid
from collections.abc import Sequence

import numpy as np

from .. import _cpus, _ext
from ..errors import StorageError
from ..format.planes import scratch
from .base import Blob, RootState, Storage

log = logging.getLogger("ckpt")

# Opening a key one directory at a time (``dir_fd``, ``O_NOFOLLOW``) where the platform can; else real paths.
_WALKS = os.open in os.supports_dir_fd and os.stat in os.supports_dir_fd and hasattr(os, "O_DIRECTORY")
_DIR = getattr(os, "O_PATH", os.O_RDONLY) | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0)
_ALIGN = 4096  # O_DIRECT's alignment of memory, offsets and lengths: a multiple of every block size in use
_PIECE = 4 << 20  # bytes staged per O_DIRECT write (the scratch buffer of each writing thread)
_DIRECT_MIN = 1 << 20  # smaller objects (step files) go through the page cache: nothing to gain
_scratch = threading.local()


class _NoDirect(Exception):
    """The file system refused O_DIRECT (EINVAL)."""


def _pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


def _write_direct(fd: int, views: list[memoryview], size: int) -> None:
    """Write ``views`` laid end to end, in aligned pieces staged in this thread's scratch buffer; the
    last piece is padded to the alignment with zeros and the file cut back to ``size``."""
    buf = getattr(_scratch, "buf", None)
    if buf is None:
        buf = _scratch.buf = memoryview(mmap.mmap(-1, _PIECE))  # page-aligned, reused: no page faults
    fill = offset = 0
    for v in views:
        while v:
            k = min(len(v), _PIECE - fill)
            buf[fill:fill + k] = v[:k]
            fill, v = fill + k, v[k:]
            if fill == _PIECE:
                _pwrite_all(fd, buf, offset)
                fill, offset = 0, offset + _PIECE
    if fill:
        padded = -(-fill // _ALIGN) * _ALIGN
        buf[fill:padded] = bytes(padded - fill)
        _pwrite_all(fd, buf[:padded], offset)
    os.ftruncate(fd, size)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _preadv_full(fd: int, views: list[memoryview], offset: int) -> int:
    """Fill ``views`` in order from byte ``offset`` of ``fd``; the bytes read (fewer where the file ends)."""
    views = [v for v in views if len(v)]
    total = 0
    while views:
        n = os.preadv(fd, views, offset + total)
        if n == 0:
            break
        total += n
        while views and n >= len(views[0]):  # drop the buffers that are full
            n -= len(views[0])
            views.pop(0)
        if views and n:
            views[0] = views[0][n:]
    return total


class LocalStorage(Storage):
    # Reads from the page cache are memory-bound: threads beyond the cores only evict each other's
    # pieces from cache before they are hashed.
    read_width = _cpus.usable()
    hashes_reads = True

    def __init__(self, root: str | os.PathLike, *, direct_io: bool = False):
        self.root = os.path.abspath(os.fspath(root))
        self.direct_io = direct_io and hasattr(os, "O_DIRECT")
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
        views = [memoryview(b).cast("B") for b in buffers]
        size = sum(len(v) for v in views)
        if self.direct_io and size >= _DIRECT_MIN:
            try:
                return self._write_file(path, views, size, direct=True)
            except _NoDirect as e:
                self.direct_io = False
                log.info("%s refuses O_DIRECT (%s); writing through the page cache", self.root, e)
        return self._write_file(path, views, size, direct=False)

    def _write_file(self, path: str, views: list[memoryview], size: int, direct: bool) -> tuple[str, int]:
        d = os.path.dirname(path)
        tmp = f"{path}.tmp-{uuid.uuid4().hex[:12]}"
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | (os.O_DIRECT if direct else 0)
        try:
            try:
                fd = os.open(tmp, flags, 0o644)
            except FileNotFoundError:  # the directory was removed behind our back: make it again
                with self._lock:
                    self._made_dirs.discard(d)
                self._ensure_dir(d)
                fd = os.open(tmp, flags, 0o644)
            try:
                if direct:
                    _write_direct(fd, views, size)
                else:
                    for v in views:
                        while v:
                            v = v[os.write(fd, v):]
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError as e:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            if direct and e.errno == errno.EINVAL:
                raise _NoDirect(e) from e
            hint = " (the disk is full: free space or point ckpt elsewhere)" if e.errno == errno.ENOSPC else ""
            raise StorageError(f"writing {path} failed: {e}{hint}") from e
        return tmp, size

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

    def _link_new(self, path: str, buffers: Sequence, what: str) -> int:
        tmp, total = self._write_tmp(path, buffers)
        try:
            # link() is atomic and fails if the target exists: create-only, unlike rename().
            os.link(tmp, path)
        except FileExistsError:
            raise
        except OSError as e:
            raise StorageError(f"{what} {path} failed: {e}") from e
        finally:
            try:
                os.unlink(tmp)
            except OSError:
                pass
        return total

    def create(self, key: str, buffers: Sequence) -> int:
        path = self._path(key)
        total = self._link_new(path, buffers, "creating")
        with self._lock:
            self._dirty_dirs.add(os.path.dirname(path))
        return total

    def commit(self, key: str, data: bytes) -> None:
        path = self._path(key)
        self.flush()  # everything written before must be durable before the commit point exists
        self._link_new(path, [data], "committing")
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

    def _open(self, key: str) -> int:
        """A descriptor for reading ``key``, which must be a regular file inside the root: never a
        link (to a file outside, say), a FIFO (which would block) or a directory. Anything else is
        reported as missing: it is not an object ckpt wrote."""
        path = self._path(key)
        flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
        parent = self._parent_fd(key, path)
        try:
            if parent is None:
                fd = os.open(path, flags)
            else:
                fd = os.open(os.path.basename(path), flags, dir_fd=parent)
        except FileNotFoundError:
            raise
        except OSError as e:
            if e.errno in (errno.ELOOP, errno.EMLINK, errno.ENOTDIR):  # a link, or a file on the way
                raise FileNotFoundError(f"{path} is a link, not a ckpt object") from e
            raise StorageError(f"reading {path} failed: {e}") from e
        finally:
            if parent is not None:
                os.close(parent)
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise FileNotFoundError(f"{path} is not a regular file (a directory, FIFO or device): not a ckpt object")
        return fd

    def _parent_fd(self, key: str, path: str) -> int | None:
        """The directory holding ``key``, opened from the root one name at a time, none of them
        followed if it is a link (``O_PATH`` where there is one: no read permission needed, nothing
        read): what is opened in it is inside the root whatever changes around it meanwhile. A third
        of the time of resolving the directory's real path (a load opens every chunk twice: 41 µs an
        open against 14 µs, with the GIL held). None where the platform cannot open relative to a
        directory: the caller checks the real path instead (:meth:`_inside`)."""
        if path == self.root:
            raise FileNotFoundError(f"{key!r} names the checkpoint root itself, not an object in it")
        if not _WALKS:
            if not self._inside(os.path.dirname(path)):
                raise FileNotFoundError(f"{path}: a directory on its way leaves the checkpoint root (a link?)")
            return None
        names = path[len(self.root) + 1:].split(os.sep)[:-1]  # _path made it root + os.sep + the key, normalised
        fd = self._open_dir(self.root, None, path)
        for name in names:
            try:
                fd_next = self._open_dir(name, fd, path)
            finally:
                os.close(fd)
            fd = fd_next
        return fd

    @staticmethod
    def _open_dir(name: str, parent: int | None, path: str) -> int:
        """Directory ``name`` (relative to ``parent``; the root itself, links followed, when None)."""
        try:
            return os.open(name, _DIR) if parent is None else os.open(name, _DIR | os.O_NOFOLLOW, dir_fd=parent)
        except FileNotFoundError as e:
            raise FileNotFoundError(errno.ENOENT, f"no directory {name!r} on the way to it", path) from e
        except OSError as e:
            if e.errno in (errno.ELOOP, errno.ENOTDIR, errno.EMLINK):  # a link, or a file where a directory was
                raise FileNotFoundError(f"{path}: {name!r} on its way is a link or not a directory (it would leave "
                                        "the checkpoint root, or is not one ckpt made)") from e
            raise StorageError(f"opening {path} failed: {e}") from e

    def _inside(self, directory: str) -> bool:
        real = os.path.realpath(directory)
        root = os.path.realpath(self.root)
        return real == root or real.startswith(root + os.sep)

    def read(self, key: str, start: int | None = None, end: int | None = None) -> Blob:
        fd = self._open(key)
        try:
            pos = start or 0
            size = os.fstat(fd).st_size
            end = size if end is None else min(end, size)  # never allocate past the end of the file
            out = bytearray(max(0, end - pos))
            n = 0
            with memoryview(out) as view:
                while n < len(out):
                    k = os.preadv(fd, [view[n:]], pos + n)
                    if k == 0:
                        break
                    n += k
            del out[n:]
            return out  # bytes-like; no second copy of a large chunk
        except OSError as e:
            raise StorageError(f"reading {self._path(key)} failed: {e}") from e
        finally:
            os.close(fd)

    def readv(self, key: str, buffers: Sequence, offset: int = 0) -> int:
        views = [memoryview(b).cast("B") for b in buffers]
        fd = self._open(key)
        try:
            return _preadv_full(fd, views, offset)
        except OSError as e:
            raise StorageError(f"reading {self._path(key)} failed: {e}") from e
        finally:
            os.close(fd)

    def read_hashed(self, key: str, buffer, offset: int = 0, head=None) -> tuple[int, str | None]:
        core = _ext.cpu()
        view = memoryview(buffer).cast("B")
        if core is None or view.readonly or not view.c_contiguous:
            return super().read_hashed(key, view, offset, head)
        fd = self._open(key)  # once, for the head and the rest
        try:
            if head is not None:
                k = memoryview(head).nbytes
                got = _preadv_full(fd, [memoryview(head).cast("B")], offset - k)
                if got < k:
                    return got - k, None
            target = np.frombuffer(view, np.uint8)  # for its address; the read is one call, the GIL released
            return core.pread_hash(fd, offset, target.ctypes.data, len(view))
        except OSError as e:
            raise StorageError(f"reading {self._path(key)} failed: {e}") from e
        finally:
            os.close(fd)

    def read_object_into(self, key: str, limit: int) -> memoryview | None:
        fd = self._open(key)
        try:
            n = min(os.fstat(fd).st_size, limit + 1)  # one byte more than limit tells the caller it is too large
            view = scratch("object", n).data.cast("B")
            return view[:_preadv_full(fd, [view], 0)]
        except OSError as e:
            raise StorageError(f"reading {self._path(key)} failed: {e}") from e
        finally:
            os.close(fd)

    def _stat(self, key: str, *, directory_ok: bool = False) -> os.stat_result:
        path = self._path(key)
        parent = self._parent_fd(key, path)  # the root itself is no object: FileNotFoundError
        try:
            if parent is None:
                st = os.stat(path, follow_symlinks=False)
            else:
                st = os.stat(os.path.basename(path), dir_fd=parent, follow_symlinks=False)
        except FileNotFoundError:
            raise
        except OSError as e:
            raise StorageError(f"stat of {key} failed: {e}") from e
        finally:
            if parent is not None:
                os.close(parent)
        regular = stat.S_ISREG(st.st_mode) or (directory_ok and stat.S_ISDIR(st.st_mode))
        if not regular or (parent is None and not self._inside(os.path.dirname(path))):
            raise FileNotFoundError(f"{path} is not a regular file inside the checkpoint root")
        return st

    def size(self, key: str) -> int:
        return self._stat(key).st_size

    def mtime(self, key: str) -> float | None:
        return self._stat(key, directory_ok=True).st_mtime

    def exists(self, key: str) -> bool:
        try:
            self._stat(key)
            return True
        except FileNotFoundError:
            return False

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
