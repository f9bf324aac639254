// ACL back end of vmm.h (CANN virtual memory) and the malloc/free entry points that torch_npu's
// NPUPluggableAllocator calls. Built only where CANN is installed; CI checks that it compiles
// against acl_decls/ (-fsyntax-only). Not yet run on Ascend hardware.
//
// Errors are returned as aclError codes and become Python exceptions in vmm_module.cpp; the
// allocator entry points return nullptr / report through PyErr_WriteUnraisable. Nothing throws
// across the C boundary.
#include <Python.h>
#include <acl/acl.h>
#include <sys/types.h>

#include "vmm.h"

namespace {

aclrtPhysicalMemProp device_prop(int device) {
  aclrtPhysicalMemProp prop = {};
  prop.handleType = ACL_MEM_HANDLE_TYPE_NONE;
  prop.allocationType = ACL_MEM_ALLOCATION_TYPE_PINNED;
  prop.memAttr = ACL_HBM_MEM_HUGE;
  prop.location.id = static_cast<uint32_t>(device);
  prop.location.type = ACL_MEM_LOCATION_TYPE_DEVICE;
  prop.reserve = 0;
  return prop;
}

int acl_granularity(int device, size_t* out) {
  aclrtPhysicalMemProp prop = device_prop(device);
  return aclrtMemGetAllocationGranularity(&prop, ACL_RT_MEM_ALLOC_GRANULARITY_MINIMUM, out);
}

int acl_reserve(size_t size, uint64_t* addr) {
  void* p = nullptr;
  aclError err = aclrtReserveMemAddress(&p, size, 0, nullptr, 0);
  if (err == ACL_SUCCESS) *addr = reinterpret_cast<uint64_t>(p);
  return err;
}

int acl_release(uint64_t addr, size_t) {
  return aclrtReleaseMemAddress(reinterpret_cast<void*>(addr));
}

int acl_create(size_t size, int device, int, uint64_t* handle) {
  aclrtPhysicalMemProp prop = device_prop(device);
  aclrtDrvMemHandle h = nullptr;
  aclError err = aclrtMallocPhysical(&h, size, &prop, 0);
  if (err == ACL_SUCCESS) *handle = reinterpret_cast<uint64_t>(h);
  return err;
}

int acl_free(uint64_t handle) {
  return aclrtFreePhysical(reinterpret_cast<aclrtDrvMemHandle>(handle));
}

int acl_map(uint64_t addr, size_t size, uint64_t handle, int) {
  return aclrtMapMem(reinterpret_cast<void*>(addr), size, 0,
                     reinterpret_cast<aclrtDrvMemHandle>(handle), 0);
}

int acl_unmap(uint64_t addr, size_t) { return aclrtUnmapMem(reinterpret_cast<void*>(addr)); }

const char* acl_describe(int) {
  const char* msg = aclGetRecentErrMsg();
  return msg ? msg : "ACL runtime error";
}

// Python callbacks of the CaMemAllocator singleton (owned references).
PyObject* g_on_malloc = nullptr;  // (device, size, va, handle) -> None
PyObject* g_on_free = nullptr;    // (va) -> (size, handle, mapped)

}  // namespace

extern "C" const VmmBackend vmm_acl_backend = {
    "acl",     acl_granularity, acl_reserve, acl_release, acl_create,
    acl_free,  acl_map,         acl_unmap,   acl_describe,
};

// Called by vmm_module.cpp: install (or with None, remove) the allocator's callbacks.
extern "C" void vmm_acl_set_callbacks(PyObject* on_malloc, PyObject* on_free) {
  PyObject* m = on_malloc == Py_None ? nullptr : on_malloc;
  PyObject* f = on_free == Py_None ? nullptr : on_free;
  Py_XINCREF(m);
  Py_XINCREF(f);
  Py_XDECREF(g_on_malloc);
  Py_XDECREF(g_on_free);
  g_on_malloc = m;
  g_on_free = f;
}

// NPUPluggableAllocator entry: reserve a range, back it with physical memory, map it, and
// record it with the Python allocator (which knows the current tag). nullptr on any failure.
extern "C" void* vllm_ascend_rl_npu_malloc(ssize_t size, int device, aclrtStream) {
  size_t gran = 0;
  if (size <= 0 || acl_granularity(device, &gran) != ACL_SUCCESS || gran == 0) return nullptr;
  size_t aligned = (static_cast<size_t>(size) + gran - 1) / gran * gran;
  uint64_t va = 0, handle = 0;
  if (acl_reserve(aligned, &va) != ACL_SUCCESS) return nullptr;
  if (acl_create(aligned, device, 1, &handle) != ACL_SUCCESS) {
    acl_release(va, aligned);
    return nullptr;
  }
  if (acl_map(va, aligned, handle, 0) != ACL_SUCCESS) {
    acl_free(handle);
    acl_release(va, aligned);
    return nullptr;
  }
  bool recorded = false;
  PyGILState_STATE gil = PyGILState_Ensure();
  if (g_on_malloc != nullptr) {
    PyObject* r = PyObject_CallFunction(g_on_malloc, "iKKK", device,
                                        static_cast<unsigned long long>(aligned),
                                        static_cast<unsigned long long>(va),
                                        static_cast<unsigned long long>(handle));
    if (r != nullptr) {
      recorded = true;
      Py_DECREF(r);
    } else {
      PyErr_WriteUnraisable(g_on_malloc);
    }
  }
  PyGILState_Release(gil);
  if (!recorded) {
    acl_unmap(va, aligned);
    acl_free(handle);
    acl_release(va, aligned);
    return nullptr;
  }
  return reinterpret_cast<void*>(va);
}

// NPUPluggableAllocator entry: forget the allocation in Python, then give back whatever it
// still holds (an allocation asleep has no physical memory and no mapping).
extern "C" void vllm_ascend_rl_npu_free(void* ptr, ssize_t, int, aclrtStream) {
  unsigned long long size = 0, handle = 0;
  int mapped = 0;
  bool known = false;
  PyGILState_STATE gil = PyGILState_Ensure();
  if (g_on_free != nullptr) {
    PyObject* r = PyObject_CallFunction(g_on_free, "K",
                                        static_cast<unsigned long long>(
                                            reinterpret_cast<uintptr_t>(ptr)));
    if (r != nullptr && PyArg_ParseTuple(r, "KKp", &size, &handle, &mapped)) {
      known = true;
    } else {
      PyErr_WriteUnraisable(g_on_free);
    }
    Py_XDECREF(r);
  }
  PyGILState_Release(gil);
  if (!known) return;  // not ours, or the callback failed: leak rather than corrupt
  uint64_t va = reinterpret_cast<uint64_t>(ptr);
  if (mapped) acl_unmap(va, size);
  if (handle != 0) acl_free(handle);
  acl_release(va, size);
}
