// SPDX-License-Identifier: Apache-2.0
// Where the daemon's socket is, and where tmsdiskd and libtmsdisk.so are: one rule shared by tmsctl,
// the shim and the docs.
#pragma once

#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <initializer_list>
#include <string>

#include "tmsdisk/common/layout.h"

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

// The private socket's directory is trusted only if it is a real directory owned by this user and
// closed to everyone else. The /tmp fallback is a public place: another user could create
// /tmp/tmsdisk-<uid> first and listen there, receiving every byte a pause writes.
inline bool private_dir_trusted(const std::string& socket_path) noexcept {
  const auto slash = socket_path.rfind('/');
  if (slash == std::string::npos || slash == 0) return false;
  struct stat st {};
  if (::lstat(socket_path.substr(0, slash).c_str(), &st) != 0) return false;
  return S_ISDIR(st.st_mode) && st.st_uid == ::getuid() && (st.st_mode & 077) == 0;
}

// $TMSDISK_SOCKET if set; else the system socket if it exists; else the private one if it exists
// in a trusted directory; else the system socket (so the error names the path an administrator
// would expect).
inline std::string default_socket_path() {
  const char* env = std::getenv("TMSDISK_SOCKET");
  if (env && *env) return env;
  struct stat st {};
  if (::stat(kSystemSocket, &st) == 0 && S_ISSOCK(st.st_mode)) return kSystemSocket;
  const std::string priv = private_socket_path();
  if (::stat(priv.c_str(), &st) == 0 && S_ISSOCK(st.st_mode) && private_dir_trusted(priv)) return priv;
  return kSystemSocket;
}

// `file` in the first of `dirs` (each relative to `from`, the directory of the running tmsctl or
// shim) where it is accessible with `mode`, as "from/dir/file"; empty if none. Callers try the
// installed layout, then `from` itself (a flat bundle, tests/gpu/bundle.sh), then the build tree.
inline std::string find_beside(const std::string& from, std::initializer_list<const char*> dirs, const char* file,
                               int mode) {
  for (const char* dir : dirs) {
    std::string path = from + "/" + dir + "/" + file;
    if (::access(path.c_str(), mode) == 0) return path;
  }
  return {};
}

// tmsdiskd beside tmsctl, whose directory is `tmsctl_dir`.
inline std::string find_daemon_beside_tmsctl(const std::string& tmsctl_dir) {
  return find_beside(tmsctl_dir, {layout::kBinToSbin, ".", layout::kBuiltCtlToDaemon}, "tmsdiskd", X_OK);
}

// libtmsdisk.so beside tmsctl, whose directory is `tmsctl_dir`.
inline std::string find_shim_beside_tmsctl(const std::string& tmsctl_dir) {
  return find_beside(tmsctl_dir, {layout::kBinToLib, ".", layout::kBuiltCtlToShim}, "libtmsdisk.so", R_OK);
}

// The Python start-up module's directory (the one holding sitecustomize.py) beside tmsctl, whose
// directory is `tmsctl_dir`: `python` in a flat bundle.
inline std::string find_python_startup_beside_tmsctl(const std::string& tmsctl_dir) {
  std::string file =
      find_beside(tmsctl_dir, {layout::kBinToPython, "python", layout::kBuiltCtlToPython}, "sitecustomize.py", R_OK);
  return file.empty() ? file : file.substr(0, file.rfind('/'));
}

// tmsdiskd beside libtmsdisk.so, whose directory is `shim_dir`.
inline std::string find_daemon_beside_shim(const std::string& shim_dir) {
  return find_beside(shim_dir, {layout::kLibToSbin, ".", layout::kBuiltShimToDaemon}, "tmsdiskd", X_OK);
}

}  // namespace tmsdisk
