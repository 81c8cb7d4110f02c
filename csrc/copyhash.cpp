// ckpt's CPU core: copy tensors into the host buffer and hash each chunk while its bytes are in cache.
//
// A C ABI loaded with ctypes (ckpt/_ext.py), so the library does not depend on torch's C++ ABI and
// ctypes releases the GIL for the whole call. Hashes are XXH3-128 with the default secret, written
// from the published algorithm description; they must equal the `xxhash` Python package's output
// (tests/test_ext.py checks every length class we compute and many offsets). Inputs of 240 bytes or
// fewer use XXH3's short-input formulas, which we do not implement: those chunks are reported as not
// hashed and Python hashes them (a chunk that small is rare and costs nothing).
//
// The same pass checks floating-point sources for NaN and Inf (ckpt refuses to save a poisoned
// state): each element is tested once, right after the copy read it, while it is still in cache.

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <thread>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define CKPT_X86 1
#endif

#include "core.h"

namespace {

constexpr uint64_t P32_1 = 0x9E3779B1ULL, P32_2 = 0x85EBCA77ULL, P32_3 = 0xC2B2AE3DULL;
constexpr uint64_t P64_1 = 0x9E3779B185EBCA87ULL, P64_2 = 0xC2B2AE3D27D4EB4FULL, P64_3 = 0x165667B19E3779F9ULL,
                   P64_4 = 0x85EBCA77C2B2AE63ULL, P64_5 = 0x27D4EB2F165667C5ULL;

constexpr size_t STRIPE = 64, SECRET_SIZE = 192, STRIPES_PER_BLOCK = (SECRET_SIZE - STRIPE) / 8;
constexpr size_t BLOCK = STRIPE * STRIPES_PER_BLOCK;  // 1024 bytes
constexpr size_t SHORT_MAX = 240;                    // longer inputs take the accumulator path

alignas(64) const uint8_t kSecret[SECRET_SIZE] = {
    0xb8, 0xfe, 0x6c, 0x39, 0x23, 0xa4, 0x4b, 0xbe, 0x7c, 0x01, 0x81, 0x2c, 0xf7, 0x21, 0xad, 0x1c, 0xde, 0xd4, 0x6d,
    0xe9, 0x83, 0x90, 0x97, 0xdb, 0x72, 0x40, 0xa4, 0xa4, 0xb7, 0xb3, 0x67, 0x1f, 0xcb, 0x79, 0xe6, 0x4e, 0xcc, 0xc0,
    0xe5, 0x78, 0x82, 0x5a, 0xd0, 0x7d, 0xcc, 0xff, 0x72, 0x21, 0xb8, 0x08, 0x46, 0x74, 0xf7, 0x43, 0x24, 0x8e, 0xe0,
    0x35, 0x90, 0xe6, 0x81, 0x3a, 0x26, 0x4c, 0x3c, 0x28, 0x52, 0xbb, 0x91, 0xc3, 0x00, 0xcb, 0x88, 0xd0, 0x65, 0x8b,
    0x1b, 0x53, 0x2e, 0xa3, 0x71, 0x64, 0x48, 0x97, 0xa2, 0x0d, 0xf9, 0x4e, 0x38, 0x19, 0xef, 0x46, 0xa9, 0xde, 0xac,
    0xd8, 0xa8, 0xfa, 0x76, 0x3f, 0xe3, 0x9c, 0x34, 0x3f, 0xf9, 0xdc, 0xbb, 0xc7, 0xc7, 0x0b, 0x4f, 0x1d, 0x8a, 0x51,
    0xe0, 0x4b, 0xcd, 0xb4, 0x59, 0x31, 0xc8, 0x9f, 0x7e, 0xc9, 0xd9, 0x78, 0x73, 0x64, 0xea, 0xc5, 0xac, 0x83, 0x34,
    0xd3, 0xeb, 0xc3, 0xc5, 0x81, 0xa0, 0xff, 0xfa, 0x13, 0x63, 0xeb, 0x17, 0x0d, 0xdd, 0x51, 0xb7, 0xf0, 0xda, 0x49,
    0xd3, 0x16, 0x55, 0x26, 0x29, 0xd4, 0x68, 0x9e, 0x2b, 0x16, 0xbe, 0x58, 0x7d, 0x47, 0xa1, 0xfc, 0x8f, 0xf8, 0xb8,
    0xd1, 0x7a, 0xd0, 0x31, 0xce, 0x45, 0xcb, 0x3a, 0x8f, 0x95, 0x16, 0x04, 0x28, 0xaf, 0xd7, 0xfb, 0xca, 0xbb, 0x4b,
    0x40, 0x7e,
};

inline uint64_t rd64(const uint8_t* p) {
  uint64_t v;
  std::memcpy(&v, p, 8);  // little-endian hosts only (x86-64, aarch64): XXH3 reads little-endian words
  return v;
}

// One 64-byte stripe into the 8 accumulators; three implementations, chosen once at load time.
void stripes_scalar(uint64_t* acc, const uint8_t* in, const uint8_t* secret, size_t n) {
  for (size_t s = 0; s < n; ++s, in += STRIPE, secret += 8) {
    for (int i = 0; i < 8; ++i) {
      uint64_t v = rd64(in + 8 * i), k = v ^ rd64(secret + 8 * i);
      acc[i ^ 1] += v;
      acc[i] += (k & 0xFFFFFFFFULL) * (k >> 32);
    }
  }
}

void scramble_scalar(uint64_t* acc, const uint8_t* secret) {
  for (int i = 0; i < 8; ++i) {
    uint64_t a = acc[i];
    a ^= a >> 47;
    a ^= rd64(secret + 8 * i);
    acc[i] = a * P32_1;
  }
}

#ifdef CKPT_X86
void stripes_sse2(uint64_t* acc, const uint8_t* in, const uint8_t* secret, size_t n) {
  __m128i a[4];
  for (int j = 0; j < 4; ++j) a[j] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(acc) + j);
  for (size_t s = 0; s < n; ++s, in += STRIPE, secret += 8) {
    for (int j = 0; j < 4; ++j) {
      __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(in) + j);
      __m128i k = _mm_xor_si128(v, _mm_loadu_si128(reinterpret_cast<const __m128i*>(secret) + j));
      __m128i prod = _mm_mul_epu32(k, _mm_shuffle_epi32(k, _MM_SHUFFLE(0, 3, 0, 1)));
      a[j] = _mm_add_epi64(a[j], _mm_add_epi64(_mm_shuffle_epi32(v, _MM_SHUFFLE(1, 0, 3, 2)), prod));
    }
  }
  for (int j = 0; j < 4; ++j) _mm_storeu_si128(reinterpret_cast<__m128i*>(acc) + j, a[j]);
}

