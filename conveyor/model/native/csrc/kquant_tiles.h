// The super-block formats (Q4_K, Q5_K, Q6_K, IQ4_XS, Q3_K, Q2_K) at the file's own size: 256-weight super-blocks
// with their packed sub-block scales, repacked for 16 output rows at a time, and the micro-kernels that unpack
// codes and scales in registers. Decoding them into quant_tiles.h's uniform form instead (a float32 scale and min
// per group) would store Q4_K at 6.0 bits a weight where the file has 4.5, and Q6_K at 10 where it has 6.56; a
// decode step reads every stored byte, so that is its speed.
//
// Layout (conveyor/model/quant/k_quants.py packs it): per tile of 16 outputs and per super-block of 256 inputs, one
// block of bytes, the tile's blocks one after another (a tile is one stream), 16 rows of the file's block:
//   the header: each row's float16 d (and dmin), then the sub-block scales, by format:
//     Q4_K, Q5_K (256 bytes)   d[16], dmin[16]; sc_lo[8][8] (sub-block j, byte b: the low 4 bits of row b's scale,
//                              then, high nibble, row b + 8's), m_lo[8][8] the same for the mins, hi[8][8] (the top
//                              2 bits of sc(b), sc(b + 8), m(b), m(b + 8), from bit 0)
//     Q6_K (288)               d[16]; sc[16][16] int8, group x row
//     IQ4_XS, Q3_K (128, 224)  d[16]; the 6-bit scales' low nibbles [groups][8] as sc_lo above, then their top 2 bits
//                              [groups / 2][8]: byte (p, b) holds those of rows b and b + 8 of sub-block 2p at bits
//                              0-1 and 2-3, of sub-block 2p + 1 at 4-5 and 6-7
//     Q2_K (320)               d[16], dmin[16]; [16 groups][16 rows] bytes: the scale's 4 bits, then the min's
//   then the codes in planes: a plane of B bits a code is 64-byte vectors each holding 32 / B inputs of all 16
//   outputs, byte 4c + b's bits [tB, tB + B) being input 4t + b of output c. The low plane (4 bits: quant_tiles.h's
//   nibble tiles; Q3_K, Q2_K: 2) holds the codes' low bits, the high plane (Q5_K, Q3_K: 1 bit; Q6_K: 2) the rest.
// A weight is then
//   Q4_K, Q5_K, Q2_K:  w = d * sc * q - dmin * m        Q6_K:  w = d * sc * (q - 32)
//   Q3_K:              w = d * (sc - 32) * (q - 4)      IQ4_XS:  w = d * (sc - 32) * (level[q] - 128)
// (IQ4_XS's codes index quant_tiles.h's kIq4Levels, IQ4_NL's). The activations are quantized with one step per
// super-block (as llama.cpp's Q8_K), their code sums kept per sub-block: then a row's super-block is integers to
// its end, sum(sc * sum(q * xq)) and sum(m * sum(xq)), and three float operations (k_block_output) where a step
// per sub-block took three a sub-block. Integers add up alike in any order, so every kernel kind, at any number
// of rows, gives the same bits. On a Zen 4 (`kernel_check bench 1024 1024 Q4_K,Q6_K vnni512`, one thread) this
// took Q4_K at 8 rows from 57.6 to 53.9 us and Q6_K from 72 to 62; at one row 12.1 to 11.1-11.5 and 19.5 to 17.9.

#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <utility>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "quant_tiles.h"

