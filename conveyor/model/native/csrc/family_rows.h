// Row-wise kernels some families need beside Llama's (rows.h): RMSNorm over each head's queries and keys
// (QK-norm: Qwen3, Gemma 3; over a whole projection: OLMoE) and OLMoE's clamp, GeGLU's activation with tanh GELU (Gemma), and a scale over whole rows (Gemma's
// embedding times sqrt(hidden)). Like rows.h, on vectors V, whatever is left past the last whole vector lane by
// lane.

#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "parallel.h"
#include "rows.h"
#include "vec.h"

namespace conveyor {

// x / rms(x) * weight over each of `heads` heads of `dim` at the start of each row (row_stride apart), in place:
// what a QK-norm does to one head's query or key before rope. Squares add up as in rms_norm_rows.
template <typename V>
void head_norm_rows(float* x, int64_t tokens, int64_t row_stride, int64_t heads, int64_t dim, const float* weight,
                    float eps) {
  constexpr int64_t lanes = kLanesOf<V>;
  parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t h = 0; h < heads; ++h) {
        float* head = x + t * row_stride + h * dim;
        V lane_squares{};
        int64_t i = 0;
        for (; i + lanes <= dim; i += lanes) lane_squares += loadv<V>(head + i) * loadv<V>(head + i);
        double squares = 0.0;
        for (; i < dim; ++i) squares += static_cast<double>(head[i]) * head[i];
        for (int64_t lane = 0; lane < lanes; ++lane) squares += lane_squares[lane];
        scale_by_rms<V>(head, weight, squares, dim, eps, head);
      }
    }
  });
}

// gelu_tanh(g) * u: GeGLU's gate. On vectors, 0.5 g (1 + tanh(y)) with y = sqrt(2 / pi) (g + 0.044715 g^3) is
// g * sigmoid(2 y), which the same exponential as SwiGLU's computes (no tanh of its own, and no cancellation
// near 0); lane by lane, the formula itself.
struct GeluTanhMul {
  template <typename V>
  V operator()(V g, V u) const {
    const V two_y = (g + g * g * g * 0.044715f) * 1.5957691216057308f;  // 2 * sqrt(2 / pi)
    return g / (1.f + expv(-two_y)) * u;
  }
  float operator()(float g, float u) const {
    return 0.5f * g * (1.f + std::tanh(0.7978845608028654f * (g + 0.044715f * g * g * g))) * u;
  }
};

template <typename V>
void gelu_tanh_and_mul_rows(const float* gate_up, int64_t rows, int64_t size, float* out) {
  gated_rows<V>(gate_up, rows, size, out, GeluTanhMul{});
}

// x clamped to [-limit, limit] over n floats, in place (OLMoE's clip_qkv).
inline void clamp_in_place(float* x, int64_t n, float limit) {
  for (int64_t i = 0; i < n; ++i) x[i] = std::min(std::max(x[i], -limit), limit);
}

// x *= factor over n floats.
template <typename V>
void scale_in_place(float* x, int64_t n, float factor) {
  constexpr int64_t lanes = kLanesOf<V>;
  int64_t i = 0;
  for (; i + lanes <= n; i += lanes) storev(x + i, loadv<V>(x + i) * factor);
  for (; i < n; ++i) x[i] *= factor;
}

}  // namespace conveyor
