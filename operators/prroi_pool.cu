// PrRoIPool kernels (precise RoI pooling, Jiang et al., ECCV 2018): each bin the exact
// integral of the bilinear interpolation surface over the bin, divided by its area;
// gradients for the data and the rois.  The kernels derive the bins and the hat
// integrals from the rois themselves (precise_window, hat_integral, hat_value: the
// operations of mx_roi.geometry.precise_bins in the compute type A);
// prroi_pool_geometry fills that function's tables for the test that proves the two equal
// bit for bit.  rois (R, 5) = (batch, x1, y1, x2, y2); output (R, C, P, Q).
#include "roi_common.cuh"

namespace mx_roi {

// One axis of a bin: the window [lo, hi] and the map nodes [first, last] it touches.
template <typename A>
struct PreciseAxis {
  A lo, hi;
  int first, count;
};

// The bins of one roi: batch, the area of a bin, the bin sizes and its start corner.
template <typename A>
struct PreciseBox {
  int batch;
  A y1, x1, bh, bw, area;
};

template <typename T, typename A>
__host__ __device__ __forceinline__ PreciseBox<A> precise_box(const T* roi, float spatial_scale,
                                                               int P, int Q) {
  typedef Traits<T> Tr;
  PreciseBox<A> b;
  const A s = (A)spatial_scale;
  b.batch = (int)(A)Tr::load(roi[0]);
  b.x1 = (A)Tr::load(roi[1]) * s;
  b.y1 = (A)Tr::load(roi[2]) * s;
  const A x2 = (A)Tr::load(roi[3]) * s, y2 = (A)Tr::load(roi[4]) * s;
  A h = y2 - b.y1, w = x2 - b.x1;
  h = h > (A)0 ? h : (A)0;  // a reversed box has size 0 (its bins area 0: output 0)
  w = w > (A)0 ? w : (A)0;
  b.bh = h / (A)P;
  b.bw = w / (A)Q;
  const A area = b.bw * b.bh;
  b.area = area > (A)0 ? area : (A)0;
  return b;
}

// Bin i's window along an axis from ``lo`` with bins of ``size``, over nodes 0..limit-1.
template <typename A>
__host__ __device__ __forceinline__ PreciseAxis<A> precise_axis(A lo, A size, int i, int limit) {
  PreciseAxis<A> a;
  a.lo = lo + size * (A)i;
  a.hi = a.lo + size;
  const A top = (A)(limit - 1);
  // clipped in floating point before the int conversion (fmax / fmin: NaN -> the bound)
  const A f = fmin(fmax(floor(a.lo), (A)0), top), l = fmin(fmax(ceil(a.hi), (A)0), top);
  a.first = (int)f;
  const int n = (int)l - a.first + 1;
  a.count = n > 0 ? n : 0;
  return a;
}

// t - t|t|/2 of clip(t, -1, 1): the integral of max(0, 1 - |u|) over [0, t]
template <typename A>
__host__ __device__ __forceinline__ A hat_antiderivative(A t) {
  t = t > (A)-1 ? t : (A)-1;
  t = t < (A)1 ? t : (A)1;
  return t - (t * (t < (A)0 ? -t : t)) * (A)0.5;
}

// The integral over [a.lo, a.hi] of node ``node``'s hat function.
template <typename A>
__host__ __device__ __forceinline__ A hat_integral(const PreciseAxis<A>& a, int node) {
  const A n = (A)node;
  return hat_antiderivative(a.hi - n) - hat_antiderivative(a.lo - n);
}

// max(0, 1 - |t|)
template <typename A>
__host__ __device__ __forceinline__ A hat_value(A t) {
  const A v = (A)1 - (t < (A)0 ? -t : t);
  return v > (A)0 ? v : (A)0;
}

}  // namespace mx_roi

#ifdef MX_ROI_HOST_NATIVE
// One roi's bins for the native walks, derived once per roi: the box, each bin row's and
// column's window and the hat integrals of its nodes (the generic kernels' values).
template <typename A>
struct PreciseRoi {
  long long roi = -1;
  mx_roi::PreciseBox<A> box;
  std::vector<mx_roi::PreciseAxis<A>> ay, ax;
  std::vector<long long> oy, ox;  // offsets of each bin row's / column's weights
  std::vector<A> wy, wx;
  template <typename T>
  void load(long long r, const T* rois, float spatial_scale, int P, int Q, int H, int W) {
    if (r == roi) return;
    roi = r;
    box = mx_roi::precise_box<T, A>(rois + r * 5, spatial_scale, P, Q);
    axis(ay, oy, wy, box.y1, box.bh, P, H);
    axis(ax, ox, wx, box.x1, box.bw, Q, W);
  }
  static void axis(std::vector<mx_roi::PreciseAxis<A>>& a, std::vector<long long>& off,
                   std::vector<A>& w, A lo, A size, int bins, int limit) {
    a.resize(bins);
    off.resize(bins);
    w.clear();
    for (int i = 0; i < bins; ++i) {
      a[i] = mx_roi::precise_axis(lo, size, i, limit);
      off[i] = (long long)w.size();
      for (int k = 0; k < a[i].count; ++k) w.push_back(mx_roi::hat_integral(a[i], a[i].first + k));
    }
  }
};

