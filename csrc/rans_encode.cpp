// The rANS encoders (csrc/rans.cpp and ckpt/format/rans.py describe the section they write): the
// scalar one (everywhere, and the reference) and, on x86 CPUs with AVX2, one that steps a block's
// eight states as the lanes of a vector, four blocks at a time (encode_rounds), compiled for AVX2 and
// again for AVX-512 and chosen at run time like the decoders. Every encoder writes the same bytes,
// and so does the numpy one in ckpt/format/rans.py: what a save stores does not depend on the machine.
//
// Called through ctypes, which releases the GIL. Everything is integer arithmetic.

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

#include "rans.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace {

using namespace ckpt_rans;

// Counts of a block's symbols scaled to frequencies summing to SCALE, every present symbol at least 1.
void normalize(const uint32_t* count, uint32_t n, uint32_t* f) {
  int32_t sum = 0;
  int top = -1;
  const int shift = (n & (n - 1)) ? -1 : __builtin_ctz(n);  // a whole block: a shift, not a 64-bit divide
  for (int s = 0; s < 256; ++s) {
    f[s] = 0;
    if (!count[s]) continue;
    uint32_t v = shift >= 0 ? uint32_t((uint64_t(count[s]) * SCALE) >> shift) : uint32_t(uint64_t(count[s]) * SCALE / n);
    f[s] = v ? v : 1;
    sum += int32_t(f[s]);
    if (top < 0 || count[s] > count[top]) top = s;
  }
  int32_t diff = int32_t(SCALE) - sum;
  if (diff >= 0) {
    f[top] += uint32_t(diff);
    return;
  }
  while (diff < 0) {  // rare symbols raised to 1 took more than the rounding left: take from the largest
    int big = top;
    uint32_t other = 0;  // the largest frequency but top's
    for (int s = 0; s < 256; ++s) {
      if (f[s] > f[big]) big = s;
      if (s != top && f[s] > other) other = f[s];
    }
    // One at a time, each from the first largest (top when it is among them). While top is, it stays
    // the choice down to `other`: take those at once (a block of one common symbol and ~200 rare ones
    // took ~200 passes over the table, as long as coding the block).
    const uint32_t run = big == top ? f[top] - other + 1 : 1;
    const uint32_t take = run < uint32_t(-diff) ? run : uint32_t(-diff);
    f[big] -= take;
    diff += int32_t(take);
  }
}

// A block being encoded: its symbols, their frequencies and, per state, the state and the slot its
// next word goes to. Each state writes its own stream backwards (the decoder reads it forwards), so
// the decoder's states never wait on one another's reads: stream j fills words[room * j, room * (j +
// 1)) from the top down. A state codes ceil(n / STATES) symbols and writes a word (kept or not) per
// symbol, so n / STATES + 2 words of room never reach the region below.
struct EncBlock {
  const uint8_t* src;
  uint32_t left;  // symbols not coded yet: the block is coded from its end
  int present;    // distinct symbols
  uint16_t* words;
  uint32_t room;
  uint32_t x[STATES];
  uint32_t pos[STATES];  // stream j's words are words[pos[j] + 1, room * (j + 1))
  uint32_t f[256], cum[256];
};

// Words of room per stream for a block of n symbols: enough (above), and rounded up so that the
// streams' tops are not 4 KiB apart (n / 8 + 2 words are 4100 bytes for a whole block; the vector
// encoder's eight stores a round to addresses that close in their low 12 bits ran at half speed).
constexpr uint32_t stream_room(uint32_t n) { return (n / STATES + 2 + 31) / 32 * 32 + 32; }

// Whether the n > 0 bytes at p are all one byte, 64 at a time (an unchanged plane of a delta is all
// zeros: 15x faster than counting it; any other block stops at its first bytes).
bool one_symbol(const uint8_t* p, uint32_t n) {
  if (!n) return false;
  const uint64_t b = 0x0101010101010101ull * p[0];
  uint32_t i = 0;
  for (; i + 64 <= n; i += 64) {
    uint64_t acc = 0;
    for (int k = 0; k < 8; ++k) {
      uint64_t w;
      memcpy(&w, p + i + 8 * k, 8);
      acc |= w ^ b;
    }
    if (acc) return false;
  }
  for (; i < n; ++i)
    if (p[i] != p[0]) return false;
  return true;
}