namespace conveyor {

// How a quantized weight's bytes are laid out: quant_tiles.h's uniform tiles, or one of the super-block layouts.
enum class QuantLayout : int { kTiles = 0, kQ4K = 1, kQ5K = 2, kQ6K = 3, kIQ4XS = 4, kQ3K = 5, kQ2K = 6 };

// How a layout's header holds its sub-block scales (and mins).
enum class KScales : int {
  kSixBitMins,    // Q4_K, Q5_K: d, dmin, 6-bit scales and mins: d * sc and -(dmin * m)
  kInt8,          // Q6_K: d, int8 scales: d * sc
  kSixBitSigned,  // IQ4_XS, Q3_K: d, 6-bit scales around 32: d * (sc - 32)
  kNibbleMins,    // Q2_K: d, dmin, a byte of 4-bit scale and min: d * sc and -(dmin * m)
};

constexpr int64_t kSuperBlock = 256;  // inputs per super-block

// What a kernel needs to know of a super-block layout, at compile time.
template <QuantLayout L>
struct KFormat {
  using Q = QuantLayout;
  static constexpr QuantLayout kLayout = L;
  static constexpr KScales kScales = L == Q::kQ6K                    ? KScales::kInt8
                                     : L == Q::kIQ4XS || L == Q::kQ3K ? KScales::kSixBitSigned
                                     : L == Q::kQ2K                   ? KScales::kNibbleMins
                                                                      : KScales::kSixBitMins;
  static constexpr int kGroup = L == Q::kQ6K || L == Q::kQ3K || L == Q::kQ2K ? 16 : 32;  // inputs per sub-block
  static constexpr int kGroups = kSuperBlock / kGroup;                                  // sub-blocks per super-block
  static constexpr int kLowBits = L == Q::kQ3K || L == Q::kQ2K ? 2 : 4;
  static constexpr int kHighBits = L == Q::kQ5K || L == Q::kQ3K ? 1 : L == Q::kQ6K ? 2 : 0;
  static constexpr bool kMins = kScales == KScales::kSixBitMins || kScales == KScales::kNibbleMins;
  static constexpr bool kLevels = L == Q::kIQ4XS;  // the codes index kIq4Levels
  static constexpr int32_t kZero = L == Q::kQ6K ? 32 : L == Q::kQ3K ? 4 : kLevels ? kIq4Zero : 0;  // with no mins
  static constexpr int32_t kLargest = kLevels ? 255 : (1 << (kLowBits + kHighBits)) - 1;  // a code's largest byte
  static constexpr int64_t kScaleBytes = kScales == KScales::kSixBitMins    ? 192
                                         : kScales == KScales::kSixBitSigned ? kGroups * 12
                                                                             : 256;
  static constexpr int64_t kHeader = (kMins ? 64 : 32) + kScaleBytes;  // d (and dmin), then the scales
  static constexpr int64_t kLowBytes = kQuantTile * kSuperBlock * kLowBits / 8;
  static constexpr int64_t kHighBytes = kQuantTile * kSuperBlock * kHighBits / 8;
  static constexpr int64_t kBlockBytes = kHeader + kLowBytes + kHighBytes;
};

// One tile's blocks: `blocks` super-blocks of K::kBlockBytes each.
struct KTileView {
  const uint8_t* data;
  int64_t blocks;
};

// ----- Scalar access: the portable kernel and embedding lookups -----

inline uint16_t load_u16(const uint8_t* p) {
  uint16_t v;
  __builtin_memcpy(&v, p, sizeof v);
  return v;
}

// Sub-block g's 6-bit scale of output c in the IQ4_XS/Q3_K header's scale bytes (after d), as stored (0..63).
template <int Groups>
inline int six_bit_scale(const uint8_t* scales, int g, int c) {
  const int b = c % 8, half = c / 8;
  const int low = (scales[8 * g + b] >> (4 * half)) & 15;
  return low | (((scales[8 * Groups + 8 * (g / 2) + b] >> (4 * (g % 2) + 2 * half)) & 3) << 4);
}

// Sub-block g's integer scale (signed where the format centres it) and min (0 where the format has none) of
// output c: what its float scale and min are d and dmin times.
template <typename K>
inline void k_sub_scale(const uint8_t* block, int g, int c, int32_t* scale, int32_t* min) {
  *min = 0;
  if constexpr (K::kScales == KScales::kInt8) {
    *scale = static_cast<int8_t>(block[32 + 16 * g + c]);
  } else if constexpr (K::kScales == KScales::kSixBitSigned) {
    *scale = six_bit_scale<K::kGroups>(block + 32, g, c) - 32;
  } else if constexpr (K::kScales == KScales::kNibbleMins) {
    const uint8_t byte = block[64 + 16 * g + c];
    *scale = byte & 15;
    *min = byte >> 4;
  } else {
    const int b = c % 8, nibble = 4 * (c / 8);
    const uint8_t hi = block[192 + 8 * g + b];
    *scale = ((block[64 + 8 * g + b] >> nibble) & 15) | (((hi >> (c / 8 * 2)) & 3) << 4);
    *min = ((block[128 + 8 * g + b] >> nibble) & 15) | (((hi >> (4 + c / 8 * 2)) & 3) << 4);
  }
}

// Output c's d, and -dmin (0 where the format has none), as float32.
template <typename K>
inline void k_row_scales(const uint8_t* block, int c, float* d, float* negative_dmin) {
  *d = half_to_float(load_u16(block + 2 * c));
  *negative_dmin = K::kMins ? -half_to_float(load_u16(block + 32 + 2 * c)) : 0.f;
}

// Sub-block g's scale and min (0 where the format has none) of output c, as the uniform form holds them.
template <typename K>
inline void k_scale_min(const uint8_t* block, int g, int c, float* scale, float* min) {
  float d, negative_dmin;
  int32_t sc, m;
  k_row_scales<K>(block, c, &d, &negative_dmin);
  k_sub_scale<K>(block, g, c, &sc, &m);
  *scale = d * static_cast<float>(sc);
  *min = negative_dmin * static_cast<float>(m);  // -(dmin * m) to the bit: -0.0 where m is 0; 0 with no mins
}

// A super-block's integer sums of one row and output added to its output: acc + dx * (d * sums + -dmin * mins),
// in this order, on every kernel kind (the vector kernels' lanes do the same three operations), so that all
// of them, at any number of rows, give the same bits. sums = sum over sub-blocks of sc * sum(code * xq) (less
// the zero point's share), mins = sum over sub-blocks of m * sum(xq): exact integers.
template <bool Mins>
inline float k_block_output(float acc, int32_t sums, int32_t mins, float d, float negative_dmin, float dx) {
  float t = d * static_cast<float>(sums);
  if constexpr (Mins) t = std::fma(negative_dmin, static_cast<float>(mins), t);
  return std::fma(t, dx, acc);
}

// Output c's bits of input j (0..255 of the super-block) in a plane of Bits bits a code.
template <int Bits>
inline int32_t plane_bits(const uint8_t* plane, int c, int j) {
  constexpr int span = 32 / Bits;  // inputs a 64-byte vector holds
  return (plane[(j / span) * 64 + c * 4 + j % 4] >> ((j % span) / 4 * Bits)) & ((1 << Bits) - 1);
}

// The code of output c, input j (0..255) of a block (IQ4_XS: its level).
template <typename K>
inline int32_t k_code(const uint8_t* block, int c, int j) {
  int32_t code = plane_bits<K::kLowBits>(block + K::kHeader, c, j);
  if constexpr (K::kHighBits > 0) {
    code |= plane_bits<K::kHighBits>(block + K::kHeader + K::kLowBytes, c, j) << K::kLowBits;
  }
  if constexpr (K::kLevels) return kIq4Levels[code];
  return code;
}

// Plain C++: any CPU, and the reference for the vector kernels' arithmetic: per super-block, integer sums of the
// codes times the activations, scaled by the sub-block scales in integers, then k_block_output.
template <typename K, int Rows>
void k_tile_portable(const QuantizedRows& x, int64_t row, const KTileView& t, float* y, int64_t ldy, int64_t cols) {
  for (int64_t r = 0; r < Rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      float acc = 0.f;
      for (int64_t b = 0; b < t.blocks; ++b) {
        const uint8_t* block = t.data + b * K::kBlockBytes;
        int32_t sums = 0, mins = 0;
        for (int g = 0; g < K::kGroups; ++g) {
          const int64_t group = b * K::kGroups + g;
          const int8_t* xq = x.q + (row + r) * x.k + group * K::kGroup;
          const int32_t xsum = x.sums[(row + r) * x.groups + group];
          int32_t sum = 0, sc, m;
          for (int i = 0; i < K::kGroup; ++i) sum += k_code<K>(block, static_cast<int>(c), g * K::kGroup + i) * xq[i];
          k_sub_scale<K>(block, g, static_cast<int>(c), &sc, &m);
          sums += sc * (sum - K::kZero * xsum);
          mins += m * xsum;
        }
        float d, negative_dmin;
        k_row_scales<K>(block, static_cast<int>(c), &d, &negative_dmin);
        acc = k_block_output<K::kMins>(acc, sums, mins, d, negative_dmin, x.d[(row + r) * x.spans + b]);
      }
      y[r * ldy + c] = acc;
    }
  }
}

// Asks for bytes further on, group g's share of a block at a time (the whole block's lines asked for at once left
// the stream as slow as not asking). A thread's tiles lie one after another, so "further on" runs into its next
// tiles. At 1 or 2 rows (Stream) the kernel waits on memory, and asks for the block BlocksAhead on, into L1
// (prefetcht0), but where the hardware prefetcher does better alone (kHardwareStream). With more rows the kernel
// computes longer per byte, and there the near requests into L1 cost the 8B-shaped file's decode of 8 requests 7%
// (222 against 208 ms a step): those take 16 KiB ahead into L2.
//
// How far ahead a stream asks depends on the core. On a 2-core Zen 4 (512-bit kernels) 2 blocks ahead was the
// fastest of 2, 3, 4, 6 and 8. On a 2-core Zen 3 (256-bit kernels) 1 block ahead (2,304 bytes of Q4_K, 3,360 of
// Q6_K) beat 2: one request of the 8B-shaped file decoded 1.062x and 1.072x as fast (one process alternating the
// two every 5 steps, 60 turns each), the OLMoE shape's 16 at once 1.011x; bench/kernel_ab at one row, four distinct
// 57,344 x 4,096 weights from memory, 2 threads: Q4_K 26.9 -> 29.5 GB/s, Q6_K 26.9 -> 29.0. Half a block was slower
// for Q6_K (25.4), a quarter slower for both.
constexpr int64_t kBlocksAhead256 = 1;
constexpr int64_t kBlocksAhead512 = 2;
constexpr int64_t kBytesAhead = 16384;

// Whether the 512-bit kernel at 1 or 2 rows leaves a layout to the hardware prefetcher: 4-bit codes in one plane
// (Q4_K, IQ4_XS), read front to back, one stream. Timed on weights streamed from memory (four distinct 57,344 x
// 4,096 weights taking turns, as a decode step's layers do: one weight timed again and again is partly served
// from the host's caches), 2 threads, a 2-core Zen 4, medians of 40-60 turns of each variant in one process:
// Q4_K 52.9-57.6 GB/s without requests against 47.5-49.7 with them, IQ4_XS 49.7 against 48.0. The others ask:
//  - two planes (Q5_K, Q6_K, Q3_K) are two streams the hardware does not follow: Q6_K 20-21 GB/s without
//    requests against 50-51, Q5_K 18-19 against 50. Interleaved in strips, so that a block is one stream, Q6_K
//    went without requests at its old speed, but Q5_K fell to 37.
//  - Q2_K, more arithmetic a byte, was as fast either way (41-45 GB/s).
//  - the 256-bit kernels at 3-4 rows read a tile twice, a half each time: without requests Q2_K fell from 26.8 to
//    22.1. At 1-2 rows (k_stream_tile_256) they read it once, and on a 2-core Zen 3 the requests still paid: Q4_K
//    29.5 GB/s with them against 26.3 without, IQ4_XS 29.8 against 24.8.
template <typename K>
inline constexpr bool kHardwareStream = K::kHighBits == 0 && K::kLowBits == 4;

