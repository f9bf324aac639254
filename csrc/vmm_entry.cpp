// The sleep allocator's table (vmm_table.h) and the malloc/free entry points of a pluggable
// allocator over any vmm.h back end: torch_npu's NPUPluggableAllocator calls the ACL pair, CI
// the generic pair over the CPU stand-in's host back end.
//
// torch_npu calls them under its allocator mutex (NPUCachingAllocator.cpp:2720-2724,
// 2.10.0.post4), so they must not wait for anything a thread waiting on that mutex may hold, the
// GIL above all. As in torch_memory_saver (csrc/core.h: AllocationMetadata under
// allocator_metadata_mutex_), the table has its own mutex, whose holder never waits for the GIL
// or torch_npu's mutex. Nothing throws across the C boundary; failures are logged with the back
// end's code and message (torch's bare OOM says nothing), and leave no mapping behind.
#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <sys/types.h>

#include <mutex>
#include <unordered_map>

#include "vmm.h"
#include "vmm_table.h"

namespace {

struct Table {
  std::mutex mutex;
  std::unordered_map<uint64_t, VmmEntry> entries;  // by address
  char tag[VMM_TAG_BYTES] = "default";              // allocator.DEFAULT_TAG
  uint64_t next_id = 1;
};

void copy_tag(char* dst, const char* src) { snprintf(dst, VMM_TAG_BYTES, "%s", src); }

// Never destroyed: torch_npu may free pool memory while the process exits, after this library's
// static destructors would have run.
Table& table() {
  static Table* t = new Table();
  return *t;
}

VmmStatus ok(const VmmBackend* b) { return VmmStatus{1, 0, nullptr, b}; }
VmmStatus failed(const VmmBackend* b, const char* op, int err) { return VmmStatus{1, err, op, b}; }
VmmStatus gone() { return VmmStatus{0, 0, nullptr, nullptr}; }

// Run f(table, entry) on the entry (addr, id) under the table's mutex; gone() if there is none.
template <typename F>
VmmStatus with_entry(uint64_t addr, uint64_t id, F f) {
  Table& t = table();
  std::lock_guard<std::mutex> lock(t.mutex);
  auto it = t.entries.find(addr);
  if (it == t.entries.end() || (id != 0 && it->second.id != id)) return gone();
  return f(t, it->second);
}

// Release an entry's physical memory, recording each step as it succeeds (the mutex is held, as
// torch_memory_saver's pause holds it across cuMemUnmap/cuMemRelease).
VmmStatus unmap(VmmEntry& e) {
  const VmmBackend* b = e.backend;
  if (e.mapped) {
    int err = b->unmap(e.addr, e.size, e.device);
    if (err != 0) return failed(b, "unmap", err);
    e.mapped = 0;
  }
  return ok(b);
}

VmmStatus release_physical(VmmEntry& e) {
  const VmmBackend* b = e.backend;
  VmmStatus st = unmap(e);
  if (st.err != 0 || e.handle == 0) return st;
  uint64_t handle = e.handle;
  e.handle = 0;  // a host handle number or an ACL handle is never freed twice
  int err = b->free_handle(handle, e.device);
  return err != 0 ? failed(b, "free", err) : st;
}

// vmm_table_wake's work (vmm_table.h). A back end sets a handle only when `create` succeeds.
VmmStatus map(VmmEntry& e, int populate) {
  const VmmBackend* b = e.backend;
  if (e.mapped) return ok(b);
  bool created = e.handle == 0;
  int err;
  if (created && (err = b->create(e.size, e.device, populate, &e.handle)) != 0) {
    return failed(b, "create", err);
  }
  if ((err = b->map(e.addr, e.size, e.handle, populate, e.device)) != 0) {
    if (created) release_physical(e);  // not mapped: this only frees the new handle
    return failed(b, "map", err);
  }
  e.mapped = 1;
  return ok(b);
}

void log_failure(const VmmBackend* b, const char* op, uint64_t va, int err) {
  fprintf(stderr, "vllm_ascend_rl: %s %s at 0x%llx failed with code %d: %s\n", b->name, op,
          static_cast<unsigned long long>(va), err, b->describe(err));
}

}  // namespace

// Reserve a range, back it with populated physical memory, map it, and record it with the
// current tag. nullptr on any failure (torch then reports out-of-memory).
void* vmm_entry_malloc(const VmmBackend* b, ssize_t size, int device) {
  if (size <= 0) return nullptr;
  VmmEntry e{};
  VmmStatus st = vmm_table_allocate(b, static_cast<uint64_t>(size), device, 1, nullptr, &e);
  if (st.err != 0) {
    log_failure(b, st.op, 0, st.err);
    return nullptr;
  }
  return reinterpret_cast<void*>(e.addr);
}

