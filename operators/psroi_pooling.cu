// PSROIPooling kernels: mean over the integer bins of mx_roi.geometry.IntBins (0 when
// empty), output channel c at bin (p, q) reading input channel channel_map[c, p, q].
#include "roi_common.cuh"

#ifdef MX_ROI_HOST_NATIVE
// With at least 8 output channels and MX_ROI_PSP_LANES_READS cell reads (all bins of all
// rois, per channel) per cell a bin's planes copy, the native forward copies each bin's
// planes channels-last and sums a roi's bin for 8 channels at a time
// (mx_roi::ps_forward_channels_last): the copy streams the map once, where the plane walk
// reads each bin's few cells from 21 planes scattered over 15 MB.  R-FCN 7x7 / 256 rois
// on a 2 x 38 x 50 map (4.4 cells a bin, 0.3 reads per copied cell): kernel 4.0 -> 2.3 ms
// on 1 thread, 2.7 -> 1.5 on 2; the two break even at about 40 rois (0.045).
#ifndef MX_ROI_PSP_LANES_READS
#define MX_ROI_PSP_LANES_READS 0.05
#endif

// res[c] = (sum over the bin's cells, row by row, of v[c]) / area for 8 lanes of the
// channels-last copy; float: 8 / VW vectors, other types: scalar lanes.
template <typename A>
struct PoolLanes {
  static void pass(const A* lane, int hs, int he, int ws, int we, int W, int ncp, A area,
                   A* res) {
    A acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int h = hs; h < he; ++h)
      for (int w = ws; w < we; ++w) {
        const A* v = lane + ((long long)h * W + w) * ncp;
        for (int c = 0; c < 8; ++c) acc[c] += v[c];
      }
    for (int c = 0; c < 8; ++c) res[c] = acc[c] / area;
  }
};

template <>
struct PoolLanes<float> {
  static const int NV = 8 / mx_roi::VW;
  static void pass(const float* lane, int hs, int he, int ws, int we, int W, int ncp,
                   float area, float* res) {
    mx_roi::vf s[NV];
    for (int k = 0; k < NV; ++k) s[k] = mx_roi::vf{};
    for (int h = hs; h < he; ++h)
      for (int w = ws; w < we; ++w) {
        const float* v = lane + ((long long)h * W + w) * ncp;
        for (int k = 0; k < NV; ++k) {
          mx_roi::vf x;
          memcpy(&x, v + k * mx_roi::VW, sizeof x);
          s[k] += x;
        }
      }
    for (int k = 0; k < NV; ++k) {
      s[k] = s[k] / area;
      memcpy(res + k * mx_roi::VW, &s[k], sizeof s[k]);
    }
  }
};
#endif

// The mean of a bin's cells of ``plane``, row by row (0 for an empty bin)
template <typename T, typename A>
__device__ __forceinline__ A bin_mean(const T* plane, int hs, int he, int ws, int we, int W) {
  A sum = 0;
  if (he <= hs || we <= ws) return sum;
  for (int h = hs; h < he; ++h) {
    for (int w = ws; w < we; ++w) {
      sum += mx_roi::Traits<T>::load(plane[h * W + w]);
    }
  }
  return sum / (A)((he - hs) * (we - ws));
}

