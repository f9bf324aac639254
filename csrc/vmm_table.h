// The process's table of sleep-allocator memory (vmm_entry.cpp): every allocation made through
// the entry points or _C.table_allocate, and the only record of its state. Python uses it
// through vmm_module.cpp, the entry points without Python. Every function is thread-safe, takes
// the table's mutex and never the GIL, and throws only std::bad_alloc from copying a tag or the
// entries (vmm_table_allocate throws nothing). An entry is named by (addr, id): an address can
// be reused after a free, an id never is (0 matches any id).
#pragma once

#include <stdint.h>

#include <string>
#include <vector>

#include "vmm.h"

struct VmmEntry {
  const VmmBackend* backend;
  uint64_t addr;
  uint64_t size;  // a multiple of the back end's granularity
  int device;
  uint64_t handle;  // physical memory; 0 while there is none
  bool mapped;      // the handle is mapped at addr
  std::string tag;
  uint64_t id;  // unique in the process, never 0
};

// Outcome of a table operation. `found` is false if (addr, id) names no entry (nothing was
// done); otherwise `err` is 0 or the code with which `backend`'s call `op` failed.
struct VmmStatus {
  bool found;
  int err;
  const char* op;
  const VmmBackend* backend;
};

// Tag given to allocations made through the entry points from now on; returns the previous one.
std::string vmm_table_set_tag(const std::string& tag);

// A copy of the entries of back end `b`.
std::vector<VmmEntry> vmm_table_entries(const VmmBackend* b);

// Reserve, back (populated if asked) and map `size` bytes rounded up to the granularity, and
// record them tagged `tag` (the entry points' tag if null). All or nothing.
VmmStatus vmm_table_allocate(const VmmBackend* b, size_t size, int device, int populate,
                             const std::string* tag, VmmEntry* out);

// Unmap the entry if mapped, then free its handle if any. Each step is recorded as soon as it
// succeeds, and a handle is forgotten before it is freed: a failed free is never retried.
VmmStatus vmm_table_sleep(uint64_t addr, uint64_t id);

// Back an unmapped entry with new physical memory and map it (populated if asked); on failure
// the memory this call created is freed again. A mapped entry is left alone.
VmmStatus vmm_table_wake(uint64_t addr, uint64_t id, int populate);

// vmm_table_sleep, then release the range and forget the entry. A failing step leaves the entry
// recorded in the state it reached. Does not drain the device: the caller does.
VmmStatus vmm_table_free(uint64_t addr, uint64_t id);

// Re-tag an entry; false if (addr, id) names none.
bool vmm_table_retag(uint64_t addr, uint64_t id, const std::string& tag);
