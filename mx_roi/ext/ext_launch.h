// The host launcher's common part, included by an op's MX_ROI_EXT_LAUNCHER section (the end
// of operators/<op>.cu, compiled for the extension library: the host shim, roi_common.cuh
// and the op's kernels are already in the translation unit).  The whole unit sits in a
// namespace of its own (mx_roi.ext._unit_source): its names, this file's namespace
// mx_roi_op included, are the unit's alone, so several ops link into one library.
//
// Both doors run it: the native operators' callbacks, and the Custom door's native backend
// through mx_roi_ext_invoke (mx_roi.cuda.library_calls).
//
// The geometry of a sample-grid op as the GPU path builds it (device_geometry.build): the
// device-geometry kernel
// roi_grid_geometry over tables sized from the shapes (grid_widths), its status word
// checked before any op kernel runs; a bad roi raises the Custom path's message
// (registry.RoIOp.roi_error, decoded as DeviceGeometry.error decodes it); a roi needing
// more sample points than the tables hold is built again with exact widths (the compiled
// twin of mx_roi.geometry, as the checked path does).
#pragma once

#include <algorithm>
#include <type_traits>

#include "mxnet/lib_api.h"
#include "ext_common.h"

namespace mx_roi_op {

using namespace ::mx_roi_ext;
using namespace ::mxnet::ext;
using mx_roi::geo::STATUS_BATCH_KEY;

// geometry.MAX_SAMPLES_PER_AXIS; onednn.GUARD_BOUND
const long long MAX_SAMPLES_PER_AXIS = 1LL << 22;
const double GUARD_BOUND = 3.0e38;
// compiled_geometry.MODES
enum { MODE_POOL_BINS = 0, MODE_PS_POOL_BINS = 1, MODE_ALIGN_GRID = 2, MODE_CAFFE_GRID = 3,
       MODE_RFCN_GRID = 4 };

// How many times this thread has laid tables over scratch slot 0 (KeptGeometry: the kept
// tables are there until the next time).
inline unsigned long long& tables_generation() {
  static thread_local unsigned long long n = 0;
  return n;
}

// A per-thread scratch buffer (slot: tables 0, a float16 backward's float32 gradient 1).
inline unsigned char* scratch(int slot, size_t bytes) {
  static thread_local std::vector<unsigned char> buf[2];
  if (slot == 0) ++tables_generation();
  if (buf[slot].size() < bytes) buf[slot].resize(bytes);
  return buf[slot].data();
}

inline double to_double(float v) { return v; }
inline double to_double(double v) { return v; }
#if !defined(__FLT16_MAX__) || defined(MX_ROI_SOFT_HALF)
inline double to_double(__half v) { return __half2float(v); }
#else
inline double to_double(_Float16 v) { return (double)(float)v; }
#endif

// registry.RoIOp.roi_error of the status word ``word`` (roi_common.cuh's roi_status key)
template <typename T>
std::string roi_error(const std::string& op, unsigned long long word, const T* rois,
                      long long images, int columns = 5) {
  const unsigned long long key = ~word;
  const bool batch = key >= STATUS_BATCH_KEY;
  const long long r = (long long)(batch ? key - STATUS_BATCH_KEY : key);
  if (!batch) {
    std::string row = "[";
    for (int k = 0; k < columns; ++k)
      row += (k ? ", " : "") + py_float_repr(to_double(rois[r * columns + k]));
    return op + ": rois[" + std::to_string(r) + "] has a NaN or infinite value " + row +
           "]; coordinates must be finite";
  }
  char b[64];
  std::snprintf(b, sizeof b, "%g", to_double(rois[r * columns]));
  return op + ": rois[" + std::to_string(r) + "] has batch index " + b +
         " but data holds only " + std::to_string(images) + " image(s) (valid: 0.." +
         std::to_string(images - 1) + "; a negative index marks a padding roi)";
}

// ---- the rois' columns (RoIOp.rois_columns / rois_layout) ----------------------------
// Callbacks<Op> takes rois (R, 5) = (batch index, x1, y1, x2, y2) unless Op declares
// ROI_COLUMNS and ROI_LAYOUT (RROIAlign: (R, 6)); detected here (C++14: no void_t).
template <typename...>
struct make_void { typedef void type; };
template <typename Op, typename = void>
struct RoiLayout {
  static constexpr int columns = 5;
  static const char* layout() { return "(batch_index, x1, y1, x2, y2)"; }
};
template <typename Op>
struct RoiLayout<Op, typename make_void<decltype(Op::ROI_COLUMNS)>::type> {
  static constexpr int columns = Op::ROI_COLUMNS;
  static const char* layout() { return Op::ROI_LAYOUT; }
};

// The roi check of an op whose kernels read the rois themselves (RROIAlign, PrRoIPool: no
// tables; the roi_check kernel into a status word first); throws the Custom path's
// message (roi_error) for a bad roi.  R >= 1.
template <typename T, typename A>
void check_rois_status(const std::string& op, const T* rois, long long R, int columns,
                       long long N) {
  unsigned long long status[2] = {0, 0};
  mx_roi_launch_serial(1, 1, [&]() {
    roi_check<T, A>(rois, columns, N, GUARD_BOUND, std::is_same<T, __half>::value ? 0 : 1,
                    status, R);
  });
  if (status[0]) throw OpError(roi_error(op, status[0], rois, N, columns));
}

// geometry.adaptive_samples_per_bin + check_samples_per_bin: the first box whose adaptive
// grid needs more than MAX_SAMPLES_PER_BIN samples per bin, in float64 as NumPy computes
// it; ``sides(row, &h, &w)`` gives a roi's sides (float64) and ``shown(row, &w, &h)`` the
// two numbers the message prints.
template <typename T, typename A, typename Sides, typename Shown>
void check_samples_per_bin(const std::string& op, const char* ratio_name, long long P,
                           long long Q, double spatial_scale, const T* rois, long long R,
                           int columns, Sides sides, Shown shown) {
  const double s = (double)(A)(float)spatial_scale;  // compute_dtype(dtype).type(float32)
  for (long long r = 0; r < R; ++r) {
    double h = 0, w = 0;
    sides(rois + r * columns, &h, &w);
    const double per_bin = mx_roi::geo::adaptive_per_bin(h, w, s, (double)P, (double)Q);
    if (per_bin > mx_roi::geo::MAX_SAMPLES_PER_BIN) {
      double a = 0, b = 0;
      shown(rois + r * columns, &a, &b);
      char text[160];
      std::snprintf(text, sizeof text, "is a box of %g x %g: %.3g samples per bin", a, b,
                    per_bin);
      throw OpError(op + ": rois[" + std::to_string(r) + "] " + text + " with " +
                    ratio_name + " <= 0, more than " +
                    std::to_string((long long)mx_roi::geo::MAX_SAMPLES_PER_BIN) +
                    "; check the box size and spatial_scale, or set " + ratio_name);
    }
  }
}

// RoIOp._check_adaptive_grid: an adaptive ROIAlign grid (ROIAlign, PSROIAlign) over (R, 5)
// rois, after the roi check (its errors come first, as on the Custom door); sides
// x2 - x1 and y2 - y1 in float64, a reversed side 0
template <typename T, typename A>
void check_adaptive_grid(const std::string& op, long long P, long long Q, double spatial_scale,
                         const T* rois, long long R, long long N) {
  if (R == 0) return;
  check_rois_status<T, A>(op, rois, R, 5, N);
  auto sides = [](const T* row, double* h, double* w) { mx_roi::geo::box_sides(row, h, w); };
  auto shown = [&](const T* row, double* a, double* b) { sides(row, b, a); };
  check_samples_per_bin<T, A>(op, "sample_ratio", P, Q, spatial_scale, rois, R, 5, sides,
                              shown);
}

// A sample grid's tables (geometry.SampleGrid; coordinates only in the exact build).
template <typename A>
struct Grid {
  int Gy = 0, Gx = 0;
  int *batch = nullptr, *y_count = nullptr, *y_low = nullptr, *y_high = nullptr;
  int *x_count = nullptr, *x_low = nullptr, *x_high = nullptr;
  A *y_wl = nullptr, *y_wh = nullptr, *x_wl = nullptr, *x_wh = nullptr, *divisor = nullptr;
  A *y_coord = nullptr, *x_coord = nullptr;
};

// Lays the tables out over ``base`` (16-byte aligned, as device_geometry._carve); with
// base == nullptr only measures.  Returns the bytes needed.
template <typename A>
size_t carve_grid(Grid<A>& g, unsigned char* base, long long R, int P, int Q, bool coords) {
  size_t off = 0;
  auto take = [&](auto*& p, long long count) {
    typedef typename std::remove_reference<decltype(*p)>::type X;
    p = base ? (X*)(base + off) : nullptr;
    off += ((size_t)count * sizeof(X) + 15) / 16 * 16;
  };
  const long long ry = R * P * (long long)g.Gy, rx = R * Q * (long long)g.Gx;
  take(g.batch, R);
  take(g.y_count, R * P);
  take(g.y_low, ry);
  take(g.y_high, ry);
  take(g.y_wl, ry);
  take(g.y_wh, ry);
  take(g.x_count, R * Q);
  take(g.x_low, rx);
  take(g.x_high, rx);
  take(g.x_wl, rx);
  take(g.x_wh, rx);
  take(g.divisor, R * P * Q);
  if (coords) {
    take(g.y_coord, ry);
    take(g.x_coord, rx);
  }
  return off < 16 ? 16 : off;
}

// The geometry of R >= 1 rois (see the top of this file); throws OpError for a bad roi.
template <typename T, typename A>
Grid<A> grid_geometry(const std::string& op, int mode, int P, int Q, int H, int W, int sample,
                      int aligned, float scale, const T* rois, long long R, long long N) {
  const bool use_bound = !std::is_same<T, __half>::value;  // onednn.bounded_dtype
  Grid<A> g;
  // device_geometry.grid_widths
  long long gy, gx;
  if (mode == MODE_RFCN_GRID || (mode == MODE_ALIGN_GRID && sample > 0)) {
    gy = gx = sample;
  } else {
    gy = (H + 1 + P - 1) / P + 1;
    gx = (W + 1 + Q - 1) / Q + 1;
  }
  const bool padded = gy >= 1 && gy * P <= MAX_SAMPLES_PER_AXIS && gx * Q <= MAX_SAMPLES_PER_AXIS;
  if (padded) {
    g.Gy = (int)gy;
    g.Gx = (int)gx;
    const size_t bytes = carve_grid(g, nullptr, R, P, Q, false);
    carve_grid(g, scratch(0, bytes), R, P, Q, false);
    unsigned long long status[2] = {0, 0};
    mx_roi_launch_serial(1, 1, [&]() {
      roi_grid_geometry<T, A>(rois, mode, P, Q, H, W, sample, aligned, scale, g.Gy, g.Gx, N,
                              GUARD_BOUND, use_bound ? 1 : 0, g.batch, g.y_count, g.y_low,
                              g.y_high, g.y_wl, g.y_wh, g.x_count, g.x_low, g.x_high, g.x_wl,
                              g.x_wh, g.divisor, status, R);
    });
    if (status[0]) throw OpError(roi_error(op, status[0], rois, N));
    if (!status[1]) return g;
  } else {
    long long row = 0;
    const int code = mx_roi::geo::check_rois<T, A>(rois, R, N, GUARD_BOUND, use_bound, &row);
    if (code)
      throw OpError(roi_error(op, code == 1 ? ~(unsigned long long)row
                                            : ~(STATUS_BATCH_KEY + (unsigned long long)row),
                              rois, N));
  }
  // exact widths (the checked path's tables)
  const mx_roi::geo::Params counts_params =
      mx_roi::geo::make_params(mode, P, Q, H, W, sample, aligned, scale, 0, 0);
  int G[2] = {0, 0};
  mx_roi::geo::geometry_counts<T, A>(counts_params, rois, R, G);
  // compiled_geometry.align_samples_problem
  long long too_many = 0;
  if (P == Q && std::abs(G[0] - G[1]) <= 8) {
    const long long n = (long long)(G[0] > G[1] ? G[0] : G[1]) * P;
    if (n > MAX_SAMPLES_PER_AXIS) too_many = n;
  } else if ((long long)G[0] * P > MAX_SAMPLES_PER_AXIS) {
    too_many = (long long)G[0] * P;
  } else if ((long long)G[1] * Q > MAX_SAMPLES_PER_AXIS) {
    too_many = (long long)G[1] * Q;
  }
  if (too_many)
    throw OpError(op + ": rois: a box needs " + std::to_string(too_many) +
                  " sample points along one axis (more than " +
                  std::to_string(MAX_SAMPLES_PER_AXIS) +
                  "); check the coordinates and spatial_scale");
  g = Grid<A>();
  g.Gy = G[0];
  g.Gx = G[1];
  const size_t bytes = carve_grid(g, nullptr, R, P, Q, true);
  carve_grid(g, scratch(0, bytes), R, P, Q, true);
  const mx_roi::geo::Params params =
      mx_roi::geo::make_params(mode, P, Q, H, W, sample, aligned, scale, g.Gy, g.Gx);
  mx_roi::geo::Tables<A> tb = {};
  tb.batch = g.batch;
  tb.y_count = g.y_count;
  tb.y_coord = g.y_coord;
  tb.y_low = g.y_low;
  tb.y_high = g.y_high;
  tb.y_wl = g.y_wl;
  tb.y_wh = g.y_wh;
  tb.x_count = g.x_count;
  tb.x_coord = g.x_coord;
  tb.x_low = g.x_low;
  tb.x_high = g.x_high;
  tb.x_wl = g.x_wl;
  tb.x_wh = g.x_wh;
  tb.divisor = g.divisor;
  for (long long r = 0; r < R; ++r) mx_roi::geo::geometry_roi<T, A>(params, rois, r, tb);
  return g;
}

// The shape of an MXTensor as Python prints a tuple: "(2, 3)", "(5,)".
inline std::string shape_repr(const std::vector<int64_t>& s) {
  std::string out = "(";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + (s.size() == 1 ? ",)" : ")");
}

inline std::string shape_repr(const std::vector<unsigned int>& s) {
  return shape_repr(std::vector<int64_t>(s.begin(), s.end()));
}

// Whether an op's parameters have an output_dim (params.py: "output_dim" in the fields)
inline long long numel(const std::vector<int64_t>& s) {
  long long n = 1;
  for (auto v : s) n *= v;
  return n;
}

// The element type pair (T, A) of an MXNet dtype: float32, float64, float16 (A = float).
template <typename F>
void dispatch_dtype(const std::string& op, int dtype, F&& f) {
  switch (dtype) {
    case mxnet::ext::kFloat32: f((float*)nullptr, (float*)nullptr); break;
    case mxnet::ext::kFloat64: f((double*)nullptr, (double*)nullptr); break;
    case mxnet::ext::kFloat16: f((__half*)nullptr, (float*)nullptr); break;
    default:
      throw OpError(op + ": data must be float16, float32 or float64 (MXNet dtype code " +
                    std::to_string(dtype) + ")");
  }
}

// The integer bins (geometry.IntBins) of R >= 1 rois through roi_bins_geometry, checked
// into the status word.  ``cells`` is the device path's argmax bound; the extension ops
// keep no argmax (their max backwards rescan the data), so none is needed: the tables'
// values do not depend on it.
struct Bins {
  int *batch = nullptr, *hstart = nullptr, *hend = nullptr, *wstart = nullptr, *wend = nullptr;
};

template <typename T, typename A>
Bins int_bins_geometry(const std::string& op, int mode, int P, int Q, int H, int W, float scale,
                       const T* rois, long long R, long long N) {
  Bins b;
  const size_t ri = ((size_t)R * sizeof(int) + 15) / 16 * 16;
  const size_t rp = ((size_t)R * P * sizeof(int) + 15) / 16 * 16;
  const size_t rq = ((size_t)R * Q * sizeof(int) + 15) / 16 * 16;
  unsigned char* m = scratch(0, ri + 2 * rp + 2 * rq + 16);
  b.batch = (int*)m;
  b.hstart = (int*)(m + ri);
  b.hend = (int*)(m + ri + rp);
  b.wstart = (int*)(m + ri + 2 * rp);
  b.wend = (int*)(m + ri + 2 * rp + rq);
  unsigned long long status[2] = {0, 0};
  mx_roi_launch_serial(1, 1, [&]() {
    roi_bins_geometry<T, A>(rois, mode, P, Q, H, W, scale, N, GUARD_BOUND,
                            std::is_same<T, __half>::value ? 0 : 1, (long long)1 << 62,
                            b.batch, b.hstart, b.hend, b.wstart, b.wend, status, R);
  });
  if (status[0]) throw OpError(roi_error(op, status[0], rois, N));
  return b;
}

// ParamBase.__post_init__'s checks of the two fields every op has (params.py's
// pooled_size_field and spatial_scale_field): both positive, then pooled_size's bound.
// An op's own checks follow (in its fields' order).
inline void check_pooled(const Kwargs& kw, long long P, long long Q, double spatial_scale) {
  const std::string size = py_pair_repr(P, Q);
  kw.positive("pooled_size", P > 0 && Q > 0, size);
  kw.positive("spatial_scale", spatial_scale > 0, py_float_repr(spatial_scale));
  kw.check("pooled_size", P <= MAX_ELEMENTS && Q <= MAX_ELEMENTS,
           "at most " + std::to_string(MAX_ELEMENTS) + " (" + SIZE_WHY + ")", size);
}

// params.ADAPTIVE_SAMPLES_BOUNDS of the sampling ratio ``name`` (sample_ratio_field: <= 0
// means adaptive; ROIAlign's and PSROIAlign's sample_ratio, RROIAlign's sampling_ratio)
inline void check_adaptive_samples(const Kwargs& kw, const char* name, long long ratio) {
  const std::string value = py_int_repr(ratio);  // (exact beyond int64, as params.py)
  kw.check(name, ratio <= MAX_SAMPLES_PER_SIDE,
           "at most " + std::to_string(MAX_SAMPLES_PER_SIDE) + " (samples per bin side)", value);
  kw.check(name, ratio >= -(1LL << 31),
           "at least " + std::to_string(-(1LL << 31)) + " (samples per bin side)", value);
}

// The parameters of an op with only pooled_size, spatial_scale and deterministic
// (ROIPoolingParam, PrRoIPoolParam: the same fields, defaults and checks), parsed as
// their from_kwargs and spelt as their to_kwargs
struct PooledParams {
  long long P = 0, Q = 0;
  double spatial_scale = 0;
  bool deterministic = false;
};

inline PooledParams parse_pooled_params(const char* op,
                                        const std::unordered_map<std::string, std::string>& attrs) {
  Kwargs kw(op, attrs, {"pooled_size", "spatial_scale", "deterministic"},
            {"pooled_size", "spatial_scale"});
  PooledParams p;
  std::tie(p.P, p.Q) = kw.size2("pooled_size");
  p.spatial_scale = kw.real("spatial_scale", 0);
  p.deterministic = kw.boolean("deterministic", false);
  kw.finish();
  check_pooled(kw, p.P, p.Q, p.spatial_scale);
  return p;
}

inline std::string format_pooled_params(const PooledParams& p) {
  return "pooled_size=" + py_pair_repr(p.P, p.Q) +
         ";spatial_scale=" + py_float_repr(p.spatial_scale) +
         ";deterministic=" + (p.deterministic ? "True" : "False");
}

// The part of an op struct that ROIPooling and PrRoIPool share (PooledParams' parse and
// spelling, channels in = channels out); ``D`` is the op (its OP names it in messages)
template <typename D>
struct PooledOp {
  typedef PooledParams Params;
  static Params parse(const std::unordered_map<std::string, std::string>& attrs) {
    return parse_pooled_params(D::OP, attrs);
  }
  static std::string format(const std::unordered_map<std::string, std::string>& attrs) {
    return format_pooled_params(parse(attrs));
  }
  static long long out_channels(const Params&, long long C) { return C; }
};

// The tables of this thread's last forward of an op (per dtype pair), kept for the backward
// of the same call: MXNet runs the backward on the thread of the forward (its one CPU
// worker) with the same parameters, data shape and rois, and building the tables again
// there took a fifth of the bench's small PSROIAlign backward (callbacks 16.5-21.0 us,
// 14.1-15.3 with the forward's; CHANGELOG).  A backward
// takes them only when its parameters (the Callbacks memo's serial of the attribute map),
// data shape and rois (byte for byte) are the forward's and the op's scratch slot 0 has
// held no other tables since (tables_generation); else it builds and checks its own, as
// before.  Only tables laid over the scratch are kept (Grid, Bins: KeepsTables); a forward
// always builds its own (a forward that failed keeps nothing).
template <typename G>
struct KeepsTables : std::false_type {};
template <typename A>
struct KeepsTables<Grid<A>> : std::true_type {};
template <>
struct KeepsTables<Bins> : std::true_type {};

template <typename G>
struct KeptGeometry {
  bool valid = false;
  unsigned long long generation = 0, params = 0;
  std::vector<int64_t> shape;
  std::vector<unsigned char> rois;
  G g;
  bool matches(unsigned long long serial, const MXTensor& data, const unsigned char* r,
               size_t bytes) const {
    return valid && generation == tables_generation() && params == serial &&
           shape == data.shape && rois.size() == bytes &&
           (bytes == 0 || std::memcmp(rois.data(), r, bytes) == 0);
  }
};

// A call's place in that: which parameters (0: none, nothing kept or taken) and direction
struct KeepKey {
  unsigned long long params = 0;
  bool backward = false;
};

// One call of ``Op`` (an op as Callbacks wants, with geometry<T, A>(p, data, rois)): data
// (N, Cin, H, W), C = Op::out_channels (the channel count checked first), the P x Q grid,
// n = R * C * P * Q output items, then g, the geometry (rois checked; built even for n = 0,
// as the device path builds it).
template <typename Op, typename T, typename A>
struct Call {
  typedef decltype(Op::template geometry<T, A>(std::declval<const typename Op::Params&>(),
                                               std::declval<const MXTensor&>(),
                                               std::declval<const MXTensor&>())) Geometry;
  int C, Cin, H, W, P, Q;
  long long n;
  Geometry g;
  Call(const typename Op::Params& p, const MXTensor& data, const MXTensor& rois,
       KeepKey key = KeepKey())
      : C((int)Op::out_channels(p, data.shape[1])), Cin((int)data.shape[1]),
        H((int)data.shape[2]), W((int)data.shape[3]), P((int)p.P), Q((int)p.Q),
        n(rois.shape[0] * (long long)C * p.P * p.Q),
        g(geometry(KeepsTables<Geometry>(), p, data, rois, key)) {}

