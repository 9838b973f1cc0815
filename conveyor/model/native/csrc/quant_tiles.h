// The quantized kernels' micro-kernels: rows x 16 outputs of one tile of codes, for each dot-product kind
// (vnni512, vnni256, avx2, portable) and each compiled format (code width, group, scale type, min or zero
// point), and what they read: the activations quantized per group, the tile's raw views. quant_gemm.h
// describes the layout and runs these over a whole weight.

#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <utility>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define CONVEYOR_VNNI512 1
#define CONVEYOR_VNNI256 1
#elif defined(__AVXVNNI__) && defined(__AVX2__)
#define CONVEYOR_VNNI256 1
#endif
#if defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
#define CONVEYOR_AVX2 1
#endif

namespace conveyor {

constexpr int64_t kQuantTile = 16;  // outputs per tile, on every kernel

enum class QuantDot : int { kPortable = 0, kAvx2 = 1, kVnni256 = 2, kVnni512 = 3 };

// m rows of k activations as int8 codes q [m, k] with one step d per span of inputs [m, spans], each group's
// code sum [m, groups], and its span's d times it as a float (what a group's min multiplies: computed once per
// group, not once per tile it meets). The uniform layouts' span is their group; the super-block layouts'
// (kquant_tiles.h) is the super-block, 256 inputs, so that their sub-block scales apply to integer sums. The code
// sums are int16 (the kernels' groups are 16 or 32 codes, at most 32 * 127; quantize_rows refuses groups whose
// sums could overflow): two neighbouring groups' sums are then one int32 pair that a broadcast reads from memory
// as it is, the operand of the vpmaddwd or vpdpwssd that takes the super-block layouts' mins off.
struct QuantizedRows {
  const int8_t* q;
  const float* d;
  const int16_t* sums;
  const float* d_sums;
  int64_t k, groups, spans;
};

// ----- The formats a kernel is compiled for -----

// IQ4_NL's 16 non-linear levels (ggml's kvalues_iq4nl, which IQ4_XS shares), each plus 128: a 4-bit code is an
// index, and its weight is scale * (level - 128). Shifted so that a looked-up level is vpdpbusd's unsigned
// operand as it stands, the 128 taken off with the group's activation sum as any zero point is.
inline constexpr uint8_t kIq4Levels[16] = {1, 24, 45, 63, 79, 93, 106, 118, 129, 141, 153, 166, 181, 197, 217, 241};
constexpr int32_t kIq4Zero = 128;

// Bits: 4 (nibbles) or 8 (bytes); Group: 16 or 32 inputs; F16: float16 scales (else float32); Mins: a min per
// group (else the zero point); Full: 8-bit codes that use all 8 bits (Q8_0, and a join of it with other forms, which
// has mins), which vpmaddubsw's 16-bit pair sums cannot take whole (255 * 127 * 2 overflows them): the avx2 kernel
// takes them as signed magnitudes; Levels: 4-bit codes that index kIq4Levels (IQ4_NL), looked up in registers
// (vpshufb) into bytes as wide as Full's.
template <int Bits, int Group, bool F16, bool Mins, bool Full, bool Levels = false>
struct QuantFormat {
  static constexpr int kBits = Bits, kGroup = Group;
  static constexpr bool kF16 = F16, kMins = Mins, kFull = Full, kLevels = Levels;
  static constexpr int64_t kGroupBytes = kQuantTile * Group * Bits / 8;
};

inline float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1fu, mantissa = h & 0x3ffu;
  uint32_t bits;
  if (exponent == 0) {
    if (mantissa == 0) {
      bits = sign;
    } else {  // subnormal: value = mantissa * 2^-24
      const float value = std::ldexp(static_cast<float>(mantissa), -24);
      __builtin_memcpy(&bits, &value, sizeof bits);
      bits |= sign;
    }
  } else if (exponent == 31) {
    bits = sign | 0x7f800000u | (mantissa << 13);
  } else {
    bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
  }
  float f;
  __builtin_memcpy(&f, &bits, sizeof f);
  return f;
}

template <typename F>
inline float scale_at(const void* scales, int64_t i) {
  if constexpr (F::kF16) return half_to_float(static_cast<const uint16_t*>(scales)[i]);
  return static_cast<const float*>(scales)[i];
}

