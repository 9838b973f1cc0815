// Linear layers on packed weights. A weight [N, K] is stored as tiles of 16 output columns (32 on the 512-bit
// path), each tile [K, 16] contiguous, so that one pass streams the whole weight once, in order, whatever the
// number of rows: at batch 1 the step is bound by memory bandwidth, and at larger batches each tile is reused
// from cache by every row.
//
// A path per vector width: 256 bits always (the portable path) and 512 where the compiler targets AVX-512F
// (32 zmm registers hold a larger register tile). Where it targets AVX512-BF16, the GEMMs also run on bf16
// weights (PathBf16, written in intrinsics, since vdpbf16ps has no vector-extension spelling): only what is
// stored is bf16, at half the bytes; the accumulators and x's rows stay float32 between kernels.

#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

#include "parallel.h"
#include "vec.h"

namespace conveyor {

constexpr int64_t kRowsPerBlock = 64;  // rows that share a weight tile while it is in cache

// A GEMM path: the vector the micro-kernel computes in, the vectors in one tile row (the tile's width in
// columns is lanes * vecs, and the packed weight's layout follows it) and the most rows one call keeps in
// registers (rows * vecs accumulators, plus the tile row and a broadcast, must fit the register file). Its
// micro-kernels are built for 1 to TableRows rows, a few past MaxRows where that fits, so that other
// heights can be timed (packed_linear's max_rows).
// In (what the micro-kernel reads x as) and Weight (the packed weight's element) are float here; PathBf16 has
// bf16 for both. The KV cache's element is the cache's own (attention.h), whatever the path.
template <typename V, int Vecs, int MaxRows, int TableRows>
struct GemmPath {
  using Vec = V;
  using In = float;
  using Weight = float;
  static constexpr int kLanes = sizeof(V) / sizeof(float);
  static constexpr int kVecs = Vecs;
  static constexpr int64_t kTile = kLanes * Vecs;
  static constexpr int kMaxRows = MaxRows;
  static constexpr int kTableRows = TableRows;
  // Elements of one packed tile of a weight with k inputs.
  static constexpr int64_t tile_elems(int64_t k) { return k * kTile; }
};

// 256 bits: 16 columns x 6 rows, 12 accumulators of the 16 ymm registers AVX2 has. Written in vector
// extensions, it is also the portable path: other targets split the vectors into what they have (NEON: 4).
using Path256 = GemmPath<v8, 2, 6, 6>;
#if defined(__AVX512F__)
// 512 bits: 32 columns x 8 rows, 16 accumulators of 32 zmm registers. On a CPU whose 512-bit FMAs are two
// 256-bit halves (Zen 4) the gain is the larger tile: 10 loads feed 16 FMAs where 8 fed 12.
using Path512 = GemmPath<v16, 2, 8, 14>;
#endif

// Stores a register tile's row (vecs vectors) to y; the last tile of a width that is no multiple of the
// tile's keeps only its `cols` columns.
template <typename V, int Vecs>
inline void store_tile_row(const V* acc, float* y, int64_t cols) {
  constexpr int lanes = sizeof(V) / sizeof(float);
  if (cols == lanes * Vecs) {
#pragma GCC unroll 4
    for (int v = 0; v < Vecs; ++v) storev(y + v * lanes, acc[v]);
    return;
  }
  alignas(64) float part[lanes * Vecs];
  for (int v = 0; v < Vecs; ++v) storev(part + v * lanes, acc[v]);
  std::copy(part, part + cols, y);
}

// rows x kTile outputs of one tile: y[r, 0:cols] = x[r, :] . tile[:, 0:cols]. A struct rather than a function
// template so that PathBf16 can have its own (a partial specialisation).
template <typename P, int Rows>
struct TileKernel {
  static void run(const float* x, int64_t ldx, const float* tile, int64_t k_size, float* y, int64_t ldy,
                  int64_t cols) {
    using V = typename P::Vec;
    V acc[Rows][P::kVecs];
#pragma GCC unroll 16
    for (int r = 0; r < Rows; ++r) {
#pragma GCC unroll 4
      for (int v = 0; v < P::kVecs; ++v) acc[r][v] = V{};
    }
    for (int64_t k = 0; k < k_size; ++k) {
      V w[P::kVecs];
#pragma GCC unroll 4
      for (int v = 0; v < P::kVecs; ++v) w[v] = loadv<V>(tile + k * P::kTile + v * P::kLanes);
#pragma GCC unroll 16
      for (int r = 0; r < Rows; ++r) {
        const float xv = x[r * ldx + k];
#pragma GCC unroll 4
        for (int v = 0; v < P::kVecs; ++v) acc[r][v] += w[v] * xv;
      }
    }
#pragma GCC unroll 16
    for (int r = 0; r < Rows; ++r) store_tile_row<V, P::kVecs>(acc[r], y + r * ldy, cols);
  }
};

template <typename P>
using TileFn = void (*)(const typename P::In*, int64_t, const typename P::Weight*, int64_t, float*, int64_t, int64_t);

// TileKernel<P, rows> by rows, 1 to P::kTableRows.
template <typename P, int... Rows>
constexpr std::array<TileFn<P>, sizeof...(Rows) + 1> tile_table(std::integer_sequence<int, Rows...>) {
  return {nullptr, &TileKernel<P, Rows + 1>::run...};
}
template <typename P>
constexpr auto kTileFns = tile_table<P>(std::make_integer_sequence<int, P::kTableRows>{});

template <typename P>
TileFn<P> tile_fn(int rows) {
  return kTileFns<P>[rows];
}

#if defined(__AVX512BF16__)
// bfloat16 weights: 32 columns x 8 rows, 16 zmm accumulators, as on the 512-bit float path (the same register
// budget; see docs/benchmarks/kernels.md for the heights and widths timed). One vdpbf16ps multiplies 16 columns' pairs of
// consecutive k by a broadcast pair of x and adds both products to float32 lanes: twice the multiply-adds of
// a float FMA per instruction, from half the weight bytes.
struct PathBf16 {
  using Vec = v16;  // what the stack's float32 kernels (norm, rotary, SwiGLU's gate) run on
  using In = uint16_t;
  using Weight = uint16_t;
  static constexpr int kLanes = 16;
  static constexpr int kVecs = 2;
  static constexpr int64_t kTile = 32;
  static constexpr int kMaxRows = 8;
  static constexpr int kTableRows = 14;
  // A tile is [pairs, 32 columns, 2]: k rounded up to even, the pair (k, k + 1) of a column side by side,
  // which is the operand vdpbf16ps multiplies lane by lane.
  static constexpr int64_t tile_elems(int64_t k) { return (k + 1) / 2 * 2 * kTile; }
};

template <int Rows>
struct TileKernel<PathBf16, Rows> {
  // x: rows of bf16, ldx elements apart, each padded to an even length (round_rows_bf16).
  static void run(const uint16_t* x, int64_t ldx, const uint16_t* tile, int64_t k_size, float* y, int64_t ldy,
                  int64_t cols) {
    constexpr int vecs = PathBf16::kVecs;
    const int64_t pairs = (k_size + 1) / 2;
    __m512 acc[Rows][vecs];
#pragma GCC unroll 16
    for (int r = 0; r < Rows; ++r) {
#pragma GCC unroll 4
      for (int v = 0; v < vecs; ++v) acc[r][v] = _mm512_setzero_ps();
    }
    for (int64_t p = 0; p < pairs; ++p) {
      __m512bh w[vecs];
#pragma GCC unroll 4
      for (int v = 0; v < vecs; ++v) {
        w[v] = (__m512bh)_mm512_loadu_si512(tile + 2 * (p * PathBf16::kTile + v * PathBf16::kLanes));
      }
#pragma GCC unroll 16
      for (int r = 0; r < Rows; ++r) {
        int32_t pair;  // x[r, 2p] in the low half, x[r, 2p + 1] in the high: the order of the weight's pair
        __builtin_memcpy(&pair, x + r * ldx + 2 * p, sizeof pair);
        const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
#pragma GCC unroll 4
        for (int v = 0; v < vecs; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], w[v], xv);
      }
    }
#pragma GCC unroll 16
    for (int r = 0; r < Rows; ++r) {
      v16 out[vecs];
      for (int v = 0; v < vecs; ++v) out[v] = (v16)acc[r][v];
      store_tile_row<v16, vecs>(out, y + r * ldy, cols);
    }
  }
};