// Stream: into L1, BlocksAhead blocks on; else into L2, kBytesAhead on.
template <typename K, bool Stream, int64_t BlocksAhead = 0>
inline void k_prefetch_group_ahead(const uint8_t* block, int g) {
  constexpr int64_t share = K::kBlockBytes / K::kGroups;
  constexpr int64_t ahead = Stream ? BlocksAhead * K::kBlockBytes : kBytesAhead;
  static_assert(ahead > 0, "a stream asks at least one block ahead");
#pragma GCC unroll 8
  for (int64_t line = 0; line < share + 63; line += 64) {
    __builtin_prefetch(block + ahead + g * share + line, 0, Stream ? 3 : 2);
  }
}

// Two sub-blocks' activation sums as one int16 pair, for vpdpwssd or vpmaddwd (a broadcast from memory).
inline int32_t sum_pair(const int16_t* sums) {
  int32_t pair;
  std::memcpy(&pair, sums, sizeof(pair));
  return pair;
}

// Where sub-block g's 16 bytes (one a row) lie in the buffer the 512-bit scale unpacking writes: per 8
// sub-blocks 128 bytes, the even ones' rows in the first 64 and the odd ones' in the next (vpunpck[lh]qdq's order).
inline int rows_at(int g) { return 128 * (g / 8) + 64 * (g % 2) + 16 * (g % 8 / 2); }

// Where group g's codes start in a plane of Bits bits a code (a 64-byte vector holds 32 / Bits inputs): the
// group's first vector, and the bit its first input starts at there (0 but where two groups share a vector: Q3_K's
// high plane). Unsigned, so that the divisions are shifts.
template <typename K, int Bits>
struct PlaneAt {
  static constexpr unsigned kSpan = 32 / Bits;  // inputs a vector holds
  static constexpr unsigned kShare = kSpan > K::kGroup ? kSpan / K::kGroup : 1;  // groups a vector holds
  static int64_t vector(unsigned g) { return kSpan > K::kGroup ? g / kShare : g * (K::kGroup / kSpan); }
  static int shift(unsigned g) { return static_cast<int>(g % kShare * (K::kGroup / 4) * Bits); }
};

#if defined(CONVEYOR_AVX2)
// Bits [shift, shift + Bits) of every byte of v moved to bits [To, To + Bits), the others cleared.
template <int To, int Bits>
inline __m256i move_bits_256(__m256i v, int shift) {
  if (shift > To) v = _mm256_srli_epi16(v, shift - To);
  if (shift < To) v = _mm256_slli_epi16(v, To - shift);
  return _mm256_and_si256(v, _mm256_set1_epi8(static_cast<char>(((1 << Bits) - 1) << To)));
}

// The IQ4_XS/Q3_K 6-bit scales of one half of the tile (rows 8 * Half ..) less 32, as int8 [group][8 rows].
template <int Groups, int Half>
inline void six_bit_scales_256(const uint8_t* scales, int8_t* out) {
  const __m256i low = _mm256_set1_epi8(0x0f), top = _mm256_set1_epi8(0x30);
#pragma GCC unroll 4
  for (int part = 0; part < Groups / 4; ++part) {  // sub-blocks 4 * part .. 4 * part + 3: a qword each
    const __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(scales + 32 * part));
    const __m128i pairs = _mm_loadu_si128(reinterpret_cast<const __m128i*>(scales + 8 * Groups + 16 * part));
    const __m256i hi = _mm256_permute4x64_epi64(_mm256_zextsi128_si256(pairs), 0x50);  // each pair's qword twice
    // Each sub-block's top bits for this half moved to bits 4-5: from 0-1 (even) or 4-5 (odd), rows b; from 2-3
    // or 6-7, rows b + 8.
    const __m256i high = Half == 0 ? _mm256_sllv_epi64(hi, _mm256_setr_epi64x(4, 0, 4, 0))
                                   : _mm256_srlv_epi64(_mm256_sllv_epi64(hi, _mm256_setr_epi64x(2, 0, 2, 0)),
                                                       _mm256_setr_epi64x(0, 2, 0, 2));
    const __m256i nibbles = _mm256_and_si256(Half == 0 ? lo : _mm256_srli_epi16(lo, 4), low);
    const __m256i sc = _mm256_sub_epi8(_mm256_or_si256(nibbles, _mm256_and_si256(high, top)), _mm256_set1_epi8(32));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 32 * part), sc);
  }
}

// A block's sub-block scales (and mins) of one half of the tile (outputs 8 * Half ..), unpacked once a block to
// bytes, 8 a group (Q6_K and Q2_K read theirs from the header as they are), and d (and -dmin) as float32. The
// mins' bytes go in pairs of sub-blocks, each output's two side by side, so that widening 16 of them to int16 is
// k_min_pair_256's operand whole.
template <typename K>
struct KScales256 {
  __m256 d, negative_dmin;
  alignas(32) uint8_t sc[K::kScales == KScales::kSixBitSigned ? K::kGroups * 8 : 64];
  alignas(32) uint8_t m[64];
};

template <typename K, int Half>
inline void k_scale_bytes_256(const uint8_t* block, KScales256<K>& out) {
  out.d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 16 * Half)));
  if constexpr (K::kMins) {
    out.negative_dmin = _mm256_sub_ps(
        _mm256_setzero_ps(),
        _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 32 + 16 * Half))));
  }
  if constexpr (K::kScales == KScales::kSixBitSigned) {
    six_bit_scales_256<K::kGroups, Half>(block + 32, reinterpret_cast<int8_t*>(out.sc));
  } else if constexpr (K::kScales == KScales::kSixBitMins) {
    // All 8 sub-blocks' 6-bit values at once, as bytes [sub-block][row of the half]: low nibbles, then top bits.
    const __m256i low = _mm256_set1_epi8(0x0f), top = _mm256_set1_epi8(0x30);
    const auto load = [&](int64_t offset, int part) {
      return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + offset + 32 * part));
    };
    // In each 128-bit lane (two sub-blocks' 8 bytes) the first's and the second's bytes interleaved.
    const __m256i pairs =
        _mm256_broadcastsi128_si256(_mm_setr_epi8(0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15));
#pragma GCC unroll 2
    for (int part = 0; part < 2; ++part) {
      const __m256i hi = load(192, part);
      const __m256i sc_lo = _mm256_and_si256(_mm256_srli_epi16(load(64, part), 4 * Half), low);
      const __m256i m_lo = _mm256_and_si256(_mm256_srli_epi16(load(128, part), 4 * Half), low);
      // sc's top bits at 2 * half, m's at 4 + 2 * half: each moved to bits 4-5
      const __m256i sc_hi = _mm256_and_si256(Half ? _mm256_slli_epi16(hi, 2) : _mm256_slli_epi16(hi, 4), top);
      const __m256i m_hi = _mm256_and_si256(Half ? _mm256_srli_epi16(hi, 2) : hi, top);
      _mm256_store_si256(reinterpret_cast<__m256i*>(out.sc + 32 * part), _mm256_or_si256(sc_lo, sc_hi));
      _mm256_store_si256(reinterpret_cast<__m256i*>(out.m + 32 * part),
                         _mm256_shuffle_epi8(_mm256_or_si256(m_lo, m_hi), pairs));
    }
  }
}

// Sub-block g's integer scales of the half's 8 outputs (k_sub_scale's numbers), one a lane.
template <typename K, int Half>
inline __m256i k_group_scales_256(const uint8_t* block, const KScales256<K>& t, int g) {
  const auto eight = [](const void* p) { return _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)); };
  if constexpr (K::kScales == KScales::kInt8) return _mm256_cvtepi8_epi32(eight(block + 32 + 16 * g + 8 * Half));
  if constexpr (K::kScales == KScales::kSixBitSigned) return _mm256_cvtepi8_epi32(eight(t.sc + 8 * g));
  if constexpr (K::kScales == KScales::kNibbleMins) {
    return _mm256_and_si256(_mm256_cvtepu8_epi32(eight(block + 64 + 16 * g + 8 * Half)), _mm256_set1_epi32(15));
  }
  return _mm256_cvtepu8_epi32(eight(t.sc + 8 * g));
}