// Take the allocation out of the table, then give back whatever it still holds (one asleep has
// no mapping and no physical memory), as torch_memory_saver's free does. The device is drained
// first: work still queued on it may read or write this memory, and unmapping under it faults.
void vmm_entry_free(const VmmBackend* b, void* ptr) {
  uint64_t va = reinterpret_cast<uint64_t>(ptr);
  VmmEntry e{};
  VmmStatus taken = with_entry(va, 0, [&](Table& t, VmmEntry& found) {
    if (found.backend != b) return gone();
    e = found;
    t.entries.erase(va);
    return ok(b);
  });
  if (!taken.found) {  // not ours: leak rather than corrupt
    fprintf(stderr, "vllm_ascend_rl: %s free of 0x%llx, which the sleep allocator did not make\n",
            b->name, static_cast<unsigned long long>(va));
    return;
  }
  int err;
  if ((err = b->synchronize(e.device)) != 0) log_failure(b, "synchronize before free", va, err);
  VmmStatus st = release_physical(e);
  if (st.err != 0) {
    log_failure(b, st.op, va, st.err);
    if (e.mapped) return;  // still mapped: releasing the range under it would fail or corrupt
  }
  if ((err = b->release(va, e.size, e.device)) != 0) log_failure(b, "release", va, err);
}

const VmmBackend* vmm_backend([[maybe_unused]] const char* name) {
#ifdef VLLM_ASCEND_RL_WITH_ACL
  if (strcmp(name, vmm_acl_backend.name) == 0) return &vmm_acl_backend;
#endif
  return nullptr;
}

void vmm_table_set_tag(const char* tag, char* previous) {
  Table& t = table();
  std::lock_guard<std::mutex> lock(t.mutex);
  copy_tag(previous, t.tag);
  copy_tag(t.tag, tag);
}

size_t vmm_table_entries(const VmmBackend* b, VmmEntry* out, size_t capacity) {
  Table& t = table();
  std::lock_guard<std::mutex> lock(t.mutex);
  size_t n = 0;
  for (const auto& kv : t.entries) {
    if (kv.second.backend != b) continue;
    if (n < capacity) out[n] = kv.second;
    ++n;
  }
  return n;
}

VmmStatus vmm_table_allocate(const VmmBackend* b, uint64_t size, int device, int populate,
                             const char* tag, VmmEntry* out) {
  size_t gran = 0;
  int err = b->granularity(device, &gran);
  if (err != 0) return failed(b, "granularity", err);
  if (size == 0 || gran == 0) return failed(b, "allocate", EINVAL);
  VmmEntry e{b, 0, (size + gran - 1) / gran * gran, 0, 0, device, 0, {}};
  if ((err = b->reserve(e.size, device, &e.addr)) != 0) return failed(b, "reserve", err);
  // Populated: a shortage fails this call (torch reports out-of-memory), not a later touch.
  VmmStatus st = map(e, populate);
  try {
    if (st.err == 0) {
      Table& t = table();
      std::lock_guard<std::mutex> lock(t.mutex);
      e.id = t.next_id++;
      copy_tag(e.tag, tag != nullptr ? tag : t.tag);
      t.entries[e.addr] = e;
      *out = e;
    }
  } catch (...) {  // out of host memory: memory the table does not know could never be released
    st = failed(b, "record (out of host memory)", ENOMEM);
  }
  if (st.err != 0) {
    release_physical(e);
    b->release(e.addr, e.size, device);
  }
  return st;
}

VmmStatus vmm_table_sleep(uint64_t addr, uint64_t id) {
  return with_entry(addr, id, [](Table&, VmmEntry& e) { return release_physical(e); });
}

VmmStatus vmm_table_unmap(uint64_t addr, uint64_t id) {
  return with_entry(addr, id, [](Table&, VmmEntry& e) { return unmap(e); });
}

// The table's mutex is held across the calls, as torch_memory_saver's resume holds it across
// cuMemCreate/cuMemMap.
VmmStatus vmm_table_wake(uint64_t addr, uint64_t id, int populate) {
  return with_entry(addr, id, [populate](Table&, VmmEntry& e) { return map(e, populate); });
}

VmmStatus vmm_table_free(uint64_t addr, uint64_t id) {
  return with_entry(addr, id, [addr](Table& t, VmmEntry& e) {
    VmmStatus st = release_physical(e);
    if (st.err != 0) return st;
    int err = e.backend->release(e.addr, e.size, e.device);
    if (err != 0) return failed(e.backend, "release", err);
    t.entries.erase(addr);
    return st;
  });
}

int vmm_table_retag(uint64_t addr, uint64_t id, const char* tag) {
  auto retag = [tag](Table&, VmmEntry& e) {
    copy_tag(e.tag, tag);
    return ok(e.backend);
  };
  return with_entry(addr, id, retag).found;
}

// torch_npu's NPUPluggableAllocator pair (signatures of torch_npu v2.10.0
// torch_npu/csrc/npu/NPUPluggableAllocator.h:17-18, the last argument an aclrtStream).
#ifdef VLLM_ASCEND_RL_WITH_ACL
extern "C" VMM_API void* vllm_ascend_rl_npu_malloc(ssize_t size, int device, void*) {
  return vmm_entry_malloc(&vmm_acl_backend, size, device);
}

extern "C" VMM_API void vllm_ascend_rl_npu_free(void* ptr, ssize_t, int, void*) {
  vmm_entry_free(&vmm_acl_backend, ptr);
}
#endif