// x [m, k] float32 -> out [m, ld] bf16 (ld = k rounded up to even, a zero after an odd k), rounded to nearest
// even: once per GEMM, so that no tile pass converts the same rows again.
inline void round_rows_bf16(const float* x, int64_t m, int64_t k, uint16_t* out) {
  const int64_t ld = (k + 1) / 2 * 2;
  parallel_for(0, m, 16, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const float* in = x + row * k;
      uint16_t* o = out + row * ld;
      int64_t i = 0;
      for (; i + 32 <= k; i += 32) {
        const __m512bh both = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(in + i + 16), _mm512_loadu_ps(in + i));
        _mm512_storeu_si512(o + i, (__m512i)both);
      }
      for (; i < k; ++i) o[i] = bf16_bits(in[i]);
      if (k % 2 != 0) o[k] = 0;
    }
  });
}
#endif

// What a path's micro-kernel reads as x: the float32 rows themselves, or (PathBf16) the rows rounded to bf16
// into a buffer of this thread's, reused by every GEMM it runs (a step runs over a hundred).
template <typename P>
struct GemmInput {
  const typename P::In* data;
  int64_t ld;
};

template <typename P>
GemmInput<P> gemm_input(const float* x, [[maybe_unused]] int64_t m, int64_t k) {
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<P, PathBf16>) {
    thread_local std::vector<uint16_t> rounded;
    const int64_t ld = (k + 1) / 2 * 2;
    if (static_cast<int64_t>(rounded.size()) < m * ld) rounded.resize(m * ld);
    round_rows_bf16(x, m, k, rounded.data());
    return {rounded.data(), ld};
  } else
