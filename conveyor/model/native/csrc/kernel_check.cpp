// The kernels' own test and microbenchmark, built with a C++ compiler alone (no Python, no torch), so that the
// kernels can be checked and profiled (`perf record ./kernel_check bench`) as a plain library:
//
//   c++ -std=c++17 -O3 -march=native -fopenmp -falign-loops=64 kernel_check.cpp -o kernel_check   (`make kernel-check`)
//   ./kernel_check test      every quantized layout, every dot-product kind this CPU has, 1 to 100 rows:
//                            against a double-precision reference, and each row bit-equal to its run alone;
//                            attention over a paged cache likewise (decodes, drafts, windows; 1 and 2 threads)
//   ./kernel_check bench [N K [LAYOUTS [KINDS [WEIGHTS]]]]   one quantized GEMV and 8-, 16- and 64-row GEMMs
//                            per layout and kind (or those named, comma-separated: Q4_K,IQ4_XS vnni512): GB/s and
//                            weights times rows a second. WEIGHTS distinct weights (default 1) take turns: one
//                            weight timed again and again is partly served from the host's caches, even at
//                            132 MB (on a 2-core Zen 4 VM: 65-79 GB/s for one 57,344 x 4,096 Q4_K weight, 47-48
//                            for three taking turns); enough of them to pass the caches time the stream from
//                            memory, as a decode step's layers meet it
//
// The weights are random bytes in each layout (scales kept finite), which the kernels read like any other.

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <new>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "attention.h"
#include "huge_pages.h"
#include "quant_gemm.h"
#include "rows.h"

namespace {

using conveyor::QuantDot;
using conveyor::QuantLayout;
using conveyor::QuantWeight;

// An allocator of memory on huge pages (huge_pages.h), as the engine's weights lie on (conveyor/model/quant/
// linear.py, WeightArena): one thread streamed a one-row Q4_K weight from 4 KiB pages at 16-17 GB/s against
// 26-27 from huge pages, so without it the bench would time the pages.
template <typename T>
struct HugePageAllocator {
  using value_type = T;
  HugePageAllocator() = default;
  template <typename U>
  HugePageAllocator(const HugePageAllocator<U>&) {}
  T* allocate(size_t count) {
    void* data = conveyor::huge_page_alloc(count * sizeof(T));
    if (data == nullptr) throw std::bad_alloc();
    return static_cast<T*>(data);
  }
  void deallocate(T* data, size_t count) { conveyor::huge_page_free(data, count * sizeof(T)); }
  template <typename U>
  bool operator==(const HugePageAllocator<U>&) const { return true; }
};

using WeightBytes = std::vector<uint8_t, HugePageAllocator<uint8_t>>;  // a random weight's storage

// float -> IEEE half, for normal values (all the scales made here are).
uint16_t to_half(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, 4);
  const uint32_t sign = (bits >> 16) & 0x8000u, exponent = (bits >> 23) & 0xffu, mantissa = bits & 0x7fffffu;
  return static_cast<uint16_t>(sign | ((exponent - 127 + 15) << 10) | (mantissa >> 13));
}

// A layout under test: how to make a random weight of it, and its name.
struct Layout {
  std::string name;
  QuantLayout layout;
  int64_t group, storage_bits, code_bits, zero_point;  // the uniform tiles' parameters
  bool mins, levels;
};

const std::vector<Layout>& layouts() {
  static const std::vector<Layout> all = {
      {"Q8_0", QuantLayout::kTiles, 32, 8, 8, 128, false, false},
      {"Q4_0", QuantLayout::kTiles, 32, 4, 4, 8, false, false},
      {"Q4_1", QuantLayout::kTiles, 32, 4, 4, 0, true, false},
      {"IQ4_NL", QuantLayout::kTiles, 32, 4, 4, conveyor::kIq4Zero, false, true},
      {"Q4_K", QuantLayout::kQ4K, 0, 0, 0, 0, false, false},
      {"Q5_K", QuantLayout::kQ5K, 0, 0, 0, 0, false, false},
      {"Q6_K", QuantLayout::kQ6K, 0, 0, 0, 0, false, false},
      {"IQ4_XS", QuantLayout::kIQ4XS, 0, 0, 0, 0, false, false},
      {"Q3_K", QuantLayout::kQ3K, 0, 0, 0, 0, false, false},
      {"Q2_K", QuantLayout::kQ2K, 0, 0, 0, 0, false, false},
  };
  return all;
}

