// A mixture of experts' feed-forward, grouped by expert: each row's top-k experts by the router's softmax, then
// the rows gathered per expert, so that an expert's weights stream once per step for all the rows that chose it
// (a batch of B rows reads E(1 - (1 - k/E)^B) experts, not B k), and the results added back to each row with
// its router weight. Like the other kernels, plain pointers and shapes: no torch.
//
// Threads: where every expert's weight has one quantized form (a GGUF file's stacked tensor), one pass runs
// all the step's experts, its (expert, tile) items split over the threads by what each costs: a tile's stream
// and its expert's rows (for_each_expert_tile). One fork a projection instead of one an expert, and a batch
// routed unevenly (most rows on a few experts) leaves no thread idle. Otherwise each expert's GEMMs split
// their own tiles over the threads.

#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <vector>

#include "family_rows.h"
#include "gemm.h"
#include "parallel.h"
#include "quant_gemm.h"
#include "rows.h"

namespace conveyor {

// Each row's top-k experts and their weights from router logits [rows, experts]: a float32 softmax, the k
// most probable (the lower index first among equals, best first), scaled to sum to 1 if `normalize` (Qwen3-MoE,
// Mixtral; OLMoE keeps the probabilities). chosen and weights are [rows, top_k].
inline void route_rows(const float* logits, int64_t rows, int64_t experts, int64_t top_k, bool normalize,
                       int64_t* chosen, float* weights) {
  CONVEYOR_CHECK(top_k >= 1 && top_k <= experts, "top-", top_k, " of ", experts, " experts");
  std::vector<float> probs(experts);
  std::vector<int64_t> order(experts);
  for (int64_t r = 0; r < rows; ++r) {
    const float* l = logits + r * experts;
    const float top = *std::max_element(l, l + experts);
    float sum = 0.f;
    for (int64_t e = 0; e < experts; ++e) sum += probs[e] = std::exp(l[e] - top);
    for (int64_t e = 0; e < experts; ++e) probs[e] /= sum;
    std::iota(order.begin(), order.end(), int64_t{0});
    std::partial_sort(order.begin(), order.begin() + top_k, order.end(), [&](int64_t a, int64_t b) {
      return probs[a] > probs[b] || (probs[a] == probs[b] && a < b);
    });
    float kept = 0.f;
    for (int64_t j = 0; j < top_k; ++j) kept += probs[order[j]];
    for (int64_t j = 0; j < top_k; ++j) {
      chosen[r * top_k + j] = order[j];
      weights[r * top_k + j] = normalize ? probs[order[j]] / kept : probs[order[j]];
    }
  }
}

// A step's routing grouped by expert: entries offsets[e] .. offsets[e + 1] are expert e's, each a row and the
// router weight it gives that expert, rows in ascending order. `distinct`: the experts some row chose.
struct ExpertGroups {
  std::vector<int64_t> offsets, rows;
  std::vector<float> weights;
  int64_t distinct = 0;

  int64_t count(int64_t expert) const { return offsets[expert + 1] - offsets[expert]; }
};

inline ExpertGroups group_by_expert(const int64_t* chosen, const float* weights, int64_t rows, int64_t top_k,
                                    int64_t experts) {
  ExpertGroups groups;
  groups.offsets.assign(experts + 1, 0);
  for (int64_t i = 0; i < rows * top_k; ++i) {
    CONVEYOR_CHECK(chosen[i] >= 0 && chosen[i] < experts, "expert ", chosen[i], " of ", experts);
    ++groups.offsets[chosen[i] + 1];
  }
  for (int64_t e = 0; e < experts; ++e) {
    groups.distinct += groups.offsets[e + 1] > 0;
    groups.offsets[e + 1] += groups.offsets[e];
  }
  groups.rows.resize(rows * top_k);
  groups.weights.resize(rows * top_k);
  std::vector<int64_t> next(groups.offsets.begin(), groups.offsets.end() - 1);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t j = 0; j < top_k; ++j) {
      const int64_t at = next[chosen[r * top_k + j]]++;
      groups.rows[at] = r;
      groups.weights[at] = weights[r * top_k + j];
    }
  }
  return groups;
}

// One expert's projection [n, k] as the kernels take it: packed for the step's path (`packed`, P::Weight), or
// quantized (`quant`).
struct ExpertMatrix {
  const void* packed = nullptr;
  const QuantWeight* quant = nullptr;
  int64_t n = 0, k = 0;
};

// An (expert, tile) item's cost against the rows it runs: a tile's weights stream in about the time 4.5 rows of
// them take to multiply (the K-quant kernels at one row, memory-bound: 48 G weights/s; at 16 rows 218 G
// multiply-adds/s, docs/quantized-weights.md), in half-rows.
inline constexpr int64_t kTileCost = 9;

