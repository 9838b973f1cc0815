// Threads and checks for the kernels, without torch: the kernels compile as a plain C++ library (the kernel
// check binary, kernel_check.cpp, builds them with g++ alone), and the torch module (kernels.cpp) defines
// CONVEYOR_ATEN before its includes so that they share ATen's thread pool and raise ATen's errors, exactly as
// they would calling ATen themselves.

#pragma once

#include <algorithm>
#include <cstdint>
#include <sstream>
#include <stdexcept>

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

}  // namespace conveyor
