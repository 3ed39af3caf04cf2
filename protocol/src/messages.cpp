// SPDX-License-Identifier: Apache-2.0
// Encoding and strict decoding of the wire protocol (messages.h).
#include "tmsdisk/protocol/messages.h"

#include <cerrno>
#include <cstring>
#include <new>
#include <type_traits>

namespace tmsdisk::proto {
namespace {

template <class T>
struct is_vector : std::false_type {};
template <class T>
struct is_vector<std::vector<T>> : std::true_type {};
template <class T>
struct is_array : std::false_type {};
template <class T, std::size_t N>
struct is_array<std::array<T, N>> : std::true_type {};

template <class T>
concept HasFields = requires(T& t) {
  t.fields([](auto&&...) {});
};
template <class T>
concept HasCheck = requires(const T& t, std::string& why) {
  { t.check(why) } -> std::same_as<bool>;
};

// Appends little-endian fields to a buffer; `failed` latches on any limit violation.
class Writer {
 public:
  explicit Writer(std::vector<uint8_t>& out) : out_(out) {}
  bool failed = false;

  template <class T>
  requires std::is_integral_v<T>
  void operator()(const T& v) {
    using U = std::make_unsigned_t<T>;
    U u = static_cast<U>(v);
    for (std::size_t i = 0; i < sizeof(T); ++i) out_.push_back(static_cast<uint8_t>(u >> (8 * i)));
  }
  void operator()(const std::string& s, std::size_t max) {
    if (s.size() > max) {
      failed = true;
      return;
    }
    (*this)(static_cast<uint16_t>(s.size()));
    out_.insert(out_.end(), s.begin(), s.end());
  }
  template <class T, std::size_t N>
  void operator()(const std::array<T, N>& a) {
    for (const auto& e : a) (*this)(e);
  }
  template <class T>
  void operator()(const std::vector<T>& v) {
    if (v.size() > kMaxPayload) {
      failed = true;
      return;
    }
    (*this)(static_cast<uint32_t>(v.size()));
    for (const auto& e : v) (*this)(e);
  }
  template <HasFields T>
  void operator()(const T& record) {
    // fields() is non-const so the Reader can fill the same list; the Writer only reads.
    const_cast<T&>(record).fields(*this);
  }

 private:
  std::vector<uint8_t>& out_;
};

// Consumes little-endian fields from a span, checking bounds and limits; `error` latches.
class Reader {
 public:
  explicit Reader(std::span<const uint8_t> in) : in_(in) {}
  std::string error;
  bool ok() const { return error.empty(); }
  std::size_t remaining() const { return in_.size() - pos_; }

  template <class T>
  requires std::is_integral_v<T>
  void operator()(T& v) {
    if (!need(sizeof(T))) return;
    using U = std::make_unsigned_t<T>;
    U u = 0;
    for (std::size_t i = 0; i < sizeof(T); ++i) u |= static_cast<U>(static_cast<U>(in_[pos_ + i]) << (8 * i));
    pos_ += sizeof(T);
    v = static_cast<T>(u);
  }
  void operator()(std::string& s, std::size_t max) {
    uint16_t len = 0;
    (*this)(len);
    if (!ok()) return;
    if (len > max)
      return fail("string of " + std::to_string(len) + " bytes exceeds its limit of " + std::to_string(max));
    if (!need(len)) return;
    s.assign(reinterpret_cast<const char*>(in_.data() + pos_), len);
    pos_ += len;
    if (s.find('\0') != std::string::npos) fail("string contains a NUL byte");
  }
  template <class T, std::size_t N>
  void operator()(std::array<T, N>& a) {
    for (auto& e : a) (*this)(e);
  }
  template <class T>
  void operator()(std::vector<T>& v) {
    uint32_t count = 0;
    (*this)(count);
    if (!ok()) return;
    // Every element takes at least one byte, so a count above the remaining bytes is a lie; refusing
    // it here keeps a hostile count from making us reserve memory.
    if (count > remaining()) return fail("element count " + std::to_string(count) + " exceeds the message");
    // No reserve(count): memory then grows only with elements actually parsed, each of which
    // consumed bytes of this (at most 64 KiB) message.
    v.clear();
    for (uint32_t i = 0; i < count && ok(); ++i) {
      T e{};
      (*this)(e);
      v.push_back(std::move(e));
    }
  }
  template <HasFields T>
  void operator()(T& record) {
    record.fields(*this);
  }

