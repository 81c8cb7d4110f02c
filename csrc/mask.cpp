// Zero masks (chunk format v3, ckpt/format/chunk.py): an element whose w bytes (XOR its base) are
// all zero is left out of a chunk's byte planes, and one bit per element says which were kept (bit
// i % 8 of mask byte i / 8, least significant first; the bits past the last element are zero). A
// chunk that is mostly zeros (a pruned layer, the XOR delta of a sparse update) then codes only its
// nonzero elements, and decoding writes the zeros as runs instead of entropy-decoding every byte.
// ckpt/format/mask.py's numpy fallback writes the same bytes.

#include <cstdint>
#include <cstring>

#include "core.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define CKPT_MASK_X86 1
#endif

namespace {

using ckpt_core::Word;

// Elements [0, m) of src (XOR base) with any bit set, in order, into out; their mask into mask.
// Every element is written at out's next place and the place kept only where nonzero (no branch
// per element): out must hold m elements. Returns how many were kept.
template <int W, bool X>
uint64_t compact(const uint8_t* src, const uint8_t* base, uint64_t m, uint8_t* mask, uint8_t* out) {
  using T = typename Word<W>::T;
  uint64_t j = 0;
  for (uint64_t i = 0; i < m; i += 8) {
    const uint64_t e = m - i < 8 ? m - i : 8;
    if (e == 8) {  // eight elements of zeros (most of a sparse update's delta): one word test per 8 bytes
      uint64_t any = 0;
      for (int q = 0; q < W; ++q) {
        uint64_t v;
        std::memcpy(&v, src + i * W + 8 * q, 8);
        if (X) {
          uint64_t u;
          std::memcpy(&u, base + i * W + 8 * q, 8);
          v ^= u;
        }
        any |= v;
      }
      if (!any) {
        mask[i / 8] = 0;
        continue;
      }
    }
    unsigned bits = 0;
    for (uint64_t b = 0; b < e; ++b) {
      T v;
      std::memcpy(&v, src + (i + b) * W, W);
      if (X) {
        T u;
        std::memcpy(&u, base + (i + b) * W, W);
        v ^= u;
      }
      std::memcpy(out + j * W, &v, W);
      const unsigned kept = v != 0;
      bits |= kept << b;
      j += kept;
    }
    mask[i / 8] = static_cast<uint8_t>(bits);
  }
  return j;
}

// Zeros (or the base's elements) over elements [i, end) of out.
template <int W, bool X>
inline void fill(const uint8_t* base, uint8_t* out, uint64_t i, uint64_t end) {
  if (!X) std::memset(out + i * W, 0, (end - i) * W);
  else if (base != out) std::memcpy(out + i * W, base + i * W, (end - i) * W);
}

// The mask byte after the run of zero bytes that starts at q (a run of zero elements: most of a
// sparse chunk, all of a frozen tensor's delta), eight bytes at a time.
inline uint64_t zero_run(const uint8_t* mask, uint64_t q, uint64_t bytes) {
  uint64_t r = q + 1;
  while (r + 8 <= bytes) {
    uint64_t word;
    std::memcpy(&word, mask + r, 8);
    if (word) break;
    r += 8;
  }
  while (r < bytes && mask[r] == 0) ++r;
  return r;
}

// The e elements of mask byte `bits` from element i: zeros (or the base's) first, then the kept ones
// set bit by bit from kept[j]. Returns the next kept element.
template <int W, bool X>
inline uint64_t place_bits(unsigned bits, uint64_t i, uint64_t e, const uint8_t* kept, uint64_t j,
                           const uint8_t* base, uint8_t* out) {
  using T = typename Word<W>::T;
  fill<W, X>(base, out, i, i + e);
  for (; bits; bits &= bits - 1) {
    const uint64_t at = (i + static_cast<uint64_t>(__builtin_ctz(bits))) * W;
    T v, u;
    std::memcpy(&v, kept + j++ * W, W);
    if (X) {
      std::memcpy(&u, out + at, W);
      v ^= u;
    }
    std::memcpy(out + at, &v, W);
  }
  return j;
}

// The inverse: element i of out is base's (zero without one) XOR, where its bit is set, the next
// kept element. base may be out itself (a delta XORed in place: only kept elements are touched).
// Returns -1 where the mask keeps more elements than the k given or sets a bit past the last
// element (out then holds anything up to there); else the count it kept.
template <int W, bool X>
int64_t expand(const uint8_t* mask, const uint8_t* kept, uint64_t k, uint64_t m, const uint8_t* base, uint8_t* out) {
  const uint64_t bytes = (m + 7) / 8;
  uint64_t j = 0;
  for (uint64_t q = 0; q < bytes;) {
    const unsigned bits = mask[q];
    const uint64_t i = q * 8, e = m - i < 8 ? m - i : 8;
    if (bits == 0) {
      const uint64_t r = zero_run(mask, q, bytes);
      fill<W, X>(base, out, i, r * 8 < m ? r * 8 : m);
      q = r;
      continue;
    }
    if (j + static_cast<uint64_t>(__builtin_popcount(bits)) > k || bits >> e) return -1;
    j = place_bits<W, X>(bits, i, e, kept, j, base, out);
    ++q;
  }
  return static_cast<int64_t>(j);
}

#ifdef CKPT_MASK_X86
// Where each of eight lanes takes its element from, for every mask byte: the kept elements are
// consecutive, so lane l takes the popcount of the bits below it (unset lanes are zeroed after).
struct Tables {
  alignas(32) int32_t lane4[256][8];   // 4-byte elements: a 32-bit lane each
  alignas(16) uint8_t byte2[256][16];  // 2-byte elements: a byte shuffle, 0x80 where unset (zeroed)
  alignas(32) int32_t lane8[16][8];    // 8-byte elements, four at a time: two 32-bit lanes each
  Tables() {
    for (int b = 0; b < 256; ++b) {
      for (int l = 0, c = 0; l < 8; ++l) {
        const bool on = b >> l & 1;
        lane4[b][l] = on ? c : 0;
        byte2[b][2 * l] = on ? static_cast<uint8_t>(2 * c) : 0x80;
        byte2[b][2 * l + 1] = on ? static_cast<uint8_t>(2 * c + 1) : 0x80;
        c += on;
      }
    }
    for (int b = 0; b < 16; ++b) {
      for (int l = 0, c = 0; l < 4; ++l) {
        const bool on = b >> l & 1;
        lane8[b][2 * l] = on ? 2 * c : 0;
        lane8[b][2 * l + 1] = on ? 2 * c + 1 : 0;
        c += on;
      }
    }
  }
};

const Tables& tables() {
  static const Tables t;
  return t;
}

// zero_run() 32 mask bytes a test: a sparse update's delta keeps an element every ~512 mask bytes.
__attribute__((target("avx2"))) uint64_t zero_run_avx2(const uint8_t* mask, uint64_t q, uint64_t bytes) {
  uint64_t r = q + 1;
  while (r + 32 <= bytes &&
         _mm256_testz_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(mask + r)), _mm256_set1_epi8(-1)))
    r += 32;
  return r < bytes && mask[r] == 0 ? zero_run(mask, r - 1, bytes) : r;
}

