// Linear layers on quantized weights, kept as the integer codes a GGUF file ships (Q8_0, Q4_0, Q4_1, the K
// formats): a decode step reads each weight's 4 or 8 bits instead of float32's 32, and that is its speed, since
// batch 1 is bound by the bytes it reads.
//
// A weight [N, K] is codes per group of 32 (or 16) inputs, with a float scale per (output, group) and either a
// float min per (output, group) or one zero point:  w = scale * code + min,  or  w = scale * (code - zero).
// The activations are quantized too, to int8 per group (d = max|x| / 127, llama.cpp's Q8 way), so that the
// products are integer dot products: 64 multiply-adds in one AVX512-VNNI vpdpbusd, 32 in AVX2's vpmaddubsw
// pair, against 16 (or 8) in a float32 FMA. Per group and output the integer sum is scaled once:
//     y += d_x * (scale * sum(code * xq) + min * sum(xq))        (or scale * (sum(code * xq) - zero * sum(xq))).
//
// Layout (conveyor/model/quant/formats.py packs it): tiles of 16 outputs; per tile and group, 64-byte vectors
// that each hold 4 consecutive inputs of all 16 outputs (lane c = output c, 4 bytes of inputs side by side: the
// operand of a vpdpbusd against a broadcast of 4 activations). 8-bit codes: one vector per 4 inputs; 4-bit
// codes: one per 8 inputs, the first 4 in the low nibbles and the next 4 in the high ones. Then the tile's
// scales [groups, 16] (float16 or float32) and mins likewise. The layout is the same for every vector width:
// a 256-bit kernel takes each vector's halves (outputs 0-7, 8-15) in two passes.
//
// The dot-product kinds: vnni512 (AVX512-VNNI), vnni256 (AVX-VNNI, or AVX512-VNNI on 256-bit registers),
// avx2 (vpmaddubsw + vpmaddwd: no VNNI needed) and portable (plain C++, any CPU). A machine may have several;
// the engine runs the one it measures fastest, and the tests hold each to the same reference.

#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "gemm.h"
#include "kquant_tiles.h"
#include "parallel.h"
#include "quant_tiles.h"
#include "vec.h"

namespace conveyor {

inline const char* quant_dot_name(QuantDot dot) {
  switch (dot) {
    case QuantDot::kPortable: return "portable";
    case QuantDot::kAvx2: return "avx2";
    case QuantDot::kVnni256: return "vnni256";
    case QuantDot::kVnni512: return "vnni512";
  }
  return "?";
}

// The dot-product kinds this build has, the fastest kind of each width last.
inline std::vector<std::string> quant_dots() {
  std::vector<std::string> dots{"portable"};
#if defined(CONVEYOR_AVX2)
  dots.push_back("avx2");
#endif
#if defined(CONVEYOR_VNNI256)
  dots.push_back("vnni256");
#endif
#if defined(CONVEYOR_VNNI512)
  dots.push_back("vnni512");
#endif
  return dots;
}

inline QuantDot parse_quant_dot(const std::string& name) {
  for (const auto& have : quant_dots()) {
    if (have == name) {
      for (int dot = 0; dot <= 3; ++dot) {
        if (name == quant_dot_name(static_cast<QuantDot>(dot))) return static_cast<QuantDot>(dot);
      }
    }
  }
  std::string have;
  for (const auto& kind : quant_dots()) have += (have.empty() ? "" : ", ") + kind;
  CONVEYOR_CHECK(false, "no quantized dot product '", name, "' in this build (it has ", have, ")");
  return QuantDot::kPortable;
}

// The best kind for a stack of `width` bits: 512 runs vnni512 where the build has it; 256 the widest 256-bit kind.
inline QuantDot default_quant_dot(int64_t width) {
#if defined(CONVEYOR_VNNI512)
  if (width == 512) return QuantDot::kVnni512;
#endif
  (void)width;
#if defined(CONVEYOR_VNNI256)
  return QuantDot::kVnni256;
#elif defined(CONVEYOR_AVX2)
  return QuantDot::kAvx2;
#else
  return QuantDot::kPortable;
#endif
}

// A quantized weight as the kernels take it: the uniform tiles' packed codes, scales and mins (no mins: the
// zero point), or a K layout's blocks (codes [tiles, super-blocks, block bytes]; no scales or mins), or the
// concatenation along the outputs of `parts`, each its own format (a Q4_K_M file's q/k/v: Q4_K beside Q6_K).
// Plain pointers: whoever made it keeps the memory alive through `owner` (the torch module: its tensors).
struct QuantWeight {
  const uint8_t* codes_data = nullptr;
  const uint8_t* scales_data = nullptr;
  const uint8_t* mins_data = nullptr;
  int64_t n = 0, k = 0, group = 32, storage_bits = 4, code_bits = 4, zero_point = 0;
  bool scales_f16 = true;  // scales and mins in float16 (else float32)
  bool levels = false;     // 4-bit codes that index kIq4Levels (IQ4_NL), zero point 128
  int64_t own_bytes = 0;   // this weight's codes, scales and mins (its parts' are theirs)
  QuantLayout layout = QuantLayout::kTiles;
  std::vector<QuantWeight> parts;
  std::shared_ptr<const void> owner;