  void fail(std::string why) {
    if (error.empty()) error = std::move(why);
  }

 private:
  bool need(std::size_t n) {
    if (!ok()) return false;
    if (remaining() < n) {
      fail("message truncated");
      return false;
    }
    return true;
  }
  std::span<const uint8_t> in_;
  std::size_t pos_ = 0;
};

void put_header(std::vector<uint8_t>& out, const Header& h) {
  Writer w(out);
  w(h.magic), w(h.version), w(h.type), w(h.length), w(h.flags), w(h.request_id);
}

Header read_header(std::span<const uint8_t> bytes) {
  Header h;
  Reader r(bytes.first(kHeaderSize));
  r(h.magic), r(h.version), r(h.type), r(h.length), r(h.flags), r(h.request_id);
  return h;
}

template <class T>
bool decode_body(std::span<const uint8_t> payload, Message& out, std::string& error) {
  T msg{};
  Reader r(payload);
  msg.fields(r);
  if (!r.ok()) {
    error = std::string(type_name(T::kType)) + ": " + r.error;
    return false;
  }
  if (r.remaining() != 0) {
    error = std::string(type_name(T::kType)) + ": " + std::to_string(r.remaining()) + " trailing bytes";
    return false;
  }
  if constexpr (HasCheck<T>) {
    std::string why;
    if (!msg.check(why)) {
      error = std::string(type_name(T::kType)) + ": " + why;
      return false;
    }
  }
  out = std::move(msg);
  return true;
}

// Maps a type number to the decoder of its alternative in Message.
template <std::size_t I = 0>
bool decode_by_type(uint16_t type, std::span<const uint8_t> payload, Message& out, std::string& error, bool& known) {
  if constexpr (I < std::variant_size_v<Message>) {
    using T = std::variant_alternative_t<I, Message>;
    if (static_cast<uint16_t>(T::kType) == type) {
      known = true;
      return decode_body<T>(payload, out, error);
    }
    return decode_by_type<I + 1>(type, payload, out, error, known);
  } else {
    known = false;
    return false;
  }
}

bool control_char(unsigned char c) noexcept {
  return c < 0x20 || c == 0x7f;
}

}  // namespace

// Text fields are shown on terminals and written to logs: no control characters (escape sequences
// could rewrite what an administrator sees, newlines could forge log lines). Bytes >= 0x80 pass
// (UTF-8).
bool printable(std::string_view s) noexcept {
  for (unsigned char c : s)
    if (control_char(c)) return false;
  return true;
}

std::string wire_text(std::string s, std::size_t max) {
  if (s.size() > max) s.resize(max);
  for (char& c : s)
    if (control_char(static_cast<unsigned char>(c))) c = ' ';
  return s;
}

std::vector<uint8_t> encode(uint64_t request_id, const Message& body) {
  try {
    std::vector<uint8_t> out;
    out.reserve(64);
    Header h;
    h.request_id = request_id;
    h.type = static_cast<uint16_t>(std::visit([](const auto& m) { return std::decay_t<decltype(m)>::kType; }, body));
    put_header(out, h);
    Writer w(out);
    std::visit([&](const auto& m) { w(m); }, body);
    if (w.failed || out.size() > kMaxMessageSize) return {};
    const auto length = static_cast<uint32_t>(out.size() - kHeaderSize);
    for (std::size_t i = 0; i < 4; ++i) out[8 + i] = static_cast<uint8_t>(length >> (8 * i));
    return out;
  } catch (const std::bad_alloc&) {
    return {};
  }
}

std::size_t encoded_size(const RankResult& r) {
  std::vector<uint8_t> out;
  Writer w(out);
  w(r);
  return out.size();
}

std::size_t encoded_size(const SessionInfo& s) {
  std::vector<uint8_t> out;
  Writer w(out);
  w(s);
  return out.size();
}

std::optional<Header> peek_header(std::span<const uint8_t> bytes) noexcept {
  if (bytes.size() < kHeaderSize) return std::nullopt;
  return read_header(bytes);
}

DecodeResult decode(std::span<const uint8_t> bytes) noexcept {
  DecodeResult res;
  try {
    if (bytes.size() < kHeaderSize) {
      res.code = EPROTO;
      res.error = "message of " + std::to_string(bytes.size()) + " bytes is shorter than the header";
      return res;
    }
    if (bytes.size() > kMaxMessageSize) {
      res.code = EMSGSIZE;
      res.error = "message of " + std::to_string(bytes.size()) + " bytes exceeds the 64 KiB limit";
      return res;
    }
    const Header h = read_header(bytes);
    if (h.magic != kMagic) {
      res.code = EPROTO;
      res.error = "bad magic: not a tmsdisk peer";
      return res;
    }
    if (h.version != kVersion) {
      res.code = EPROTONOSUPPORT;
      res.error = "peer speaks protocol version " + std::to_string(h.version) + ", this build speaks " +
                  std::to_string(kVersion) + "; run the same tmsdisk release everywhere on the node";
      return res;
    }
    if (h.flags != 0) {
      res.code = EPROTO;
      res.error = "reserved header flags are set";
      return res;
    }
    if (h.length != bytes.size() - kHeaderSize) {
      res.code = EPROTO;
      res.error = "header says " + std::to_string(h.length) + " payload bytes, message has " +
                  std::to_string(bytes.size() - kHeaderSize);
      return res;
    }
    Message body;
    bool known = false;
    std::string error;
    if (!decode_by_type(h.type, bytes.subspan(kHeaderSize), body, error, known)) {
      res.code = known ? EBADMSG : EPROTO;
      res.error = known ? error : "unknown message type " + std::to_string(h.type);
      return res;
    }
    res.envelope = Envelope{h.request_id, std::move(body)};
  } catch (const std::bad_alloc&) {
    res.envelope.reset();
    res.code = ENOMEM;
    res.error = "out of memory while decoding";
  }
  return res;
}

// ---------------------------------------------------------------------------------------------
// Semantic checks

namespace {

// What was skipped is part of the bytes covered: zero, unchanged and host-tier chunks are disjoint.
bool valid_skipped(const Skipped& s, uint64_t total, std::string& why) {
  if (s.zero_bytes > total || s.unchanged_bytes > total - s.zero_bytes ||
      s.host_bytes > total - s.zero_bytes - s.unchanged_bytes ||
      s.discarded_bytes > total - s.zero_bytes - s.unchanged_bytes - s.host_bytes) {
    why = "more bytes skipped than covered";
    return false;
  }
  return true;
}

}  // namespace

bool RankStats::check(std::string& why) const {
  if (!valid_skipped(last_pause_skipped, last_pause_bytes, why) ||
      !valid_skipped(last_resume_skipped, last_resume_bytes, why))
    return false;
  if (state > kRankStateMax) {
    why = "unknown rank state " + std::to_string(state);
    return false;
  }
  if (damaged.size() > kMaxDamagedRanges || damaged.size() > damaged_allocations) {
    why = "more damaged ranges listed than allowed or counted";
    return false;
  }
  for (const auto& d : damaged) {
    if (d.reason == 0 || d.reason > kDamageMax) {
      why = "unknown damage reason " + std::to_string(d.reason);
      return false;
    }
    if (d.size == 0) {
      why = "damaged range of size 0";
      return false;
    }
  }
  if (tags.size() > kMaxTagsReported) {
    why = "more tags listed than allowed";
    return false;
  }
  for (const auto& t : tags) {
    if (t.tag.empty() || !valid_tag(t.tag) || t.policy > 1) {
      why = "a tag entry with a bad name or an unknown policy";
      return false;
    }
  }
  return true;
}

bool ErrorReply::check(std::string& why) const {
  if (code <= 0) {
    why = "error code must be a positive errno value";
    return false;
  }
  if (!printable(message)) {
    why = "error message has control characters";
    return false;
  }
  return true;
}

bool Hello::check(std::string& why) const {
  if (role != static_cast<uint8_t>(Role::Shim) && role != static_cast<uint8_t>(Role::Control)) {
    why = "unknown role " + std::to_string(role);
    return false;
  }
  if (rank < -1) {
    why = "rank must be -1 (undeclared) or non-negative";
    return false;
  }
  if (!printable(job) || !printable(backup_dir)) {
    why = "job or backup dir has control characters";
    return false;
  }
  if (flags & ~kHelloRankDir) {
    why = "unknown HELLO flags";
    return false;
  }
  return true;
}

bool Welcome::check(std::string& why) const {
  if (restored > 1 || adopted > 1) {
    why = "restored and adopted must be 0 or 1";
    return false;
  }
  if (chunk_bytes != 0 && staging_budget_bytes / chunk_bytes < slot_count) {
    why = "slot layout exceeds the staging buffer";
    return false;
  }
  // It is printed as it is: no control characters that could rewrite a terminal.
  for (char c : version) {
    if (c < 0x21 || c > 0x7e) {
      why = "version must be printable ASCII without spaces";
      return false;
    }
  }
  return true;
}

bool Reserve::check(std::string& why) const {
  if (flags & ~(kReserveFirst | kReserveLast)) {
    why = "unknown reserve flags";
    return false;
  }
  for (const auto* runs : {&zero_runs, &host_runs}) {
    for (const auto& z : *runs) {
      if (z.count == 0 || z.first_chunk + z.count < z.first_chunk) {
        why = std::string(runs == &zero_runs ? "zero" : "host-tier") + " run of blob " + std::to_string(z.blob) +
              " is empty or wraps around";
        return false;
      }
    }
  }
  for (const auto& b : blobs) {
    if (b.size == 0) {
      why = "blob " + std::to_string(b.id) + " has size 0";
      return false;
    }
  }
  return true;
}

bool Written::check(std::string& why) const {
  if (unchanged > 1) {
    why = "WRITTEN.unchanged must be 0 or 1";
    return false;
  }
  return true;
}

bool ChunkRef::check(std::string& why) const {
  if (length == 0) {
    why = "chunk length is 0";
    return false;
  }
  if (offset > UINT64_MAX - length) {
    why = "chunk offset + length overflows";
    return false;
  }
  return true;
}

bool Commit::check(std::string& why) const {
  if (state != static_cast<uint8_t>(CommitState::Paused) && state != static_cast<uint8_t>(CommitState::Resumed)) {
    why = "unknown commit state " + std::to_string(state);
    return false;
  }
  return true;
}

bool TierAsk::check(std::string& why) const {
  if (flags & ~kTierAskAhead) {
    why = "TIER_ASK.flags has unknown bits";
    return false;
  }
  return true;
}

bool TierGrant::check(std::string& why) const {
  if (!printable(note)) {
    why = "TIER_GRANT.note has control characters";
    return false;
  }
  if (flags & ~(kTierKeep | kTierReuse | kTierReleaseFirst)) {
    why = "TIER_GRANT.flags has unknown bits";
    return false;
  }
  if ((flags & kTierReuse) && (flags & kTierReleaseFirst)) {
    why = "TIER_GRANT says both reuse and release first";
    return false;
  }
  if ((flags & kTierReleaseFirst) && bytes != 0) {
    why = "TIER_GRANT says release first with bytes";
    return false;
  }
  return true;
}

bool PauseStateReply::check(std::string& why) const {
  if (paused > 1) {
    why = "paused must be 0 or 1";
    return false;
  }
  return true;
}

namespace {

// Flags of a pause or resume: only known bits, and accepting loss only where something is restored.
bool valid_op_flags(uint8_t op, uint8_t flags, std::string& why) {
  if (flags & ~kAcceptLoss) {
    why = "unknown flags " + std::to_string(flags);
    return false;
  }
  if ((flags & kAcceptLoss) && op != static_cast<uint8_t>(CommandOp::Resume)) {
    why = "accept-loss applies to a resume only";
    return false;
  }
  return true;
}

}  // namespace

bool valid_tag(std::string_view tag) noexcept {
  if (tag.size() > kMaxTagLength) return false;
  for (char c : tag)
    if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' || c == '.' ||
          c == '-'))
      return false;
  return true;
}

