// DeformablePSROIPooling kernels (Deformable R-FCN: Dai et al., "Deformable Convolutional
// Networks", ICCV 2017; the semantics of mx.nd.contrib.DeformablePSROIPooling).
//
// No geometry tables: every kernel derives its roi box, bin starts (shifted by the
// offsets `trans`) and sample points from rois and trans with the __host__ __device__
// functions below, in the operation order of MXNet's CPU kernel, in A.  The second
// implementation is mx_roi.geometry.deformable_samples (NumPy backend, pictures);
// deformable_psroi_pooling_samples fills the same table from these functions, and a test
// compares the two bit for bit.
//
// Items: output element (r, c, p, q) of (R, C, P, Q); class k = c / (C / K) selects the
// offsets trans[r, 2k + (0: x, 1: y), part_h(p), part_w(q)] (K = 1, offsets 0 with
// no_trans); input channel (c * G + gh(p)) * G + gw(q).  A sample outside
// [-0.5, W - 0.5] x [-0.5, H - 0.5] (or NaN) is skipped; the others are clamped to the map
// and interpolated; the output is their mean (0 if none).
#include "roi_common.cuh"

namespace mx_roi {

__host__ __device__ __forceinline__ float dfloor(float v) { return floorf(v); }
__host__ __device__ __forceinline__ double dfloor(double v) { return floor(v); }
__host__ __device__ __forceinline__ float dceil(float v) { return ceilf(v); }
__host__ __device__ __forceinline__ double dceil(double v) { return ceil(v); }
// C round(): half away from zero
__host__ __device__ __forceinline__ float dround(float v) { return roundf(v); }
__host__ __device__ __forceinline__ double dround(double v) { return round(v); }

// One roi's box: corners C-rounded, end + 1, scaled, shifted by half a cell; sizes at
// least 0.1 (std::max(size, 0.1): a NaN size stays NaN); bins and sub-bins.
template <typename A>
struct DeformBox {
  int batch;
  A start_w, start_h, roi_w, roi_h, bin_w, bin_h, sub_w, sub_h;
};

template <typename T, typename A>
__host__ __device__ __forceinline__ DeformBox<A> deform_box(const T* rois, long long r,
                                                            A scale, int P, int Q, int S) {
  const T* b = rois + r * 5;
  DeformBox<A> g;
  g.batch = (int)Traits<T>::load(b[0]);  // truncation toward zero
  const A half = (A)0.5, one = (A)1, least = (A)0.1;
  g.start_w = dround((A)Traits<T>::load(b[1])) * scale - half;
  g.start_h = dround((A)Traits<T>::load(b[2])) * scale - half;
  const A end_w = (dround((A)Traits<T>::load(b[3])) + one) * scale - half;
  const A end_h = (dround((A)Traits<T>::load(b[4])) + one) * scale - half;
  const A w = end_w - g.start_w, h = end_h - g.start_h;
  g.roi_w = w < least ? least : w;
  g.roi_h = h < least ? least : h;
  g.bin_h = g.roi_h / (A)P;
  g.bin_w = g.roi_w / (A)Q;
  g.sub_h = g.bin_h / (A)S;
  g.sub_w = g.bin_w / (A)S;
  return g;
}

// The part cell of bin p of P: floor(p / P * part) (MXNet's order, in A).
template <typename A>
__host__ __device__ __forceinline__ int deform_part(int p, int P, int part) {
  return (int)dfloor((A)p / (A)P * (A)part);
}

// The group cell of bin p of P: floor(p * G / P), clamped to [0, G - 1].
template <typename A>
__host__ __device__ __forceinline__ int deform_group(int p, int P, int G) {
  int g = (int)dfloor((A)p * (A)G / (A)P);
  g = g < 0 ? 0 : g;
  return g > G - 1 ? G - 1 : g;
}

// Offset index of trans[r, 2k + axis, u, v] in (R, 2K, part, part).
__host__ __device__ __forceinline__ long long deform_trans_index(long long r, int k, int K,
                                                                 int axis, int part, int u,
                                                                 int v) {
  return (((r * K + k) * 2 + axis) * (long long)part + u) * part + v;
}

// Start (hstart, wstart) of bin (p, q) of class k: p * bin + start, then + offset * size
// (offset = trans * trans_std; 0 without trans, still added as MXNet does).
template <typename T, typename A>
__host__ __device__ __forceinline__ void deform_bin_start(const DeformBox<A>& g,
                                                          const T* trans, long long r, int k,
                                                          int K, int part, int p, int q,
                                                          int P, int Q, A trans_std,
                                                          bool no_trans, A* hs, A* ws) {
  A tx = 0, ty = 0;
  if (!no_trans) {
    const int u = deform_part<A>(p, P, part), v = deform_part<A>(q, Q, part);
    tx = (A)Traits<T>::load(trans[deform_trans_index(r, k, K, 0, part, u, v)]) * trans_std;
    ty = (A)Traits<T>::load(trans[deform_trans_index(r, k, K, 1, part, u, v)]) * trans_std;
  }
  A w = (A)q * g.bin_w + g.start_w;
  w += tx * g.roi_w;
  A h = (A)p * g.bin_h + g.start_h;
  h += ty * g.roi_h;
  *hs = h;
  *ws = w;
}

// One axis of a sample: inside [-0.5, limit - 0.5] (compared in double, as MXNet's
// `w < -0.5 || w > width - 0.5`; NaN is outside), the coordinate clamped to
// [0, limit - 1] (std::min(std::max(v, 0), limit - 1)), its taps floor / ceil and the
// distance to the low tap.
template <typename A>
struct DeformAxis {
  bool inside;
  A v, d;
  int lo, hi;
};

template <typename A>
__host__ __device__ __forceinline__ DeformAxis<A> deform_axis(A v, int limit) {
  DeformAxis<A> a;
  a.inside = (double)v >= -0.5 && (double)v <= (double)limit - 0.5;
  A c = v < (A)0 ? (A)0 : v;
  c = (A)(limit - 1) < c ? (A)(limit - 1) : c;
  a.v = c;
  const A f = dfloor(c);
  a.lo = (int)f;
  a.hi = (int)dceil(c);
  a.d = c - f;
  return a;
}

// One sample's terms of d out / d trans (x, y) (MXNet's operation order); diff = the
// item's out-grad / count.
template <typename A>
__host__ __device__ __forceinline__ void deform_trans_terms(A u00, A u01, A u10, A u11, A dx,
                                                            A dy, A tstd, A diff, A roi_w,
                                                            A roi_h, A* tx, A* ty) {
  const A one = (A)1;
  A x = u11 * dy + u10 * (one - dy) - u01 * dy - u00 * (one - dy);
  x *= tstd * diff * roi_w;
  A y = u11 * dx + u01 * (one - dx) - u10 * dx - u00 * (one - dx);
  y *= tstd * diff * roi_h;
  *tx = x;
  *ty = y;
}

// Everything an item needs: its box, class, input plane, bin start.
template <typename A>
struct DeformItem {
  DeformBox<A> g;
  int k, cin;
  A hs, ws;
};

template <typename T, typename A>
__host__ __device__ __forceinline__ DeformItem<A> deform_item(
    const T* rois, const T* trans, long long r, int c, int p, int q, A scale, A trans_std,
    bool no_trans, int K, int C, int G, int part, int S, int P, int Q) {
  DeformItem<A> d;
  d.g = deform_box<T, A>(rois, r, scale, P, Q, S);
  d.k = c / (C / K);
  d.cin = (c * G + deform_group<A>(p, P, G)) * G + deform_group<A>(q, Q, G);
  deform_bin_start<T, A>(d.g, trans, r, d.k, K, part, p, q, P, Q, trans_std, no_trans, &d.hs,
                         &d.ws);
  return d;
}

// Valid samples of an item (the divisor of its mean).
template <typename A>
__host__ __device__ __forceinline__ int deform_count(const DeformItem<A>& d, int S, int H,
                                                     int W) {
  int count = 0;
  for (int i = 0; i < S; ++i) {
    const bool yin = deform_axis<A>(d.hs + (A)i * d.g.sub_h, H).inside;
    for (int j = 0; j < S; ++j)
      count += (yin && deform_axis<A>(d.ws + (A)j * d.g.sub_w, W).inside) ? 1 : 0;
  }
  return count;
}

}  // namespace mx_roi

