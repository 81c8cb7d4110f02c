// Byte planes for the delta codecs (ckpt/codec.py): the bytes of each w-byte element split into w
// planes, optionally XOR'd with a base chunk first, and back. Plain loops the compiler vectorises;
// called from Python through ctypes, which releases the GIL for the call.
//
// Grouped layout of an n-byte chunk with element width w, m = n / w elements:
//   plane 0 (byte 0 of every element, little-endian), plane 1, ..., plane w-1 (m bytes each), then
//   the n - w*m tail bytes as they are. With a base, every byte is XOR'd with the base's byte at the
//   same place first. With `rot` (floats of width 2, 4 or 8), each element (XOR its base) is rotated
//   left by one bit before it is split: the sign moves to the lowest bit and the top plane holds
//   exponent bits only (float32, bfloat16: the whole exponent), which compresses better.
// ckpt/codec.py's numpy fallback produces the same bytes.

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "core.h"

#if defined(__SSE2__)  // every x86-64 compiler targets SSE2: no runtime dispatch needed
#include <emmintrin.h>
#define CKPT_SSE2 1
#endif

namespace {

using ckpt_core::Word;

template <typename T> inline T rotl1(T v) { return static_cast<T>((v << 1) | (v >> (8 * sizeof(T) - 1))); }
template <typename T> inline T rotr1(T v) { return static_cast<T>((v >> 1) | (v << (8 * sizeof(T) - 1))); }

constexpr uint64_t STEP = 4096;  // elements per block

#ifdef CKPT_SSE2
inline __m128i load16(const uint8_t* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); }
inline void store16(uint8_t* p, __m128i v) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), v); }

// Elements [0, m) of width 2 or 4 into their planes, 16 at a time: each 16-element block's bytes are
// transposed by rounds of byte unpacks (no byte shuffle in SSE2). Returns the first element not done.
template <int W, bool X, bool R>
uint64_t group_sse2(const uint8_t* in, const uint8_t* base, uint64_t m, uint8_t* const* P) {
  auto word = [&](uint64_t off) {  // 16 bytes of elements, XOR base, rotated left by one bit
    __m128i v = load16(in + off);
    if (X) v = _mm_xor_si128(v, load16(base + off));
    if (R) {
      v = W == 4 ? _mm_or_si128(_mm_slli_epi32(v, 1), _mm_srli_epi32(v, 31))
                 : _mm_or_si128(_mm_slli_epi16(v, 1), _mm_srli_epi16(v, 15));
    }
    return v;
  };
  uint64_t j = 0;
  for (; j + 16 <= m; j += 16) {
    const uint64_t off = j * W;
    if (W == 2) {
      const __m128i v0 = word(off), v1 = word(off + 16);
      const __m128i t0 = _mm_unpacklo_epi8(v0, v1), t1 = _mm_unpackhi_epi8(v0, v1);
      const __m128i u0 = _mm_unpacklo_epi8(t0, t1), u1 = _mm_unpackhi_epi8(t0, t1);
      const __m128i w0 = _mm_unpacklo_epi8(u0, u1), w1 = _mm_unpackhi_epi8(u0, u1);
      store16(P[0] + j, _mm_unpacklo_epi8(w0, w1));
      store16(P[1] + j, _mm_unpackhi_epi8(w0, w1));
    } else {
      const __m128i v0 = word(off), v1 = word(off + 16), v2 = word(off + 32), v3 = word(off + 48);
      const __m128i t0 = _mm_unpacklo_epi8(v0, v1), t1 = _mm_unpackhi_epi8(v0, v1);
      const __m128i t2 = _mm_unpacklo_epi8(v2, v3), t3 = _mm_unpackhi_epi8(v2, v3);
      const __m128i u0 = _mm_unpacklo_epi8(t0, t1), u1 = _mm_unpackhi_epi8(t0, t1);
      const __m128i u2 = _mm_unpacklo_epi8(t2, t3), u3 = _mm_unpackhi_epi8(t2, t3);
      const __m128i w0 = _mm_unpacklo_epi8(u0, u1), w1 = _mm_unpackhi_epi8(u0, u1);  // elements 0-7
      const __m128i w2 = _mm_unpacklo_epi8(u2, u3), w3 = _mm_unpackhi_epi8(u2, u3);  // elements 8-15
      store16(P[0] + j, _mm_unpacklo_epi64(w0, w2));
      store16(P[1] + j, _mm_unpackhi_epi64(w0, w2));
      store16(P[2] + j, _mm_unpacklo_epi64(w1, w3));
      store16(P[3] + j, _mm_unpackhi_epi64(w1, w3));
    }
  }
  return j;
}
#endif