bool Command::check(std::string& why) const {
  if (!valid_command_op(op)) {
    why = "unknown command " + std::to_string(op);
    return false;
  }
  if (!valid_tag(tag)) {
    why = "tag must be 1 to 63 of A-Z a-z 0-9 _ . -";
    return false;
  }
  return valid_op_flags(op, flags, why);
}

namespace {

// A no-op moved nothing and did not fail: it found the rank in the state asked for. One that claims
// bytes or an error contradicts itself, and a reader could not tell which half to believe.
bool valid_outcome(uint8_t outcome, int32_t code, uint64_t bytes, const Skipped& skipped, std::string& why) {
  if (!valid_skipped(skipped, bytes, why)) return false;
  if (outcome > kOutcomeMax) {
    why = "unknown outcome " + std::to_string(outcome);
    return false;
  }
  if (outcome == static_cast<uint8_t>(Outcome::NoOp) && (code != 0 || bytes != 0)) {
    why = "a no-op with an error code or moved bytes";
    return false;
  }
  return true;
}

}  // namespace

bool CommandDone::check(std::string& why) const {
  if (code < 0) {
    why = "result code must be 0 or a positive errno value";
    return false;
  }
  if (!printable(message)) {
    why = "result message has control characters";
    return false;
  }
  return valid_outcome(outcome, code, bytes, skipped, why);
}