// The block's symbol counts.
void count_block(const uint8_t* src, uint32_t n, uint32_t* count) {
  if (one_symbol(src, n)) {
    memset(count, 0, 256 * sizeof(uint32_t));
    count[src[0]] = n;
    return;
  }
  // Eight histograms fed from 64-bit loads: runs of one symbol (a plane of mostly zeros) would
  // otherwise wait on their own increments. 16-bit counts: a table sees at most n / 8 < 2^16.
  static_assert((1u << BLOCK_LOG) / 8 < 65536, "a histogram's counts must fit 16 bits");
  uint16_t part[8][256] = {{0}};
  uint32_t i = 0;
  for (; i + 8 <= n; i += 8) {
    uint64_t w;
    memcpy(&w, src + i, 8);  // the byte order does not matter: every byte is counted once
    for (int k = 0; k < 8; ++k) part[k][(w >> (8 * k)) & 255]++;
  }
  for (int s = 0; s < 256; ++s) {
    uint32_t c = 0;
    for (int k = 0; k < 8; ++k) c += part[k][s];
    count[s] = c;
  }
  for (; i < n; ++i) count[src[i]]++;
}

// Count the block's symbols and derive its frequencies; the states start at LOW.
void plan_block(EncBlock& b, const uint8_t* src, uint32_t n, uint16_t* words, uint32_t room) {
  b.src = src;
  b.left = n;
  b.words = words;
  b.room = room;
  uint32_t count[256];
  count_block(src, n, count);
  normalize(count, n, b.f);
  b.present = 0;
  uint32_t c = 0;
  for (int s = 0; s < 256; ++s) {
    b.cum[s] = c;
    c += b.f[s];
    b.present += b.f[s] != 0;
  }
  for (int j = 0; j < STATES; ++j) {
    b.x[j] = LOW;
    b.pos[j] = room * (j + 1) - 1;
  }
}

// The scalar encoder (everywhere, and the reference the vector one is tested against): all of the
// block's symbols, from its end.
void code_scalar(EncBlock& b) {
  const uint32_t* f = b.f;
  const uint32_t* cum = b.cum;
  const uint8_t* src = b.src;
  uint16_t* w[STATES];
  uint32_t x[STATES];
  // Division by a frequency as a multiply (a 32-bit divide per symbol was the encoder's bottleneck).
  // With m = ceil(2^44 / f): floor(v * m / 2^44) = floor(v / f) because the error v * (m - 2^44/f)
  // is below v < 2^20 * f, and v * f < 2^44 for f < 4096. The product fits in 64 bits:
  // v * m < 2^20 * f * (2^44 / f + 1) = 2^64 + 2^20 * f - ..., below 2^64 as f^2 < 2^24.
  uint64_t rcp[256];
  for (int k = 0; k < 256; ++k) rcp[k] = f[k] ? ((uint64_t(1) << 44) + f[k] - 1) / f[k] : 0;
  for (int j = 0; j < STATES; ++j) {
    w[j] = b.words + b.pos[j] + 1;
    x[j] = b.x[j];
  }
  // One symbol into state x, its word (if any) onto stream w. Renormalisation is branch-free (whether
  // a word goes out is data-dependent, unpredictable): the word is always stored, and kept only when
  // the state is too large for this symbol.
  auto put = [&](uint32_t& x, uint16_t*& w, uint32_t sym) {
    const uint32_t fs = f[sym];
    uint32_t v = x;
    const uint32_t emit = v >= ((LOW >> SCALE_BITS) << 16) * fs;
    w[-1] = uint16_t(v);
    w -= emit;
    v >>= emit << 4;
    const uint32_t q = uint32_t((uint64_t(v) * rcp[sym]) >> 44);  // v / fs, exactly (above)
    x = (q << SCALE_BITS) + (v - q * fs) + cum[sym];
  };
  uint32_t i = b.left;
  for (; i % STATES; --i) put(x[(i - 1) % STATES], w[(i - 1) % STATES], src[i - 1]);  // the tail, backwards
  {
    uint32_t x0 = x[0], x1 = x[1], x2 = x[2], x3 = x[3], x4 = x[4], x5 = x[5], x6 = x[6], x7 = x[7];
    uint16_t *w0 = w[0], *w1 = w[1], *w2 = w[2], *w3 = w[3], *w4 = w[4], *w5 = w[5], *w6 = w[6], *w7 = w[7];
    for (; i; i -= STATES) {  // eight states in registers, each its own dependency chain
      const uint8_t* g = src + i - STATES;
      put(x7, w7, g[7]);
      put(x6, w6, g[6]);
      put(x5, w5, g[5]);
      put(x4, w4, g[4]);
      put(x3, w3, g[3]);
      put(x2, w2, g[2]);
      put(x1, w1, g[1]);
      put(x0, w0, g[0]);
    }
    x[0] = x0, x[1] = x1, x[2] = x2, x[3] = x3, x[4] = x4, x[5] = x5, x[6] = x6, x[7] = x7;
    w[0] = w0, w[1] = w1, w[2] = w2, w[3] = w3, w[4] = w4, w[5] = w5, w[6] = w6, w[7] = w7;
  }
  for (int j = 0; j < STATES; ++j) {
    b.x[j] = x[j];
    b.pos[j] = uint32_t(w[j] - b.words) - 1;
  }
  b.left = 0;
}

