// Native CPU kernels for the places a step loses most time in eager PyTorch.
//
// 1. Linear layers on packed weights. A weight [N, K] is stored as tiles of 16
//    output columns (32 on the 512-bit path), each tile [K, 16] contiguous,
//    so that one pass streams the whole weight once, in order, whatever the
//    number of rows: at batch 1 the step is bound by memory bandwidth, and at
//    larger batches each tile is reused from cache by every row.
// 2. Attention straight over the paged KV cache. Each query row reads its own
//    context through its sequence's block table; nothing is gathered into a
//    padded copy, and decode rows and prompt rows of any length share one call.
// 3. The whole model (NativeLlama: embedding, the thirty layers, the LM head
//    on the sampled rows and their argmax) in one call per step, on inputs
//    handed over as plain lists, so that no Python or tensor dispatch runs
//    between the kernels, nor around them.
//
// Vectors are GCC/Clang vector extensions rather than intrinsics, so the same
// source builds for AVX2 or NEON with -march=native. Every kernel comes in two
// widths: 256 bits (8 floats; AVX2's ymm, or pairs of NEON / SSE registers on
// other targets: the portable path) and, where the target has AVX-512F, 512 bits
// (16 floats in zmm registers, and 32 of them, which lets the GEMM hold a larger
// register tile). The caller picks one per call or per stack (with_path); a
// weight is packed for one width. Threads: ATen's parallel_for (OpenMP).
//
// bfloat16, where the compiler targets AVX512-BF16: the GEMMs also run on bf16 weights (PathBf16, written
// in intrinsics, since vdpbf16ps has no vector-extension spelling), and the stack then keeps its KV cache in
// bf16. Only what is stored is bf16, at half the bytes: weights and K/V. Everything computed (accumulators,
// norms, rotary, softmax, the activations between kernels) stays float32.
//
// Inside the stack, a projection can hand some row counts to torch's own GEMM (oneDNN / MKL, and AMX for bf16
// where the CPU has it) on a plain copy of its weight: `--kernels auto` times both once per machine and
// routes each (projection, row count class) to the faster (NativeLlama::route_to_torch).

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <sys/mman.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kRowsPerBlock = 64;  // rows that share a weight tile while it is in cache

typedef float v8 __attribute__((vector_size(32)));
typedef float v16 __attribute__((vector_size(64)));

// Unaligned load and store of a vector of any width (the copy compiles to one vector move).
template <typename V>
inline V loadv(const float* p) {
  V v;
  __builtin_memcpy(&v, p, sizeof v);
  return v;
}
template <typename V>
inline void storev(float* p, V v) {
  __builtin_memcpy(p, &v, sizeof v);
}

