// The K-quants (Q4_K, Q5_K, Q6_K) at the file's own size: 256-weight super-blocks with their 6-bit (Q6_K: 8-bit)
// sub-block scales, repacked for 16 output rows at a time, and the micro-kernels that unpack the scales in
// registers. Decoding them into quant_tiles.h's uniform form instead (a float32 scale and min per group) would
// store Q4_K at 6.0 bits a weight where the file has 4.5, and Q6_K at 10 where it has 6.56; a decode step reads
// every stored byte, so that is its speed.
//
// Layout (conveyor/model/quant/k_quants.py packs it): per tile of 16 outputs and per super-block of 256 inputs, one
// block of bytes, the tile's blocks one after another (a tile is one stream):
//   Q4_K, Q5_K (2,304 / 2,816 bytes = 16 rows x 144 / 176, the file's sizes):
//     d[16], dmin[16]     float16, row by row
//     sc_lo[8][8]         sub-block j, byte b: the low 4 bits of row b's scale, then (high nibble) row b + 8's
//     m_lo[8][8]          the same for the mins
//     hi[8][8]            sub-block j, byte b: the top 2 bits of sc(b), sc(b + 8), m(b), m(b + 8), from bit 0
//     codes               8 groups of 32 inputs in quant_tiles.h's 4-bit layout (4 vectors of 64 bytes a group)
//     Q5_K's 5th bits     8 groups x 64 bytes: byte 4c + b, bit t: input 4t + b of output c
//   Q6_K (3,360 bytes = 16 x 210):
//     d[16]               float16
//     sc[16][16]          int8, group g (16 inputs) x row
//     codes' low 4 bits   16 groups of 16 inputs in the 4-bit layout (2 vectors a group)
//     codes' top 2 bits   16 groups x 64 bytes: byte 4c + b, bits 2t, 2t + 1: input 4t + b of output c
// A weight is then   Q4_K, Q5_K:  w = d * sc * q - dmin * m        Q6_K:  w = d * sc * (q - 32).
// The activations are quantized per group (32 inputs; Q6_K 16) as for the uniform formats, and per group the
// kernels form d * sc and -(dmin * m) in float32, exactly (an f16 times a 6-bit integer): the same numbers the
// uniform form holds, so a K-quant computes the same outputs to the bit in either layout.

#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <utility>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "quant_tiles.h"

