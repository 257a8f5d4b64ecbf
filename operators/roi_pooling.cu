// ROIPooling kernels: max over the integer bins of mx_roi.geometry.IntBins
// ([hstart, hend) x [wstart, wend), already clipped to the map).  Row-major scan from
// max_init() (-FLT_MAX) with strict '>' (the first maximum wins, NaN never wins); an
// empty bin or a negative batch index gives 0 and argmax -1, a bin nothing beat gives
// -FLT_MAX and argmax -1; argmax is h*W + w within the (b, c) plane.
#include "roi_common.cuh"

#ifdef MX_ROI_HOST_NATIVE
// Native host build: the same result, walked plane by plane.  The bins of a roi differ
// in size by one cell at most, so scanning each bin of a roi over the roi's largest bin
// (kh x kw cells, the bin's last row / column repeated: a repeat never beats the first
// maximum) gives every bin the same trip count -- loops the branch predictor learns,
// where exact per-bin bounds of 1 or 2 cells mispredicted about once per output.
template <int KH, int KW, typename T, typename A>
__forceinline__ void roi_pooling_plane(const T* plane, const int* hs, const int* he,
                                       const int* ws, const int* we, int kh, int kw, int W,
                                       int P, int Q, T* out, int* argmax) {
  if (KH) kh = KH;
  if (KW) kw = KW;
  for (int p = 0; p < P; ++p) {
    const int h0 = hs[p], hl = he[p] - h0;
    for (int q = 0; q < Q; ++q) {
      const int w0 = ws[q], wl = we[q] - w0;
      A best = 0;
      int arg = -1;
      if (hl > 0 && wl > 0) {
        best = mx_roi::max_init<A>();
        for (int i = 0; i < kh; ++i) {
          const int row = (h0 + (i < hl ? i : hl - 1)) * W;
          for (int j = 0; j < kw; ++j) {
            const int k = row + w0 + (j < wl ? j : wl - 1);
            mx_roi::max_step(mx_roi::Traits<T>::load(plane[k]), best, k, arg);
          }
        }
      }
      out[p * Q + q] = mx_roi::Traits<T>::store(best);
      if (argmax) argmax[p * Q + q] = arg;
    }
  }
}

// The calling thread's channel block [mx_roi_c_begin, mx_roi_c_end) of every roi, roi by
// roi (one contiguous run of output per roi, the block's planes stay in cache).
template <typename T, typename A>
void roi_pooling_forward_native(const T* data, const int* batch, const int* hstart,
                                const int* hend, const int* wstart, const int* wend, int C,
                                int H, int W, int P, int Q, T* out, int* argmax,
                                int store_argmax, long long n) {
  const long long plane_out = (long long)P * Q, per_roi = C * plane_out;
  const long long R = per_roi > 0 ? n / per_roi : 0;
  for (long long r = 0; r < R; ++r) {
    const int b = batch[r];
    const int *hs = hstart + r * P, *he = hend + r * P, *ws = wstart + r * Q, *we = wend + r * Q;
    int kh = 1, kw = 1;
    for (int p = 0; p < P; ++p) kh = he[p] - hs[p] > kh ? he[p] - hs[p] : kh;
    for (int q = 0; q < Q; ++q) kw = we[q] - ws[q] > kw ? we[q] - ws[q] : kw;
    for (int c = mx_roi_c_begin; c < mx_roi_c_end; ++c) {
      const long long o = (r * C + c) * plane_out;
      int* a = store_argmax ? argmax + o : nullptr;  // 0: inference, nothing kept
      if (b < 0) {
        for (long long i = 0; i < plane_out; ++i) {
          out[o + i] = mx_roi::Traits<T>::store((A)0);
          if (a) a[i] = -1;
        }
        continue;
      }
      const T* plane = data + mx_roi::plane_offset(b, c, C, H, W);
      if (kh == 1 && kw == 1)
        roi_pooling_plane<1, 1, T, A>(plane, hs, he, ws, we, kh, kw, W, P, Q, out + o, a);
      else if (kh == 1 && kw == 2)
        roi_pooling_plane<1, 2, T, A>(plane, hs, he, ws, we, kh, kw, W, P, Q, out + o, a);
      else if (kh == 2 && kw == 1)
        roi_pooling_plane<2, 1, T, A>(plane, hs, he, ws, we, kh, kw, W, P, Q, out + o, a);
      else if (kh == 2 && kw == 2)
        roi_pooling_plane<2, 2, T, A>(plane, hs, he, ws, we, kh, kw, W, P, Q, out + o, a);
      else
        roi_pooling_plane<0, 0, T, A>(plane, hs, he, ws, we, kh, kw, W, P, Q, out + o, a);
    }
  }
}
#endif

template <typename T, typename A>
__global__ void roi_pooling_forward(
    const T* __restrict__ data, const int* __restrict__ batch, const int* __restrict__ hstart,
    const int* __restrict__ hend, const int* __restrict__ wstart, const int* __restrict__ wend,
    int C, int H, int W, int P, int Q, T* __restrict__ out, int* __restrict__ argmax,
    int store_argmax, long long n) {
#ifdef MX_ROI_HOST_NATIVE
  roi_pooling_forward_native<T, A>(data, batch, hstart, hend, wstart, wend, C, H, W, P, Q, out,
                             argmax, store_argmax, n);
#else
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
#endif
}

#ifdef MX_ROI_HOST_NATIVE
// Native host build of the backward: the calling thread's channel block of every roi,
// plane by plane, in the generic loop's order, without its per-item index bookkeeping.
template <typename T, typename A, typename O>
void roi_pooling_backward_native(const T* grad, const int* batch, const int* argmax, int C,
                                 int H, int W, int P, int Q, O* bottom, double scale,
                                 long long n) {
  const long long plane_out = (long long)P * Q, per_roi = C * plane_out;
  const long long R = per_roi > 0 ? n / per_roi : 0;
  for (long long r = 0; r < R; ++r) {
    const int b = batch[r];
    if (b < 0) continue;
    for (int c = mx_roi_c_begin; c < mx_roi_c_end; ++c) {
      const long long o = (r * C + c) * plane_out;
      const T* g = grad + o;
      const int* a = argmax + o;
      O* plane = bottom + mx_roi::plane_offset(b, c, C, H, W);
      for (long long i = 0; i < plane_out; ++i)
        if (a[i] >= 0) mx_roi::grad_add(plane + a[i], (A)mx_roi::Traits<T>::load(g[i]), scale);
    }
  }
}
#endif

template <typename T, typename A, typename O>
__global__ void roi_pooling_backward(
    const T* __restrict__ grad, const int* __restrict__ batch, const int* __restrict__ argmax,
    int C, int H, int W, int P, int Q, O* __restrict__ bottom, double scale, long long n) {
#ifdef MX_ROI_HOST_NATIVE
  roi_pooling_backward_native<T, A, O>(grad, batch, argmax, C, H, W, P, Q, bottom, scale, n);
#else
  MX_ROI_ITEM_LOOP(it, n, C, P, Q, false) {
    const int a = argmax[it.i];
    const int b = batch[it.r];
    if (a < 0 || b < 0) continue;
    mx_roi::grad_add(bottom + mx_roi::plane_offset(b, it.c, C, H, W) + a,
                     (A)mx_roi::Traits<T>::load(grad[it.i]), scale);
  }
#endif
}