// Eight elements from the kept ones at `from` into place by the mask byte `bits`, XOR `under` (X).
// Reads eight kept elements (four, twice, for W = 8): the caller makes sure they are there.
template <int W, bool X>
__attribute__((target("avx2"), always_inline)) inline void place8(const Tables& t, unsigned bits, const uint8_t* from,
                                                                   const uint8_t* under, uint8_t* to) {
  if constexpr (W == 2) {
    __m128i v = _mm_shuffle_epi8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(from)),
                                 _mm_load_si128(reinterpret_cast<const __m128i*>(t.byte2[bits])));
    if (X) v = _mm_xor_si128(v, _mm_loadu_si128(reinterpret_cast<const __m128i*>(under)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(to), v);
  } else if constexpr (W == 4) {
    const __m256i lanes = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    __m256i v = _mm256_permutevar8x32_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(from)),
                                            _mm256_load_si256(reinterpret_cast<const __m256i*>(t.lane4[bits])));
    v = _mm256_and_si256(v, _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32(static_cast<int>(bits)), lanes),
                                               lanes));
    if (X) v = _mm256_xor_si256(v, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(under)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(to), v);
  } else {
    const __m256i lanes = _mm256_setr_epi32(1, 1, 2, 2, 4, 4, 8, 8);
    for (int h = 0; h < 2; ++h) {
      const unsigned nib = bits >> (4 * h) & 15u;
      __m256i v = _mm256_permutevar8x32_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(from)),
                                              _mm256_load_si256(reinterpret_cast<const __m256i*>(t.lane8[nib])));
      v = _mm256_and_si256(v, _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32(static_cast<int>(nib)), lanes),
                                                 lanes));
      if (X) v = _mm256_xor_si256(v, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(under + 32 * h)));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(to + 32 * h), v);
      from += 8 * __builtin_popcount(nib);
    }
  }
}

