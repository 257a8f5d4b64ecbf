// The library-wide part of mx_roi's MXNet extension library (mx_roi.ext builds it with
// MXNet's own src/lib_api.cc and each op's operators/<op>.cu compiled with
// -DMX_ROI_EXT_LAUNCHER): the error channel, the library's initialize(), the no-op op
// (the floor of an extension op's call) and the entry point the tests parse parameters
// through.
#include <dlfcn.h>

#include <atomic>
#include <cstdio>
#include <mutex>
#include <sstream>

#include "mxnet/lib_api.h"
#include "ext_common.h"

using namespace mxnet::ext;

// ---- the error channel ------------------------------------------------------------------
// MXerrorMsgs::messages is private and lib_api.cc never clears it (MXNet then repeats every
// earlier error after each new one).  An explicit instantiation may name a private member
// ([temp.explicit]/12): Steal hands out its pointer-to-member.
namespace {
struct MessagesTag {
  typedef std::vector<std::stringstream*> MXerrorMsgs::*type;
  friend type member(MessagesTag);
};
template <typename Tag, typename Tag::type M>
struct Steal {
  friend typename Tag::type member(Tag) { return M; }
};
template struct Steal<MessagesTag, &MXerrorMsgs::messages>;

std::mutex error_lock;

void clear_messages() {
  auto& messages = MXerrorMsgs::get()->*member(MessagesTag());
  for (auto* m : messages) delete m;
  messages.clear();
}
}  // namespace

namespace mx_roi_ext {
void begin_call() {
  std::lock_guard<std::mutex> lock(error_lock);
  clear_messages();
}

// One message, without the "file[line]: " that MX_ERROR_MSG puts first.
void set_error(const std::string& message) {
  std::lock_guard<std::mutex> lock(error_lock);
  clear_messages();
  auto& messages = MXerrorMsgs::get()->*member(MessagesTag());
  messages.push_back(new std::stringstream());
  *messages.back() << message;
}

std::map<std::string, ParamsFormatter>& params_formatters() {
  static std::map<std::string, ParamsFormatter> table;
  return table;
}
}  // namespace mx_roi_ext

namespace mx_roi_ext {
std::atomic<bool> callback_timing{false};
namespace {
std::atomic<long long> callback_ns[2], callback_calls[2];
}
void add_callback_time(int direction, long long ns) {
  callback_ns[direction].fetch_add(ns, std::memory_order_relaxed);
  callback_calls[direction].fetch_add(1, std::memory_order_relaxed);
}
}  // namespace mx_roi_ext

// Starts (1) or stops (0) timing the ops' callbacks; starting zeroes the totals.
extern "C" void mx_roi_ext_callback_timing(int enable) {
  using namespace mx_roi_ext;
  if (enable)
    for (int d = 0; d < 2; ++d) callback_ns[d] = callback_calls[d] = 0;
  callback_timing.store(enable != 0);
}

// The totals since timing started: out[0..3] = forward ns, forward calls, backward ns,
// backward calls.
extern "C" void mx_roi_ext_callback_times(long long* out) {
  using namespace mx_roi_ext;
  for (int d = 0; d < 2; ++d) {
    out[2 * d] = callback_ns[d].load();
    out[2 * d + 1] = callback_calls[d].load();
  }
}

namespace mx_roi_ext {
std::atomic<long long> geometry_reuse[2];
void count_geometry_reuse(bool reused) {
  geometry_reuse[reused ? 1 : 0].fetch_add(1, std::memory_order_relaxed);
}
}  // namespace mx_roi_ext

// The backwards' tables since the library loaded: out[0] built, out[1] reused (the
// forward's, kept).
extern "C" void mx_roi_ext_geometry_reuse(long long* out) {
  for (int i = 0; i < 2; ++i) out[i] = mx_roi_ext::geometry_reuse[i].load();
}

// The messages MXNet would print now (tests: the list holds one message per failure).
extern "C" int mx_roi_ext_message_count() {
  return MXerrorMsgs::get()->size();
}

// mx_roi_ext::huge_page_range (the native door's huge-page advice on a call's fresh
// output; tests/test_ext_library.py compares it with scratch.advise_huge_pages_at).
extern "C" void mx_roi_ext_huge_page_range(unsigned long long addr, unsigned long long bytes,
                                           unsigned long long* start, unsigned long long* len) {
  mx_roi_ext::huge_page_range(addr, bytes, start, len);
}