// A GEMM path: the vector the micro-kernel computes in, the vectors in one tile row (the tile's width in
// columns is lanes * vecs, and the packed weight's layout follows it) and the most rows one call keeps in
// registers (rows * vecs accumulators, plus the tile row and a broadcast, must fit the register file). Its
// micro-kernels are built for 1 to TableRows rows, a few past MaxRows where that fits, so that other
// heights can be timed (packed_linear's max_rows).
// In (what the micro-kernel reads x as), Weight (the packed weight's element) and Cache (the KV cache's, in the
// stack) are float here; PathBf16 has bf16 for all three.
template <typename V, int Vecs, int MaxRows, int TableRows>
struct GemmPath {
  using Vec = V;
  using In = float;
  using Weight = float;
  using Cache = float;
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

// bfloat16 is the top half of a float32: widening is a 16-bit shift, narrowing rounds the low half away (to
// nearest, ties to even, as torch's .to(torch.bfloat16) does; a NaN stays a NaN).
inline uint16_t bf16_bits(float f) {
  uint32_t u;
  __builtin_memcpy(&u, &f, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

#if defined(__AVX512BF16__)
// bfloat16 weights: 32 columns x 8 rows, 16 zmm accumulators, as on the 512-bit float path (the same register
// budget; see README for the heights and widths timed). One vdpbf16ps multiplies 16 columns' pairs of
// consecutive k by a broadcast pair of x and adds both products to float32 lanes: twice the multiply-adds of
// a float FMA per instruction, from half the weight bytes.
struct PathBf16 {
  using Vec = v16;  // what the stack's float32 kernels (norm, rotary, SwiGLU's gate) run on
  using In = uint16_t;
  using Weight = uint16_t;
  using Cache = uint16_t;
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
void round_rows_bf16(const float* x, int64_t m, int64_t k, uint16_t* out) {
  const int64_t ld = (k + 1) / 2 * 2;
  at::parallel_for(0, m, 16, [&](int64_t begin, int64_t end) {
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
GemmInput<P> gemm_input(const float* x, int64_t m, int64_t k) {
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

typedef float v4 __attribute__((vector_size(16)));

inline float sum8(v8 v) {
  const v4 half = __builtin_shufflevector(v, v, 0, 1, 2, 3) + __builtin_shufflevector(v, v, 4, 5, 6, 7);
  return (half[0] + half[2]) + (half[1] + half[3]);
}

// A vector folded to 8 lanes (lane i + lane i + 8): reductions of any width end in sum8 / sums8.
inline v8 fold8(v8 v) { return v; }
inline v8 fold8(v16 v) {
  return __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
         __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
}

template <typename V>
inline float sumv(V v) {
  return sum8(fold8(v));
}

template <typename V>
constexpr int kLanesOf = sizeof(V) / sizeof(float);

template <typename V>
inline V splatv(float x) {
  return V{} + x;
}

// The int32 vector as wide as V.
template <typename V>
struct IntOf {
  typedef int32_t type __attribute__((vector_size(sizeof(V))));
};

// e^x lane by lane, to about 1 ulp: x = n ln2 + r with |r| <= ln2 / 2, e^r by Cephes' degree-6 polynomial,
// 2^n by writing n into the exponent bits. A scalar std::exp per element costs more than the rest of
// attention's softmax together.
template <typename V>
inline V expv(V x) {
  const V lo = splatv<V>(-87.3f), hi = splatv<V>(88.3f);
  x = x < lo ? lo : x;
  x = x > hi ? hi : x;
  const V shifter = splatv<V>(12582912.f);  // 1.5 * 2^23: adding and subtracting it rounds to the nearest integer
  const V n = (x * 1.44269504f + shifter) - shifter;
  const V r = (x - n * 0.693359375f) + n * 2.12194440e-4f;  // ln2 in two parts, so r keeps its low bits
  V p = splatv<V>(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  const typename IntOf<V>::type scale = (__builtin_convertvector(n, typename IntOf<V>::type) + 127) << 23;
  V two_n;
  __builtin_memcpy(&two_n, &scale, sizeof two_n);
  return p * two_n;
}

// silu(g) * u lane by lane: SwiGLU's gate.
template <typename V>
inline V silu_mul(V g, V u) {
  return g / (1.f + expv(-g)) * u;
}

// A vector V of the KV cache's elements as float32: float as it is, bf16 widened in registers (the 16 bits
// shifted into the top half of each lane), so that a bf16 cache is read at half the bytes and computed on
// exactly as the float32 values it stands for.
template <typename V>
inline V loadc(const float* p) {
  return loadv<V>(p);
}
template <typename V>
inline V loadc(const uint16_t* p) {
  typedef uint16_t Half __attribute__((vector_size(sizeof(V) / 2)));
  Half half;
  __builtin_memcpy(&half, p, sizeof half);
  const typename IntOf<V>::type bits = __builtin_convertvector(half, typename IntOf<V>::type) << 16;
  V v;
  __builtin_memcpy(&v, &bits, sizeof v);
  return v;
}

// q . k over NV vectors V, in two accumulators to halve the dependency chain; k is a cache row (float or bf16).
template <typename V, int NV, typename C>
inline float dot(const float* q, const C* k) {
  constexpr int lanes = kLanesOf<V>;
  V even = loadv<V>(q) * loadc<V>(k), odd = V{};
  for (int j = 1; j < NV; ++j) (j % 2 ? odd : even) += loadv<V>(q + lanes * j) * loadc<V>(k + lanes * j);
  return sumv(even + odd);
}

// s[i] = exp(s[i] - top), top being max(s); returns the sum.
template <typename V>
inline float softmax_numerators(float* s, int64_t n, float top) {
  constexpr int lanes = kLanesOf<V>;
  V total = V{};
  int64_t i = 0;
  for (; i + lanes <= n; i += lanes) {
    const V e = expv(loadv<V>(s + i) - top);
    storev(s + i, e);
    total += e;
  }
  float rest = sumv(total);
  for (; i < n; ++i) rest += (s[i] = std::exp(s[i] - top));
  return rest;
}

// The shape of a paged KV cache of one layer: [blocks, block_size, kv_heads, head_dim] for K and for V.
struct CacheShape {
  int64_t block_size, kv_heads, dim;
  int64_t token_stride() const { return kv_heads * dim; }
  int64_t block_stride() const { return block_size * token_stride(); }
};

// The sums of 8 vectors as one vector, out[p] = sum(a[p]): pairwise adds across lanes, 7 shuffles and adds
// for all 8 where one sum on its own takes 3.
inline v8 hadd(v8 a, v8 b) {
  return __builtin_shufflevector(a, b, 0, 2, 8, 10, 4, 6, 12, 14) +
         __builtin_shufflevector(a, b, 1, 3, 9, 11, 5, 7, 13, 15);
}

inline v8 sums8(const v8* a) {
  const v8 lo = hadd(hadd(a[0], a[1]), hadd(a[2], a[3]));  // sums of a[0..3], each in two halves
  const v8 hi = hadd(hadd(a[4], a[5]), hadd(a[6], a[7]));
  return __builtin_shufflevector(lo, hi, 0, 1, 2, 3, 8, 9, 10, 11) +
         __builtin_shufflevector(lo, hi, 4, 5, 6, 7, 12, 13, 14, 15);
}

// q . k for 8 consecutive positions (keys token_stride apart) at once: q is loaded once per 8 keys, and the 8
// sums are reduced together (each folded to 8 lanes first).
template <typename V, int NV, typename C>
inline v8 dot8(const float* q, const C* keys, int64_t token_stride) {
  constexpr int lanes = kLanesOf<V>;
  V acc[8] = {};
  for (int j = 0; j < NV; ++j) {
    const V qv = loadv<V>(q + lanes * j);
    for (int p = 0; p < 8; ++p) acc[p] += qv * loadc<V>(keys + p * token_stride + lanes * j);
  }
  v8 folded[8];
  for (int p = 0; p < 8; ++p) folded[p] = fold8(acc[p]);
  return sums8(folded);
}

// s = softmax(s), in place.
template <typename V>
inline void softmax(float* s, int64_t n) {
  constexpr int lanes = kLanesOf<V>;
  const float inv = 1.f / softmax_numerators<V>(s, n, *std::max_element(s, s + n));
  int64_t i = 0;
  for (; i + lanes <= n; i += lanes) storev(s + i, loadv<V>(s + i) * inv);
  for (; i < n; ++i) s[i] *= inv;
}

// Asks for one slice of the next block (of `bytes` bytes) per head worked on in the current one: blocks lie
// anywhere in the cache, so the hardware prefetcher cannot guess the next, and a step's KV is cold (the
// whole model's weights streamed through since it was last read). Spread over the heads, the requests
// arrive while the current block is computed on rather than all at once. Into L2 (locality 2, prefetcht1),
// not L1: requests for L1 wait on its few miss buffers; measured in a decode step at context 512 (Zen 4):
// attention 1.46 ms with L1 prefetches, 1.00-1.04 ms with L2 ones, 1.83 ms with none.
inline void prefetch_slice(const void* next, int64_t bytes, int64_t slice, int64_t slices) {
  const char* base = static_cast<const char*>(next);
  for (int64_t line = slice * bytes / 64 / slices; line < (slice + 1) * bytes / 64 / slices; ++line) {
    __builtin_prefetch(base + line * 64, 0, 2);
  }
}

// Positions [begin, end) of a query row's context; begin is the first of a block.
struct Span {
  int64_t begin, end;
};

// One query row over the positions `span` of the paged cache, for every head. Blocks are the outer loop,
// heads the inner one: a position's K (and V) for all KV heads is one contiguous run in the cache, so each
// block is read from memory once, in order, and then serves every head from L1. q and out point at the
// row's head 0; scores holds heads * (span.end - span.begin) floats. With stats == nullptr, out is the
// attention (the span is the whole context); otherwise it is one part of it: out the sum of V weighted by
// exp(score - max) and stats[2h], stats[2h + 1] head h's max and sum of those weights, which merge_parts
// combines. A head is NV vectors V; the cache holds C (float, or bf16 bits).
template <typename V, int NV, typename C>
void attend_row(const float* q, const C* k_cache, const C* v_cache, const int64_t* table, Span span,
                const CacheShape& shape, int64_t group, float scale, float* scores, float* out, float* stats) {
  constexpr int lanes = kLanesOf<V>;
  constexpr int64_t dim = lanes * NV;
  const int64_t stride = shape.token_stride(), heads = shape.kv_heads * group, len = span.end - span.begin;
  const int64_t block_bytes = shape.block_stride() * static_cast<int64_t>(sizeof(C));
  const auto block_at = [&](const C* cache, int64_t block) { return cache + table[block] * shape.block_stride(); };
  for (int64_t first = span.begin; first < span.end; first += shape.block_size) {
    const int64_t block = first / shape.block_size, n = std::min(shape.block_size, span.end - first);
    const C* keys = block_at(k_cache, block);
    const C* next = first + n < span.end ? block_at(k_cache, block + 1)
                                         : block_at(v_cache, span.begin / shape.block_size);  // V follows K
    for (int64_t h = 0; h < heads; ++h) {
      prefetch_slice(next, block_bytes, h, heads);
      const float* qh = q + h * dim;
      const C* kh = keys + h / group * dim;
      float* s = scores + h * len + (first - span.begin);
      int64_t i = 0;
      for (; i + 8 <= n; i += 8) storev(s + i, dot8<V, NV, C>(qh, kh + i * stride, stride) * scale);
      for (; i < n; ++i) s[i] = dot<V, NV, C>(qh, kh + i * stride) * scale;
    }
  }
  for (int64_t h = 0; h < heads; ++h) {
    float* s = scores + h * len;
    if (stats == nullptr) {
      softmax<V>(s, len);
      continue;
    }
    stats[2 * h] = *std::max_element(s, s + len);
    stats[2 * h + 1] = softmax_numerators<V>(s, len, stats[2 * h]);
  }
  // Accumulators of up to 8 vectors stay in registers; wider heads go in two halves.
  constexpr int kChunk = NV <= 8 ? NV : NV / 2;
  for (int64_t first = span.begin; first < span.end; first += shape.block_size) {
    const int64_t block = first / shape.block_size, n = std::min(shape.block_size, span.end - first);
    const C* values = block_at(v_cache, block);
    const C* next = first + n < span.end ? block_at(v_cache, block + 1) : nullptr;
    for (int64_t h = 0; h < heads; ++h) {
      if (next != nullptr) prefetch_slice(next, block_bytes, h, heads);
      const C* vh = values + h / group * dim;
      const float* p = scores + h * len + (first - span.begin);
      float* o = out + h * dim;
      for (int j0 = 0; j0 < NV; j0 += kChunk) {
        V acc[kChunk];
        for (int c = 0; c < kChunk; ++c) acc[c] = first == span.begin ? V{} : loadv<V>(o + lanes * (j0 + c));
        for (int64_t i = 0; i < n; ++i) {
          const V weight = splatv<V>(p[i]);
          for (int c = 0; c < kChunk; ++c) acc[c] += loadc<V>(vh + i * stride + lanes * (j0 + c)) * weight;
        }
        for (int c = 0; c < kChunk; ++c) storev(o + lanes * (j0 + c), acc[c]);
      }
    }
  }
}

// A row's attention from its `parts` parts (attend_row with stats; a part with sum 0 saw no position):
// each part's weights were relative to its own max, so they are rescaled to the largest before adding.
inline void merge_parts(const float* part_out, const float* part_stats, int64_t parts, int64_t heads, int64_t dim,
                        float* out) {
  const int64_t out_size = heads * dim, part_size = out_size + 2 * heads;
  for (int64_t h = 0; h < heads; ++h) {
    float top = -std::numeric_limits<float>::infinity(), total = 0.f;
    for (int64_t p = 0; p < parts; ++p) {
      if (part_stats[p * part_size + 2 * h + 1] > 0.f) top = std::max(top, part_stats[p * part_size + 2 * h]);
    }
    float* o = out + h * dim;
    std::fill(o, o + dim, 0.f);
    for (int64_t p = 0; p < parts; ++p) {
      const float* stats = part_stats + p * part_size + 2 * h;
      if (stats[1] <= 0.f) continue;
      const float weight = std::exp(stats[0] - top);
      total += weight * stats[1];
      const float* po = part_out + p * part_size + h * dim;
      for (int64_t d = 0; d < dim; ++d) o[d] += weight * po[d];
    }
    for (int64_t d = 0; d < dim; ++d) o[d] /= total;
  }
}

template <typename C>
using AttendFn = void (*)(const float*, const C*, const C*, const int64_t*, Span, const CacheShape&, int64_t, float,
                          float*, float*, float*);

// Head sizes with their own unrolled kernel (the accumulators stay in registers) in vectors V over a cache of
// C; others are refused. A head of 8 is narrower than 16 lanes: the 512-bit path runs it on 8.
template <typename V, typename C = float>
AttendFn<C> attend_fn(int64_t dim) {
  constexpr int lanes = kLanesOf<V>;
  switch (dim) {
    case 8: return attend_row<v8, 1, C>;
    case 16: return attend_row<V, 16 / lanes, C>;
    case 32: return attend_row<V, 32 / lanes, C>;
    case 64: return attend_row<V, 64 / lanes, C>;
    case 96: return attend_row<V, 96 / lanes, C>;
    case 128: return attend_row<V, 128 / lanes, C>;
    default: return nullptr;
  }
}

// Each kernel below works on raw rows and splits them over ATen's threads itself, so that the model's
// forward (NativeLlama) calls them with no tensor or Python in between.

// The GEMMs' schedule over m rows and `tiles` weight tiles: work items are (row block, tile), row block
// outermost, so that neighbouring items share x rows and each tile is reused by up to 64 rows; each item calls
// pass(tile, row, rows) for its rows, up to max_rows at a time. The blocks are of equal size (65 rows make two
// blocks of 33 and 32, not 64 and 1): the threads take contiguous runs of items, and a short last block would
// leave one thread with nearly all the rows (a 65-row step cost what a 128-row one did).
template <typename Pass>
void for_each_tile_pass(int64_t m, int64_t tiles, int max_rows, const Pass& pass) {
  const int64_t row_blocks = (m + kRowsPerBlock - 1) / kRowsPerBlock;
  const int64_t block_rows = (m + row_blocks - 1) / row_blocks;
  at::parallel_for(0, row_blocks * tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t block = item / tiles, tile = item % tiles;
      const int64_t row_end = std::min(m, (block + 1) * block_rows);
      for (int64_t row = block * block_rows; row < row_end; row += max_rows) {
        pass(tile, row, static_cast<int>(std::min<int64_t>(max_rows, row_end - row)));
      }
    }
  });
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
    if (bias != nullptr) {
      for (int64_t r = row; r < row + rows; ++r) {
        for (int64_t c = col; c < col + cols; ++c) y[r * n + c] += bias[c];
      }
    }
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

// The elementwise kernels below run on vectors V (v8 or v16), whatever is left over past the last whole
// vector lane by lane.

// out = x / rms(x) * weight, row by row. With `residual`, first x += residual (in place): the residual add
// and the next norm read x once. Squares add up per lane in float and across lanes in double.
template <typename V>
void rms_norm_rows(float* x, const float* residual, const float* weight, int64_t rows, int64_t size, float eps,
                   float* out) {
  constexpr int64_t lanes = sizeof(V) / sizeof(float);
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      float* in = x + row * size;
      V lane_squares{};
      int64_t i = 0;
      for (; i + lanes <= size; i += lanes) {
        V v = loadv<V>(in + i);
        if (residual != nullptr) storev(in + i, v += loadv<V>(residual + row * size + i));
        lane_squares += v * v;
      }
      double squares = 0.0;
      for (; i < size; ++i) {
        if (residual != nullptr) in[i] += residual[row * size + i];
        squares += static_cast<double>(in[i]) * in[i];
      }
      for (int64_t lane = 0; lane < lanes; ++lane) squares += lane_squares[lane];
      const float inv = 1.f / std::sqrt(static_cast<float>(squares / size) + eps);
      float* o = out + row * size;
      for (i = 0; i + lanes <= size; i += lanes) storev(o + i, loadv<V>(weight + i) * (loadv<V>(in + i) * inv));
      for (; i < size; ++i) o[i] = weight[i] * (in[i] * inv);
    }
  });
}

// x * cos + rotate_half(x) * sin on `heads` heads of `dim` at the start of each row, in place.
template <typename V>
void rotary_rows(float* x, int64_t tokens, int64_t row_stride, int64_t heads, int64_t dim, const float* cos,
                 const float* sin) {
  constexpr int64_t lanes = sizeof(V) / sizeof(float);
  const int64_t half = dim / 2;
  at::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* c = cos + t * dim;
      const float* s = sin + t * dim;
      for (int64_t h = 0; h < heads; ++h) {
        float* head = x + t * row_stride + h * dim;
        int64_t i = 0;
        for (; i + lanes <= half; i += lanes) {
          const V a = loadv<V>(head + i), b = loadv<V>(head + i + half);
          storev(head + i, a * loadv<V>(c + i) - b * loadv<V>(s + i));
          storev(head + i + half, b * loadv<V>(c + i + half) + a * loadv<V>(s + i + half));
        }
        for (; i < half; ++i) {
          const float a = head[i], b = head[i + half];
          head[i] = a * c[i] - b * s[i];
          head[i + half] = b * c[i + half] + a * s[i + half];
        }
      }
    }
  });
}

// out [rows, size] = silu(gate) * up, from [rows, 2 * size] (gate then up).
template <typename V>
void silu_and_mul_rows(const float* gate_up, int64_t rows, int64_t size, float* out) {
  constexpr int64_t lanes = sizeof(V) / sizeof(float);
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const float* gate = gate_up + row * 2 * size;
      const float* up = gate + size;
      float* o = out + row * size;
      int64_t i = 0;
      for (; i + lanes <= size; i += lanes) storev(o + i, silu_mul(loadv<V>(gate + i), loadv<V>(up + i)));
      for (; i < size; ++i) o[i] = gate[i] / (1.f + std::exp(-gate[i])) * up[i];
    }
  });
}