#ifdef MX_ROI_HOST_NATIVE
#include <algorithm>
#include <vector>
namespace mx_roi {
// The items of the calling thread's channel block [mx_roi_c_begin, mx_roi_c_end) class by
// class: per class (its channels in the block), roi by roi, then channel, bin.  With
// shared offsets (K = 1) that is ItemLoop's roi-major order; with per-class offsets
// (R-FCN: one channel per class) a channel's planes (P * Q per image, ~0.75 MB on
// R-FCN's 2 x 38 x 50 maps) stay in cache for all its rois, where roi-major order swept
// the block's 16 classes' planes (~12 MB) once per roi.  A plane is written only by one
// (c, p, q), in roi order either way: the same bits.  The rois are walked image by image
// (a stable sort by batch index: each image's rois still in roi order), so that only one
// image's planes of the channel, and of its gradient, are hot at a time (R-FCN: 0.37 MB
// each, where both images' data and gradient planes overflowed a 1 MB L2).
template <typename T>
class DeformWalk {
 public:
  DeformWalk(long long n, int C, int P, int Q, int K, const T* rois)
      : C_(C), P_(P), Q_(Q), per_(K > 0 && C / K > 0 ? C / K : 1) {
    R_ = mx_roi::launch_rois(n, C, P, Q);
    if (mx_roi_c_begin < mx_roi_c_end && R_ > 0) {
      std::vector<int> batch((size_t)R_);
      order_.resize((size_t)R_);
      for (long long r = 0; r < R_; ++r) {
        order_[r] = r;
        batch[r] = (int)Traits<T>::load(rois[r * 5]);  // as deform_box
      }
      std::stable_sort(order_.begin(), order_.end(),
                       [&](long long a, long long b) { return batch[a] < batch[b]; });
    }
    end_ = mx_roi_c_end;
    c0_ = mx_roi_c_begin;
    group();
    first_ = true;
  }
  // the current class's channels in the block: [group_begin, group_end)
  int group_begin() const { return c0_; }
  int group_end() const { return c1_; }
  inline bool next(Item& it) {
    if (first_) {
      first_ = false;
    } else if (++it_.q == Q_) {
      it_.q = 0;
      if (++it_.p == P_) {
        it_.p = 0;
        if (++it_.c == c1_) {
          it_.c = c0_;
          if (++ri_ >= R_) {
            c0_ = c1_;
            group();
          }
        }
      }
    }
    if (R_ <= 0 || c0_ >= end_) return false;
    it_.r = order_[ri_];
    it_.i = ((it_.r * C_ + it_.c) * P_ + it_.p) * (long long)Q_ + it_.q;
    it = it_;
    return true;
  }

 private:
  void group() {  // the block's channels of c0_'s class: [c0_, c1_)
    const int last = (c0_ / per_ + 1) * per_;
    c1_ = last < end_ ? last : end_;
    ri_ = 0;
    it_.c = c0_;
    it_.p = 0;
    it_.q = 0;
  }
  Item it_;
  std::vector<long long> order_;  // the rois image by image
  long long R_, ri_ = 0;
  int C_, P_, Q_, per_, end_, c0_, c1_;
  bool first_;
};

// At the start of each (class, image) phase of a DeformWalk: hint every cache line of the
// phase's input planes -- channels [c0, c1) read planes [c0 * G * G, c1 * G * G) of image
// b, one contiguous run (at most 1 MB of it) -- so that they stream in at memory speed,
// where the items' scattered first touches each waited for memory.
template <typename T>
inline void deform_prefetch_phase(const T* base, int b, int c0, int c1, int G, int Cin,
                                  int H, int W, bool write) {
#ifndef MX_ROI_NO_PREFETCH
  const long long first = plane_offset(b, c0 * G * G, Cin, H, W);
  long long bytes = ((long long)(c1 - c0) * G * G * H * W) * (long long)sizeof(T);
  if (bytes > (1LL << 20)) bytes = 1LL << 20;
  const char* p = (const char*)(base + first);
  for (long long o = 0; o < bytes; o += 64) {
    if (write)
      __builtin_prefetch(p + o, 1);
    else
      __builtin_prefetch(p + o, 0);
  }
#endif
}

// Native host build: the samples of every bin of one (roi, class), built once and reused
// by every output channel of that class in the thread's block (a class-agnostic model --
// K = 1, e.g. Deformable-ConvNets' FPN head with 256 channels -- builds them once per
// roi): per valid sample its four tap offsets in the plane, its four bilinear weights
// (the very products the generic kernels form: (1 - dx) * (1 - dy), ...) and its
// distances (the offsets' gradient).  The same values in the same order: the same bits.
template <typename A>
struct DeformTap {
  int o[4];
  A w[4];
  A dx, dy;
};

template <typename T, typename A>
struct DeformBins {
  std::vector<DeformTap<A>> taps;  // valid samples, bin by bin, (i, j) order (the first `used`)
  std::vector<int> start;          // bin b = p * Q + q: taps[start[b] .. start[b + 1])
  DeformBox<A> g;
  long long r = -1;
  int k = -1;

  // every bin of (r_, k_) (bin b = p * Q + q), unless already built
  void ensure(const T* rois, const T* trans, long long r_, int k_, A scale, A trans_std,
              bool no_trans, int K, int part, int S, int P, int Q, int H, int W) {
    if (r_ == r && k_ == k) return;
    begin(rois, r_, k_, scale, S, P, Q);
    for (int p = 0; p < P; ++p)
      for (int q = 0; q < Q; ++q)
        add_bin(trans, trans_std, no_trans, K, part, S, P, Q, H, W, p, q);
  }

  // bin (p, q) of (r_, k_) alone, as bin 0 (the roi-inner walk: each item its own bin)
 private:
  std::vector<DeformAxis<A>> ax;
  int used = 0;

  void begin(const T* rois, long long r_, int k_, A scale, int S, int P, int Q) {
    r = r_;
    k = k_;
    g = deform_box<T, A>(rois, r, scale, P, Q, S);
    // room for every sample of every bin, written in place: a tap built on the stack and
    // pushed back was stored piecewise and reloaded whole, a stalled store-to-load
    // forward per tap (measured: most of the table's time)
    const size_t most = (size_t)P * Q * S * S;
    if (taps.size() < most) taps.resize(most);
    used = 0;
    start.assign(1, 0);
    ax.resize(S);
  }

  void add_bin(const T* trans, A trans_std, bool no_trans, int K, int part, int S, int P,
               int Q, int H, int W, int p, int q) {
    const A one = (A)1;
    A hs, ws;
    deform_bin_start<T, A>(g, trans, r, k, K, part, p, q, P, Q, trans_std, no_trans, &hs, &ws);
    for (int j = 0; j < S; ++j) ax[j] = deform_axis<A>(ws + (A)j * g.sub_w, W);
    for (int i = 0; i < S; ++i) {
      const DeformAxis<A> ay = deform_axis<A>(hs + (A)i * g.sub_h, H);
      if (!ay.inside) continue;
      for (int j = 0; j < S; ++j) {
        if (!ax[j].inside) continue;
        DeformTap<A>& t = taps[used++];
        t.o[0] = ay.lo * W + ax[j].lo;
        t.o[1] = ay.hi * W + ax[j].lo;
        t.o[2] = ay.lo * W + ax[j].hi;
        t.o[3] = ay.hi * W + ax[j].hi;
        t.w[0] = (one - ax[j].d) * (one - ay.d);
        t.w[1] = (one - ax[j].d) * ay.d;
        t.w[2] = ax[j].d * (one - ay.d);
        t.w[3] = ax[j].d * ay.d;
        t.dx = ax[j].d;
        t.dy = ay.d;
      }
    }
    start.push_back(used);
  }
};

// The native walk of both directions: the items class by class, roi by roi (DeformWalk),
// the samples of each (roi, class) built once (DeformBins), ``phase(b, c0, c1)`` called
// when a live roi starts another image or class group (the planes to prefetch), then
// ``item(it, bins)`` for every item.  (Walking a bin's rois back to back instead, its
// plane hot, measured 1.7x slower on R-FCN 7x7 / 256 rois: the out / out-grad and offset
// reads then stride by a roi.)
template <typename T, typename A, typename Phase, typename ItemFn>
__forceinline__ void deform_walk(long long n, int C, int K, int P, int Q, const T* rois,
                                 const T* trans, A spatial_scale, A trans_std, bool no_trans,
                                 int part, int S, int H, int W, Phase&& phase, ItemFn&& item) {
  DeformBins<T, A> bins;
  Item it;
  int phase_c = -1, phase_b = -1;
  for (DeformWalk<T> walk(n, C, P, Q, K, rois); walk.next(it);) {
    bins.ensure(rois, trans, it.r, it.c / (C / K), spatial_scale, trans_std, no_trans, K,
                part, S, P, Q, H, W);
    if (bins.g.batch >= 0 && (walk.group_begin() != phase_c || bins.g.batch != phase_b)) {
      phase_c = walk.group_begin();
      phase_b = bins.g.batch;
      phase(phase_b, phase_c, walk.group_end());
    }
    item(it, bins);
  }
}
}  // namespace mx_roi
#endif

// The sample table of mx_roi.geometry.deformable_samples from the functions above (for
// the equality test): items (r, k, p, q) of (R, K, P, Q); per sample index s < S the
// clamped y of row s and x of column s, and whether each is inside (1) or not (0).
template <typename T, typename A>
__global__ void deformable_psroi_pooling_samples(
    const T* __restrict__ rois, const T* __restrict__ trans, double spatial_scale,
    double trans_std, int no_trans, int part, int S, int C, int H, int W, int P, int Q,
    A* __restrict__ y, A* __restrict__ x, int* __restrict__ y_in, int* __restrict__ x_in,
    long long n) {
  MX_ROI_ITEM_LOOP(it, n, C, P, Q, false) {
    const mx_roi::DeformBox<A> g =
        mx_roi::deform_box<T, A>(rois, it.r, (A)spatial_scale, P, Q, S);
    A hs, ws;
    mx_roi::deform_bin_start<T, A>(g, trans, it.r, it.c, C, part, it.p, it.q, P, Q,
                                   (A)trans_std, no_trans != 0, &hs, &ws);
    for (int s = 0; s < S; ++s) {
      const mx_roi::DeformAxis<A> ay = mx_roi::deform_axis<A>(hs + (A)s * g.sub_h, H);
      const mx_roi::DeformAxis<A> ax = mx_roi::deform_axis<A>(ws + (A)s * g.sub_w, W);
      y[it.i * S + s] = ay.v;
      x[it.i * S + s] = ax.v;
      y_in[it.i * S + s] = ay.inside ? 1 : 0;
      x_in[it.i * S + s] = ax.inside ? 1 : 0;
    }
  }
}