// The coded block at `out`: its length, table, states, word counts and streams; returns the bytes written.
size_t write_block(const EncBlock& b, uint8_t* out) {
  uint8_t* p = out + 4;
  *p++ = uint8_t(b.present - 1);
  for (int s = 0; s < 256; ++s) {
    if (!b.f[s]) continue;
    *p++ = uint8_t(s);
    if (b.present > 1) {
      put16(p, b.f[s]);
      p += 2;
    }
  }
  if (b.present > 1) {
    for (int j = 0; j < STATES; ++j, p += 4) put32(p, b.x[j]);
    for (int j = 0; j < STATES; ++j, p += 2) put16(p, b.room * (j + 1) - 1 - b.pos[j]);
    for (int j = 0; j < STATES; ++j) {
      const uint16_t* c = b.words + b.pos[j] + 1;
      const size_t count = b.room * (j + 1) - 1 - b.pos[j];
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
      memcpy(p, c, 2 * count);
      p += 2 * count;
#else
      for (size_t k = 0; k < count; ++k, p += 2) put16(p, c[k]);
#endif
    }
  }
  put32(out, uint32_t(p - out - 4));
  return size_t(p - out);
}

// One block of n symbols at `out` with the scalar encoder; returns the bytes written.
size_t encode_block(const uint8_t* src, uint32_t n, uint8_t* out, std::vector<uint16_t>& words) {
  EncBlock b;
  const uint32_t room = stream_room(n);
  words.resize(size_t(room) * STATES);
  plan_block(b, src, n, words.data(), room);
  if (b.present > 1) code_scalar(b);
  return write_block(b, out);
}

#if defined(__x86_64__) || defined(__i386__)
#define CKPT_RANS_ENC_AVX2 1

// The vector encoder divides by a frequency with a 33-bit reciprocal, so that a 32x32-bit multiply
// (vpmuludq) does it: with l = ceil(log2 f) and m = ceil(2^(32+l) / f) = 2^32 + m' (0 <= m' < 2^32),
//   floor(v / f) = floor(v * m / 2^(32+l)) = (floor(v * m' / 2^32) + v) >> l
// for every v < 2^20 * f, the states the encoder divides (after renormalisation, v < bound = 2^20 * f).
// Why: with e = m * f - 2^(32+l) (0 <= e < f) and v = q * f + r, v * m / 2^(32+l) = q + (r + v * e /
// 2^(32+l)) / f, which stays below q + 1 while r + v * e / 2^(32+l) < f; the worst case, r = f - 1 with
// v = 2^20 * f - 1, needs (2^20 * f - 1) * e < 2^(32+l), true as e < f <= 2^l and 2^20 * f <= 2^(20+l)
// <= 2^32 (f <= 4096). Adding v * 2^32 before the shift commutes with the floor, hence the second form,
// and its sum t = floor(v * m' / 2^32) + v fits in 32 bits (t >> l = q < 2^20, l <= 12).
uint32_t recip33(uint32_t f, int* l) {
  *l = f > 1 ? 32 - __builtin_clz(f - 1) : 0;
  return uint32_t(((uint64_t(1) << (32 + *l)) + f - 1) / f - (uint64_t(1) << 32));
}

