"""The compiled CPU core (csrc/copyhash.cpp) against the pure-Python path: same bytes, same hashes."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest
import torch
import xxhash

import ckpt
from ckpt import _ext
from ckpt.format.chunk import chunk_hash
from ckpt.save.buffer_layout import make_layout
from ckpt.save.snapshot import HostBuffer

core = _ext.cpu()
needs_core = pytest.mark.skipif(core is None, reason="compiled core not built (no C++ compiler, or CKPT_NO_EXT)")


def test_extensions_are_built_where_the_toolchain_exists():
    """CI builds with CKPT_BUILD_STRICT=1; this catches a build that silently produced nothing."""
    if os.environ.get("CKPT_NO_EXT"):
        pytest.skip("CKPT_NO_EXT is set: nothing is compiled on purpose")
    info = _ext.info()
    if shutil.which("c++") or shutil.which("g++"):
        assert info["cpu"] is not None, "a C++ compiler is here but ckpt/_copyhash*.so is missing: reinstall"
    if shutil.which("nvcc") and not os.environ.get("CKPT_NO_CUDA"):
        assert info["cuda"] is not None, "nvcc is here but ckpt/_cuda_copy*.so is missing: reinstall"


@needs_core
def test_xxh3_128_matches_xxhash_at_every_length_and_alignment():
    rng = np.random.default_rng(1)
    data = rng.integers(0, 256, size=(1 << 21) + 64, dtype=np.uint8)
    lengths = list(range(230, 2200)) + [4095, 4096, 4097, 65536, 65537, 1 << 20, 1 << 21]
    for n in lengths:
        for off in (0, 1, 13):
            view = data[off : off + n]
            got = core.xxh3_128(view.ctypes.data, n)
            if n <= 240:
                assert got is None  # short inputs are left to Python
            else:
                assert got == xxhash.xxh3_128_hexdigest(view.tobytes()), (n, off)


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    big = torch.randn(700, 300, generator=g)
    c = torch.randn(64, 8, dtype=torch.complex64, generator=g)
    return {
        "f32": torch.randn(1000, 257, generator=g),
        "bf16": torch.randn(333, 129, generator=g).to(torch.bfloat16),
        "f16": torch.randn(77, generator=g).half(),
        "f64": torch.randn(5, 7, generator=g, dtype=torch.float64),
        "i8": torch.randint(-128, 127, (999,), dtype=torch.int8, generator=g),
        "i64": torch.randint(0, 1 << 40, (31, 3), generator=g),
        "bool": torch.rand(513, generator=g) > 0.5,
        "scalar": torch.tensor(3.5),
        "empty": torch.empty(0, 4),
        "transposed": big.t(),  # not contiguous
        "strided": big[::3, 1::2],
        "conj": c.conj(),  # lazily conjugated: a raw memcpy would be wrong
        "neg": torch.randn(4, 4, dtype=torch.complex64, generator=g).conj().imag,  # negative-bit view
        "tail": torch.randn(3, generator=g),
    }


@needs_core
@pytest.mark.parametrize("chunk_size", [64 * 1024, 65_537, 1 << 20])
@pytest.mark.parametrize("threads", [1, 3])
def test_fused_copy_hash_equals_the_python_path(chunk_size, threads):
    state = _state()
    layout = make_layout(state, chunk_size)
    native = HostBuffer(layout, native=True, threads=threads)
    plain = HostBuffer(layout, native=False)
    _, hashes, _ = native.copy_in(state)
    _, none, _ = plain.copy_in(state)
    assert none is None and native.last_used["cpu"].startswith("native")
    assert torch.equal(native.buffer, plain.buffer)
    for slot in layout.slots:  # and the bytes are the tensors' values
        got = native.buffer[slot.offset : slot.offset + slot.nbytes].view(slot.dtype).view(slot.shape)
        want = state[slot.key].resolve_conj().resolve_neg()
        assert torch.equal(got, want), slot.key
    assert len(hashes) == len(layout.chunks)
    for c, h in zip(layout.chunks, hashes):
        want = chunk_hash(native.view(c.offset, c.length))
        assert h == want if c.length > 240 else h is None


@needs_core
def test_saves_with_and_without_the_core_store_identical_chunks(tmp_path):
    state = _state()
    manifests = []
    for native in (True, False):
        with ckpt.Checkpointer(tmp_path / str(native), chunk_size=64 * 1024, native=native) as c:
            c.save(1, state).wait()
            manifests.append(c.manifest(1))
    a, b = manifests
    assert a.chunks == b.chunks and len(a.chunks) > 5
    out = {k: torch.full_like(v.resolve_conj().resolve_neg(), 0) for k, v in state.items()}
    ckpt.Checkpointer(tmp_path / "True").load(1, out)
    for k, v in state.items():
        assert torch.equal(out[k], v.resolve_conj().resolve_neg()), k


@needs_core
def test_second_save_after_in_place_change_rehashes(tmp_path):
    """The snapshot hashes what it copied this time, not what an earlier save saw."""
    t = torch.randn(1 << 18)
    with ckpt.Checkpointer(tmp_path, chunk_size=64 * 1024) as c:
        c.save(1, {"t": t}).wait()
        t[12345] += 1.0
        c.save(2, {"t": t}).wait()
        changed = set(c.manifest(2).chunks) - set(c.manifest(1).chunks)
    assert len(changed) == 1  # exactly the chunk holding element 12345
    out = {"t": torch.zeros_like(t)}
    ckpt.Checkpointer(tmp_path).load(2, out)
    assert torch.equal(out["t"], t)


FLOATS = [torch.float16, torch.bfloat16, torch.float32, torch.float64]


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("chunk_size", [64 * 1024, 65_538, 1 << 20])
def test_the_nan_inf_check_finds_every_poisoned_element_and_nothing_else(native, chunk_size):
    """One bad element anywhere (first, last, at a chunk or 64 KiB piece edge, in a source not aligned
    to 16 bytes) of any checked dtype is found by the copy pass; finite extremes (max, subnormals,
    -0.0) and unchecked tensors holding NaN are not reported."""
    if native and core is None:
        pytest.skip("compiled core not built")
    rng = np.random.default_rng(chunk_size + native)
    base = torch.zeros(1 << 20, dtype=torch.float64)
    for trial in range(12):
        state: dict[str, torch.Tensor] = {}
        poisoned = set()
        for i, dtype in enumerate(FLOATS * 2):
            n = int(rng.integers(1, 200_000))
            t = torch.randn(n + 3, dtype=torch.float64).to(dtype)[int(rng.integers(0, 3)):][:n]  # odd start
            t[rng.integers(0, n, 3)] = torch.finfo(dtype).max
            t[rng.integers(0, n, 3)] = torch.finfo(dtype).tiny / 4  # subnormal
            key = f"{i}_{str(dtype)[6:]}"
            if rng.random() < 0.5:
                edges = [0, n - 1, n // 2] + [e for e in range(0, n, chunk_size // t.element_size())]
                where = int(rng.choice(edges + [int(rng.integers(0, n))]))
                t[where] = float(rng.choice([float("nan"), float("inf"), float("-inf")]))
                poisoned.add(key)
            state[key] = t
        state["unchecked"] = base[: int(rng.integers(1, 1000))].clone().fill_(float("nan"))
        layout = make_layout(state, chunk_size)
        buf = HostBuffer(layout, native=native, threads=3)
        _, _, bad = buf.copy_in(state, frozenset(), frozenset(k for k in state if k != "unchecked"))
        assert set(bad) == poisoned, trial
        for slot in layout.slots:  # the copy is still exact
            got = buf.buffer[slot.offset : slot.offset + slot.nbytes].view(slot.dtype).view(slot.shape)
            assert torch.equal(got.view(torch.uint8), state[slot.key].contiguous().view(torch.uint8)), slot.key


@needs_core
@pytest.mark.parametrize("width", [2, 4, 8])
@pytest.mark.parametrize("rot", [False, True])
@pytest.mark.parametrize("n", [0, 5, 31, 64, 4096 * 4 + 7, 100_003 * 8])
def test_planes_come_back_to_the_same_bytes_with_and_without_a_base(width, rot, n):
    """The compiled un-grouping (16 elements a step with SSE2, then element by element) inverts the
    grouping at every length, with a base, and with the base as its own output (a delta in place);
    a base that agrees over whole blocks exercises the unchanged-block shortcut."""
    from ckpt.format.planes import group, ungroup

    rng = np.random.default_rng(n + width)
    raw = rng.integers(0, 256, n, dtype=np.uint8)
    base = rng.integers(0, 256, n, dtype=np.uint8)
    base[: n // 2] = raw[: n // 2]  # half the chunk unchanged: zero planes there
    for b in (None, base):
        g = group(raw, b, width, rot=rot)
        assert np.array_equal(ungroup(g, b, width, np.empty(n, np.uint8), rot), raw)
    in_place = base.copy()
    assert np.array_equal(ungroup(group(raw, base, width, rot=rot), in_place, width, in_place, rot), raw)


@needs_core
@pytest.mark.parametrize("width", [2, 4, 8])
@pytest.mark.parametrize("rot", [False, True])
@pytest.mark.parametrize("n", [0, 5, 31, 64, 4096 * 4 + 7, 100_003 * 8])
def test_compiled_grouping_writes_the_format_s_bytes(width, rot, n):
    """The compiled grouping (SSE2 byte transposes for 2- and 4-byte elements) stores exactly the
    layout docs/format.md gives: plane p holds byte p of every element (XOR base, rotated left by
    one bit with rot), then the tail; computed here with plain numpy."""
    from ckpt.format.planes import group

    rng = np.random.default_rng(7 * n + width)
    raw = rng.integers(0, 256, n, dtype=np.uint8)
    base = rng.integers(0, 256, n, dtype=np.uint8)
    words = {2: np.uint16, 4: np.uint32, 8: np.uint64}[width]
    m = n // width
    for b in (None, base):
        body = raw[: m * width] if b is None else raw[: m * width] ^ b[: m * width]
        if rot:
            v = body.view(words)
            body = ((v << words(1)) | (v >> words(8 * width - 1))).view(np.uint8)
        tail = raw[m * width:] if b is None else raw[m * width:] ^ b[m * width:]
        want = np.concatenate([body.reshape(m, width).T.reshape(-1), tail])
        assert np.array_equal(group(raw, b, width, rot=rot), want)
