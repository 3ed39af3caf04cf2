// SPDX-License-Identifier: Apache-2.0
// A small reader of the Prometheus text exposition format (0.0.4), written apart from the daemon's
// writer, so that tests check what tmsdiskd writes against the format rather than against itself:
// every line a `# HELP`, a `# TYPE` or a `name{labels} value` sample, label values unescaped (\\, \",
// \n), and each sample's family announced by HELP and TYPE before it. Header-only.
#pragma once

#include <cerrno>
#include <cstdlib>
#include <limits>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <vector>

namespace tmsdisk::testing {

struct ParsedSample {
  std::string name;
  std::map<std::string, std::string> labels;
  double value = 0;
};

struct ParsedExposition {
  std::vector<ParsedSample> samples;
  std::map<std::string, std::string> help;  // by family name, unescaped
  std::map<std::string, std::string> type;
  std::vector<std::string> problems;  // "line N: what is wrong"; empty for a valid exposition

  // The value of the sample `name` whose labels are exactly `labels`.
  std::optional<double> value(const std::string& name, const std::map<std::string, std::string>& labels = {}) const {
    for (const auto& s : samples)
      if (s.name == name && s.labels == labels) return s.value;
    return std::nullopt;
  }
  std::vector<const ParsedSample*> all(const std::string& name) const {
    std::vector<const ParsedSample*> out;
    for (const auto& s : samples)
      if (s.name == name) out.push_back(&s);
    return out;
  }
};

namespace exposition_detail {

inline bool name_char(char c, bool first) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_' || c == ':' || (!first && c >= '0' && c <= '9');
}

// The metric or label name at `at`; advances past it. Empty when there is none.
inline std::string take_name(std::string_view line, std::size_t& at, bool metric) {
  const std::size_t start = at;
  while (at < line.size() && name_char(line[at], at == start) && (metric || line[at] != ':')) ++at;
  return std::string(line.substr(start, at - start));
}

inline std::optional<double> parse_value(std::string_view text) {
  if (text == "+Inf") return std::numeric_limits<double>::infinity();
  if (text == "-Inf") return -std::numeric_limits<double>::infinity();
  if (text == "NaN") return std::numeric_limits<double>::quiet_NaN();
  if (text.empty()) return std::nullopt;
  const std::string copy(text);
  char* end = nullptr;
  errno = 0;
  const double v = std::strtod(copy.c_str(), &end);
  if (errno != 0 || end != copy.c_str() + copy.size()) return std::nullopt;
  // strtod also reads "inf", "nan" and hex, which the format does not use.
  for (char c : copy)
    if (!((c >= '0' && c <= '9') || c == '.' || c == 'e' || c == 'E' || c == '+' || c == '-')) return std::nullopt;
  return v;
}

// The family a sample belongs to: its own name, or a histogram's name for its _bucket, _sum, _count.
inline std::string family_of(const ParsedExposition& e, const std::string& name) {
  if (e.type.count(name)) return name;
  for (std::string_view suffix : {"_bucket", "_sum", "_count"}) {
    if (name.size() > suffix.size() && name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0) {
      const std::string base = name.substr(0, name.size() - suffix.size());
      auto t = e.type.find(base);
      if (t != e.type.end() && t->second == "histogram") return base;
    }
  }
  return name;
}

}  // namespace exposition_detail

inline ParsedExposition parse_exposition(std::string_view text) {
  using namespace exposition_detail;
  ParsedExposition e;
  std::size_t number = 0;
  std::set<std::string> sampled;  // families with samples already: HELP and TYPE must come first
  while (!text.empty()) {
    ++number;
    const std::size_t nl = text.find('\n');
    if (nl == std::string_view::npos) {
      e.problems.push_back("line " + std::to_string(number) + ": the text does not end with a newline");
      break;
    }
    const std::string_view line = text.substr(0, nl);
    text.remove_prefix(nl + 1);
    auto problem = [&](const std::string& what) {
      e.problems.push_back("line " + std::to_string(number) + ": " + what + ": " + std::string(line));
    };
    if (line.starts_with("# HELP ") || line.starts_with("# TYPE ")) {
      const bool help = line[2] == 'H';
      std::size_t at = 7;
      const std::string name = take_name(line, at, true);
      if (name.empty() || at >= line.size() || line[at] != ' ') {
        problem("a metric name and a space must follow # HELP or # TYPE");
        continue;
      }
      const std::string_view rest = line.substr(at + 1);
      if (sampled.count(name)) problem(std::string(help ? "HELP" : "TYPE") + " after the family's samples");
      auto& where = help ? e.help : e.type;
      if (where.count(name)) problem(std::string("a second ") + (help ? "HELP" : "TYPE") + " for " + name);
      if (help) {
        std::string unescaped;
        for (std::size_t i = 0; i < rest.size(); ++i) {
          if (rest[i] != '\\') {
            unescaped += rest[i];
          } else if (i + 1 < rest.size() && (rest[i + 1] == '\\' || rest[i + 1] == 'n')) {
            unescaped += rest[++i] == 'n' ? '\n' : '\\';
          } else {
            problem("a backslash in HELP that escapes neither \\ nor n");
          }
        }
        e.help[name] = unescaped;
      } else {
        static const std::set<std::string_view> kTypes = {"counter", "gauge", "histogram", "summary", "untyped"};
        if (!kTypes.count(rest)) problem("unknown TYPE");
        e.type[name] = std::string(rest);
      }
      continue;
    }
    if (line.empty() || line[0] == '#') {
      problem("neither a sample nor # HELP or # TYPE");
      continue;
    }
    ParsedSample s;
    std::size_t at = 0;
    s.name = take_name(line, at, true);
    if (s.name.empty()) {
      problem("no metric name");
      continue;
    }
    bool ok = true;
    if (at < line.size() && line[at] == '{') {
      ++at;
      while (ok && at < line.size() && line[at] != '}') {
        const std::string label = take_name(line, at, false);
        if (label.empty() || at + 1 >= line.size() || line[at] != '=' || line[at + 1] != '"') {
          ok = false;
          break;
        }
        at += 2;
        std::string value;
        bool closed = false;
        while (at < line.size()) {
          const char c = line[at++];
          if (c == '"') {
            closed = true;
            break;
          }
          if (c != '\\') {
            value += c;
            continue;
          }
          if (at >= line.size()) break;
          const char next = line[at++];
          if (next == '\\' || next == '"') {
            value += next;
          } else if (next == 'n') {
            value += '\n';
          } else {
            break;  // no other escape exists
          }
        }
        if (!closed || s.labels.count(label)) {
          ok = false;
          break;
        }
        s.labels[label] = value;
        if (at < line.size() && line[at] == ',') ++at;
      }
      if (!ok || at >= line.size() || line[at] != '}') {
        problem("malformed labels");
        continue;
      }
      ++at;
    }
    if (at >= line.size() || line[at] != ' ') {
      problem("no space before the value");
      continue;
    }
    const auto value = parse_value(line.substr(at + 1));
    if (!value) {
      problem("the value is not a number");
      continue;
    }
    s.value = *value;
    const std::string family = family_of(e, s.name);
    if (!e.help.count(family) || !e.type.count(family)) problem("a sample of a family without HELP and TYPE before it");
    sampled.insert(family);
    e.samples.push_back(std::move(s));
  }
  return e;
}

}  // namespace tmsdisk::testing