bool Progress::check(std::string& why) const {
  if (done_bytes > total_bytes) {
    why = "progress beyond its total";
    return false;
  }
  return true;
}

bool SessionInfo::check(std::string& why) const {
  if (!stats.check(why)) return false;
  if (!printable(job)) {
    why = "job name has control characters";
    return false;
  }
  if (orphaned > 1) {
    why = "orphaned must be 0 or 1";
    return false;
  }
  // The time is what `tmsctl status` shows of an orphan: one without it, or a connected session
  // with one, contradicts itself.
  if ((orphaned == 1) != (orphaned_unix_ms != 0)) {
    why = orphaned ? "an orphaned session without the time it lost its connection"
                   : "a connected session with an orphaned time";
    return false;
  }
  if (host_tier_kept > 1 || (host_tier_kept && host_tier_bytes == 0)) {
    why = "host_tier_kept must be 0, or 1 with host-tier bytes";
    return false;
  }
  return true;
}

bool Sessions::check(std::string& why) const {
  for (const auto& s : sessions)
    if (!s.check(why)) return false;
  return true;
}

bool Control::check(std::string& why) const {
  if (!printable(job)) {
    why = "job name has control characters";
    return false;
  }
  if (!valid_tag(tag)) {
    why = "tag must be 1 to 63 of A-Z a-z 0-9 _ . -";
    return false;
  }
  if (!valid_command_op(op)) {
    why = "unknown control operation " + std::to_string(op);
    return false;
  }
  if (match == 0 || (match & ~(kMatchJob | kMatchRank | kMatchPid | kMatchAll)) ||
      ((match & kMatchAll) && match != kMatchAll)) {
    why = "selector must be 'all' alone, or any of job/rank/pid";
    return false;
  }
  if ((match & kMatchJob) && job.empty()) {
    why = "job selector with an empty job name";
    return false;
  }
  if ((match & kMatchRank) && rank < 0) {
    why = "rank selector with a negative rank";
    return false;
  }
  if ((match & kMatchPid) && pid <= 0) {
    why = "pid selector with a non-positive pid";
    return false;
  }
  return valid_op_flags(op, flags, why);
}