  int64_t tiles() const { return (n + kQuantTile - 1) / kQuantTile; }
  int64_t groups() const { return k / group; }
  // The inputs one activation step covers: a group of the uniform layouts, a super-block of the others.
  int64_t activation_span() const { return layout == QuantLayout::kTiles ? group : kSuperBlock; }
  int64_t group_bytes() const { return kQuantTile * group * storage_bits / 8; }
  bool f16() const { return scales_f16; }
  bool has_mins() const { return mins_data != nullptr; }
  int64_t bytes() const {
    int64_t total = own_bytes;
    for (const QuantWeight& part : parts) total += part.bytes();
    return total;
  }
};

// A uniform-tile weight [n, k] over packed memory: codes uint8 [tiles, groups, group bytes], scales (and mins,
// or nullptr for a zero point) [tiles, groups, 16] in float16 or float32; `levels`: the codes index kIq4Levels.
inline QuantWeight quant_weight(const uint8_t* codes, const void* scales, const void* mins, bool f16, int64_t n,
                                int64_t k, int64_t group, int64_t storage_bits, int64_t code_bits,
                                int64_t zero_point, bool levels = false) {
  CONVEYOR_CHECK(group == 16 || group == 32, "a quantized weight's group is 16 or 32 inputs, not ", group);
  CONVEYOR_CHECK(storage_bits == 4 || storage_bits == 8, "codes are stored in 4 or 8 bits, not ", storage_bits);
  CONVEYOR_CHECK(storage_bits == 8 || group == 32, "4-bit codes come in groups of 32");
  CONVEYOR_CHECK(code_bits >= 1 && code_bits <= storage_bits, "codes of ", code_bits, " bits do not fit ",
                 storage_bits);
  CONVEYOR_CHECK(n > 0 && k > 0 && k % group == 0, "a [", n, ", ", k, "] weight is no whole number of groups of ",
                 group);
  CONVEYOR_CHECK(!levels || (storage_bits == 4 && code_bits == 4 && mins == nullptr && zero_point == kIq4Zero),
                 "IQ4 levels are indexed by 4-bit codes, with zero point ", kIq4Zero, " and no mins");
  CONVEYOR_CHECK(mins != nullptr || levels || (zero_point >= 0 && zero_point < (int64_t{1} << code_bits)),
                 "zero point ", zero_point, " outside the codes' range");
  QuantWeight w;
  w.codes_data = codes;
  w.scales_data = static_cast<const uint8_t*>(scales);
  w.mins_data = static_cast<const uint8_t*>(mins);
  w.n = n, w.k = k, w.group = group, w.storage_bits = storage_bits, w.code_bits = code_bits;
  w.zero_point = zero_point;
  w.scales_f16 = f16;
  w.levels = levels;
  const int64_t scale_bytes = w.tiles() * w.groups() * kQuantTile * (f16 ? 2 : 4);
  w.own_bytes = w.tiles() * w.groups() * w.group_bytes() + scale_bytes * (mins != nullptr ? 2 : 1);
  return w;
}

// The super-block layouts by their GGUF type names.
inline constexpr std::pair<const char*, QuantLayout> kSuperBlockTypes[] = {
    {"Q4_K", QuantLayout::kQ4K},     {"Q5_K", QuantLayout::kQ5K}, {"Q6_K", QuantLayout::kQ6K},
    {"IQ4_XS", QuantLayout::kIQ4XS}, {"Q3_K", QuantLayout::kQ3K}, {"Q2_K", QuantLayout::kQ2K},
};

// The super-block layout of a GGUF type name; a clear error for any other.
inline QuantLayout k_layout(const std::string& type) {
  std::string names;
  for (const auto& [name, layout] : kSuperBlockTypes) {
    if (type == name) return layout;
    names += (names.empty() ? "" : ", ") + std::string(name);
  }
  CONVEYOR_CHECK(false, "no super-block layout for ", type, " (", names, ")");
  return QuantLayout::kTiles;
}

// Runs f(KFormat<L>{}) for a super-block layout L (the uniform tiles are none).
template <typename Fn>
auto with_k_format(QuantLayout layout, const Fn& f) {
  switch (layout) {
    case QuantLayout::kQ4K: return f(KFormat<QuantLayout::kQ4K>{});
    case QuantLayout::kQ5K: return f(KFormat<QuantLayout::kQ5K>{});
    case QuantLayout::kQ6K: return f(KFormat<QuantLayout::kQ6K>{});
    case QuantLayout::kIQ4XS: return f(KFormat<QuantLayout::kIQ4XS>{});
    case QuantLayout::kQ3K: return f(KFormat<QuantLayout::kQ3K>{});
    case QuantLayout::kQ2K: return f(KFormat<QuantLayout::kQ2K>{});
    case QuantLayout::kTiles: break;
  }
  CONVEYOR_CHECK(false, "the uniform tiles are no super-block layout");
  return f(KFormat<QuantLayout::kQ4K>{});  // not reached: the check throws
}

inline int64_t k_block_bytes(QuantLayout layout) {
  return with_k_format(layout, [](auto format) { return decltype(format)::kBlockBytes; });
}

// A super-block weight [n, k] over its blocks in kquant_tiles.h's layout: uint8 [tiles, k / 256, block bytes].
inline QuantWeight k_quant_weight(const uint8_t* blocks, const std::string& type, int64_t n, int64_t k) {
  QuantWeight w;
  w.layout = k_layout(type);
  CONVEYOR_CHECK(n > 0 && k > 0 && k % kSuperBlock == 0, "a [", n, ", ", k, "] ", type,
                 " weight is no whole number of ", kSuperBlock, "-input super-blocks");
  w.n = n;
  w.k = k;
  with_k_format(w.layout, [&](auto format) {
    using K = decltype(format);
    w.group = K::kGroup;
    w.code_bits = w.storage_bits = K::kLowBits + K::kHighBits;
  });
  w.scales_f16 = false;
  w.codes_data = blocks;
  w.own_bytes = w.tiles() * (k / kSuperBlock) * k_block_bytes(w.layout);
  return w;
}

// Weights of one input width stacked along their outputs, each run by its own format's kernel.
inline QuantWeight join_quant_weights(const std::vector<QuantWeight>& parts) {
  CONVEYOR_CHECK(!parts.empty(), "nothing to join");
  QuantWeight w;
  w.k = parts.front().k;
  for (const QuantWeight& part : parts) {
    CONVEYOR_CHECK(part.k == w.k, "parts of ", part.k, " and ", w.k, " inputs cannot be joined");
    CONVEYOR_CHECK(part.parts.empty(), "a joined weight's parts are not joined weights themselves");
    w.n += part.n;
  }
  w.parts = parts;
  return w;
}

// ----- Activations quantized to int8 per span (QuantizedRows, quant_tiles.h) -----

// One span of a row: d = max|x| / 127 over the span, q = round(x * (127 / max|x|)) to nearest even (a zero span:
// all zero), and each group's code sum. In float32 throughout, so that the Python reference
// (quant_formats.quantize_activations) rounds alike: the product is rounded to float first, then to an integer
// (never fused into one rounding).
inline void quantize_span(const float* x, int64_t span, int64_t group, int8_t* q, float* d, int16_t* sums) {
#if defined(CONVEYOR_AVX2)
  // A step runs over a hundred of these per row; scalar nearbyint cost a tenth of a batch-1 step.
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 top = _mm256_setzero_ps();
  for (int64_t i = 0; i < span; i += 8) top = _mm256_max_ps(top, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + i)));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, top);
  float amax = 0.f;
  for (const float lane : lanes) amax = std::max(amax, lane);
  *d = amax / 127.f;
  const __m256 id = _mm256_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
  for (int64_t g = 0; g < span; g += group) {
    __m256i total = _mm256_setzero_si256();
    for (int64_t i = g; i < g + group; i += 8) {
      const __m256i v = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + i), id));  // MXCSR: nearest even
      total = _mm256_add_epi32(total, v);
      const __m128i packed16 = _mm_packs_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
      const __m128i packed8 = _mm_packs_epi16(packed16, packed16);
      _mm_storel_epi64(reinterpret_cast<__m128i*>(q + i), packed8);
    }
    alignas(32) int32_t lane_sums[8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(lane_sums), total);
    int32_t sum = 0;
    for (const int32_t lane : lane_sums) sum += lane;
    sums[g / group] = static_cast<int16_t>(sum);
  }
