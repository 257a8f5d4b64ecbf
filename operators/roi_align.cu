// ROIAlign kernels (average and max over the bilinear samples of each bin).
// Table driven: the SampleGrid of mx_roi.geometry.roi_align_grid (or any legacy grid)
// gives every bin's sample count, taps and weights; see roi_common.cuh.
// Output and argmax are (R, C, P, Q); the max kernels' argmax is bin-relative, the winning
// sample iy*Gx+ix on the bin's padded Gy x Gx grid, stored as I (the smallest unsigned type
// holding Gy*Gx indices, mx_roi.cuda.tables.argmax_dtype), "no winner" as I's maximum
// value (mx_roi::index_store / index_load).
#include "roi_common.cuh"

#ifdef MX_ROI_HOST_NATIVE
// Native host build of the average forward: the thread's channel block channels-last
// (mx_roi::channels_last_block), each bin's samples taken once for a group of up to 64
// channels (LaneWalk::each_group_staged; mx_roi::SumLanes per 16-channel pass of the
// group: per lane the generic kernel's operations in its order), the bin's sums stored
// to its staged row ``o`` (the group's channel c at o[c]).  NP: the group's passes.
template <int NP, typename T, typename A>
__forceinline__ void roi_align_avg_bin_lanes(const A* img, int cc, int ncp, int W, int ny,
                                             int nx, long long yb, long long xb,
                                             const int* y_low, const int* y_high,
                                             const A* y_wl, const A* y_wh, const int* x_low,
                                             const int* x_high, const A* x_wl, const A* x_wh,
                                             A d, T* o) {
  const int L = mx_roi::LANES;
  // four named sums (an array of them is kept in memory)
  mx_roi::SumLanes<A> m0, m1, m2, m3;
  m0.zero();
  if (NP > 1) m1.zero();
  if (NP > 2) m2.zero();
  if (NP > 3) m3.zero();
  for (int iy = 0; iy < ny; ++iy) {
    for (int ix = 0; ix < nx; ++ix) {
      const mx_roi::Sample<A> s = mx_roi::sample_at(yb, xb, iy, ix, y_low, y_high, y_wl,
                                                    y_wh, x_low, x_high, x_wl, x_wh);
      const A* row_l = img + (size_t)s.yl * W * ncp + cc;
      const A* row_h = img + (size_t)s.yh * W * ncp + cc;
      const A *v1 = row_l + (size_t)s.xl * ncp, *v2 = row_l + (size_t)s.xh * ncp;
      const A *v3 = row_h + (size_t)s.xl * ncp, *v4 = row_h + (size_t)s.xh * ncp;
      m0.add(v1, v2, v3, v4, s.w1, s.w2, s.w3, s.w4);
      if (NP > 1) m1.add(v1 + L, v2 + L, v3 + L, v4 + L, s.w1, s.w2, s.w3, s.w4);
      if (NP > 2) m2.add(v1 + 2 * L, v2 + 2 * L, v3 + 2 * L, v4 + 2 * L, s.w1, s.w2, s.w3, s.w4);
      if (NP > 3) m3.add(v1 + 3 * L, v2 + 3 * L, v3 + 3 * L, v4 + 3 * L, s.w1, s.w2, s.w3, s.w4);
    }
  }
  // pass k's 16 lanes to its staged row (LaneWalk::each_group_staged)
  auto store = [&](mx_roi::SumLanes<A>& m, int k) {
    m.divide(d);
    mx_roi::store_lanes<T>(m, o + k * L);
  };
  store(m0, 0);
  if (NP > 1) store(m1, 1);
  if (NP > 2) store(m2, 2);
  if (NP > 3) store(m3, 3);
}

// Passes per group: 4 in the 8-wide (AVX) build, whose 16 vector registers hold the four
// passes' sums; 1 in the 4-wide build: with more, its sums spill and g++ swapped the
// operands of an add (legal, but a NaN of the data then lost to an invalid operation's
// NaN: a sign bit unlike the emulation's; so too when roi_align_avg_bin_lanes was not
// inlined).  tests/test_native.py's vector widths test compares both builds bit for bit,
// NaN cells included, with one to four passes per group.
const int AVG_GROUP = mx_roi::VW == 8 ? 4 : 1;
static_assert(AVG_GROUP <= mx_roi::PASS_ROWS_SLOTS, "a PassRows slot per pass of a group");