// The code of output c, input j of a group (0 <= j < Group), from its tile's group bytes (IQ4_NL: its level).
template <typename F>
inline int32_t code_at(const uint8_t* group_bytes, int64_t c, int64_t j) {
  if constexpr (F::kBits == 8) return group_bytes[(j / 4) * 64 + c * 4 + j % 4];
  const uint8_t byte = group_bytes[(j / 8) * 64 + c * 4 + j % 4];
  const int nibble = (j % 8) < 4 ? (byte & 0x0f) : (byte >> 4);
  return F::kLevels ? kIq4Levels[nibble] : nibble;
}

// A weight from its code: s * code + min, or s * (code - zero); every layout's lookups share it.
template <bool Mins>
inline float affine_weight(float s, float min, int32_t code, int32_t zero) {
  if constexpr (Mins) return s * static_cast<float>(code) + min;
  return s * static_cast<float>(code - zero);
}

// One output column's weights of a group, scaled: what dequantize_rows and the portable kernel share.
template <typename F>
inline float weight_value(const void* scales, const void* mins, int64_t at, int32_t code, int32_t zero) {
  return affine_weight<F::kMins>(scale_at<F>(scales, at), F::kMins ? scale_at<F>(mins, at) : 0.f, code, zero);
}

// One group of one row added to an output's sum, in plain C++: d * (s * sum + min * sum(xq)), or
// d * s * (sum - zero * sum(xq)); the portable kernels of every layout share it (scale_group_256 is its vector twin).
template <bool Mins>
inline float scale_group(float acc, int32_t sum, float s, float min, const QuantizedRows& x, int64_t at,
                         int32_t zero) {
  const float d = x.d[at];
  if constexpr (Mins) return acc + (static_cast<float>(sum) * (s * d) + min * x.d_sums[at]);
  return acc + static_cast<float>(sum - zero * x.sums[at]) * (s * d);
}

// A weight's raw views for one tile.
struct QuantTileView {
  const uint8_t* codes;
  const void* scales;
  const void* mins;
  int64_t groups;
  int32_t zero;
};

// ----- Kernels: rows x 16 outputs of one tile -----

// Plain C++: any CPU, and the reference for the vector kernels' arithmetic (integer sums per group, then one
// float multiply-add per group as they do).
template <typename F, int Rows>
void quant_tile_portable(const QuantizedRows& x, int64_t row, const QuantTileView& t, float* y, int64_t ldy,
                         int64_t cols) {
  for (int64_t r = 0; r < Rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      float acc = 0.f;
      for (int64_t g = 0; g < t.groups; ++g) {
        const uint8_t* bytes = t.codes + g * F::kGroupBytes;
        const int8_t* xq = x.q + (row + r) * x.k + g * F::kGroup;
        int32_t sum = 0;
        for (int64_t j = 0; j < F::kGroup; ++j) sum += code_at<F>(bytes, c, j) * xq[j];
        const float min = F::kMins ? scale_at<F>(t.mins, g * kQuantTile + c) : 0.f;
        acc = scale_group<F::kMins>(acc, sum, scale_at<F>(t.scales, g * kQuantTile + c), min, x,
                                    (row + r) * x.groups + g, t.zero);
      }
      y[r * ldy + c] = acc;
    }
  }
}

// A few rows are a stream of the weight's bytes with little work on each, and one core keeps too few of its
// reads in flight for memory to deliver its bandwidth: Q4_1 codes streamed at 15-19 GB/s on one Zen 4 core
// where the float32 GEMV reads 33 (its kernel spends one load and one FMA on 64 bytes, this one about 40
// instructions on a group's 320). So each group asks for the bytes kQuantAhead further on, codes, scales and
// mins alike; the codes of a thread's tiles lie one after another, so "further on" runs into its next tiles.
// Measured over the default model's 120 layer weights in turn, 2 threads: 2.29 ms without, 2.00 ms 4 KiB ahead
// (1, 2, 6 and 8 KiB were no better).
constexpr int64_t kQuantAhead = 4096;

template <typename F>
inline void prefetch_group_ahead(const QuantTileView& t, int64_t g) {
  const uint8_t* codes = t.codes + g * F::kGroupBytes + kQuantAhead;
#pragma GCC unroll 8
  for (int64_t line = 0; line < F::kGroupBytes; line += 64) __builtin_prefetch(codes + line, 0, 3);
  // The scales and mins of a group are 16 values: 1/8 (float16) or 1/4 (float32) of a 4-bit group's codes.
  constexpr int64_t scale_bytes = kQuantTile * (F::kF16 ? 2 : 4);
  constexpr int64_t scales_ahead = kQuantAhead * scale_bytes / F::kGroupBytes;
  __builtin_prefetch(static_cast<const uint8_t*>(t.scales) + g * scale_bytes + scales_ahead, 0, 3);
  if constexpr (F::kMins) __builtin_prefetch(static_cast<const uint8_t*>(t.mins) + g * scale_bytes + scales_ahead, 0, 3);
}