  static Geometry geometry(std::false_type, const typename Op::Params& p, const MXTensor& data,
                           const MXTensor& rois, KeepKey) {
    return Op::template geometry<T, A>(p, data, rois);
  }
  // KeptGeometry: a forward keeps its tables, a backward takes them when they are its own
  static Geometry geometry(std::true_type, const typename Op::Params& p, const MXTensor& data,
                           const MXTensor& rois, KeepKey key) {
    if (!key.params) return Op::template geometry<T, A>(p, data, rois);
    static thread_local KeptGeometry<Geometry> kept;
    const unsigned char* r = (const unsigned char*)rois.data_ptr;
    const size_t bytes = (size_t)numel(rois.shape) * sizeof(T);
    if (key.backward) {
      const bool hit = kept.matches(key.params, data, r, bytes);
      ::mx_roi_ext::count_geometry_reuse(hit);
      return hit ? kept.g : Op::template geometry<T, A>(p, data, rois);
    }
    kept.valid = false;
    const Geometry g = Op::template geometry<T, A>(p, data, rois);  // (throws: none kept)
    kept.g = g;
    kept.generation = tables_generation();
    kept.params = key.params;
    kept.shape = data.shape;
    kept.rois.assign(r, r + bytes);
    kept.valid = true;
    return g;
  }

