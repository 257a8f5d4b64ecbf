// The native GPU path's launcher library (mx_roi.ext.cuda builds it: mx_roi_ext_cuda-<key>.so):
// what every op's entries share, then the ops' entry points -- each op's
// MX_ROI_EXT_CUDA_LAUNCHER section of its .cu file, gathered by mx_roi.ext.cuda into
// ext_cuda_sections.h -- C functions callable through ctypes with raw device pointers and
// a stream handle, which ext_cuda.h's driver calls launch; ext_cuda_kernels.h holds the PTX
// that NVRTC made of each op's .cu text (and of ext_cuda_cast.cu) at build time.
//
// Return value of every entry: 0 done (queued), 1 an error (its message in ``err``:
// "<Op>: <problem>..."), nothing queued by the call except, after a reported status, the
// status word's reset.
#include "ext_cuda.h"
#include "ext_cuda_kernels.h"

namespace mx_roi_cuda {

// mxnet::ext::MXDType codes (lib_api.h), the dtype argument of every entry
const int DTYPE_FLOAT32 = 0, DTYPE_FLOAT64 = 1, DTYPE_FLOAT16 = 2;
// onednn.GUARD_BOUND; geometry.MAX_SAMPLES_PER_AXIS
const double GUARD_BOUND = 3.0e38;
const long long MAX_SAMPLES_PER_AXIS = 1LL << 22;
// compiled_geometry.MODES
const int MODE_POOL_BINS = 0, MODE_PS_POOL_BINS = 1, MODE_ALIGN_GRID = 2, MODE_CAFFE_GRID = 3,
          MODE_RFCN_GRID = 4;

// The kernels' template arguments (T, A) of a dtype (source.TYPE_PAIRS), the compute
// dtype's size, and whether the roi check bounds coordinates (onednn.bounded_dtype).
struct Types {
  const char* T;
  const char* A;
  size_t acc_size;
  bool bounded;
};

inline Types types_of(const std::string& op, int dtype) {
  switch (dtype) {
    case DTYPE_FLOAT32: return {"float", "float", 4, true};
    case DTYPE_FLOAT64: return {"double", "double", 8, true};
    case DTYPE_FLOAT16: return {"__half", "float", 4, false};
    default:
      throw Error(op + ": data must be float16, float32 or float64 (MXNet dtype code " +
                  std::to_string(dtype) + ")");
  }
}

// A sample grid's device tables over one workspace, as device_geometry.build lays them
// out (_carve: 16-byte aligned, in this order): batch (R,), then per axis (y: P, x: Q)
// count (R, pooled), low, high (R, pooled, G) int32, wl, wh (R, pooled, G) compute dtype,
// then divisor (R, P, Q).  ``offset[k]`` of table k in that order; ``bytes`` in all.
struct GridLayout {
  int Gy = 0, Gx = 0;
  size_t offset[12] = {};
  size_t bytes = 0;
};

// ``bytes`` rounded up to a multiple of 16 (device_geometry._carve's alignment of every
// array a call keeps in its workspace)
inline unsigned long long aligned16(unsigned long long bytes) {
  return (bytes + 15) / 16 * 16;
}

// device_geometry.grid_widths, then the layout; false where the tables cannot be built on
// the device (more than MAX_SAMPLES_PER_AXIS points along an axis)
inline bool grid_layout(int mode, int P, int Q, int H, int W, int sample, long long R,
                        size_t acc, GridLayout& g) {
  long long gy, gx;
  if ((mode == MODE_ALIGN_GRID && sample > 0) || mode == MODE_RFCN_GRID) {
    gy = gx = sample;
  } else {
    gy = (H + 1 + P - 1) / P + 1;
    gx = (W + 1 + Q - 1) / Q + 1;
  }
  if (gy < 1 || gy * P > MAX_SAMPLES_PER_AXIS || gx * Q > MAX_SAMPLES_PER_AXIS) return false;
  g.Gy = (int)gy;
  g.Gx = (int)gx;
  const size_t sizes[12] = {
      (size_t)R * 4,
      (size_t)R * P * 4, (size_t)(R * P * gy) * 4, (size_t)(R * P * gy) * 4,
      (size_t)(R * P * gy) * acc, (size_t)(R * P * gy) * acc,
      (size_t)R * Q * 4, (size_t)(R * Q * gx) * 4, (size_t)(R * Q * gx) * 4,
      (size_t)(R * Q * gx) * acc, (size_t)(R * Q * gx) * acc,
      (size_t)(R * P * Q) * acc};
  size_t total = 0;
  for (int k = 0; k < 12; ++k) {
    g.offset[k] = total;
    total += aligned16(sizes[k]);
  }
  g.bytes = total < 16 ? 16 : total;
  return true;
}

// One entry call of ``op`` on ``stream``: the dtype's kernel types, the thread's CUDA
// context and the (context, stream, op) channel, locked for the call; what the call queues
// goes through it (every launch, memset and the status copy on the caller's stream).
struct CallScope {
  const std::string op;
  const CUstream stream;
  const Types t;
  const CUcontext ctx;
  Channel& ch;
  std::lock_guard<std::mutex> hold;

