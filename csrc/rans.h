// What the rANS decoders (rans.cpp) and encoders (rans_encode.cpp) share: the section format's
// constants (rans.cpp describes the format) and its little-endian fields. Internal, not part of the C
// ABI Python loads.
#pragma once

#include <cstdint>
#include <cstring>

namespace ckpt_rans {

constexpr int SCALE_BITS = 12;
constexpr uint32_t SCALE = 1u << SCALE_BITS;
constexpr uint32_t LOW = 1u << 16;  // states live in [LOW, LOW << 16)
constexpr uint8_t FORMAT = 1;
constexpr int STATES = 8;
constexpr int BLOCK_LOG = 14;  // at most 16: a state's word count is a u16  // 16384 symbols: small enough to follow tensors, large enough for its table

inline void put16(uint8_t* p, uint32_t v) { p[0] = uint8_t(v); p[1] = uint8_t(v >> 8); }
inline void put32(uint8_t* p, uint32_t v) { put16(p, v); put16(p + 2, v >> 16); }
inline uint32_t get16(const uint8_t* p) {  // little-endian hosts (x86-64, aarch64): one load
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
  uint16_t v;
  memcpy(&v, p, 2);
  return v;
#else
  return uint32_t(p[0]) | uint32_t(p[1]) << 8;
#endif
}
inline uint32_t get32(const uint8_t* p) { return get16(p) | get16(p + 2) << 16; }

// Blocks the vector decoders step together. Measured on Zen 4, of 2 to 8: 4 (more chains in flight
// than that, and their tables, 16 KiB each, no longer stay in the L1 cache).
constexpr int GROUP = 4;

// A section being decoded a run of blocks at a time (rans.cpp; chain.cpp interleaves each run while
// it is in cache, ckpt_rans_decode takes all of it at once). `tables` (SCALE * GROUP entries) is only
// used within one run, so every section of a chain shares one (8 links of 8 coded planes would
// otherwise hold 4 MiB of tables, far more than the tiles they decode).
struct Section {
  const uint8_t* p = nullptr;
  const uint8_t* end = nullptr;
  uint64_t block = 0, n = 0, i = 0;  // block length, symbols, the first symbol not decoded
  int level = 0;
  uint32_t* tables = nullptr;
  int uniform = -1;  // after run: the one symbol every block it decoded holds, or -1 (coded blocks, or several)

  // A section of len bytes at in, of `symbols` symbols, decoded with vector code up to `simd`: 0, or
  // 2 (a damaged header).
  int open(const uint8_t* in, uint64_t len, uint64_t symbols, int simd, uint32_t* shared);
  // Decode the blocks that start before `upto`, symbol k to out[k - origin]: 0 or an error code.
  int run(uint64_t upto, uint8_t* out, uint64_t origin);
  // Step over the blocks that start before `upto` by their length prefixes, decoding nothing (a range
  // of a chunk decoded alone): 0, or 1 (a prefix that runs past the section).
  int skip(uint64_t upto);
  int close() const { return p == end ? 0 : 3; }  // every block used, nothing after them
};

}  // namespace ckpt_rans

extern "C" int ckpt_rans_simd();  // rans.cpp: the best vector code this CPU runs (2: AVX-512, 1: AVX2, 0)
