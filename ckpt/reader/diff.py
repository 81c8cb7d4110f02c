"""What differs between two committed steps (``Reader.diff``, ``ckpt diff``)."""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from .. import tree as st
from ..format import manifest as mf
from .tensors import read_tensors

if TYPE_CHECKING:
    from .core import Reader


# -- difference between two steps --------------------------------------------------------------------

@dataclass
class TensorChange:
    key: str
    rank: int | None
    status: str  # "added", "removed", "changed", "same"
    how: str  # how it was decided: "hashes", "bytes", "shape" (dtype or shape differ), "-"
    detail: str = ""
    max_abs_diff: float | None = None

    @property
    def name(self) -> str:
        return self.key + (f" [rank {self.rank}]" if self.rank is not None else "")


def _by_hashes(a: mf.TensorEntry, ma: mf.Manifest, b: mf.TensorEntry, mb: mf.Manifest) -> bool | None:
    """True/False when chunk hashes decide whether two saved tensors hold the same bytes, None
    when they cannot (different shard layouts, or chunks shared with other tensors that differ)."""
    def shards(e):
        return sorted((s for s in e.shards if math.prod(s.lengths) > 0), key=lambda s: (s.offsets, s.lengths))
    sa, sb = shards(a), shards(b)
    if [(s.offsets, s.lengths) for s in sa] != [(s.offsets, s.lengths) for s in sb]:
        return None
    undecided = False
    for x, y in zip(sa, sb):
        gx = [(g.chunk, g.offset, g.length) for g in x.segments]
        gy = [(g.chunk, g.offset, g.length) for g in y.segments]
        if gx == gy:
            continue
        # A chunk that holds nothing but this piece of the tensor: equal hash <=> equal bytes.
        whole_x = all(g.offset == 0 and g.length == ma.chunks[g.chunk].size for g in x.segments)
        whole_y = all(g.offset == 0 and g.length == mb.chunks[g.chunk].size for g in y.segments)
        if whole_x and whole_y and [g[2] for g in gx] == [g[2] for g in gy]:
            return False
        undecided = True
    return None if undecided else True


def _max_abs_diff(x: torch.Tensor, y: torch.Tensor) -> float:
    if x.numel() == 0:
        return 0.0
    if x.is_complex():
        d = (x.to(torch.complex128) - y.to(torch.complex128)).abs()
    else:
        d = (x.to(torch.float64) - y.to(torch.float64)).abs()
    return float(d.max())


def _same_bytes(x: torch.Tensor, y: torch.Tensor) -> bool:
    return torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8))


def _changed_elements(x: torch.Tensor, y: torch.Tensor) -> int:
    """How many elements differ bit for bit (a NaN saved again is unchanged)."""
    if x.numel() == 0:
        return 0
    bx = x.reshape(-1).contiguous().view(torch.uint8).reshape(x.numel(), -1)
    by = y.reshape(-1).contiguous().view(torch.uint8).reshape(y.numel(), -1)
    return int((bx != by).any(dim=1).sum())


def _chunks_changed(a: mf.TensorEntry, b: mf.TensorEntry) -> tuple[int, int]:
    """(chunks of ``b`` that are not the chunk at the same place in ``a``, chunks of ``b``)."""
    def refs(e: mf.TensorEntry) -> list[tuple[list[int], str]]:
        return [(s.offsets, g.chunk) for s in sorted(e.shards, key=lambda s: (s.offsets, s.lengths))
                for g in s.segments]
    ra, rb = refs(a), refs(b)
    return sum(1 for i, r in enumerate(rb) if i >= len(ra) or ra[i] != r), len(rb)


def _read_detail(x: torch.Tensor, y: torch.Tensor, max_abs_diff: float | None) -> str:
    n = _changed_elements(x, y)
    return f"{n} of {x.numel()} element(s) differ" + (
        f", max abs diff {max_abs_diff:.6g}" if max_abs_diff is not None else "")