// Native forward: the thread's channel block channels-last, each bin's nodes taken for 16
// channels at a time (per lane the generic kernel's operations in its order: the same bits).
template <typename T, typename A>
void prroi_pool_forward_native(const T* data, const T* rois, float spatial_scale, int C, int H,
                               int W, int P, int Q, T* out, long long n) {
  const long long R = mx_roi::launch_rois(n, C, P, Q);
  const int* batch = mx_roi::rois_batch_column<T, A>(rois, R, 5);
  const mx_roi::LaneWalk<T, A> walk(data, batch, C, H, W, P, Q, n);
  const int ncp = walk.ncp;
  static thread_local PreciseRoi<A> pr;
  pr.roi = -1;
  walk.each_pass_staged(batch, C, P, Q, out, (int*)nullptr, [&](
      long long r, int cc, int lanes, int p, int q, const A* img, T* o, int*) {
    A sum[16] = {};
    if (img) pr.load(r, rois, spatial_scale, P, Q, H, W);
    if (img && pr.box.area > (A)0) {
      const mx_roi::PreciseAxis<A>& ay = pr.ay[p];
      const mx_roi::PreciseAxis<A>& ax = pr.ax[q];
      const A* wy = pr.wy.data() + pr.oy[p];
      const A* wx = pr.wx.data() + pr.ox[q];
      A row[16];
      for (int i = 0; i < ay.count; ++i) {
        for (int c = 0; c < 16; ++c) row[c] = 0;
        const A* cell = img + ((size_t)(ay.first + i) * W + ax.first) * ncp + cc;
        for (int j = 0; j < ax.count; ++j) mx_roi::AddLanes<A>::run(row, cell + (size_t)j * ncp, wx[j]);
        mx_roi::AddLanes<A>::run(sum, row, wy[i]);
      }
      for (int c = 0; c < 16; ++c) sum[c] = sum[c] / pr.box.area;
    }
    for (int c = 0; c < 16; ++c) o[c] = mx_roi::Traits<T>::store(sum[c]);  // (row of 16)
  });
}

// Native data backward, float accumulation (O = A; fixed point takes the generic loop):
// the channel block accumulated channels-last, each node's share added for 16 channels at
// a time; per channel the generic kernel's contributions in its order onto a zero start.
template <typename T, typename A, typename O>
struct PreciseBackwardLanes {
  template <typename... Args>
  static bool run(Args...) { return false; }
};

template <typename T, typename A>
struct PreciseBackwardLanes<T, A, A> {
  static bool run(const T* grad, const T* rois, float spatial_scale, int C, int H, int W, int P,
                  int Q, A* bottom, long long n) {
    const int L = mx_roi::LANES, c0 = mx_roi_c_begin, nc = mx_roi_c_end - mx_roi_c_begin;
    const int ncp = mx_roi::padded_lanes(nc);
    const long long plane_out = (long long)P * Q;
    const long long R = C * plane_out > 0 ? n / (C * plane_out) : 0;
    if (R <= 0 || nc <= 0) return true;
    const int* batch = mx_roi::rois_batch_column<T, A>(rois, R, 5);
    const mx_roi::GradBlock<A> block(batch, R, H, W);
    static thread_local PreciseRoi<A> pr;
    pr.roi = -1;
    A g[16], gy[16];
    for (long long r = 0; r < R; ++r) {
      if (batch[r] < 0) continue;
      pr.load(r, rois, spatial_scale, P, Q, H, W);
      if (!(pr.box.area > (A)0)) continue;
      A* img = block.image(batch[r]);
      for (int cc = 0; cc < ncp; cc += L) {
        const int lanes = nc - cc < L ? nc - cc : L;
        mx_roi::PassRows<T, A> rows(grad + (r * C + c0 + cc) * plane_out, plane_out, lanes);
        for (int p = 0; p < P; ++p)
          for (int q = 0; q < Q; ++q) {
            const long long o = p * Q + q;
            const A* const gk = rows.at(o);
            for (int c = 0; c < L; ++c) g[c] = gk[c] / pr.box.area;
            const mx_roi::PreciseAxis<A>& ay = pr.ay[p];
            const mx_roi::PreciseAxis<A>& ax = pr.ax[q];
            const A* wy = pr.wy.data() + pr.oy[p];
            const A* wx = pr.wx.data() + pr.ox[q];
            for (int i = 0; i < ay.count; ++i) {
              for (int c = 0; c < L; ++c) gy[c] = g[c] * wy[i];
              A* cell = img + ((size_t)(ay.first + i) * W + ax.first) * ncp + cc;
              for (int j = 0; j < ax.count; ++j)
                mx_roi::AddLanes<A>::run(cell + (size_t)j * ncp, gy, wx[j]);
            }
          }
      }
    }
    block.add_to(bottom, C, H, W, 1.0);
    return true;
  }
};
#endif

// out[r, c, p, q] = sum_i wy_i * (sum_j wx_j * f[i, j]) / area
template <typename T, typename A>
__global__ void prroi_pool_forward(const T* __restrict__ data, const T* __restrict__ rois,
                                   float spatial_scale, int C, int H, int W, int P, int Q,
                                   T* __restrict__ out, long long n) {
#ifdef MX_ROI_HOST_NATIVE
  prroi_pool_forward_native<T, A>(data, rois, spatial_scale, C, H, W, P, Q, out, n);
  return;
#endif
  typedef mx_roi::Traits<T> Tr;
  MX_ROI_ITEM_LOOP(it, n, C, P, Q, false) {
    const mx_roi::PreciseBox<A> b = mx_roi::precise_box<T, A>(rois + it.r * 5, spatial_scale,
                                                              P, Q);
    A sum = 0;
    if (b.batch >= 0 && b.area > (A)0) {
      const T* plane = data + mx_roi::plane_offset(b.batch, it.c, C, H, W);
      const mx_roi::PreciseAxis<A> ay = mx_roi::precise_axis(b.y1, b.bh, it.p, H);
      const mx_roi::PreciseAxis<A> ax = mx_roi::precise_axis(b.x1, b.bw, it.q, W);
      for (int i = 0; i < ay.count; ++i) {
        const int y = ay.first + i;
        A row = 0;
        for (int j = 0; j < ax.count; ++j) {
          const int x = ax.first + j;
          row += mx_roi::hat_integral(ax, x) * (A)Tr::load(plane[(long long)y * W + x]);
        }
        sum += mx_roi::hat_integral(ay, y) * row;
      }
      sum = sum / b.area;
    }
    out[it.i] = Tr::store(sum);
  }
}