#else
  float amax = 0.f;
  for (int64_t i = 0; i < span; ++i) amax = std::max(amax, std::fabs(x[i]));
  *d = amax / 127.f;
  const float id = amax > 0.f ? 127.f / amax : 0.f;
  for (int64_t g = 0; g < span; g += group) {
    int32_t total = 0;
    for (int64_t i = g; i < g + group; ++i) {
      const float scaled = x[i] * id;
      const int32_t v = static_cast<int32_t>(std::nearbyint(scaled));
      q[i] = static_cast<int8_t>(v);
      total += v;
    }
    sums[g / group] = static_cast<int16_t>(total);
  }
#endif
}

// Into buffers of the calling thread's, reused by every GEMM it runs (a step runs over a hundred). `span`: the
// inputs one step covers, a multiple of `group` (the weight's activation_span()).
inline QuantizedRows quantize_rows(const float* x, int64_t m, int64_t k, int64_t group, int64_t span) {
  thread_local std::vector<int8_t> q;
  thread_local std::vector<float> d;
  thread_local std::vector<int16_t> sums;
  thread_local std::vector<float> d_sums;
  CONVEYOR_CHECK(span % group == 0 && k % span == 0, "activations of ", k, " inputs in spans of ", span,
                 " and groups of ", group);
  CONVEYOR_CHECK(group * 127 <= INT16_MAX, "groups of ", group, " inputs: their code sums are int16 (at most 258)");
  const int64_t groups = k / group, spans = k / span, per_span = span / group;
  if (static_cast<int64_t>(q.size()) < m * k) q.resize(m * k);
  if (static_cast<int64_t>(sums.size()) < m * groups) {
    d.resize(m * groups);
    sums.resize(m * groups);
    d_sums.resize(m * groups);
  }
  int8_t* qp = q.data();
  float* dp = d.data();
  int16_t* sp = sums.data();
  float* dsp = d_sums.data();
  parallel_for(0, m, 16, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      for (int64_t s = 0; s < spans; ++s) {
        const int64_t at = row * groups + s * per_span;
        quantize_span(x + row * k + s * span, span, group, qp + row * k + s * span, dp + row * spans + s, sp + at);
        for (int64_t g = at; g < at + per_span; ++g) dsp[g] = dp[row * spans + s] * static_cast<float>(sp[g]);
      }
    }
  });
  return {qp, dp, sp, dsp, k, groups, spans};
}

