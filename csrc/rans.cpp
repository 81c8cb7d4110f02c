// Entropy coding of byte planes (ckpt/format/rans.py has the format and a numpy decoder that reads
// the same bytes): order-0 rANS in blocks of 2^BLOCK_LOG symbols, each block with its own frequency
// table, so a chunk that spans several tensors (weights, then Adam's second moments) adapts to each.
//
// Section:  u8 format (1), u8 log2 of the block length, then every block in order:
//   u32 length of the rest of the block, u8 (symbols present - 1), per present symbol in increasing
//   order: u8 symbol and, when more than one is present, u16 frequency (12-bit scale, sum 4096);
//   then, when more than one is present: eight u32 final states, eight u16 word counts and the eight
//   streams of 16-bit words, each in the order the decoder reads it. A block with one symbol present is that symbol repeated (no states, no words).
// Symbol i of a block is coded by state i % 8, which reads its own stream: eight dependency chains
// that never wait on each other (a lookup, multiply and add take ~10 cycles; eight in flight keep the
// core busy); all little-endian. The decoder never reads or writes outside the section and the
// output, and refuses a block whose states do not return to their start or whose words are not all
// used. That catches most damage, not all (a flipped word can still decode to other bytes of the
// right length): the chunk's hash, checked after decoding, is what guarantees the bytes.
//
// The encoders write the same bytes: the scalar one (everywhere, and the reference) and, on x86 CPUs
// with AVX2, one that steps a block's eight states as the lanes of a vector, four blocks at a time
// (encode_rounds). The decoders give the same bytes and the same verdicts: the scalar one (everywhere, and the
// reference) and, on x86 CPUs with AVX2, one that steps a block's eight states as the lanes of a
// vector, four blocks at a time (vector_rounds; 1.8x the scalar one on Zen 4, 1.9x compiled for
// AVX-512, which gives it twice the registers).
//
// Called through ctypes, which releases the GIL. Everything is integer arithmetic: the same input gives
// the same bytes on every machine.

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

#include "core.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace {

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

