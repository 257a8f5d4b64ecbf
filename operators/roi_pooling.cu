// ROIPooling kernels: max over the integer bins of mx_roi.geometry.IntBins
// ([hstart, hend) x [wstart, wend), already clipped to the map).  Row-major scan from
// max_init() (-FLT_MAX) with strict '>' (the first maximum wins, NaN never wins); an
// empty bin or a negative batch index gives 0 and no argmax, a bin nothing beat gives
// -FLT_MAX and no argmax.  The argmax is bin-relative: the winner's offset
// (h - hstart) * (wend - wstart) + (w - wstart) among the bin's cells, stored as I (the
// smallest unsigned type fitting the call's largest bin, mx_roi.cuda.tables.argmax_dtype),
// "no argmax" as I's maximum value (mx_roi::index_store); the backward decodes h and w
// with the same bin's hstart, wstart and wend.  A training forward that keeps no argmax
// (a large call, mx_roi.cuda.backend.ARGMAX_KEEP_MAX_ELEMENTS) leaves the winners to
// roi_pooling_backward_rescan, which finds them again in the data by the same scan.
#include "roi_common.cuh"

namespace mx_roi {
// The first maximum of the non-empty integer bin [hs, he) x [ws, we) of a plane: its
// value in best (max_init() if nothing beat it) and its bin-relative index
// (h - hs) * (we - ws) + (w - ws), or -1.
template <typename T, typename A>
__device__ __forceinline__ int int_bin_argmax(const T* plane, int W, int hs, int he, int ws,
                                              int we, A& best) {
  best = max_init<A>();
  int arg = -1, k = 0;
  for (int h = hs; h < he; ++h)
    for (int w = ws; w < we; ++w, ++k) max_step(Traits<T>::load(plane[h * W + w]), best, k, arg);
  return arg;
}

// The cell (h * W + w in the plane) of bin-relative index k of a bin starting at (hs, ws)
// with wl columns.
__device__ __forceinline__ long long int_bin_cell(int k, int hs, int ws, int wl, int W) {
  return (long long)(hs + k / wl) * W + ws + k % wl;
}

#ifdef MX_ROI_HOST_NATIVE
// Native: the cells of bin [h0, h0 + hl) x [w0, w0 + wl) scanned row-major for 16 channels
// (lane pass cc of a channels-last image, ncp lanes per cell) by m; cell (i, j) is
// candidate k0 + i * kstride + j (bin-relative: k0 = 0, kstride = wl; the plane offset:
// k0 = h0 * W + w0, kstride = W).
template <typename M, typename A>
inline void scan_int_bin_lanes(M& m, const A* img, int cc, int ncp, int W, int h0,
                               int hl, int w0, int wl, int k0, int kstride) {
  m.init();
  for (int i = 0; i < hl; ++i) {
    const A* row = img + ((size_t)(h0 + i) * W + w0) * ncp + cc;
    for (int j = 0; j < wl; ++j) m.step(row + (size_t)j * ncp, k0 + i * kstride + j);
  }
}
#endif
}  // namespace mx_roi