// Whether any lane of a comparison's mask is set.
template <typename I>
inline bool any_lane(I mask) {
  bool any = false;
  for (size_t lane = 0; lane < sizeof(I) / sizeof(int32_t); ++lane) any |= mask[lane] != 0;
  return any;
}

// The index of the largest of x[0, n): the first of equals, and the first NaN if there is one (a NaN counts as
// largest, as torch's and NumPy's argmax have it). A vector pass finds the maximum, a second its first place.
template <typename V>
int64_t argmax_row(const float* x, int64_t n) {
  constexpr int64_t lanes = kLanesOf<V>;
  using I = typename IntOf<V>::type;
  V top = splatv<V>(-std::numeric_limits<float>::infinity());
  I unordered{};
  int64_t i = 0;
  for (; i + lanes <= n; i += lanes) {
    const V v = loadv<V>(x + i);
    unordered |= v != v;
    top = v > top ? v : top;
  }
  bool nan = any_lane(unordered);
  float best = top[0];
  for (int64_t lane = 1; lane < lanes; ++lane) best = std::max(best, top[lane]);
  for (; i < n; ++i) {
    nan |= std::isnan(x[i]);
    best = x[i] > best ? x[i] : best;
  }
  const V best_v = splatv<V>(best);
  i = 0;
  for (; i + lanes <= n; i += lanes) {  // skip whole vectors without it
    const V v = loadv<V>(x + i);
    if (any_lane(nan ? v != v : v == best_v)) break;
  }
  for (; i < n; ++i) {
    if (nan ? std::isnan(x[i]) : x[i] == best) return i;
  }
  return 0;  // n == 0
}

// argmax_row of each row of x [rows, n], rows shared between the threads.
template <typename V>
std::vector<int64_t> argmax_rows(const float* x, int64_t rows, int64_t n) {
  std::vector<int64_t> out(rows);
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) out[row] = argmax_row<V>(x + row * n, n);
  });
  return out;
}

// Copies this step's K and V rows (row_stride apart) into their cache slots.
// A bf16 cache gets them rounded to nearest even (as torch's .to(torch.bfloat16)).
inline void store_cache_row(const float* from, int64_t n, float* to) { std::copy(from, from + n, to); }
inline void store_cache_row(const float* from, int64_t n, uint16_t* to) {
  for (int64_t i = 0; i < n; ++i) to[i] = bf16_bits(from[i]);
}

template <typename C>
void write_kv_rows(const float* k, const float* v, int64_t tokens, int64_t row_stride, const int64_t* slots,
                   const CacheShape& shape, C* k_cache, C* v_cache) {
  const int64_t width = shape.token_stride();
  for (int64_t t = 0; t < tokens; ++t) {
    store_cache_row(k + t * row_stride, width, k_cache + slots[t] * width);
    store_cache_row(v + t * row_stride, width, v_cache + slots[t] * width);
  }
}