template <typename T, typename A>
__global__ void deformable_psroi_pooling_forward(
    const T* __restrict__ data, const T* __restrict__ rois, const T* __restrict__ trans,
    double spatial_scale, double trans_std, int no_trans, int K, int G, int part, int S,
    int C, int Cin, int H, int W, int P, int Q, T* __restrict__ out, long long n) {
#ifdef MX_ROI_HOST_NATIVE
  {
    // class by class, roi by roi (deform_walk), the (roi, class) table shared by the
    // class's channels
    auto phase = [&](int pb, int c0, int c1) {
      mx_roi::deform_prefetch_phase(data, pb, c0, c1, G, Cin, H, W, false);
    };
    mx_roi::deform_walk<T, A>(n, C, K, P, Q, rois, trans, (A)spatial_scale, (A)trans_std,
                              no_trans != 0, part, S, H, W, phase,
                              [&](const mx_roi::Item& it, const mx_roi::DeformBins<T, A>& bins) {
      const int b = it.p * Q + it.q;
      const int count = bins.start[b + 1] - bins.start[b];
      A sum = 0;
      if (bins.g.batch >= 0 && count > 0) {
        const int cin = (it.c * G + mx_roi::deform_group<A>(it.p, P, G)) * G +
                        mx_roi::deform_group<A>(it.q, Q, G);
        const T* plane = data + mx_roi::plane_offset(bins.g.batch, cin, Cin, H, W);
        for (int t = bins.start[b]; t < bins.start[b + 1]; ++t) {
          const mx_roi::DeformTap<A>& s = bins.taps[t];
          sum += s.w[0] * mx_roi::Traits<T>::load(plane[s.o[0]]) +
                 s.w[1] * mx_roi::Traits<T>::load(plane[s.o[1]]) +
                 s.w[2] * mx_roi::Traits<T>::load(plane[s.o[2]]) +
                 s.w[3] * mx_roi::Traits<T>::load(plane[s.o[3]]);
        }
      }
      out[it.i] = mx_roi::Traits<T>::store(bins.g.batch < 0 || count == 0 ? (A)0
                                                                           : sum / (A)count);
    });
    return;
  }
#endif
  MX_ROI_ITEM_LOOP(it, n, C, P, Q, false) {
    const mx_roi::DeformItem<A> d = mx_roi::deform_item<T, A>(
        rois, trans, it.r, it.c, it.p, it.q, (A)spatial_scale, (A)trans_std, no_trans != 0, K,
        C, G, part, S, P, Q);
    A sum = 0;
    int count = 0;
    if (d.g.batch >= 0) {
      const T* plane = data + mx_roi::plane_offset(d.g.batch, d.cin, Cin, H, W);
      for (int i = 0; i < S; ++i) {
        const mx_roi::DeformAxis<A> ay = mx_roi::deform_axis<A>(d.hs + (A)i * d.g.sub_h, H);
        for (int j = 0; j < S; ++j) {
          const mx_roi::DeformAxis<A> ax =
              mx_roi::deform_axis<A>(d.ws + (A)j * d.g.sub_w, W);
          if (!(ay.inside && ax.inside)) continue;
          const A v00 = mx_roi::Traits<T>::load(plane[(long long)ay.lo * W + ax.lo]);
          const A v01 = mx_roi::Traits<T>::load(plane[(long long)ay.hi * W + ax.lo]);
          const A v10 = mx_roi::Traits<T>::load(plane[(long long)ay.lo * W + ax.hi]);
          const A v11 = mx_roi::Traits<T>::load(plane[(long long)ay.hi * W + ax.hi]);
          const A one = (A)1;
          const A value = (one - ax.d) * (one - ay.d) * v00 + (one - ax.d) * ay.d * v01 +
                          ax.d * (one - ay.d) * v10 + ax.d * ay.d * v11;
          sum += value;
          ++count;
        }
      }
    }
    out[it.i] = mx_roi::Traits<T>::store(count == 0 ? (A)0 : sum / (A)count);
  }
}

// Data gradient: each valid sample hands out grad / count with its four bilinear weights
// (taps in MXNet's order: (lo, lo), (hi, lo), (lo, hi), (hi, hi) as (y, x)).  With
// fuse_trans (one offset class per output channel and one bin per part cell: every offset
// element is one item's alone) also the offsets' gradient, each item writing its two
// elements (the sum of its samples' terms in MXNet's order, from 0: the same bits as
// deformable_psroi_pooling_backward_trans, which is then not launched).
template <typename T, typename A, typename O>
__global__ void deformable_psroi_pooling_backward(
    const T* __restrict__ grad, const T* __restrict__ data, const T* __restrict__ rois,
    const T* __restrict__ trans, double spatial_scale, double trans_std, int no_trans, int K,
    int G, int part, int S, int C, int Cin, int H, int W, int P, int Q,
    O* __restrict__ bottom, A* __restrict__ trans_grad, int fuse_trans, double scale,
    long long n) {
#ifdef MX_ROI_HOST_NATIVE
  {
    // as the forward (deform_walk): MXNet's order of additions into every plane (roi by
    // roi)
    auto phase = [&](int pb, int c0, int c1) {
      mx_roi::deform_prefetch_phase(bottom, pb, c0, c1, G, Cin, H, W, true);
      if (fuse_trans) mx_roi::deform_prefetch_phase(data, pb, c0, c1, G, Cin, H, W, false);
    };
    mx_roi::deform_walk<T, A>(n, C, K, P, Q, rois, trans, (A)spatial_scale, (A)trans_std,
                              no_trans != 0, part, S, H, W, phase,
                              [&](const mx_roi::Item& it, const mx_roi::DeformBins<T, A>& bins) {
      const int b = it.p * Q + it.q;
      const int count = bins.start[b + 1] - bins.start[b];
      A sx = 0, sy = 0;
      if (bins.g.batch >= 0 && count > 0) {
        const A diff = (A)mx_roi::Traits<T>::load(grad[it.i]) / (A)count;
        const int cin = (it.c * G + mx_roi::deform_group<A>(it.p, P, G)) * G +
                        mx_roi::deform_group<A>(it.q, Q, G);
        const long long base = mx_roi::plane_offset(bins.g.batch, cin, Cin, H, W);
        O* plane = bottom + base;
        const T* in = data + base;
        const A tstd = (A)trans_std;
        for (int t = bins.start[b]; t < bins.start[b + 1]; ++t) {
          const mx_roi::DeformTap<A>& s = bins.taps[t];
          for (int m = 0; m < 4; ++m) mx_roi::grad_add(plane + s.o[m], s.w[m] * diff, scale);
          if (fuse_trans) {
            A tx, ty;
            mx_roi::deform_trans_terms<A>(
                mx_roi::Traits<T>::load(in[s.o[0]]), mx_roi::Traits<T>::load(in[s.o[1]]),
                mx_roi::Traits<T>::load(in[s.o[2]]), mx_roi::Traits<T>::load(in[s.o[3]]),
                s.dx, s.dy, tstd, diff, bins.g.roi_w, bins.g.roi_h, &tx, &ty);
            sx += tx;
            sy += ty;
          }
        }
      }
      if (fuse_trans) {
        const int k = it.c / (C / K), u = mx_roi::deform_part<A>(it.p, P, part),
                  v = mx_roi::deform_part<A>(it.q, Q, part);
        trans_grad[mx_roi::deform_trans_index(it.r, k, K, 0, part, u, v)] = sx;
        trans_grad[mx_roi::deform_trans_index(it.r, k, K, 1, part, u, v)] = sy;
      }
    });
    return;
  }
#endif
  MX_ROI_ITEM_LOOP(it, n, C, P, Q, false) {
    const mx_roi::DeformItem<A> d = mx_roi::deform_item<T, A>(
        rois, trans, it.r, it.c, it.p, it.q, (A)spatial_scale, (A)trans_std, no_trans != 0, K,
        C, G, part, S, P, Q);
    const int count = d.g.batch < 0 ? 0 : mx_roi::deform_count<A>(d, S, H, W);
    A sx = 0, sy = 0;
    if (count > 0) {
      const A diff = (A)mx_roi::Traits<T>::load(grad[it.i]) / (A)count;
      const long long base = mx_roi::plane_offset(d.g.batch, d.cin, Cin, H, W);
      O* plane = bottom + base;
      const T* in = data + base;
      for (int i = 0; i < S; ++i) {
        const mx_roi::DeformAxis<A> ay = mx_roi::deform_axis<A>(d.hs + (A)i * d.g.sub_h, H);
        for (int j = 0; j < S; ++j) {
          const mx_roi::DeformAxis<A> ax =
              mx_roi::deform_axis<A>(d.ws + (A)j * d.g.sub_w, W);
          if (!(ay.inside && ax.inside)) continue;
          const A one = (A)1;
          const A q00 = (one - ax.d) * (one - ay.d), q01 = (one - ax.d) * ay.d;
          const A q10 = ax.d * (one - ay.d), q11 = ax.d * ay.d;
          const long long o00 = (long long)ay.lo * W + ax.lo, o01 = (long long)ay.hi * W + ax.lo;
          const long long o10 = (long long)ay.lo * W + ax.hi, o11 = (long long)ay.hi * W + ax.hi;
          mx_roi::grad_add(plane + o00, q00 * diff, scale);
          mx_roi::grad_add(plane + o01, q01 * diff, scale);
          mx_roi::grad_add(plane + o10, q10 * diff, scale);
          mx_roi::grad_add(plane + o11, q11 * diff, scale);
          if (fuse_trans) {
            A tx, ty;
            mx_roi::deform_trans_terms<A>(
                mx_roi::Traits<T>::load(in[o00]), mx_roi::Traits<T>::load(in[o01]),
                mx_roi::Traits<T>::load(in[o10]), mx_roi::Traits<T>::load(in[o11]), ax.d, ay.d,
                (A)trans_std, diff, d.g.roi_w, d.g.roi_h, &tx, &ty);
            sx += tx;
            sy += ty;
          }
        }
      }
    }
    if (fuse_trans) {
      const int u = mx_roi::deform_part<A>(it.p, P, part), v = mx_roi::deform_part<A>(it.q, Q, part);
      trans_grad[mx_roi::deform_trans_index(it.r, d.k, K, 0, part, u, v)] = sx;
      trans_grad[mx_roi::deform_trans_index(it.r, d.k, K, 1, part, u, v)] = sy;
    }
  }
}

