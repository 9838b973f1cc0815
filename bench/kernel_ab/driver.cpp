// bench/kernel_ab's driver: the variants (VARIANTS, from run.sh) take turns, a few GEMVs (or GEMMs of ROWS rows)
// each, and each prints the median, 25th and 75th percentile of its GB/s of weights, and its multiply-adds a second
// at the median (GB/s times ROWS, in weights).
// This host's memory bandwidth changes by half from one minute to the next, so two builds timed one after the
// other, in two processes, differ by more than most kernel changes do; taking turns within seconds, they see the
// same machine.

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#define KERNEL_AB_DECLARE(v)                                                      \
  extern "C" void* setup_##v(const char*, const char*, long, long, long, long);  \
  extern "C" double time_##v(void*, int);                                         \
  extern "C" double bytes_##v(void*);
VARIANT_DECLARATIONS

struct Variant {
  const char* label;
  void* (*setup)(const char*, const char*, long, long, long, long);
  double (*time)(void*, int);
  double (*bytes)(void*);
};

int main(int argc, char** argv) {
  if (argc < 7) {
    std::printf("usage: driver LAYOUT KIND N K WEIGHTS TURNS [ROWS]\n");
    return 2;
  }
  const long rows = argc > 7 ? std::atol(argv[7]) : 1;
  std::vector<Variant> variants = {VARIANT_LIST};
  const long n = std::atol(argv[3]), k = std::atol(argv[4]), copies = std::atol(argv[5]);
  const int turns = std::atoi(argv[6]);
  std::vector<void*> states;
  for (const Variant& v : variants) {
    states.push_back(v.setup(argv[1], argv[2], n, k, copies, rows));
    if (states.back() == nullptr) return 2;  // setup said why
  }
  std::vector<std::vector<double>> seconds(variants.size());
  for (int turn = 0; turn < turns; ++turn) {
    for (size_t i = 0; i < variants.size(); ++i) {
      seconds[i].push_back(variants[i].time(states[i], static_cast<int>(copies)));
    }
  }
  for (size_t i = 0; i < variants.size(); ++i) {
    std::vector<double> s = seconds[i];
    std::sort(s.begin(), s.end());
    const double bytes = variants[i].bytes(states[i]);
    const auto rate = [&](double q) { return bytes / s[static_cast<size_t>(q * (s.size() - 1))] / 1e9; };
    const double madds = static_cast<double>(n) * k * rows / s[(s.size() - 1) / 2] / 1e9;
    std::printf("%-7s %-8s %3ld rows %-24s median %5.1f GB/s  (25th-75th percentile %5.1f-%5.1f), %6.1f G multiply-adds/s\n",
                argv[1], argv[2], rows, variants[i].label, rate(0.5), rate(0.75), rate(0.25), madds);
  }
  return 0;
}