// Sub-blocks 2p's and 2p + 1's mins of the half's 8 outputs as int16 pairs, one pair a lane (vpmaddwd's operand):
// 16 bytes, each output's two side by side, widened. Q2_K's are its header's high nibbles, interleaved here.
template <typename K, int Half>
inline __m256i k_min_pair_256(const uint8_t* block, const KScales256<K>& t, int p) {
  if constexpr (K::kScales == KScales::kNibbleMins) {
    const auto eight = [](const void* at) { return _mm_loadl_epi64(reinterpret_cast<const __m128i*>(at)); };
    const __m128i both =
        _mm_unpacklo_epi8(eight(block + 64 + 32 * p + 8 * Half), eight(block + 80 + 32 * p + 8 * Half));
    return _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(both, 4), _mm_set1_epi8(15)));
  } else {
    return _mm256_cvtepu8_epi16(_mm_load_si128(reinterpret_cast<const __m128i*>(t.m + 16 * p)));
  }
}

// Group g's high plane of one half of the tile (Q5_K, Q6_K, Q3_K), shifted to where the group's bits start.
template <typename K, int Half>
inline __m256i k_high_plane_256(const uint8_t* block, int g) {
  using High = PlaneAt<K, K::kHighBits>;
  __m256i high = _mm256_loadu_si256(
      reinterpret_cast<const __m256i*>(block + K::kHeader + K::kLowBytes + High::vector(g) * 64 + 32 * Half));
  if constexpr (High::kShare > 1) high = _mm256_srl_epi16(high, _mm_cvtsi32_si128(High::shift(g)));
  return high;
}

// Operand t of group g of one half of the tile as bytes: inputs 4t .. 4t + 3 of every output, the low plane's bits
// or'ed with the high plane's (k_high_plane_256's, unused without one) above them (IQ4_XS: the codes still, not
// their levels). The shifts are constants where t is (an unrolled loop's).
template <typename K, int Half>
inline __m256i k_operand_256(const uint8_t* block, int g, int t, [[maybe_unused]] __m256i high) {
  using Low = PlaneAt<K, K::kLowBits>;
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(
      block + K::kHeader + (Low::vector(g) + 4 * t / Low::kSpan) * 64 + 32 * Half));
  __m256i operand = move_bits_256<0, K::kLowBits>(v, 4 * t % Low::kSpan / 4 * K::kLowBits);
  if constexpr (K::kHighBits > 0) {
    operand = _mm256_or_si256(operand, move_bits_256<K::kLowBits, K::kHighBits>(high, t * K::kHighBits));
  }
  return operand;
}

// One group's codes of one half of the tile, operand t for inputs 4t .. 4t + 3 (k_operand_256).
template <typename K, int Half>
inline void k_codes_256(const uint8_t* block, int g, __m256i* operand) {
  [[maybe_unused]] __m256i high{};
  if constexpr (K::kHighBits > 0) high = k_high_plane_256<K, Half>(block, g);
#pragma GCC unroll 8
  for (int t = 0; t < K::kGroup / 4; ++t) operand[t] = k_operand_256<K, Half>(block, g, t, high);
}

// u8 codes of 4 inputs . s8 activations, pairs summed to int16 (vpmaddubsw) or, with VNNI, fours to int32.
template <bool Vnni>
inline __m256i k_dot(__m256i acc, __m256i codes, __m256i x) {
  if constexpr (Vnni) return dot4x8<true>(acc, codes, x);
  return _mm256_add_epi16(acc, _mm256_maddubs_epi16(codes, x));
}

// Whether k_group_sums_256's sums come centred already: IQ4_XS's levels less 128 without VNNI (as magnitudes and
// signs), which the zero point then leaves alone.
template <typename K, bool Vnni>
inline constexpr bool kCentredSums = K::kLevels && !Vnni;

// Without VNNI: how many vpmaddubsw results an int16 lane holds before a vpmaddwd widens them (Q4_K: all 8 of a
// group; Q5_K: 4; Q6_K: 2; IQ4_XS's signed levels: 1); with VNNI the sums are int32 from the start.
template <typename K, bool Vnni>
inline constexpr int kPerWiden =
    Vnni ? K::kGroup / 4 : std::min(K::kGroup / 4, 32767 / (2 * (kCentredSums<K, Vnni> ? 127 : K::kLargest) * 127));

// Whether the half tile's rows run k_row_sums_asm: without VNNI, the layouts with no zero point to take off a group's
// sums (Q4_K, Q5_K, Q2_K). The vpmaddwd that widens the int16 sums multiplies them by the sub-block scales too (an
// int16 pair a lane), where vpmaddwd by ones and then vpmulld took two instructions of the two multiply pipes. The
// same int32 sums: widened, a lane is at most 2 * 4 * 2 * 31 * 127 * 63 (Q5_K), and a group's at most twice that.
template <typename K, bool Vnni>
inline constexpr bool kAsmRows = !Vnni && K::kZero == 0 && !kCentredSums<K, Vnni>;

// Product t (activations at + 0..3 against operand t) into register reg, or added to it through tmp.
#define K_ASM_FIRST(reg, t, at) \
  "vpbroadcastd " #at "(%[x]), %t[" #reg "]\n\tvpmaddubsw %t[" #reg "], %t[o" #t "], %t[" #reg "]\n\t"
#define K_ASM_NEXT(reg, t, at)                                                           \
  "vpbroadcastd " #at "(%[x]), %t[tmp]\n\tvpmaddubsw %t[tmp], %t[o" #t "], %t[tmp]\n\t" \
  "vpaddw %t[tmp], %t[" #reg "], %t[" #reg "]\n\t"
#define K_ASM_WIDEN "vpmaddwd %t[w], %t[part], %t[dot]\n\t"
#define K_ASM_WIDEN_ADD "vpmaddwd %t[w], %t[part], %t[part]\n\tvpaddd %t[part], %t[dot], %t[dot]\n\t"
#define K_ASM_OUT [dot] "=&x"(dot), [part] "=&x"(part), [part2] "=&x"(part2), [tmp] "=&x"(tmp)
#define K_ASM_IN(ops)                                                                                          \
  [x] "r"(xq), "m"(*reinterpret_cast<const int8_t(*)[4 * (ops)]>(xq)), [w] "x"(widen), [o0] "x"(operand[0]), \
      [o1] "x"(operand[1]), [o2] "x"(operand[2]), [o3] "x"(operand[3])
#define K_ASM_IN_8 K_ASM_IN(8), [o4] "x"(operand[4]), [o5] "x"(operand[5]), [o6] "x"(operand[6]), [o7] "x"(operand[7])