@dataclass
class Diff:
    """What differs between two steps: tensors (``status`` added / removed / changed / same, and
    how it was decided) and plain values (path, value in a, value in b, as short previews)."""

    a: int
    b: int
    tensors: list[TensorChange] = field(default_factory=list)
    values: list[tuple[str, str, str]] = field(default_factory=list)

    @property
    def identical(self) -> bool:
        return not self.values and all(c.status == "same" for c in self.tensors)

    def to_json(self, url: str) -> dict:
        """The ``ckpt diff --json`` document (schema ``ckpt-diff/1``)."""
        return {"schema": "ckpt-diff/1", "url": url, "a": self.a, "b": self.b,
                "tensors": [{"key": c.key, "rank": c.rank, "status": c.status, "decided_by": c.how,
                             "detail": c.detail, "max_abs_diff": c.max_abs_diff} for c in self.tensors],
                "values": [{"key": p, "a": x, "b": y} for p, x, y in self.values],
                "identical": self.identical}


def diff(reader: Reader, a: int, b: int, *, max_diff: bool = False, threads: int = 8) -> Diff:
    """Tensors and plain values that differ between steps ``a`` and ``b``.

    Tensors are compared by chunk hashes where those decide it, else by reading their bytes
    (small tensors packed with others, or a different shard layout). With ``max_diff`` every
    changed tensor of the same shape and dtype is read to report its largest absolute difference.
    A changed tensor's ``detail`` says what changed: dtype/shape (``float32(3,) -> float64(3,)``),
    how many elements differ (and the largest difference) when it was read, else how many of its
    chunks differ; an added or removed one's, its dtype and shape. Values that differ come as
    (value path, preview in a, preview in b)."""
    ma, mb = reader.manifest(a), reader.manifest(b)
    ea = {(t.key, t.rank): t for t in ma.tensors}
    eb = {(t.key, t.rank): t for t in mb.tensors}
    changes: list[TensorChange] = []
    to_read: list[TensorChange] = []
    for k in sorted(ea.keys() | eb.keys(), key=lambda k: (k[0], -1 if k[1] is None else k[1])):
        x, y = ea.get(k), eb.get(k)
        if x is None or y is None:
            t = x or y
            assert t is not None  # k is a key of ea or of eb
            changes.append(TensorChange(k[0], k[1], "removed" if y is None else "added", "-",
                                        f"{t.dtype}{tuple(t.shape)}"))
            continue
        if x.dtype != y.dtype or x.shape != y.shape:
            changes.append(TensorChange(k[0], k[1], "changed", "shape",
                                        f"{x.dtype}{tuple(x.shape)} -> {y.dtype}{tuple(y.shape)}"))
            continue
        same = _by_hashes(x, ma, y, mb)
        c = TensorChange(k[0], k[1], "same" if same else "changed", "hashes")
        if same is False:
            n, of = _chunks_changed(x, y)
            c.detail = f"{n} of {of} chunk(s) differ"
        if same is None:
            c.how = "bytes"
            to_read.append(c)
        elif not same and max_diff:
            to_read.append(c)
        changes.append(c)
    if to_read:
        with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="ckpt-diff") as io:
            for c in to_read:
                [ta] = read_tensors(reader.storage, ma, [ea[(c.key, c.rank)]], io)
                [tb] = read_tensors(reader.storage, mb, [eb[(c.key, c.rank)]], io)
                if c.how == "bytes":
                    c.status = "same" if _same_bytes(ta, tb) else "changed"
                if c.status == "changed" and max_diff:
                    c.max_abs_diff = _max_abs_diff(ta, tb)
                if c.status == "changed":
                    c.detail = _read_detail(ta, tb, c.max_abs_diff)
    va = dict(st.value_nodes(ma.structure))
    vb = dict(st.value_nodes(mb.structure))
    values = [(p, st.preview(va[p]) if p in va else "(absent)", st.preview(vb[p]) if p in vb else "(absent)")
              for p in sorted(va.keys() | vb.keys()) if va.get(p, ...) != vb.get(p, ...)]
    return Diff(a, b, changes, values)
