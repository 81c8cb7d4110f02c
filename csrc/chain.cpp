// Decoding planes/xor chunks and whole delta chains from their sections (csrc/planes.cpp has the
// layout, rans.cpp the rANS sections): rANS planes are decoded a tile at a time into a small buffer,
// interleaved, XORed into what lies under them and hashed, all while the tile is in cache (a decode
// into whole planes, an interleave and a hash were three passes over memory; a chain decoded link by
// link was one more pass per link).
//
// Called through ctypes, which releases the GIL.

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

#include "core.h"
#include "rans.h"

namespace {

using namespace ckpt_rans;

// One link of a chain: the planes of a planes/xor chunk as ckpt_planes_decode takes them, or w == 0:
// `out` holds the link's bytes already (a chunk stored whole as zstd, decompressed there first).
// `first` (null: all 0): per plane not coded, the element its bytes start at (a range's part of a
// plane decoded from zstd holds only the elements the range's tiles need).
struct Link {
  int w, rot;
  const uint8_t* const* src;
  const uint64_t* len;
  const uint8_t* coded;
  const uint8_t* tail;
  const uint64_t* first;
};

// A tile whose planes are each one byte repeated is one element repeated: XOR it over the m elements
// at `under` (or write it where null) into out, a word at a time instead of a plane interleave. A
// delta of a frozen tensor (all zero) leaves the bytes under it as they are; one of a constant bit
// flip, as from a fixed mask, costs a plain XOR.
// Not inlined: inside chain_decode's tile loop the compiler ran its word loop one word at a time,
// reloading `out` from the stack every word (5 mask deltas of 16 MiB: 1.4 ms more).
__attribute__((noinline)) void repeat(const uint8_t* const* planes, const uint8_t* under, uint64_t m, int w, int rot,
                                      uint8_t* out) {
  uint8_t one[16], word[8 * 16];
  ckpt_ungroup_planes(planes, nullptr, nullptr, uint64_t(w), w, rot, one);  // the element, un-rotated
  bool zero = true;
  for (int p = 0; p < w; ++p) zero = zero && one[p] == 0;
  if (zero && under == out) return;
  for (int r = 0; r < 8 * w; ++r) word[r] = one[r % w];  // 8 elements: a whole number of 8-byte words
  const uint64_t bytes = m * uint64_t(w);
  uint64_t done = 0;
  if (8 % w == 0) {  // widths 1, 2, 4, 8: one word repeated (loops the compiler vectorizes)
    uint64_t pat;
    memcpy(&pat, word, 8);
    const uint64_t words = bytes / 8;
    if (under) {
      for (uint64_t i = 0; i < words; ++i) {
        uint64_t v;
        memcpy(&v, under + 8 * i, 8);
        v ^= pat;
        memcpy(out + 8 * i, &v, 8);
      }
    } else {
      for (uint64_t i = 0; i < words; ++i) memcpy(out + 8 * i, &pat, 8);
    }
    done = 8 * words;
  }
  for (uint64_t b = done; b < bytes; ++b) out[b] = uint8_t((under ? under[b] : 0) ^ word[b % (8 * uint64_t(w))]);
}

uint64_t gcd(uint64_t a, uint64_t b) { return b ? gcd(b, a % b) : a; }

constexpr uint64_t MAX_TILE = 1 << 24;  // bytes; widths whose tile would be larger are refused (5)

// The links in order, the chunk stored whole first, each later one a delta XORed into the bytes so far
// (the first XORs `base` where not null; base may be out), bytes [lo, hi) of them into out[lo:hi), and,
// where `hash` is not null (then lo is 0 and hi is n), the result's XXH3-128 (see ckpt_planes_decode).
// One pass over `out`, a tile of bytes at a time: every link's part of the tile is decoded into it
// while it is in cache. A tile is a whole number of every link's elements and of every rANS block
// (links may differ in width), so no block straddles two tiles. Link 0 may be no planes (w 0): its
// bytes are `base` where given, else `out` holds them already (a whole decode only).
//
// A range decodes only the tiles that cover it: the rANS blocks before its first tile are stepped
// over by their length prefixes, those after its last are never read, and a tile that reaches past
// the range is decoded into `edge` and only its part in the range copied out, so nothing outside
// out[lo:hi) is written.
int chain_decode(const Link* links, int count, const uint8_t* base, uint64_t n, uint64_t lo, uint64_t hi, int simd,
                 uint8_t* out, uint64_t* hash, bool hashed = true) {
  if (hash) hash[2] = 0;
  if (count < 1 || hi > n || (hash ? lo || hi != n : lo >= hi)) return 4;
  const bool in_out = links[0].w == 0 && !base;  // link 0's bytes lie in `out` already
  if (in_out && (lo || hi != n)) return 4;
  uint64_t widths = 1, unit = 1 << 16;  // the widths' least common multiple; elements per tile for width 1
  std::vector<Section> secs(size_t(count) * 16);
  std::vector<uint32_t> tables(size_t(SCALE) * GROUP);
  for (int l = 0; l < count; ++l) {
    const Link& k = links[l];
    if (k.w == 0 && l == 0) continue;
    if (k.w < 1 || k.w > 16 || (k.rot && k.w != 2 && k.w != 4 && k.w != 8)) return 4;
    widths = widths / gcd(widths, uint64_t(k.w)) * uint64_t(k.w);
    if (widths > MAX_TILE) return 5;
    for (int p = 0; p < k.w; ++p) {
      if (!k.coded[p]) continue;
      Section& s = secs[size_t(l) * 16 + p];
      if (int err = s.open(k.src[p], k.len[p], n / k.w, simd, tables.data())) return err;
      unit = s.block * GROUP > unit ? s.block * GROUP : unit;
    }
  }
  if (widths * unit > MAX_TILE) return 5;
  const uint64_t tile = widths * unit;
  std::vector<uint8_t> buf(n < tile ? n + 16 : tile);  // a link's coded planes for one tile: at most its bytes
  std::vector<uint8_t> edge;                            // a tile that reaches past the range
  const bool hashing = hash && hashed && n > 240;
  ckpt_core::Hash128 h;
  if (hashing) ckpt_core::hash_start(h, n);
  uint64_t hashed_to = 0;
  const uint8_t* planes[16];
  for (uint64_t b0 = lo / tile * tile;; b0 += tile) {
    const uint64_t b1 = n - b0 < tile ? n : b0 + tile;
    const bool inside = lo <= b0 && b1 <= hi;
    if (!inside && edge.empty()) edge.resize(n < tile ? n : tile);
    uint8_t* const at = inside ? out + b0 : edge.data();  // where the tile is decoded
    bool written = in_out;                               // `at` holds the chain's bytes so far
    for (int l = 0; l < count; ++l) {
      const Link& k = links[l];
      if (k.w == 0) continue;
      const uint64_t m = n / k.w, j0 = b0 / k.w, j1 = b1 == n ? m : b1 / k.w;
      uint8_t* dst = buf.data();
      bool uniform = true;  // every plane one byte repeated over the tile
      for (int p = 0; p < k.w; ++p) {
        if (!k.coded[p]) {
          const uint64_t f = k.first ? k.first[p] : 0;
          if (j0 < f || j1 - f > k.len[p]) return 4;  // the plane does not hold the tile's elements
          planes[p] = k.src[p] + (j0 - f);
          uniform = false;
          continue;
        }
        Section& s = secs[size_t(l) * 16 + p];
        if (int err = s.skip(j0)) return err;  // a range's first tile: the blocks before it
        if (s.i != j0 && s.i < s.n) return 4;  // not at a block's start (tiles are whole blocks)
        if (int err = s.run(j1, dst, j0)) return err;
        uniform = uniform && s.uniform >= 0;
        planes[p] = dst;
        dst += j1 - j0;
      }
      const uint8_t* under = written ? at : base ? base + b0 : nullptr;
      written = true;
      if (uniform && j1 > j0 && (b1 - b0) == (j1 - j0) * k.w) {
        repeat(planes, under, j1 - j0, k.w, k.rot, at);
        continue;
      }
      if (ckpt_ungroup_planes(planes, k.tail, under, b1 - b0, k.w, k.rot, at)) return 4;
    }
    const uint64_t c0 = lo > b0 ? lo : b0, c1 = hi < b1 ? hi : b1;
    if (!written) {  // a chain of link 0 alone, given as `base`
      if (!base) return 4;
      memcpy(out + c0, base + c0, c1 - c0);
    } else if (!inside) {  // only the part in the range leaves `edge`
      memcpy(out + c0, at + (c0 - b0), c1 - c0);
    }
    if (hashing) {  // the whole blocks written so far, from where the last tile stopped
      const uint64_t upto = b1 / ckpt_core::HASH_BLOCK * ckpt_core::HASH_BLOCK;
      if (upto > hashed_to) {
        ckpt_core::hash_blocks(h, out + hashed_to, (upto - hashed_to) / ckpt_core::HASH_BLOCK);
        hashed_to = upto;
      }
    }
    if (b1 >= hi) break;
  }
  if (hash) {  // a whole decode: every block used, nothing after them (a range leaves the rest unread)
    for (const Section& s : secs)
      if (s.p)
        if (int err = s.close()) return err;
  }
  if (hashing) {
    ckpt_core::hash_finish(h, out, hash);
    hash[2] = 1;
  }
  return 0;
}

}  // namespace

