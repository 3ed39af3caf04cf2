// SPDX-License-Identifier: Apache-2.0
// Where the daemon's socket is, where tmsdiskd and libtmsdisk.so are, and where the daemon's
// configuration is: one rule shared by tmsctl, tmsdiskd, the shim and the docs.
#pragma once

#include <sys/stat.h>
#include <unistd.h>

#include <climits>
#include <cstdio>
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

// Why the private socket's directory is not trusted, in words that say whose it is and what to do;
// empty when it is trusted or does not exist yet (the daemon then creates it).
inline std::string private_dir_problem(const std::string& socket_path) {
  const std::string dir = socket_path.substr(0, socket_path.rfind('/'));
  struct stat st {};
  if (::lstat(dir.c_str(), &st) != 0 || private_dir_trusted(socket_path)) return {};
  const std::string elsewhere =
      "or set XDG_RUNTIME_DIR to a directory of your own (mode 0700), where the private "
      "daemon's socket then goes";
  if (!S_ISDIR(st.st_mode))
    return dir + std::string(" is not a directory") + (S_ISLNK(st.st_mode) ? " but a symbolic link" : "") +
           ", so the private daemon's socket cannot go there: remove it (ask root if you cannot), " + elsewhere;
  if (st.st_uid != ::getuid())
    return dir + " belongs to another user (uid " + std::to_string(st.st_uid) + "), not to you (uid " +
           std::to_string(::getuid()) +
           "): a daemon listening there would receive everything your ranks pause, so it is not used; ask its owner "
           "or root to remove it, " +
           elsewhere;
  char mode[8];
  std::snprintf(mode, sizeof(mode), "%03o", static_cast<unsigned>(st.st_mode & 0777));
  return dir + " is yours but open to other users (mode " + mode + "), so it is not used: `chmod 700 " + dir +
         "`, or remove it";
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

// The daemon's configuration file in a tree installed under `prefix`: GNUInstallDirs' rule for the
// sysconfdir, as systemd/install.cmake applies it when it installs the file. /etc for the prefixes /
// and /usr, /etc/opt/<pkg> for /opt/<pkg>, else <prefix>/etc.
inline std::string config_file_for_prefix(std::string prefix) {
  const std::string sysconf = layout::kSysconfDir;
  std::string dir;
  if (!sysconf.empty() && sysconf.front() == '/') {
    dir = sysconf;
  } else {
    while (!prefix.empty() && prefix.back() == '/') prefix.pop_back();
    if (prefix.empty() || prefix == "/usr")
      dir = "/" + sysconf;
    else if (prefix.rfind("/opt/", 0) == 0)
      dir = "/" + sysconf + prefix;
    else
      dir = prefix + "/" + sysconf;
  }
  return dir + "/tmsdisk/tmsdiskd.conf";
}

// tmsdiskd's default --config (also what tmsctl doctor names): where the install put the file for
// the prefix the running program lies in, `<prefix>/<installed_dir>` (layout::kSbinDir for
// tmsdiskd, layout::kBinDir for tmsctl), so that the .deb's daemon reads /etc/tmsdisk whatever prefix
// the build was configured with. A program that is not installed there (the build tree, a flat
// bundle) takes the configured prefix's.
inline std::string default_config_file(const char* installed_dir) {
  char exe[PATH_MAX];
  const ssize_t n = ::readlink("/proc/self/exe", exe, sizeof(exe) - 1);
  const std::string rel = installed_dir;
  if (n <= 0 || rel.empty() || rel.front() == '/') return layout::kBuiltConfigFile;
  const std::string path(exe, static_cast<std::size_t>(n));
  const std::string dir = path.substr(0, path.rfind('/'));
  const std::string tail = "/" + rel;
  if (dir.size() < tail.size() || dir.compare(dir.size() - tail.size(), tail.size(), tail) != 0)
    return layout::kBuiltConfigFile;
  return config_file_for_prefix(dir.substr(0, dir.size() - tail.size()));
}

}  // namespace tmsdisk