template <typename T, typename A>
__global__ void psroi_pooling_forward(
    const T* __restrict__ data, const int* __restrict__ batch,
    const int* __restrict__ channel_map, const int* __restrict__ hstart,
    const int* __restrict__ hend, const int* __restrict__ wstart, const int* __restrict__ wend,
    int C, int Cin, int H, int W, int P, int Q, T* __restrict__ out, long long n) {
#ifdef MX_ROI_HOST_NATIVE
  const long long plane_out = (long long)P * Q, R = mx_roi::launch_rois(n, C, P, Q);
  double reads = 0;  // cells read per channel, all bins of all rois
  for (long long r = 0; r < R && C >= 8; ++r) {
    if (batch[r] < 0) continue;
    long long rows = 0, cols = 0;
    for (int p = 0; p < P; ++p)
      rows += hend[r * P + p] > hstart[r * P + p] ? hend[r * P + p] - hstart[r * P + p] : 0;
    for (int q = 0; q < Q; ++q)
      cols += wend[r * Q + q] > wstart[r * Q + q] ? wend[r * Q + q] - wstart[r * Q + q] : 0;
    reads += (double)rows * cols;
  }
  const double copied = (double)mx_roi::images_read(batch, R) * H * W * plane_out;
  if (C >= 8 && R > 0 && reads >= MX_ROI_PSP_LANES_READS * copied) {
    // per item the loop below's sum in its order, per vector lane
    mx_roi::ps_forward_channels_last<T, A>(
        data, batch, channel_map, C, Cin, H, W, P, Q, out, n,
        [&](long long r, int p, int q, long long, int ncp) {
          const int hs = hstart[r * P + p], he = hend[r * P + p];
          const int ws = wstart[r * Q + q], we = wend[r * Q + q];
          return [hs, he, ws, we, W, ncp](const A* lane, A* res) {
            if (he <= hs || we <= ws) {  // an empty bin: 0
              for (int c = 0; c < 8; ++c) res[c] = 0;
              return;
            }
            PoolLanes<A>::pass(lane, hs, he, ws, we, W, ncp, (A)((he - hs) * (we - ws)), res);
          };
        });
    return;
  }
  if (!mx_roi::hint_map(Cin, H, W, sizeof(T))) {  // a map that fits in cache
    mx_roi::ps_forward_small_map<T, A>(
        data, batch, channel_map, C, Cin, H, W, P, Q, out, n,
        [&](long long r, int p, int q, const T* plane) {
          return bin_mean<T, A>(plane, hstart[r * P + p], hend[r * P + p], wstart[r * Q + q],
                                wend[r * Q + q], W);
        });
    return;
  }
  // bin by bin, roi by roi, all channels (mx_roi::ps_forward_native); per item the loop
  // below's sum in its order
  mx_roi::ps_forward_native<T, A>(
      data, batch, channel_map, C, Cin, H, W, P, Q, out, n, [&](long long r, int p, int q,
                                                                 long long) {
        const int hs = hstart[r * P + p], he = hend[r * P + p];
        const int ws = wstart[r * Q + q], we = wend[r * Q + q];
        return [hs, he, ws, we, W](const T* plane) {
          return bin_mean<T, A>(plane, hs, he, ws, we, W);
        };
      });
  return;
#endif
  MX_ROI_ITEM_LOOP(it, n, C, P, Q, true) {
    const int b = batch[it.r];
    const int hs = hstart[it.r * P + it.p], he = hend[it.r * P + it.p];
    const int ws = wstart[it.r * Q + it.q], we = wend[it.r * Q + it.q];
    A sum = 0;
    if (b >= 0) {
      const T* plane =
          data + mx_roi::plane_offset(b, mx_roi::in_channel(channel_map, it, P, Q), Cin, H, W);
      mx_roi::prefetch_next_plane(data, channel_map, it, C, Cin, H, W, P, Q, b, false);
      sum = bin_mean<T, A>(plane, hs, he, ws, we, W);
    }
    out[it.i] = mx_roi::Traits<T>::store(sum);
  }
}

