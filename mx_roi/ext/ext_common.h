// Shared by every translation unit of mx_roi's MXNet extension library (mx_roi.ext):
// the error channel to MXNet, Python-compatible parameter parsing (the second
// implementation of mx_roi/params.py: the same messages, tests/test_ext_library.py
// compares them value by value), Python's repr of numbers and strings for those
// messages, and the thread count of a native launch (mx_roi.parallel's rule).
//
// No kernel code here: an op's launcher (the MX_ROI_EXT_LAUNCHER section at the end of its
// operators/<op>.cu) includes ext_launch.h for the geometry driver.
#pragma once

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <stdexcept>
#include <tuple>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#if defined(__linux__)
#include <sched.h>
#endif

namespace mx_roi_ext {

// ---- the error channel ---------------------------------------------------------------
// lib_api.cc keeps one process-wide list of messages that MXNet prints after "Error
// calling FCompute for custom operator '<op>'" and never clears: every entry point of ours
// starts with begin_call() (the list emptied), and a failure sets exactly one message.
// Defined in ext_main.cc (the one translation unit that includes lib_api.cc).
void begin_call();
void set_error(const std::string& message);

// Each op's parameter parser as the tests see it (mx_roi_ext_parse_params in ext_main.cc):
// the parsed parameters as params.ParamBase.to_kwargs spells them, "name=value;" per
// field, or the error (OpError).  Registered by each op's translation unit.
typedef std::string (*ParamsFormatter)(const std::unordered_map<std::string, std::string>&);
std::map<std::string, ParamsFormatter>& params_formatters();
struct RegisterParams {
  RegisterParams(const char* op, ParamsFormatter f) { params_formatters()[op] = f; }
};

// A parameter, shape or input problem: its what() is the whole message (op name first).
struct OpError : std::runtime_error {
  explicit OpError(const std::string& m) : std::runtime_error(m) {}
};

// The body of an extension entry point (a lib_api.h callback): the error list emptied
// first, any exception turned into the call's one message and MX_FAIL (nothing may unwind
// into MXNet's C code).
#define MX_ROI_EXT_CALL(...)                          \
  ::mx_roi_ext::begin_call();                         \
  try {                                               \
    __VA_ARGS__                                       \
  } catch (const std::exception& e) {                 \
    ::mx_roi_ext::set_error(e.what());                \
    return MX_FAIL;                                   \
  } catch (...) {                                     \
    ::mx_roi_ext::set_error("mx_roi: unknown error"); \
    return MX_FAIL;                                   \
  }                                                   \
  return MX_SUCCESS;

// ---- Python's repr ---------------------------------------------------------------------
// repr(float): the shortest decimal that reads back, fixed notation for exponents in
// [-4, 16), else d.ddde+XX (Python's float_repr_style 'short').
inline std::string py_float_repr(double v) {
  if (std::isnan(v)) return "nan";
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  char buf[64];
  for (int prec = 1; prec <= 17; ++prec) {
    std::snprintf(buf, sizeof buf, "%.*e", prec - 1, v);
    if (std::strtod(buf, nullptr) == v) break;
  }
  std::string s(buf);
  bool neg = s[0] == '-';
  if (neg) s = s.substr(1);
  const size_t epos = s.find('e');
  const int e = std::atoi(s.c_str() + epos + 1);
  std::string digits;
  for (size_t i = 0; i < epos; ++i)
    if (s[i] != '.') digits += s[i];
  while (digits.size() > 1 && digits.back() == '0') digits.pop_back();
  std::string out;
  if (e >= -4 && e < 16) {
    if (e >= 0) {
      std::string ip = digits.substr(0, std::min(digits.size(), (size_t)e + 1));
      while ((int)ip.size() < e + 1) ip += '0';
      std::string fp = digits.size() > (size_t)e + 1 ? digits.substr(e + 1) : "0";
      out = ip + "." + fp;
    } else {
      out = "0." + std::string(-e - 1, '0') + digits;
    }
  } else {
    out = digits.substr(0, 1);
    if (digits.size() > 1) out += "." + digits.substr(1);
    char eb[16];
    std::snprintf(eb, sizeof eb, "e%c%02d", e < 0 ? '-' : '+', e < 0 ? -e : e);
    out += eb;
  }
  return neg ? "-" + out : out;
}

// repr(str) of an ASCII/UTF-8 string: single quotes unless it holds a single quote and no
// double quote; backslash escapes for the quote, \\, \t, \n, \r and other control bytes.
inline std::string py_str_repr(const std::string& s) {
  const bool dq = s.find('\'') != std::string::npos && s.find('"') == std::string::npos;
  const char q = dq ? '"' : '\'';
  std::string out(1, q);
  for (unsigned char c : s) {
    if (c == '\\') out += "\\\\";
    else if (c == (unsigned char)q) out += std::string("\\") + (char)q;
    else if (c == '\t') out += "\\t";
    else if (c == '\n') out += "\\n";
    else if (c == '\r') out += "\\r";
    else if (c < 0x20 || c == 0x7f) {
      char b[8];
      std::snprintf(b, sizeof b, "\\x%02x", c);
      out += b;
    } else {
      out += (char)c;
    }
  }
  return out + q;
}

inline std::string py_pair_repr(long long a, long long b) {
  return "(" + std::to_string(a) + ", " + std::to_string(b) + ")";
}

// ---- parsing as mx_roi/params.py (every value arrives as a string) --------------------
inline bool is_py_space(char c) {
  return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\x0b' || c == '\x0c' ||
         (c >= '\x1c' && c <= '\x1f');
}

inline std::string py_strip(const std::string& s) {
  size_t a = 0, b = s.size();
  while (a < b && is_py_space(s[a])) ++a;
  while (b > a && is_py_space(s[b - 1])) --b;
  return s.substr(a, b - a);
}

inline std::string py_lower(std::string s) {
  for (auto& c : s)
    if (c >= 'A' && c <= 'Z') c = (char)(c - 'A' + 'a');
  return s;
}

// ``parameter '<name>': expected <expected>, got <repr>`` (params._fail)
inline OpError param_fail(const std::string& name, const std::string& got_repr,
                          const std::string& expected) {
  return OpError("parameter '" + name + "': expected " + expected + ", got " + got_repr);
}

// digitpart := digit (["_"] digit)*; returns the end, or npos when malformed.
inline size_t scan_digits(const std::string& s, size_t i, std::string& out) {
  const size_t start = i;
  while (i < s.size()) {
    if (std::isdigit((unsigned char)s[i])) {
      out += s[i++];
    } else if (s[i] == '_' && i > start && i + 1 < s.size() &&
               std::isdigit((unsigned char)s[i + 1]) &&
               std::isdigit((unsigned char)s[i - 1])) {
      ++i;
    } else {
      break;
    }
  }
  return i == start ? std::string::npos : i;
}

// Python's float(text) for an already stripped text: false if it does not parse.
inline bool py_float(const std::string& t, double& v) {
  size_t i = 0;
  std::string norm;
  if (i < t.size() && (t[i] == '+' || t[i] == '-')) norm += t[i++];
  const std::string rest = py_lower(t.substr(i));
  if (rest == "inf" || rest == "infinity") {
    v = norm == "-" ? -HUGE_VAL : HUGE_VAL;
    return true;
  }
  if (rest == "nan") {
    v = NAN;
    return true;
  }
  bool any = false;
  if (i < t.size() && std::isdigit((unsigned char)t[i])) {
    i = scan_digits(t, i, norm);
    if (i == std::string::npos) return false;
    any = true;
  }
  if (i < t.size() && t[i] == '.') {
    norm += t[i++];
    if (i < t.size() && std::isdigit((unsigned char)t[i])) {
      i = scan_digits(t, i, norm);
      if (i == std::string::npos) return false;
      any = true;
    }
  }
  if (!any) return false;
  if (i < t.size() && (t[i] == 'e' || t[i] == 'E')) {
    norm += t[i++];
    if (i < t.size() && (t[i] == '+' || t[i] == '-')) norm += t[i++];
    i = scan_digits(t, i, norm);
    if (i == std::string::npos) return false;
  }
  if (i != t.size()) return false;
  v = std::strtod(norm.c_str(), nullptr);
  return true;
}

inline bool parse_bool(const std::string& name, const std::string& raw) {
  const std::string t = py_lower(py_strip(raw));
  if (t == "true" || t == "1" || t == "yes" || t == "on") return true;
  if (t == "false" || t == "0" || t == "no" || t == "off") return false;
  throw param_fail(name, py_str_repr(raw), "a boolean (True/False/1/0)");
}

inline long long parse_int(const std::string& name, const std::string& raw) {
  double v;
  if (!py_float(py_strip(raw), v) || !std::isfinite(v) || v != std::trunc(v) ||
      std::fabs(v) >= 9.2e18)  // (Python's ints are unbounded; ours are 64-bit)
    throw param_fail(name, py_str_repr(raw), "an integer");
  return (long long)v;
}

inline double parse_float(const std::string& name, const std::string& raw) {
  double v;
  if (!py_float(py_strip(raw), v)) throw param_fail(name, py_str_repr(raw), "a number");
  if (!std::isfinite(v)) throw param_fail(name, py_str_repr(raw), "a finite number");
  return v;
}

// One number of a Python literal (ast.literal_eval): an int (decimal, 0x, 0o, 0b) or a
// float, at most one leading sign; false for anything else.
inline bool literal_number(std::string t, double& v, bool& is_int) {
  std::string sign;
  if (!t.empty() && (t[0] == '+' || t[0] == '-')) {
    sign = t.substr(0, 1);
    t = py_strip(t.substr(1));
  }
  if (t.empty() || !(std::isdigit((unsigned char)t[0]) || t[0] == '.')) return false;
  const std::string low = py_lower(t);
  int base = 0;
  if (low.size() > 2 && low[0] == '0' && (low[1] == 'x' || low[1] == 'o' || low[1] == 'b'))
    base = low[1] == 'x' ? 16 : low[1] == 'o' ? 8 : 2;
  if (base) {
    std::string digits;
    for (size_t i = 2; i < low.size(); ++i) {
      const char c = low[i];
      if (c == '_') {
        if (i + 1 >= low.size() || low[i + 1] == '_') return false;
        continue;
      }
      const int d = std::isdigit((unsigned char)c) ? c - '0' : (c >= 'a' && c <= 'f') ? c - 'a' + 10 : 99;
      if (d >= base) return false;
      digits += c;
    }
    if (digits.empty()) return false;
    v = (double)std::strtoull(digits.c_str(), nullptr, base);
    if (sign == "-") v = -v;
    is_int = true;
    return true;
  }
  const bool looks_int = low.find_first_of(".e") == std::string::npos;
  if (looks_int) {
    std::string digits;
    if (scan_digits(t, 0, digits) != t.size()) return false;
    // Python 3: no leading zeros in a non-zero decimal literal
    if (digits.size() > 1 && digits[0] == '0' && digits.find_first_not_of('0') != std::string::npos)
      return false;
    v = std::strtod(digits.c_str(), nullptr);
    if (sign == "-") v = -v;
    is_int = true;
    return true;
  }
  if (!py_float(t, v) || py_lower(t).find_first_of("in") != std::string::npos) return false;
  if (sign == "-") v = -v;
  is_int = false;
  return true;
}

// params.parse_size2 ("7", "(7, 7)", "[7,5]", "(7,)") -> (h, w), before the sign check
inline std::pair<long long, long long> parse_size2(const std::string& name, const std::string& raw) {
  const auto bad = [&]() { return param_fail(name, py_str_repr(raw), "an int or a (height, width) tuple"); };
  std::string t = py_strip(raw);
  if (!t.empty() && (t[0] == '(' || t[0] == '[')) {
    if (t.back() != (t[0] == '(' ? ')' : ']')) throw bad();
    t = t.substr(1, t.size() - 2);  // "(7)" is 7, "(7,)" a 1-tuple: both give (7, 7)
  }
  if (t.find_first_of("()[]") != std::string::npos) throw bad();
  std::vector<std::string> items;
  size_t start = 0;
  for (;;) {
    const size_t comma = t.find(',', start);
    items.push_back(py_strip(t.substr(start, comma == std::string::npos ? std::string::npos
                                                                          : comma - start)));
    if (comma == std::string::npos) break;
    start = comma + 1;
  }
  if (items.size() > 1 && items.back().empty()) items.pop_back();  // a trailing comma
  for (const auto& item : items)
    if (item.empty()) throw bad();
  if (items.size() == 1) items.push_back(items[0]);
  if (items.size() != 2) throw bad();
  long long out[2];
  for (int k = 0; k < 2; ++k) {
    double v;
    bool is_int;
    if (!literal_number(items[k], v, is_int) || !std::isfinite(v) || v != std::trunc(v) ||
        std::fabs(v) >= 9.2e18)
      throw bad();
    out[k] = (long long)v;
  }
  return {out[0], out[1]};
}

// params._GROUP_EXPECTED
const char* const GROUP_EXPECTED =
    "0 (= the pooled grid), a positive int or a (gh, gw) pair of positive ints";

// params.parse_group ("0", "3", "(3, 4)", "[3, 4]") -> (gh, gw): parse_size2's spellings,
// the group grid's own expectation in the message; signs are checked by check_group
inline std::pair<long long, long long> parse_group(const std::string& name,
                                                   const std::string& raw) {
  try {
    return parse_size2(name, raw);
  } catch (const OpError&) {
    throw param_fail(name, py_str_repr(raw), GROUP_EXPECTED);
  }
}

// A group_size (gh, gw) as params.py's messages spell it: "3" when square, else "(3, 4)"
inline std::string py_group_repr(long long gh, long long gw) {
  return gh == gw ? std::to_string(gh) : py_pair_repr(gh, gw);
}

inline std::string parse_choice(const std::string& name, const std::string& raw,
                                const std::vector<std::string>& choices,
                                const std::string& got_repr) {
  const std::string t = py_lower(py_strip(raw));
  for (const auto& c : choices)
    if (t == c) return t;
  std::string expected = "one of ";
  for (size_t i = 0; i < choices.size(); ++i)
    expected += (i ? ", " : "") + py_str_repr(choices[i]);
  throw param_fail(name, got_repr, expected);
}

// A ``legacy`` field (params._legacy): '' or 'none', or one of ``kernels``
inline std::string parse_legacy(const std::string& name, const std::string& raw,
                                const std::vector<std::string>& kernels) {
  std::string t = py_lower(py_strip(raw));
  if (t == "none") t = "";
  std::vector<std::string> choices{""};
  choices.insert(choices.end(), kernels.begin(), kernels.end());
  return parse_choice(name, t, choices, py_str_repr(t));
}

// MXNet's own attributes (``__profiler_scope__``, ``__ext_dtype__``, ...) are not
// parameters.
inline bool is_hidden_attr(const std::string& key) {
  return key.size() >= 4 && key.compare(0, 2, "__") == 0 &&
         key.compare(key.size() - 2, 2, "__") == 0;
}

// An op's keyword arguments as ParamBase._parse reads them: ``fields`` in the struct's
// order; MXNet's hidden attributes and ``extras`` (built-in parameters the op handles
// itself) skipped; an unknown key first, then each field's parse as its getter is
// called (in field order), then finish(): the missing required ones.  Every message
// starts with the op's name, as params.py's.
class Kwargs {
 public:
  Kwargs(const std::string& op, const std::unordered_map<std::string, std::string>& attrs,
         std::vector<std::string> fields, std::vector<std::string> required,
         std::vector<std::string> extras = {})
      : op_(op), fields_(std::move(fields)), required_(std::move(required)) {
    for (const auto& kv : attrs) {
      if (is_hidden_attr(kv.first)) continue;
      bool extra = false;
      for (const auto& e : extras) extra = extra || kv.first == e;
      if (!extra) given_.insert(kv);  // (sorted: a deterministic first error)
    }
    for (const auto& kv : given_) {
      bool ok = false;
      for (const auto& f : fields_) ok = ok || kv.first == f;
      if (!ok) {
        std::string names;
        for (const auto& f : fields_) names += (names.empty() ? "" : ", ") + f;
        throw OpError(op_ + ": unknown parameter '" + kv.first + "' (= " +
                      py_str_repr(kv.second) + "); known parameters: " + names);
      }
    }
  }

