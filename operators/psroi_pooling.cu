// PSROIPooling kernels: mean over the integer bins of mx_roi.geometry.IntBins (0 when
// empty), output channel c at bin (p, q) reading input channel channel_map[c, p, q].
#include "roi_common.cuh"

template <typename T, typename A>
__global__ void psroi_pooling_forward(
    const T* __restrict__ data, const int* __restrict__ batch,
    const int* __restrict__ channel_map, const int* __restrict__ hstart,
    const int* __restrict__ hend, const int* __restrict__ wstart, const int* __restrict__ wend,
    int C, int Cin, int H, int W, int P, int Q, T* __restrict__ out, long long n) {
#ifdef MX_ROI_HOST_NATIVE
  // bin by bin, roi by roi, all channels (mx_roi::ps_forward_native); per item the loop
  // below's sum in its order
  mx_roi::ps_forward_native<T, A>(
      data, batch, channel_map, C, Cin, H, W, P, Q, out, n, [&](long long r, int p, int q,
                                                                 long long) {
        const int hs = hstart[r * P + p], he = hend[r * P + p];
        const int ws = wstart[r * Q + q], we = wend[r * Q + q];
        return [hs, he, ws, we, W](const T* plane) {
          A sum = 0;
          if (he <= hs || we <= ws) return sum;  // an empty bin: 0
          for (int h = hs; h < he; ++h)
            for (int w = ws; w < we; ++w) sum += mx_roi::Traits<T>::load(plane[h * W + w]);
          return sum / (A)((he - hs) * (we - ws));
        };
      });
  return;
#endif
  MX_ROI_ITEM_LOOP(it, n, C, P, Q, true) {
    const int b = batch[it.r];
    const int hs = hstart[it.r * P + it.p], he = hend[it.r * P + it.p];
    const int ws = wstart[it.r * Q + it.q], we = wend[it.r * Q + it.q];
    A sum = 0;
    if (b >= 0 && he > hs && we > ws) {
      const T* plane =
          data + mx_roi::plane_offset(b, mx_roi::in_channel(channel_map, it, P, Q), Cin, H, W);
      mx_roi::prefetch_next_plane(data, channel_map, it, C, Cin, H, W, P, Q, b, false);
      for (int h = hs; h < he; ++h) {
        for (int w = ws; w < we; ++w) {
          sum += mx_roi::Traits<T>::load(plane[h * W + w]);
        }
      }
      sum = sum / (A)((he - hs) * (we - ws));
    }
    out[it.i] = mx_roi::Traits<T>::store(sum);
  }
}

template <typename T, typename A, typename O>
__global__ void psroi_pooling_backward(
    const T* __restrict__ grad, const int* __restrict__ batch,
    const int* __restrict__ channel_map, const int* __restrict__ hstart,
    const int* __restrict__ hend, const int* __restrict__ wstart, const int* __restrict__ wend,
    int C, int Cin, int H, int W, int P, int Q, O* __restrict__ bottom, double scale,
    long long n) {
  MX_ROI_ITEM_LOOP(it, n, C, P, Q, true) {
    const int b = batch[it.r];
    const int hs = hstart[it.r * P + it.p], he = hend[it.r * P + it.p];
    const int ws = wstart[it.r * Q + it.q], we = wend[it.r * Q + it.q];
    if (b < 0 || he <= hs || we <= ws) continue;
    const A g = (A)mx_roi::Traits<T>::load(grad[it.i]) / (A)((he - hs) * (we - ws));
    O* plane =
        bottom + mx_roi::plane_offset(b, mx_roi::in_channel(channel_map, it, P, Q), Cin, H, W);
    mx_roi::prefetch_next_plane(bottom, channel_map, it, C, Cin, H, W, P, Q, b, true);
    for (int h = hs; h < he; ++h) {
      for (int w = ws; w < we; ++w) {
        mx_roi::grad_add(plane + h * W + w, g, scale);
      }
    }
  }
}
