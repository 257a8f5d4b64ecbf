// RROIAlign kernels: the average of bilinear samples over the bins of rotated boxes
// (MXNet's contrib.RROIAlign, forward; our backward).  The kernels derive every bin's
// sample points from the rois themselves (rotated_box, rotated_sample: MXNet's operation
// order in the compute type A); mx_roi.geometry.rotated_grid is the NumPy twin, and
// rroi_align_geometry fills its tables from these functions for the test that proves the
// two equal bit for bit.
// rois (R, 6) = (batch, x_center, y_center, width, height, angle in degrees); output
// (R, C, P, Q).
#include "roi_common.cuh"

namespace mx_roi {

// cos / sin in the compute type: cosf / sinf for float (MXNet's CPU build calls them on
// its float angle), cos / sin for double
__host__ __device__ __forceinline__ float angle_cos(float t) { return cosf(t); }
__host__ __device__ __forceinline__ double angle_cos(double t) { return cos(t); }
__host__ __device__ __forceinline__ float angle_sin(float t) { return sinf(t); }
__host__ __device__ __forceinline__ double angle_sin(double t) { return sin(t); }

// Most samples of one bin (mx_roi.geometry.MAX_ROTATED_SAMPLES; the op refuses rois that
// need more before any kernel runs; the clamp keeps the int conversion defined).
#define MX_ROI_MAX_ROTATED_SAMPLES (1 << 20)

// One roi's box in feature-map cells: centre, rotation, bins and sample grid.
template <typename A>
struct RotatedBox {
  int batch, gy, gx;
  A cy, cx, cos_t, sin_t, start_h, start_w, bin_h, bin_w, divisor;
};

template <typename A>
__host__ __device__ __forceinline__ int rotated_grid_side(A len, int pooled, int ratio) {
  if (ratio > 0) return ratio;
  const A g = ceil(len / (A)pooled);  // a reversed box (aligned: no 1x1 floor): none
  return g <= (A)0 ? 0 : g < (A)MX_ROI_MAX_ROTATED_SAMPLES ? (int)g : MX_ROI_MAX_ROTATED_SAMPLES;
}

// mx_roi.geometry.rotated_boxes: the roi scaled (aligned: centre - 0.5, Detectron2), the
// angle in degrees -> radians in double (MXNet: rois[5] * M_PI / 180.0) then A, negated
// when clockwise (mmcv); a box forced to at least 1x1 unless aligned.
template <typename T, typename A>
__host__ __device__ __forceinline__ RotatedBox<A> rotated_box(const T* roi, float spatial_scale,
                                                               int P, int Q, int ratio,
                                                               int aligned, int clockwise) {
  typedef Traits<T> Tr;
  RotatedBox<A> b;
  const A s = (A)spatial_scale, off = aligned ? (A)0.5 : (A)0;
  const A r0 = Tr::load(roi[0]);
  b.batch = (int)r0;
  b.cx = (A)Tr::load(roi[1]) * s - off;
  b.cy = (A)Tr::load(roi[2]) * s - off;
  A w = (A)Tr::load(roi[3]) * s, h = (A)Tr::load(roi[4]) * s;
  A theta = (A)((double)(A)Tr::load(roi[5]) * 3.14159265358979323846 / 180.0);
  if (clockwise) theta = -theta;
  b.cos_t = angle_cos(theta);
  b.sin_t = angle_sin(theta);
  if (!aligned) {
    w = w > (A)1 ? w : (A)1;
    h = h > (A)1 ? h : (A)1;
  }
  b.start_h = -h / (A)2;
  b.start_w = -w / (A)2;
  b.bin_h = h / (A)P;
  b.bin_w = w / (A)Q;
  b.gy = rotated_grid_side(h, P, ratio);
  b.gx = rotated_grid_side(w, Q, ratio);
  const long long count = (long long)b.gy * b.gx;
  b.divisor = (A)(count > 0 ? count : 1);
  return b;
}

// Sample (iy, ix) of bin (p, q): its point (y, x) before the bilinear rule, taps and
// weights (outside [-1, H] x [-1, W]: outside, all weights 0).
template <typename A>
__host__ __device__ __forceinline__ Sample<A> rotated_sample(const RotatedBox<A>& b, int p,
                                                              int q, int iy, int ix, int H,
                                                              int W, A* py = 0, A* px = 0) {
  const A yy = (b.start_h + (A)p * b.bin_h) + (A)((float)iy + .5f) * b.bin_h / (A)b.gy;
  const A xx = (b.start_w + (A)q * b.bin_w) + (A)((float)ix + .5f) * b.bin_w / (A)b.gx;
  A x = (xx * b.cos_t + yy * b.sin_t) + b.cx;
  A y = (yy * b.cos_t - xx * b.sin_t) + b.cy;
  if (py) *py = y;
  if (px) *px = x;
  Sample<A> s;
  if (!(y >= (A)-1 && y <= (A)H && x >= (A)-1 && x <= (A)W)) {  // NaN is outside
    s.yl = s.yh = s.xl = s.xh = 0;
    s.w1 = s.w2 = s.w3 = s.w4 = (A)0;
    s.outside = true;
    return s;
  }
  if (y <= (A)0) y = (A)0;
  if (x <= (A)0) x = (A)0;
  s.yl = (int)y;
  s.xl = (int)x;
  if (s.yl >= H - 1) {
    s.yh = s.yl = H - 1;
    y = (A)s.yl;
  } else {
    s.yh = s.yl + 1;
  }
  if (s.xl >= W - 1) {
    s.xh = s.xl = W - 1;
    x = (A)s.xl;
  } else {
    s.xh = s.xl + 1;
  }
  const A ly = y - (A)s.yl, lx = x - (A)s.xl;
  const A hy = (A)1 - ly, hx = (A)1 - lx;
  s.w1 = hy * hx;
  s.w2 = hy * lx;
  s.w3 = ly * hx;
  s.w4 = ly * lx;
  s.outside = false;
  return s;
}

}  // namespace mx_roi

