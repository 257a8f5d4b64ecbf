// The native GPU path's op entry points (C functions, callable through ctypes with raw
// device pointers and a stream handle; ext_cuda.h launches them).  Built by mx_roi.ext.cuda
// into a library of its own (mx_roi_ext_cuda-<key>.so), with ext_cuda_kernels.h, the PTX
// that NVRTC made of each op's .cu text at build time.  Today: ROIAlign's forward and
// backward.
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
const int MODE_ALIGN_GRID = 2, MODE_CAFFE_GRID = 3;

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

// device_geometry.grid_widths, then the layout; false where the tables cannot be built on
// the device (more than MAX_SAMPLES_PER_AXIS points along an axis)
inline bool grid_layout(int mode, int P, int Q, int H, int W, int sample, long long R,
                        size_t acc, GridLayout& g) {
  long long gy, gx;
  if (mode == MODE_ALIGN_GRID && sample > 0) {
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
    total += (sizes[k] + 15) / 16 * 16;
  }
  g.bytes = total < 16 ? 16 : total;
  return true;
}

inline GridLayout roi_align_layout(const std::string& op, int dtype, long long R, int P,
                                   int Q, int H, int W, int sample_ratio, int caffe) {
  const Types t = types_of(op, dtype);
  GridLayout g;
  if (!grid_layout(caffe ? MODE_CAFFE_GRID : MODE_ALIGN_GRID, P, Q, H, W,
                   caffe ? 0 : sample_ratio, R, t.acc_size, g))
    throw Error(op + ": the native GPU path cannot build this call's sample grid on the "
                "device (more than " + std::to_string(MAX_SAMPLES_PER_AXIS) +
                " sample points along an axis); use the Custom door");
  return g;
}

// A ROIAlign call's sample grid (both directions): the tables' layout over the
// workspace, checked against the kernels' limits; geometry() queues roi_grid_geometry,
// which fills the tables and marks a bad roi (as padding, in the channel's status word).
struct RoiAlignGrid {
  GridLayout g;
  CUdeviceptr tb[12];  // batch, y_count .. y_wh, x_count .. x_wh, divisor
  std::string ta;      // "<T, A" of the kernels' names
  bool is_max;

  RoiAlignGrid(const std::string& op, const Types& t, int dtype, long long R, int P, int Q,
               long long H, long long W, int sample_ratio, int pool_max, int caffe,
               CUdeviceptr workspace)
      : g(roi_align_layout(op, dtype, R, P, Q, (int)H, (int)W, sample_ratio, caffe)),
        ta(std::string("<") + t.T + ", " + t.A), is_max(pool_max || caffe) {
    if (is_max && (long long)g.Gy * g.Gx >= (1LL << 31))  // the running argmax is an int
      throw Error(op + ": " + std::to_string(g.Gy) + "x" + std::to_string(g.Gx) +
                  " sample points per bin are too many for pool_mode='max' on the CUDA "
                  "backend");
    for (int k = 0; k < 12; ++k) tb[k] = workspace + g.offset[k];
  }

