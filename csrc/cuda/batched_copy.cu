// ckpt's CUDA core: device-to-host copies of many tensors into the pinned host buffer in few calls.
//
// Two ways, both enqueued on the caller's (side) stream, both behind a C ABI loaded with ctypes:
//  * ckpt_cuda_copy_kernel: ONE kernel launch for a whole list of pieces; SM threads store straight
//    into pinned (mapped) host memory. Wins for many small tensors, where one cudaMemcpyAsync per
//    tensor costs a few microseconds of host time each.
//  * ckpt_cuda_copy_memcpy: one cudaMemcpyAsync per piece, issued from C (no Python per tensor). The
//    copy engines do the work, leaving the SMs to the training step: best for large tensors.
// ckpt/cuda_snapshot.py decides per size class which one a piece takes (KERNEL_MAX_BYTES; see docs/design.md).
// All pieces of one call come from one device and go into one pinned buffer.
//
// The runtime is linked statically (nvcc's default), so ckpt/_ext.py asks ckpt_cuda_probe, per
// device and before the first copy, whether this build can run there at all (driver new enough,
// a kernel image for the GPU), and falls back to torch's copies with a warning if not.

#include <cuda_runtime.h>
#include <cstdint>

// Bumped whenever CopyDesc or an exported signature changes: ckpt/_ext.py CUDA_ABI_VERSION must
// match, so a library left over from an older ckpt is refused instead of misread.
#define CKPT_CUDA_ABI_VERSION 2

struct CopyDesc {  // one piece: nbytes from device src to host dst (dst is pinned, so device-visible)
  const uint8_t* src;
  uint8_t* dst;
  uint64_t nbytes;
};

constexpr int kUnroll = 4;  // 16-byte loads each thread has in flight before its first store

// One block per piece. Each thread walks its own indices tid, tid + B, tid + 2B, ... (B = blockDim.x)
// through the piece's 16-byte words: kUnroll of them per iteration while all kUnroll are in range
// (loads first, then stores, so the loads overlap), then the rest one at a time. Together the threads
// cover every word exactly once; bytes past the last whole word, or a piece not 16-byte aligned on
// both sides, go byte by byte.
__global__ void copy_pieces(const CopyDesc* __restrict__ descs) {
  const CopyDesc d = descs[blockIdx.x];
  const uint8_t* __restrict__ src = d.src;
  uint8_t* __restrict__ dst = d.dst;
  const uint64_t stride = blockDim.x;
  uint64_t done = 0;
  if (((reinterpret_cast<uintptr_t>(src) | reinterpret_cast<uintptr_t>(dst)) & 15) == 0) {
    const uint4* __restrict__ s = reinterpret_cast<const uint4*>(src);
    uint4* __restrict__ t = reinterpret_cast<uint4*>(dst);
    const uint64_t words = d.nbytes / 16;
    uint64_t i = threadIdx.x;
    for (; i + (kUnroll - 1) * stride < words; i += kUnroll * stride) {
      uint4 v[kUnroll];
#pragma unroll
      for (int k = 0; k < kUnroll; ++k) v[k] = __ldg(s + i + k * stride);
#pragma unroll
      for (int k = 0; k < kUnroll; ++k) t[i + k * stride] = v[k];
    }
    for (; i < words; i += stride) t[i] = __ldg(s + i);
    done = words * 16;
  }
  for (uint64_t i = done + threadIdx.x; i < d.nbytes; i += stride) dst[i] = src[i];
}