bool ControlResult::check(std::string& why) const {
  if (last > 1) {
    why = "last must be 0 or 1";
    return false;
  }
  for (const auto& r : results) {
    if (r.code < 0) {
      why = "result code must be 0 or a positive errno value";
      return false;
    }
    if (!printable(r.message) || !printable(r.job)) {
      why = "result text has control characters";
      return false;
    }
    if (!valid_outcome(r.outcome, r.code, r.bytes, r.skipped, why)) return false;
  }
  return true;
}

bool ControlTargets::check(std::string& why) const {
  if (last > 1) {
    why = "last must be 0 or 1";
    return false;
  }
  for (const auto& t : ranks) {
    if (!printable(t.job)) {
      why = "target job name has control characters";
      return false;
    }
    if (t.rank < -1 || t.pid < 0) {
      why = "target rank below -1 or negative pid";
      return false;
    }
  }
  return true;
}

namespace {

// Export ids are random and never 0 (0 means "none" on both ends).
bool valid_export_id(uint64_t id, std::string& why) {
  if (id != 0) return true;
  why = "export id 0";
  return false;
}

bool valid_ipc_memory(uint64_t bytes, int32_t device, std::string& why) {
  if (bytes == 0 || bytes > kMaxIpcBytes) {
    why = "exported size " + std::to_string(bytes) + " out of range";
    return false;
  }
  if (device < 0) {
    why = "negative device ordinal";
    return false;
  }
  return true;
}

}  // namespace

