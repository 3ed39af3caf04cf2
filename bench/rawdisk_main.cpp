// SPDX-License-Identifier: Apache-2.0
// tmsdisk-rawdisk: prints the raw sequential O_DIRECT write/read ceiling of a directory.
#include <CLI/CLI.hpp>
#include <cstdio>
#include <string>

#include "rawdisk.h"

int main(int argc, char** argv) {
  std::string dir;
  double gib = 4;
  unsigned request_mib = 8;
  unsigned queue_depth = 8;
  CLI::App app{"Measure sequential O_DIRECT write and read bandwidth of DIR (a temporary, unlinked file)"};
  app.add_option("dir", dir, "Directory on the disk to measure")->required()->check(CLI::ExistingDirectory);
  app.add_option("--gib", gib, "GiB written then read")->capture_default_str()->check(CLI::PositiveNumber);
  app.add_option("--request-mib", request_mib, "MiB per request")->capture_default_str()->check(CLI::Range(1u, 1024u));
  app.add_option("--queue-depth", queue_depth, "Requests in flight")
      ->capture_default_str()
      ->check(CLI::Range(1u, 4096u));
  CLI11_PARSE(app, argc, argv);

  auto bytes = static_cast<uint64_t>(gib * (1ull << 30));
  auto r = tmsdisk::bench::measure_raw_disk(dir, bytes, request_mib << 20, queue_depth);
  if (!r) {
    std::fprintf(stderr, "tmsdisk-rawdisk: %s\n", r.error().describe().c_str());
    return 1;
  }
  std::printf("directory  %s\n", dir.c_str());
  std::printf("bytes      %llu each way, %u MiB requests, %u in flight\n", static_cast<unsigned long long>(r->bytes),
              request_mib, queue_depth);
  std::printf("write      %.3f GB/s (%.0f MiB/s, including one fdatasync)\n", r->write_bytes_per_s / 1e9,
              r->write_bytes_per_s / (1 << 20));
  std::printf("read       %.3f GB/s (%.0f MiB/s)\n", r->read_bytes_per_s / 1e9, r->read_bytes_per_s / (1 << 20));
  std::printf("O_DIRECT   %s\n", r->direct_io ? "yes" : "no");
  std::printf("engine     %s\n", r->io_uring ? "io_uring" : "pread/pwrite");
  if (!r->notes.empty()) std::printf("notes      %s\n", r->notes.c_str());
  return 0;
}