namespace conveyor {

// How a quantized weight's bytes are laid out: quant_tiles.h's uniform tiles, or one of the K super-blocks.
enum class QuantLayout : int { kTiles = 0, kQ4K = 1, kQ5K = 2, kQ6K = 3 };

constexpr int64_t kSuperBlock = 256;  // inputs per K super-block

// What a kernel needs to know of a K layout, at compile time.
template <QuantLayout L>
struct KFormat {
  static constexpr QuantLayout kLayout = L;
  static constexpr bool kSix = L == QuantLayout::kQ6K;
  static constexpr int kGroup = kSix ? 16 : 32;                       // inputs per sub-block scale
  static constexpr int kGroups = kSuperBlock / kGroup;                // sub-blocks per super-block
  static constexpr int64_t kHeader = kSix ? 32 + 256 : 256;           // d (and dmin) and the sub-block scales
  static constexpr int64_t kLowBytes = kQuantTile * kSuperBlock / 2;  // the codes' low 4 bits
  static constexpr int64_t kGroupLowBytes = kLowBytes / kGroups;
  static constexpr int64_t kHighBytes = L == QuantLayout::kQ4K ? 0 : kQuantTile * kSuperBlock * (kSix ? 2 : 1) / 8;
  static constexpr int64_t kGroupHighBytes = kHighBytes / kGroups;
  static constexpr int64_t kBlockBytes = kHeader + kLowBytes + kHighBytes;
  static constexpr int32_t kZero = kSix ? 32 : 0;  // Q6_K's zero point; the others have mins
  static constexpr bool kMins = !kSix;
};

inline int64_t k_block_bytes(QuantLayout layout) {
  switch (layout) {
    case QuantLayout::kQ4K: return KFormat<QuantLayout::kQ4K>::kBlockBytes;
    case QuantLayout::kQ5K: return KFormat<QuantLayout::kQ5K>::kBlockBytes;
    case QuantLayout::kQ6K: return KFormat<QuantLayout::kQ6K>::kBlockBytes;
    default: return 0;
  }
}

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

// Sub-block g's scale and min (Q6_K: min 0) of output c, as the uniform form holds them: d * sc, -(dmin * m).
template <typename K>
inline void k_scale_min(const uint8_t* block, int g, int c, float* scale, float* min) {
  if constexpr (K::kSix) {
    *scale = half_to_float(load_u16(block + 2 * c)) * static_cast<float>(static_cast<int8_t>(block[32 + 16 * g + c]));
    *min = 0.f;
  } else {
    const int b = c % 8, nibble = 4 * (c / 8);
    const uint8_t hi = block[192 + 8 * g + b];
    const int sc = ((block[64 + 8 * g + b] >> nibble) & 15) | (((hi >> (c / 8 * 2)) & 3) << 4);
    const int m = ((block[128 + 8 * g + b] >> nibble) & 15) | (((hi >> (4 + c / 8 * 2)) & 3) << 4);
    *scale = half_to_float(load_u16(block + 2 * c)) * static_cast<float>(sc);
    *min = -(half_to_float(load_u16(block + 32 + 2 * c)) * static_cast<float>(m));  // -0.0 where m is 0
  }
}

// The code of output c, input j (0..255) of a block.
template <typename K>
inline int32_t k_code(const uint8_t* block, int c, int j) {
  const int g = j / K::kGroup, i = j % K::kGroup;
  const uint8_t byte = block[K::kHeader + g * K::kGroupLowBytes + (i / 8) * 64 + c * 4 + i % 4];
  int32_t code = (i % 8) < 4 ? (byte & 0x0f) : (byte >> 4);
  if constexpr (K::kLayout != QuantLayout::kQ4K) {
    const uint8_t high = block[K::kHeader + K::kLowBytes + g * K::kGroupHighBytes + c * 4 + i % 4];
    const int t = i / 4;
    code |= K::kSix ? ((high >> (2 * t)) & 3) << 4 : ((high >> t) & 1) << 4;
  }
  return code;
}

// Plain C++: any CPU, and the reference for the vector kernel's arithmetic (integer sums per group, then one
// float multiply-add per group, in the same order).
template <typename K, int Rows>
void k_tile_portable(const QuantizedRows& x, int64_t row, const KTileView& t, float* y, int64_t ldy, int64_t cols) {
  for (int64_t r = 0; r < Rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      float acc = 0.f;
      for (int64_t b = 0; b < t.blocks; ++b) {
        const uint8_t* block = t.data + b * K::kBlockBytes;
        for (int g = 0; g < K::kGroups; ++g) {
          const int64_t group = b * K::kGroups + g;
          const int8_t* xq = x.q + (row + r) * x.k + group * K::kGroup;
          int32_t sum = 0;
          for (int i = 0; i < K::kGroup; ++i) sum += k_code<K>(block, static_cast<int>(c), g * K::kGroup + i) * xq[i];
          float s, m;
          k_scale_min<K>(block, g, static_cast<int>(c), &s, &m);
          acc = scale_group<K::kMins>(acc, sum, s, m, x, (row + r) * x.groups + group, K::kZero);
        }
      }
      y[r * ldy + c] = acc;
    }
  }
}

// Asks for the bytes kQuantAhead further on (see prefetch_group_ahead), group g's share of the block at a time:
// the whole block's lines asked for at once left the stream as slow as not asking. Into L2 (prefetcht1), not
// L1, as attention's prefetch_slice does: on a Zen 4, 8 Q4_K weights of 14,336 x 4,096 (264 MB) at one row
// streamed at 27.2-30.8 GB/s against 24.7-29.0 in alternating runs, and the 8B-shaped Q4_K_M file decoded at
// 7.5 and 6.7 tokens a second against 7.1 and 5.6 (8 KB or 2 KB ahead instead of 4 were no better).
template <typename K>
inline void k_prefetch_group_ahead(const uint8_t* block, int g) {
  constexpr int64_t share = K::kBlockBytes / K::kGroups;
#pragma GCC unroll 8
  for (int64_t line = 0; line < share + 63; line += 64) __builtin_prefetch(block + kQuantAhead + g * share + line, 0, 2);
}

