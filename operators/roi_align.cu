// ROIAlign kernels (average and max over the bilinear samples of each bin).
// Table driven: the SampleGrid of mx_roi.geometry.roi_align_grid (or any legacy grid)
// gives every bin's sample count, taps and weights; see roi_common.cuh.
// Output and argmax are (R, C, P, Q); argmax holds the winning sample iy*Gx+ix or -1.
#include "roi_common.cuh"

#ifdef MX_ROI_HOST_NATIVE
// Native host build of the average forward: the thread's channel block channels-last
// (mx_roi::channels_last_block), each bin's samples taken once for 16 channels at a time
// (mx_roi::SumLanes: per lane the generic kernel's operations in its order).
template <typename T, typename A>
void roi_align_forward_avg_native(const T* data, const int* batch, const int* y_count,
                                  const int* y_low, const int* y_high, const A* y_wl,
                                  const A* y_wh, const int* x_count, const int* x_low,
                                  const int* x_high, const A* x_wl, const A* x_wh,
                                  const A* divisor, int C, int H, int W, int P, int Q, int Gy,
                                  int Gx, T* out, long long n) {
  const mx_roi::LaneWalk<T, A> walk(data, batch, C, H, W, P, Q, n);
  if (walk.empty()) return;
  const long long plane_out = walk.plane_out;
  const int L = mx_roi::LANES, nc = walk.nc, ncp = walk.ncp;
  walk.each_bin(batch, C, P, Q, out, [&](long long r, int p, int q, const A* img, T* o) {
    if (!img) {  // skipped roi: 0
      for (int c = 0; c < nc; ++c) o[c * plane_out] = mx_roi::Traits<T>::store((A)0);
      return;
    }
    const int ny = y_count[r * P + p], nx = x_count[r * Q + q];
    const long long yb = (r * P + p) * (long long)Gy, xb = (r * Q + q) * (long long)Gx;
    const A d = divisor[(r * P + p) * Q + q];
    for (int cc = 0; cc < ncp; cc += L) {
      mx_roi::SumLanes<A> m;
      m.zero();
      for (int iy = 0; iy < ny; ++iy) {
        for (int ix = 0; ix < nx; ++ix) {
          const mx_roi::Sample<A> s = mx_roi::sample_at(yb, xb, iy, ix, y_low, y_high, y_wl,
                                                        y_wh, x_low, x_high, x_wl, x_wh);
          const A* row_l = img + (size_t)s.yl * W * ncp + cc;
          const A* row_h = img + (size_t)s.yh * W * ncp + cc;
          m.add(row_l + (size_t)s.xl * ncp, row_l + (size_t)s.xh * ncp,
                row_h + (size_t)s.xl * ncp, row_h + (size_t)s.xh * ncp, s.w1, s.w2, s.w3,
                s.w4);
        }
      }
      m.divide(d);
      const int lanes = nc - cc < L ? nc - cc : L;
      for (int c = 0; c < lanes; ++c)
        o[(cc + c) * plane_out] = mx_roi::Traits<T>::store(m.value(c));
    }
  });
}
#endif

template <typename T, typename A>
__global__ void roi_align_forward_avg(
    const T* __restrict__ data, const int* __restrict__ batch, const int* __restrict__ y_count,
    const int* __restrict__ y_low, const int* __restrict__ y_high, const A* __restrict__ y_wl,
    const A* __restrict__ y_wh, const int* __restrict__ x_count, const int* __restrict__ x_low,
    const int* __restrict__ x_high, const A* __restrict__ x_wl, const A* __restrict__ x_wh,
    const A* __restrict__ divisor, int C, int H, int W, int P, int Q, int Gy, int Gx,
    T* __restrict__ out, long long n) {
#ifdef MX_ROI_HOST_NATIVE
  roi_align_forward_avg_native<T, A>(data, batch, y_count, y_low, y_high, y_wl, y_wh, x_count,
                                     x_low, x_high, x_wl, x_wh, divisor, C, H, W, P, Q, Gy, Gx,
                                     out, n);
#else
  MX_ROI_ITEM_LOOP(it, n, C, P, Q, false) {
    mx_roi::align_avg_forward_item<T, A>(it, data, batch, (const int*)0, y_count, y_low, y_high,
                                         y_wl, y_wh, x_count, x_low, x_high, x_wl, x_wh,
                                         divisor, C, C, H, W, P, Q, Gy, Gx, out);
  }
#endif
}