inline int32_t load_i32(const int8_t* p) {
  int32_t v;
  __builtin_memcpy(&v, p, sizeof v);
  return v;
}

#if defined(CONVEYOR_VNNI512)
// 4-bit codes [0, 16) in bytes as vpdpbusd's unsigned operand: themselves, or (Levels) their kIq4Levels, looked up
// 64 at a time (vpshufb looks up within each 128-bit lane, so the table is in all four).
template <bool Levels>
inline __m512i code_bytes_512(__m512i nibbles) {
  if constexpr (!Levels) return nibbles;
  const __m512i table = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kIq4Levels)));
  return _mm512_shuffle_epi8(table, nibbles);
}

template <typename F>
inline __m512 load_scales16(const void* p, int64_t g) {
  if constexpr (F::kF16) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(p) +
                                                                               g * kQuantTile)));
  }
  return _mm512_loadu_ps(static_cast<const float*>(p) + g * kQuantTile);
}

// 512 bits: one zmm holds a row's 16 outputs. Per group each row's integer sum gets registers of its own, reset
// per group, so that successive groups are independent chains the core overlaps; with few rows, two of them
// (the low and the high nibbles' products, or alternate quads), which halves the chain of vpdpbusd a group
// waits on: a single chain of 8 held one row to 42 GB/s of codes per core from cache, too close to what
// memory delivers to stay at its bound.
template <typename F, int Rows>
void quant_tile_vnni512(const QuantizedRows& x, int64_t row, const QuantTileView& t, float* y, int64_t ldy,
                        int64_t cols) {
  constexpr int split = Rows <= 4 ? 2 : 1;
  __m512 acc[Rows];
#pragma GCC unroll 8
  for (int r = 0; r < Rows; ++r) acc[r] = _mm512_setzero_ps();
  const __m512i low = _mm512_set1_epi8(0x0f);
  for (int64_t g = 0; g < t.groups; ++g) {
    const uint8_t* bytes = t.codes + g * F::kGroupBytes;
    if constexpr (Rows <= 4) prefetch_group_ahead<F>(t, g);
    __m512i sums[split][Rows];
#pragma GCC unroll 8
    for (int r = 0; r < Rows; ++r) {
      for (int part = 0; part < split; ++part) sums[part][r] = _mm512_setzero_si512();
    }
    if constexpr (F::kBits == 4) {
#pragma GCC unroll 4
      for (int o = 0; o < F::kGroup / 8; ++o) {
        const __m512i v = _mm512_loadu_si512(bytes + 64 * o);
        const __m512i lo = code_bytes_512<F::kLevels>(_mm512_and_si512(v, low));
        const __m512i hi = code_bytes_512<F::kLevels>(_mm512_and_si512(_mm512_srli_epi16(v, 4), low));
#pragma GCC unroll 8
        for (int r = 0; r < Rows; ++r) {
          const int8_t* xq = x.q + (row + r) * x.k + g * F::kGroup + 8 * o;
          sums[0][r] = _mm512_dpbusd_epi32(sums[0][r], lo, _mm512_set1_epi32(load_i32(xq)));
          sums[split - 1][r] = _mm512_dpbusd_epi32(sums[split - 1][r], hi, _mm512_set1_epi32(load_i32(xq + 4)));
        }
      }
    } else {
#pragma GCC unroll 8
      for (int quad = 0; quad < F::kGroup / 4; ++quad) {
        const __m512i v = _mm512_loadu_si512(bytes + 64 * quad);
#pragma GCC unroll 8
        for (int r = 0; r < Rows; ++r) {
          const int8_t* xq = x.q + (row + r) * x.k + g * F::kGroup + 4 * quad;
          __m512i& sum = sums[quad % split][r];
          sum = _mm512_dpbusd_epi32(sum, v, _mm512_set1_epi32(load_i32(xq)));
        }
      }
    }
    __m512i sum[Rows];
#pragma GCC unroll 8
    for (int r = 0; r < Rows; ++r) sum[r] = split == 2 ? _mm512_add_epi32(sums[0][r], sums[split - 1][r]) : sums[0][r];
    const __m512 s = load_scales16<F>(t.scales, g);
    [[maybe_unused]] __m512 mins;
    if constexpr (F::kMins) mins = load_scales16<F>(t.mins, g);
#pragma GCC unroll 8
    for (int r = 0; r < Rows; ++r) {
      const int64_t at = (row + r) * x.groups + g;
      const float d = x.d[at];
      if constexpr (F::kMins) {
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[r]), _mm512_mul_ps(s, _mm512_set1_ps(d)), acc[r]);
        acc[r] = _mm512_fmadd_ps(mins, _mm512_set1_ps(x.d_sums[at]), acc[r]);
      } else {
        const __m512i centred = _mm512_sub_epi32(sum[r], _mm512_set1_epi32(t.zero * x.sums[at]));
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(centred), _mm512_mul_ps(s, _mm512_set1_ps(d)), acc[r]);
      }
    }
  }
  const __mmask16 mask = static_cast<__mmask16>((1u << cols) - 1u);
