// Zero masks (chunk format v3, ckpt/format/chunk.py): an element whose w bytes (XOR its base) are
// all zero is left out of a chunk's byte planes, and one bit per element says which were kept (bit
// i % 8 of mask byte i / 8, least significant first; the bits past the last element are zero). A
// chunk that is mostly zeros (a pruned layer, the XOR delta of a sparse update) then codes only its
// nonzero elements, and decoding writes the zeros as runs instead of entropy-decoding every byte.
// ckpt/format/mask.py's numpy fallback writes the same bytes.

#include <cstdint>
#include <cstring>

namespace {

template <int W> struct Word;
template <> struct Word<2> { using T = uint16_t; };
template <> struct Word<4> { using T = uint32_t; };
template <> struct Word<8> { using T = uint64_t; };

// Elements [0, m) of src (XOR base) with any bit set, in order, into out; their mask into mask.
// Every element is written at out's next place and the place kept only where nonzero (no branch
// per element): out must hold m elements. Returns how many were kept.
template <int W, bool X>
uint64_t compact(const uint8_t* src, const uint8_t* base, uint64_t m, uint8_t* mask, uint8_t* out) {
  using T = typename Word<W>::T;
  uint64_t j = 0;
  for (uint64_t i = 0; i < m; i += 8) {
    const uint64_t e = m - i < 8 ? m - i : 8;
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

// The inverse: element i of out is base's (zero without one) XOR, where its bit is set, the next
// kept element. base may be out itself (a delta XORed in place: only kept elements are touched).
// Returns -1, touching nothing past the byte of the mask that says so, where the mask keeps more
// elements than the k given or sets a bit past the last element; else the count it kept.
template <int W, bool X>
int64_t expand(const uint8_t* mask, const uint8_t* kept, uint64_t k, uint64_t m, const uint8_t* base, uint8_t* out) {
  using T = typename Word<W>::T;
  const uint64_t bytes = (m + 7) / 8;
  uint64_t j = 0;
  for (uint64_t q = 0; q < bytes;) {
    unsigned bits = mask[q];
    if (bits == 0) {  // a run of zero elements (most of a sparse chunk; all of a frozen tensor's delta): one fill
      uint64_t r = q + 1;
      while (r + 8 <= bytes) {
        uint64_t word;
        std::memcpy(&word, mask + r, 8);
        if (word) break;
        r += 8;
      }
      while (r < bytes && mask[r] == 0) ++r;
      const uint64_t i = q * 8, end = r * 8 < m ? r * 8 : m;
      if (!X) std::memset(out + i * W, 0, (end - i) * W);
      else if (base != out) std::memcpy(out + i * W, base + i * W, (end - i) * W);
      q = r;
      continue;
    }
    const uint64_t i = q * 8, e = m - i < 8 ? m - i : 8;
    if (j + static_cast<uint64_t>(__builtin_popcount(bits)) > k || bits >> e) return -1;
    // the eight elements first as zeros (or the base's), then the kept ones set bit by bit: no branch
    // depends on each element's bit
    if (!X) std::memset(out + i * W, 0, e * W);
    else if (base != out) std::memcpy(out + i * W, base + i * W, e * W);
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
    ++q;
  }
  return static_cast<int64_t>(j);
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
    case 2: return base ? expand<2, true>(mask, kept, k, m, base, out) : expand<2, false>(mask, kept, k, m, base, out);
    case 4: return base ? expand<4, true>(mask, kept, k, m, base, out) : expand<4, false>(mask, kept, k, m, base, out);
    case 8: return base ? expand<8, true>(mask, kept, k, m, base, out) : expand<8, false>(mask, kept, k, m, base, out);
    default: return -1;
  }
}

}  // extern "C"
