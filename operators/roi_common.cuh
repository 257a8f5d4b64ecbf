// Shared device code of the mx_roi CUDA kernels (operators/*.cu).
//
// The kernels are *table driven*: they read the op's geometry tables (IntBins or
// SampleGrid of mx_roi/geometry.py) and never re-derive a bin or a sample point.  The
// tables come from geometry.py (NumPy) or, on the host builds, from its compiled twin at
// the end of this file (mx_roi::geo: per-roi __host__ __device__ functions, proven
// bit-equal to geometry.py by tests/test_geometry_compiled.py).  Every kernel is a template on
//   T  the element type of data/output/out-grad (float, double, __half),
//   A  the accumulation/table type (float for float and __half, double for double),
//   O  (backward only) the gradient accumulator: A (atomicAdd in A) or
//      unsigned long long (deterministic mode: fixed-point atomics, see grad_add),
//   I  (max kernels only, last) the storage type of the argmax: unsigned char, short or
//      int, the smallest that fits the call's bins (index_store / index_load below).
//
// The same text compiles with NVRTC (CuPy RawModule) and, for the host emulation,
// with g++ through mx_roi/cuda/host_shim.h (which defines MX_ROI_HOST_SHIM).
#pragma once
#ifndef MX_ROI_HOST_SHIM
#include <cuda_fp16.h>
#endif