bool IpcExport::check(std::string& why) const {
  return valid_ipc_memory(bytes, device, why);
}
bool IpcExported::check(std::string& why) const {
  return valid_export_id(export_id, why);
}
bool IpcRevoke::check(std::string& why) const {
  if (freed > 1) {
    why = "freed must be 0 or 1";
    return false;
  }
  return valid_export_id(export_id, why);
}
bool IpcOpen::check(std::string& why) const {
  return valid_export_id(export_id, why);
}
bool IpcOpened::check(std::string& why) const {
  if (exporter_pid < 0) {  // 0: the exporter is outside the daemon's pid namespace
    why = "negative exporter pid";
    return false;
  }
  return valid_export_id(export_id, why) && valid_ipc_memory(bytes, device, why);
}
bool IpcClose::check(std::string& why) const {
  return valid_export_id(export_id, why);
}
bool IpcUsers::check(std::string& why) const {
  return valid_export_id(export_id, why);
}

namespace {

bool valid_object_name(std::string_view name, std::string& why) {
  if (tmsdisk::valid_object_name(name)) return true;
  why = std::string("object names are ") + kObjectNameRule;
  return false;
}

bool valid_handle(uint64_t handle, std::string& why) {
  if (handle != 0) return true;
  why = "object handle 0";
  return false;
}

}  // namespace

bool StoreOpen::check(std::string& why) const {
  if (size == 0) {
    why = "an object of 0 bytes";
    return false;
  }
  if (flags != 0 && flags != kStoreOpenHost && flags != kStoreOpenHeld) {
    why = "STORE_OPEN.flags must be 0, kStoreOpenHost or kStoreOpenHeld";
    return false;
  }
  return valid_object_name(name, why);
}
bool StoreOpened::check(std::string& why) const {
  if (created > 1) {
    why = "STORE_OPENED.created must be 0 or 1";
    return false;
  }
  return valid_handle(handle, why);
}
bool StoreCommit::check(std::string& why) const {
  if (flags & ~kStoreDiscard) {
    why = "unknown STORE_COMMIT flags";
    return false;
  }
  if (length == 0 || offset > UINT64_MAX - length) {
    why = "an empty or overflowing range";
    return false;
  }
  return valid_handle(handle, why);
}
bool StoreRemove::check(std::string& why) const {
  return valid_object_name(name, why);
}
bool SetRankDir::check(std::string& why) const {
  if (path.empty() || !printable(path)) {
    why = "the directory's name is empty or has control characters";
    return false;
  }
  return true;
}

// ---------------------------------------------------------------------------------------------
// Names