  std::pair<long long, long long> size2(const char* name) {
    return get(name, std::pair<long long, long long>(0, 0), parse_size2);
  }
  double real(const char* name, double fallback) { return get(name, fallback, parse_float); }
  long long integer(const char* name, long long fallback) {
    return get(name, fallback, parse_int);
  }
  bool boolean(const char* name, bool fallback) { return get(name, fallback, parse_bool); }
  std::string choice(const char* name, const std::string& fallback,
                     const std::vector<std::string>& choices) {
    return get(name, fallback, [&](const std::string& n, const std::string& raw) {
      return parse_choice(n, raw, choices, py_str_repr(raw));
    });
  }
  // a position-sensitive group_size (params.parse_group); (0, 0), the pooled grid, if absent
  std::pair<long long, long long> group(const char* name) {
    return get(name, std::pair<long long, long long>(0, 0), parse_group);
  }
  std::string legacy(const char* name, const std::vector<std::string>& kernels) {
    return get(name, std::string(), [&](const std::string& n, const std::string& raw) {
      return parse_legacy(n, raw, kernels);
    });
  }

  // the missing required parameters (after every getter)
  void finish() const {
    std::string missing;
    for (const auto& k : required_)
      if (!given_.count(k)) missing += (missing.empty() ? "'" : ", '") + k + "'";
    if (!missing.empty()) throw OpError(op_ + ": missing required parameter(s) " + missing);
  }