template <typename T, typename A, typename O>
__global__ void roi_align_backward_avg(
    const T* __restrict__ grad, const int* __restrict__ batch, const int* __restrict__ y_count,
    const int* __restrict__ y_low, const int* __restrict__ y_high, const A* __restrict__ y_wl,
    const A* __restrict__ y_wh, const int* __restrict__ x_count, const int* __restrict__ x_low,
    const int* __restrict__ x_high, const A* __restrict__ x_wl, const A* __restrict__ x_wh,
    const A* __restrict__ divisor, int C, int H, int W, int P, int Q, int Gy, int Gx,
    O* __restrict__ bottom, double scale, long long n) {
  MX_ROI_ITEM_LOOP(it, n, C, P, Q, false) {
    mx_roi::align_avg_backward_item<T, A, O>(it, grad, batch, (const int*)0, y_count, y_low,
                                             y_high, y_wl, y_wh, x_count, x_low, x_high, x_wl,
                                             x_wh, divisor, C, C, H, W, P, Q, Gy, Gx, bottom,
                                             scale);
  }
}

// Max over the same samples, iy-major, from max_init() (-FLT_MAX) with strict '>' (the
// first maximum wins; a NaN sample -- a NaN on any of its taps, as in MXNet's bilinear
// interpolation, even one of weight 0 -- never wins; a point outside the map is 0); a bin
// without samples (or a roi with a negative batch index) gives 0 and argmax -1, a bin
// whose samples none beat -FLT_MAX gives -FLT_MAX and argmax -1.
template <typename T, typename A>
__global__ void roi_align_forward_max(
    const T* __restrict__ data, const int* __restrict__ batch, const int* __restrict__ y_count,
    const int* __restrict__ y_low, const int* __restrict__ y_high, const A* __restrict__ y_wl,
    const A* __restrict__ y_wh, const int* __restrict__ x_count, const int* __restrict__ x_low,
    const int* __restrict__ x_high, const A* __restrict__ x_wl, const A* __restrict__ x_wh,
    int C, int H, int W, int P, int Q, int Gy, int Gx, T* __restrict__ out,
    int* __restrict__ argmax, int store_argmax, long long n) {
  MX_ROI_ITEM_LOOP(it, n, C, P, Q, false) {
    const int b = batch[it.r];
    A best = 0;
    int arg = -1;
    if (b >= 0) {
      const T* plane = data + mx_roi::plane_offset(b, it.c, C, H, W);
      const int ny = y_count[it.r * P + it.p], nx = x_count[it.r * Q + it.q];
      const long long yb = (it.r * P + it.p) * (long long)Gy;
      const long long xb = (it.r * Q + it.q) * (long long)Gx;
      if (ny > 0 && nx > 0) best = mx_roi::max_init<A>();
      for (int iy = 0; iy < ny; ++iy) {
        for (int ix = 0; ix < nx; ++ix) {
          const mx_roi::Sample<A> s = mx_roi::sample_at(yb, xb, iy, ix, y_low, y_high, y_wl,
                                                        y_wh, x_low, x_high, x_wl, x_wh);
          // a point outside the map is 0 whatever the (weight-0) taps it names hold
          mx_roi::max_step(s.outside ? (A)0 : mx_roi::sample_value(plane, W, s), best,
                           iy * Gx + ix, arg);
        }
      }
    }
    out[it.i] = mx_roi::Traits<T>::store(best);
    if (store_argmax) argmax[it.i] = arg;  // 0: inference, nothing kept
  }
}

// The whole gradient of a bin goes to the four taps of its winning sample.
template <typename T, typename A, typename O>
__global__ void roi_align_backward_max(
    const T* __restrict__ grad, const int* __restrict__ batch, const int* __restrict__ y_low,
    const int* __restrict__ y_high, const A* __restrict__ y_wl, const A* __restrict__ y_wh,
    const int* __restrict__ x_low, const int* __restrict__ x_high, const A* __restrict__ x_wl,
    const A* __restrict__ x_wh, const int* __restrict__ argmax, int C, int H, int W, int P,
    int Q, int Gy, int Gx, O* __restrict__ bottom, double scale, long long n) {
  MX_ROI_ITEM_LOOP(it, n, C, P, Q, false) {
    const int a = argmax[it.i];
    const int b = batch[it.r];
    if (a < 0 || b < 0) continue;
    const A g = (A)mx_roi::Traits<T>::load(grad[it.i]);
    const long long yb = (it.r * P + it.p) * (long long)Gy;
    const long long xb = (it.r * Q + it.q) * (long long)Gx;
    mx_roi::sample_backward(bottom + mx_roi::plane_offset(b, it.c, C, H, W), W,
                            mx_roi::sample_at(yb, xb, a / Gx, a % Gx, y_low, y_high, y_wl,
                                              y_wh, x_low, x_high, x_wl, x_wh),
                            g, scale);
  }
}