// The per-symbol entries of a block for the vector code (64 bits: m' in the low half, then f - 1 in
// bits 32-43, cum in 44-55 and 32 + l in 56-63); a table of every frequency's reciprocal is made
// once (a 64-bit divide per present symbol per block cost more than the table).
void fill_entries(const EncBlock& b, uint64_t* tab) {
  static const std::vector<uint32_t> magic = [] {
    std::vector<uint32_t> m(SCALE + 1);
    int l;
    for (uint32_t f = 1; f <= SCALE; ++f) m[f] = recip33(f, &l);
    return m;
  }();
  for (int s = 0; s < 256; ++s) {
    const uint32_t f = b.f[s];
    const uint32_t l = f > 1 ? 32 - __builtin_clz(f - 1) : 0;
    tab[s] = f ? uint64_t(magic[f]) | uint64_t((f - 1) | b.cum[s] << 12 | (32 + l) << 24) << 32 : 0;
  }
}

// The symbols of the block's tail (n mod STATES, the last ones: coded first) one at a time, as the
// vector code codes them.
void code_tail(EncBlock& b, const uint64_t* tab) {
  for (; b.left % STATES; --b.left) {
    const int j = int((b.left - 1) % STATES);
    const uint64_t e = tab[b.src[b.left - 1]];
    const uint32_t m = uint32_t(e), f = (uint32_t(e >> 32) & 0xFFF) + 1, cum = uint32_t(e >> 44) & 0xFFF;
    const int l = int(e >> 56) - 32;
    uint32_t v = b.x[j];
    b.words[b.pos[j]] = uint16_t(v);
    const uint32_t emit = (v >> 20) >= f;
    b.pos[j] -= emit;
    v >>= emit << 4;
    const uint32_t q = uint32_t(((uint64_t(v) * m >> 32) + v) >> l);
    b.x[j] = (q << SCALE_BITS) + (v - q * f) + cum;
  }
}

// Vector lane i holds state LANE[i]: the even lanes are the low halves of the 64-bit lanes, whose
// entries are states 0-3's; the odd ones, the high halves, states 4-7's.
constexpr int LANE[STATES] = {0, 4, 1, 5, 2, 6, 3, 7};

// The words of a whole block's streams, and the blocks coded in step: block g's entries are at
// tab0 + 256 g and its words at words0 + BLOCK_WORDS g, so that one register reaches every block's.
constexpr uint32_t BLOCK_WORDS = STATES * stream_room(1u << BLOCK_LOG);
constexpr int ENC_GROUP = 4;

