/* A stand-in libcuda.so.1 for tests/test_ext_cuda.py: the driver entry points the native
 * GPU launcher (mx_roi/ext/ext_cuda.h) may call, and the ones it must not call in a valid
 * call (the synchronising ones), each recording one line in a log.  "Device memory" is host
 * memory, handed out filled with garbage (0xAB) as real device memory is uninitialised;
 * copies and memsets act at once; nothing runs a kernel.  cuEventQuery answers what
 * fake_set_ready() last set (CUDA_SUCCESS or CUDA_ERROR_NOT_READY); fake_image() returns
 * every image loaded so far, concatenated.
 *
 * Log lines (one per call, fields space-separated; pointers and handles in hex):
 *   cuLaunchKernel <function name> grid X Y Z block X Y Z shared S stream H args A0 A1 ...
 *     (each argument: the first 8 bytes at the pointer the launcher passed, in hex; the
 *      list ends at the launcher's null entry)
 *   <function> <its arguments>  (the others) */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef int CUresult;
typedef unsigned long long CUdeviceptr;
#define NOT_READY 600

static char g_log[1 << 20];
static size_t g_len = 0;
static int g_ready = 1;
static int g_has_context = 1;
static const char* g_image = NULL;
static char g_names[1024][512];
static int g_nnames = 0;

static void logf_(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
#include <stdarg.h>
static void logf_(const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  int n = vsnprintf(g_log + g_len, sizeof g_log - g_len, fmt, ap);
  va_end(ap);
  if (n > 0 && g_len + (size_t)n + 1 < sizeof g_log) {
    g_len += (size_t)n;
    g_log[g_len++] = '\n';
    g_log[g_len] = 0;
  }
}

/* ---- the test's controls ---- */
const char* fake_log(void) { return g_log; }
void fake_clear(void) { g_len = 0; g_log[0] = 0; }
void fake_set_ready(int ready) { g_ready = ready; }
void fake_set_context(int has) { g_has_context = has; }
const char* fake_image(void) { return g_image; }

/* ---- what the launcher resolves ---- */
CUresult cuInit(unsigned flags) { logf_("cuInit %u", flags); return 0; }
CUresult cuGetErrorString(CUresult rc, const char** s) {
  *s = rc == NOT_READY ? "CUDA_ERROR_NOT_READY" : "CUDA_ERROR_FAKE";
  return 0;
}
CUresult cuCtxGetCurrent(void** ctx) {
  *ctx = g_has_context ? (void*)0xC7000 : NULL;
  logf_("cuCtxGetCurrent");
  return 0;
}
CUresult cuModuleLoadData(void** mod, const void* image) {
  /* every image loaded, one after the other (fake_image: their concatenation) */
  size_t old = g_image ? strlen(g_image) : 0, add = strlen((const char*)image);
  char* all = (char*)realloc((void*)g_image, old + add + 2);
  if (!all) return 2;
  if (!old) all[0] = 0;
  strcat(all, (const char*)image);
  strcat(all, "\n");
  g_image = all;
  static int loaded = 0;
  *mod = (void*)(intptr_t)(0x30D00 + ++loaded);
  logf_("cuModuleLoadData %zu module %llx", strlen((const char*)image),
        (unsigned long long)(uintptr_t)*mod);
  return 0;
}
CUresult cuModuleGetFunction(void** fn, void* mod, const char* name) {
  if (g_nnames == 1024) return 1;
  snprintf(g_names[g_nnames], sizeof g_names[0], "%s", name);
  *fn = (void*)(intptr_t)(++g_nnames);
  logf_("cuModuleGetFunction %s module %llx", name, (unsigned long long)(uintptr_t)mod);
  return 0;
}
CUresult cuLaunchKernel(void* fn, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                        unsigned by, unsigned bz, unsigned shared, void* stream, void** params,
                        void** extra) {
  char args[4096] = "";
  size_t len = 0;
  for (int i = 0; params && params[i] && i < 64; ++i) {
    uint64_t v;
    memcpy(&v, params[i], 8);
    len += (size_t)snprintf(args + len, sizeof args - len, " %llx", (unsigned long long)v);
  }
  logf_("cuLaunchKernel %s grid %u %u %u block %u %u %u shared %u stream %llx extra %d args%s",
        g_names[(intptr_t)fn - 1], gx, gy, gz, bx, by, bz, shared,
        (unsigned long long)(uintptr_t)stream, extra != NULL, args);
  return 0;
}
CUresult cuMemAlloc_v2(CUdeviceptr* p, size_t n) {
  void* m = malloc(n);
  memset(m, 0xAB, n);
  *p = (CUdeviceptr)(uintptr_t)m;
  logf_("cuMemAlloc_v2 %zu %llx", n, *p);
  return 0;
}
CUresult cuMemHostAlloc(void** p, size_t n, unsigned flags) {
  *p = malloc(n);
  memset(*p, 0xAB, n);
  logf_("cuMemHostAlloc %zu %u %llx", n, flags, (unsigned long long)(uintptr_t)*p);
  return 0;
}
CUresult cuMemsetD8Async(CUdeviceptr p, unsigned char v, size_t n, void* stream) {
  memset((void*)(uintptr_t)p, v, n);
  logf_("cuMemsetD8Async %llx %u %zu stream %llx", p, v, n,
        (unsigned long long)(uintptr_t)stream);
  return 0;
}
CUresult cuMemcpyDtoHAsync_v2(void* dst, CUdeviceptr src, size_t n, void* stream) {
  memcpy(dst, (void*)(uintptr_t)src, n);
  logf_("cuMemcpyDtoHAsync_v2 %llx %llx %zu stream %llx", (unsigned long long)(uintptr_t)dst,
        src, n, (unsigned long long)(uintptr_t)stream);
  return 0;
}
CUresult cuEventCreate(void** ev, unsigned flags) {
  *ev = (void*)0xE7;
  logf_("cuEventCreate %u", flags);
  return 0;
}
CUresult cuEventRecord(void* ev, void* stream) {
  logf_("cuEventRecord %llx stream %llx", (unsigned long long)(uintptr_t)ev,
        (unsigned long long)(uintptr_t)stream);
  return 0;
}
CUresult cuEventQuery(void* ev) {
  logf_("cuEventQuery %llx %s", (unsigned long long)(uintptr_t)ev, g_ready ? "ready" : "busy");
  return g_ready ? 0 : NOT_READY;
}
CUresult cuEventSynchronize(void* ev) {
  logf_("cuEventSynchronize %llx", (unsigned long long)(uintptr_t)ev);
  return 0;
}

/* ---- what a valid call must never call (host synchronisation, sync copies, frees) ---- */
#define NEVER(name)                        \
  CUresult name(void* a, void* b, void* c) { \
    (void)a; (void)b; (void)c;             \
    logf_(#name);                          \
    return 0;                              \
  }
NEVER(cuCtxSynchronize)
NEVER(cuStreamSynchronize)
NEVER(cuStreamQuery)
NEVER(cuMemcpyDtoH_v2)
NEVER(cuMemcpy)
NEVER(cuMemcpyAsync)
NEVER(cuMemFree_v2)
NEVER(cuMemAllocHost_v2)
NEVER(cuDeviceSynchronize)
