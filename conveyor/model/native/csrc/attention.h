// Attention straight over the paged KV cache. Each query row reads its own context through its sequence's
// block table; nothing is gathered into a padded copy, and decode rows and prompt rows of any length share one
// call. The cache holds float32, bfloat16, float16 or fp8 e5m2 (widened in registers, computed on as float32).

#pragma once

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "parallel.h"
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

// Positions [begin, end) of a query row's context: one span of it (attention_rows), cut by the row's window.
struct Span {
  int64_t begin, end;
};

// Query rows of one sequence (a decode alone, or a decode and its drafts) over the paged cache, for every head:
// row r over the positions spans[r]. Blocks are the outer loop, heads and then rows the inner ones: a
// position's K (and V) for all KV heads is one contiguous run in the cache, so each block is read from memory
// once, in order, and then serves every head of every row that sees it from L1. Each row's arithmetic is
// that of the row alone over its span, in the same order. q and out point at row 0's head 0, q_stride and
// out_stride apart; scores holds rows * heads * (the longest span) floats. out is the span's part of the
// attention: the sum of V weighted by exp(score - max), with stats[2h], stats[2h + 1] head h's max and sum of
// those weights (row r's at stats + r * out_stride), which fold_span folds. A head is NV vectors V; the cache
// holds C (float, or bf16 bits).
template <typename V, int NV, typename C>
void attend_rows(const float* q, int64_t q_stride, int64_t rows, const C* k_cache, const C* v_cache,
                 const int64_t* table, const Span* spans, const CacheShape& shape, int64_t group, float scale,
                 float* scores, float* out, int64_t out_stride, float* stats) {
  constexpr int lanes = kLanesOf<V>;
  constexpr int64_t dim = lanes * NV;
  const int64_t stride = shape.token_stride(), heads = shape.kv_heads * group;
  int64_t begin = spans[0].begin, end = spans[0].end, width = 0;
  for (int64_t r = 0; r < rows; ++r) {
    begin = std::min(begin, spans[r].begin);
    end = std::max(end, spans[r].end);
    width = std::max(width, spans[r].end - spans[r].begin);
  }
  begin -= begin % shape.block_size;  // spans start at whole blocks; an empty one may not
  const auto scores_of = [&](int64_t r, int64_t h) { return scores + (r * heads + h) * width; };
  // A row's positions within the block at `first`: [from, to), none when to <= from.
  const auto within = [&](int64_t r, int64_t first) {
    return std::pair{std::max(first, spans[r].begin), std::min(first + shape.block_size, spans[r].end)};
  };
  const int64_t block_bytes = shape.block_stride() * static_cast<int64_t>(sizeof(C));
  const auto block_at = [&](const C* cache, int64_t block) { return cache + table[block] * shape.block_stride(); };
  for (int64_t first = begin; first < end; first += shape.block_size) {
    const int64_t block = first / shape.block_size;
    const C* keys = block_at(k_cache, block);
    const C* next = first + shape.block_size < end ? block_at(k_cache, block + 1)
                                                   : block_at(v_cache, begin / shape.block_size);  // V comes next
    for (int64_t h = 0; h < heads; ++h) {
      prefetch_slice(next, block_bytes, h, heads);
      const C* kh = keys + h / group * dim;
      for (int64_t r = 0; r < rows; ++r) {
        const auto [from, to] = within(r, first);
        if (to <= from) continue;
        const float* qh = q + r * q_stride + h * dim;
        float* s = scores_of(r, h) + (from - spans[r].begin);
        const C* k0 = kh + (from - first) * stride;
        const int64_t n = to - from;
        int64_t i = 0;
        for (; i + 8 <= n; i += 8) storev(s + i, dot8<V, NV, C>(qh, k0 + i * stride, stride) * scale);
        for (; i < n; ++i) s[i] = dot<V, NV, C>(qh, k0 + i * stride) * scale;
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t len = spans[r].end - spans[r].begin;
    float* row_stats = stats + r * out_stride;
    for (int64_t h = 0; h < heads; ++h) {
      if (len <= 0) {  // a span with no position of the row's (fold_span skips a sum of 0)
        row_stats[2 * h] = row_stats[2 * h + 1] = 0.f;
        continue;
      }
      float* s = scores_of(r, h);
      row_stats[2 * h] = *std::max_element(s, s + len);
      row_stats[2 * h + 1] = softmax_numerators<V>(s, len, row_stats[2 * h]);
    }
  }
  // Accumulators of up to 8 vectors stay in registers; wider heads go in pieces of 8 (or halves, for 12).
  constexpr int kChunk = NV <= 8 ? NV : (NV % 8 == 0 ? 8 : NV / 2);
  for (int64_t first = begin; first < end; first += shape.block_size) {
    const int64_t block = first / shape.block_size;
    const C* values = block_at(v_cache, block);
    const C* next = first + shape.block_size < end ? block_at(v_cache, block + 1) : nullptr;
    for (int64_t h = 0; h < heads; ++h) {
      if (next != nullptr) prefetch_slice(next, block_bytes, h, heads);
      const C* vh = values + h / group * dim;
      for (int64_t r = 0; r < rows; ++r) {
        const auto [from, to] = within(r, first);
        if (to <= from) continue;
        const float* p = scores_of(r, h) + (from - spans[r].begin);
        const C* v0 = vh + (from - first) * stride;
        float* o = out + r * out_stride + h * dim;
        for (int j0 = 0; j0 < NV; j0 += kChunk) {
          V acc[kChunk];
          for (int c = 0; c < kChunk; ++c) acc[c] = from == spans[r].begin ? V{} : loadv<V>(o + lanes * (j0 + c));
          for (int64_t i = 0; i < to - from; ++i) {
            const V weight = splatv<V>(p[i]);
            for (int c = 0; c < kChunk; ++c) acc[c] += loadc<V>(v0 + i * stride + lanes * (j0 + c)) * weight;
          }
          for (int c = 0; c < kChunk; ++c) storev(o + lanes * (j0 + c), acc[c]);
        }
      }
    }
  }
}

// A row's attention folded span by span, in span order: acc (heads * dim weighted values, then each head's
// max and sum, as attend_rows writes a part) takes the next part, both rescaled to the larger max. A part with
// sum 0 saw no position of the row's and is skipped; acc starts with sum 0. Whoever computed a part and
// whenever it is folded, a row's parts go through the same additions in the same order: the same bits.
inline void fold_span(const float* part, int64_t heads, int64_t dim, float* acc) {
  const float* part_stats = part + heads * dim;
  float* acc_stats = acc + heads * dim;
  for (int64_t h = 0; h < heads; ++h) {
    const float part_top = part_stats[2 * h], part_sum = part_stats[2 * h + 1];
    if (part_sum <= 0.f) continue;
    float* o = acc + h * dim;
    const float* po = part + h * dim;
    if (acc_stats[2 * h + 1] <= 0.f) {
      std::copy(po, po + dim, o);
      acc_stats[2 * h] = part_top;
      acc_stats[2 * h + 1] = part_sum;
      continue;
    }
    const float top = std::max(acc_stats[2 * h], part_top);
    const float keep = std::exp(acc_stats[2 * h] - top), add = std::exp(part_top - top);
    for (int64_t d = 0; d < dim; ++d) o[d] = o[d] * keep + po[d] * add;
    acc_stats[2 * h] = top;
    acc_stats[2 * h + 1] = acc_stats[2 * h + 1] * keep + part_sum * add;
  }
}

// An empty fold: no position seen yet.
inline void start_fold(int64_t heads, int64_t dim, float* acc) {
  std::fill(acc + heads * dim, acc + heads * dim + 2 * heads, 0.f);
}

// The row's attention from its fold: each head's weighted values over their sum (one division a head).
inline void finish_fold(const float* acc, int64_t heads, int64_t dim, float* out) {
  for (int64_t h = 0; h < heads; ++h) {
    const float inv_total = 1.f / acc[heads * dim + 2 * h + 1];
    for (int64_t d = 0; d < dim; ++d) out[h * dim + d] = acc[h * dim + d] * inv_total;
  }
}

template <typename C>
using AttendFn = void (*)(const float*, int64_t, int64_t, const C*, const C*, const int64_t*, const Span*,
                          const CacheShape&, int64_t, float, float*, float*, int64_t, float*);

// Head sizes with their own unrolled kernel (the accumulators stay in registers) in vectors V over a cache of
// C; others are refused. A head of 8 is narrower than 16 lanes: the 512-bit path runs it on 8.
template <typename V, typename C = float>
AttendFn<C> attend_fn(int64_t dim) {
  constexpr int lanes = kLanesOf<V>;
  switch (dim) {
    case 8: return attend_rows<v8, 1, C>;
    case 16: return attend_rows<V, 16 / lanes, C>;
    case 32: return attend_rows<V, 32 / lanes, C>;
    case 64: return attend_rows<V, 64 / lanes, C>;
    case 96: return attend_rows<V, 96 / lanes, C>;
    case 128: return attend_rows<V, 128 / lanes, C>;
    case 256: return attend_rows<V, 256 / lanes, C>;
    default: return nullptr;
  }
}

// Copies this step's K and V rows (row_stride apart) into their cache slots.
// A bf16 cache gets them rounded to nearest even (as torch's .to(torch.bfloat16)), a float16 or fp8 one likewise
// (as .to(torch.float16), .to(torch.float8_e5m2)).
inline void store_cache_row(const float* from, int64_t n, float* to) { std::copy(from, from + n, to); }
inline void store_cache_row(const float* from, int64_t n, uint16_t* to) {
  for (int64_t i = 0; i < n; ++i) to[i] = bf16_bits(from[i]);
}
inline void store_cache_row(const float* from, int64_t n, uint8_t* to) {
  for (int64_t i = 0; i < n; ++i) to[i] = fp8_e5m2_bits(from[i]);
}
inline void store_cache_row(const float* from, int64_t n, Float16Bits* to) {
  int64_t i = 0;
#if defined(__F16C__)
  for (; i + 8 <= n; i += 8) {
    const __m128i half = _mm256_cvtps_ph(_mm256_loadu_ps(from + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(to + i), half);
  }
#endif
  for (; i < n; ++i) to[i] = float16_bits(from[i]);
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

// Rows attend_rows takes together: each block of K and V read once serves them all (a row alone reads the
// whole context; a prompt's rows one at a time would read it once each, where its KV no longer fits in cache).
constexpr int64_t kMaxRunRows = 32;

// A row's context is attended in spans of this many positions at fixed places ([0, 64), [64, 128), ...), and
// the spans' parts are folded in span order (fold_span). The spans depend on the row's own context alone,
// never on the batch, the chunking of a prompt or the threads: a request's attention is the same bits alone or
// beside any others. A span need not start at a block's start: attend_rows reads only the positions it holds.
constexpr int64_t kSpanPositions = 64;

// A call with at least this many runs per thread gives each thread whole runs, folded where they are
// computed; with fewer (a decode alone, one short prompt) the runs' spans are the work threads share, so that
// one long context keeps every core busy.
constexpr int64_t kWholeRunsPerThread = 4;

// Consecutive rows of one sequence at consecutive positions (up to kMaxRunRows), and the spans
// [span, span_end) their contexts reach: from the first any row's window reaches to the last any row sees.
struct RowRun {
  int64_t row, rows, span, span_end;
};

inline std::vector<RowRun> row_runs(int64_t rows, const int64_t* row_seq, const int64_t* context_lens,
                                    int64_t window) {
  std::vector<RowRun> runs;
  for (int64_t row = 0; row < rows;) {
    int64_t n = 1;
    while (row + n < rows && n < kMaxRunRows && row_seq[row + n] == row_seq[row] &&
           context_lens[row + n] == context_lens[row] + n) {
      ++n;
    }
    const int64_t lo = window > 0 ? std::max<int64_t>(0, context_lens[row] - window) : 0;
    runs.push_back({row, n, lo / kSpanPositions, (context_lens[row + n - 1] + kSpanPositions - 1) / kSpanPositions});
    row += n;
  }
  return runs;
}

// One unit of attention_rows' work: a run's spans [span, span_end), all of them (whole) or one.
struct WorkItem {
  RowRun run;
  int64_t span, span_end;
};

// Whole runs, longest first (threads take the next item as they finish), or one item per span of every run.
inline std::vector<WorkItem> work_items(const std::vector<RowRun>& runs, bool whole) {
  std::vector<WorkItem> items;
  if (whole) {
    for (const RowRun& run : runs) items.push_back({run, run.span, run.span_end});
    std::stable_sort(items.begin(), items.end(), [](const WorkItem& a, const WorkItem& b) {
      return a.run.rows * (a.span_end - a.span) > b.run.rows * (b.span_end - b.span);
    });
  } else {
    for (const RowRun& run : runs) {
      for (int64_t span = run.span; span < run.span_end; ++span) items.push_back({run, span, span + 1});
    }
  }
  return items;
}

// Attention of every query row over the paged cache: row r belongs to the sequence whose block table is
// tables[row_seq[r]] and sees positions [0, context_lens[r]). A decode row is one query at the end of its
// context; the rows of a prompt chunk (or of a decode and its drafts) each see the context up to themselves,
// which makes the mask causal. Query rows are row_stride apart, heads contiguous within a row; out is
// [rows, heads * dim]. Every row goes through attend_rows on vectors V, span by span (kSpanPositions), its
// parts folded in span order: the same bits for a row whatever else the call holds. `window` > 0: each row
// sees only the last `window` positions of its context (itself included), and reads no block wholly behind
// them (a windowed KV group may have given those back).
template <typename V, typename C>
void attention_rows(const float* query, int64_t rows, int64_t row_stride, int64_t heads, const C* k_cache,
                    const C* v_cache, const CacheShape& shape, const int64_t* tables, int64_t table_width,
                    const int64_t* row_seq, const int64_t* context_lens, float scale, int64_t window, float* out) {
  const AttendFn<C> attend = attend_fn<V, C>(shape.dim);
  CONVEYOR_CHECK(attend != nullptr, "no attention kernel for head size ", shape.dim, " (8, 16, 32, 64, 96, 128 or 256)");
  const int64_t group = heads / shape.kv_heads, threads = num_threads(), out_size = heads * shape.dim;
  const int64_t part_size = out_size + 2 * heads;  // a span's weighted values, then each head's max and sum
  const std::vector<RowRun> runs = row_runs(rows, row_seq, context_lens, window);
  // Whole runs are folded by the thread that computes them; split by span, their parts are folded after.
  const bool whole = static_cast<int64_t>(runs.size()) >= kWholeRunsPerThread * threads;
  const std::vector<WorkItem> items = work_items(runs, whole);
  // Items split by span leave their parts here: row r's parts from first_part[r], one per span of its run.
  std::vector<int64_t> first_part;
  if (!whole) {
    first_part.assign(rows + 1, 0);
    for (const RowRun& run : runs) {
      for (int64_t r = run.row; r < run.row + run.rows; ++r) first_part[r + 1] = run.span_end - run.span;
    }
    for (int64_t r = 0; r < rows; ++r) first_part[r + 1] += first_part[r];
  }
  std::vector<float> partials(whole ? 0 : first_part[rows] * part_size);
  const int64_t count = static_cast<int64_t>(items.size());
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(threads, count));
  std::atomic<int64_t> next{0};
  parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    std::vector<float> scores, parts, acc;
    for (int64_t item = next++; item < count; item = next++) {
      const WorkItem& work = items[item];
      const RowRun& run = work.run;
      const int64_t* table = tables + row_seq[run.row] * table_width;
      if (whole) {
        parts.resize(run.rows * part_size);
        acc.resize(run.rows * part_size);
        for (int64_t r = 0; r < run.rows; ++r) start_fold(heads, shape.dim, acc.data() + r * part_size);
      }
      for (int64_t span = work.span; span < work.span_end; ++span) {
        // Span `span` of each row's context (its window's part of it); empty where the row does not reach it.
        const int64_t span_begin = span * kSpanPositions, span_end = span_begin + kSpanPositions;
        Span spans[kMaxRunRows];
        int64_t width = 0;
        for (int64_t r = 0; r < run.rows; ++r) {
          const int64_t row_ctx = context_lens[run.row + r];
          const int64_t lo = window > 0 ? std::max<int64_t>(0, row_ctx - window) : 0;
          spans[r] = {std::max(lo, span_begin), std::min(row_ctx, span_end)};
          width = std::max(width, spans[r].end - spans[r].begin);
        }
        // Where the parts go: this item's own buffer, or the span's slot among each row's partials.
        float* part = whole ? parts.data() : partials.data() + (first_part[run.row] + span - run.span) * part_size;
        const int64_t stride = whole ? part_size : (run.span_end - run.span) * part_size;
        scores.resize(run.rows * heads * std::max<int64_t>(width, 1));
        attend(query + run.row * row_stride, row_stride, run.rows, k_cache, v_cache, table, spans, shape, group,
               scale, scores.data(), part, stride, part + out_size);
        if (!whole) continue;
        for (int64_t r = 0; r < run.rows; ++r) {
          fold_span(part + r * part_size, heads, shape.dim, acc.data() + r * part_size);
        }
      }
      if (!whole) continue;
      for (int64_t r = 0; r < run.rows; ++r) {
        finish_fold(acc.data() + r * part_size, heads, shape.dim, out + (run.row + r) * out_size);
      }
    }
  });
  if (whole) return;
  std::vector<float> acc(part_size);
  for (int64_t row = 0; row < rows; ++row) {
    start_fold(heads, shape.dim, acc.data());
    for (int64_t p = first_part[row]; p < first_part[row + 1]; ++p) {
      fold_span(partials.data() + p * part_size, heads, shape.dim, acc.data());
    }
    finish_fold(acc.data(), heads, shape.dim, out + row * out_size);
  }
}

}  // namespace conveyor
