// Parallel loops that tolerate a preempted thread.
//
// at::parallel_for gives each thread a fixed range, so a region ends when its slowest thread
// does. On a machine with as many threads as cores, another thread of the process (a
// restore's readers) preempts one of them and the others wait at the region's end. Here each
// thread still takes its own range first, in order (the same items, and memory walked the
// same way, as a fixed split), then takes what is left of the others' from their ends.
#pragma once

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <vector>

namespace hcache {

// `f(i)` for every i in 0..n, each exactly once, on the compute threads
template <typename F>
void parallel_steal(int64_t n, F&& f) {
  TORCH_CHECK(n < (int64_t(1) << 32), "parallel_steal: ", n, " items");
  const int64_t nt = std::min<int64_t>(at::get_num_threads(), n);
  if (nt <= 1 || at::in_parallel_region()) {
    for (int64_t i = 0; i < n; ++i) f(i);
    return;
  }
  struct alignas(64) Range {
    std::atomic<uint64_t> lohi;  // (next from the front) << 32 | (end, taken from the back)
  };
  std::vector<Range> ranges(nt);
  for (int64_t t = 0; t < nt; ++t) ranges[t].lohi = (uint64_t(n * t / nt) << 32) | uint64_t(n * (t + 1) / nt);
  // one index per thread (a grain of 1 over nt items); a region run inline takes every range
  at::parallel_for(0, nt, 1, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      for (int64_t s = 0; s < nt; ++s) {
        const bool own = s == 0;
        std::atomic<uint64_t>& r = ranges[(t + s) % nt].lohi;
        uint64_t cur = r.load(std::memory_order_relaxed);
        while (true) {
          const uint64_t lo = cur >> 32, hi = cur & 0xFFFFFFFFu;
          if (lo >= hi) break;
          const uint64_t next = own ? ((lo + 1) << 32) | hi : (lo << 32) | (hi - 1);
          if (r.compare_exchange_weak(cur, next, std::memory_order_relaxed)) {
            f(int64_t(own ? lo : hi - 1));
            cur = r.load(std::memory_order_relaxed);
          }
        }
      }
    }
  });
}

}  // namespace hcache
