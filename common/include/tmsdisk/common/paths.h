// SPDX-License-Identifier: Apache-2.0
// Where the daemon's socket is: one rule shared by tmsctl, the shim and the docs.
#pragma once

#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <string>

namespace tmsdisk {

// The system daemon's socket (tmsdiskd.socket / tmsdiskd.service).
inline constexpr const char* kSystemSocket = "/run/tmsdisk/tmsdiskd.sock";

// The private per-user daemon's socket: $XDG_RUNTIME_DIR/tmsdisk/tmsdiskd.sock, else
// /tmp/tmsdisk-<uid>/tmsdiskd.sock.
inline std::string private_socket_path() {
  const char* xdg = std::getenv("XDG_RUNTIME_DIR");
  if (xdg && *xdg) return std::string(xdg) + "/tmsdisk/tmsdiskd.sock";
  return "/tmp/tmsdisk-" + std::to_string(::getuid()) + "/tmsdiskd.sock";
}

// $TMSDISK_SOCKET if set; else the system socket if it exists; else the private one if it exists;
// else the system socket (so the error names the path an administrator would expect).
inline std::string default_socket_path() {
  const char* env = std::getenv("TMSDISK_SOCKET");
  if (env && *env) return env;
  struct stat st{};
  if (::stat(kSystemSocket, &st) == 0 && S_ISSOCK(st.st_mode)) return kSystemSocket;
  const std::string priv = private_socket_path();
  if (::stat(priv.c_str(), &st) == 0 && S_ISSOCK(st.st_mode)) return priv;
  return kSystemSocket;
}

}  // namespace tmsdisk
