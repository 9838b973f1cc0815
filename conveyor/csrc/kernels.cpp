// Native CPU kernels for the two places a decode step loses most time in eager PyTorch.
//
// 1. Linear layers on packed weights. A weight [N, K] is stored as tiles of 16
//    output columns, each tile [K, 16] contiguous, so that one pass streams the
//    whole weight once, in order, whatever the number of rows: at batch 1 the
//    step is bound by memory bandwidth, and at larger batches each tile is
//    reused from cache by every row.
// 2. Decode attention straight over the paged KV cache. Each query row reads
//    its own context through its block table; nothing is gathered into a
//    padded copy, and rows of any context length share one call.
//
// Vectors are GCC/Clang vector extensions rather than intrinsics, so the same
// source builds for AVX2 or NEON with -march=native. Threads: ATen's parallel_for (OpenMP).

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

constexpr int64_t kTile = 16;  // output columns per weight tile: two 8-float vectors
constexpr int64_t kRowsPerBlock = 64;  // rows that share a weight tile while it is in cache

typedef float v8 __attribute__((vector_size(32)));
typedef float v8u __attribute__((vector_size(32), aligned(4)));

inline v8 load8(const float* p) { return *reinterpret_cast<const v8u*>(p); }
inline void store8(float* p, v8 v) { *reinterpret_cast<v8u*>(p) = v; }

// rows x 16 outputs of one tile: y[r, 0:cols] = x[r, :] . tile[:, 0:cols]
template <int Rows>
void tile_kernel(const float* x, int64_t ldx, const float* tile, int64_t k_size, float* y, int64_t ldy,
                 int64_t cols) {
  v8 acc[Rows][2];
  for (int r = 0; r < Rows; ++r) acc[r][0] = acc[r][1] = v8{};
  for (int64_t k = 0; k < k_size; ++k) {
    const v8 w0 = load8(tile + k * kTile);
    const v8 w1 = load8(tile + k * kTile + 8);
    for (int r = 0; r < Rows; ++r) {
      const float xv = x[r * ldx + k];
      acc[r][0] += w0 * xv;
      acc[r][1] += w1 * xv;
    }
  }
  for (int r = 0; r < Rows; ++r) {
    if (cols == kTile) {
      store8(y + r * ldy, acc[r][0]);
      store8(y + r * ldy + 8, acc[r][1]);
    } else {
      float out[kTile];
      store8(out, acc[r][0]);
      store8(out + 8, acc[r][1]);
      std::copy(out, out + cols, y + r * ldy);
    }
  }
}

using TileFn = void (*)(const float*, int64_t, const float*, int64_t, float*, int64_t, int64_t);
constexpr int kMaxRows = 6;  // 12 accumulators + 2 weight vectors + 1 broadcast: fits 16 vector registers
constexpr TileFn kTileFns[kMaxRows + 1] = {nullptr,          tile_kernel<1>, tile_kernel<2>, tile_kernel<3>,
                                           tile_kernel<4>, tile_kernel<5>, tile_kernel<6>};

typedef float v4 __attribute__((vector_size(16)));
typedef int32_t v8i __attribute__((vector_size(32)));

inline float sum8(v8 v) {
  const v4 half = __builtin_shufflevector(v, v, 0, 1, 2, 3) + __builtin_shufflevector(v, v, 4, 5, 6, 7);
  return (half[0] + half[2]) + (half[1] + half[3]);
}

inline v8 splat(float x) { return v8{} + x; }

// e^x for 8 lanes, to about 1 ulp: x = n ln2 + r with |r| <= ln2 / 2, e^r by Cephes' degree-6 polynomial,
// 2^n by writing n into the exponent bits. A scalar std::exp per element costs more than the rest of
// attention's softmax together.
inline v8 exp8(v8 x) {
  const v8 lo = splat(-87.3f), hi = splat(88.3f);
  x = x < lo ? lo : x;
  x = x > hi ? hi : x;
  const v8 shifter = splat(12582912.f);  // 1.5 * 2^23: adding and subtracting it rounds to the nearest integer
  const v8 n = (x * 1.44269504f + shifter) - shifter;
  const v8 r = (x - n * 0.693359375f) + n * 2.12194440e-4f;  // ln2 in two parts, so r keeps its low bits
  v8 p = splat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  const v8i scale = (__builtin_convertvector(n, v8i) + 127) << 23;
  v8 two_n;
  __builtin_memcpy(&two_n, &scale, sizeof two_n);
  return p * two_n;
}