#ifdef MX_ROI_HOST_NATIVE
// The maxima of bin [h0, h0 + hl) x [w0, w0 + wl) for NP 16-channel passes of a
// channels-last image at once (pass k's lanes to o[16k, 16k + 16), as
// LaneWalk::each_group_staged stages them): each cell's lanes of every pass read as the
// cell is reached, per lane MaxValueLanes' scan in its order (the same maxima).  Walked a
// pass at a time, a small roi's bins were scanned once per pass, their few cells each
// time (measured, one thread, the bench's small inference forward -- 16 rois 7x7 on a
// 64-channel 19x25 map: 23-26 -> 16-17 us).
template <int NP, typename T, typename A>
inline void roi_pool_max_bin_group(const A* img, int cc, int ncp, int W, int h0, int hl, int w0,
                                   int wl, T* o) {
  const int L = mx_roi::LANES;
  mx_roi::MaxValueLanes<A> m0, m1, m2, m3;  // named, as roi_align_avg_bin_lanes' sums
  m0.init();
  if (NP > 1) m1.init();
  if (NP > 2) m2.init();
  if (NP > 3) m3.init();
  for (int i = 0; i < hl; ++i) {
    const A* row = img + ((size_t)(h0 + i) * W + w0) * ncp + cc;
    for (int j = 0; j < wl; ++j) {
      const A* v = row + (size_t)j * ncp;
      m0.step(v, 0);
      if (NP > 1) m1.step(v + L, 0);
      if (NP > 2) m2.step(v + 2 * L, 0);
      if (NP > 3) m3.step(v + 3 * L, 0);
    }
  }
  mx_roi::store_lanes<T>(m0, o);
  if (NP > 1) mx_roi::store_lanes<T>(m1, o + L);
  if (NP > 2) mx_roi::store_lanes<T>(m2, o + 2 * L);
  if (NP > 3) mx_roi::store_lanes<T>(m3, o + 3 * L);
}

// Passes per group of an inference forward: 4 for float lanes in the 8-wide (AVX) build
// (8 vector registers of maxima), else 1: the 4-wide build's maxima would take 16, and
// four groups of scalar lanes (float64) spill (its small inference forward, one thread:
// 70 us a pass at a time, 94 us four at once)
template <typename A>
constexpr int max_group() {
  return std::is_same<A, float>::value && mx_roi::VW == 8 ? 4 : 1;
}

