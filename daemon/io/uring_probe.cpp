// SPDX-License-Identifier: Apache-2.0
// The io_uring probes (uring_probe.h).
#include "uring_probe.h"

#include <liburing.h>

#include <cerrno>
#include <cstdio>

namespace tmsdisk::io {

int setup_ring(io_uring& ring, unsigned entries) noexcept {
  io_uring_params p{};
  p.flags = IORING_SETUP_SUBMIT_ALL;
  int rc = io_uring_queue_init_params(entries, &ring, &p);
  if (rc == -EINVAL) {
    p = io_uring_params{};
    rc = io_uring_queue_init_params(entries, &ring, &p);
  }
  return rc;
}

int ring_setup_error(unsigned entries) noexcept {
  io_uring ring{};
  const int rc = setup_ring(ring, entries);
  if (rc < 0) return -rc;
  io_uring_queue_exit(&ring);
  return 0;
}

std::optional<int> io_uring_disabled() noexcept {
  FILE* f = std::fopen("/proc/sys/kernel/io_uring_disabled", "re");
  if (!f) return std::nullopt;
  int v = 0;
  const bool read = std::fscanf(f, "%d", &v) == 1;
  std::fclose(f);
  return read ? std::optional<int>(v) : std::nullopt;
}

}  // namespace tmsdisk::io