// q . k over NV 8-float vectors, in two accumulators to halve the dependency chain.
template <int NV>
inline float dot(const float* q, const float* k) {
  v8 even = load8(q) * load8(k), odd = v8{};
  for (int j = 1; j < NV; ++j) (j % 2 ? odd : even) += load8(q + 8 * j) * load8(k + 8 * j);
  return sum8(even + odd);
}

// s[i] = exp(s[i] - max(s)); returns the sum.
inline float softmax_numerators(float* s, int64_t n) {
  const float top = *std::max_element(s, s + n);
  v8 total = v8{};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const v8 e = exp8(load8(s + i) - top);
    store8(s + i, e);
    total += e;
  }
  float rest = sum8(total);
  for (; i < n; ++i) rest += (s[i] = std::exp(s[i] - top));
  return rest;
}

// Asks for one KV head's slice of a whole block (block_size rows of dim floats, token_stride apart) while the
// current block is worked on: blocks lie anywhere in the cache, so the hardware prefetcher cannot guess the
// next one, and a decode step's KV is cold (the whole model's weights streamed through since it was read).
inline void prefetch_block(const float* first, int64_t dim, int64_t token_stride, int64_t block_size) {
  for (int64_t i = 0; i < block_size; ++i) {
    for (int64_t d = 0; d < dim; d += 16) __builtin_prefetch(first + i * token_stride + d);
  }
}

// One decode row and one KV head: its `group` query heads attend over `ctx` positions of the paged cache.
// k / v point at this KV head's slice of block 0; table maps position / block_size to a block.
template <int NV>
void attend_kv_head(const float* q, int64_t group, const float* k, const float* v, const int64_t* table,
                    int64_t ctx, int64_t block_size, int64_t token_stride, int64_t block_stride, float scale,
                    float* scores, float* out) {
  constexpr int64_t dim = 8 * NV;
  for (int64_t first = 0; first < ctx; first += block_size) {
    const float* keys = k + table[first / block_size] * block_stride;
    if (first + block_size < ctx) prefetch_block(k + table[first / block_size + 1] * block_stride, dim, token_stride, block_size);
    const int64_t n = std::min(block_size, ctx - first);
    for (int64_t i = 0; i < n; ++i) {
      for (int64_t g = 0; g < group; ++g) {
        scores[g * ctx + first + i] = dot<NV>(q + g * dim, keys + i * token_stride) * scale;
      }
    }
  }
  for (int64_t g = 0; g < group; ++g) {
    float* p = scores + g * ctx;
    const float inv = 1.f / softmax_numerators(p, ctx);
    v8 acc[NV] = {};
    for (int64_t first = 0; first < ctx; first += block_size) {
      const float* values = v + table[first / block_size] * block_stride;
      if (first + block_size < ctx) prefetch_block(v + table[first / block_size + 1] * block_stride, dim, token_stride, block_size);
      const int64_t n = std::min(block_size, ctx - first);
      for (int64_t i = 0; i < n; ++i) {
        const v8 weight = splat(p[first + i]);
        for (int j = 0; j < NV; ++j) acc[j] += load8(values + i * token_stride + 8 * j) * weight;
      }
    }
    for (int j = 0; j < NV; ++j) store8(out + g * dim + 8 * j, acc[j] * inv);
  }
}

using AttendFn = void (*)(const float*, int64_t, const float*, const float*, const int64_t*, int64_t, int64_t,
                          int64_t, int64_t, float, float*, float*);

// Head sizes with their own unrolled kernel (the accumulators stay in registers); others are refused.
AttendFn attend_fn(int64_t dim) {
  switch (dim) {
    case 8: return attend_kv_head<1>;
    case 16: return attend_kv_head<2>;
    case 32: return attend_kv_head<4>;
    case 64: return attend_kv_head<8>;
    case 96: return attend_kv_head<12>;
    case 128: return attend_kv_head<16>;
    default: return nullptr;
  }
}

}  // namespace