// d out / d f[i, j] = wy_i * wx_j / area
template <typename T, typename A, typename O>
__global__ void prroi_pool_backward(const T* __restrict__ grad, const T* __restrict__ rois,
                                    float spatial_scale, int C, int H, int W, int P, int Q,
                                    O* __restrict__ bottom, double scale, long long n) {
#ifdef MX_ROI_HOST_NATIVE
  if (PreciseBackwardLanes<T, A, O>::run(grad, rois, spatial_scale, C, H, W, P, Q, bottom, n))
    return;
#endif
  MX_ROI_ITEM_LOOP(it, n, C, P, Q, false) {
    const mx_roi::PreciseBox<A> b = mx_roi::precise_box<T, A>(rois + it.r * 5, spatial_scale,
                                                              P, Q);
    if (b.batch < 0 || !(b.area > (A)0)) continue;
    const A g = (A)mx_roi::Traits<T>::load(grad[it.i]) / b.area;
    O* plane = bottom + mx_roi::plane_offset(b.batch, it.c, C, H, W);
    const mx_roi::PreciseAxis<A> ay = mx_roi::precise_axis(b.y1, b.bh, it.p, H);
    const mx_roi::PreciseAxis<A> ax = mx_roi::precise_axis(b.x1, b.bw, it.q, W);
    for (int i = 0; i < ay.count; ++i) {
      const int y = ay.first + i;
      const A gy = g * mx_roi::hat_integral(ay, y);
      for (int j = 0; j < ax.count; ++j) {
        const int x = ax.first + j;
        mx_roi::grad_add(plane + (long long)y * W + x, gy * mx_roi::hat_integral(ax, x), scale);
      }
    }
  }
}

// The rois' gradient (R, 5) in A, one roi per item (C = R, P = Q = 1 for the launch: the
// native build splits the rois over its threads, no two write the same row).  A bin's
// integral I over [y1, y2] x [x1, x2] has dI/dy2 = the integral over x of the surface at
// y2 (dI/dy1 the negative at y1), and out = I / (bh * bw) with y1 = ys + p * bh,
// y2 = y1 + bh, bh = (ye - ys) / P (x alike); chained to the image coordinates.  Per
// node row i the three row sums over j (weights wx_j, and the hat values at x1 and x2)
// give all five integrals.  The native build (prroi_pool_rois_backward_lanes) takes each
// bin's node weights from a table made once per bin instead of once per channel (the same
// values: the same bits).
template <typename A>
struct PreciseNodeWeights {
  A w, lo, hi;  // the hat integral over the window, the hat values at its two ends
};

template <typename A>
__host__ __device__ __forceinline__ PreciseNodeWeights<A> precise_node(
    const mx_roi::PreciseAxis<A>& a, int node) {
  PreciseNodeWeights<A> n;
  n.w = mx_roi::hat_integral(a, node);
  n.lo = mx_roi::hat_value(a.lo - (A)node);
  n.hi = mx_roi::hat_value(a.hi - (A)node);
  return n;
}

#ifdef MX_ROI_HOST_NATIVE
// The native build's table of an axis bin's node weights: t[k] = those of node a.first + k.
template <typename A>
void tabulate_nodes(std::vector<PreciseNodeWeights<A>>& t, const mx_roi::PreciseAxis<A>& a) {
  t.resize((size_t)a.count);
  for (int k = 0; k < a.count; ++k) t[k] = precise_node(a, a.first + k);
}
#endif

