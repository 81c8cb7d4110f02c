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

namespace {

template <int W> struct Word;
template <> struct Word<2> { using T = uint16_t; };
template <> struct Word<4> { using T = uint32_t; };
template <> struct Word<8> { using T = uint64_t; };

template <typename T> inline T rotl1(T v) { return static_cast<T>((v << 1) | (v >> (8 * sizeof(T) - 1))); }
template <typename T> inline T rotr1(T v) { return static_cast<T>((v >> 1) | (v << (8 * sizeof(T) - 1))); }

constexpr uint64_t STEP = 4096;  // elements per block

// Whole elements at a time: load (XOR base, rotate), then one byte to each plane.
template <int W, bool X, bool R>
void group_w(const uint8_t* in, const uint8_t* base, uint64_t m, uint8_t* out) {
  using T = typename Word<W>::T;
  uint8_t* P[W];
  for (int p = 0; p < W; ++p) P[p] = out + static_cast<uint64_t>(p) * m;
  for (uint64_t j = 0; j < m; ++j) {
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
    for (uint64_t j = j0; j < j1; ++j) {
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