// Offset gradient: items (r * K + k, u, v) of (R * K, part, part) -- C is R * K, so that
// a native launch splits over rois and classes (there: k * R + r) -- each the sum, in MXNet's order (output
// channel c of class k, bin (p, q) of part cell (u, v), sample (i, j)), of d out / d trans;
// written (each element by one item: no atomics, the same bits on every backend).  D is
// the output channel count.
template <typename T, typename A>
__global__ void deformable_psroi_pooling_backward_trans(
    const T* __restrict__ grad, const T* __restrict__ data, const T* __restrict__ rois,
    const T* __restrict__ trans, double spatial_scale, double trans_std, int K, int G,
    int part, int S, int C, int D, int Cin, int H, int W, int P, int Q,
    A* __restrict__ trans_grad, long long n) {
  const A tstd = (A)trans_std;
  const int per_class = D / K;
#ifdef MX_ROI_HOST_NATIVE
  {
    // up to TILE (roi, class) pairs of one class at once (their items (u, v) = (0, 0)):
    // output channel by channel, each plane read by every roi of the tile while it is in
    // cache (roi by roi, a class-agnostic model's 256 channels' planes, 1.9 MB an image,
    // were swept once per roi), every sample added to its roi's part cell's sums -- per
    // (roi, cell) still in the order c, (p, q), (i, j): the same bits
    const int TILE = 16;
    std::vector<mx_roi::DeformBins<T, A>> tile(TILE);
    std::vector<A> sx, sy;
    std::vector<int> cellv((size_t)P * Q), gsh((size_t)P * Q);
    for (int p = 0; p < P; ++p)
      for (int q = 0; q < Q; ++q) {
        cellv[p * Q + q] =
            mx_roi::deform_part<A>(p, P, part) * part + mx_roi::deform_part<A>(q, Q, part);
        gsh[p * Q + q] = mx_roi::deform_group<A>(p, P, G) * G + mx_roi::deform_group<A>(q, Q, G);
      }
    const int cells = part * part;
    const long long R = C / K;
    // class-major (index = k * R + r): consecutive indices read the same class's planes
    for (long long i0 = n > 0 ? mx_roi_c_begin : 0, i1 = n > 0 ? mx_roi_c_end : 0; i0 < i1;) {
      const int k = (int)(i0 / R);
      long long e = i0 + TILE;
      if (e > i1) e = i1;
      if (e > (long long)(k + 1) * R) e = (long long)(k + 1) * R;
      const int nt = (int)(e - i0);
      for (int t = 0; t < nt; ++t)
        tile[t].ensure(rois, trans, (i0 + t) % R, k, (A)spatial_scale, tstd, false, K, part,
                       S, P, Q, H, W);
      sx.assign((size_t)nt * cells, (A)0);
      sy.assign((size_t)nt * cells, (A)0);
      for (int c = k * per_class; c < (k + 1) * per_class; ++c) {
        for (int t = 0; t < nt; ++t) {
          const mx_roi::DeformBins<T, A>& bins = tile[t];
          if (bins.g.batch < 0) continue;
          const long long r = (i0 + t) % R;
          A* tx = sx.data() + (size_t)t * cells;
          A* ty = sy.data() + (size_t)t * cells;
          const T* planes = data + mx_roi::plane_offset(bins.g.batch, c * G * G, Cin, H, W);
          const T* g = grad + (r * D + c) * (long long)P * Q;
          for (int b = 0; b < P * Q; ++b) {
            const int count = bins.start[b + 1] - bins.start[b];
            if (count == 0) continue;
            const A diff = (A)mx_roi::Traits<T>::load(g[b]) / (A)count;
            const T* plane = planes + (long long)gsh[b] * H * W;
            const int cell = cellv[b];
            A ax = tx[cell], ay = ty[cell];
            for (int j = bins.start[b]; j < bins.start[b + 1]; ++j) {
              const mx_roi::DeformTap<A>& s = bins.taps[j];
              A dx, dy;
              mx_roi::deform_trans_terms<A>(
                  mx_roi::Traits<T>::load(plane[s.o[0]]), mx_roi::Traits<T>::load(plane[s.o[1]]),
                  mx_roi::Traits<T>::load(plane[s.o[2]]), mx_roi::Traits<T>::load(plane[s.o[3]]),
                  s.dx, s.dy, tstd, diff, bins.g.roi_w, bins.g.roi_h, &dx, &dy);
              ax += dx;
              ay += dy;
            }
            tx[cell] = ax;
            ty[cell] = ay;
          }
        }
      }
      for (int t = 0; t < nt; ++t) {
        const long long r = (i0 + t) % R;
        for (int u = 0; u < part; ++u)
          for (int v = 0; v < part; ++v) {
            trans_grad[mx_roi::deform_trans_index(r, k, K, 0, part, u, v)] =
                sx[(size_t)t * cells + u * part + v];
            trans_grad[mx_roi::deform_trans_index(r, k, K, 1, part, u, v)] =
                sy[(size_t)t * cells + u * part + v];
          }
      }
      i0 = e;
    }
    return;
  }
#endif
  MX_ROI_ITEM_LOOP(it, n, C, part, part, false) {
    const long long r = it.c / K;
    const int k = it.c % K, u = it.p, v = it.q;
    A sx = 0, sy = 0;
    const mx_roi::DeformBox<A> g0 = mx_roi::deform_box<T, A>(rois, r, (A)spatial_scale, P,
                                                            Q, S);
    for (int c = k * per_class; g0.batch >= 0 && c < (k + 1) * per_class; ++c) {
      for (int p = 0; p < P; ++p) {
        if (mx_roi::deform_part<A>(p, P, part) != u) continue;
        for (int q = 0; q < Q; ++q) {
          if (mx_roi::deform_part<A>(q, Q, part) != v) continue;
          const mx_roi::DeformItem<A> d = mx_roi::deform_item<T, A>(
              rois, trans, r, c, p, q, (A)spatial_scale, tstd, false, K, D, G, part, S, P, Q);
          const int count = mx_roi::deform_count<A>(d, S, H, W);
          if (count == 0) continue;
          const A diff =
              (A)mx_roi::Traits<T>::load(grad[((r * D + c) * P + p) * (long long)Q + q]) /
              (A)count;
          const T* plane = data + mx_roi::plane_offset(d.g.batch, d.cin, Cin, H, W);
          for (int i = 0; i < S; ++i) {
            const mx_roi::DeformAxis<A> ay =
                mx_roi::deform_axis<A>(d.hs + (A)i * d.g.sub_h, H);
            for (int j = 0; j < S; ++j) {
              const mx_roi::DeformAxis<A> ax =
                  mx_roi::deform_axis<A>(d.ws + (A)j * d.g.sub_w, W);
              if (!(ay.inside && ax.inside)) continue;
              A dx, dy;
              mx_roi::deform_trans_terms<A>(
                  mx_roi::Traits<T>::load(plane[(long long)ay.lo * W + ax.lo]),
                  mx_roi::Traits<T>::load(plane[(long long)ay.hi * W + ax.lo]),
                  mx_roi::Traits<T>::load(plane[(long long)ay.lo * W + ax.hi]),
                  mx_roi::Traits<T>::load(plane[(long long)ay.hi * W + ax.hi]), ax.d, ay.d, tstd,
                  diff, d.g.roi_w, d.g.roi_h, &dx, &dy);
              sx += dx;
              sy += dy;
            }
          }
        }
      }
    }
    trans_grad[mx_roi::deform_trans_index(r, k, K, 0, part, u, v)] = sx;
    trans_grad[mx_roi::deform_trans_index(r, k, K, 1, part, u, v)] = sy;
  }
}