#ifdef MX_ROI_HOST_NATIVE
// Native rois' gradient: the calling thread's rois (the launch's "channels"), every channel
// of the images they read channels-last, each bin's five integrals taken for 16 channels
// at a time (per lane the generic loop's operations in its order), and the lanes' terms
// then added to the roi's four sums channel by channel -- the generic order (bin, then
// channel; a channel whose out-grad is 0 skipped): the same bits.
template <typename T, typename A>
bool prroi_pool_rois_backward_lanes(const T* grad, const T* data, const T* rois,
                                    float spatial_scale, int channels, int H, int W, int P,
                                    int Q, A* rois_grad) {
  typedef mx_roi::Traits<T> Tr;
  const int L = mx_roi::LANES, ncp = mx_roi::padded_lanes(channels);
  const int r0 = mx_roi_c_begin, r1 = mx_roi_c_end;
  if (r1 <= r0) return true;
  const long long HW = (long long)H * W;
  // the images the thread's rois read, all channels channels-last: each made once per
  // launch and thread (a launch hands a thread several blocks of rois), slot[b] its place
  static thread_local std::vector<long long> slot;
  static thread_local mx_roi::LaneBuffer<A> cells;
  static thread_local std::vector<const T*> planes;
  static thread_local unsigned long long launch = 0;
  static thread_local int images = 0;
  if (launch != mx_roi_launch_id || launch == 0) {
    launch = mx_roi_launch_id;
    slot.clear();
    images = 0;
  }
  for (int r = r0; r < r1; ++r) {
    const int b = (int)(A)Tr::load(rois[r * 5LL]);
    if (b < 0) continue;
    if ((size_t)b >= slot.size()) slot.resize((size_t)b + 1, -1);
    if (slot[b] >= 0) continue;
    slot[b] = images++;
    cells.resize((size_t)images * HW * ncp);
    A* img = cells.data() + (size_t)slot[b] * HW * ncp;
    planes.resize((size_t)channels);
    for (int c = 0; c < channels; ++c)
      planes[c] = data + mx_roi::plane_offset(b, c, channels, H, W);
    mx_roi::ChannelsLast<T, A>::run(img, planes.data(), channels, HW, ncp);
    if (channels < ncp)
      for (long long k = 0; k < HW; ++k)
        for (int c = channels; c < ncp; ++c) img[k * ncp + c] = (A)0;
  }
  static thread_local std::vector<PreciseNodeWeights<A>> ny, nx;
  A g[16], I[16], ey1[16], ey2[16], ex1[16], ex2[16], rs[16], q1[16], q2[16];
  A tys[16], tye[16], txs[16], txe[16];
  for (int r = r0; r < r1; ++r) {
    A* out = rois_grad + r * 5LL;
    for (int k = 0; k < 5; ++k) out[k] = 0;
    const mx_roi::PreciseBox<A> b = mx_roi::precise_box<T, A>(rois + r * 5LL, spatial_scale, P,
                                                              Q);
    if (b.batch < 0 || !(b.area > (A)0)) continue;
    const A* img = cells.data() + (size_t)slot[b.batch] * HW * ncp;
    A d_ys = 0, d_ye = 0, d_xs = 0, d_xe = 0;
    for (int p = 0; p < P; ++p) {
      const mx_roi::PreciseAxis<A> ay = mx_roi::precise_axis(b.y1, b.bh, p, H);
      tabulate_nodes(ny, ay);
      const A fp = (A)p / (A)P, fp1 = (A)(p + 1) / (A)P;
      for (int q = 0; q < Q; ++q) {
        const mx_roi::PreciseAxis<A> ax = mx_roi::precise_axis(b.x1, b.bw, q, W);
        tabulate_nodes(nx, ax);
        const A fq = (A)q / (A)Q, fq1 = (A)(q + 1) / (A)Q;
        for (int cc = 0; cc < ncp; cc += L) {
          const int lanes = channels - cc < L ? channels - cc : L;
          bool any = false;
          for (int c = 0; c < L; ++c) {
            const long long at = (((long long)r * channels + cc + c) * P + p) * Q + q;
            g[c] = c < lanes ? (A)Tr::load(grad[at]) : (A)0;
            any |= g[c] != (A)0;
          }
          if (!any) continue;
          for (int c = 0; c < L; ++c) I[c] = ey1[c] = ey2[c] = ex1[c] = ex2[c] = (A)0;
          for (int i = 0; i < ay.count; ++i) {
            const PreciseNodeWeights<A> wy = ny[i];
            const A* cell = img + ((size_t)(ay.first + i) * W + ax.first) * ncp + cc;
            for (int c = 0; c < L; ++c) rs[c] = q1[c] = q2[c] = (A)0;
            for (int j = 0; j < ax.count; ++j) {
              const PreciseNodeWeights<A> wx = nx[j];
              const A* f = cell + (size_t)j * ncp;
              for (int c = 0; c < L; ++c) {
                rs[c] += wx.w * f[c];
                q1[c] += wx.lo * f[c];
                q2[c] += wx.hi * f[c];
              }
            }
            for (int c = 0; c < L; ++c) {
              I[c] += wy.w * rs[c];
              ey1[c] += wy.lo * rs[c];
              ey2[c] += wy.hi * rs[c];
              ex1[c] += wy.w * q1[c];
              ex2[c] += wy.w * q2[c];
            }
          }
          for (int c = 0; c < L; ++c) {
            const A o = I[c] / b.area;
            tys[c] = g[c] * ((-ey1[c] * ((A)1 - fp) + ey2[c] * ((A)1 - fp1)) / b.area +
                             o / ((A)P * b.bh));
            tye[c] = g[c] * ((-ey1[c] * fp + ey2[c] * fp1) / b.area - o / ((A)P * b.bh));
            txs[c] = g[c] * ((-ex1[c] * ((A)1 - fq) + ex2[c] * ((A)1 - fq1)) / b.area +
                             o / ((A)Q * b.bw));
            txe[c] = g[c] * ((-ex1[c] * fq + ex2[c] * fq1) / b.area - o / ((A)Q * b.bw));
          }
          for (int c = 0; c < lanes; ++c) {
            if (g[c] == (A)0) continue;
            d_ys += tys[c];
            d_ye += tye[c];
            d_xs += txs[c];
            d_xe += txe[c];
          }
        }
      }
    }
    const A sc = (A)spatial_scale;
    out[1] = d_xs * sc;
    out[2] = d_ys * sc;
    out[3] = d_xe * sc;
    out[4] = d_ye * sc;
  }
  return true;
}
#endif