  // ``kernel()`` on the native backend's threads, the C output channels split among them
  template <typename F>
  void launch(F&& kernel) const {
    mx_roi_launch_channels(C, native_threads(n), kernel, (long long)H * W);
  }
};

// ---- position-sensitive ops (PSROIPooling, PSROIAlign) --------------------------------
// The group grid of a position-sensitive op's parameters (params._GroupGrid): group_size
// (group_h, group_w), (0, 0) meaning the pooled grid.
struct PsGrid {
  long long P = 0, Q = 0, output_dim = 0;
  long long group_h = 0, group_w = 0;
  // _GroupGrid.group_grid
  long long Gh() const { return group_h || group_w ? group_h : P; }
  long long Gw() const { return group_h || group_w ? group_w : Q; }
};

// A non-negative 128-bit integer as Python prints it (output_dim * gh * gw, unbounded there)
inline std::string u128_str(unsigned __int128 v) {
  std::string s;
  do {
    s.insert(s.begin(), (char)('0' + (int)(v % 10)));
    v /= 10;
  } while (v);
  return s;
}

// PositionSensitive.out_channels: data must hold output_dim * gh * gw channels; returns
// output_dim, the output's channels
inline long long ps_out_channels(const std::string& op, const PsGrid& p, long long C) {
  const unsigned __int128 need =
      (unsigned __int128)p.output_dim * (unsigned __int128)p.Gh() * (unsigned __int128)p.Gw();
  if (need != (unsigned __int128)C) {
    const std::string gh = std::to_string(p.Gh()), gw = std::to_string(p.Gw());
    throw OpError(op + ": data has " + std::to_string(C) +
                  " channels but output_dim * gh * gw = " + std::to_string(p.output_dim) +
                  " * " + gh + " * " + gw + " = " + u128_str(need) +
                  " are required (group grid (gh, gw) = (" + gh + ", " + gw +
                  "), from group_size=" + py_group_repr(p.group_h, p.group_w) +
                  " and pooled_size=" + py_pair_repr(p.P, p.Q) + ")");
  }
  return p.output_dim;
}

// geometry.ps_channel_map (output_dim, P, Q) (mx_roi::geo::ps_channel, the GPU path's
// rule too); kept per thread for the last grid (the pointer is good until this thread asks for
// another)
inline const int* ps_channel_map(const PsGrid& p) {
  static thread_local std::vector<int> map;
  static thread_local long long key[5] = {-1, -1, -1, -1, -1};
  const long long now[5] = {p.output_dim, p.P, p.Q, p.Gh(), p.Gw()};
  if (!std::equal(now, now + 5, key)) {
    map.assign((size_t)(p.output_dim * p.P * p.Q), 0);
    size_t i = 0;
    for (long long c = 0; c < p.output_dim; ++c)
      for (long long y = 0; y < p.P; ++y)
        for (long long x = 0; x < p.Q; ++x)
          map[i++] = mx_roi::geo::ps_channel(c, (int)y, (int)x, (int)p.P, (int)p.Q,
                                             (int)p.Gh(), (int)p.Gw());
    std::copy(now, now + 5, key);
  }
  return map.data();
}

// ---- an optional third input (DeformablePSROIPooling's trans) ---------------------------
// An op that declares ``static int num_inputs(const Params&)`` (2 or 3) and ``EXTRA_INPUT``
// (the input's name) takes a third input after data and rois when num_inputs says 3, of
// the data's dtype; Callbacks then checks its shape with Op::check_extra_shape(p, shape, R)
// once known, hands it (nullptr when absent) to Op::forward<T, A>(p, data, rois, extra,
// out) and Op::backward<T, A>(p, grad, data, rois, extra, bottom, extra_grad) -- whole
// calls: such an op runs its own checks, in its Custom path's order, and builds no Call --
// and zeroes its gradient before the backward (as the rois').  Ops that declare neither
// keep the two-input callbacks unchanged (ExtraInput's false case).
template <typename Op, typename = void>
struct ExtraInput : std::false_type {
  static int count(const typename Op::Params&) { return 2; }
  static std::string name() { return ""; }
  static void check_shape(const typename Op::Params&,
                          const std::vector<std::vector<unsigned int>>&) {}
  static void check_tensor(const typename Op::Params&, const std::vector<int64_t>&, long long) {}
};

template <typename Op>
struct ExtraInput<Op, decltype((void)Op::num_inputs(std::declval<const typename Op::Params&>()))>
    : std::true_type {
  static int count(const typename Op::Params& p) { return Op::num_inputs(p); }
  static std::string name() { return Op::EXTRA_INPUT; }
  // its shape, once known (an unknown one, a free graph variable, is not inferred)
  static void check_shape(const typename Op::Params& p,
                          const std::vector<std::vector<unsigned int>>& in) {
    if (in.size() > 2 && !in[2].empty()) Op::check_extra_shape(p, in[2], in[1][0]);
  }
  // a given array's shape (R rois)
  static void check_tensor(const typename Op::Params& p, const std::vector<int64_t>& shape,
                           long long R) {
    Op::check_extra_shape(p, shape, R);
  }
};

// ---- the Custom door's shape and dtype messages (registry.RoIOp.out_shape, check_out_size,
// check_dtypes, _Prop.infer_type), word for word: the fuzz (mx_roi.ext.fuzz) compares them
const unsigned int UNKNOWN_DIM = 0xffffffffu;  // an unknown dimension in lib_api's shapes

inline std::string shape_repr_known(const std::vector<unsigned int>& s) {
  std::string out = "(";
  for (size_t i = 0; i < s.size(); ++i)
    out += (i ? ", " : "") + (s[i] == UNKNOWN_DIM ? std::string("-1") : std::to_string(s[i]));
  return out + (s.size() == 1 ? ",)" : ")");
}
inline std::string shape_repr_known(const std::vector<int64_t>& s) { return shape_repr(s); }

// RoIOp.out_shape's checks of data (N, C, H, W) and rois (R, columns)
template <typename S>
void check_shapes(const std::string& op, const S& data, const S& rois, unsigned columns,
                  const char* layout) {
  if (data.size() != 4)
    throw OpError(op + ": data must be 4-D (N, C, H, W), got shape " + shape_repr_known(data));
  if (rois.size() != 2 || rois[1] != columns)
    throw OpError(op + ": rois must have shape (R, " + std::to_string(columns) + ") = " +
                  layout + ", got " + shape_repr_known(rois));
}

// numpy's name of an MXNet dtype code (lib_api.h's MXDType; mshadow's codes beyond it)
inline std::string dtype_name(int code) {
  static const char* const names[] = {"float32", "float64", "float16", "uint8", "int32",
                                      "int8",    "int64",   "bool",    "int16", "uint16",
                                      "uint32",  "uint64"};
  return code >= 0 && code < 12 ? names[code] : "dtype code " + std::to_string(code);
}

// RoIOp.check_dtypes: one dtype of float16/32/64 for data and rois
inline void check_dtypes(const std::string& op, int data, int rois) {
  if (data != rois)
    throw OpError(op + ": data and rois must have the same dtype, got data " + dtype_name(data) +
                  " and rois " + dtype_name(rois));
  if (data != kFloat32 && data != kFloat64 && data != kFloat16)
    throw OpError(op + ": dtype " + dtype_name(data) +
                  " is not supported (float16, float32, float64)");
}

// An extra input's dtype: the data's (registry's infer_type message)
template <typename Op>
void check_extra_dtype(int data, int extra) {
  if (extra == data) return;
  const std::string n = ExtraInput<Op>::name();
  throw OpError(std::string(Op::OP) + ": data and " + n + " must have the same dtype, got "
                "data " + dtype_name(data) + " and " + n + " " + dtype_name(extra));
}

template <typename P, typename = void>
struct has_output_dim : std::false_type {};
template <typename P>
struct has_output_dim<P, decltype((void)std::declval<P>().output_dim)> : std::true_type {};

// RoIOp.check_out_size of (R, C_out, P, Q) (-1: unknown, counted as 1, as an empty one)
inline void check_out_size(const std::string& op, const std::vector<long long>& shape,
                           bool output_dim) {
  unsigned __int128 size = 1;
  bool empty = false;
  std::string text = "(";
  for (size_t i = 0; i < shape.size(); ++i) {
    size *= (unsigned __int128)(shape[i] > 1 ? shape[i] : 1);
    empty = empty || shape[i] <= 0;
    text += (i ? ", " : "") + std::to_string(shape[i]);
  }
  if (size <= (unsigned __int128)MAX_ELEMENTS) return;
  throw OpError(op + ": output shape " + text + ") (rois, " +
                (output_dim ? "output_dim" : "data channels") + ", pooled_size) " +
                (empty ? "would have (empty or unknown dimensions at 1)" : "has") + " " +
                u128_str(size) + " elements, more than " + std::to_string(MAX_ELEMENTS) +
                " (2^31 - 2, the most elements of an MXNet array): reduce " +
                (output_dim ? "pooled_size, output_dim or the number of rois"
                            : "pooled_size, the number of rois or the data's channels"));
}

// The lib_api callbacks of an op with inputs (data (N, C, H, W), rois (R, 5), or (R,
// Op::ROI_COLUMNS): RoiLayout) of one dtype and output (R, Op::out_channels(p, C), P, Q).
// Op gives: OP (its name in messages),
// Params (with P, Q), parse(attrs), out_channels(p, C), geometry<T, A>(p, data, rois),
// forward<T, A>(p, call, data, out) and backward<T, A>(p, call, grad, data, bottom) -- call:
// the Call (channels checked, geometry built; only with R >= 1, and the op's kernels only
// with n >= 1), bottom: the zeroed accumulator of the input gradient, in the compute dtype A.
// The backward writes the rois' gradient as zeros (over which an optional
// Op::rois_backward writes its own) and, for float16, rounds the float32
// accumulator into the gradient once (the Custom path's grad_buffer / grad_value).  MXNet passes no req (see mx_roi.ext.add_safe).
template <typename Op>
struct Callbacks {
  typedef std::unordered_map<std::string, std::string> Attrs;

