// Python's repr of a float, for the messages of mx_roi's native libraries: the MXNet
// extension library (ext_common.h) and the native GPU launcher (ext_cuda.h), whose
// messages quote values as the Custom door's Python messages do.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>

namespace mx_roi_repr {

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

}  // namespace mx_roi_repr