// Random memory in `layout` for [n, k], and the weight over it (the memory lives in `bytes`).
QuantWeight random_weight(const Layout& layout, int64_t n, int64_t k, std::mt19937& rng, WeightBytes& bytes) {
  std::uniform_int_distribution<int> byte(0, 255);
  std::uniform_real_distribution<float> scale(0.002f, 0.02f);
  const int64_t tiles = (n + conveyor::kQuantTile - 1) / conveyor::kQuantTile;
  if (layout.layout == QuantLayout::kTiles) {
    const int64_t groups = k / layout.group, group_bytes = conveyor::kQuantTile * layout.group * layout.storage_bits / 8;
    const int64_t codes = tiles * groups * group_bytes, scales = tiles * groups * conveyor::kQuantTile;
    bytes.assign(codes + 2 * scales * 2, 0);
    for (int64_t i = 0; i < codes; ++i) bytes[i] = static_cast<uint8_t>(byte(rng));
    auto* halves = reinterpret_cast<uint16_t*>(bytes.data() + codes);
    for (int64_t i = 0; i < 2 * scales; ++i) halves[i] = to_half(i < scales ? scale(rng) : -4 * scale(rng));
    return conveyor::quant_weight(bytes.data(), halves, layout.mins ? halves + scales : nullptr, true, n, k,
                                  layout.group, layout.storage_bits, layout.code_bits, layout.zero_point,
                                  layout.levels);
  }
  const int64_t block_bytes = conveyor::k_block_bytes(layout.layout), blocks = k / conveyor::kSuperBlock;
  bytes.assign(tiles * blocks * block_bytes, 0);
  for (auto& b : bytes) b = static_cast<uint8_t>(byte(rng));
  const bool mins = conveyor::with_k_format(layout.layout, [](auto format) { return decltype(format)::kMins; });
  const int halves = mins ? 32 : 16;  // d (and dmin) per row of the tile
  for (int64_t block = 0; block < tiles * blocks; ++block) {
    auto* head = reinterpret_cast<uint16_t*>(bytes.data() + block * block_bytes);
    for (int i = 0; i < halves; ++i) head[i] = to_half(scale(rng) * (layout.layout == QuantLayout::kQ6K ? 0.1f : 0.5f));
  }
  return conveyor::k_quant_weight(bytes.data(), layout.name, n, k);
}

std::vector<float> random_rows(int64_t m, int64_t k, std::mt19937& rng) {
  std::normal_distribution<float> normal(0.f, 1.f);
  std::vector<float> x(m * k);
  for (auto& v : x) v = normal(rng);
  return x;
}

// What the kernels compute, in double: each row quantized to int8 per span as the kernels quantize it, times
// the weight's rows as dequantize_rows gives them.
std::vector<double> reference(const std::vector<float>& x, int64_t m, const QuantWeight& w, double* magnitude) {
  const int64_t span = w.activation_span();
  const conveyor::QuantizedRows xq = conveyor::quantize_rows(x.data(), m, w);
  std::vector<float> row(w.k);
  std::vector<double> y(m * w.n);
  *magnitude = 0;
  for (int64_t j = 0; j < w.n; ++j) {
    const int64_t id = j;
    conveyor::dequantize_rows(w, &id, 1, row.data());
    for (int64_t r = 0; r < m; ++r) {
      double sum = 0, size = 0;
      for (int64_t i = 0; i < w.k; ++i) {
        const double term = double(xq.d[r * xq.spans + i / span]) * xq.q[r * w.k + i] * row[i];
        sum += term;
        size += std::fabs(term);
      }
      y[r * w.n + j] = sum;
      *magnitude = std::max(*magnitude, size);
    }
  }
  return y;
}

int failures = 0;