#ifdef MX_ROI_HOST_NATIVE
// The in-map samples of a launch's rois, derived once per roi and read by every channel
// pass: per sample the offsets of its four taps in a channels-last block of ``ncp`` lanes
// per cell and their weights, bin by bin in the generic kernel's order (the off-map
// samples, which add nothing, left out).  The native launcher calls a kernel once per
// channel block; the tables of one launch are kept per thread from block to block (a
// launch is recognised by its rois' bytes and parameters, compared in full) up to
// MX_ROI_ROTATED_CACHE taps, else rebuilt per roi.  A roi whose bins hold more samples
// than that (or a launch with more bins than that: a pooled_size of thousands) keeps
// nothing: each() derives its bin's samples again per pass, in the same order (the same
// bits), so that the memory stays bounded (a (3000, 3000) pool took gigabytes).
#ifndef MX_ROI_ROTATED_CACHE
#define MX_ROI_ROTATED_CACHE (1 << 20)
#endif
template <typename A>
struct RotatedRoiSamples {
  struct Taps {
    long long o1, o2, o3, o4;
    A w1, w2, w3, w4;
  };
  std::vector<unsigned char> key;      // the launch: rois bytes, then the parameters
  std::vector<Taps> taps;
  std::vector<long long> first;        // (r * (P * Q + 1) + b): roi r's bin b's first tap
  std::vector<mx_roi::RotatedBox<A>> boxes;
  std::vector<char> built;
  int PQ = 0, Qn = 0, Hn = 0, Wn = 0, lanes = 0;
  bool keep = true;                    // the launch's bin starts fit MX_ROI_ROTATED_CACHE
  bool direct = false;                 // roi ``roi`` keeps nothing (each() derives)
  mx_roi::RotatedBox<A> current;       // roi ``roi``'s box when direct
  long long roi = -1;                  // the roi each() / box() read

  template <typename T>
  void start(const T* rois, long long R, float spatial_scale, int P, int Q, int ratio,
             int aligned, int clockwise, int H, int W, int ncp) {
    const int params[] = {P, Q, ratio, aligned, clockwise, H, W, ncp};
    std::vector<unsigned char> k((size_t)R * 6 * sizeof(T) + sizeof params + sizeof(float));
    memcpy(k.data(), rois, (size_t)R * 6 * sizeof(T));
    memcpy(k.data() + (size_t)R * 6 * sizeof(T), params, sizeof params);
    memcpy(k.data() + k.size() - sizeof(float), &spatial_scale, sizeof(float));
    if (k == key) return;
    key.swap(k);
    PQ = P * Q;
    Qn = Q;
    Hn = H;
    Wn = W;
    lanes = ncp;
    keep = (long long)R * (PQ + 1) <= (long long)MX_ROI_ROTATED_CACHE;
    reset(R);
  }
  void reset(long long R) {
    taps.clear();
    built.assign((size_t)R, 0);
    first.resize(keep ? (size_t)R * (PQ + 1) : 0);
    boxes.resize(keep ? (size_t)R : 0);
    if (!keep) {  // (a large earlier launch's tables given back)
      std::vector<Taps>().swap(taps);
      std::vector<long long>().swap(first);
    }
  }
  template <typename T>
  void load(long long r, const T* rois, float spatial_scale, int P, int Q, int ratio,
            int aligned, int clockwise, int H, int W, int ncp) {
    roi = r;
    if (keep && built[r]) {
      direct = false;
      return;
    }
    const mx_roi::RotatedBox<A> box = mx_roi::rotated_box<T, A>(
        rois + r * 6, spatial_scale, P, Q, ratio, aligned, clockwise);
    direct = !keep || (long long)PQ * box.gy * box.gx > (long long)MX_ROI_ROTATED_CACHE;
    if (direct) {
      current = box;
      return;
    }
    if (taps.size() > (size_t)MX_ROI_ROTATED_CACHE) reset((long long)built.size());
    boxes[r] = box;
    long long* f = first.data() + r * (PQ + 1);
    for (int p = 0; p < P; ++p)
      for (int q = 0; q < Q; ++q) {
        f[p * Q + q] = (long long)taps.size();
        for (int iy = 0; iy < box.gy; ++iy)
          for (int ix = 0; ix < box.gx; ++ix) {
            const mx_roi::Sample<A> s = mx_roi::rotated_sample(box, p, q, iy, ix, H, W);
            if (s.outside) continue;
            taps.push_back(Taps{((long long)s.yl * W + s.xl) * ncp,
                                ((long long)s.yl * W + s.xh) * ncp,
                                ((long long)s.yh * W + s.xl) * ncp,
                                ((long long)s.yh * W + s.xh) * ncp, s.w1, s.w2, s.w3, s.w4});
          }
      }
    f[PQ] = (long long)taps.size();
    built[r] = 1;
  }
  const mx_roi::RotatedBox<A>& box() const { return direct ? current : boxes[roi]; }
  // f(taps) for every in-map sample of bin (p, q) of roi ``roi``, in the generic order
  template <typename F>
  void each(int p, int q, F&& f) const {
    if (!direct) {
      const long long b = roi * (PQ + 1) + p * Qn + q;
      for (const Taps *t = taps.data() + first[b], *e = taps.data() + first[b + 1]; t != e; ++t)
        f(*t);
      return;
    }
    for (int iy = 0; iy < current.gy; ++iy)
      for (int ix = 0; ix < current.gx; ++ix) {
        const mx_roi::Sample<A> s = mx_roi::rotated_sample(current, p, q, iy, ix, Hn, Wn);
        if (s.outside) continue;
        f(Taps{((long long)s.yl * Wn + s.xl) * lanes, ((long long)s.yl * Wn + s.xh) * lanes,
               ((long long)s.yh * Wn + s.xl) * lanes, ((long long)s.yh * Wn + s.xh) * lanes,
               s.w1, s.w2, s.w3, s.w4});
      }
  }
};

