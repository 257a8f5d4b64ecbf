// ROIPooling kernels: max over the integer bins of mx_roi.geometry.IntBins
// ([hstart, hend) x [wstart, wend), already clipped to the map).  Row-major scan from
// max_init() (-FLT_MAX) with strict '>' (the first maximum wins, NaN never wins); an
// empty bin or a negative batch index gives 0 and no argmax, a bin nothing beat gives
// -FLT_MAX and no argmax.  The argmax is bin-relative: the winner's offset
// (h - hstart) * (wend - wstart) + (w - wstart) among the bin's cells, stored as I (the
// smallest unsigned type fitting the call's largest bin, mx_roi.cuda.tables.argmax_dtype),
// "no argmax" as I's maximum value (mx_roi::index_store); the backward decodes h and w
// with the same bin's hstart, wstart and wend.
#include "roi_common.cuh"

#ifdef MX_ROI_HOST_NATIVE
// Native host build of the forward: the thread's channel block copied channels-last
// (mx_roi::channels_last_block), then, 16 channels at a time (LaneWalk::each_pass), every
// bin of a roi scanned cell by cell in row-major order (mx_roi::MaxLanes:
// strict '>' per lane, the generic kernel's first maximum and NaN rule, bit for bit).
template <typename T, typename A, typename I>
void roi_pooling_forward_native(const T* data, const int* batch, const int* hstart,
                                const int* hend, const int* wstart, const int* wend, int C,
                                int H, int W, int P, int Q, T* out, I* argmax,
                                int store_argmax, long long n) {
  const mx_roi::LaneWalk<T, A> walk(data, batch, C, H, W, P, Q, n);
  const long long plane_out = walk.plane_out;
  const int ncp = walk.ncp;
  walk.each_pass(batch, C, P, Q, out, [&](long long r, int cc, int lanes, int p, int q,
                                           const A* img, T* o) {
    const int h0 = hstart[r * P + p], hl = hend[r * P + p] - h0;
    const int w0 = wstart[r * Q + q], wl = wend[r * Q + q] - w0;
    I* a = store_argmax ? argmax + (o - out) : nullptr;  // 0: inference, nothing kept
    if (!img || hl <= 0 || wl <= 0) {  // empty bin or skipped roi: 0, no argmax
      for (int c = 0; c < lanes; ++c) {
        o[c * plane_out] = mx_roi::Traits<T>::store((A)0);
        if (a) a[c * plane_out] = mx_roi::index_store<I>(-1);
      }
      return;
    }
    mx_roi::MaxLanes<A> m;
    m.init();
    for (int i = 0; i < hl; ++i) {
      const A* row = img + ((size_t)(h0 + i) * W + w0) * ncp + cc;
      for (int j = 0; j < wl; ++j) m.step(row + (size_t)j * ncp, i * wl + j);
    }
    for (int c = 0; c < lanes; ++c) {
      o[c * plane_out] = mx_roi::Traits<T>::store(m.value(c));
      if (a) a[c * plane_out] = m.template index<I>(c);
    }
  });
}
#endif

template <typename T, typename A, typename I>
__global__ void roi_pooling_forward(
    const T* __restrict__ data, const int* __restrict__ batch, const int* __restrict__ hstart,
    const int* __restrict__ hend, const int* __restrict__ wstart, const int* __restrict__ wend,
    int C, int H, int W, int P, int Q, T* __restrict__ out, I* __restrict__ argmax,
    int store_argmax, long long n) {
#ifdef MX_ROI_HOST_NATIVE
  roi_pooling_forward_native<T, A, I>(data, batch, hstart, hend, wstart, wend, C, H, W, P, Q,
                                      out, argmax, store_argmax, n);
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
      int k = 0;  // bin-relative: (h - hs) * (we - ws) + (w - ws)
      for (int h = hs; h < he; ++h) {
        for (int w = ws; w < we; ++w, ++k) {
          mx_roi::max_step(mx_roi::Traits<T>::load(plane[h * W + w]), best, k, arg);
        }
      }
    }
    out[it.i] = mx_roi::Traits<T>::store(best);
    if (store_argmax) argmax[it.i] = mx_roi::index_store<I>(arg);  // 0: inference
  }
#endif
}

