// The native GPU path's launcher: the NVRTC-compiled kernels launched through the CUDA
// driver API, loaded at run time (dlopen "libcuda.so.1"; no nvcc, no CUDA runtime, no CuPy),
// on the caller's stream (MXNet's OpResource::get_cuda_stream(), or a CuPy stream's handle),
// with no host synchronisation in a call whose rois are valid.  docs/gpu.md, "The native
// GPU path", documents it; tests/test_ext_cuda.py proves it against a stand-in libcuda.
//
// The PTX comes from NVRTC when the library is built (mx_roi.ext.cuda: the op's .cu text,
// the RawModule's options, for the lowest architecture that NVRTC supports); the driver
// compiles it for the device at the first call in a context (cuModuleLoadData).
//
// The status-word rule (a bad roi on the GPU):
//   * each channel -- (CUDA context, stream, op) -- owns a status in device memory
//     (roi_common.cuh's roi_status: word 0 the first bad roi, word 1 a box needing more
//     sample points than the device tables hold; words 2..4 DeformablePSROIPooling's first
//     bad offset, STATUS_WORDS), a pinned host copy and an event;
//   * a call queues the geometry kernel, which marks a bad roi's row as padding (the op
//     kernels read no data for it: its output is zeros) and records it in the word with
//     atomicMax, so the word stays set until it is reported ("sticky": a later call that
//     starts before the report cannot erase it); then the op kernels; then an asynchronous
//     copy of the word into the pinned copy and an event record -- all on the stream;
//   * a call first asks the event of the channel's previous call (cuEventQuery, no wait).
//     Finished: the pinned copy is the word as of that call; if it is set, this call
//     launches nothing, queues the word's reset and raises the bad roi's error.  Not yet
//     finished: no check now (the word is sticky: the next call checks again);
//   * so the error of a bad call is raised by the first call on the same op and stream
//     that starts after the bad call's work has finished on the GPU -- deterministically by
//     the next call after anything that waited for the stream (asnumpy, wait_to_read,
//     waitall, stream.synchronize()) -- or by check(wait=true), which waits for the
//     channel's last call (cuEventSynchronize: the only wait there is) and reports.
#pragma once

#include <dlfcn.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "py_repr.h"

namespace mx_roi_cuda {

// ---- the driver API, as cuda.h declares it (only what the launcher calls) --------------
typedef int CUresult;
typedef struct CUctx_st* CUcontext;
typedef struct CUmod_st* CUmodule;
typedef struct CUfunc_st* CUfunction;
typedef struct CUstream_st* CUstream;
typedef struct CUevent_st* CUevent;
typedef unsigned long long CUdeviceptr;  // CUdeviceptr_v2
const CUresult CUDA_SUCCESS = 0;
const CUresult CUDA_ERROR_NOT_READY = 600;
const unsigned CU_EVENT_DISABLE_TIMING = 0x2;

// loader.BLOCK, loader.MAX_GRID (loader.launch_config)
const unsigned BLOCK = 256;
const long long MAX_GRID = 65535;

// roi_common.cuh STATUS_BATCH_KEY
const unsigned long long STATUS_BATCH_KEY = 1ULL << 62;
// The status words of a channel: 0 and 1 the rois' (roi_common.cuh roi_status), 2..4 the
// first bad offset of DeformablePSROIPooling (deformable_trans_status: roi + 1, channel << 32
// | u << 16 | v, the value's double)
const int STATUS_WORDS = 5;
const size_t STATUS_BYTES = STATUS_WORDS * sizeof(unsigned long long);

// A launcher error: the message names the op and the problem (first line).
struct Error : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// The driver entry points, resolved once from libcuda.so.1 (the versioned names cuda.h
// maps the plain ones to where it does: _v2).
struct Driver {
  CUresult (*cuInit)(unsigned) = nullptr;
  CUresult (*cuGetErrorString)(CUresult, const char**) = nullptr;
  CUresult (*cuCtxGetCurrent)(CUcontext*) = nullptr;
  CUresult (*cuModuleLoadData)(CUmodule*, const void*) = nullptr;
  CUresult (*cuModuleGetFunction)(CUfunction*, CUmodule, const char*) = nullptr;
  CUresult (*cuLaunchKernel)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned,
                             unsigned, unsigned, CUstream, void**, void**) = nullptr;
  CUresult (*cuMemAlloc)(CUdeviceptr*, size_t) = nullptr;
  CUresult (*cuMemHostAlloc)(void**, size_t, unsigned) = nullptr;
  CUresult (*cuMemsetD8Async)(CUdeviceptr, unsigned char, size_t, CUstream) = nullptr;
  CUresult (*cuMemcpyDtoHAsync)(void*, CUdeviceptr, size_t, CUstream) = nullptr;
  CUresult (*cuEventCreate)(CUevent*, unsigned) = nullptr;
  CUresult (*cuEventRecord)(CUevent, CUstream) = nullptr;
  CUresult (*cuEventQuery)(CUevent) = nullptr;
  CUresult (*cuEventSynchronize)(CUevent) = nullptr;
  std::string missing;  // why the driver cannot be used ('' when it can)

