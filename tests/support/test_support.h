// SPDX-License-Identifier: Apache-2.0
// Helpers for tests and benchmarks that talk to a real tmsdiskd: temp directories, a daemon child
// process started with readiness notification, and a client that plays the shim's role.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "pattern.h"
#include "tmsdisk/common/result.h"
#include "tmsdisk/common/unique_fd.h"
#include "tmsdisk/protocol/messages.h"

namespace tmsdisk::testing {

// Ends a test that cannot run here: CTest reports exit status 77 as skipped, with the reason printed.
[[noreturn]] inline void skip(const std::string& why) {
  std::printf("SKIPPED: %s\n", why.c_str());
  std::fflush(stdout);
  std::_Exit(77);
}

// Waits for a condition another process makes true asynchronously (a closed session's teardown, a
// daemon's reconnect), checking it every few milliseconds up to a deadline; the assertion is on the
// condition, not on the time.
template <class Pred>
bool eventually(Pred pred, std::chrono::milliseconds limit = std::chrono::seconds(30)) {
  const auto deadline = std::chrono::steady_clock::now() + limit;
  while (std::chrono::steady_clock::now() < deadline) {
    if (pred()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  return pred();
}

// A fresh directory (mode 0755) removed with its contents on destruction.
class TempDir {
 public:
  explicit TempDir(const std::string& parent, const std::string& prefix = "tmsdisk-test");
  ~TempDir();
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::string& path() const { return path_; }
  std::string operator/(const std::string& rel) const { return path_ + "/" + rel; }

 private:
  std::string path_;
};

// Where tests put their files: $TMSDISK_TEST_TMP, else the build tree (a real disk filesystem
// where O_DIRECT works, unlike a tmpfs /tmp).
std::string test_tmp_root();

// A tmsdiskd child process. start() waits for its sd_notify READY=1 (a real readiness signal, not
// a sleep) or for it to exit.
class DaemonProcess {
 public:
  DaemonProcess() = default;
  ~DaemonProcess();
  DaemonProcess(const DaemonProcess&) = delete;
  DaemonProcess& operator=(const DaemonProcess&) = delete;

  // Starts `binary args...`. Returns 0 once ready, or the exit status (>0) if it exited instead;
  // its stderr is collected in log().
  int start(const std::string& binary, const std::vector<std::string>& args,
            std::chrono::milliseconds timeout = std::chrono::seconds(30));
  // SIGTERM and wait; returns the exit status.
  int stop();
  void kill9();
  pid_t pid() const { return pid_; }
  std::string log() const;

 private:
  pid_t pid_ = -1;
  std::string log_path_;
};

// Plays the shim's role on the wire: HELLO, maps the staging memfd, issues chunk requests.
class ShimClient {
 public:
  struct Options {
    std::string job = "testjob";
    int64_t rank = 0;
    uint64_t staging_bytes = 0;
    uint32_t slot_bytes = 0;
    uint64_t token = 0;
    std::string backup_dir;
  };
  static Result<ShimClient> connect(const std::string& socket, const Options& options);
  ShimClient(ShimClient&&) noexcept;
  ShimClient& operator=(ShimClient&&) noexcept;
  ~ShimClient();

  const proto::Welcome& welcome() const { return welcome_; }
  uint8_t* slot(uint32_t i) const { return staging_ + uint64_t{i} * welcome_.slot_bytes; }
  int fd() const { return fd_.get(); }

  // One request, one answer (ERROR replies become errors). `fd` rides along with the request and
  // *reply_fd receives one that comes back. Unsolicited messages (request id 0, such as IPC_USERS)
  // that arrive first are kept in notices().
  Result<proto::Message> call(const proto::Message& request, int fd = -1, UniqueFd* reply_fd = nullptr);
  // Sends without waiting; returns the request id.
  Result<uint64_t> send(const proto::Message& request, int fd = -1);
  // Next message from the daemon (any request id), with its id.
  Result<proto::Envelope> receive(UniqueFd* fd = nullptr);
  std::vector<proto::Envelope>& notices() { return notices_; }

  Status reserve(const std::vector<proto::BlobSize>& blobs);
  Status commit(proto::CommitState state, uint64_t generation);

  // Writes every blob through the slots, keeping all slots busy; fill(blob, offset, dst, len)
  // produces the bytes. Then reads them all back and checks with verify(blob, offset, src, len).
  Status write_all(const std::vector<proto::BlobSize>& blobs,
                   const std::function<void(uint64_t, uint64_t, uint8_t*, uint32_t)>& fill);
  Status read_all(const std::vector<proto::BlobSize>& blobs,
                  const std::function<bool(uint64_t, uint64_t, const uint8_t*, uint32_t)>& verify);

  void close();

 private:
  ShimClient() = default;
  UniqueFd fd_;
  uint8_t* staging_ = nullptr;
  proto::Welcome welcome_;
  uint64_t next_request_ = 1;
  std::vector<proto::Envelope> notices_;
};

}  // namespace tmsdisk::testing
