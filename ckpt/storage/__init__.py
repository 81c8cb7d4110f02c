"""Where checkpoint objects live: a local directory or any fsspec URL, behind one small surface."""

from .base import Storage, open_storage, open_tiered
from .local import LocalStorage
from .remote import FsspecStorage

__all__ = ["Storage", "LocalStorage", "FsspecStorage", "open_storage", "open_tiered"]