template <typename T, typename A>
void roi_align_forward_avg_native(const T* data, const int* batch, const int* y_count,
                                  const int* y_low, const int* y_high, const A* y_wl,
                                  const A* y_wh, const int* x_count, const int* x_low,
                                  const int* x_high, const A* x_wl, const A* x_wh,
                                  const A* divisor, int C, int H, int W, int P, int Q, int Gy,
                                  int Gx, T* out, long long n) {
  const mx_roi::LaneWalk<T, A> walk(data, batch, C, H, W, P, Q, n);
  const int ncp = walk.ncp;
  walk.template each_group_staged<AVG_GROUP>(batch, C, P, Q, out, (int*)nullptr, [&](
      long long r, int cc, int passes, int lanes, int p, int q, const A* img, T* o, int*) {
    if (!img) {  // skipped roi: 0
      for (int c = 0; c < lanes; ++c) o[c] = mx_roi::Traits<T>::store((A)0);
      return;
    }
    const int ny = y_count[r * P + p], nx = x_count[r * Q + q];
    const long long yb = (r * P + p) * (long long)Gy, xb = (r * Q + q) * (long long)Gx;
    const A d = divisor[(r * P + p) * Q + q];
#define MX_ROI_AVG_BIN(NP)                                                                   \
  roi_align_avg_bin_lanes<NP, T, A>(img, cc, ncp, W, ny, nx, yb, xb, y_low, y_high, y_wl,   \
                                    y_wh, x_low, x_high, x_wl, x_wh, d, o)
    switch (passes) {
      case 1: MX_ROI_AVG_BIN(1); break;
      case 2: MX_ROI_AVG_BIN(2); break;
      case 3: MX_ROI_AVG_BIN(3); break;
      default: MX_ROI_AVG_BIN(4); break;
    }
#undef MX_ROI_AVG_BIN
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

#ifdef MX_ROI_HOST_NATIVE
// Native host build of the average backward (float accumulation, O = A; the fixed-point
// O falls through to the generic loop): the calling thread's channel block accumulated
// channels-last, each sample's four taps added for 16 channels at a time (one vector
// step per tap instead of 16 scattered adds), then added to the gradient planes.  Per
// channel the same contributions g*w in the generic loop's order (roi, bin, sample, tap)
// onto a zero start, so the same bits.
// The backwards read a roi's samples (taps and weights of each sample of each bin) from
// the tables once per roi, as CellTaps kept while its channel passes run, when it has at
// most this many: the max backward's lanes would otherwise read and multiply them again
// per lane (16 lanes x 4 passes of a 64-channel call per sample), the average backward
// again per pass (only with more than one pass); larger grids read them directly.
// -DMX_ROI_ROI_SAMPLE_TABLE=... lowers it so that a test runs both paths on small problems.
#ifndef MX_ROI_ROI_SAMPLE_TABLE
#define MX_ROI_ROI_SAMPLE_TABLE (1 << 14)
#endif

// A sample's four taps as offsets into a channels-last block of ``ncp`` lanes per cell
// ((yl, xl), (yl, xh), (yh, xl), (yh, xh)) and their weights.
template <typename A>
struct CellTaps {
  long long o1, o2, o3, o4;
  A w1, w2, w3, w4;
  CellTaps() = default;
  CellTaps(const mx_roi::Sample<A>& s, int W, int ncp)
      : o1(((long long)s.yl * W + s.xl) * ncp), o2(((long long)s.yl * W + s.xh) * ncp),
        o3(((long long)s.yh * W + s.xl) * ncp), o4(((long long)s.yh * W + s.xh) * ncp),
        w1(s.w1), w2(s.w2), w3(s.w3), w4(s.w4) {}
};

// The CellTaps of every sample of roi r's bins on their padded Gy x Gx grids, at
// (p * Q + q) * Gy * Gx + iy * Gx + ix of ``rs`` (padding: no tap of weight > 0).
template <typename A>
void roi_cell_taps(CellTaps<A>* rs, long long r, int P, int Q, int Gy, int Gx, int W, int ncp,
                   const int* y_low, const int* y_high, const A* y_wl, const A* y_wh,
                   const int* x_low, const int* x_high, const A* x_wl, const A* x_wh) {
  for (int p = 0; p < P; ++p)
    for (int q = 0; q < Q; ++q) {
      const long long yb = (r * P + p) * (long long)Gy, xb = (r * Q + q) * (long long)Gx;
      CellTaps<A>* bs = rs + (p * Q + q) * (long long)Gy * Gx;
      for (int iy = 0; iy < Gy; ++iy)
        for (int ix = 0; ix < Gx; ++ix)
          *bs++ = CellTaps<A>(mx_roi::sample_at(yb, xb, iy, ix, y_low, y_high, y_wl, y_wh,
                                                x_low, x_high, x_wl, x_wh), W, ncp);
    }
}

template <typename T, typename A, typename O>
struct AvgBackwardLanes {
  template <typename... Args>
  static bool run(Args...) { return false; }
};

template <typename T, typename A>
struct AvgBackwardLanes<T, A, A> {
  static bool run(const T* grad, const int* batch, const int* y_count, const int* y_low,
                  const int* y_high, const A* y_wl, const A* y_wh, const int* x_count,
                  const int* x_low, const int* x_high, const A* x_wl, const A* x_wh,
                  const A* divisor, int C, int H, int W, int P, int Q, int Gy, int Gx,
                  A* bottom, long long n) {
    const int L = mx_roi::LANES, GL = AVG_GROUP * L, c0 = mx_roi_c_begin;
    const int nc = mx_roi_c_end - mx_roi_c_begin, ncp = mx_roi::padded_lanes(nc);
    const long long plane_out = (long long)P * Q;
    const long long R = C * plane_out > 0 ? n / (C * plane_out) : 0;
    if (R <= 0 || nc <= 0) return true;
    const mx_roi::GradBlock<A> block(batch, R, H, W);
    const long long K = (long long)Gy * Gx;
    const bool roi_table = ncp > GL && plane_out * K <= MX_ROI_ROI_SAMPLE_TABLE;
    static thread_local std::vector<CellTaps<A>> roi_samples;  // (p * Q + q) * K + k
    if (roi_table) roi_samples.resize((size_t)(plane_out * K));
    const Roi a{y_count, y_low, y_high, y_wl, y_wh, x_count, x_low, x_high, x_wl, x_wh,
                divisor, P, Q, Gy, Gx, W, ncp, roi_table ? roi_samples.data() : nullptr};
    for (long long r = 0; r < R; ++r) {
      if (batch[r] < 0) continue;
      A* img = block.image(batch[r]);
      if (roi_table)
        roi_cell_taps(a.rs, r, P, Q, Gy, Gx, W, ncp, y_low, y_high, y_wl, y_wh, x_low, x_high,
                      x_wl, x_wh);
      // a group of up to AVG_GROUP 16-channel passes over all the roi's bins touches the
      // same few cells again and again (they stay in L1); per channel the order is still
      // bin, sample, tap.  The group's passes add to their lanes of a cell side by side:
      // one pass alone made each tap's add wait for the previous add to the same cell
      // (store, reload), 2 vectors at a time.
      for (int cc = 0; cc < ncp; cc += GL) {
        const int left = (ncp - cc) / L, passes = left < AVG_GROUP ? left : AVG_GROUP;
        mx_roi::PassRows<T, A> rows[AVG_GROUP];
        for (int k = 0; k < passes; ++k) {
          const int ck = cc + k * L, lanes = nc - ck < L ? nc - ck : L;
          rows[k] = mx_roi::PassRows<T, A>(grad + (r * C + c0 + ck) * plane_out, plane_out,
                                           lanes, k);
        }
        switch (passes) {
          case 1: a.template passes<1>(r, img + cc, rows); break;
          case 2: a.template passes<2>(r, img + cc, rows); break;
          case 3: a.template passes<3>(r, img + cc, rows); break;
          default: a.template passes<4>(r, img + cc, rows); break;
        }
      }
    }
    block.add_to(bottom, C, H, W, 1.0);
    return true;
  }

  // One roi's tables, and its bins' walk for a group of NP passes
  struct Roi {
    const int *y_count, *y_low, *y_high;
    const A *y_wl, *y_wh;
    const int *x_count, *x_low, *x_high;
    const A *x_wl, *x_wh, *divisor;
    int P, Q, Gy, Gx, W, ncp;
    CellTaps<A>* rs;  // the roi's CellTaps, or null: the tables are read per sample

    // the bins of roi r for the NP passes whose lanes start at ``lane`` (the group's
    // first lane of cell 0) and whose out-grad rows are rows[0..NP)
    template <int NP>
    void passes(long long r, A* lane, mx_roi::PassRows<T, A>* rows) const {
      const int L = mx_roi::LANES;
      const long long K = (long long)Gy * Gx;
      A g[NP][16];
      // the group's lanes of one cell += g * w, pass by pass
      auto add = [&](A* cell, A w) {
        for (int k = 0; k < NP; ++k) add_lanes(cell + k * L, g[k], w);
      };
      for (int p = 0; p < P; ++p) {
        for (int q = 0; q < Q; ++q) {
          const int ny = y_count[r * P + p], nx = x_count[r * Q + q];
          const A d = divisor[(r * P + p) * Q + q];
          const long long o = p * Q + q;
          for (int k = 0; k < NP; ++k) {
            const A* const gk = rows[k].at(o);
            for (int c = 0; c < L; ++c) g[k][c] = gk[c] / d;  // (vectorised)
          }
          if (rs) {
            for (int iy = 0; iy < ny; ++iy) {
              const CellTaps<A>* t = rs + o * K + (long long)iy * Gx;
              for (int ix = 0; ix < nx; ++ix, ++t) {
                add(lane + t->o1, t->w1);
                add(lane + t->o2, t->w2);
                add(lane + t->o3, t->w3);
                add(lane + t->o4, t->w4);
              }
            }
            continue;
          }
          const long long yb = (r * P + p) * (long long)Gy, xb = (r * Q + q) * (long long)Gx;
          for (int iy = 0; iy < ny; ++iy) {
            for (int ix = 0; ix < nx; ++ix) {
              const mx_roi::Sample<A> s = mx_roi::sample_at(yb, xb, iy, ix, y_low, y_high,
                                                            y_wl, y_wh, x_low, x_high, x_wl,
                                                            x_wh);
              A* row_l = lane + (size_t)s.yl * W * ncp;
              A* row_h = lane + (size_t)s.yh * W * ncp;
              add(row_l + (size_t)s.xl * ncp, s.w1);
              add(row_l + (size_t)s.xh * ncp, s.w2);
              add(row_h + (size_t)s.xl * ncp, s.w3);
              add(row_h + (size_t)s.xh * ncp, s.w4);
            }
          }
        }
      }
    }
  };
  // dst[c] += g[c] * w for the 16 lanes (no contraction: a product, then a sum)
  static void add_lanes(A* dst, const A* g, A w) { mx_roi::AddLanes<A>::run(dst, g, w); }
};
#endif

template <typename T, typename A, typename O>
__global__ void roi_align_backward_avg(
    const T* __restrict__ grad, const int* __restrict__ batch, const int* __restrict__ y_count,
    const int* __restrict__ y_low, const int* __restrict__ y_high, const A* __restrict__ y_wl,
    const A* __restrict__ y_wh, const int* __restrict__ x_count, const int* __restrict__ x_low,
    const int* __restrict__ x_high, const A* __restrict__ x_wl, const A* __restrict__ x_wh,
    const A* __restrict__ divisor, int C, int H, int W, int P, int Q, int Gy, int Gx,
    O* __restrict__ bottom, double scale, long long n) {
#ifdef MX_ROI_HOST_NATIVE
  if (AvgBackwardLanes<T, A, O>::run(grad, batch, y_count, y_low, y_high, y_wl, y_wh, x_count,
                                     x_low, x_high, x_wl, x_wh, divisor, C, H, W, P, Q, Gy, Gx,
                                     bottom, n))
    return;
#endif
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
// whose samples none beat -FLT_MAX gives -FLT_MAX and argmax -1 (stored: I's maximum).
// The max scan of the samples of bin (r, p, q) (ny * nx > 0) of a plane: the best value
// in best (max_init() if nothing beat it) and the winner iy * Gx + ix, or -1.
template <typename T, typename A>
__device__ __forceinline__ int align_max_scan(const T* plane, int W, int ny, int nx,
                                              long long yb, long long xb, int Gx,
                                              const int* y_low, const int* y_high,
                                              const A* y_wl, const A* y_wh, const int* x_low,
                                              const int* x_high, const A* x_wl, const A* x_wh,
                                              A& best) {
  best = mx_roi::max_init<A>();
  int arg = -1;
  for (int iy = 0; iy < ny; ++iy) {
    for (int ix = 0; ix < nx; ++ix) {
      const mx_roi::Sample<A> s = mx_roi::sample_at(yb, xb, iy, ix, y_low, y_high, y_wl, y_wh,
                                                    x_low, x_high, x_wl, x_wh);
      // a point outside the map is 0 whatever the (weight-0) taps it names hold
      mx_roi::max_step(s.outside ? (A)0 : mx_roi::sample_value(plane, W, s), best,
                       iy * Gx + ix, arg);
    }
  }
  return arg;
}

#ifdef MX_ROI_HOST_NATIVE
// Native: align_max_scan for 16 channels -- lane pass cc of a channels-last image, ncp
// lanes per cell -- each sample's value for the 16 lanes at once (mx_roi::InterpLanes:
// per lane sample_value's operations in its order) scanned by m (mx_roi::MaxLanes: strict
// '>', first maximum wins, NaN never): per lane the generic scan's result and winner.
template <typename A>
inline void scan_samples_lanes(mx_roi::MaxLanes<A>& m, const A* img, int cc, int ncp, int W,
                               int ny, int nx, long long yb, long long xb, int Gx,
                               const int* y_low, const int* y_high, const A* y_wl,
                               const A* y_wh, const int* x_low, const int* x_high,
                               const A* x_wl, const A* x_wh) {
  m.init();
  A v[16];
  for (int iy = 0; iy < ny; ++iy) {
    for (int ix = 0; ix < nx; ++ix) {
      const mx_roi::Sample<A> s = mx_roi::sample_at(yb, xb, iy, ix, y_low, y_high, y_wl, y_wh,
                                                    x_low, x_high, x_wl, x_wh);
      if (s.outside) {  // a point outside the map is 0 (its weight-0 taps are not read)
        for (int c = 0; c < 16; ++c) v[c] = (A)0;
      } else {
        const A* row_l = img + (size_t)s.yl * W * ncp + cc;
        const A* row_h = img + (size_t)s.yh * W * ncp + cc;
        mx_roi::InterpLanes<A>::run(v, row_l + (size_t)s.xl * ncp, row_l + (size_t)s.xh * ncp,
                                    row_h + (size_t)s.xl * ncp, row_h + (size_t)s.xh * ncp,
                                    s.w1, s.w2, s.w3, s.w4);
      }
      m.step(v, iy * Gx + ix);
    }
  }
}

// Native host build of the max forward: the thread's channel block channels-last, every
// bin scanned for 16 channels at a time (scan_samples_lanes) -- per lane the generic
// kernel's result and argmax.
template <typename T, typename A, typename I>
void roi_align_forward_max_native(const T* data, const int* batch, const int* y_count,
                                  const int* y_low, const int* y_high, const A* y_wl,
                                  const A* y_wh, const int* x_count, const int* x_low,
                                  const int* x_high, const A* x_wl, const A* x_wh, int C, int H,
                                  int W, int P, int Q, int Gy, int Gx, T* out, I* argmax,
                                  int store_argmax, long long n) {
  const mx_roi::LaneWalk<T, A> walk(data, batch, C, H, W, P, Q, n);
  const long long plane_out = walk.plane_out;
  const int ncp = walk.ncp;
  // the output staged, the argmax stored directly (none kept for inference)
  walk.each_pass_staged(batch, C, P, Q, out, store_argmax ? argmax : nullptr, [&](
      long long r, int cc, int lanes, int p, int q, const A* img, T* o, I* a) {
    const int ny = img ? y_count[r * P + p] : 0, nx = img ? x_count[r * Q + q] : 0;
    if (ny <= 0 || nx <= 0) {  // a skipped roi or a bin without samples: 0, no winner
      for (int c = 0; c < lanes; ++c) {
        o[c] = mx_roi::Traits<T>::store((A)0);
        if (a) a[c * plane_out] = mx_roi::index_store<I>(-1);
      }
      return;
    }
    mx_roi::MaxLanes<A> m;
    scan_samples_lanes(m, img, cc, ncp, W, ny, nx, (r * P + p) * (long long)Gy,
                       (r * Q + q) * (long long)Gx, Gx, y_low, y_high, y_wl, y_wh, x_low,
                       x_high, x_wl, x_wh);
    mx_roi::store_lanes<T>(m, o);
    if (a)
      for (int c = 0; c < lanes; ++c) a[c * plane_out] = m.template index<I>(c);
  });
}
#endif

template <typename T, typename A, typename I>
__global__ void roi_align_forward_max(
    const T* __restrict__ data, const int* __restrict__ batch, const int* __restrict__ y_count,
    const int* __restrict__ y_low, const int* __restrict__ y_high, const A* __restrict__ y_wl,
    const A* __restrict__ y_wh, const int* __restrict__ x_count, const int* __restrict__ x_low,
    const int* __restrict__ x_high, const A* __restrict__ x_wl, const A* __restrict__ x_wh,
    int C, int H, int W, int P, int Q, int Gy, int Gx, T* __restrict__ out,
    I* __restrict__ argmax, int store_argmax, long long n) {
#ifdef MX_ROI_HOST_NATIVE
  roi_align_forward_max_native<T, A, I>(data, batch, y_count, y_low, y_high, y_wl, y_wh,
                                        x_count, x_low, x_high, x_wl, x_wh, C, H, W, P, Q, Gy,
                                        Gx, out, argmax, store_argmax, n);
  return;
#endif
  MX_ROI_ITEM_LOOP(it, n, C, P, Q, false) {
    const int b = batch[it.r];
    A best = 0;
    int arg = -1;
    const int ny = y_count[it.r * P + it.p], nx = x_count[it.r * Q + it.q];
    if (b >= 0 && ny > 0 && nx > 0)
      arg = align_max_scan(data + mx_roi::plane_offset(b, it.c, C, H, W), W, ny, nx,
                           (it.r * P + it.p) * (long long)Gy, (it.r * Q + it.q) * (long long)Gx,
                           Gx, y_low, y_high, y_wl, y_wh, x_low, x_high, x_wl, x_wh, best);
    out[it.i] = mx_roi::Traits<T>::store(best);
    if (store_argmax) argmax[it.i] = mx_roi::index_store<I>(arg);  // 0: inference
  }
}

#ifdef MX_ROI_HOST_NATIVE
// Native host build of the max backwards (float accumulation, O = A): like the average
// backward, the thread's channel block accumulated channels-last roi by roi, 16 channels
// per pass (each lane's winner names its own four taps: scalar adds into cells a pass
// keeps in L1, instead of into 16 gradient planes), then added to the gradient planes.
// Per channel the generic loop's contributions g*w (all four taps, weight 0 included) in
// its order (roi, bin) onto a zero start: the same bits.  The winners of a pass's bin come
// from ``winners(r, cc, lanes, p, q, win)`` (win[c]: iy * Gx + ix, or -1): the kept argmax,
// or the rescan of the data.
// (bins of more samples are left to the generic loop, which divides instead of decoding)
const long long MAX_LANES_SAMPLES = 1 << 16;
// With at most MX_ROI_MAX_VEC_SAMPLES (<= 64) samples per bin, a pass's bin is added as
// whole vectors (WinnerLanes): per winning sample its lanes' gradients (the other lanes
// 0) times each tap's weight added to the 16 lanes at the tap, instead of four scalar
// adds per lane -- 16 lanes name at most 16 winners, a 4-sample bin usually all 4 (small
// max ROIAlign backward kernel 0.45 -> 0.21 ms at sample_ratio=1, 0.60 -> 0.47 at 2).
// A lane gets the products of its own winner's taps in tap order, as the scalar walk
// gives them, and +0 elsewhere: a cell of the block is never -0 (a zero start, and a sum
// that rounds to zero is +0) and x + 0 is x, NaN and inf included -- the same bits.
// -DMX_ROI_MAX_VEC_SAMPLES=0 keeps the scalar walk (the tests compare the two).
#ifndef MX_ROI_MAX_VEC_SAMPLES
#define MX_ROI_MAX_VEC_SAMPLES 64
#endif

// The vector form of a pass's bin (MX_ROI_MAX_VEC_SAMPLES): for each winning sample a in
// ``present``, the lanes it won (win[c] == a) take their gradient g[c], the others 0
// (select), and the 16 lanes at each of its taps get that times the tap's weight
// (AddLanes: the product, then the sum).
template <typename A>
struct WinnerLanes {
  static void select(A* gk, const A* g, const int* win, int a) {
    for (int c = 0; c < 16; ++c) gk[c] = win[c] == a ? g[c] : (A)0;
  }
  template <typename Taps>
  static void add(A* lane, const A* g, const int* win, unsigned long long present,
                  Taps&& taps_of) {
    A gk[16];
    for (; present; present &= present - 1) {
      const int a = __builtin_ctzll(present);
      select(gk, g, win, a);
      const CellTaps<A> t = taps_of(a);
      mx_roi::AddLanes<A>::run(lane + t.o1, gk, t.w1);
      mx_roi::AddLanes<A>::run(lane + t.o2, gk, t.w2);
      mx_roi::AddLanes<A>::run(lane + t.o3, gk, t.w3);
      mx_roi::AddLanes<A>::run(lane + t.o4, gk, t.w4);
    }
  }
};

// float: the selection as VN vector compares (g++ leaves the scalar form a loop of
// branches: the max backward 2x slower)
template <>
inline void WinnerLanes<float>::select(float* gk, const float* g, const int* win, int a) {
  const mx_roi::vi av = mx_roi::vi{} + a;
  for (int i = 0; i < mx_roi::VN; ++i) {
    mx_roi::vf gv;
    mx_roi::vi wv;
    memcpy(&gv, g + mx_roi::VW * i, sizeof gv);
    memcpy(&wv, win + mx_roi::VW * i, sizeof wv);
    const mx_roi::vf r = wv == av ? gv : mx_roi::vf{};
    memcpy(gk + mx_roi::VW * i, &r, sizeof r);
  }
}

template <typename T, typename A, typename O>
struct MaxBackwardLanes {
  template <typename... Args>
  static bool run(Args...) { return false; }
};

template <typename T, typename A>
struct MaxBackwardLanes<T, A, A> {
  template <typename Winners>
  static bool run(const T* grad, const int* batch, const int* y_low, const int* y_high,
                  const A* y_wl, const A* y_wh, const int* x_low, const int* x_high,
                  const A* x_wl, const A* x_wh, int C, int H, int W, int P, int Q, int Gy,
                  int Gx, A* bottom, long long n, Winners&& winners) {
    const int L = mx_roi::LANES, c0 = mx_roi_c_begin, nc = mx_roi_c_end - mx_roi_c_begin;
    const int ncp = mx_roi::padded_lanes(nc);
    const long long plane_out = (long long)P * Q;
    const long long R = C * plane_out > 0 ? n / (C * plane_out) : 0;
    const long long K = (long long)Gy * Gx;
    if (K > MAX_LANES_SAMPLES) return false;
    if (R <= 0 || nc <= 0) return true;
    const mx_roi::GradBlock<A> block(batch, R, H, W);
    static thread_local std::vector<int> decode;  // k -> (k / Gx, k % Gx)
    decode.resize(2 * K);
    for (long long k = 0; k < K; ++k) {
      decode[2 * k] = (int)(k / Gx);
      decode[2 * k + 1] = (int)(k % Gx);
    }
    // (a plain pointer: a thread_local read in the loop costs a call per access)
    const int* const kd = decode.data();
    const bool roi_table = plane_out * K <= MX_ROI_ROI_SAMPLE_TABLE;
    // (p * Q + q) * K + k: the sample's four taps as offsets in the channels-last block
    static thread_local std::vector<CellTaps<A>> roi_samples;
    if (roi_table) roi_samples.resize((size_t)(plane_out * K));
    CellTaps<A>* const rs = roi_samples.data();
    int win[16];
    for (long long r = 0; r < R; ++r) {
      if (batch[r] < 0) continue;
      A* img = block.image(batch[r]);
      if (roi_table)
        roi_cell_taps(rs, r, P, Q, Gy, Gx, W, ncp, y_low, y_high, y_wl, y_wh, x_low, x_high,
                      x_wl, x_wh);
      for (int cc = 0; cc < ncp; cc += L) {
        const int lanes = nc - cc < L ? nc - cc : L;
        const long long o0 = (r * C + c0 + cc) * plane_out;
        for (int p = 0; p < P; ++p) {
          for (int q = 0; q < Q; ++q) {
            const long long yb = (r * P + p) * (long long)Gy, xb = (r * Q + q) * (long long)Gx;
            const long long o = o0 + p * Q + q;
            winners(r, cc, lanes, p, q, win);
            const CellTaps<A>* const bs = roi_table ? rs + (p * Q + q) * K : nullptr;
            // the sample's taps, from the roi's table or worked out
            auto taps_of = [&](int a) {
              return roi_table ? bs[a]
                               : CellTaps<A>(mx_roi::sample_at(yb, xb, kd[2 * a], kd[2 * a + 1],
                                                               y_low, y_high, y_wl, y_wh, x_low,
                                                               x_high, x_wl, x_wh),
                                             W, ncp);
            };
            if (K <= MX_ROI_MAX_VEC_SAMPLES && K <= 64) {
              unsigned long long present = 0;  // the winning samples
              A g[16];
              for (int c = 0; c < L; ++c) {
                if (c >= lanes) win[c] = -1;
                if (win[c] < 0) {
                  g[c] = 0;
                  continue;
                }
                present |= 1ull << win[c];
                g[c] = (A)mx_roi::Traits<T>::load(grad[o + c * plane_out]);
              }
              WinnerLanes<A>::add(img + cc, g, win, present, taps_of);
              continue;
            }
            for (int c = 0; c < lanes; ++c) {
              const int a = win[c];
              if (a < 0) continue;
              const A g = (A)mx_roi::Traits<T>::load(grad[o + c * plane_out]);
              const CellTaps<A> t = taps_of(a);
              A* const lane = img + cc + c;
              lane[t.o1] += g * t.w1;
              lane[t.o2] += g * t.w2;
              lane[t.o3] += g * t.w3;
              lane[t.o4] += g * t.w4;
            }
          }
        }
      }
    }
    block.add_to(bottom, C, H, W, 1.0);
    return true;
  }
};
#endif

// The whole gradient of a bin goes to the four taps of its winning sample.
template <typename T, typename A, typename O, typename I>
__global__ void roi_align_backward_max(
    const T* __restrict__ grad, const int* __restrict__ batch, const int* __restrict__ y_low,
    const int* __restrict__ y_high, const A* __restrict__ y_wl, const A* __restrict__ y_wh,
    const int* __restrict__ x_low, const int* __restrict__ x_high, const A* __restrict__ x_wl,
    const A* __restrict__ x_wh, const I* __restrict__ argmax, int C, int H, int W, int P,
    int Q, int Gy, int Gx, O* __restrict__ bottom, double scale, long long n) {
#ifdef MX_ROI_HOST_NATIVE
  const long long plane_out = (long long)P * Q;
  if (MaxBackwardLanes<T, A, O>::run(
          grad, batch, y_low, y_high, y_wl, y_wh, x_low, x_high, x_wl, x_wh, C, H, W, P, Q, Gy,
          Gx, bottom, n, [&](long long r, int cc, int lanes, int p, int q, int* win) {
            const I* a = argmax + (r * C + mx_roi_c_begin + cc) * plane_out + p * Q + q;
            for (int c = 0; c < lanes; ++c) win[c] = mx_roi::index_load(a[c * plane_out]);
          }))
    return;
  // (the lanes walk declines bins of more than 2^16 points: the loop below divides)
#endif
  MX_ROI_ITEM_LOOP(it, n, C, P, Q, false) {
    const int a = mx_roi::index_load(argmax[it.i]);
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

// The backward of a training forward that kept no argmax: each bin's winning sample found
// again by the forward's scan of the data (same first maximum, same NaN rule), the bin's
// gradient added to its four taps as by roi_align_backward_max.
template <typename T, typename A, typename O>
__global__ void roi_align_backward_max_rescan(
    const T* __restrict__ data, const T* __restrict__ grad, const int* __restrict__ batch,
    const int* __restrict__ y_count, const int* __restrict__ y_low,
    const int* __restrict__ y_high, const A* __restrict__ y_wl, const A* __restrict__ y_wh,
    const int* __restrict__ x_count, const int* __restrict__ x_low,
    const int* __restrict__ x_high, const A* __restrict__ x_wl, const A* __restrict__ x_wh,
    int C, int H, int W, int P, int Q, int Gy, int Gx, O* __restrict__ bottom, double scale,
    long long n) {
#ifdef MX_ROI_HOST_NATIVE
  // the forward's walk (the thread's channel block of the data channels-last) rescans a
  // pass's bin for 16 channels at once; bins the lanes walk declines skip the copy
  if ((long long)Gy * Gx <= MAX_LANES_SAMPLES) {
    const mx_roi::LaneWalk<T, A> walk(data, batch, C, H, W, P, Q, n);
    if (MaxBackwardLanes<T, A, O>::run(
            grad, batch, y_low, y_high, y_wl, y_wh, x_low, x_high, x_wl, x_wh, C, H, W, P, Q,
            Gy, Gx, bottom, n, [&](long long r, int cc, int lanes, int p, int q, int* win) {
              const int ny = y_count[r * P + p], nx = x_count[r * Q + q];
              mx_roi::MaxLanes<A> m;
              if (ny > 0 && nx > 0) {
                scan_samples_lanes(m, walk.image(batch[r]), cc, walk.ncp, W, ny, nx,
                                   (r * P + p) * (long long)Gy, (r * Q + q) * (long long)Gx,
                                   Gx, y_low, y_high, y_wl, y_wh, x_low, x_high, x_wl, x_wh);
                for (int c = 0; c < lanes; ++c) win[c] = m.template index<int>(c);
              } else {
                for (int c = 0; c < lanes; ++c) win[c] = -1;
              }
            }))
      return;
  }
#endif
  MX_ROI_ITEM_LOOP(it, n, C, P, Q, false) {
    const int b = batch[it.r];
    const int ny = y_count[it.r * P + it.p], nx = x_count[it.r * Q + it.q];
    if (b < 0 || ny <= 0 || nx <= 0) continue;
    const long long yb = (it.r * P + it.p) * (long long)Gy;
    const long long xb = (it.r * Q + it.q) * (long long)Gx;
    const long long plane = mx_roi::plane_offset(b, it.c, C, H, W);
    A best;
    const int a = align_max_scan(data + plane, W, ny, nx, yb, xb, Gx, y_low, y_high, y_wl, y_wh,
                                 x_low, x_high, x_wl, x_wh, best);
    if (a < 0) continue;
    mx_roi::sample_backward(bottom + plane, W,
                            mx_roi::sample_at(yb, xb, a / Gx, a % Gx, y_low, y_high, y_wl,
                                              y_wh, x_low, x_high, x_wl, x_wh),
                            (A)mx_roi::Traits<T>::load(grad[it.i]), scale);
  }
}

#ifdef MX_ROI_EXT_LAUNCHER
// ==== mx_roi_ROIAlign: this op in mx_roi's MXNet extension library (mx_roi.ext) ===========
// Compiled only into that library (g++ with -DMX_ROI_EXT_LAUNCHER, the host shim in native
// mode): the GPU, emulated and native builds never see this section.  Parameters as
// mx.nd.contrib.ROIAlign's and ROIAlignParam's (parsed as mx_roi/params.py parses them, with
// its messages); the host launcher runs what forward_cuda / backward_cuda launch: the
// device geometry and its roi check, then this file's kernels (forward: avg or max; backward: avg,
// or max found again in the data, the *_rescan kernel).
#include "ext_launch.h"

namespace mx_roi_op {

struct ROIAlignOp {
  static constexpr const char* OP = "ROIAlign";

  struct Params {
    long long P = 0, Q = 0;
    double spatial_scale = 0;
    long long sample_ratio = -1;
    bool aligned = false, deterministic = false;
    std::string pool_mode = "avg", legacy = "";
    bool is_max() const { return pool_mode == "max" || legacy == "caffe"; }
    bool caffe() const { return legacy == "caffe"; }
  };

  // ROIAlignParam.from_kwargs (plus contrib.ROIAlign's position_sensitive, api.py's rule)
  static Params parse(const std::unordered_map<std::string, std::string>& attrs) {
    const auto ps = attrs.find("position_sensitive");
    if (ps != attrs.end() && ps->second != "False" && ps->second != "false" && ps->second != "0")
      throw OpError(std::string(OP) + ": parameter 'position_sensitive': use PSROIAlign (with "
                    "output_dim) instead of ROIAlign(position_sensitive=True)");
    Kwargs kw(OP, attrs, {"pooled_size", "spatial_scale", "sample_ratio", "aligned",
                          "pool_mode", "deterministic", "legacy"},
              {"pooled_size", "spatial_scale"}, {"position_sensitive"});
    Params p;
    std::tie(p.P, p.Q) = kw.size2("pooled_size");
    p.spatial_scale = kw.real("spatial_scale", 0);
    p.sample_ratio = kw.integer("sample_ratio", -1);
    p.aligned = kw.boolean("aligned", false);
    p.pool_mode = kw.choice("pool_mode", "avg", {"avg", "max"});
    p.deterministic = kw.boolean("deterministic", false);
    p.legacy = kw.legacy("legacy", {"caffe"});
    kw.finish();
    // ParamBase.__post_init__: positive, then bounds in field order; then ROIAlignParam's
    // samples per axis (not for the Caffe grid, which ignores sample_ratio)
    check_pooled(kw, p.P, p.Q, p.spatial_scale);
    check_adaptive_samples(kw, "sample_ratio", p.sample_ratio);
    const std::string ratio = py_int_repr(p.sample_ratio);
    if (!p.caffe()) {
      const long long most = MAX_SAMPLES_PER_AXIS_PARAM / (p.P > p.Q ? p.P : p.Q);
      kw.check("sample_ratio", p.sample_ratio <= most,
               "at most " + std::to_string(most) + " with pooled_size " +
                   py_pair_repr(p.P, p.Q) + " (" +
                   std::to_string(MAX_SAMPLES_PER_AXIS_PARAM) + " sample points along an axis)",
               ratio);
    }
    return p;
  }

  // ROIAlignParam.to_kwargs, "name=value;..." (the tests compare it with params.py)
  static std::string format(const std::unordered_map<std::string, std::string>& attrs) {
    const Params p = parse(attrs);
    return "pooled_size=" + py_pair_repr(p.P, p.Q) +
           ";spatial_scale=" + py_float_repr(p.spatial_scale) +
           ";sample_ratio=" + std::to_string(p.sample_ratio) +
           ";aligned=" + (p.aligned ? "True" : "False") + ";pool_mode=" + p.pool_mode +
           ";deterministic=" + (p.deterministic ? "True" : "False") + ";legacy=" + p.legacy;
  }

  static long long out_channels(const Params&, long long C) { return C; }

  // the geometry of the call (Spec: the Caffe grid takes neither sample nor aligned)
  template <typename T, typename A>
  static Grid<A> geometry(const Params& p, const MXTensor& data, const MXTensor& rois) {
    if (!p.caffe() && p.sample_ratio <= 0)
      check_adaptive_grid<T, A>(OP, p.P, p.Q, p.spatial_scale, (const T*)rois.data_ptr,
                                rois.shape[0], data.shape[0]);
    return grid_geometry<T, A>(OP, p.caffe() ? MODE_CAFFE_GRID : MODE_ALIGN_GRID, (int)p.P,
                               (int)p.Q, (int)data.shape[2], (int)data.shape[3],
                               p.caffe() ? 0 : (int)p.sample_ratio, p.caffe() ? 0 : p.aligned,
                               (float)p.spatial_scale, (const T*)rois.data_ptr,
                               rois.shape[0], data.shape[0]);
  }

  template <typename T, typename A>
  static void forward(const Params& p, const Call<ROIAlignOp, T, A>& c,
                      const MXTensor& data, MXTensor& out) {
    const Grid<A>& g = c.g;
    const T* x = (const T*)data.data_ptr;
    T* y = (T*)out.data_ptr;
    if (p.is_max()) {
      unsigned char no_argmax = 0;  // (store_argmax 0: the backward rescans the data)
      c.launch([&]() {
        roi_align_forward_max<T, A, unsigned char>(
            x, g.batch, g.y_count, g.y_low, g.y_high, g.y_wl, g.y_wh, g.x_count, g.x_low,
            g.x_high, g.x_wl, g.x_wh, c.C, c.H, c.W, c.P, c.Q, g.Gy, g.Gx, y, &no_argmax, 0,
            c.n);
      });
    } else {
      c.launch([&]() {
        roi_align_forward_avg<T, A>(x, g.batch, g.y_count, g.y_low, g.y_high, g.y_wl, g.y_wh,
                                    g.x_count, g.x_low, g.x_high, g.x_wl, g.x_wh, g.divisor,
                                    c.C, c.H, c.W, c.P, c.Q, g.Gy, g.Gx, y, c.n);
      });
    }
  }

  template <typename T, typename A>
  static void backward(const Params& p, const Call<ROIAlignOp, T, A>& c,
                       const MXTensor& grad, const MXTensor& data, A* bottom) {
    const Grid<A>& g = c.g;
    const T* dy = (const T*)grad.data_ptr;
    if (p.is_max()) {
      c.launch([&]() {
        roi_align_backward_max_rescan<T, A, A>(
            (const T*)data.data_ptr, dy, g.batch, g.y_count, g.y_low, g.y_high, g.y_wl,
            g.y_wh, g.x_count, g.x_low, g.x_high, g.x_wl, g.x_wh, c.C, c.H, c.W, c.P, c.Q,
            g.Gy, g.Gx, bottom, 1.0, c.n);
      });
    } else {
      c.launch([&]() {
        roi_align_backward_avg<T, A, A>(dy, g.batch, g.y_count, g.y_low, g.y_high, g.y_wl,
                                        g.y_wh, g.x_count, g.x_low, g.x_high, g.x_wl, g.x_wh,
                                        g.divisor, c.C, c.H, c.W, c.P, c.Q, g.Gy, g.Gx, bottom,
                                        1.0, c.n);
      });
    }
  }
};

const RegisterParams roi_align_params("ROIAlign", ROIAlignOp::format);

// ---- the native GPU path (opt-in; docs/gpu.md): the forward and the backward through
// mx_roi.ext.cuda's launcher (ext_cuda.h: driver API, NVRTC's PTX of this file) on MXNet's
// stream, their tables in MXNet's temporary workspace; no host wait.
struct ROIAlignGpu {
  typedef ROIAlignOp Op;
  typedef int (*Workspace)(int, long long, int, int, int, int, int, int, unsigned long long*,
                           char*, size_t);
  typedef int (*BackwardWorkspace)(int, long long, long long, long long, long long, long long,
                                   int, int, int, int, unsigned long long*, char*, size_t);
  typedef int (*Forward)(int, const void*, const void*, void*, long long, long long, long long,
                         long long, long long, int, int, float, int, int, int, int, void*,
                         unsigned long long, void*, char*, size_t);
  typedef int (*Backward)(int, const void*, const void*, const void*, void*, void*, long long,
                          long long, long long, long long, long long, int, int, float, int,
                          int, int, int, void*, unsigned long long, void*, char*, size_t);
  static constexpr const char* OP = ROIAlignOp::OP;

  // the call's device memory (tables; a float16 backward's accumulator) in MXNet's
  // temporary workspace (null: none needed)
  static void* tables(const ROIAlignOp::Params& p, const MXTensor& data, long long R,
                      bool backward, const OpResource& res, unsigned long long* bytes) {
    char err[4096] = "";
    const int sample = p.caffe() ? 0 : (int)p.sample_ratio, caffe = p.caffe() ? 1 : 0;
    gpu_call(backward ? gpu_entry<BackwardWorkspace>(
                            OP, "mx_roi_ext_cuda_roi_align_backward_workspace")(
                            data.dtype, data.shape[0], data.shape[1], data.shape[2],
                            data.shape[3], R, (int)p.P, (int)p.Q, sample, caffe, bytes, err,
                            sizeof err)
                      : gpu_entry<Workspace>(OP, "mx_roi_ext_cuda_roi_align_workspace")(
                            data.dtype, R, (int)p.P, (int)p.Q, (int)data.shape[2],
                            (int)data.shape[3], sample, caffe, bytes, err, sizeof err),
             err);
    return gpu_workspace(OP, res, *bytes);
  }

  static int forward(const ROIAlignOp::Params& p, const MXTensor& data, const MXTensor& rois,
                     MXTensor& out, void* ws, unsigned long long bytes, void* stream, char* err,
                     size_t len) {
    return gpu_entry<Forward>(OP, "mx_roi_ext_cuda_roi_align_forward")(
        data.dtype, data.data_ptr, rois.data_ptr, out.data_ptr, data.shape[0], data.shape[1],
        data.shape[2], data.shape[3], rois.shape[0], (int)p.P, (int)p.Q,
        (float)p.spatial_scale, p.caffe() ? 0 : (int)p.sample_ratio, p.aligned ? 1 : 0,
        p.pool_mode == "max", p.caffe() ? 1 : 0, ws, bytes, stream, err, len);
  }

  static int backward(const ROIAlignOp::Params& p, const MXTensor& grad, const MXTensor& data,
                      const MXTensor& rois, MXTensor& in_grad, MXTensor& rois_grad, void* ws,
                      unsigned long long bytes, void* stream, char* err, size_t len) {
    return gpu_entry<Backward>(OP, "mx_roi_ext_cuda_roi_align_backward")(
        data.dtype, grad.data_ptr, data.data_ptr, rois.data_ptr, in_grad.data_ptr,
        rois_grad.data_ptr, data.shape[0], data.shape[1], data.shape[2], data.shape[3],
        rois.shape[0], (int)p.P, (int)p.Q, (float)p.spatial_scale,
        p.caffe() ? 0 : (int)p.sample_ratio, p.aligned ? 1 : 0, p.pool_mode == "max",
        p.caffe() ? 1 : 0, ws, bytes, stream, err, len);
  }
};

}  // namespace mx_roi_op

MX_ROI_EXT_REGISTER(mx_roi_ROIAlign, mx_roi_op::ROIAlignOp)
    .setForward(mx_roi_op::GpuCallbacks<mx_roi_op::ROIAlignGpu>::forward, "gpu")
    .setBackward(mx_roi_op::GpuCallbacks<mx_roi_op::ROIAlignGpu>::backward, "gpu");
#endif  // MX_ROI_EXT_LAUNCHER

#ifdef MX_ROI_EXT_CUDA_LAUNCHER
// ==== this op on the native GPU path (opt-in; docs/gpu.md) ===============================
// Compiled only into mx_roi.ext.cuda's launcher library (gathered from here into
// ext_cuda_sections.h, after ext_cuda_ops.cc's shared part; NVRTC and the host builds never
// see it): the driver-API launch of this file's kernels (roi_align.py's native_gpu_kernels,
// NVRTC's PTX in ROI_ALIGN_IMAGE) as forward_cuda / backward_cuda run them, and the C
// entries that the extension op's "gpu" callbacks above and mx_roi.ext.cuda's wrappers call.
namespace mx_roi_cuda {

// ROIAlign's grid: the Caffe grid for legacy 'caffe' (no sample count, not aligned)
inline int roi_align_mode(int caffe) { return caffe ? MODE_CAFFE_GRID : MODE_ALIGN_GRID; }

// A ROIAlign call's sample grid (both directions; SampleGrid), checked against the max
// kernels' running argmax.
struct RoiAlignGrid : SampleGrid {
  bool is_max;

  RoiAlignGrid(const std::string& op, int dtype, long long R, int P, int Q, long long H,
               long long W, int sample_ratio, int aligned, int pool_max, int caffe,
               CUdeviceptr workspace)
      : SampleGrid(op, dtype, roi_align_mode(caffe), R, P, Q, H, W, caffe ? 0 : sample_ratio,
                   caffe ? 0 : (aligned ? 1 : 0), workspace),
        is_max(pool_max || caffe) {
    if (is_max && (long long)g.Gy * g.Gx >= (1LL << 31))  // the running argmax is an int
      throw Error(op + ": " + std::to_string(g.Gy) + "x" + std::to_string(g.Gx) +
                  " sample points per bin are too many for pool_mode='max' on the CUDA "
                  "backend");
  }
};

// ROIAlign's forward (roi_align.py forward_cuda, on tables from device_geometry.build):
// the geometry kernel, then roi_align_forward_avg or roi_align_forward_max (pool_mode
// 'max' or legacy 'caffe'; no argmax kept: store_argmax 0), on ``stream``.
inline void roi_align_forward(int dtype, CUdeviceptr data, CUdeviceptr rois, CUdeviceptr out,
                              long long N, long long C, long long H, long long W, long long R,
                              int P, int Q, float spatial_scale, int sample_ratio, int aligned,
                              int pool_max, int caffe, CUdeviceptr workspace,
                              unsigned long long workspace_bytes, CUstream stream) {
  const CallScope call("ROIAlign", dtype, stream);
  call.report();
  if (R <= 0) return;  // no roi: nothing to launch (the output is empty)
  const RoiAlignGrid grid(call.op, dtype, R, P, Q, H, W, sample_ratio, aligned, pool_max,
                          caffe, workspace);
  if (workspace_bytes < grid.g.bytes)
    throw Error(call.op + ": the workspace holds " + std::to_string(workspace_bytes) +
                " bytes but the call's tables need " + std::to_string(grid.g.bytes));
  grid.geometry(call, ROI_ALIGN_IMAGE, rois, N, H, W, R, P, Q, spatial_scale);
  const long long n = R * C * P * Q;
  Args k;
  k(data);
  grid.tables(k, !grid.is_max);  // batch .. x_wh, the divisor for avg
  k((int)C)((int)H)((int)W)(P)(Q)(grid.g.Gy)(grid.g.Gx)(out);
  if (grid.is_max) k(workspace)(0);            // argmax (never written: store_argmax 0)
  k(n);
  call.run(ROI_ALIGN_IMAGE,
           grid.is_max ? "roi_align_forward_max" + call.ta() + ", unsigned char>"
                       : "roi_align_forward_avg" + call.ta() + ">",
           n, k);
  call.record();
}

// A ROIAlign backward's workspace: the tables (as the forward's), then for float16 the
// float32 accumulator (with_accumulator); 0 for R = 0.  ``*acc_offset``: where that starts.
inline unsigned long long roi_align_backward_bytes(int dtype, long long N, long long C,
                                                   long long H, long long W, long long R, int P,
                                                   int Q, int sample_ratio, int caffe,
                                                   unsigned long long* acc_offset = nullptr) {
  if (R <= 0) return 0;
  const GridLayout g = sample_layout("ROIAlign", dtype, roi_align_mode(caffe), R, P, Q, H, W,
                                     caffe ? 0 : sample_ratio);
  if (acc_offset) *acc_offset = g.bytes;  // (a multiple of 16)
  return with_accumulator(g.bytes, dtype, N * C * H * W);
}

// ROIAlign's backward (roi_align.py backward_cuda on device-built tables, as the CuPy path's
// _backward_device runs it with req write): the gradients zeroed (GradTarget), the geometry
// kernel, then roi_align_backward_avg or, for pool_mode 'max' / legacy 'caffe',
// roi_align_backward_max_rescan (the forward kept no argmax: the winners are found again
// in ``data``), then for float16 the accumulator's store; all on ``stream``.
// A bad roi raises nothing here: the geometry kernel treats it as padding and marks the
// status word, and the next forward on this stream (or check()) reports it -- a backward
// must succeed (MXNet runs it even after its forward failed).  Earlier calls' status is
// left for that report too.
inline void roi_align_backward(int dtype, CUdeviceptr grad, CUdeviceptr data, CUdeviceptr rois,
                               CUdeviceptr in_grad, CUdeviceptr rois_grad, long long N,
                               long long C, long long H, long long W, long long R, int P, int Q,
                               float spatial_scale, int sample_ratio, int aligned, int pool_max,
                               int caffe, CUdeviceptr workspace,
                               unsigned long long workspace_bytes, CUstream stream) {
  const CallScope call("ROIAlign", dtype, stream);
  unsigned long long acc_at = 0;
  const unsigned long long need = roi_align_backward_bytes(dtype, N, C, H, W, R, P, Q,
                                                           sample_ratio, caffe, &acc_at);
  if (workspace_bytes < need)
    throw Error(call.op + ": the workspace holds " + std::to_string(workspace_bytes) +
                " bytes but the call's tables and accumulator need " + std::to_string(need));
  if (R <= 0) return call.zero(in_grad, (size_t)(N * C * H * W) * item_size(dtype));
  const RoiAlignGrid grid(call.op, dtype, R, P, Q, H, W, sample_ratio, aligned, pool_max,
                          caffe, workspace);
  const GradTarget target(call, dtype, in_grad, rois_grad, N * C * H * W, R, 5,
                          workspace + acc_at);
  grid.geometry(call, ROI_ALIGN_IMAGE, rois, N, H, W, R, P, Q, spatial_scale);
  const long long n = R * C * P * Q;
  Args k;
  if (grid.is_max) k(data);
  k(grad);
  grid.tables(k, !grid.is_max);  // batch .. x_wh, the divisor for avg
  k((int)C)((int)H)((int)W)(P)(Q)(grid.g.Gy)(grid.g.Gx)(target.bottom)(1.0)(n);  // scale, n
  call.run(ROI_ALIGN_IMAGE,
           (grid.is_max ? "roi_align_backward_max_rescan" : "roi_align_backward_avg") +
               call.ta() + ", " + call.t.A + ">",
           n, k);
  target.store(call);
  call.record();
}

}  // namespace mx_roi_cuda

extern "C" {


// The workspace bytes of a ROIAlign forward (the device tables): 0, or 1 with the message.
int mx_roi_ext_cuda_roi_align_workspace(int dtype, long long R, int P, int Q, int H, int W,
                                        int sample_ratio, int caffe, unsigned long long* bytes,
                                        char* err, size_t err_len) {
  return mx_roi_cuda::c_entry(err, err_len, [&]() {
    *bytes = R <= 0 ? 0
                    : mx_roi_cuda::sample_layout("ROIAlign", dtype,
                                                 mx_roi_cuda::roi_align_mode(caffe), R, P, Q,
                                                 H, W, caffe ? 0 : sample_ratio).bytes;
  });
}

// ROIAlign's forward on ``stream`` (a CUstream / cudaStream_t; 0: the legacy default
// stream): data (N, C, H, W), rois (R, 5), out (R, C, P, Q), all device pointers of
// ``dtype`` in the current context; ``workspace``: at least the workspace function's bytes
// of device memory, free until the call's kernels have run.  No host synchronisation.
int mx_roi_ext_cuda_roi_align_forward(int dtype, const void* data, const void* rois, void* out,
                                      long long N, long long C, long long H, long long W,
                                      long long R, int P, int Q, float spatial_scale,
                                      int sample_ratio, int aligned, int pool_max, int caffe,
                                      void* workspace, unsigned long long workspace_bytes,
                                      void* stream, char* err, size_t err_len) {
  return mx_roi_cuda::c_entry(err, err_len, [&]() {
    mx_roi_cuda::roi_align_forward(
        dtype, (mx_roi_cuda::CUdeviceptr)data, (mx_roi_cuda::CUdeviceptr)rois,
        (mx_roi_cuda::CUdeviceptr)out, N, C, H, W, R, P, Q, spatial_scale, sample_ratio,
        aligned, pool_max, caffe, (mx_roi_cuda::CUdeviceptr)workspace, workspace_bytes,
        (mx_roi_cuda::CUstream)stream);
  });
}

// The workspace bytes of a ROIAlign backward (the tables, and for float16 the float32
// accumulator of the data gradient): 0, or 1 with the message.
int mx_roi_ext_cuda_roi_align_backward_workspace(int dtype, long long N, long long C,
                                                 long long H, long long W, long long R, int P,
                                                 int Q, int sample_ratio, int caffe,
                                                 unsigned long long* bytes, char* err,
                                                 size_t err_len) {
  return mx_roi_cuda::c_entry(err, err_len, [&]() {
    mx_roi_cuda::types_of("ROIAlign", dtype);
    *bytes = mx_roi_cuda::roi_align_backward_bytes(dtype, N, C, H, W, R, P, Q, sample_ratio,
                                                   caffe);
  });
}

// ROIAlign's backward on ``stream``: grad (R, C, P, Q) the out-grad, data (N, C, H, W),
// rois (R, 5), in_grad (N, C, H, W) the data gradient (written: req write), rois_grad (R, 5)
// the rois' gradient (zeroed; null: none), all device pointers of ``dtype``; ``workspace``:
// at least the backward workspace function's bytes.  No host synchronisation; a bad roi is
// reported by a later forward (roi_align_backward above).
int mx_roi_ext_cuda_roi_align_backward(int dtype, const void* grad, const void* data,
                                       const void* rois, void* in_grad, void* rois_grad,
                                       long long N, long long C, long long H, long long W,
                                       long long R, int P, int Q, float spatial_scale,
                                       int sample_ratio, int aligned, int pool_max, int caffe,
                                       void* workspace, unsigned long long workspace_bytes,
                                       void* stream, char* err, size_t err_len) {
  return mx_roi_cuda::c_entry(err, err_len, [&]() {
    mx_roi_cuda::roi_align_backward(
        dtype, (mx_roi_cuda::CUdeviceptr)grad, (mx_roi_cuda::CUdeviceptr)data,
        (mx_roi_cuda::CUdeviceptr)rois, (mx_roi_cuda::CUdeviceptr)in_grad,
        (mx_roi_cuda::CUdeviceptr)rois_grad, N, C, H, W, R, P, Q, spatial_scale, sample_ratio,
        aligned, pool_max, caffe, (mx_roi_cuda::CUdeviceptr)workspace, workspace_bytes,
        (mx_roi_cuda::CUstream)stream);
  });
}

}  // extern "C"
#endif  // MX_ROI_EXT_CUDA_LAUNCHER
