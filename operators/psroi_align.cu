// PSROIAlign kernels: ROIAlign's average over bilinear samples, output channel c at
// bin (p, q) reading input channel channel_map[c, p, q] (C_out, P, Q) int.
// Table driven (SampleGrid), see roi_common.cuh.
#include "roi_common.cuh"

#ifdef MX_ROI_HOST_NATIVE
// Native host build of the forward: a roi's bin's samples (taps and weights,
// mx_roi::sample_at) worked out once for every output channel, then per channel
// sample_value's operations in the generic loop's order (iy, then ix): the same bits.
// Two walks of the bins (psroi_align_forward_native below): plane by plane
// (mx_roi::ps_forward_native), or with many reads per input cell over a channels-last
// copy of each bin's planes, 8 channels at a time.
template <typename A>
struct PsTap {
  // (yl, xl), (yl, xh), (yh, xl), (yh, xh): offsets in the plane, or lane offsets of the
  // cells in the channels-last copy (the plane offset times the cell's lane count)
  long long o1, o2, o3, o4;
  A w1, w2, w3, w4;
};

// A bin's samples are held for its channels only up to MX_ROI_PS_MAX_TAPS of them (a huge
// adaptive grid -- sample_ratio <= 0 on a box far larger than the map -- would need
// gigabytes): past that the generic loop below computes them item by item (false).
// -DMX_ROI_PS_MAX_TAPS=... lowers it so that a test runs that path on small problems.
#ifndef MX_ROI_PS_MAX_TAPS
#define MX_ROI_PS_MAX_TAPS (1 << 16)
#endif

// With many reads per input cell (a detector's hundreds of rois on a map) and at least 8
// output channels, a bin's planes are first copied channels-last -- cell (b, y, x)
// holding the C output channels' values side by side, padded to a multiple of 8 lanes
// (computed, never stored) -- and each roi's samples are then taken for 8 channels at a
// time as vector lanes: per lane sample_value's operations in the generic loop's order,
// the same bits.  Below MX_ROI_PS_LANES_READS taps per input cell the copy costs more
// than it saves (measured: 16 rois on a 2 x 38 x 50 map, 21 classes: 1.3 ms copied vs
// 0.55 plane by plane; 256 rois: 2.6 vs 5.5 ms), and the plane-by-plane walk runs.
#ifndef MX_ROI_PS_LANES_READS
#define MX_ROI_PS_LANES_READS 0.5
#endif

// Up to this many output channels the plane-by-plane walk reads each sample from the
// tables where it is taken instead of building the bin's taps first (tests lower it to
// -1 to run the taps on the same problems).
#ifndef MX_ROI_PS_DIRECT_CHANNELS
#define MX_ROI_PS_DIRECT_CHANNELS 2
#endif

// res[c] = (sum over the m samples, in order, of (w1*v1[c] + w2*v2[c]) + w3*v3[c] +
// w4*v4[c]) / d for 8 lanes; float: 8 / VW vectors, other types: scalar lanes.
template <typename A>
struct PsLanes {
  static void pass(const A* lane, const PsTap<A>* tp, int m, A d, A* res) {
    A acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int i = 0; i < m; ++i) {
      const PsTap<A>& t = tp[i];
      for (int c = 0; c < 8; ++c)
        acc[c] += (t.w1 * lane[t.o1 + c] + t.w2 * lane[t.o2 + c]) + t.w3 * lane[t.o3 + c] +
                  t.w4 * lane[t.o4 + c];
    }
    for (int c = 0; c < 8; ++c) res[c] = acc[c] / d;
  }
};

template <>
struct PsLanes<float> {
  static const int NV = 8 / mx_roi::VW;  // vectors per pass (1 with AVX, 2 with SSE)
  static void pass(const float* lane, const PsTap<float>* tp, int m, float d, float* res) {
    mx_roi::vf s[NV];
    for (int k = 0; k < NV; ++k) s[k] = mx_roi::vf{};
    for (int i = 0; i < m; ++i) {
      const PsTap<float>& t = tp[i];
      for (int k = 0; k < NV; ++k) {
        const int o = k * mx_roi::VW;
        s[k] += mx_roi::interp_vector(lane + t.o1 + o, lane + t.o2 + o, lane + t.o3 + o,
                                      lane + t.o4 + o, t.w1, t.w2, t.w3, t.w4);
      }
    }
    for (int k = 0; k < NV; ++k) {
      s[k] = s[k] / d;
      memcpy(res + k * mx_roi::VW, &s[k], sizeof s[k]);
    }
  }
};