  // A check of ParamBase.__post_init__ (or the struct's own): ``parameter '<name>':
  // expected <expected>, got <got_repr>`` unless ok
  void check(const char* name, bool ok, const std::string& expected,
             const std::string& got_repr) const {
    if (!ok) throw OpError(op_ + ": " + param_fail(name, got_repr, expected).what());
  }
  void positive(const char* name, bool ok, const std::string& got_repr) const {
    check(name, ok, "positive value(s)", got_repr);
  }

 private:
  template <typename V, typename F>
  V get(const char* name, V fallback, F&& parse) {
    auto it = given_.find(name);
    if (it == given_.end()) return fallback;
    try {
      return parse(name, it->second);
    } catch (const OpError& e) {
      throw OpError(op_ + ": " + e.what());
    }
  }

  std::string op_;
  std::vector<std::string> fields_, required_;
  std::map<std::string, std::string> given_;
};

// _GroupGrid.__post_init__'s sign rule: group_size is (0, 0) or two positive sizes
inline void check_group(const Kwargs& kw, long long gh, long long gw) {
  kw.check("group_size", (gh == 0 && gw == 0) || (gh > 0 && gw > 0), GROUP_EXPECTED,
           py_group_repr(gh, gw));
}

// params.py's limits: MAX_ELEMENTS (SIZE_BOUNDS), MAX_SAMPLES_PER_SIDE (SAMPLES_BOUNDS),
// geometry.MAX_SAMPLES_PER_AXIS
const long long MAX_ELEMENTS = (1LL << 31) - 2;
const char* const SIZE_WHY = "2^31 - 2, the most elements of an MXNet array";
const long long MAX_SAMPLES_PER_SIDE = 1024;  // isqrt(geometry.MAX_ROTATED_SAMPLES = 2^20)
const long long MAX_SAMPLES_PER_AXIS_PARAM = 1LL << 22;

// ---- threads of a native launch (mx_roi.parallel.num_threads, loader.native_threads) --
inline int num_threads() {
  const char* env = std::getenv("MX_ROI_NUM_THREADS");
  if (env && *env) {
    const int v = std::atoi(env);
    return v > 0 ? v : 1;
  }
  const char* omp = std::getenv("OMP_NUM_THREADS");
  if (omp && *omp) {
    const int v = std::atoi(omp);
    if (v > 0) return v;
  }
  static int cores = 0;
  if (cores == 0) {
#if defined(__linux__)
    cpu_set_t set;
    cores = sched_getaffinity(0, sizeof set, &set) == 0 ? CPU_COUNT(&set) : 1;
#else
    cores = 1;
#endif
  }
  return cores < 1 ? 1 : (cores > 8 ? 8 : cores);
}

// loader.NATIVE_MIN_ITEMS_PER_THREAD
inline int native_threads(long long items) {
  const long long by_items = items >> 16;
  const long long t = num_threads() < by_items ? num_threads() : by_items;
  return t < 1 ? 1 : (int)t;
}

}  // namespace mx_roi_ext
