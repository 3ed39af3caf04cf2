// SPDX-License-Identifier: Apache-2.0
// The daemon's Prometheus textfile as node-exporter would read it, checked line by line against the
// format (exposition_parser.h) and the project's naming. Header-only, for Catch2 test programs.
#pragma once

#include <catch2/catch.hpp>
#include <fstream>
#include <iterator>
#include <regex>
#include <string>

#include "exposition_parser.h"

namespace tmsdisk::testing {

// The file at `path`, parsed: every line valid, every sample named tmsdisk_*, every family with both
// its HELP and its TYPE.
inline ParsedExposition read_metrics(const std::string& path) {
  std::ifstream in(path);
  REQUIRE(in);
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  ParsedExposition e = parse_exposition(text);
  INFO(text);
  for (const auto& p : e.problems) UNSCOPED_INFO(p);
  CHECK(e.problems.empty());
  const std::regex valid_name("^tmsdisk_[a-z0-9_]+$");
  for (const auto& s : e.samples) CHECK(std::regex_match(s.name, valid_name));
  for (const auto& [name, type] : e.type) CHECK(e.help.count(name));
  for (const auto& [name, help] : e.help) CHECK(e.type.count(name));
  return e;
}

}  // namespace tmsdisk::testing
