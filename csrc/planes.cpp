// Byte planes for the delta codecs (ckpt/codec.py): the bytes of each w-byte element split into w
// planes, optionally XOR'd with a base chunk first, and back. Plain loops the compiler vectorises;
// called from Python through ctypes, which releases the GIL for the call.
//
// Grouped layout of an n-byte chunk with element width w, m = n / w elements:
//   plane 0 (byte 0 of every element), plane 1, ..., plane w-1 (m bytes each), then the n - w*m
//   tail bytes as they are. With a base, every byte is XOR'd with the base's byte at the same place.
// ckpt/codec.py's numpy fallback produces the same bytes.

#include <cstddef>
#include <cstdint>
#include <cstring>

namespace {

constexpr uint64_t BLOCK = 4096;  // elements per pass: every plane's slice of a block stays in cache

template <int W, bool X>
void group_w(const uint8_t* in, const uint8_t* base, uint64_t m, uint8_t* out) {
  for (uint64_t j0 = 0; j0 < m; j0 += BLOCK) {
    uint64_t j1 = j0 + BLOCK < m ? j0 + BLOCK : m;
    for (int p = 0; p < W; ++p) {
      uint8_t* dst = out + static_cast<uint64_t>(p) * m;
      for (uint64_t j = j0; j < j1; ++j) {
        uint8_t v = in[j * W + p];
        if (X) v ^= base[j * W + p];
        dst[j] = v;
      }
    }
  }
}

template <int W, bool X>
void ungroup_w(const uint8_t* planes, const uint8_t* base, uint64_t m, uint8_t* out) {
  for (uint64_t j0 = 0; j0 < m; j0 += BLOCK) {
    uint64_t j1 = j0 + BLOCK < m ? j0 + BLOCK : m;
    for (int p = 0; p < W; ++p) {
      const uint8_t* src = planes + static_cast<uint64_t>(p) * m;
      for (uint64_t j = j0; j < j1; ++j) {
        uint8_t v = src[j];
        if (X) v ^= base[j * W + p];
        out[j * W + p] = v;
      }
    }
  }
}

template <bool X>
void group_any(const uint8_t* in, const uint8_t* base, uint64_t m, int w, uint8_t* out) {
  switch (w) {
    case 2: group_w<2, X>(in, base, m, out); return;
    case 4: group_w<4, X>(in, base, m, out); return;
    case 8: group_w<8, X>(in, base, m, out); return;
    default:
      for (uint64_t j = 0; j < m; ++j)
        for (int p = 0; p < w; ++p) out[static_cast<uint64_t>(p) * m + j] = in[j * w + p] ^ (X ? base[j * w + p] : 0);
  }
}

template <bool X>
void ungroup_any(const uint8_t* planes, const uint8_t* base, uint64_t m, int w, uint8_t* out) {
  switch (w) {
    case 2: ungroup_w<2, X>(planes, base, m, out); return;
    case 4: ungroup_w<4, X>(planes, base, m, out); return;
    case 8: ungroup_w<8, X>(planes, base, m, out); return;
    default:
      for (uint64_t j = 0; j < m; ++j)
        for (int p = 0; p < w; ++p) out[j * w + p] = planes[static_cast<uint64_t>(p) * m + j] ^ (X ? base[j * w + p] : 0);
  }
}

// Whole elements at a time: one byte from each plane, stored as one W-byte word (the compiler turns
// this into byte shuffles; storing a plane at a time with a stride of W is several times slower).
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

template <int W>
void interleave_range(const uint8_t* const* P, const uint8_t* base, uint64_t j0, uint64_t j1, uint8_t* out);

// With a base, blocks where every plane is zero (what did not change) are the base's bytes: copied,
// or skipped when out is the base itself (a delta decoded in place: then only the planes are read).
template <int W>
void interleave(const uint8_t* const* planes, const uint8_t* base, uint64_t m, uint8_t* out) {
  const uint64_t step = 4096;
  for (uint64_t j0 = 0; j0 < m; j0 += step) {
    uint64_t j1 = j0 + step < m ? j0 + step : m;
    if (base) {
      bool zero = true;
      for (int p = 0; p < W && zero; ++p) zero = all_zero(planes[p] + j0, j1 - j0);
      if (zero) {
        if (out != base) std::memcpy(out + j0 * W, base + j0 * W, (j1 - j0) * W);
        continue;
      }
    }
    interleave_range<W>(planes, base, j0, j1, out);
  }
}

template <int W>
void interleave_range(const uint8_t* const* planes, const uint8_t* base, uint64_t j0, uint64_t j1, uint8_t* out) {
  const uint8_t* P[W];
  for (int p = 0; p < W; ++p) P[p] = planes[p];
  for (uint64_t j = j0; j < j1; ++j) {
    uint8_t e[W];
    for (int p = 0; p < W; ++p) e[p] = P[p][j];
    if (base) {
      uint8_t b[W];
      std::memcpy(b, base + j * W, W);
      for (int p = 0; p < W; ++p) e[p] ^= b[p];
    }
    std::memcpy(out + j * W, e, W);
  }
}

void tail(const uint8_t* in, const uint8_t* base, uint64_t n, uint8_t* out) {
  for (uint64_t i = 0; i < n; ++i) out[i] = base ? static_cast<uint8_t>(in[i] ^ base[i]) : in[i];
}

}  // namespace