// Loop of a kernel over its items: declares ``mx_roi::Item it`` (see ItemLoop below).
// ``plane_per_bin``: whether the input plane an item touches depends on its bin (p, q)
// besides its channel (the position-sensitive ops) -- a traversal-order hint for the
// native host build; a GPU ignores it.
#define MX_ROI_ITEM_LOOP(it, n, C, P, Q, plane_per_bin) \
  mx_roi::Item it;                                      \
  for (mx_roi::ItemLoop it##_loop(n, C, P, Q, plane_per_bin); it##_loop.next(it);)

namespace mx_roi {

// ---- element type -> accumulator type ------------------------------------------
template <typename T>
struct Traits {
  typedef T acc;
  static __device__ __forceinline__ T load(T v) { return v; }
  static __device__ __forceinline__ T store(T v) { return v; }
};

template <>
struct Traits<__half> {
  typedef float acc;
  static __device__ __forceinline__ float load(__half v) { return __half2float(v); }
  static __device__ __forceinline__ __half store(float v) { return __float2half(v); }
};

// ---- max modes: MXNet's NaN rule ----------------------------------------------------
// A non-empty max bin starts at -FLT_MAX (in A, also for double) with argmax -1, and a
// value replaces the running max only if strictly greater (MXNet's roi_pooling): NaN,
// -inf and values <= -FLT_MAX never win; a bin nothing beat keeps -FLT_MAX (-inf once
// stored as __half) and argmax -1.  mx_roi.kernels_numpy.MAX_INIT is the same value.
template <typename A>
__device__ __forceinline__ A max_init() {
  return (A)(-3.402823466385288598117e+38f);
}

// One step of the max scan: if v > best (strict; NaN never wins), best = v and arg = k.
// In the native host build the argmax update is a mask, hidden from the compiler so that
// it cannot turn it back into a branch: on real data '>' is unpredictable, and a
// mispredicted branch per cell made the ROIPooling training forward 2-3x slower than
// the max alone.  Same result either way.
template <typename A>
__device__ __forceinline__ void max_step(A v, A& best, int k, int& arg) {
#ifdef MX_ROI_HOST_NATIVE
  int take = -(int)(v > best);
  __asm__("" : "+r"(take));
  arg = (k & take) | (arg & ~take);
  best = v > best ? v : best;
#else
  if (v > best) {
    best = v;
    arg = k;
  }
#endif
}

// ---- the stored argmax ---------------------------------------------------------------
// A max kernel's running argmax is an int: the winner's index among its bin's candidates
// (bin-relative, so small), or -1.  It is stored as I (unsigned char / short / int, the
// smallest type holding every index of the call's bins besides its maximum value), -1
// becoming that maximum (255, 65535, 0xFFFFFFFF: the sentinel "no winner"), and loaded
// back as the same int.  Indices are < 2^31 (the launch glue checks the geometry).
template <typename I>
__device__ __forceinline__ I index_store(int k) {
  return (I)k;  // unsigned conversion: -1 -> the type's maximum
}
template <typename I>
__device__ __forceinline__ int index_load(I v) {
  return v == (I)~(I)0 ? -1 : (int)v;
}

// ---- the items (output elements) of a launch -----------------------------------------
// Item: output element (r, c, p, q) of the (R, C, P, Q) output and its flat index i.
struct Item {
  long long i, r;
  int c, p, q;
};

__device__ __forceinline__ Item unravel(long long i, int C, int P, int Q) {
  Item it;
  it.i = i;
  it.q = (int)(i % Q);
  long long t = i / Q;
  it.p = (int)(t % P);
  t /= P;
  it.c = (int)(t % C);
  it.r = t / C;
  return it;
}

// The rois of a launch of n items: (R, C, P, Q) outputs, R = 0 for an empty C x P x Q.
__device__ __forceinline__ long long launch_rois(long long n, int C, int P, int Q) {
  const long long per_roi = (long long)C * P * Q;
  return per_roi > 0 ? n / per_roi : 0;
}

// The same in 32-bit unsigned arithmetic (a 64-bit div/mod costs several times a 32-bit one
// on a GPU); only for indices that fit, see ItemLoop.
__device__ __forceinline__ Item unravel32(unsigned i, unsigned C, unsigned P, unsigned Q) {
  Item it;
  it.i = i;
  it.q = (int)(i % Q);
  unsigned t = i / Q;
  it.p = (int)(t % P);
  t /= P;
  it.c = (int)(t % C);
  it.r = t / C;
  return it;
}

// Launches whose item count is at most this unravel in 32 bits; -DMX_ROI_INDEX32_LIMIT=...
// lowers it so the host emulation can test the 64-bit path on small problems.
#ifndef MX_ROI_INDEX32_LIMIT
#define MX_ROI_INDEX32_LIMIT 0x7fffffffLL
#endif

#ifndef MX_ROI_HOST_NATIVE
// On a GPU (and in the serial host emulation): a grid-stride loop over the flat index,
// 64-bit (tensors may exceed 2^31 elements).
class ItemLoop {
 public:
  __device__ ItemLoop(long long n, int C, int P, int Q, bool)
      : i_((long long)blockIdx.x * (long long)blockDim.x + threadIdx.x),
        step_((long long)blockDim.x * (long long)gridDim.x), n_(n), C_(C), P_(P), Q_(Q),
        // i < n <= 2^31 - 1 and i + step < 2^32 (step <= 65535 * 1024): no unsigned wrap
        small_(n <= MX_ROI_INDEX32_LIMIT) {}
  __device__ __forceinline__ bool next(Item& it) {
    if (i_ >= n_) return false;
    it = small_ ? unravel32((unsigned)i_, (unsigned)C_, (unsigned)P_, (unsigned)Q_)
                : unravel(i_, C_, P_, Q_);
    i_ += step_;
    return true;
  }

 private:
  long long i_, step_, n_;
  int C_, P_, Q_;
  bool small_;
};
#else
// Native host build (mx_roi/cuda/host_shim.h with MX_ROI_HOST_NATIVE): the calling
// thread's block of output channels [mx_roi_c_begin, mx_roi_c_end); threads with
// disjoint channel blocks never write the same input-gradient plane (no atomics needed),
// and every channel is walked in the same (r, p, q) order whatever the block, so results
// do not depend on the thread count.  When every bin of a channel reads the same plane:
// roi by roi, the block's channels in turn -- one contiguous run of output / out-grad
// elements per roi, while the block's planes stay in cache (measured: ROIPooling 14x14
// forward 1.4x, backward 1.3x faster than channel by channel).  When each bin has its
// own plane (position-sensitive ops): channel, bin, then all rois of that bin's plane.
// The flat index is advanced, not recomputed.
class ItemLoop {
 public:
  ItemLoop(long long n, int C, int P, int Q, bool plane_per_bin)
      : C_(C), P_(P), Q_(Q), roi_inner_(plane_per_bin) {
    R_ = launch_rois(n, C, P, Q);
    it_.c = mx_roi_c_begin;
    it_.r = 0;
    it_.p = 0;
    it_.q = 0;
    first_ = true;
    begin_ = mx_roi_c_begin;
    end_ = R_ > 0 ? mx_roi_c_end : mx_roi_c_begin;
    if (!roi_inner_ && end_ <= begin_) R_ = 0;
  }
  inline bool next(Item& it) {
    if (first_) {
      first_ = false;
      if (roi_inner_ ? it_.c >= end_ : it_.r >= R_) return false;
      it_.i = ((it_.r * C_ + it_.c) * P_ + it_.p) * Q_ + it_.q;
    } else if (roi_inner_) {
      if (++it_.r == R_) {
        it_.r = 0;
        if (++it_.q == Q_) {
          it_.q = 0;
          if (++it_.p == P_) {
            it_.p = 0;
            if (++it_.c >= end_) return false;
          }
        }
        it_.i = ((long long)it_.c * P_ + it_.p) * Q_ + it_.q;
      } else {
        it_.i += (long long)C_ * P_ * Q_;
      }
    } else {
      // a roi's channels [begin, end) are one contiguous run of output elements
      ++it_.i;
      if (++it_.q == Q_) {
        it_.q = 0;
        if (++it_.p == P_) {
          it_.p = 0;
          if (++it_.c == end_) {
            it_.c = begin_;
            if (++it_.r >= R_) return false;
            it_.i = (it_.r * C_ + begin_) * ((long long)P_ * Q_);
          }
        }
      }
    }
    it = it_;
    return true;
  }

 private:
  Item it_;
  long long R_;
  int C_, P_, Q_, begin_, end_;
  bool roi_inner_, first_;
};
#endif

// Input channel read by output channel c at bin (p, q): channel_map[c, p, q] for the
// position-sensitive ops (null: the identity, c).
__device__ __forceinline__ int in_channel(const int* channel_map, const Item& it, int P, int Q) {
  return channel_map ? channel_map[((long long)it.c * P + it.p) * Q + it.q] : it.c;
}

// Offset of the (b, ch) plane of an (N, C, H, W) tensor, 64-bit.
__device__ __forceinline__ long long plane_offset(int b, int ch, int C, int H, int W) {
  return ((long long)b * C + ch) * ((long long)H * W);
}

// ---- native host build: prefetching the next plane ------------------------------------
// In the native build a position-sensitive kernel walks all rois of one bin -- one input
// plane per channel -- before the next bin, so the first loads of the next bin's plane
// would each wait for memory.  Every roi r of a bin hints two cache lines of that plane
// (PlaneHint: lines 2r and 2r + 1, wrapped), spreading the plane over the current bin's
// rois (measured on the 2-core test machine: PS forward 1.5-2x, backward 1.3x faster).
// The wrap takes no division: two 64-bit divisions per hint (one per roi and bin, or per
// item in the generic loops) were half of a small PSROIAlign forward's kernel time.
// The per-channel ops reuse one plane for all R*P*Q items of a channel and gained
// nothing.  No hints where an image's Cin planes take at most MX_ROI_HINT_MIN_BYTES: such
// a map stays in the core's cache, and working the hints out cost more than they saved
// (the bench's small call, 16 rois 7x7 on a 49-plane 19x25 map, 93 KB, one thread, the
// native door's callbacks in a loop of training steps: PSROIPooling 14-15 -> 10-12 us
// forward, 17-18 -> 10-12 us backward; PSROIAlign ~25 -> 19-23 us each way).  Nothing on
// a GPU or in the emulation, nor with -DMX_ROI_NO_PREFETCH (to measure it).
#ifndef MX_ROI_HINT_MIN_BYTES
#define MX_ROI_HINT_MIN_BYTES (256 << 10)
#endif
#ifdef MX_ROI_HOST_NATIVE
// whether an image's Cin planes of H x W elements of ``bytes`` take more than
// MX_ROI_HINT_MIN_BYTES (in double: no product overflows)
inline bool hint_map(int Cin, int H, int W, size_t bytes) {
  return (double)Cin * H * W * (double)bytes > (double)(MX_ROI_HINT_MIN_BYTES);
}
#endif

template <typename T>
struct PlaneHint {
  long long off = 0, off2 = 0;  // the two lines' element offsets in a plane
  bool on = false;              // a map of more than MX_ROI_HINT_MIN_BYTES: hints
  __device__ PlaneHint(long long r, int Cin, int H, int W) {
#if defined(MX_ROI_HOST_NATIVE) && !defined(MX_ROI_NO_PREFETCH)
    const long long line = 64 / (long long)sizeof(T);
    const unsigned long long lines = (unsigned long long)((long long)H * W / line);
    on = hint_map(Cin, H, W, sizeof(T));
    if (!on || lines < 2) return;  // (a plane of under two lines: its first line)
    // line i of the plane's whole lines, i taken modulo up = the smallest power of two >=
    // lines; an i >= lines folds back by up / 2 (< lines): every line is some roi's
    const unsigned long long up = 2ULL << (63 - __builtin_clzll(lines - 1));
    auto wrap = [&](unsigned long long i) {
      i &= up - 1;
      return (long long)(i < lines ? i : i - up / 2) * line;
    };
    off = wrap(2 * (unsigned long long)r);
    off2 = wrap(2 * (unsigned long long)r + 1);
#else
    (void)r;
    (void)Cin;
    (void)H;
    (void)W;
#endif
  }
  // ``write``: the plane is a gradient plane the next bin's items will update
  __device__ __forceinline__ void operator()(const T* plane, bool write) const {
#if defined(MX_ROI_HOST_NATIVE) && !defined(MX_ROI_NO_PREFETCH)
    if (!on) return;
    if (write) {
      __builtin_prefetch(plane + off, 1);
      __builtin_prefetch(plane + off2, 1);
    } else {
      __builtin_prefetch(plane + off, 0);
      __builtin_prefetch(plane + off2, 0);
    }
#endif
  }
};

// The hint of an item of the generic loop (ItemLoop's order: channel, bin, then all
// rois): the plane of the next bin in (c, p, q) order, the item's batch.
template <typename T>
__device__ __forceinline__ void prefetch_next_plane(const T* base, const int* channel_map,
                                                    const Item& it, int C, int Cin, int H,
                                                    int W, int P, int Q, int b, bool write) {
#if defined(MX_ROI_HOST_NATIVE) && !defined(MX_ROI_NO_PREFETCH)
  if (!channel_map) return;
  const PlaneHint<T> hint(it.r, Cin, H, W);
  if (!hint.on) return;
  Item nx = it;  // the next bin in (c, p, q) order; the last one re-hints itself
  if (++nx.q == Q) {
    nx.q = 0;
    if (++nx.p == P) {
      nx.p = 0;
      ++nx.c;
    }
  }
  if (nx.c >= C) nx = it;
  hint(base + plane_offset(b, in_channel(channel_map, nx, P, Q), Cin, H, W), write);
#endif
}

// ---- gradient accumulation ---------------------------------------------------------
// Plain atomics (order of additions, hence the last bits, vary from run to run) ...
__device__ __forceinline__ void grad_add(float* dst, float v, double) { atomicAdd(dst, v); }
__device__ __forceinline__ void grad_add(double* dst, double v, double) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 600
  // No double atomicAdd before sm_60 (Maxwell): the CUDA C++ Programming Guide's
  // compare-and-swap loop on the 64-bit pattern (retry until no other thread wrote).
  unsigned long long* addr = (unsigned long long*)dst;
  unsigned long long old = *addr, assumed;
  do {
    assumed = old;
    old = atomicCAS(addr, assumed, __double_as_longlong(v + __longlong_as_double(assumed)));
  } while (assumed != old);  // integer compare: also ends when the value is NaN
#else
  atomicAdd(dst, v);
#endif
}
// ... or fixed point: round(v * scale) added as a 64-bit integer.  Integer addition is
// associative, so the result does not depend on the order (deterministic mode).
__device__ __forceinline__ void grad_add(unsigned long long* dst, double v, double scale) {
  atomicAdd(dst, (unsigned long long)__double2ll_rn(v * scale));
}

// ---- one bilinear sample of a SampleGrid ---------------------------------------------
// Taps (yl|yh, xl|xh) and weights of sample iy of bin (r, p) along y and ix of bin
// (r, q) along x.  Tables: low/high (R, P, G) int, w_low/w_high (R, P, G) A.
template <typename A>
struct Sample {
  int yl, yh, xl, xh;
  A w1, w2, w3, w4;  // wy_low*wx_low, wy_low*wx_high, wy_high*wx_low, wy_high*wx_high
  bool outside;      // both weights of an axis are 0: a point outside the map (value 0)
};

template <typename A>
__device__ __forceinline__ Sample<A> sample_at(long long ybase, long long xbase, int iy, int ix,
                                               const int* y_low, const int* y_high,
                                               const A* y_wl, const A* y_wh,
                                               const int* x_low, const int* x_high,
                                               const A* x_wl, const A* x_wh) {
  Sample<A> s;
  const long long ky = ybase + iy, kx = xbase + ix;
  s.yl = y_low[ky];
  s.yh = y_high[ky];
  s.xl = x_low[kx];
  s.xh = x_high[kx];
  const A wyl = y_wl[ky], wyh = y_wh[ky], wxl = x_wl[kx], wxh = x_wh[kx];
  s.w1 = wyl * wxl;
  s.w2 = wyl * wxh;
  s.w3 = wyh * wxl;
  s.w4 = wyh * wxh;
  s.outside = (wyl == 0 && wyh == 0) || (wxl == 0 && wxh == 0);
  return s;
}

// value = (w1*v(yl,xl) + w2*v(yl,xh)) + w3*v(yh,xl) + w4*v(yh,xh), in A
// (the operation order of mx_roi.kernels_numpy.sample_values / MXNet / Caffe2).
template <typename T, typename A>
__device__ __forceinline__ A sample_value(const T* plane, int W, const Sample<A>& s) {
  typedef Traits<T> Tr;
  const A v1 = Tr::load(plane[(long long)s.yl * W + s.xl]);
  const A v2 = Tr::load(plane[(long long)s.yl * W + s.xh]);
  const A v3 = Tr::load(plane[(long long)s.yh * W + s.xl]);
  const A v4 = Tr::load(plane[(long long)s.yh * W + s.xh]);
  return (s.w1 * v1 + s.w2 * v2) + s.w3 * v3 + s.w4 * v4;
}

// Gradient g of one sample to its four taps.
template <typename A, typename O>
__device__ __forceinline__ void sample_backward(O* plane, int W, const Sample<A>& s, A g,
                                                double scale) {
  grad_add(plane + (long long)s.yl * W + s.xl, g * s.w1, scale);
  grad_add(plane + (long long)s.yl * W + s.xh, g * s.w2, scale);
  grad_add(plane + (long long)s.yh * W + s.xl, g * s.w3, scale);
  grad_add(plane + (long long)s.yh * W + s.xh, g * s.w4, scale);
}

#ifdef MX_ROI_HOST_NATIVE
// ---- native host build: channel lanes ------------------------------------------------
// The per-channel kernels (ROIPooling, ROIAlign average) read the same cells for every
// channel of a roi's bin.  The native build copies the calling thread's channel block
// channels-last once per launch and then walks each bin once for LANES channels at a time,
// the channels being independent vector lanes: per lane the same operations in the same
// order as the generic kernel, so the same bits (-ffp-contract=off, no fast-math).
}  // namespace mx_roi
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <new>
#include <type_traits>
#include <vector>
#if defined(__AVX__)
#include <immintrin.h>
#elif defined(__SSE2__)
#include <xmmintrin.h>
#endif
namespace mx_roi {

const int LANES = 16;
inline int padded_lanes(int nc) { return (nc + LANES - 1) / LANES * LANES; }

// Storage on 64-byte boundaries (a cache line): a cell's 16 float lanes are then one
// line, and no vector load or store of the lanes straddles two.  A std::vector's buffer
// under malloc's mmap threshold is 16-byte aligned: with it, half of the 8-wide loads of
// ROIAlign's small forward (16 rois x 64 channels, a 121 KB channels-last map) crossed a
// line, and its kernel took 45 us instead of 37.5.  Placement never changes a value.
template <typename T>
struct LineAligned {
  typedef T value_type;
  LineAligned() = default;
  template <typename U>
  LineAligned(const LineAligned<U>&) {}
  T* allocate(size_t n) {
    void* p = nullptr;
    if (posix_memalign(&p, 64, n ? n * sizeof(T) : 1) != 0) throw std::bad_alloc();
    return static_cast<T*>(p);
  }
  void deallocate(T* p, size_t) { free(p); }
  template <typename U>
  bool operator==(const LineAligned<U>&) const { return true; }
  template <typename U>
  bool operator!=(const LineAligned<U>&) const { return false; }
};
// A thread's reused lane buffer (channels-last maps, gradient blocks, staged rows)
template <typename T>
using LaneBuffer = std::vector<T, LineAligned<T>>;

// The images the R rois read: 1 + their largest batch index (validated: < N), 0 if none.
inline int images_read(const int* batch, long long R) {
  int images = 0;
  for (long long r = 0; r < R; ++r) images = batch[r] >= images ? batch[r] + 1 : images;
  return images;
}

// The batch index of each of the R rois, column 0 of their rows of `cols` values, loaded
// and truncated as the generic kernels read it ((int)(A)).  Thread-local storage, reused:
// valid until the calling thread's next call.
template <typename T, typename A>
const int* rois_batch_column(const T* rois, long long R, int cols) {
  static thread_local std::vector<int> batch;
  batch.resize((size_t)(R > 0 ? R : 0));
  for (long long r = 0; r < R; ++r) batch[r] = (int)(A)Traits<T>::load(rois[r * cols]);
  return batch.data();
}

// cells[j * ncp + c] = planes[c][j] for c < C, j < HW, 64 cells at a time (their lanes
// stay in L1); the other lanes untouched.  float: 8 x 8 AVX transposes, else 4 x 4 SSE
// ones (lanes up to the next multiple of 8 or 4: copies of the last channel), the planes'
// next lines prefetched (measured: PSROIAlign's copy of the 7x7 R-FCN bench's bins 2.3 ->
// 0.9 ms with SSE; AVX: that forward's kernel 7% faster on 1 and 2 threads).
template <typename T, typename A>
struct ChannelsLast {
  static void run(A* cells, const T* const* planes, int C, long long HW, int ncp) {
    for (long long j0 = 0; j0 < HW; j0 += 64) {
      const long long j1 = j0 + 64 < HW ? j0 + 64 : HW;
      for (int c = 0; c < C; ++c)
        for (long long j = j0; j < j1; ++j)
          cells[j * ncp + c] = (A)Traits<T>::load(planes[c][j]);
    }
  }
};

#if defined(__SSE2__)
// float: tiles of K channels x K cells, each one K x K transpose (Tile::run: the cells
// j .. j+K-1 of planes p[0..K-1] to their rows at dst + (j + i) * ncp); padding lanes up
// to the next multiple of K are copies of the last channel (ncp is a multiple of 8:
// 16-lane blocks, PSROIAlign's 8-lane passes).
template <int K, typename Tile>
inline void channels_last_tiles(float* cells, const float* const* planes, int C,
                                long long HW, int ncp) {
  const long long HK = HW / K * K;
  for (long long j0 = 0; j0 < HK; j0 += 64) {
    const long long j1 = j0 + 64 < HK ? j0 + 64 : HK;
    for (int c = 0; c < C; c += K) {
      const float* p[K];
      for (int i = 0; i < K; ++i) p[i] = planes[c + i < C ? c + i : C - 1];
      for (long long j = j0; j < j1; j += K) {
        if ((j & 15) == 0)  // a line ahead of each plane (a hint: never faults)
          for (int i = 0; i < K; ++i) __builtin_prefetch(p[i] + j + 64, 0, 0);
        Tile::run(p, j, cells + c, ncp);
      }
    }
  }
  for (int c = 0; c < C; ++c)  // the last HW % K cells
    for (long long j = HK; j < HW; ++j) cells[j * ncp + c] = planes[c][j];
}

#if defined(__AVX__)
struct Tile8 {  // unpack, shuffle, then the 128-bit halves recombined
  static void run(const float* const* p, long long j, float* dst, long long ncp) {
    __m256 r[8], t[8];
    for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(p[i] + j);
    for (int i = 0; i < 8; i += 2) {
      t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
      t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) {
      r[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
      r[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
      r[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
      r[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
    }
    for (int i = 0; i < 4; ++i) {  // cells j + i and j + 4 + i
      _mm256_storeu_ps(dst + (j + i) * ncp, _mm256_permute2f128_ps(r[i], r[i + 4], 0x20));
      _mm256_storeu_ps(dst + (j + 4 + i) * ncp, _mm256_permute2f128_ps(r[i], r[i + 4], 0x31));
    }
  }
};
#else
struct Tile4 {
  static void run(const float* const* p, long long j, float* dst, long long ncp) {
    __m128 a = _mm_loadu_ps(p[0] + j), b = _mm_loadu_ps(p[1] + j);
    __m128 e = _mm_loadu_ps(p[2] + j), f = _mm_loadu_ps(p[3] + j);
    _MM_TRANSPOSE4_PS(a, b, e, f);
    _mm_storeu_ps(dst + j * ncp, a);
    _mm_storeu_ps(dst + (j + 1) * ncp, b);
    _mm_storeu_ps(dst + (j + 2) * ncp, e);
    _mm_storeu_ps(dst + (j + 3) * ncp, f);
  }
};
#endif

template <>
struct ChannelsLast<float, float> {
  static void run(float* cells, const float* const* planes, int C, long long HW, int ncp) {
#if defined(__AVX__)
    channels_last_tiles<8, Tile8>(cells, planes, C, HW, ncp);
#else
    channels_last_tiles<4, Tile4>(cells, planes, C, HW, ncp);
#endif
  }
};
#endif

// The inverse move: out[c * plane_out + k] = staged[k * GL + c] for c < lanes, k < PQ
// (a roi's bins staged lanes-contiguous, LaneWalk::each_group_staged, to its output
// planes).  float: the same K x K tiles, each reading K staged rows and writing K planes
// (measured alone, 16 rois x 64 channels x 49 bins: 14.7 us as channel-strided scalar
// stores, 4.6 us as 8 x 8 AVX tiles); the rest, and other types, one value at a time.
template <typename U>
struct StagedToPlanes {
  static void run(const U* staged, int GL, long long PQ, int lanes, U* out,
                  long long plane_out) {
    for (int c = 0; c < lanes; ++c, out += plane_out)
      for (long long k = 0; k < PQ; ++k) out[k] = staged[k * GL + c];
  }
};

#if defined(__SSE2__)
template <>
struct StagedToPlanes<float> {
  static void run(const float* staged, int GL, long long PQ, int lanes, float* out,
                  long long plane_out) {
#if defined(__AVX__)
    const int K = 8;
    typedef Tile8 Tile;
#else
    const int K = 4;
    typedef Tile4 Tile;
#endif
    const long long PK = PQ / K * K;
    const int LK = lanes / K * K;
    for (long long k = 0; k < PK; k += K)
      for (int c = 0; c < LK; c += K) {
        const float* rows[K];
        for (int i = 0; i < K; ++i) rows[i] = staged + (k + i) * GL + c;
        Tile::run(rows, 0, out + c * plane_out + k, plane_out);
      }
    for (int c = 0; c < lanes; ++c)  // the tiles' leftovers: channels >= LK, bins >= PK
      for (long long k = c < LK ? PK : 0; k < PQ; ++k)
        out[c * plane_out + k] = staged[k * GL + c];
  }
};
#endif

// The staged copies below (a forward's outputs, a backward's out-grad) hold at most this
// many bins at a time: their memory stays that of a few hundred bins (64 KB of float
// lanes a pass) whatever the pool (a (3000, 3000) pool is 9M bins).
#ifndef MX_ROI_STAGED_BINS
#define MX_ROI_STAGED_BINS 256
#endif

// GradBlock::add_to moves a block of at least this many lanes a cell to the gradient
// planes in tiles, a narrower one plane by plane (measured there).
// -DMX_ROI_ADD_TILED_LANES=1000000: always plane by plane (a test).
#ifndef MX_ROI_ADD_TILED_LANES
#define MX_ROI_ADD_TILED_LANES 32
#endif

// A backward's out-grad of one roi's 16-channel pass, bin-major and loaded as A: at(k)
// points at bin k's LANES values, channel c at at(k)[c] = go[c * plane_out + k] for c <
// lanes, copied MX_ROI_STAGED_BINS bins at a time with ChannelsLast's tiles as the bins
// are asked for in increasing order; the lanes past ``lanes`` hold 0 or a copy of a real
// lane and feed only the padding lanes of a GradBlock, which no gradient plane
// receives.  Read bin by bin from the planes, each bin was 16 channel-strided scalar
// loads.  Thread-local storage, reused: ``slot`` (< PASS_ROWS_SLOTS) picks the buffer, so
// that the passes of a group (several PassRows alive at once) each have their own.
const int PASS_ROWS_SLOTS = 4;
template <typename T, typename A>
struct PassRows {
  const T* go;
  long long plane_out, k0 = 0, k1 = 0;
  int lanes;
  A* rows;
  const T* planes[LANES];
  PassRows(const T* go_, long long plane_out_, int lanes_, int slot = 0)
      : go(go_), plane_out(plane_out_), lanes(lanes_) {
    static thread_local LaneBuffer<A> buf[PASS_ROWS_SLOTS];
    buf[slot].resize((size_t)MX_ROI_STAGED_BINS * LANES);
    rows = buf[slot].data();
  }
  PassRows() : go(nullptr), plane_out(0), lanes(0), rows(nullptr) {}
  const A* at(long long k) {
    if (k < k0 || k >= k1) {
      k0 = k;
      k1 = k + MX_ROI_STAGED_BINS < plane_out ? k + MX_ROI_STAGED_BINS : plane_out;
      if (lanes < LANES) std::fill(rows, rows + (k1 - k0) * LANES, (A)0);
      for (int c = 0; c < lanes; ++c) planes[c] = go + c * plane_out + k0;
      ChannelsLast<T, A>::run(rows, planes, lanes, k1 - k0, LANES);
    }
    return rows + (k - k0) * LANES;
  }
};

// The block [mx_roi_c_begin, mx_roi_c_end) of every image a roi reads, channels-last and
// loaded as A: element (b, k, c) at (b * H*W + k) * padded_lanes(nc) + c - c_begin; the
// padding lanes are 0 (computed, never stored).  Thread-local storage, reused.
template <typename T, typename A>
const A* channels_last_block(const T* data, const int* batch, long long R, int C, int H,
                             int W) {
  const int c0 = mx_roi_c_begin, nc = mx_roi_c_end - mx_roi_c_begin, ncp = padded_lanes(nc);
  const long long HW = (long long)H * W;
  const int images = images_read(batch, R);
  static thread_local LaneBuffer<A> cells;
  cells.resize((size_t)images * HW * ncp);
  static thread_local std::vector<const T*> planes;
  planes.resize((size_t)nc);
  for (int b = 0; b < images; ++b) {
    A* img = cells.data() + (size_t)b * HW * ncp;
    for (int c = 0; c < nc; ++c) planes[c] = data + plane_offset(b, c0 + c, C, H, W);
    ChannelsLast<T, A>::run(img, planes.data(), nc, HW, ncp);
    if (nc < ncp)  // the padding lanes: 0
      for (long long k = 0; k < HW; ++k)
        for (int c = nc; c < ncp; ++c) img[k * ncp + c] = (A)0;
  }
  return cells.data();
}

// The calling thread's channel block [c0, c0 + nc) of the input gradient of every image
// a roi writes, channels-last (channels_last_block's layout: cell k of image b at
// (b * H*W + k) * ncp), zeroed.  A native backward adds a 16-channel pass's
// contributions into cells it keeps in L1 (a cell's lanes share one 64-byte line),
// instead of into 16 gradient planes, and add_to() then adds the block to the planes.
// Per channel: the same contributions in the same order onto a zero start, and the
// planes start at zero (the native backward always accumulates into a zeroed buffer), so
// the same bits as adding to the planes directly.  Thread-local storage, reused.
template <typename A>
struct GradBlock {
  long long HW;
  int c0, nc, ncp, images;
  A* cells;
  GradBlock(const int* batch, long long R, int H, int W)
      : HW((long long)H * W), c0(mx_roi_c_begin), nc(mx_roi_c_end - mx_roi_c_begin),
        ncp(padded_lanes(nc)), images(images_read(batch, R)) {
    static thread_local LaneBuffer<A> block;
    block.assign((size_t)images * HW * ncp, (A)0);
    cells = block.data();
  }
  A* image(int b) const { return cells + (size_t)b * HW * ncp; }
  template <typename O>
  void add_to(O* bottom, int C, int H, int W, double scale) const {
    if (ncp < MX_ROI_ADD_TILED_LANES) {
      // one 16-channel pass: plane by plane, the block's lines read in order (on the 38 x
      // 50 bench's backwards on two threads, 16-channel blocks, the tiles below were up to
      // 20% slower: ROIAlign max; python -m mx_roi.bench.kernel_ab)
      for (int b = 0; b < images; ++b) {
        const A* img = image(b);
        for (int c = 0; c < nc; ++c) {
          O* plane = bottom + plane_offset(b, c0 + c, C, H, W);
          for (long long k = 0; k < HW; ++k) grad_add(plane + k, img[k * ncp + c], scale);
        }
      }
      return;
    }
    // more lanes: 8 channels x 256 cells at a time moved to planes in L1 (StagedToPlanes'
    // tiles), then added to the 8 gradient planes.  Plane by plane, each value was a load
    // ncp lanes away from the last: ROIAlign's small backward (64 channels x 475 cells)
    // spent 17 of its 75 us on it, the bench's on one thread (64-channel blocks) ~5% more
    // than with the tiles.  Either way the same grad_add of the same values in the same
    // order per element.
    const int TC = 8, TK = 256;
    static thread_local LaneBuffer<A> tile;  // (TC, TK)
    tile.resize((size_t)TC * TK);
    A* const t = tile.data();
    for (int b = 0; b < images; ++b) {
      const A* img = image(b);
      for (int ct = 0; ct < nc; ct += TC) {
        const int lanes = nc - ct < TC ? nc - ct : TC;
        for (long long k0 = 0; k0 < HW; k0 += TK) {
          const long long kb = HW - k0 < TK ? HW - k0 : TK;
          StagedToPlanes<A>::run(img + k0 * ncp + ct, ncp, kb, lanes, t, TK);
          for (int c = 0; c < lanes; ++c) {
            O* plane = bottom + plane_offset(b, c0 + ct + c, C, H, W) + k0;
            const A* tc = t + c * TK;
            for (long long k = 0; k < kb; ++k) grad_add(plane + k, tc[k], scale);
          }
        }
      }
    }
  }
};

// The outputs of bins [k0, k1) staged (bin, roi, channel) to the (R, C, P*Q) output:
// one contiguous run of bins per roi and channel.  Stored bin by bin straight into the
// output, each store is channel-strided and costs a cache miss once the output is cold
// (as it is after MXNet's op ran; R-FCN 7x7 bench, calls interleaved with MXNet's, kernel
// on 1 / 2 threads: PSROIAlign channels-last 5.0 -> 4.2 / 3.0 -> 2.6 ms, PSROIPooling
// 3.55 -> 3.32 / 2.38 -> 2.28 ms).
template <typename T>
void staged_to_output(const T* staged, long long R, int C, long long plane_out, long long k0,
                      long long k1, T* out) {
  for (long long r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) {
      T* o = out + (r * C + c) * plane_out;
      const T* s = staged + r * C + c;
      for (long long k = k0; k < k1; ++k) o[k] = s[(k - k0) * R * C];
    }
}

// The bins [k0, k1) of the calling thread's share (its channels' share of the P*Q bins)
// for the two walks below: ``at_bin(k, p, q)`` once per bin, then ``at_roi(r, b, p, q, k,
// o)`` for every roi r of an image b >= 0, which stores the roi's C outputs of bin k at
// o[c]; a negative batch index gives 0.  The outputs are staged (staged_to_output).
template <typename T, typename A, typename AtBin, typename AtRoi>
void ps_bins_staged(const int* batch, int C, int P, int Q, T* out, long long n, AtBin&& at_bin,
                    AtRoi&& at_roi) {
  const long long plane_out = (long long)P * Q, R = launch_rois(n, C, P, Q);
  if (R <= 0) return;
  const long long k0 = mx_roi_c_begin * plane_out / C, k1 = mx_roi_c_end * plane_out / C;
  if (k1 <= k0) return;
  static thread_local LaneBuffer<T> staged;  // (k1 - k0, R, C): the block's outputs
  staged.resize((size_t)((k1 - k0) * R * C));
  for (long long k = k0; k < k1; ++k) {
    const int p = (int)(k / Q), q = (int)(k % Q);
    at_bin(k, p, q);
    for (long long r = 0; r < R; ++r) {
      T* o = staged.data() + ((k - k0) * R + r) * C;
      const int b = batch[r];
      if (b < 0) {
        for (int c = 0; c < C; ++c) o[c] = Traits<T>::store((A)0);
        continue;
      }
      at_roi(r, b, p, q, k, o);
    }
  }
  staged_to_output(staged.data(), R, C, plane_out, k0, k1, out);
}

// The items of the calling thread's channel block [mx_roi_c_begin, mx_roi_c_end) in the
// flat index's order -- roi, channel, bin, as the GPU and the emulation number them --:
// ``f(it)`` for each.  The position-sensitive backwards walk them so on a map that fits
// in cache (hint_map false), where ItemLoop's bin-major order and its hints only cost
// time (measured, one thread, the bench's small backward -- 16 rois 7x7 on a 49-channel
// 19x25 map, one output channel: PSROIPooling 7.2-8.1 -> 5.8-6.5 us, PSROIAlign with 2x2
// samples a bin 13.7-14.0 -> 12.2-12.8 us).  The threads still own whole channels, and
// each input-gradient cell still takes its adds in one order (roi, then bin) whatever
// their count.
template <typename F>
void ps_items_by_roi(long long n, int C, int P, int Q, F&& f) {
  const long long plane_out = (long long)P * Q, R = launch_rois(n, C, P, Q);
  Item it;
  for (it.r = 0; it.r < R; ++it.r)
    for (it.c = mx_roi_c_begin; it.c < mx_roi_c_end; ++it.c) {
      it.i = (it.r * C + it.c) * plane_out;
      for (it.p = 0; it.p < P; ++it.p)
        for (it.q = 0; it.q < Q; ++it.q, ++it.i) f((const Item&)it);
    }
}

// The native forward of a position-sensitive op on a map that fits in cache (hint_map
// false: no hints needed, and the bin-major order of ps_forward_native buys nothing):
// the calling thread's channel block roi by roi in the output's order, ``value(r, p, q,
// plane)`` the output of roi r's bin (p, q) read from its plane, stored in place; a
// negative batch index gives 0.  (Measured, one thread, the bench's small call -- 16
// rois 7x7 on a 49-channel 19x25 map, one output channel, bin-major -> this walk:
// PSROIPooling 6.6-7.6 -> 4.1-4.7 us, PSROIAlign 2x2 samples 9.5-10.6 -> 6.1-6.8 us,
// adaptive 8.9 -> 6.1-6.9 us; storing a skipped roi's zeros inside the bin loop instead,
// 9.8 and 6.0-6.5 us.)
template <typename T, typename A, typename Value>
void ps_forward_small_map(const T* data, const int* batch, const int* channel_map, int C,
                          int Cin, int H, int W, int P, int Q, T* out, long long n,
                          Value&& value) {
  const long long plane_out = (long long)P * Q, R = launch_rois(n, C, P, Q);
  const long long HW = (long long)H * W;
  for (long long r = 0; r < R; ++r) {
    const int b = batch[r];
    for (int c = mx_roi_c_begin; c < mx_roi_c_end; ++c) {
      T* const o = out + (r * C + c) * plane_out;
      if (b < 0) {
        for (long long k = 0; k < plane_out; ++k) o[k] = Traits<T>::store((A)0);
        continue;
      }
      const T* const image = data + plane_offset(b, 0, Cin, H, W);
      const int* const cm = channel_map + c * plane_out;
      for (int p = 0; p < P; ++p)
        for (int q = 0; q < Q; ++q)
          o[p * Q + q] = Traits<T>::store((A)value(r, p, q, image + cm[p * Q + q] * HW));
    }
  }
}

// The native forward of a position-sensitive op (each output channel c of bin (p, q)
// reads its own input plane channel_map[c, p, q]): bin by bin, roi by roi, every output
// channel of the bin.  ``bin(r, p, q, k)`` (k = p * Q + q) prepares roi r's bin once --
// e.g. its samples' taps and weights -- and returns ``value(plane)``, the output read
// from one plane (A), which is then called for every channel; while a bin's rois are
// read, each roi hints two lines of the planes of the next bin (its image's: PlaneHint),
// which would otherwise come from memory item by item.  A forward writes each output
// once, so the threads need not split channels: the launch's share [c0, c1) of the C
// channels stands for the same share of the P*Q bins, all channels each (blocks of one
// or two of the 21 channels of an R-FCN head would prepare every bin once per block).
// (Measured, 2-vCPU VM, R-FCN 7x7 / 256 rois, one thread: PSROIAlign 6.1 -> 4.1 ms,
// PSROIPooling 4.2 -> 2.6 ms; walking a bin's rois channel by channel instead, with
// every roi prepared first, was no faster for PSROIAlign and 20% slower for
// PSROIPooling.)  The outputs are staged (staged_to_output).  A negative batch index
// gives 0.
template <typename T, typename A, typename Bin>
void ps_forward_native(const T* data, const int* batch, const int* channel_map, int C, int Cin,
                       int H, int W, int P, int Q, T* out, long long n, Bin&& bin) {
  const long long plane_out = (long long)P * Q;
  ps_bins_staged<T, A>(
      batch, C, P, Q, out, n, [](long long, int, int) {},
      [&](long long r, int b, int p, int q, long long k, T* o) {
        const long long kn = k + 1 < plane_out ? k + 1 : k;  // the next bin
        const auto value = bin(r, p, q, k);
        const PlaneHint<T> hint(r, Cin, H, W);
        for (int c = 0; c < C; ++c) {
          const int* cm = channel_map + (long long)c * plane_out;
          if (hint.on) hint(data + plane_offset(b, cm[kn], Cin, H, W), false);
          o[c] = Traits<T>::store(value(data + plane_offset(b, cm[k], Cin, H, W)));
        }
      });
}

// The other native walk of a position-sensitive forward, for many reads per input cell (a
// detector's hundreds of rois on a map): each bin's C planes (per image a roi reads) are
// first copied channels-last -- cell (b, y, x) holding the C channels' values side by
// side, padded to a multiple of 8 lanes (computed, never stored) --, then
// ``roi_bin(r, p, q, k, ncp)`` prepares roi r's bin k and returns ``pass(lane, res)``,
// which computes 8 channels' outputs res[0..8) from the copy at their first lane (cell
// i's channel c at lane[i * ncp + c]): called for channels 0, 8, ... of the roi's image.
// Bins are split, and the outputs staged, as by ps_forward_native (ps_bins_staged).
template <typename T, typename A, typename RoiBin>
void ps_forward_channels_last(const T* data, const int* batch, const int* channel_map, int C,
                              int Cin, int H, int W, int P, int Q, T* out, long long n,
                              RoiBin&& roi_bin) {
  const long long plane_out = (long long)P * Q, R = launch_rois(n, C, P, Q);
  const long long HW = (long long)H * W;
  if (R <= 0) return;
  const int images = images_read(batch, R);
  static thread_local std::vector<char> used;  // the images a roi reads
  used.assign((size_t)images, 0);
  for (long long r = 0; r < R; ++r)
    if (batch[r] >= 0) used[batch[r]] = 1;
  const int ncp = (C + 7) / 8 * 8;
  static thread_local LaneBuffer<A> block;  // (images, H*W, ncp)
  static thread_local int block_ncp = 0;     // the lane count block was zeroed for
  static thread_local std::vector<const T*> planes;
  // zeroed only when the layout changes (a launch calls this once per block of channels,
  // 16 times on 2 threads: a 365 KB memset each time for the R-FCN bench): the padding
  // lanes are never written, and every real lane of a bin is written before it is read
  if (block.size() != (size_t)(images * HW * ncp) || block_ncp != ncp) {
    block.assign((size_t)(images * HW * ncp), (A)0);
    block_ncp = ncp;
  }
  planes.resize((size_t)C);
  A* const cells = block.data();
  ps_bins_staged<T, A>(
      batch, C, P, Q, out, n,
      [&](long long k, int, int) {
        for (int b = 0; b < images; ++b) {
          if (!used[b]) continue;
          for (int c = 0; c < C; ++c)
            planes[c] = data + plane_offset(b, channel_map[c * plane_out + k], Cin, H, W);
          ChannelsLast<T, A>::run(cells + (size_t)b * HW * ncp, planes.data(), C, HW, ncp);
        }
      },
      [&](long long r, int b, int p, int q, long long k, T* o) {
        const A* img = cells + (size_t)b * HW * ncp;
        const auto pass = roi_bin(r, p, q, k, ncp);
        for (int cc = 0; cc < C; cc += 8) {
          A res[8];
          pass(img + cc, res);
          const int lanes = C - cc < 8 ? C - cc : 8;
          for (int c = 0; c < lanes; ++c) o[cc + c] = Traits<T>::store(res[c]);
        }
      });
}

// The native walk of a per-channel kernel over its launch: R rois of C channels x (P, Q)
// outputs, the calling thread's channel block [c0, c0 + nc) channels-last in ``cells``
// (lanes padded to ncp), ``image(b)`` the cells of image b (null for a skipped roi).
template <typename T, typename A>
struct LaneWalk {
  long long plane_out, R, HW;
  int c0, nc, ncp;
  const A* cells;
  LaneWalk(const T* data, const int* batch, int C, int H, int W, int P, int Q, long long n)
      : plane_out((long long)P * Q), R(launch_rois(n, C, P, Q)), HW((long long)H * W),
        c0(mx_roi_c_begin), nc(mx_roi_c_end - mx_roi_c_begin), ncp(padded_lanes(nc)),
        cells(nullptr) {
    if (R > 0 && nc > 0) cells = channels_last_block<T, A>(data, batch, R, C, H, W);
  }
  bool empty() const { return R <= 0 || nc <= 0; }  // (cells is null when no roi reads)
  const A* image(int b) const { return b >= 0 ? cells + (size_t)b * HW * ncp : nullptr; }
  // For a forward, every bin of every roi over groups of up to GROUP 16-channel passes
  // (roi by roi, then group by group: a group's cells stay in L1 from bin to bin), with
  // the bins' outputs staged.  f(r, cc, passes, lanes, p, q, img, s, a) gets the group's first channel cc,
  // its 16-channel passes (1..GROUP) and real channels (lanes <= 16 * passes), so that a
  // kernel takes a sample's taps once for the group's channels instead of once per pass
  // (a group of 4, 64 channels or 4 lines a cell, still stays in L1 from bin to bin for
  // a roi of a few hundred cells); it stores the group's channel cc + c of the bin at
  // s[c] (c < 16 * passes; lanes past ``lanes`` are scratch), and the walk moves every
  // MX_ROI_STAGED_BINS staged bins to ``out``, plane by plane (StagedToPlanes' tiles).
  // Stored straight into the output, every value was a channel-strided scalar store
  // (python -m mx_roi.bench.kernel_ab, 256 channels, 7x7, 256 rois, inference on one
  // thread: ROIAlign average 32%, RROIAlign 17%, PrRoIPool 15% faster staged).  A second
  // output (the argmax: ``aux``, in the (R, C, P, Q) layout of ``out``; null: none) is
  // stored directly, channel c at a[c * plane_out]: its small index types have no tiles,
  // and moved one at a time it cost more than it saved (max forwards ~15% slower).
  // Values are moved, never changed: the same bits.
  template <int GROUP, typename U, typename V, typename F>
  void each_group_staged(const int* batch, int C, int P, int Q, U* out, V* aux, F&& f) const {
    if (empty()) return;
    const int GL = GROUP * LANES;
    static thread_local LaneBuffer<U> staged;  // (MX_ROI_STAGED_BINS, GL)
    staged.resize((size_t)MX_ROI_STAGED_BINS * GL);
    U* const s = staged.data();
    for (long long r = 0; r < R; ++r) {
      const A* img = image(batch[r]);
      for (int cc = 0; cc < ncp; cc += GL) {
        const int left = (ncp - cc) / LANES, passes = left < GROUP ? left : GROUP;
        const int lanes = nc - cc < passes * LANES ? nc - cc : passes * LANES;
        const long long at = (r * C + c0 + cc) * plane_out;
        long long k0 = 0;  // the staged bins: [k0, k)
        int p = 0, q = 0;
        for (long long k = 0; k < plane_out; ++k) {
          f(r, cc, passes, lanes, p, q, img, s + (k - k0) * GL, aux ? aux + at + k : nullptr);
          if (++q == Q) q = 0, ++p;
          if (k + 1 - k0 == MX_ROI_STAGED_BINS || k + 1 == plane_out) {
            StagedToPlanes<U>::run(s, GL, k + 1 - k0, lanes, out + at + k0, plane_out);
            k0 = k + 1;
          }
        }
      }
    }
  }
  // each_group_staged with groups of one pass: f(r, cc, lanes, p, q, img, s, a)
  template <typename U, typename V, typename F>
  void each_pass_staged(const int* batch, int C, int P, int Q, U* out, V* aux, F&& f) const {
    each_group_staged<1>(batch, C, P, Q, out, aux,
                         [&](long long r, int cc, int, int lanes, int p, int q, const A* img,
                             U* so, V* sa) { f(r, cc, lanes, p, q, img, so, sa); });
  }
};

// The float lanes' vector: 8 floats (one AVX register) where the build targets AVX
// (mx_roi.cuda.loader adds -mavx2 on a CPU that has it), else 4 (SSE); VN of them make
// the LANES = 16 channels.  Per lane the same operations either way: the same bits.
#ifdef __AVX__
const int VW = 8;
#else
const int VW = 4;
#endif
const int VN = LANES / VW;
typedef float vf __attribute__((vector_size(4 * VW)));
typedef int vi __attribute__((vector_size(4 * VW)));
}  // namespace mx_roi
// the float lanes' vector width of this build (tests read it: mx_roi.cuda.loader)
extern "C" const int mx_roi_float_vector_width = mx_roi::VW;
namespace mx_roi {

// The running max and argmax of L = 16 channels (lanes) over a bin's cells: strict '>'
// per lane, the first maximum wins and NaN never does.  float: VN vectors of VW lanes (GCC /
// Clang vector extensions; g++ does not vectorise the scalar form with its argmax);
// other types: scalar lanes.  The argmax is an int (the caller's bin-relative index k, or
// -1): index<I>(c) converts it to the kernel's storage type I (index_store).
template <typename A>
struct MaxLanes {
  A best[16];
  int arg[16];
  void init() {
    for (int c = 0; c < 16; ++c) {
      best[c] = max_init<A>();
      arg[c] = -1;
    }
  }
  void step(const A* v, int k) {
    for (int c = 0; c < 16; ++c) max_step(v[c], best[c], k, arg[c]);
  }
  A value(int c) const { return best[c]; }
  void store(A* dst) const {  // the 16 maxima to dst[0..16)
    for (int c = 0; c < 16; ++c) dst[c] = best[c];
  }
  template <typename I>
  I index(int c) const { return index_store<I>(arg[c]); }
};


template <>
struct MaxLanes<float> {
  vf best[VN];
  vi arg[VN];
  void init() {
    for (int i = 0; i < VN; ++i) {
      best[i] = vf{} + max_init<float>();
      arg[i] = vi{} - 1;
    }
  }
  void step(const float* v, int k) {
    const vi kv = vi{} + k;
    for (int i = 0; i < VN; ++i) {
      vf x;
      memcpy(&x, v + VW * i, sizeof x);
      const vi take = x > best[i];  // -1 where strictly greater (NaN: 0)
      best[i] = take ? x : best[i];
      arg[i] = take ? kv : arg[i];
    }
  }
  float value(int c) const { return best[c / VW][c % VW]; }
  void store(float* dst) const {  // one vector store each
    for (int i = 0; i < VN; ++i) memcpy(dst + VW * i, &best[i], sizeof best[i]);
  }
  template <typename I>
  I index(int c) const { return index_store<I>(arg[c / VW][c % VW]); }
};

// MaxLanes without the argmax (an inference forward keeps none): the same strict '>'
// per lane, the same maxima.  float: max_ps(x, best) is (x > best ? x : best) with
// best kept where x is NaN -- MaxLanes' rule in one instruction instead of a compare
// and a blend.
template <typename A>
struct MaxValueLanes {
  A best[16];
  void init() {
    for (int c = 0; c < 16; ++c) best[c] = max_init<A>();
  }
  void step(const A* v, int) {
    for (int c = 0; c < 16; ++c) best[c] = v[c] > best[c] ? v[c] : best[c];
  }
  A value(int c) const { return best[c]; }
  void store(A* dst) const {
    for (int c = 0; c < 16; ++c) dst[c] = best[c];
  }
};

template <>
struct MaxValueLanes<float> {
  vf best[VN];
  void init() {
    for (int i = 0; i < VN; ++i) best[i] = vf{} + max_init<float>();
  }
  void step(const float* v, int) {
    for (int i = 0; i < VN; ++i) {
#if defined(__AVX__)
      best[i] = (vf)_mm256_max_ps(_mm256_loadu_ps(v + VW * i), (__m256)best[i]);
#elif defined(__SSE2__)
      best[i] = (vf)_mm_max_ps(_mm_loadu_ps(v + VW * i), (__m128)best[i]);
#else
      vf x;
      memcpy(&x, v + VW * i, sizeof x);
      best[i] = x > best[i] ? x : best[i];
#endif
    }
  }
  float value(int c) const { return best[c / VW][c % VW]; }
  void store(float* dst) const {  // one vector store each
    for (int i = 0; i < VN; ++i) memcpy(dst + VW * i, &best[i], sizeof best[i]);
  }
};

// v[c] = (w1*v1[c] + w2*v2[c]) + w3*v3[c] + w4*v4[c] for 16 lanes: sample_value per lane,
// its operations in its order.  float: VN vectors of VW lanes.
template <typename A>
struct InterpLanes {
  static void run(A* v, const A* v1, const A* v2, const A* v3, const A* v4, A w1, A w2, A w3,
                  A w4) {
    for (int c = 0; c < 16; ++c) v[c] = (w1 * v1[c] + w2 * v2[c]) + w3 * v3[c] + w4 * v4[c];
  }
};

// One vector of VW lanes of sample_value: (w1*v1 + w2*v2) + w3*v3 + w4*v4, the four tap
// vectors read unaligned (InterpLanes, PSROIAlign's PsLanes).
inline vf interp_vector(const float* v1, const float* v2, const float* v3, const float* v4,
                        float w1, float w2, float w3, float w4) {
  vf a, b, c, d;
  memcpy(&a, v1, sizeof a);
  memcpy(&b, v2, sizeof b);
  memcpy(&c, v3, sizeof c);
  memcpy(&d, v4, sizeof d);
  return (w1 * a + w2 * b) + w3 * c + w4 * d;
}

template <>
struct InterpLanes<float> {
  static void run(float* v, const float* v1, const float* v2, const float* v3, const float* v4,
                  float w1, float w2, float w3, float w4) {
    for (int i = 0; i < VN; ++i) {
      const int o = VW * i;
      const vf r = interp_vector(v1 + o, v2 + o, v3 + o, v4 + o, w1, w2, w3, w4);
      memcpy(v + o, &r, sizeof r);
    }
  }
};

// The running sum of a bin's bilinear samples for LANES channels: per lane
// (w1*v1 + w2*v2) + w3*v3 + w4*v4 added in sample order, then / divisor (sample_value,
// align_avg_forward_item).  float: VN vectors of VW lanes; other types: scalar lanes.
template <typename A>
struct SumLanes {
  A sum[16];
  void zero() {
    for (int c = 0; c < 16; ++c) sum[c] = 0;
  }
  void add(const A* v1, const A* v2, const A* v3, const A* v4, A w1, A w2, A w3, A w4) {
    A v[16];
    InterpLanes<A>::run(v, v1, v2, v3, v4, w1, w2, w3, w4);
    for (int c = 0; c < 16; ++c) sum[c] += v[c];
  }
  void divide(A d) {
    for (int c = 0; c < 16; ++c) sum[c] = sum[c] / d;
  }
  A value(int c) const { return sum[c]; }
  void store(A* dst) const {  // the 16 lanes to dst[0..16)
    for (int c = 0; c < 16; ++c) dst[c] = sum[c];
  }
};

template <>
struct SumLanes<float> {
  vf sum[VN];
  void zero() {
    for (int i = 0; i < VN; ++i) sum[i] = vf{};
  }
  void add(const float* v1, const float* v2, const float* v3, const float* v4, float w1,
           float w2, float w3, float w4) {
    float v[16];
    InterpLanes<float>::run(v, v1, v2, v3, v4, w1, w2, w3, w4);
    for (int i = 0; i < VN; ++i) {
      vf x;
      memcpy(&x, v + VW * i, sizeof x);
      sum[i] += x;
    }
  }
  void divide(float d) {
    for (int i = 0; i < VN; ++i) sum[i] = sum[i] / d;
  }
  float value(int c) const { return sum[c / VW][c % VW]; }
  void store(float* dst) const {  // one vector store each (a memcpy of the array went
    for (int i = 0; i < VN; ++i)  // through the stack and general registers)
      memcpy(dst + VW * i, &sum[i], sizeof sum[i]);
  }
};

// The 16 lanes of a MaxLanes / SumLanes to a staged row dst[0..16) as T: vector stores
// where T is the lanes' type, else one conversion (Traits<T>::store) per lane.
template <typename T, typename A, template <typename> class M>
void store_lanes(const M<A>& m, T* dst) {
  if (std::is_same<T, A>::value)
    m.store(reinterpret_cast<A*>(dst));
  else
    for (int c = 0; c < 16; ++c) dst[c] = Traits<T>::store(m.value(c));
}

// dst[c] += g[c] * w for LANES channels (a gradient scattered to one tap: the product,
// then the sum, as grad_add(dst, g * w)).  float: VN vectors of VW lanes.
template <typename A>
struct AddLanes {
  static void run(A* dst, const A* g, A w) {
    for (int c = 0; c < 16; ++c) dst[c] += g[c] * w;
  }
};

template <>
struct AddLanes<float> {
  static void run(float* dst, const float* g, float w) {
    for (int i = 0; i < VN; ++i) {
      vf a, b;
      memcpy(&a, dst + VW * i, sizeof a);
      memcpy(&b, g + VW * i, sizeof b);
      a += b * w;
      memcpy(dst + VW * i, &a, sizeof a);
    }
  }
};
#endif

// ---- average over the samples of a bin (ROIAlign avg, PSROIAlign) --------------------
// out[i] = sum over iy < y_count[r,p], ix < x_count[r,q] of sample_value / divisor[r,p,q]
template <typename T, typename A>
__device__ __forceinline__ void align_avg_forward_item(
    const Item& it, const T* data, const int* batch, const int* channel_map,
    const int* y_count, const int* y_low, const int* y_high, const A* y_wl, const A* y_wh,
    const int* x_count, const int* x_low, const int* x_high, const A* x_wl, const A* x_wh,
    const A* divisor, int C, int Cin, int H, int W, int P, int Q, int Gy, int Gx, T* out) {
  const int b = batch[it.r];
  A sum = 0;
  if (b >= 0) {
    const T* plane = data + plane_offset(b, in_channel(channel_map, it, P, Q), Cin, H, W);
    prefetch_next_plane(data, channel_map, it, C, Cin, H, W, P, Q, b, false);
    const int ny = y_count[it.r * P + it.p], nx = x_count[it.r * Q + it.q];
    const long long yb = (it.r * P + it.p) * (long long)Gy;
    const long long xb = (it.r * Q + it.q) * (long long)Gx;
    for (int iy = 0; iy < ny; ++iy) {
      for (int ix = 0; ix < nx; ++ix) {
        sum += sample_value(plane, W, sample_at(yb, xb, iy, ix, y_low, y_high, y_wl, y_wh,
                                                x_low, x_high, x_wl, x_wh));
      }
    }
    sum = sum / divisor[(it.r * P + it.p) * Q + it.q];
  }
  out[it.i] = Traits<T>::store(sum);
}

template <typename T, typename A, typename O>
__device__ __forceinline__ void align_avg_backward_item(
    const Item& it, const T* grad, const int* batch, const int* channel_map,
    const int* y_count, const int* y_low, const int* y_high, const A* y_wl, const A* y_wh,
    const int* x_count, const int* x_low, const int* x_high, const A* x_wl, const A* x_wh,
    const A* divisor, int C, int Cin, int H, int W, int P, int Q, int Gy, int Gx, O* bottom,
    double scale) {
  const int b = batch[it.r];
  if (b < 0) return;
  const A g = (A)Traits<T>::load(grad[it.i]) / divisor[(it.r * P + it.p) * Q + it.q];
  O* plane = bottom + plane_offset(b, in_channel(channel_map, it, P, Q), Cin, H, W);
  prefetch_next_plane(bottom, channel_map, it, C, Cin, H, W, P, Q, b, true);
  const int ny = y_count[it.r * P + it.p], nx = x_count[it.r * Q + it.q];
  const long long yb = (it.r * P + it.p) * (long long)Gy;
  const long long xb = (it.r * Q + it.q) * (long long)Gx;
  for (int iy = 0; iy < ny; ++iy) {
    for (int ix = 0; ix < nx; ++ix) {
      sample_backward(plane, W, sample_at(yb, xb, iy, ix, y_low, y_high, y_wl, y_wh, x_low,
                                          x_high, x_wl, x_wh), g, scale);
    }
  }
}

}  // namespace mx_roi

// ==== geometry: the compiled twin of mx_roi/geometry.py ================================
// The bins and sample points of every op, per roi, as __host__ __device__ functions in
// the compute dtype A and in geometry.py's operation order (NumPy's semantics spelled
// out: np.maximum/np.minimum propagate NaN and return the second operand on a tie,
// np.fmax/np.fmin ignore NaN, a float -> int32 cast of NaN or an out-of-range value gives
// INT_MIN, int32 sums and products wrap), so that the tables they fill are geometry.py's
// bit for bit -- tests/test_geometry_compiled.py proves it on random grids of every dtype
// and mode through the host entry points mx_roi_geometry_counts / _fill below.
namespace mx_roi {
namespace geo {

__device__ __forceinline__ float floor_(float v) { return floorf(v); }
__device__ __forceinline__ double floor_(double v) { return floor(v); }
__device__ __forceinline__ float ceil_(float v) { return ceilf(v); }
__device__ __forceinline__ double ceil_(double v) { return ceil(v); }
__device__ __forceinline__ float trunc_(float v) { return truncf(v); }
__device__ __forceinline__ double trunc_(double v) { return trunc(v); }
__device__ __forceinline__ float fabs_(float v) { return fabsf(v); }
__device__ __forceinline__ double fabs_(double v) { return fabs(v); }

// np.maximum / np.minimum: NaN if either is NaN, else the larger / smaller; on a tie
// (-0 vs +0) the second operand, as NumPy's SIMD loops give it
template <typename A>
__device__ __forceinline__ A np_maximum(A a, A b) { return (a > b || a != a) ? a : b; }
template <typename A>
__device__ __forceinline__ A np_minimum(A a, A b) { return (a < b || a != a) ? a : b; }
// np.fmax / np.fmin: a NaN operand is ignored
template <typename A>
__device__ __forceinline__ A np_fmax(A a, A b) { return (a > b || b != b) ? a : b; }
template <typename A>
__device__ __forceinline__ A np_fmin(A a, A b) { return (a < b || b != b) ? a : b; }

// float -> int32 as NumPy casts on x86 (cvttss2si): truncation, INT_MIN for NaN and for
// values out of range
template <typename A>
__device__ __forceinline__ int to_i32(A v) {
  return (v >= (A)-2147483648.0 && v < (A)2147483648.0) ? (int)v : (int)0x80000000u;
}
// int32 arithmetic that wraps, as NumPy's
__device__ __forceinline__ int add_i32(int a, int b) { return (int)((unsigned)a + (unsigned)b); }
__device__ __forceinline__ int sub_i32(int a, int b) { return (int)((unsigned)a - (unsigned)b); }
__device__ __forceinline__ int mul_i32(int a, int b) { return (int)((unsigned)a * (unsigned)b); }
__device__ __forceinline__ int imax(int a, int b) { return a > b ? a : b; }
__device__ __forceinline__ int imin(int a, int b) { return a < b ? a : b; }

// geometry.c_round: C round(), half away from zero
template <typename A>
__device__ __forceinline__ A c_round(A v) {
  const A t = trunc_(v);
  const A d = v - t;
  const A sign = v > (A)0 ? (A)1 : (v < (A)0 ? (A)-1 : (A)0);
  return t + (fabs_(d) >= (A)0.5 ? sign : (A)0);
}

// geometry.batch_index: trunc(rois[r, 0]) as int32
template <typename A>
__device__ __forceinline__ int batch_of(A b) { return to_i32(trunc_(b)); }

// geometry._scale: spatial_scale is a C float, then the compute dtype
template <typename A>
__device__ __forceinline__ A scale_of(float spatial_scale) { return (A)spatial_scale; }

// ---- integer bins (IntBins) ------------------------------------------------------------
// ROIPooling (geometry.roi_pooling_bins) along one axis of one roi: v1, v2 the box's
// coordinates (image units, A), bins [start, end) of ``pooled`` bins clipped to [0, limit].
template <typename A>
__device__ __forceinline__ void pool_bins_axis(A v1, A v2, A s, int pooled, int limit,
                                               int* start, int* end) {
  const int c1 = to_i32(c_round(v1 * s)), c2 = to_i32(c_round(v2 * s));
  // malformed (reversed) rois are forced to 1x1, as in Caffe
  const A size = (A)imax(add_i32(sub_i32(c2, c1), 1), 1);
  const A bin = size / (A)pooled;
  for (int p = 0; p < pooled; ++p) {
    const int lo = add_i32(to_i32(floor_((A)p * bin)), c1);
    const int hi = add_i32(to_i32(ceil_((A)(p + 1) * bin)), c1);
    start[p] = imin(imax(lo, 0), limit);
    end[p] = imin(imax(hi, 0), limit);
  }
}

// PSROIPooling (geometry.psroi_pooling_bins) along one axis: corners rounded, then scaled;
// end round(v2) + 1; size at least 0.1; the offset added in floating point and the edges
// clipped there (fmax/fmin: a NaN edge gives 0).
template <typename A>
__device__ __forceinline__ void ps_pool_bins_axis(A v1, A v2, A s, int pooled, int limit,
                                                  int* start, int* end) {
  const A st = c_round(v1) * s;
  const A en = (c_round(v2) + (A)1) * s;
  const A size = np_maximum(en - st, (A)0.1);
  const A bin = size / (A)pooled;
  const A lim = (A)limit;
  for (int p = 0; p < pooled; ++p) {
    A lo = (A)p * bin, hi = (A)(p + 1) * bin;
    lo = lo + st;
    hi = hi + st;
    start[p] = to_i32(np_fmin(np_fmax(floor_(lo), (A)0), lim));
    end[p] = to_i32(np_fmin(np_fmax(ceil_(hi), (A)0), lim));
  }
}

// ---- bilinear taps (geometry.bilinear_axis) -------------------------------------------
template <typename A>
struct Tap {
  int low, high;
  A w_low, w_high;
};

template <typename A>
__device__ __forceinline__ Tap<A> bilinear_tap(A coord, int limit, A valid_lo) {
  const A lim = (A)limit;
  // NaN is outside (a box whose scaled size overflows: inf * 0 points), as geometry.py
  const bool outside = !(coord >= valid_lo && coord <= lim);
  A c = (coord <= (A)0 || outside) ? (A)0 : coord;
  Tap<A> t;
  t.low = to_i32(c);
  const int top = limit - 1;
  const bool last = t.low >= top;
  if (last) t.low = top;
  t.high = last ? t.low : add_i32(t.low, 1);
  const A low_c = (A)t.low;
  if (last) c = low_c;
  t.w_high = c - low_c;
  t.w_low = (A)1 - t.w_high;
  if (outside) {
    t.w_high = (A)0;
    t.w_low = (A)0;
  }
  return t;
}

// ---- ROIAlign sample grid (geometry.roi_align_grid) ------------------------------------
// One axis of one roi: the box start and size along it (after the scale, the aligned
// shift and the >= 1 clamp: align_box), its bins' sample count (adaptive: ceil(size /
// pooled) >= 0, align_grid; fixed: sample_ratio) and the points.
template <typename A>
__device__ __forceinline__ void align_box(A v1, A v2, A s, bool aligned, A* start, A* size) {
  A a = v1 * s, b = v2 * s;
  if (aligned) {
    a = a - (A)0.5;
    b = b - (A)0.5;
  }
  *start = a;
  *size = aligned ? b - a : np_maximum(b - a, (A)1);
}

template <typename A>
__device__ __forceinline__ int align_grid(A size, int pooled) {
  return to_i32(np_maximum(ceil_(size / (A)pooled), (A)0));
}

// Sample g of bin p (a padded sample, g >= count, gets no tap and weight 0); ``grid``
// the adaptive count (padded) or, with padded false, the fixed sample_ratio ``G``.
template <typename A>
__device__ __forceinline__ Tap<A> align_sample(A start, A size, int pooled, int p, int g,
                                               int grid, int G, bool padded, int limit,
                                               A* coord) {
  const A bin = size / (A)pooled;
  const A first = start + (A)p * bin;
  A step = ((A)g + (A)0.5) * bin;
  step = padded ? step / (A)imax(grid, 1) : step / (A)G;
  const A c = first + step;
  *coord = c;
  Tap<A> t = bilinear_tap(c, limit, (A)-1);
  if (padded) {  // x * 1 is x, a weight times 0 is +0 (geometry multiplies by the mask)
    const int live = g < grid ? 1 : 0;
    t.low = mul_i32(t.low, live);
    t.high = mul_i32(t.high, live);
    t.w_low = t.w_low * (A)live;
    t.w_high = t.w_high * (A)live;
  }
  return t;
}

// ---- legacy Caffe ROIAlign grid (geometry.caffe_align_grid) -----------------------------
// Bin p's float range [lo, hi) along one axis, clipped to [0, limit].
template <typename A>
__device__ __forceinline__ void caffe_bin(A start, A end, int pooled, int p, int limit, A* lo,
                                          A* hi) {
  const A size = (end - start) + (A)1;
  const A bin = size / (A)pooled;
  const A lim = (A)limit;
  *lo = np_minimum(np_maximum((A)p * bin + start, (A)0), lim);
  *hi = np_minimum(np_maximum(((A)p + (A)1) * bin + start, (A)0), lim);
}

// The points lo, lo+1, ... (accumulated) while < hi: their number, at most ``cap`` + 1.
template <typename A>
__device__ __forceinline__ int caffe_count(A lo, A hi, int cap) {
  int n = 0;
  for (A cur = lo; cur < hi && n <= cap; cur = cur + (A)1) ++n;
  return n;
}

// Point k (coordinate c: lo plus k additions of 1, as the kernel loops) of a bin with
// ``count`` live points; y axis (ceil_first): tap 1 is the ceil row.
template <typename A>
__device__ __forceinline__ Tap<A> caffe_sample(A c, int k, int count, int limit,
                                               bool ceil_first) {
  const bool alive = k < count;
  const A fl_i = floor_(c), ce_i = ceil_(c);
  const int fl = to_i32(fl_i), ce = to_i32(ce_i);
  const A w_fl = ((A)1 - c) + fl_i, w_ce = ((A)1 - ce_i) + c;
  const int t1 = ceil_first ? ce : fl, t2 = ceil_first ? fl : ce;
  const A w1 = ceil_first ? w_ce : w_fl, w2 = ceil_first ? w_fl : w_ce;
  const bool in1 = alive && t1 >= 0 && t1 <= limit - 1;
  const bool in2 = alive && t2 >= 0 && t2 <= limit - 1;
  Tap<A> t;
  t.low = in1 ? t1 : (in2 ? t2 : 0);
  t.high = in2 ? t2 : (in1 ? t1 : 0);
  t.w_low = in1 ? w1 : (A)0;
  t.w_high = in2 ? w2 : (A)0;
  return t;
}

// ---- legacy R-FCN PSROIAlign grid (geometry.rfcn_align_grid) ---------------------------
template <typename A>
__device__ __forceinline__ void rfcn_bin(A start, A end, int pooled, int p, int limit, A* lo,
                                         A* hi, A* step, int sample_num) {
  const A size = np_maximum(end - start, (A)0.1);
  const A bin = size / (A)pooled;
  const A last = (A)(limit - 1);
  *lo = np_minimum(np_maximum((A)p * bin + start, (A)0), last);
  *hi = np_minimum(np_maximum(((A)p + (A)1) * bin + start, (A)0), last);
  *step = bin / (A)(sample_num + 1);
}

template <typename A>
__device__ __forceinline__ A rfcn_point(A lo, A step, int k) { return lo + (A)(k + 1) * step; }

template <typename A>
__device__ __forceinline__ Tap<A> rfcn_sample(A c, int k, int count, int limit) {
  Tap<A> t = bilinear_tap(c, limit, (A)-0.5);
  const bool live = k < count && !(c > (A)((double)limit - 0.5));
  if (!live) {
    t.low = t.high = 0;
    t.w_low = t.w_high = (A)0;
  }
  return t;
}

// ---- position-sensitive group cells (geometry.group_index), in float32 ---------------
__device__ __forceinline__ int group_cell(int i, int pooled, int group) {
  const int g = to_i32(floor_((float)i * (float)group / (float)pooled));
  return imin(imax(g, 0), group - 1);
}

// geometry.ps_channel_map's entry (c, p, q): the input channel (c * Gh + gh[p]) * Gw + gw[q]
// that output channel c reads at bin (p, q) of a P x Q grid on the group grid (Gh, Gw) --
// the C++ form of the rule (the extension library's host map, ps_channel_map_fill)
__device__ __forceinline__ int ps_channel(long long c, int p, int q, int P, int Q, int Gh,
                                          int Gw) {
  return (int)((c * Gh + group_cell(p, P, Gh)) * Gw + group_cell(q, Q, Gw));
}

}  // namespace geo
}  // namespace mx_roi

// ==== geometry tables, filled roi by roi (the host entry points below; a GPU prologue
// kernel can call geometry_roi with one thread per roi) ===================================
namespace mx_roi {
namespace geo {

// Which geometry (mx_roi.cuda.compiled_geometry.MODES names them).
enum Mode { POOL_BINS = 0, PS_POOL_BINS = 1, ALIGN_GRID = 2, CAFFE_GRID = 3, RFCN_GRID = 4 };

// geometry.MAX_SAMPLES_PER_AXIS
const int MAX_SAMPLES_PER_AXIS = 1 << 22;

struct Params {
  int mode, P, Q, H, W;
  int sample;   // ROIAlign: sample_ratio (<= 0: adaptive); R-FCN: sample_num
  int aligned;  // ROIAlign: the half-pixel shift
  float scale;  // spatial_scale (a C float)
  int Gy, Gx;   // the padded sample counts per bin side (sample grids)
};

__host__ __device__ inline Params make_params(int mode, int P, int Q, int H, int W, int sample,
                                              int aligned, float scale, int Gy, int Gx) {
  Params g;
  g.mode = mode;
  g.P = P;
  g.Q = Q;
  g.H = H;
  g.W = W;
  g.sample = sample;
  g.aligned = aligned;
  g.scale = scale;
  g.Gy = Gy;
  g.Gx = Gx;
  return g;
}

// The tables of geometry.IntBins / SampleGrid, in the dataclasses' field order.
template <typename A>
struct Tables {
  int* batch;
  int *hstart, *hend, *wstart, *wend;  // IntBins
  int *y_count, *y_low, *y_high;       // SampleGrid
  A *y_coord, *y_wl, *y_wh;
  int *x_count, *x_low, *x_high;
  A *x_coord, *x_wl, *x_wh;
  A* divisor;
};

template <typename A>
__device__ __forceinline__ void put(int* low, int* high, A* wl, A* wh, A* coord, long long k,
                                    const Tap<A>& t, A c) {
  low[k] = t.low;
  high[k] = t.high;
  wl[k] = t.w_low;
  wh[k] = t.w_high;
  if (coord) coord[k] = c;  // null on the device: only the pictures read the coordinates
}

// One axis of a ROIAlign roi: count and points of its ``pooled`` bins; returns the count.
template <typename A>
__device__ __forceinline__ int align_axis(A v1, A v2, const Params& g, int pooled, int limit,
                                          int G, long long r, int* count, int* low, int* high,
                                          A* wl, A* wh, A* coord) {
  A start, size;
  align_box(v1, v2, scale_of<A>(g.scale), g.aligned != 0, &start, &size);
  const bool padded = g.sample <= 0;
  const int grid = padded ? align_grid(size, pooled) : g.sample;
  for (int p = 0; p < pooled; ++p) {
    count[r * pooled + p] = padded ? grid : G;
    for (int k = 0; k < G; ++k) {
      A c;
      const Tap<A> t = align_sample(start, size, pooled, p, k, grid, G, padded, limit, &c);
      put(low, high, wl, wh, coord, (r * pooled + p) * (long long)G + k, t, c);
    }
  }
  return grid;
}

template <typename A>
__device__ __forceinline__ void caffe_axis(A v1, A v2, const Params& g, int pooled, int limit,
                                           int G, bool ceil_first, long long r, int* count,
                                           int* low, int* high, A* wl, A* wh, A* coord) {
  const A s = scale_of<A>(g.scale);
  const A start = v1 * s, end = v2 * s;
  for (int p = 0; p < pooled; ++p) {
    A lo, hi;
    caffe_bin(start, end, pooled, p, limit, &lo, &hi);
    const int n = caffe_count(lo, hi, G);
    count[r * pooled + p] = n;
    A c = lo;
    for (int k = 0; k < G; ++k, c = c + (A)1)
      put(low, high, wl, wh, coord, (r * pooled + p) * (long long)G + k,
          caffe_sample(c, k, n, limit, ceil_first), c);
  }
}

template <typename A>
__device__ __forceinline__ void rfcn_axis(A v1, A v2, const Params& g, int pooled, int limit,
                                          long long r, int* count, int* low, int* high, A* wl,
                                          A* wh, A* coord) {
  const int G = g.sample;
  for (int p = 0; p < pooled; ++p) {
    A lo, hi, step;
    rfcn_bin(v1, v2, pooled, p, limit, &lo, &hi, &step, G);
    int n = 0;
    for (int k = 0; k < G; ++k) n += rfcn_point(lo, step, k) < hi ? 1 : 0;
    count[r * pooled + p] = n;
    for (int k = 0; k < G; ++k) {
      const A c = rfcn_point(lo, step, k);
      put(low, high, wl, wh, coord, (r * pooled + p) * (long long)G + k,
          rfcn_sample(c, k, n, limit), c);
    }
  }
}

// Every table row of roi r (rois (R, 5): batch, x1, y1, x2, y2).
template <typename T, typename A>
__device__ void geometry_roi(const Params& g, const T* rois, long long r, const Tables<A>& t) {
  typedef Traits<T> Tr;
  const T* row = rois + r * 5;
  const A b = (A)Tr::load(row[0]), x1 = (A)Tr::load(row[1]), y1 = (A)Tr::load(row[2]);
  const A x2 = (A)Tr::load(row[3]), y2 = (A)Tr::load(row[4]);
  const A s = scale_of<A>(g.scale);
  t.batch[r] = batch_of(b);
  const int P = g.P, Q = g.Q;
  if (g.mode == POOL_BINS || g.mode == PS_POOL_BINS) {
    if (g.mode == POOL_BINS) {
      pool_bins_axis(y1, y2, s, P, g.H, t.hstart + r * P, t.hend + r * P);
      pool_bins_axis(x1, x2, s, Q, g.W, t.wstart + r * Q, t.wend + r * Q);
    } else {
      ps_pool_bins_axis(y1, y2, s, P, g.H, t.hstart + r * P, t.hend + r * P);
      ps_pool_bins_axis(x1, x2, s, Q, g.W, t.wstart + r * Q, t.wend + r * Q);
    }
    return;
  }
  A* div = t.divisor + r * P * (long long)Q;
  if (g.mode == ALIGN_GRID) {
    const int gy = align_axis(y1, y2, g, P, g.H, g.Gy, r, t.y_count, t.y_low, t.y_high, t.y_wl,
                              t.y_wh, t.y_coord);
    const int gx = align_axis(x1, x2, g, Q, g.W, g.Gx, r, t.x_count, t.x_low, t.x_high, t.x_wl,
                              t.x_wh, t.x_coord);
    const A d = g.sample > 0 ? (A)((long long)g.sample * g.sample)
                             : (A)imax(mul_i32(gy, gx), 1);
    for (long long k = 0; k < (long long)P * Q; ++k) div[k] = d;
    return;
  }
  if (g.mode == CAFFE_GRID) {
    caffe_axis(y1, y2, g, P, g.H, g.Gy, true, r, t.y_count, t.y_low, t.y_high, t.y_wl, t.y_wh,
               t.y_coord);
    caffe_axis(x1, x2, g, Q, g.W, g.Gx, false, r, t.x_count, t.x_low, t.x_high, t.x_wl, t.x_wh,
               t.x_coord);
    for (int p = 0; p < P; ++p)
      for (int q = 0; q < Q; ++q)
        div[p * Q + q] = (A)imax(mul_i32(t.y_count[r * P + p], t.x_count[r * Q + q]), 1);
    return;
  }
  // RFCN_GRID: box x1*s .. (x2 + 1)*s
  rfcn_axis(y1 * s, (y2 + (A)1) * s, g, P, g.H, r, t.y_count, t.y_low, t.y_high, t.y_wl,
            t.y_wh, t.y_coord);
  rfcn_axis(x1 * s, (x2 + (A)1) * s, g, Q, g.W, r, t.x_count, t.x_low, t.x_high, t.x_wl,
            t.x_wh, t.x_coord);
  const A d = (A)((long long)g.sample * g.sample);
  for (long long k = 0; k < (long long)P * Q; ++k) div[k] = d;
}

// The padded sample counts (Gy, Gx) of a sample grid over all R rois (geometry.py's table
// widths): ROIAlign adaptive max(1, the largest ceil(size / pooled)), fixed sample_ratio
// (1 without rois); Caffe the most points of any bin (1 if none; MAX_SAMPLES_PER_AXIS + 1
// means "more than allowed"); R-FCN sample_num.  Integer bins: 0.
template <typename T, typename A>
__device__ void geometry_counts(const Params& g, const T* rois, long long R, int* G) {
  typedef Traits<T> Tr;
  G[0] = G[1] = 0;
  if (g.mode == POOL_BINS || g.mode == PS_POOL_BINS) return;
  if (g.mode == RFCN_GRID) {
    G[0] = G[1] = g.sample;
    return;
  }
  if (g.mode == ALIGN_GRID && g.sample > 0) {
    G[0] = G[1] = R > 0 ? g.sample : 1;
    return;
  }
  int gy = 0, gx = 0;
  for (long long r = 0; r < R; ++r) {
    const T* row = rois + r * 5;
    const A x1 = (A)Tr::load(row[1]), y1 = (A)Tr::load(row[2]);
    const A x2 = (A)Tr::load(row[3]), y2 = (A)Tr::load(row[4]);
    if (g.mode == ALIGN_GRID) {
      A start, size;
      align_box(y1, y2, scale_of<A>(g.scale), g.aligned != 0, &start, &size);
      gy = imax(gy, align_grid(size, g.P));
      align_box(x1, x2, scale_of<A>(g.scale), g.aligned != 0, &start, &size);
      gx = imax(gx, align_grid(size, g.Q));
    } else {  // CAFFE_GRID
      const A s = scale_of<A>(g.scale);
      for (int axis = 0; axis < 2; ++axis) {
        const int pooled = axis ? g.Q : g.P, limit = axis ? g.W : g.H;
        int& most = axis ? gx : gy;
        const A v1 = (axis ? x1 : y1) * s, v2 = (axis ? x2 : y2) * s;
        for (int p = 0; p < pooled; ++p) {
          A lo, hi;
          caffe_bin(v1, v2, pooled, p, limit, &lo, &hi);
          most = imax(most, caffe_count(lo, hi, MAX_SAMPLES_PER_AXIS));
        }
      }
    }
  }
  G[0] = imax(gy, 1);
  G[1] = imax(gx, 1);
}

// Whether value ``x`` fails the finiteness rule of check_rois and of the offsets' check
// (DeformablePSROIPooling.check_extra_inputs): |x| not below ``bound`` compared in A, the
// inputs' compute type, as NumPy compares (use_bound: onednn.bounded_dtype), else not finite.
template <typename T, typename A>
__device__ __forceinline__ bool value_bad(T x, double bound, bool use_bound) {
  const double v = (double)Traits<T>::load(x);
  return use_bound ? !(fabs(v) < (double)(A)bound) : !(v - v == 0);
}

// geometry.adaptive_samples_per_bin of one box: ceil(h * s / P) * ceil(w * s / Q) in
// float64, over the box's sides (h, w) in image units and ``s`` the spatial scale as the
// compute type holds it; a box over MAX_SAMPLES_PER_BIN is refused
// (geometry.check_samples_per_bin: ROIAlign's and PSROIAlign's adaptive grid, RROIAlign's).
constexpr double MAX_SAMPLES_PER_BIN = 1048576.0;  // geometry.MAX_SAMPLES_PER_BIN (2^20)

__device__ __forceinline__ double adaptive_per_bin(double h, double w, double s, double P,
                                                   double Q) {
  return ceil(h * s / P) * ceil(w * s / Q);
}

// An axis-aligned roi's sides (y2 - y1, x2 - x1) in float64, a reversed side 0
// (RoIOp._check_adaptive_grid's np.maximum(side, 0); a NaN side 0 too, where NumPy keeps
// NaN: never over the bound either way, and the roi check refuses the roi)
template <typename T>
__device__ __forceinline__ void box_sides(const T* row, double* h, double* w) {
  const double dh = (double)Traits<T>::load(row[4]) - (double)Traits<T>::load(row[2]);
  const double dw = (double)Traits<T>::load(row[3]) - (double)Traits<T>::load(row[1]);
  *h = dh > 0 ? dh : 0.0;
  *w = dw > 0 ? dw : 0.0;
}

// Whether roi ``row`` (``columns`` values) has a NaN or infinite value (check_rois' code 1).
template <typename T, typename A>
__device__ __forceinline__ bool roi_nonfinite(const T* row, double bound, bool use_bound,
                                              int columns = 5) {
  for (int k = 0; k < columns; ++k)
    if (value_bad<T, A>(row[k], bound, use_bound)) return true;
  return false;
}

// Whether roi ``row`` has a batch index >= N (check_rois' code 2; N = 0: trunc(b) >= 0).
template <typename T>
__device__ __forceinline__ bool roi_batch_out(const T* row, long long N) {
  const double b = (double)Traits<T>::load(row[0]);
  return N > 0 ? b >= (double)N : trunc(b) >= (double)N;
}

// The first bad roi of R (rois (R, 5)) for images 0..N-1: 1 = a NaN or infinite value
// (|x| >= bound counts as infinite where the dtype holds bound), checked over all rows
// first; 2 = a batch index >= N (N = 0: trunc(b) >= 0); 0 = none.  ``row`` gets the row.
template <typename T, typename A>
__device__ int check_rois(const T* rois, long long R, long long N, double bound, bool use_bound,
                          long long* row) {
  for (long long r = 0; r < R; ++r)
    if (roi_nonfinite<T, A>(rois + r * 5, bound, use_bound)) {
      *row = r;
      return 1;
    }
  for (long long r = 0; r < R; ++r)
    if (roi_batch_out(rois + r * 5, N)) {
      *row = r;
      return 2;
    }
  return 0;
}

// ---- the status word of the device geometry (kernels roi_bins_geometry /
// roi_grid_geometry below; mx_roi.cuda.device_geometry reads it) ---------------------------
// status[0]: the complement of the smallest key of a bad roi, key = row for code 1 (a NaN or
// infinite value) and 2^62 + row for code 2 (a batch index >= N), so that the largest
// complement (atomicMax, from a zeroed word) names check_rois' roi: the first non-finite
// row, else the first row with a batch index out of range; 0 = every roi is valid.
// status[1]: 1 when some roi needs more sample points per bin side than the tables hold.
const unsigned long long STATUS_BATCH_KEY = 1ULL << 62;

// Checks roi r (check_rois' rule over its ``columns`` values), records a bad one in
// status[0]; true if it is bad.
template <typename T, typename A>
__device__ __forceinline__ bool roi_status(const T* rois, long long r, long long N, double bound,
                                           bool use_bound, unsigned long long* status,
                                           int columns = 5) {
  const T* row = rois + r * columns;
  unsigned long long key;
  if (roi_nonfinite<T, A>(row, bound, use_bound, columns))
    key = (unsigned long long)r;
  else if (roi_batch_out(row, N))
    key = STATUS_BATCH_KEY + (unsigned long long)r;
  else
    return false;
  atomicMax(status, ~key);
  return true;
}

// Roi r of ``rois`` (R, columns) into ``safe``, for op kernels that read the rois
// themselves (the native GPU path): as it is, or where ``bad`` a padding roi (batch -1,
// the rest 0), which those kernels skip without reading data.
template <typename T, typename A>
__device__ __forceinline__ void copy_safe_roi(const T* rois, long long r, int columns, bool bad,
                                              T* safe) {
  for (int k = 0; k < columns; ++k)
    safe[r * columns + k] = bad ? Traits<T>::store((A)(k == 0 ? -1 : 0)) : rois[r * columns + k];
}

// Roi r's verdict in a device geometry kernel: a bad roi (roi_status) or one whose tables
// cannot hold it (``over``: flagged in status[1]) becomes padding (batch -1), so the op
// kernels that follow read no data for it.
template <typename T, typename A>
__device__ __forceinline__ void roi_verdict(const T* rois, long long r, long long N, double bound,
                                            bool use_bound, bool over,
                                            unsigned long long* status, int* batch) {
  if (over) status[1] = 1ULL;
  if (roi_status<T, A>(rois, r, N, bound, use_bound, status) || over) batch[r] = -1;
}

}  // namespace geo
}  // namespace mx_roi

// ==== the geometry on the device: one thread per roi ======================================
// The roi check and the tables of mx_roi::geo, filled where the op kernels read them (a GPU
// call copies nothing to the host before its launches; mx_roi.cuda.device_geometry).  A bad
// roi is recorded in ``status`` (roi_status) and its table row marked as padding (batch
// -1): the op kernels read no data for it, and the call raises once it reads the status.
// Parameters as mx_roi::geo::Params; N the images of the map, bound/use_bound the
// finite-coordinate bound of check_rois; n = R.  Integer bins: a roi with a bin of more
// than ``cells`` cells (the bound the argmax type was chosen for) is flagged in status[1]
// and marked as padding, as a grid roi needing more points than Gy, Gx.
template <typename T, typename A>
__global__ void roi_bins_geometry(const T* __restrict__ rois, int mode, int P, int Q, int H,
                                  int W, float spatial_scale, long long N, double bound,
                                  int use_bound, long long cells, int* __restrict__ batch,
                                  int* __restrict__ hstart, int* __restrict__ hend,
                                  int* __restrict__ wstart, int* __restrict__ wend,
                                  unsigned long long* __restrict__ status, long long n) {
  const mx_roi::geo::Params g =
      mx_roi::geo::make_params(mode, P, Q, H, W, 0, 0, spatial_scale, 0, 0);
  mx_roi::geo::Tables<A> t = {};
  t.batch = batch;
  t.hstart = hstart;
  t.hend = hend;
  t.wstart = wstart;
  t.wend = wend;
  const long long step = (long long)blockDim.x * (long long)gridDim.x;
  for (long long r = (long long)blockIdx.x * blockDim.x + threadIdx.x; r < n; r += step) {
    mx_roi::geo::geometry_roi<T, A>(g, rois, r, t);
    // the most cells of a bin of this roi (longest y range times longest x range) against
    // what the max kernels' argmax type was chosen for
    int h = 0, w = 0;
    for (int p = 0; p < P; ++p) h = mx_roi::geo::imax(h, hend[r * P + p] - hstart[r * P + p]);
    for (int q = 0; q < Q; ++q) w = mx_roi::geo::imax(w, wend[r * Q + q] - wstart[r * Q + q]);
    mx_roi::geo::roi_verdict<T, A>(rois, r, N, bound, use_bound != 0,
                                   (long long)h * (long long)w > cells, status, batch);
  }
}

// The sample grid's tables (coordinates left out) for padded counts Gy, Gx chosen from the
// shapes; a roi needing more points per bin side than that is marked as padding and
// flagged in status[1] (the call then runs again with tables built to measure).
template <typename T, typename A>
__global__ void roi_grid_geometry(const T* __restrict__ rois, int mode, int P, int Q, int H,
                                  int W, int sample, int aligned, float spatial_scale, int Gy,
                                  int Gx, long long N, double bound, int use_bound,
                                  int* __restrict__ batch, int* __restrict__ y_count,
                                  int* __restrict__ y_low, int* __restrict__ y_high,
                                  A* __restrict__ y_wl, A* __restrict__ y_wh,
                                  int* __restrict__ x_count, int* __restrict__ x_low,
                                  int* __restrict__ x_high, A* __restrict__ x_wl,
                                  A* __restrict__ x_wh, A* __restrict__ divisor,
                                  unsigned long long* __restrict__ status, long long n) {
  const mx_roi::geo::Params g =
      mx_roi::geo::make_params(mode, P, Q, H, W, sample, aligned, spatial_scale, Gy, Gx);
  mx_roi::geo::Tables<A> t = {};
  t.batch = batch;
  t.y_count = y_count;
  t.y_low = y_low;
  t.y_high = y_high;
  t.y_wl = y_wl;
  t.y_wh = y_wh;
  t.x_count = x_count;
  t.x_low = x_low;
  t.x_high = x_high;
  t.x_wl = x_wl;
  t.x_wh = x_wh;
  t.divisor = divisor;
  const long long step = (long long)blockDim.x * (long long)gridDim.x;
  for (long long r = (long long)blockIdx.x * blockDim.x + threadIdx.x; r < n; r += step) {
    mx_roi::geo::geometry_roi<T, A>(g, rois, r, t);
    bool over = false;
    for (int p = 0; p < P; ++p) over = over || y_count[r * P + p] > Gy;
    for (int q = 0; q < Q; ++q) over = over || x_count[r * Q + q] > Gx;
    mx_roi::geo::roi_verdict<T, A>(rois, r, N, bound, use_bound != 0, over, status, batch);
  }
}

// The adaptive grid's samples-per-bin bound on the device (the native GPU path of ROIAlign
// and PSROIAlign with sample_ratio <= 0, after roi_grid_geometry; the Custom door's
// RoIOp._check_adaptive_grid on the host): a roi whose bins need more than
// MAX_SAMPLES_PER_BIN samples is marked as padding in the tables (batch -1) and flagged in
// status[1] = 3 (RROIAlign's rroi_align_safe_rois flags its own bound 2).  n = R.
template <typename T, typename A>
__global__ void roi_adaptive_bound(const T* __restrict__ rois, float spatial_scale, int P, int Q,
                                   int* __restrict__ batch, unsigned long long* __restrict__ status,
                                   long long n) {
  const double s = (double)(A)spatial_scale;
  const long long step = (long long)blockDim.x * (long long)gridDim.x;
  for (long long r = (long long)blockIdx.x * blockDim.x + threadIdx.x; r < n; r += step) {
    double h, w;
    mx_roi::geo::box_sides(rois + r * 5, &h, &w);
    if (mx_roi::geo::adaptive_per_bin(h, w, s, P, Q) > mx_roi::geo::MAX_SAMPLES_PER_BIN) {
      status[1] = 3ULL;
      batch[r] = -1;
    }
  }
}

// The roi check alone, for an op whose kernels read the rois themselves (no tables): one
// thread per roi, check_rois' rule over each roi's ``columns`` values, into ``status``
// (status[0] as above; the extension library's launcher stops before the op's kernels
// when it is set: ext_launch.h's check_rois_status).  n = R.
template <typename T, typename A>
__global__ void roi_check(const T* __restrict__ rois, int columns, long long N, double bound,
                          int use_bound, unsigned long long* __restrict__ status, long long n) {
  const long long step = (long long)blockDim.x * (long long)gridDim.x;
  for (long long r = (long long)blockIdx.x * blockDim.x + threadIdx.x; r < n; r += step)
    mx_roi::geo::roi_status<T, A>(rois, r, N, bound, use_bound != 0, status, columns);
}

// The roi check with a checked copy, for an op whose kernels read the rois themselves on
// the native GPU path: each roi by check_rois' rule into ``status`` (as roi_check), copied
// into ``safe`` (R, columns), a bad one as a padding roi (copy_safe_roi).  n = R.
template <typename T, typename A>
__global__ void roi_safe_copy(const T* __restrict__ rois, int columns, long long N, double bound,
                              int use_bound, T* __restrict__ safe,
                              unsigned long long* __restrict__ status, long long n) {
  const long long step = (long long)blockDim.x * (long long)gridDim.x;
  for (long long r = (long long)blockIdx.x * blockDim.x + threadIdx.x; r < n; r += step)
    mx_roi::geo::copy_safe_roi<T, A>(
        rois, r, columns,
        mx_roi::geo::roi_status<T, A>(rois, r, N, bound, use_bound != 0, status, columns), safe);
}

// The position-sensitive channel map (C_out, P, Q) int32 built where the op kernels read it
// (mx_roi::geo::ps_channel; geometry.ps_channel_map on the host): PositionSensitive's CUDA
// and emulated launches and the native GPU path fill it instead of copying a host table to
// the device.  n = C_out * P * Q.
template <typename T, typename A>
__global__ void ps_channel_map_fill(int* __restrict__ channel_map, int P, int Q, int Gh, int Gw,
                                    long long n) {
  const long long step = (long long)blockDim.x * (long long)gridDim.x;
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += step)
    channel_map[i] = mx_roi::geo::ps_channel(i / ((long long)P * Q), (int)(i / Q % P),
                                             (int)(i % Q), P, Q, Gh, Gw);
}

#ifdef MX_ROI_HOST_SHIM
// ---- host entry points of the geometry (mx_roi.cuda.compiled_geometry) -----------------
// dtype: the rois' element type, 0 float16, 1 float32, 2 float64.
#define MX_ROI_GEO_DISPATCH(dtype, ...)                 \
  switch (dtype) {                                       \
    case 0: { typedef __half T; typedef float A; __VA_ARGS__; } break;  \
    case 1: { typedef float T; typedef float A; __VA_ARGS__; } break;   \
    case 2: { typedef double T; typedef double A; __VA_ARGS__; } break; \
    default: return -1;                                  \
  }

// G[0], G[1] = the padded sample counts (geometry_counts).  Returns 0, -1 for a bad dtype.
extern "C" int mx_roi_geometry_counts(int mode, int dtype, const void* rois, long long R, int P,
                                      int Q, int H, int W, int sample, int aligned, float scale,
                                      int* G) {
  const mx_roi::geo::Params g =
      mx_roi::geo::make_params(mode, P, Q, H, W, sample, aligned, scale, 0, 0);
  MX_ROI_GEO_DISPATCH(dtype, mx_roi::geo::geometry_counts<T, A>(g, (const T*)rois, R, G));
  return 0;
}

// Fills the tables t[] (the dataclass's arrays in field order: IntBins 5, SampleGrid 14,
// C-contiguous, int32 / the compute dtype) for R rois.  Returns 0, -1 for a bad dtype.
extern "C" int mx_roi_geometry_fill(int mode, int dtype, const void* rois, long long R, int P,
                                    int Q, int H, int W, int sample, int aligned, float scale,
                                    int Gy, int Gx, void* const* t) {
  const mx_roi::geo::Params g =
      mx_roi::geo::make_params(mode, P, Q, H, W, sample, aligned, scale, Gy, Gx);
  MX_ROI_GEO_DISPATCH(dtype, {
    mx_roi::geo::Tables<A> tb = {};
    tb.batch = (int*)t[0];
    if (mode == mx_roi::geo::POOL_BINS || mode == mx_roi::geo::PS_POOL_BINS) {
      tb.hstart = (int*)t[1];
      tb.hend = (int*)t[2];
      tb.wstart = (int*)t[3];
      tb.wend = (int*)t[4];
    } else {
      tb.y_count = (int*)t[1];
      tb.y_coord = (A*)t[2];
      tb.y_low = (int*)t[3];
      tb.y_high = (int*)t[4];
      tb.y_wl = (A*)t[5];
      tb.y_wh = (A*)t[6];
      tb.x_count = (int*)t[7];
      tb.x_coord = (A*)t[8];
      tb.x_low = (int*)t[9];
      tb.x_high = (int*)t[10];
      tb.x_wl = (A*)t[11];
      tb.x_wh = (A*)t[12];
      tb.divisor = (A*)t[13];
    }
    for (long long r = 0; r < R; ++r)
      mx_roi::geo::geometry_roi<T, A>(g, (const T*)rois, r, tb);
  });
  return 0;
}

// gh[i] = group_index(pooled, group) (geometry.group_index, float32), i < pooled.
extern "C" void mx_roi_group_index(int pooled, int group, int* out) {
  for (int i = 0; i < pooled; ++i) out[i] = mx_roi::geo::group_cell(i, pooled, group);
}

// The first bad roi (check_rois): 0 none, 1 non-finite, 2 batch index; -1 a bad dtype.
extern "C" int mx_roi_check_rois(int dtype, const void* rois, long long R, long long N,
                                 double bound, int use_bound, long long* row) {
  MX_ROI_GEO_DISPATCH(dtype, return mx_roi::geo::check_rois<T, A>((const T*)rois, R, N, bound,
                                                                use_bound != 0, row));
  return 0;
}
#endif