// Count the block's symbols and derive its frequencies; the states start at LOW.
void plan_block(EncBlock& b, const uint8_t* src, uint32_t n, uint16_t* words, uint32_t room) {
  b.src = src;
  b.left = n;
  b.words = words;
  b.room = room;
  uint32_t count[256];
  if (one_symbol(src, n)) {
    memset(count, 0, sizeof count);
    count[src[0]] = n;
  } else {
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
// put together: gathers are slower, see gather8) as two vectors of four, whose low halves are what
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

// A block's decoding table: per 12-bit slot, the symbol (bits 0-7), its frequency (8-19) and the
// slot's offset within the symbol's range (20-31).
int read_table(const uint8_t*& p, const uint8_t* end, uint32_t* table, int* single) {
  if (p >= end) return 1;
  const int present = int(*p++) + 1;
  if (present == 1) {
    if (p >= end) return 1;
    *single = *p++;
    return 0;
  }
  *single = -1;
  if (end - p < 3 * present) return 1;
  uint32_t c = 0;
  int last = -1;
  for (int k = 0; k < present; ++k, p += 3) {
    const int s = p[0];
    const uint32_t fs = get16(p + 1);
    if (s <= last || fs == 0 || c + fs > SCALE) return 2;
    last = s;
    for (uint32_t j = 0; j < fs; ++j) table[c + j] = uint32_t(s) | fs << 8 | j << 20;
    c += fs;
  }
  return c == SCALE ? 0 : 2;
}

// A coded block being decoded: its table, states, where each stream is read and where it ends.
struct Block {
  const uint32_t* t;
  uint32_t x[STATES];
  const uint8_t* q[STATES];
  const uint8_t* e[STATES];
  const uint8_t* streams;  // the first word of stream 0
  uint8_t* out;
  uint64_t m, k;  // symbols in the block, symbols decoded
};

// Parse the block at p (m symbols, for out) and move p past it. A block of one symbol is written at
// once (*coded false); a coded one is set up in b with its table built in `table`. Returns 0 or the
// section's error code.
int open_block(const uint8_t*& p, const uint8_t* end, uint8_t* out, uint64_t m, uint32_t* table, Block& b,
               bool* coded) {
  if (end - p < 4) return 1;
  const uint64_t size = get32(p);
  p += 4;
  if (uint64_t(end - p) < size) return 1;
  const uint8_t* const stop = p + size;
  int single = -1;
  if (int err = read_table(p, stop, table, &single)) return err;
  *coded = single < 0;
  if (single >= 0) {
    if (p != stop) return 3;
    memset(out, single, m);
    return 0;
  }
  if (stop - p < 6 * STATES) return 1;
  const uint8_t* streams = p + 6 * STATES;
  b.t = table;
  b.streams = streams;
  b.out = out;
  b.m = m;
  b.k = 0;
  for (int j = 0; j < STATES; ++j) {
    b.x[j] = get32(p + 4 * j);
    if (b.x[j] < LOW) return 3;
    const uint64_t words = get16(p + 4 * STATES + 2 * j);
    if (uint64_t(stop - streams) < 2 * words) return 1;
    b.q[j] = streams;
    b.e[j] = streams += 2 * words;
  }
  if (streams != stop) return 3;
  p = stop;
  return 0;
}

// Whole rounds of eight symbols while every stream's next reads stay below `limit` (the end of the
// section: a damaged stream that reads into its neighbour's words, or the next block's, is caught
// at the end). One symbol: look up its slot, step the state back, and take a word from its own stream
// when the state fell below LOW; branch-free by arithmetic (the take is unpredictable, and compilers
// turn a conditional expression into a jump). The word is read before it is known to be needed.
void run_scalar(Block& b, const uint8_t* limit) {
  const uint32_t* __restrict__ t = b.t;
  uint8_t* __restrict__ ob = b.out;  // stores through a byte pointer may alias anything: promise they do not
#define CKPT_RANS_STEP(j, k)                                         \
  do {                                                               \
    uint32_t x = x##j;                                               \
    const uint32_t e = t[x & (SCALE - 1)];                           \
    ob[k] = uint8_t(e);                                              \
    x = ((e >> 8) & 0xFFF) * (x >> SCALE_BITS) + (e >> 20);          \
    const uint32_t take = x < LOW;                                   \
    const uint32_t word = get16(q##j);                               \
    x##j = (x << (take << 4)) | (word & (0u - take));                \
    q##j += take << 1;                                               \
  } while (0)
  uint64_t k = b.k;
  uint32_t x0 = b.x[0], x1 = b.x[1], x2 = b.x[2], x3 = b.x[3], x4 = b.x[4], x5 = b.x[5], x6 = b.x[6], x7 = b.x[7];
  const uint8_t *q0 = b.q[0], *q1 = b.q[1], *q2 = b.q[2], *q3 = b.q[3], *q4 = b.q[4], *q5 = b.q[5], *q6 = b.q[6],
                *q7 = b.q[7];
  for (;;) {
    const uint64_t rounds = (b.m - k) / STATES;
    const uint8_t* hi = q0;
    for (const uint8_t* c : {q1, q2, q3, q4, q5, q6, q7}) hi = c > hi ? c : hi;
    const uint64_t safe = hi < limit ? uint64_t(limit - hi) / 2 : 0;  // rounds every stream can take a word in
    uint64_t r = rounds < safe ? rounds : safe;
    if (!r) break;
    for (; r; --r, k += STATES) {
      CKPT_RANS_STEP(0, k);
      CKPT_RANS_STEP(1, k + 1);
      CKPT_RANS_STEP(2, k + 2);
      CKPT_RANS_STEP(3, k + 3);
      CKPT_RANS_STEP(4, k + 4);
      CKPT_RANS_STEP(5, k + 5);
      CKPT_RANS_STEP(6, k + 6);
      CKPT_RANS_STEP(7, k + 7);
    }
  }
#undef CKPT_RANS_STEP
  b.k = k;
  b.x[0] = x0, b.x[1] = x1, b.x[2] = x2, b.x[3] = x3, b.x[4] = x4, b.x[5] = x5, b.x[6] = x6, b.x[7] = x7;
  b.q[0] = q0, b.q[1] = q1, b.q[2] = q2, b.q[3] = q3, b.q[4] = q4, b.q[5] = q5, b.q[6] = q6, b.q[7] = q7;
}

// The rest of a block, every read checked, then the end check: 0, or 3 (damaged).
int finish(Block& b) {
  const uint32_t* t = b.t;
  for (uint64_t k = b.k; k < b.m; ++k) {
    const int j = int(k % STATES);
    uint32_t x = b.x[j];
    const uint32_t e = t[x & (SCALE - 1)];
    b.out[k] = uint8_t(e);
    x = ((e >> 8) & 0xFFF) * (x >> SCALE_BITS) + (e >> 20);
    if (x < LOW) {
      if (b.e[j] - b.q[j] < 2) return 3;
      x = x << 16 | get16(b.q[j]);
      b.q[j] += 2;
    }
    b.x[j] = x;
  }
  b.k = b.m;
  for (int j = 0; j < STATES; ++j)
    if (b.q[j] != b.e[j] || b.x[j] != LOW) return 3;
  return 0;
}

#if defined(__x86_64__) || defined(__i386__)
#define CKPT_RANS_AVX2 1

// Eight 32-bit loads at base + SCALE_BYTES * idx[lane], as scalar loads put together: a vpgatherdd
// of eight lanes took 2.7 ns on this Zen 4, and the decoder ran 1.5x slower with it (3.6 against 2.4
// ms on a 4 MiB plane); Intel's gathers are slow too since the Gather Data Sampling fix.
template <int SCALE_BYTES>
__attribute__((target("avx2"), always_inline)) inline __m256i gather8(const uint8_t* base, __m256i idx) {
  alignas(32) int32_t i[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(i), idx);
  auto at = [&](int l) {
    int32_t v;
    memcpy(&v, base + int64_t(i[l]) * SCALE_BYTES, 4);
    return v;
  };
  __m128i lo = _mm_cvtsi32_si128(at(0)), hi = _mm_cvtsi32_si128(at(4));
  lo = _mm_insert_epi32(lo, at(1), 1);
  hi = _mm_insert_epi32(hi, at(5), 1);
  lo = _mm_insert_epi32(lo, at(2), 2);
  hi = _mm_insert_epi32(hi, at(6), 2);
  lo = _mm_insert_epi32(lo, at(3), 3);
  hi = _mm_insert_epi32(hi, at(7), 3);
  return _mm256_inserti128_si256(_mm256_castsi128_si256(lo), hi, 1);
}

// The eight states of a block are the eight 32-bit lanes of one vector, and G blocks are decoded in
// step (a block's rounds form one dependency chain, ~40 cycles a round; several chains keep the core
// busy). Per round: look up each lane's slot, step the states; a lane whose state fell below LOW takes
// the next word of its own stream from `buf`, which holds the next two words of every lane's stream.
// A lane takes at most one word a round, so refilling buf every second round (32 bits at each lane's
// read position) is enough. The refill reads 4 bytes at a lane's position whether or not it will use
// them, so a run of rounds stays where every lane's refills end below `limit`. Four rounds (32
// symbols) at a time, their bytes collected into one 32-byte store.
template <int G>
__attribute__((target("avx2"), always_inline)) inline void vector_rounds(Block* bs, const uint8_t* limit) {
  const __m256i slot_mask = _mm256_set1_epi32(SCALE - 1), freq_mask = _mm256_set1_epi32(0xFFF);
  const __m256i low16 = _mm256_set1_epi32(0xFFFF), zero = _mm256_setzero_si256();
  // each lane's low byte (its symbol) to bytes 0-3 of its 128-bit half; four rounds shift in behind
  const __m256i pick = _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                        0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  // the halves' dwords in symbol order
  __m256i x[G], idx[G];
  const uint8_t* tab[G];
  for (int g = 0; g < G; ++g) {
    x[g] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bs[g].x));
    alignas(32) int32_t w[STATES];
    for (int j = 0; j < STATES; ++j) w[j] = int32_t((bs[g].q[j] - bs[g].streams) / 2);
    idx[g] = _mm256_load_si256(reinterpret_cast<const __m256i*>(w));
    tab[g] = reinterpret_cast<const uint8_t*>(bs[g].t);
  }
  for (;;) {
    uint64_t r = ~uint64_t(0);
    for (int g = 0; g < G; ++g) {
      const uint64_t rounds = (bs[g].m - bs[g].k) / STATES;
      alignas(32) int32_t w[STATES];
      _mm256_store_si256(reinterpret_cast<__m256i*>(w), idx[g]);
      int32_t hi = w[0];
      for (int j = 1; j < STATES; ++j) hi = w[j] > hi ? w[j] : hi;
      const uint8_t* at = bs[g].streams + 2 * int64_t(hi) + 4;  // the end of the furthest refill now
      const uint64_t safe = at <= limit ? uint64_t(limit - at) / 2 : 0;  // r rounds move it by 2r bytes at most
      r = rounds < r ? rounds : r;
      r = safe < r ? safe : r;
    }
    r &= ~uint64_t(3);
    if (!r) break;
    for (; r; r -= 4) {
      __m256i acc[G];
      for (int g = 0; g < G; ++g) acc[g] = zero;
      for (int h = 0; h < 2; ++h) {
        __m256i buf[G];
        for (int g = 0; g < G; ++g) buf[g] = gather8<2>(bs[g].streams, idx[g]);
        for (int i = 0; i < 2; ++i) {
          for (int g = 0; g < G; ++g) {
            const __m256i e = gather8<4>(tab[g], _mm256_and_si256(x[g], slot_mask));
            const __m256i sym = _mm256_shuffle_epi8(e, pick);
            acc[g] = _mm256_alignr_epi8(sym, acc[g], 4);
            const __m256i f = _mm256_and_si256(_mm256_srli_epi32(e, 8), freq_mask);
            const __m256i v = _mm256_add_epi32(_mm256_mullo_epi32(f, _mm256_srli_epi32(x[g], SCALE_BITS)),
                                               _mm256_srli_epi32(e, 20));
            const __m256i take = _mm256_cmpeq_epi32(_mm256_srli_epi32(v, 16), zero);
            x[g] = _mm256_blendv_epi8(v, _mm256_or_si256(_mm256_slli_epi32(v, 16), _mm256_and_si256(buf[g], low16)),
                                      take);
            buf[g] = _mm256_blendv_epi8(buf[g], _mm256_srli_epi32(buf[g], 16), take);
            idx[g] = _mm256_sub_epi32(idx[g], take);
          }
        }
      }
      for (int g = 0; g < G; ++g) {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(bs[g].out + bs[g].k), _mm256_permutevar8x32_epi32(acc[g], order));
        bs[g].k += 4 * STATES;
      }
    }
  }
  for (int g = 0; g < G; ++g) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(bs[g].x), x[g]);
    alignas(32) int32_t w[STATES];
    _mm256_store_si256(reinterpret_cast<__m256i*>(w), idx[g]);
    for (int j = 0; j < STATES; ++j) bs[g].q[j] = bs[g].streams + 2 * int64_t(w[j]);
  }
}

