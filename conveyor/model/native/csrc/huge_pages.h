// Memory that Linux may back with 2 MiB pages (transparent huge pages, asked for with madvise: most
// distributions enable them only on request), without torch, so that the kernel check binary streams its weights
// from the same pages the engine's weights lie on. A decode step streams every weight once; on 4 KiB pages the
// stream crosses a page every 4 KiB, each a TLB miss and a restart for the hardware prefetcher. Where the kernel
// declines, the memory is ordinary pages; nothing else changes. The pages are fresh anonymous ones, zero until
// written and resident only where written.

#pragma once

#include <sys/mman.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>

namespace conveyor {

constexpr size_t kHugePage = size_t{1} << 21;

// The bytes a huge_page_alloc of `bytes` maps: whole 4 KiB pages, at least one.
inline size_t huge_page_span(size_t bytes) { return std::max<size_t>((bytes + 4095) / 4096 * 4096, 4096); }

// `bytes` of zeros starting on a 2 MiB boundary and advised to huge pages, or nullptr if out of memory. Mapped
// with a huge page to spare, then trimmed: a huge page must lie wholly inside the advised range, aligned.
inline void* huge_page_alloc(size_t bytes) {
  const size_t span = huge_page_span(bytes), mapped = span + kHugePage;
  void* base = mmap(nullptr, mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (base == MAP_FAILED) return nullptr;
  auto* start = static_cast<char*>(base);
  auto* data = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(start) + kHugePage - 1) & ~(kHugePage - 1));
  if (data > start) munmap(start, static_cast<size_t>(data - start));
  const size_t tail = static_cast<size_t>(start + mapped - (data + span));
  if (tail > 0) munmap(data + span, tail);
#if defined(MADV_HUGEPAGE)
  madvise(data, span, MADV_HUGEPAGE);  // advice: an error leaves ordinary pages
#endif
  return data;
}

// Returns what huge_page_alloc(bytes) gave.
inline void huge_page_free(void* data, size_t bytes) { munmap(data, huge_page_span(bytes)); }

}  // namespace conveyor
