// Host back end of vmm.h: the CPU stand-in for CANN virtual memory.
// A reserved range is an anonymous PROT_NONE mapping; physical memory is a memfd; mapping
// replaces part of the reservation with a MAP_SHARED|MAP_FIXED view of the memfd; unmapping
// puts a PROT_NONE reservation back, so the address stays ours and the pages go back to the
// OS once the memfd is closed.
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "vmm.h"

namespace {

int host_granularity(int, size_t* out) {
  long page = sysconf(_SC_PAGESIZE);
  if (page <= 0) return errno ? errno : EINVAL;
  *out = static_cast<size_t>(page);
  return 0;
}

// Handles are file descriptors: anything above INT_MAX cannot be one of ours, and truncating it
// would close an unrelated descriptor.
bool valid_fd(uint64_t handle) { return handle <= static_cast<uint64_t>(INT_MAX); }

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
  // process. Refuse up front instead.
  size_t avail = populate ? available_bytes() : 0;
  if (populate && avail != 0 && size > avail) return ENOMEM;
  int fd = memfd_create("vllm_ascend_rl_vmm", MFD_CLOEXEC);
  if (fd < 0) return errno;
  int err = 0;
  if (ftruncate(fd, static_cast<off_t>(size)) != 0) {
    err = errno;
  } else if (populate) {
    // Commit the pages now: running out of memory is reported here, not by a later SIGBUS.
    err = posix_fallocate(fd, 0, static_cast<off_t>(size));
  }
  if (err != 0) {
    close(fd);
    return err;
  }
  *handle = static_cast<uint64_t>(fd);
  return 0;
}

int host_free(uint64_t handle, int) {
  if (!valid_fd(handle)) return EBADF;
  return close(static_cast<int>(handle)) == 0 ? 0 : errno;
}

int host_map(uint64_t addr, size_t size, uint64_t handle, int populate, int) {
  if (!valid_fd(handle)) return EBADF;
  int flags = MAP_SHARED | MAP_FIXED | (populate ? MAP_POPULATE : 0);
  void* want = reinterpret_cast<void*>(addr);
  void* p = mmap(want, size, PROT_READ | PROT_WRITE, flags, static_cast<int>(handle), 0);
  if (p == MAP_FAILED) return errno;
  if (p != want) {  // cannot happen with MAP_FIXED; never leave a stray mapping behind
    munmap(p, size);
    return EFAULT;
  }
  return 0;
}

int host_unmap(uint64_t addr, size_t size, int) {
  void* want = reinterpret_cast<void*>(addr);
  void* p = mmap(want, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE,
                 -1, 0);
  return p == MAP_FAILED ? errno : 0;
}

// Fresh memfd pages are zero already (maps_zeroed); this serves an explicit request.
int host_zero(uint64_t addr, size_t size, int) {
  memset(reinterpret_cast<void*>(addr), 0, size);
  return 0;
}

int host_synchronize(int) { return 0; }  // host work is synchronous

const char* host_describe(int code) { return strerror(code); }

}  // namespace

extern "C" const VmmBackend vmm_host_backend = {
    "host",    1,          host_granularity, host_reserve,     host_release,  host_create,
    host_free, host_map,   host_unmap,       host_zero,        host_synchronize, host_describe,
};

extern "C" __attribute__((visibility("default"))) void* vllm_ascend_rl_host_malloc(ssize_t size,
                                                                                   int device,
                                                                                   void*) {
  return vmm_entry_malloc(&vmm_host_backend, size, device);
}

extern "C" __attribute__((visibility("default"))) void vllm_ascend_rl_host_free(void* ptr, ssize_t,
                                                                                int device, void*) {
  vmm_entry_free(&vmm_host_backend, ptr, device);
}