template <typename T, typename A>
__global__ void prroi_pool_rois_backward(const T* __restrict__ grad,
                                         const T* __restrict__ data,
                                         const T* __restrict__ rois, float spatial_scale,
                                         int channels, int H, int W, int P, int Q, int C,
                                         A* __restrict__ rois_grad, long long n) {
  typedef mx_roi::Traits<T> Tr;
#ifdef MX_ROI_HOST_NATIVE
  if (prroi_pool_rois_backward_lanes<T, A>(grad, data, rois, spatial_scale, channels, H, W, P,
                                           Q, rois_grad))
    return;
#endif
  MX_ROI_ITEM_LOOP(it, n, C, 1, 1, false) {
    const long long r = it.c;
    A* out = rois_grad + r * 5;
    for (int k = 0; k < 5; ++k) out[k] = 0;
    const mx_roi::PreciseBox<A> b = mx_roi::precise_box<T, A>(rois + r * 5, spatial_scale, P,
                                                              Q);
    if (b.batch < 0 || !(b.area > (A)0)) continue;
    A d_ys = 0, d_ye = 0, d_xs = 0, d_xe = 0;
    for (int p = 0; p < P; ++p) {
      const mx_roi::PreciseAxis<A> ay = mx_roi::precise_axis(b.y1, b.bh, p, H);
      for (int q = 0; q < Q; ++q) {
        const mx_roi::PreciseAxis<A> ax = mx_roi::precise_axis(b.x1, b.bw, q, W);
        for (int c = 0; c < channels; ++c) {
          const A g = (A)Tr::load(grad[((r * channels + c) * P + p) * Q + q]);
          if (g == (A)0) continue;
          const T* plane = data + mx_roi::plane_offset(b.batch, c, channels, H, W);
          A I = 0, ey1 = 0, ey2 = 0, ex1 = 0, ex2 = 0;
          for (int i = 0; i < ay.count; ++i) {
            const int y = ay.first + i;
            const PreciseNodeWeights<A> wy = precise_node(ay, y);
            const T* row = plane + (long long)y * W + ax.first;
            A rs = 0, r1 = 0, r2 = 0;
            for (int j = 0; j < ax.count; ++j) {
              const PreciseNodeWeights<A> wx = precise_node(ax, ax.first + j);
              const A f = (A)Tr::load(row[j]);
              rs += wx.w * f;
              r1 += wx.lo * f;
              r2 += wx.hi * f;
            }
            I += wy.w * rs;
            ey1 += wy.lo * rs;
            ey2 += wy.hi * rs;
            ex1 += wy.w * r1;
            ex2 += wy.w * r2;
          }
          const A o = I / b.area;
          const A fp = (A)p / (A)P, fp1 = (A)(p + 1) / (A)P;
          const A fq = (A)q / (A)Q, fq1 = (A)(q + 1) / (A)Q;
          // d out / d ys, ye, xs, xe (the area's share: -+ out / (P * bh), out / (Q * bw))
          d_ys += g * ((-ey1 * ((A)1 - fp) + ey2 * ((A)1 - fp1)) / b.area + o / ((A)P * b.bh));
          d_ye += g * ((-ey1 * fp + ey2 * fp1) / b.area - o / ((A)P * b.bh));
          d_xs += g * ((-ex1 * ((A)1 - fq) + ex2 * ((A)1 - fq1)) / b.area + o / ((A)Q * b.bw));
          d_xe += g * ((-ex1 * fq + ex2 * fq1) / b.area - o / ((A)Q * b.bw));
        }
      }
    }
    const A s = (A)spatial_scale;
    out[1] = d_xs * s;
    out[2] = d_ys * s;
    out[3] = d_xe * s;
    out[4] = d_ye * s;
  }
}

// The tables of mx_roi.geometry.precise_bins from the functions above (for the
// geometry-equality test; C = R, one roi per item): batch, area (R,), bin_size (R, 2);
// per axis start, count (R, P) and weight, edge_lo, edge_hi (R, P, K), padding 0.
template <typename T, typename A>
__global__ void prroi_pool_geometry(const T* __restrict__ rois, float spatial_scale, int C,
                                    int H, int W, int P, int Q, int Ky, int Kx, int* batch,
                                    A* area, A* bin_size, int* y_start, int* y_count,
                                    A* y_weight, A* y_edge_lo, A* y_edge_hi, int* x_start,
                                    int* x_count, A* x_weight, A* x_edge_lo, A* x_edge_hi,
                                    long long n) {
  MX_ROI_ITEM_LOOP(it, n, C, 1, 1, false) {
    const long long r = it.c;
    const mx_roi::PreciseBox<A> b = mx_roi::precise_box<T, A>(rois + r * 5, spatial_scale, P,
                                                              Q);
    batch[r] = b.batch;
    area[r] = b.area;
    bin_size[r * 2] = b.bh;
    bin_size[r * 2 + 1] = b.bw;
    for (int axis = 0; axis < 2; ++axis) {
      const int bins = axis ? Q : P, K = axis ? Kx : Ky, limit = axis ? W : H;
      int* start = axis ? x_start : y_start;
      int* count = axis ? x_count : y_count;
      A* weight = axis ? x_weight : y_weight;
      A* lo = axis ? x_edge_lo : y_edge_lo;
      A* hi = axis ? x_edge_hi : y_edge_hi;
      for (int i = 0; i < bins; ++i) {
        const mx_roi::PreciseAxis<A> a = axis ? mx_roi::precise_axis(b.x1, b.bw, i, limit)
                                              : mx_roi::precise_axis(b.y1, b.bh, i, limit);
        const long long row = r * bins + i;
        start[row] = a.first;
        count[row] = a.count;
        for (int k = 0; k < K; ++k) {
          const bool live = k < a.count;
          const int node = a.first + k;
          weight[row * K + k] = live ? mx_roi::hat_integral(a, node) : (A)0;
          lo[row * K + k] = live ? mx_roi::hat_value(a.lo - (A)node) : (A)0;
          hi[row * K + k] = live ? mx_roi::hat_value(a.hi - (A)node) : (A)0;
        }
      }
    }
  }
}