  static void check(const MXTensor& data, const MXTensor& rois) {
    check_shapes(Op::OP, data.shape, rois.shape, RoiLayout<Op>::columns,
                 RoiLayout<Op>::layout());
    check_dtypes(Op::OP, data.dtype, rois.dtype);
  }

  // Op::parse(attrs), memoised per thread: MXNet hands every callback of one imperative
  // call the same string map (ParseAttrs, num_inputs, num_outputs, InferShape, InferType,
  // FCompute: six parses of ~3 us each).  The last few maps are kept whole and compared
  // with == (no copy, sort or allocation on a hit: the sorted-text key this replaced cost
  // ~0.5 us a callback, 3-6 us a small fwd+bwd).  Errors are not kept: a bad value is
  // parsed, and reported, each time.  Each entry has a serial of its own (never reused,
  // on any thread): KeptGeometry's name for the parameters.
  struct Parsed {
    typename Op::Params p;
    unsigned long long serial;
  };
  static Parsed parsed(const Attrs& attrs) {
    static thread_local std::vector<std::pair<Attrs, Parsed>> memo;
    static std::atomic<unsigned long long> serials(0);
    for (size_t i = memo.size(); i-- > 0;)
      if (memo[i].first == attrs) return memo[i].second;
    const Parsed x = {Op::parse(attrs), ++serials};
    if (memo.size() >= 16) memo.erase(memo.begin());  // the oldest goes
    memo.emplace_back(attrs, x);
    return x;
  }
  static typename Op::Params params(const Attrs& attrs) { return parsed(attrs).p; }

