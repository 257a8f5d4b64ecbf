// Host shim: compiles the CUDA kernel sources (operators/*.cu) with a C++ compiler so
// that the very same kernel text runs on the CPU, in one of two builds:
//
// * emulation (mx_roi "emulated-cuda" backend): the launch runs every (block, thread) of
//   the grid serially, so the kernels' grid-stride loops behave exactly as on a GPU;
// * native (-DMX_ROI_HOST_NATIVE, mx_roi "native" backend): a fast CPU build.  The
//   launch cuts the output channels into small contiguous blocks that the threads take
//   one at a time from a shared counter (a dynamic split: a thread slowed by a busy core
//   simply takes fewer blocks; a helper keeps off its caller's CPU, so that the two do
//   not share a core while another is free -- mx_roi_cpu_avoider), and walks each block
//   channel by channel
//   (mx_roi::ItemLoop in roi_common.cuh).  A backward of output channel c writes only
//   the input planes of channel c (the channel_map of the position-sensitive ops keeps
//   classes apart), and one channel is always walked whole by one thread in the same
//   order, so threads never write the same element: atomicAdd stays a plain add and the
//   result is bit-identical for any thread count and any timing.
//
// Common to both:
// * __global__/__device__/__forceinline__/__host__ expand to nothing (plain inline C++);
// * blockIdx/threadIdx/gridDim/blockDim are (thread-local) globals that the generated launch wrappers
//   set before calling the kernel once per (block, thread): the grid-stride loops then
//   run serially, each "thread" covering its own strided slice exactly as on a GPU;
// * atomicAdd (and atomicMax, unsigned long long) is a plain read-modify-write
//   (execution is serial), including the
//   unsigned long long overload of the deterministic fixed-point mode (wraps modulo
//   2^64 like the hardware atomic);
// * __half is the compiler's IEEE binary16 (_Float16) or, without it (or with
//   -DMX_ROI_SOFT_HALF), a 16-bit struct with bit-exact conversions; float->half rounds
//   to nearest even like __float2half.
#pragma once
#define MX_ROI_HOST_SHIM 1

#include <cmath>
#include <cstdint>

#define __global__
#define __device__
#define __host__
#ifdef MX_ROI_HOST_NATIVE
// as in CUDA: always inlined (GCC 12 otherwise may find a small helper whose only effect
// is __builtin_prefetch "const" and drop the call -- mx_roi::prefetch_next_plane)
#define __forceinline__ __attribute__((always_inline)) inline
#else
#define __forceinline__ inline
#endif
#define __restrict__

struct mx_roi_dim3 {
  unsigned int x, y, z;
};
// thread_local: MXNet may run custom ops from several worker threads at once.
static thread_local mx_roi_dim3 blockIdx, threadIdx, gridDim, blockDim;

#if defined(__FLT16_MAX__) && !defined(MX_ROI_SOFT_HALF)
typedef _Float16 __half;
static inline float __half2float(__half h) { return (float)h; }
static inline __half __float2half(float f) { return (__half)f; }
#else
// Compilers without _Float16 (or -DMX_ROI_SOFT_HALF): binary16 in a 16-bit struct with
// bit-exact conversions (round to nearest even; F. Giesen's public-domain algorithms).
#include <cstring>
struct __half {
  unsigned short x;
};
static inline float __half2float(__half h) {
  const unsigned int shifted_exp = 0x7c00u << 13;
  unsigned int o = (unsigned int)(h.x & 0x7fffu) << 13;
  const unsigned int exp = shifted_exp & o;
  o += (127u - 15u) << 23;
  float f;
  if (exp == shifted_exp) {  // inf / nan
    o += (128u - 16u) << 23;
    std::memcpy(&f, &o, 4);
  } else if (exp == 0) {  // zero / subnormal: renormalise
    o += 1u << 23;
    const unsigned int magic_bits = 113u << 23;
    float magic;
    std::memcpy(&magic, &magic_bits, 4);
    std::memcpy(&f, &o, 4);
    f -= magic;
    std::memcpy(&o, &f, 4);
  }
  o |= (unsigned int)(h.x & 0x8000u) << 16;
  std::memcpy(&f, &o, 4);
  return f;
}
static inline __half __float2half(float value) {
  unsigned int u;
  std::memcpy(&u, &value, 4);
  const unsigned int sign = u & 0x80000000u;
  u ^= sign;
  __half o;
  if (u >= (127u + 16u) << 23) {  // >= 65536: inf, or nan
    o.x = (u > 255u << 23) ? 0x7e00 : 0x7c00;
  } else if (u < 113u << 23) {  // subnormal or zero: align the mantissa by an addition
    const unsigned int magic_bits = ((127u - 15u) + (23u - 10u) + 1u) << 23;
    float f, magic;
    std::memcpy(&f, &u, 4);
    std::memcpy(&magic, &magic_bits, 4);
    f += magic;
    std::memcpy(&u, &f, 4);
    o.x = (unsigned short)(u - magic_bits);
  } else {
    const unsigned int mant_odd = (u >> 13) & 1u;
    u += ((unsigned int)(15 - 127) << 23) + 0xfffu;
    u += mant_odd;
    o.x = (unsigned short)(u >> 13);
  }
  o.x = (unsigned short)(o.x | (sign >> 16));
  return o;
}
#endif

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
static inline unsigned long long atomicMax(unsigned long long* p, unsigned long long v) {
  unsigned long long old = *p;
  if (v > old) *p = v;
  return old;
}

