// SPDX-License-Identifier: Apache-2.0
// systemd integration (readiness notification, socket activation) through libsystemd, loaded at run
// time: under systemd the library is always there, and elsewhere (a container running the private
// daemon) the daemon must not fail to start for want of it.
#pragma once

namespace tmsdisk::systemd {

// sd_notify(0, state); does nothing when libsystemd or $NOTIFY_SOCKET is absent.
void notify(const char* state) noexcept;

// sd_listen_fds(1): how many sockets systemd passed (from fd 3 on); 0 without libsystemd.
int listen_fds() noexcept;

}  // namespace tmsdisk::systemd