// Native forward: the thread's channel block channels-last, each bin's samples taken for
// 16 channels at a time (mx_roi::SumLanes; per lane the generic kernel's operations in
// its order, so the same bits).
template <typename T, typename A>
void rroi_align_forward_native(const T* data, const T* rois, float spatial_scale, int ratio,
                               int aligned, int clockwise, int C, int H, int W, int P, int Q,
                               T* out, long long n) {
  const long long R = mx_roi::launch_rois(n, C, P, Q);
  const int* batch = mx_roi::rois_batch_column<T, A>(rois, R, 6);
  const mx_roi::LaneWalk<T, A> walk(data, batch, C, H, W, P, Q, n);
  const int ncp = walk.ncp;
  static thread_local RotatedRoiSamples<A> rs;
  rs.start(rois, R, spatial_scale, P, Q, ratio, aligned, clockwise, H, W, ncp);
  walk.each_pass_staged(batch, C, P, Q, out, (int*)nullptr, [&](
      long long r, int cc, int lanes, int p, int q, const A* img, T* o, int*) {
    if (!img) {  // padding roi: 0
      for (int c = 0; c < lanes; ++c) o[c] = mx_roi::Traits<T>::store((A)0);
      return;
    }
    rs.load(r, rois, spatial_scale, P, Q, ratio, aligned, clockwise, H, W, ncp);
    const A* base = img + cc;
    mx_roi::SumLanes<A> m;
    m.zero();
    rs.each(p, q, [&](const typename RotatedRoiSamples<A>::Taps& t) {
      m.add(base + t.o1, base + t.o2, base + t.o3, base + t.o4, t.w1, t.w2, t.w3, t.w4);
    });
    m.divide(rs.box().divisor);
    mx_roi::store_lanes<T>(m, o);
  });
}

// Native backward, float accumulation (O = A; the fixed-point O of deterministic mode
// takes the generic loop): per roi its samples once, the thread's channel block
// accumulated channels-last (mx_roi::GradBlock), each sample's four taps added for 16
// channels at a time (mx_roi::AddLanes), then added to the gradient planes.  Per channel
// the generic kernel's contributions g * w in its order (roi, bin, sample, tap) onto a
// zero start: the same bits.
template <typename T, typename A, typename O>
struct RotatedBackwardLanes {
  template <typename... Args>
  static bool run(Args...) { return false; }
};

template <typename T, typename A>
struct RotatedBackwardLanes<T, A, A> {
  static bool run(const T* grad, const T* rois, float spatial_scale, int ratio, int aligned,
                  int clockwise, int C, int H, int W, int P, int Q, A* bottom, long long n) {
    const int L = mx_roi::LANES, c0 = mx_roi_c_begin, nc = mx_roi_c_end - mx_roi_c_begin;
    const int ncp = mx_roi::padded_lanes(nc);
    const long long plane_out = (long long)P * Q;
    const long long R = C * plane_out > 0 ? n / (C * plane_out) : 0;
    if (R <= 0 || nc <= 0) return true;
    const int* batch = mx_roi::rois_batch_column<T, A>(rois, R, 6);
    const mx_roi::GradBlock<A> block(batch, R, H, W);
    static thread_local RotatedRoiSamples<A> rs;
    rs.start(rois, R, spatial_scale, P, Q, ratio, aligned, clockwise, H, W, ncp);
    A g[16];
    for (long long r = 0; r < R; ++r) {
      if (batch[r] < 0) continue;
      A* img = block.image(batch[r]);
      rs.load(r, rois, spatial_scale, P, Q, ratio, aligned, clockwise, H, W, ncp);
      const A d = rs.box().divisor;
      for (int cc = 0; cc < ncp; cc += L) {
        const int lanes = nc - cc < L ? nc - cc : L;
        mx_roi::PassRows<T, A> rows(grad + (r * C + c0 + cc) * plane_out, plane_out, lanes);
        A* const lane = img + cc;
        for (int p = 0; p < P; ++p)
          for (int q = 0; q < Q; ++q) {
            const long long o = p * Q + q;
            const A* const gk = rows.at(o);
            for (int c = 0; c < L; ++c) g[c] = gk[c] / d;
            rs.each(p, q, [&](const typename RotatedRoiSamples<A>::Taps& t) {
              mx_roi::AddLanes<A>::run(lane + t.o1, g, t.w1);
              mx_roi::AddLanes<A>::run(lane + t.o2, g, t.w2);
              mx_roi::AddLanes<A>::run(lane + t.o3, g, t.w3);
              mx_roi::AddLanes<A>::run(lane + t.o4, g, t.w4);
            });
          }
      }
    }
    block.add_to(bottom, C, H, W, 1.0);
    return true;
  }
};