// One round of G blocks in step (see encode_rounds): states and slots into ring slot P, the words
// of the round before (ring slot 1 - P) into their slots.
template <int G, int P>
__attribute__((target("avx2"), always_inline)) inline void encode_round(__m256i* x, __m256i* pos, const uint8_t** src,
                                                                        const uint64_t* tab0, uint16_t* words0,
                                                                        uint32_t (*rx)[2][STATES],
                                                                        uint32_t (*rp)[2][STATES]) {
  const __m256i lo12 = _mm256_set1_epi32(0xFFF), hi32 = _mm256_set1_epi64x(int64_t(0xFFFFFFFF00000000));
  const __m256i c32 = _mm256_set1_epi64x(32);
#pragma GCC unroll 8  // the blocks' states stay in registers (GCC made a loop of them, through memory)
  for (int g = 0; g < G; ++g) {
    src[g] -= STATES;
    const uint8_t* s = src[g];
    const uint64_t* t = tab0 + 256 * g;
    __m128i a0 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(t + s[0]));
    __m128i a1 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(t + s[2]));
    __m128i b0 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(t + s[4]));
    __m128i b1 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(t + s[6]));
    a0 = _mm_insert_epi64(a0, int64_t(t[s[1]]), 1);
    a1 = _mm_insert_epi64(a1, int64_t(t[s[3]]), 1);
    b0 = _mm_insert_epi64(b0, int64_t(t[s[5]]), 1);
    b1 = _mm_insert_epi64(b1, int64_t(t[s[7]]), 1);
    const __m256i ea = _mm256_inserti128_si256(_mm256_castsi128_si256(a0), a1, 1);  // states 0-3: the even lanes
    const __m256i eb = _mm256_inserti128_si256(_mm256_castsi128_si256(b0), b1, 1);  // states 4-7: the odd lanes
    const __m256i h = _mm256_blend_epi32(_mm256_srli_epi64(ea, 32), eb, 0xAA);     // every lane's high half
    const __m256i fm1 = _mm256_and_si256(h, lo12);
    const __m256i cf = _mm256_xor_si256(fm1, lo12);  // SCALE - f
    const __m256i cum = _mm256_and_si256(_mm256_srli_epi32(h, 12), lo12);
    const __m256i shift_a = _mm256_srli_epi64(ea, 56), shift_b = _mm256_sub_epi64(_mm256_srli_epi64(eb, 56), c32);
    _mm256_store_si256(reinterpret_cast<__m256i*>(rx[g][P]), x[g]);
    _mm256_store_si256(reinterpret_cast<__m256i*>(rp[g][P]), pos[g]);
    {
      asm("" : "+m"(rx[g][1 - P]), "+m"(rp[g][1 - P]));  // loads, not the compiler's extracts of the stored vectors
      uint16_t* w = words0 + BLOCK_WORDS * g;
      for (int i = 0; i < STATES; ++i) w[rp[g][1 - P][i]] = uint16_t(rx[g][1 - P][i]);
    }
    const __m256i emit = _mm256_cmpgt_epi32(_mm256_srli_epi32(x[g], 20), fm1);  // x >= 2^20 f
    pos[g] = _mm256_add_epi32(pos[g], emit);
    const __m256i v = _mm256_blendv_epi8(x[g], _mm256_srli_epi32(x[g], 16), emit);
    // t = (v * m' >> 32) + v in the high half of each 64-bit lane, q = t >> l: the even lanes' q
    // lands in the low half, the odd lanes' in the high half (the low half below it is dropped)
    const __m256i ta = _mm256_add_epi64(_mm256_mul_epu32(v, ea), _mm256_slli_epi64(v, 32));
    const __m256i tb = _mm256_add_epi64(_mm256_mul_epu32(_mm256_srli_epi64(v, 32), eb), _mm256_and_si256(v, hi32));
    const __m256i q = _mm256_blend_epi32(_mm256_srlv_epi64(ta, shift_a), _mm256_srlv_epi64(tb, shift_b), 0xAA);
    x[g] = _mm256_add_epi32(_mm256_add_epi32(v, cum), _mm256_mullo_epi32(q, cf));  // (q << 12) + v - q f + cum
  }
}

