// PSROIAlign kernels: ROIAlign's average over bilinear samples, output channel c at
// bin (p, q) reading input channel channel_map[c, p, q] (C_out, P, Q) int.
// Table driven (SampleGrid), see roi_common.cuh.
#include "roi_common.cuh"

#ifdef MX_ROI_HOST_NATIVE
// Native host build of the forward (mx_roi::ps_forward_native): a roi's bin's samples
// (taps and weights, mx_roi::sample_at) worked out once for every output channel; per
// item sample_value's operations in the generic loop's order (iy, then ix): the same bits.
template <typename A>
struct PsTap {
  long long o1, o2, o3, o4;  // (yl, xl), (yl, xh), (yh, xl), (yh, xh) in the plane
  A w1, w2, w3, w4;
};

// A bin's samples are held for its channels only up to MX_ROI_PS_MAX_TAPS of them (a huge
// adaptive grid -- sample_ratio <= 0 on a box far larger than the map -- would need
// gigabytes): past that the generic loop below computes them item by item (false).
// -DMX_ROI_PS_MAX_TAPS=... lowers it so that a test runs that path on small problems.
#ifndef MX_ROI_PS_MAX_TAPS
#define MX_ROI_PS_MAX_TAPS (1 << 16)
#endif

template <typename T, typename A>
bool psroi_align_forward_native(const T* data, const int* batch, const int* channel_map,
                                const int* y_count, const int* y_low, const int* y_high,
                                const A* y_wl, const A* y_wh, const int* x_count,
                                const int* x_low, const int* x_high, const A* x_wl,
                                const A* x_wh, const A* divisor, int C, int Cin, int H, int W,
                                int P, int Q, int Gy, int Gx, T* out, long long n) {
  if ((long long)Gy * Gx > MX_ROI_PS_MAX_TAPS) return false;
  static thread_local std::vector<PsTap<A>> taps;
  if ((long long)taps.size() < (long long)Gy * Gx) taps.resize((size_t)Gy * Gx);
  PsTap<A>* const tp = taps.data();  // (a thread_local read in the loop costs a call)
  mx_roi::ps_forward_native<T, A>(
      data, batch, channel_map, C, Cin, H, W, P, Q, out, n,
      [&](long long r, int p, int q, long long k) {
        const int ny = y_count[r * P + p], nx = x_count[r * Q + q];
        const long long yb = (r * P + p) * (long long)Gy, xb = (r * Q + q) * (long long)Gx;
        int m = 0;
        for (int iy = 0; iy < ny; ++iy) {
          for (int ix = 0; ix < nx; ++ix, ++m) {
            const mx_roi::Sample<A> s = mx_roi::sample_at(yb, xb, iy, ix, y_low, y_high, y_wl,
                                                          y_wh, x_low, x_high, x_wl, x_wh);
            tp[m] = PsTap<A>{(long long)s.yl * W + s.xl, (long long)s.yl * W + s.xh,
                             (long long)s.yh * W + s.xl, (long long)s.yh * W + s.xh,
                             s.w1, s.w2, s.w3, s.w4};
          }
        }
        const A d = divisor[r * P * Q + k];
        return [tp, m, d](const T* plane) {
          A sum = 0;
          for (int i = 0; i < m; ++i) {
            const PsTap<A>& t = tp[i];
            const A v1 = mx_roi::Traits<T>::load(plane[t.o1]);
            const A v2 = mx_roi::Traits<T>::load(plane[t.o2]);
            const A v3 = mx_roi::Traits<T>::load(plane[t.o3]);
            const A v4 = mx_roi::Traits<T>::load(plane[t.o4]);
            sum += (t.w1 * v1 + t.w2 * v2) + t.w3 * v3 + t.w4 * v4;
          }
          return sum / d;
        };
      });
  return true;
}
#endif

template <typename T, typename A>
__global__ void psroi_align_forward(
    const T* __restrict__ data, const int* __restrict__ batch,
    const int* __restrict__ channel_map, const int* __restrict__ y_count,
    const int* __restrict__ y_low, const int* __restrict__ y_high, const A* __restrict__ y_wl,
    const A* __restrict__ y_wh, const int* __restrict__ x_count, const int* __restrict__ x_low,
    const int* __restrict__ x_high, const A* __restrict__ x_wl, const A* __restrict__ x_wh,
    const A* __restrict__ divisor, int C, int Cin, int H, int W, int P, int Q, int Gy, int Gx,
    T* __restrict__ out, long long n) {
#ifdef MX_ROI_HOST_NATIVE
  if (psroi_align_forward_native<T, A>(data, batch, channel_map, y_count, y_low, y_high, y_wl,
                                       y_wh, x_count, x_low, x_high, x_wl, x_wh, divisor, C, Cin,
                                       H, W, P, Q, Gy, Gx, out, n))
    return;
#endif
  MX_ROI_ITEM_LOOP(it, n, C, P, Q, true) {
    mx_roi::align_avg_forward_item<T, A>(it, data, batch, channel_map, y_count, y_low, y_high,
                                         y_wl, y_wh, x_count, x_low, x_high, x_wl, x_wh,
                                         divisor, C, Cin, H, W, P, Q, Gy, Gx, out);
  }
}

template <typename T, typename A, typename O>
__global__ void psroi_align_backward(
    const T* __restrict__ grad, const int* __restrict__ batch,
    const int* __restrict__ channel_map, const int* __restrict__ y_count,
    const int* __restrict__ y_low, const int* __restrict__ y_high, const A* __restrict__ y_wl,
    const A* __restrict__ y_wh, const int* __restrict__ x_count, const int* __restrict__ x_low,
    const int* __restrict__ x_high, const A* __restrict__ x_wl, const A* __restrict__ x_wh,
    const A* __restrict__ divisor, int C, int Cin, int H, int W, int P, int Q, int Gy, int Gx,
    O* __restrict__ bottom, double scale, long long n) {
  MX_ROI_ITEM_LOOP(it, n, C, P, Q, true) {
    mx_roi::align_avg_backward_item<T, A, O>(it, grad, batch, channel_map, y_count, y_low,
                                             y_high, y_wl, y_wh, x_count, x_low, x_high, x_wl,
                                             x_wh, divisor, C, Cin, H, W, P, Q, Gy, Gx, bottom,
                                             scale);
  }
}