// Attention of every query row over the paged cache: row r belongs to the sequence whose block table is
// tables[row_seq[r]] and sees positions [0, context_lens[r]). A decode row is one query at the end of its
// context; the rows of a prompt chunk each see the prompt up to themselves, which makes the mask causal.
// query rows are row_stride apart, heads contiguous within a row; out is [rows, heads * dim].
template <typename V, typename C>
void attention_rows(const float* query, int64_t rows, int64_t row_stride, int64_t heads, const C* k_cache,
                    const C* v_cache, const CacheShape& shape, const int64_t* tables, int64_t table_width,
                    const int64_t* row_seq, const int64_t* context_lens, float scale, float* out) {
  const AttendFn<C> attend = attend_fn<V, C>(shape.dim);
  TORCH_CHECK(attend != nullptr, "no attention kernel for head size ", shape.dim, " (8, 16, 32, 64, 96 or 128)");
  const int64_t group = heads / shape.kv_heads, threads = at::get_num_threads(), out_size = heads * shape.dim;
  // A whole row per work item when there are rows enough to share out; otherwise each row's context in one
  // run of whole blocks per thread, merged after (one row, 2 threads: each reads half the K and V, in order;
  // split by KV head instead, 3 of them took 1.5x as long, each thread reading every block's slices).
  const int64_t parts = rows >= 2 * threads ? 1 : threads, items = rows * parts, part_size = out_size + 2 * heads;
  std::vector<float> partials(parts > 1 ? items * part_size : 0);
  // Items are dealt out in turn rather than in halves: a prompt's later rows see longer contexts, and
  // halves would leave one thread all the long ones.
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(threads, items));
  at::parallel_for(0, workers, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t worker = begin; worker < end; ++worker) {
      for (int64_t item = worker; item < items; item += workers) {
        const int64_t row = item / parts, part = item % parts, ctx = context_lens[row];
        const int64_t blocks = (ctx + shape.block_size - 1) / shape.block_size;
        const Span span{part * blocks / parts * shape.block_size,
                        std::min(ctx, (part + 1) * blocks / parts * shape.block_size)};
        float* stats = parts > 1 ? partials.data() + item * part_size + out_size : nullptr;
        if (span.begin >= span.end) {  // fewer blocks than parts: this one saw nothing
          for (int64_t h = 0; h < heads; ++h) stats[2 * h] = stats[2 * h + 1] = 0.f;
          continue;
        }
        scores.resize(heads * (span.end - span.begin));
        attend(query + row * row_stride, k_cache, v_cache, tables + row_seq[row] * table_width, span, shape, group,
               scale, scores.data(), parts > 1 ? partials.data() + item * part_size : out + row * out_size, stats);
      }
    }
  });
  for (int64_t row = 0; parts > 1 && row < rows; ++row) {
    const float* first = partials.data() + row * parts * part_size;
    merge_parts(first, first + out_size, parts, heads, shape.dim, out + row * out_size);
  }
}

// The vector widths in bits this build has kernels for: 256 always (on AVX2, or split into what the target
// has: the portable path), 512 where the compiler targets AVX-512F.
std::vector<int64_t> kernel_widths() {
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
  TORCH_CHECK(false, "no ", width, "-bit kernels in this build (",
              width == 512 ? "the CPU lacks avx512f" : "widths are 256 or 512", ")");
}

// Whether this build has the bfloat16 GEMMs (the compiler targets AVX512-BF16).
bool has_bfloat16() {
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
  TORCH_CHECK(width == 512, "the bfloat16 kernels are 512-bit, not ", width);
  return f(PathBf16{});
#else
  TORCH_CHECK(false, "no bfloat16 kernels in this build (the CPU lacks avx512_bf16)");
#endif
}

// The width a packed weight was laid out for, from its tile's columns (0: none of ours). A float32 weight is
// [tiles, K, T]; a bf16 one [tiles, ceil(K / 2), 32, 2].
int64_t packed_width(const torch::Tensor& packed) {
  if (packed.scalar_type() == torch::kBFloat16) {
    return has_bfloat16() && packed.dim() == 4 && packed.size(2) == 32 && packed.size(3) == 2 ? 512 : 0;
  }
  int64_t width = 0;
  for (const int64_t w : kernel_widths()) {
    with_path(w, [&](auto path) {
      if (packed.dim() == 3 && packed.scalar_type() == torch::kFloat32 && packed.size(2) == decltype(path)::kTile) {
        width = w;
      }
    });
  }
  return width;
}

// The inputs a packed weight of k inputs has in its second dimension (pairs of them for bf16).
int64_t packed_inputs(int64_t k, bool bf16) { return bf16 ? (k + 1) / 2 : k; }

// A tensor's elements as path P's weight (float, or bf16 bits), once its dtype is checked.
template <typename P>
const typename P::Weight* weight_data(const torch::Tensor& t) {
  return static_cast<const typename P::Weight*>(t.data_ptr());
}

const float* optional_data(const torch::Tensor& t) { return t.numel() == 0 ? nullptr : t.data_ptr<float>(); }

void check_float_rows(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == torch::kFloat32 && t.is_contiguous(), name, " must be a contiguous float32 tensor");
}

// A KV cache: contiguous, float32 or bfloat16 (bf16 when `bf16`, where the caller knows which).
void check_cache(const torch::Tensor& t, const char* name, bool bf16) {
  TORCH_CHECK(t.scalar_type() == (bf16 ? torch::kBFloat16 : torch::kFloat32) && t.is_contiguous(), name,
              " must be a contiguous ", bf16 ? "bfloat16" : "float32", " tensor");
}

torch::Tensor as_int64(const torch::Tensor& t) { return t.to(torch::kInt64).contiguous(); }

// Every row must name one of the block tables and a context that table covers: attention_rows reads
// through both unchecked. All three tensors int64 and contiguous (as_int64).
void check_rows(const torch::Tensor& tables, const torch::Tensor& row_seq, const torch::Tensor& context_lens,
                int64_t block_size) {
  const int64_t* seqs = row_seq.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  for (int64_t row = 0; row < row_seq.numel(); ++row) {
    TORCH_CHECK(seqs[row] >= 0 && seqs[row] < tables.size(0), "row ", row, " names block table ", seqs[row], " of ",
                tables.size(0));
    TORCH_CHECK(lens[row] >= 1 && lens[row] <= tables.size(1) * block_size, "context length outside the block table");
  }
}

}  // namespace

// ----- Tensor-level entry points (also what the tests compare with PyTorch) -----

// An uninitialized contiguous tensor in memory that Linux may back with 2 MiB pages (transparent huge pages,
// asked for with madvise: most distributions enable them only on request). A decode step streams every
// weight once; on 4 KiB pages the stream crosses a page every 4 KiB, each a TLB miss and a restart for the
// hardware prefetcher. Measured over all the default model's weights, both kinds in one process and in turn,
// at 1 and 8 rows: 6-16% faster. Where the kernel declines, the memory is ordinary pages; nothing else changes.
torch::Tensor empty_on_huge_pages(at::IntArrayRef sizes, torch::ScalarType dtype) {
  constexpr size_t kHugePage = size_t{1} << 21;
  int64_t numel = 1;
  for (const int64_t size : sizes) numel *= size;
  const size_t bytes = (static_cast<size_t>(numel) * c10::elementSize(dtype) + 4095) / 4096 * 4096;
  void* data = nullptr;
  TORCH_CHECK(posix_memalign(&data, kHugePage, std::max<size_t>(bytes, 4096)) == 0, "out of memory packing a weight");
#if defined(MADV_HUGEPAGE)
  madvise(data, bytes, MADV_HUGEPAGE);  // advice: an error leaves ordinary pages
#endif
  return torch::from_blob(data, sizes, [](void* p) { std::free(p); }, torch::TensorOptions().dtype(dtype));
}

// The shape pack_linear_weight gives a weight [n, k] on the path of `width` bits (bf16 if asked).
std::vector<int64_t> packed_shape(int64_t n, int64_t k, int64_t width, bool bfloat16) {
  TORCH_CHECK(n > 0 && k > 0, "a weight of ", n, " x ", k, " has nothing to pack");
  std::vector<int64_t> shape;
  with_gemm_path(width, bfloat16, [&](auto path) {
    constexpr int64_t tile = decltype(path)::kTile;
    const int64_t tiles = (n + tile - 1) / tile;
    shape = bfloat16 ? std::vector<int64_t>{tiles, (k + 1) / 2, tile, 2} : std::vector<int64_t>{tiles, k, tile};
  });
  return shape;
}

// A 1-D buffer of `numel` float32 (or bf16) elements on huge pages where Linux grants them: what a model packs
// all its weights into, back to back in the order a step reads them. Packed one allocation each, a weight
// smaller than 2 MiB (or a large one's tail) is on 4 KiB pages, since a huge page must lie wholly inside
// the advised range. Measured with the default model's 120 layer GEMVs in turn, on 2 threads, in a C++
// harness: 1.25-1.36x the time of one GEMV over the same bytes apart, 1.05-1.07x in one buffer (in the engine,
// whose separate weights mostly got huge pages anyway, 1.00-1.02x a decode step).
torch::Tensor huge_page_buffer(int64_t numel, bool bfloat16) {
  TORCH_CHECK(numel > 0, "an empty buffer");
  return empty_on_huge_pages({numel}, bfloat16 ? torch::kBFloat16 : torch::kFloat32);
}