// ---- the offsets' device check (the native GPU path: mx_roi.ext.cuda) --------------------
// check_extra_inputs' rule where the offsets are: every element of trans below the guard
// bound in magnitude (float16: finite), as the rois' check (mx_roi::geo::value_bad).  The
// bad element check_extra_inputs names (the first in C order) in two launches:
// deformable_trans_check records each bad element's index in ``first`` (the complement,
// atomicMax from a zeroed word: the lowest index wins; n = trans.size), then
// deformable_trans_status (n = 1) moves it into the channel's status words 2..4 -- the
// roi + 1; channel << 32 | u << 16 | v (2K channels, part x part cells); the value as a
// double -- unless an earlier call's, not yet reported, is there: the first bad call's
// offset is the one reported (ext_cuda.h's status_error).
template <typename T, typename A>
__global__ void deformable_trans_check(const T* __restrict__ trans, double bound, int use_bound,
                                       unsigned long long* __restrict__ first, long long n) {
  const long long step = (long long)blockDim.x * (long long)gridDim.x;
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += step)
    if (mx_roi::geo::value_bad<T, A>(trans[i], bound, use_bound != 0))
      atomicMax(first, ~(unsigned long long)i);
}

template <typename T, typename A>
__global__ void deformable_trans_status(const T* __restrict__ trans,
                                        const unsigned long long* __restrict__ first,
                                        int channels, int part,
                                        unsigned long long* __restrict__ status, long long n) {
  const long long step = (long long)blockDim.x * (long long)gridDim.x;
  for (long long t = (long long)blockIdx.x * blockDim.x + threadIdx.x; t < n; t += step) {
    if (*first == 0 || status[2] != 0) continue;
    const unsigned long long i = ~*first, cells = (unsigned long long)part * part;
    status[2] = i / (cells * channels) + 1;
    status[3] = (i / cells % channels) << 32 | (i % cells / part) << 16 | (i % part);
    reinterpret_cast<double*>(status)[4] = (double)mx_roi::Traits<T>::load(trans[i]);
  }
}

#ifdef MX_ROI_EXT_LAUNCHER
// ==== mx_roi_DeformablePSROIPooling: this op in mx_roi's MXNet extension library ==========
// Compiled only into that library (g++ with -DMX_ROI_EXT_LAUNCHER, the host shim in native
// mode): the GPU, emulated and native builds never see this section.  Inputs as
// mx.nd.contrib.DeformablePSROIPooling's and the Custom op's (operators/
// deformable_psroi_pooling.py): data, rois and, unless no_trans, trans (R, 2K, part, part);
// one output (the built-in's top_count is not exposed, as the Custom op does not).
// Parameters as DeformablePSROIPoolingParam's (parsed as mx_roi/params.py parses them, with
// its messages).  The host launcher makes the native backend's checked call
// (cuda/backend.py _forward / _backward with forward_cuda / backward_cuda; this op is never
// recorded): the same checks in the same order and messages, then this file's kernels with
// the same arguments -- forward; backward (the offsets' gradient fused into it when every
// offset element is one item's alone, else deformable_psroi_pooling_backward_trans).  The
// native build is deterministic whatever ``deterministic`` says (each thread owns whole
// gradient planes), so it is parsed and has nothing to change.
#include <set>

#include "ext_launch.h"

namespace mx_roi_op {

struct DeformablePSROIPoolingOp {
  static constexpr const char* OP = "DeformablePSROIPooling";
  static constexpr const char* EXTRA_INPUT = "trans";  // (ExtraInput: the third input)

  struct Params {
    long long P = 0, Q = 0;  // pooled_size, twice (Callbacks reads the output's P x Q)
    double spatial_scale = 0, trans_std = 0;
    long long output_dim = 0, group_size = 0, part_size = 0, sample_per_part = 1;
    bool no_trans = false, deterministic = false;
    long long part() const { return part_size ? part_size : P; }
  };

  // DeformablePSROIPoolingParam.input_names: no trans with no_trans
  static int num_inputs(const Params& p) { return p.no_trans ? 2 : 3; }

  // DeformablePSROIPoolingParam.from_kwargs
  static Params parse(const std::unordered_map<std::string, std::string>& attrs) {
    Kwargs kw(OP, attrs, {"spatial_scale", "output_dim", "group_size", "pooled_size",
                          "part_size", "sample_per_part", "trans_std", "no_trans",
                          "deterministic"},
              {"spatial_scale", "output_dim", "group_size", "pooled_size"});
    Params p;
    p.spatial_scale = kw.real("spatial_scale", 0);
    p.output_dim = kw.integer("output_dim", 0);
    p.group_size = kw.integer("group_size", 0);
    p.P = p.Q = kw.integer("pooled_size", 0);
    p.part_size = kw.integer("part_size", 0);
    p.sample_per_part = kw.integer("sample_per_part", 1);
    p.trans_std = kw.real("trans_std", 0.0);
    p.no_trans = kw.boolean("no_trans", false);
    p.deterministic = kw.boolean("deterministic", false);
    kw.finish();
    // ParamBase.__post_init__: _positive in order, then each field's bounds in field
    // order; then the struct's own part_size and trans_std rules
    // (py_int_repr: a value beyond int64 printed exactly, as params.py's message does)
    const std::string dim = py_int_repr(p.output_dim), grp = py_int_repr(p.group_size);
    const std::string pooled = py_int_repr(p.P), part = py_int_repr(p.part_size);
    const std::string spp = py_int_repr(p.sample_per_part);
    kw.positive("spatial_scale", p.spatial_scale > 0, py_float_repr(p.spatial_scale));
    kw.positive("output_dim", p.output_dim > 0, dim);
    kw.positive("group_size", p.group_size > 0, grp);
    kw.positive("pooled_size", p.P > 0, pooled);
    kw.positive("sample_per_part", p.sample_per_part > 0, spp);
    const std::string most_size = "at most " + std::to_string(MAX_ELEMENTS) + " (" + SIZE_WHY + ")";
    kw.check("output_dim", p.output_dim <= MAX_ELEMENTS, most_size, dim);
    kw.check("group_size", p.group_size <= MAX_ELEMENTS, most_size, grp);
    kw.check("pooled_size", p.P <= MAX_POOLED,
             "at most " + std::to_string(MAX_POOLED) +
                 " (pooled_size^2 bins of one roi and channel in an MXNet array)",
             pooled);
    kw.check("part_size", p.part_size <= MAX_PART,
             "at most " + std::to_string(MAX_PART) +
                 " (2 * part_size^2 offsets of one roi in an MXNet array)",
             part);
    kw.check("sample_per_part", p.sample_per_part <= MAX_SAMPLES_PER_SIDE,
             "at most " + std::to_string(MAX_SAMPLES_PER_SIDE) + " (samples per bin side)", spp);
    kw.check("part_size", p.part_size >= 0, "0 (= pooled_size) or a positive int", part);
    kw.check("trans_std", p.trans_std >= 0, "a value >= 0", py_float_repr(p.trans_std));
    return p;
  }

  // deformable_psroi_pooling.MAX_POOLED, MAX_PART: isqrt(MAX_ELEMENTS), isqrt(MAX_ELEMENTS / 2)
  static constexpr long long MAX_POOLED = 46340, MAX_PART = 32767;

  // DeformablePSROIPoolingParam.to_kwargs, "name=value;..." (the tests compare it)
  static std::string format(const std::unordered_map<std::string, std::string>& attrs) {
    const Params p = parse(attrs);
    return "spatial_scale=" + py_float_repr(p.spatial_scale) +
           ";output_dim=" + std::to_string(p.output_dim) +
           ";group_size=" + std::to_string(p.group_size) + ";pooled_size=" + std::to_string(p.P) +
           ";part_size=" + std::to_string(p.part_size) +
           ";sample_per_part=" + std::to_string(p.sample_per_part) +
           ";trans_std=" + py_float_repr(p.trans_std) + ";no_trans=" +
           (p.no_trans ? "True" : "False") + ";deterministic=" +
           (p.deterministic ? "True" : "False");
  }

  // DeformablePSROIPooling.out_channels: at least output_dim * group_size^2 channels (the
  // built-in reads the first ones; more are unused)
  static long long out_channels(const Params& p, long long C) {
    const unsigned __int128 need = (unsigned __int128)p.output_dim *
                                   (unsigned __int128)p.group_size *
                                   (unsigned __int128)p.group_size;
    if ((unsigned __int128)C < need)
      throw OpError(std::string(OP) + ": data has " + std::to_string(C) +
                    " channels but output_dim * group_size^2 = " + std::to_string(p.output_dim) +
                    " * " + std::to_string(p.group_size) + "^2 = " + u128_str(need) +
                    " are required");
    return p.output_dim;
  }

