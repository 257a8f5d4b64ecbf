// ROIPooling kernels: max over the integer bins of mx_roi.geometry.IntBins
// ([hstart, hend) x [wstart, wend), already clipped to the map).  Row-major scan from
// max_init() (-FLT_MAX) with strict '>' (the first maximum wins, NaN never wins); an
// empty bin or a negative batch index gives 0 and argmax -1, a bin nothing beat gives
// -FLT_MAX and argmax -1; argmax is h*W + w within the (b, c) plane.
#include "roi_common.cuh"

#ifdef MX_ROI_HOST_NATIVE
// Native host build of the forward: the thread's channel block copied channels-last
// (mx_roi::channels_last_block), then every bin of a roi scanned cell by cell in
// row-major order, updating the running max of 16 channels at a time (mx_roi::MaxLanes:
// strict '>' per lane, the generic kernel's first maximum and NaN rule, bit for bit).
template <typename T, typename A>
void roi_pooling_forward_native(const T* data, const int* batch, const int* hstart,
                                const int* hend, const int* wstart, const int* wend, int C,
                                int H, int W, int P, int Q, T* out, int* argmax,
                                int store_argmax, long long n) {
  const mx_roi::LaneWalk<T, A> walk(data, batch, C, H, W, P, Q, n);
  if (walk.empty()) return;
  const long long plane_out = walk.plane_out;
  const int L = mx_roi::LANES, nc = walk.nc, ncp = walk.ncp;
  walk.each_bin(batch, C, P, Q, out, [&](long long r, int p, int q, const A* img, T* o) {
    const int h0 = hstart[r * P + p], hl = hend[r * P + p] - h0;
    const int w0 = wstart[r * Q + q], wl = wend[r * Q + q] - w0;
    int* a = store_argmax ? argmax + (o - out) : nullptr;  // 0: inference, nothing kept
    if (!img || hl <= 0 || wl <= 0) {  // empty bin or skipped roi: 0, no argmax
      for (int c = 0; c < nc; ++c) {
        o[c * plane_out] = mx_roi::Traits<T>::store((A)0);
        if (a) a[c * plane_out] = -1;
      }
      return;
    }
    for (int cc = 0; cc < ncp; cc += L) {
      mx_roi::MaxLanes<A> m;
      m.init();
      for (int i = 0; i < hl; ++i) {
        for (int j = 0; j < wl; ++j) {
          const int k = (h0 + i) * W + w0 + j;
          m.step(img + (size_t)k * ncp + cc, k);
        }
      }
      const int lanes = nc - cc < L ? nc - cc : L;
      for (int c = 0; c < lanes; ++c) {
        o[(cc + c) * plane_out] = mx_roi::Traits<T>::store(m.value(c));
        if (a) a[(cc + c) * plane_out] = m.index(c);
      }
    }
  });
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