void expect(bool ok, const std::string& what) {
  if (!ok) {
    ++failures;
    std::printf("FAILED: %s\n", what.c_str());
  }
}

void test_layout(const Layout& layout, QuantDot dot, std::mt19937& rng) {
  const int64_t n = 40, k = 512;  // a ragged last tile; two super-blocks
  WeightBytes bytes;
  const QuantWeight w = random_weight(layout, n, k, rng, bytes);
  const std::string label = layout.name + " on " + conveyor::quant_dot_name(dot);
  for (int64_t m : {1, 3, 16, 17, 64, 100}) {
    const std::vector<float> x = random_rows(m, k, rng);
    std::vector<float> y(m * n), alone(n);
    conveyor::quant_linear_rows(x.data(), m, w, nullptr, y.data(), dot);
    double magnitude = 0;
    const std::vector<double> want = reference(x, m, w, &magnitude);
    double worst = 0;
    for (int64_t i = 0; i < m * n; ++i) worst = std::max(worst, std::fabs(y[i] - want[i]));
    expect(worst <= 1e-5 * magnitude, label + ", " + std::to_string(m) + " rows: off the reference by " +
                                          std::to_string(worst) + " (scale " + std::to_string(magnitude) + ")");
    for (int64_t r = 0; r < m; r += std::max<int64_t>(1, m / 5)) {
      conveyor::quant_linear_rows(x.data() + r * k, 1, w, nullptr, alone.data(), dot);
      expect(std::memcmp(alone.data(), y.data() + r * n, n * sizeof(float)) == 0,
             label + ": row " + std::to_string(r) + " of " + std::to_string(m) + " differs from its run alone");
    }
  }
}

void test_rows(std::mt19937& rng) {
  const int64_t rows = 5, size = 200;
  std::vector<float> x = random_rows(rows, size, rng), residual = random_rows(rows, size, rng);
  std::vector<float> weight = random_rows(1, size, rng), want(rows * size);
  for (int64_t r = 0; r < rows; ++r) {
    double squares = 0;
    for (int64_t i = 0; i < size; ++i) {
      const double v = double(x[r * size + i]) + residual[r * size + i];
      squares += v * v;
    }
    const double inv = 1.0 / std::sqrt(squares / size + 1e-6);
    for (int64_t i = 0; i < size; ++i) {
      want[r * size + i] = static_cast<float>((double(x[r * size + i]) + residual[r * size + i]) * inv * weight[i]);
    }
  }
  std::vector<float> residual_out = residual;
  conveyor::rms_norm_rows<conveyor::v8>(x.data(), residual_out.data(), weight.data(), rows, size, 1e-6f,
                                        x.data());
  double worst = 0;
  for (int64_t i = 0; i < rows * size; ++i) worst = std::max(worst, double(std::fabs(x[i] - want[i])));
  expect(worst < 1e-4, "rms_norm_rows off the reference by " + std::to_string(worst));
  std::vector<float> logits = random_rows(3, 1000, rng);
  logits[1 * 1000 + 777] = 100.f;
  expect(conveyor::argmax_rows<conveyor::v8>(logits.data(), 3, 1000)[1] == 777, "argmax_rows");
}

// Attention of one row in double: softmax(q . k * scale) . v over positions [lo, ctx) of its table.
std::vector<double> attention_reference(const float* q, int64_t heads, const float* k_cache, const float* v_cache,
                                        const conveyor::CacheShape& shape, const int64_t* table, int64_t ctx,
                                        int64_t window, float scale) {
  const int64_t dim = shape.dim, group = heads / shape.kv_heads, lo = window > 0 ? std::max<int64_t>(0, ctx - window) : 0;
  std::vector<double> out(heads * dim, 0.0);
  for (int64_t h = 0; h < heads; ++h) {
    std::vector<double> weights;
    double top = -1e300, total = 0;
    const auto at = [&](const float* cache, int64_t pos) {
      return cache + (table[pos / shape.block_size] * shape.block_size + pos % shape.block_size) * shape.token_stride() +
             (h / group) * dim;
    };
    for (int64_t pos = lo; pos < ctx; ++pos) {
      double dot = 0;
      for (int64_t d = 0; d < dim; ++d) dot += double(q[h * dim + d]) * at(k_cache, pos)[d];
      weights.push_back(dot * scale);
      top = std::max(top, weights.back());
    }
    for (double& w : weights) total += (w = std::exp(w - top));
    for (int64_t pos = lo; pos < ctx; ++pos) {
      for (int64_t d = 0; d < dim; ++d) out[h * dim + d] += weights[pos - lo] / total * at(v_cache, pos)[d];
    }
  }
  return out;
}

