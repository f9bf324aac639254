// Argument converters shared by the extension's modules (vmm_module.cpp, host_copy.cpp).
#pragma once

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

// "O&" converter for addresses, sizes and handles: a non-negative int below 2**64 (PyArg's "K"
// silently wraps -1 to 2**64-1).
static inline int to_u64(PyObject* obj, void* out) {
  if (!PyLong_Check(obj) || PyBool_Check(obj)) {
    PyErr_Format(PyExc_TypeError, "expected an int, got %s", Py_TYPE(obj)->tp_name);
    return 0;
  }
  unsigned long long v = PyLong_AsUnsignedLongLong(obj);
  if (v == static_cast<unsigned long long>(-1) && PyErr_Occurred()) {
    PyErr_Clear();
    PyErr_SetString(PyExc_ValueError, "expected a non-negative int below 2**64");
    return 0;
  }
  *static_cast<uint64_t*>(out) = static_cast<uint64_t>(v);
  return 1;
}