// One item's backward: its bin's out-grad over the bin's area, added to each cell
template <typename T, typename A, typename O>
__device__ __forceinline__ void psroi_pooling_backward_item(
    const mx_roi::Item& it, const T* __restrict__ grad, const int* __restrict__ batch,
    const int* __restrict__ channel_map, const int* __restrict__ hstart,
    const int* __restrict__ hend, const int* __restrict__ wstart, const int* __restrict__ wend,
    int C, int Cin, int H, int W, int P, int Q, O* __restrict__ bottom, double scale) {
  const int b = batch[it.r];
  const int hs = hstart[it.r * P + it.p], he = hend[it.r * P + it.p];
  const int ws = wstart[it.r * Q + it.q], we = wend[it.r * Q + it.q];
  if (b < 0 || he <= hs || we <= ws) return;
  const A g = (A)mx_roi::Traits<T>::load(grad[it.i]) / (A)((he - hs) * (we - ws));
  O* plane =
      bottom + mx_roi::plane_offset(b, mx_roi::in_channel(channel_map, it, P, Q), Cin, H, W);
  mx_roi::prefetch_next_plane(bottom, channel_map, it, C, Cin, H, W, P, Q, b, true);
  for (int h = hs; h < he; ++h) {
    for (int w = ws; w < we; ++w) {
      mx_roi::grad_add(plane + h * W + w, g, scale);
    }
  }
}

template <typename T, typename A, typename O>
__global__ void psroi_pooling_backward(
    const T* __restrict__ grad, const int* __restrict__ batch,
    const int* __restrict__ channel_map, const int* __restrict__ hstart,
    const int* __restrict__ hend, const int* __restrict__ wstart, const int* __restrict__ wend,
    int C, int Cin, int H, int W, int P, int Q, O* __restrict__ bottom, double scale,
    long long n) {
#ifdef MX_ROI_HOST_NATIVE
  if (!mx_roi::hint_map(Cin, H, W, sizeof(O))) {  // a map that fits in cache
    mx_roi::ps_items_by_roi(n, C, P, Q, [&](const mx_roi::Item& it) {
      psroi_pooling_backward_item<T, A, O>(it, grad, batch, channel_map, hstart, hend, wstart,
                                           wend, C, Cin, H, W, P, Q, bottom, scale);
    });
    return;
  }
#endif
  MX_ROI_ITEM_LOOP(it, n, C, P, Q, true) {
    psroi_pooling_backward_item<T, A, O>(it, grad, batch, channel_map, hstart, hend, wstart,
                                         wend, C, Cin, H, W, P, Q, bottom, scale);
  }
}

#ifdef MX_ROI_EXT_LAUNCHER
// ==== mx_roi_PSROIPooling: this op in mx_roi's MXNet extension library (mx_roi.ext) =======
// Compiled only into that library (see roi_align.cu's section): mx.nd.contrib.PSROIPooling's
// parameters (spatial_scale, output_dim, pooled_size, group_size) plus PSROIPoolingParam's
// (deterministic: the native build is deterministic anyway), the device geometry's
// position-sensitive integer bins and roi check, the channel map, then this file's kernels
// over the output channels, as PositionSensitive.forward_cuda / backward_cuda launch them.
#include "ext_launch.h"

namespace mx_roi_op {

struct PSROIPoolingOp {
  static constexpr const char* OP = "PSROIPooling";

  struct Params : PsGrid {  // P, Q, output_dim, group_size (group_h, group_w)
    double spatial_scale = 0;
    bool deterministic = false;
  };

  // PSROIPoolingParam.from_kwargs: fields in _GroupGrid's order, then ParamBase's checks
  // (positive, then bounds in field order), then _GroupGrid's group_size sign check
  static Params parse(const std::unordered_map<std::string, std::string>& attrs) {
    Kwargs kw(OP, attrs, {"pooled_size", "output_dim", "spatial_scale", "group_size",
                          "deterministic"},
              {"pooled_size", "output_dim", "spatial_scale"});
    Params p;
    std::tie(p.P, p.Q) = kw.size2("pooled_size");
    p.output_dim = kw.integer("output_dim", 0);
    p.spatial_scale = kw.real("spatial_scale", 0);
    std::tie(p.group_h, p.group_w) = kw.group("group_size");
    p.deterministic = kw.boolean("deterministic", false);
    kw.finish();
    const std::string size = py_pair_repr(p.P, p.Q), dim = py_int_repr(p.output_dim);
    const std::string most = "at most " + std::to_string(MAX_ELEMENTS) + " (" + SIZE_WHY + ")";
    kw.positive("pooled_size", p.P > 0 && p.Q > 0, size);
    kw.positive("output_dim", p.output_dim > 0, dim);
    kw.positive("spatial_scale", p.spatial_scale > 0, py_float_repr(p.spatial_scale));
    kw.check("pooled_size", p.P <= MAX_ELEMENTS && p.Q <= MAX_ELEMENTS, most, size);
    kw.check("output_dim", p.output_dim <= MAX_ELEMENTS, most, dim);
    kw.check("group_size", p.group_h <= MAX_ELEMENTS && p.group_w <= MAX_ELEMENTS, most,
             py_pair_repr(p.group_h, p.group_w));
    check_group(kw, p.group_h, p.group_w);
    return p;
  }