__attribute__((target("avx2"))) void stripes_avx2(uint64_t* acc, const uint8_t* in, const uint8_t* secret,
                                                  size_t n) {
  __m256i a0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(acc));
  __m256i a1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(acc) + 1);
  for (size_t s = 0; s < n; ++s, in += STRIPE, secret += 8) {
    __m256i v0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(in));
    __m256i v1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(in) + 1);
    __m256i k0 = _mm256_xor_si256(v0, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(secret)));
    __m256i k1 = _mm256_xor_si256(v1, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(secret) + 1));
    // low 32 bits times high 32 bits of each 64-bit lane; the data goes to the neighbouring lane
    __m256i p0 = _mm256_mul_epu32(k0, _mm256_srli_epi64(k0, 32));
    __m256i p1 = _mm256_mul_epu32(k1, _mm256_srli_epi64(k1, 32));
    a0 = _mm256_add_epi64(a0, _mm256_add_epi64(_mm256_shuffle_epi32(v0, _MM_SHUFFLE(1, 0, 3, 2)), p0));
    a1 = _mm256_add_epi64(a1, _mm256_add_epi64(_mm256_shuffle_epi32(v1, _MM_SHUFFLE(1, 0, 3, 2)), p1));
  }
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(acc), a0);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(acc) + 1, a1);
}
#endif