// weight [N, K] -> packed [ceil(N / T), K, T], zero-padded past N, for the path of `width` bits (T = 16 for
// 256, 32 for 512): the tile is as wide as that path's micro-kernel. With bfloat16, [ceil(N / 32), ceil(K / 2),
// 32, 2] in bf16 (a float32 weight rounded to nearest even), zero-padded past N and K: each column's pairs of
// consecutive k side by side, as vdpbf16ps reads them. Into `out` when given (contiguous, of packed_shape and
// the path's dtype: a slice of a huge_page_buffer), else into a new allocation on huge pages.
torch::Tensor pack_linear_weight(const torch::Tensor& weight, int64_t width, bool bfloat16,
                                 std::optional<torch::Tensor> out) {
  const auto dtype = weight.scalar_type();
  TORCH_CHECK(weight.dim() == 2 && (dtype == torch::kFloat32 || (bfloat16 && dtype == torch::kBFloat16)),
              "weight must be a 2-D float32 tensor (or bfloat16, packed for the bfloat16 kernels)");
  const int64_t n = weight.size(0), k = weight.size(1);
  const auto shape = packed_shape(n, k, width, bfloat16);
  const auto packed_dtype = bfloat16 ? torch::kBFloat16 : torch::kFloat32;
  torch::Tensor packed = out.has_value() ? *out : empty_on_huge_pages(shape, packed_dtype);
  TORCH_CHECK(packed.sizes() == at::IntArrayRef(shape) && packed.scalar_type() == packed_dtype &&
                  packed.is_contiguous(),
              "out must be a contiguous ", bfloat16 ? "bfloat16" : "float32", " tensor of shape ", shape);
  const int64_t tiles = shape[0], tile = shape[2];
  if (!bfloat16) {
    auto padded = torch::zeros({tiles * tile, k}, weight.options());
    padded.narrow(0, 0, n).copy_(weight);
    packed.copy_(padded.view({tiles, tile, k}).transpose(1, 2));
    return packed;
  }
  const int64_t pairs = shape[1];
  auto padded = torch::zeros({tiles * tile, 2 * pairs}, weight.options().dtype(torch::kBFloat16));
  padded.narrow(0, 0, n).narrow(1, 0, k).copy_(weight);
  packed.copy_(padded.view({tiles, tile, pairs, 2}).permute({0, 2, 1, 3}));
  return packed;
}

// x [M, K] float32 and a weight packed by pack_linear_weight for K inputs: checked; the packing's width.
int64_t check_gemm_operands(const torch::Tensor& x, const torch::Tensor& packed) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, "x must be a 2-D float32 tensor");
  const int64_t width = packed_width(packed);
  const bool bf16 = packed.scalar_type() == torch::kBFloat16;
  TORCH_CHECK(width > 0 && packed.is_contiguous(), "packed weight expected");
  TORCH_CHECK(packed_inputs(x.size(1), bf16) == packed.size(1), "x has ", x.size(1), " features, the weight expects ",
              bf16 ? 2 * packed.size(1) : packed.size(1), bf16 ? " (or one fewer)" : "");
  return width;
}

// x [M, K] @ weight.T -> [M, N], the weight given packed by pack_linear_weight (its tile width picks the
// path). max_rows > 0 runs the micro-kernel at that height instead of the path's own (for timing).
torch::Tensor packed_linear(const torch::Tensor& x, const torch::Tensor& packed, int64_t n, int64_t max_rows) {
  const int64_t width = check_gemm_operands(x, packed);
  const bool bf16 = packed.scalar_type() == torch::kBFloat16;
  const int64_t m = x.size(0), k = x.size(1);
  TORCH_CHECK(n <= packed.size(0) * packed.size(2), "n is larger than the packed weight");
  auto xc = x.contiguous();
  auto y = torch::empty({m, n}, x.options());
  with_gemm_path(width, bf16, [&](auto path) {
    using P = decltype(path);
    TORCH_CHECK(max_rows >= 0 && max_rows <= P::kTableRows, "max_rows above ", P::kTableRows, " for ", width, " bits");
    linear_rows<P>(xc.data_ptr<float>(), m, k, weight_data<P>(packed), n, nullptr, y.data_ptr<float>(),
                   static_cast<int>(max_rows));
  });
  return y;
}

// x [M, K] -> silu(x . Wg^T) * (x . Wu^T) [M, I], gate and up packed together as one [2I, K] weight (gate first,
// I a whole number of the path's tiles): the stack's fused SwiGLU, callable alone to time it against the
// unfused pair (packed_linear, then silu_and_mul).
torch::Tensor packed_swiglu(const torch::Tensor& x, const torch::Tensor& packed, int64_t intermediate) {
  const int64_t width = check_gemm_operands(x, packed);
  const bool bf16 = packed.scalar_type() == torch::kBFloat16;
  auto xc = x.contiguous();
  auto out = torch::empty({x.size(0), intermediate}, x.options());
  with_gemm_path(width, bf16, [&](auto path) {
    using P = decltype(path);
    TORCH_CHECK(intermediate > 0 && intermediate % P::kTile == 0 && packed.size(0) * P::kTile == 2 * intermediate,
                "gate and up must be whole ", P::kTile, "-column tiles, packed as one [2 * ", intermediate, ", K]");
    swiglu_rows<P>(xc.data_ptr<float>(), x.size(0), x.size(1), weight_data<P>(packed), intermediate, nullptr,
                   out.data_ptr<float>());
  });
  return out;
}

// query [T, H, D]; k_cache / v_cache [blocks, block_size, KVH, D], both float32 or both bfloat16 (widened to
// float32 as they are read); block_tables [S, max_blocks]; row_seq [T] (which table each row uses);
// context_lens [T]. Returns [T, H, D] float32.
torch::Tensor paged_attention(const torch::Tensor& query, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                              const torch::Tensor& block_tables, const torch::Tensor& row_seq,
                              const torch::Tensor& context_lens, double scale, int64_t width) {
  const bool bf16 = k_cache.scalar_type() == torch::kBFloat16;
  check_cache(k_cache, "k_cache", bf16);
  check_cache(v_cache, "v_cache", bf16);
  TORCH_CHECK(query.scalar_type() == torch::kFloat32 && query.dim() == 3, "query must be [T, H, D] float32");
  auto q = query.contiguous();
  auto tables = as_int64(block_tables), seqs = as_int64(row_seq), lens = as_int64(context_lens);
  const int64_t rows = q.size(0), heads = q.size(1), dim = q.size(2);
  const CacheShape shape{k_cache.size(1), k_cache.size(2), dim};
  TORCH_CHECK(heads % shape.kv_heads == 0 && k_cache.size(3) == dim, "head shapes do not match");
  const int64_t table_width = tables.size(1);
  check_rows(tables, seqs, lens, shape.block_size);
  auto out = torch::empty_like(q);
  with_path(width, [&](auto path) {
    const auto attend = [&](const auto* k, const auto* v) {
      attention_rows<typename decltype(path)::Vec>(q.data_ptr<float>(), rows, heads * dim, heads, k, v, shape,
                                                   tables.data_ptr<int64_t>(), table_width, seqs.data_ptr<int64_t>(),
                                                   lens.data_ptr<int64_t>(), static_cast<float>(scale),
                                                   out.data_ptr<float>());
    };
    if (bf16) {
      attend(static_cast<const uint16_t*>(k_cache.data_ptr()), static_cast<const uint16_t*>(v_cache.data_ptr()));
    } else {
      attend(k_cache.data_ptr<float>(), v_cache.data_ptr<float>());
    }
  });
  return out;
}

// Root-mean-square norm of each row, times weight.
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps, int64_t width) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && x.dim() == 2, "2-D float32 x expected");
  auto xc = x.contiguous().clone();
  TORCH_CHECK(weight.numel() == xc.size(1) && weight.is_contiguous(), "weight must have one entry per column");
  auto out = torch::empty_like(xc);
  with_path(width, [&](auto path) {
    rms_norm_rows<typename decltype(path)::Vec>(xc.data_ptr<float>(), nullptr, weight.data_ptr<float>(), xc.size(0),
                                                xc.size(1), static_cast<float>(eps), out.data_ptr<float>());
  });
  return out;
}

// Rotary embedding in place on q [T, H, D] and k [T, KVH, D] (views of one projection output are fine):
// x * cos + rotate_half(x) * sin, with cos / sin [T, D] looked up by position.
void rotary_embedding(torch::Tensor& q, torch::Tensor& k, const torch::Tensor& cos, const torch::Tensor& sin,
                      int64_t width) {
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && q.stride(1) == q.size(2) && k.stride(1) == k.size(2) &&
                  cos.is_contiguous() && sin.is_contiguous(),
              "rotary embedding wants heads contiguous within a row");
  const int64_t tokens = q.size(0), dim = q.size(2);
  with_path(width, [&](auto path) {
    using V = typename decltype(path)::Vec;
    const float *c = cos.data_ptr<float>(), *s = sin.data_ptr<float>();
    rotary_rows<V>(q.data_ptr<float>(), tokens, q.stride(0), q.size(1), dim, c, s);
    rotary_rows<V>(k.data_ptr<float>(), tokens, k.stride(0), k.size(1), dim, c, s);
  });
}