#pragma GCC unroll 8
  for (int r = 0; r < Rows; ++r) _mm512_mask_storeu_ps(y + r * ldy, mask, acc[r]);
}
#endif

#if defined(CONVEYOR_AVX2)
// u8 codes . s8 activations, 4 at a time, added to 8 int32 lanes: vpdpbusd where the CPU has VNNI, else
// vpmaddubsw (pairs to int16) and vpmaddwd (pairs of those to int32). The codes must be under 128 without VNNI:
// a pair of larger ones times 127 overflows vpmaddubsw's int16 (group_sums_256 takes full 8-bit codes apart).
template <bool Vnni>
inline __m256i dot4x8(__m256i acc, __m256i codes, __m256i x) {
#if defined(CONVEYOR_VNNI256)
  if constexpr (Vnni) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(acc, codes, x);
#else
    return _mm256_dpbusd_avx_epi32(acc, codes, x);
#endif
  }
#endif
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(codes, x), _mm256_set1_epi16(1)));
}

// IQ4's 4-bit codes looked up into bytes, 32 at a time (vpshufb, within each 128-bit lane): their levels,
// VNNI's unsigned operand; or, Signed, the levels less 128 (|level - 128| <= 127), which vpmaddubsw takes as
// magnitudes with the signs moved onto the activations, as Q8_0's bytes: the levels' own pair sums, up to
// 2 * 241 * 127, would overflow its int16.
template <bool Signed>
inline __m256i levels_256(__m256i nibbles) {
  __m256i table = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kIq4Levels)));
  if constexpr (Signed) table = _mm256_xor_si256(table, _mm256_set1_epi8(static_cast<char>(0x80)));
  return _mm256_shuffle_epi8(table, nibbles);
}

// One group's integer sums, sum(code * xq), for Rows rows against one half of a tile (8 outputs, int32 lanes).
// Without VNNI the multiplies bound the kernel (vpmaddubsw and vpmaddwd share the core's multiply pipes: a Zen 3
// core read Q4_1 from cache at 15 GB/s with both for every 4 inputs), so each is made to count:
// - 4-bit codes: vpmaddubsw's int16 pair sums add up over the whole group before one vpmaddwd (8 of them, each
//   at most 2 * 15 * 127, stay under 32,767);
// - full 8-bit codes (Q8_0's, zero point 128, or a join's with mins): taken as signed bytes code - 128, whose
//   magnitude is vpmaddubsw's unsigned operand and whose sign moves onto the activation (vpsignb): one vpmaddubsw
//   and one vpmaddwd for 4 inputs where splitting the codes into nibbles took two of each (the pair sums, at most
//   2 * 128 * 127, fit); 128 * sum(xq) then makes them the codes' sums again. IQ4_NL's levels go the same way.
// Both give the same integers as the plain way, so the outputs are the same to the bit.
template <typename F, int Rows, bool Vnni>
inline void group_sums_256(const QuantizedRows& x, int64_t row, int64_t g, const uint8_t* bytes, __m256i* sum) {
  const __m256i ones = _mm256_set1_epi16(1);
  const auto xq = [&](int r, int input) {
    return _mm256_set1_epi32(load_i32(x.q + (row + r) * x.k + g * F::kGroup + input));
  };
#pragma GCC unroll 4
  for (int r = 0; r < Rows; ++r) sum[r] = _mm256_setzero_si256();
  if constexpr (F::kLevels && !Vnni) {
    const __m256i low = _mm256_set1_epi8(0x0f);
#pragma GCC unroll 4
    for (int o = 0; o < F::kGroup / 8; ++o) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bytes + 64 * o));
      const __m256i centred[2] = {levels_256<true>(_mm256_and_si256(v, low)),
                                  levels_256<true>(_mm256_and_si256(_mm256_srli_epi16(v, 4), low))};
      const __m256i magnitude[2] = {_mm256_abs_epi8(centred[0]), _mm256_abs_epi8(centred[1])};
