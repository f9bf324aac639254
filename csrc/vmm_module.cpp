// vllm_ascend_rl._C: the vmm.h back ends and the allocation table (vmm_table.h, table_*) as
// Python functions over int addresses and handles. A failing call raises VmmError(code,
// message); no C++ exception crosses into CPython.
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>

#include <new>
#include <string>
#include <vector>

#include "py_args.h"

#include "vmm.h"
#include "vmm_table.h"

PyObject* py_host_copy(PyObject*, PyObject* args);  // host_copy.cpp

namespace {

PyObject* g_vmm_error = nullptr;

const VmmBackend* find_backend(const char* name) {
  if (strcmp(name, vmm_host_backend.name) == 0) return &vmm_host_backend;
#ifdef VLLM_ASCEND_RL_WITH_ACL
  if (strcmp(name, vmm_acl_backend.name) == 0) return &vmm_acl_backend;
#endif
  PyErr_Format(PyExc_ValueError, "VMM back end '%s' is not built in this extension", name);
  return nullptr;
}

PyObject* fail(const VmmBackend* b, const char* op, int code) {
  PyObject* args = Py_BuildValue("(is)", code, b->describe(code));
  if (args == nullptr) return nullptr;
  PyObject* exc = PyObject_CallObject(g_vmm_error, args);
  Py_DECREF(args);
  if (exc == nullptr) return nullptr;
  PyObject* where = PyUnicode_FromFormat("%s.%s", b->name, op);
  if (where != nullptr) {
    PyObject_SetAttrString(exc, "op", where);
    Py_DECREF(where);
  }
  PyErr_SetObject(g_vmm_error, exc);
  Py_DECREF(exc);
  return nullptr;
}

#define BACKEND_OR_RETURN(name) \
  const VmmBackend* b = find_backend(name); \
  if (b == nullptr) return nullptr

#define CALL(op, expr)                           \
  int err;                                       \
  Py_BEGIN_ALLOW_THREADS err = (expr);           \
  Py_END_ALLOW_THREADS if (err) return fail(b, op, err)

// release, unmap and zero share one shape: (backend, address, size, device=0) -> None.
using RangeOp = int (*VmmBackend::*)(uint64_t, size_t, int);

PyObject* range_op(PyObject* args, const char* op, RangeOp member) {
  const char* name;
  uint64_t addr = 0, size = 0;
  int device = 0;
  if (!PyArg_ParseTuple(args, "sO&O&|i", &name, to_u64, &addr, to_u64, &size, &device))
    return nullptr;
  BACKEND_OR_RETURN(name);
  CALL(op, (b->*member)(addr, size, device));
  Py_RETURN_NONE;
}

PyObject* py_release(PyObject*, PyObject* args) {
  return range_op(args, "release", &VmmBackend::release);
}

PyObject* py_unmap(PyObject*, PyObject* args) {
  return range_op(args, "unmap", &VmmBackend::unmap);
}

PyObject* py_zero(PyObject*, PyObject* args) { return range_op(args, "zero", &VmmBackend::zero); }

PyObject* py_granularity(PyObject*, PyObject* args) {
  const char* name;
  int device = 0;
  if (!PyArg_ParseTuple(args, "s|i", &name, &device)) return nullptr;
  BACKEND_OR_RETURN(name);
  size_t out = 0;
  CALL("granularity", b->granularity(device, &out));
  return PyLong_FromSize_t(out);
}

PyObject* py_reserve(PyObject*, PyObject* args) {
  const char* name;
  uint64_t size = 0, addr = 0;
  int device = 0;
  if (!PyArg_ParseTuple(args, "sO&|i", &name, to_u64, &size, &device)) return nullptr;
  BACKEND_OR_RETURN(name);
  CALL("reserve", b->reserve(size, device, &addr));
  return PyLong_FromUnsignedLongLong(addr);
}

PyObject* py_create(PyObject*, PyObject* args) {
  const char* name;
  uint64_t size = 0, handle = 0;
  int device = 0, populate = 0;
  if (!PyArg_ParseTuple(args, "sO&|ip", &name, to_u64, &size, &device, &populate)) return nullptr;
  BACKEND_OR_RETURN(name);
  CALL("create", b->create(size, device, populate, &handle));
  return PyLong_FromUnsignedLongLong(handle);
}

PyObject* py_free(PyObject*, PyObject* args) {
  const char* name;
  uint64_t handle = 0;
  int device = 0;
  if (!PyArg_ParseTuple(args, "sO&|i", &name, to_u64, &handle, &device)) return nullptr;
  BACKEND_OR_RETURN(name);
  CALL("free", b->free_handle(handle, device));
  Py_RETURN_NONE;
}

PyObject* py_map(PyObject*, PyObject* args) {
  const char* name;
  uint64_t addr = 0, size = 0, handle = 0;
  int populate = 0, device = 0;
  if (!PyArg_ParseTuple(args, "sO&O&O&|pi", &name, to_u64, &addr, to_u64, &size, to_u64,
                        &handle, &populate, &device))
    return nullptr;
  BACKEND_OR_RETURN(name);
  CALL("map", b->map(addr, size, handle, populate, device));
  Py_RETURN_NONE;
}

PyObject* py_synchronize(PyObject*, PyObject* args) {
  const char* name;
  int device = 0;
  if (!PyArg_ParseTuple(args, "s|i", &name, &device)) return nullptr;
  BACKEND_OR_RETURN(name);
  CALL("synchronize", b->synchronize(device));
  Py_RETURN_NONE;
}

PyObject* py_maps_zeroed(PyObject*, PyObject* args) {
  const char* name;
  if (!PyArg_ParseTuple(args, "s", &name)) return nullptr;
  BACKEND_OR_RETURN(name);
  return PyBool_FromLong(b->maps_zeroed);
}

PyObject* py_backends(PyObject*, PyObject*) {
#ifdef VLLM_ASCEND_RL_WITH_ACL
  return Py_BuildValue("(ss)", vmm_host_backend.name, vmm_acl_backend.name);
#else
  return Py_BuildValue("(s)", vmm_host_backend.name);
#endif
}

// The allocation table (vmm_table.h). Every call releases the GIL before it takes the table's
// mutex: a holder of that mutex (an entry point, inside torch_npu's allocator lock) never needs
// the GIL, so waiting here cannot deadlock, and other Python threads run meanwhile.
template <typename F>
bool without_gil(F&& fn) {
  bool oom = false;
  PyThreadState* state = PyEval_SaveThread();
  try {
    fn();
  } catch (const std::bad_alloc&) {
    oom = true;
  }
  PyEval_RestoreThread(state);
  if (oom) PyErr_NoMemory();
  return !oom;
}

// False if the entry is gone, VmmError if a back-end call failed, else True.
PyObject* status_result(const VmmStatus& st) {
  if (!st.found) Py_RETURN_FALSE;
  if (st.err != 0) return fail(st.backend, st.op, st.err);
  Py_RETURN_TRUE;
}

PyObject* py_table_set_tag(PyObject*, PyObject* args) {
  const char* tag;
  if (!PyArg_ParseTuple(args, "s", &tag)) return nullptr;
  std::string previous;
  if (!without_gil([&] { previous = vmm_table_set_tag(tag); })) return nullptr;
  return PyUnicode_FromStringAndSize(previous.data(), static_cast<Py_ssize_t>(previous.size()));
}

// (address, size, device, handle, mapped, tag, id); handle 0 means none.
PyObject* entry_tuple(const VmmEntry& e) {
  return Py_BuildValue("(KKiKNs#K)", static_cast<unsigned long long>(e.addr),
                       static_cast<unsigned long long>(e.size), e.device,
                       static_cast<unsigned long long>(e.handle), PyBool_FromLong(e.mapped),
                       e.tag.data(), static_cast<Py_ssize_t>(e.tag.size()),
                       static_cast<unsigned long long>(e.id));
}

PyObject* py_table_entries(PyObject*, PyObject* args) {
  const char* name;
  if (!PyArg_ParseTuple(args, "s", &name)) return nullptr;
  BACKEND_OR_RETURN(name);
  std::vector<VmmEntry> entries;
  if (!without_gil([&] { entries = vmm_table_entries(b); })) return nullptr;
  PyObject* out = PyList_New(static_cast<Py_ssize_t>(entries.size()));
  for (size_t i = 0; out != nullptr && i < entries.size(); ++i) {
    PyObject* item = entry_tuple(entries[i]);
    if (item == nullptr) Py_CLEAR(out);
    else PyList_SET_ITEM(out, static_cast<Py_ssize_t>(i), item);
  }
  return out;
}

PyObject* py_table_allocate(PyObject*, PyObject* args) {
  const char *name, *tag;
  uint64_t size = 0;
  int device = 0, populate = 1;
  if (!PyArg_ParseTuple(args, "sO&s|ip", &name, to_u64, &size, &tag, &device, &populate))
    return nullptr;
  BACKEND_OR_RETURN(name);
  VmmEntry e{};
  VmmStatus st{};
  if (!without_gil([&] {
        std::string t = tag;
        st = vmm_table_allocate(b, size, device, populate, &t, &e);
      }))
    return nullptr;
  if (st.err != 0) return fail(st.backend, st.op, st.err);
  return entry_tuple(e);
}

PyObject* py_table_sleep(PyObject*, PyObject* args) {
  uint64_t addr = 0, id = 0;
  if (!PyArg_ParseTuple(args, "O&O&", to_u64, &addr, to_u64, &id)) return nullptr;
  VmmStatus st{};
  if (!without_gil([&] { st = vmm_table_sleep(addr, id); })) return nullptr;
  return status_result(st);
}

PyObject* py_table_wake(PyObject*, PyObject* args) {
  uint64_t addr = 0, id = 0;
  int populate = 1;
  if (!PyArg_ParseTuple(args, "O&O&|p", to_u64, &addr, to_u64, &id, &populate)) return nullptr;
  VmmStatus st{};
  if (!without_gil([&] { st = vmm_table_wake(addr, id, populate); })) return nullptr;
  return status_result(st);
}

PyObject* py_table_free(PyObject*, PyObject* args) {
  uint64_t addr = 0, id = 0;
  if (!PyArg_ParseTuple(args, "O&|O&", to_u64, &addr, to_u64, &id)) return nullptr;
  VmmStatus st{};
  if (!without_gil([&] { st = vmm_table_free(addr, id); })) return nullptr;
  return status_result(st);
}

PyObject* py_table_retag(PyObject*, PyObject* args) {
  uint64_t addr = 0, id = 0;
  const char* tag;
  if (!PyArg_ParseTuple(args, "O&O&s", to_u64, &addr, to_u64, &id, &tag)) return nullptr;
  bool found = false;
  if (!without_gil([&] { found = vmm_table_retag(addr, id, tag); })) return nullptr;
  return PyBool_FromLong(found);
}

PyMethodDef kMethods[] = {
    {"host_copy", py_host_copy, METH_VARARGS,
     "host_copy(dst, src, nbytes, threads): memcpy on up to `threads` threads, GIL released"},
    {"backends", py_backends, METH_NOARGS, "Names of the VMM back ends built in."},
    {"maps_zeroed", py_maps_zeroed, METH_VARARGS,
     "maps_zeroed(backend) -> whether fresh physical memory reads as zero"},
    {"granularity", py_granularity, METH_VARARGS, "granularity(backend, device=0) -> bytes"},
    {"reserve", py_reserve, METH_VARARGS, "reserve(backend, size, device=0) -> address"},
    {"release", py_release, METH_VARARGS, "release(backend, address, size, device=0)"},
    {"create", py_create, METH_VARARGS,
     "create(backend, size, device=0, populate=False) -> physical handle"},
    {"free", py_free, METH_VARARGS, "free(backend, handle, device=0)"},
    {"map", py_map, METH_VARARGS,
     "map(backend, address, size, handle, populate=False, device=0)"},
    {"unmap", py_unmap, METH_VARARGS, "unmap(backend, address, size, device=0)"},
    {"zero", py_zero, METH_VARARGS, "zero(backend, address, size, device=0)"},
    {"synchronize", py_synchronize, METH_VARARGS,
     "synchronize(backend, device=0): wait for the device's queued work"},
    {"table_set_tag", py_table_set_tag, METH_VARARGS,
     "table_set_tag(tag) -> previous tag: the tag of allocations the entry points make"},
    {"table_entries", py_table_entries, METH_VARARGS,
     "table_entries(backend) -> [(address, size, device, handle, mapped, tag, id)]"},
    {"table_allocate", py_table_allocate, METH_VARARGS,
     "table_allocate(backend, size, tag, device=0, populate=True) -> entry: reserve, back "
     "and map, recorded in the table"},
    {"table_sleep", py_table_sleep, METH_VARARGS,
     "table_sleep(address, id) -> found: unmap and free the entry's physical memory"},
    {"table_wake", py_table_wake, METH_VARARGS,
     "table_wake(address, id, populate=True) -> found: back and map an unmapped entry"},
    {"table_free", py_table_free, METH_VARARGS,
     "table_free(address, id=0) -> found: release everything, then forget the entry"},
    {"table_retag", py_table_retag, METH_VARARGS,
     "table_retag(address, id, tag) -> found"},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef kModule = {PyModuleDef_HEAD_INIT, "vllm_ascend_rl._C",
                       "Virtual-memory back ends of the sleep allocator.", -1, kMethods,
                       nullptr, nullptr, nullptr, nullptr};

}  // namespace

PyMODINIT_FUNC PyInit__C(void) {
  PyObject* m = PyModule_Create(&kModule);
  if (m == nullptr) return nullptr;
  g_vmm_error = PyErr_NewExceptionWithDoc(
      "vllm_ascend_rl._C.VmmError",
      "A virtual-memory call failed: args are (code, message); .op names the call.",
      PyExc_RuntimeError, nullptr);
  if (g_vmm_error == nullptr || PyModule_AddObject(m, "VmmError", g_vmm_error) < 0) {
    Py_XDECREF(g_vmm_error);
    Py_DECREF(m);
    return nullptr;
  }
  Py_INCREF(g_vmm_error);
  PyModule_AddStringConstant(m, "HOST_MALLOC", "vllm_ascend_rl_host_malloc");
  PyModule_AddStringConstant(m, "HOST_FREE", "vllm_ascend_rl_host_free");
#ifdef VLLM_ASCEND_RL_WITH_ACL
  PyModule_AddStringConstant(m, "NPU_MALLOC", "vllm_ascend_rl_npu_malloc");
  PyModule_AddStringConstant(m, "NPU_FREE", "vllm_ascend_rl_npu_free");
#endif
  return m;
}