const char* type_name(MsgType type) noexcept {
  switch (type) {
    case MsgType::Error: return "ERROR";
    case MsgType::Ok: return "OK";
    case MsgType::Hello: return "HELLO";
    case MsgType::Welcome: return "WELCOME";
    case MsgType::Reserve: return "RESERVE";
    case MsgType::Write: return "WRITE";
    case MsgType::Written: return "WRITTEN";
    case MsgType::Read: return "READ";
    case MsgType::ReadDone: return "READ_DONE";
    case MsgType::Commit: return "COMMIT";
    case MsgType::PauseState: return "PAUSE_STATE";
    case MsgType::PauseStateReply: return "PAUSE_STATE_REPLY";
    case MsgType::TierAsk: return "TIER_ASK";
    case MsgType::TierGrant: return "TIER_GRANT";
    case MsgType::TierRelease: return "TIER_RELEASE";
    case MsgType::TierAdopt: return "TIER_ADOPT";
    case MsgType::TierKeep: return "TIER_KEEP";
    case MsgType::TierReclaim: return "TIER_RECLAIM";
    case MsgType::Report: return "REPORT";
    case MsgType::Command: return "COMMAND";
    case MsgType::CommandDone: return "COMMAND_DONE";
    case MsgType::Progress: return "PROGRESS";
    case MsgType::ListSessions: return "LIST_SESSIONS";
    case MsgType::Sessions: return "SESSIONS";
    case MsgType::Control: return "CONTROL";
    case MsgType::ControlResult: return "CONTROL_RESULT";
    case MsgType::Gc: return "GC";
    case MsgType::GcResult: return "GC_RESULT";
    case MsgType::ControlTargets: return "CONTROL_TARGETS";
    case MsgType::IpcExport: return "IPC_EXPORT";
    case MsgType::IpcExported: return "IPC_EXPORTED";
    case MsgType::IpcRevoke: return "IPC_REVOKE";
    case MsgType::IpcOpen: return "IPC_OPEN";
    case MsgType::IpcOpened: return "IPC_OPENED";
    case MsgType::IpcClose: return "IPC_CLOSE";
    case MsgType::IpcUsers: return "IPC_USERS";
    case MsgType::StoreOpen: return "STORE_OPEN";
    case MsgType::StoreOpened: return "STORE_OPENED";
    case MsgType::StoreWrite: return "STORE_WRITE";
    case MsgType::StoreRead: return "STORE_READ";
    case MsgType::StoreCommit: return "STORE_COMMIT";
    case MsgType::StoreRemove: return "STORE_REMOVE";
    case MsgType::SetRankDir: return "SET_RANK_DIR";
  }
  return "UNKNOWN";
}

const char* state_name(RankState state) noexcept {
  switch (state) {
    case RankState::Running: return "running";
    case RankState::Pausing: return "pausing";
    case RankState::Paused: return "paused";
    case RankState::Resuming: return "resuming";
    case RankState::PartiallyPaused: return "partially-paused";
  }
  return "unknown";
}

const char* outcome_name(Outcome outcome) noexcept {
  switch (outcome) {
    case Outcome::Done: return "done";
    case Outcome::NoOp: return "no-op";
  }
  return "unknown";
}

const char* unmanaged_name(Unmanaged reason) noexcept {
  switch (reason) {
    case Unmanaged::Small: return "small";
    case Unmanaged::Exported: return "exported";
    case Unmanaged::Imported: return "imported";
    case Unmanaged::Multicast: return "multicast";
    case Unmanaged::Pool: return "pool";
    case Unmanaged::ManagedMemory: return "managed-memory";
    case Unmanaged::Other: return "other";
    case Unmanaged::Resident: return "resident-by-request";
  }
  return "unknown";
}

const char* damage_name(Damage reason) noexcept {
  switch (reason) {
    case Damage::ChecksumMismatch: return "checksum-mismatch";
    case Damage::ReadError: return "read-error";
    case Damage::Missing: return "missing";
  }
  return "unknown";
}

}  // namespace tmsdisk::proto
