// Attention straight over the paged KV cache. Each query row reads its own context through its sequence's
// block table; nothing is gathered into a padded copy, and decode rows and prompt rows of any length share one
// call. The cache holds float32, bfloat16 or fp8 e5m2 (widened in registers, computed on as float32).

#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "gemm.h"
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
// those weights (row r's at stats + r * out_stride), which merge_parts combines. A head is NV vectors V; the cache holds C (float, or
// bf16 bits).
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
      if (len <= 0) {  // a span with no position of the row's (merge_parts skips a sum of 0)
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

// A row's attention from its `parts` parts (attend_rows with stats; a part with sum 0 saw no position):
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
    const float inv_total = 1.f / total;  // one division a head, as softmax's own normalisation
    for (int64_t d = 0; d < dim; ++d) o[d] *= inv_total;
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
// A bf16 cache gets them rounded to nearest even (as torch's .to(torch.bfloat16)), an fp8 one likewise (as
// .to(torch.float8_e5m2)).
inline void store_cache_row(const float* from, int64_t n, float* to) { std::copy(from, from + n, to); }
inline void store_cache_row(const float* from, int64_t n, uint16_t* to) {
  for (int64_t i = 0; i < n; ++i) to[i] = bf16_bits(from[i]);
}
inline void store_cache_row(const float* from, int64_t n, uint8_t* to) {
  for (int64_t i = 0; i < n; ++i) to[i] = fp8_e5m2_bits(from[i]);
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

// ----- Prompt rows in tiles -----

// What one thread's prompt tiles work in, reused from tile to tile.
struct TileScratch {
  std::vector<float> keys, values, scores, products, out, max, sum;
};

// One chunk of n positions from `start` of KV head kv, packed as GEMM tiles (zeros past n): keys as one
// [dim, chunk] tile (position i in column i), values as dim / chunk tiles of [chunk, chunk] (position i in
// row i). The blocks of the paged cache lie anywhere: each position is looked up in the table. Positions before
// `seen_from` (behind every row's window: their blocks may have been given back) stay zeros, never read.
template <typename C>
void pack_chunk(const C* k_cache, const C* v_cache, const int64_t* table, const CacheShape& shape, int64_t kv,
                int64_t start, int64_t n, int64_t chunk, int64_t seen_from, TileScratch& scratch) {
  const int64_t dim = shape.dim;
  std::fill(scratch.keys.begin(), scratch.keys.end(), 0.f);
  std::fill(scratch.values.begin(), scratch.values.end(), 0.f);
  for (int64_t i = std::max<int64_t>(0, seen_from - start); i < n; ++i) {
    const int64_t pos = start + i;
    const int64_t slot = table[pos / shape.block_size] * shape.block_size + pos % shape.block_size;
    const C* key = k_cache + slot * shape.token_stride() + kv * dim;
    const C* value = v_cache + slot * shape.token_stride() + kv * dim;
    for (int64_t d = 0; d < dim; ++d) {
      scratch.keys[d * chunk + i] = cache_float(key[d]);
      scratch.values[(d / chunk) * chunk * chunk + i * chunk + d % chunk] = cache_float(value[d]);
    }
  }
}

// Folds one chunk's scores (scratch.scores: `rows` x chunk, unscaled, positions from `start`) for the block's
// rows row0.. of query head h into their running max and sum, and turns them into weights in place: block row
// b sees positions up to first + b, the rest weigh 0. Their outputs so far are rescaled to the new max (once
// a row has seen position 0 its max is finite). The running max and sum are block_rows apart per head.
template <typename V>
inline void online_softmax(TileScratch& scratch, int64_t block_rows, int64_t row0, int rows, int64_t first,
                           int64_t start, int64_t chunk, float scale, int64_t h, int64_t padded, int64_t window) {
  constexpr int64_t lanes = kLanesOf<V>;
  for (int r = 0; r < rows; ++r) {
    const int64_t row = row0 + r;
    float* s = scratch.scores.data() + r * chunk;
    // This chunk's positions the row sees: [lo, seen), after its window's start and up to itself.
    const int64_t seen = std::clamp<int64_t>(first + row + 1 - start, 0, chunk);
    const int64_t lo = window > 0 ? std::clamp<int64_t>(first + row + 1 - window - start, 0, chunk) : 0;
    if (seen <= lo) {
      std::fill(s, s + chunk, 0.f);
      continue;
    }
    float& top = scratch.max[h * block_rows + row];
    float& total = scratch.sum[h * block_rows + row];
    float chunk_top = -std::numeric_limits<float>::infinity();
    if (seen == chunk && lo == 0) {
      V lane_top = loadv<V>(s);
      for (int64_t i = lanes; i < chunk; i += lanes) {
        const V next = loadv<V>(s + i);
        lane_top = next > lane_top ? next : lane_top;
      }
      for (int64_t lane = 0; lane < lanes; ++lane) chunk_top = std::max(chunk_top, lane_top[lane]);
    } else {  // the last chunk a row sees, or its window's first: the positions outside weigh exp(-inf), nothing
      for (int64_t i = lo; i < seen; ++i) chunk_top = std::max(chunk_top, s[i]);
      std::fill(s, s + lo, -std::numeric_limits<float>::infinity());
      std::fill(s + seen, s + chunk, -std::numeric_limits<float>::infinity());
    }
    const float new_top = std::max(top, chunk_top * scale);  // scale > 0: the max of the scaled scores
    const float rescale = std::exp(top - new_top);            // exp(-inf) = 0 before the first chunk
    V added{};
    for (int64_t i = 0; i < chunk; i += lanes) {
      const V e = expv(loadv<V>(s + i) * scale - new_top);
      storev(s + i, e);
      added += e;
    }
    // expv floors at e^-87 (1e-38), which these add to the sum at most
    std::fill(s, s + lo, 0.f);
    std::fill(s + seen, s + chunk, 0.f);
    total = total * rescale + sumv(added);
    top = new_top;
    if (rescale != 1.f) {
      float* o = scratch.out.data() + (h * block_rows + row) * padded;
      for (int64_t d = 0; d < padded; d += lanes) storev(o + d, loadv<V>(o + d) * rescale);
    }
  }
}

// Attention of `rows` consecutive prompt rows of one sequence (the first at position `first`, row r seeing
// positions [0, first + r]) as small GEMMs on the GEMM path's micro-kernel, flash-attention style: for each
// chunk of P::kTile positions and each KV head, the chunk's keys and values are packed as GEMM tiles once and
// serve every row of the block for all the head's query heads, in register tiles of P::kMaxRows rows: S = Q
// K^T (rows x chunk), an online softmax that rescales what came before, and O += P V. Per row, attend_rows
// computes each score as its own dot product summed across lanes; here a score is one lane of a register
// tile, and a key is read once per block of rows rather than once per query head and row. q and out point at
// the first row's head 0, row_stride and out_stride apart. With a window (> 0), row r sees only the last
// `window` of those positions, and chunks wholly behind every row's window are never packed.
template <typename P, typename C>
void attend_prompt_tile(const float* q, int64_t row_stride, int64_t rows, int64_t first, const C* k_cache,
                        const C* v_cache, const int64_t* table, const CacheShape& shape, int64_t group, float scale,
                        int64_t window, float* out, int64_t out_stride, TileScratch& scratch) {
  constexpr int64_t chunk = P::kTile;
  const int64_t dim = shape.dim, dim_tiles = (dim + chunk - 1) / chunk, padded = dim_tiles * chunk;
  scratch.keys.resize(dim * chunk);
  scratch.values.resize(dim_tiles * chunk * chunk);
  scratch.scores.resize(P::kMaxRows * chunk);
  scratch.products.resize(P::kMaxRows * padded);
  scratch.out.resize(group * rows * padded);
  scratch.max.resize(group * rows);
  scratch.sum.resize(group * rows);
  for (int64_t kv = 0; kv < shape.kv_heads; ++kv) {
    std::fill(scratch.out.begin(), scratch.out.end(), 0.f);
    std::fill(scratch.max.begin(), scratch.max.end(), -std::numeric_limits<float>::infinity());
    std::fill(scratch.sum.begin(), scratch.sum.end(), 0.f);
    const int64_t seen_from = window > 0 ? std::max<int64_t>(0, first + 1 - window) : 0;  // by the first row
    for (int64_t start = seen_from / chunk * chunk; start < first + rows; start += chunk) {
      pack_chunk(k_cache, v_cache, table, shape, kv, start, std::min(chunk, first + rows - start), chunk, seen_from,
                 scratch);
      // Register tiles of rows from the first that sees this chunk (position start: row start - first) to the
      // last whose window still reaches it.
      const int64_t row_end = window > 0 ? std::min(rows, start + chunk - 1 + window - first) : rows;
      for (int64_t row0 = std::max<int64_t>(0, (start - first) / P::kMaxRows * P::kMaxRows); row0 < row_end;
           row0 += P::kMaxRows) {
        const int tile_rows = static_cast<int>(std::min<int64_t>(P::kMaxRows, rows - row0));
        for (int64_t h = 0; h < group; ++h) {
          const float* qh = q + row0 * row_stride + (kv * group + h) * dim;
          tile_fn<P>(tile_rows)(qh, row_stride, scratch.keys.data(), dim, scratch.scores.data(), chunk, chunk);
          online_softmax<typename P::Vec>(scratch, rows, row0, tile_rows, first, start, chunk, scale, h, padded,
                                          window);
          for (int64_t j = 0; j < dim_tiles; ++j) {
            tile_fn<P>(tile_rows)(scratch.scores.data(), chunk, scratch.values.data() + j * chunk * chunk, chunk,
                                  scratch.products.data() + j * chunk, padded, chunk);
          }
          float* o = scratch.out.data() + (h * rows + row0) * padded;
          for (int64_t i = 0; i < tile_rows * padded; ++i) o[i] += scratch.products[i];
        }
      }
    }
    for (int64_t h = 0; h < group; ++h) {
      for (int64_t r = 0; r < rows; ++r) {
        const float inv = 1.f / scratch.sum[h * rows + r];
        const float* o = scratch.out.data() + (h * rows + r) * padded;
        float* dst = out + r * out_stride + (kv * group + h) * dim;
        for (int64_t d = 0; d < dim; ++d) dst[d] = o[d] * inv;
      }
    }
  }
}

// A work item of attention_rows: `rows` consecutive rows of one sequence from `row` (consecutive positions), in
// a prompt tile (`tile`: attend_prompt_tile) or row by row (attend_rows) over the whole context or over part
// `part` of it.
struct RowRun {
  int64_t row, rows, part;
  bool tile;
};

// A run of prompt rows goes through attend_prompt_tile where its last row sees this many positions; below,
// its rows go one at a time. Prefill of prompts submitted at once, tiles against rows (Zen 4, 2 threads):
// 0.98x at 128 tokens, 1.02x at 256, 1.03-1.05x at 512, 1.10x at 1024, 1.13x at 1536.
constexpr int64_t kTileMinContext = 192;

// A run of fewer rows than this goes row by row whatever its context: a tile packs its whole context for the
// run, which pays only when enough rows share the packing. Short runs at the end of a long context are what
// speculative decoding verifies (the last token and its drafts). One sequence, n rows at the end of ctx
// positions, tiles against rows (Zen 5, 2 threads, ms): n=4 6.95 vs 4.24 at ctx 200, 23.8 vs 8.0 at ctx 1000;
// n=16 14.2 vs 12.3 and 35.3 vs 26.1; n=32 21.6 vs 20.3 and 58.4 vs 44.7.
constexpr int64_t kTileMinRows = 32;

// Rows attend_rows takes together: each block of K and V read once serves them all (a row alone reads the
// whole context; five rows of one sequence read it five times over, where its KV no longer fits in cache).
constexpr int64_t kMaxRunRows = 8;

// The rows in runs: consecutive rows of one sequence at consecutive positions, up to max_rows. A run of
// kTileMinRows or more whose last row sees kTileMinContext positions is a prompt tile; the others go row by row
// in runs of up to kMaxRunRows (a decode alone, a decode and its drafts, a short prompt's rows).
inline std::vector<RowRun> row_runs(int64_t rows, const int64_t* row_seq, const int64_t* context_lens,
                                    int64_t max_rows) {
  std::vector<RowRun> items;
  for (int64_t row = 0; row < rows;) {
    int64_t n = 1;
    while (row + n < rows && n < max_rows && row_seq[row + n] == row_seq[row] &&
           context_lens[row + n] == context_lens[row] + n) {
      ++n;
    }
    if (n >= kTileMinRows && context_lens[row + n - 1] >= kTileMinContext) {
      items.push_back({row, n, 0, true});
    } else {
      for (int64_t i = 0; i < n; i += kMaxRunRows) items.push_back({row + i, std::min(kMaxRunRows, n - i), 0, false});
    }
    row += n;
  }
  return items;
}

// A row's context is attended in spans of this many positions at fixed places ([0, 64), [64, 128), ...),
// each span's weighted values and softmax statistics merged after in span order (merge_parts). The spans
// depend on the row's own context alone, never on the batch or the threads: a request's attention is the same
// bits alone or beside any others, and the spans are the work threads share (a long decode alone keeps both
// cores busy). A span need not start at a block's start: attend_rows reads only the positions it holds.
constexpr int64_t kSpanPositions = 64;

// A run that goes row by row, one item per span of the context its rows see (a tile stays whole): spans from
// the first any row's window reaches to the last any row sees.
inline void add_span_items(const RowRun& run, const int64_t* context_lens, int64_t window,
                           std::vector<RowRun>& items) {
  const int64_t ctx_first = context_lens[run.row], ctx_last = context_lens[run.row + run.rows - 1];
  const int64_t lo = window > 0 ? std::max<int64_t>(0, ctx_first - window) : 0;
  const int64_t first_span = lo / kSpanPositions, end_span = (ctx_last + kSpanPositions - 1) / kSpanPositions;
  for (int64_t span = first_span; span < end_span; ++span) items.push_back({run.row, run.rows, span, false});
}

// Attention of every query row over the paged cache: row r belongs to the sequence whose block table is
// tables[row_seq[r]] and sees positions [0, context_lens[r]). A decode row is one query at the end of its
// context; the rows of a prompt chunk (or of a decode and its drafts) each see the context up to themselves,
// which makes the mask causal. Query rows are row_stride apart, heads contiguous within a row; out is
// [rows, heads * dim]. Runs row by row go on vectors V (attend_rows) in spans of kSpanPositions, the same for a
// row whatever else the call holds, prompt tiles on the float32 GEMM path P (attend_prompt_tile). `window` > 0: each row sees only the last `window` positions of its context (itself included), and reads
// no block wholly behind them (a windowed KV group may have given those back).
template <typename V, typename P, typename C>
void attention_rows(const float* query, int64_t rows, int64_t row_stride, int64_t heads, const C* k_cache,
                    const C* v_cache, const CacheShape& shape, const int64_t* tables, int64_t table_width,
                    const int64_t* row_seq, const int64_t* context_lens, float scale, int64_t window, float* out) {
  const AttendFn<C> attend = attend_fn<V, C>(shape.dim);
  CONVEYOR_CHECK(attend != nullptr, "no attention kernel for head size ", shape.dim, " (8, 16, 32, 64, 96, 128 or 256)");
  const int64_t group = heads / shape.kv_heads, threads = num_threads(), out_size = heads * shape.dim;
  const int64_t part_size = out_size + 2 * heads;  // a span's weighted values, then each head's max and sum
  std::vector<RowRun> items;
  std::vector<int64_t> first_part(rows + 1, 0);  // row r's spans are parts first_part[r] .. first_part[r + 1]
  for (const RowRun& run : row_runs(rows, row_seq, context_lens, kRowsPerBlock)) {
    const size_t before = items.size();
    if (run.tile) {
      items.push_back(run);
    } else {
      add_span_items(run, context_lens, window, items);
    }
    const int64_t spans = run.tile ? 0 : static_cast<int64_t>(items.size() - before);
    for (int64_t r = run.row; r < run.row + run.rows; ++r) first_part[r + 1] = spans;
  }
  for (int64_t r = 0; r < rows; ++r) first_part[r + 1] += first_part[r];
  const int64_t count = static_cast<int64_t>(items.size());
  std::vector<float> partials(first_part[rows] * part_size);
  // Items are dealt out in turn rather than in halves: a prompt's later rows see longer contexts, and
  // halves would leave one thread all the long ones.
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(threads, count));
  parallel_for(0, workers, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    TileScratch scratch;
    for (int64_t worker = begin; worker < end; ++worker) {
      for (int64_t item = worker; item < count; item += workers) {
        const RowRun run = items[item];
        const int64_t row = run.row, ctx = context_lens[row];
        const int64_t* table = tables + row_seq[row] * table_width;
        if (run.tile) {
          attend_prompt_tile<P>(query + row * row_stride, row_stride, run.rows, ctx - 1, k_cache, v_cache, table,
                                shape, group, scale, window, out + row * out_size, out_size, scratch);
          continue;
        }
        // Span run.part of each row's context (its window's part of it); empty where the row does not reach it.
        const int64_t span_begin = run.part * kSpanPositions, span_end = span_begin + kSpanPositions;
        Span spans[kMaxRunRows];
        int64_t width = 0;
        for (int64_t r = 0; r < run.rows; ++r) {
          const int64_t row_ctx = ctx + r, lo = window > 0 ? std::max<int64_t>(0, row_ctx - window) : 0;
          spans[r] = {std::max(lo, span_begin), std::min(row_ctx, span_end)};
          width = std::max(width, spans[r].end - spans[r].begin);
        }
        // This span's slot among each row's parts: rows of a run have the same spans (items in span order).
        const int64_t slot = run.part - (window > 0 ? std::max<int64_t>(0, ctx - window) : 0) / kSpanPositions;
        float* part_out = partials.data() + (first_part[row] + slot) * part_size;
        const int64_t stride = (first_part[row + 1] - first_part[row]) * part_size;  // row r + 1's same span
        scores.resize(run.rows * heads * std::max<int64_t>(width, 1));
        attend(query + row * row_stride, row_stride, run.rows, k_cache, v_cache, table, spans, shape, group, scale,
               scores.data(), part_out, stride, part_out + out_size);
      }
    }
  });
  for (int64_t row = 0; row < rows; ++row) {  // a tile wrote its rows' attention itself
    const int64_t parts = first_part[row + 1] - first_part[row];
    if (parts == 0) continue;
    const float* first = partials.data() + first_part[row] * part_size;
    merge_parts(first, first + out_size, parts, heads, shape.dim, out + row * out_size);
  }
}

}  // namespace conveyor
