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

}  // namespace ckpt_rans

extern "C" int ckpt_rans_simd();  // rans.cpp: the best vector code this CPU runs (2: AVX-512, 1: AVX2, 0)