#endif
  {
    return {x, k};
  }
}

// The GEMMs' schedule over m rows and `tiles` weight tiles: work items are (row block, tile), row block
// outermost, so that neighbouring items share x rows and each tile is reused by up to 64 rows; each item calls
// pass(tile, row, rows) for its rows, up to max_rows at a time. The blocks are of equal size (65 rows make two
// blocks of 33 and 32, not 64 and 1): each thread's share is a contiguous run of items, and a short last block
// would leave one thread with nearly all the rows (a 65-row step cost what a 128-row one did). The threads share
// the items out by claim_runs: a thread done with its own share takes runs from the others'.
template <typename Pass>
void for_each_tile_pass(int64_t m, int64_t tiles, int max_rows, const Pass& pass) {
  const int64_t row_blocks = (m + kRowsPerBlock - 1) / kRowsPerBlock;
  const int64_t block_rows = (m + row_blocks - 1) / row_blocks;
  claim_runs(row_blocks * tiles, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t block = item / tiles, tile = item % tiles;
      const int64_t row_end = std::min(m, (block + 1) * block_rows);
      for (int64_t row = block * block_rows; row < row_end; row += max_rows) {
        pass(tile, row, static_cast<int>(std::min<int64_t>(max_rows, row_end - row)));
      }
    }
  });
}

// y[r, c] += bias[c] over the rows and columns one tile pass wrote (y is [m, n]).
inline void add_bias(float* y, int64_t n, int64_t row, int rows, int64_t col, int64_t cols, const float* bias) {
  for (int64_t r = row; r < row + rows; ++r) {
    for (int64_t c = col; c < col + cols; ++c) y[r * n + c] += bias[c];
  }
}