  static MXReturnValue parse_attrs(const Attrs& attrs, int* num_in, int* num_out) {
    MX_ROI_EXT_CALL(*num_in = ExtraInput<Op>::count(params(attrs)); *num_out = 1;)
  }

  static MXReturnValue infer_type(const Attrs& attrs, std::vector<int>* in_types,
                                  std::vector<int>* out_types) {
    MX_ROI_EXT_CALL({
      int& d = (*in_types)[0];
      int& r = (*in_types)[1];
      if (d < 0 || d == kUNSET) d = r;
      if (r < 0 || r == kUNSET) r = d;
      if (d >= 0 && d != kUNSET)  // (the Custom door's infer_type and forward messages)
        check_dtypes(Op::OP, d, r);
      for (size_t i = 2; i < in_types->size(); ++i) {  // an extra input (ExtraInput)
        int& e = (*in_types)[i];
        if (e < 0 || e == kUNSET) e = d;
        check_extra_dtype<Op>(d, e);
      }
      (*out_types)[0] = d;
    })
  }

  static MXReturnValue infer_shape(const Attrs& attrs,
                                   std::vector<std::vector<unsigned int>>* in_shapes,
                                   std::vector<std::vector<unsigned int>>* out_shapes) {
    MX_ROI_EXT_CALL({
      const typename Op::Params p = params(attrs);
      const auto& d = (*in_shapes)[0];
      const auto& r = (*in_shapes)[1];
      check_shapes(Op::OP, d, r, RoiLayout<Op>::columns, RoiLayout<Op>::layout());
      // RoIOp.out_shape then check_out_size (the fuzz found MXNet's own "larger than 2^31
      // elements" in place of the op's message); an unknown dimension is (unsigned)-1
      const long long C = d[1] == UNKNOWN_DIM ? -1 : (long long)Op::out_channels(p, d[1]);
      check_out_size(Op::OP, {r[0] == UNKNOWN_DIM ? -1 : (long long)r[0], C, p.P, p.Q},
                     has_output_dim<typename Op::Params>::value);
      (*out_shapes)[0] = {r[0], (unsigned int)C, (unsigned int)p.P, (unsigned int)p.Q};
      ExtraInput<Op>::check_shape(p, *in_shapes);
    })
  }

