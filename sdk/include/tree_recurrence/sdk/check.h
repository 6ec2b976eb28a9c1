#pragma once
// Argument checks of the torch ops, with messages built without iostreams.
//
// TR_CHECK / TR_CHECK_VALUE / TR_CHECK_TYPE / TR_CHECK_INDEX take the same arguments as torch's
// TORCH_CHECK family and throw the same c10 errors (RuntimeError, ValueError, TypeError, IndexError in
// Python), with the same text c10::str would write for the types used in messages here: strings, integers,
// floating values (as "%g"), bool, c10::ScalarType, c10::Device and sizes (IntArrayRef, "[2, 3]").
//
// Why not TORCH_CHECK itself: on the GPU machine's build (Ubuntu 24.04, g++ 13.3, the libstdc++ of
// GCC 14, torch 2.11 wheels) a message that inserted a number into c10::str's std::ostringstream from our
// plugin libraries ended the process with SIGSEGV instead of raising, while string-only messages raised
// (docs/kernels.md, "Errors on the CUDA paths"). Here a message is one
// std::string built with std::to_string / snprintf and handed to TORCH_CHECK as its only argument, which
// c10 passes through without an ostream. Like TORCH_CHECK, nothing is formatted unless the check fails.
#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <cstdio>
#include <string>
#include <string_view>
#include <type_traits>

namespace tree_recurrence::sdk::message {

inline void put(std::string& s, const char* v) { s += v ? v : "(null)"; }
inline void put(std::string& s, const std::string& v) { s += v; }
inline void put(std::string& s, std::string_view v) { s.append(v.data(), v.size()); }
inline void put(std::string& s, char v) { s += v; }
inline void put(std::string& s, bool v) { s += v ? "1" : "0"; }  // as an ostream without boolalpha
template <class T, std::enable_if_t<std::is_integral_v<T> && !std::is_same_v<T, bool> && !std::is_same_v<T, char>, int> = 0>
inline void put(std::string& s, T v) {
  s += std::to_string(v);
}
inline void put(std::string& s, double v) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%g", v);
  s += buf;
}
inline void put(std::string& s, float v) { put(s, static_cast<double>(v)); }
inline void put(std::string& s, c10::ScalarType v) { s += c10::toString(v); }
inline void put(std::string& s, const c10::Device& v) { s += v.str(); }
inline void put(std::string& s, c10::IntArrayRef v) {
  s += '[';
  for (size_t i = 0; i < v.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(v[i]);
  }
  s += ']';
}

template <class... Args>
std::string str(const Args&... args) {
  std::string s;
  (put(s, args), ...);
  return s;
}

}  // namespace tree_recurrence::sdk::message

#define TR_CHECK(cond, ...) TORCH_CHECK(cond, ::tree_recurrence::sdk::message::str(__VA_ARGS__))
#define TR_CHECK_VALUE(cond, ...) TORCH_CHECK_VALUE(cond, ::tree_recurrence::sdk::message::str(__VA_ARGS__))
#define TR_CHECK_TYPE(cond, ...) TORCH_CHECK_TYPE(cond, ::tree_recurrence::sdk::message::str(__VA_ARGS__))
#define TR_CHECK_INDEX(cond, ...) TORCH_CHECK_INDEX(cond, ::tree_recurrence::sdk::message::str(__VA_ARGS__))
#define TR_CHECK_NOT_IMPLEMENTED(cond, ...) \
  TORCH_CHECK_NOT_IMPLEMENTED(cond, ::tree_recurrence::sdk::message::str(__VA_ARGS__))