extern "C" {

int ckpt_cuda_abi_version() { return CKPT_CUDA_ABI_VERSION; }

// What the loader needs to decide whether this build runs on `device` (ckpt/_ext.py cuda_verdict):
// out[0] the driver's CUDA version (0: no driver), out[1] the runtime this library was built with,
// out[2], out[3] the device's compute capability (0 if it could not be read), out[4] the error of
// asking for copy_pieces' attributes there (0: the kernel has an image this GPU can run; 35: the
// driver is too old; 209: no image for this GPU). Like the copies, it makes `device` current: the
// caller runs it with that device current already (torch.cuda.device), so nothing changes.
int ckpt_cuda_probe(int device, int* out) {
  for (int k = 0; k < 5; ++k) out[k] = 0;
  cudaDriverGetVersion(&out[0]);
  cudaRuntimeGetVersion(&out[1]);
  cudaError_t e = cudaDeviceGetAttribute(&out[2], cudaDevAttrComputeCapabilityMajor, device);
  if (e == cudaSuccess) e = cudaDeviceGetAttribute(&out[3], cudaDevAttrComputeCapabilityMinor, device);
  if (e == cudaSuccess) e = cudaSetDevice(device);
  if (e == cudaSuccess) {
    cudaFuncAttributes attr;
    e = cudaFuncGetAttributes(&attr, copy_pieces);
  }
  out[4] = static_cast<int>(e);
  cudaGetLastError();  // the errors above are not sticky: clear them so later checks see their own
  return 0;
}

// A stream of ckpt's own on `device` (not one of torch's pooled streams, which other libraries are
// handed too), non-blocking (no implicit sync with the legacy default stream, which is the compute
// stream unless the caller set another) at the lowest priority (training kernels go first). Never
// destroyed: ckpt makes one per device and keeps it for the life of the process. Called, like the
// others, with `device` current already.
int ckpt_cuda_stream_create(int device, void** out) {
  *out = nullptr;
  cudaError_t e = cudaSetDevice(device);
  int least = 0, greatest = 0;
  if (e == cudaSuccess) e = cudaDeviceGetStreamPriorityRange(&least, &greatest);
  cudaStream_t s = nullptr;
  if (e == cudaSuccess) e = cudaStreamCreateWithPriority(&s, cudaStreamNonBlocking, least);
  if (e == cudaSuccess) *out = s;
  return static_cast<int>(e);
}

// Host memory the kernel may touch through the same pointer: pinned, and mapped at the same address
// (true for cudaHostAlloc memory under unified addressing, which is how torch pins by default).
static bool mapped_in_place(const void* p) {
  cudaPointerAttributes attr;
  if (cudaPointerGetAttributes(&attr, p) != cudaSuccess) {
    cudaGetLastError();  // clear it, so the next check of the last error sees only its own
    return false;
  }
  return attr.type == cudaMemoryTypeHost && attr.devicePointer == p;
}

// `descs` must stay valid until the stream reaches the kernel (pinned host memory is read in place).
// Returns -1 (nothing enqueued) when the piece list or the destination is not usable in place:
// the caller then uses ckpt_cuda_copy_memcpy.
int ckpt_cuda_copy_kernel(const CopyDesc* descs, int n, void* stream, int device) {
  if (n <= 0) return 0;
  cudaError_t e = cudaSetDevice(device);
  if (e != cudaSuccess) return static_cast<int>(e);
  if (!mapped_in_place(descs) || !mapped_in_place(descs[0].dst)) return -1;
  copy_pieces<<<n, 512, 0, static_cast<cudaStream_t>(stream)>>>(descs);
  return static_cast<int>(cudaGetLastError());
}

int ckpt_cuda_copy_memcpy(const CopyDesc* descs, int n, void* stream, int device) {
  cudaError_t e0 = cudaSetDevice(device);
  if (e0 != cudaSuccess) return static_cast<int>(e0);
  for (int i = 0; i < n; ++i) {
    cudaError_t e = cudaMemcpyAsync(descs[i].dst, descs[i].src, descs[i].nbytes, cudaMemcpyDeviceToHost,
                                    static_cast<cudaStream_t>(stream));
    if (e != cudaSuccess) return static_cast<int>(e);
  }
  return 0;
}

const char* ckpt_cuda_error_string(int code) { return cudaGetErrorString(static_cast<cudaError_t>(code)); }

}  // extern "C"
