// SPDX-License-Identifier: Apache-2.0
// Protocol encode/decode round trips and rejection of malformed input.
#include <catch2/catch.hpp>

#include "tmsdisk/protocol/messages.h"

using namespace tmsdisk::proto;

TEST_CASE("write round-trips") {
  Write w;
  w.slot = 3;
  w.length = 4096;
  w.blob = 7;
  w.offset = 8 << 20;
  auto bytes = encode(42, w);
  REQUIRE(bytes.size() == kHeaderSize + 24);
  auto d = decode(bytes);
  REQUIRE(d.envelope);
  CHECK(d.envelope->request_id == 42);
  auto* got = std::get_if<Write>(&d.envelope->body);
  REQUIRE(got);
  CHECK(got->slot == 3);
  CHECK(got->offset == (8u << 20));
}