// The same code for AVX2, and for CPUs with AVX-512 (VL), where the compiler has 32 vector
// registers instead of 16: four blocks' states, positions and bytes no longer spill (12% faster).
template <int G>
__attribute__((target("avx2"))) void run_avx2(Block* bs, const uint8_t* limit) {
  vector_rounds<G>(bs, limit);
}

template <int G>
__attribute__((target("avx2,avx512f,avx512vl"))) void run_avx512(Block* bs, const uint8_t* limit) {
  vector_rounds<G>(bs, limit);
}

#endif

// Blocks the vector decoders step together. Measured on Zen 4, of 2 to 8: 4 (more chains in flight
// than that, and their tables, 16 KiB each, no longer stay in the L1 cache).
constexpr int GROUP = 4;

// Decode the opened blocks bs[0:count) to their ends with the vector code of `level` (0: none, 1:
// AVX2, 2: AVX-512), then the scalar code: 0, or 3 (damaged).
int run_group(Block* bs, int count, const uint8_t* limit, int level) {
#ifdef CKPT_RANS_AVX2
  if (level == 2) {
    switch (count) {
      case 4: run_avx512<4>(bs, limit); break;
      case 3: run_avx512<3>(bs, limit); break;
      case 2: run_avx512<2>(bs, limit); break;
      default: break;
    }
    for (int g = 0; g < count; ++g) run_avx512<1>(bs + g, limit);  // a shorter block, or one stopped by another
  } else if (level == 1) {
    switch (count) {
      case 4: run_avx2<4>(bs, limit); break;
      case 3: run_avx2<3>(bs, limit); break;
      case 2: run_avx2<2>(bs, limit); break;
      default: break;
    }
    for (int g = 0; g < count; ++g) run_avx2<1>(bs + g, limit);
  }
#else
  (void)level;
#endif
  for (int g = 0; g < count; ++g) {
    run_scalar(bs[g], limit);
    if (finish(bs[g])) return 3;
  }
  return 0;
}