// One row's sums against a group's Ops operands (4 activations each, from xq): vpmaddubsw's int16 pair sums added
// up PerWiden at a time, each run widened by vpmaddwd with widen (the scales). In assembly because GCC, given the
// same intrinsics, kept every product live and spilled. Q4_K's 8 products go into two chains of additions, where one
// chain's latency showed (4 chains: no faster). bench/kernel_ab on a 2-core Zen 3 (weights from cache, one thread,
// 4 rows, both builds in one process): Q4_K 10.2 -> 10.9 GB/s, Q5_K 10.8 -> 11.2 (from one pass), Q2_K 5.6 -> 5.8.
template <int Ops, int PerWiden>
inline __m256i k_row_sums_asm(const __m256i* operand, __m256i widen, const int8_t* xq) {
  __m256i dot, part, part2, tmp;
  if constexpr (Ops == 8 && PerWiden == 8) {
    asm(K_ASM_FIRST(part, 0, 0) K_ASM_FIRST(part2, 1, 4) K_ASM_NEXT(part, 2, 8) K_ASM_NEXT(part2, 3, 12)
            K_ASM_NEXT(part, 4, 16) K_ASM_NEXT(part2, 5, 20) K_ASM_NEXT(part, 6, 24) K_ASM_NEXT(part2, 7, 28)
                "vpaddw %t[part2], %t[part], %t[part]\n\t" K_ASM_WIDEN
        : K_ASM_OUT
        : K_ASM_IN_8);
  } else if constexpr (Ops == 8 && PerWiden == 4) {
    asm(K_ASM_FIRST(part, 0, 0) K_ASM_NEXT(part, 1, 4) K_ASM_NEXT(part, 2, 8) K_ASM_NEXT(part, 3, 12) K_ASM_WIDEN
            K_ASM_FIRST(part, 4, 16) K_ASM_NEXT(part, 5, 20) K_ASM_NEXT(part, 6, 24) K_ASM_NEXT(part, 7, 28)
                K_ASM_WIDEN_ADD
        : K_ASM_OUT
        : K_ASM_IN_8);
  } else {
    static_assert(Ops == 4 && PerWiden == 4, "a group of 8 operands widened every 8 or 4, or of 4 widened once");
    asm(K_ASM_FIRST(part, 0, 0) K_ASM_NEXT(part, 1, 4) K_ASM_NEXT(part, 2, 8) K_ASM_NEXT(part, 3, 12) K_ASM_WIDEN
        : K_ASM_OUT
        : K_ASM_IN(4));
  }
  return dot;
}
#undef K_ASM_FIRST
#undef K_ASM_NEXT
#undef K_ASM_WIDEN
#undef K_ASM_WIDEN_ADD
#undef K_ASM_OUT
#undef K_ASM_IN
#undef K_ASM_IN_8

// One group's integer sums sum(code * xq) for Rows rows against one half of the tile (8 outputs, int32 lanes): with
// VNNI by vpdpbusd (IQ4_XS's levels as unsigned bytes, their 128 taken off with the zero point); without, by
// k_row_sums_asm, times the group's scales sc already (kAsmRows: the other layouts take the one-pass kernel at 3-4
// rows, kStreamAtFourRows).
template <typename K, int Half, int Rows, bool Vnni>
inline void k_group_sums_256(const QuantizedRows& x, int64_t row, int64_t group, const uint8_t* block, int g,
                             __m256i sc, __m256i* sum) {
  static_assert(Vnni || kAsmRows<K, Vnni>, "without VNNI the half tile takes only the assembly rows' layouts");
  __m256i operand[K::kGroup / 4];
  k_codes_256<K, Half>(block, g, operand);
  if constexpr (K::kLevels) {
#pragma GCC unroll 8
    for (int t = 0; t < K::kGroup / 4; ++t) operand[t] = levels_256<false>(operand[t]);
  }
  const auto xq = [&](int r) { return x.q + (row + r) * x.k + group * K::kGroup; };
  if constexpr (kAsmRows<K, Vnni>) {
    const __m256i widen = _mm256_or_si256(_mm256_and_si256(sc, _mm256_set1_epi32(0xffff)), _mm256_slli_epi32(sc, 16));
#pragma GCC unroll 4
    for (int r = 0; r < Rows; ++r) sum[r] = k_row_sums_asm<K::kGroup / 4, kPerWiden<K, Vnni>>(operand, widen, xq(r));
  } else {
#pragma GCC unroll 4
    for (int r = 0; r < Rows; ++r) {
      __m256i part = _mm256_setzero_si256();
#pragma GCC unroll 8
      for (int t = 0; t < K::kGroup / 4; ++t) {
        part = k_dot<Vnni>(part, operand[t], _mm256_set1_epi32(load_i32(xq(r) + 4 * t)));
      }
      sum[r] = part;
    }
  }
}

// A group's integer sums of one row (k_group_sums_256's) scaled by its sub-block scales into the row's super-block
// sum: sum + sc * (dot - zero * xsum), the zero point's share taken here where the sums are not centred already.
template <typename K, bool Vnni>
inline __m256i k_scaled_group_256(const QuantizedRows& x, int64_t row, int64_t group, __m256i dot, __m256i sc,
                                  __m256i sum) {
  if constexpr (K::kZero != 0 && !kCentredSums<K, Vnni>) {
    dot = _mm256_sub_epi32(dot, _mm256_set1_epi32(K::kZero * x.sums[row * x.groups + group]));
  }
  return _mm256_add_epi32(sum, _mm256_mullo_epi32(dot, sc));
}

// f(std::integral_constant<int, I>{}) for each I of the sequence, in order: a loop whose index is a constant
// (the operands' shifts are), however large its body.
template <typename F, int... I>
inline void for_each_index(const F& f, std::integer_sequence<int, I...>) {
  (f(std::integral_constant<int, I>{}), ...);
}

// Super-block b's integer sums of Rows rows against one half of the tile into the rows' float outputs: the mins'
// share (one vpmaddwd a row for two sub-blocks), then k_block_output's three float operations, lane by lane.
template <typename K, int Half, int Rows>
inline void k_block_outputs_256(const QuantizedRows& x, int64_t row, int64_t b, const uint8_t* block,
                                const KScales256<K>& unpacked, const __m256i* sums, __m256* acc) {
  [[maybe_unused]] __m256i mins[Rows];
  if constexpr (K::kMins) {
#pragma GCC unroll 4
    for (int r = 0; r < Rows; ++r) mins[r] = _mm256_setzero_si256();
    for_each_index([&](auto index) {
      constexpr int p = decltype(index)::value;
      const __m256i pair = k_min_pair_256<K, Half>(block, unpacked, p);
#pragma GCC unroll 4
      for (int r = 0; r < Rows; ++r) {
        // Sub-blocks 2p's and 2p + 1's activation sums, an int16 pair read from memory by the broadcast.
        const __m256i xpair = _mm256_set1_epi32(sum_pair(x.sums + (row + r) * x.groups + b * K::kGroups + 2 * p));
        mins[r] = _mm256_add_epi32(mins[r], _mm256_madd_epi16(pair, xpair));
      }
    }, std::make_integer_sequence<int, K::kGroups / 2>{});
  }
#pragma GCC unroll 4
  for (int r = 0; r < Rows; ++r) {
    __m256 v = _mm256_mul_ps(unpacked.d, _mm256_cvtepi32_ps(sums[r]));
    if constexpr (K::kMins) v = _mm256_fmadd_ps(unpacked.negative_dmin, _mm256_cvtepi32_ps(mins[r]), v);
    acc[r] = _mm256_fmadd_ps(v, _mm256_set1_ps(x.d[(row + r) * x.spans + b]), acc[r]);
  }
}