using StripesFn = void (*)(uint64_t*, const uint8_t*, const uint8_t*, size_t);

StripesFn pick_stripes(int* level) {
#ifdef CKPT_X86
  if (__builtin_cpu_supports("avx2")) {
    *level = 2;
    return stripes_avx2;
  }
  *level = 1;
  return stripes_sse2;
#else
  *level = 0;
  return stripes_scalar;
#endif
}

int g_level = 0;
StripesFn g_stripes = pick_stripes(&g_level);

uint64_t fold64(uint64_t a, uint64_t b) {
  __uint128_t p = static_cast<__uint128_t>(a) * b;
  return static_cast<uint64_t>(p) ^ static_cast<uint64_t>(p >> 64);
}

uint64_t avalanche(uint64_t h) {
  h ^= h >> 37;
  h *= 0x165667919E3779F9ULL;
  return h ^ (h >> 32);
}

uint64_t merge(const uint64_t* acc, const uint8_t* secret, uint64_t start) {
  uint64_t r = start;
  for (int i = 0; i < 4; ++i) r += fold64(acc[2 * i] ^ rd64(secret + 16 * i), acc[2 * i + 1] ^ rd64(secret + 16 * i + 8));
  return avalanche(r);
}

// XXH3-128 of a long input (> 240 bytes) fed block by block: blocks() may be called on pieces that
// each hold a whole number of blocks, in order; finish() needs the whole input in memory.
struct Long128 {
  uint64_t acc[8] = {P32_3, P64_1, P64_2, P64_3, P64_4, P32_2, P64_5, P32_1};
  size_t len, full_blocks, done = 0;
  explicit Long128(size_t n) : len(n), full_blocks((n - 1) / BLOCK) {}

  // Hash blocks [done, done + count) from `p` (which holds exactly those bytes); extra blocks are ignored.
  void blocks(const uint8_t* p, size_t count) {
    count = std::min(count, full_blocks - done);
    for (size_t b = 0; b < count; ++b, p += BLOCK) {
      g_stripes(acc, p, kSecret, STRIPES_PER_BLOCK);
      scramble_scalar(acc, kSecret + SECRET_SIZE - STRIPE);
    }
    done += count;
  }

  void finish(const uint8_t* input, uint64_t out[2]) {
    if (done < full_blocks) blocks(input + done * BLOCK, full_blocks - done);
    size_t tail_stripes = ((len - 1) - BLOCK * full_blocks) / STRIPE;
    g_stripes(acc, input + full_blocks * BLOCK, kSecret, tail_stripes);
    g_stripes(acc, input + len - STRIPE, kSecret + SECRET_SIZE - STRIPE - 7, 1);
    out[0] = merge(acc, kSecret + 11, static_cast<uint64_t>(len) * P64_1);                          // low 64
    out[1] = merge(acc, kSecret + SECRET_SIZE - STRIPE - 11, ~(static_cast<uint64_t>(len) * P64_2));  // high 64
  }
};

struct Seg {  // one contiguous source copied to [dst_off, dst_off + len) of the buffer
  const uint8_t* src;
  uint64_t dst_off, len;
  uint64_t check;  // its elements, when checked for NaN/Inf: 0 not checked, 1 f16, 2 bf16, 3 f32, 4 f64
};

// True if any element of the `n` bytes at `p` (whole elements of type T) has every exponent bit set:
// an Inf or a NaN in IEEE formats. Branch-free over 4 KiB blocks so the compiler vectorises it.
template <typename T>
inline __attribute__((always_inline)) bool any_nonfinite(const uint8_t* p, size_t n, T exponent) {
  constexpr size_t BLK = 4096 / sizeof(T);
  size_t count = n / sizeof(T);
  for (size_t i = 0; i < count; i += BLK) {
    size_t e = std::min(count, i + BLK);
    T hit = 0;
    for (size_t j = i; j < e; ++j) {
      T v;
      std::memcpy(&v, p + j * sizeof(T), sizeof(T));
      hit |= static_cast<T>(-static_cast<T>((v & exponent) == exponent));
    }
    if (hit) return true;
  }
  return false;
}

