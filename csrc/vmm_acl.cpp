// ACL back end of vmm.h (CANN virtual memory). Built only with CANN; CI compiles it against
// tests/support/acl_decls/ (a verbatim subset of CANN 9.1.0's headers). Not yet run on Ascend
// hardware. Every ACL call and argument is recorded, with the header and document it
// was checked against, in docs/ascend-conformance.md. Errors are aclError codes: VmmError in
// vmm.py, a log line in the entry points (vmm_entry.cpp); nothing throws across the C boundary.
#include <acl/acl.h>
#include <stdio.h>

#include "vmm.h"

namespace {

// Make `device` current on this thread (per thread in ACL, aclrtSetDevice.md); this attaches
// the thread to the device's default context, shared by every thread, and creates none.
int ensure_device(int device) {
  int32_t current = -1;
  if (aclrtGetDevice(&current) == ACL_SUCCESS && current == device) return ACL_SUCCESS;
  return aclrtSetDevice(device);
}

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

int acl_reserve(size_t size, int device, uint64_t* addr) {
  int err = ensure_device(device);
  if (err != ACL_SUCCESS) return err;
  void* p = nullptr;
  err = aclrtReserveMemAddress(&p, size, 0, nullptr, 0);
  if (err == ACL_SUCCESS) *addr = reinterpret_cast<uint64_t>(p);
  return err;
}

int acl_release(uint64_t addr, size_t, int device) {
  int err = ensure_device(device);
  return err != ACL_SUCCESS ? err : aclrtReleaseMemAddress(reinterpret_cast<void*>(addr));
}

int acl_create(size_t size, int device, int, uint64_t* handle) {
  int err = ensure_device(device);
  if (err != ACL_SUCCESS) return err;
  aclrtPhysicalMemProp prop = device_prop(device);
  aclrtDrvMemHandle h = nullptr;
  err = aclrtMallocPhysical(&h, size, &prop, 0);
  if (err == ACL_SUCCESS) *handle = reinterpret_cast<uint64_t>(h);
  return err;
}

int acl_free(uint64_t handle, int device) {
  int err = ensure_device(device);
  return err != ACL_SUCCESS ? err
                            : aclrtFreePhysical(reinterpret_cast<aclrtDrvMemHandle>(handle));
}

int acl_map(uint64_t addr, size_t size, uint64_t handle, int, int device) {
  int err = ensure_device(device);
  if (err != ACL_SUCCESS) return err;
  return aclrtMapMem(reinterpret_cast<void*>(addr), size, 0,
                     reinterpret_cast<aclrtDrvMemHandle>(handle), 0);
}

int acl_unmap(uint64_t addr, size_t, int device) {
  int err = ensure_device(device);
  return err != ACL_SUCCESS ? err : aclrtUnmapMem(reinterpret_cast<void*>(addr));
}

// Fresh physical memory holds whatever was there before: zero it where zeros are promised.
// aclrtMemset runs at once, with no implicit device or stream synchronization (aclrtMemset.md).
int acl_zero(uint64_t addr, size_t size, int device) {
  int err = ensure_device(device);
  return err != ACL_SUCCESS ? err : aclrtMemset(reinterpret_cast<void*>(addr), size, 0, size);
}

int acl_synchronize(int device) {
  int err = ensure_device(device);
  return err != ACL_SUCCESS ? err : aclrtSynchronizeDevice();
}

// aclGetRecentErrMsg returns this thread's latest message and clears it
// (aclGetRecentErrMsg.md): read it once, right after the failure, together with the code.
const char* acl_describe(int code) {
  static thread_local char text[512];
  const char* msg = aclGetRecentErrMsg();
  snprintf(text, sizeof text, "aclError %d: %s", code, msg != nullptr ? msg : "(no message)");
  return text;
}

}  // namespace

extern "C" const VmmBackend vmm_acl_backend = {
    "acl",    0,       acl_granularity, acl_reserve, acl_release,     acl_create,
    acl_free, acl_map, acl_unmap,       acl_zero,    acl_synchronize, acl_describe,
};