// x [m, w.k] quantized as w's kernels take it: per w's group, one step per its activation_span().
inline QuantizedRows quantize_rows(const float* x, int64_t m, const QuantWeight& w) {
  return quantize_rows(x, m, w.k, w.group, w.activation_span());
}

template <typename F>
inline QuantTileView tile_view(const QuantWeight& w, int64_t tile) {
  const int64_t scale_bytes = F::kF16 ? 2 : 4, groups = w.k / F::kGroup;
  const int64_t scale_offset = tile * groups * kQuantTile * scale_bytes;
  return {w.codes_data + tile * groups * F::kGroupBytes, w.scales_data + scale_offset,
          w.mins_data ? w.mins_data + scale_offset : nullptr, groups, static_cast<int32_t>(w.zero_point)};
}

// Runs f(F{}) with the compiled format of a weight.
template <typename Fn>
void with_quant_format(const QuantWeight& w, const Fn& f) {
  // Full: codes of all 8 bits, with a zero point (Q8_0) or with mins (Q8_0 joined with parts of another zero
  // point, as Gemma 3's Q4_K_M q/k/v: Q5_0 beside Q8_0), which the AVX2 kernel must centre either way.
  const bool f16 = w.f16(), mins = w.has_mins(), full = w.code_bits == 8;
  const auto pick = [&](auto bits, auto group) {
    constexpr int B = decltype(bits)::value, G = decltype(group)::value;
    const auto with_mins = [&](auto f16_scales, auto is_full) {
      constexpr bool S = decltype(f16_scales)::value, U = decltype(is_full)::value;
      return mins ? f(QuantFormat<B, G, S, true, U>{}) : f(QuantFormat<B, G, S, false, U>{});
    };
    const auto with_full = [&](auto f16_scales) {
      if constexpr (B == 8) {
        if (full) return with_mins(f16_scales, std::true_type{});
      }
      return with_mins(f16_scales, std::false_type{});
    };
    return f16 ? with_full(std::true_type{}) : with_full(std::false_type{});
  };
  if (w.levels) {
    return f16 ? f(QuantFormat<4, 32, true, false, false, true>{}) : f(QuantFormat<4, 32, false, false, false, true>{});
  }
  if (w.storage_bits == 4) return pick(std::integral_constant<int, 4>{}, std::integral_constant<int, 32>{});
  if (w.group == 32) return pick(std::integral_constant<int, 8>{}, std::integral_constant<int, 32>{});
  return pick(std::integral_constant<int, 8>{}, std::integral_constant<int, 16>{});
}