// expand() with eight elements placed at once by a shuffle, 64 at a time wherever 64 kept elements
// follow (about 4x faster on a 90%-zero chunk); near the end, eight or one at a time as they fit.
template <int W, bool X>
__attribute__((target("avx2"))) int64_t expand_avx2(const uint8_t* mask, const uint8_t* kept, uint64_t k, uint64_t m,
                                                    const uint8_t* base, uint8_t* out) {
  const Tables& t = tables();
  const uint64_t bytes = (m + 7) / 8, whole = m / 8;  // mask bytes; those whose eight elements all exist
  uint64_t j = 0;
  for (uint64_t q = 0; q < bytes;) {
    if (q + 8 <= whole && j + 64 <= k) {  // 64 elements, and 64 kept ones to read from: no check per byte
      uint64_t word;
      std::memcpy(&word, mask + q, 8);
      const uint64_t i = q * 8;
      if (word == 0) {  // a run of zero elements (most of a sparse update's delta): one fill
        const uint64_t r = zero_run_avx2(mask, q, bytes);
        fill<W, X>(base, out, i, r * 8 < m ? r * 8 : m);
        q = r;
        continue;
      }
      for (int b = 0; b < 8; ++b) {  // no branch on a byte's bits: a sparse mask's are random
        const unsigned bits = static_cast<unsigned>(word >> (8 * b)) & 255u;
        place8<W, X>(t, bits, kept + j * W, X ? base + (i + 8 * b) * W : nullptr, out + (i + 8 * b) * W);
        j += static_cast<uint64_t>(__builtin_popcount(bits));
      }
      q += 8;
      continue;
    }
    unsigned bits = mask[q];
    const uint64_t i = q * 8, e = m - i < 8 ? m - i : 8;
    if (bits == 0) {
      const uint64_t r = zero_run_avx2(mask, q, bytes);
      fill<W, X>(base, out, i, r * 8 < m ? r * 8 : m);
      q = r;
      continue;
    }
    const uint64_t count = static_cast<uint64_t>(__builtin_popcount(bits));
    if (j + count > k || bits >> e) return -1;
    if (e == 8 && j + 8 <= k) {
      place8<W, X>(t, bits, kept + j * W, X ? base + i * W : nullptr, out + i * W);
      j += count;
    } else {
      j = place_bits<W, X>(bits, i, e, kept, j, base, out);
    }
    ++q;
  }
  return static_cast<int64_t>(j);
}

bool has_avx2() {
  static const bool yes = __builtin_cpu_supports("avx2");
  return yes;
}
#endif

template <int W, bool X>
int64_t expand_any(const uint8_t* mask, const uint8_t* kept, uint64_t k, uint64_t m, const uint8_t* base, uint8_t* out) {
#ifdef CKPT_MASK_X86
  if (has_avx2()) return expand_avx2<W, X>(mask, kept, k, m, base, out);
#endif
  return expand<W, X>(mask, kept, k, m, base, out);
}

}  // namespace

extern "C" {

// src[0:m*w) (XOR base when not null) as a mask (ceil(m / 8) bytes) and the elements kept, in
// order, at out (room for m elements). Returns the count kept, or -1 for a width other than 2, 4, 8.
int64_t ckpt_mask_compact(const uint8_t* src, const uint8_t* base, uint64_t m, int w, uint8_t* mask, uint8_t* out) {
  switch (w) {
    case 2: return static_cast<int64_t>(base ? compact<2, true>(src, base, m, mask, out)
                                             : compact<2, false>(src, base, m, mask, out));
    case 4: return static_cast<int64_t>(base ? compact<4, true>(src, base, m, mask, out)
                                             : compact<4, false>(src, base, m, mask, out));
    case 8: return static_cast<int64_t>(base ? compact<8, true>(src, base, m, mask, out)
                                             : compact<8, false>(src, base, m, mask, out));
    default: return -1;
  }
}

// m elements of width w into out from the mask and the k kept elements (base: null, out itself, or
// another buffer of m elements). Returns the count the mask kept (the caller checks it is k), or -1
// where the mask keeps more than k or sets a bit past element m, or the width is other than 2, 4, 8.
int64_t ckpt_mask_expand(const uint8_t* mask, const uint8_t* kept, uint64_t k, uint64_t m, int w, const uint8_t* base,
                         uint8_t* out) {
  switch (w) {
    case 2: return base ? expand_any<2, true>(mask, kept, k, m, base, out) : expand_any<2, false>(mask, kept, k, m, base, out);
    case 4: return base ? expand_any<4, true>(mask, kept, k, m, base, out) : expand_any<4, false>(mask, kept, k, m, base, out);
    case 8: return base ? expand_any<8, true>(mask, kept, k, m, base, out) : expand_any<8, false>(mask, kept, k, m, base, out);
    default: return -1;
  }
}

}  // extern "C"