// Whole elements at a time: load (XOR base, rotate), then one byte to each plane.
template <int W, bool X, bool R>
void group_w(const uint8_t* in, const uint8_t* base, uint64_t m, uint8_t* out) {
  using T = typename Word<W>::T;
  uint8_t* P[W];
  for (int p = 0; p < W; ++p) P[p] = out + static_cast<uint64_t>(p) * m;
  uint64_t j0 = 0;
#ifdef CKPT_SSE2
  if constexpr (W == 2 || W == 4) j0 = group_sse2<W, X, R>(in, base, m, P);
#endif
  for (uint64_t j = j0; j < m; ++j) {
    T v, b;
    std::memcpy(&v, in + j * W, W);
    if (X) {
      std::memcpy(&b, base + j * W, W);
      v ^= b;
    }
    if (R) v = rotl1(v);
    for (int p = 0; p < W; ++p) P[p][j] = static_cast<uint8_t>(v >> (8 * p));
  }
}

bool all_zero(const uint8_t* p, uint64_t n) {
  uint64_t acc = 0, i = 0;
  for (; i + 8 <= n; i += 8) {
    uint64_t v;
    std::memcpy(&v, p + i, 8);
    acc |= v;
  }
  for (; i < n; ++i) acc |= p[i];
  return acc == 0;
}

#ifdef CKPT_SSE2
// Elements [j, j1) of width 2 or 4 from their planes, 16 at a time with byte unpacks (the compiler
// does not vectorise the scalar loop: out may be base). Returns the first element not done.
template <int W, bool R>
uint64_t interleave_sse2(const uint8_t* const* planes, const uint8_t* base, uint64_t j, uint64_t j1, uint8_t* out) {
  auto load = load16;
  auto finish = [&](__m128i v, uint8_t* o, const uint8_t* b) {
    if (R) {
      v = W == 4 ? _mm_or_si128(_mm_srli_epi32(v, 1), _mm_slli_epi32(v, 31))
                 : _mm_or_si128(_mm_srli_epi16(v, 1), _mm_slli_epi16(v, 15));
    }
    if (b) v = _mm_xor_si128(v, load(b));
    store16(o, v);
  };
  for (; j + 16 <= j1; j += 16) {
    const __m128i a = load(planes[0] + j), b = load(planes[1] + j);
    const __m128i ab_lo = _mm_unpacklo_epi8(a, b), ab_hi = _mm_unpackhi_epi8(a, b);  // 16-bit: a | b << 8
    uint8_t* o = out + j * W;
    const uint8_t* bs = base ? base + j * W : nullptr;
    if (W == 2) {
      finish(ab_lo, o, bs);
      finish(ab_hi, o + 16, bs ? bs + 16 : nullptr);
    } else {
      const __m128i c = load(planes[2] + j), d = load(planes[3] + j);
      const __m128i cd_lo = _mm_unpacklo_epi8(c, d), cd_hi = _mm_unpackhi_epi8(c, d);
      finish(_mm_unpacklo_epi16(ab_lo, cd_lo), o, bs);  // 32-bit: ab | cd << 16, elements 0-3
      finish(_mm_unpackhi_epi16(ab_lo, cd_lo), o + 16, bs ? bs + 16 : nullptr);
      finish(_mm_unpacklo_epi16(ab_hi, cd_hi), o + 32, bs ? bs + 32 : nullptr);
      finish(_mm_unpackhi_epi16(ab_hi, cd_hi), o + 48, bs ? bs + 48 : nullptr);
    }
  }
  return j;
}
#endif