  // DeformablePSROIPooling._check_trans_shape: (R, 2K, part, part), K >= 1 dividing output_dim
  template <typename S>
  static void check_extra_shape(const Params& p, const std::vector<S>& shape, long long R) {
    const long long part = p.part();
    const std::string got = shape_repr(shape);
    if (shape.size() != 4 || (long long)shape[0] != R || (long long)shape[2] != part ||
        (long long)shape[3] != part || shape[1] < 2 || shape[1] % 2)
      throw OpError(std::string(OP) + ": trans must have shape (R, 2 * K, part_size, part_size) = (" +
                    std::to_string(R) + ", 2 * K, " + std::to_string(part) + ", " +
                    std::to_string(part) + ") with K >= 1 offset classes, got " + got);
    const long long K = (long long)shape[1] / 2;
    if (p.output_dim % K)
      throw OpError(std::string(OP) + ": trans has K = " + std::to_string(K) +
                    " offset classes (shape " + got + ") but output_dim = " +
                    std::to_string(p.output_dim) + " is not a multiple of K");
  }

  // RoIOp.check_inputs on the host (check_rois: the first non-finite roi, else the first
  // batch index out of range; the message of registry.RoIOp.roi_error)
  template <typename T, typename A>
  static void check_rois(const MXTensor& data, const MXTensor& rois) {
    const long long R = rois.shape[0], N = data.shape[0];
    if (R == 0) return;
    const T* r = (const T*)rois.data_ptr;
    long long row = 0;
    const int code = mx_roi::geo::check_rois<T, A>(r, R, N, GUARD_BOUND,
                                                   !std::is_same<T, __half>::value, &row);
    if (code)
      throw OpError(roi_error(OP, code == 1 ? ~(unsigned long long)row
                                            : ~(STATUS_BATCH_KEY + (unsigned long long)row),
                              r, N));
  }

  // check_extra_inputs: trans's shape, then its values below GUARD_BOUND (float16: finite),
  // compared as NumPy compares them (the bound in the dtype), the first bad one in C order
  template <typename T, typename A>
  static void check_trans(const Params& p, const MXTensor* trans, long long R) {
    if (p.no_trans) return;
    check_extra_shape(p, trans->shape, R);
    const T* t = (const T*)trans->data_ptr;
    const long long n = numel(trans->shape);
    const bool use_bound = !std::is_same<T, __half>::value;  // onednn.bounded_dtype
    for (long long i = 0; i < n; ++i) {
      if (!mx_roi::geo::value_bad<T, A>(t[i], GUARD_BOUND, use_bound)) continue;
      const double v = to_double(t[i]);
      std::string at;
      long long rest = i;
      for (int d = 3; d >= 0; --d) {
        const long long s = trans->shape[d];
        at = std::to_string(rest % s) + (d == 3 ? "" : ", ") + at;
        rest /= s;
      }
      throw OpError(std::string(OP) + ": trans[" + at + "] is " + py_float_repr(v) +
                    "; offsets must be finite");
    }
  }

  // backend._check_plane: the kernels index within one (H, W) plane in int32
  static void check_plane(const MXTensor& data) {
    const long long H = data.shape[2], W = data.shape[3];
    if (H * W >= (1LL << 31))
      throw OpError(std::string(OP) + ": a feature map of " + std::to_string(H) + "x" +
                    std::to_string(W) + " has 2^31 or more elements per channel, more than "
                    "the CUDA kernels index");
  }

  // The kernels' common arguments (_kernel_args): trans (a zero when absent), K
  template <typename T>
  struct Args {
    const T* trans;
    int K;
    T zero[1];
    Args(const Params& p, const MXTensor* t) {
      std::memset(zero, 0, sizeof zero);
      trans = p.no_trans ? zero : (const T*)t->data_ptr;
      K = p.no_trans ? 1 : (int)(t->shape[1] / 2);
    }
  };

  // (_forward: checks, then nothing for no rois, zeros for an empty map, else the kernel)
  template <typename T, typename A>
  static void forward(const Params& p, const MXTensor& data, const MXTensor& rois,
                      const MXTensor* trans, MXTensor& out) {
    check_rois<T, A>(data, rois);
    check_trans<T, A>(p, trans, rois.shape[0]);
    check_plane(data);
    const long long R = rois.shape[0];
    if (R == 0) return;
    if (numel(data.shape) == 0) {
      std::memset(out.data_ptr, 0, (size_t)numel(out.shape) * sizeof(T));
      return;
    }
    const Args<T> a(p, trans);
    const int D = (int)p.output_dim, P = (int)p.P;
    const long long n = R * D * (long long)P * P;
    mx_roi_launch_channels(D, native_threads(n), [&]() {
      deformable_psroi_pooling_forward<T, A>(
          (const T*)data.data_ptr, (const T*)rois.data_ptr, a.trans,
          (double)(float)p.spatial_scale, (double)(float)p.trans_std, p.no_trans ? 1 : 0, a.K,
          (int)p.group_size, (int)p.part(), (int)p.sample_per_part, D, (int)data.shape[1],
          (int)data.shape[2], (int)data.shape[3], P, P, (T*)out.data_ptr, n);
    }, data.shape[2] * data.shape[3]);
  }

  // DeformablePSROIPooling._fused: every offset element one item's alone
  template <typename A>
  static bool fused(const Params& p, int K) {
    if (K != p.output_dim || p.part() != p.P) return false;
    std::set<int> cells;
    for (int i = 0; i < (int)p.P; ++i) cells.insert(mx_roi::deform_part<A>(i, (int)p.P, (int)p.part()));
    return (long long)cells.size() == p.P;
  }

  // (_backward: the plane, rois and trans checks, nothing more for no rois or an empty map
  // -- Callbacks zeroed both gradients --, else backward_cuda's launches)
  template <typename T, typename A>
  static void backward(const Params& p, const MXTensor& grad, const MXTensor& data,
                       const MXTensor& rois, const MXTensor* trans, A* bottom,
                       MXTensor* trans_grad) {
    check_plane(data);
    check_rois<T, A>(data, rois);
    check_trans<T, A>(p, trans, rois.shape[0]);
    const long long R = rois.shape[0];
    if (R == 0 || numel(data.shape) == 0) return;
    const Args<T> a(p, trans);
    const int D = (int)p.output_dim, P = (int)p.P, part = (int)p.part();
    const int G = (int)p.group_size, S = (int)p.sample_per_part;
    const int Cin = (int)data.shape[1], H = (int)data.shape[2], W = (int)data.shape[3];
    const double scale = (double)(float)p.spatial_scale, tstd = (double)(float)p.trans_std;
    const T* x = (const T*)data.data_ptr;
    const T* r = (const T*)rois.data_ptr;
    // the offsets' gradient in A: MXNet's memory, or (float16) a float32 buffer stored once
    const long long tn = p.no_trans ? 1 : numel(trans_grad->shape);
    static thread_local std::vector<A> own;
    const bool direct = !p.no_trans && std::is_same<T, A>::value;
    if (!direct && own.size() < (size_t)tn) own.resize((size_t)tn);
    A* tgrad = direct ? (A*)trans_grad->data_ptr : own.data();
    const bool fuse = !p.no_trans && fused<A>(p, a.K);
    const long long n = R * D * (long long)P * P;
    mx_roi_launch_channels(D, native_threads(n), [&]() {
      deformable_psroi_pooling_backward<T, A, A>(
          (const T*)grad.data_ptr, p.no_trans ? a.zero : x, r, a.trans, scale, tstd,
          p.no_trans ? 1 : 0, a.K, G, part, S, D, Cin, H, W, P, P, bottom, tgrad, fuse ? 1 : 0,
          1.0, n);
    }, (long long)H * W);
    if (p.no_trans) return;
    if (!fuse) {
      const long long RK = R * a.K, tn_items = RK * part * (long long)part;
      mx_roi_launch_channels((int)RK, native_threads(tn_items), [&]() {
        deformable_psroi_pooling_backward_trans<T, A>(
            (const T*)grad.data_ptr, x, r, a.trans, scale, tstd, a.K, G, part, S, (int)RK, D,
            Cin, H, W, P, P, tgrad, tn_items);
      }, (long long)H * W);
    }
    if (!direct) {
      T* out = (T*)trans_grad->data_ptr;
      for (long long i = 0; i < tn; ++i) out[i] = mx_roi::Traits<T>::store(tgrad[i]);
    }
  }
};

const RegisterParams deformable_psroi_pooling_params("DeformablePSROIPooling",
                                                     DeformablePSROIPoolingOp::format);

// mx_roi.ext.cuda's launcher (the MX_ROI_EXT_CUDA_LAUNCHER section below) on MXNet's
// stream: the rois' checked copy and the offsets' device check in MXNet's temporary
// workspace; no host wait.  trans (its shape and dtype checked by GpuCallbacks) is the
// third input; its gradient the third output.
struct DeformablePSROIPoolingGpu {
  typedef DeformablePSROIPoolingOp Op;
  typedef int (*Workspace)(int, long long, long long, long long, long long, long long,
                           long long, int, int, unsigned long long*, char*, size_t);
  typedef int (*Forward)(int, const void*, const void*, const void*, void*, long long,
                         long long, long long, long long, long long, long long, int, int, int,
                         int, int, float, float, void*, unsigned long long, void*, char*,
                         size_t);
  typedef int (*Backward)(int, const void*, const void*, const void*, const void*, void*, void*,
                          void*, long long, long long, long long, long long, long long,
                          long long, int, int, int, int, int, float, float, void*,
                          unsigned long long, void*, char*, size_t);
  static constexpr const char* OP = DeformablePSROIPoolingOp::OP;