  // PSROIPoolingParam.to_kwargs, "name=value;..." (the tests compare it with params.py)
  static std::string format(const std::unordered_map<std::string, std::string>& attrs) {
    const Params p = parse(attrs);
    return "pooled_size=" + py_pair_repr(p.P, p.Q) +
           ";output_dim=" + std::to_string(p.output_dim) +
           ";spatial_scale=" + py_float_repr(p.spatial_scale) +
           ";group_size=" + py_pair_repr(p.group_h, p.group_w) +
           ";deterministic=" + (p.deterministic ? "True" : "False");
  }

  static long long out_channels(const Params& p, long long C) {
    return ps_out_channels(OP, p, C);
  }

  template <typename T, typename A>
  static Bins geometry(const Params& p, const MXTensor& data, const MXTensor& rois) {
    return int_bins_geometry<T, A>(OP, MODE_PS_POOL_BINS, (int)p.P, (int)p.Q,
                                   (int)data.shape[2], (int)data.shape[3],
                                   (float)p.spatial_scale, (const T*)rois.data_ptr,
                                   rois.shape[0], data.shape[0]);
  }

  template <typename T, typename A>
  static void forward(const Params& p, const Call<PSROIPoolingOp, T, A>& c,
                      const MXTensor& data, MXTensor& out) {
    const Bins& b = c.g;
    const int* cmap = ps_channel_map(p);
    c.launch([&]() {
      psroi_pooling_forward<T, A>((const T*)data.data_ptr, b.batch, cmap, b.hstart, b.hend,
                                  b.wstart, b.wend, c.C, c.Cin, c.H, c.W, c.P, c.Q,
                                  (T*)out.data_ptr, c.n);
    });
  }

  template <typename T, typename A>
  static void backward(const Params& p, const Call<PSROIPoolingOp, T, A>& c,
                       const MXTensor& grad, const MXTensor& data, A* bottom) {
    const Bins& b = c.g;
    const int* cmap = ps_channel_map(p);
    c.launch([&]() {
      psroi_pooling_backward<T, A, A>((const T*)grad.data_ptr, b.batch, cmap, b.hstart,
                                      b.hend, b.wstart, b.wend, c.C, c.Cin, c.H, c.W, c.P,
                                      c.Q, bottom, 1.0, c.n);
    });
  }
};

const RegisterParams psroi_pooling_params("PSROIPooling", PSROIPoolingOp::format);

// The "gpu" forward and backward (opt-in; docs/gpu.md): this file's kernels launched by
// mx_roi.ext.cuda's launcher (the MX_ROI_EXT_CUDA_LAUNCHER section below) on MXNet's
// stream, the tables and the channel map in MXNet's temporary workspace; no host wait.
struct PSROIPoolingGpu {
  typedef PSROIPoolingOp Op;
  typedef int (*Workspace)(int, long long, long long, long long, long long, long long,
                           long long, int, int, int, unsigned long long*, char*, size_t);
  typedef int (*Forward)(int, const void*, const void*, void*, long long, long long, long long,
                         long long, long long, long long, int, int, int, int, float, void*,
                         unsigned long long, void*, char*, size_t);
  typedef int (*Backward)(int, const void*, const void*, void*, void*, long long, long long,
                          long long, long long, long long, long long, int, int, int, int,
                          float, void*, unsigned long long, void*, char*, size_t);
  static constexpr const char* OP = PSROIPoolingOp::OP;