#ifdef MX_ROI_HOST_NATIVE
// Native host build of the backward: per roi, every bin's cell offsets decoded once
// (cell[first[i] + k] for argmax k of bin i: a division per cell instead of one per
// channel and bin), then the calling thread's channels plane by plane in the generic
// loop's order (roi, then bin), so the same sums.
template <typename T, typename A, typename O, typename I>
void roi_pooling_backward_native(const T* grad, const int* batch, const int* hstart,
                                 const int* hend, const int* wstart, const int* wend,
                                 const I* argmax, int C, int H, int W, int P, int Q, O* bottom,
                                 double scale, long long n) {
  const long long plane_out = (long long)P * Q, per_roi = C * plane_out;
  const long long R = per_roi > 0 ? n / per_roi : 0;
  // a roi with more bin cells (e.g. one 1x1 bin over a 300x300 map) decodes each
  // winner by division instead (detector rois have a few thousand at most)
  const long long kMaxCells = 1 << 16;
  static thread_local std::vector<long long> cell, first;
  first.resize(plane_out);
  for (long long r = 0; r < R; ++r) {
    const int b = batch[r];
    if (b < 0) continue;
    const int* hs = hstart + r * P;
    const int *he = hend + r * P, *ws = wstart + r * Q, *we = wend + r * Q;
    long long cells = 0;
    for (int p = 0; p < P; ++p)
      for (int q = 0; q < Q; ++q) {
        first[p * Q + q] = cells;
        const int hl = he[p] - hs[p], wl = we[q] - ws[q];
        cells += hl > 0 && wl > 0 ? (long long)hl * wl : 0;
      }
    const bool table = cells <= kMaxCells;
    if (table) {
      if ((long long)cell.size() < cells) cell.resize(cells);
      for (int p = 0; p < P; ++p)
        for (int q = 0; q < Q; ++q) {
          const int hl = he[p] - hs[p], wl = we[q] - ws[q];
          if (hl <= 0 || wl <= 0) continue;
          long long* at = cell.data() + first[p * Q + q];
          for (int i = 0; i < hl; ++i)
            for (int j = 0; j < wl; ++j) *at++ = (long long)(hs[p] + i) * W + ws[q] + j;
        }
    }
    // (plain pointers: a thread_local read in the loop costs a call per access)
    const long long *cells_at = cell.data(), *first_at = first.data();
    for (int c = mx_roi_c_begin; c < mx_roi_c_end; ++c) {
      const long long o = (r * C + c) * plane_out;
      const T* g = grad + o;
      const I* a = argmax + o;
      O* plane = bottom + mx_roi::plane_offset(b, c, C, H, W);
      if (table) {
        for (long long i = 0; i < plane_out; ++i) {
          const int k = mx_roi::index_load(a[i]);
          if (k >= 0)
            mx_roi::grad_add(plane + cells_at[first_at[i] + k],
                             (A)mx_roi::Traits<T>::load(g[i]), scale);
        }
        continue;
      }
      for (int p = 0, i = 0; p < P; ++p) {
        for (int q = 0; q < Q; ++q, ++i) {
          const int k = mx_roi::index_load(a[i]);
          if (k < 0) continue;
          const int wl = we[q] - ws[q];
          mx_roi::grad_add(plane + (long long)(hs[p] + k / wl) * W + ws[q] + k % wl,
                           (A)mx_roi::Traits<T>::load(g[i]), scale);
        }
      }
    }
  }
}
#endif

template <typename T, typename A, typename O, typename I>
__global__ void roi_pooling_backward(
    const T* __restrict__ grad, const int* __restrict__ batch, const int* __restrict__ hstart,
    const int* __restrict__ hend, const int* __restrict__ wstart, const int* __restrict__ wend,
    const I* __restrict__ argmax, int C, int H, int W, int P, int Q, O* __restrict__ bottom,
    double scale, long long n) {
#ifdef MX_ROI_HOST_NATIVE
  roi_pooling_backward_native<T, A, O, I>(grad, batch, hstart, hend, wstart, wend, argmax, C, H,
                                          W, P, Q, bottom, scale, n);
#else
  MX_ROI_ITEM_LOOP(it, n, C, P, Q, false) {
    const int k = mx_roi::index_load(argmax[it.i]);
    const int b = batch[it.r];
    if (k < 0 || b < 0) continue;
    const int hs = hstart[it.r * P + it.p];
    const int ws = wstart[it.r * Q + it.q], wl = wend[it.r * Q + it.q] - ws;
    mx_roi::grad_add(bottom + mx_roi::plane_offset(b, it.c, C, H, W) + (hs + k / wl) * W + ws +
                         k % wl,
                     (A)mx_roi::Traits<T>::load(grad[it.i]), scale);
  }
#endif
}