  static MXReturnValue forward(const Attrs& attrs, std::vector<MXTensor>* inputs,
                               std::vector<MXTensor>* outputs, const OpResource& res) {
    const ::mx_roi_ext::CallbackTimer timer(0);
    MX_ROI_EXT_CALL(forward_checked(attrs, inputs, outputs);)
  }

  // inputs: data, rois[, extra]; outputs: the output.  Throws for a bad input.
  static void forward_checked(const Attrs& attrs, std::vector<MXTensor>* inputs,
                              std::vector<MXTensor>* outputs) {
    const Parsed x = parsed(attrs);
    const typename Op::Params& p = x.p;
    const MXTensor &data = (*inputs)[0], &rois = (*inputs)[1];
    check(data, rois);
    advise_fresh(*outputs);
    dispatch_dtype(Op::OP, data.dtype, [&](auto* t, auto* a) {
      typedef typename std::remove_pointer<decltype(t)>::type T;
      typedef typename std::remove_pointer<decltype(a)>::type A;
      run_forward<T, A>(ExtraInput<Op>(), p, {x.serial, false}, data, rois,
                        inputs->size() > 2 ? &(*inputs)[2] : nullptr, (*outputs)[0]);
    });
  }

  // A call of the Custom door's native backend (mx_roi_ext_invoke; mx_roi.cuda.library_calls):
  // the forward (direction 0) or the backward (1), a bad input thrown -- the backward's too,
  // which the Custom door raises (its caller then takes the checked path for the message)
  // The arrays are those MXNet would hand the native operator (a C caller's other counts
  // are refused, never indexed past): the forward data, rois[, extra] -> the output; the
  // backward the out-grad and those inputs -> a gradient of each.
  static void invoke(int direction, const Attrs& attrs, std::vector<MXTensor>* inputs,
                     std::vector<MXTensor>* outputs) {
    const size_t n = (size_t)ExtraInput<Op>::count(params(attrs));
    if (direction != 0 && direction != 1)
      throw OpError(std::string(Op::OP) + ": mx_roi_ext_invoke: direction " +
                    std::to_string(direction) + " (0: forward, 1: backward)");
    const size_t want_in = direction == 0 ? n : n + 1, want_out = direction == 0 ? 1 : n;
    if (inputs->size() != want_in || outputs->size() != want_out)
      throw OpError(std::string(Op::OP) + ": mx_roi_ext_invoke: the " +
                    (direction == 0 ? "forward" : "backward") + " takes " +
                    std::to_string(want_in) + " inputs and " + std::to_string(want_out) +
                    " outputs, got " + std::to_string(inputs->size()) + " and " +
                    std::to_string(outputs->size()));
    if (direction == 0)
      forward_checked(attrs, inputs, outputs);
    else
      backward_checked(attrs, inputs, outputs);
  }

  // Op::rois_backward<T, A>(p, call, grad, data, rois, rois_grad) where Op has one (the
  // rois' gradient, RoIOp.differentiates_rois; chosen by overload: int beats long), else
  // nothing: the rois keep the zeros
  template <typename T, typename A, typename O = Op>
  static auto rois_backward(int, const typename Op::Params& p, const Call<Op, T, A>& c,
                            const MXTensor& grad, const MXTensor& data, const MXTensor& rois,
                            MXTensor& rois_grad)
      -> decltype(O::template rois_backward<T, A>(p, c, grad, data, rois, rois_grad)) {
    return O::template rois_backward<T, A>(p, c, grad, data, rois, rois_grad);
  }
  template <typename T, typename A>
  static void rois_backward(long, const typename Op::Params&, const Call<Op, T, A>&,
                            const MXTensor&, const MXTensor&, const MXTensor&, MXTensor&) {}

  // Whether data is an empty map (H or W = 0 under np_shape; R >= 1): after the rois'
  // check (RoIOp.check_inputs' rule), the Custom path's answer is zeros (backend._forward),
  // and no geometry or kernel may run on it (they divide by and index the map's sides:
  // SIGFPE / SIGSEGV seen)
  template <typename T, typename A>
  static bool empty_map(const MXTensor& data, const MXTensor& rois) {
    if (numel(data.shape) > 0) return false;
    check_rois_status<T, A>(Op::OP, (const T*)rois.data_ptr, rois.shape[0],
                            RoiLayout<Op>::columns, data.shape[0]);
    return true;
  }

  template <typename T, typename A>
  static void run_forward(std::false_type, const typename Op::Params& p, KeepKey key,
                          const MXTensor& data, const MXTensor& rois, const MXTensor*,
                          MXTensor& out) {
    if (rois.shape[0] > 0 && empty_map<T, A>(data, rois)) {
      std::memset(out.data_ptr, 0, (size_t)numel(out.shape) * sizeof(T));
    } else if (rois.shape[0] > 0) {
      const Call<Op, T, A> c(p, data, rois, key);
      if (c.n > 0) Op::template forward<T, A>(p, c, data, out);
    }
  }

