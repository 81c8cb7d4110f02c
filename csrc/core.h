// What one part of the compiled core uses of another; internal, not part of the C ABI Python loads.
#pragma once

#include <cstddef>
#include <cstdint>
#include <new>

namespace ckpt_core {

// The unsigned word of a w-byte element (byte planes, zero masks).
template <int W> struct Word;
template <> struct Word<2> { using T = uint16_t; };
template <> struct Word<4> { using T = uint32_t; };
template <> struct Word<8> { using T = uint64_t; };

constexpr size_t HASH_BLOCK = 1024;  // XXH3's block: pieces fed to hash_blocks hold whole ones

// XXH3-128 of an input longer than 240 bytes fed in pieces (copyhash.cpp): hash_blocks() takes the
// next `count` whole blocks (extra ones past the last full block are ignored); hash_finish() needs
// the whole input in memory and hashes what was not fed.
struct Hash128 {
  alignas(8) unsigned char state[96];
};
void hash_start(Hash128& h, uint64_t len);
void hash_blocks(Hash128& h, const uint8_t* p, uint64_t count);
void hash_finish(Hash128& h, const uint8_t* input, uint64_t out[2]);

}  // namespace ckpt_core

extern "C" int ckpt_ungroup_planes(const uint8_t* const* planes, const uint8_t* tail_src, const uint8_t* base,
                                   uint64_t n, int w, int rot, uint8_t* out);