#ifdef MX_ROI_EXT_LAUNCHER
// ==== mx_roi_PrRoIPool: this op in mx_roi's MXNet extension library (mx_roi.ext) ==========
// Compiled only into that library (see roi_align.cu's section): PrRoIPoolParam's
// parameters (pooled_size, spatial_scale, deterministic: the native build is deterministic
// anyway).  The kernels derive the bins' integrals from the rois (no tables), so the call
// runs the roi_check kernel's status word first (the
// Custom path's message), then this file's kernels; the backward also writes the rois'
// gradient (prroi_pool_rois_backward, one roi per item, in A; float16 rounded once).
#include "ext_launch.h"

namespace mx_roi_op {

struct PrRoIPoolOp : PooledOp<PrRoIPoolOp> {
  static constexpr const char* OP = "PrRoIPool";

  // parse / format (PrRoIPoolParam.from_kwargs / to_kwargs) / out_channels: PooledOp

  // the call's roi check; the kernels read the rois themselves (the "geometry": the rois)
  template <typename T, typename A>
  static const T* geometry(const Params&, const MXTensor& data, const MXTensor& rois) {
    const T* r = (const T*)rois.data_ptr;
    check_rois_status<T, A>(OP, r, rois.shape[0], 5, data.shape[0]);
    return r;
  }

  template <typename T, typename A>
  static void forward(const Params& p, const Call<PrRoIPoolOp, T, A>& c, const MXTensor& data,
                      MXTensor& out) {
    c.launch([&]() {
      prroi_pool_forward<T, A>((const T*)data.data_ptr, c.g, (float)p.spatial_scale, c.C, c.H,
                               c.W, c.P, c.Q, (T*)out.data_ptr, c.n);
    });
  }

  template <typename T, typename A>
  static void backward(const Params& p, const Call<PrRoIPoolOp, T, A>& c, const MXTensor& grad,
                       const MXTensor&, A* bottom) {
    c.launch([&]() {
      prroi_pool_backward<T, A, A>((const T*)grad.data_ptr, c.g, (float)p.spatial_scale, c.C,
                                   c.H, c.W, c.P, c.Q, bottom, 1.0, c.n);
    });
  }

  // PrRoIPool.rois_backward_cuda: (R, 5) in A from zeros, one roi per item (the launch's
  // "channels" are the rois), then stored in T (float16: rounded once, as the Custom path
  // writes its float32 result into the float16 gradient)
  template <typename T, typename A>
  static void rois_backward(const Params& p, const Call<PrRoIPoolOp, T, A>& c,
                            const MXTensor& grad, const MXTensor& data, const MXTensor& rois,
                            MXTensor& rois_grad) {
    const long long R = rois.shape[0];
    const bool direct = std::is_same<T, A>::value;
    static thread_local std::vector<A> buf;  // (float16: the float32 result)
    if (!direct) buf.resize((size_t)R * 5);
    A* out = direct ? (A*)rois_grad.data_ptr : buf.data();
    std::memset(out, 0, (size_t)R * 5 * sizeof(A));  // (launch.empty(...).fill(0))
    // threads by the work (every roi's bins over every channel), not the roi count: each
    // roi is one thread's, so the bits do not depend on the split
    mx_roi_launch_channels((int)R, native_threads(R * c.C * c.P * c.Q), [&]() {
      prroi_pool_rois_backward<T, A>((const T*)grad.data_ptr, (const T*)data.data_ptr, c.g,
                                     (float)p.spatial_scale, c.C, c.H, c.W, c.P, c.Q, (int)R,
                                     out, R);
    });
    if (!direct) {
      T* g = (T*)rois_grad.data_ptr;
      for (long long i = 0; i < R * 5; ++i) g[i] = mx_roi::Traits<T>::store(buf[(size_t)i]);
    }
  }
};

const RegisterParams prroi_pool_params("PrRoIPool", PrRoIPoolOp::format);

// The "gpu" forward and backward (opt-in; docs/gpu.md): this file's kernels launched by
// mx_roi.ext.cuda's launcher (the MX_ROI_EXT_CUDA_LAUNCHER section below) on MXNet's
// stream, the checked copy of the rois in MXNet's temporary workspace; no host wait.  The
// backward also writes the rois' gradient (this op differentiates its rois).
struct PrRoIPoolGpu {
  typedef PrRoIPoolOp Op;
  typedef int (*Workspace)(int, long long, long long, long long, long long, long long, int,
                           unsigned long long*, char*, size_t);
  typedef int (*Forward)(int, const void*, const void*, void*, long long, long long, long long,
                         long long, long long, int, int, float, void*, unsigned long long,
                         void*, char*, size_t);
  typedef int (*Backward)(int, const void*, const void*, const void*, void*, void*, long long,
                          long long, long long, long long, long long, int, int, float, void*,
                          unsigned long long, void*, char*, size_t);
  static constexpr const char* OP = PrRoIPoolOp::OP;