#ifdef CKPT_X86
__attribute__((target_clones("avx2", "default")))  // 32-byte compares where the CPU has them
#endif
bool nonfinite(uint64_t kind, const uint8_t* p, size_t n) {
  switch (kind) {
    case 1: return any_nonfinite<uint16_t>(p, n, 0x7C00);
    case 2: return any_nonfinite<uint16_t>(p, n, 0x7F80);
    case 3: return any_nonfinite<uint32_t>(p, n, 0x7F800000U);
    case 4: return any_nonfinite<uint64_t>(p, n, 0x7FF0000000000000ULL);
    default: return false;
  }
}

constexpr size_t elem_size(uint64_t kind) { return kind <= 2 ? 2 : kind == 3 ? 4 : 8; }

constexpr size_t PIECE = 64 * BLOCK;  // 64 KiB: copied, then hashed while it is still in L2

size_t first_seg(const Seg* segs, size_t nsegs, uint64_t lo) {  // the first segment ending after lo
  return std::partition_point(segs, segs + nsegs, [lo](const Seg& s) { return s.dst_off + s.len <= lo; }) - segs;
}

// Copy the parts of `segs` that fall into [lo, hi) of the buffer; segs are sorted by dst_off.
void copy_range(uint8_t* dst, const Seg* segs, size_t nsegs, uint64_t lo, uint64_t hi) {
  for (size_t i = first_seg(segs, nsegs, lo); i < nsegs && segs[i].dst_off < hi; ++i) {
    uint64_t a = std::max(lo, segs[i].dst_off), b = std::min(hi, segs[i].dst_off + segs[i].len);
    if (a < b) std::memcpy(dst + a, segs[i].src + (a - segs[i].dst_off), b - a);
  }
}

// Check the elements of segment `s` that start in [a, b) (offsets in the segment), reading its source
// (an element straddling `b` is read whole from there). Returns true if one is NaN or Inf.
bool check_elems(const Seg& s, uint64_t a, uint64_t b) {
  uint64_t es = elem_size(s.check);
  a = (a + es - 1) / es * es;
  b = std::min<uint64_t>((b + es - 1) / es * es, s.len / es * es);
  return a < b && nonfinite(s.check, s.src + a, b - a);
}

void mark(uint8_t* flag) { __atomic_store_n(flag, 1, __ATOMIC_RELAXED); }
bool marked(const uint8_t* flag) { return __atomic_load_n(flag, __ATOMIC_RELAXED) != 0; }

// Check the elements of checked segments that start in [lo, hi) of the buffer, from their sources
// (the copy just read them, so they are in cache). bad[i] is set for a segment holding a NaN or Inf;
// a segment found bad is not checked again.
void check_range(const Seg* segs, size_t nsegs, uint64_t lo, uint64_t hi, uint8_t* bad) {
  for (size_t i = first_seg(segs, nsegs, lo); i < nsegs && segs[i].dst_off < hi; ++i) {
    const Seg& s = segs[i];
    if (!s.check || marked(&bad[i])) continue;
    if (check_elems(s, std::max(lo, s.dst_off) - s.dst_off, std::min(hi, s.dst_off + s.len) - s.dst_off)) mark(&bad[i]);
  }
}

