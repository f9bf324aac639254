// One virtual-memory interface for the sleep allocator, with two back ends:
//   host: memfd + mmap (reserve with PROT_NONE, map with MAP_FIXED), always built;
//   acl:  CANN's aclrtReserveMemAddress / aclrtMallocPhysical / aclrtMapMem, built with CANN.
// Every call returns 0 or an error code (errno, or an aclError); nothing throws.
#pragma once

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct VmmBackend {
  const char* name;
  // Smallest size/alignment of physical allocations (bytes).
  int (*granularity)(int device, size_t* out);
  // Reserve a virtual address range that maps nothing yet.
  int (*reserve)(size_t size, uint64_t* addr);
  int (*release)(uint64_t addr, size_t size);
  // Physical memory of `size` bytes; `populate` commits it now (fails cleanly on OOM).
  int (*create)(size_t size, int device, int populate, uint64_t* handle);
  int (*free_handle)(uint64_t handle);
  // Map `handle` at `addr` (inside a reserved range); unmap keeps the range reserved.
  int (*map)(uint64_t addr, size_t size, uint64_t handle, int populate);
  int (*unmap)(uint64_t addr, size_t size);
  // Human text for an error code of this back end.
  const char* (*describe)(int code);
} VmmBackend;

extern const VmmBackend vmm_host_backend;
#ifdef VLLM_ASCEND_RL_WITH_ACL
extern const VmmBackend vmm_acl_backend;
#endif

#ifdef __cplusplus
}
#endif