  // "<what> failed: <driver's name of rc> (CUresult rc)"
  std::string describe(CUresult rc) const {
    const char* s = nullptr;
    if (cuGetErrorString) cuGetErrorString(rc, &s);
    return std::string(s ? s : "unknown error") + " (CUresult " + std::to_string(rc) + ")";
  }
};

template <typename F>
void resolve(void* lib, const char* name, F& fn, std::string& missing) {
  fn = reinterpret_cast<F>(dlsym(lib, name));
  if (!fn && missing.empty()) missing = std::string("libcuda.so.1 has no ") + name;
}

// The process's driver (loaded at the first GPU call; never unloaded).
inline const Driver& driver() {
  static const Driver d = [] {
    Driver x;
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
      const char* e = dlerror();
      x.missing = std::string("no NVIDIA driver: libcuda.so.1 not loadable (") +
                  (e ? e : "?") + ")";
      return x;
    }
    resolve(lib, "cuInit", x.cuInit, x.missing);
    resolve(lib, "cuGetErrorString", x.cuGetErrorString, x.missing);
    resolve(lib, "cuCtxGetCurrent", x.cuCtxGetCurrent, x.missing);
    resolve(lib, "cuModuleLoadData", x.cuModuleLoadData, x.missing);
    resolve(lib, "cuModuleGetFunction", x.cuModuleGetFunction, x.missing);
    resolve(lib, "cuLaunchKernel", x.cuLaunchKernel, x.missing);
    resolve(lib, "cuMemAlloc_v2", x.cuMemAlloc, x.missing);
    resolve(lib, "cuMemHostAlloc", x.cuMemHostAlloc, x.missing);
    resolve(lib, "cuMemsetD8Async", x.cuMemsetD8Async, x.missing);
    resolve(lib, "cuMemcpyDtoHAsync_v2", x.cuMemcpyDtoHAsync, x.missing);
    resolve(lib, "cuEventCreate", x.cuEventCreate, x.missing);
    resolve(lib, "cuEventRecord", x.cuEventRecord, x.missing);
    resolve(lib, "cuEventQuery", x.cuEventQuery, x.missing);
    resolve(lib, "cuEventSynchronize", x.cuEventSynchronize, x.missing);
    if (x.missing.empty()) {
      const CUresult rc = x.cuInit(0);
      if (rc != CUDA_SUCCESS) x.missing = "cuInit failed: " + x.describe(rc);
    }
    return x;
  }();
  return d;
}

// Throws Error "<op>: <what> failed: ..." unless rc is CUDA_SUCCESS.
inline void check(const std::string& op, CUresult rc, const char* what) {
  if (rc != CUDA_SUCCESS)
    throw Error(op + ": " + what + " failed: " + driver().describe(rc));
}

// The driver and the current context of this thread (MXNet's worker and CuPy both make
// the device's primary context current before a call).
inline CUcontext current_context(const std::string& op) {
  const Driver& d = driver();
  if (!d.missing.empty()) throw Error(op + ": the native GPU path cannot run: " + d.missing);
  CUcontext ctx = nullptr;
  check(op, d.cuCtxGetCurrent(&ctx), "cuCtxGetCurrent");
  if (!ctx) throw Error(op + ": the native GPU path needs a current CUDA context on this thread");
  return ctx;
}

// ---- modules: one PTX image per op source, loaded once per context ----------------------
// ``names``: {name expression, lowered (mangled) name} pairs, ended by {nullptr, nullptr}.
struct KernelName {
  const char* expression;
  const char* lowered;
};