// The sum of a bin's ny x nx samples from one plane, each sample's taps and weights read
// from the tables where it is taken (sample_at's products, sample_value's operations in
// its order); NY, NX > 0: the counts known at compile time (then ny, nx are those).
template <int NY, int NX, typename T, typename A>
inline A ps_align_direct_sum(const T* plane, int W, int ny, int nx, long long yb, long long xb,
                             const int* y_low, const int* y_high, const A* y_wl, const A* y_wh,
                             const int* x_low, const int* x_high, const A* x_wl, const A* x_wh) {
  const int my = NY > 0 ? NY : ny, mx = NX > 0 ? NX : nx;
  A sum = 0;
  for (int iy = 0; iy < my; ++iy) {
    const A wyl = y_wl[yb + iy], wyh = y_wh[yb + iy];
    const T* lo = plane + (long long)y_low[yb + iy] * W;
    const T* hi = plane + (long long)y_high[yb + iy] * W;
    for (int ix = 0; ix < mx; ++ix) {
      const int xl = x_low[xb + ix], xh = x_high[xb + ix];
      const A wxl = x_wl[xb + ix], wxh = x_wh[xb + ix];
      const A w1 = wyl * wxl, w2 = wyl * wxh, w3 = wyh * wxl, w4 = wyh * wxh;
      const A v1 = mx_roi::Traits<T>::load(lo[xl]);
      const A v2 = mx_roi::Traits<T>::load(lo[xh]);
      const A v3 = mx_roi::Traits<T>::load(hi[xl]);
      const A v4 = mx_roi::Traits<T>::load(hi[xh]);
      sum += (w1 * v1 + w2 * v2) + w3 * v3 + w4 * v4;
    }
  }
  return sum;
}