  static void* tables(const Op::Params&, const MXTensor& data, long long R, bool backward,
                      const OpResource& res, unsigned long long* bytes) {
    char err[4096] = "";
    gpu_call(gpu_entry<Workspace>(OP, "mx_roi_ext_cuda_prroi_pool_workspace")(
                 data.dtype, data.shape[0], data.shape[1], data.shape[2], data.shape[3], R,
                 backward ? 1 : 0, bytes, err, sizeof err),
             err);
    return gpu_workspace(OP, res, *bytes);
  }

  static int forward(const Op::Params& p, const MXTensor& data, const MXTensor& rois,
                     MXTensor& out, void* ws, unsigned long long bytes, void* stream, char* err,
                     size_t len) {
    return gpu_entry<Forward>(OP, "mx_roi_ext_cuda_prroi_pool_forward")(
        data.dtype, data.data_ptr, rois.data_ptr, out.data_ptr, data.shape[0], data.shape[1],
        data.shape[2], data.shape[3], rois.shape[0], (int)p.P, (int)p.Q,
        (float)p.spatial_scale, ws, bytes, stream, err, len);
  }

  static int backward(const Op::Params& p, const MXTensor& grad, const MXTensor& data,
                      const MXTensor& rois, MXTensor& in_grad, MXTensor& rois_grad, void* ws,
                      unsigned long long bytes, void* stream, char* err, size_t len) {
    return gpu_entry<Backward>(OP, "mx_roi_ext_cuda_prroi_pool_backward")(
        data.dtype, grad.data_ptr, data.data_ptr, rois.data_ptr, in_grad.data_ptr,
        rois_grad.data_ptr, data.shape[0], data.shape[1], data.shape[2], data.shape[3],
        rois.shape[0], (int)p.P, (int)p.Q, (float)p.spatial_scale, ws, bytes, stream, err,
        len);
  }
};

}  // namespace mx_roi_op

MX_ROI_EXT_REGISTER(mx_roi_PrRoIPool, mx_roi_op::PrRoIPoolOp)
    .setForward(mx_roi_op::GpuCallbacks<mx_roi_op::PrRoIPoolGpu>::forward, "gpu")
    .setBackward(mx_roi_op::GpuCallbacks<mx_roi_op::PrRoIPoolGpu>::backward, "gpu");
#endif  // MX_ROI_EXT_LAUNCHER

#ifdef MX_ROI_EXT_CUDA_LAUNCHER
// ==== this op on the native GPU path (opt-in; docs/gpu.md) ===============================
// Compiled only into mx_roi.ext.cuda's launcher library (as roi_align.cu's section): the
// driver-API launch of this file's kernels (prroi_pool.py's native_gpu_kernels, NVRTC's PTX
// in PRROI_POOL_IMAGE).  The op kernels read the rois themselves, so they read the checked
// copy roi_safe_copy makes in the workspace (a bad roi there a padding roi, in the status
// word for the next call's report), then run as forward_cuda / backward_cuda /
// rois_backward_cuda.
namespace mx_roi_cuda {

// PrRoIPool's workspace: the rois' checked copy (R, 5); for a float16 backward then the
// float32 results of the rois' gradient (R, 5) and of the data gradient
// (with_accumulator); 0 for R = 0.
inline unsigned long long prroi_rois_acc_bytes(int dtype, long long R) {
  return dtype == DTYPE_FLOAT16 ? aligned16((unsigned long long)R * 5 * 4) : 0;
}

inline unsigned long long prroi_pool_bytes(int dtype, long long N, long long C, long long H,
                                           long long W, long long R, bool backward) {
  if (R <= 0) return 0;
  if (!backward) return safe_rois_bytes(dtype, R, 5);
  return with_accumulator(safe_rois_bytes(dtype, R, 5) + prroi_rois_acc_bytes(dtype, R), dtype,
                          N * C * H * W);
}

// roi_safe_copy on the call's stream: the checked copy at ``safe``
inline void prroi_safe_rois(const CallScope& call, CUdeviceptr rois, CUdeviceptr safe,
                            long long N, long long R) {
  Args a;
  a(rois)(5)(N)(GUARD_BOUND)(call.t.bounded ? 1 : 0)(safe)(call.ch.status)(R);
  call.run(PRROI_POOL_IMAGE, "roi_safe_copy" + call.ta() + ">", R, a);
}

// PrRoIPool's forward (prroi_pool.py forward_cuda, on the checked copy of the rois) on
// ``stream``.
inline void prroi_pool_forward(int dtype, CUdeviceptr data, CUdeviceptr rois, CUdeviceptr out,
                               long long N, long long C, long long H, long long W, long long R,
                               int P, int Q, float spatial_scale, CUdeviceptr workspace,
                               unsigned long long workspace_bytes, CUstream stream) {
  const CallScope call("PrRoIPool", dtype, stream);
  call.report();
  if (R <= 0) return;  // no roi: nothing to launch (the output is empty)
  need_workspace(call.op, workspace_bytes, prroi_pool_bytes(dtype, N, C, H, W, R, false));
  prroi_safe_rois(call, rois, workspace, N, R);
  const long long n = R * C * P * Q;
  Args k;
  k(data)(workspace)(spatial_scale)((int)C)((int)H)((int)W)(P)(Q)(out)(n);
  call.run(PRROI_POOL_IMAGE, "prroi_pool_forward" + call.ta() + ">", n, k);
  call.record();
}

// PrRoIPool's backward (the Custom path's order: rois_backward_cuda, then backward_cuda;
// req write) on ``stream``: the data gradient zeroed (GradTarget), the checked copy, the
// rois' gradient (prroi_pool_rois_backward writes every row; float16: into the float32
// result, then stored), then prroi_pool_backward and float16's store.  ``rois_grad`` null:
// no rois' gradient.  A bad roi raises nothing here (the next forward reports it).
inline void prroi_pool_backward(int dtype, CUdeviceptr grad, CUdeviceptr data, CUdeviceptr rois,
                                CUdeviceptr in_grad, CUdeviceptr rois_grad, long long N,
                                long long C, long long H, long long W, long long R, int P,
                                int Q, float spatial_scale, CUdeviceptr workspace,
                                unsigned long long workspace_bytes, CUstream stream) {
  const CallScope call("PrRoIPool", dtype, stream);
  need_workspace(call.op, workspace_bytes, prroi_pool_bytes(dtype, N, C, H, W, R, true));
  if (R <= 0) return call.zero(in_grad, (size_t)(N * C * H * W) * item_size(dtype));
  const unsigned long long safe_bytes = safe_rois_bytes(dtype, R, 5);
  const CUdeviceptr rois_acc = workspace + safe_bytes;
  const GradTarget target(call, dtype, in_grad, 0, N * C * H * W, R, 5,
                          rois_acc + prroi_rois_acc_bytes(dtype, R));
  prroi_safe_rois(call, rois, workspace, N, R);
  if (rois_grad) {
    const bool half = dtype == DTYPE_FLOAT16;
    Args g;
    g(grad)(data)(workspace)(spatial_scale)((int)C)((int)H)((int)W)(P)(Q)((int)R)(
        half ? rois_acc : rois_grad)(R);  // channels = C; "C" = R: one roi per item
    call.run(PRROI_POOL_IMAGE, "prroi_pool_rois_backward" + call.ta() + ">", R, g);
    if (half) {
      Args c;
      c(rois_acc)(rois_grad)(R * 5);
      call.run(EXT_CUDA_CAST_IMAGE, "store_float_as<__half>", R * 5, c);
    }
  }
  const long long n = R * C * P * Q;
  Args k;
  k(grad)(workspace)(spatial_scale)((int)C)((int)H)((int)W)(P)(Q)(target.bottom)(1.0)(n);
  call.run(PRROI_POOL_IMAGE, "prroi_pool_backward" + call.ta() + ", " + call.t.A + ">", n, k);
  target.store(call);
  call.record();
}

}  // namespace mx_roi_cuda