struct Image {
  const char* source;  // the op's .cu file, for messages
  const char* ptx;
  const KernelName* names;
};

// kernel ``expression`` (e.g. "roi_grid_geometry<float, float>") of ``image`` in ``ctx``
inline CUfunction function(const std::string& op, CUcontext ctx, const Image& image,
                           const std::string& expression) {
  static std::mutex lock;
  static std::map<std::pair<CUcontext, const char*>, CUmodule> modules;
  static std::map<std::tuple<CUcontext, const char*, std::string>, CUfunction> functions;
  std::lock_guard<std::mutex> guard(lock);
  const auto fkey = std::make_tuple(ctx, image.ptx, expression);
  const auto hit = functions.find(fkey);
  if (hit != functions.end()) return hit->second;
  const char* lowered = nullptr;
  for (const KernelName* k = image.names; k->expression; ++k)
    if (expression == k->expression) lowered = k->lowered;
  if (!lowered)
    throw Error(op + ": the native GPU library has no kernel " + expression + " of " +
                image.source);
  CUmodule& mod = modules[std::make_pair(ctx, image.ptx)];
  if (!mod) check(op, driver().cuModuleLoadData(&mod, image.ptx), "cuModuleLoadData");
  CUfunction fn = nullptr;
  check(op, driver().cuModuleGetFunction(&fn, mod, lowered), "cuModuleGetFunction");
  functions[fkey] = fn;
  return fn;
}

// ---- kernel arguments and the launch -------------------------------------------------------
// Each argument in an 8-byte slot of its own (the driver copies the parameter's size from
// the slot's start); the pointer list ends with a null entry beyond the kernel's count
// (ignored by the driver; read by the stand-in libcuda of the tests).
class Args {
 public:
  template <typename X>
  Args& operator()(X value) {
    static_assert(sizeof(X) <= 8, "a kernel argument of at most 8 bytes");
    std::uint64_t slot = 0;
    std::memcpy(&slot, &value, sizeof(X));
    slots_.push_back(slot);
    return *this;
  }
  void** pointers() {
    ptrs_.clear();
    for (auto& s : slots_) ptrs_.push_back(&s);
    ptrs_.push_back(nullptr);
    return ptrs_.data();
  }

 private:
  std::vector<std::uint64_t> slots_;
  std::vector<void*> ptrs_;
};

// ``fn`` over ``n`` work items on ``stream`` (loader.launch_config: 256 threads a block,
// at most 65535 blocks; the kernels' grid-stride loops take the rest); nothing for n = 0.
inline void launch(const std::string& op, CUfunction fn, long long n, CUstream stream,
                   Args& args) {
  if (n <= 0) return;
  long long grid = (n + BLOCK - 1) / BLOCK;
  if (grid > MAX_GRID) grid = MAX_GRID;
  check(op, driver().cuLaunchKernel(fn, (unsigned)grid, 1, 1, BLOCK, 1, 1, 0, stream,
                                    args.pointers(), nullptr),
        "cuLaunchKernel");
}

// ---- the status word of a channel (see the top of this file) ------------------------------
struct Channel {
  CUdeviceptr status = 0;                 // STATUS_WORDS x uint64 in device memory
  unsigned long long* pinned = nullptr;   // its pinned host copy
  CUevent done = nullptr;                 // recorded after the copy of the latest call
  bool recorded = false;
  std::mutex lock;                        // one call of a channel at a time
};

// The channel of (context, stream, op); created (zeroed on the stream) at its first call.
inline Channel& channel(const std::string& op, CUcontext ctx, CUstream stream) {
  static std::mutex lock;
  static std::map<std::tuple<CUcontext, CUstream, std::string>, std::unique_ptr<Channel>> all;
  std::lock_guard<std::mutex> guard(lock);
  std::unique_ptr<Channel>& ch = all[std::make_tuple(ctx, stream, op)];
  if (!ch) {
    std::unique_ptr<Channel> c(new Channel());
    const Driver& d = driver();
    check(op, d.cuMemAlloc(&c->status, STATUS_BYTES), "cuMemAlloc");
    check(op, d.cuMemHostAlloc((void**)&c->pinned, STATUS_BYTES, 0), "cuMemHostAlloc");
    std::memset(c->pinned, 0, STATUS_BYTES);
    check(op, d.cuEventCreate(&c->done, CU_EVENT_DISABLE_TIMING), "cuEventCreate");
    check(op, d.cuMemsetD8Async(c->status, 0, STATUS_BYTES, stream), "cuMemsetD8Async");
    ch = std::move(c);
  }
  return *ch;
}