#if defined(CONVEYOR_AVX2)
// A block's sub-block scales (and mins) of one half of the tile (outputs 8 * half ..), as float32 [group][8].
template <typename K>
inline void k_scales_256(const uint8_t* block, int half, float* scales, float* mins) {
  const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 16 * half)));
  if constexpr (K::kSix) {
#pragma GCC unroll 16
    for (int g = 0; g < K::kGroups; ++g) {
      const __m128i sc = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(block + 32 + 16 * g + 8 * half));
      _mm256_store_ps(scales + 8 * g, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc))));
    }
  } else {
    // All 8 sub-blocks' 6-bit values at once, as bytes [sub-block][row of the half]: low nibbles, then top bits.
    const __m256i low = _mm256_set1_epi8(0x0f), top = _mm256_set1_epi8(0x30);
    const auto load = [&](int64_t offset, int part) {
      return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + offset + 32 * part));
    };
    alignas(32) uint8_t sc[64], m[64];
#pragma GCC unroll 2
    for (int part = 0; part < 2; ++part) {
      const __m256i hi = load(192, part);
      const __m256i sc_lo = _mm256_and_si256(_mm256_srli_epi16(load(64, part), 4 * half), low);
      const __m256i m_lo = _mm256_and_si256(_mm256_srli_epi16(load(128, part), 4 * half), low);
      // sc's top bits at 2 * half, m's at 4 + 2 * half: each moved to bits 4-5
      const __m256i sc_hi = _mm256_and_si256(half ? _mm256_slli_epi16(hi, 2) : _mm256_slli_epi16(hi, 4), top);
      const __m256i m_hi = _mm256_and_si256(half ? _mm256_srli_epi16(hi, 2) : hi, top);
      _mm256_store_si256(reinterpret_cast<__m256i*>(sc + 32 * part), _mm256_or_si256(sc_lo, sc_hi));
      _mm256_store_si256(reinterpret_cast<__m256i*>(m + 32 * part), _mm256_or_si256(m_lo, m_hi));
    }
    const __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 32 + 16 * half)));
    const __m256 negative_dmin = _mm256_sub_ps(_mm256_setzero_ps(), dmin);
#pragma GCC unroll 8
    for (int g = 0; g < K::kGroups; ++g) {
      const __m256i s8 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sc + 8 * g)));
      const __m256i m8 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(m + 8 * g)));
      _mm256_store_ps(scales + 8 * g, _mm256_mul_ps(d, _mm256_cvtepi32_ps(s8)));
      _mm256_store_ps(mins + 8 * g, _mm256_mul_ps(negative_dmin, _mm256_cvtepi32_ps(m8)));
    }
  }
}

// u8 codes of 4 inputs . s8 activations, pairs summed to int16 (vpmaddubsw) or, with VNNI, fours to int32.
template <bool Vnni>
inline __m256i k_dot(__m256i acc, __m256i codes, __m256i x) {
  if constexpr (Vnni) return dot4x8<true>(acc, codes, x);
  return _mm256_add_epi16(acc, _mm256_maddubs_epi16(codes, x));
}

// One group's integer sums sum(code * xq) for Rows rows against one half of the tile (8 outputs, int32 lanes).
// Without VNNI vpmaddubsw's int16 pair sums are added up while they fit (a pair is at most 2 * 63 * 127 for Q6_K,
// 2 * 31 * 127 for Q5_K) before one vpmaddwd widens them.
template <typename K, int Rows, bool Vnni>
inline void k_group_sums_256(const QuantizedRows& x, int64_t row, int64_t group, const uint8_t* block, int g,
                             int half, __m256i* sum) {
  const __m256i ones = _mm256_set1_epi16(1), low = _mm256_set1_epi8(0x0f);
  const uint8_t* codes = block + K::kHeader + g * K::kGroupLowBytes + 32 * half;
  const auto xq = [&](int r, int input) {
    return _mm256_set1_epi32(load_i32(x.q + (row + r) * x.k + group * K::kGroup + input));
  };
  // the codes of inputs 4t .. 4t + 3 of every output, as bytes: low nibbles or'ed with the top bits
  __m256i operand[K::kGroup / 4];
  __m256i high = _mm256_setzero_si256();
  if constexpr (K::kLayout != QuantLayout::kQ4K) {
    high = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + K::kHeader + K::kLowBytes +
                                                                g * K::kGroupHighBytes + 32 * half));
  }
