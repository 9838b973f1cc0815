// One checkout's kernels as a variant of bench/kernel_ab: kernel_check.cpp compiled with its namespace and main
// renamed (run.sh passes -Dconveyor=conveyor_abN -Dmain=main_abN -DKERNEL_AB_V=abN), so that several checkouts'
// kernels link into one process and take turns on the same minute of the machine.

#include <memory>
#include <stdexcept>

#include "kernel_check.cpp"

#define KERNEL_AB_CAT2(a, b) a##b
#define KERNEL_AB_CAT(a, b) KERNEL_AB_CAT2(a, b)

namespace {

// Distinct weights taking turns (a decode step meets each layer's weight once) and `rows` rows of activations.
struct Variant {
  std::vector<WeightBytes> bytes;
  std::vector<QuantWeight> weights;
  std::vector<float> x, y;
  QuantDot dot;
  long rows = 1;
  size_t call = 0;
};

}  // namespace

// The variant's weights and rows, or nullptr with the reason on stderr (no such layout or kind).
extern "C" void* KERNEL_AB_CAT(setup_, KERNEL_AB_V)(const char* layout_name, const char* dot, long n, long k,
                                                    long copies, long rows) {
  try {
    auto v = std::make_unique<Variant>();
    v->dot = conveyor::parse_quant_dot(dot);
    std::mt19937 rng(11);
    v->bytes.resize(copies);
    for (const Layout& layout : layouts()) {
      if (layout.name != layout_name) continue;
      for (WeightBytes& copy : v->bytes) v->weights.push_back(random_weight(layout, n, k, rng, copy));
    }
    if (v->weights.empty()) throw std::invalid_argument(std::string("no layout ") + layout_name);
    v->rows = rows;
    v->x = random_rows(rows, k, rng);
    v->y.resize(rows * n);
    return v.release();
  } catch (const std::exception& error) {
    std::fprintf(stderr, "error: %s\n", error.what());
    return nullptr;
  }
}

// Seconds a call, over `calls` GEMVs (or GEMMs of `rows` rows) on the weights in turn.
extern "C" double KERNEL_AB_CAT(time_, KERNEL_AB_V)(void* state, int calls) {
  auto* v = static_cast<Variant*>(state);
  const auto start = std::chrono::steady_clock::now();
  for (int c = 0; c < calls; ++c) {
    const QuantWeight& w = v->weights[v->call++ % v->weights.size()];
    conveyor::quant_linear_rows(v->x.data(), v->rows, w, nullptr, v->y.data(), v->dot);
  }
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() / calls;
}

extern "C" double KERNEL_AB_CAT(bytes_, KERNEL_AB_V)(void* state) {
  return static_cast<Variant*>(state)->weights[0].bytes();
}
