// ROIPooling kernels: max over the integer bins of mx_roi.geometry.IntBins
// ([hstart, hend) x [wstart, wend), already clipped to the map).  Row-major scan from
// max_init() (-FLT_MAX) with strict '>' (the first maximum wins, NaN never wins); an
// empty bin or a negative batch index gives 0 and argmax -1, a bin nothing beat gives
// -FLT_MAX and argmax -1; argmax is h*W + w within the (b, c) plane.
#include "roi_common.cuh"

template <typename T, typename A>
__global__ void roi_pooling_forward(
    const T* __restrict__ data, const int* __restrict__ batch, const int* __restrict__ hstart,
    const int* __restrict__ hend, const int* __restrict__ wstart, const int* __restrict__ wend,
    int C, int H, int W, int P, int Q, T* __restrict__ out, int* __restrict__ argmax,
    int store_argmax, long long n) {
  MX_ROI_ITEM_LOOP(it, n, C, P, Q, false) {
    const int b = batch[it.r];
    const int hs = hstart[it.r * P + it.p], he = hend[it.r * P + it.p];
    const int ws = wstart[it.r * Q + it.q], we = wend[it.r * Q + it.q];
    A best = 0;
    int arg = -1;
    if (b >= 0 && he > hs && we > ws) {
      const T* plane = data + mx_roi::plane_offset(b, it.c, C, H, W);
      best = mx_roi::max_init<A>();
      for (int h = hs; h < he; ++h) {
        for (int w = ws; w < we; ++w) {
          const int k = h * W + w;
          mx_roi::max_step(mx_roi::Traits<T>::load(plane[k]), best, k, arg);
        }
      }
    }
    out[it.i] = mx_roi::Traits<T>::store(best);
    if (store_argmax) argmax[it.i] = arg;  // 0: inference, nothing kept
  }
}

template <typename T, typename A, typename O>
__global__ void roi_pooling_backward(
    const T* __restrict__ grad, const int* __restrict__ batch, const int* __restrict__ argmax,
    int C, int H, int W, int P, int Q, O* __restrict__ bottom, double scale, long long n) {
  MX_ROI_ITEM_LOOP(it, n, C, P, Q, false) {
    const int a = argmax[it.i];
    const int b = batch[it.r];
    if (a < 0 || b < 0) continue;
    mx_roi::grad_add(bottom + mx_roi::plane_offset(b, it.c, C, H, W) + a,
                     (A)mx_roi::Traits<T>::load(grad[it.i]), scale);
  }
}
