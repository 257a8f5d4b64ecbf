// Shared by every translation unit of mx_roi's MXNet extension library (mx_roi.ext):
// the error channel to MXNet, Python-compatible parameter parsing (the second
// implementation of mx_roi/params.py: the same messages, tests/test_ext_library.py
// compares them value by value), Python's repr of numbers and strings for those
// messages, and the thread count of a native launch (mx_roi.parallel's rule).
//
// No kernel code here: an op's launcher (the MX_ROI_EXT_LAUNCHER section at the end of its
// operators/<op>.cu) includes ext_launch.h for the geometry driver.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <climits>
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
#include <sys/mman.h>
#endif

#include "mxnet/lib_api.h"
#include "py_repr.h"
#include "ext_unicode.h"  // (generated at build time: mx_roi/ext/unicode_table.py)

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

// The launchers mx_roi_ext_invoke calls (ext_main.cc), by native operator name: the Custom
// door's native backend (mx_roi.cuda.library_calls) runs an op's forward or backward
// through the code its native operator runs (MX_ROI_EXT_REGISTER registers each op's
// Callbacks<Op>::invoke).
typedef void (*InvokeFn)(int direction, const std::unordered_map<std::string, std::string>&,
                         std::vector<::mxnet::ext::MXTensor>*,
                         std::vector<::mxnet::ext::MXTensor>*);
std::map<std::string, InvokeFn>& invoke_table();
struct RegisterInvoke {
  RegisterInvoke(const char* op, InvokeFn f) { invoke_table()[op] = f; }
};

// ---- the callbacks' own time (mx_roi_ext_callback_timing / mx_roi_ext_callback_times) --
// While enabled, each op's forward and backward callback adds its wall time and one call
// to its direction's totals (0: forward, 1: backward): the profiler's time of an
// extension operator minus these is MXNet's share of the call (its dispatch, and the
// reorder of oneDNN-layout inputs into fresh memory before the callback runs).
// Defined in ext_main.cc.
extern std::atomic<bool> callback_timing;
void add_callback_time(int direction, long long ns);
struct CallbackTimer {
  const int direction;
  const bool on;
  std::chrono::steady_clock::time_point t0;
  explicit CallbackTimer(int d)
      : direction(d), on(callback_timing.load(std::memory_order_relaxed)) {
    if (on) t0 = std::chrono::steady_clock::now();
  }
  ~CallbackTimer() {
    if (on)
      add_callback_time(direction, std::chrono::duration_cast<std::chrono::nanoseconds>(
                                       std::chrono::steady_clock::now() - t0).count());
  }
};

// ---- the backwards' tables (mx_roi_ext_geometry_reuse) ------------------------------
// Every backward that could take its forward's kept tables (ext_launch.h's KeptGeometry)
// counts once: built (0) or reused (1).  Defined in ext_main.cc.
void count_geometry_reuse(bool reused);

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
using ::mx_roi_repr::py_float_repr;  // (py_repr.h: the native GPU launcher's messages use it too)

// ---- Unicode (MXNet hands every value over as UTF-8) ---------------------------------------
inline std::vector<unsigned> utf8_decode(const std::string& s) {
  std::vector<unsigned> out;
  for (size_t i = 0; i < s.size();) {
    const unsigned char c = (unsigned char)s[i];
    const int n = c < 0x80 ? 1 : c >= 0xf0 ? 4 : c >= 0xe0 ? 3 : c >= 0xc0 ? 2 : 1;
    unsigned cp = n == 1 ? c : c & (0xff >> (n + 1));
    for (int k = 1; k < n && i + k < s.size(); ++k) cp = (cp << 6) | ((unsigned char)s[i + k] & 0x3f);
    out.push_back(cp);
    i += n;
  }
  return out;
}

inline std::string utf8_encode(unsigned cp) {
  std::string o;
  if (cp < 0x80) {
    o += (char)cp;
  } else if (cp < 0x800) {
    o += (char)(0xc0 | (cp >> 6));
    o += (char)(0x80 | (cp & 0x3f));
  } else if (cp < 0x10000) {
    o += (char)(0xe0 | (cp >> 12));
    o += (char)(0x80 | ((cp >> 6) & 0x3f));
    o += (char)(0x80 | (cp & 0x3f));
  } else {
    o += (char)(0xf0 | (cp >> 18));
    o += (char)(0x80 | ((cp >> 12) & 0x3f));
    o += (char)(0x80 | ((cp >> 6) & 0x3f));
    o += (char)(0x80 | (cp & 0x3f));
  }
  return o;
}