#ifdef CKPT_X86
// The NaN/Inf test of 16 bytes held in a register: lanes whose exponent bits are all set. f64 is
// tested on the high 32 bits of each element (where its exponent lives), the low lanes masked off.
struct VecCheck {
  __m128i exponent, lanes;
  bool wide;  // 32-bit lanes (f32, f64) or 16-bit (f16, bf16)
  explicit VecCheck(uint64_t kind) {
    wide = kind >= 3;
    lanes = _mm_set1_epi32(-1);
    if (kind == 1) exponent = _mm_set1_epi16(0x7C00);
    else if (kind == 2) exponent = _mm_set1_epi16(0x7F80);
    else if (kind == 3) exponent = _mm_set1_epi32(0x7F800000);
    else {
      exponent = _mm_set_epi32(0x7FF00000, 0, 0x7FF00000, 0);
      lanes = _mm_set_epi32(-1, 0, -1, 0);
    }
  }
  __m128i hits(__m128i v) const {
    __m128i e = _mm_and_si128(v, exponent);
    return _mm_and_si128(wide ? _mm_cmpeq_epi32(e, exponent) : _mm_cmpeq_epi16(e, exponent), lanes);
  }
};
#endif

// memcpy with streaming (non-temporal) stores: the destination is not read back soon, so it should
// not be pulled into cache first (that read-for-ownership is a third pass over memory). When `seg`
// is given (the source is that checked segment, `off` bytes in), the copy also tests every element
// for NaN/Inf in the registers it copies through, and sets *bad if one is; it returns false if it
// could not (elements not aligned with the vector lanes): the caller checks the bytes then.
bool copy_stream(uint8_t* dst, const uint8_t* src, size_t n, const Seg* seg = nullptr, uint64_t off = 0,
                 uint8_t* bad = nullptr) {
#ifdef CKPT_X86
  size_t head = (16 - (reinterpret_cast<uintptr_t>(dst) & 15)) & 15;
  if (head > n) head = n;
  bool checking = seg != nullptr && seg->check && !marked(bad);
  if (checking && (off + head) % elem_size(seg->check) != 0) checking = false;
  std::memcpy(dst, src, head);
  size_t i = head;
  if (checking) {
    VecCheck vc(seg->check);
    __m128i acc = _mm_setzero_si128();
    for (; i + 64 <= n; i += 64) {
      __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
      __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 16));
      __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 32));
      __m128i d = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 48));
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i), a);
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 16), b);
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 32), c);
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 48), d);
      acc = _mm_or_si128(acc, _mm_or_si128(_mm_or_si128(vc.hits(a), vc.hits(b)), _mm_or_si128(vc.hits(c), vc.hits(d))));
    }
    std::memcpy(dst + i, src + i, n - i);
    // the elements starting in the unaligned head and in the tail were not in the registers
    if (_mm_movemask_epi8(acc) != 0 || check_elems(*seg, off, off + head) || check_elems(*seg, off + i, off + n))
      mark(bad);
    return true;
  }
  for (; i + 64 <= n; i += 64) {
    __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 16));
    __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 32));
    __m128i d = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 48));
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i), a);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 16), b);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 32), c);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 48), d);
  }
  std::memcpy(dst + i, src + i, n - i);
  return seg == nullptr || !seg->check || marked(bad);
#else
  std::memcpy(dst, src, n);
  return seg == nullptr || !seg->check;
#endif
}

// One piece [lo, hi): copy it, check its elements for NaN/Inf (segments with a `check` kind), and
// return where its bytes can be hashed from while they are in cache. A piece inside one source (the
// common case: large tensors) is streamed to the buffer, checked in the registers it passes through
// and hashed from the source, which the copy just read; any other piece is copied plainly, checked
// from its sources and hashed from the buffer.
const uint8_t* copy_piece(uint8_t* dst, const Seg* segs, size_t nsegs, uint64_t lo, uint64_t hi, uint8_t* bad) {
  size_t i = first_seg(segs, nsegs, lo);
  if (i < nsegs && segs[i].dst_off <= lo && segs[i].dst_off + segs[i].len >= hi) {
    const uint8_t* src = segs[i].src + (lo - segs[i].dst_off);
    if (!copy_stream(dst + lo, src, hi - lo, &segs[i], lo - segs[i].dst_off, &bad[i]))
      check_range(segs, nsegs, lo, hi, bad);
    return src;
  }
  copy_range(dst, segs, nsegs, lo, hi);
  check_range(segs, nsegs, lo, hi, bad);
  return dst + lo;
}