  static void* tables(const Op::Params& p, const MXTensor& data, long long R, bool backward,
                      const OpResource& res, unsigned long long* bytes) {
    char err[4096] = "";
    gpu_call(gpu_entry<Workspace>(OP, "mx_roi_ext_cuda_psroi_pooling_workspace")(
                 data.dtype, data.shape[0], data.shape[1], data.shape[2], data.shape[3], R,
                 p.output_dim, (int)p.P, (int)p.Q, backward ? 1 : 0, bytes, err, sizeof err),
             err);
    return gpu_workspace(OP, res, *bytes);
  }

  static int forward(const Op::Params& p, const MXTensor& data, const MXTensor& rois,
                     MXTensor& out, void* ws, unsigned long long bytes, void* stream, char* err,
                     size_t len) {
    return gpu_entry<Forward>(OP, "mx_roi_ext_cuda_psroi_pooling_forward")(
        data.dtype, data.data_ptr, rois.data_ptr, out.data_ptr, data.shape[0], data.shape[1],
        data.shape[2], data.shape[3], rois.shape[0], p.output_dim, (int)p.P, (int)p.Q,
        (int)p.Gh(), (int)p.Gw(), (float)p.spatial_scale, ws, bytes, stream, err, len);
  }

  static int backward(const Op::Params& p, const MXTensor& grad, const MXTensor& data,
                      const MXTensor& rois, MXTensor& in_grad, MXTensor& rois_grad, void* ws,
                      unsigned long long bytes, void* stream, char* err, size_t len) {
    return gpu_entry<Backward>(OP, "mx_roi_ext_cuda_psroi_pooling_backward")(
        data.dtype, grad.data_ptr, rois.data_ptr, in_grad.data_ptr, rois_grad.data_ptr,
        data.shape[0], data.shape[1], data.shape[2], data.shape[3], rois.shape[0],
        p.output_dim, (int)p.P, (int)p.Q, (int)p.Gh(), (int)p.Gw(), (float)p.spatial_scale,
        ws, bytes, stream, err, len);
  }
};

}  // namespace mx_roi_op

MX_ROI_EXT_REGISTER(mx_roi_PSROIPooling, mx_roi_op::PSROIPoolingOp)
    .setForward(mx_roi_op::GpuCallbacks<mx_roi_op::PSROIPoolingGpu>::forward, "gpu")
    .setBackward(mx_roi_op::GpuCallbacks<mx_roi_op::PSROIPoolingGpu>::backward, "gpu");
#endif  // MX_ROI_EXT_LAUNCHER