#ifdef MX_ROI_HOST_NATIVE
#include <unistd.h>
#if defined(__linux__)
#include <pthread.h>
#include <sched.h>
#endif

#include <atomic>
#include <condition_variable>
#include <cstring>
#include <memory>
#include <mutex>
#include <thread>
// The output channels [begin, end) of the calling thread (read by mx_roi::ItemLoop).
static thread_local int mx_roi_c_begin = 0, mx_roi_c_end = 0;
// The launch the calling thread's block belongs to (a number no other launch of this
// process had): a kernel may keep what it derived from the inputs for the thread's next
// block of the same launch (PrRoIPool's rois' gradient: its channels-last images).
static std::atomic<unsigned long long> mx_roi_launches{0};
static thread_local unsigned long long mx_roi_launch_id = 0;

// Channel blocks per thread of a native launch: enough that a thread sharing its core
// with another process hands most of its share to the others, few enough that a block
// still streams whole planes (a block is at least one channel).
#define MX_ROI_BLOCKS_PER_THREAD 8
// Channel blocks (at most) a launch on one thread walks in turn: a block's channels-last
// scratch is then a quarter of the call's (ROIPooling 14x14 / 512 rois backward: 7.8 ->
// 2 MB).  Measured on one thread, bench workloads: forwards up to 13% faster, backwards
// the same but ROIPooling's (+8%: it builds each roi's cell table once per block); with
// 8 blocks two more backwards were 8-10% slower.
#ifndef MX_ROI_SERIAL_BLOCKS
#define MX_ROI_SERIAL_BLOCKS 4
#endif
// ... but only while each block still holds this many map cells (H * W per channel, the
// launch's ``plane`` hint): a small call's whole channels-last scratch is cache-sized
// already, and one block lets the lanes kernels take a sample's taps once for all its
// channels (ROIAlign's small forward, 64 channels of 19x25: four blocks walked every
// sample four times).  -DMX_ROI_SERIAL_BLOCK_CELLS=1 keeps MX_ROI_SERIAL_BLOCKS blocks.
#ifndef MX_ROI_SERIAL_BLOCK_CELLS
#define MX_ROI_SERIAL_BLOCK_CELLS (1LL << 16)
#endif
// Channels per block unit (mx_roi::LANES of the lanes kernels).
#define MX_ROI_LANE_QUANTUM 16

// The shared state of one launch; helpers hold it by shared_ptr, so one that comes
// after the launch has returned finds no block left and touches nothing else (fn, on
// the caller's stack, is only called for a block taken while the caller waits).
struct mx_roi_launch_state {
  std::atomic<int> next{0}, done{0};
  std::atomic<int> seats{0};  // helpers that may still join (the thread count's limit)
  int blocks = 1, C = 0, quantum = 1;
  int caller_cpu = -1;  // the CPU the caller published the launch from (-1: unknown)
  unsigned long long id = 0;  // mx_roi_launch_id of its blocks
  void (*call)(void*) = nullptr;  // runs the launch's fn, type-erased
  void* fn = nullptr;
  std::mutex m;
  std::condition_variable cv;
};