// G blocks coded in step, `rounds` rounds of STATES symbols each (every block has at least that many
// left, and no tail), a block's eight states the eight 32-bit lanes of a vector. A block's rounds are
// one dependency chain; four keep the core busy. Per round: the eight symbols' entries (scalar loads
// put together: gathers are slower, see rans.cpp gather8) as two vectors of four, whose low halves are what
// vpmuludq multiplies by; then per lane the branch-free step of the scalar encoder. Every lane's
// word is stored by a scalar store, kept (its slot taken) where the lane emits; the words and slots
// are those of the round before, read back from memory: the loads wait for no store, and vpextrd
// (two uops each) took longer. The instructions a round takes are what bounds the speed: two rounds
// an iteration keep the ring's addresses fixed, and the blocks' tables and streams one register.
template <int G>
__attribute__((target("avx2"), always_inline)) inline void encode_rounds(EncBlock* const* bs, const uint64_t* tab0,
                                                                         uint16_t* words0, uint32_t rounds) {
  __m256i x[G], pos[G];
  const uint8_t* src[G];
  // per block the last two rounds' states and slots, lane by lane; the first round writes what the one
  // before it left (the states at their current slots, which the first round writes again)
  alignas(32) uint32_t rx[G][2][STATES], rp[G][2][STATES];
  for (int g = 0; g < G; ++g) {
    for (int i = 0; i < STATES; ++i) rx[g][1][i] = bs[g]->x[LANE[i]], rp[g][1][i] = bs[g]->pos[LANE[i]];
    x[g] = _mm256_load_si256(reinterpret_cast<const __m256i*>(rx[g][1]));
    pos[g] = _mm256_load_si256(reinterpret_cast<const __m256i*>(rp[g][1]));
    src[g] = bs[g]->src + bs[g]->left;
  }
  uint32_t r = 0;
  for (; r + 2 <= rounds; r += 2) {
    encode_round<G, 0>(x, pos, src, tab0, words0, rx, rp);
    encode_round<G, 1>(x, pos, src, tab0, words0, rx, rp);
  }
  const int last = r < rounds ? 0 : 1;
  if (r < rounds) encode_round<G, 0>(x, pos, src, tab0, words0, rx, rp);
  for (int g = 0; g < G; ++g) {
    uint16_t* w = words0 + BLOCK_WORDS * g;
    for (int i = 0; rounds && i < STATES; ++i) w[rp[g][last][i]] = uint16_t(rx[g][last][i]);
    alignas(32) uint32_t xs[STATES], ps[STATES];
    _mm256_store_si256(reinterpret_cast<__m256i*>(xs), x[g]);
    _mm256_store_si256(reinterpret_cast<__m256i*>(ps), pos[g]);
    for (int i = 0; i < STATES; ++i) bs[g]->x[LANE[i]] = xs[i], bs[g]->pos[LANE[i]] = ps[i];
    bs[g]->left -= STATES * rounds;
  }
}

// As the decoder: the same code for AVX2 and for AVX-512 (VL), where it has 32 vector registers.
template <int G>
__attribute__((target("avx2"))) void encode_avx2(EncBlock* const* bs, const uint64_t* tab0, uint16_t* words0,
                                                 uint32_t rounds) {
  encode_rounds<G>(bs, tab0, words0, rounds);
}

template <int G>
__attribute__((target("avx2,avx512f,avx512vl"))) void encode_avx512(EncBlock* const* bs, const uint64_t* tab0,
                                                                    uint16_t* words0, uint32_t rounds) {
  encode_rounds<G>(bs, tab0, words0, rounds);
}

// Code the planned blocks bs[0:count) (each with more than one symbol, block g's words at words0 +
// BLOCK_WORDS g) to their starts with the vector code of `level` (1: AVX2, 2: AVX-512): tails first,
// then the rounds the blocks have in common in step, then each block's own rest.
void encode_group(EncBlock* const* bs, int count, uint64_t* tab0, uint16_t* words0, int level) {
  for (int g = 0; g < count; ++g) {
    fill_entries(*bs[g], tab0 + 256 * g);
    code_tail(*bs[g], tab0 + 256 * g);
  }
  uint32_t common = ~0u;
  for (int g = 0; g < count; ++g) common = bs[g]->left < common ? bs[g]->left : common;
  common /= STATES;
  auto run = [&](auto fn4, auto fn3, auto fn2, auto fn1) {
    switch (count) {
      case 4: fn4(bs, tab0, words0, common); break;
      case 3: fn3(bs, tab0, words0, common); break;
      case 2: fn2(bs, tab0, words0, common); break;
      default: break;
    }
    for (int g = 0; g < count; ++g)  // a shorter block: the rest alone
      fn1(bs + g, tab0 + 256 * g, words0 + BLOCK_WORDS * g, bs[g]->left / STATES);
  };
  if (level == 2)
    run(encode_avx512<4>, encode_avx512<3>, encode_avx512<2>, encode_avx512<1>);
  else
    run(encode_avx2<4>, encode_avx2<3>, encode_avx2<2>, encode_avx2<1>);
}

