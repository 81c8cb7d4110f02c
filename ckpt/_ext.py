"""The optional compiled core (csrc/), loaded with ctypes; ``None`` where it was not built.

``cpu()`` is the fused copy + xxh3-128 library, ``cuda()`` the batched device-to-host copy. Both are
plain C ABIs: they do not depend on torch's C++ ABI, and ctypes releases the GIL for each call. Set
``CKPT_NO_EXT=1`` to ignore them at run time (the pure-Python paths give the same bytes and hashes).
"""

from __future__ import annotations

import ctypes
import glob
import logging
import os
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

log = logging.getLogger("ckpt")

_HERE = os.path.dirname(os.path.abspath(__file__))

# numpy layouts of the C structs (csrc/copyhash.cpp Seg, csrc/cuda/batched_copy.cu CopyDesc)
SEG = np.dtype([("src", "<u8"), ("dst_off", "<u8"), ("len", "<u8"), ("check", "<u8")])
# A link of a chain for CpuCore.chain_decode: its planes, which are rANS sections, its tail bytes, rotated.
ChainLink = tuple[list[np.ndarray], list[bool], np.ndarray, bool]

ABI_VERSION = 13  # csrc/copyhash.cpp ckpt_abi_version(): a library built for another layout is not used
CUDA_ABI_VERSION = 2  # csrc/cuda/batched_copy.cu ckpt_cuda_abi_version(), the same rule
# Seg.check: how the core checks a segment's elements for NaN/Inf (0: not checked)
CHECK_KINDS = {"float16": 1, "bfloat16": 2, "float32": 3, "float64": 4}
DESC = np.dtype([("src", "<u8"), ("dst", "<u8"), ("nbytes", "<u8")])
COPY = np.dtype([("dst", "<u8"), ("src", "<u8"), ("len", "<u8")])  # csrc/copyhash.cpp CopyItem


def _find(stem: str) -> str | None:
    hits = sorted(glob.glob(os.path.join(_HERE, stem + "*.so")) + glob.glob(os.path.join(_HERE, stem + "*.pyd")))
    return hits[0] if hits else None


def _disabled() -> bool:
    return os.environ.get("CKPT_NO_EXT", "").strip().lower() not in ("", "0", "false", "no")


def _chain_args(links: list[ChainLink]) -> tuple[int, list]:
    """The link count and the arrays ckpt_chain_decode(_range) take for ``links``: widths and rotations,
    plane pointers, lengths, coded flags (16 slots a link), tail pointers. The arrays must outlive the call."""
    count = len(links)
    wr = np.zeros(2 * count, np.int32)
    ptrs = (ctypes.c_void_p * (16 * count))()
    lens = np.zeros(16 * count, np.uint64)
    flags = np.zeros(16 * count, np.uint8)
    tails = (ctypes.c_void_p * count)()
    for i, (planes, coded, tail, rot) in enumerate(links):
        if len(planes) > 16:
            raise ValueError("a chain link has at most 16 planes")
        wr[2 * i:2 * i + 2] = len(planes), int(rot)
        for k, (p, c) in enumerate(zip(planes, coded)):
            ptrs[16 * i + k], lens[16 * i + k], flags[16 * i + k] = p.ctypes.data, p.size, c
        tails[i] = tail.ctypes.data
    return count, [wr.ctypes.data_as(ctypes.c_void_p), ptrs, lens.ctypes.data_as(ctypes.c_void_p),
                   flags.ctypes.data_as(ctypes.c_void_p), tails]