// SwiGLU's gate: [M, 2I] (gate then up) -> silu(gate) * up, [M, I].
torch::Tensor silu_and_mul(const torch::Tensor& gate_up, int64_t width) {
  TORCH_CHECK(gate_up.is_contiguous() && gate_up.dim() == 2 && gate_up.size(1) % 2 == 0, "contiguous [M, 2I]");
  const int64_t rows = gate_up.size(0), size = gate_up.size(1) / 2;
  auto out = torch::empty({rows, size}, gate_up.options());
  with_path(width, [&](auto path) {
    silu_and_mul_rows<typename decltype(path)::Vec>(gate_up.data_ptr<float>(), rows, size, out.data_ptr<float>());
  });
  return out;
}

// The index of each row's largest value in x [rows, n] float32 (the first of equals; a NaN counts as largest).
std::vector<int64_t> argmax(const torch::Tensor& x, int64_t width) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, "x must be a 2-D float32 tensor");
  auto xc = x.contiguous();
  std::vector<int64_t> out;
  with_path(width, [&](auto path) {
    out = argmax_rows<typename decltype(path)::Vec>(xc.data_ptr<float>(), xc.size(0), xc.size(1));
  });
  return out;
}

// ----- The whole decoder stack in one call -----

// y [m, n] = x [m, k] . W^T (+ bias) through torch's own GEMM, on the plain weight [n, k] (float32 or bf16: then
// x is rounded to bf16 for the product, as F.linear on bf16 weights does). x and y stay float32.
void torch_linear(const float* x, int64_t m, int64_t k, const torch::Tensor& weight, const torch::Tensor& bias,
                  float* y) {
  auto xt = torch::from_blob(const_cast<float*>(x), {m, k});
  auto yt = torch::from_blob(y, {m, weight.size(0)});
  if (weight.scalar_type() == torch::kFloat32) {
    if (bias.numel() == 0) {
      at::mm_out(yt, xt, weight.t());
    } else {
      at::addmm_out(yt, bias, xt, weight.t());
    }
    return;
  }
  yt.copy_(at::linear(xt.to(weight.scalar_type()), weight));
  if (bias.numel() != 0) yt.add_(bias);
}

// A Llama-family decoder's layers on packed weights. One forward runs every layer for a flat batch of
// prompt and decode rows: in eager PyTorch the same step is about twelve dispatches per layer, each costing
// Python and allocator time that at batch 1 adds up to a third of the step. With bfloat16, its weights are
// packed bf16 and its KV cache is bf16; norms, biases and everything computed stay float32.
class NativeLlama {
 public:
  NativeLlama(int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t hidden, int64_t intermediate, double eps,
              torch::Tensor final_norm, int64_t width, bool bfloat16)
      : heads_(heads), kv_heads_(kv_heads), dim_(head_dim), hidden_(hidden), intermediate_(intermediate),
        eps_(static_cast<float>(eps)), final_norm_(final_norm.contiguous()), width_(width), bf16_(bfloat16) {
    TORCH_CHECK(heads % kv_heads == 0, "query heads must be a multiple of KV heads");
    with_gemm_path(width, bfloat16, [](auto) {});  // refuses a width (or bf16) this build lacks
    TORCH_CHECK(attend_fn<v8>(head_dim) != nullptr, "no attention kernel for head size ", head_dim);
    check_float_rows(final_norm_, "final_norm");
  }

  // Weights packed by pack_linear_weight for this stack's width and dtype; norms and biases float32 (a bias
  // may be an empty tensor). A projection that route_to_torch will send to torch's GEMM also needs its plain
  // weight [N, K] (float32, or bf16 on a bf16 stack); the others take an empty tensor.
  void add_layer(torch::Tensor input_norm, torch::Tensor qkv, torch::Tensor qkv_bias, torch::Tensor o,
                 torch::Tensor post_norm, torch::Tensor gate_up, torch::Tensor gate_up_bias, torch::Tensor down,
                 torch::Tensor down_bias, torch::Tensor qkv_plain, torch::Tensor o_plain, torch::Tensor gate_up_plain,
                 torch::Tensor down_plain) {
    const int64_t qkv_width = (heads_ + 2 * kv_heads_) * dim_;
    Layer layer{input_norm.contiguous(), post_norm.contiguous(),
                {projection(qkv, qkv_bias, qkv_plain, hidden_, qkv_width),
                 projection(o, torch::empty({0}), o_plain, heads_ * dim_, hidden_),
                 projection(gate_up, gate_up_bias, gate_up_plain, hidden_, 2 * intermediate_),
                 projection(down, down_bias, down_plain, intermediate_, hidden_)}};
    for (const auto* t : {&layer.input_norm, &layer.post_norm}) {
      TORCH_CHECK(t->scalar_type() == torch::kFloat32, "norm weights and biases must be float32 (on every stack)");
    }
    for (size_t which = 0; which < kProjections; ++which) {
      TORCH_CHECK(torch_rows_[which].empty() || layer.projections[which].plain.numel() > 0, kProjectionNames[which],
                  " is routed to torch's GEMM: every layer needs its plain weight");
    }
    layers_.push_back(std::move(layer));
  }

  // From now on, steps of lo..hi rows (inclusive) run projection `name` (qkv, o, gate_up or down) on torch's
  // GEMM instead of the packed kernels; for lm_head, LM heads over lo..hi logit rows do. Every layer added so
  // far (or set_io, for lm_head) must have handed that projection's plain weight.
  void route_to_torch(const std::string& name, int64_t lo, int64_t hi) {
    TORCH_CHECK(lo >= 1 && lo <= hi, "rows ", lo, "..", hi, " is no range of row counts");
    if (name == "lm_head") {
      TORCH_CHECK(lm_head_.plain.numel() > 0, "lm_head has no plain weight to hand torch's GEMM (set_io)");
      lm_head_torch_rows_.push_back({lo, hi});
      return;
    }
    const auto it = std::find(kProjectionNames.begin(), kProjectionNames.end(), name);
    TORCH_CHECK(it != kProjectionNames.end(), "no projection named ", name, " (qkv, o, gate_up, down, lm_head)");
    const auto which = static_cast<size_t>(it - kProjectionNames.begin());
    for (const Layer& layer : layers_) {
      TORCH_CHECK(layer.projections[which].plain.numel() > 0, name, " has no plain weight to hand torch's GEMM");
    }
    torch_rows_[which].push_back({lo, hi});
  }

  // From now on, SwiGLU is fused into the packed gate/up GEMM at exactly these row counts (inclusive ranges).
  void fuse_swiglu_at(const std::vector<std::pair<int64_t, int64_t>>& ranges) {
    fused_rows_.clear();
    for (const auto& [lo, hi] : ranges) {
      TORCH_CHECK(lo >= 1 && lo <= hi, "rows ", lo, "..", hi, " is no range of row counts");
      fused_rows_.push_back({lo, hi});
    }
  }

  // What a step's inputs are looked up in, and its last projection: the token embedding [vocab, hidden]
  // (float32, or bf16 on a bf16 model), the rotary tables cos / sin [positions, head_dim] float32, and the LM
  // head packed like the layers' projections (its plain weight [vocab, hidden] in the stack's dtype when
  // route_to_torch sends some row counts of it to torch's GEMM, else empty).
  void set_io(torch::Tensor embedding, torch::Tensor cos, torch::Tensor sin, torch::Tensor lm_head,
              torch::Tensor lm_head_plain) {
    TORCH_CHECK(embedding.dim() == 2 && embedding.size(1) == hidden_ && embedding.is_contiguous() &&
                    (embedding.scalar_type() == torch::kFloat32 || embedding.scalar_type() == torch::kBFloat16),
                "the embedding must be a contiguous [vocab, ", hidden_, "] float32 or bfloat16 tensor");
    check_float_rows(cos, "cos");
    check_float_rows(sin, "sin");
    TORCH_CHECK(cos.dim() == 2 && cos.size(1) == dim_ && sin.sizes() == cos.sizes(), "cos and sin must be [positions, ",
                dim_, "]");
    embedding_ = embedding;
    cos_ = cos;
    sin_ = sin;
    lm_head_ = projection(lm_head, torch::empty({0}), lm_head_plain, hidden_, embedding.size(0));
  }

