// How the C interfaces (cpu/c_api.cpp, cuda/c_api.cu) report a failed check: inside, a
// check throws ArgumentError (its kind and message); each entry point runs its body through
// `guarded`, which returns 0 or the kind and keeps the message for the library's
// *_last_error() (per thread), so no C++ exception crosses the C boundary.
#pragma once

#include <exception>
#include <string>
#include <type_traits>

namespace chunk_llama_api {

enum : int { kOk = 0, kValueError = 1, kTypeError = 2 };  // CHUNK_LLAMA_OK, *_VALUE_ERROR, *_TYPE_ERROR

struct ArgumentError {
  int kind;
  std::string message;
};

inline std::string& last_error() {
  thread_local std::string message;
  return message;
}

// Text of a message part. Not std::ostringstream: its constructor needs a libstdc++ of
// GCC 9 or newer, which would narrow the wheel to manylinux_2_31 (std::string: GCC 5).
template <typename Part>
std::string text_of(const Part& part) {  // a number, an enum's value, or text (string, pointer, array)
  if constexpr (std::is_arithmetic_v<Part>) {
    return std::to_string(part);
  } else if constexpr (std::is_enum_v<Part>) {
    return std::to_string(static_cast<long long>(part));
  } else {
    return std::string(part);
  }
}

template <typename... Parts>
[[noreturn]] void fail(int kind, const Parts&... parts) {
  std::string message;
  ((message += text_of(parts)), ...);
  throw ArgumentError{kind, message};
}

// Runs an entry point's body: 0, or the failed check's kind with its message kept.
template <typename Body>
int guarded(Body&& body) {
  try {
    body();
    return kOk;
  } catch (const ArgumentError& error) {
    last_error() = error.message;
    return error.kind;
  } catch (const std::exception& error) {  // e.g. std::bad_alloc
    last_error() = error.what();
    return kValueError;
  }
}

}  // namespace chunk_llama_api

#define CHECK_VALUE(cond, ...)                                                   \
  do {                                                                                       \
    if (!(cond)) ::chunk_llama_api::fail(::chunk_llama_api::kValueError, __VA_ARGS__);      \
  } while (0)
#define CHECK_TYPE(cond, ...)                                                    \
  do {                                                                                       \
    if (!(cond)) ::chunk_llama_api::fail(::chunk_llama_api::kTypeError, __VA_ARGS__);       \
  } while (0)