// One half of the tile for 3 or 4 rows (without VNNI of Q4_K, Q5_K and Q2_K only: kStreamAtFourRows) (the rows'
// sums and a group's operands fill the registers); the tile takes two passes, the second finding the tile's bytes in
// L1. The half is a template argument: left to the compiler to propagate, the generic planes' addressing stopped it
// doing so, and Q5_K and Q6_K ran 6-13% slower at one row. The arithmetic is k_tile_vnni512's, 8 lanes at a time.
template <typename K, int Half, int Rows, bool Vnni>
void k_half_tile_256(const QuantizedRows& x, int64_t row, const KTileView& t, float* y, int64_t ldy, int64_t cols) {
  __m256 acc[Rows];
#pragma GCC unroll 4
  for (int r = 0; r < Rows; ++r) acc[r] = _mm256_setzero_ps();
  KScales256<K> unpacked;
  for (int64_t b = 0; b < t.blocks; ++b) {
    const uint8_t* block = t.data + b * K::kBlockBytes;
    k_scale_bytes_256<K, Half>(block, unpacked);
    __m256i sums[Rows];
#pragma GCC unroll 4
    for (int r = 0; r < Rows; ++r) sums[r] = _mm256_setzero_si256();
#pragma GCC unroll 2
    for (int g = 0; g < K::kGroups; ++g) {
      const int64_t group = b * K::kGroups + g;
      if constexpr (Half == 0) k_prefetch_group_ahead<K, false>(block, g);  // the second half finds the tile in L1
      const __m256i sc = k_group_scales_256<K, Half>(block, unpacked, g);
      __m256i dot[Rows];
      k_group_sums_256<K, Half, Rows, Vnni>(x, row, group, block, g, sc, dot);
#pragma GCC unroll 4
      for (int r = 0; r < Rows; ++r) {
        sums[r] = kAsmRows<K, Vnni> ? _mm256_add_epi32(sums[r], dot[r])
                                    : k_scaled_group_256<K, Vnni>(x, row + r, group, dot[r], sc, sums[r]);
      }
    }
    k_block_outputs_256<K, Half, Rows>(x, row, b, block, unpacked, sums, acc);
  }
#pragma GCC unroll 4
  for (int r = 0; r < Rows; ++r) store_outputs_256(y + r * ldy, acc[r], cols);
}

// One or two rows (and 3-4 of the layouts kStreamAtFourRows names) against the whole tile in one pass: each broadcast
// of 4 activations serves both halves' vpmaddubsw, and the block is walked once where k_half_tile_256 walks it twice. A
// few rows use each operand once or twice, so both halves' operands are formed as they are needed and few registers are
// live. On a 2-core Zen 3 (bench/kernel_ab, one row, four distinct 57,344 x 4,096 weights streamed from memory, 2
// threads) Q4_K went from 23.7 to 33.5 GB/s, Q6_K from 22.5 to 27.6, Q5_K 28.2 to 40.7, IQ4_XS 22.9 to 33.2; from cache
// (one thread) every layout 11-18% faster. The arithmetic is k_half_tile_256's: the same bits.
template <typename K, int Rows, bool Vnni>
void k_stream_tile_256(const QuantizedRows& x, int64_t row, const KTileView& t, float* y, int64_t ldy,
                       int64_t cols) {
  constexpr bool kSigned = kCentredSums<K, Vnni>;
  constexpr int per_widen = kPerWiden<K, Vnni>;
  using H0 = std::integral_constant<int, 0>;
  using H1 = std::integral_constant<int, 1>;
  const auto both_halves = [](const auto& f) { f(H0{}), f(H1{}); };
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[2][Rows];
  for (auto& half : acc) for (__m256& a : half) a = _mm256_setzero_ps();
  KScales256<K> unpacked[2];
  for (int64_t b = 0; b < t.blocks; ++b) {
    const uint8_t* block = t.data + b * K::kBlockBytes;
    both_halves([&](auto h) { k_scale_bytes_256<K, decltype(h)::value>(block, unpacked[h]); });
    __m256i sums[2][Rows];
    for (auto& half : sums) for (__m256i& sum : half) sum = _mm256_setzero_si256();
#pragma GCC unroll 2
    for (int g = 0; g < K::kGroups; ++g) {
      const int64_t group = b * K::kGroups + g;
      k_prefetch_group_ahead<K, true, kBlocksAhead256>(block, g);
      [[maybe_unused]] __m256i high[2]{};
      if constexpr (K::kHighBits > 0) {
        both_halves([&](auto h) { high[h] = k_high_plane_256<K, decltype(h)::value>(block, g); });
      }
      __m256i part[2][Rows], total[2][Rows];
      for (int h = 0; h < 2; ++h) {
        for (int r = 0; r < Rows; ++r) part[h][r] = total[h][r] = _mm256_setzero_si256();
      }
      for_each_index([&](auto index) {
        constexpr int q = decltype(index)::value;
        __m256i activations[Rows];
        for (int r = 0; r < Rows; ++r) {
          activations[r] = _mm256_set1_epi32(load_i32(x.q + (row + r) * x.k + group * K::kGroup + 4 * q));
        }
        both_halves([&](auto h) {
          __m256i operand = k_operand_256<K, decltype(h)::value>(block, g, q, high[h]);
          if constexpr (K::kLevels) operand = levels_256<kSigned>(operand);
          [[maybe_unused]] const __m256i sign = operand;
          if constexpr (kSigned) operand = _mm256_abs_epi8(operand);
          for (int r = 0; r < Rows; ++r) {
            const __m256i a = kSigned ? _mm256_sign_epi8(activations[r], sign) : activations[r];
            part[h][r] = k_dot<Vnni>(part[h][r], operand, a);
            if constexpr (!Vnni && (q + 1) % per_widen == 0) {
              total[h][r] = _mm256_add_epi32(total[h][r], _mm256_madd_epi16(part[h][r], ones));
              part[h][r] = _mm256_setzero_si256();
            }
          }
        });
      }, std::make_integer_sequence<int, K::kGroup / 4>{});
      both_halves([&](auto h) {
        const __m256i sc = k_group_scales_256<K, decltype(h)::value>(block, unpacked[h], g);
        for (int r = 0; r < Rows; ++r) {
          sums[h][r] = k_scaled_group_256<K, Vnni>(x, row + r, group, Vnni ? part[h][r] : total[h][r], sc, sums[h][r]);
        }
      });
    }
    both_halves([&](auto h) {
      k_block_outputs_256<K, decltype(h)::value, Rows>(x, row, b, block, unpacked[h], sums[h], acc[h]);
    });
  }
  for (int r = 0; r < Rows; ++r) {
    store_outputs_256(y + r * ldy, acc[0][r], std::min<int64_t>(cols, 8));
    if (cols > 8) store_outputs_256(y + r * ldy + 8, acc[1][r], cols - 8);
  }
}

// Whether 3-4 rows also take the one-pass kernel: without VNNI, the layouts the half tile's assembly rows do not take
// (Q6_K, Q3_K and IQ4_XS: a zero point or signed levels), where forming an operand takes a high plane or levels. The
// half-tile kernel forms a group's 8 operands (and IQ4_XS's 8 signs) before its rows use them; the one-pass kernel
// forms each as its rows need it, and serves both halves with a broadcast. bench/kernel_ab on a 2-core Zen 3,
// weights from cache, one thread, both builds in one process, at 4 rows: Q6_K 11.9 -> 13.0 GB/s, IQ4_XS 6.4 -> 7.2,
// Q3_K 6.2 -> 6.3; Q6_K's groups through the half tile's assembly rows (the zero point taken a block at a time) or a
// both-halves form of it (8 operands a group) ran 9% and 15% slower than one pass. Q5_K, one pass at 3-4 rows before
// the assembly rows, now takes the half tile (4 rows: 10.8 -> 11.2 GB/s; 3 rows: 13.9 -> 13.6).
// Without VNNI only: the AVX-VNNI build was not timed.
template <typename K, bool Vnni>
inline constexpr bool kStreamAtFourRows = !Vnni && !kAsmRows<K, Vnni>;

template <typename K, int Rows, bool Vnni>
void k_tile_256(const QuantizedRows& x, int64_t row, const KTileView& t, float* y, int64_t ldy, int64_t cols) {
  if constexpr (Rows <= 2 || kStreamAtFourRows<K, Vnni>) {
    k_stream_tile_256<K, Rows, Vnni>(x, row, t, y, ldy, cols);
  } else {
    k_half_tile_256<K, 0, Rows, Vnni>(x, row, t, y, ldy, std::min<int64_t>(cols, 8));
    if (cols > 8) k_half_tile_256<K, 1, Rows, Vnni>(x, row, t, y + 8, ldy, cols - 8);
  }
}
#endif