  template <typename T, typename A>
  static void run_forward(std::true_type, const typename Op::Params& p, KeepKey,
                          const MXTensor& data, const MXTensor& rois, const MXTensor* extra,
                          MXTensor& out) {
    Op::template forward<T, A>(p, data, rois, extra, out);
  }

  // inputs: out-grad, data, rois, [extra,] output (lib_api's order); outputs: d data,
  // d rois[, d extra] (one per input: an extra input is there when outputs has three)
  // An input error in the backward (the rois, shapes, dtype, parameters: what the forward
  // checks the same way and has reported already) leaves zero gradients and *succeeds*.
  // MXNet gives every extension op its CPU temp-space resource, a var each such op writes;
  // a failed op hands its exception to that var, and every later op on it (the next,
  // valid, training step's forward and backward) is then skipped without running -- its
  // output left as the pool's old memory, read with no error once the failed step's
  // error had been read (seen: 5 of 60 valid steps wrong, tests/test_ext_backward_safe.py).
  // The forward cannot avoid failing (its error is the user's), the backward can.
  static MXReturnValue backward(const Attrs& attrs, std::vector<MXTensor>* inputs,
                                std::vector<MXTensor>* outputs, const OpResource& res) {
    const ::mx_roi_ext::CallbackTimer timer(1);
    ::mx_roi_ext::begin_call();
    try {
      backward_checked(attrs, inputs, outputs);
    } catch (const OpError&) {
      for (MXTensor& t : *outputs) zero_tensor(t);
    } catch (const std::exception& e) {
      ::mx_roi_ext::set_error(e.what());
      return MX_FAIL;
    } catch (...) {
      ::mx_roi_ext::set_error("mx_roi: unknown error");
      return MX_FAIL;
    }
    return MX_SUCCESS;
  }

  // the bytes of ``t``'s elements (0: a dtype no op's output or gradient has)
  static size_t tensor_bytes(const MXTensor& t) {
    size_t item = 0;
    switch (t.dtype) {
      case mxnet::ext::kFloat16: item = 2; break;
      case mxnet::ext::kFloat32: item = 4; break;
      case mxnet::ext::kFloat64: item = 8; break;
      default: item = 0;  // (no gradient of another dtype reaches an op's backward)
    }
    return t.data_ptr ? (size_t)numel(t.shape) * item : 0;
  }

  // all of ``t``'s bytes zero (a gradient MXNet allocated for its shape and dtype)
  static void zero_tensor(MXTensor& t) {
    const size_t bytes = tensor_bytes(t);
    if (bytes) std::memset(t.data_ptr, 0, bytes);
  }

  // MXNet's fresh memory of a call's outputs (forward: the output; backward: the
  // gradients) onto huge pages before the first touch (ext_common.h's advise_huge_pages;
  // the Custom door's native_program.py advises the same arrays)
  static void advise_fresh(std::vector<MXTensor>& outputs) {
    for (MXTensor& t : outputs) advise_huge_pages(t.data_ptr, tensor_bytes(t));
  }

  static void backward_checked(const Attrs& attrs, std::vector<MXTensor>* inputs,
                               std::vector<MXTensor>* outputs) {
    {
      const Parsed x = parsed(attrs);
      const typename Op::Params& p = x.p;
      const MXTensor &grad = (*inputs)[0], &data = (*inputs)[1], &rois = (*inputs)[2];
      const bool has_extra = outputs->size() > 2;
      const MXTensor* extra = has_extra ? &(*inputs)[3] : nullptr;
      MXTensor* extra_grad = has_extra ? &(*outputs)[2] : nullptr;
      check(data, rois);
      advise_fresh(*outputs);
      dispatch_dtype(Op::OP, data.dtype, [&](auto* t, auto* a) {
        typedef typename std::remove_pointer<decltype(t)>::type T;
        typedef typename std::remove_pointer<decltype(a)>::type A;
        MXTensor &data_grad = (*outputs)[0], &rois_grad = (*outputs)[1];
        if (rois_grad.data_ptr)  // (null: mx_roi_ext_invoke's call with the rois' req null)
          std::memset(rois_grad.data_ptr, 0, (size_t)numel(rois_grad.shape) * sizeof(T));
        if (extra_grad)  // zeros unless the op writes it
          std::memset(extra_grad->data_ptr, 0, (size_t)numel(extra_grad->shape) * sizeof(T));
        const long long size = numel(data.shape);
        const bool direct = std::is_same<T, A>::value;  // float16: a float32 accumulator
        A* bottom = direct ? (A*)data_grad.data_ptr
                           : (A*)scratch(1, (size_t)size * sizeof(A) + 16);
        std::memset(bottom, 0, (size_t)size * sizeof(A));
        run_backward<T, A>(ExtraInput<Op>(), p, {x.serial, true}, grad, data, rois, extra,
                           bottom, rois_grad, extra_grad);
        if (!direct) {
          T* out = (T*)data_grad.data_ptr;
          for (long long i = 0; i < size; ++i) out[i] = mx_roi::Traits<T>::store(bottom[i]);
        }
      });
    }
  }

  template <typename T, typename A>
  static void run_backward(std::false_type, const typename Op::Params& p, KeepKey key,
                           const MXTensor& grad, const MXTensor& data, const MXTensor& rois,
                           const MXTensor*, A* bottom, MXTensor& rois_grad, MXTensor*) {
    if (rois.shape[0] > 0 && !empty_map<T, A>(data, rois)) {
      const Call<Op, T, A> c(p, data, rois, key);
      if (c.n > 0) Op::template backward<T, A>(p, c, grad, data, bottom);
      // an op that differentiates its rois (PrRoIPool) writes their gradient over the
      // zeros
      if (rois_grad.data_ptr) rois_backward<T, A>(0, p, c, grad, data, rois, rois_grad);
    }
  }