  // trans's offset classes K (0: no trans)
  static long long classes(const MXTensor* trans) { return trans ? trans->shape[1] / 2 : 0; }

  static void* tables(const Op::Params& p, const MXTensor& data, long long R,
                      const MXTensor* trans, bool backward, const OpResource& res,
                      unsigned long long* bytes) {
    char err[4096] = "";
    gpu_call(gpu_entry<Workspace>(OP, "mx_roi_ext_cuda_deformable_psroi_pooling_workspace")(
                 data.dtype, data.shape[0], data.shape[1], data.shape[2], data.shape[3], R,
                 classes(trans), (int)p.part(), backward ? 1 : 0, bytes, err, sizeof err),
             err);
    return gpu_workspace(OP, res, *bytes);
  }

  static int forward(const Op::Params& p, const MXTensor& data, const MXTensor& rois,
                     const MXTensor* trans, MXTensor& out, void* ws, unsigned long long bytes,
                     void* stream, char* err, size_t len) {
    return gpu_entry<Forward>(OP, "mx_roi_ext_cuda_deformable_psroi_pooling_forward")(
        data.dtype, data.data_ptr, rois.data_ptr, trans ? trans->data_ptr : nullptr,
        out.data_ptr, data.shape[0], data.shape[1], data.shape[2], data.shape[3],
        rois.shape[0], classes(trans), (int)p.output_dim, (int)p.group_size, (int)p.P,
        (int)p.part(), (int)p.sample_per_part, (float)p.spatial_scale, (float)p.trans_std, ws,
        bytes, stream, err, len);
  }

  static int backward(const Op::Params& p, const MXTensor& grad, const MXTensor& data,
                      const MXTensor& rois, const MXTensor* trans, MXTensor& in_grad,
                      MXTensor& rois_grad, MXTensor* trans_grad, void* ws,
                      unsigned long long bytes, void* stream, char* err, size_t len) {
    return gpu_entry<Backward>(OP, "mx_roi_ext_cuda_deformable_psroi_pooling_backward")(
        data.dtype, grad.data_ptr, data.data_ptr, rois.data_ptr,
        trans ? trans->data_ptr : nullptr, in_grad.data_ptr, rois_grad.data_ptr,
        trans_grad ? trans_grad->data_ptr : nullptr, data.shape[0], data.shape[1],
        data.shape[2], data.shape[3], rois.shape[0], classes(trans), (int)p.output_dim,
        (int)p.group_size, (int)p.P, (int)p.part(), (int)p.sample_per_part,
        (float)p.spatial_scale, (float)p.trans_std, ws, bytes, stream, err, len);
  }
};

}  // namespace mx_roi_op

MX_ROI_EXT_REGISTER(mx_roi_DeformablePSROIPooling, mx_roi_op::DeformablePSROIPoolingOp)
    .setForward(mx_roi_op::GpuCallbacks<mx_roi_op::DeformablePSROIPoolingGpu>::forward, "gpu")
    .setBackward(mx_roi_op::GpuCallbacks<mx_roi_op::DeformablePSROIPoolingGpu>::backward,
                 "gpu");
#endif  // MX_ROI_EXT_LAUNCHER

#ifdef MX_ROI_EXT_CUDA_LAUNCHER
// ==== this op on the native GPU path (opt-in; docs/gpu.md) ===============================
// Compiled only into mx_roi.ext.cuda's launcher library (as roi_align.cu's section): the
// driver-API launch of this file's kernels (deformable_psroi_pooling.py's
// native_gpu_kernels, NVRTC's PTX in DEFORMABLE_PSROI_POOLING_IMAGE).  The op kernels read
// the rois and the offsets themselves: the rois through roi_safe_copy's checked copy in
// the workspace (a bad roi a padding roi there, in the status word), the offsets as given
// after their device check (deformable_trans_check / _status: a bad offset in status
// words 2..4; the kernels' sample test keeps any offset from indexing outside the map),
// then forward_cuda's / backward_cuda's launches.  Workspace: the rois' copy (R, 5), a
// 16-byte scratch (the check's first bad index; zeros standing in for absent offsets),
// then for a float16 backward with offsets their float32 gradient and the data gradient's
// accumulator (with_accumulator).
namespace mx_roi_cuda {

inline unsigned long long deform_trans_size(long long R, long long K, int part) {
  return (unsigned long long)R * 2 * K * part * part;
}

// Where the call's arrays are in the workspace
struct DeformWorkspace {
  CUdeviceptr safe, scratch, trans_acc, acc;
  unsigned long long bytes;

