// One-pass host kernels of delta (sparse) weight updates (module vllm_ascend_rl._host).
//
// The torch version of a diff (compare, mask, nonzero, gather, cast) makes five passes over a
// tensor and materializes a mask and int64 indices as large as the tensor; on a 1 GB model it
// cost more than the bytes it saved. Here one pass compares 8 bytes at a time, looks inside a
// word only when it differs, writes indices and values as it goes, and stops as soon as more
// elements differ than a sparse encoding is worth. Memory is raw host addresses (the Python
// side checks every tensor: CPU, contiguous, sizes); the GIL is released while scanning.
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "host_kernels.h"
#include "py_args.h"

namespace {

bool valid_widths(unsigned elem, unsigned index) {
  return (elem == 1 || elem == 2 || elem == 4 || elem == 8) && (index == 4 || index == 8);
}

int64_t read_index(const unsigned char* idx, unsigned width, uint64_t i) {
  if (width == 4) {
    int32_t v;
    memcpy(&v, idx + 4 * i, 4);
    return v;
  }
  int64_t v;
  memcpy(&v, idx + 8 * i, 8);
  return v;
}

// Elements of `a` whose bytes differ from `b`'s, in increasing order: indices to `idx`, `a`'s
// values to `val` (each of them room for `limit + 8` entries). Returns how many, or -1 once
// there would be more than `limit`. `T` is an
// unsigned integer of the element's width, so every comparison is one load, never memcmp.
template <typename T, typename I>
int64_t scan(const unsigned char* a, const unsigned char* b, uint64_t numel, uint64_t limit,
             unsigned char* idx, unsigned char* val) {
  uint64_t count = 0;
  auto differs = [&](uint64_t e, T* out) {
    T x, y;
    memcpy(&x, a + e * sizeof(T), sizeof(T));
    memcpy(&y, b + e * sizeof(T), sizeof(T));
    *out = x;
    return x != y;
  };
  auto emit = [&](uint64_t e, T value) {
    I i = static_cast<I>(e);
    memcpy(idx + count * sizeof(I), &i, sizeof(I));
    memcpy(val + count * sizeof(T), &value, sizeof(T));
    ++count;
  };
  constexpr uint64_t per_word = 8 / sizeof(T);
  const uint64_t words = numel / per_word;
  for (uint64_t w = 0; w < words; ++w) {
    uint64_t x, y;
    memcpy(&x, a + 8 * w, 8);
    memcpy(&y, b + 8 * w, 8);
    if (x == y) continue;
    // Branch-free inside a word: every element is written at `count`, which moves on only
    // past those that differ (the buffers hold `limit + 8` entries for this).
    for (uint64_t e = w * per_word; e < (w + 1) * per_word; ++e) {
      T value;
      bool d = differs(e, &value);
      emit(e, value);
      count -= !d;
    }
    if (count > limit) return -1;
  }
  for (uint64_t e = words * per_word; e < numel; ++e) {
    T value;
    if (!differs(e, &value)) continue;
    if (count == limit) return -1;
    emit(e, value);
  }
  return static_cast<int64_t>(count);
}

template <typename I>
int64_t scan_width(const unsigned char* a, const unsigned char* b, uint64_t numel, unsigned elem,
                   uint64_t limit, unsigned char* idx, unsigned char* val) {
  switch (elem) {
    case 1: return scan<uint8_t, I>(a, b, numel, limit, idx, val);
    case 2: return scan<uint16_t, I>(a, b, numel, limit, idx, val);
    case 4: return scan<uint32_t, I>(a, b, numel, limit, idx, val);
    default: return scan<uint64_t, I>(a, b, numel, limit, idx, val);
  }
}

}  // namespace

namespace host_kernels {

PyObject* py_diff(PyObject*, PyObject* args) {
  uint64_t a, b, numel, limit, idx, val;
  unsigned elem, index_width;
  if (!PyArg_ParseTuple(args, "O&O&O&IO&O&IO&", to_u64, &a, to_u64, &b, to_u64, &numel, &elem,
                        to_u64, &limit, to_u64, &idx, &index_width, to_u64, &val))
    return nullptr;
  if (!valid_widths(elem, index_width)) {
    PyErr_SetString(PyExc_ValueError, "element width must be 1, 2, 4 or 8; index width 4 or 8");
    return nullptr;
  }
  int64_t count;
  Py_BEGIN_ALLOW_THREADS
  auto* pa = reinterpret_cast<const unsigned char*>(a);
  auto* pb = reinterpret_cast<const unsigned char*>(b);
  auto* pi = reinterpret_cast<unsigned char*>(idx);
  auto* pv = reinterpret_cast<unsigned char*>(val);
  count = index_width == 4 ? scan_width<int32_t>(pa, pb, numel, elem, limit, pi, pv)
                           : scan_width<int64_t>(pa, pb, numel, elem, limit, pi, pv);
  Py_END_ALLOW_THREADS
  return PyLong_FromLongLong(count);
}

// Index `i` of a scatter's list that breaks its rule (in 0..numel, strictly increasing), or -1.
int64_t first_bad_index(const unsigned char* idx, unsigned width, uint64_t count, uint64_t numel) {
  int64_t previous = -1;
  for (uint64_t i = 0; i < count; ++i) {
    int64_t v = read_index(idx, width, i);
    if (v <= previous || static_cast<uint64_t>(v) >= numel) return static_cast<int64_t>(i);
    previous = v;
  }
  return -1;
}

PyObject* py_scatter(PyObject*, PyObject* args) {
  uint64_t dst, numel, idx, count, val, old;
  unsigned elem, index_width;
  if (!PyArg_ParseTuple(args, "O&O&IO&IO&O&O&", to_u64, &dst, to_u64, &numel, &elem, to_u64,
                        &idx, &index_width, to_u64, &count, to_u64, &val, to_u64, &old))
    return nullptr;
  if (!valid_widths(elem, index_width)) {
    PyErr_SetString(PyExc_ValueError, "element width must be 1, 2, 4 or 8; index width 4 or 8");
    return nullptr;
  }
  auto* d = reinterpret_cast<unsigned char*>(dst);
  auto* ix = reinterpret_cast<const unsigned char*>(idx);
  auto* v = reinterpret_cast<const unsigned char*>(val);
  auto* o = reinterpret_cast<unsigned char*>(old);
  int64_t bad;
  Py_BEGIN_ALLOW_THREADS
  bad = first_bad_index(ix, index_width, count, numel);
  if (bad < 0) {
    for (uint64_t i = 0; i < count; ++i) {
      uint64_t at = static_cast<uint64_t>(read_index(ix, index_width, i)) * elem;
      if (o != nullptr) memcpy(o + i * elem, d + at, elem);
      memcpy(d + at, v + i * elem, elem);
    }
  }
  Py_END_ALLOW_THREADS
  if (bad >= 0) {
    PyErr_Format(PyExc_ValueError,
                 "sparse index #%lld (%lld) is out of range 0..%llu or not above the one before",
                 static_cast<long long>(bad),
                 static_cast<long long>(read_index(ix, index_width, static_cast<uint64_t>(bad))),
                 static_cast<unsigned long long>(numel) - 1);
    return nullptr;
  }
  Py_RETURN_NONE;
}

}  // namespace host_kernels
