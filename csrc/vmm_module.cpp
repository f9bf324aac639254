// vllm_ascend_rl._C: the vmm.h back ends as Python functions. Addresses and handles are
// Python ints. A failing call raises vllm_ascend_rl._C.VmmError(code, message); no C++
// exception ever crosses into CPython.
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>

#include "py_args.h"

#include "vmm.h"

extern "C" void vmm_set_callbacks(PyObject* on_malloc, PyObject* on_free);

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

PyObject* py_set_callbacks(PyObject*, PyObject* args) {
  PyObject *on_malloc, *on_free;
  if (!PyArg_ParseTuple(args, "OO", &on_malloc, &on_free)) return nullptr;
  vmm_set_callbacks(on_malloc, on_free);
  Py_RETURN_NONE;
}

PyMethodDef kMethods[] = {
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
    {"set_callbacks", py_set_callbacks, METH_VARARGS,
     "set_callbacks(on_malloc, on_free): the allocator hooks of the pluggable entry points"},
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
