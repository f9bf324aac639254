// The process's table of sleep-allocator memory (vmm_entry.cpp): every allocation made through
// the entry points or vmm_table_allocate, and the only record of its state. Python calls these
// functions through ctypes (vllm_ascend_rl/vmm.py), which releases the GIL for each call; the
// entry points call them without Python. Every function is thread-safe, takes the table's mutex
// and never the GIL, and throws nothing. An entry is named by (addr, id): an address can be
// reused after a free, an id never is (0 matches any id).
#pragma once

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "vmm.h"

#define VMM_API __attribute__((visibility("default")))
#define VMM_TAG_BYTES 64  // a tag is at most 63 bytes; longer ones are cut (Python refuses them)

#ifdef __cplusplus
extern "C" {
#endif

typedef struct VmmEntry {
  const VmmBackend* backend;
  uint64_t addr;
  uint64_t size;    // a multiple of the back end's granularity
  uint64_t handle;  // physical memory; 0 while there is none
  uint64_t id;      // unique in the process, never 0
  int32_t device;
  int32_t mapped;  // the handle is mapped at addr
  char tag[VMM_TAG_BYTES];
} VmmEntry;

// Outcome of a table operation. `found` is 0 if (addr, id) names no entry (nothing was done);
// otherwise `err` is 0 or the code with which `backend`'s call `op` failed.
typedef struct VmmStatus {
  int32_t found;
  int32_t err;
  const char* op;
  const VmmBackend* backend;
} VmmStatus;

// The built-in back end called `name` ("acl"), or NULL if this build has none by that name.
VMM_API const VmmBackend* vmm_backend(const char* name);

// Tag given to allocations made through the entry points from now on; the previous one is
// copied to `previous` (VMM_TAG_BYTES).
VMM_API void vmm_table_set_tag(const char* tag, char* previous);

// Copy up to `capacity` entries of back end `b` to `out`; returns how many there are.
VMM_API size_t vmm_table_entries(const VmmBackend* b, VmmEntry* out, size_t capacity);

// Reserve, back (populated if asked) and map `size` bytes rounded up to the granularity, and
// record them tagged `tag` (the entry points' tag if NULL). All or nothing.
VMM_API VmmStatus vmm_table_allocate(const VmmBackend* b, uint64_t size, int device, int populate,
                                     const char* tag, VmmEntry* out);

// Unmap the entry if mapped, then free its handle if any. Each step is recorded as soon as it
// succeeds, and a handle is forgotten before it is freed: a failed free is never retried.
VMM_API VmmStatus vmm_table_sleep(uint64_t addr, uint64_t id);

// Unmap the entry if mapped, keeping its handle: its physical memory and contents stay until
// vmm_table_sleep frees them, and vmm_table_wake maps them back. The step a sleep can undo.
VMM_API VmmStatus vmm_table_unmap(uint64_t addr, uint64_t id);

// Map an unmapped entry: its own handle if it kept one (contents as they were), else new
// physical memory (populated if asked), freed again on failure. A mapped entry is left alone.
VMM_API VmmStatus vmm_table_wake(uint64_t addr, uint64_t id, int populate);

// vmm_table_sleep, then release the range and forget the entry. A failing step leaves the entry
// recorded in the state it reached. Does not drain the device: the caller does.
VMM_API VmmStatus vmm_table_free(uint64_t addr, uint64_t id);

// Re-tag an entry; 0 if (addr, id) names none.
VMM_API int vmm_table_retag(uint64_t addr, uint64_t id, const char* tag);

// The malloc/free pair of a pluggable allocator over back end `b`: nullptr on any failure;
// a free of memory the table did not make is logged and leaks. torch_npu's pair wraps them.
VMM_API void* vmm_entry_malloc(const VmmBackend* b, ssize_t size, int device);
VMM_API void vmm_entry_free(const VmmBackend* b, void* ptr);

#ifdef __cplusplus
}
#endif