// Runs pass(tile, row, rows, expert) over every tile of every expert with rows, each expert's rows in passes of
// at most max_rows (row: the first of them, in the grouped rows), the items split over the threads into shares
// of equal cost, kTileCost + 2 rows each, expert by expert; a thread done with its share takes runs from the back
// of the other's (claim_runs_in), where with fixed shares it waited for it.
template <typename Pass>
void for_each_expert_tile(const ExpertGroups& groups, int64_t tiles, int64_t max_rows, const Pass& pass) {
  std::vector<int64_t> active;
  for (int64_t e = 0; e + 1 < static_cast<int64_t>(groups.offsets.size()); ++e) {
    if (groups.count(e) > 0) active.push_back(e);
  }
  const int64_t items = static_cast<int64_t>(active.size()) * tiles;
  std::vector<int64_t> cost(items + 1, 0);  // cost[i]: of the items before i
  for (int64_t i = 0; i < items; ++i) cost[i + 1] = cost[i] + kTileCost + 2 * groups.count(active[i / tiles]);
  const int64_t threads = std::max<int64_t>(1, std::min(num_threads(), items));
  std::vector<int64_t> bounds(threads + 1, items);
  for (int64_t t = 0; t < threads; ++t) {
    bounds[t] = std::lower_bound(cost.begin(), cost.end(), cost.back() * t / threads) - cost.begin();
  }
  claim_runs_in(bounds, [&](int64_t first, int64_t last) {
    for (int64_t item = first; item < last; ++item) {
      const int64_t expert = active[item / tiles], at = groups.offsets[expert], m = groups.count(expert);
      for (int64_t row = 0; row < m; row += max_rows) pass(item % tiles, at + row, std::min(max_rows, m - row), expert);
    }
  });
}

// Whether every expert's weight is quantized in one form (layout, group, bits, scales), none joined of parts:
// then grouped_quant_rows runs them all in one pass.
inline bool one_quant_form(const ExpertMatrix* w, int64_t experts) {
  const QuantWeight* first = w[0].quant;
  for (int64_t e = 0; e < experts; ++e) {
    const QuantWeight* q = w[e].quant;
    if (q == nullptr || !q->parts.empty() || q->layout != first->layout || q->group != first->group ||
        q->storage_bits != first->storage_bits || q->code_bits != first->code_bits ||
        q->scales_f16 != first->scales_f16 || q->has_mins() != first->has_mins() || q->levels != first->levels ||
        q->n != first->n || q->k != first->k) {
      return false;
    }
  }
  return true;
}

// Rows `rows` of xq, one after another, in buffers of the calling thread's: a grouped step's input gathered after
// quantizing, so that a token is quantized once rather than once for each of its top-k experts, and its copies
// are int8 codes, a quarter of its floats.
inline QuantizedRows gather_quantized_rows(const QuantizedRows& xq, const std::vector<int64_t>& rows) {
  thread_local std::vector<int8_t> q;
  thread_local std::vector<float> d, d_sums;
  thread_local std::vector<int16_t> sums;
  const int64_t total = static_cast<int64_t>(rows.size()), k = xq.k, groups = xq.groups, spans = xq.spans;
  q.resize(total * k);
  d.resize(total * spans);
  d_sums.resize(total * groups);
  sums.resize(total * groups);
  // The buffers' own pointers: in the workers' threads the names are other (empty) buffers.
  int8_t* qp = q.data();
  float *dp = d.data(), *dsp = d_sums.data();
  int16_t* sp = sums.data();
  parallel_for(0, total, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t from = rows[i];
      std::memcpy(qp + i * k, xq.q + from * k, k);
      std::memcpy(dp + i * spans, xq.d + from * spans, sizeof(float) * spans);
      std::memcpy(sp + i * groups, xq.sums + from * groups, sizeof(int16_t) * groups);
      std::memcpy(dsp + i * groups, xq.d_sums + from * groups, sizeof(float) * groups);
    }
  });
  return {qp, dp, sp, dsp, k, groups, spans};
}

// y [total, n] = x_e . W_e^T for each row's expert e, from its rows quantized already (xq: [total, k], grouped by
// expert as `groups`), every W_e of one quantized form: one pass over all experts' tiles (for_each_expert_tile).
inline void grouped_quant_rows(const QuantizedRows& xq, const ExpertGroups& groups, const ExpertMatrix* w, float* y,
                               QuantDot dot) {
  const QuantWeight& form = *w[0].quant;
  const int64_t n = form.n, tiles = form.tiles();
  with_quant_tile_kernel(form, dot, [&](int max_rows, auto run) {
    for_each_expert_tile(groups, tiles, max_rows, [&](int64_t tile, int64_t row, int64_t rows, int64_t e) {
      run(*w[e].quant, xq, tile, row, static_cast<int>(rows), y + row * n + tile * kQuantTile, n);
    });
  });
}

