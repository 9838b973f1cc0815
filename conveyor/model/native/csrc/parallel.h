// Threads and checks for the kernels, without torch: the kernels compile as a plain C++ library (the kernel
// check binary, kernel_check.cpp, builds them with g++ alone), and the torch module (kernels.cpp) defines
// CONVEYOR_ATEN before its includes so that they share ATen's thread pool and raise ATen's errors, exactly as
// they would calling ATen themselves.

#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <sstream>
#include <stdexcept>
#include <vector>

#if defined(CONVEYOR_ATEN)
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#elif defined(_OPENMP)
#include <omp.h>
#endif

namespace conveyor {

#if defined(CONVEYOR_ATEN)

inline int64_t num_threads() { return at::get_num_threads(); }

template <typename F>
inline void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  at::parallel_for(begin, end, grain, f);
}

#define CONVEYOR_CHECK(cond, ...) TORCH_CHECK(cond, __VA_ARGS__)

#else

#if defined(_OPENMP)
inline int64_t num_threads() { return omp_in_parallel() ? 1 : omp_get_max_threads(); }
#else
inline int64_t num_threads() { return 1; }
#endif

// ATen's split: at most one chunk per thread and none under `grain` items; serial inside a parallel region.
template <typename F>
inline void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  if (begin >= end) return;
  const int64_t range = end - begin, threads = num_threads();
  if (threads <= 1 || range <= grain) {
    f(begin, end);
    return;
  }
  const int64_t tasks = std::min(threads, (range + std::max<int64_t>(grain, 1) - 1) / std::max<int64_t>(grain, 1));
  const int64_t chunk = (range + tasks - 1) / tasks;
#if defined(_OPENMP)
#pragma omp parallel num_threads(static_cast<int>(tasks))
  {
    const int64_t lo = begin + omp_get_thread_num() * chunk;
    if (lo < end) f(lo, std::min(end, lo + chunk));
  }
#else
  for (int64_t lo = begin; lo < end; lo += chunk) f(lo, std::min(end, lo + chunk));
#endif
}

template <typename... Args>
[[noreturn]] inline void check_failed(const char* cond, const Args&... args) {
  std::ostringstream message;
  if constexpr (sizeof...(Args) == 0) {
    message << "check failed: " << cond;
  } else {
    (message << ... << args);
  }
  throw std::invalid_argument(message.str());
}

#define CONVEYOR_CHECK(cond, ...) \
  do {                            \
    if (!(cond)) ::conveyor::check_failed(#cond, ##__VA_ARGS__); \
  } while (false)

#endif

// f(begin, end) over [0, items): each thread owns an even share and takes it in runs from the front; a thread
// done with its own takes from the back of the others' (`stolen`). On a shared host one core is often slower
// for a while, and with fixed shares the other waited for it at the end of every GEMM: libgomp's wait took 5.1% of
// an 8B-shaped file's decode steps on a 2-core Zen 3 (perf, one request), 3.2% with the shares claimed. Each thread
// still streams its own share front to back, as the prefetchers follow, until the shares meet.
//
// The runs shrink as a share runs out (ClaimedShare::claim), so that the threads finish together: with runs of a
// fixed eighth of a share, a thread that stole a whole run (4 MB of the 8B shape's gate and up projections) left
// the other nothing, and the one that finished first waited for the other 68 us a GEMV on average (one request,
// both threads' finishing times taken in claim_runs_in), 12 us with halving runs. Decode steps, one process
// alternating the two every 5 steps, 2-core Zen 3: one request of the 8B shape 2.4% faster (80 turns; 1.9% and
// -0.6% over 40 and 25; an earlier trial of a near rule, the owner taking a quarter, read 1.004x over 30), 8 at
// once 0.6%, the OLMoE shape at 16 at once 2.2%: gains near the host's noise, the shorter wait measured directly.
constexpr int64_t kRunsPerShare = 8;

// A share's unclaimed items [front, back), packed in one word so that either end is claimed by one CAS.
class ClaimedShare {
 public:
  void reset(int64_t front, int64_t back) { bounds_.store(pack(front, back)); }

  // The next run from the front, of up to `run` items and at most half of those left (stolen: half of those
  // left, from the back), so that the owner and a thread helping it end within an item or so of each other;
  // false when none is left.
  bool claim(int64_t run, bool stolen, int64_t* begin, int64_t* end) {
    uint64_t seen = bounds_.load();
    for (;;) {
      const int64_t front = static_cast<int64_t>(seen >> 32), back = static_cast<int64_t>(seen & 0xffffffffu);
      if (front >= back) return false;
      const int64_t left = back - front;
      *begin = stolen ? back - std::max<int64_t>(1, left / 2) : front;
      *end = stolen ? back : front + std::min(run, (left + 1) / 2);
      if (bounds_.compare_exchange_weak(seen, stolen ? pack(front, *begin) : pack(*end, back))) return true;
    }
  }

 private:
  static uint64_t pack(int64_t front, int64_t back) {
    return static_cast<uint64_t>(front) << 32 | static_cast<uint64_t>(back);
  }
  std::atomic<uint64_t> bounds_{0};
};

// claim_runs with the threads' shares given: thread t owns items [bounds[t], bounds[t + 1]) (bounds[0] = 0, the
// last bound the item count), each taken in runs of up to a kRunsPerShare-th of it; shares of unequal length suit
// items of unequal cost (for_each_expert_tile's).
template <typename F>
inline void claim_runs_in(const std::vector<int64_t>& bounds, const F& f) {
  const int64_t threads = static_cast<int64_t>(bounds.size()) - 1, items = bounds.back();
  if (threads <= 1) {
    if (items > 0) f(0, items);
    return;
  }
  CONVEYOR_CHECK(items < (int64_t{1} << 31), "too many work items to share out: ", items);
  std::vector<ClaimedShare> shares(threads);
  std::vector<int64_t> runs(threads);
  for (int64_t t = 0; t < threads; ++t) {
    shares[t].reset(bounds[t], bounds[t + 1]);
    runs[t] = std::max<int64_t>(1, (bounds[t + 1] - bounds[t]) / kRunsPerShare);
  }
  parallel_for(0, threads, 1, [&](int64_t first, int64_t last) {
    int64_t begin, end;
    for (int64_t t = first; t < last; ++t) {
      while (shares[t].claim(runs[t], false, &begin, &end)) f(begin, end);
    }
    for (int64_t t = 0; t < threads; ++t) {
      const int64_t other = (last + t) % threads;
      while (shares[other].claim(runs[other], true, &begin, &end)) f(begin, end);
    }
  });
}

template <typename F>
inline void claim_runs(int64_t items, const F& f) {
  const int64_t threads = std::max<int64_t>(1, std::min(num_threads(), items));
  const int64_t share = (items + threads - 1) / threads;
  std::vector<int64_t> bounds(threads + 1);
  for (int64_t t = 0; t <= threads; ++t) bounds[t] = std::min(items, t * share);
  claim_runs_in(bounds, f);
}

}  // namespace conveyor