// Rows of several sequences (decodes of short and long contexts, a decode and its drafts, a short prompt's
// rows), against the reference, and each row the same bits alone, in the whole call, and on 1 or 2 threads.
void test_attention(std::mt19937& rng) {
  const int64_t block_size = 16, kv_heads = 2, heads = 6, dim = 64, blocks = 80;
  const conveyor::CacheShape shape{block_size, kv_heads, dim};
  const std::vector<float> k_cache = random_rows(blocks * block_size, kv_heads * dim, rng);
  const std::vector<float> v_cache = random_rows(blocks * block_size, kv_heads * dim, rng);
  const std::vector<std::vector<int64_t>> contexts = {{1}, {63, 64, 65}, {200}, {700, 701, 702, 703, 704}, {30}, {}};
  const int64_t table_width = 50;
  std::vector<int64_t> tables, row_seq, lens;
  std::vector<int64_t> ids(blocks);
  for (int64_t i = 0; i < blocks; ++i) ids[i] = i;
  for (size_t seq = 0; seq < contexts.size(); ++seq) {
    std::shuffle(ids.begin(), ids.end(), rng);
    tables.insert(tables.end(), ids.begin(), ids.begin() + table_width);
    for (const int64_t ctx : contexts[seq]) row_seq.push_back(seq), lens.push_back(ctx);
  }
  for (int64_t i = 0; i < 20; ++i) row_seq.push_back(4), lens.push_back(11 + i);  // a short prompt's rows
  // A long prompt's rows: enough runs that threads take whole runs in the call, where a row alone is split by span.
  for (int64_t i = 0; i < 300; ++i) row_seq.push_back(5), lens.push_back(1 + i);
  const int64_t rows = static_cast<int64_t>(row_seq.size());
  const std::vector<float> q = random_rows(rows, heads * dim, rng);
  const float scale = 0.125f;
  for (const int64_t window : {int64_t{0}, int64_t{100}}) {
    const std::string label = "attention" + std::string(window > 0 ? " over a window of 100" : "");
    std::vector<float> all(rows * heads * dim), alone(heads * dim);
    const auto attend = [&](int64_t first, int64_t count, float* out) {
      conveyor::attention_rows<conveyor::v8>(q.data() + first * heads * dim, count, heads * dim, heads,
                                             k_cache.data(), v_cache.data(), shape, tables.data(), table_width,
                                             row_seq.data() + first, lens.data() + first, scale, window, out);
    };
    attend(0, rows, all.data());
    double worst = 0;
    for (int64_t r = 0; r < rows; ++r) {
      const std::vector<double> want = attention_reference(q.data() + r * heads * dim, heads, k_cache.data(),
                                                           v_cache.data(), shape, tables.data() + row_seq[r] * table_width,
                                                           lens[r], window, scale);
      for (int64_t i = 0; i < heads * dim; ++i) worst = std::max(worst, std::fabs(all[r * heads * dim + i] - want[i]));
      attend(r, 1, alone.data());
      expect(std::memcmp(alone.data(), all.data() + r * heads * dim, alone.size() * sizeof(float)) == 0,
             label + ": row " + std::to_string(r) + " (context " + std::to_string(lens[r]) +
                 ") differs from its run alone");
    }
    expect(worst < 1e-4, label + " off the reference by " + std::to_string(worst));
#if defined(_OPENMP)
    const int threads = omp_get_max_threads();
    omp_set_num_threads(1);
    std::vector<float> one(rows * heads * dim);
    attend(0, rows, one.data());
    omp_set_num_threads(threads);
    expect(one == all, label + ": one thread and " + std::to_string(threads) + " give other bits");
#endif
  }
}