// y [m, n] = x [m, k] . W^T (+ bias), W packed by pack_linear_weight for path P. max_rows (0: the path's
// own) is the micro-kernel's height, a knob for timing other heights. x and y are float32 on every path.
template <typename P>
void linear_rows(const float* x, int64_t m, int64_t k, const typename P::Weight* packed, int64_t n,
                 const float* bias, float* y, int max_rows = 0) {
  constexpr int64_t tile_cols = P::kTile;
  const GemmInput<P> in = gemm_input<P>(x, m, k);
  for_each_tile_pass(m, (n + tile_cols - 1) / tile_cols, max_rows > 0 ? max_rows : P::kMaxRows,
                     [&](int64_t tile, int64_t row, int rows) {
    const int64_t col = tile * tile_cols, cols = std::min(tile_cols, n - col);
    tile_fn<P>(rows)(in.data + row * in.ld, in.ld, packed + tile * P::tile_elems(k), k, y + row * n + col, n, cols);
    if (bias != nullptr) add_bias(y, n, row, rows, col, cols, bias);
  });
}

// out [m, I] = silu(x . Wg^T + bg) * (x . Wu^T + bu), with gate and up packed as one [2I, k] weight, gate
// first, I a multiple of the tile width. Each pass computes a gate tile and the matching up tile for its rows
// and writes only their product: the [m, 2I] projection never goes through memory, and no separate pass
// reads it back.
template <typename P>
void swiglu_rows(const float* x, int64_t m, int64_t k, const typename P::Weight* packed, int64_t intermediate,
                 const float* bias, float* out) {
  using V = typename P::Vec;
  constexpr int64_t tile_cols = P::kTile;
  const int64_t tiles = intermediate / tile_cols;
  const GemmInput<P> in = gemm_input<P>(x, m, k);
  for_each_tile_pass(m, tiles, P::kMaxRows, [&](int64_t tile, int64_t row, int rows) {
    alignas(64) float gate[P::kMaxRows * tile_cols], up[P::kMaxRows * tile_cols];
    const int64_t col = tile * tile_cols;
    const typename P::In* xs = in.data + row * in.ld;
    tile_fn<P>(rows)(xs, in.ld, packed + tile * P::tile_elems(k), k, gate, tile_cols, tile_cols);
    tile_fn<P>(rows)(xs, in.ld, packed + (tile + tiles) * P::tile_elems(k), k, up, tile_cols, tile_cols);
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t c = 0; c < tile_cols; c += P::kLanes) {
        V g = loadv<V>(gate + r * tile_cols + c), u = loadv<V>(up + r * tile_cols + c);
        if (bias != nullptr) {
          g += loadv<V>(bias + col + c);
          u += loadv<V>(bias + intermediate + col + c);
        }
        storev(out + (row + r) * intermediate + col + c, silu_mul(g, u));
      }
    }
  });
}

// The vector widths in bits this build has kernels for: 256 always (on AVX2, or split into what the target
// has: the portable path), 512 where the compiler targets AVX-512F.
inline std::vector<int64_t> kernel_widths() {
#if defined(__AVX512F__)
  return {256, 512};
#else
  return {256};
#endif
}

// Runs f(P{}) with the path P of a width in bits; a width this build lacks is an error, never a fallback.
template <typename F>
void with_path(int64_t width, const F& f) {
  if (width == 256) return f(Path256{});
#if defined(__AVX512F__)
  if (width == 512) return f(Path512{});
#endif
  CONVEYOR_CHECK(false, "no ", width, "-bit kernels in this build (",
              width == 512 ? "the CPU lacks avx512f" : "widths are 256 or 512", ")");
}

// Whether this build has the bfloat16 GEMMs (the compiler targets AVX512-BF16).
inline bool has_bfloat16() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

// Runs f(P{}) with the GEMM path for bf16 weights (512 bits only: vdpbf16ps works on zmm registers here) or
// for float32 ones of a width; what this build lacks is an error naming the missing feature.
template <typename F>
void with_gemm_path(int64_t width, bool bf16, const F& f) {
  if (!bf16) return with_path(width, f);
#if defined(__AVX512BF16__)
  CONVEYOR_CHECK(width == 512, "the bfloat16 kernels are 512-bit, not ", width);
  return f(PathBf16{});
#else
  CONVEYOR_CHECK(false, "no bfloat16 kernels in this build (the CPU lacks avx512_bf16)");
#endif
}

}  // namespace conveyor