template <typename Fn>
void with_quant_dot(QuantDot dot, const Fn& f) {
  switch (dot) {
#if defined(CONVEYOR_VNNI512)
    case QuantDot::kVnni512: return f(std::integral_constant<QuantDot, QuantDot::kVnni512>{});
#endif
#if defined(CONVEYOR_VNNI256)
    case QuantDot::kVnni256: return f(std::integral_constant<QuantDot, QuantDot::kVnni256>{});
#endif
#if defined(CONVEYOR_AVX2)
    case QuantDot::kAvx2: return f(std::integral_constant<QuantDot, QuantDot::kAvx2>{});
#endif
    case QuantDot::kPortable: return f(std::integral_constant<QuantDot, QuantDot::kPortable>{});
    default: CONVEYOR_CHECK(false, "no quantized dot product ", quant_dot_name(dot), " in this build");
  }
}

// Runs f(max_rows, run) with the micro-kernels of `form`'s quantized format on `dot`: run(w, xq, tile, row, rows,
// y, ldy) computes rows [row, row + rows) (rows <= max_rows) of output tile `tile` of w, a weight of that same
// form, from activations quantized already, into y (at the tile's first column, rows ldy apart). The one place
// that picks a quantized weight's kernel: quant_linear_rows runs it over one weight's tiles, the grouped expert
// step (experts.h) over many experts' tiles at once.
template <typename Fn>
void with_quant_tile_kernel(const QuantWeight& form, QuantDot dot, const Fn& f) {
  if (form.layout != QuantLayout::kTiles) {
    return with_k_format(form.layout, [&](auto format) {
      using F = decltype(format);
      with_quant_dot(dot, [&](auto kind) {
        using T = KQuantKernels<F, decltype(kind)::value>;
        f(T::kMaxRows, [](const QuantWeight& w, const QuantizedRows& xq, int64_t tile, int64_t row, int rows,
                          float* y, int64_t ldy) {
          const int64_t blocks = w.k / kSuperBlock;
          T::at(rows)(xq, row, KTileView{w.codes_data + tile * blocks * F::kBlockBytes, blocks}, y, ldy,
                      std::min(kQuantTile, w.n - tile * kQuantTile));
        });
      });
    });
  }
  with_quant_format(form, [&](auto format) {
    using F = decltype(format);
    with_quant_dot(dot, [&](auto kind) {
      using K = QuantKernels<F, decltype(kind)::value>;
      f(K::kMaxRows, [](const QuantWeight& w, const QuantizedRows& xq, int64_t tile, int64_t row, int rows,
                        float* y, int64_t ldy) {
        K::at(rows)(xq, row, tile_view<F>(w, tile), y, ldy, std::min(kQuantTile, w.n - tile * kQuantTile));
      });
    });
  });
}

