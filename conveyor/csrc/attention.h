// Attention straight over the paged KV cache. Each query row reads its own context through its sequence's
// block table; nothing is gathered into a padded copy, and decode rows and prompt rows of any length share one
// call. The cache holds float32 or bfloat16 (widened in registers, computed on as float32).

#pragma once

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "vec.h"

namespace conveyor {

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

}  // namespace conveyor