// str.isspace, the decimal value of a digit (-1: none), str.isprintable
inline bool uni_space(unsigned cp) {
  for (unsigned s : UNI_SPACE)
    if (s == cp) return true;
  return false;
}
inline int uni_digit(unsigned cp) {
  if (cp < 0x80) return cp >= '0' && cp <= '9' ? (int)(cp - '0') : -1;
  for (unsigned z : UNI_DIGIT_ZERO)
    if (cp >= z && cp < z + 10) return (int)(cp - z);
  return -1;
}
inline bool uni_printable(unsigned cp) {
  const size_t n = sizeof UNI_NOT_PRINTABLE / sizeof UNI_NOT_PRINTABLE[0] / 2;
  size_t lo = 0, hi = n;  // the first range ending at or after cp
  while (lo < hi) {
    const size_t mid = (lo + hi) / 2;
    if (UNI_NOT_PRINTABLE[2 * mid + 1] < cp) lo = mid + 1; else hi = mid;
  }
  return !(lo < n && UNI_NOT_PRINTABLE[2 * lo] <= cp);
}

// repr(str) of a UTF-8 string: single quotes unless it holds a single quote and no
// double quote; backslash escapes for the quote, \\, \t, \n, \r and, as \xhh, \uhhhh
// or \Uhhhhhhhh, every other code point that is not printable (str.isprintable).
inline std::string py_str_repr(const std::string& s) {
  const bool dq = s.find('\'') != std::string::npos && s.find('"') == std::string::npos;
  const char q = dq ? '"' : '\'';
  std::string out(1, q);
  for (unsigned c : utf8_decode(s)) {
    if (c == '\\') out += "\\\\";
    else if (c == (unsigned char)q) out += std::string("\\") + (char)q;
    else if (c == '\t') out += "\\t";
    else if (c == '\n') out += "\\n";
    else if (c == '\r') out += "\\r";
    else if (!uni_printable(c)) {
      char b[16];
      std::snprintf(b, sizeof b, c < 0x100 ? "\\x%02x" : c < 0x10000 ? "\\u%04x" : "\\U%08x", c);
      out += b;
    } else {
      out += utf8_encode(c);
    }
  }
  return out + q;
}

// ---- Python's unbounded ints (found by mx_roi.ext.fuzz: '2**64' or '1e30' was "not an
// integer" here where params.py names the bound it breaks, with the exact value).  A value
// beyond int64 parses to a sentinel near LLONG_MAX (LLONG_MIN when negative) -- beyond
// every bound, so each check fails as Python's would -- and py_int_repr prints its exact
// decimal text, kept per thread for the parse under way (Kwargs clears it).
inline std::map<long long, std::string>& big_ints() {
  static thread_local std::map<long long, std::string> table;
  return table;
}

inline long long big_int(const std::string& text, bool negative) {
  auto& t = big_ints();
  for (const auto& kv : t)
    if (kv.second == (negative ? "-" : "") + text) return kv.first;
  const long long k = (long long)t.size();
  const long long v = negative ? LLONG_MIN + k : LLONG_MAX - k;
  t[v] = (negative ? "-" : "") + text;
  return v;
}

inline std::string py_int_repr(long long v) {
  const auto& t = big_ints();
  const auto it = t.find(v);
  return it == t.end() ? std::to_string(v) : it->second;
}

// int(v) of a finite, integral double as a long long (a sentinel beyond int64)
inline long long py_int_of_double(double v) {
  if (std::fabs(v) < 9223372036854775808.0) return (long long)v;
  char buf[400];
  std::snprintf(buf, sizeof buf, "%.0f", std::fabs(v));  // (exact: glibc prints every digit)
  return big_int(buf, v < 0);
}

// The decimal text of the digits ``digits`` (no sign, no '_') in base 2..16
inline std::string digits_to_decimal(const std::string& digits, int base) {
  std::vector<unsigned> limbs{0};  // base 1e9, least significant first
  for (char c : digits) {
    unsigned long long carry = (unsigned long long)(std::isdigit((unsigned char)c)
                                                        ? c - '0' : (c | 32) - 'a' + 10);
    for (auto& l : limbs) {
      const unsigned long long x = (unsigned long long)l * base + carry;
      l = (unsigned)(x % 1000000000ULL);
      carry = x / 1000000000ULL;
    }
    if (carry) limbs.push_back((unsigned)carry);
  }
  std::string out = std::to_string(limbs.back());
  for (size_t i = limbs.size() - 1; i-- > 0;) {
    char b[16];
    std::snprintf(b, sizeof b, "%09u", limbs[i]);
    out += b;
  }
  return out;
}