// A share runs out in shrinking runs: its owner alone takes whole runs while two or more runs' worth are left,
// then half of what is left, down to one item; a thread helping it takes half of what is left, from the back.
void test_claimed_share() {
  conveyor::ClaimedShare share;
  share.reset(0, 40);
  std::vector<int64_t> sizes;
  int64_t begin, end, next = 0;
  while (share.claim(8, false, &begin, &end)) {
    expect(begin == next, "ClaimedShare: the owner's runs skip or repeat items");
    sizes.push_back(end - begin);
    next = end;
  }
  expect(next == 40 && sizes == std::vector<int64_t>{8, 8, 8, 8, 4, 2, 1, 1},
         "ClaimedShare: the owner's runs of 40 items are not 8, 8, 8, 8, 4, 2, 1, 1");
  share.reset(0, 40);
  const std::vector<std::pair<bool, std::pair<int64_t, int64_t>>> turns{
      {true, {20, 40}}, {false, {0, 8}}, {true, {14, 20}}, {false, {8, 11}}, {true, {13, 14}}, {false, {11, 12}},
      {true, {12, 13}}};
  for (const auto& [stolen, run] : turns) {
    expect(share.claim(8, stolen, &begin, &end) && begin == run.first && end == run.second,
           "ClaimedShare: owner and thief took other runs than halves of what was left");
  }
  expect(!share.claim(8, true, &begin, &end), "ClaimedShare: items left after all 40 were taken");
}

// claim_runs visits every item once, for any count of items and threads; and a thread slowed in its share (each
// of thread 0's items takes 200 us) leaves part of it to the other, who takes it from the back.
void test_claim_runs() {
#if defined(_OPENMP)
  const int threads = omp_get_max_threads();
  for (const int use : {1, 2, 3, 4}) {
    omp_set_num_threads(use);
    for (const int64_t items : {0, 1, 2, 3, 7, 8, 9, 63, 64, 65, 1000}) {
      std::vector<std::atomic<int>> visits(items);
      conveyor::claim_runs(items, [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i) visits[i].fetch_add(1);
      });
      bool once = true;
      for (const auto& count : visits) once = once && count.load() == 1;
      expect(once, "claim_runs over " + std::to_string(items) + " items on " + std::to_string(use) +
                       " threads visits some item other than once");
    }
  }
  omp_set_num_threads(2);
  std::atomic<int64_t> by_second{0};
  conveyor::claim_runs(64, [&](int64_t begin, int64_t end) {
    if (omp_get_thread_num() == 0) std::this_thread::sleep_for(std::chrono::microseconds(200 * (end - begin)));
    if (omp_get_thread_num() == 1) by_second.fetch_add(end - begin);
  });
  expect(by_second.load() > 32, "claim_runs: the idle thread took " + std::to_string(by_second.load()) +
                                    " of 64 items, none of the slow one's");
  omp_set_num_threads(threads);
#endif
}

// The float16 cache's portable conversions (half_bits, half_bits_float: what a build without F16C runs) against the
// CPU's own where it has F16C: every float16 widened, and narrowed back, bit for bit; random floats of every
// magnitude narrowed alike (NaNs: both NaN).
void test_float16_conversions(std::mt19937& rng) {
#if defined(__F16C__)
  int wrong = 0;
  const auto narrowed = [&](float f) {
    const uint16_t mine = conveyor::half_bits(f), cpu = _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const bool nan = (cpu & 0x7c00) == 0x7c00 && (cpu & 0x3ff) != 0;
    wrong += nan ? !((mine & 0x7c00) == 0x7c00 && (mine & 0x3ff) != 0) : mine != cpu;
  };
  for (uint32_t h = 0; h < 65536; ++h) {
    const float cpu = _cvtsh_ss(static_cast<uint16_t>(h)), mine = conveyor::half_bits_float(static_cast<uint16_t>(h));
    wrong += std::memcmp(&cpu, &mine, sizeof cpu) != 0 && !(std::isnan(cpu) && std::isnan(mine));
    narrowed(cpu);
    narrowed(std::nextafter(cpu, 0.f));  // just under a float16: where the rounding decides
  }
  std::uniform_int_distribution<uint32_t> bits;
  for (int i = 0; i < 1000000; ++i) {
    const uint32_t u = bits(rng);
    float f;
    std::memcpy(&f, &u, sizeof f);
    narrowed(f);
  }
  expect(wrong == 0, "the portable float16 conversions differ from F16C's on " + std::to_string(wrong) + " values");
#else
  (void)rng;
#endif
}