// The best vector code this CPU runs: 2 (AVX-512 F and VL), 1 (AVX2) or 0.
int cpu_level() {
#ifdef CKPT_RANS_AVX2
  static const int level = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") ? 2
                           : __builtin_cpu_supports("avx2")                                          ? 1
                                                                                                     : 0;
  return level;
#else
  return 0;
#endif
}

// A section being decoded a run of blocks at a time (ckpt_planes_decode interleaves each run while
// it is in cache; ckpt_rans_decode takes all of it at once).
struct Section {
  const uint8_t* p = nullptr;
  const uint8_t* end = nullptr;
  uint64_t block = 0, n = 0, i = 0;  // block length, symbols, the first symbol not decoded
  int level = 0;
  std::vector<uint32_t> tables;

  // 0, or 2 (a damaged header)
  int open(const uint8_t* in, uint64_t len, uint64_t symbols, int simd) {
    if (len < 2 || in[0] != FORMAT || in[1] < 8 || in[1] > 16) return 2;
    block = 1ull << in[1];
    p = in + 2;
    end = in + len;
    n = symbols;
    level = simd < cpu_level() ? (simd > 0 ? simd : 0) : cpu_level();
    tables.resize(size_t(SCALE) * (level ? GROUP : 1));
    return 0;
  }

