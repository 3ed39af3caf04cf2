// SPDX-License-Identifier: Apache-2.0
// Raw disk ceiling (rawdisk.h): an unlinked O_DIRECT file, written then read sequentially through io::Engine.
#include "rawdisk.h"

#include <fcntl.h>
#include <linux/magic.h>
#include <sys/stat.h>
#include <sys/vfs.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>
#include <vector>

#include "io_engine.h"
#include "tmsdisk/common/memory_filesystem.h"
#include "tmsdisk/common/unique_fd.h"

namespace tmsdisk::bench {
namespace {

constexpr uint64_t kAlign = 4096;  // O_DIRECT alignment that every common device accepts

using Clock = std::chrono::steady_clock;

struct FreeDeleter {
  void operator()(void* p) const noexcept { std::free(p); }
};
using AlignedPtr = std::unique_ptr<unsigned char, FreeDeleter>;

// An unlinked file in `dir`: O_TMPFILE where the filesystem has it, else a named file unlinked at once.
Result<UniqueFd> open_unlinked(const std::string& dir, int flags) {
  flags |= O_RDWR | O_CLOEXEC;
  UniqueFd fd(::open(dir.c_str(), flags | O_TMPFILE, 0600));
  if (fd) return fd;
  if (errno != EOPNOTSUPP && errno != EISDIR) return errno_error("creating a temporary file in " + dir);
  static std::atomic<unsigned> serial{0};
  std::string name = dir + "/.tmsdisk-rawdisk-" + std::to_string(::getpid()) + "-" + std::to_string(serial++);
  fd.reset(::open(name.c_str(), flags | O_CREAT | O_EXCL, 0600));
  if (!fd) return errno_error("creating " + name);
  ::unlink(name.c_str());
  return fd;
}

// One sequential pass over [0, total) with `buffers.size()` requests in flight. A read checks the
// offset stamped at the start of each request by the write, so a misdirected request cannot pass.
Result<double> sequential_pass(io::Engine& engine, io::Op op, int fd, const std::vector<AlignedPtr>& buffers,
                               const std::vector<int>& buf_index, uint64_t total, uint32_t request_bytes, bool async) {
  std::vector<uint64_t> offset_of(buffers.size());
  uint64_t next = 0;
  int first_error = 0;
  uint64_t error_offset = 0;
  auto issue = [&](std::size_t b) {
    auto len = static_cast<uint32_t>(std::min<uint64_t>(request_bytes, total - next));
    if (op == io::Op::Write) std::memcpy(buffers[b].get(), &next, sizeof(next));
    offset_of[b] = next;
    engine.queue(io::Request{op, fd, buffers[b].get(), b < buf_index.size() ? buf_index[b] : -1, len, next, b, async});
    next += len;
  };

  auto start = Clock::now();
  for (std::size_t b = 0; b < buffers.size() && next < total; ++b) issue(b);
  engine.submit();
  std::vector<io::Completion> done;
  while (engine.in_flight() > 0) {
    done.clear();
    if (engine.wait(done) == 0) return make_error(EIO, "the I/O engine stopped making progress");
    for (const io::Completion& c : done) {
      uint64_t stamp;
      std::memcpy(&stamp, buffers[c.tag].get(), sizeof(stamp));
      int result = c.result;
      if (result == 0 && op == io::Op::Read && stamp != offset_of[c.tag]) result = -EILSEQ;
      if (result < 0 && first_error == 0) {
        first_error = -result;
        error_offset = offset_of[c.tag];
      }
      if (first_error == 0 && next < total) issue(c.tag);  // after an error, only drain
    }
    engine.submit();
  }
  if (op == io::Op::Write && first_error == 0 && ::fdatasync(fd) != 0) first_error = errno;
  std::chrono::duration<double> seconds = Clock::now() - start;
  if (first_error != 0)
    return make_error(first_error, std::string(op == io::Op::Write ? "writing" : "reading") +
                                       " the test file at offset " + std::to_string(error_offset));
  return static_cast<double>(total) / seconds.count();
}

}  // namespace

Result<RawDiskResult> measure_raw_disk(const std::string& dir, uint64_t total_bytes, uint32_t request_bytes,
                                       unsigned queue_depth) {
  if (total_bytes == 0 || request_bytes == 0 || request_bytes % kAlign != 0 || queue_depth == 0)
    return make_error(EINVAL, "raw disk test needs bytes > 0, a request size that is a multiple of 4096, depth > 0");
  try {
    RawDiskResult r;
    r.bytes = (total_bytes + kAlign - 1) / kAlign * kAlign;

    struct statfs sf {};
    if (::statfs(dir.c_str(), &sf) != 0) return errno_error("examining " + dir);
    // In memory, requests go to the kernel's workers as the daemon sends them (io::Request::async).
    const bool in_memory = in_memory_filesystem(static_cast<unsigned long>(sf.f_type));
    if (in_memory) r.notes += dir + " is in memory (tmpfs/ramfs), not a disk: requests run in io_uring's workers. ";

    auto fd = open_unlinked(dir, O_DIRECT);
    r.direct_io = fd.ok();
    if (!fd && fd.error().errnum() == EINVAL) {
      r.notes += "O_DIRECT refused by the filesystem: buffered I/O, page cache dropped before reading. ";
      fd = open_unlinked(dir, 0);
    }
    if (!fd) return std::move(fd).error();

    if (::fallocate(fd->get(), 0, 0, static_cast<off_t>(r.bytes)) != 0) {
      if (errno == ENOSPC)
        return make_error(ENOSPC, "not enough space in " + dir + " for " + std::to_string(r.bytes) + " bytes");
      if (errno != EOPNOTSUPP) return errno_error("preallocating the test file in " + dir);
      r.notes += "no fallocate: the writes allocate extents as they go. ";
    }

    io::Engine::Options options;
    options.queue_depth = queue_depth;
    // Registered (pinned) buffers, as the daemon uses for staging, where the kernel allows them;
    // plain buffers otherwise (an unprivileged RLIMIT_MEMLOCK), which the notes then say.
    options.buffer_slots = queue_depth;
    auto engine = io::Engine::create(options);
    if (!engine) return std::move(engine).error();
    r.io_uring = (*engine)->uses_io_uring();
    if (!r.io_uring) r.notes += "synchronous engine: " + (*engine)->fallback_reason() + ". ";

    // Pseudo-random contents, so that no layer below can shortcut zeros or repeated blocks.
    auto depth =
        static_cast<std::size_t>(std::min<uint64_t>(queue_depth, (r.bytes + request_bytes - 1) / request_bytes));
    std::vector<AlignedPtr> buffers;
    uint64_t x = 0x9e3779b97f4a7c15ull;
    for (std::size_t b = 0; b < depth; ++b) {
      void* p = nullptr;
      if (::posix_memalign(&p, kAlign, request_bytes) != 0) throw std::bad_alloc();
      buffers.emplace_back(static_cast<unsigned char*>(p));
      auto* words = static_cast<uint64_t*>(p);
      for (std::size_t i = 0; i < request_bytes / sizeof(uint64_t); ++i) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        words[i] = x;
      }
    }

    std::vector<int> buf_index;
    std::string why;
    for (auto& b : buffers) {
      int idx = (*engine)->register_buffer(b.get(), request_bytes, &why);
      if (idx < 0) {
        buf_index.clear();
        r.notes += "buffers not registered with io_uring (" + why + "). ";
        break;
      }
      buf_index.push_back(idx);
    }
    auto write =
        sequential_pass(**engine, io::Op::Write, fd->get(), buffers, buf_index, r.bytes, request_bytes, in_memory);
    if (!write) return std::move(write).error();
    r.write_bytes_per_s = *write;
    // Written back by the fdatasync above; for buffered I/O this makes the read come from the device.
    ::posix_fadvise(fd->get(), 0, 0, POSIX_FADV_DONTNEED);
    // Two read passes, the better one counts: right after a large write a virtual disk is still
    // flushing underneath and the first pass reads slower than the device can (seen on the H200
    // node's virtio disk). A higher ceiling only makes the ratios against it more pessimistic.
    for (int pass = 0; pass < 2; ++pass) {
      auto read =
          sequential_pass(**engine, io::Op::Read, fd->get(), buffers, buf_index, r.bytes, request_bytes, in_memory);
      if (!read) return std::move(read).error();
      r.read_bytes_per_s = std::max(r.read_bytes_per_s, *read);
    }
    if (!r.notes.empty()) r.notes.pop_back();
    return r;
  } catch (const std::bad_alloc&) {
    return make_error(ENOMEM, "allocating raw disk test buffers");
  }
}

}  // namespace tmsdisk::bench