  CallScope(const std::string& op_, int dtype, CUstream stream_)
      : op(op_), stream(stream_), t(types_of(op_, dtype)), ctx(current_context(op_)),
        ch(channel(op_, ctx, stream_)), hold(ch.lock) {}

  // "<T, A" of the kernels' name expressions
  std::string ta() const { return std::string("<") + t.T + ", " + t.A; }
  // ``expression`` of ``image`` over ``n`` work items
  void run(const Image& image, const std::string& expression, long long n, Args& args) const {
    launch(op, function(op, ctx, image, expression), n, stream, args);
  }
  void zero(CUdeviceptr p, size_t bytes) const {
    check(op, driver().cuMemsetD8Async(p, 0, bytes, stream), "cuMemsetD8Async");
  }
  // the status of the channel's earlier calls (ext_cuda.h report: a forward asks first)
  void report() const { mx_roi_cuda::report(op, ch, stream, false); }
  // after the call's kernels: the status copy and the event (ext_cuda.h record)
  void record() const { mx_roi_cuda::record(op, ch, stream); }
};

// The bytes of one element of ``dtype``
inline size_t item_size(int dtype) {
  return dtype == DTYPE_FLOAT64 ? 8 : dtype == DTYPE_FLOAT16 ? 2 : 4;
}

// Throws unless the caller's workspace holds the call's ``need`` bytes
inline void need_workspace(const std::string& op, unsigned long long have,
                           unsigned long long need) {
  if (have < need)
    throw Error(op + ": the workspace holds " + std::to_string(have) +
                " bytes but the call needs " + std::to_string(need));
}

// A backward's workspace bytes: its ``tables``, then for float16 the float32 accumulator of
// the ``size``-element data gradient (Launch.grad_buffer's temporary), 16-byte aligned.
inline unsigned long long with_accumulator(unsigned long long tables, int dtype,
                                           long long size) {
  return tables + (dtype == DTYPE_FLOAT16 ? aligned16((unsigned long long)size * 4) : 0);
}

// A backward's gradients, req write (Launch.grad_buffer): the kernels add into ``bottom``,
// MXNet's data gradient itself or, for float16, the float32 accumulator at ``acc`` (the
// workspace after the tables); both zeroed on the stream here, with the rois' gradient
// (R rows of ``columns``; null: none) for an op that does not differentiate its rois.
// store() then rounds a float16 accumulator into the gradient (ext_cuda_cast.cu).
struct GradTarget {
  CUdeviceptr bottom, in_grad;
  long long size;
  bool half;

  GradTarget(const CallScope& call, int dtype, CUdeviceptr in_grad_, CUdeviceptr rois_grad,
             long long size_, long long R, int columns, CUdeviceptr acc)
      : bottom(dtype == DTYPE_FLOAT16 ? acc : in_grad_), in_grad(in_grad_), size(size_),
        half(dtype == DTYPE_FLOAT16) {
    call.zero(bottom, (size_t)size * (half ? 4 : item_size(dtype)));
    if (rois_grad && R > 0) call.zero(rois_grad, (size_t)R * columns * item_size(dtype));
  }