  void geometry(const std::string& op, CUcontext ctx, const Channel& ch, const Types& t,
                CUdeviceptr rois, long long N, long long H, long long W, long long R, int P,
                int Q, float spatial_scale, int sample_ratio, int aligned, int caffe,
                CUstream stream) const {
    Args geo;
    geo(rois)(caffe ? MODE_CAFFE_GRID : MODE_ALIGN_GRID)(P)(Q)((int)H)((int)W)(
        caffe ? 0 : sample_ratio)(caffe ? 0 : (aligned ? 1 : 0))(spatial_scale)(g.Gy)(g.Gx)(
        (long long)N)(GUARD_BOUND)(t.bounded ? 1 : 0);
    for (int k = 0; k < 12; ++k) geo(tb[k]);
    geo(ch.status)((long long)R);
    launch(op, function(op, ctx, ROI_ALIGN_IMAGE, "roi_grid_geometry" + ta + ">"), R, stream,
           geo);
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
  const std::string op = "ROIAlign";
  const Types t = types_of(op, dtype);
  CUcontext ctx = current_context(op);
  Channel& ch = channel(op, ctx, stream);
  std::lock_guard<std::mutex> guard(ch.lock);
  report(op, ch, stream, false);
  if (R <= 0) return;  // no roi: nothing to launch (the output is empty)
  const RoiAlignGrid grid(op, t, dtype, R, P, Q, H, W, sample_ratio, pool_max, caffe,
                          workspace);
  if (workspace_bytes < grid.g.bytes)
    throw Error(op + ": the workspace holds " + std::to_string(workspace_bytes) +
                " bytes but the call's tables need " + std::to_string(grid.g.bytes));
  grid.geometry(op, ctx, ch, t, rois, N, H, W, R, P, Q, spatial_scale, sample_ratio, aligned,
                caffe, stream);
  const long long n = R * C * P * Q;
  Args k;
  k(data);
  for (int i = 0; i < 11; ++i) k(grid.tb[i]);  // batch .. x_wh
  if (!grid.is_max) k(grid.tb[11]);            // divisor
  k((int)C)((int)H)((int)W)(P)(Q)(grid.g.Gy)(grid.g.Gx)(out);
  if (grid.is_max) k(workspace)(0);            // argmax (never written: store_argmax 0)
  k(n);
  launch(op,
         function(op, ctx, ROI_ALIGN_IMAGE,
                  grid.is_max ? "roi_align_forward_max" + grid.ta + ", unsigned char>"
                              : "roi_align_forward_avg" + grid.ta + ">"),
         n, stream, k);
  record(op, ch, stream);
}

// A ROIAlign backward's workspace: the tables (as the forward's), then for float16 the
// float32 accumulator of the data gradient (Launch.grad_buffer's temporary); 0 for R = 0.
// ``*acc_offset``: where the accumulator starts.
inline unsigned long long roi_align_backward_bytes(int dtype, long long N, long long C,
                                                   long long H, long long W, long long R, int P,
                                                   int Q, int sample_ratio, int caffe,
                                                   unsigned long long* acc_offset = nullptr) {
  if (R <= 0) return 0;
  const GridLayout g = roi_align_layout("ROIAlign", dtype, R, P, Q, (int)H, (int)W,
                                        sample_ratio, caffe);
  if (acc_offset) *acc_offset = g.bytes;  // (a multiple of 16)
  return g.bytes + (dtype == DTYPE_FLOAT16 ? (N * C * H * W * 4 + 15) / 16 * 16 : 0);
}

// ROIAlign's backward (roi_align.py backward_cuda on device-built tables, as the CuPy path's
// _backward_device runs it with req write): the accumulator zeroed -- the data gradient
// itself, or for float16 a float32 one in the workspace (the rois' gradient too, where
// given: ROIAlign does not differentiate its rois) --, the geometry kernel, then
// roi_align_backward_avg or, for pool_mode 'max' / legacy 'caffe',
// roi_align_backward_max_rescan (the forward kept no argmax: the winners are found again
// in ``data``), and for float16 store_float_as (ext_cuda_cast.cu) into the gradient; all
// on ``stream``.
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
  const std::string op = "ROIAlign";
  const Types t = types_of(op, dtype);
  const bool half = dtype == DTYPE_FLOAT16;
  const size_t item = dtype == DTYPE_FLOAT64 ? 8 : half ? 2 : 4;
  CUcontext ctx = current_context(op);
  Channel& ch = channel(op, ctx, stream);
  std::lock_guard<std::mutex> guard(ch.lock);
  unsigned long long acc_at = 0;
  const unsigned long long need = roi_align_backward_bytes(dtype, N, C, H, W, R, P, Q,
                                                           sample_ratio, caffe, &acc_at);
  if (workspace_bytes < need)
    throw Error(op + ": the workspace holds " + std::to_string(workspace_bytes) +
                " bytes but the call's tables and accumulator need " + std::to_string(need));
  const Driver& d = driver();
  const long long size = N * C * H * W;
  if (R <= 0) {  // no roi: the gradient is zeros
    check(op, d.cuMemsetD8Async(in_grad, 0, (size_t)size * item, stream), "cuMemsetD8Async");
    return;
  }
  const RoiAlignGrid grid(op, t, dtype, R, P, Q, H, W, sample_ratio, pool_max, caffe,
                          workspace);
  // the kernels add into ``bottom``: MXNet's gradient, or the float32 accumulator
  const CUdeviceptr bottom = half ? workspace + acc_at : in_grad;
  check(op, d.cuMemsetD8Async(bottom, 0, (size_t)size * (half ? 4 : item), stream),
        "cuMemsetD8Async");
  if (rois_grad)
    check(op, d.cuMemsetD8Async(rois_grad, 0, (size_t)R * 5 * item, stream),
          "cuMemsetD8Async");
  grid.geometry(op, ctx, ch, t, rois, N, H, W, R, P, Q, spatial_scale, sample_ratio, aligned,
                caffe, stream);
  const long long n = R * C * P * Q;
  Args k;
  if (grid.is_max) k(data);
  k(grad);
  for (int i = 0; i < 11; ++i) k(grid.tb[i]);  // batch .. x_wh
  if (!grid.is_max) k(grid.tb[11]);            // divisor
  k((int)C)((int)H)((int)W)(P)(Q)(grid.g.Gy)(grid.g.Gx)(bottom)(1.0)(n);  // bottom, scale, n
  launch(op,
         function(op, ctx, ROI_ALIGN_IMAGE,
                  (grid.is_max ? "roi_align_backward_max_rescan" : "roi_align_backward_avg") +
                      grid.ta + ", " + t.A + ">"),
         n, stream, k);
  if (half) {
    Args c;
    c(bottom)(in_grad)(size);
    launch(op, function(op, ctx, CAST_IMAGE, "store_float_as<__half>"), size, stream, c);
  }
  record(op, ch, stream);
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

extern "C" {

// The workspace bytes of a ROIAlign forward (the device tables): 0, or 1 with the message.
int mx_roi_ext_cuda_roi_align_workspace(int dtype, long long R, int P, int Q, int H, int W,
                                        int sample_ratio, int caffe, unsigned long long* bytes,
                                        char* err, size_t err_len) {
  return mx_roi_cuda::c_entry(err, err_len, [&]() {
    *bytes = R <= 0 ? 0
                    : mx_roi_cuda::roi_align_layout("ROIAlign", dtype, R, P, Q, H, W,
                                                    sample_ratio, caffe).bytes;
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
