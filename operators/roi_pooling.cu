// ROIPooling kernels: max over the integer bins of mx_roi.geometry.IntBins
// ([hstart, hend) x [wstart, wend), already clipped to the map).  Row-major scan from
// max_init() (-FLT_MAX) with strict '>' (the first maximum wins, NaN never wins); an
// empty bin or a negative batch index gives 0 and argmax -1, a bin nothing beat gives
// -FLT_MAX and argmax -1; argmax is h*W + w within the (b, c) plane.
#include "roi_common.cuh"

#ifdef MX_ROI_HOST_NATIVE
#include <cstring>
#include <vector>
// Native host build of the forward: the thread's channel block [mx_roi_c_begin,
// mx_roi_c_end) is first copied channels-last (cell by cell, the block's channels
// contiguous, loaded as A), then every bin of a roi is scanned cell by cell in row-major
// order, updating the running max of all the block's channels in one loop the compiler
// vectorises (the channels are independent lanes: strict '>' per lane gives the same
// first maximum and NaN rule as the generic kernel, bit for bit).
// The running max and argmax of L = 16 channels (lanes) over a bin's cells: strict '>'
// per lane, the first maximum wins and NaN never does.  float: four 4-lane vectors (GCC /
// Clang vector extensions; g++ does not vectorise the scalar form with its argmax);
// other types: scalar lanes.
template <typename A>
struct MaxLanes {
  A best[16];
  int arg[16];
  void init() {
    for (int c = 0; c < 16; ++c) {
      best[c] = mx_roi::max_init<A>();
      arg[c] = -1;
    }
  }
  void step(const A* v, int k) {
    for (int c = 0; c < 16; ++c) mx_roi::max_step(v[c], best[c], k, arg[c]);
  }
  A value(int c) const { return best[c]; }
  int index(int c) const { return arg[c]; }
};

typedef float mx_roi_v4f __attribute__((vector_size(16)));
typedef int mx_roi_v4i __attribute__((vector_size(16)));

template <>
struct MaxLanes<float> {
  mx_roi_v4f best[4];
  mx_roi_v4i arg[4];
  void init() {
    for (int i = 0; i < 4; ++i) {
      best[i] = mx_roi_v4f{} + mx_roi::max_init<float>();
      arg[i] = mx_roi_v4i{} - 1;
    }
  }
  void step(const float* v, int k) {
    const mx_roi_v4i kv = mx_roi_v4i{} + k;
    for (int i = 0; i < 4; ++i) {
      mx_roi_v4f x;
      memcpy(&x, v + 4 * i, sizeof x);
      const mx_roi_v4i take = x > best[i];  // -1 where strictly greater (NaN: 0)
      best[i] = take ? x : best[i];
      arg[i] = take ? kv : arg[i];
    }
  }
  float value(int c) const { return best[c / 4][c % 4]; }
  int index(int c) const { return arg[c / 4][c % 4]; }
};

template <typename T, typename A>
void roi_pooling_forward_native(const T* data, const int* batch, const int* hstart,
                                const int* hend, const int* wstart, const int* wend, int C,
                                int H, int W, int P, int Q, T* out, int* argmax,
                                int store_argmax, long long n) {
  const long long plane_out = (long long)P * Q, per_roi = C * plane_out;
  const long long R = per_roi > 0 ? n / per_roi : 0;
  const int c0 = mx_roi_c_begin, nc = mx_roi_c_end - mx_roi_c_begin;
  if (R <= 0 || nc <= 0) return;
  const long long HW = (long long)H * W;
  const int L = 16, ncp = (nc + L - 1) / L * L;  // lanes per pass; padded block width
  int images = 0;  // images any roi reads (batch indices are validated: < N)
  for (long long r = 0; r < R; ++r) images = batch[r] >= images ? batch[r] + 1 : images;
  static thread_local std::vector<A> cells;
  cells.resize((size_t)images * HW * ncp);
  for (int b = 0; b < images; ++b) {
    A* img = cells.data() + (size_t)b * HW * ncp;
    for (int c = 0; c < nc; ++c) {
      const T* plane = data + mx_roi::plane_offset(b, c0 + c, C, H, W);
      for (long long k = 0; k < HW; ++k) img[k * ncp + c] = (A)mx_roi::Traits<T>::load(plane[k]);
    }
    for (int c = nc; c < ncp; ++c)  // padding lanes: computed, never stored
      for (long long k = 0; k < HW; ++k) img[k * ncp + c] = (A)0;
  }
  for (long long r = 0; r < R; ++r) {
    const int b = batch[r];
    const A* img = b >= 0 ? cells.data() + (size_t)b * HW * ncp : nullptr;
    for (int p = 0; p < P; ++p) {
      const int h0 = hstart[r * P + p], hl = hend[r * P + p] - h0;
      for (int q = 0; q < Q; ++q) {
        const int w0 = wstart[r * Q + q], wl = wend[r * Q + q] - w0;
        T* o = out + (r * C + c0) * plane_out + p * Q + q;  // channel c0 + c: o[c * plane_out]
        int* a = store_argmax ? argmax + (o - out) : nullptr;  // 0: inference, nothing kept
        if (b < 0 || hl <= 0 || wl <= 0) {  // empty bin or skipped roi: 0, no argmax
          for (int c = 0; c < nc; ++c) {
            o[c * plane_out] = mx_roi::Traits<T>::store((A)0);
            if (a) a[c * plane_out] = -1;
          }
          continue;
        }
        for (int cc = 0; cc < ncp; cc += L) {
          MaxLanes<A> m;
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
      }
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