// Native backward of the other accumulators (fixed point): the generic kernel's loop,
// each roi's box derived once.
template <typename T, typename A, typename O>
void rroi_align_backward_native(const T* grad, const T* rois, float spatial_scale, int ratio,
                                int aligned, int clockwise, int C, int H, int W, int P,
                                int Q, O* bottom, double scale, long long n) {
  if (RotatedBackwardLanes<T, A, O>::run(grad, rois, spatial_scale, ratio, aligned, clockwise,
                                          C, H, W, P, Q, bottom, n))
    return;
  const long long R = mx_roi::launch_rois(n, C, P, Q);
  for (long long r = 0; r < R; ++r) {
    const mx_roi::RotatedBox<A> b = mx_roi::rotated_box<T, A>(rois + r * 6, spatial_scale, P,
                                                              Q, ratio, aligned, clockwise);
    if (b.batch < 0) continue;
    for (int c = mx_roi_c_begin; c < mx_roi_c_end; ++c) {
      O* plane = bottom + mx_roi::plane_offset(b.batch, c, C, H, W);
      const T* go = grad + (r * C + c) * (long long)P * Q;
      for (int p = 0; p < P; ++p)
        for (int q = 0; q < Q; ++q) {
          const A g = (A)mx_roi::Traits<T>::load(go[p * Q + q]) / b.divisor;
          for (int iy = 0; iy < b.gy; ++iy)
            for (int ix = 0; ix < b.gx; ++ix) {
              const mx_roi::Sample<A> s = mx_roi::rotated_sample(b, p, q, iy, ix, H, W);
              if (!s.outside) mx_roi::sample_backward(plane, W, s, g, scale);
            }
        }
    }
  }
}
#endif

template <typename T, typename A>
__global__ void rroi_align_forward(const T* __restrict__ data, const T* __restrict__ rois,
                                   float spatial_scale, int ratio, int aligned, int clockwise,
                                   int C, int H, int W, int P, int Q, T* __restrict__ out,
                                   long long n) {
#ifdef MX_ROI_HOST_NATIVE
  rroi_align_forward_native<T, A>(data, rois, spatial_scale, ratio, aligned, clockwise, C, H,
                                  W, P, Q, out, n);
#else
  MX_ROI_ITEM_LOOP(it, n, C, P, Q, false) {
    const mx_roi::RotatedBox<A> b = mx_roi::rotated_box<T, A>(rois + it.r * 6, spatial_scale,
                                                              P, Q, ratio, aligned, clockwise);
    A sum = 0;
    if (b.batch >= 0) {
      const T* plane = data + mx_roi::plane_offset(b.batch, it.c, C, H, W);
      for (int iy = 0; iy < b.gy; ++iy)
        for (int ix = 0; ix < b.gx; ++ix) {
          const mx_roi::Sample<A> s = mx_roi::rotated_sample(b, it.p, it.q, iy, ix, H, W);
          if (!s.outside) sum += mx_roi::sample_value(plane, W, s);
        }
      sum = sum / b.divisor;
    }
    out[it.i] = mx_roi::Traits<T>::store(sum);
  }
#endif
}

template <typename T, typename A, typename O>
__global__ void rroi_align_backward(const T* __restrict__ grad, const T* __restrict__ rois,
                                    float spatial_scale, int ratio, int aligned, int clockwise,
                                    int C, int H, int W, int P, int Q, O* __restrict__ bottom,
                                    double scale, long long n) {
#ifdef MX_ROI_HOST_NATIVE
  rroi_align_backward_native<T, A, O>(grad, rois, spatial_scale, ratio, aligned, clockwise, C,
                                      H, W, P, Q, bottom, scale, n);
#else
  MX_ROI_ITEM_LOOP(it, n, C, P, Q, false) {
    const mx_roi::RotatedBox<A> b = mx_roi::rotated_box<T, A>(rois + it.r * 6, spatial_scale,
                                                              P, Q, ratio, aligned, clockwise);
    if (b.batch < 0) continue;
    const A g = (A)mx_roi::Traits<T>::load(grad[it.i]) / b.divisor;
    O* plane = bottom + mx_roi::plane_offset(b.batch, it.c, C, H, W);
    for (int iy = 0; iy < b.gy; ++iy)
      for (int ix = 0; ix < b.gx; ++ix) {
        const mx_roi::Sample<A> s = mx_roi::rotated_sample(b, it.p, it.q, iy, ix, H, W);
        if (!s.outside) mx_roi::sample_backward(plane, W, s, g, scale);
      }
  }
#endif
}

