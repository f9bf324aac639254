// A host memcpy on a few threads, GIL released, for the staging copies of weight transfers on
// CPU: one thread does not reach memory bandwidth, and torch's copy_ goes through the OpenMP
// pool, whose barrier stalls for milliseconds while a colocated vLLM worker holds the cores.
#include <errno.h>
#include <string.h>

#include <algorithm>
#include <thread>
#include <vector>

#include "vmm_table.h"  // VMM_API

constexpr uint64_t kMinPerThread = 4ull << 20;  // below this a thread costs more than it saves
constexpr uint64_t kMaxThreads = 8;

// EINVAL, copying nothing, if an address is null or the ranges overlap.
extern "C" VMM_API int standin_host_copy(uint64_t d, uint64_t s, uint64_t n, uint64_t threads) {
  if (n != 0 && (d == 0 || s == 0 || (d < s + n && s < d + n))) return EINVAL;
  auto dst = reinterpret_cast<unsigned char*>(d);
  auto src = reinterpret_cast<const unsigned char*>(s);
  threads = std::min({threads, kMaxThreads, std::max<uint64_t>(1, n / kMinPerThread)});
  // Cache-line aligned slices; the calling thread takes the first.
  uint64_t chunk = threads <= 1 ? n : (n / threads + 63) & ~uint64_t{63};
  std::vector<std::thread> pool;
  for (uint64_t off = chunk; off < n; off += chunk) {
    pool.emplace_back([=] { memcpy(dst + off, src + off, std::min(chunk, n - off)); });
  }
  memcpy(dst, src, std::min(chunk, n));
  for (auto& t : pool) t.join();
  return 0;
}