// mx_roi_ext::native_threads (a CPU launch's threads over ``items`` items, with
// $MX_ROI_NUM_THREADS and $MX_ROI_MIN_ITEMS_PER_THREAD as they are now;
// tests/test_library_calls.py compares it with loader.native_threads).
extern "C" int mx_roi_ext_native_threads(long long items) {
  return mx_roi_ext::native_threads(items);
}

// Parses op's parameters as its extension op does: writes "name=value;..." (the parsed
// values as params.ParamBase.to_kwargs spells them) or the error message into out;
// returns 0 (parsed), 1 (an error), -1 (no such op), -2 (out too small).
extern "C" int mx_roi_ext_parse_params(const char* op, int n, const char* const* keys,
                                       const char* const* values, char* out, int out_len) {
  auto& table = mx_roi_ext::params_formatters();
  auto it = table.find(op);
  if (it == table.end()) return -1;
  std::unordered_map<std::string, std::string> attrs;
  for (int i = 0; i < n; ++i) attrs[keys[i]] = values[i];
  std::string text;
  int rc = 0;
  try {
    text = it->second(attrs);
  } catch (const std::exception& e) {
    text = e.what();
    rc = 1;
  }
  if ((int)text.size() + 1 > out_len) return -2;
  std::memcpy(out, text.c_str(), text.size() + 1);
  return rc;
}

// ---- the Custom door's native backend: an op's launcher, called from Python ------------
// (mx_roi.cuda.library_calls).  A handle holds the op's launcher and its parameters as
// MXNet would hand them to the native operator (kept for the op's lifetime: the launcher's
// per-thread parse memo then hits on every call); a call passes the arrays' addresses,
// shapes and dtypes (MXNet's type flags) and gets 0, or 1 with the error's message in
// ``err`` (the caller then takes its checked path, which raises the Custom door's message).
namespace mx_roi_ext {
std::map<std::string, InvokeFn>& invoke_table() {
  static std::map<std::string, InvokeFn> table;
  return table;
}
}  // namespace mx_roi_ext

namespace {
struct InvokeHandle {
  mx_roi_ext::InvokeFn fn;
  std::unordered_map<std::string, std::string> attrs;
};
}  // namespace

// One array of a call: its memory, dtype (MXNet's flag: 0 float32, 1 float64, 2 float16)
// and shape (``ndim`` <= 6 dimensions)
struct mx_roi_ext_tensor {
  void* data;
  long long shape[6];
  int ndim;
  int dtype;
};

// The handle of native operator ``op`` with parameters keys[i]=values[i], or null when the
// library has no such operator.
extern "C" void* mx_roi_ext_invoke_handle(const char* op, int n, const char* const* keys,
                                          const char* const* values) {
  auto& table = mx_roi_ext::invoke_table();
  auto it = table.find(op);
  if (it == table.end()) return nullptr;
  InvokeHandle* h = new InvokeHandle{it->second, {}};
  for (int i = 0; i < n; ++i) h->attrs[keys[i]] = values[i];
  return h;
}

extern "C" void mx_roi_ext_invoke_release(void* handle) {
  delete static_cast<InvokeHandle*>(handle);
}

// Runs the forward (direction 0: inputs data, rois[, extra]; output the output) or the
// backward (1: inputs out-grad, data, rois[, extra]; outputs their gradients) on the
// caller's thread: 0, or 1 and the message in ``err`` (``err_len`` bytes; may be null with
// ``err_len`` 0).
extern "C" int mx_roi_ext_invoke(void* handle, int direction, int n_in, int n_out,
                                 const mx_roi_ext_tensor* arrays, char* err, int err_len) {
  const InvokeHandle* h = static_cast<const InvokeHandle*>(handle);
  std::vector<MXTensor> in, out;
  in.reserve(n_in);
  out.reserve(n_out);
  for (int i = 0; i < n_in + n_out; ++i) {
    const mx_roi_ext_tensor& a = arrays[i];
    (i < n_in ? in : out).emplace_back(a.data, std::vector<int64_t>(a.shape, a.shape + a.ndim),
                                       (MXDType)a.dtype, 0, MXContext("cpu", 0));
  }
  try {
    h->fn(direction, h->attrs, &in, &out);
  } catch (const std::exception& e) {
    if (err_len > 0) std::snprintf(err, (size_t)err_len, "%s", e.what());
    return 1;
  } catch (...) {
    if (err_len > 0) std::snprintf(err, (size_t)err_len, "mx_roi: unknown error");
    return 1;
  }
  return 0;
}