// y [m, n] = x [m, k] . W^T through one expert's projection.
template <typename P>
void expert_linear(const ExpertMatrix& w, const float* x, int64_t m, float* y, QuantDot dot) {
  if (w.quant != nullptr) return quant_linear_rows(x, m, *w.quant, nullptr, y, dot);
  linear_rows<P>(x, m, w.k, static_cast<const typename P::Weight*>(w.packed), w.n, nullptr, y);
}

// out [rows, hidden] = the sum of each row's experts' outputs ys (by entry, as groups orders them) times their
// router weights, the experts of a row added in ascending order (as the reference's loop over experts adds them),
// the rows split over the threads.
inline void add_expert_outputs(const ExpertGroups& groups, const float* ys, int64_t rows, int64_t hidden,
                               float* out) {
  const int64_t total = static_cast<int64_t>(groups.rows.size());
  std::vector<int64_t> starts(rows + 1, 0), entries(total);  // each row's entries, in expert order
  for (int64_t i = 0; i < total; ++i) ++starts[groups.rows[i] + 1];
  std::partial_sum(starts.begin(), starts.end(), starts.begin());
  std::vector<int64_t> next(starts.begin(), starts.end() - 1);
  for (int64_t i = 0; i < total; ++i) entries[next[groups.rows[i]]++] = i;
  parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* row = out + r * hidden;
      std::fill(row, row + hidden, 0.f);
      for (int64_t at = starts[r]; at < starts[r + 1]; ++at) {
        const float* y = ys + entries[at] * hidden;
        const float w = groups.weights[entries[at]];
        for (int64_t c = 0; c < hidden; ++c) row[c] += y[c] * w;
      }
    }
  });
}

// out [rows, hidden] = sum over each row's experts of weight * down(act(gate(x)) * up(x)), each expert's gate
// and up one [2 width, hidden] projection (gate first) and its down [hidden, width]; `gelu`: GeGLU's activation,
// else SwiGLU's. Experts add up in ascending order, as the reference's loop over experts does. dot_for(m): the
// quantized dot-product kind for an expert's GEMM of m rows.
template <typename P, typename DotFor>
void expert_rows(const float* x, int64_t rows, int64_t hidden, int64_t width, const ExpertGroups& groups,
                 const ExpertMatrix* gate_up, const ExpertMatrix* down, bool gelu, const DotFor& dot_for, float* out) {
  using V = typename P::Vec;
  const int64_t experts = static_cast<int64_t>(groups.offsets.size()) - 1;
  const int64_t total = static_cast<int64_t>(groups.rows.size());
  thread_local std::vector<float> xs, gate_up_out, act, ys;  // reused by every layer of every step
  gate_up_out.resize(total * 2 * width);
  act.resize(total * width);
  ys.resize(total * hidden);
  const int64_t per_expert = (total + groups.distinct - 1) / std::max<int64_t>(groups.distinct, 1);
  // x_e [rows of e, k] -> y_e [rows of e, n] through each expert's weight w[e], the rows grouped already
  // (grouped_in: in by entry): in one pass where they share a quantized form, else expert by expert.
  const auto project = [&](const ExpertMatrix* w, const float* grouped_in, int64_t k, float* y, int64_t n) {
    if (one_quant_form(w, experts)) {
      const QuantWeight& form = *w[0].quant;
      return grouped_quant_rows(quantize_rows(grouped_in, total, form), groups, w, y, dot_for(per_expert));
    }
    for (int64_t e = 0; e < experts; ++e) {
      if (const int64_t m = groups.count(e); m > 0) {
        expert_linear<P>(w[e], grouped_in + groups.offsets[e] * k, m, y + groups.offsets[e] * n, dot_for(m));
      }
    }
  };
  if (one_quant_form(gate_up, experts)) {  // each token quantized once, then its codes gathered
    const QuantizedRows xq = quantize_rows(x, rows, *gate_up[0].quant);
    grouped_quant_rows(gather_quantized_rows(xq, groups.rows), groups, gate_up, gate_up_out.data(),
                       dot_for(per_expert));
  } else {
    xs.resize(total * hidden);
    float* gathered = xs.data();  // this thread's buffer, which the workers' name would not reach
    parallel_for(0, total, 16, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        std::memcpy(gathered + i * hidden, x + groups.rows[i] * hidden, sizeof(float) * hidden);
      }
    });
    project(gate_up, xs.data(), hidden, gate_up_out.data(), 2 * width);
  }
  if (gelu) {
    gelu_tanh_and_mul_rows<V>(gate_up_out.data(), total, width, act.data());
  } else {
    silu_and_mul_rows<V>(gate_up_out.data(), total, width, act.data());
  }
  project(down, act.data(), width, ys.data(), hidden);
  add_expert_outputs(groups, ys.data(), rows, hidden, out);
}

}  // namespace conveyor