// Native host build of the forward: the thread's channel block copied channels-last
// (mx_roi::channels_last_block), then, 16 channels at a time (LaneWalk::each_pass_staged),
// every bin of a roi scanned cell by cell in row-major order (mx_roi::MaxLanes: strict
// '>' per lane, the generic kernel's first maximum and NaN rule, bit for bit).  An
// inference call, which keeps no argmax, scans each cell for a group of up to
// max_group<A>() passes at once (roi_pool_max_bin_group, mx_roi::MaxValueLanes: the same maxima).
template <typename T, typename A, typename I>
void roi_pooling_forward_native(const T* data, const int* batch, const int* hstart,
                                const int* hend, const int* wstart, const int* wend, int C,
                                int H, int W, int P, int Q, T* out, I* argmax,
                                int store_argmax, long long n) {
  const mx_roi::LaneWalk<T, A> walk(data, batch, C, H, W, P, Q, n);
  const long long plane_out = walk.plane_out;
  const int ncp = walk.ncp;
  if (!store_argmax) {  // inference: the maxima alone, a group of passes a bin
    walk.template each_group_staged<max_group<A>()>(batch, C, P, Q, out, (int*)nullptr, [&](
        long long r, int cc, int passes, int lanes, int p, int q, const A* img, T* o, int*) {
      const int h0 = hstart[r * P + p], hl = hend[r * P + p] - h0;
      const int w0 = wstart[r * Q + q], wl = wend[r * Q + q] - w0;
      if (!img || hl <= 0 || wl <= 0) {  // empty bin or skipped roi: 0
        for (int c = 0; c < lanes; ++c) o[c] = mx_roi::Traits<T>::store((A)0);
        return;
      }
      switch (passes) {
        case 1: roi_pool_max_bin_group<1, T, A>(img, cc, ncp, W, h0, hl, w0, wl, o); break;
        case 2: roi_pool_max_bin_group<2, T, A>(img, cc, ncp, W, h0, hl, w0, wl, o); break;
        case 3: roi_pool_max_bin_group<3, T, A>(img, cc, ncp, W, h0, hl, w0, wl, o); break;
        default: roi_pool_max_bin_group<4, T, A>(img, cc, ncp, W, h0, hl, w0, wl, o); break;
      }
    });
    return;
  }
  // training: the output staged, the argmax stored directly
  walk.each_pass_staged(batch, C, P, Q, out, argmax, [&](
      long long r, int cc, int lanes, int p, int q, const A* img, T* o, I* a) {
    const int h0 = hstart[r * P + p], hl = hend[r * P + p] - h0;
    const int w0 = wstart[r * Q + q], wl = wend[r * Q + q] - w0;
    if (!img || hl <= 0 || wl <= 0) {  // empty bin or skipped roi: 0, no argmax
      for (int c = 0; c < lanes; ++c) {
        o[c] = mx_roi::Traits<T>::store((A)0);
        a[c * plane_out] = mx_roi::index_store<I>(-1);
      }
      return;
    }
    mx_roi::MaxLanes<A> m;
    mx_roi::scan_int_bin_lanes(m, img, cc, ncp, W, h0, hl, w0, wl, 0, wl);
    mx_roi::store_lanes<T>(m, o);
    for (int c = 0; c < lanes; ++c) a[c * plane_out] = m.template index<I>(c);
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
    if (b >= 0 && he > hs && we > ws)
      arg = mx_roi::int_bin_argmax(data + mx_roi::plane_offset(b, it.c, C, H, W), W, hs, he,
                                   ws, we, best);
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
  const long long plane_out = (long long)P * Q, R = mx_roi::launch_rois(n, C, P, Q);
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
    int c = mx_roi_c_begin;
    if (table) {
      // four channels at a time: their planes are apart, so the four read-add-write
      // chains overlap (one channel's winners often repeat a cell: each add waits for
      // the last); per plane the adds keep the order below, so the same sums
      const long long hw = (long long)H * W;
      for (; c + 4 <= mx_roi_c_end; c += 4) {
        const long long o = (r * C + c) * plane_out;
        const T* g = grad + o;
        const I* a = argmax + o;
        O* plane = bottom + mx_roi::plane_offset(b, c, C, H, W);
        for (long long i = 0; i < plane_out; ++i) {
          const long long* cells_i = cells_at + first_at[i];
          for (int j = 0; j < 4; ++j) {
            const int k = mx_roi::index_load(a[j * plane_out + i]);
            if (k >= 0)
              mx_roi::grad_add(plane + j * hw + cells_i[k],
                               (A)mx_roi::Traits<T>::load(g[j * plane_out + i]), scale);
          }
        }
      }
    }
    for (; c < mx_roi_c_end; ++c) {
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
          mx_roi::grad_add(plane + mx_roi::int_bin_cell(k, hs[p], ws[q], we[q] - ws[q], W),
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
    mx_roi::grad_add(bottom + mx_roi::plane_offset(b, it.c, C, H, W) +
                         mx_roi::int_bin_cell(k, hs, ws, wl, W),
                     (A)mx_roi::Traits<T>::load(grad[it.i]), scale);
  }
#endif
}

#ifdef MX_ROI_HOST_NATIVE
// A bin's gradient g[c] (16 lanes) to its winners -- m's argmax for the first ``lanes``
// lanes: a cell's plane offset, or -1 (none) -- in a channels-last gradient block whose
// cell k's lanes start at lane0 + k * ncp: one scalar add per winning lane.
template <typename A>
inline void add_to_winners_by_lane(A* lane0, int ncp, const mx_roi::MaxLanes<A>& m, int lanes,
                                   const A* g) {
  for (int c = 0; c < lanes; ++c) {
    const int cell = m.template index<int>(c);
    if (cell >= 0) lane0[(size_t)cell * ncp + c] += g[c];
  }
}

// The same for a bin of the cells (h0 + i, w0 + j), i < hl, j < wl, of a map W cells
// wide (float: below).
template <typename A>
struct WinnersAdd {
  static void run(A* lane0, int ncp, const mx_roi::MaxLanes<A>& m, int lanes, const A* g, int,
                  int, int, int, int) {
    add_to_winners_by_lane(lane0, ncp, m, lanes, g);
  }
};

#if defined(__SSE2__)
// float, a bin of at most WINNERS_BY_CELL cells: every cell of the bin gets the vector of
// the lanes it won (their g; the other lanes +0.0, the all-zero bits) -- VN vector adds
// per cell, no branch on the data -- instead of up to 16 scalar adds, each a load and
// store through a cell that a small roi's next bins often share (ROIPooling's small
// backward, kernel in a C++ loop: 71 -> 46 us).  +0 leaves a lane as it was: a block
// starts at +0 and a sum of IEEE additions from +0 is never -0 (x + +0 == x bit for bit,
// NaN included), so per lane the same additions in the same order.  Larger bins: the
// scalar adds (a vector add per cell would outnumber them).
template <>
struct WinnersAdd<float> {
  static const int WINNERS_BY_CELL = 4;
  static void run(float* lane0, int ncp, const mx_roi::MaxLanes<float>& m, int lanes,
                  const float* g, int h0, int hl, int w0, int wl, int W) {
    if (hl * wl > WINNERS_BY_CELL) {
      add_to_winners_by_lane(lane0, ncp, m, lanes, g);
      return;
    }
    using mx_roi::VN;
    using mx_roi::VW;
    mx_roi::vi gv[VN];  // (the lanes past ``lanes`` feed only the block's padding lanes)
    for (int i = 0; i < VN; ++i) memcpy(&gv[i], g + VW * i, sizeof gv[i]);
    for (int y = h0; y < h0 + hl; ++y)
      for (int x = w0; x < w0 + wl; ++x) {
        const int k = y * W + x;
        float* s = lane0 + (size_t)k * ncp;
        for (int i = 0; i < VN; ++i) {
          const mx_roi::vf v = (mx_roi::vf)(gv[i] & (m.arg[i] == k));
          mx_roi::vf a;
          memcpy(&a, s + VW * i, sizeof a);
          a = a + v;
          memcpy(s + VW * i, &a, sizeof a);
        }
      }
  }
};
#endif

// Native host build of the rescanning backward: the forward's walk (the thread's channel
// block channels-last, 16 channels per pass, roi by roi; LaneWalk's block and images) finds each bin's winners again
// -- candidates numbered by their plane offset, so no decoding -- and adds the bin's
// gradient (its 16 channels bin-major: mx_roi::PassRows) to them in a channels-last
// gradient block (mx_roi::GradBlock, WinnersAdd), then to the planes; per channel in
// the order (roi, bin) of the other backwards, so the same sums.
template <typename T, typename A, typename O>
void roi_pooling_backward_rescan_native(const T* data, const T* grad, const int* batch,
                                        const int* hstart, const int* hend, const int* wstart,
                                        const int* wend, int C, int H, int W, int P, int Q,
                                        O* bottom, double scale, long long n) {
  const mx_roi::LaneWalk<T, A> walk(data, batch, C, H, W, P, Q, n);
  if (walk.empty()) return;
  const mx_roi::GradBlock<A> block(batch, walk.R, H, W);
  const long long plane_out = walk.plane_out;
  const int ncp = walk.ncp, L = mx_roi::LANES;
  for (long long r = 0; r < walk.R; ++r) {
    const A* img = walk.image(batch[r]);
    if (!img) continue;
    for (int cc = 0; cc < ncp; cc += L) {
      const int lanes = walk.nc - cc < L ? walk.nc - cc : L;
      mx_roi::PassRows<T, A> rows(grad + (r * C + walk.c0 + cc) * plane_out, plane_out, lanes);
      A* const sums = block.image(batch[r]) + cc;
      for (int p = 0; p < P; ++p) {
        const int h0 = hstart[r * P + p], hl = hend[r * P + p] - h0;
        if (hl <= 0) continue;
        for (int q = 0; q < Q; ++q) {
          const int w0 = wstart[r * Q + q], wl = wend[r * Q + q] - w0;
          if (wl <= 0) continue;
          mx_roi::MaxLanes<A> m;
          mx_roi::scan_int_bin_lanes(m, img, cc, ncp, W, h0, hl, w0, wl, h0 * W + w0, W);
          WinnersAdd<A>::run(sums, ncp, m, lanes, rows.at(p * Q + q), h0, hl, w0, wl, W);
        }
      }
    }
  }
  block.add_to(bottom, C, H, W, scale);
}
#endif

// The backward of a training forward that kept no argmax: each bin's winner found again
// by the forward's scan of the data (same first maximum, same NaN rule), its gradient
// added there as by roi_pooling_backward.
template <typename T, typename A, typename O>
__global__ void roi_pooling_backward_rescan(
    const T* __restrict__ data, const T* __restrict__ grad, const int* __restrict__ batch,
    const int* __restrict__ hstart, const int* __restrict__ hend,
    const int* __restrict__ wstart, const int* __restrict__ wend, int C, int H, int W, int P,
    int Q, O* __restrict__ bottom, double scale, long long n) {
#ifdef MX_ROI_HOST_NATIVE
  roi_pooling_backward_rescan_native<T, A, O>(data, grad, batch, hstart, hend, wstart, wend, C,
                                              H, W, P, Q, bottom, scale, n);
#else
  MX_ROI_ITEM_LOOP(it, n, C, P, Q, false) {
    const int b = batch[it.r];
    const int hs = hstart[it.r * P + it.p], he = hend[it.r * P + it.p];
    const int ws = wstart[it.r * Q + it.q], we = wend[it.r * Q + it.q];
    if (b < 0 || he <= hs || we <= ws) continue;
    const long long plane = mx_roi::plane_offset(b, it.c, C, H, W);
    A best;
    const int k = mx_roi::int_bin_argmax(data + plane, W, hs, he, ws, we, best);
    if (k >= 0)
      mx_roi::grad_add(bottom + plane + mx_roi::int_bin_cell(k, hs, ws, we - ws, W),
                       (A)mx_roi::Traits<T>::load(grad[it.i]), scale);
  }
#endif
}

#ifdef MX_ROI_EXT_LAUNCHER
// ==== mx_roi_ROIPooling: this op in mx_roi's MXNet extension library (mx_roi.ext) =========
// Compiled only into that library (see roi_align.cu's section): mx.nd.ROIPooling's
// parameters plus ROIPoolingParam's, the device geometry's integer bins and roi check,
// then this file's kernels (the backward finds each bin's winner again in the data).
#include "ext_launch.h"

namespace mx_roi_op {

struct ROIPoolingOp : PooledOp<ROIPoolingOp> {
  static constexpr const char* OP = "ROIPooling";

  // parse / format (ROIPoolingParam.from_kwargs / to_kwargs) / out_channels: PooledOp

  template <typename T, typename A>
  static Bins geometry(const Params& p, const MXTensor& data, const MXTensor& rois) {
    return int_bins_geometry<T, A>(OP, MODE_POOL_BINS, (int)p.P, (int)p.Q, (int)data.shape[2],
                                   (int)data.shape[3], (float)p.spatial_scale,
                                   (const T*)rois.data_ptr, rois.shape[0], data.shape[0]);
  }

  template <typename T, typename A>
  static void forward(const Params& p, const Call<ROIPoolingOp, T, A>& c,
                      const MXTensor& data, MXTensor& out) {
    const Bins& b = c.g;
    unsigned char no_argmax = 0;  // (store_argmax 0: the backward rescans the data)
    c.launch([&]() {
      roi_pooling_forward<T, A, unsigned char>((const T*)data.data_ptr, b.batch, b.hstart,
                                               b.hend, b.wstart, b.wend, c.C, c.H, c.W,
                                               c.P, c.Q, (T*)out.data_ptr, &no_argmax, 0,
                                               c.n);
    });
  }

  template <typename T, typename A>
  static void backward(const Params& p, const Call<ROIPoolingOp, T, A>& c,
                       const MXTensor& grad, const MXTensor& data, A* bottom) {
    const Bins& b = c.g;
    c.launch([&]() {
      roi_pooling_backward_rescan<T, A, A>((const T*)data.data_ptr, (const T*)grad.data_ptr,
                                           b.batch, b.hstart, b.hend, b.wstart, b.wend, c.C,
                                           c.H, c.W, c.P, c.Q, bottom, 1.0, c.n);
    });
  }
};

const RegisterParams roi_pooling_params("ROIPooling", ROIPoolingOp::format);

// ---- the native GPU path (opt-in; docs/gpu.md): the forward and the backward through
// mx_roi.ext.cuda's launcher (this file's MX_ROI_EXT_CUDA_LAUNCHER section below) on MXNet's
// stream, their tables in MXNet's temporary workspace; no host wait.
struct ROIPoolingGpu {
  typedef ROIPoolingOp Op;
  typedef int (*Workspace)(int, long long, long long, long long, long long, long long, int,
                           int, int, unsigned long long*, char*, size_t);
  typedef int (*Forward)(int, const void*, const void*, void*, long long, long long, long long,
                         long long, long long, int, int, float, void*, unsigned long long,
                         void*, char*, size_t);
  typedef int (*Backward)(int, const void*, const void*, const void*, void*, void*, long long,
                          long long, long long, long long, long long, int, int, float, void*,
                          unsigned long long, void*, char*, size_t);
  static constexpr const char* OP = ROIPoolingOp::OP;

  // the call's device memory (tables; a float16 backward's accumulator) in MXNet's
  // temporary workspace (null: none needed)
  static void* tables(const PooledParams& p, const MXTensor& data, long long R, bool backward,
                      const OpResource& res, unsigned long long* bytes) {
    char err[4096] = "";
    gpu_call(gpu_entry<Workspace>(OP, "mx_roi_ext_cuda_roi_pooling_workspace")(
                 data.dtype, data.shape[0], data.shape[1], data.shape[2], data.shape[3], R,
                 (int)p.P, (int)p.Q, backward ? 1 : 0, bytes, err, sizeof err),
             err);
    return gpu_workspace(OP, res, *bytes);
  }

  static int forward(const PooledParams& p, const MXTensor& data, const MXTensor& rois,
                     MXTensor& out, void* ws, unsigned long long bytes, void* stream, char* err,
                     size_t len) {
    return gpu_entry<Forward>(OP, "mx_roi_ext_cuda_roi_pooling_forward")(
        data.dtype, data.data_ptr, rois.data_ptr, out.data_ptr, data.shape[0], data.shape[1],
        data.shape[2], data.shape[3], rois.shape[0], (int)p.P, (int)p.Q,
        (float)p.spatial_scale, ws, bytes, stream, err, len);
  }

  static int backward(const PooledParams& p, const MXTensor& grad, const MXTensor& data,
                      const MXTensor& rois, MXTensor& in_grad, MXTensor& rois_grad, void* ws,
                      unsigned long long bytes, void* stream, char* err, size_t len) {
    return gpu_entry<Backward>(OP, "mx_roi_ext_cuda_roi_pooling_backward")(
        data.dtype, grad.data_ptr, data.data_ptr, rois.data_ptr, in_grad.data_ptr,
        rois_grad.data_ptr, data.shape[0], data.shape[1], data.shape[2], data.shape[3],
        rois.shape[0], (int)p.P, (int)p.Q, (float)p.spatial_scale, ws, bytes, stream, err,
        len);
  }
};

}  // namespace mx_roi_op

MX_ROI_EXT_REGISTER(mx_roi_ROIPooling, mx_roi_op::ROIPoolingOp)
    .setForward(mx_roi_op::GpuCallbacks<mx_roi_op::ROIPoolingGpu>::forward, "gpu")
    .setBackward(mx_roi_op::GpuCallbacks<mx_roi_op::ROIPoolingGpu>::backward, "gpu");
#endif  // MX_ROI_EXT_LAUNCHER

#ifdef MX_ROI_EXT_CUDA_LAUNCHER
// ==== this op on the native GPU path (opt-in; docs/gpu.md) ===============================
// Compiled only into mx_roi.ext.cuda's launcher library (as roi_align.cu's section): the
// driver-API launch of this file's kernels (roi_pooling.py's native_gpu_kernels, NVRTC's
// PTX in ROI_POOLING_IMAGE) as forward_cuda / backward_cuda run them on the device-built
// integer bins, and the C entries.
namespace mx_roi_cuda {

// ROIPooling's workspace: the tables, and for a float16 backward the float32 accumulator
// (with_accumulator); 0 for R = 0.
inline unsigned long long roi_pooling_bytes(int dtype, long long N, long long C, long long H,
                                            long long W, long long R, int P, int Q,
                                            bool backward) {
  if (R <= 0) return 0;
  const unsigned long long tables = IntBins(MODE_POOL_BINS, R, P, Q, H, W, 0).bytes;
  return backward ? with_accumulator(tables, dtype, N * C * H * W) : tables;
}

// ROIPooling's forward (roi_pooling.py forward_cuda on device-built bins, IntBins): the
// geometry kernel, then roi_pooling_forward (no argmax kept: store_argmax 0, the backward rescans),
// on ``stream``.
inline void roi_pooling_forward(int dtype, CUdeviceptr data, CUdeviceptr rois, CUdeviceptr out,
                                long long N, long long C, long long H, long long W,
                                long long R, int P, int Q, float spatial_scale,
                                CUdeviceptr workspace, unsigned long long workspace_bytes,
                                CUstream stream) {
  const CallScope call("ROIPooling", dtype, stream);
  call.report();
  if (R <= 0) return;  // no roi: nothing to launch (the output is empty)
  need_workspace(call.op, workspace_bytes,
                 roi_pooling_bytes(dtype, N, C, H, W, R, P, Q, false));
  const IntBins bins(MODE_POOL_BINS, R, P, Q, H, W, workspace);
  bins.geometry(call, ROI_POOLING_IMAGE, rois, N, H, W, R, P, Q, spatial_scale);
  const long long n = R * C * P * Q;
  Args k;
  k(data);
  for (int i = 0; i < 5; ++i) k(bins.tb[i]);
  k((int)C)((int)H)((int)W)(P)(Q)(out)(workspace)(0)(n);  // argmax: never written
  call.run(ROI_POOLING_IMAGE, "roi_pooling_forward" + call.ta() + ", unsigned char>", n, k);
  call.record();
}

// ROIPooling's backward (roi_pooling.py backward_cuda with no kept argmax, req write): the
// gradients zeroed (GradTarget), the geometry kernel, roi_pooling_backward_rescan, then for
// float16 the accumulator's store; all on ``stream``.  A bad roi raises nothing here (as
// ROIAlign's backward: the next forward reports it).
inline void roi_pooling_backward(int dtype, CUdeviceptr grad, CUdeviceptr data,
                                 CUdeviceptr rois, CUdeviceptr in_grad, CUdeviceptr rois_grad,
                                 long long N, long long C, long long H, long long W,
                                 long long R, int P, int Q, float spatial_scale,
                                 CUdeviceptr workspace, unsigned long long workspace_bytes,
                                 CUstream stream) {
  const CallScope call("ROIPooling", dtype, stream);
  need_workspace(call.op, workspace_bytes, roi_pooling_bytes(dtype, N, C, H, W, R, P, Q, true));
  if (R <= 0) return call.zero(in_grad, (size_t)(N * C * H * W) * item_size(dtype));
  const IntBins bins(MODE_POOL_BINS, R, P, Q, H, W, workspace);
  const GradTarget target(call, dtype, in_grad, rois_grad, N * C * H * W, R, 5,
                          workspace + bins.bytes);
  bins.geometry(call, ROI_POOLING_IMAGE, rois, N, H, W, R, P, Q, spatial_scale);
  const long long n = R * C * P * Q;
  Args k;
  k(data)(grad);
  for (int i = 0; i < 5; ++i) k(bins.tb[i]);
  k((int)C)((int)H)((int)W)(P)(Q)(target.bottom)(1.0)(n);  // bottom, scale, n
  call.run(ROI_POOLING_IMAGE,
           "roi_pooling_backward_rescan" + call.ta() + ", " + call.t.A + ">", n, k);
  target.store(call);
  call.record();
}

}  // namespace mx_roi_cuda

extern "C" {

// The workspace bytes of a ROIPooling forward (``backward`` 0) or backward (1): 0, or 1
// with the message.
int mx_roi_ext_cuda_roi_pooling_workspace(int dtype, long long N, long long C, long long H,
                                          long long W, long long R, int P, int Q, int backward,
                                          unsigned long long* bytes, char* err,
                                          size_t err_len) {
  return mx_roi_cuda::c_entry(err, err_len, [&]() {
    mx_roi_cuda::types_of("ROIPooling", dtype);
    *bytes = mx_roi_cuda::roi_pooling_bytes(dtype, N, C, H, W, R, P, Q, backward != 0);
  });
}

// ROIPooling's forward on ``stream``: data (N, C, H, W), rois (R, 5), out (R, C, P, Q),
// device pointers of ``dtype``; ``workspace``: at least the workspace function's bytes.
// No host synchronisation.
int mx_roi_ext_cuda_roi_pooling_forward(int dtype, const void* data, const void* rois,
                                        void* out, long long N, long long C, long long H,
                                        long long W, long long R, int P, int Q,
                                        float spatial_scale, void* workspace,
                                        unsigned long long workspace_bytes, void* stream,
                                        char* err, size_t err_len) {
  return mx_roi_cuda::c_entry(err, err_len, [&]() {
    mx_roi_cuda::roi_pooling_forward(
        dtype, (mx_roi_cuda::CUdeviceptr)data, (mx_roi_cuda::CUdeviceptr)rois,
        (mx_roi_cuda::CUdeviceptr)out, N, C, H, W, R, P, Q, spatial_scale,
        (mx_roi_cuda::CUdeviceptr)workspace, workspace_bytes, (mx_roi_cuda::CUstream)stream);
  });
}

// ROIPooling's backward on ``stream`` (arguments as ROIAlign's backward's): in_grad written
// (req write), rois_grad zeroed (null: none).  No host synchronisation.
int mx_roi_ext_cuda_roi_pooling_backward(int dtype, const void* grad, const void* data,
                                         const void* rois, void* in_grad, void* rois_grad,
                                         long long N, long long C, long long H, long long W,
                                         long long R, int P, int Q, float spatial_scale,
                                         void* workspace, unsigned long long workspace_bytes,
                                         void* stream, char* err, size_t err_len) {
  return mx_roi_cuda::c_entry(err, err_len, [&]() {
    mx_roi_cuda::roi_pooling_backward(
        dtype, (mx_roi_cuda::CUdeviceptr)grad, (mx_roi_cuda::CUdeviceptr)data,
        (mx_roi_cuda::CUdeviceptr)rois, (mx_roi_cuda::CUdeviceptr)in_grad,
        (mx_roi_cuda::CUdeviceptr)rois_grad, N, C, H, W, R, P, Q, spatial_scale,
        (mx_roi_cuda::CUdeviceptr)workspace, workspace_bytes, (mx_roi_cuda::CUstream)stream);
  });
}

}  // extern "C"
#endif  // MX_ROI_EXT_CUDA_LAUNCHER
