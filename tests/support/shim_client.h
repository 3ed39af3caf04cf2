// SPDX-License-Identifier: Apache-2.0
// A client that plays the shim's role on the wire: HELLO, the staging memfd mapped, chunk requests.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "tmsdisk/common/result.h"
#include "tmsdisk/common/unique_fd.h"
#include "tmsdisk/protocol/messages.h"

namespace tmsdisk::testing {

// Plays the shim's role on the wire: HELLO, maps the staging memfd, issues chunk requests.
class ShimClient {
 public:
  struct Options {
    std::string job = "testjob";
    int64_t rank = 0;
    uint64_t staging_budget_bytes = 0;
    uint32_t chunk_bytes = 0;
    uint64_t token = 0;
    std::string backup_dir;
    int dir_fd = -1;  // not -1: HELLO hands this directory over as the rank's own (kHelloRankDir)
  };
  static Result<ShimClient> connect(const std::string& socket, const Options& options);
  ShimClient(ShimClient&&) noexcept;
  ShimClient& operator=(ShimClient&&) noexcept;
  ~ShimClient();

  const proto::Welcome& welcome() const { return welcome_; }
  uint8_t* slot(uint32_t i) const { return staging_ + uint64_t{i} * welcome_.chunk_bytes; }
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
  // ... with the runs of chunks that are all zero (never written nor read afterwards).
  Status reserve(const std::vector<proto::BlobSize>& blobs, const std::vector<proto::ChunkRun>& zero_runs);
  Status commit(proto::CommitState state);

  // Writes every blob through the slots, keeping all slots busy; fill(blob, offset, dst, len)
  // produces the bytes. Then reads them all back and checks with verify(blob, offset, src, len).
  Status write_all(const std::vector<proto::BlobSize>& blobs,
                   const std::function<void(uint64_t, uint64_t, uint8_t*, uint32_t)>& fill);
  // Each slot is overwritten (0xEE) before its READ, so that a READ answered without its bytes shows;
  // a benchmark passes poison_slots = false (the shim does not do it, and it costs a pass over memory).
  Status read_all(const std::vector<proto::BlobSize>& blobs,
                  const std::function<bool(uint64_t, uint64_t, const uint8_t*, uint32_t)>& verify,
                  bool poison_slots = true);

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
