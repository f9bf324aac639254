// One virtual-memory interface for the sleep allocator. Its back end here is acl (CANN's
// aclrtReserveMemAddress/aclrtMallocPhysical/aclrtMapMem); the CPU stand-in brings a host one.
// Every call returns 0 or an error code (errno or aclError) and throws nothing. Calls take the
// device they touch, since ACL's current device is per thread: the back end makes it current.
#pragma once

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct VmmBackend {
  const char* name;
  // 1 if physical memory reads as zero once mapped (anonymous pages); 0 if it holds whatever was
  // there before (aclrtMallocPhysical), so a promise of zeros needs `zero`.
  int maps_zeroed;
  // Smallest size/alignment of physical allocations (bytes).
  int (*granularity)(int device, size_t* out);
  // Reserve a virtual address range that maps nothing yet.
  int (*reserve)(size_t size, int device, uint64_t* addr);
  int (*release)(uint64_t addr, size_t size, int device);
  // Physical memory of `size` bytes; `populate` commits it now (fails cleanly on OOM).
  int (*create)(size_t size, int device, int populate, uint64_t* handle);
  int (*free_handle)(uint64_t handle, int device);
  // Map `handle` at `addr` (inside a reserved range); unmap keeps the range reserved.
  int (*map)(uint64_t addr, size_t size, uint64_t handle, int populate, int device);
  int (*unmap)(uint64_t addr, size_t size, int device);
  // Set `size` mapped bytes at `addr` to zero.
  int (*zero)(uint64_t addr, size_t size, int device);
  // Wait until the device has finished all queued work (no-op on the host).
  int (*synchronize)(int device);
  // Human text for an error code of this back end.
  const char* (*describe)(int code);
} VmmBackend;

#ifdef VLLM_ASCEND_RL_WITH_ACL
extern const VmmBackend vmm_acl_backend;
#endif

#ifdef __cplusplus
}
#endif
