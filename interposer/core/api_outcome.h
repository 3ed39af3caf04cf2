// SPDX-License-Identifier: Apache-2.0
// What the C API's functions over the engine's parts (api_objects.cpp, api_paused.cpp) return: 0, or
// a negative errno, with the message in the shim's log, the C API having no other place for it.
#pragma once

#include <cerrno>

#include "log.h"
#include "tmsdisk/common/result.h"

namespace tmsdisk::shim {

// 0, or the negative errno of `st`, logged as a warning; an errno that is an answer rather than a
// failure (`quiet`: ENODATA for resident memory a weight sync asks about as a matter of course) at
// debug level only.
inline int api_outcome(const Status& st, const char* call, int quiet = 0) noexcept {
  if (st) return 0;
  if (quiet && st.error().errnum() == quiet)
    TMS_DEBUG("%s: %s", call, st.error().message.c_str());
  else
    TMS_WARN("%s: %s", call, st.error().message.c_str());
  return -st.error().errnum();
}

// ... and *out = the value on success.
template <class T>
int api_outcome(Result<T>&& r, T* out, const char* call, int quiet = 0) noexcept {
  if (!r) return api_outcome(Status(std::move(r).error()), call, quiet);
  if (out) *out = *r;
  return 0;
}

}  // namespace tmsdisk::shim