extern "C" {

// The workspace bytes of a PrRoIPool forward (``backward`` 0) or backward (1): 0, or 1 with
// the message.
int mx_roi_ext_cuda_prroi_pool_workspace(int dtype, long long N, long long C, long long H,
                                         long long W, long long R, int backward,
                                         unsigned long long* bytes, char* err,
                                         size_t err_len) {
  return mx_roi_cuda::c_entry(err, err_len, [&]() {
    mx_roi_cuda::types_of("PrRoIPool", dtype);
    *bytes = mx_roi_cuda::prroi_pool_bytes(dtype, N, C, H, W, R, backward != 0);
  });
}

// PrRoIPool's forward on ``stream``: data (N, C, H, W), rois (R, 5), out (R, C, P, Q),
// device pointers of ``dtype``; ``workspace``: at least the workspace function's bytes.  No
// host synchronisation.
int mx_roi_ext_cuda_prroi_pool_forward(int dtype, const void* data, const void* rois,
                                       void* out, long long N, long long C, long long H,
                                       long long W, long long R, int P, int Q,
                                       float spatial_scale, void* workspace,
                                       unsigned long long workspace_bytes, void* stream,
                                       char* err, size_t err_len) {
  return mx_roi_cuda::c_entry(err, err_len, [&]() {
    mx_roi_cuda::prroi_pool_forward(
        dtype, (mx_roi_cuda::CUdeviceptr)data, (mx_roi_cuda::CUdeviceptr)rois,
        (mx_roi_cuda::CUdeviceptr)out, N, C, H, W, R, P, Q, spatial_scale,
        (mx_roi_cuda::CUdeviceptr)workspace, workspace_bytes, (mx_roi_cuda::CUstream)stream);
  });
}

// PrRoIPool's backward on ``stream``: grad (R, C, P, Q), data (N, C, H, W) (read for the
// rois' gradient), in_grad (N, C, H, W) written (req write), rois_grad (R, 5) written (the
// op's gradient of its rois; null: not computed).  No host synchronisation; a bad roi is
// reported by a later forward.
int mx_roi_ext_cuda_prroi_pool_backward(int dtype, const void* grad, const void* data,
                                        const void* rois, void* in_grad, void* rois_grad,
                                        long long N, long long C, long long H, long long W,
                                        long long R, int P, int Q, float spatial_scale,
                                        void* workspace, unsigned long long workspace_bytes,
                                        void* stream, char* err, size_t err_len) {
  return mx_roi_cuda::c_entry(err, err_len, [&]() {
    mx_roi_cuda::prroi_pool_backward(
        dtype, (mx_roi_cuda::CUdeviceptr)grad, (mx_roi_cuda::CUdeviceptr)data,
        (mx_roi_cuda::CUdeviceptr)rois, (mx_roi_cuda::CUdeviceptr)in_grad,
        (mx_roi_cuda::CUdeviceptr)rois_grad, N, C, H, W, R, P, Q, spatial_scale,
        (mx_roi_cuda::CUdeviceptr)workspace, workspace_bytes, (mx_roi_cuda::CUstream)stream);
  });
}

}  // extern "C"
#endif  // MX_ROI_EXT_CUDA_LAUNCHER