// ---- the native GPU path (opt-in; mx_roi.ext.cuda, docs/gpu.md) --------------------------
// The ops' "gpu" callbacks call the launcher library's C entries (mx_roi_ext_cuda_*) found
// here; until mx_roi_ext_set_gpu_launcher has opened that library (mx_roi.ext.cuda.enable()
// does, with the path it built and checked), a GPU call fails with a message saying so.
// The CPU callbacks never look here.
namespace {
std::atomic<void*> gpu_launcher{nullptr};
}

// Opens the launcher library at ``path`` for the GPU callbacks: 0, or 1 (dlerror's text
// in ``err``).
extern "C" int mx_roi_ext_set_gpu_launcher(const char* path, char* err, int err_len) {
  void* lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  if (!lib) {
    const char* e = dlerror();
    std::snprintf(err, (size_t)err_len, "%s", e ? e : "dlopen failed");
    return 1;
  }
  gpu_launcher.store(lib);
  return 0;
}

// The launcher's entry ``name``, or null when the native GPU path is not enabled.
extern "C" void* mx_roi_ext_gpu_symbol(const char* name) {
  void* lib = gpu_launcher.load();
  return lib ? dlsym(lib, name) : nullptr;
}

// ---- mx_roi_noop: the floor of an extension op's call -----------------------------------
// Inputs (data, rois), one output of shape ``out_shape`` (a JSON list of ints), the data's
// dtype; forward and backward do nothing, like the bench's no-op Custom op
// (mx_roi.bench.overhead), so the two floors compare the calls' machinery alone.
namespace {
using mx_roi_ext::OpError;

std::vector<unsigned int> noop_shape(const std::unordered_map<std::string, std::string>& attrs) {
  auto it = attrs.find("out_shape");
  if (it == attrs.end()) throw OpError("mx_roi_noop: missing required parameter(s) 'out_shape'");
  std::string t = it->second;
  for (auto& c : t)
    if (c == '[' || c == ']' || c == '(' || c == ')' || c == ',') c = ' ';
  std::istringstream in(t);
  std::vector<unsigned int> shape;
  long long v;
  while (in >> v) {
    if (v < 0) break;
    shape.push_back((unsigned int)v);
  }
  if (!in.eof() || shape.empty())
    throw OpError("mx_roi_noop: parameter 'out_shape': expected a list of non-negative ints, "
                  "got " + mx_roi_ext::py_str_repr(it->second));
  return shape;
}

MXReturnValue noop_parse(const std::unordered_map<std::string, std::string>& attrs,
                         int* num_in, int* num_out) {
  MX_ROI_EXT_CALL(noop_shape(attrs); *num_in = 2; *num_out = 1;)
}

MXReturnValue noop_type(const std::unordered_map<std::string, std::string>& attrs,
                        std::vector<int>* in_types, std::vector<int>* out_types) {
  MX_ROI_EXT_CALL((*out_types)[0] = (*in_types)[0];)
}

MXReturnValue noop_shape_fn(const std::unordered_map<std::string, std::string>& attrs,
                            std::vector<std::vector<unsigned int>>* in_shapes,
                            std::vector<std::vector<unsigned int>>* out_shapes) {
  MX_ROI_EXT_CALL((*out_shapes)[0] = noop_shape(attrs);)
}

MXReturnValue noop_compute(const std::unordered_map<std::string, std::string>& attrs,
                           std::vector<MXTensor>* inputs, std::vector<MXTensor>* outputs,
                           const OpResource& res) {
  MX_ROI_EXT_CALL((void)0;)
}
}  // namespace

REGISTER_OP(mx_roi_noop)
    .setForward(noop_compute, "cpu")
    .setBackward(noop_compute, "cpu")
    .setParseAttrs(noop_parse)
    .setInferType(noop_type)
    .setInferShape(noop_shape_fn);

MXReturnValue initialize(int version) {
  // 10901: the MXNet the extension API of this lib_api.h shipped with (1.9.x)
  if (version < 10900) {
    MX_ERROR_MSG << "mx_roi's extension library needs MXNet >= 1.9.0, got " << version;
    return MX_FAIL;
  }
  return MX_SUCCESS;
}