  void store(const CallScope& call) const {
    if (!half) return;
    Args c;
    c(bottom)(in_grad)(size);
    call.run(EXT_CUDA_CAST_IMAGE, "store_float_as<__half>", size, c);
  }
};

// ---- the device-built tables two ops share (device_geometry.build's layout) -------------
// The integer bins (the pooling ops') over one workspace (_carve: 16-byte
// aligned): batch (R,), hstart, hend (R, P), wstart, wend (R, Q), int32; ``cells``, the
// most cells per bin the tables allow (device_geometry.bin_cells: a roi with a larger bin
// is flagged in the status word, as a grid roi the tables cannot hold).
struct IntBins {
  int mode;
  CUdeviceptr tb[5];
  unsigned long long bytes = 0;
  long long cells;

  IntBins(int mode_, long long R, int P, int Q, long long H, long long W, CUdeviceptr workspace)
      : mode(mode_) {
    const long long counts[5] = {R, R * P, R * P, R * Q, R * Q};
    for (int k = 0; k < 5; ++k) {
      tb[k] = workspace + bytes;
      bytes += aligned16((unsigned long long)counts[k] * 4);
    }
    if (bytes < 16) bytes = 16;
    const long long by_side = ((H + 1 + P - 1) / P + 1) * ((W + 1 + Q - 1) / Q + 1);
    cells = mode == MODE_POOL_BINS && by_side < H * W ? by_side : H * W;
  }

  // roi_bins_geometry (of ``image``) on the call's stream: the tables filled, a bad roi
  // marked (padding, status)
  void geometry(const CallScope& call, const Image& image, CUdeviceptr rois, long long N,
                long long H, long long W, long long R, int P, int Q, float spatial_scale) const {
    Args geo;
    geo(rois)(mode)(P)(Q)((int)H)((int)W)(spatial_scale)(N)(GUARD_BOUND)(
        call.t.bounded ? 1 : 0)(cells);
    for (int k = 0; k < 5; ++k) geo(tb[k]);
    geo(call.ch.status)(R);
    call.run(image, "roi_bins_geometry" + call.ta() + ">", R, geo);
  }
};

// A sample grid's layout (device_geometry.grid_widths, then GridLayout), or the error of a
// call whose tables cannot be built on the device.
inline GridLayout sample_layout(const std::string& op, int dtype, int mode, long long R, int P,
                                int Q, long long H, long long W, int sample) {
  GridLayout g;
  if (!grid_layout(mode, P, Q, (int)H, (int)W, sample, R, types_of(op, dtype).acc_size, g))
    throw Error(op + ": the native GPU path cannot build this call's sample grid on the "
                "device (more than " + std::to_string(MAX_SAMPLES_PER_AXIS) +
                " sample points along an axis); use the Custom door");
  return g;
}

// A sample grid's device tables over one workspace (the align ops'); geometry()
// queues roi_grid_geometry, which fills them and marks a bad roi (as padding, in the
// channel's status word), then for an adaptive align grid (sample <= 0)
// roi_adaptive_bound, which marks a box over the samples-per-bin bound the same way
// (RoIOp._check_adaptive_grid's rule).  ``sample``, ``aligned``: the geometry kernel's (0
// where the mode has none).
struct SampleGrid {
  int mode, sample, aligned;
  GridLayout g;
  CUdeviceptr tb[12];  // batch, y_count .. y_wh, x_count .. x_wh, divisor

  SampleGrid(const std::string& op, int dtype, int mode_, long long R, int P, int Q,
             long long H, long long W, int sample_, int aligned_, CUdeviceptr workspace)
      : mode(mode_), sample(sample_), aligned(aligned_),
        g(sample_layout(op, dtype, mode_, R, P, Q, H, W, sample_)) {
    for (int k = 0; k < 12; ++k) tb[k] = workspace + g.offset[k];
  }

  void geometry(const CallScope& call, const Image& image, CUdeviceptr rois, long long N,
                long long H, long long W, long long R, int P, int Q, float spatial_scale) const {
    Args geo;
    geo(rois)(mode)(P)(Q)((int)H)((int)W)(sample)(aligned)(spatial_scale)(g.Gy)(g.Gx)(N)(
        GUARD_BOUND)(call.t.bounded ? 1 : 0);
    for (int k = 0; k < 12; ++k) geo(tb[k]);
    geo(call.ch.status)(R);
    call.run(image, "roi_grid_geometry" + call.ta() + ">", R, geo);
    if (mode != MODE_ALIGN_GRID || sample > 0) return;
    Args bound;
    bound(rois)(spatial_scale)(P)(Q)(tb[0])(call.ch.status)(R);
    call.run(image, "roi_adaptive_bound" + call.ta() + ">", R, bound);
  }