#pragma GCC unroll 4
  for (int o = 0; o < K::kGroup / 8; ++o) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + 64 * o));
    operand[2 * o] = _mm256_and_si256(v, low);
    operand[2 * o + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
  }
  if constexpr (K::kSix) {  // bits 2t, 2t + 1 of the high bytes to bits 4-5
    const __m256i top = _mm256_set1_epi8(0x30);
    operand[0] = _mm256_or_si256(operand[0], _mm256_and_si256(_mm256_slli_epi16(high, 4), top));
    operand[1] = _mm256_or_si256(operand[1], _mm256_and_si256(_mm256_slli_epi16(high, 2), top));
    operand[2] = _mm256_or_si256(operand[2], _mm256_and_si256(high, top));
    operand[3] = _mm256_or_si256(operand[3], _mm256_and_si256(_mm256_srli_epi16(high, 2), top));
  } else if constexpr (K::kLayout == QuantLayout::kQ5K) {  // bit t of the high bytes to bit 4
    const __m256i bit = _mm256_set1_epi8(0x10);
    operand[0] = _mm256_or_si256(operand[0], _mm256_and_si256(_mm256_slli_epi16(high, 4), bit));
    operand[1] = _mm256_or_si256(operand[1], _mm256_and_si256(_mm256_slli_epi16(high, 3), bit));
    operand[2] = _mm256_or_si256(operand[2], _mm256_and_si256(_mm256_slli_epi16(high, 2), bit));
    operand[3] = _mm256_or_si256(operand[3], _mm256_and_si256(_mm256_slli_epi16(high, 1), bit));
    operand[4] = _mm256_or_si256(operand[4], _mm256_and_si256(high, bit));
    operand[5] = _mm256_or_si256(operand[5], _mm256_and_si256(_mm256_srli_epi16(high, 1), bit));
    operand[6] = _mm256_or_si256(operand[6], _mm256_and_si256(_mm256_srli_epi16(high, 2), bit));
    operand[7] = _mm256_or_si256(operand[7], _mm256_and_si256(_mm256_srli_epi16(high, 3), bit));
  }
  // Without VNNI: how many vpmaddubsw results an int16 lane holds (Q4_K: all 8; Q5_K: 4; Q6_K: 2).
  constexpr int per_widen = Vnni ? K::kGroup / 4 : (K::kLayout == QuantLayout::kQ4K ? 8 : K::kSix ? 2 : 4);
#pragma GCC unroll 4
  for (int r = 0; r < Rows; ++r) {
    __m256i total = _mm256_setzero_si256(), part = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int t = 0; t < K::kGroup / 4; ++t) {
      part = k_dot<Vnni>(part, operand[t], xq(r, 4 * t));
      if constexpr (!Vnni) {
        if ((t + 1) % per_widen == 0) {
          total = _mm256_add_epi32(total, _mm256_madd_epi16(part, ones));
          part = _mm256_setzero_si256();
        }
      }
    }
    sum[r] = Vnni ? part : total;
  }
}

