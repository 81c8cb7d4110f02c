// ckpt's CUDA core: device-to-host copies of many tensors into the pinned host buffer in few calls.
//
// Two ways, both enqueued on the caller's (side) stream, both behind a C ABI loaded with ctypes:
//  * ckpt_cuda_copy_kernel: ONE kernel launch for a whole list of pieces; SM threads store straight
//    into pinned (mapped) host memory. Wins for many small tensors, where one cudaMemcpyAsync per
//    tensor costs a few microseconds of host time each.
//  * ckpt_cuda_copy_memcpy: one cudaMemcpyAsync per piece, issued from C (no Python per tensor). The
//    copy engines do the work, leaving the SMs to the training step: best for large tensors.
// ckpt/snapshot.py decides per size class which one a piece takes (KERNEL_MAX_BYTES; see docs/design.md).
// All pieces of one call come from one device and go into one pinned buffer.

#include <cuda_runtime.h>
#include <cstdint>

struct CopyDesc {  // one piece: nbytes from device src to host dst (dst is pinned, so device-visible)
  const uint8_t* src;
  uint8_t* dst;
  uint64_t nbytes;
};

__global__ void copy_pieces(const CopyDesc* __restrict__ descs) {
  CopyDesc d = descs[blockIdx.x];
  const bool vec = ((reinterpret_cast<uintptr_t>(d.src) | reinterpret_cast<uintptr_t>(d.dst)) & 15) == 0;
  uint64_t done = 0;
  if (vec) {  // 16-byte loads and stores, several in flight per thread
    const uint4* s = reinterpret_cast<const uint4*>(d.src);
    uint4* t = reinterpret_cast<uint4*>(d.dst);
    uint64_t n = d.nbytes / 16;
    for (uint64_t i = threadIdx.x; i < n; i += blockDim.x) t[i] = __ldg(s + i);
    done = n * 16;
  }
  for (uint64_t i = done + threadIdx.x; i < d.nbytes; i += blockDim.x) d.dst[i] = d.src[i];
}

extern "C" {

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