  // the op kernels' table arguments: batch .. x_wh, then the divisor where ``divisor``
  void tables(Args& k, bool divisor) const {
    for (int i = 0; i < 11; ++i) k(tb[i]);
    if (divisor) k(tb[11]);
  }
};

// ---- the checked copy of the rois (ops whose kernels read the rois themselves) ---------
// Its bytes in the workspace: (R, columns) of ``dtype``, 16-aligned
inline unsigned long long safe_rois_bytes(int dtype, long long R, int columns) {
  return aligned16((unsigned long long)R * columns * item_size(dtype));
}

// ---- the position-sensitive ops' channel map ------------------------------------------
// The kernels read input channels up to output_dim * Gh * Gw - 1 of ``Cin``: a call whose
// data has other than that many is refused (PositionSensitive.out_channels' rule).
inline void ps_check_channels(const std::string& op, long long Cin, long long output_dim,
                              int Gh, int Gw) {
  if (output_dim < 1 || Gh < 1 || Gw < 1 || Cin != output_dim * Gh * Gw)
    throw Error(op + ": data has " + std::to_string(Cin) + " channels but output_dim * gh " +
                "* gw = " + std::to_string(output_dim) + " * " + std::to_string(Gh) + " * " +
                std::to_string(Gw) + " = " + std::to_string(output_dim * Gh * Gw) +
                " are required");
}

// A position-sensitive call's workspace after its ``tables`` bytes: the channel map
// (output_dim, P, Q) int32 at ``map_at``, then for a float16 backward the float32
// accumulator of the ``size``-element data gradient at ``acc_at`` (with_accumulator);
// ``bytes`` in all.
struct PsWorkspace {
  unsigned long long map_at, acc_at, bytes;

  PsWorkspace(unsigned long long tables, int dtype, long long output_dim, int P, int Q,
              long long size, bool backward)
      : map_at(tables),
        acc_at(tables + aligned16((unsigned long long)(output_dim * P * Q) * 4)),
        bytes(backward ? with_accumulator(acc_at, dtype, size) : acc_at) {}
};

// The channel map's fill on the call's stream (ps_channel_map_fill of ``image``, per call:
// nothing is copied from the host).

inline void ps_fill_channel_map(const CallScope& call, const Image& image, CUdeviceptr map,
                                long long output_dim, int P, int Q, int Gh, int Gw) {
  const long long n = output_dim * P * Q;
  Args a;
  a(map)(P)(Q)(Gh)(Gw)(n);
  call.run(image, "ps_channel_map_fill" + call.ta() + ">", n, a);
}

// A C entry's body: 0 when ``body()`` returned, else 1 with its message in ``err``.
template <typename F>
int c_entry(char* err, size_t err_len, F&& body) {
  try {
    body();
    return 0;
  } catch (const std::exception& e) {
    put_message(e.what(), err, err_len);
    return 1;
  }
}

}  // namespace mx_roi_cuda

// ---- the ops' entries (each op's MX_ROI_EXT_CUDA_LAUNCHER section) ------------------------
#include "ext_cuda_sections.h"

extern "C" {

// The status report of ``op``'s channel on ``stream`` (ext_cuda.h): 0 nothing to report,
// 1 the error (in ``err``).  ``wait``: first wait for the channel's latest call (the only
// host wait of the native GPU path), else report only a call that has finished.
int mx_roi_ext_cuda_check(const char* op, void* stream, int wait, char* err, size_t err_len) {
  return mx_roi_cuda::c_entry(err, err_len, [&]() {
    const std::string name = op;
    mx_roi_cuda::CUcontext ctx = mx_roi_cuda::current_context(name);
    mx_roi_cuda::Channel& ch = mx_roi_cuda::channel(name, ctx, (mx_roi_cuda::CUstream)stream);
    std::lock_guard<std::mutex> guard(ch.lock);
    mx_roi_cuda::report(name, ch, (mx_roi_cuda::CUstream)stream, wait != 0);
  });
}

}  // extern "C"