  DeformWorkspace(int dtype, long long N, long long C, long long H, long long W, long long R,
                  long long K, int part, bool backward, CUdeviceptr ws = 0) {
    const unsigned long long safe_bytes = safe_rois_bytes(dtype, R, 5);
    const unsigned long long tacc_bytes =
        backward && K > 0 && dtype == DTYPE_FLOAT16 ? aligned16(deform_trans_size(R, K, part) * 4)
                                                    : 0;
    safe = ws;
    scratch = ws + safe_bytes;
    trans_acc = scratch + 16;
    acc = trans_acc + tacc_bytes;
    bytes = R <= 0 ? 0
            : backward ? with_accumulator(safe_bytes + 16 + tacc_bytes, dtype, N * C * H * W)
                       : safe_bytes + 16;
  }
};

// The entries' checks of what the kernels would index with (DeformablePSROIPooling's
// out_channels, _check_trans_shape's class rule and backend._check_plane; the callers'
// parameters validated as DeformablePSROIPoolingParam does)
inline void deform_check(const std::string& op, long long C, long long H, long long W, long long K,
                         bool has_trans, int output_dim, int group_size, int pooled, int part,
                         int sample_per_part) {
  if (output_dim < 1 || group_size < 1 || pooled < 1 || part < 1 || sample_per_part < 1)
    throw Error(op + ": output_dim, group_size, pooled_size, part and sample_per_part must "
                "be positive");
  const long long need = (long long)output_dim * group_size * group_size;
  if (C < need)
    throw Error(op + ": data has " + std::to_string(C) + " channels but output_dim * " +
                "group_size^2 = " + std::to_string(output_dim) + " * " +
                std::to_string(group_size) + "^2 = " + std::to_string(need) +
                " are required");
  if (H * W >= (1LL << 31))
    throw Error(op + ": a feature map of " + std::to_string(H) + "x" + std::to_string(W) +
                " has 2^31 or more elements per channel, more than the CUDA kernels index");
  if (has_trans && (K < 1 || output_dim % K))
    throw Error(op + ": trans has K = " + std::to_string(K) + " offset classes but "
                "output_dim = " + std::to_string(output_dim) + " is not a multiple of K");
}

// DeformablePSROIPooling._fused in the compute type A: every offset element one item's
// alone (K = output_dim, part = pooled_size, and the part cells floor(p / P * part) --
// deform_part's order -- all distinct)
template <typename A>
inline bool deform_fused_in(long long K, int output_dim, int pooled, int part) {
  if (K != output_dim || part != pooled) return false;
  std::vector<char> seen((size_t)pooled, 0);
  for (int p = 0; p < pooled; ++p) {
    const int u = (int)std::floor((A)p / (A)pooled * (A)part);
    if (u < 0 || u >= pooled || seen[(size_t)u]) return false;
    seen[(size_t)u] = 1;
  }
  return true;
}

// The rois' checked copy, and with offsets their check, on the call's stream (after the
// scratch is zeroed)
inline void deform_prepare(const CallScope& call, const DeformWorkspace& w, CUdeviceptr rois,
                           CUdeviceptr trans, long long N, long long R, long long K,
                           int part) {
  call.zero(w.scratch, 16);
  Args a;
  a(rois)(5)(N)(GUARD_BOUND)(call.t.bounded ? 1 : 0)(w.safe)(call.ch.status)(R);
  call.run(DEFORMABLE_PSROI_POOLING_IMAGE, "roi_safe_copy" + call.ta() + ">", R, a);
  if (!trans) return;
  const long long n = (long long)deform_trans_size(R, K, part);
  Args c;
  c(trans)(GUARD_BOUND)(call.t.bounded ? 1 : 0)(w.scratch)(n);
  call.run(DEFORMABLE_PSROI_POOLING_IMAGE, "deformable_trans_check" + call.ta() + ">", n, c);
  Args s;
  s(trans)(w.scratch)((int)(2 * K))(part)(call.ch.status)(1LL);
  call.run(DEFORMABLE_PSROI_POOLING_IMAGE, "deformable_trans_status" + call.ta() + ">", 1, s);
}

// The kernels' common arguments after (data,) rois, trans: scales, no_trans, K, G, part, S
inline void deform_common(Args& k, bool has_trans, long long K, float spatial_scale,
                          float trans_std, int group_size, int part, int sample_per_part) {
  k((double)spatial_scale)((double)trans_std)(has_trans ? 0 : 1)((int)(has_trans ? K : 1))(
      group_size)(part)(sample_per_part);
}

// DeformablePSROIPooling's forward (forward_cuda on the checked rois) on ``stream``
inline void deformable_psroi_pooling_forward(int dtype, CUdeviceptr data, CUdeviceptr rois,
                                             CUdeviceptr trans, CUdeviceptr out, long long N,
                                             long long C, long long H, long long W,
                                             long long R, long long K, int output_dim,
                                             int group_size, int pooled, int part,
                                             int sample_per_part, float spatial_scale,
                                             float trans_std, CUdeviceptr workspace,
                                             unsigned long long workspace_bytes,
                                             CUstream stream) {
  const CallScope call("DeformablePSROIPooling", dtype, stream);
  call.report();
  deform_check(call.op, C, H, W, K, trans != 0, output_dim, group_size, pooled, part,
               sample_per_part);
  if (R <= 0) return;  // no roi: nothing to launch (the output is empty)
  const DeformWorkspace w(dtype, N, C, H, W, R, K, part, false, workspace);
  need_workspace(call.op, workspace_bytes, w.bytes);
  deform_prepare(call, w, rois, trans, N, R, K, part);
  const long long n = R * output_dim * (long long)pooled * pooled;
  if (N * C * H * W == 0) {  // an empty map: zeros (backend._forward), no kernel on it
    call.zero(out, (size_t)n * item_size(dtype));
  } else {
    Args k;
    k(data)(w.safe)(trans ? trans : w.scratch);
    deform_common(k, trans != 0, K, spatial_scale, trans_std, group_size, part,
                  sample_per_part);
    k(output_dim)((int)C)((int)H)((int)W)(pooled)(pooled)(out)(n);
    call.run(DEFORMABLE_PSROI_POOLING_IMAGE,
             "deformable_psroi_pooling_forward" + call.ta() + ">", n, k);
  }
  call.record();
}

// DeformablePSROIPooling's backward (backward_cuda, req write) on ``stream``: the data
// gradient (and the rois') zeroed, the checks, the data gradient's pass -- writing the
// offsets' gradient too where fused -- else deformable_psroi_pooling_backward_trans; float16
// through float32 results, stored last.  ``trans_grad`` null: the offsets' gradient is not
// computed.  A bad roi or offset raises nothing here (the next forward reports it).
inline void deformable_psroi_pooling_backward(
    int dtype, CUdeviceptr grad, CUdeviceptr data, CUdeviceptr rois, CUdeviceptr trans,
    CUdeviceptr in_grad, CUdeviceptr rois_grad, CUdeviceptr trans_grad, long long N, long long C,
    long long H, long long W, long long R, long long K, int output_dim, int group_size,
    int pooled, int part, int sample_per_part, float spatial_scale, float trans_std,
    CUdeviceptr workspace, unsigned long long workspace_bytes, CUstream stream) {
  const CallScope call("DeformablePSROIPooling", dtype, stream);
  deform_check(call.op, C, H, W, K, trans != 0, output_dim, group_size, pooled, part,
               sample_per_part);
  const DeformWorkspace w(dtype, N, C, H, W, R, K, part, true, workspace);
  need_workspace(call.op, workspace_bytes, w.bytes);
  if (R <= 0) return call.zero(in_grad, (size_t)(N * C * H * W) * item_size(dtype));
  const GradTarget target(call, dtype, in_grad, rois_grad, N * C * H * W, R, 5, w.acc);
  deform_prepare(call, w, rois, trans, N, R, K, part);
  const bool want_tgrad = trans && trans_grad, half = dtype == DTYPE_FLOAT16;
  const unsigned long long tsize = want_tgrad ? deform_trans_size(R, K, part) : 0;
  if (N * C * H * W == 0) {  // an empty map: the offsets' gradient is zeros
    if (want_tgrad) call.zero(trans_grad, (size_t)tsize * item_size(dtype));
    return call.record();
  }
  const bool fuse = want_tgrad && (dtype == DTYPE_FLOAT64
                                       ? deform_fused_in<double>(K, output_dim, pooled, part)
                                       : deform_fused_in<float>(K, output_dim, pooled, part));
  const CUdeviceptr tgrad = !want_tgrad ? w.scratch : half ? w.trans_acc : trans_grad;
  const long long n = R * output_dim * (long long)pooled * pooled;
  Args k;
  k(grad)(trans ? data : w.scratch)(w.safe)(trans ? trans : w.scratch);
  deform_common(k, trans != 0, K, spatial_scale, trans_std, group_size, part, sample_per_part);
  k(output_dim)((int)C)((int)H)((int)W)(pooled)(pooled)(target.bottom)(tgrad)(fuse ? 1 : 0)(1.0)(
      n);
  call.run(DEFORMABLE_PSROI_POOLING_IMAGE,
           "deformable_psroi_pooling_backward" + call.ta() + ", " + call.t.A + ">", n, k);
  if (want_tgrad && !fuse) {
    const long long RK = R * K, items = RK * part * (long long)part;  // C = R * K
    Args t;
    t(grad)(data)(w.safe)(trans)((double)spatial_scale)((double)trans_std)((int)K)(group_size)(
        part)(sample_per_part)((int)RK)(output_dim)((int)C)((int)H)((int)W)(pooled)(pooled)(
        tgrad)(items);
    call.run(DEFORMABLE_PSROI_POOLING_IMAGE,
             "deformable_psroi_pooling_backward_trans" + call.ta() + ">", items, t);
  }
  if (want_tgrad && half) {
    Args c;
    c(w.trans_acc)(trans_grad)((long long)tsize);
    call.run(EXT_CUDA_CAST_IMAGE, "store_float_as<__half>", (long long)tsize, c);
  }
  target.store(call);
  call.record();
}

}  // namespace mx_roi_cuda

extern "C" {

// The workspace bytes of a DeformablePSROIPooling forward (``backward`` 0) or backward (1)
// with K offset classes of part x part cells (K 0: no trans): 0, or 1 with the message.
int mx_roi_ext_cuda_deformable_psroi_pooling_workspace(int dtype, long long N, long long C,
                                                       long long H, long long W, long long R,
                                                       long long K, int part, int backward,
                                                       unsigned long long* bytes, char* err,
                                                       size_t err_len) {
  return mx_roi_cuda::c_entry(err, err_len, [&]() {
    mx_roi_cuda::types_of("DeformablePSROIPooling", dtype);
    *bytes = mx_roi_cuda::DeformWorkspace(dtype, N, C, H, W, R, K, part, backward != 0).bytes;
  });
}

// DeformablePSROIPooling's forward on ``stream``: data (N, C, H, W), rois (R, 5), trans
// (R, 2K, part, part) or null (no_trans: K is not read), out (R, output_dim, pooled,
// pooled), device pointers of ``dtype``; ``workspace``: at least the workspace function's
// bytes.  No host synchronisation.
int mx_roi_ext_cuda_deformable_psroi_pooling_forward(
    int dtype, const void* data, const void* rois, const void* trans, void* out, long long N,
    long long C, long long H, long long W, long long R, long long K, int output_dim,
    int group_size, int pooled, int part, int sample_per_part, float spatial_scale,
    float trans_std, void* workspace, unsigned long long workspace_bytes, void* stream, char* err,
    size_t err_len) {
  return mx_roi_cuda::c_entry(err, err_len, [&]() {
    mx_roi_cuda::deformable_psroi_pooling_forward(
        dtype, (mx_roi_cuda::CUdeviceptr)data, (mx_roi_cuda::CUdeviceptr)rois,
        (mx_roi_cuda::CUdeviceptr)trans, (mx_roi_cuda::CUdeviceptr)out, N, C, H, W, R, K,
        output_dim, group_size, pooled, part, sample_per_part, spatial_scale, trans_std,
        (mx_roi_cuda::CUdeviceptr)workspace, workspace_bytes, (mx_roi_cuda::CUstream)stream);
  });
}

// DeformablePSROIPooling's backward on ``stream``: grad (R, output_dim, pooled, pooled),
// data (read with offsets), in_grad written, rois_grad (R, 5) zeroed, trans_grad (R, 2K,
// part, part) written (null: not computed; absent offsets: none).  No host
// synchronisation; a bad roi or offset is reported by a later forward.
int mx_roi_ext_cuda_deformable_psroi_pooling_backward(
    int dtype, const void* grad, const void* data, const void* rois, const void* trans,
    void* in_grad, void* rois_grad, void* trans_grad, long long N, long long C, long long H,
    long long W, long long R, long long K, int output_dim, int group_size, int pooled, int part,
    int sample_per_part, float spatial_scale, float trans_std, void* workspace,
    unsigned long long workspace_bytes, void* stream, char* err, size_t err_len) {
  return mx_roi_cuda::c_entry(err, err_len, [&]() {
    mx_roi_cuda::deformable_psroi_pooling_backward(
        dtype, (mx_roi_cuda::CUdeviceptr)grad, (mx_roi_cuda::CUdeviceptr)data,
        (mx_roi_cuda::CUdeviceptr)rois, (mx_roi_cuda::CUdeviceptr)trans,
        (mx_roi_cuda::CUdeviceptr)in_grad, (mx_roi_cuda::CUdeviceptr)rois_grad,
        (mx_roi_cuda::CUdeviceptr)trans_grad, N, C, H, W, R, K, output_dim, group_size, pooled,
        part, sample_per_part, spatial_scale, trans_std, (mx_roi_cuda::CUdeviceptr)workspace,
        workspace_bytes, (mx_roi_cuda::CUstream)stream);
  });
}

}  // extern "C"
#endif  // MX_ROI_EXT_CUDA_LAUNCHER
