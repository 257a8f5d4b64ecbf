// PSROIAlign kernels: ROIAlign's average over bilinear samples, output channel c at
// bin (p, q) reading input channel channel_map[c, p, q] (C_out, P, Q) int.
// Table driven (SampleGrid), see roi_common.cuh.
#include "roi_common.cuh"

template <typename T, typename A>
__global__ void psroi_align_forward(
    const T* __restrict__ data, const int* __restrict__ batch,
    const int* __restrict__ channel_map, const int* __restrict__ y_count,
    const int* __restrict__ y_low, const int* __restrict__ y_high, const A* __restrict__ y_wl,
    const A* __restrict__ y_wh, const int* __restrict__ x_count, const int* __restrict__ x_low,
    const int* __restrict__ x_high, const A* __restrict__ x_wl, const A* __restrict__ x_wh,
    const A* __restrict__ divisor, int C, int Cin, int H, int W, int P, int Q, int Gy, int Gx,
    T* __restrict__ out, long long n) {
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