  // One step over a flat batch of T rows, its inputs as plain lists (the caller builds no tensor for them):
  // each row's token and position, the KV slot it writes, which sequence it belongs to (row_seq, an index
  // into block_tables, one table per sequence), and logit_rows, the rows the LM head runs on. A row sees
  // positions [0, position] of its sequence: a decode row its whole context, a prompt row the prompt up to
  // itself. kv_cache is [layers, 2, blocks, block_size, KVH, D]. Returns the final-normed hidden states
  // [T, hidden] and the logits [logit rows, vocab], both float32, and each logit row's argmax (the greedy
  // token, taken while the logits are still in cache).
  std::tuple<torch::Tensor, torch::Tensor, std::vector<int64_t>> step(const std::vector<int64_t>& token_ids,
                                                const std::vector<int64_t>& positions, torch::Tensor& kv_cache,
                                                const std::vector<int64_t>& slots,
                                                const std::vector<std::vector<int64_t>>& block_tables,
                                                const std::vector<int64_t>& row_seq,
                                                const std::vector<int64_t>& logit_rows) {
    TORCH_CHECK(embedding_.defined(), "set_io must run before the first step");
    check_cache(kv_cache, "kv_cache", bf16_);
    TORCH_CHECK(kv_cache.dim() == 6 && kv_cache.size(0) == static_cast<int64_t>(layers_.size()) &&
                    kv_cache.size(4) == kv_heads_ && kv_cache.size(5) == dim_,
                "kv_cache must be [layers, 2, blocks, block_size, kv_heads, head_dim]");
    const int64_t tokens = static_cast<int64_t>(token_ids.size());
    TORCH_CHECK(positions.size() == token_ids.size() && slots.size() == token_ids.size() &&
                    row_seq.size() == token_ids.size(),
                "token_ids, positions, slots and row_seq must have one entry per row");
    const CacheShape shape{kv_cache.size(3), kv_heads_, dim_};
    const StepTables tables = step_tables(block_tables, kv_cache.size(2));
    std::vector<int64_t> context_lens(tokens);
    for (int64_t t = 0; t < tokens; ++t) {
      TORCH_CHECK(slots[t] >= 0 && slots[t] < kv_cache.size(2) * shape.block_size, "slot ", slots[t],
                  " outside the cache");
      TORCH_CHECK(positions[t] >= 0 && positions[t] < cos_.size(0), "position ", positions[t], " outside the ",
                  cos_.size(0), " the rotary tables cover");
      TORCH_CHECK(row_seq[t] >= 0 && row_seq[t] < static_cast<int64_t>(block_tables.size()), "row ", t,
                  " names block table ", row_seq[t], " of ", block_tables.size());
      context_lens[t] = positions[t] + 1;
      TORCH_CHECK(context_lens[t] <= static_cast<int64_t>(block_tables[row_seq[t]].size()) * shape.block_size,
                  "row ", t, ": position ", positions[t], " is past its sequence's blocks");
    }
    for (const int64_t row : logit_rows) TORCH_CHECK(row >= 0 && row < tokens, "logit row ", row, " of ", tokens);
    auto x = embed(token_ids);
    auto cos = rows_of(cos_, positions), sin = rows_of(sin_, positions);
    const Step step{tokens, x.data_ptr<float>(), cos.data_ptr<float>(), sin.data_ptr<float>(), &kv_cache, shape,
                    slots.data(), tables.ids.data(), tables.width, row_seq.data(), context_lens.data()};
    auto out = torch::empty({tokens, hidden_}, x.options());
    torch::Tensor logits;
    std::vector<int64_t> greedy;
    with_gemm_path(width_, bf16_, [&](auto path) {
      using P = decltype(path);
      run<P>(step, out.data_ptr<float>());
      logits = lm_head_logits<P>(out, logit_rows);
      greedy = argmax_rows<typename P::Vec>(logits.data_ptr<float>(), logits.size(0), logits.size(1));
    });
    return {out, logits, greedy};
  }

 private:
  // One forward's inputs, checked.
  struct Step {
    int64_t tokens;
    float *x;
    const float *cos, *sin;
    torch::Tensor* kv_cache;
    CacheShape shape;
    const int64_t *slots, *tables;
    int64_t table_width;
    const int64_t *row_seq, *context_lens;
  };

  // A step's block tables, padded with block 0 to the longest, each block checked to lie in the cache.
  struct StepTables {
    std::vector<int64_t> ids;
    int64_t width;
  };

  static StepTables step_tables(const std::vector<std::vector<int64_t>>& tables, int64_t num_blocks) {
    int64_t width = 1;
    for (const auto& table : tables) width = std::max<int64_t>(width, static_cast<int64_t>(table.size()));
    std::vector<int64_t> ids(tables.size() * width, 0);
    for (size_t seq = 0; seq < tables.size(); ++seq) {
      for (size_t i = 0; i < tables[seq].size(); ++i) {
        const int64_t block = tables[seq][i];
        TORCH_CHECK(block >= 0 && block < num_blocks, "block ", block, " outside the cache of ", num_blocks);
        ids[seq * width + i] = block;
      }
    }
    return {std::move(ids), width};
  }

  // The embedding rows of the step's tokens, float32 [T, hidden] (widened from a bf16 table).
  torch::Tensor embed(const std::vector<int64_t>& token_ids) const {
    const int64_t vocab = embedding_.size(0);
    for (const int64_t id : token_ids) TORCH_CHECK(id >= 0 && id < vocab, "token id ", id, " outside the vocabulary");
    return rows_of(embedding_, token_ids).to(torch::kFloat32);
  }

  // Rows `index` of a table [rows, columns], contiguous [index.size(), columns] in the table's dtype.
  static torch::Tensor rows_of(const torch::Tensor& table, const std::vector<int64_t>& index) {
    auto ids = torch::from_blob(const_cast<int64_t*>(index.data()), {static_cast<int64_t>(index.size())},
                                torch::kInt64);
    return table.index_select(0, ids);
  }

  // The LM head on rows `rows` of the final hidden states: the packed kernels, or torch's GEMM where routed.
  template <typename P>
  torch::Tensor lm_head_logits(const torch::Tensor& hidden, const std::vector<int64_t>& rows) const {
    const int64_t m = static_cast<int64_t>(rows.size());
    bool every_row = m == hidden.size(0);  // a batch of decodes samples every row: no gather
    for (int64_t i = 0; every_row && i < m; ++i) every_row = rows[i] == i;
    const torch::Tensor x = every_row ? hidden : rows_of(hidden, rows);
    auto logits = torch::empty({m, lm_head_.n}, hidden.options());
    if (m == 0) return logits;
    if (in_ranges(lm_head_torch_rows_, m)) {
      torch_linear(x.data_ptr<float>(), m, hidden_, lm_head_.plain, lm_head_.bias, logits.data_ptr<float>());
    } else {
      linear_rows<P>(x.data_ptr<float>(), m, hidden_, weight_data<P>(lm_head_.packed), lm_head_.n, nullptr,
                     logits.data_ptr<float>());
    }
    return logits;
  }

  // Every layer and the final norm on path P; out [tokens, hidden].
  template <typename P>
  void run(const Step& step, float* out) {
    using V = typename P::Vec;
    using C = typename P::Cache;
    const int64_t tokens = step.tokens;
    const int64_t q_width = heads_ * dim_, qkv_width = (heads_ + 2 * kv_heads_) * dim_;
    auto opts = final_norm_.options();
    auto normed = torch::empty({tokens, hidden_}, opts), qkv = torch::empty({tokens, qkv_width}, opts);
    auto attn = torch::empty({tokens, q_width}, opts), delta = torch::empty({tokens, hidden_}, opts);
    // A tile must not straddle gate and up; a gate/up on torch's GEMM goes through memory.
    const bool fused_swiglu =
        in_ranges(fused_rows_, tokens) && intermediate_ % P::kTile == 0 && !on_torch(kGateUp, tokens);
    auto gate_up = torch::empty({fused_swiglu ? 0 : tokens, 2 * intermediate_}, opts);
    auto act = torch::empty({tokens, intermediate_}, opts);
    float* xp = step.x;
    float *np = normed.data_ptr<float>(), *qkvp = qkv.data_ptr<float>(), *ap = attn.data_ptr<float>();
    float *dp = delta.data_ptr<float>(), *gp = gate_up.data_ptr<float>(), *actp = act.data_ptr<float>();
    const float scale = 1.f / std::sqrt(static_cast<float>(dim_));
    const torch::Tensor& kv_cache = *step.kv_cache;
    const int64_t layer_stride = kv_cache.stride(0), kv_stride = kv_cache.stride(1);
    for (size_t l = 0; l < layers_.size(); ++l) {
      const Layer& w = layers_[l];
      C* k_cache = static_cast<C*>(kv_cache.data_ptr()) + l * layer_stride;
      C* v_cache = k_cache + kv_stride;
      // The previous layer's MLP output joins the residual stream on the way into this layer's norm.
      rms_norm_rows<V>(xp, l == 0 ? nullptr : dp, w.input_norm.data_ptr<float>(), tokens, hidden_, eps_, np);
      project<P>(w, kQkv, np, tokens, hidden_, qkvp);
      rotary_rows<V>(qkvp, tokens, qkv_width, heads_ + kv_heads_, dim_, step.cos, step.sin);
      write_kv_rows(qkvp + q_width, qkvp + q_width + kv_heads_ * dim_, tokens, qkv_width, step.slots, step.shape,
                    k_cache, v_cache);
      // Attention on 8 lanes on either path: 16 measured no faster (reading K and V bounds it).
      attention_rows<v8>(qkvp, tokens, qkv_width, heads_, k_cache, v_cache, step.shape, step.tables, step.table_width,
                      step.row_seq, step.context_lens, scale, ap);
      project<P>(w, kO, ap, tokens, q_width, dp);
      rms_norm_rows<V>(xp, dp, w.post_norm.data_ptr<float>(), tokens, hidden_, eps_, np);
      if (fused_swiglu) {
        const Projection& gate_up = w.projections[kGateUp];
        swiglu_rows<P>(np, tokens, hidden_, weight_data<P>(gate_up.packed), intermediate_,
                       optional_data(gate_up.bias), actp);
      } else {
        project<P>(w, kGateUp, np, tokens, hidden_, gp);
        silu_and_mul_rows<V>(gp, tokens, intermediate_, actp);
      }
      project<P>(w, kDown, actp, tokens, intermediate_, dp);
    }
    rms_norm_rows<V>(xp, layers_.empty() ? nullptr : dp, final_norm_.data_ptr<float>(), tokens, hidden_, eps_, out);
  }