#ifdef MX_ROI_EXT_CUDA_LAUNCHER
// ==== this op on the native GPU path (opt-in; docs/gpu.md) ===============================
// Compiled only into mx_roi.ext.cuda's launcher library (as roi_align.cu's section): the
// driver-API launch of this file's kernels (psroi_pooling.py's native_gpu_kernels, NVRTC's
// PTX in PSROI_POOLING_IMAGE) as PositionSensitive.forward_cuda / backward_cuda run them
// on the device-built integer bins and channel map, and the C entries.
namespace mx_roi_cuda {

// PSROIPooling's workspace: the integer bins (IntBins), then the channel map and float16's
// accumulator (PsWorkspace); for R >= 1.
inline PsWorkspace psroi_pooling_workspace(int dtype, long long N, long long Cin, long long H,
                                           long long W, long long R, long long output_dim,
                                           int P, int Q, bool backward) {
  return PsWorkspace(IntBins(MODE_PS_POOL_BINS, R, P, Q, H, W, 0).bytes, dtype, output_dim, P,
                     Q, N * Cin * H * W, backward);
}

// PSROIPooling's forward (PositionSensitive.forward_cuda on device-built bins): the
// geometry kernel, the channel map's fill, then psroi_pooling_forward, on ``stream``.
inline void psroi_pooling_forward(int dtype, CUdeviceptr data, CUdeviceptr rois,
                                  CUdeviceptr out, long long N, long long Cin, long long H,
                                  long long W, long long R, long long output_dim, int P, int Q,
                                  int Gh, int Gw, float spatial_scale, CUdeviceptr workspace,
                                  unsigned long long workspace_bytes, CUstream stream) {
  const CallScope call("PSROIPooling", dtype, stream);
  ps_check_channels(call.op, Cin, output_dim, Gh, Gw);
  call.report();
  if (R <= 0) return;  // no roi: nothing to launch (the output is empty)
  const PsWorkspace ws = psroi_pooling_workspace(dtype, N, Cin, H, W, R, output_dim, P, Q,
                                                 false);
  need_workspace(call.op, workspace_bytes, ws.bytes);
  const IntBins bins(MODE_PS_POOL_BINS, R, P, Q, H, W, workspace);
  bins.geometry(call, PSROI_POOLING_IMAGE, rois, N, H, W, R, P, Q, spatial_scale);
  ps_fill_channel_map(call, PSROI_POOLING_IMAGE, workspace + ws.map_at, output_dim, P, Q, Gh,
                      Gw);
  const long long n = R * output_dim * P * Q;
  Args k;
  k(data)(bins.tb[0])(workspace + ws.map_at);  // data, batch, channel_map
  for (int i = 1; i < 5; ++i) k(bins.tb[i]);
  k((int)output_dim)((int)Cin)((int)H)((int)W)(P)(Q)(out)(n);
  call.run(PSROI_POOLING_IMAGE, "psroi_pooling_forward" + call.ta() + ">", n, k);
  call.record();
}

// PSROIPooling's backward (PositionSensitive.backward_cuda, req write): the gradients zeroed
// (GradTarget), the geometry kernel, the channel map, psroi_pooling_backward, then for
// float16 the accumulator's store; all on ``stream``.  A bad roi raises nothing here (as
// ROIAlign's backward: the next forward reports it).
inline void psroi_pooling_backward(int dtype, CUdeviceptr grad, CUdeviceptr rois,
                                   CUdeviceptr in_grad, CUdeviceptr rois_grad, long long N,
                                   long long Cin, long long H, long long W, long long R,
                                   long long output_dim, int P, int Q, int Gh, int Gw,
                                   float spatial_scale, CUdeviceptr workspace,
                                   unsigned long long workspace_bytes, CUstream stream) {
  const CallScope call("PSROIPooling", dtype, stream);
  ps_check_channels(call.op, Cin, output_dim, Gh, Gw);
  if (R <= 0) return call.zero(in_grad, (size_t)(N * Cin * H * W) * item_size(dtype));
  const PsWorkspace ws = psroi_pooling_workspace(dtype, N, Cin, H, W, R, output_dim, P, Q,
                                                 true);
  need_workspace(call.op, workspace_bytes, ws.bytes);
  const IntBins bins(MODE_PS_POOL_BINS, R, P, Q, H, W, workspace);
  const GradTarget target(call, dtype, in_grad, rois_grad, N * Cin * H * W, R, 5,
                          workspace + ws.acc_at);
  bins.geometry(call, PSROI_POOLING_IMAGE, rois, N, H, W, R, P, Q, spatial_scale);
  ps_fill_channel_map(call, PSROI_POOLING_IMAGE, workspace + ws.map_at, output_dim, P, Q, Gh,
                      Gw);
  const long long n = R * output_dim * P * Q;
  Args k;
  k(grad)(bins.tb[0])(workspace + ws.map_at);  // grad, batch, channel_map
  for (int i = 1; i < 5; ++i) k(bins.tb[i]);
  k((int)output_dim)((int)Cin)((int)H)((int)W)(P)(Q)(target.bottom)(1.0)(n);  // scale, n
  call.run(PSROI_POOLING_IMAGE,
           "psroi_pooling_backward" + call.ta() + ", " + call.t.A + ">", n, k);
  target.store(call);
  call.record();
}

}  // namespace mx_roi_cuda