extern "C" {

// in[0:n) (XOR base[0:n) when base is not null) into the grouped layout at out[0:n).
// Returns 0, or 1 for a width outside 1..16. in, base and out must not overlap.
int ckpt_group(const uint8_t* in, const uint8_t* base, uint64_t n, int w, uint8_t* out) {
  if (w < 1 || w > 16) return 1;
  uint64_t m = n / w;
  if (base) group_any<true>(in, base, m, w, out); else group_any<false>(in, nullptr, m, w, out);
  tail(in + m * w, base ? base + m * w : nullptr, n - m * w, out + m * w);
  return 0;
}

// The inverse: the grouped planes[0:n) back into element order at out[0:n), XOR base when not null.
int ckpt_ungroup(const uint8_t* planes, const uint8_t* base, uint64_t n, int w, uint8_t* out) {
  if (w < 1 || w > 16) return 1;
  uint64_t m = n / w;
  if (base) ungroup_any<true>(planes, base, m, w, out); else ungroup_any<false>(planes, nullptr, m, w, out);
  tail(planes + m * w, base ? base + m * w : nullptr, n - m * w, out + m * w);
  return 0;
}

// out[i] = a[i] ^ b[i] for i < n (out may be a or b).
void ckpt_xor(const uint8_t* a, const uint8_t* b, uint64_t n, uint8_t* out) {
  uint64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    uint64_t x, y;
    std::memcpy(&x, a + i, 8);
    std::memcpy(&y, b + i, 8);
    x ^= y;
    std::memcpy(out + i, &x, 8);
  }
  for (; i < n; ++i) out[i] = a[i] ^ b[i];
}

}  // extern "C"

extern "C" {

// ckpt_ungroup with the planes in separate buffers: planes[p] holds plane p (n / w bytes), tail the
// n mod w tail bytes; base may be null, or out itself (XOR in place). Lets a decoder point at planes where they lie (in the payload,
// or decompressed into scratch) instead of gathering them first.
int ckpt_ungroup_planes(const uint8_t* const* planes, const uint8_t* tail_src, const uint8_t* base, uint64_t n,
                        int w, uint8_t* out) {
  if (w < 1 || w > 16) return 1;
  uint64_t m = n / w;
  switch (w) {
    case 2: interleave<2>(planes, base, m, out); break;
    case 4: interleave<4>(planes, base, m, out); break;
    case 8: interleave<8>(planes, base, m, out); break;
    default:
      for (uint64_t j = 0; j < m; ++j)
        for (int p = 0; p < w; ++p) out[j * w + p] = planes[p][j] ^ (base ? base[j * w + p] : 0);
  }
  tail(tail_src, base ? base + m * w : nullptr, n - m * w, out + m * w);
  return 0;
}

}  // extern "C"