// The native GPU path's roi check (the kernels above read the rois themselves, so a bad roi
// must not reach them; roi_safe_copy plus this op's bound): roi r copied into ``safe`` (R,
// 6), or a padding roi (batch -1, a zero box: no data read, no gradient) when check_rois'
// rule finds it bad (status[0], as roi_check) or, with adaptive sampling (ratio <= 0), its
// bins need more than MX_ROI_MAX_ROTATED_SAMPLES samples (status[1] = 2:
// check_samples_per_bin's bound, in float64 over |w|, |h| as the host computes it).  n = R.
template <typename T, typename A>
__global__ void rroi_align_safe_rois(const T* __restrict__ rois, float spatial_scale, int ratio,
                                     int P, int Q, long long N, double bound, int use_bound,
                                     T* __restrict__ safe,
                                     unsigned long long* __restrict__ status, long long n) {
  typedef mx_roi::Traits<T> Tr;
  const double s = (double)(A)spatial_scale;
  const long long step = (long long)blockDim.x * (long long)gridDim.x;
  for (long long r = (long long)blockIdx.x * blockDim.x + threadIdx.x; r < n; r += step) {
    const T* row = rois + r * 6;
    bool bad = mx_roi::geo::roi_status<T, A>(rois, r, N, bound, use_bound != 0, status, 6);
    if (!bad && ratio <= 0) {
      const double w = fabs((double)(A)Tr::load(row[3]));
      const double h = fabs((double)(A)Tr::load(row[4]));
      if (mx_roi::geo::adaptive_per_bin(h, w, s, P, Q) > mx_roi::geo::MAX_SAMPLES_PER_BIN) {
        status[1] = 2ULL;
        bad = true;
      }
    }
    mx_roi::geo::copy_safe_roi<T, A>(rois, r, 6, bad, safe);
  }
}

// The sample tables of mx_roi.geometry.RotatedGrid from the functions above (for the
// geometry-equality test; C = 1, n = R * P * Q items, G padded samples per bin):
// batch/count/divisor (R,), the rest (R, P, Q, G), padding entries 0.
template <typename T, typename A>
__global__ void rroi_align_geometry(const T* __restrict__ rois, float spatial_scale, int ratio,
                                    int aligned, int clockwise, int C, int H, int W, int P,
                                    int Q, int G, int* batch, int* count, A* divisor, A* y,
                                    A* x, int* y_low, int* y_high, int* x_low, int* x_high,
                                    A* w1, A* w2, A* w3, A* w4, long long n) {
  MX_ROI_ITEM_LOOP(it, n, C, P, Q, false) {
    const mx_roi::RotatedBox<A> b = mx_roi::rotated_box<T, A>(rois + it.r * 6, spatial_scale,
                                                              P, Q, ratio, aligned, clockwise);
    if (it.p == 0 && it.q == 0) {
      batch[it.r] = b.batch;
      count[it.r] = b.gy * b.gx;
      divisor[it.r] = b.divisor;
    }
    const long long base = ((it.r * P + it.p) * Q + it.q) * (long long)G;
    for (int k = 0; k < G; ++k) {
      mx_roi::Sample<A> s;
      A py = 0, px = 0;
      s.yl = s.yh = s.xl = s.xh = 0;
      s.w1 = s.w2 = s.w3 = s.w4 = (A)0;
      if (k < b.gy * b.gx) s = mx_roi::rotated_sample(b, it.p, it.q, k / b.gx, k % b.gx, H, W,
                                                      &py, &px);
      y[base + k] = py;
      x[base + k] = px;
      y_low[base + k] = s.yl;
      y_high[base + k] = s.yh;
      x_low[base + k] = s.xl;
      x_high[base + k] = s.xh;
      w1[base + k] = s.w1;
      w2[base + k] = s.w2;
      w3[base + k] = s.w3;
      w4[base + k] = s.w4;
    }
  }
}

#ifdef MX_ROI_EXT_LAUNCHER
// ==== mx_roi_RROIAlign: this op in mx_roi's MXNet extension library (mx_roi.ext) ==========
// Compiled only into that library (see roi_align.cu's section): contrib.RROIAlign's
// parameters (pooled_size, spatial_scale, sampling_ratio) plus RROIAlignParam's (aligned,
// clockwise, deterministic: the native build is deterministic anyway), rois (R, 6).  The
// kernels derive each bin's samples from the rois (no tables), so the call runs the
// roi_check kernel's status word first (the Custom
// path's message), for an adaptive grid (sampling_ratio <= 0) RROIAlign.check_inputs' box
// size check, then this file's kernels (their per-thread sample cache included).
#include "ext_launch.h"

namespace mx_roi_op {

static_assert(MX_ROI_MAX_ROTATED_SAMPLES == (long long)mx_roi::geo::MAX_SAMPLES_PER_BIN,
              "the rotated tables clip where the box-size check refuses");

struct RROIAlignOp {
  static constexpr const char* OP = "RROIAlign";
  // RROIAlign.rois_columns / rois_layout
  static constexpr int ROI_COLUMNS = 6;
  static constexpr const char* ROI_LAYOUT =
      "(batch_index, x_center, y_center, width, height, angle_degrees)";