#pragma GCC unroll 4
      for (int r = 0; r < Rows; ++r) {
#pragma GCC unroll 2
        for (int h = 0; h < 2; ++h) {
          const __m256i signed_x = _mm256_sign_epi8(xq(r, 8 * o + 4 * h), centred[h]);
          sum[r] = _mm256_add_epi32(sum[r], _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude[h], signed_x), ones));
        }
      }
    }
#pragma GCC unroll 4
    for (int r = 0; r < Rows; ++r) {
      sum[r] = _mm256_add_epi32(sum[r], _mm256_set1_epi32(kIq4Zero * x.sums[(row + r) * x.groups + g]));
    }
  } else if constexpr (F::kBits == 4) {
    const __m256i low = _mm256_set1_epi8(0x0f);
    __m256i pairs[Rows];
#pragma GCC unroll 4
    for (int r = 0; r < Rows; ++r) pairs[r] = _mm256_setzero_si256();
#pragma GCC unroll 4
    for (int o = 0; o < F::kGroup / 8; ++o) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bytes + 64 * o));
      __m256i lo = _mm256_and_si256(v, low), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
      if constexpr (F::kLevels) lo = levels_256<false>(lo), hi = levels_256<false>(hi);  // VNNI only: see above
#pragma GCC unroll 4
      for (int r = 0; r < Rows; ++r) {
        if constexpr (Vnni) {
          sum[r] = dot4x8<true>(dot4x8<true>(sum[r], lo, xq(r, 8 * o)), hi, xq(r, 8 * o + 4));
        } else {
          pairs[r] = _mm256_add_epi16(pairs[r], _mm256_maddubs_epi16(lo, xq(r, 8 * o)));
          pairs[r] = _mm256_add_epi16(pairs[r], _mm256_maddubs_epi16(hi, xq(r, 8 * o + 4)));
        }
      }
    }
    if constexpr (!Vnni) {
#pragma GCC unroll 4
      for (int r = 0; r < Rows; ++r) sum[r] = _mm256_madd_epi16(pairs[r], ones);
    }
  } else if constexpr (F::kFull && !Vnni) {
    const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
#pragma GCC unroll 8
    for (int quad = 0; quad < F::kGroup / 4; ++quad) {
      const __m256i centred = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(bytes + 64 * quad)),
                                               flip);
      const __m256i magnitude = _mm256_abs_epi8(centred);
#pragma GCC unroll 4
      for (int r = 0; r < Rows; ++r) {
        const __m256i signed_x = _mm256_sign_epi8(xq(r, 4 * quad), centred);
        sum[r] = _mm256_add_epi32(sum[r], _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude, signed_x), ones));
      }
    }
#pragma GCC unroll 4
    for (int r = 0; r < Rows; ++r) sum[r] = _mm256_add_epi32(sum[r], _mm256_set1_epi32(128 * x.sums[(row + r) * x.groups + g]));
  } else {
#pragma GCC unroll 8
    for (int quad = 0; quad < F::kGroup / 4; ++quad) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bytes + 64 * quad));
#pragma GCC unroll 4
      for (int r = 0; r < Rows; ++r) sum[r] = dot4x8<Vnni>(sum[r], v, xq(r, 4 * quad));
    }
  }
}

template <typename F>
inline __m256 load_scales8(const void* p, int64_t at) {
  if constexpr (F::kF16) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(p) + at)));
  }
  return _mm256_loadu_ps(static_cast<const float*>(p) + at);
}

