// Declarations-only stand-in for CANN's <acl/acl.h>: just the runtime API that vmm_acl.cpp
// uses, so CI can compile it with -fsyntax-only on machines without CANN and it cannot rot
// unseen. Never linked; enum values here are placeholders, real builds use CANN's header.
#pragma once
#include <stddef.h>
#include <stdint.h>

typedef int aclError;
typedef void* aclrtStream;
typedef void* aclrtDrvMemHandle;
#define ACL_SUCCESS 0

typedef enum aclrtMemHandleType { ACL_MEM_HANDLE_TYPE_NONE = 0 } aclrtMemHandleType;
typedef enum aclrtMemAllocationType { ACL_MEM_ALLOCATION_TYPE_PINNED = 0 } aclrtMemAllocationType;
typedef enum aclrtMemAttr { ACL_HBM_MEM_HUGE = 0 } aclrtMemAttr;
typedef enum aclrtMemLocationType {
  ACL_MEM_LOCATION_TYPE_HOST = 0,
  ACL_MEM_LOCATION_TYPE_DEVICE = 1
} aclrtMemLocationType;
typedef enum aclrtMemGranularityOptions {
  ACL_RT_MEM_ALLOC_GRANULARITY_MINIMUM = 0
} aclrtMemGranularityOptions;

typedef struct aclrtMemLocation {
  uint32_t id;
  aclrtMemLocationType type;
} aclrtMemLocation;

typedef struct aclrtPhysicalMemProp {
  aclrtMemHandleType handleType;
  aclrtMemAllocationType allocationType;
  aclrtMemAttr memAttr;
  aclrtMemLocation location;
  uint64_t reserve;
} aclrtPhysicalMemProp;

#ifdef __cplusplus
extern "C" {
#endif
aclError aclrtMemGetAllocationGranularity(aclrtPhysicalMemProp* prop,
                                          aclrtMemGranularityOptions option,
                                          size_t* granularity);
aclError aclrtReserveMemAddress(void** virPtr, size_t size, size_t alignment, void* expectPtr,
                                uint64_t flags);
aclError aclrtReleaseMemAddress(void* virPtr);
aclError aclrtMallocPhysical(aclrtDrvMemHandle* handle, size_t size,
                             const aclrtPhysicalMemProp* prop, uint64_t flags);
aclError aclrtFreePhysical(aclrtDrvMemHandle handle);
aclError aclrtMapMem(void* virPtr, size_t size, size_t offset, aclrtDrvMemHandle handle,
                     uint64_t flags);
aclError aclrtUnmapMem(void* virPtr);
const char* aclGetRecentErrMsg(void);
#ifdef __cplusplus
}
#endif
