// A host memcpy on a few threads, GIL released, for the staging copies of weight transfers on
// CPU: one thread does not reach memory bandwidth, and torch's copy_ goes through the OpenMP
// pool, whose barrier stalls for milliseconds while a colocated vLLM worker holds the cores.
#include <string.h>

#include <algorithm>
#include <thread>
#include <vector>

#include "py_args.h"

namespace {

constexpr uint64_t kMinPerThread = 4ull << 20;  // below this a thread costs more than it saves
constexpr uint64_t kMaxThreads = 8;

void parallel_copy(unsigned char* dst, const unsigned char* src, uint64_t n, uint64_t threads) {
  threads = std::min({threads, kMaxThreads, std::max<uint64_t>(1, n / kMinPerThread)});
  if (threads <= 1) {
    memcpy(dst, src, n);
    return;
  }
  uint64_t chunk = (n / threads + 63) & ~uint64_t{63};  // cache-line aligned slices
  std::vector<std::thread> pool;
  for (uint64_t off = chunk; off < n; off += chunk) {
    uint64_t len = std::min(chunk, n - off);
    pool.emplace_back([=] { memcpy(dst + off, src + off, len); });
  }
  memcpy(dst, src, std::min(chunk, n));  // the calling thread takes the first slice
  for (auto& t : pool) t.join();
}

}  // namespace

// host_copy(dst, src, nbytes, threads): addresses of host memory that the caller owns and
// checked (contiguous, at least nbytes, not overlapping). In _C's method table (vmm_module.cpp).
PyObject* py_host_copy(PyObject*, PyObject* args) {
  uint64_t dst, src, n, threads;
  if (!PyArg_ParseTuple(args, "O&O&O&O&", to_u64, &dst, to_u64, &src, to_u64, &n, to_u64,
                        &threads)) {
    return nullptr;
  }
  if (n != 0 && (dst == 0 || src == 0)) {
    PyErr_SetString(PyExc_ValueError, "copy: null address");
    return nullptr;
  }
  if (n != 0 && dst < src + n && src < dst + n) {
    PyErr_SetString(PyExc_ValueError, "copy: source and destination overlap");
    return nullptr;
  }
  Py_BEGIN_ALLOW_THREADS
  parallel_copy(reinterpret_cast<unsigned char*>(dst),
                reinterpret_cast<const unsigned char*>(src), n, threads);
  Py_END_ALLOW_THREADS
  Py_RETURN_NONE;
}
