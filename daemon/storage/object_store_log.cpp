// SPDX-License-Identifier: Apache-2.0
// The object store's log: records and the file (object_store_log.h).
#include "object_store_log.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include <bit>
#include <cerrno>
#include <cstring>

#include "storage_fs.h"

namespace tmsdisk::storage::detail {

static_assert(std::endian::native == std::endian::little, "the log is read and written as little-endian");

namespace {

template <class T>
void put_le(std::string& out, T v) {
  char b[sizeof(T)];
  std::memcpy(b, &v, sizeof(T));
  out.append(b, sizeof(T));
}

// A record's body, field by field; every read says whether the bytes were there.
class Fields {
 public:
  explicit Fields(std::string_view body) : body_(body) {}
  template <class T>
  bool take(T& v) {
    if (body_.size() < sizeof(T)) return false;
    std::memcpy(&v, body_.data(), sizeof(T));
    body_.remove_prefix(sizeof(T));
    return true;
  }
  bool take_text(std::string& out, std::size_t length) {
    if (body_.size() < length) return false;
    out.assign(body_.substr(0, length));
    body_.remove_prefix(length);
    return true;
  }
  std::size_t left() const noexcept { return body_.size(); }

 private:
  std::string_view body_;
};

// The fields after the kind; false when they are not exactly the kind's.
bool read_body(Fields& f, LogRecord& r) {
  switch (r.kind) {
    case LogKind::Header: {
      uint64_t magic = 0;
      return f.take(magic) && magic == kObjectLogMagic && f.take(r.version) && f.take(r.chunk_bytes) &&
             f.take(r.roots) && f.take(r.next_handle) && f.left() == 0;
    }
    case LogKind::Created: {
      uint8_t length = 0;
      return f.take(r.handle) && f.take(r.size) && f.take(length) && f.take_text(r.name, length) && f.left() == 0;
    }
    case LogKind::Removed: return f.take(r.handle) && f.left() == 0;
    case LogKind::Committed: {
      uint64_t count = 0;
      if (!f.take(r.handle) || !f.take(count) || count != f.left() / 32 || f.left() % 32 != 0) return false;
      r.chunks.resize(count);
      for (auto& c : r.chunks) {
        f.take(c.chunk);
        f.take(c.offset);
        f.take(c.seal.low);
        f.take(c.seal.high);
      }
      return true;
    }
  }
  return false;
}

uint64_t frame_hash(std::string_view length_and_body) {
  return XXH3_64bits(length_and_body.data(), length_and_body.size());
}

}  // namespace

void encode_log_record(std::string& out, const LogRecord& r) {
  std::string body;
  put_le(body, static_cast<uint8_t>(r.kind));
  switch (r.kind) {
    case LogKind::Header:
      put_le(body, kObjectLogMagic);
      put_le(body, r.version);
      put_le(body, r.chunk_bytes);
      put_le(body, r.roots);
      put_le(body, r.next_handle);
      break;
    case LogKind::Created: {
      const std::size_t length = std::min<std::size_t>(r.name.size(), UINT8_MAX);
      put_le(body, r.handle);
      put_le(body, r.size);
      put_le(body, static_cast<uint8_t>(length));
      body.append(r.name, 0, length);
      break;
    }
    case LogKind::Removed: put_le(body, r.handle); break;
    case LogKind::Committed:
      put_le(body, r.handle);
      put_le(body, static_cast<uint64_t>(r.chunks.size()));
      for (const auto& c : r.chunks) {
        put_le(body, c.chunk);
        put_le(body, c.offset);
        put_le(body, c.seal.low);
        put_le(body, c.seal.high);
      }
      break;
  }
  const std::size_t start = out.size();
  put_le(out, static_cast<uint32_t>(body.size()));
  out += body;
  put_le(out, frame_hash(std::string_view(out).substr(start)));
}

std::optional<LogRecord> LogReader::fail(std::string why) {
  why_ = std::move(why);
  return std::nullopt;
}

std::optional<LogRecord> LogReader::next() {
  const std::size_t left = bytes_.size() - pos_;
  if (left == 0) return std::nullopt;
  uint32_t length = 0;
  if (left < sizeof(length)) return fail(fmt::format("a torn record of {} bytes", left));
  std::memcpy(&length, bytes_.data() + pos_, sizeof(length));
  if (length == 0 || length > left - sizeof(length) || left - sizeof(length) - length < sizeof(uint64_t))
    return fail(fmt::format("a torn record (its length says {} bytes, {} are left)", length, left));
  const std::string_view framed = bytes_.substr(pos_, sizeof(length) + length);
  uint64_t stored = 0;
  std::memcpy(&stored, bytes_.data() + pos_ + framed.size(), sizeof(stored));
  if (frame_hash(framed) != stored) return fail("a record that fails its checksum");
  LogRecord r;
  r.begin = pos_;
  Fields f(framed.substr(sizeof(length)));
  uint8_t kind = 0;
  f.take(kind);
  if (kind < static_cast<uint8_t>(LogKind::Header) || kind > static_cast<uint8_t>(LogKind::Committed))
    return fail(fmt::format("a record of unknown kind {}", kind));
  r.kind = static_cast<LogKind>(kind);
  if (!read_body(f, r)) return fail(fmt::format("a malformed record of kind {}", kind));
  pos_ += framed.size() + sizeof(stored);
  return r;
}

Result<ObjectLog> ObjectLog::open(int dir, const std::string& dir_path, const RankFileNames& names) {
  ObjectLog log;
  log.dir_ = dir;
  log.dir_path_ = dir_path;
  log.name_ = names.objects_log;
  log.tmp_name_ = names.objects_log_tmp;
  log.path_ = join_path(dir_path, log.name_);
  log.fd_.reset(::openat(dir, log.name_.c_str(), O_RDWR | O_NOFOLLOW | O_CLOEXEC));
  if (!log.fd_) {
    if (errno == ELOOP)
      return make_error(ELOOP, log.path_ +
                                   " is a symbolic link; tmsdiskd never follows links inside a rank "
                                   "directory. It was not created by tmsdiskd: remove it");
    return errno_error("cannot open the object log " + log.path_);
  }
  struct stat st {};
  if (::fstat(log.fd_.get(), &st) != 0) return errno_error("cannot stat " + log.path_);
  if (!S_ISREG(st.st_mode) || st.st_nlink != 1)
    return make_error(EINVAL,
                      log.path_ + " is not a regular file of its own: it was not created by tmsdiskd; remove it");
  log.size_ = static_cast<uint64_t>(st.st_size);
  return log;
}

Result<ObjectLog> ObjectLog::create(int dir, const std::string& dir_path, const RankFileNames& names,
                                    std::string_view content) {
  ObjectLog log;
  log.dir_ = dir;
  log.dir_path_ = dir_path;
  log.name_ = names.objects_log;
  log.tmp_name_ = names.objects_log_tmp;
  log.path_ = join_path(dir_path, log.name_);
  if (auto st = log.replace(content); !st) return std::move(st).error();
  return log;
}

Status ObjectLog::replace(std::string_view content) {
  if (flushing()) return make_error(EBUSY, "a record of " + path_ + " is still being flushed");
  const std::string tmp_path = join_path(dir_path_, tmp_name_);
  // Unlinked first and created exclusively: whatever sits under that name (a leftover, or a link
  // planted to make the daemon write another file) is never written through.
  if (::unlinkat(dir_, tmp_name_.c_str(), 0) != 0 && errno != ENOENT) return errno_error("cannot remove " + tmp_path);
  UniqueFd fd(::openat(dir_, tmp_name_.c_str(), O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, kFileMode));
  if (!fd) return errno_error("cannot create " + tmp_path);
  Status st = write_all(fd.get(), content.data(), content.size(), tmp_path);
  if (st && ::fdatasync(fd.get()) != 0) st = errno_error("cannot flush " + tmp_path);
  if (st && ::renameat(dir_, tmp_name_.c_str(), dir_, name_.c_str()) != 0)
    st = errno_error("cannot rename " + tmp_path + " to " + name_);
  if (!st) {
    (void)::unlinkat(dir_, tmp_name_.c_str(), 0);
    return st;
  }
  // From the rename on, the name is the new file's: appends go there, whatever follows.
  fd_ = std::move(fd);
  size_ = content.size();
  if (::fsync(dir_) != 0) {
    // Until the directory is flushed, a crash may bring the old log back, without whatever this
    // one would be given: nothing more is acknowledged through it.
    problem_ = fmt::format("cannot flush directory {} after replacing {}: {}", dir_path_, path_, std::strerror(errno));
    return make_error(EIO, problem_);
  }
  return {};
}

Result<std::string> ObjectLog::read_all() const {
  struct stat st {};
  if (::fstat(fd_.get(), &st) != 0) return errno_error("cannot stat " + path_);
  if (static_cast<uint64_t>(st.st_size) > kMaxObjectLogBytes)
    return make_error(EFBIG,
                      fmt::format("{} is larger than {} bytes: not a log tmsdiskd wrote", path_, kMaxObjectLogBytes));
  std::string out(static_cast<std::size_t>(st.st_size), '\0');
  std::size_t got = 0;
  while (got < out.size()) {
    const ssize_t n = ::pread(fd_.get(), out.data() + got, out.size() - got, static_cast<off_t>(got));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return errno_error("cannot read " + path_);
    if (n == 0) break;
    got += static_cast<std::size_t>(n);
  }
  out.resize(got);
  return out;
}

Status ObjectLog::append(std::string_view records) {
  if (Status st = write(records); !st) return st;
  return flushed(::fdatasync(fd_.get()) == 0 ? 0 : -errno);
}

Status ObjectLog::write(std::string_view records) {
  if (!problem_.empty()) return make_error(EIO, problem_);
  if (unflushed_ != 0) return make_error(EBUSY, "a record of " + path_ + " is still being flushed");
  std::size_t done = 0;
  Status st;
  while (done < records.size()) {
    const ssize_t n =
        ::pwrite(fd_.get(), records.data() + done, records.size() - done, static_cast<off_t>(size_ + done));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      st = n < 0 ? errno_error("cannot append to " + path_) : make_error(ENOSPC, "cannot append to " + path_);
      break;
    }
    done += static_cast<std::size_t>(n);
  }
  if (!st) return cut(std::move(st));
  unflushed_ = records.size();
  return st;
}

Status ObjectLog::flushed(int result) {
  const uint64_t written = unflushed_;
  unflushed_ = 0;
  if (result == 0) {
    size_ += written;
    return {};
  }
  // After a failed flush the kernel may have dropped the pages it could not write and call them clean:
  // what the file holds is unknown from then on, so nothing more is acknowledged through it.
  Status st = make_error(-result, "cannot flush " + path_);
  problem_ = st.error().describe();
  return cut(std::move(st));
}

Status ObjectLog::cut(Status st) {
  // The record is not acknowledged: cut it off, so that the next one never follows its torn bytes,
  // and flush the cut, so that a crash cannot bring back a refused commit whose extents are reused.
  while (::ftruncate(fd_.get(), static_cast<off_t>(size_)) != 0) {
    if (errno == EINTR) continue;
    problem_ = fmt::format("cannot cut a failed append off {}: {}", path_, std::strerror(errno));
    return st;
  }
  (void)::fdatasync(fd_.get());
  return st;
}

}  // namespace tmsdisk::storage::detail