extern "C" {

// The workspace bytes of a PSROIPooling forward (``backward`` 0) or backward (1): 0, or 1
// with the message.  Cin: the data's channels (output_dim * Gh * Gw).
int mx_roi_ext_cuda_psroi_pooling_workspace(int dtype, long long N, long long Cin, long long H,
                                            long long W, long long R, long long output_dim,
                                            int P, int Q, int backward,
                                            unsigned long long* bytes, char* err,
                                            size_t err_len) {
  return mx_roi_cuda::c_entry(err, err_len, [&]() {
    mx_roi_cuda::types_of("PSROIPooling", dtype);
    *bytes = R <= 0 ? 0
                    : mx_roi_cuda::psroi_pooling_workspace(dtype, N, Cin, H, W, R, output_dim,
                                                           P, Q, backward != 0).bytes;
  });
}

// PSROIPooling's forward on ``stream``: data (N, Cin, H, W), rois (R, 5), out (R,
// output_dim, P, Q), device pointers of ``dtype``; (Gh, Gw) the group grid (Cin must be
// output_dim * Gh * Gw); ``workspace``: at least the workspace function's bytes.  No host
// synchronisation.
int mx_roi_ext_cuda_psroi_pooling_forward(int dtype, const void* data, const void* rois,
                                          void* out, long long N, long long Cin, long long H,
                                          long long W, long long R, long long output_dim,
                                          int P, int Q, int Gh, int Gw, float spatial_scale,
                                          void* workspace, unsigned long long workspace_bytes,
                                          void* stream, char* err, size_t err_len) {
  return mx_roi_cuda::c_entry(err, err_len, [&]() {
    mx_roi_cuda::psroi_pooling_forward(
        dtype, (mx_roi_cuda::CUdeviceptr)data, (mx_roi_cuda::CUdeviceptr)rois,
        (mx_roi_cuda::CUdeviceptr)out, N, Cin, H, W, R, output_dim, P, Q, Gh, Gw,
        spatial_scale, (mx_roi_cuda::CUdeviceptr)workspace, workspace_bytes,
        (mx_roi_cuda::CUstream)stream);
  });
}

// PSROIPooling's backward on ``stream``: grad (R, output_dim, P, Q), in_grad (N, Cin, H, W)
// written (req write), rois_grad (R, 5) zeroed (null: none); the data is not read.  No host
// synchronisation; a bad roi is reported by a later forward.
int mx_roi_ext_cuda_psroi_pooling_backward(int dtype, const void* grad, const void* rois,
                                           void* in_grad, void* rois_grad, long long N,
                                           long long Cin, long long H, long long W, long long R,
                                           long long output_dim, int P, int Q, int Gh, int Gw,
                                           float spatial_scale, void* workspace,
                                           unsigned long long workspace_bytes, void* stream,
                                           char* err, size_t err_len) {
  return mx_roi_cuda::c_entry(err, err_len, [&]() {
    mx_roi_cuda::psroi_pooling_backward(
        dtype, (mx_roi_cuda::CUdeviceptr)grad, (mx_roi_cuda::CUdeviceptr)rois,
        (mx_roi_cuda::CUdeviceptr)in_grad, (mx_roi_cuda::CUdeviceptr)rois_grad, N, Cin, H, W,
        R, output_dim, P, Q, Gh, Gw, spatial_scale, (mx_roi_cuda::CUdeviceptr)workspace,
        workspace_bytes, (mx_roi_cuda::CUstream)stream);
  });
}

}  // extern "C"
#endif  // MX_ROI_EXT_CUDA_LAUNCHER