// One byte from each plane makes an element (rotated back, XOR base), stored whole. With a base,
// blocks where every plane is zero (what did not change) are the base's bytes: copied, or skipped
// when out is the base itself (a delta decoded in place: then only the planes are read).
template <int W, bool R>
void interleave(const uint8_t* const* planes, const uint8_t* base, uint64_t m, uint8_t* out) {
  using T = typename Word<W>::T;
  for (uint64_t j0 = 0; j0 < m; j0 += STEP) {
    uint64_t j1 = j0 + STEP < m ? j0 + STEP : m;
    if (base) {
      bool zero = true;
      for (int p = 0; p < W && zero; ++p) zero = all_zero(planes[p] + j0, j1 - j0);
      if (zero) {
        if (out != base) std::memcpy(out + j0 * W, base + j0 * W, (j1 - j0) * W);
        continue;
      }
    }
    uint64_t j = j0;
#ifdef CKPT_SSE2
    if constexpr (W == 2 || W == 4) j = interleave_sse2<W, R>(planes, base, j0, j1, out);
#endif
    for (; j < j1; ++j) {
      T v = 0;
      for (int p = 0; p < W; ++p) v |= static_cast<T>(static_cast<T>(planes[p][j]) << (8 * p));
      if (R) v = rotr1(v);
      if (base) {
        T b;
        std::memcpy(&b, base + j * W, W);
        v ^= b;
      }
      std::memcpy(out + j * W, &v, W);
    }
  }
}

template <bool R>
int group_dispatch(const uint8_t* in, const uint8_t* base, uint64_t m, int w, uint8_t* out) {
  switch (w) {
    case 2: base ? group_w<2, true, R>(in, base, m, out) : group_w<2, false, R>(in, base, m, out); return 0;
    case 4: base ? group_w<4, true, R>(in, base, m, out) : group_w<4, false, R>(in, base, m, out); return 0;
    case 8: base ? group_w<8, true, R>(in, base, m, out) : group_w<8, false, R>(in, base, m, out); return 0;
    default:
      if (R) return 1;
      for (uint64_t j = 0; j < m; ++j)
        for (int p = 0; p < w; ++p)
          out[static_cast<uint64_t>(p) * m + j] = in[j * w + p] ^ (base ? base[j * w + p] : 0);
      return 0;
  }
}

template <bool R>
int interleave_dispatch(const uint8_t* const* planes, const uint8_t* base, uint64_t m, int w, uint8_t* out) {
  switch (w) {
    case 2: interleave<2, R>(planes, base, m, out); return 0;
    case 4: interleave<4, R>(planes, base, m, out); return 0;
    case 8: interleave<8, R>(planes, base, m, out); return 0;
    default:
      if (R) return 1;
      for (uint64_t j = 0; j < m; ++j)
        for (int p = 0; p < w; ++p) out[j * w + p] = planes[p][j] ^ (base ? base[j * w + p] : 0);
      return 0;
  }
}

void tail(const uint8_t* in, const uint8_t* base, uint64_t n, uint8_t* out) {
  for (uint64_t i = 0; i < n; ++i) out[i] = base ? static_cast<uint8_t>(in[i] ^ base[i]) : in[i];
}

}  // namespace

extern "C" {

// in[0:n) (XOR base[0:n) when base is not null; each element rotated left by one bit with rot) into
// the grouped layout at out[0:n). Returns 0, or 1 for a width outside 1..16 (rot: other than 2, 4, 8).
// in, base and out must not overlap.
int ckpt_group(const uint8_t* in, const uint8_t* base, uint64_t n, int w, int rot, uint8_t* out) {
  if (w < 1 || w > 16) return 1;
  uint64_t m = n / w;
  int rc = rot ? group_dispatch<true>(in, base, m, w, out) : group_dispatch<false>(in, base, m, w, out);
  if (rc) return rc;
  tail(in + m * w, base ? base + m * w : nullptr, n - m * w, out + m * w);
  return 0;
}

// The inverse, from planes in separate buffers: planes[p] holds plane p (n / w bytes), tail_src the
// n mod w tail bytes; base may be null, or out itself (XOR in place). A decoder points at planes
// where they lie (in the payload, or decompressed into scratch) instead of gathering them first.
int ckpt_ungroup_planes(const uint8_t* const* planes, const uint8_t* tail_src, const uint8_t* base, uint64_t n,
                        int w, int rot, uint8_t* out) {
  if (w < 1 || w > 16) return 1;
  uint64_t m = n / w;
  int rc = rot ? interleave_dispatch<true>(planes, base, m, w, out) : interleave_dispatch<false>(planes, base, m, w, out);
  if (rc) return rc;
  tail(tail_src, base ? base + m * w : nullptr, n - m * w, out + m * w);
  return 0;
}

}  // extern "C"