// Block b's channels [begin, end): in whole units of `quantum` channels (the last unit
// may be partial).  The lanes kernels work on 16 channels at a time: a block of 4 would
// pad to 16 lanes and do 4x the work (measured: a small 14x14 ROIAlign 2x slower on two
// threads than on one).
static inline void mx_roi_block_range(int C, int blocks, int quantum, int b) {
  const long long units = (C + quantum - 1) / quantum;
  const long long u0 = units * b / blocks, u1 = units * (b + 1) / blocks;
  mx_roi_c_begin = (int)(u0 * quantum < C ? u0 * quantum : C);
  mx_roi_c_end = (int)(u1 * quantum < C ? u1 * quantum : C);
}

static inline void mx_roi_run_blocks(mx_roi_launch_state& st) {
  for (int b; (b = st.next.fetch_add(1, std::memory_order_relaxed)) < st.blocks;) {
    mx_roi_block_range(st.C, st.blocks, st.quantum, b);
    mx_roi_launch_id = st.id;
    st.call(st.fn);
    if (st.done.fetch_add(1, std::memory_order_acq_rel) + 1 == st.blocks) {
      std::lock_guard<std::mutex> lock(st.m);
      st.cv.notify_all();
    }
  }
}

// Helper threads kept for the life of the process (starting a thread per launch cost
// ~0.1 ms, as much as a small call's whole kernel).  They sleep on a condition variable
// (no spinning: a busy core loses nothing to them) and wake for each published launch.
// Never freed (a detached helper may still wait on it at exit); after a fork the child
// has none of the parent's threads, so a pool belongs to one process id.
struct mx_roi_pool {
  std::mutex m;
  std::condition_variable cv;
  std::shared_ptr<mx_roi_launch_state> job;  // the latest launch
  unsigned long long gen = 0;                 // launches published
  int threads = 0;
  pid_t pid = 0;
};

// Keeps a helper off the CPU its launch's caller runs on.  With no idle CPU (one core
// busy with another process, on 2 cores), Linux wakes a helper on the waker's CPU, so the
// caller and its helper time-share one core while the other process has the other:
// the launch ran as slowly as on one thread (ROIAlign 7x7 forward 1.9x its quiet time).
// Off the caller's CPU the helper shares the busy core instead, and the dynamic block
// split gives it what it manages (1.4x).  Only the helper's own affinity changes, within
// the CPUs it started with (those of the thread that created it); one syscall when the
// caller's CPU changes, none otherwise.
struct mx_roi_cpu_avoider {
#if defined(__linux__)
  cpu_set_t allowed;
  bool usable = false;
  int avoided = -1;  // the CPU taken out of this thread's affinity (-1: none)
  mx_roi_cpu_avoider() {
    CPU_ZERO(&allowed);
    usable = pthread_getaffinity_np(pthread_self(), sizeof allowed, &allowed) == 0 &&
             CPU_COUNT(&allowed) > 1;
  }
  void avoid(int cpu) {
    if (!usable) return;
    const int want = (cpu >= 0 && cpu < CPU_SETSIZE && CPU_ISSET(cpu, &allowed)) ? cpu : -1;
    if (want == avoided) return;
    cpu_set_t set = allowed;
    if (want >= 0) CPU_CLR(want, &set);
    if (pthread_setaffinity_np(pthread_self(), sizeof set, &set) == 0) avoided = want;
  }
#else
  void avoid(int) {}
#endif
};

static inline int mx_roi_current_cpu() {
#if defined(__linux__)
  return sched_getcpu();
#else
  return -1;
#endif
}

static inline void mx_roi_pool_worker(mx_roi_pool* p, unsigned long long seen) {
#if defined(__linux__)
  pthread_setname_np(pthread_self(), "mx_roi helper");  // as top / gdb / /proc show it
#endif
  mx_roi_cpu_avoider cpus;
  for (;;) {
    std::shared_ptr<mx_roi_launch_state> job;
    {
      std::unique_lock<std::mutex> lock(p->m);
      p->cv.wait(lock, [&]() { return p->gen != seen; });
      seen = p->gen;
      job = p->job;
    }
    if (job && job->seats.fetch_sub(1, std::memory_order_acq_rel) > 0) {
      cpus.avoid(job->caller_cpu);
      mx_roi_run_blocks(*job);
    }
  }
}