  template <typename T, typename A>
  static void run_backward(std::true_type, const typename Op::Params& p, KeepKey,
                           const MXTensor& grad, const MXTensor& data, const MXTensor& rois,
                           const MXTensor* extra, A* bottom, MXTensor&, MXTensor* extra_grad) {
    Op::template backward<T, A>(p, grad, data, rois, extra, bottom, extra_grad);
  }
};

// ---- the "gpu" callbacks of an op on the native GPU path (opt-in; docs/gpu.md) ----------
// They parse and check as the CPU callbacks do, then call the op's entries in
// mx_roi.ext.cuda's launcher library (its MX_ROI_EXT_CUDA_LAUNCHER section), found through
// ext_main.cc.
extern "C" void* mx_roi_ext_gpu_symbol(const char* name);  // ext_main.cc

// The launcher's entry ``name`` (a clear error until mx_roi.ext.cuda.enable() ran)
template <typename F>
F gpu_entry(const char* op, const char* name) {
  const F fn = (F)mx_roi_ext_gpu_symbol(name);
  if (!fn)
    throw OpError(std::string(op) +
                  ": the native GPU path is opt-in and not enabled in this process: call "
                  "mx_roi.ext.cuda.enable() first, or use the Custom door on GPU contexts");
  return fn;
}

// ``bytes`` of MXNet's temporary GPU workspace for the call (null for none)
inline void* gpu_workspace(const char* op, const OpResource& res, unsigned long long bytes) {
  if (bytes > 0x7fffffffULL)  // OpResource::alloc_gpu takes an int
    throw OpError(std::string(op) + ": the call's device tables need " + std::to_string(bytes) +
                  " bytes, more than MXNet's workspace hands out");
  return bytes ? res.alloc_gpu((int)bytes) : nullptr;
}

// A launcher entry's failure (its message) as the callback's error
inline void gpu_call(int failed, const char* err) {
  if (failed) throw OpError(err);
}

// The "gpu" forward and backward of an op from its Gpu struct ``G``: ``G::Op`` (the op of
// Callbacks: parameters and input checks as on the CPU), ``G::OP``, ``G::tables(p, data,
// R, backward, res, &bytes)`` (the call's workspace) and ``G::forward(p, data, rois, out,
// ws, bytes, stream, err, len)`` / ``G::backward(p, grad, data, rois, in_grad, rois_grad,
// ws, bytes, stream, err, len)``, which call the op's launcher entries (0 or 1 and the
// message).  The backward's inputs: out-grad, data, rois; outputs: their gradients, as the
// CPU backward's.  An op with a third input (ExtraInput: DeformablePSROIPooling's trans)
// gets it after the rois in each of the three -- ``G::tables(p, data, R, extra, ...)``,
// ``G::forward(p, data, rois, extra, out, ...)``, ``G::backward(p, grad, data, rois,
// extra, in_grad, rois_grad, extra_grad, ...)`` -- null where the parameters take none;
// its shape and dtype checked here as on the CPU.  A bad roi (or offset) is not the
// backward's error (the launcher reports it at the next forward); deterministic=True (the
// cuda backend's fixed-point backward) is refused.
template <typename G>
struct GpuCallbacks {
  typedef typename G::Op Op;
  typedef ExtraInput<Op> Extra;

  static MXReturnValue forward(const std::unordered_map<std::string, std::string>& attrs,
                               std::vector<MXTensor>* inputs, std::vector<MXTensor>* outputs,
                               const OpResource& res) {
    MX_ROI_EXT_CALL({
      const typename Op::Params p = Callbacks<Op>::params(attrs);
      const MXTensor &data = (*inputs)[0], &rois = (*inputs)[1];
      Callbacks<Op>::check(data, rois);
      const MXTensor* extra = extra_input(p, *inputs, 2, data, rois);
      char err[4096] = "";
      gpu_call(run_forward(Extra(), p, data, rois, extra, (*outputs)[0], res, err, sizeof err),
               err);
    })
  }

  static MXReturnValue backward(const std::unordered_map<std::string, std::string>& attrs,
                                std::vector<MXTensor>* inputs, std::vector<MXTensor>* outputs,
                                const OpResource& res) {
    MX_ROI_EXT_CALL({
      const typename Op::Params p = Callbacks<Op>::params(attrs);
      const MXTensor &grad = (*inputs)[0], &data = (*inputs)[1], &rois = (*inputs)[2];
      Callbacks<Op>::check(data, rois);
      const MXTensor* extra = extra_input(p, *inputs, 3, data, rois);
      if (p.deterministic)  // (the CuPy path's fixed-point accumulation: not here yet)
        throw OpError(std::string(G::OP) +
                      ": deterministic=True: the native GPU path has no deterministic "
                      "backward yet; use the Custom door on GPU contexts for it");
      char err[4096] = "";
      gpu_call(run_backward(Extra(), p, grad, data, rois, extra, *outputs, res, err, sizeof err),
               err);
    })
  }

 private:
  // The op's third input (``inputs[at]``) where its parameters take one, its shape and
  // dtype checked; else null
  static const MXTensor* extra_input(const typename Op::Params& p,
                                     const std::vector<MXTensor>& inputs, size_t at,
                                     const MXTensor& data, const MXTensor& rois) {
    if (Extra::count(p) < 3) return nullptr;
    if (inputs.size() <= at)
      throw OpError(std::string(G::OP) + ": the " + Extra::name() + " input is missing");
    const MXTensor& e = inputs[at];
    check_extra_dtype<Op>(data.dtype, e.dtype);
    Extra::check_tensor(p, e.shape, rois.shape[0]);
    return &e;
  }

  static int run_forward(std::false_type, const typename Op::Params& p, const MXTensor& data,
                         const MXTensor& rois, const MXTensor*, MXTensor& out,
                         const OpResource& res, char* err, size_t len) {
    unsigned long long bytes = 0;
    void* ws = G::tables(p, data, rois.shape[0], false, res, &bytes);
    return G::forward(p, data, rois, out, ws, bytes, res.get_cuda_stream(), err, len);
  }

  static int run_forward(std::true_type, const typename Op::Params& p, const MXTensor& data,
                         const MXTensor& rois, const MXTensor* extra, MXTensor& out,
                         const OpResource& res, char* err, size_t len) {
    unsigned long long bytes = 0;
    void* ws = G::tables(p, data, rois.shape[0], extra, false, res, &bytes);
    return G::forward(p, data, rois, extra, out, ws, bytes, res.get_cuda_stream(), err, len);
  }

  static int run_backward(std::false_type, const typename Op::Params& p, const MXTensor& grad,
                          const MXTensor& data, const MXTensor& rois, const MXTensor*,
                          std::vector<MXTensor>& outputs, const OpResource& res, char* err,
                          size_t len) {
    unsigned long long bytes = 0;
    void* ws = G::tables(p, data, rois.shape[0], true, res, &bytes);
    return G::backward(p, grad, data, rois, outputs[0], outputs[1], ws, bytes,
                       res.get_cuda_stream(), err, len);
  }

  static int run_backward(std::true_type, const typename Op::Params& p, const MXTensor& grad,
                          const MXTensor& data, const MXTensor& rois, const MXTensor* extra,
                          std::vector<MXTensor>& outputs, const OpResource& res, char* err,
                          size_t len) {
    unsigned long long bytes = 0;
    void* ws = G::tables(p, data, rois.shape[0], extra, true, res, &bytes);
    return G::backward(p, grad, data, rois, extra, outputs[0], outputs[1],
                       extra && outputs.size() > 2 ? &outputs[2] : nullptr, ws, bytes,
                       res.get_cuda_stream(), err, len);
  }
};

}  // namespace mx_roi_op

// Registers ``Op`` (a struct as Callbacks wants) as the MXNet operator ``Name``, and its
// launcher for mx_roi_ext_invoke under the same name.
#define MX_ROI_EXT_REGISTER(Name, Op)                                        \
  static const ::mx_roi_ext::RegisterInvoke Name##_invoke(                   \
      #Name, mx_roi_op::Callbacks<Op>::invoke);                              \
  REGISTER_OP(Name)                                                          \
      .setForward(mx_roi_op::Callbacks<Op>::forward, "cpu")                  \
      .setBackward(mx_roi_op::Callbacks<Op>::backward, "cpu")                \
      .setParseAttrs(mx_roi_op::Callbacks<Op>::parse_attrs)                  \
      .setInferType(mx_roi_op::Callbacks<Op>::infer_type)                    \
      .setInferShape(mx_roi_op::Callbacks<Op>::infer_shape)