int run_tests() {
  std::mt19937 rng(7);
  int cases = 0;
  for (const std::string& name : conveyor::quant_dots()) {
    const QuantDot dot = conveyor::parse_quant_dot(name);
    for (const Layout& layout : layouts()) {
      test_layout(layout, dot, rng);
      ++cases;
    }
  }
  test_rows(rng);
  test_attention(rng);
  test_float16_conversions(rng);
  test_claimed_share();
  test_claim_runs();
  std::printf("%d layout x kind cases (kinds: ", cases);
  for (const std::string& name : conveyor::quant_dots()) std::printf("%s ", name.c_str());
  std::printf("), threads %lld: %s\n", static_cast<long long>(conveyor::num_threads()),
              failures == 0 ? "passed" : "FAILED");
  return failures == 0 ? 0 : 1;
}

// Whether `name` is in the comma-separated `names` (all are, when it is empty).
bool named(const std::string& names, const std::string& name) {
  return names.empty() || ("," + names + ",").find("," + name + ",") != std::string::npos;
}

int run_bench(int64_t n, int64_t k, const std::string& layouts_named, const std::string& kinds_named,
              int64_t copies) {
  std::mt19937 rng(11);
  std::printf("[%lld, %lld] weights (%lld taking turns), %lld threads\n", static_cast<long long>(n),
              static_cast<long long>(k), static_cast<long long>(copies), static_cast<long long>(conveyor::num_threads()));
  for (const Layout& layout : layouts()) {
    if (!named(layouts_named, layout.name)) continue;
    std::vector<WeightBytes> bytes(copies);
    std::vector<QuantWeight> weights;
    for (WeightBytes& copy : bytes) weights.push_back(random_weight(layout, n, k, rng, copy));
    const QuantWeight& w = weights[0];
    for (const std::string& name : conveyor::quant_dots()) {
      if (!named(kinds_named, name)) continue;
      const QuantDot dot = conveyor::parse_quant_dot(name);
      for (int64_t m : {1, 8, 16, 64}) {
        const std::vector<float> x = random_rows(m, k, rng);
        std::vector<float> y(m * n);
        conveyor::quant_linear_rows(x.data(), m, w, nullptr, y.data(), dot);  // warm
        int reps = 0;
        const auto start = std::chrono::steady_clock::now();
        double seconds = 0;
        while (seconds < 0.5) {
          conveyor::quant_linear_rows(x.data(), m, weights[reps % copies], nullptr, y.data(), dot);
          ++reps;
          seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        }
        const double per_call = seconds / reps;
        std::printf("%-6s %-8s %2lld rows: %8.1f us  %6.1f GB/s of weights  %6.1f G weight-rows/s\n",
                    layout.name.c_str(), name.c_str(), static_cast<long long>(m), per_call * 1e6,
                    w.bytes() / per_call / 1e9, double(n) * k * m / per_call / 1e9);
      }
    }
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "test";
  try {
    if (mode == "test") return run_tests();
    if (mode == "bench") {
      const int64_t n = argc > 2 ? std::atoll(argv[2]) : 4096, k = argc > 3 ? std::atoll(argv[3]) : 4096;
      const int64_t copies = argc > 6 ? std::max<int64_t>(1, std::atoll(argv[6])) : 1;
      return run_bench(n, k, argc > 4 ? argv[4] : "", argc > 5 ? argv[5] : "", copies);
    }
  } catch (const std::exception& error) {
    std::printf("error: %s\n", error.what());
    return 2;
  }
  std::printf("usage: kernel_check [test | bench [N K [LAYOUTS [KINDS [WEIGHTS]]]]]\n");
  return 2;
}