class CpuCore:
    """Fused copy + hash. Hashes equal ``xxhash.xxh3_128_hexdigest`` of the same bytes."""

    def __init__(self, lib: ctypes.CDLL, path: str):
        self.path = path
        self.lib = lib
        lib.ckpt_abi_version.restype = ctypes.c_int
        if lib.ckpt_abi_version() != ABI_VERSION:
            raise OSError(f"built for ABI {lib.ckpt_abi_version()}, this ckpt needs {ABI_VERSION}")
        lib.ckpt_simd_level.restype = ctypes.c_int
        lib.ckpt_xxh3_128.restype = ctypes.c_int
        lib.ckpt_xxh3_128.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_void_p]
        lib.ckpt_copy_hash.restype = ctypes.c_int
        ptr = ctypes.c_void_p
        u64 = ctypes.c_uint64
        lib.ckpt_copy_hash.argtypes = [ptr, ptr, u64, ptr, ptr, u64, ptr, ptr, ptr, ctypes.c_int]
        self.simd = {2: "avx2", 1: "sse2", 0: "portable"}.get(lib.ckpt_simd_level(), "?")
        lib.ckpt_group.restype = ctypes.c_int
        lib.ckpt_group.argtypes = [ptr, ptr, u64, ctypes.c_int, ctypes.c_int, ptr]
        lib.ckpt_ungroup_planes.restype = ctypes.c_int
        lib.ckpt_ungroup_planes.argtypes = [ptr, ptr, ptr, u64, ctypes.c_int, ctypes.c_int, ptr]
        lib.ckpt_rans_bound.restype = u64
        lib.ckpt_rans_bound.argtypes = [u64]
        lib.ckpt_rans_encode.restype = ctypes.c_int64
        lib.ckpt_rans_encode.argtypes = [ptr, u64, ptr, u64, ctypes.c_int]
        lib.ckpt_rans_estimate.restype = u64
        lib.ckpt_rans_estimate.argtypes = [ptr, u64, ptr]
        lib.ckpt_rans_decode.restype = ctypes.c_int
        lib.ckpt_rans_decode.argtypes = [ptr, u64, ptr, u64, ctypes.c_int]
        lib.ckpt_rans_simd.restype = ctypes.c_int
        lib.ckpt_planes_decode.restype = ctypes.c_int
        lib.ckpt_planes_decode.argtypes = [ptr, ptr, ptr, ptr, ptr, u64, ctypes.c_int, ctypes.c_int, ctypes.c_int, ptr,
                                           ptr]
        lib.ckpt_chain_decode.restype = ctypes.c_int
        lib.ckpt_chain_decode.argtypes = [ctypes.c_int, ptr, ptr, ptr, ptr, ptr, u64, ctypes.c_int, ptr, ptr,
                                          ctypes.c_int]
        lib.ckpt_chain_decode_range.restype = ctypes.c_int
        lib.ckpt_chain_decode_range.argtypes = [ctypes.c_int, ptr, ptr, ptr, ptr, ptr, ptr, ptr, u64, u64, u64,
                                                ctypes.c_int, ptr]
        self.rans_simd = lib.ckpt_rans_simd()
        lib.ckpt_pread_hash.restype = ctypes.c_int64
        lib.ckpt_pread_hash.argtypes = [ctypes.c_int, u64, ptr, u64, ptr]
        lib.ckpt_copy_many.restype = ctypes.c_int
        lib.ckpt_copy_many.argtypes = [ptr, u64, ctypes.c_int]
        lib.ckpt_mask_compact.restype = ctypes.c_int64
        lib.ckpt_mask_compact.argtypes = [ptr, ptr, u64, ctypes.c_int, ptr, ptr]
        lib.ckpt_mask_expand.restype = ctypes.c_int64
        lib.ckpt_mask_expand.argtypes = [ptr, ptr, u64, u64, ctypes.c_int, ptr, ptr]

    def pread_hash(self, fd: int, offset: int, ptr: int, length: int) -> tuple[int, str | None]:
        """Read ``length`` bytes at ``offset`` of file ``fd`` into memory at ``ptr``, hashing each
        piece while it is in cache. Returns the bytes read and their xxh3-128 (None when fewer were
        read or the input is 240 bytes or shorter); OSError on a failed read."""
        out = np.zeros(3, np.uint64)
        n = self.lib.ckpt_pread_hash(fd, offset, ptr, length, out.ctypes.data)
        if n < 0:
            raise OSError(-n, os.strerror(-n))
        lo, hi, hashed = out.tolist()
        return n, (f"{hi:016x}{lo:016x}" if hashed else None)

    def copy_many(self, items: np.ndarray, threads: int) -> None:
        """Copy COPY records (non-overlapping) with ``threads`` threads, the GIL released."""
        if len(items):
            self.lib.ckpt_copy_many(items.ctypes.data, len(items), threads)

    def group(self, src: np.ndarray, base: np.ndarray | None, width: int, out: np.ndarray, rot: bool = False) -> None:
        """``src`` (XOR ``base``; each element rotated left one bit with ``rot``) split into ``width``
        byte planes in ``out`` (uint8 arrays of one length)."""
        if self.lib.ckpt_group(src.ctypes.data, None if base is None else base.ctypes.data, src.nbytes, width,
                               int(rot), out.ctypes.data):
            raise ValueError(f"byte planes of width {width} (rotated: {rot}) are not supported")

    def ungroup_planes(self, planes: list[np.ndarray], tail: np.ndarray, base: np.ndarray | None, n: int,
                       out: np.ndarray, rot: bool = False) -> None:
        """The inverse of :meth:`group`, from planes in separate buffers (each ``n // len(planes)``
        bytes) and the tail; ``base`` may be ``out`` itself."""
        ptrs = (ctypes.c_void_p * len(planes))(*[p.ctypes.data for p in planes])
        if self.lib.ckpt_ungroup_planes(ptrs, tail.ctypes.data, None if base is None else base.ctypes.data, n,
                                        len(planes), int(rot), out.ctypes.data):
            raise ValueError(f"byte planes of width {len(planes)} (rotated: {rot}) are not supported")

    def mask_compact(self, src: np.ndarray, base: np.ndarray | None, width: int, mask: np.ndarray,
                     out: np.ndarray) -> int:
        """The elements of ``src`` (XOR ``base``) with a bit set, in order, into ``out`` (room for all of
        them), and one bit per element into ``mask`` (``ceil(m / 8)`` bytes): the count kept. Widths 2, 4
        and 8 (ValueError else)."""
        k = self.lib.ckpt_mask_compact(src.ctypes.data, None if base is None else base.ctypes.data,
                                       src.nbytes // width, width, mask.ctypes.data, out.ctypes.data)
        if k < 0:
            raise ValueError(f"zero masks of width {width} are not supported")
        return int(k)

    def mask_expand(self, mask: np.ndarray, kept: np.ndarray, k: int, width: int, base: np.ndarray | None,
                    out: np.ndarray) -> int:
        """The inverse of :meth:`mask_compact` into ``out`` (the elements' bytes; ``base`` may be ``out``):
        the count the mask kept, or -1 where it keeps more than the ``k`` elements ``kept`` holds."""
        return int(self.lib.ckpt_mask_expand(mask.ctypes.data, kept.ctypes.data, k, out.size // width, width,
                                             None if base is None else base.ctypes.data, out.ctypes.data))

    def rans_encode(self, src: np.ndarray, simd: int = 2) -> bytes:
        """The rANS section of the uint8 array ``src`` (csrc/rans_encode.cpp; format in ckpt/format/rans.py).
        ``simd`` caps the vector code used, as :meth:`rans_decode`'s: every level writes the same bytes."""
        src = np.ascontiguousarray(src, np.uint8)
        out = np.empty(self.lib.ckpt_rans_bound(src.size), np.uint8)
        n = self.lib.ckpt_rans_encode(src.ctypes.data, src.size, out.ctypes.data, out.size, simd)
        if n < 0:
            raise ValueError("rans: output bound too small")
        return out[:n].tobytes()

    def rans_estimate(self, src: np.ndarray, cost: np.ndarray) -> int:
        """About the length of :meth:`rans_encode`'s section of ``src``, from its blocks' counts alone
        (``cost``: uint32 per frequency, from ckpt/format/rans.py)."""
        src = np.ascontiguousarray(src, np.uint8)
        from .format.rans import SCALE_BITS
        if cost.dtype != np.uint32 or not cost.flags.c_contiguous or cost.size != (1 << SCALE_BITS) + 1:
            raise ValueError(f"rans_estimate takes the contiguous uint32 cost table of {(1 << SCALE_BITS) + 1} "
                             "entries (rans._cost())")
        return int(self.lib.ckpt_rans_estimate(src.ctypes.data, src.size, cost.ctypes.data))

    def rans_decode(self, section, out: np.ndarray, simd: int = 2) -> int:
        """Decode ``section`` into exactly the uint8 array ``out``: 0, or the core's error code. ``simd``
        caps the vector code used (2: AVX-512, 1: AVX2, 0: the scalar decoder, the reference the
        others are tested against); :attr:`rans_simd` is what this CPU has."""
        sec = np.frombuffer(section, np.uint8)
        if out.dtype != np.uint8 or not out.flags.c_contiguous:
            raise ValueError("rans_decode writes into a contiguous uint8 array")
        return int(self.lib.ckpt_rans_decode(sec.ctypes.data, sec.size, out.ctypes.data, out.size, simd))

    def planes_decode(self, planes: list[np.ndarray], coded: list[bool], tail: np.ndarray, base: np.ndarray | None,
                      out: np.ndarray, rot: bool, simd: int = 2) -> tuple[int, str | None]:
        """The inverse of :meth:`group` into ``out`` (uint8, the chunk's length) from the planes, each
        as it is or, where ``coded``, a rANS section, decoded a tile at a time while in cache, and
        hashed as it goes. Returns (0 or the rANS decoder's error code, the xxh3-128 of ``out`` or None
        where it is 240 bytes or shorter)."""
        w = len(planes)
        ptrs = (ctypes.c_void_p * w)(*[p.ctypes.data for p in planes])
        lens = np.array([p.size for p in planes], np.uint64)
        flags = np.array(coded, np.uint8)
        h = np.zeros(3, np.uint64)
        err = self.lib.ckpt_planes_decode(ptrs, lens.ctypes.data, flags.ctypes.data, tail.ctypes.data,
                                          None if base is None else base.ctypes.data, out.size, w, int(rot), simd,
                                          out.ctypes.data, h.ctypes.data)
        lo, hi, hashed = h.tolist()
        return int(err), (f"{hi:016x}{lo:016x}" if hashed and not err else None)

    def chain_decode(self, links: list[ChainLink], out: np.ndarray, simd: int = 2,
                     hashed: bool = True) -> tuple[int, str | None]:
        """A delta chain in one pass into ``out`` (uint8, the chunk's length): ``links`` whole-first,
        each a delta of the one before (see :meth:`planes_decode`; a link of no planes: ``out`` holds
        it already, only as the first). Returns (0, the rANS decoder's error code, or 5: widths too
        varied to decode together; the xxh3-128 of the result or None where it is 240 bytes or shorter,
        or not ``hashed``: a pass that more links follow). Only the result is hashed."""
        count, arrays = _chain_args(links)
        h = np.zeros(3, np.uint64)
        err = self.lib.ckpt_chain_decode(count, *arrays, out.size, simd, out.ctypes.data, h.ctypes.data, int(hashed))
        lo, hi, done = h.tolist()
        return int(err), (f"{hi:016x}{lo:016x}" if done and not err else None)

    def chain_decode_range(self, links: list[ChainLink], base: np.ndarray | None, out: np.ndarray, lo: int, hi: int,
                           first: list[list[int]] | None = None, simd: int = 2) -> int:
        """Bytes [lo, hi) of a delta chain into ``out[lo:hi]`` (``out``: uint8, the chunk's length; the
        rest of it is not written), only the tiles that cover them decoded and not hashed (the caller
        checks them against span digests). ``links`` as :meth:`chain_decode` takes them, except that a
        first link of no planes is ``base`` (the chunk's length); ``first``: per link, per plane not
        coded, the element its bytes start at (where it holds only the part the range needs). Returns
        0 or the error code (4 also for a plane that does not hold what the range needs of it)."""
        if base is not None and base.size != out.size:
            raise ValueError("chain_decode_range: base must be as long as out")
        count, arrays = _chain_args(links)
        starts = np.zeros(16 * count, np.uint64)
        for i, f in enumerate(first or []):
            starts[16 * i:16 * i + len(f)] = f
        return int(self.lib.ckpt_chain_decode_range(count, *arrays, starts.ctypes.data,
                                                    None if base is None else base.ctypes.data, out.size, lo, hi,
                                                    simd, out.ctypes.data))

    def xxh3_128(self, ptr: int, length: int) -> str | None:
        """Hex xxh3-128 of ``length`` bytes at ``ptr``; None for inputs of 240 bytes or fewer."""
        out = np.empty(2, np.uint64)
        if self.lib.ckpt_xxh3_128(ptr, length, out.ctypes.data) != 0:
            return None
        return f"{int(out[1]):016x}{int(out[0]):016x}"

    def copy_hash(self, dst_ptr: int, segs: np.ndarray, chunk_offsets: np.ndarray, want: np.ndarray,
                  threads: int) -> tuple[list[str | None], np.ndarray]:
        """Copy ``segs`` (SEG records sorted by dst_off) into the buffer at ``dst_ptr`` and hash the
        chunks ``[offsets[c], offsets[c+1])`` with ``want[c]``. Returns the hashes (None where a chunk
        was not hashed) and, per segment, 1 where its ``check`` found a NaN or Inf."""
        n = len(chunk_offsets) - 1
        out = np.zeros(2 * max(n, 1), np.uint64)
        hashed = np.zeros(max(n, 1), np.uint8)
        bad = np.zeros(max(len(segs), 1), np.uint8)
        self.lib.ckpt_copy_hash(dst_ptr, segs.ctypes.data, len(segs), chunk_offsets.ctypes.data, want.ctypes.data,
                                n, out.ctypes.data, hashed.ctypes.data, bad.ctypes.data, threads)
        lo, hi = out[0::2].tolist(), out[1::2].tolist()
        return [f"{hi[c]:016x}{lo[c]:016x}" if hashed[c] else None for c in range(n)], bad[:len(segs)]


class CudaCore:
    """Batched device-to-host copies on a given stream: one kernel for many pieces, or a C loop of
    ``cudaMemcpyAsync``; and the side streams they run on.

    The library links the CUDA runtime statically, so loading it proves nothing about the GPU:
    :meth:`usable` asks it, per device and before the first copy there, whether the driver is new
    enough and the kernel has an image for that GPU (see :func:`cuda_verdict`)."""

    def __init__(self, lib: ctypes.CDLL, path: str):
        self.path = path
        self.lib = lib
        lib.ckpt_cuda_abi_version.restype = ctypes.c_int
        if lib.ckpt_cuda_abi_version() != CUDA_ABI_VERSION:
            raise OSError(f"built for CUDA ABI {lib.ckpt_cuda_abi_version()}, this ckpt needs {CUDA_ABI_VERSION} "
                          "(a library left from another ckpt: reinstall ckpt to rebuild it)")
        for name in ("ckpt_cuda_copy_kernel", "ckpt_cuda_copy_memcpy"):
            fn = getattr(lib, name)
            fn.restype = ctypes.c_int
            fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
        lib.ckpt_cuda_error_string.restype = ctypes.c_char_p
        lib.ckpt_cuda_error_string.argtypes = [ctypes.c_int]
        lib.ckpt_cuda_probe.restype = ctypes.c_int
        lib.ckpt_cuda_probe.argtypes = [ctypes.c_int, ctypes.c_void_p]
        lib.ckpt_cuda_stream_create.restype = ctypes.c_int
        lib.ckpt_cuda_stream_create.argtypes = [ctypes.c_int, ctypes.c_void_p]
        self._verdicts: dict[int, str | None] = {}

    def error_string(self, code: int) -> str:
        return self.lib.ckpt_cuda_error_string(code).decode()

    def probe(self, device: int) -> CudaProbe:
        """What the library finds on ``device`` (call with that device current)."""
        out = (ctypes.c_int * 5)()
        self.lib.ckpt_cuda_probe(device, out)
        return CudaProbe(driver=out[0], runtime=out[1], capability=(out[2], out[3]), kernel_error=out[4])

    def usable(self, device: int) -> bool:
        """Can this build copy on ``device``? Asked once per device (with it current); on no, one
        warning says why and what to do, and that device's snapshots use torch's copies."""
        if device not in self._verdicts:
            p = self.probe(device)
            why = self._verdicts[device] = cuda_verdict(p, self.error_string(p.kernel_error))
            if why is not None:
                log.warning("the compiled CUDA copy (%s) cannot run on GPU %d: %s. Snapshots from that GPU use "
                            "torch's copies instead (the same bytes; slower for many small tensors).",
                            self.path, device, why)
        return self._verdicts[device] is None

    def stream(self, device: int) -> int:
        """A new non-blocking, lowest-priority stream of ckpt's own on ``device`` (its cudaStream_t as an
        int; call with that device current). It is never destroyed: make one per device."""
        out = ctypes.c_void_p()
        code = self.lib.ckpt_cuda_stream_create(device, ctypes.byref(out))
        if code != 0 or not out.value:
            raise OSError(f"cudaStreamCreateWithPriority failed on GPU {device}: {self.error_string(code)} "
                          f"(error {code})")
        return out.value

    def copy(self, descs: np.ndarray, stream: int, device: int, kernel: bool) -> bool:
        """Enqueue DESC records on ``stream`` of GPU ``device``. With ``kernel``, ``descs`` must live in
        pinned memory until the stream has run the kernel; returns False (nothing enqueued) if the
        kernel cannot reach that memory in place, so the caller uses the memcpy way instead."""
        if len(descs) == 0:
            return True
        fn = self.lib.ckpt_cuda_copy_kernel if kernel else self.lib.ckpt_cuda_copy_memcpy
        code = fn(descs.ctypes.data, len(descs), stream, device)
        if code == -1:
            return False
        if code != 0:
            from .errors import CheckpointError
            raise CheckpointError(f"CUDA snapshot copy failed: {self.error_string(code)} "
                                  f"(error {code}); set CKPT_NO_EXT=1 to use torch's copies instead")
        return True


@dataclass(frozen=True)
class CudaProbe:
    """What ``ckpt_cuda_probe`` reports for one device."""

    driver: int  # the CUDA version the driver supports, as 1000 * major + 10 * minor (0: no driver)
    runtime: int  # the CUDA runtime the library was built with (linked in), same encoding
    capability: tuple[int, int]  # the GPU's compute capability ((0, 0): could not be read)
    kernel_error: int  # cudaFuncGetAttributes on the copy kernel there (0: it can run)


# cudaError_t values the verdict names (driver_types.h)
ERR_INSUFFICIENT_DRIVER = 35
ERR_INVALID_DEVICE_FUNCTION = 98
ERR_NO_KERNEL_IMAGE = 209
ERR_UNSUPPORTED_PTX = 222


def _cuda_version(v: int) -> str:
    return f"{v // 1000}.{v % 1000 // 10}"


def cuda_verdict(p: CudaProbe, error_name: str = "") -> str | None:
    """Why the compiled CUDA copy cannot run on a device, with what to do about it; None if it can.

    The runtime is linked in, so the driver must support its major version (a 13.x runtime runs on
    any 13.x driver, not on a 12.x one: CUDA error 35), and the library must hold an image for the
    GPU: machine code for its architecture, or PTX the driver can compile (else error 209)."""
    rebuild = "rebuild ckpt's core (`pip install -e .` in ckpt's checkout, or `python setup.py build_ext --inplace`)"
    if p.driver == 0:
        return "no NVIDIA driver was found"
    if p.driver // 1000 < p.runtime // 1000 or p.kernel_error == ERR_INSUFFICIENT_DRIVER:
        return (f"the NVIDIA driver supports CUDA {_cuda_version(p.driver)}, older than the CUDA "
                f"{_cuda_version(p.runtime)} runtime it was built with (CUDA error 35). Update the driver, or "
                f"{rebuild} with a CUDA {p.driver // 1000}.x toolkit (CUDA_HOME)")
    if p.kernel_error in (ERR_NO_KERNEL_IMAGE, ERR_INVALID_DEVICE_FUNCTION):
        cc = "".join(map(str, p.capability))
        return (f"it holds no kernel for this GPU (compute capability {p.capability[0]}.{p.capability[1]}; CUDA "
                f"error {p.kernel_error}). Set CKPT_CUDA_ARCHS=\"{cc}\" and {rebuild}")
    if p.kernel_error == ERR_UNSUPPORTED_PTX:
        return (f"its kernel's PTX is newer than the driver (CUDA {_cuda_version(p.driver)}) can compile (CUDA error "
                f"222). Update the driver, or set CKPT_CUDA_ARCHS to this GPU's architecture and {rebuild}")
    if p.kernel_error:
        named = f", {error_name}" if error_name else ""
        return f"asking for its kernel failed (CUDA error {p.kernel_error}{named})"
    return None


def _load(stem: str, cls):
    path = _find(stem)
    if path is None:
        return None
    try:
        return cls(ctypes.CDLL(path), path)
    except (OSError, AttributeError) as e:  # AttributeError: a symbol is missing (a build of an older ckpt)
        log.warning("could not load %s (%s); using the pure-Python path", path, e)
        return None


@lru_cache(None)
def _load_cpu() -> CpuCore | None:
    core = _load("_copyhash", CpuCore)
    if core is None:
        return None
    # Self-check against the reference before trusting it with checkpoints.
    import xxhash
    probe = np.frombuffer(bytes(range(256)) * 20, np.uint8)
    if core.xxh3_128(probe.ctypes.data, probe.nbytes) != xxhash.xxh3_128_hexdigest(probe.tobytes()):
        log.warning("%s hashes differently from xxhash; not using it (reinstall ckpt to rebuild it)", core.path)
        return None
    return core


@lru_cache(None)
def _load_cuda() -> CudaCore | None:
    return _load("_cuda_copy", CudaCore)


def cpu() -> CpuCore | None:
    return None if _disabled() else _load_cpu()


def cuda() -> CudaCore | None:
    return None if _disabled() else _load_cuda()


def info() -> dict:
    """What is built and used, for ``ckpt --version``-style reports and bug reports."""
    c, g = _load_cpu(), _load_cuda()
    return {"cpu": c.path if c else None, "simd": c.simd if c else None, "cuda": g.path if g else None,
            "disabled": _disabled()}