  struct Params {
    long long P = 0, Q = 0;
    double spatial_scale = 0;
    long long sampling_ratio = -1;
    bool aligned = false, clockwise = false, deterministic = false;
  };

  // RROIAlignParam.from_kwargs: fields in order, then ParamBase's checks (positive, then
  // bounds in field order: pooled_size, sampling_ratio's ADAPTIVE_SAMPLES_BOUNDS)
  static Params parse(const std::unordered_map<std::string, std::string>& attrs) {
    Kwargs kw(OP, attrs, {"pooled_size", "spatial_scale", "sampling_ratio", "aligned",
                          "clockwise", "deterministic"},
              {"pooled_size", "spatial_scale"});
    Params p;
    std::tie(p.P, p.Q) = kw.size2("pooled_size");
    p.spatial_scale = kw.real("spatial_scale", 0);
    p.sampling_ratio = kw.integer("sampling_ratio", -1);
    p.aligned = kw.boolean("aligned", false);
    p.clockwise = kw.boolean("clockwise", false);
    p.deterministic = kw.boolean("deterministic", false);
    kw.finish();
    check_pooled(kw, p.P, p.Q, p.spatial_scale);
    check_adaptive_samples(kw, "sampling_ratio", p.sampling_ratio);
    return p;
  }

  // RROIAlignParam.to_kwargs, "name=value;..." (the tests compare it with params.py)
  static std::string format(const std::unordered_map<std::string, std::string>& attrs) {
    const Params p = parse(attrs);
    return "pooled_size=" + py_pair_repr(p.P, p.Q) +
           ";spatial_scale=" + py_float_repr(p.spatial_scale) +
           ";sampling_ratio=" + std::to_string(p.sampling_ratio) +
           ";aligned=" + (p.aligned ? "True" : "False") +
           ";clockwise=" + (p.clockwise ? "True" : "False") +
           ";deterministic=" + (p.deterministic ? "True" : "False");
  }

  static long long out_channels(const Params&, long long C) { return C; }

  // RROIAlign.check_inputs' box size rule (adaptive grid only): |height|, |width|; the
  // message prints the signed width and height
  template <typename T, typename A>
  static void check_box_sizes(const Params& p, const T* rois, long long R) {
    check_samples_per_bin<T, A>(
        OP, "sampling_ratio", p.P, p.Q, p.spatial_scale, rois, R, ROI_COLUMNS,
        [](const T* row, double* h, double* w) {
          *h = std::fabs(to_double(row[4]));
          *w = std::fabs(to_double(row[3]));
        },
        [](const T* row, double* a, double* b) {
          *a = to_double(row[3]);
          *b = to_double(row[4]);
        });
  }

  // the call's checks; the kernels read the rois themselves (the "geometry": the rois)
  template <typename T, typename A>
  static const T* geometry(const Params& p, const MXTensor& data, const MXTensor& rois) {
    const T* r = (const T*)rois.data_ptr;
    check_rois_status<T, A>(OP, r, rois.shape[0], ROI_COLUMNS, data.shape[0]);
    if (p.sampling_ratio <= 0) check_box_sizes<T, A>(p, r, rois.shape[0]);
    return r;
  }

  template <typename T, typename A>
  static void forward(const Params& p, const Call<RROIAlignOp, T, A>& c, const MXTensor& data,
                      MXTensor& out) {
    c.launch([&]() {
      rroi_align_forward<T, A>((const T*)data.data_ptr, c.g, (float)p.spatial_scale,
                               (int)p.sampling_ratio, p.aligned, p.clockwise, c.C, c.H, c.W,
                               c.P, c.Q, (T*)out.data_ptr, c.n);
    });
  }

  template <typename T, typename A>
  static void backward(const Params& p, const Call<RROIAlignOp, T, A>& c, const MXTensor& grad,
                       const MXTensor&, A* bottom) {
    c.launch([&]() {
      rroi_align_backward<T, A, A>((const T*)grad.data_ptr, c.g, (float)p.spatial_scale,
                                   (int)p.sampling_ratio, p.aligned, p.clockwise, c.C, c.H,
                                   c.W, c.P, c.Q, bottom, 1.0, c.n);
    });
  }
};

const RegisterParams rroi_align_params("RROIAlign", RROIAlignOp::format);

// The "gpu" forward and backward (opt-in; docs/gpu.md): this file's kernels launched by
// mx_roi.ext.cuda's launcher (the MX_ROI_EXT_CUDA_LAUNCHER section below) on MXNet's
// stream, the checked copy of the rois in MXNet's temporary workspace; no host wait.
struct RROIAlignGpu {
  typedef RROIAlignOp Op;
  typedef int (*Workspace)(int, long long, long long, long long, long long, long long, int,
                           unsigned long long*, char*, size_t);
  typedef int (*Forward)(int, const void*, const void*, void*, long long, long long, long long,
                         long long, long long, int, int, float, int, int, int, void*,
                         unsigned long long, void*, char*, size_t);
  typedef int (*Backward)(int, const void*, const void*, void*, void*, long long, long long,
                          long long, long long, long long, int, int, float, int, int, int,
                          void*, unsigned long long, void*, char*, size_t);
  static constexpr const char* OP = RROIAlignOp::OP;