// Run `work` on `t` threads (this one included); each picks its own share. A thread that cannot be
// started leaves its share to the others (at least this one).
template <typename F>
void run_on(int t, F& work) {
  std::vector<std::thread> pool;
  try {
    for (int i = 1; i < t; ++i) pool.emplace_back(std::ref(work));
  } catch (...) {
  }
  work();
  for (auto& th : pool) th.join();
}

}  // namespace

namespace ckpt_core {

static_assert(sizeof(Long128) <= sizeof(Hash128::state) && alignof(Long128) <= 8, "Hash128 holds a Long128");
static_assert(HASH_BLOCK == BLOCK, "one block size");

void hash_start(Hash128& h, uint64_t len) { new (h.state) Long128(len); }
void hash_blocks(Hash128& h, const uint8_t* p, uint64_t count) {
  std::launder(reinterpret_cast<Long128*>(h.state))->blocks(p, count);
}
void hash_finish(Hash128& h, const uint8_t* input, uint64_t out[2]) {
  std::launder(reinterpret_cast<Long128*>(h.state))->finish(input, out);
}

}  // namespace ckpt_core

extern "C" {

// The layout of this library's calls; Python refuses a library built for another (a stale build).
int ckpt_abi_version() { return 13; }  // 5: ckpt_pread_hash, ckpt_copy_many (the load path); 6: ckpt_rans_* (rans.cpp);
// 7: ckpt_rans_decode takes `simd`; ckpt_rans_simd, ckpt_planes_decode; 8: ckpt_rans_encode takes `simd`;
// 9: ckpt_chain_decode (chain.cpp); 10: ckpt_chain_decode_range; 11: ckpt_mask_compact, ckpt_mask_expand (mask.cpp);
// 12: ckpt_rans_estimate; 13: ckpt_chain_decode takes `hashed`

// 2 = AVX2, 1 = SSE2, 0 = portable C: which accumulator loop this machine runs.
int ckpt_simd_level() { return g_level; }

// XXH3-128 of data[0:len) into out = {low64, high64}. Returns 0, or 1 if len <= 240 (not handled here).
int ckpt_xxh3_128(const void* data, uint64_t len, uint64_t* out) {
  if (len <= SHORT_MAX) return 1;
  Long128 h(len);
  h.finish(static_cast<const uint8_t*>(data), out);
  return 0;
}

// Copy `nsegs` contiguous sources into `dst` and hash the chunks [offs[c], offs[c+1]) whose want[c] is
// set, with `threads` threads, each chunk by one thread, each 64 KiB piece hashed right after it is
// copied, from whichever copy of its bytes is in cache. hashed[c] is set to 1 where out[2c:2c+2] holds
// the chunk's hash (0: short chunk, hash it in Python). bad[i] is set to 1 where segment i has a
// `check` kind and holds a NaN or Inf (bad must come zeroed). Segments must be sorted by dst_off and
// must not overlap. Bytes outside every segment are left as they are (the buffer's zero padding, or
// data copied in beforehand).
int ckpt_copy_hash(uint8_t* dst, const Seg* segs, uint64_t nsegs, const uint64_t* offs, const uint8_t* want,
                   uint64_t nchunks, uint64_t* out, uint8_t* hashed, uint8_t* bad, int threads) {
  std::atomic<uint64_t> next{0};
  auto work = [&]() {
    for (uint64_t c; (c = next.fetch_add(1)) < nchunks;) {
      uint64_t lo = offs[c], hi = offs[c + 1], n = hi - lo;
      hashed[c] = 0;
      if (!want[c] || n <= SHORT_MAX) {
        for (uint64_t p = lo; p < hi; p += PIECE) {
          uint64_t e = std::min(hi, p + PIECE);
          copy_range(dst, segs, nsegs, p, e);
          check_range(segs, nsegs, p, e, bad);
        }
        continue;
      }
      Long128 h(n);
      for (uint64_t p = lo; p < hi; p += PIECE) {
        uint64_t e = std::min(hi, p + PIECE);
        h.blocks(copy_piece(dst, segs, nsegs, p, e, bad), (e - p) / BLOCK);
      }
#ifdef CKPT_X86
      _mm_sfence();  // streaming stores are weakly ordered: make them visible before finish() reads the tail
#endif
      h.finish(dst + lo, out + 2 * c);
      hashed[c] = 1;
    }
  };
  int t = static_cast<int>(std::min<uint64_t>(std::max(threads, 1), std::max<uint64_t>(nchunks, 1)));
  run_on(t, work);
  return 0;
}

// Read [offset, offset + len) of file `fd` into `dst` and hash those bytes with XXH3-128, each
// READ_PIECE-sized piece hashed right after pread put it there, while it is still in cache (one
// pass over memory instead of a read and a second one to hash). Returns the bytes read (fewer at
// the end of the file), or -errno. out = {low64, high64, hashed}: hashed is 1 when all `len` bytes
// were read and len > 240 (shorter inputs: hash them in Python).
constexpr size_t READ_PIECE = 256 * BLOCK;

int64_t ckpt_pread_hash(int fd, uint64_t offset, uint8_t* dst, uint64_t len, uint64_t* out) {
  out[2] = 0;
  bool hashing = len > SHORT_MAX;
  Long128 h(hashing ? len : SHORT_MAX + 1);
  uint64_t got = 0, hashed_to = 0;
  while (got < len) {
    size_t want = static_cast<size_t>(std::min<uint64_t>(READ_PIECE, len - got));
    ssize_t k = pread(fd, dst + got, want, static_cast<off_t>(offset + got));
    if (k < 0) {
      if (errno == EINTR) continue;
      return -static_cast<int64_t>(errno);
    }
    if (k == 0) break;
    got += static_cast<uint64_t>(k);
    if (hashing) {  // the whole blocks that landed, from where the last piece stopped
      uint64_t upto = got / BLOCK * BLOCK;
      if (upto > hashed_to) {
        h.blocks(dst + hashed_to, (upto - hashed_to) / BLOCK);
        hashed_to = upto;
      }
    }
  }
  if (hashing && got == len) {
    h.finish(dst, out);
    out[2] = 1;
  }
  return static_cast<int64_t>(got);
}

struct CopyItem {  // [src, src + len) copied to dst
  uint8_t* dst;
  const uint8_t* src;
  uint64_t len;
};

// Copy every item with `threads` threads, in 1 MiB pieces handed out in order, with streaming
// stores (the destination is not read back during the load: pulling it into cache first would be a
// third pass over memory). Items must not overlap.
int ckpt_copy_many(const CopyItem* items, uint64_t n, int threads) {
  constexpr uint64_t STEP = 1 << 20;
  std::vector<uint64_t> first(n + 1, 0);  // the first piece of each item
  for (uint64_t i = 0; i < n; ++i) first[i + 1] = first[i] + (items[i].len + STEP - 1) / STEP;
  std::atomic<uint64_t> next{0};
  auto work = [&]() {
    uint64_t item = 0;
    for (uint64_t p; (p = next.fetch_add(1)) < first[n];) {
      while (first[item + 1] <= p) ++item;  // pieces are taken in increasing order by each thread
      uint64_t lo = (p - first[item]) * STEP, k = std::min(STEP, items[item].len - lo);
      copy_stream(items[item].dst + lo, items[item].src + lo, k);
    }
#ifdef CKPT_X86
    _mm_sfence();  // streaming stores are weakly ordered: visible before the caller reads the tensors
#endif
  };
  int t = static_cast<int>(std::min<uint64_t>(std::max(threads, 1), std::max<uint64_t>(first[n], 1)));
  run_on(t, work);
  return 0;
}

}  // extern "C"
