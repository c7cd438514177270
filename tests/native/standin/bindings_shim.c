/* standin_cuda.c, its cuGetProcAddress_v2 renamed so that the one below can fall back to the
 * library's own exports (cuda.bindings resolves every driver call through it). */
#define cuGetProcAddress_v2 standin_base_cuGetProcAddress_v2
#include "standin_cuda.c"
#undef cuGetProcAddress_v2

static void* self_handle(void) {
  static void* h;
  if (!h) {
    Dl_info info;
    dladdr((void*)&standin_calls, &info);
    h = dlopen(info.dli_fname, RTLD_LAZY | RTLD_NOLOAD);
  }
  return h;
}
EXPORT CUresult cuGetProcAddress_v2(const char* symbol, void** pfn, int version, cuuint64_t flags,
                                    CUdriverProcAddressQueryResult* status) {
  CUresult rc = standin_base_cuGetProcAddress_v2(symbol, pfn, version, flags, status);
  if (rc != CUDA_ERROR_NOT_FOUND || !symbol) return rc;
  if (!strcmp(symbol, "cuGetProcAddress")) {
    *pfn = (void*)&cuGetProcAddress_v2;
  } else {
    char name[160];
    snprintf(name, sizeof name, "%s_v2", symbol);
    if (!(*pfn = dlsym(self_handle(), name))) *pfn = dlsym(self_handle(), symbol);
    if (!*pfn) return rc;
  }
  if (status) *status = CU_GET_PROC_ADDRESS_SUCCESS;
  return CUDA_SUCCESS;
}

EXPORT CUresult cuDriverGetVersion(int* v) { *v = 13000; return CUDA_SUCCESS; }
EXPORT CUresult cuDeviceGet(CUdevice* d, int ordinal) {
  if (ordinal != 0) return CUDA_ERROR_INVALID_DEVICE;
  *d = 0;
  return CUDA_SUCCESS;
}
EXPORT CUresult cuDeviceGetName(char* name, int len, CUdevice d) {
  snprintf(name, len, "Stand-in GPU");
  return CUDA_SUCCESS;
}
EXPORT CUresult cuDeviceGetAttribute(int* v, CUdevice_attribute a, CUdevice d) {
  *v = a == CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR ? 9 : 0;
  return CUDA_SUCCESS;
}
static int events_alive, graph_launches;
EXPORT CUresult cuEventCreate(CUevent* e, unsigned flags) {
  *e = (CUevent)calloc(1, 16);
  __atomic_add_fetch(&events_alive, 1, __ATOMIC_SEQ_CST);
  return CUDA_SUCCESS;
}
EXPORT CUresult cuEventDestroy_v2(CUevent e) {
  free(e);
  __atomic_sub_fetch(&events_alive, 1, __ATOMIC_SEQ_CST);
  return CUDA_SUCCESS;
}
EXPORT CUresult cuFuncGetAttribute(int* v, CUfunction_attribute a, CUfunction f) {
  if (!valid_fn(f)) return CUDA_ERROR_INVALID_HANDLE;
  *v = ((struct fn*)f)->attr[a & 63];
  return CUDA_SUCCESS;
}
static CUgraphExec last_launched;
EXPORT CUresult cuGraphLaunch(CUgraphExec e, CUstream s) {
  note("cuGraphLaunch");
  if (!e) return CUDA_ERROR_INVALID_VALUE;
  __atomic_add_fetch(&graph_launches, 1, __ATOMIC_SEQ_CST);
  last_launched = e;
  return CUDA_SUCCESS;
}
/* Uploads counted; free memory falls by 1 MiB per exec alive (what LOAD's cap measures). */
static int uploads;
EXPORT CUresult cuGraphUpload(CUgraphExec e, CUstream s) {
  if (!e) return CUDA_ERROR_INVALID_VALUE;
  __atomic_add_fetch(&uploads, 1, __ATOMIC_SEQ_CST);
  return CUDA_SUCCESS;
}
EXPORT CUresult cuMemGetInfo_v2(size_t* free_bytes, size_t* total) {
  *total = (size_t)80 << 30;
  *free_bytes = *total - ((size_t)standin_execs_alive() << 20);
  return CUDA_SUCCESS;
}
EXPORT int standin_uploads(void) { return uploads; }
EXPORT uint64_t standin_last_launched(void) { return (uint64_t)last_launched; }
EXPORT int standin_graph_launches(void) { return graph_launches; }
EXPORT int standin_events_alive(void) { return events_alive; }