  static void* tables(const Op::Params&, const MXTensor& data, long long R, bool backward,
                      const OpResource& res, unsigned long long* bytes) {
    char err[4096] = "";
    gpu_call(gpu_entry<Workspace>(OP, "mx_roi_ext_cuda_rroi_align_workspace")(
                 data.dtype, data.shape[0], data.shape[1], data.shape[2], data.shape[3], R,
                 backward ? 1 : 0, bytes, err, sizeof err),
             err);
    return gpu_workspace(OP, res, *bytes);
  }

  static int forward(const Op::Params& p, const MXTensor& data, const MXTensor& rois,
                     MXTensor& out, void* ws, unsigned long long bytes, void* stream, char* err,
                     size_t len) {
    return gpu_entry<Forward>(OP, "mx_roi_ext_cuda_rroi_align_forward")(
        data.dtype, data.data_ptr, rois.data_ptr, out.data_ptr, data.shape[0], data.shape[1],
        data.shape[2], data.shape[3], rois.shape[0], (int)p.P, (int)p.Q,
        (float)p.spatial_scale, (int)p.sampling_ratio, p.aligned ? 1 : 0, p.clockwise ? 1 : 0,
        ws, bytes, stream, err, len);
  }

  static int backward(const Op::Params& p, const MXTensor& grad, const MXTensor& data,
                      const MXTensor& rois, MXTensor& in_grad, MXTensor& rois_grad, void* ws,
                      unsigned long long bytes, void* stream, char* err, size_t len) {
    return gpu_entry<Backward>(OP, "mx_roi_ext_cuda_rroi_align_backward")(
        data.dtype, grad.data_ptr, rois.data_ptr, in_grad.data_ptr, rois_grad.data_ptr,
        data.shape[0], data.shape[1], data.shape[2], data.shape[3], rois.shape[0], (int)p.P,
        (int)p.Q, (float)p.spatial_scale, (int)p.sampling_ratio, p.aligned ? 1 : 0,
        p.clockwise ? 1 : 0, ws, bytes, stream, err, len);
  }
};

}  // namespace mx_roi_op

MX_ROI_EXT_REGISTER(mx_roi_RROIAlign, mx_roi_op::RROIAlignOp)
    .setForward(mx_roi_op::GpuCallbacks<mx_roi_op::RROIAlignGpu>::forward, "gpu")
    .setBackward(mx_roi_op::GpuCallbacks<mx_roi_op::RROIAlignGpu>::backward, "gpu");
#endif  // MX_ROI_EXT_LAUNCHER

#ifdef MX_ROI_EXT_CUDA_LAUNCHER
// ==== this op on the native GPU path (opt-in; docs/gpu.md) ===============================
// Compiled only into mx_roi.ext.cuda's launcher library (as roi_align.cu's section): the
// driver-API launch of this file's kernels (rroi_align.py's native_gpu_kernels, NVRTC's PTX
// in RROI_ALIGN_IMAGE).  The op kernels read the rois themselves, so they read the checked
// copy rroi_align_safe_rois makes in the workspace (a bad roi there a padding roi, in the
// status word for the next call's report), then run as forward_cuda / backward_cuda.
namespace mx_roi_cuda {

// RROIAlign's workspace: the rois' checked copy (R, 6), and for a float16 backward the
// float32 accumulator (with_accumulator); 0 for R = 0.
inline unsigned long long rroi_align_bytes(int dtype, long long N, long long C, long long H,
                                           long long W, long long R, bool backward) {
  if (R <= 0) return 0;
  const unsigned long long rois = safe_rois_bytes(dtype, R, 6);
  return backward ? with_accumulator(rois, dtype, N * C * H * W) : rois;
}

// rroi_align_safe_rois on the call's stream: the checked copy at ``safe``
inline void rroi_align_safe_rois(const CallScope& call, CUdeviceptr rois, CUdeviceptr safe,
                                 long long N, long long R, int P, int Q, float spatial_scale,
                                 int ratio) {
  Args a;
  a(rois)(spatial_scale)(ratio)(P)(Q)(N)(GUARD_BOUND)(call.t.bounded ? 1 : 0)(safe)(
      call.ch.status)(R);
  call.run(RROI_ALIGN_IMAGE, "rroi_align_safe_rois" + call.ta() + ">", R, a);
}

// RROIAlign's forward (rroi_align.py forward_cuda, on the checked copy of the rois) on
// ``stream``.
inline void rroi_align_forward(int dtype, CUdeviceptr data, CUdeviceptr rois, CUdeviceptr out,
                               long long N, long long C, long long H, long long W, long long R,
                               int P, int Q, float spatial_scale, int ratio, int aligned,
                               int clockwise, CUdeviceptr workspace,
                               unsigned long long workspace_bytes, CUstream stream) {
  const CallScope call("RROIAlign", dtype, stream);
  call.report();
  if (R <= 0) return;  // no roi: nothing to launch (the output is empty)
  need_workspace(call.op, workspace_bytes, rroi_align_bytes(dtype, N, C, H, W, R, false));
  rroi_align_safe_rois(call, rois, workspace, N, R, P, Q, spatial_scale, ratio);
  const long long n = R * C * P * Q;
  Args k;
  k(data)(workspace)(spatial_scale)(ratio)(aligned)(clockwise)((int)C)((int)H)((int)W)(P)(Q)(
      out)(n);
  call.run(RROI_ALIGN_IMAGE, "rroi_align_forward" + call.ta() + ">", n, k);
  call.record();
}

// RROIAlign's backward (rroi_align.py backward_cuda, req write): the gradients zeroed
// (GradTarget), the checked copy, rroi_align_backward, then for float16 the accumulator's
// store; all on ``stream``.  A bad roi raises nothing here (the next forward reports it).
inline void rroi_align_backward(int dtype, CUdeviceptr grad, CUdeviceptr rois,
                                CUdeviceptr in_grad, CUdeviceptr rois_grad, long long N,
                                long long C, long long H, long long W, long long R, int P,
                                int Q, float spatial_scale, int ratio, int aligned,
                                int clockwise, CUdeviceptr workspace,
                                unsigned long long workspace_bytes, CUstream stream) {
  const CallScope call("RROIAlign", dtype, stream);
  need_workspace(call.op, workspace_bytes, rroi_align_bytes(dtype, N, C, H, W, R, true));
  if (R <= 0) return call.zero(in_grad, (size_t)(N * C * H * W) * item_size(dtype));
  const GradTarget target(call, dtype, in_grad, rois_grad, N * C * H * W, R, 6,
                          workspace + rroi_align_bytes(dtype, N, C, H, W, R, false));
  rroi_align_safe_rois(call, rois, workspace, N, R, P, Q, spatial_scale, ratio);
  const long long n = R * C * P * Q;
  Args k;
  k(grad)(workspace)(spatial_scale)(ratio)(aligned)(clockwise)((int)C)((int)H)((int)W)(P)(Q)(
      target.bottom)(1.0)(n);  // scale, n
  call.run(RROI_ALIGN_IMAGE, "rroi_align_backward" + call.ta() + ", " + call.t.A + ">", n, k);
  target.store(call);
  call.record();
}

}  // namespace mx_roi_cuda