extern "C" {

// The planes of a planes/xor chunk (csrc/planes.cpp's layout) back into element order in `out` (n
// bytes, element width w, rotated with rot, XOR `base` where not null; base may be out), and the
// result's XXH3-128. Plane p is `src[p]`: its n / w bytes as they are when coded[p] is 0, a rANS section
// of len[p] bytes when 1; `tail` holds the n mod w tail bytes. The work goes a tile of elements at a
// time: the rANS planes' blocks for the tile are decoded into a small buffer, the tile is interleaved,
// then hashed, all while it is in cache (a decode into whole planes, an interleave and a hash were
// three passes over memory). hash = {low64, high64, hashed}; hashed is 0 for n <= 240 (Python hashes
// those). Returns 0, a rANS section's error (1 truncated, 2 damaged header or table, 3 damaged words),
// or 4 (a width or rotation the interleave does not support). `out` may be partly written on error.
int ckpt_planes_decode(const uint8_t* const* src, const uint64_t* len, const uint8_t* coded, const uint8_t* tail,
                       const uint8_t* base, uint64_t n, int w, int rot, int simd, uint8_t* out, uint64_t* hash) {
  const Link link{w, rot, src, len, coded, tail, nullptr};
  hash[2] = 0;
  if (w < 1) return 4;
  return chain_decode(&link, 1, base, n, 0, n, simd, out, hash);
}

// A delta chain of `count` links decoded at once into out[0:n) and the result's XXH3-128 (as
// ckpt_planes_decode gives it): link 0 is the chunk stored whole, each later one a delta of the one
// before. Link l is w[l] = wr[2l] planes rotated as wr[2l + 1] says, plane p at src[16l + p] (len and
// coded likewise, as ckpt_planes_decode takes them) and its tail at tails[l]; w[0] may be 0: `out`
// holds link 0's bytes already. Only the result is hashed: a link that decodes to wrong bytes shows
// as a wrong hash, and the caller decodes link by link to say which. Returns ckpt_planes_decode's
// codes, or 5 (widths whose common tile would be too large: decode link by link). `hashed` 0: every
// section still checked to its end, but no hash (a pass before a masked link: hash[2] stays 0).
int ckpt_chain_decode(int count, const int32_t* wr, const uint8_t* const* src, const uint64_t* len,
                      const uint8_t* coded, const uint8_t* const* tails, uint64_t n, int simd, uint8_t* out,
                      uint64_t* hash, int hashed) {
  hash[2] = 0;
  if (count < 1 || count > 256) return 4;
  std::vector<Link> links(count);
  for (int l = 0; l < count; ++l)
    links[l] = Link{wr[2 * l], wr[2 * l + 1], src + 16 * l, len + 16 * l, coded + 16 * l, tails[l], nullptr};
  return chain_decode(links.data(), count, nullptr, n, 0, n, simd, out, hash, hashed != 0);
}

// Bytes [lo, hi) of a delta chain (links as ckpt_chain_decode takes them; w[0] 0: link 0's bytes are
// `base`, n bytes) decoded into out[lo:hi) (`out` is the whole chunk's n bytes; nothing outside the
// range is written), a reshard's part of a chunk, without its hash: the caller checks the range
// against its span digests. Only the tiles covering the range are decoded, and only their blocks
// read: damage elsewhere in the links goes unseen. Returns ckpt_chain_decode's codes (4 also for a
// range not within [0, n), w[0] 0 without `base`, or a plane that does not hold what the range's tiles
// need of it). A plane not coded may hold only some of its elements: first[16l + p] is the one it starts at.
int ckpt_chain_decode_range(int count, const int32_t* wr, const uint8_t* const* src, const uint64_t* len,
                            const uint8_t* coded, const uint8_t* const* tails, const uint64_t* first,
                            const uint8_t* base, uint64_t n, uint64_t lo, uint64_t hi, int simd, uint8_t* out) {
  if (count < 1 || count > 256 || (wr[0] == 0 && !base)) return 4;
  std::vector<Link> links(count);
  for (int l = 0; l < count; ++l)
    links[l] = Link{wr[2 * l], wr[2 * l + 1], src + 16 * l, len + 16 * l, coded + 16 * l, tails[l], first + 16 * l};
  return chain_decode(links.data(), count, base, n, lo, hi, simd, out, nullptr);
}

}  // extern "C"
