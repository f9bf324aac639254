// vllm_ascend_rl._host: plain C++ host kernels, built on every install (no accelerator SDK).
#include "host_kernels.h"

namespace {

PyMethodDef kMethods[] = {
    {"diff", host_kernels::py_diff, METH_VARARGS,
     "diff(new, base, numel, elem_size, limit, idx_out, idx_width, val_out) -> count, or -1 "
     "once more than limit elements differ; the outputs hold limit + 8 entries"},
    {"scatter", host_kernels::py_scatter, METH_VARARGS,
     "scatter(dst, numel, elem_size, idx, idx_width, count, values, old_out or 0): write "
     "values at strictly increasing indices (all checked before any write), saving the old"},
    {"copy", host_kernels::py_copy, METH_VARARGS,
     "copy(dst, src, nbytes, threads): memcpy on up to `threads` threads, GIL released"},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef kModule = {PyModuleDef_HEAD_INIT, "vllm_ascend_rl._host",
                       "Host kernels: delta diff and scatter, the multi-threaded copy.", -1,
                       kMethods, nullptr, nullptr, nullptr, nullptr};

}  // namespace

PyMODINIT_FUNC PyInit__host(void) { return PyModule_Create(&kModule); }
