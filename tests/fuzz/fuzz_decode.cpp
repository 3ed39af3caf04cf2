// SPDX-License-Identifier: Apache-2.0
// libFuzzer target for the protocol decoder: any byte string must decode or be rejected, never crash,
// and whatever decodes must re-encode to the same bytes.
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "tmsdisk/protocol/messages.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace tmsdisk::proto;
  auto d = decode(std::span<const uint8_t>(data, size));
  if (!d.envelope) return 0;
  auto again = encode(d.envelope->request_id, d.envelope->body);
  if (again.size() != size || std::memcmp(again.data(), data, size) != 0) std::abort();
  return 0;
}