// One half of the tile for Rows rows; the tile takes two passes, the second finding the tile's bytes in L1.
template <typename K, int Rows, bool Vnni>
void k_half_tile_256(const QuantizedRows& x, int64_t row, const KTileView& t, int half, float* y, int64_t ldy,
                     int64_t cols) {
  __m256 acc[Rows];
#pragma GCC unroll 4
  for (int r = 0; r < Rows; ++r) acc[r] = _mm256_setzero_ps();
  alignas(32) float scales[K::kGroups * 8], mins[K::kGroups * 8];
  for (int64_t b = 0; b < t.blocks; ++b) {
    const uint8_t* block = t.data + b * K::kBlockBytes;
    k_scales_256<K>(block, half, scales, mins);
#pragma GCC unroll 2
    for (int g = 0; g < K::kGroups; ++g) {
      const int64_t group = b * K::kGroups + g;
      if (half == 0) k_prefetch_group_ahead<K>(block, g);  // the second half finds the tile in L1
      __m256i sum[Rows];
      k_group_sums_256<K, Rows, Vnni>(x, row, group, block, g, half, sum);
      const __m256 s = _mm256_load_ps(scales + 8 * g);
      const __m256 m = K::kMins ? _mm256_load_ps(mins + 8 * g) : _mm256_setzero_ps();
#pragma GCC unroll 4
      for (int r = 0; r < Rows; ++r) {
        acc[r] = scale_group_256<K::kMins>(acc[r], sum[r], s, m, x, (row + r) * x.groups + group, K::kZero);
      }
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < Rows; ++r) store_outputs_256(y + r * ldy, acc[r], cols);
}

template <typename K, int Rows, bool Vnni>
void k_tile_256(const QuantizedRows& x, int64_t row, const KTileView& t, float* y, int64_t ldy, int64_t cols) {
  k_half_tile_256<K, Rows, Vnni>(x, row, t, 0, y, ldy, std::min<int64_t>(cols, 8));
  if (cols > 8) k_half_tile_256<K, Rows, Vnni>(x, row, t, 1, y + 8, ldy, cols - 8);
}
#endif

#if defined(CONVEYOR_VNNI512)
// A block's sub-block scales and mins of all 16 outputs, as float32 [group][16]: k_scales_256's numbers, both
// halves at once.
template <typename K>
inline void k_scales_512(const uint8_t* block, float* scales, float* mins) {
  const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(block)));
  if constexpr (K::kSix) {
#pragma GCC unroll 16
    for (int g = 0; g < K::kGroups; ++g) {
      const __m128i sc = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 32 + 16 * g));
      _mm512_store_ps(scales + 16 * g, _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(sc))));
    }
  } else {
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
    // Sub-block g's 16 rows side by side: the even sub-blocks in one vector's 128-bit lanes, the odd in another.
    alignas(64) uint8_t sc[128], m[128];
    _mm512_store_si512(sc, _mm512_unpacklo_epi64(sc_a, sc_b));
    _mm512_store_si512(sc + 64, _mm512_unpackhi_epi64(sc_a, sc_b));
    _mm512_store_si512(m, _mm512_unpacklo_epi64(m_a, m_b));
    _mm512_store_si512(m + 64, _mm512_unpackhi_epi64(m_a, m_b));
    const __m512 dmin = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 32)));
    const __m512 negative_dmin = _mm512_sub_ps(_mm512_setzero_ps(), dmin);
#pragma GCC unroll 8
    for (int g = 0; g < K::kGroups; ++g) {
      const int at = 64 * (g % 2) + 16 * (g / 2);
      const __m512i s8 = _mm512_cvtepu8_epi32(_mm_load_si128(reinterpret_cast<const __m128i*>(sc + at)));
      const __m512i m8 = _mm512_cvtepu8_epi32(_mm_load_si128(reinterpret_cast<const __m128i*>(m + at)));
      _mm512_store_ps(scales + 16 * g, _mm512_mul_ps(d, _mm512_cvtepi32_ps(s8)));
      _mm512_store_ps(mins + 16 * g, _mm512_mul_ps(negative_dmin, _mm512_cvtepi32_ps(m8)));
    }
  }
}