// One group of one row scaled into its 8 outputs' sums: acc + d * (s * sum + mins * sum(xq)), or, with a zero
// point, acc + d * s * (sum - zero * sum(xq)): the arithmetic every 256-bit kernel shares, uniform or K layout.
template <bool Mins>
inline __m256 scale_group_256(__m256 acc, __m256i sum, __m256 s, __m256 mins, const QuantizedRows& x, int64_t at,
                              int32_t zero) {
  const float d = x.d[at];
  if constexpr (Mins) {
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_mul_ps(s, _mm256_set1_ps(d)), acc);
    return _mm256_fmadd_ps(mins, _mm256_set1_ps(x.d_sums[at]), acc);
  }
  const __m256i centred = _mm256_sub_epi32(sum, _mm256_set1_epi32(zero * x.sums[at]));
  return _mm256_fmadd_ps(_mm256_cvtepi32_ps(centred), _mm256_mul_ps(s, _mm256_set1_ps(d)), acc);
}

// A row's 8 outputs, or the first `cols` of them.
inline void store_outputs_256(float* y, __m256 v, int64_t cols) {
  if (cols >= 8) {
    _mm256_storeu_ps(y, v);
    return;
  }
  alignas(32) float part[8];
  _mm256_store_ps(part, v);
  std::copy(part, part + cols, y);
}

// 256 bits: one half of the tile (outputs 8 * half .. 8 * half + 7, the half of each 64-byte vector) for Rows
// rows; the tile takes two passes, the second finding the tile's bytes in L1.
template <typename F, int Rows, bool Vnni>
void quant_half_tile_256(const QuantizedRows& x, int64_t row, const QuantTileView& t, int half, float* y,
                         int64_t ldy, int64_t cols) {
  __m256 acc[Rows];
#pragma GCC unroll 4
  for (int r = 0; r < Rows; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < t.groups; ++g) {
    const uint8_t* bytes = t.codes + g * F::kGroupBytes + 32 * half;
    if constexpr (Rows <= 4) {
      if (half == 0) prefetch_group_ahead<F>(t, g);  // the second pass finds the tile in L1
    }
    __m256i sum[Rows];
    group_sums_256<F, Rows, Vnni>(x, row, g, bytes, sum);
    const __m256 s = load_scales8<F>(t.scales, g * kQuantTile + 8 * half);
    const __m256 mins = F::kMins ? load_scales8<F>(t.mins, g * kQuantTile + 8 * half) : _mm256_setzero_ps();
#pragma GCC unroll 4
    for (int r = 0; r < Rows; ++r) {
      acc[r] = scale_group_256<F::kMins>(acc[r], sum[r], s, mins, x, (row + r) * x.groups + g, t.zero);
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < Rows; ++r) store_outputs_256(y + r * ldy, acc[r], cols);
}

template <typename F, int Rows, bool Vnni>
void quant_tile_256(const QuantizedRows& x, int64_t row, const QuantTileView& t, float* y, int64_t ldy,
                    int64_t cols) {
  quant_half_tile_256<F, Rows, Vnni>(x, row, t, 0, y, ldy, std::min<int64_t>(cols, 8));
  if (cols > 8) quant_half_tile_256<F, Rows, Vnni>(x, row, t, 1, y + 8, ldy, cols - 8);
}
#endif

using QuantTileFn = void (*)(const QuantizedRows&, int64_t, const QuantTileView&, float*, int64_t, int64_t);

// A kind's micro-kernels by rows (1 to its most), and the most rows it keeps in registers.
template <typename F, QuantDot Dot>
struct QuantKernels {
  static constexpr int kMaxRows = Dot == QuantDot::kVnni512 ? 8 : 4;

  template <int Rows>
  static void tile(const QuantizedRows& x, int64_t row, const QuantTileView& t, float* y, int64_t ldy,
                   int64_t cols) {
#if defined(CONVEYOR_VNNI512)
    if constexpr (Dot == QuantDot::kVnni512) return quant_tile_vnni512<F, Rows>(x, row, t, y, ldy, cols);
#endif
#if defined(CONVEYOR_AVX2)
    if constexpr (Dot == QuantDot::kVnni256) return quant_tile_256<F, Rows, true>(x, row, t, y, ldy, cols);
    if constexpr (Dot == QuantDot::kAvx2) return quant_tile_256<F, Rows, false>(x, row, t, y, ldy, cols);
#endif
    quant_tile_portable<F, Rows>(x, row, t, y, ldy, cols);
  }

  template <int... Rows>
  static constexpr std::array<QuantTileFn, sizeof...(Rows) + 1> table(std::integer_sequence<int, Rows...>) {
    return {nullptr, &tile<Rows + 1>...};
  }
  static QuantTileFn at(int rows) {
    static constexpr auto fns = table(std::make_integer_sequence<int, kMaxRows>{});
    return fns[rows];
  }
};

}  // namespace conveyor
