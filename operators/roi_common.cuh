// Shared device code of the mx_roi CUDA kernels (operators/*.cu).
//
// The kernels are *table driven*: the Python side builds the op's geometry tables
// (mx_roi/geometry.py: IntBins or SampleGrid) and the kernels only read them, so no
// kernel re-derives a bin or a sample point.  Every kernel is a template on
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
    const long long per_roi = (long long)C * P * Q;
    R_ = per_roi > 0 ? n / per_roi : 0;
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
// The per-channel ops reuse one plane for all R*P*Q items of a channel and gained
// nothing.  Nothing on a GPU or in the emulation, nor with -DMX_ROI_NO_PREFETCH (to
// measure it).
template <typename T>
struct PlaneHint {
  long long off, off2;  // the two lines' element offsets in a plane
  __device__ PlaneHint(long long r, int H, int W) {
    const long long hw = (long long)H * W, line = 64 / (long long)sizeof(T);
    off = (2 * r * line) % hw;
    off2 = (off + line) % hw;
  }
  // ``write``: the plane is a gradient plane the next bin's items will update
  __device__ __forceinline__ void operator()(const T* plane, bool write) const {
#if defined(MX_ROI_HOST_NATIVE) && !defined(MX_ROI_NO_PREFETCH)
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
  Item nx = it;  // the next bin in (c, p, q) order; the last one re-hints itself
  if (++nx.q == Q) {
    nx.q = 0;
    if (++nx.p == P) {
      nx.p = 0;
      ++nx.c;
    }
  }
  if (nx.c >= C) nx = it;
  PlaneHint<T>(it.r, H, W)(base + plane_offset(b, in_channel(channel_map, nx, P, Q), Cin, H, W),
                           write);
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
#include <cstring>
#include <vector>
#if defined(__AVX__)
#include <immintrin.h>
#elif defined(__SSE2__)
#include <xmmintrin.h>
#endif
namespace mx_roi {

const int LANES = 16;
inline int padded_lanes(int nc) { return (nc + LANES - 1) / LANES * LANES; }

// The images the R rois read: 1 + their largest batch index (validated: < N), 0 if none.
inline int images_read(const int* batch, long long R) {
  int images = 0;
  for (long long r = 0; r < R; ++r) images = batch[r] >= images ? batch[r] + 1 : images;
  return images;
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
  static void run(const float* const* p, long long j, float* dst, int ncp) {
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
  static void run(const float* const* p, long long j, float* dst, int ncp) {
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

// The block [mx_roi_c_begin, mx_roi_c_end) of every image a roi reads, channels-last and
// loaded as A: element (b, k, c) at (b * H*W + k) * padded_lanes(nc) + c - c_begin; the
// padding lanes are 0 (computed, never stored).  Thread-local storage, reused.
template <typename T, typename A>
const A* channels_last_block(const T* data, const int* batch, long long R, int C, int H,
                             int W) {
  const int c0 = mx_roi_c_begin, nc = mx_roi_c_end - mx_roi_c_begin, ncp = padded_lanes(nc);
  const long long HW = (long long)H * W;
  const int images = images_read(batch, R);
  static thread_local std::vector<A> cells;
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
    static thread_local std::vector<A> block;
    block.assign((size_t)images * HW * ncp, (A)0);
    cells = block.data();
  }
  A* image(int b) const { return cells + (size_t)b * HW * ncp; }
  template <typename O>
  void add_to(O* bottom, int C, int H, int W, double scale) const {
    for (int b = 0; b < images; ++b) {
      const A* img = image(b);
      for (int c = 0; c < nc; ++c) {
        O* plane = bottom + plane_offset(b, c0 + c, C, H, W);
        for (long long k = 0; k < HW; ++k) grad_add(plane + k, img[k * ncp + c], scale);
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
  const long long plane_out = (long long)P * Q, per_roi = C * plane_out;
  const long long R = per_roi > 0 ? n / per_roi : 0;
  if (R <= 0) return;
  const long long k0 = mx_roi_c_begin * plane_out / C, k1 = mx_roi_c_end * plane_out / C;
  if (k1 <= k0) return;
  static thread_local std::vector<T> staged;  // (k1 - k0, R, C): the block's outputs
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
        const PlaneHint<T> hint(r, H, W);
        for (int c = 0; c < C; ++c) {
          const int* cm = channel_map + (long long)c * plane_out;
          hint(data + plane_offset(b, cm[kn], Cin, H, W), false);
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
  const long long plane_out = (long long)P * Q, per_roi = C * plane_out;
  const long long R = per_roi > 0 ? n / per_roi : 0, HW = (long long)H * W;
  if (R <= 0) return;
  const int images = images_read(batch, R);
  static thread_local std::vector<char> used;  // the images a roi reads
  used.assign((size_t)images, 0);
  for (long long r = 0; r < R; ++r)
    if (batch[r] >= 0) used[batch[r]] = 1;
  const int ncp = (C + 7) / 8 * 8;
  static thread_local std::vector<A> block;  // (images, H*W, ncp)
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
      : plane_out((long long)P * Q), R(0), HW((long long)H * W), c0(mx_roi_c_begin),
        nc(mx_roi_c_end - mx_roi_c_begin), ncp(padded_lanes(nc)), cells(nullptr) {
    const long long per_roi = C * plane_out;
    R = per_roi > 0 ? n / per_roi : 0;
    if (R > 0 && nc > 0) cells = channels_last_block<T, A>(data, batch, R, C, H, W);
  }
  bool empty() const { return R <= 0 || nc <= 0; }  // (cells is null when no roi reads)
  const A* image(int b) const { return b >= 0 ? cells + (size_t)b * HW * ncp : nullptr; }
  // f(r, cc, lanes, p, q, img, o) for every 16-channel pass cc (0, 16, ...; its lanes
  // real channels) over every bin of every roi: roi by roi, then pass by pass, so that a
  // pass's cells (a 64-byte line per cell) stay in L1 from bin to bin instead of being
  // fetched again for every pass; o points into the (R, C, P, Q) array ``out`` (the
  // output, or a backward's out-grad) at channel c0 + cc of the bin (channel c0 + cc + c
  // at o[c * plane_out]).
  template <typename U, typename F>
  void each_pass(const int* batch, int C, int P, int Q, U* out, F&& f) const {
    if (empty()) return;
    for (long long r = 0; r < R; ++r) {
      const A* img = image(batch[r]);
      for (int cc = 0; cc < ncp; cc += LANES) {
        const int lanes = nc - cc < LANES ? nc - cc : LANES;
        U* o = out + (r * C + c0 + cc) * plane_out;
        for (int p = 0; p < P; ++p)
          for (int q = 0; q < Q; ++q) f(r, cc, lanes, p, q, img, o + p * Q + q);
      }
    }
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
  template <typename I>
  I index(int c) const { return index_store<I>(arg[c / VW][c % VW]); }
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
};

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