#if defined(CONVEYOR_VNNI512)
// Bits [shift, shift + Bits) of every byte of v moved to bits [To, To + Bits), the others cleared.
template <int To, int Bits>
inline __m512i move_bits_512(__m512i v, int shift) {
  if (shift > To) v = _mm512_srli_epi16(v, shift - To);
  if (shift < To) v = _mm512_slli_epi16(v, To - shift);
  return _mm512_and_si512(v, _mm512_set1_epi8(static_cast<char>(((1 << Bits) - 1) << To)));
}

// The IQ4_XS/Q3_K 6-bit scales of all 16 rows less 32, as int8 bytes at rows_at(g): per 8 sub-blocks, their low
// nibbles (a qword each) beside their pairs' top bits (each pair's qword twice), a sub-block's top bits moved to
// bits 4-5 by rotating its qword: by 4 (even, rows b) or 0 (odd), by 2 (even, rows b + 8) or -2 (odd).
template <int Groups>
inline void six_bit_scales_512(const uint8_t* scales, int8_t* out) {
  const __m512i low = _mm512_set1_epi8(0x0f), top = _mm512_set1_epi8(0x30), bias = _mm512_set1_epi8(32);
  const __m512i twice = _mm512_setr_epi64(0, 0, 1, 1, 2, 2, 3, 3);
#pragma GCC unroll 2
  for (int part = 0; part < Groups / 8; ++part) {
    const __m512i lo = _mm512_loadu_si512(scales + 64 * part);
    const __m256i pairs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(scales + 8 * Groups + 32 * part));
    const __m512i hi = _mm512_permutexvar_epi64(twice, _mm512_zextsi256_si512(pairs));
    const __m512i rows_a = _mm512_rolv_epi64(hi, _mm512_setr_epi64(4, 0, 4, 0, 4, 0, 4, 0));
    const __m512i rows_b = _mm512_rolv_epi64(hi, _mm512_setr_epi64(2, 62, 2, 62, 2, 62, 2, 62));
    const __m512i a = _mm512_or_si512(_mm512_and_si512(lo, low), _mm512_and_si512(rows_a, top));
    const __m512i b = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(lo, 4), low), _mm512_and_si512(rows_b, top));
    _mm512_storeu_si512(out + 128 * part, _mm512_sub_epi8(_mm512_unpacklo_epi64(a, b), bias));
    _mm512_storeu_si512(out + 128 * part + 64, _mm512_sub_epi8(_mm512_unpackhi_epi64(a, b), bias));
  }
}

// A block's sub-block scales (and mins) of all 16 outputs, unpacked once a block: int8 or uint8 bytes, 16 a group
// at rows_at(g) (Q6_K and Q2_K read theirs from the header as they are), and d (and -dmin) as float32.
template <typename K>
struct KScales512 {
  __m512 d, negative_dmin;
  alignas(64) uint8_t sc[K::kScales == KScales::kSixBitSigned ? K::kGroups * 16 : 128];
  alignas(64) uint8_t m[128];
};

template <typename K>
inline void k_scale_bytes_512(const uint8_t* block, KScales512<K>& out) {
  const auto halves = [](const uint8_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  };
  out.d = halves(block);
  if constexpr (K::kMins) out.negative_dmin = _mm512_sub_ps(_mm512_setzero_ps(), halves(block + 32));
  if constexpr (K::kScales == KScales::kSixBitSigned) {
    six_bit_scales_512<K::kGroups>(block + 32, reinterpret_cast<int8_t*>(out.sc));
  } else if constexpr (K::kScales == KScales::kSixBitMins) {
    const __m512i low = _mm512_set1_epi8(0x0f), top = _mm512_set1_epi8(0x30);
    const auto load = [&](int64_t offset) { return _mm512_loadu_si512(block + offset); };
    const __m512i sc_lo = load(64), m_lo = load(128), hi = load(192);
    // Bytes [sub-block][row]: rows 0-7 from the low nibbles (top bits at 0-1, mins' at 4-5), rows 8-15 from the
    // high ones (top bits at 2-3, 6-7), each top pair moved to bits 4-5.
    const __m512i sc_a = _mm512_or_si512(_mm512_and_si512(sc_lo, low), _mm512_and_si512(_mm512_slli_epi16(hi, 4), top));
    const __m512i sc_b = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(sc_lo, 4), low),
                                         _mm512_and_si512(_mm512_slli_epi16(hi, 2), top));
    const __m512i m_a = _mm512_or_si512(_mm512_and_si512(m_lo, low), _mm512_and_si512(hi, top));
    const __m512i m_b = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(m_lo, 4), low),
                                        _mm512_and_si512(_mm512_srli_epi16(hi, 2), top));
    // Sub-block g's 16 rows side by side at rows_at(g): the even sub-blocks in one vector's 128-bit lanes, the odd
    // in another.
    _mm512_store_si512(out.sc, _mm512_unpacklo_epi64(sc_a, sc_b));
    _mm512_store_si512(out.sc + 64, _mm512_unpackhi_epi64(sc_a, sc_b));
    _mm512_store_si512(out.m, _mm512_unpacklo_epi64(m_a, m_b));
    _mm512_store_si512(out.m + 64, _mm512_unpackhi_epi64(m_a, m_b));
  }
}

// Sub-block g's integer scales of all 16 outputs (k_sub_scale's numbers), one a lane.
template <typename K>
inline __m512i k_group_scales_512(const uint8_t* block, const KScales512<K>& t, int g) {
  const auto sixteen = [](const void* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); };
  if constexpr (K::kScales == KScales::kInt8) return _mm512_cvtepi8_epi32(sixteen(block + 32 + 16 * g));
  if constexpr (K::kScales == KScales::kSixBitSigned) return _mm512_cvtepi8_epi32(sixteen(t.sc + rows_at(g)));
  if constexpr (K::kScales == KScales::kNibbleMins) {
    return _mm512_and_si512(_mm512_cvtepu8_epi32(sixteen(block + 64 + 16 * g)), _mm512_set1_epi32(15));
  }
  return _mm512_cvtepu8_epi32(sixteen(t.sc + rows_at(g)));
}

// Sub-blocks 2p's and 2p + 1's mins of all 16 outputs as int16 pairs, one pair a lane: vpdpwssd's operand
// against the two sub-blocks' activation sums.
template <typename K>
inline __m512i k_min_pair_512(const uint8_t* block, const KScales512<K>& t, int p) {
  const auto sixteen = [](const void* at) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(at)); };
  __m512i even, odd;
  if constexpr (K::kScales == KScales::kNibbleMins) {
    even = _mm512_srli_epi32(_mm512_cvtepu8_epi32(sixteen(block + 64 + 32 * p)), 4);
    odd = _mm512_srli_epi32(_mm512_cvtepu8_epi32(sixteen(block + 80 + 32 * p)), 4);
  } else {
    even = _mm512_cvtepu8_epi32(sixteen(t.m + rows_at(2 * p)));
    odd = _mm512_cvtepu8_epi32(sixteen(t.m + rows_at(2 * p + 1)));
  }
  return _mm512_or_si512(even, _mm512_slli_epi32(odd, 16));
}

