// The row-wise kernels between the GEMMs: RMSNorm (with the residual add before it), rotary embedding,
// SwiGLU's activation, and the argmax a greedy step samples. Each runs on vectors V (v8 or v16), whatever is
// left over past the last whole vector lane by lane.

#pragma once

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "parallel.h"
#include "vec.h"

namespace conveyor {

// out = in / rms(in) * weight over one vector of `size`, its sum of squares given (out may be in).
template <typename V>
inline void scale_by_rms(const float* in, const float* weight, double squares, int64_t size, float eps, float* out) {
  constexpr int64_t lanes = sizeof(V) / sizeof(float);
  const float inv = 1.f / std::sqrt(static_cast<float>(squares / size) + eps);
  int64_t i = 0;
  for (; i + lanes <= size; i += lanes) storev(out + i, loadv<V>(weight + i) * (loadv<V>(in + i) * inv));
  for (; i < size; ++i) out[i] = weight[i] * (in[i] * inv);
}

// out = x / rms(x) * weight, row by row. With `residual`, first x += residual (in place): the residual add
// and the next norm read x once. Squares add up per lane in float and across lanes in double.
template <typename V>
void rms_norm_rows(float* x, const float* residual, const float* weight, int64_t rows, int64_t size, float eps,
                   float* out) {
  constexpr int64_t lanes = sizeof(V) / sizeof(float);
  parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
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
      scale_by_rms<V>(in, weight, squares, size, eps, out + row * size);
    }
  });
}

// x * cos + rotate_half(x) * sin on `heads` heads of `dim` at the start of each row, in place.
template <typename V>
void rotary_rows(float* x, int64_t tokens, int64_t row_stride, int64_t heads, int64_t dim, const float* cos,
                 const float* sin) {
  constexpr int64_t lanes = sizeof(V) / sizeof(float);
  const int64_t half = dim / 2;
  parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
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

// out [rows, size] = act(gate) * up, from [rows, 2 * size] (gate then up): a gated MLP's activation. Act's
// call takes (gate, up) as vectors V, and as floats for what is left past the last whole vector.
template <typename V, typename Act>
void gated_rows(const float* gate_up, int64_t rows, int64_t size, float* out, Act act) {
  constexpr int64_t lanes = sizeof(V) / sizeof(float);
  parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const float* gate = gate_up + row * 2 * size;
      const float* up = gate + size;
      float* o = out + row * size;
      int64_t i = 0;
      for (; i + lanes <= size; i += lanes) storev(o + i, act(loadv<V>(gate + i), loadv<V>(up + i)));
      for (; i < size; ++i) o[i] = act(gate[i], up[i]);
    }
  });
}

// silu(g) * u: SwiGLU's gate.
struct SiluMul {
  template <typename V>
  V operator()(V g, V u) const {
    return silu_mul(g, u);
  }
  float operator()(float g, float u) const { return g / (1.f + std::exp(-g)) * u; }
};

template <typename V>
void silu_and_mul_rows(const float* gate_up, int64_t rows, int64_t size, float* out) {
  gated_rows<V>(gate_up, rows, size, out, SiluMul{});
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
  parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) out[row] = argmax_row<V>(x + row * n, n);
  });
  return out;
}

}  // namespace conveyor
