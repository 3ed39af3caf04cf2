// SPDX-License-Identifier: Apache-2.0
// Result<T>: a value or an error (std::error_code + message + source location), in the spirit of
// oomd's SystemMaybe. Used on paths that must not throw, including inside the preloaded shim.
#pragma once

#include <cerrno>
#include <source_location>
#include <string>
#include <system_error>
#include <utility>
#include <variant>

namespace tmsdisk {

struct Error {
  std::error_code code;
  std::string message;  // what failed, in words a user can act on
  const char* file = "";
  unsigned line = 0;

  int errnum() const noexcept { return code.value(); }
  std::string describe() const {
    std::string out = message;
    if (code) {
      out += ": ";
      out += code.message();
    }
    return out;
  }
};

// Builds an Error from an errno value (positive) and a message, recording where it was made.
inline Error make_error(int errnum, std::string message, std::source_location where = std::source_location::current()) {
  return Error{std::error_code(errnum, std::generic_category()), std::move(message), where.file_name(),
               static_cast<unsigned>(where.line())};
}

// Same, taking errno as it is now (call right after the failing system call).
inline Error errno_error(std::string message, std::source_location where = std::source_location::current()) {
  return make_error(errno, std::move(message), where);
}

template <typename T>
class [[nodiscard]] Result {
 public:
  Result(T value) : v_(std::move(value)) {}
  Result(Error error) : v_(std::move(error)) {}

  bool ok() const noexcept { return v_.index() == 0; }
  explicit operator bool() const noexcept { return ok(); }

  T& value() & { return std::get<0>(v_); }
  const T& value() const& { return std::get<0>(v_); }
  T&& value() && { return std::get<0>(std::move(v_)); }
  T* operator->() { return &std::get<0>(v_); }
  const T* operator->() const { return &std::get<0>(v_); }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }

  const Error& error() const& { return std::get<1>(v_); }
  Error&& error() && { return std::get<1>(std::move(v_)); }

 private:
  std::variant<T, Error> v_;
};

template <>
class [[nodiscard]] Result<void> {
 public:
  Result() = default;
  Result(Error error) : error_(std::move(error)), failed_(true) {}

  bool ok() const noexcept { return !failed_; }
  explicit operator bool() const noexcept { return ok(); }
  const Error& error() const& { return error_; }
  Error&& error() && { return std::move(error_); }

 private:
  Error error_;
  bool failed_ = false;
};

using Status = Result<void>;

}  // namespace tmsdisk
