// vllm_ascend_rl._C: the vmm.h back ends as Python functions. Addresses and handles are
// Python ints. A failing call raises vllm_ascend_rl._C.VmmError(code, message); no C++
// exception ever crosses into CPython.
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>

#include "vmm.h"

#ifdef VLLM_ASCEND_RL_WITH_ACL
extern "C" void vmm_acl_set_callbacks(PyObject* on_malloc, PyObject* on_free);
#endif

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

PyObject* py_granularity(PyObject*, PyObject* args) {
  const char* name;
  int device = 0;
  if (!PyArg_ParseTuple(args, "s|i", &name, &device)) return nullptr;
  BACKEND_OR_RETURN(name);
  size_t out = 0;
  int err = b->granularity(device, &out);
  return err ? fail(b, "granularity", err) : PyLong_FromSize_t(out);
}

PyObject* py_reserve(PyObject*, PyObject* args) {
  const char* name;
  unsigned long long size;
  if (!PyArg_ParseTuple(args, "sK", &name, &size)) return nullptr;
  BACKEND_OR_RETURN(name);
  uint64_t addr = 0;
  int err;
  Py_BEGIN_ALLOW_THREADS err = b->reserve(size, &addr);
  Py_END_ALLOW_THREADS
  return err ? fail(b, "reserve", err) : PyLong_FromUnsignedLongLong(addr);
}

PyObject* py_release(PyObject*, PyObject* args) {
  const char* name;
  unsigned long long addr, size;
  if (!PyArg_ParseTuple(args, "sKK", &name, &addr, &size)) return nullptr;
  BACKEND_OR_RETURN(name);
  int err;
  Py_BEGIN_ALLOW_THREADS err = b->release(addr, size);
  Py_END_ALLOW_THREADS
  if (err) return fail(b, "release", err);
  Py_RETURN_NONE;
}

PyObject* py_create(PyObject*, PyObject* args) {
  const char* name;
  unsigned long long size;
  int device = 0, populate = 0;
  if (!PyArg_ParseTuple(args, "sK|ip", &name, &size, &device, &populate)) return nullptr;
  BACKEND_OR_RETURN(name);
  uint64_t handle = 0;
  int err;
  Py_BEGIN_ALLOW_THREADS err = b->create(size, device, populate, &handle);
  Py_END_ALLOW_THREADS
  return err ? fail(b, "create", err) : PyLong_FromUnsignedLongLong(handle);
}

PyObject* py_free(PyObject*, PyObject* args) {
  const char* name;
  unsigned long long handle;
  if (!PyArg_ParseTuple(args, "sK", &name, &handle)) return nullptr;
  BACKEND_OR_RETURN(name);
  int err;
  Py_BEGIN_ALLOW_THREADS err = b->free_handle(handle);
  Py_END_ALLOW_THREADS
  if (err) return fail(b, "free", err);
  Py_RETURN_NONE;
}

PyObject* py_map(PyObject*, PyObject* args) {
  const char* name;
  unsigned long long addr, size, handle;
  int populate = 0;
  if (!PyArg_ParseTuple(args, "sKKK|p", &name, &addr, &size, &handle, &populate)) return nullptr;
  BACKEND_OR_RETURN(name);
  int err;
  Py_BEGIN_ALLOW_THREADS err = b->map(addr, size, handle, populate);
  Py_END_ALLOW_THREADS
  if (err) return fail(b, "map", err);
  Py_RETURN_NONE;
}

PyObject* py_unmap(PyObject*, PyObject* args) {
  const char* name;
  unsigned long long addr, size;
  if (!PyArg_ParseTuple(args, "sKK", &name, &addr, &size)) return nullptr;
  BACKEND_OR_RETURN(name);
  int err;
  Py_BEGIN_ALLOW_THREADS err = b->unmap(addr, size);
  Py_END_ALLOW_THREADS
  if (err) return fail(b, "unmap", err);
  Py_RETURN_NONE;
}

PyObject* py_backends(PyObject*, PyObject*) {
#ifdef VLLM_ASCEND_RL_WITH_ACL
  return Py_BuildValue("(ss)", vmm_host_backend.name, vmm_acl_backend.name);
#else
  return Py_BuildValue("(s)", vmm_host_backend.name);
#endif
}

PyObject* py_acl_set_callbacks(PyObject*, PyObject* args) {
  PyObject *on_malloc, *on_free;
  if (!PyArg_ParseTuple(args, "OO", &on_malloc, &on_free)) return nullptr;
#ifdef VLLM_ASCEND_RL_WITH_ACL
  vmm_acl_set_callbacks(on_malloc, on_free);
  Py_RETURN_NONE;
#else
  PyErr_SetString(PyExc_RuntimeError,
                  "this build of vllm_ascend_rl._C has no ACL back end (CANN was not found "
                  "when it was built)");
  return nullptr;
#endif
}

PyMethodDef kMethods[] = {
    {"backends", py_backends, METH_NOARGS, "Names of the VMM back ends built in."},
    {"granularity", py_granularity, METH_VARARGS, "granularity(backend, device=0) -> bytes"},
    {"reserve", py_reserve, METH_VARARGS, "reserve(backend, size) -> address"},
    {"release", py_release, METH_VARARGS, "release(backend, address, size)"},
    {"create", py_create, METH_VARARGS,
     "create(backend, size, device=0, populate=False) -> physical handle"},
    {"free", py_free, METH_VARARGS, "free(backend, handle)"},
    {"map", py_map, METH_VARARGS, "map(backend, address, size, handle, populate=False)"},
    {"unmap", py_unmap, METH_VARARGS, "unmap(backend, address, size)"},
    {"acl_set_callbacks", py_acl_set_callbacks, METH_VARARGS,
     "acl_set_callbacks(on_malloc, on_free): the allocator hooks of the NPU entry points"},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef kModule = {PyModuleDef_HEAD_INIT, "vllm_ascend_rl._C",
                       "Virtual-memory back ends of the sleep allocator.", -1, kMethods};

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
#ifdef VLLM_ASCEND_RL_WITH_ACL
  PyModule_AddStringConstant(m, "NPU_MALLOC", "vllm_ascend_rl_npu_malloc");
  PyModule_AddStringConstant(m, "NPU_FREE", "vllm_ascend_rl_npu_free");
#endif
  return m;
}