// weight [N, K] -> packed [ceil(N / 16), K, 16], zero-padded past N.
torch::Tensor pack_linear_weight(const torch::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == torch::kFloat32, "weight must be a 2-D float32 tensor");
  const int64_t n = weight.size(0), k = weight.size(1);
  const int64_t tiles = (n + kTile - 1) / kTile;
  auto padded = torch::zeros({tiles * kTile, k}, weight.options());
  padded.narrow(0, 0, n).copy_(weight);
  return padded.view({tiles, kTile, k}).transpose(1, 2).contiguous();
}

// x [M, K] @ weight.T -> [M, N], the weight given packed by pack_linear_weight.
torch::Tensor packed_linear(const torch::Tensor& x, const torch::Tensor& packed, int64_t n) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, "x must be a 2-D float32 tensor");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kTile && packed.is_contiguous(), "packed weight expected");
  const int64_t m = x.size(0), k = x.size(1);
  TORCH_CHECK(packed.size(1) == k, "x has ", k, " features, the weight expects ", packed.size(1));
  TORCH_CHECK(n <= packed.size(0) * kTile, "n is larger than the packed weight");
  auto xc = x.contiguous();
  auto y = torch::empty({m, n}, x.options());
  const int64_t tiles = packed.size(0);
  const int64_t row_blocks = (m + kRowsPerBlock - 1) / kRowsPerBlock;
  const float* xp = xc.data_ptr<float>();
  const float* wp = packed.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  // Work items: (row block, tile), row block outermost so neighbouring items share x rows.
  at::parallel_for(0, row_blocks * tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t block = item / tiles, tile = item % tiles;
      const int64_t col = tile * kTile, cols = std::min(kTile, n - col);
      const int64_t row_end = std::min(m, (block + 1) * kRowsPerBlock);
      for (int64_t row = block * kRowsPerBlock; row < row_end; row += kMaxRows) {
        const int64_t rows = std::min<int64_t>(kMaxRows, row_end - row);
        kTileFns[rows](xp + row * k, k, wp + tile * k * kTile, k, yp + row * n + col, n, cols);
      }
    }
  });
  return y;
}

// One query row per decode request: query [T, H, D]; k_cache / v_cache [blocks, block_size, KVH, D];
// block_tables [T, max_blocks] (int64); context_lens [T]. Returns [T, H, D].
torch::Tensor paged_decode_attention(const torch::Tensor& query, const torch::Tensor& k_cache,
                                     const torch::Tensor& v_cache, const torch::Tensor& block_tables,
                                     const torch::Tensor& context_lens, double scale) {
  TORCH_CHECK(query.scalar_type() == torch::kFloat32 && k_cache.scalar_type() == torch::kFloat32,
              "float32 query and cache expected");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "contiguous KV cache expected");
  auto q = query.contiguous();
  auto tables = block_tables.to(torch::kInt64).contiguous();
  auto lens = context_lens.to(torch::kInt64).contiguous();
  const int64_t rows = q.size(0), heads = q.size(1), dim = q.size(2);
  const int64_t block_size = k_cache.size(1), kv_heads = k_cache.size(2);
  const int64_t group = heads / kv_heads, max_blocks = tables.size(1);
  TORCH_CHECK(heads % kv_heads == 0 && k_cache.size(3) == dim, "head shapes do not match");
  const AttendFn attend = attend_fn(dim);
  TORCH_CHECK(attend != nullptr, "no decode attention kernel for head size ", dim, " (8, 16, 32, 64, 96 or 128)");
  const int64_t* lp = lens.data_ptr<int64_t>();
  for (int64_t row = 0; row < rows; ++row) {
    TORCH_CHECK(lp[row] >= 1 && lp[row] <= max_blocks * block_size, "context length outside the block table");
  }
  auto out = torch::empty_like(q);
  const float* qp = q.data_ptr<float>();
  const float* kp = k_cache.data_ptr<float>();
  const float* vp = v_cache.data_ptr<float>();
  const int64_t* tp = tables.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const int64_t token_stride = kv_heads * dim, block_stride = block_size * token_stride;
  const float fscale = static_cast<float>(scale);
  at::parallel_for(0, rows * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t row = item / kv_heads, kvh = item % kv_heads, first_head = row * heads + kvh * group;
      scores.resize(group * lp[row]);
      attend(qp + first_head * dim, group, kp + kvh * dim, vp + kvh * dim, tp + row * max_blocks, lp[row],
             block_size, token_stride, block_stride, fscale, scores.data(), op + first_head * dim);
    }
  });
  return out;
}

