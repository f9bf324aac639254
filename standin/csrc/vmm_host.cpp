// Host back end of vmm.h: the CPU stand-in for CANN virtual memory. A reserved range is an
// anonymous PROT_NONE mapping; "physical memory" is a handle that records a size and, once
// mapped, the address its pages live at. Mapping a fresh handle replaces part of the
// reservation with private anonymous memory (MAP_FIXED; not shmem, which costs twice as much to
// populate, benchmarks/README.md), populated on request. As with aclrtUnmapMem, an unmap keeps
// the physical memory and its contents (the range becomes PROT_NONE, the pages stay) until the
// handle is freed, which gives the pages back at once; mapping the handle again at the same
// address restores access to the same contents. A handle maps at one address only.
#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <vector>

#include "vmm_table.h"  // VMM_API

namespace {

int host_granularity(int, size_t* out) {
  *out = static_cast<size_t>(sysconf(_SC_PAGESIZE));  // cannot fail on Linux
  return 0;
}

// Live handles: a handle that is not one of ours is EBADF, never a guess.
struct Handle {
  size_t size;
  uint64_t pages_at;  // the address its pages live at, mapped or not; 0 before the first map
};
std::mutex g_handles_lock;
std::unordered_map<uint64_t, Handle> g_handles;
uint64_t g_next_handle = 1;  // never 0: the entry points read 0 as "no handle"

// Give the pages of [addr, addr + size) back to the kernel; the range stays reserved.
int drop_pages(uint64_t addr, size_t size) {
  void* p = mmap(reinterpret_cast<void*>(addr), size, PROT_NONE,
                 MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0);
  return p == MAP_FAILED ? errno : 0;
}

int host_reserve(size_t size, int, uint64_t* addr) {
  void* p = mmap(nullptr, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) return errno;
  *addr = reinterpret_cast<uint64_t>(p);
  return 0;
}

int host_release(uint64_t addr, size_t size, int) {
  return munmap(reinterpret_cast<void*>(addr), size) == 0 ? 0 : errno;
}

// Memory the kernel can hand out now (MemAvailable), or 0 if unknown.
size_t available_bytes() {
  FILE* f = fopen("/proc/meminfo", "r");
  if (f == nullptr) return 0;
  char line[256];
  unsigned long long kib = 0;
  while (fgets(line, sizeof line, f) != nullptr) {
    if (sscanf(line, "MemAvailable: %llu kB", &kib) == 1) break;
  }
  fclose(f);
  return static_cast<size_t>(kib) * 1024;
}

int host_create(size_t size, int, int populate, uint64_t* handle) {
  // Committing more than the host can give would not fail: the OOM killer would end the
  // process. Refuse up front instead (the pages themselves are committed when mapped).
  size_t avail = populate ? available_bytes() : 0;
  if (populate && avail != 0 && size > avail) return ENOMEM;
  std::lock_guard<std::mutex> lock(g_handles_lock);
  *handle = g_next_handle++;
  g_handles[*handle] = Handle{size, 0};
  return 0;
}

int host_free(uint64_t handle, int) {
  std::lock_guard<std::mutex> lock(g_handles_lock);
  auto it = g_handles.find(handle);
  if (it == g_handles.end()) return EBADF;
  Handle h = it->second;
  g_handles.erase(it);
  return h.pages_at != 0 ? drop_pages(h.pages_at, h.size) : 0;
}

// The pages stay (as physical memory stays with its handle on ACL); only access goes.
int host_unmap(uint64_t addr, size_t size, int) {
  return mprotect(reinterpret_cast<void*>(addr), size, PROT_NONE) == 0 ? 0 : errno;
}

// Write-fault every page now, in one kernel call. MADV_POPULATE_WRITE (Linux 5.14) reports a
// shortage as ENOMEM; older kernels reject it (EINVAL) and get MAP_POPULATE's best effort.
#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif
int populate_chunk(char* p, size_t size) {
  if (madvise(p, size, MADV_POPULATE_WRITE) == 0) return 0;
  if (errno != EINVAL) return errno;
  void* q = mmap(p, size, PROT_READ | PROT_WRITE,
                 MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE | MAP_POPULATE, -1, 0);
  return q == MAP_FAILED ? errno : 0;
}

// Zeroing the pages is the cost, and one core does it well below memory bandwidth: large
// ranges are populated by a few threads, one chunk each (the calling thread takes the first).
int populate_range(char* p, size_t size) {
  constexpr size_t kMinChunk = 64ul << 20;
  size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  size_t threads = std::min<size_t>({std::max(1u, std::thread::hardware_concurrency()), 8,
                                     std::max<size_t>(1, size / kMinChunk)});
  size_t chunk = (size / threads + page - 1) / page * page;
  std::vector<int> errs(threads, 0);
  std::vector<std::thread> pool;
  for (size_t off = chunk; off < size; off += chunk) {
    int* err = &errs[off / chunk];
    pool.emplace_back([=] { *err = populate_chunk(p + off, std::min(chunk, size - off)); });
  }
  errs[0] = populate_chunk(p, std::min(chunk, size));
  for (auto& t : pool) t.join();
  for (int e : errs) {
    if (e != 0) return e;
  }
  return 0;
}

// Under the handles' lock throughout: a handle freed meanwhile cannot leave its pages behind.
int host_map(uint64_t addr, size_t size, uint64_t handle, int populate, int) {
  std::lock_guard<std::mutex> lock(g_handles_lock);
  auto it = g_handles.find(handle);
  if (it == g_handles.end()) return EBADF;
  Handle& h = it->second;
  if (size > h.size) return EINVAL;
  void* want = reinterpret_cast<void*>(addr);
  if (h.pages_at == addr) {  // mapped here before: the same pages, the same contents
    return mprotect(want, size, PROT_READ | PROT_WRITE) == 0 ? 0 : errno;
  }
  if (h.pages_at != 0) return EINVAL;  // its pages live elsewhere
  // MAP_NORESERVE: no commit charge up front; what is committed is what `populate` (or a
  // touch) faults in, as create's check intends.
  void* p = mmap(want, size, PROT_READ | PROT_WRITE,
                 MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) return errno;
  int err = populate ? populate_range(static_cast<char*>(p), size) : 0;  // MAP_FIXED: p is addr
  if (err != 0) {
    drop_pages(addr, size);  // never leave a half-made mapping behind
    return err;
  }
  h.pages_at = addr;
  return 0;
}

// Fresh anonymous pages are zero already (maps_zeroed); this serves an explicit request.
int host_zero(uint64_t addr, size_t size, int) {
  memset(reinterpret_cast<void*>(addr), 0, size);
  return 0;
}

int host_synchronize(int) { return 0; }  // host work is synchronous

const char* host_describe(int code) { return strerror(code); }

}  // namespace

extern "C" VMM_API const VmmBackend vmm_host_backend = {
    "host",    1,          host_granularity, host_reserve,     host_release,  host_create,
    host_free, host_map,   host_unmap,       host_zero,        host_synchronize, host_describe,
};
