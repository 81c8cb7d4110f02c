// ckpt's CUDA core: device-to-host copies of many tensors into the pinned host buffer in few calls.
//
// Two ways, both enqueued on the caller's (side) stream, both behind a C ABI loaded with ctypes:
//  * ckpt_cuda_copy_kernel: ONE kernel launch for a whole list of pieces; SM threads store straight
//    into pinned (mapped) host memory. Wins for many small tensors, where one cudaMemcpyAsync per
//    tensor costs a few microseconds of host time each.
//  * ckpt_cuda_copy_memcpy: one cudaMemcpyAsync per piece, issued from C (no Python per tensor). The
//    copy engines do the work, leaving the SMs to the training step: best for large tensors.
// ckpt/_ext.py decides per size class which one a piece takes (the threshold is measured, see README).

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

// `descs` must stay valid until the stream reaches the kernel (pinned host memory is read in place).
int ckpt_cuda_copy_kernel(const CopyDesc* descs, int n, void* stream) {
  if (n <= 0) return 0;
  const CopyDesc* dev = descs;
  cudaPointerAttributes attr;
  if (cudaPointerGetAttributes(&attr, descs) == cudaSuccess && attr.devicePointer != nullptr)
    dev = static_cast<const CopyDesc*>(attr.devicePointer);
  copy_pieces<<<n, 512, 0, static_cast<cudaStream_t>(stream)>>>(dev);
  return static_cast<int>(cudaGetLastError());
}

int ckpt_cuda_copy_memcpy(const CopyDesc* descs, int n, void* stream) {
  for (int i = 0; i < n; ++i) {
    cudaError_t e = cudaMemcpyAsync(descs[i].dst, descs[i].src, descs[i].nbytes, cudaMemcpyDeviceToHost,
                                    static_cast<cudaStream_t>(stream));
    if (e != cudaSuccess) return static_cast<int>(e);
  }
  return 0;
}

const char* ckpt_cuda_error_string(int code) { return cudaGetErrorString(static_cast<cudaError_t>(code)); }

}  // extern "C"