// The small per-layer ops, fused: in eager PyTorch each is five to ten dispatches per layer, which at
// batch 1 costs more than the arithmetic.

// Root-mean-square norm of each row, times weight.
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && x.dim() == 2, "2-D float32 x expected");
  auto xc = x.contiguous();
  const int64_t rows = xc.size(0), size = xc.size(1);
  TORCH_CHECK(weight.numel() == size && weight.is_contiguous(), "weight must have one entry per column");
  auto out = torch::empty_like(xc);
  const float* xp = xc.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const float* in = xp + row * size;
      double squares = 0.0;
      for (int64_t i = 0; i < size; ++i) squares += static_cast<double>(in[i]) * in[i];
      const float inv = 1.f / std::sqrt(static_cast<float>(squares / size) + static_cast<float>(eps));
      float* o = op + row * size;
      for (int64_t i = 0; i < size; ++i) o[i] = wp[i] * (in[i] * inv);
    }
  });
  return out;
}

// Rotary embedding in place on q [T, H, D] and k [T, KVH, D] (views of one projection output are fine):
// x * cos + rotate_half(x) * sin, with cos / sin [T, D] looked up by position.
void rotary_embedding(torch::Tensor& q, torch::Tensor& k, const torch::Tensor& cos, const torch::Tensor& sin) {
  const int64_t tokens = q.size(0), dim = q.size(2), half = dim / 2;
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && cos.is_contiguous() && sin.is_contiguous(),
              "rotary embedding wants unit stride along the head dimension");
  float* qp = q.data_ptr<float>();
  float* kp = k.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  auto rotate = [&](float* x, const float* c, const float* s) {
    for (int64_t i = 0; i < half; ++i) {
      const float a = x[i], b = x[i + half];
      x[i] = a * c[i] - b * s[i];
      x[i + half] = b * c[i + half] + a * s[i + half];
    }
  };
  at::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* c = cp + t * dim;
      const float* s = sp + t * dim;
      for (int64_t h = 0; h < q.size(1); ++h) rotate(qp + t * q.stride(0) + h * q.stride(1), c, s);
      for (int64_t h = 0; h < k.size(1); ++h) rotate(kp + t * k.stride(0) + h * k.stride(1), c, s);
    }
  });
}

// SwiGLU's gate: [M, 2I] (gate then up) -> silu(gate) * up, [M, I].
torch::Tensor silu_and_mul(const torch::Tensor& gate_up) {
  TORCH_CHECK(gate_up.is_contiguous() && gate_up.dim() == 2 && gate_up.size(1) % 2 == 0, "contiguous [M, 2I]");
  const int64_t rows = gate_up.size(0), size = gate_up.size(1) / 2;
  auto out = torch::empty({rows, size}, gate_up.options());
  const float* in = gate_up.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const float* gate = in + row * 2 * size;
      const float* up = gate + size;
      float* o = op + row * size;
      int64_t i = 0;
      for (; i + 8 <= size; i += 8) {
        const v8 g = load8(gate + i);
        store8(o + i, g / (1.f + exp8(-g)) * load8(up + i));
      }
      for (; i < size; ++i) o[i] = gate[i] / (1.f + std::exp(-gate[i])) * up[i];
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("pack_linear_weight", &pack_linear_weight, "weight [N, K] -> tiles [N/16, K, 16]");
  m.def("packed_linear", &packed_linear, "x [M, K] times a packed weight -> [M, N]");
  m.def("rms_norm", &rms_norm, "RMSNorm of each row, times weight");
  m.def("rotary_embedding", &rotary_embedding, "rotary embedding of q and k, in place");
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up");
  m.def("paged_decode_attention", &paged_decode_attention, "decode attention over a paged KV cache");
}