  // Decode the blocks that start before `upto`, symbol k to out[k - origin]: 0 or an error code.
  int run(uint64_t upto, uint8_t* out, uint64_t origin) {
    const int group = level ? GROUP : 1;
    Block bs[GROUP];
    int count = 0;
    for (; i < n && i < upto; i += block) {
      const uint64_t m = n - i < block ? n - i : block;
      bool coded = false;
      if (int err = open_block(p, end, out + (i - origin), m, tables.data() + size_t(SCALE) * count, bs[count],
                               &coded))
        return err;
      if (coded && ++count == group) {
        if (run_group(bs, count, end, level)) return 3;
        count = 0;
      }
    }
    return run_group(bs, count, end, level) ? 3 : 0;
  }

  int close() const { return p == end ? 0 : 3; }  // every block used, nothing after them
};

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
  const int level = simd < cpu_level() ? (simd > 0 ? simd : 0) : cpu_level();
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

// Decode a section of `len` bytes into exactly n bytes at `out`, with the best vector decoder the CPU
// has up to level `simd` (0: the scalar one, which gives the same bytes and verdicts; 1: AVX2; 2:
// AVX-512). Returns 0, or 1
// (truncated), 2 (a damaged table or header), 3 (states or words that do not add up: damaged).
int ckpt_rans_decode(const uint8_t* in, uint64_t len, uint8_t* out, uint64_t n, int simd) {
  Section sec;
  if (int err = sec.open(in, len, n, simd)) return err;
  if (int err = sec.run(n, out, 0)) return err;
  return sec.close();
}

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
  hash[2] = 0;
  if (w < 1 || w > 16 || (rot && w != 2 && w != 4 && w != 8)) return 4;
  const uint64_t m = n / w;
  Section secs[16];
  uint64_t tile = 1 << 16;  // elements: a multiple of every block length, 4 blocks of the encoder's
  for (int k = 0; k < w; ++k) {
    if (!coded[k]) continue;
    if (int err = secs[k].open(src[k], len[k], m, simd)) return err;
    tile = secs[k].block * GROUP > tile ? secs[k].block * GROUP : tile;
  }
  std::vector<uint8_t> buf;
  int ncoded = 0;
  for (int k = 0; k < w; ++k) ncoded += coded[k] != 0;
  buf.resize(size_t(ncoded) * tile);
  const bool hashing = n > 240;
  ckpt_core::Hash128 h;
  if (hashing) ckpt_core::hash_start(h, n);
  uint64_t hashed_to = 0;
  const uint8_t* planes[16];
  for (uint64_t j0 = 0; j0 < m || j0 == 0; j0 += tile) {
    const uint64_t j1 = m - j0 < tile ? m : j0 + tile;
    for (int k = 0, c = 0; k < w; ++k) {
      if (!coded[k]) {
        planes[k] = src[k] + j0;
        continue;
      }
      uint8_t* dst = buf.data() + size_t(c++) * tile;
      if (int err = secs[k].run(j1, dst, j0)) return err;
      planes[k] = dst;
    }
    const bool last = j1 == m;
    const uint64_t bytes = (j1 - j0) * w + (last ? n - m * w : 0);
    if (ckpt_ungroup_planes(planes, tail, base ? base + j0 * w : nullptr, bytes, w, rot, out + j0 * w)) return 4;
    if (hashing) {  // the whole blocks written so far, from where the last tile stopped
      const uint64_t upto = (j0 * w + bytes) / ckpt_core::HASH_BLOCK * ckpt_core::HASH_BLOCK;
      if (upto > hashed_to) {
        ckpt_core::hash_blocks(h, out + hashed_to, (upto - hashed_to) / ckpt_core::HASH_BLOCK);
        hashed_to = upto;
      }
    }
    if (last) break;
  }
  for (int k = 0; k < w; ++k)
    if (coded[k])
      if (int err = secs[k].close()) return err;
  if (hashing) {
    ckpt_core::hash_finish(h, out, hash);
    hash[2] = 1;
  }
  return 0;
}

// The best vector decoder ckpt_rans_decode runs here: 2 (AVX-512), 1 (AVX2) or 0 (scalar only).
int ckpt_rans_simd() { return cpu_level(); }

}  // extern "C"