// One group's codes of all 16 outputs as vpdpbusd operands: operand t holds inputs 4t .. 4t + 3, low nibbles
// or'ed with the bits above the fourth.
template <typename K>
inline void k_operands_512(const uint8_t* block, int g, __m512i* operand) {
  const __m512i low = _mm512_set1_epi8(0x0f);
  const uint8_t* codes = block + K::kHeader + g * K::kGroupLowBytes;
#pragma GCC unroll 4
  for (int o = 0; o < K::kGroup / 8; ++o) {
    const __m512i v = _mm512_loadu_si512(codes + 64 * o);
    operand[2 * o] = _mm512_and_si512(v, low);
    operand[2 * o + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
  }
  if constexpr (K::kLayout == QuantLayout::kQ4K) return;
  const __m512i high = _mm512_loadu_si512(block + K::kHeader + K::kLowBytes + g * K::kGroupHighBytes);
  if constexpr (K::kSix) {  // bits 2t, 2t + 1 to bits 4-5
    const __m512i top = _mm512_set1_epi8(0x30);
    operand[0] = _mm512_or_si512(operand[0], _mm512_and_si512(_mm512_slli_epi16(high, 4), top));
    operand[1] = _mm512_or_si512(operand[1], _mm512_and_si512(_mm512_slli_epi16(high, 2), top));
    operand[2] = _mm512_or_si512(operand[2], _mm512_and_si512(high, top));
    operand[3] = _mm512_or_si512(operand[3], _mm512_and_si512(_mm512_srli_epi16(high, 2), top));
  } else {  // Q5_K: bit t to bit 4
    const __m512i bit = _mm512_set1_epi8(0x10);
#pragma GCC unroll 8
    for (int t = 0; t < 8; ++t) {
      const __m512i moved = t < 4 ? _mm512_slli_epi16(high, 4 - t) : _mm512_srli_epi16(high, t - 4);
      operand[t] = _mm512_or_si512(operand[t], _mm512_and_si512(moved, bit));
    }
  }
}

// 512 bits: one zmm holds a row's 16 outputs, so the tile takes one pass. As quant_tile_vnni512, the rows
// sum each group in two chains (even and odd operands) that the core overlaps; the scaling is that kernel's,
// so a K layout and its uniform form give the same bits.
template <typename K, int Rows>
void k_tile_vnni512(const QuantizedRows& x, int64_t row, const KTileView& t, float* y, int64_t ldy, int64_t cols) {
  __m512 acc[Rows];
#pragma GCC unroll 4
  for (int r = 0; r < Rows; ++r) acc[r] = _mm512_setzero_ps();
  alignas(64) float scales[K::kGroups * 16], mins[K::kGroups * 16];
  for (int64_t b = 0; b < t.blocks; ++b) {
    const uint8_t* block = t.data + b * K::kBlockBytes;
    k_scales_512<K>(block, scales, mins);
#pragma GCC unroll 2
    for (int g = 0; g < K::kGroups; ++g) {
      const int64_t group = b * K::kGroups + g;
      k_prefetch_group_ahead<K>(block, g);
      __m512i operand[K::kGroup / 4];
      k_operands_512<K>(block, g, operand);
      __m512i sums[2][Rows];
#pragma GCC unroll 4
      for (int r = 0; r < Rows; ++r) {
        const int8_t* xq = x.q + (row + r) * x.k + group * K::kGroup;
        sums[0][r] = sums[1][r] = _mm512_setzero_si512();
#pragma GCC unroll 8
        for (int q = 0; q < K::kGroup / 4; ++q) {
          __m512i& sum = sums[q % 2][r];
          sum = _mm512_dpbusd_epi32(sum, operand[q], _mm512_set1_epi32(load_i32(xq + 4 * q)));
        }
      }
      const __m512 s = _mm512_load_ps(scales + 16 * g);
      const __m512 m = K::kMins ? _mm512_load_ps(mins + 16 * g) : _mm512_setzero_ps();
#pragma GCC unroll 4
      for (int r = 0; r < Rows; ++r) {
        const __m512i sum = _mm512_add_epi32(sums[0][r], sums[1][r]);
        const int64_t at = (row + r) * x.groups + group;
        const float d = x.d[at];
        if constexpr (K::kMins) {
          acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(s, _mm512_set1_ps(d)), acc[r]);
          acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(x.d_sums[at]), acc[r]);
        } else {
          const __m512i centred = _mm512_sub_epi32(sum, _mm512_set1_epi32(K::kZero * x.sums[at]));
          acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(centred), _mm512_mul_ps(s, _mm512_set1_ps(d)), acc[r]);
        }
      }
    }
  }
  const __mmask16 mask = static_cast<__mmask16>((1u << cols) - 1u);
#pragma GCC unroll 4
  for (int r = 0; r < Rows; ++r) _mm512_mask_storeu_ps(y + r * ldy, mask, acc[r]);
}
#endif

using KTileFn = void (*)(const QuantizedRows&, int64_t, const KTileView&, float*, int64_t, int64_t);

// A kind's K micro-kernels by rows (1 to 4, on every kind). A K group's operands are all unpacked before the rows
// run (8 registers for Q4_K and Q5_K), so 8 rows in one vnni512 tile ran out of registers: on a Zen 4, 8 rows of
// one 4,096 x 14,336 Q6_K weight took 4.0 ms in one tile where two tiles of 4 take 2.4 (Q4_K: 2.4 and 1.9 ms),
// and 64 rows the same either way.
template <typename K, QuantDot Dot>
struct KQuantKernels {
  static constexpr int kMaxRows = 4;

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