// The section's blocks after its two header bytes, ENC_GROUP blocks at a time; returns the bytes written.
size_t encode_vector(const uint8_t* src, uint64_t n, uint8_t* out, int level) {
  const uint32_t block = 1u << BLOCK_LOG;
  std::vector<uint16_t> words(size_t(BLOCK_WORDS) * ENC_GROUP);
  std::vector<uint64_t> tabs(256 * ENC_GROUP);
  EncBlock blocks[ENC_GROUP];
  size_t pos = 0;
  for (uint64_t i = 0; i < n; i += uint64_t(block) * ENC_GROUP) {
    EncBlock* coded[ENC_GROUP];
    int count = 0, planned = 0;
    for (; planned < ENC_GROUP && i + uint64_t(planned) * block < n; ++planned) {
      const uint64_t at = i + uint64_t(planned) * block;
      EncBlock& b = blocks[planned];
      // the coded blocks take the first slots in order (a block of one symbol writes no words)
      plan_block(b, src + at, uint32_t(n - at < block ? n - at : block), words.data() + size_t(BLOCK_WORDS) * count,
                 stream_room(block));
      if (b.present > 1) coded[count++] = &b;
    }
    if (count) encode_group(coded, count, tabs.data(), words.data(), level);
    for (int g = 0; g < planned; ++g) pos += write_block(blocks[g], out + pos);
  }
  return pos;
}

#endif

// A coded block's bytes: length, count, table, states and word counts exactly; its words from the
// symbols' information (`bits`, in 1/65536 bits) less the ~4 words its final states keep.
uint64_t estimate_block(int present, uint64_t bits) {
  const uint64_t words = (bits + (uint64_t(16) << 16) - 1) / (uint64_t(16) << 16);
  return 4 + 1 + 3 * uint64_t(present) + 6 * STATES + 2 * (words > 4 ? words - 4 : 0);
}

}  // namespace

extern "C" {

// Bytes a section of n symbols may take at most (the caller's buffer for ckpt_rans_encode).
uint64_t ckpt_rans_bound(uint64_t n) {
  const uint64_t blocks = (n + (1u << BLOCK_LOG) - 1) >> BLOCK_LOG;
  return 2 + blocks * (4 + 1 + 3 * 256 + 6 * STATES) + 2 * n;
}

// Encode n bytes with the best vector encoder the CPU has up to level `simd` (0: the scalar one, the
// reference; 1: AVX2; 2: AVX-512): the same bytes at every level. Returns the section's length, or -1
// when `cap` is below ckpt_rans_bound(n).
int64_t ckpt_rans_encode(const uint8_t* src, uint64_t n, uint8_t* out, uint64_t cap, int simd) {
  if (cap < ckpt_rans_bound(n)) return -1;
  out[0] = FORMAT;
  out[1] = BLOCK_LOG;
  size_t pos = 2;
#ifdef CKPT_RANS_ENC_AVX2
  const int best = ckpt_rans_simd();
  const int level = simd < best ? (simd > 0 ? simd : 0) : best;
  if (level) return int64_t(pos + encode_vector(src, n, out + pos, level));
#else
  (void)simd;
#endif
  std::vector<uint16_t> words;
  for (uint64_t i = 0; i < n; i += 1u << BLOCK_LOG) {
    const uint32_t len = uint32_t(n - i < (1u << BLOCK_LOG) ? n - i : (1u << BLOCK_LOG));
    pos += encode_block(src + i, len, out + pos, words);
  }
  return int64_t(pos);
}

// About the bytes ckpt_rans_encode would write for n bytes, without coding them (auto's trials compare
// sizes only): per block the exact header and table, and the coded words from the symbols' costs,
// cost[f] being -log2(f / SCALE) in 1/65536 bits for each frequency f (1..SCALE; made by
// ckpt/format/rans.py, which computes the same sum without the core: the same result on every machine).
// A block of one symbol is exact (6 bytes), so a section of such blocks only is recognised by its size.
uint64_t ckpt_rans_estimate(const uint8_t* src, uint64_t n, const uint32_t* cost) {
  uint64_t total = 2;
  uint32_t count[256], f[256];
  for (uint64_t i = 0; i < n; i += 1u << BLOCK_LOG) {
    const uint32_t len = uint32_t(n - i < (1u << BLOCK_LOG) ? n - i : (1u << BLOCK_LOG));
    count_block(src + i, len, count);
    normalize(count, len, f);
    uint64_t bits = 0;  // in 1/65536 bits
    int present = 0;
    for (int s = 0; s < 256; ++s) {
      if (!f[s]) continue;
      ++present;
      bits += uint64_t(count[s]) * cost[f[s]];
    }
    total += present == 1 ? 6 : estimate_block(present, bits);
  }
  return total;
}

}  // extern "C"
