// Host shim: compiles the CUDA kernel sources (operators/*.cu) with a C++ compiler so
// that the very same kernel text runs on the CPU (mx_roi "emulated-cuda" backend).
//
// * __global__/__device__/__forceinline__/__host__ expand to nothing (plain inline C++);
// * blockIdx/threadIdx/gridDim/blockDim are (thread-local) globals that the generated launch wrappers
//   set before calling the kernel once per (block, thread): the grid-stride loops then
//   run serially, each "thread" covering its own strided slice exactly as on a GPU;
// * atomicAdd is a plain read-modify-write (execution is serial), including the
//   unsigned long long overload of the deterministic fixed-point mode (wraps modulo
//   2^64 like the hardware atomic);
// * __half is the compiler's IEEE binary16 (_Float16): float->half rounds to nearest
//   even like __float2half.
#pragma once
#define MX_ROI_HOST_SHIM 1

#include <cmath>
#include <cstdint>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __restrict__

struct mx_roi_dim3 {
  unsigned int x, y, z;
};
// thread_local: MXNet may run custom ops from several worker threads at once.
static thread_local mx_roi_dim3 blockIdx, threadIdx, gridDim, blockDim;

typedef _Float16 __half;
static inline float __half2float(__half h) { return (float)h; }
static inline __half __float2half(float f) { return (__half)f; }

static inline long long __double2ll_rn(double v) { return (long long)std::llrint(v); }

static inline float atomicAdd(float* p, float v) {
  float old = *p;
  *p = old + v;
  return old;
}
static inline double atomicAdd(double* p, double v) {
  double old = *p;
  *p = old + v;
  return old;
}
static inline unsigned long long atomicAdd(unsigned long long* p, unsigned long long v) {
  unsigned long long old = *p;
  *p = old + v;
  return old;
}

// Runs fn() once for every (block, thread) of a 1-D launch, serially.
template <typename F>
static inline void mx_roi_launch_serial(unsigned int grid, unsigned int block, F fn) {
  gridDim.x = grid; gridDim.y = 1; gridDim.z = 1;
  blockDim.x = block; blockDim.y = 1; blockDim.z = 1;
  blockIdx.y = blockIdx.z = threadIdx.y = threadIdx.z = 0;
  for (unsigned int b = 0; b < grid; ++b) {
    blockIdx.x = b;
    for (unsigned int t = 0; t < block; ++t) {
      threadIdx.x = t;
      fn();
    }
  }
}