// y [m, n] = x [m, k] . W^T (+ bias) for a quantized W, y's rows `ldy` apart (-1: n): x quantized once per call
// (per part of a joined weight: parts may group their inputs differently), then the tile schedule of the float
// GEMMs (row blocks of up to 64 rows sharing each tile while it is in cache).
inline void quant_linear_rows(const float* x, int64_t m, const QuantWeight& w, const float* bias, float* y,
                              QuantDot dot, int64_t ldy = -1) {
  if (m == 0) return;
  if (ldy < 0) ldy = w.n;
  if (!w.parts.empty()) {
    int64_t col = 0;
    for (const QuantWeight& part : w.parts) {
      quant_linear_rows(x, m, part, bias == nullptr ? nullptr : bias + col, y + col, dot, ldy);
      col += part.n;
    }
    return;
  }
  const QuantizedRows xq = quantize_rows(x, m, w);
  with_quant_tile_kernel(w, dot, [&](int max_rows, auto run) {
    for_each_tile_pass(m, w.tiles(), max_rows, [&](int64_t tile, int64_t row, int rows) {
      const int64_t col = tile * kQuantTile;
      run(w, xq, tile, row, rows, y + row * ldy + col, ldy);
      if (bias != nullptr) add_bias(y, ldy, row, rows, col, std::min(kQuantTile, w.n - col), bias);
    });
  });
}

// Row `id` of a super-block weight as float32 [k].
template <typename K>
void k_dequantize_row(const QuantWeight& w, int64_t id, float* out) {
  const int64_t blocks = w.k / kSuperBlock;
  const int c = static_cast<int>(id % kQuantTile);
  const uint8_t* tile = w.codes_data + (id / kQuantTile) * blocks * K::kBlockBytes;
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* block = tile + b * K::kBlockBytes;
    for (int g = 0; g < K::kGroups; ++g) {
      float s, m;
      k_scale_min<K>(block, g, c, &s, &m);
      for (int i = 0; i < K::kGroup; ++i) {
        const int32_t code = k_code<K>(block, c, g * K::kGroup + i);
        out[b * kSuperBlock + g * K::kGroup + i] = affine_weight<K::kMins>(s, m, code, K::kZero);
      }
    }
  }
}

// Rows `ids` of W as float32 [ids, k]: an embedding table that is also a quantized LM head (tied) is looked
// up straight from its codes.
inline void dequantize_rows(const QuantWeight& w, const int64_t* ids, int64_t count, float* out) {
  for (int64_t i = 0; i < count; ++i) {
    int64_t id = ids[i];
    const QuantWeight* part = &w;
    for (const QuantWeight& p : w.parts) {  // the part that holds row id
      part = &p;
      if (id < p.n) break;
      id -= p.n;
    }
    float* row = out + i * w.k;
    if (part->layout != QuantLayout::kTiles) {
      with_k_format(part->layout, [&](auto format) { k_dequantize_row<decltype(format)>(*part, id, row); });
      continue;
    }
    with_quant_format(*part, [&](auto format) {
      using F = decltype(format);
      const int64_t c = id % kQuantTile;
      const QuantTileView t = tile_view<F>(*part, id / kQuantTile);
      for (int64_t g = 0; g < t.groups; ++g) {
        const uint8_t* bytes = t.codes + g * F::kGroupBytes;
        for (int64_t j = 0; j < F::kGroup; ++j) {
          row[g * F::kGroup + j] = weight_value<F>(t.scales, t.mins, g * kQuantTile + c, code_at<F>(bytes, c, j), t.zero);
        }
      }
    });
  }
}

}  // namespace conveyor