// One group's codes of all 16 outputs as vpdpbusd operands: operand t holds inputs 4t .. 4t + 3, the low plane's
// bits or'ed with the high plane's above them (IQ4_XS: looked up into their levels), as k_codes_256 takes them.
template <typename K>
inline void k_operands_512(const uint8_t* block, int g, __m512i* operand) {
  using Low = PlaneAt<K, K::kLowBits>;
  const uint8_t* low = block + K::kHeader;
  [[maybe_unused]] __m512i high;
  if constexpr (K::kHighBits > 0) {
    using High = PlaneAt<K, K::kHighBits>;
    high = _mm512_loadu_si512(block + K::kHeader + K::kLowBytes + High::vector(g) * 64);
    if constexpr (High::kShare > 1) high = _mm512_srl_epi16(high, _mm_cvtsi32_si128(High::shift(g)));
  }
#pragma GCC unroll 8
  for (int t = 0; t < K::kGroup / 4; ++t) {
    const __m512i v = _mm512_loadu_si512(low + (Low::vector(g) + 4 * t / Low::kSpan) * 64);
    operand[t] = move_bits_512<0, K::kLowBits>(v, 4 * t % Low::kSpan / 4 * K::kLowBits);
    if constexpr (K::kHighBits > 0) {
      operand[t] = _mm512_or_si512(operand[t], move_bits_512<K::kLowBits, K::kHighBits>(high, t * K::kHighBits));
    }
    operand[t] = code_bytes_512<K::kLevels>(operand[t]);
  }
}

// 512 bits: one zmm holds a row's 16 outputs, so the tile takes one pass. As quant_tile_vnni512, up to 4 rows
// sum each group in two chains (even and odd operands) that the core overlaps; 5 to 8 rows are independent chains
// enough. A group's sums are scaled by its sub-block scales in integers (vpmulld) into the super-block's sum; the
// mins' share is one vpdpwssd per two sub-blocks and row; then three float operations a super-block and row
// (k_block_output) where per-group scaling took three a group.
template <typename K, int Rows>
void k_tile_vnni512(const QuantizedRows& x, int64_t row, const KTileView& t, float* y, int64_t ldy, int64_t cols) {
  constexpr int kChains = Rows > 4 ? 1 : 2;
  __m512 acc[Rows];
#pragma GCC unroll 8
  for (int r = 0; r < Rows; ++r) acc[r] = _mm512_setzero_ps();
  KScales512<K> unpacked;
  for (int64_t b = 0; b < t.blocks; ++b) {
    const uint8_t* block = t.data + b * K::kBlockBytes;
    k_scale_bytes_512<K>(block, unpacked);
    __m512i sums[Rows];
#pragma GCC unroll 8
    for (int r = 0; r < Rows; ++r) sums[r] = _mm512_setzero_si512();
#pragma GCC unroll 2
    for (int g = 0; g < K::kGroups; ++g) {
      const int64_t group = b * K::kGroups + g;
      if constexpr (Rows > 2 || !kHardwareStream<K>) {
        k_prefetch_group_ahead<K, (Rows <= 2), kBlocksAhead512>(block, g);
      }
      __m512i operand[K::kGroup / 4];
      k_operands_512<K>(block, g, operand);
      __m512i dots[kChains][Rows];
#pragma GCC unroll 8
      for (int r = 0; r < Rows; ++r) {
        const int8_t* xq = x.q + (row + r) * x.k + group * K::kGroup;
#pragma GCC unroll 2
        for (int chain = 0; chain < kChains; ++chain) dots[chain][r] = _mm512_setzero_si512();
#pragma GCC unroll 8
        for (int q = 0; q < K::kGroup / 4; ++q) {
          __m512i& dot = dots[q % kChains][r];
          dot = _mm512_dpbusd_epi32(dot, operand[q], _mm512_set1_epi32(load_i32(xq + 4 * q)));
        }
      }
      const __m512i sc = k_group_scales_512<K>(block, unpacked, g);
#pragma GCC unroll 8
      for (int r = 0; r < Rows; ++r) {
        __m512i dot = dots[0][r];
        if constexpr (kChains == 2) dot = _mm512_add_epi32(dot, dots[1][r]);
        if constexpr (K::kZero != 0) {
          dot = _mm512_sub_epi32(dot, _mm512_set1_epi32(K::kZero * x.sums[(row + r) * x.groups + group]));
        }
        sums[r] = _mm512_add_epi32(sums[r], _mm512_mullo_epi32(dot, sc));
      }
    }
    [[maybe_unused]] __m512i mins[Rows];
    if constexpr (K::kMins) {
#pragma GCC unroll 8
      for (int r = 0; r < Rows; ++r) mins[r] = _mm512_setzero_si512();
#pragma GCC unroll 8
      for (int p = 0; p < K::kGroups / 2; ++p) {
        const __m512i pair = k_min_pair_512<K>(block, unpacked, p);
#pragma GCC unroll 8
        for (int r = 0; r < Rows; ++r) {
          const int16_t* xsums = x.sums + (row + r) * x.groups + b * K::kGroups + 2 * p;
          mins[r] = _mm512_dpwssd_epi32(mins[r], pair, _mm512_set1_epi32(sum_pair(xsums)));
        }
      }
    }
#pragma GCC unroll 8
    for (int r = 0; r < Rows; ++r) {
      __m512 t = _mm512_mul_ps(unpacked.d, _mm512_cvtepi32_ps(sums[r]));
      if constexpr (K::kMins) t = _mm512_fmadd_ps(unpacked.negative_dmin, _mm512_cvtepi32_ps(mins[r]), t);
      acc[r] = _mm512_fmadd_ps(t, _mm512_set1_ps(x.d[(row + r) * x.spans + b]), acc[r]);
    }
  }
  const __mmask16 mask = static_cast<__mmask16>((1u << cols) - 1u);
#pragma GCC unroll 8
  for (int r = 0; r < Rows; ++r) _mm512_mask_storeu_ps(y + r * ldy, mask, acc[r]);
}
#endif

using KTileFn = void (*)(const QuantizedRows&, int64_t, const KTileView&, float*, int64_t, int64_t);

// A kind's super-block micro-kernels by rows: 1 to 8 on vnni512, 1 to 4 on the 256-bit kinds (16 registers). A
// group's operands are unpacked once for all the tile's rows (8 registers for Q4_K and Q5_K), so the more rows a
// pass takes, the fewer times they are unpacked: on a Zen 4 (2 threads), 8 rows of a 14,336 x 4,096 weight in one
// pass rather than two of 4 took 1.82-1.86 ms against 2.04-2.09 (Q4_K), 2.17-2.21 against 2.77-2.84 (Q5_K) and
// 2.17-2.30 against 3.16-3.26 (Q6_K); 64 rows 13.6-13.7 against 14.3 (Q4_K), 16.4-16.6 against 19.8 (Q6_K)
// (`kernel_check bench 14336 4096 Q4_K,Q5_K,Q6_K vnni512`). Two chains a row, as up to 4 rows take, spilled at 8.
template <typename K, QuantDot Dot>
struct KQuantKernels {
  static constexpr int kMaxRows = Dot == QuantDot::kVnni512 ? 8 : 4;

  template <int Rows>
  static void tile(const QuantizedRows& x, int64_t row, const KTileView& t, float* y, int64_t ldy, int64_t cols) {
#if defined(CONVEYOR_VNNI512)
    if constexpr (Dot == QuantDot::kVnni512) return k_tile_vnni512<K, Rows>(x, row, t, y, ldy, cols);
#endif
#if defined(CONVEYOR_AVX2)
#if defined(CONVEYOR_VNNI256)
    if constexpr (Dot == QuantDot::kVnni256) return k_tile_256<K, Rows, true>(x, row, t, y, ldy, cols);
#endif
    if constexpr (Dot == QuantDot::kAvx2) return k_tile_256<K, Rows, false>(x, row, t, y, ldy, cols);
#endif
    k_tile_portable<K, Rows>(x, row, t, y, ldy, cols);
  }

  template <int... Rows>
  static constexpr std::array<KTileFn, sizeof...(Rows) + 1> table(std::integer_sequence<int, Rows...>) {
    return {nullptr, &tile<Rows + 1>...};
  }
  static KTileFn at(int rows) {
    static constexpr auto fns = table(std::make_integer_sequence<int, kMaxRows>{});
    return fns[rows];
  }
};

}  // namespace conveyor
