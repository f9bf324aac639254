// The functions of vllm_ascend_rl._host (host_module.cpp holds its method table).
#pragma once

#define PY_SSIZE_T_CLEAN
#include <Python.h>

namespace host_kernels {
PyObject* py_diff(PyObject*, PyObject* args);     // delta_scan.cpp
PyObject* py_scatter(PyObject*, PyObject* args);  // delta_scan.cpp
PyObject* py_copy(PyObject*, PyObject* args);     // host_copy.cpp
}  // namespace host_kernels