  // A layer's projection: its packed weight, bias (float32, or empty) and plain weight (empty unless some row
  // counts run it on torch's GEMM).
  struct Projection {
    torch::Tensor packed, bias, plain;
    int64_t n;
  };
  enum Which : size_t { kQkv, kO, kGateUp, kDown, kProjections };
  static constexpr std::array<const char*, kProjections> kProjectionNames{"qkv", "o", "gate_up", "down"};
  struct Layer {
    torch::Tensor input_norm, post_norm;
    std::array<Projection, kProjections> projections;
  };
  struct RowRange {
    int64_t lo, hi;
  };

  Projection projection(const torch::Tensor& packed, const torch::Tensor& bias, const torch::Tensor& plain,
                        int64_t k, int64_t n) const {
    check_packed(packed, k, n);
    TORCH_CHECK(bias.scalar_type() == torch::kFloat32, "norm weights and biases must be float32 (on every stack)");
    TORCH_CHECK(bias.numel() == 0 || bias.numel() == n, "a bias of ", n, " expected");
    const auto plain_dtype = bf16_ ? torch::kBFloat16 : torch::kFloat32;
    TORCH_CHECK(plain.numel() == 0 || (plain.dim() == 2 && plain.size(0) == n && plain.size(1) == k &&
                                       plain.scalar_type() == plain_dtype),
                "a plain weight must be [", n, ", ", k, "] in the stack's dtype, or empty");
    return {packed, bias.contiguous(), plain.numel() == 0 ? plain : plain.contiguous(), n};
  }

  void check_packed(const torch::Tensor& packed, int64_t k, int64_t n) const {
    TORCH_CHECK(packed_width(packed) == width_ && (packed.scalar_type() == torch::kBFloat16) == bf16_ &&
                    packed.size(1) == packed_inputs(k, bf16_) && packed.is_contiguous() &&
                    packed.size(0) * packed.size(2) >= n,
                "a [", n, ", ", k, "] weight packed for ", width_, " bits", bf16_ ? " in bfloat16" : "", " expected");
  }

  static bool in_ranges(const std::vector<RowRange>& ranges, int64_t rows) {
    for (const RowRange& range : ranges) {
      if (rows >= range.lo && rows <= range.hi) return true;
    }
    return false;
  }

  bool on_torch(Which which, int64_t rows) const { return in_ranges(torch_rows_[which], rows); }

  // y [rows, n] = x [rows, k] through a layer's projection: the packed kernels, or torch's GEMM where routed.
  template <typename P>
  void project(const Layer& layer, Which which, const float* x, int64_t rows, int64_t k, float* y) const {
    const Projection& w = layer.projections[which];
    if (on_torch(which, rows)) return torch_linear(x, rows, k, w.plain, w.bias, y);
    linear_rows<P>(x, rows, k, weight_data<P>(w.packed), w.n, optional_data(w.bias), y);
  }

  int64_t heads_, kv_heads_, dim_, hidden_, intermediate_;
  float eps_;
  torch::Tensor final_norm_;
  int64_t width_;
  bool bf16_;
  std::vector<Layer> layers_;
  std::array<std::vector<RowRange>, kProjections> torch_rows_;
  torch::Tensor embedding_, cos_, sin_;  // set_io's
  Projection lm_head_;
  std::vector<RowRange> lm_head_torch_rows_;
  // Fused SwiGLU pays where the step is compute-bound and the [T, 2I] projection outgrows L2 (measured: 5% off
  // a forward of 64 rows); below that the step is a weight stream, which reads faster as one stream in order
  // (2% slower fused at 1 and 8 rows). The default; --kernels auto sets what it measures (fuse_swiglu_at).
  std::vector<RowRange> fused_rows_{{kRowsPerBlock, std::numeric_limits<int64_t>::max()}};
};

// The compute releases the GIL: it touches no Python object (arguments are converted before, the result
// after), so the server's event loop keeps answering, streaming and accepting while a model step runs.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using release_gil = pybind11::call_guard<pybind11::gil_scoped_release>;
  using pybind11::arg;
  m.def("kernel_widths", &kernel_widths, "the vector widths in bits this build has kernels for");
  m.def("has_bfloat16", &has_bfloat16, "whether this build has the bfloat16 GEMMs (avx512_bf16)");
  m.def("packed_shape", &packed_shape, "the shape pack_linear_weight gives a weight [n, k]", arg("n"), arg("k"),
        arg("width") = 256, arg("bfloat16") = false);
  m.def("huge_page_buffer", &huge_page_buffer, "a 1-D float32 (or bf16) buffer on huge pages", arg("numel"),
        arg("bfloat16") = false, release_gil());
  m.def("pack_linear_weight", &pack_linear_weight, "weight [N, K] -> tiles [N/T, K, T] for a path's width",
        arg("weight"), arg("width") = 256, arg("bfloat16") = false, arg("out") = pybind11::none(), release_gil());
  m.def("packed_linear", &packed_linear, "x [M, K] times a packed weight -> [M, N]", arg("x"), arg("packed"),
        arg("n"), arg("max_rows") = 0, release_gil());
  m.def("packed_swiglu", &packed_swiglu, "silu(x . Wg^T) * (x . Wu^T), gate and up packed as one weight",
        arg("x"), arg("packed"), arg("intermediate"), release_gil());
  m.def("argmax", &argmax, "the index of each row's largest value (first of equals; NaN counts as largest)",
        arg("x"), arg("width") = 256, release_gil());
  m.def("rms_norm", &rms_norm, "RMSNorm of each row, times weight", arg("x"), arg("weight"), arg("eps"),
        arg("width") = 256, release_gil());
  m.def("rotary_embedding", &rotary_embedding, "rotary embedding of q and k, in place", arg("q"), arg("k"),
        arg("cos"), arg("sin"), arg("width") = 256, release_gil());
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up", arg("gate_up"), arg("width") = 256, release_gil());
  m.def("paged_attention", &paged_attention, "attention of query rows over a paged KV cache", arg("query"),
        arg("k_cache"), arg("v_cache"), arg("block_tables"), arg("row_seq"), arg("context_lens"), arg("scale"),
        arg("width") = 256, release_gil());
  pybind11::class_<NativeLlama>(m, "NativeLlama", pybind11::module_local())
      .def(pybind11::init<int64_t, int64_t, int64_t, int64_t, int64_t, double, torch::Tensor, int64_t, bool>(),
           arg("heads"), arg("kv_heads"), arg("head_dim"), arg("hidden"), arg("intermediate"), arg("eps"),
           arg("final_norm"), arg("width"), arg("bfloat16") = false)
      .def("add_layer", &NativeLlama::add_layer)
      .def("route_to_torch", &NativeLlama::route_to_torch, arg("name"), arg("lo"), arg("hi"))
      .def("fuse_swiglu_at", &NativeLlama::fuse_swiglu_at, arg("ranges"))
      .def("set_io", &NativeLlama::set_io, arg("embedding"), arg("cos"), arg("sin"), arg("lm_head"),
           arg("lm_head_plain"))
      .def("step", &NativeLlama::step, arg("token_ids"), arg("positions"), arg("kv_cache"), arg("slots"),
           arg("block_tables"), arg("row_seq"), arg("logit_rows"), release_gil());
}