// The message of a reported status ``w`` (word 0: the first bad roi by check_rois' rule;
// word 1: 1 a box the device tables could not hold, 2 (3) a box over the adaptive grid's
// samples-per-bin bound -- RROIAlign's sampling_ratio (ROIAlign's and PSROIAlign's
// sample_ratio); words 2..4: a bad offset, reported after the rois as the Custom door
// checks them).
inline std::string status_error(const std::string& op, const unsigned long long* w) {
  const std::string found =
      " (found on the GPU by the device check of an earlier call of this op on this stream, ";
  const std::string when = " at the next call after that call has finished)";
  const std::string where = found + "which treated the roi as padding: its output rows are "
                            "zeros; the native GPU path reports a bad roi" + when;
  if (w[0]) {
    const unsigned long long key = ~w[0];
    if (key >= STATUS_BATCH_KEY)
      return op + ": rois[" + std::to_string(key - STATUS_BATCH_KEY) +
             "] has a batch index beyond the images of data (valid: 0..N-1; a negative "
             "index marks a padding roi)" + where;
    return op + ": rois[" + std::to_string(key) +
           "] has a NaN or infinite value; coordinates must be finite" + where;
  }
  if (w[1] == 2 || w[1] == 3) {
    const std::string ratio = w[1] == 2 ? "sampling_ratio" : "sample_ratio";
    return op + ": rois: a box needs more than 1048576 samples per bin with " + ratio +
           " <= 0; check the box size and spatial_scale, or set " + ratio + where;
  }
  if (w[1])
    return op + ": rois: a box needs more sample points per bin side than the device tables "
                "hold (a box far larger than the feature map); check the coordinates and "
                "spatial_scale, or run such boxes through the Custom door" + where;
  double value;
  std::memcpy(&value, &w[4], sizeof value);
  return op + ": trans[" + std::to_string(w[2] - 1) + ", " + std::to_string(w[3] >> 32) + ", " +
         std::to_string(w[3] >> 16 & 0xffff) + ", " + std::to_string(w[3] & 0xffff) + "] is " +
         ::mx_roi_repr::py_float_repr(value) + "; offsets must be finite" + found +
         "which ran with the offsets as given: a bin whose offset is not finite pools no "
         "sample (0); the native GPU path reports a bad offset" + when;
}

// The report of the channel's previous calls: throws the status error if the latest
// call has finished with the word set (and queues the word's reset on ``stream``);
// ``wait``: first wait for that call (cuEventSynchronize), else only ask (cuEventQuery).
inline void report(const std::string& op, Channel& ch, CUstream stream, bool wait) {
  if (!ch.recorded) return;
  const Driver& d = driver();
  CUresult rc;
  if (wait) {
    rc = d.cuEventSynchronize(ch.done);
    check(op, rc, "cuEventSynchronize");
  } else {
    rc = d.cuEventQuery(ch.done);
    if (rc == CUDA_ERROR_NOT_READY) return;  // not finished: checked by a later call
    check(op, rc, "cuEventQuery");
  }
  unsigned long long w[STATUS_WORDS];
  std::memcpy(w, ch.pinned, STATUS_BYTES);
  if (!w[0] && !w[1] && !w[2]) return;
  std::memset(ch.pinned, 0, STATUS_BYTES);
  ch.recorded = false;
  check(op, d.cuMemsetD8Async(ch.status, 0, STATUS_BYTES, stream), "cuMemsetD8Async");
  throw Error(status_error(op, w));
}

// After a call's kernels: the word into the pinned copy, then the event (both queued).
inline void record(const std::string& op, Channel& ch, CUstream stream) {
  const Driver& d = driver();
  check(op, d.cuMemcpyDtoHAsync(ch.pinned, ch.status, STATUS_BYTES, stream),
        "cuMemcpyDtoHAsync");
  check(op, d.cuEventRecord(ch.done, stream), "cuEventRecord");
  ch.recorded = true;
}

// Writes ``message`` (truncated) into ``buf`` for a C caller.
inline void put_message(const std::string& message, char* buf, size_t len) {
  if (!buf || !len) return;
  std::snprintf(buf, len, "%s", message.c_str());
}

}  // namespace mx_roi_cuda