template <typename T, typename A>
bool psroi_align_forward_native(const T* data, const int* batch, const int* channel_map,
                                const int* y_count, const int* y_low, const int* y_high,
                                const A* y_wl, const A* y_wh, const int* x_count,
                                const int* x_low, const int* x_high, const A* x_wl,
                                const A* x_wh, const A* divisor, int C, int Cin, int H, int W,
                                int P, int Q, int Gy, int Gx, T* out, long long n) {
  const long long plane_out = (long long)P * Q, R = mx_roi::launch_rois(n, C, P, Q);
  const long long HW = (long long)H * W;
  const long long K = (long long)Gy * Gx;
  if (K > MX_ROI_PS_MAX_TAPS) return false;
  static thread_local std::vector<PsTap<A>> taps;
  if ((long long)taps.size() < K) taps.resize((size_t)K);
  PsTap<A>* const tp = taps.data();  // (a thread_local read in the loop costs a call)
  // roi r's samples in bin (p, q) into tp, offsets times `stride`; returns their count
  auto bin_taps = [&](long long r, int p, int q, long long stride) {
    const int ny = y_count[r * P + p], nx = x_count[r * Q + q];
    const long long yb = (r * P + p) * (long long)Gy, xb = (r * Q + q) * (long long)Gx;
    int m = 0;
    for (int iy = 0; iy < ny; ++iy) {
      for (int ix = 0; ix < nx; ++ix, ++m) {
        const mx_roi::Sample<A> s = mx_roi::sample_at(yb, xb, iy, ix, y_low, y_high, y_wl,
                                                      y_wh, x_low, x_high, x_wl, x_wh);
        tp[m] = PsTap<A>{((long long)s.yl * W + s.xl) * stride,
                         ((long long)s.yl * W + s.xh) * stride,
                         ((long long)s.yh * W + s.xl) * stride,
                         ((long long)s.yh * W + s.xh) * stride, s.w1, s.w2, s.w3, s.w4};
      }
    }
    return m;
  };
  const int images = mx_roi::images_read(batch, R);
  if (R > 0 && C <= MX_ROI_PS_DIRECT_CHANNELS) {
    // plane by plane, each sample's taps and weights read from the tables where it is
    // taken (sample_at's products, sample_value's operations in its order): with one
    // or two channels a bin's taps are used too seldom to pay for building them first
    // (measured, one thread, 16 rois 7x7 2x2 samples, one channel: 21 -> 13 us; four
    // channels: 38 -> 40 us).  Spelled out rather than through sample_at / sample_value,
    // which re-read a row's taps for every column: 14.4 us there.  A 2 x 2 grid
    // (sample_ratio=2) unrolled, its x taps read once: 12.4 -> 9.8 us bin by bin, and
    // on a map that fits in cache, roi by roi (ps_forward_small_map), 6.1-6.8 us.
    auto direct = [&](long long r, int p, int q, const T* plane) {
      const int ny = y_count[r * P + p], nx = x_count[r * Q + q];
      const long long yb = (r * P + p) * (long long)Gy, xb = (r * Q + q) * (long long)Gx;
      const A sum = ny == 2 && nx == 2
                        ? ps_align_direct_sum<2, 2, T, A>(plane, W, ny, nx, yb, xb, y_low,
                                                          y_high, y_wl, y_wh, x_low, x_high,
                                                          x_wl, x_wh)
                        : ps_align_direct_sum<0, 0, T, A>(plane, W, ny, nx, yb, xb, y_low,
                                                          y_high, y_wl, y_wh, x_low, x_high,
                                                          x_wl, x_wh);
      return sum / divisor[(r * P + p) * Q + q];
    };
    if (!mx_roi::hint_map(Cin, H, W, sizeof(T))) {  // a map that fits in cache
      mx_roi::ps_forward_small_map<T, A>(data, batch, channel_map, C, Cin, H, W, P, Q, out, n,
                                         direct);
      return true;
    }
    mx_roi::ps_forward_native<T, A>(
        data, batch, channel_map, C, Cin, H, W, P, Q, out, n,
        [&](long long r, int p, int q, long long) {
          return [&direct, r, p, q](const T* plane) { return direct(r, p, q, plane); };
        });
    return true;
  }
  if (R <= 0 || C < 8 || (double)R * K * 4 < MX_ROI_PS_LANES_READS * (double)images * HW) {
    mx_roi::ps_forward_native<T, A>(
        data, batch, channel_map, C, Cin, H, W, P, Q, out, n,
        [&](long long r, int p, int q, long long k) {
          const int m = bin_taps(r, p, q, 1);
          const A d = divisor[r * plane_out + k];
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
  // the channels-last walk (mx_roi::ps_forward_channels_last): 8 channels per pass
  mx_roi::ps_forward_channels_last<T, A>(
      data, batch, channel_map, C, Cin, H, W, P, Q, out, n,
      [&](long long r, int p, int q, long long k, int ncp) {
        const int m = bin_taps(r, p, q, ncp);
        const A d = divisor[r * plane_out + k];
        return [tp, m, d](const A* lane, A* res) { PsLanes<A>::pass(lane, tp, m, d, res); };
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
#ifdef MX_ROI_HOST_NATIVE
  if (!mx_roi::hint_map(Cin, H, W, sizeof(O))) {  // a map that fits in cache
    mx_roi::ps_items_by_roi(n, C, P, Q, [&](const mx_roi::Item& it) {
      mx_roi::align_avg_backward_item<T, A, O>(it, grad, batch, channel_map, y_count, y_low,
                                               y_high, y_wl, y_wh, x_count, x_low, x_high,
                                               x_wl, x_wh, divisor, C, Cin, H, W, P, Q, Gy,
                                               Gx, bottom, scale);
    });
    return;
  }
#endif
  MX_ROI_ITEM_LOOP(it, n, C, P, Q, true) {
    mx_roi::align_avg_backward_item<T, A, O>(it, grad, batch, channel_map, y_count, y_low,
                                             y_high, y_wl, y_wh, x_count, x_low, x_high, x_wl,
                                             x_wh, divisor, C, Cin, H, W, P, Q, Gy, Gx, bottom,
                                             scale);
  }
}

#ifdef MX_ROI_EXT_LAUNCHER
// ==== mx_roi_PSROIAlign: this op in mx_roi's MXNet extension library (mx_roi.ext) =========
// Compiled only into that library (g++ with -DMX_ROI_EXT_LAUNCHER, the host shim in native
// mode): the GPU, emulated and native builds never see this section.  Parameters as
// PSROIAlignParam's (mx.nd.contrib.ROIAlign's pooled_size, spatial_scale, sample_ratio,
// aligned; PSROIPooling's output_dim, group_size; ours: deterministic, legacy='rfcn',
// sample_num), parsed as mx_roi/params.py parses them, with its messages; the host launcher
// runs what PositionSensitive.forward_cuda / backward_cuda launch: the device geometry and
// its roi check, then this file's kernels with the channel map.
#include "ext_launch.h"

namespace mx_roi_op {

struct PSROIAlignOp {
  static constexpr const char* OP = "PSROIAlign";

  struct Params : PsGrid {  // P, Q, output_dim, group_size (group_h, group_w)
    double spatial_scale = 0;
    long long sample_ratio = -1, sample_num = 2;
    bool aligned = false, deterministic = false;
    std::string legacy = "";
    bool rfcn() const { return legacy == "rfcn"; }
  };

  // PSROIAlignParam.from_kwargs
  static Params parse(const std::unordered_map<std::string, std::string>& attrs) {
    Kwargs kw(OP, attrs, {"pooled_size", "output_dim", "spatial_scale", "sample_ratio",
                          "aligned", "group_size", "deterministic", "legacy", "sample_num"},
              {"pooled_size", "output_dim", "spatial_scale"});
    Params p;
    std::tie(p.P, p.Q) = kw.size2("pooled_size");
    p.output_dim = kw.integer("output_dim", 0);
    p.spatial_scale = kw.real("spatial_scale", 0);
    p.sample_ratio = kw.integer("sample_ratio", -1);
    p.aligned = kw.boolean("aligned", false);
    std::tie(p.group_h, p.group_w) = kw.group("group_size");
    p.deterministic = kw.boolean("deterministic", false);
    p.legacy = kw.legacy("legacy", {"rfcn"});
    p.sample_num = kw.integer("sample_num", 2);
    kw.finish();
    // ParamBase.__post_init__: _positive in order, then each field's bounds in field
    // order; then _GroupGrid's group rule; then _check_axis_samples
    const std::string size = py_pair_repr(p.P, p.Q), dim = py_int_repr(p.output_dim);
    const std::string num = py_int_repr(p.sample_num);
    const std::string grp = py_pair_repr(p.group_h, p.group_w);
    kw.positive("pooled_size", p.P > 0 && p.Q > 0, size);
    kw.positive("output_dim", p.output_dim > 0, dim);
    kw.positive("spatial_scale", p.spatial_scale > 0, py_float_repr(p.spatial_scale));
    kw.positive("sample_num", p.sample_num > 0, num);
    const std::string most_size = "at most " + std::to_string(MAX_ELEMENTS) + " (" + SIZE_WHY + ")";
    const std::string most_side =
        "at most " + std::to_string(MAX_SAMPLES_PER_SIDE) + " (samples per bin side)";
    kw.check("pooled_size", p.P <= MAX_ELEMENTS && p.Q <= MAX_ELEMENTS, most_size, size);
    kw.check("output_dim", p.output_dim <= MAX_ELEMENTS, most_size, dim);
    check_adaptive_samples(kw, "sample_ratio", p.sample_ratio);
    kw.check("group_size", p.group_h <= MAX_ELEMENTS && p.group_w <= MAX_ELEMENTS, most_size,
             grp);
    kw.check("sample_num", p.sample_num <= MAX_SAMPLES_PER_SIDE, most_side, num);
    check_group(kw, p.group_h, p.group_w);
    const long long samples = p.rfcn() ? p.sample_num : p.sample_ratio;
    const long long most = MAX_SAMPLES_PER_AXIS_PARAM / (p.P > p.Q ? p.P : p.Q);
    kw.check(p.rfcn() ? "sample_num" : "sample_ratio", samples <= most,
             "at most " + std::to_string(most) + " with pooled_size " + size + " (" +
                 std::to_string(MAX_SAMPLES_PER_AXIS_PARAM) + " sample points along an axis)",
             std::to_string(samples));
    return p;
  }

  // PSROIAlignParam.to_kwargs, "name=value;..." (the tests compare it with params.py)
  static std::string format(const std::unordered_map<std::string, std::string>& attrs) {
    const Params p = parse(attrs);
    return "pooled_size=" + py_pair_repr(p.P, p.Q) + ";output_dim=" +
           std::to_string(p.output_dim) + ";spatial_scale=" + py_float_repr(p.spatial_scale) +
           ";sample_ratio=" + std::to_string(p.sample_ratio) +
           ";aligned=" + (p.aligned ? "True" : "False") +
           ";group_size=" + py_pair_repr(p.group_h, p.group_w) +
           ";deterministic=" + (p.deterministic ? "True" : "False") + ";legacy=" + p.legacy +
           ";sample_num=" + std::to_string(p.sample_num);
  }

  static long long out_channels(const Params& p, long long C) {
    return ps_out_channels(OP, p, C);
  }

  // the geometry of the call (Spec: align_grid, or rfcn_grid with sample_num and no aligned)
  template <typename T, typename A>
  static Grid<A> geometry(const Params& p, const MXTensor& data, const MXTensor& rois) {
    if (!p.rfcn() && p.sample_ratio <= 0)
      check_adaptive_grid<T, A>(OP, p.P, p.Q, p.spatial_scale, (const T*)rois.data_ptr,
                                rois.shape[0], data.shape[0]);
    return grid_geometry<T, A>(OP, p.rfcn() ? MODE_RFCN_GRID : MODE_ALIGN_GRID, (int)p.P,
                               (int)p.Q, (int)data.shape[2], (int)data.shape[3],
                               (int)(p.rfcn() ? p.sample_num : p.sample_ratio),
                               p.rfcn() ? 0 : p.aligned, (float)p.spatial_scale,
                               (const T*)rois.data_ptr, rois.shape[0], data.shape[0]);
  }

  template <typename T, typename A>
  static void forward(const Params& p, const Call<PSROIAlignOp, T, A>& c,
                      const MXTensor& data, MXTensor& out) {
    const Grid<A>& g = c.g;
    const int* cmap = ps_channel_map(p);
    c.launch([&]() {
      psroi_align_forward<T, A>((const T*)data.data_ptr, g.batch, cmap, g.y_count, g.y_low,
                                g.y_high, g.y_wl, g.y_wh, g.x_count, g.x_low, g.x_high,
                                g.x_wl, g.x_wh, g.divisor, c.C, c.Cin, c.H, c.W, c.P, c.Q,
                                g.Gy, g.Gx, (T*)out.data_ptr, c.n);
    });
  }

  template <typename T, typename A>
  static void backward(const Params& p, const Call<PSROIAlignOp, T, A>& c,
                       const MXTensor& grad, const MXTensor& data, A* bottom) {
    const Grid<A>& g = c.g;
    const int* cmap = ps_channel_map(p);
    c.launch([&]() {
      psroi_align_backward<T, A, A>((const T*)grad.data_ptr, g.batch, cmap, g.y_count,
                                    g.y_low, g.y_high, g.y_wl, g.y_wh, g.x_count, g.x_low,
                                    g.x_high, g.x_wl, g.x_wh, g.divisor, c.C, c.Cin, c.H, c.W,
                                    c.P, c.Q, g.Gy, g.Gx, bottom, 1.0, c.n);
    });
  }
};

const RegisterParams psroi_align_params("PSROIAlign", PSROIAlignOp::format);

// The "gpu" forward and backward (opt-in; docs/gpu.md): as psroi_pooling.cu's, on the
// sample grid of ROIAlign (sample_ratio, aligned) or of legacy 'rfcn' (sample_num).
struct PSROIAlignGpu {
  typedef PSROIAlignOp Op;
  typedef int (*Workspace)(int, long long, long long, long long, long long, long long,
                           long long, int, int, int, int, int, int, unsigned long long*, char*,
                           size_t);
  typedef int (*Forward)(int, const void*, const void*, void*, long long, long long, long long,
                         long long, long long, long long, int, int, int, int, float, int, int,
                         int, int, void*, unsigned long long, void*, char*, size_t);
  typedef int (*Backward)(int, const void*, const void*, void*, void*, long long, long long,
                          long long, long long, long long, long long, int, int, int, int,
                          float, int, int, int, int, void*, unsigned long long, void*, char*,
                          size_t);
  static constexpr const char* OP = PSROIAlignOp::OP;

  static void* tables(const Op::Params& p, const MXTensor& data, long long R, bool backward,
                      const OpResource& res, unsigned long long* bytes) {
    char err[4096] = "";
    gpu_call(gpu_entry<Workspace>(OP, "mx_roi_ext_cuda_psroi_align_workspace")(
                 data.dtype, data.shape[0], data.shape[1], data.shape[2], data.shape[3], R,
                 p.output_dim, (int)p.P, (int)p.Q, (int)p.sample_ratio, p.rfcn() ? 1 : 0,
                 (int)p.sample_num, backward ? 1 : 0, bytes, err, sizeof err),
             err);
    return gpu_workspace(OP, res, *bytes);
  }

  static int forward(const Op::Params& p, const MXTensor& data, const MXTensor& rois,
                     MXTensor& out, void* ws, unsigned long long bytes, void* stream, char* err,
                     size_t len) {
    return gpu_entry<Forward>(OP, "mx_roi_ext_cuda_psroi_align_forward")(
        data.dtype, data.data_ptr, rois.data_ptr, out.data_ptr, data.shape[0], data.shape[1],
        data.shape[2], data.shape[3], rois.shape[0], p.output_dim, (int)p.P, (int)p.Q,
        (int)p.Gh(), (int)p.Gw(), (float)p.spatial_scale, (int)p.sample_ratio,
        p.aligned ? 1 : 0, p.rfcn() ? 1 : 0, (int)p.sample_num, ws, bytes, stream, err, len);
  }

  static int backward(const Op::Params& p, const MXTensor& grad, const MXTensor& data,
                      const MXTensor& rois, MXTensor& in_grad, MXTensor& rois_grad, void* ws,
                      unsigned long long bytes, void* stream, char* err, size_t len) {
    return gpu_entry<Backward>(OP, "mx_roi_ext_cuda_psroi_align_backward")(
        data.dtype, grad.data_ptr, rois.data_ptr, in_grad.data_ptr, rois_grad.data_ptr,
        data.shape[0], data.shape[1], data.shape[2], data.shape[3], rois.shape[0],
        p.output_dim, (int)p.P, (int)p.Q, (int)p.Gh(), (int)p.Gw(), (float)p.spatial_scale,
        (int)p.sample_ratio, p.aligned ? 1 : 0, p.rfcn() ? 1 : 0, (int)p.sample_num, ws,
        bytes, stream, err, len);
  }
};

}  // namespace mx_roi_op

MX_ROI_EXT_REGISTER(mx_roi_PSROIAlign, mx_roi_op::PSROIAlignOp)
    .setForward(mx_roi_op::GpuCallbacks<mx_roi_op::PSROIAlignGpu>::forward, "gpu")
    .setBackward(mx_roi_op::GpuCallbacks<mx_roi_op::PSROIAlignGpu>::backward, "gpu");
#endif  // MX_ROI_EXT_LAUNCHER

#ifdef MX_ROI_EXT_CUDA_LAUNCHER
// ==== this op on the native GPU path (opt-in; docs/gpu.md) ===============================
// Compiled only into mx_roi.ext.cuda's launcher library (as roi_align.cu's section): the
// driver-API launch of this file's kernels (psroi_align.py's native_gpu_kernels, NVRTC's
// PTX in PSROI_ALIGN_IMAGE) as PositionSensitive.forward_cuda / backward_cuda run them on
// the device-built sample grid and channel map, and the C entries.
namespace mx_roi_cuda {

// A PSROIAlign call's sample grid: ROIAlign's (sample_ratio, aligned), or for legacy
// 'rfcn' the R-FCN grid of sample_num points a side (not aligned).
struct PsAlignGrid : SampleGrid {
  PsAlignGrid(int dtype, long long R, int P, int Q, long long H, long long W, int sample_ratio,
              int aligned, int rfcn, int sample_num, CUdeviceptr workspace)
      : SampleGrid("PSROIAlign", dtype, rfcn ? MODE_RFCN_GRID : MODE_ALIGN_GRID, R, P, Q, H, W,
                   rfcn ? sample_num : sample_ratio, rfcn ? 0 : (aligned ? 1 : 0), workspace) {}
};

// PSROIAlign's workspace: the grid's tables, then the channel map and float16's accumulator
// (PsWorkspace); for R >= 1.
inline PsWorkspace psroi_align_workspace(int dtype, long long N, long long Cin, long long H,
                                         long long W, long long R, long long output_dim, int P,
                                         int Q, int sample_ratio, int rfcn, int sample_num,
                                         bool backward) {
  return PsWorkspace(sample_layout("PSROIAlign", dtype, rfcn ? MODE_RFCN_GRID : MODE_ALIGN_GRID,
                                   R, P, Q, H, W, rfcn ? sample_num : sample_ratio).bytes,
                     dtype, output_dim, P, Q, N * Cin * H * W, backward);
}

// The kernels' arguments from ``first`` (data or grad) through the divisor: first, batch,
// channel_map, y_count .. x_wh, divisor
inline void ps_align_tables(Args& k, CUdeviceptr first, const SampleGrid& grid,
                            CUdeviceptr map) {
  k(first)(grid.tb[0])(map);
  for (int i = 1; i < 12; ++i) k(grid.tb[i]);
}

// PSROIAlign's forward (PositionSensitive.forward_cuda on a device-built grid): the
// geometry kernel, the channel map's fill, then psroi_align_forward, on ``stream``.
inline void psroi_align_forward(int dtype, CUdeviceptr data, CUdeviceptr rois, CUdeviceptr out,
                                long long N, long long Cin, long long H, long long W,
                                long long R, long long output_dim, int P, int Q, int Gh,
                                int Gw, float spatial_scale, int sample_ratio, int aligned,
                                int rfcn, int sample_num, CUdeviceptr workspace,
                                unsigned long long workspace_bytes, CUstream stream) {
  const CallScope call("PSROIAlign", dtype, stream);
  ps_check_channels(call.op, Cin, output_dim, Gh, Gw);
  call.report();
  if (R <= 0) return;  // no roi: nothing to launch (the output is empty)
  const PsWorkspace ws = psroi_align_workspace(dtype, N, Cin, H, W, R, output_dim, P, Q,
                                               sample_ratio, rfcn, sample_num, false);
  need_workspace(call.op, workspace_bytes, ws.bytes);
  const PsAlignGrid grid(dtype, R, P, Q, H, W, sample_ratio, aligned, rfcn, sample_num,
                         workspace);
  grid.geometry(call, PSROI_ALIGN_IMAGE, rois, N, H, W, R, P, Q, spatial_scale);
  ps_fill_channel_map(call, PSROI_ALIGN_IMAGE, workspace + ws.map_at, output_dim, P, Q, Gh, Gw);
  const long long n = R * output_dim * P * Q;
  Args k;
  ps_align_tables(k, data, grid, workspace + ws.map_at);
  k((int)output_dim)((int)Cin)((int)H)((int)W)(P)(Q)(grid.g.Gy)(grid.g.Gx)(out)(n);
  call.run(PSROI_ALIGN_IMAGE, "psroi_align_forward" + call.ta() + ">", n, k);
  call.record();
}

// PSROIAlign's backward (PositionSensitive.backward_cuda, req write), as PSROIPooling's.
inline void psroi_align_backward(int dtype, CUdeviceptr grad, CUdeviceptr rois,
                                 CUdeviceptr in_grad, CUdeviceptr rois_grad, long long N,
                                 long long Cin, long long H, long long W, long long R,
                                 long long output_dim, int P, int Q, int Gh, int Gw,
                                 float spatial_scale, int sample_ratio, int aligned, int rfcn,
                                 int sample_num, CUdeviceptr workspace,
                                 unsigned long long workspace_bytes, CUstream stream) {
  const CallScope call("PSROIAlign", dtype, stream);
  ps_check_channels(call.op, Cin, output_dim, Gh, Gw);
  if (R <= 0) return call.zero(in_grad, (size_t)(N * Cin * H * W) * item_size(dtype));
  const PsWorkspace ws = psroi_align_workspace(dtype, N, Cin, H, W, R, output_dim, P, Q,
                                               sample_ratio, rfcn, sample_num, true);
  need_workspace(call.op, workspace_bytes, ws.bytes);
  const PsAlignGrid grid(dtype, R, P, Q, H, W, sample_ratio, aligned, rfcn, sample_num,
                         workspace);
  const GradTarget target(call, dtype, in_grad, rois_grad, N * Cin * H * W, R, 5,
                          workspace + ws.acc_at);
  grid.geometry(call, PSROI_ALIGN_IMAGE, rois, N, H, W, R, P, Q, spatial_scale);
  ps_fill_channel_map(call, PSROI_ALIGN_IMAGE, workspace + ws.map_at, output_dim, P, Q, Gh, Gw);
  const long long n = R * output_dim * P * Q;
  Args k;
  ps_align_tables(k, grad, grid, workspace + ws.map_at);
  k((int)output_dim)((int)Cin)((int)H)((int)W)(P)(Q)(grid.g.Gy)(grid.g.Gx)(target.bottom)(
      1.0)(n);  // scale, n
  call.run(PSROI_ALIGN_IMAGE, "psroi_align_backward" + call.ta() + ", " + call.t.A + ">", n,
           k);
  target.store(call);
  call.record();
}

}  // namespace mx_roi_cuda

extern "C" {

// The workspace bytes of a PSROIAlign forward (``backward`` 0) or backward (1): 0, or 1
// with the message.  ``rfcn``: legacy 'rfcn' (the grid of ``sample_num``).
int mx_roi_ext_cuda_psroi_align_workspace(int dtype, long long N, long long Cin, long long H,
                                          long long W, long long R, long long output_dim,
                                          int P, int Q, int sample_ratio, int rfcn,
                                          int sample_num, int backward,
                                          unsigned long long* bytes, char* err,
                                          size_t err_len) {
  return mx_roi_cuda::c_entry(err, err_len, [&]() {
    mx_roi_cuda::types_of("PSROIAlign", dtype);
    *bytes = R <= 0 ? 0
                    : mx_roi_cuda::psroi_align_workspace(dtype, N, Cin, H, W, R, output_dim,
                                                         P, Q, sample_ratio, rfcn, sample_num,
                                                         backward != 0).bytes;
  });
}

// PSROIAlign's forward on ``stream`` (arguments as PSROIPooling's, then the sample grid's:
// sample_ratio, aligned, rfcn, sample_num).  No host synchronisation.
int mx_roi_ext_cuda_psroi_align_forward(int dtype, const void* data, const void* rois,
                                        void* out, long long N, long long Cin, long long H,
                                        long long W, long long R, long long output_dim, int P,
                                        int Q, int Gh, int Gw, float spatial_scale,
                                        int sample_ratio, int aligned, int rfcn,
                                        int sample_num, void* workspace,
                                        unsigned long long workspace_bytes, void* stream,
                                        char* err, size_t err_len) {
  return mx_roi_cuda::c_entry(err, err_len, [&]() {
    mx_roi_cuda::psroi_align_forward(
        dtype, (mx_roi_cuda::CUdeviceptr)data, (mx_roi_cuda::CUdeviceptr)rois,
        (mx_roi_cuda::CUdeviceptr)out, N, Cin, H, W, R, output_dim, P, Q, Gh, Gw,
        spatial_scale, sample_ratio, aligned, rfcn, sample_num,
        (mx_roi_cuda::CUdeviceptr)workspace, workspace_bytes, (mx_roi_cuda::CUstream)stream);
  });
}

// PSROIAlign's backward on ``stream`` (as PSROIPooling's, with the sample grid's
// arguments).  No host synchronisation; a bad roi is reported by a later forward.
int mx_roi_ext_cuda_psroi_align_backward(int dtype, const void* grad, const void* rois,
                                         void* in_grad, void* rois_grad, long long N,
                                         long long Cin, long long H, long long W, long long R,
                                         long long output_dim, int P, int Q, int Gh, int Gw,
                                         float spatial_scale, int sample_ratio, int aligned,
                                         int rfcn, int sample_num, void* workspace,
                                         unsigned long long workspace_bytes, void* stream,
                                         char* err, size_t err_len) {
  return mx_roi_cuda::c_entry(err, err_len, [&]() {
    mx_roi_cuda::psroi_align_backward(
        dtype, (mx_roi_cuda::CUdeviceptr)grad, (mx_roi_cuda::CUdeviceptr)rois,
        (mx_roi_cuda::CUdeviceptr)in_grad, (mx_roi_cuda::CUdeviceptr)rois_grad, N, Cin, H, W,
        R, output_dim, P, Q, Gh, Gw, spatial_scale, sample_ratio, aligned, rfcn, sample_num,
        (mx_roi_cuda::CUdeviceptr)workspace, workspace_bytes, (mx_roi_cuda::CUstream)stream);
  });
}

}  // extern "C"
#endif  // MX_ROI_EXT_CUDA_LAUNCHER
