// The malloc/free entry points of a pluggable allocator, over any vmm.h back end, and the
// Python callbacks they report to (the CaMemAllocator singleton knows the current tag and the
// state of every allocation). torch_npu's NPUPluggableAllocator calls the ACL pair; the host
// pair runs the same code in CI through ctypes.
//
// Nothing throws across the C boundary. Failures are logged with the back end's code and
// message (a bare OOM from torch would say nothing), and a failing call never leaves a mapping
// behind.
#include <Python.h>
#include <stdio.h>

#include "vmm.h"

namespace {

// Python callbacks (owned references):
//   on_malloc(device, size, va, handle) -> None
//   on_free(va) -> (size, handle, mapped)
PyObject* g_on_malloc = nullptr;
PyObject* g_on_free = nullptr;

void log_failure(const VmmBackend* b, const char* op, uint64_t va, int err) {
  fprintf(stderr, "vllm_ascend_rl: %s %s at 0x%llx failed with code %d: %s\n", b->name, op,
          static_cast<unsigned long long>(va), err, b->describe(err));
}

// Calls `fn(args)` under the GIL without disturbing an exception the interpreter may have
// pending on this thread; returns a new reference or nullptr (failure logged).
PyObject* call_python(PyObject* fn, PyObject* args) {
  PyObject *type, *value, *traceback;
  PyErr_Fetch(&type, &value, &traceback);
  PyObject* result = args != nullptr ? PyObject_CallObject(fn, args) : nullptr;
  if (result == nullptr) PyErr_WriteUnraisable(fn);
  PyErr_Restore(type, value, traceback);
  return result;
}

}  // namespace

// Install (or with None, remove) the allocator's callbacks. The new ones are stored before the
// old ones are released: a finalizer run by that release may allocate through the pool.
extern "C" void vmm_set_callbacks(PyObject* on_malloc, PyObject* on_free) {
  PyObject* m = on_malloc == Py_None ? nullptr : on_malloc;
  PyObject* f = on_free == Py_None ? nullptr : on_free;
  Py_XINCREF(m);
  Py_XINCREF(f);
  PyObject* old_m = g_on_malloc;
  PyObject* old_f = g_on_free;
  g_on_malloc = m;
  g_on_free = f;
  Py_XDECREF(old_m);
  Py_XDECREF(old_f);
}

// Reserve a range, back it with physical memory, map it, and record it with the Python
// allocator. nullptr on any failure (torch then reports out-of-memory).
extern "C" void* vmm_entry_malloc(const VmmBackend* b, ssize_t size, int device) {
  size_t gran = 0;
  int err = size > 0 ? b->granularity(device, &gran) : 0;
  if (size <= 0 || err != 0 || gran == 0) {
    if (err != 0) log_failure(b, "granularity", 0, err);
    return nullptr;
  }
  size_t aligned = (static_cast<size_t>(size) + gran - 1) / gran * gran;
  uint64_t va = 0, handle = 0;
  if ((err = b->reserve(aligned, device, &va)) != 0) {
    log_failure(b, "reserve", 0, err);
    return nullptr;
  }
  if ((err = b->create(aligned, device, 1, &handle)) != 0) {
    log_failure(b, "create", va, err);
    b->release(va, aligned, device);
    return nullptr;
  }
  // Populated: a shortage fails this malloc (torch reports out-of-memory), not a later touch.
  if ((err = b->map(va, aligned, handle, 1, device)) != 0) {
    log_failure(b, "map", va, err);
    b->free_handle(handle, device);
    b->release(va, aligned, device);
    return nullptr;
  }
  bool recorded = false;
  if (Py_IsInitialized()) {  // never touch an interpreter that is gone
    PyGILState_STATE gil = PyGILState_Ensure();
    if (g_on_malloc != nullptr) {
      PyObject* args = Py_BuildValue("(iKKK)", device, static_cast<unsigned long long>(aligned),
                                     static_cast<unsigned long long>(va),
                                     static_cast<unsigned long long>(handle));
      PyObject* r = call_python(g_on_malloc, args);
      Py_XDECREF(args);
      recorded = r != nullptr;
      Py_XDECREF(r);
    }
    PyGILState_Release(gil);
  }
  if (!recorded) {  // an allocation the allocator does not know could never sleep or be freed
    b->unmap(va, aligned, device);
    b->free_handle(handle, device);
    b->release(va, aligned, device);
    return nullptr;
  }
  return reinterpret_cast<void*>(va);
}

// Forget the allocation in Python, then give back whatever it still holds (an allocation asleep
// has no physical memory and no mapping). The device is drained first: work still queued on it
// may read or write this memory, and unmapping under it faults.
extern "C" void vmm_entry_free(const VmmBackend* b, void* ptr, int device) {
  if (!Py_IsInitialized()) return;  // process exit: the OS takes everything back
  uint64_t va = reinterpret_cast<uint64_t>(ptr);
  unsigned long long size = 0, handle = 0;
  int mapped = 0;
  bool known = false;
  PyGILState_STATE gil = PyGILState_Ensure();
  if (g_on_free != nullptr) {
    PyObject* args = Py_BuildValue("(K)", static_cast<unsigned long long>(va));
    PyObject* r = call_python(g_on_free, args);
    Py_XDECREF(args);
    if (r != nullptr) {
      PyObject *type, *value, *traceback;
      PyErr_Fetch(&type, &value, &traceback);
      known = PyArg_ParseTuple(r, "KKp", &size, &handle, &mapped) != 0;
      if (!known) PyErr_WriteUnraisable(g_on_free);
      PyErr_Restore(type, value, traceback);
      Py_DECREF(r);
    }
  }
  PyGILState_Release(gil);
  if (!known) return;  // not ours, or the callback failed: leak rather than corrupt
  int err;
  if ((err = b->synchronize(device)) != 0) log_failure(b, "synchronize before free", va, err);
  if (mapped && (err = b->unmap(va, size, device)) != 0) {
    log_failure(b, "unmap", va, err);
    return;  // still mapped: freeing the memory or the range under it would fail or corrupt
  }
  if (handle != 0 && (err = b->free_handle(handle, device)) != 0) log_failure(b, "free", va, err);
  if ((err = b->release(va, size, device)) != 0) log_failure(b, "release", va, err);
}
