"""One save's view of a :class:`ckpt.storage.tiered.TieredStorage` with local commits (see that
module's docstring): writes, ``exists``, ``head`` and ``commit`` answer in this save's sense."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING

from ..format.paths import is_chunk_key
from .base import Blob, RootState, Storage

if TYPE_CHECKING:
    from .tiered import TieredStorage


class SaveView(Storage):
    """One save's view of a :class:`TieredStorage` with local commits (see the module docstring):
    ``persist`` is whether the save is uploaded. Writes, ``exists``, ``head`` and ``commit`` answer
    in this save's sense; everything else is the tiered storage's."""

    def __init__(self, tiers: TieredStorage, persist: bool):
        self.tiers = tiers
        self.persist = persist
        self.url = tiers.url

    def write(self, key: str, buffers: Sequence) -> int:
        if not self.persist:
            return self.tiers.local.write(key, buffers)
        return self.tiers.write(key, buffers)

    def create(self, key: str, buffers: Sequence) -> int:
        if not self.persist:
            return self.tiers.local.create(key, buffers)
        return self.tiers.create(key, buffers)

    def finish_creates(self, keys: Collection[str]) -> set[str]:
        return self.tiers.finish_creates(keys) if self.persist else set()

    def commit(self, key: str, data: bytes) -> None:
        if not self.persist:
            self.tiers.local.commit(key, data)
            return
        self.tiers.commit(key, data)

    def exists(self, key: str) -> bool:
        if not self.persist:
            return self.tiers.local.exists(key)
        return self.tiers.stored(key)

    def head(self, key: str, n: int) -> Blob:
        if is_chunk_key(key):
            if not self.exists(key):
                raise FileNotFoundError(key)
            return self.tiers.local.read(key, 0, n)
        return self.tiers.read(key, 0, n)

    def read(self, key: str, start: int | None = None, end: int | None = None) -> Blob:
        return self.tiers.read(key, start, end)

    def read_object(self, key: str, limit: int) -> Blob:
        return self.tiers.read_object(key, limit)

    def readv(self, key: str, buffers: Sequence, offset: int = 0) -> int:
        return self.tiers.readv(key, buffers, offset)

    def size(self, key: str) -> int:
        return self.tiers.size(key)

    def mtime(self, key: str) -> float | None:
        return self.tiers.mtime(key)

    def list(self, prefix: str) -> list[str]:
        return self.tiers.list(prefix)

    def delete(self, key: str) -> None:
        self.tiers.delete(key)

    def delete_many(self, keys: Sequence[str]) -> None:
        self.tiers.delete_many(keys)

    def root_state(self) -> RootState:
        return self.tiers.root_state()

    def remove_root(self) -> None:
        self.tiers.remove_root()

    def flush(self) -> None:
        self.tiers.flush()

    def describe(self) -> str:
        return self.tiers.describe()

    def close(self) -> None:
        pass  # the tiered storage outlives its saves