// An exact integer from its digits (base 2..16), sign applied; a sentinel beyond int64
inline long long py_int_of_digits(const std::string& digits, int base, bool negative) {
  unsigned __int128 v = 0;
  bool big = false;
  for (char c : digits) {
    const int d = std::isdigit((unsigned char)c) ? c - '0' : (c | 32) - 'a' + 10;
    v = v * base + d;
    if (v > ((unsigned __int128)1 << 63)) { big = true; break; }
  }
  if (!big && (v < ((unsigned __int128)1 << 63) || (negative && v == ((unsigned __int128)1 << 63))))
    return negative ? (long long)(-(__int128)v) : (long long)v;
  return big_int(digits_to_decimal(digits, base), negative);
}

inline std::string py_pair_repr(long long a, long long b) {
  return "(" + py_int_repr(a) + ", " + py_int_repr(b) + ")";
}

// ---- parsing as mx_roi/params.py (every value arrives as a string) --------------------
inline bool is_py_space(char c) {
  return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\x0b' || c == '\x0c' ||
         (c >= '\x1c' && c <= '\x1f');
}

// str.strip(): every Unicode space (UNI_SPACE) at either end
inline std::string py_strip(const std::string& s) {
  size_t a = 0, b = s.size();
  while (a < b && is_py_space(s[a])) ++a;
  while (b > a && is_py_space(s[b - 1])) --b;
  std::string t = s.substr(a, b - a);
  if (std::all_of(t.begin(), t.end(), [](char c) { return (unsigned char)c < 0x80; })) return t;
  const std::vector<unsigned> cps = utf8_decode(t);
  size_t i = 0, j = cps.size();
  while (i < j && uni_space(cps[i])) ++i;
  while (j > i && uni_space(cps[j - 1])) --j;
  std::string out;
  for (size_t k = i; k < j; ++k) out += utf8_encode(cps[k]);
  return out;
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
inline bool py_float(const std::string& text, double& v) {
  // float() reads every Unicode decimal digit as its ASCII digit, a Unicode space as ' '
  std::string t;
  for (unsigned cp : utf8_decode(text)) {
    const int d = uni_digit(cp);
    t += d >= 0 ? (char)('0' + d) : uni_space(cp) ? ' ' : cp < 0x80 ? (char)cp : '\x7f';
  }
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
  if (!py_float(py_strip(raw), v) || !std::isfinite(v) || v != std::trunc(v))
    throw param_fail(name, py_str_repr(raw), "an integer");
  return py_int_of_double(v);  // (Python's ints are unbounded: see big_int)
}

inline double parse_float(const std::string& name, const std::string& raw) {
  double v;
  if (!py_float(py_strip(raw), v)) throw param_fail(name, py_str_repr(raw), "a number");
  if (!std::isfinite(v)) throw param_fail(name, py_str_repr(raw), "a finite number");
  return v;
}

// ---- ast.literal_eval, as far as parse_size2 reads it -----------------------------------
// A value of a Python literal: an int (exact, see big_int), a float, a str, a tuple/list,
// or anything else (bytes, complex, sets, dicts, None, True/False: parse_int refuses them
// all).  The fuzz found the earlier scanner refusing '-(7)', "'7'", '7 # c' and ints
// beyond 2^53 (rounded through a double), all of which literal_eval reads.
struct Literal {
  enum Kind { INT, FLOAT, STR, SEQ, OTHER } kind = OTHER;
  long long i = 0;
  double f = 0;
  std::string s;
  std::vector<Literal> items;
  bool negated_sign_seen = false;  // literal_eval takes one sign on a number, not '--7'
};

class LiteralParser {
 public:
  explicit LiteralParser(const std::string& t) : t_(t) {}

  // the whole text as a Python expression (a bare "7, 7" is a tuple); false: not a literal
  bool parse(Literal& out) {
    if (!sequence(out, '\0')) return false;
    skip(false);
    return i_ == t_.size();
  }

 private:
  // spaces, tabs, form feeds and comments; newlines only inside brackets (``nl``)
  void skip(bool nl) {
    for (;;) {
      while (i_ < t_.size() && (t_[i_] == ' ' || t_[i_] == '\t' || t_[i_] == '\x0c' ||
                                (nl && (t_[i_] == '\n' || t_[i_] == '\r'))))
        ++i_;
      if (i_ < t_.size() && t_[i_] == '#') {
        while (i_ < t_.size() && t_[i_] != '\n') ++i_;
        continue;
      }
      return;
    }
  }

  // items separated by commas up to ``close`` ('\0': the end); one item without a comma is
  // that item (a parenthesised expression), unless close is ']'
  bool sequence(Literal& out, char close) {
    const bool nl = close != '\0';
    std::vector<Literal> items;
    bool comma = false;
    for (;;) {
      skip(nl);
      if (i_ >= t_.size() || t_[i_] == close) break;
      Literal item;
      if (!value(item, nl)) return false;
      items.push_back(item);
      skip(nl);
      if (i_ < t_.size() && t_[i_] == ',') {
        ++i_;
        comma = true;
        continue;
      }
      break;
    }
    if (items.empty() && close != ']' && close != ')') return false;  // '' is no literal
    if (close == ']' || comma || items.empty()) {
      out.kind = Literal::SEQ;
      out.items = items;
    } else {
      out = items[0];
    }
    return true;
  }

  bool value(Literal& out, bool nl) {
    if (i_ >= t_.size()) return false;
    const char c = t_[i_];
    if (c == '(' || c == '[') {
      ++i_;
      const char close = c == '(' ? ')' : ']';
      if (!sequence(out, close)) return false;
      skip(true);
      if (i_ >= t_.size() || t_[i_] != close) return false;
      ++i_;
      return true;
    }
    if (c == '{') {  // a set or a dict: never an int (its syntax is not checked further)
      int depth = 0;
      for (; i_ < t_.size(); ++i_) {
        depth += t_[i_] == '{' ? 1 : t_[i_] == '}' ? -1 : 0;
        if (depth == 0) break;
      }
      if (i_ >= t_.size()) return false;
      ++i_;
      out.kind = Literal::OTHER;
      return true;
    }
    if (c == '+' || c == '-') {  // a sign applies to a number only ('-(7)' is -7)
      ++i_;
      skip(nl);
      Literal operand;
      if (!value(operand, nl)) return false;
      if (operand.kind != Literal::INT && operand.kind != Literal::FLOAT) return false;
      if (operand.negated_sign_seen) return false;
      out = operand;
      out.negated_sign_seen = true;
      if (c == '-') {
        if (out.kind == Literal::FLOAT) out.f = -out.f;
        else out.i = negate(out.i);
      }
      return true;
    }
    return atom(out);
  }

  static long long negate(long long v) {
    const auto& t = big_ints();
    const auto it = t.find(v);
    if (it == t.end()) return v == LLONG_MIN ? big_int("9223372036854775808", false) : -v;
    const std::string text = it->second;
    return text[0] == '-' ? big_int(text.substr(1), false) : big_int(text, true);
  }

  // a number, a string, or a name (True/False/None ...: OTHER, parse_int refuses them)
  bool atom(Literal& out) {
    const size_t start = i_;
    const char c = t_[i_];
    if (std::isalpha((unsigned char)c) || c == '_') {
      size_t j = i_;
      while (j < t_.size() && (std::isalnum((unsigned char)t_[j]) || t_[j] == '_')) ++j;
      const std::string word = t_.substr(i_, j - i_);
      if (j < t_.size() && (t_[j] == '\'' || t_[j] == '"') && word.size() <= 2) {
        const std::string w = py_lower(word);
        if (w != "r" && w != "u" && w != "b" && w != "rb" && w != "br") return false;
        i_ = j;
        if (!string(out, w.find('r') != std::string::npos)) return false;
        if (w.find('b') != std::string::npos) out.kind = Literal::OTHER;  // bytes
        return true;
      }
      if (word != "True" && word != "False" && word != "None") return false;
      i_ = j;
      out.kind = Literal::OTHER;
      return true;
    }
    if (c == '\'' || c == '"') return string(out, false);
    // a number token: digits, letters, '_' and '.', and a sign after an exponent
    size_t j = i_;
    while (j < t_.size()) {
      const char d = t_[j];
      if (std::isalnum((unsigned char)d) || d == '_' || d == '.') {
        ++j;
      } else if ((d == '+' || d == '-') && j > start && (t_[j - 1] == 'e' || t_[j - 1] == 'E') &&
                 !(t_.size() > start + 1 && t_[start] == '0' &&
                   (t_[start + 1] == 'x' || t_[start + 1] == 'X'))) {
        ++j;
      } else {
        break;
      }
    }
    const std::string tok = t_.substr(i_, j - i_);
    if (tok.empty() || !(std::isdigit((unsigned char)tok[0]) || tok[0] == '.')) return false;
    i_ = j;
    return number(tok, out);
  }

  static bool number(const std::string& tok, Literal& out) {
    const std::string low = py_lower(tok);
    if (low.back() == 'j') {  // complex: parse_int refuses it (its syntax unchecked)
      out.kind = Literal::OTHER;
      return true;
    }
    if (low.size() > 1 && low[0] == '0' && (low[1] == 'x' || low[1] == 'o' || low[1] == 'b')) {
      const int base = low[1] == 'x' ? 16 : low[1] == 'o' ? 8 : 2;
      std::string digits;
      for (size_t k = 2; k < low.size(); ++k) {
        const char d = low[k];
        if (d == '_') {  // one '_' before each digit group ('0x_1' too)
          if (k + 1 >= low.size() || low[k + 1] == '_') return false;
          continue;
        }
        const int v = std::isdigit((unsigned char)d) ? d - '0' : (d >= 'a' && d <= 'f') ? d - 'a' + 10 : 99;
        if (v >= base) return false;
        digits += d;
      }
      if (digits.empty()) return false;
      out.kind = Literal::INT;
      out.i = py_int_of_digits(digits, base, false);
      return true;
    }
    if (low.find_first_of(".e") == std::string::npos) {  // a decimal int
      std::string digits;
      if (scan_digits(tok, 0, digits) != tok.size()) return false;
      // Python 3: no leading zeros in a non-zero decimal literal
      if (digits.size() > 1 && digits[0] == '0' && digits.find_first_not_of('0') != std::string::npos)
        return false;
      out.kind = Literal::INT;
      out.i = py_int_of_digits(digits, 10, false);
      return true;
    }
    double v;
    if (!py_float(tok, v) || low.find_first_of("in") != std::string::npos) return false;
    out.kind = Literal::FLOAT;
    out.f = v;
    return true;
  }

  // a quoted string (no triple quotes); escapes \\ \' \" \t \n \r \xhh unless raw
  bool string(Literal& out, bool raw) {
    const char q = t_[i_++];
    std::string s;
    while (i_ < t_.size() && t_[i_] != q) {
      char c = t_[i_++];
      if (c == '\n') return false;
      if (c == '\\' && !raw) {
        if (i_ >= t_.size()) return false;
        const char e = t_[i_++];
        if (e == '\\' || e == '\'' || e == '"') c = e;
        else if (e == 't') c = '\t';
        else if (e == 'n') c = '\n';
        else if (e == 'r') c = '\r';
        else if (e == 'x' && i_ + 1 < t_.size() && std::isxdigit((unsigned char)t_[i_]) &&
                 std::isxdigit((unsigned char)t_[i_ + 1])) {
          c = (char)std::strtol(t_.substr(i_, 2).c_str(), nullptr, 16);
          i_ += 2;
        } else {
          return false;  // (other escapes: not read here)
        }
      } else if (c == '\\' && raw && i_ < t_.size()) {
        s += c;
        c = t_[i_++];
      }
      s += c;
    }
    if (i_ >= t_.size()) return false;
    ++i_;
    if (s.empty() && i_ - 2 < t_.size() && t_.compare(i_ - 3 < t_.size() ? i_ - 3 : 0, 3,
                                                      std::string(3, q)) == 0)
      return false;  // a triple quote
    out.kind = Literal::STR;
    out.s = s;
    return true;
  }

  const std::string& t_;
  size_t i_ = 0;
};

// params.parse_int of one literal_eval'd item: an int, an integral float or a string
// float() reads (bool, None, bytes, complex, sequences: refused)
inline bool literal_int(const Literal& v, long long& out) {
  double f;
  switch (v.kind) {
    case Literal::INT: out = v.i; return true;
    case Literal::FLOAT: f = v.f; break;
    case Literal::STR:
      if (!py_float(py_strip(v.s), f)) return false;
      break;
    default: return false;
  }
  if (!std::isfinite(f) || f != std::trunc(f)) return false;
  out = py_int_of_double(f);
  return true;
}

// params.parse_size2 ("7", "(7, 7)", "[7,5]", "(7,)", "-(7)", "'7'") -> (h, w), before the
// sign check
inline std::pair<long long, long long> parse_size2(const std::string& name, const std::string& raw) {
  const auto bad = [&]() { return param_fail(name, py_str_repr(raw), "an int or a (height, width) tuple"); };
  const std::string t = py_strip(raw);
  Literal v;
  if (t.empty() || !LiteralParser(t).parse(v)) throw bad();
  std::vector<Literal> items = v.kind == Literal::SEQ ? v.items : std::vector<Literal>{v};
  if (items.size() == 1) items.push_back(items[0]);
  if (items.size() != 2) throw bad();
  long long out[2];
  for (int k = 0; k < 2; ++k)
    if (!literal_int(items[k], out[k])) throw bad();
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
  return gh == gw ? py_int_repr(gh) : py_pair_repr(gh, gw);
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
    big_ints().clear();  // (the exact texts of this parse's ints beyond int64)
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

// loader.min_items_per_thread: $MX_ROI_MIN_ITEMS_PER_THREAD when it is ASCII digits and
// at least 1 (Python refuses any other value; here, with no one to tell, it is ignored),
// else loader.NATIVE_MIN_ITEMS_PER_THREAD = 2^16.  Read per launch, as Python reads it.
inline long long min_items_per_thread() {
  const char* env = std::getenv("MX_ROI_MIN_ITEMS_PER_THREAD");
  if (env && *env) {
    long long v = 0;
    const char* c = env;
    for (; *c >= '0' && *c <= '9'; ++c) v = v > (1LL << 40) ? v : v * 10 + (*c - '0');
    if (*c == 0 && v >= 1) return v;
  }
  return 1LL << 16;
}

// loader.native_threads
inline int native_threads(long long items) {
  const long long by_items = items / min_items_per_thread();
  const long long t = num_threads() < by_items ? num_threads() : by_items;
  return t < 1 ? 1 : (int)t;
}

// ---- huge pages for a call's fresh output (mx_roi.scratch.advise_huge_pages_at) ----------
// MXNet hands a large output fresh mmap pages in every call; the kernels' first write to
// each 4 KiB page is a page fault and its zeroing.  The launcher asks for transparent huge
// pages on MXNet's output and input gradient before they are first touched (both doors;
// the Custom door's checked path does the same, mx_roi.scratch).  Without it (issue 42's
// detector rows: ROIAlign 14x14, 256 boxes, 2 x 256 x 50 x 50, a 51 MB output) the native
// door took ~12,500 page faults more per forward than the Custom door, perf put 37% of its
// samples in the kernel's fault path (6% with the advice), and it ran up to 1.4x slower.
// scratch.HUGE_MIN_BYTES, and scratch._HUGE (the x86-64 PMD page)
const unsigned long long HUGE_MIN_BYTES = 8ULL << 20, HUGE_PAGE_BYTES = 2ULL << 20;

// The 2 MiB pages lying fully inside ``bytes`` at ``addr``: ``*start`` and ``*len`` (0:
// none, or the memory is smaller than HUGE_MIN_BYTES).  tests/test_ext_huge_pages.py checks
// it against scratch.advise_huge_pages_at through mx_roi_ext_huge_page_range.
inline void huge_page_range(unsigned long long addr, unsigned long long bytes,
                            unsigned long long* start, unsigned long long* len) {
  *start = *len = 0;
  if (bytes < HUGE_MIN_BYTES || !addr) return;
  const unsigned long long s = (addr + HUGE_PAGE_BYTES - 1) & ~(HUGE_PAGE_BYTES - 1);
  const unsigned long long e = (addr + bytes) & ~(HUGE_PAGE_BYTES - 1);
  if (e > s) {
    *start = s;
    *len = e - s;
  }
}

// madvise(MADV_HUGEPAGE) over huge_page_range (only the VMA's flags change: harmless on
// memory already touched; a failure is ignored, as scratch's)
inline void advise_huge_pages(void* addr, unsigned long long bytes) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  unsigned long long start = 0, len = 0;
  huge_page_range((unsigned long long)(size_t)addr, bytes, &start, &len);
  if (len) (void)madvise((void*)(size_t)start, (size_t)len, MADV_HUGEPAGE);
#else
  (void)addr;
  (void)bytes;
#endif
}

}  // namespace mx_roi_ext