static inline mx_roi_pool* mx_roi_pool_get() {
  static std::atomic<mx_roi_pool*> current{nullptr};
  const pid_t pid = getpid();
  mx_roi_pool* p = current.load(std::memory_order_acquire);
  while (!p || p->pid != pid) {
    mx_roi_pool* fresh = new (std::nothrow) mx_roi_pool();
    if (!fresh) return nullptr;
    fresh->pid = pid;
    if (current.compare_exchange_strong(p, fresh, std::memory_order_acq_rel)) return fresh;
    delete fresh;  // another thread installed one first: p now holds it
  }
  return p;
}

template <typename F>
static void mx_roi_call(void* fn) {
  (*static_cast<F*>(fn))();
}

// Runs fn() over blocks of channels on up to nthreads threads (at most C): every thread,
// the caller included, takes the next block [c0, c1) from an atomic counter until none is
// left.  The caller waits only for blocks that were taken, never for a helper that has
// not woken up yet (on a busy machine that can take milliseconds): a late helper finds
// the counter exhausted and goes back to sleep.  A helper that cannot be started
// (resource limits) is simply not there.  An exception must not leave this extern "C"
// code (it would abort the process).
// ``plane``: the map cells per input channel (H * W; 0: unknown), which bounds the blocks
// of a launch on one thread (MX_ROI_SERIAL_BLOCK_CELLS).
template <typename F>
static inline void mx_roi_launch_channels(int C, int nthreads, F fn, long long plane = 0) {
  const int T = nthreads < 1 ? 1 : (nthreads > C ? (C > 0 ? C : 1) : nthreads);
  std::shared_ptr<mx_roi_launch_state> st;
  mx_roi_pool* pool = nullptr;
  if (T > 1) {
    try {
      st = std::make_shared<mx_roi_launch_state>();
      pool = mx_roi_pool_get();
    } catch (...) {
      pool = nullptr;
    }
  }
  // whole 16-channel units (MX_ROI_LANE_QUANTUM) when every thread can have one
  const int quantum = C >= MX_ROI_LANE_QUANTUM * T ? MX_ROI_LANE_QUANTUM : 1;
  const int units = (C + quantum - 1) / quantum;
  if (!pool) {
    // one thread walks the same blocks in turn: a block's channels-last scratch stays a
    // fraction of the call's (cache-sized, and not a second copy of the whole map)
    int blocks = units < MX_ROI_SERIAL_BLOCKS ? units : MX_ROI_SERIAL_BLOCKS;
    if (plane > 0 && blocks > 1) {
      const long long by_size = ((long long)C * plane + MX_ROI_SERIAL_BLOCK_CELLS - 1) /
                                MX_ROI_SERIAL_BLOCK_CELLS;
      if (by_size < blocks) blocks = by_size < 1 ? 1 : (int)by_size;
    }
    mx_roi_launch_id = ++mx_roi_launches;
    if (blocks <= 0) {  // no channels: one call over the empty range, as ever
      mx_roi_c_begin = mx_roi_c_end = 0;
      fn();
    }
    for (int b = 0; b < blocks; ++b) {
      mx_roi_block_range(C, blocks, quantum, b);
      fn();
    }
    return;
  }
  const int want = T * MX_ROI_BLOCKS_PER_THREAD;
  st->blocks = units < want ? units : want;
  st->C = C;
  st->quantum = quantum;
  st->seats.store(T - 1, std::memory_order_relaxed);
  st->caller_cpu = mx_roi_current_cpu();
  st->call = &mx_roi_call<F>;
  st->fn = &fn;
  st->id = ++mx_roi_launches;
  {
    std::lock_guard<std::mutex> lock(pool->m);
    while (pool->threads < T - 1) {
      try {
        std::thread(mx_roi_pool_worker, pool, pool->gen).detach();
      } catch (...) {
        break;
      }
      ++pool->threads;
    }
    pool->job = st;
    ++pool->gen;
  }
  pool->cv.notify_all();
  mx_roi_run_blocks(*st);
  std::unique_lock<std::mutex> lock(st->m);
  st->cv.wait(lock, [&]() { return st->done.load(std::memory_order_acquire) == st->blocks; });
}
#endif

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
