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
// The encoders are in rans_encode.cpp. The decoders give the same bytes and the same verdicts: the scalar one (everywhere, and the
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
#include "rans.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace {

using namespace ckpt_rans;

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
  // the AVX-512 build is AVX2 code too: a hypervisor may hide AVX2 while showing AVX-512, so ask for both
  static const int avx2 = __builtin_cpu_supports("avx2");
  static const int level = avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") ? 2
                           : avx2                                                                           ? 1
                                                                                                            : 0;
  return level;
#else
  return 0;
#endif
}

}  // namespace

namespace ckpt_rans {

int Section::open(const uint8_t* in, uint64_t len, uint64_t symbols, int simd, uint32_t* shared) {
  if (len < 2 || in[0] != FORMAT || in[1] < 8 || in[1] > 16) return 2;
  block = 1ull << in[1];
  p = in + 2;
  end = in + len;
  n = symbols;
  level = simd < cpu_level() ? (simd > 0 ? simd : 0) : cpu_level();
  tables = shared;
  return 0;
}

int Section::run(uint64_t upto, uint8_t* out, uint64_t origin) {
  const int group = level ? GROUP : 1;
  Block bs[GROUP];
  int count = 0;
  uniform = -2;  // no block yet
  for (; i < n && i < upto; i += block) {
    const uint64_t m = n - i < block ? n - i : block;
    bool coded = false;
    if (int err = open_block(p, end, out + (i - origin), m, tables + size_t(SCALE) * count, bs[count], &coded))
      return err;
    const int one = coded ? -1 : out[i - origin];
    uniform = uniform == -2 || uniform == one ? one : -1;
    if (coded && ++count == group) {
      if (run_group(bs, count, end, level)) return 3;
      count = 0;
    }
  }
  return run_group(bs, count, end, level) ? 3 : 0;
}

int Section::skip(uint64_t upto) {
  for (; i < n && i < upto; i += block) {
    if (end - p < 4) return 1;
    const uint64_t size = get32(p);
    p += 4;
    if (uint64_t(end - p) < size) return 1;
    p += size;
  }
  return 0;
}

}  // namespace ckpt_rans

extern "C" {

// Decode a section of `len` bytes into exactly n bytes at `out`, with the best vector decoder the CPU
// has up to level `simd` (0: the scalar one, which gives the same bytes and verdicts; 1: AVX2; 2:
// AVX-512). Returns 0, or 1
// (truncated), 2 (a damaged table or header), 3 (states or words that do not add up: damaged).
int ckpt_rans_decode(const uint8_t* in, uint64_t len, uint8_t* out, uint64_t n, int simd) {
  Section sec;
  std::vector<uint32_t> tables(size_t(SCALE) * GROUP);
  if (int err = sec.open(in, len, n, simd, tables.data())) return err;
  if (int err = sec.run(n, out, 0)) return err;
  return sec.close();
}

// The best vector decoder ckpt_rans_decode runs here: 2 (AVX-512), 1 (AVX2) or 0 (scalar only).
int ckpt_rans_simd() { return cpu_level(); }

}  // extern "C"
