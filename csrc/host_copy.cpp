// A host memcpy on a few threads, GIL released, for the staging copies of weight transfers on
// CPU: one thread does not reach memory bandwidth, and torch's copy_ goes through the OpenMP
// pool, whose barrier stalls for milliseconds while a colocated vLLM worker holds the cores.
#include <errno.h>
#include <string.h>

#include <algorithm>
#include <thread>
#include <vector>

#include "vmm_table.h"

namespace {

constexpr uint64_t kMinPerThread = 4ull << 20;  // below this a thread costs more than it saves
constexpr uint64_t kMaxThreads = 8;

void parallel_copy(unsigned char* dst, const unsigned char* src, uint64_t n, uint64_t threads) {
  threads = std::min({threads, kMaxThreads, std::max<uint64_t>(1, n / kMinPerThread)});
  if (threads <= 1) {
    memcpy(dst, src, n);
    return;
  }
  uint64_t chunk = (n / threads + 63) & ~uint64_t{63};  // cache-line aligned slices
  std::vector<std::thread> pool;
  for (uint64_t off = chunk; off < n; off += chunk) {
    uint64_t len = std::min(chunk, n - off);
    pool.emplace_back([=] { memcpy(dst + off, src + off, len); });
  }
  memcpy(dst, src, std::min(chunk, n));  // the calling thread takes the first slice
  for (auto& t : pool) t.join();
}

}  // namespace

int vmm_host_copy(void* dst, const void* src, uint64_t n, uint64_t threads) {
  auto d = reinterpret_cast<uintptr_t>(dst), s = reinterpret_cast<uintptr_t>(src);
  if (n != 0 && (d == 0 || s == 0 || (d < s + n && s < d + n))) return EINVAL;
  parallel_copy(static_cast<unsigned char*>(dst), static_cast<const unsigned char*>(src), n,
                threads);
  return 0;
}