extern "C" {

// The workspace bytes of a RROIAlign forward (``backward`` 0) or backward (1): 0, or 1 with
// the message.
int mx_roi_ext_cuda_rroi_align_workspace(int dtype, long long N, long long C, long long H,
                                         long long W, long long R, int backward,
                                         unsigned long long* bytes, char* err,
                                         size_t err_len) {
  return mx_roi_cuda::c_entry(err, err_len, [&]() {
    mx_roi_cuda::types_of("RROIAlign", dtype);
    *bytes = mx_roi_cuda::rroi_align_bytes(dtype, N, C, H, W, R, backward != 0);
  });
}

// RROIAlign's forward on ``stream``: data (N, C, H, W), rois (R, 6), out (R, C, P, Q),
// device pointers of ``dtype``; ``ratio``: sampling_ratio; ``workspace``: at least the
// workspace function's bytes.  No host synchronisation.
int mx_roi_ext_cuda_rroi_align_forward(int dtype, const void* data, const void* rois,
                                       void* out, long long N, long long C, long long H,
                                       long long W, long long R, int P, int Q,
                                       float spatial_scale, int ratio, int aligned,
                                       int clockwise, void* workspace,
                                       unsigned long long workspace_bytes, void* stream,
                                       char* err, size_t err_len) {
  return mx_roi_cuda::c_entry(err, err_len, [&]() {
    mx_roi_cuda::rroi_align_forward(
        dtype, (mx_roi_cuda::CUdeviceptr)data, (mx_roi_cuda::CUdeviceptr)rois,
        (mx_roi_cuda::CUdeviceptr)out, N, C, H, W, R, P, Q, spatial_scale, ratio, aligned,
        clockwise, (mx_roi_cuda::CUdeviceptr)workspace, workspace_bytes,
        (mx_roi_cuda::CUstream)stream);
  });
}

// RROIAlign's backward on ``stream``: grad (R, C, P, Q), in_grad (N, C, H, W) written (req
// write), rois_grad (R, 6) zeroed (null: none); the data is not read.  No host
// synchronisation; a bad roi is reported by a later forward.
int mx_roi_ext_cuda_rroi_align_backward(int dtype, const void* grad, const void* rois,
                                        void* in_grad, void* rois_grad, long long N, long long C,
                                        long long H, long long W, long long R, int P, int Q,
                                        float spatial_scale, int ratio, int aligned,
                                        int clockwise, void* workspace,
                                        unsigned long long workspace_bytes, void* stream,
                                        char* err, size_t err_len) {
  return mx_roi_cuda::c_entry(err, err_len, [&]() {
    mx_roi_cuda::rroi_align_backward(
        dtype, (mx_roi_cuda::CUdeviceptr)grad, (mx_roi_cuda::CUdeviceptr)rois,
        (mx_roi_cuda::CUdeviceptr)in_grad, (mx_roi_cuda::CUdeviceptr)rois_grad, N, C, H, W, R,
        P, Q, spatial_scale, ratio, aligned, clockwise, (mx_roi_cuda::CUdeviceptr)workspace,
        workspace_bytes, (mx_roi_cuda::CUstream)stream);
  });
}

}  // extern "C"
#endif  // MX_ROI_EXT_CUDA_LAUNCHER
