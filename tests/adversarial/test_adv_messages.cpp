// SPDX-License-Identifier: Apache-2.0
// Adversarial suite, family 1: malformed and hostile messages to a live tmsdiskd over real sockets.
//
// A table-driven generator builds, for every message type of the protocol, a valid sample and its
// mutations: wrong magic, version, length, reserved flags and type; truncated and padded payloads;
// strings over their limit, with a NUL or an escape, claiming more bytes than there are; element
// counts beyond the message; out-of-range enums and flags; then seeded random corruptions. Each goes
// on a fresh connection in each of three places: before HELLO, after a control HELLO, after a shim
// HELLO, so that wrong-role requests (a shim message on a control connection, a daemon's reply sent
// to the daemon, a second HELLO) come out of the same table. The protocol's own decoder is the
// oracle: a message it refuses must be refused by the daemon with the same code and the connection
// closed; one it accepts is refused (EPROTO) where the role may not send it, else served, and the
// connection stays usable. After each batch the daemon still serves a well-formed client and holds
// no descriptor more than before (/proc/<daemon>/fd).
//
// Then: requests well-formed on the wire but hostile in meaning, connection floods up to the
// per-user limit, and thousands of descriptors passed with messages that take none.
//
// Already elsewhere, not repeated here: the decoder's unit cases (tests/unit/test_protocol.cpp), the
// decoder fuzz target (tests/fuzz), a handful of malformed messages and a silent connection
// (tests/integration/test_daemon_hostile.cpp).
#include <poll.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <random>
#include <set>
#include <thread>
#include <type_traits>
#include <variant>

#include "adversarial.h"
#include "fd_passing.h"
#include "other_user.h"
#include "tmsdisk/protocol/client.h"
#include "tmsdisk/protocol/socket.h"

using namespace tmsdisk;
using namespace tmsdisk::adversarial;
using tmsdisk::testing::send_with_fds;

namespace {

using proto::MsgType;

// ------------------------------------------------------------------------------------------------
// The field map: where each field of a message's payload lies, walking fields() as the encoder does
// (integers little-endian, strings as u16 length + bytes, vectors as u32 count + elements). Checked
// against proto::encode for every sample, so it cannot drift from the real layout unnoticed.

struct FieldRef {
  enum Kind { Int, String, Count } kind;
  std::size_t offset;  // in the payload
  std::size_t width;   // bytes of the integer, the length or the count
  std::size_t max;     // a string's limit
};

template <class T>
concept HasFields = requires(T& t) {
  t.fields([](auto&&...) {});
};

class Mapper {
 public:
  std::vector<uint8_t> out;
  std::vector<FieldRef> fields;

  template <class T>
  requires std::is_integral_v<T>
  void operator()(const T& v) {
    fields.push_back({FieldRef::Int, out.size(), sizeof(T), 0});
    put(static_cast<uint64_t>(static_cast<std::make_unsigned_t<T>>(v)), sizeof(T));
  }
  void operator()(const std::string& s, std::size_t max) {
    fields.push_back({FieldRef::String, out.size(), 2, max});
    put(s.size(), 2);
    out.insert(out.end(), s.begin(), s.end());
  }
  template <class T, std::size_t N>
  void operator()(const std::array<T, N>& a) {
    for (const auto& e : a) (*this)(e);
  }
  template <class T>
  void operator()(const std::vector<T>& v) {
    fields.push_back({FieldRef::Count, out.size(), 4, 0});
    put(v.size(), 4);
    for (const auto& e : v) (*this)(e);
  }
  template <HasFields T>
  void operator()(const T& record) {
    const_cast<T&>(record).fields(*this);
  }

 private:
  void put(uint64_t v, std::size_t width) {
    for (std::size_t i = 0; i < width; ++i) out.push_back(static_cast<uint8_t>(v >> (8 * i)));
  }
};

// ------------------------------------------------------------------------------------------------
// One valid message of every type: the fields that a default leaves invalid are set, strings and
// vectors are non-empty so that their mutations have something to work on.

struct SampleContext {
  std::string root;  // the daemon's root, for a HELLO's backup dir
};

template <class T>
void fill_sample(T&, const SampleContext&) {}

void fill_sample(proto::ErrorReply& m, const SampleContext&) {
  m.code = EIO;
  m.message = "a reply the daemon never takes";
}
void fill_sample(proto::Hello& m, const SampleContext& c) {
  m.role = static_cast<uint8_t>(proto::Role::Shim);
  m.rank = 7;
  m.device_count = 1;
  m.job = "adv-sample";
  m.backup_dir = c.root;
  m.staging_budget_bytes = 128 * 1024;
  m.chunk_bytes = 64 * 1024;
}
void fill_sample(proto::Welcome& m, const SampleContext&) {
  m.session_id = 1;
  m.token = 2;
  m.staging_budget_bytes = 2 * MiB;
  m.chunk_bytes = 1 * MiB;
  m.slot_count = 2;
  m.rank_dir = "/nowhere";
  m.version = "0.0.0";
}
void fill_sample(proto::Reserve& m, const SampleContext&) {
  m.flags = proto::kReserveFirst | proto::kReserveLast;
  m.blobs = {{1, 4096}, {2, 8192}};
}
void fill_sample(proto::Write& m, const SampleContext&) {
  m.slot = 0;
  m.length = 4096;
  m.blob = 1;
}
void fill_sample(proto::Read& m, const SampleContext&) {
  m.slot = 1;
  m.length = 4096;
  m.blob = 2;
}
void fill_sample(proto::Commit& m, const SampleContext&) {
  m.state = static_cast<uint8_t>(proto::CommitState::Resumed);
}
void fill_sample(proto::PauseStateReply& m, const SampleContext&) {
  m.generation = 3;
}
void fill_sample(proto::Report& m, const SampleContext&) {
  m.stats.state = static_cast<uint8_t>(proto::RankState::PartiallyPaused);
  m.stats.resident_bytes = 4096;
  m.stats.damaged_allocations = 1;
  m.stats.damaged_bytes = 4096;
  m.stats.damaged = {{.address = 0x7f0000000000, .size = 4096, .reason = 1, .chunk = 0}};
}
void fill_sample(proto::Command& m, const SampleContext&) {
  m.op = static_cast<uint8_t>(proto::CommandOp::Pause);
}
void fill_sample(proto::CommandDone& m, const SampleContext&) {
  m.bytes = 4096;
  m.message = "done";
}
void fill_sample(proto::Progress& m, const SampleContext&) {
  m.done_bytes = 1;
  m.total_bytes = 2;
}
void fill_sample(proto::ListSessions& m, const SampleContext&) {
  m.start = 0;
}
void fill_sample(proto::Sessions& m, const SampleContext&) {
  m.total = 1;
  m.sessions = {proto::SessionInfo{.session_id = 1, .pid = 1, .job = "j"}};
}
void fill_sample(proto::Control& m, const SampleContext&) {
  m.op = static_cast<uint8_t>(proto::CommandOp::Pause);
  m.match = proto::kMatchJob;
  m.job = "no-rank-has-this-job";
  m.timeout_ms = 1000;
}
void fill_sample(proto::ControlResult& m, const SampleContext&) {
  m.results = {proto::RankResult{.session_id = 1, .job = "j", .message = "m"}};
}
void fill_sample(proto::ControlTargets& m, const SampleContext&) {
  m.ranks = {proto::RankTarget{.session_id = 1, .pid = 1, .rank = 0, .job = "j"}};
}
void fill_sample(proto::IpcExport& m, const SampleContext&) {
  m.bytes = 4096;
}
void fill_sample(proto::IpcExported& m, const SampleContext&) {
  m.export_id = 1;
}
void fill_sample(proto::IpcRevoke& m, const SampleContext&) {
  m.export_id = 0x1234;
}
void fill_sample(proto::IpcOpen& m, const SampleContext&) {
  m.export_id = 0x1234;
}
void fill_sample(proto::IpcOpened& m, const SampleContext&) {
  m.export_id = 1;
  m.bytes = 4096;
  m.exporter_pid = 1;
}
void fill_sample(proto::IpcClose& m, const SampleContext&) {
  m.export_id = 0x1234;
}
void fill_sample(proto::IpcUsers& m, const SampleContext&) {
  m.export_id = 1;
}
void fill_sample(proto::StoreOpen& m, const SampleContext&) {
  m.name = "adam.b0";
  m.size = 4096;
}
void fill_sample(proto::StoreOpened& m, const SampleContext&) {
  m.handle = 1;
}
void fill_sample(proto::StoreWrite& m, const SampleContext&) {
  m.length = 4096;
  m.blob = 0x5eed;
}
void fill_sample(proto::StoreRead& m, const SampleContext&) {
  m.length = 4096;
  m.blob = 0x5eed;
}
void fill_sample(proto::StoreCommit& m, const SampleContext&) {
  m.handle = 0x5eed;
  m.length = 4096;
}
void fill_sample(proto::StoreRemove& m, const SampleContext&) {
  m.name = "adam.b0";
}
void fill_sample(proto::SetRankDir& m, const SampleContext& c) {
  m.path = c.root;  // a path alone, without the directory's descriptor: refused, never opened
}

template <std::size_t... I>
std::vector<proto::Message> all_samples(const SampleContext& c, std::index_sequence<I...>) {
  std::vector<proto::Message> out{proto::Message(std::in_place_index<I>)...};
  for (auto& m : out) std::visit([&](auto& x) { fill_sample(x, c); }, m);
  return out;
}

std::vector<proto::Message> samples(const SampleContext& c) {
  return all_samples(c, std::make_index_sequence<std::variant_size_v<proto::Message>>{});
}

MsgType type_of(const proto::Message& m) {
  return std::visit([](const auto& x) { return std::decay_t<decltype(x)>::kType; }, m);
}

// ------------------------------------------------------------------------------------------------
// Roles: who may send what to the daemon (server.cpp's dispatch). Control requests are authorized by
// the peer's uid (SO_PEERCRED), not by the connection's role: a shim session may list and control
// what its user may.

bool daemon_sends_only(MsgType t) {
  switch (t) {
    case MsgType::Error:
    case MsgType::Ok:
    case MsgType::Welcome:
    case MsgType::Written:
    case MsgType::ReadDone:
    case MsgType::PauseStateReply:
    case MsgType::TierGrant:
    case MsgType::TierReclaim:
    case MsgType::Command:
    case MsgType::Sessions:
    case MsgType::ControlResult:
    case MsgType::GcResult:
    case MsgType::ControlTargets:
    case MsgType::IpcExported:
    case MsgType::IpcOpened:
    case MsgType::IpcUsers:
    case MsgType::StoreOpened: return true;
    default: return false;
  }
}

bool shim_sends_only(MsgType t) {
  switch (t) {
    case MsgType::Reserve:
    case MsgType::Write:
    case MsgType::Read:
    case MsgType::Commit:
    case MsgType::PauseState:
    case MsgType::TierAsk:
    case MsgType::TierRelease:
    case MsgType::TierAdopt:
    case MsgType::TierKeep:
    case MsgType::Report:
    case MsgType::CommandDone:
    case MsgType::Progress:
    case MsgType::IpcExport:
    case MsgType::IpcRevoke:
    case MsgType::IpcOpen:
    case MsgType::IpcClose:
    case MsgType::StoreOpen:
    case MsgType::StoreWrite:
    case MsgType::StoreRead:
    case MsgType::StoreCommit:
    case MsgType::StoreRemove:
    case MsgType::SetRankDir: return true;
    default: return false;
  }
}

enum class Place { BeforeHello, Control, Shim };

const char* place_name(Place p) {
  switch (p) {
    case Place::BeforeHello: return "before HELLO";
    case Place::Control: return "on a control connection";
    case Place::Shim: return "on a shim session";
  }
  return "?";
}

// What the daemon must do with `bytes` sent in `place`.
struct Expect {
  enum What {
    Refused,      // an ERROR with `code`, then the connection closes
    Served,       // the connection stays usable (whatever the request's own answer)
    HelloAnswer,  // a first HELLO: WELCOME, or an ERROR and the connection closes
    Dropped,      // closed without an answer (a zero-length datagram reads as end of stream)
  } what;
  int code = 0;
};

Expect expect(Place place, const std::vector<uint8_t>& bytes) {
  if (bytes.size() > proto::kMaxMessageSize) return {Expect::Refused, EMSGSIZE};
  if (bytes.empty()) return {Expect::Dropped};
  auto d = proto::decode(bytes);
  if (!d.envelope) return {Expect::Refused, d.code};
  const MsgType t = type_of(d.envelope->body);
  if (place == Place::BeforeHello)
    return t == MsgType::Hello ? Expect{Expect::HelloAnswer} : Expect{Expect::Refused, EPROTO};
  if (t == MsgType::Hello || daemon_sends_only(t)) return {Expect::Refused, EPROTO};
  if (place == Place::Control && shim_sends_only(t)) return {Expect::Refused, EPROTO};
  return {Expect::Served};
}

// A message that decodes and that the daemon would carry out as asked, not refuse, yet that the
// suite must not send: it would ask for real disk space, or leave a committed pause of nothing
// (whose files the daemon rightly keeps while this process lives). Empty when it may be sent.
std::string not_sent_because(Place place, const std::vector<uint8_t>& bytes) {
  if (place != Place::Shim || bytes.size() > proto::kMaxMessageSize) return {};
  auto d = proto::decode(bytes);
  if (!d.envelope) return {};
  if (auto* r = std::get_if<proto::Reserve>(&d.envelope->body)) {
    uint64_t total = 0;
    for (const auto& b : r->blobs) total += std::min<uint64_t>(b.size, uint64_t{1} << 40);
    if (total > 64 * MiB && total < (uint64_t{1} << 40)) return "a reservation of real disk space";
  }
  if (auto* c = std::get_if<proto::Commit>(&d.envelope->body);
      c && c->state == static_cast<uint8_t>(proto::CommitState::Paused))
    return "a committed pause of nothing";
  // An object is the rank's data as a paused chunk is: the daemon keeps it (and the session) while
  // this process lives. Its WRITE, READ, COMMIT and REMOVE are sent, and refused for want of it.
  if (std::holds_alternative<proto::StoreOpen>(d.envelope->body)) return "an object kept while this process lives";
  return {};
}

// ------------------------------------------------------------------------------------------------
// Mutations

struct Hostile {
  std::string name;
  std::vector<uint8_t> bytes;
};

void set_le(std::vector<uint8_t>& b, std::size_t at, uint64_t v, std::size_t width) {
  for (std::size_t i = 0; i < width; ++i) b[at + i] = static_cast<uint8_t>(v >> (8 * i));
}
uint64_t get_le(const std::vector<uint8_t>& b, std::size_t at, std::size_t width) {
  uint64_t v = 0;
  for (std::size_t i = 0; i < width; ++i) v |= uint64_t{b[at + i]} << (8 * i);
  return v;
}

// Header offsets (wire.h: magic u32, version u16, type u16, length u32, flags u32, request u64).
constexpr std::size_t kVersionAt = 4, kTypeAt = 6, kLengthAt = 8, kFlagsAt = 12;

// `payload` behind the sample's header, with the header's length made to match.
std::vector<uint8_t> with_payload(const std::vector<uint8_t>& sample, const std::vector<uint8_t>& payload) {
  // Sized once and copied into: GCC 12 at -O3 warns falsely (-Warray-bounds, a memcpy "out of the
  // bounds [0, 24]") of a vector made from the header and then grown by insert().
  std::vector<uint8_t> out(proto::kHeaderSize + payload.size());
  std::copy(sample.begin(), sample.begin() + proto::kHeaderSize, out.begin());
  std::copy(payload.begin(), payload.end(), out.begin() + proto::kHeaderSize);
  set_le(out, kLengthAt, payload.size(), 4);
  return out;
}

// The deterministic mutations of one sample, named for the attack.
std::vector<Hostile> targeted(const proto::Message& sample) {
  const std::string type = proto::type_name(type_of(sample));
  const std::vector<uint8_t> good = proto::encode(1, sample);
  REQUIRE_FALSE(good.empty());
  Mapper map;
  std::visit([&](const auto& m) { map(m); }, sample);
  const std::vector<uint8_t> payload(good.begin() + proto::kHeaderSize, good.end());
  INFO(type);
  REQUIRE(map.out == payload);  // the map walks the real layout

  std::vector<Hostile> out;
  auto add = [&](std::string what, std::vector<uint8_t> b) { out.push_back({type + ": " + what, std::move(b)}); };
  add("as it should be", good);

  // Header.
  auto h = good;
  h[0] ^= 0xFF;
  add("wrong magic", h);
  for (uint16_t v : {uint16_t{0}, static_cast<uint16_t>(proto::kVersion - 1),
                     static_cast<uint16_t>(proto::kVersion + 1), uint16_t{0xFFFF}}) {
    h = good;
    set_le(h, kVersionAt, v, 2);
    add("protocol version " + std::to_string(v), h);
  }
  h = good;
  set_le(h, kFlagsAt, 0x80000000u, 4);
  add("reserved header flags set", h);
  h = good;
  set_le(h, kLengthAt, payload.size() + 1, 4);
  add("length one more than sent", h);
  h = good;
  set_le(h, kLengthAt, 0xFFFFFFFFu, 4);
  add("length 4 GiB", h);
  if (!payload.empty()) {
    h = good;
    set_le(h, kLengthAt, payload.size() - 1, 4);
    add("length one less than sent", h);
    add("header alone, its length unchanged", std::vector<uint8_t>(good.begin(), good.begin() + proto::kHeaderSize));
  }
  add("a single byte", std::vector<uint8_t>(good.begin(), good.begin() + 1));
  add("a header cut short", std::vector<uint8_t>(good.begin(), good.begin() + proto::kHeaderSize - 1));
  h = good;
  set_le(h, kTypeAt, 0, 2);
  add("type 0", h);
  h = good;
  set_le(h, kTypeAt, 0xFFFF, 2);
  add("type 65535", h);
  h = good;
  h.resize(proto::kMaxMessageSize + 1, 0xA5);
  set_le(h, kLengthAt, h.size() - proto::kHeaderSize, 4);
  add("over the 64 KiB limit", h);

  // Payload.
  auto p = payload;
  p.push_back(0);
  add("a trailing byte", with_payload(good, p));
  if (!payload.empty()) {
    add("truncated by one byte", with_payload(good, {payload.begin(), payload.end() - 1}));
    add("truncated to half", with_payload(good, {payload.begin(), payload.begin() + payload.size() / 2}));
  }
  for (std::size_t i = 0; i < map.fields.size(); ++i) {
    const FieldRef& f = map.fields[i];
    const std::string at = " (field " + std::to_string(i) + ")";
    if (f.kind == FieldRef::String) {
      const std::size_t len = get_le(payload, f.offset, 2);
      auto splice = [&](const std::string& s) {
        std::vector<uint8_t> q(payload.begin(), payload.begin() + f.offset);
        q.push_back(static_cast<uint8_t>(s.size()));
        q.push_back(static_cast<uint8_t>(s.size() >> 8));
        q.insert(q.end(), s.begin(), s.end());
        q.insert(q.end(), payload.begin() + f.offset + 2 + len, payload.end());
        return with_payload(good, q);
      };
      add("string over its limit" + at, splice(std::string(f.max + 1, 'A')));
      add("string with a NUL" + at, splice(std::string("a\0b", 3)));
      add("string with an escape sequence" + at, splice("x\x1b[2J"));
      add("string with a newline" + at, splice("forged\nlog line"));
      add("string of invalid UTF-8" + at, splice("\xff\xfe"));
      p = payload;
      set_le(p, f.offset, 0xFFFF, 2);
      add("string longer than the message" + at, with_payload(good, p));
    } else if (f.kind == FieldRef::Count) {
      p = payload;
      set_le(p, f.offset, 0xFFFFFFFFu, 4);
      add("element count 2^32-1" + at, with_payload(good, p));
      p = payload;
      set_le(p, f.offset, get_le(payload, f.offset, 4) + 1, 4);
      add("element count one more than sent" + at, with_payload(good, p));
    } else if (f.width == 1) {  // enums, flags and booleans
      for (uint8_t v : {uint8_t(payload[f.offset] + 1), uint8_t(payload[f.offset] + 2), uint8_t{0x80}, uint8_t{0xFF}}) {
        p = payload;
        p[f.offset] = v;
        add("one-byte field set to " + std::to_string(v) + at, with_payload(good, p));
      }
    } else {
      p = payload;
      set_le(p, f.offset, ~get_le(payload, f.offset, f.width), f.width);
      add("integer inverted" + at, with_payload(good, p));
    }
  }
  return out;
}

// Seeded random corruptions of one sample.
std::vector<Hostile> random_mutants(const proto::Message& sample, std::mt19937_64& rng, int count) {
  const std::string type = proto::type_name(type_of(sample));
  const std::vector<uint8_t> good = proto::encode(1, sample);
  Mapper map;
  std::visit([&](const auto& m) { map(m); }, sample);
  const std::vector<uint8_t> payload(good.begin() + proto::kHeaderSize, good.end());
  auto below = [&](std::size_t n) { return n == 0 ? std::size_t{0} : static_cast<std::size_t>(rng() % n); };
  std::vector<Hostile> out;
  for (int i = 0; i < count; ++i) {
    const std::string name = type + ": random #" + std::to_string(i);
    std::vector<uint8_t> b = good, p = payload;
    switch (rng() % 6) {
      case 0:  // a few bits flipped anywhere
        for (int k = 1 + static_cast<int>(rng() % 3); k > 0; --k) b[below(b.size())] ^= uint8_t(1u << (rng() % 8));
        out.push_back({name + " (bits flipped)", b});
        break;
      case 1:  // payload bytes replaced
        if (!p.empty())
          for (int k = 1 + static_cast<int>(rng() % 4); k > 0; --k) p[below(p.size())] = static_cast<uint8_t>(rng());
        out.push_back({name + " (payload bytes replaced)", with_payload(good, p)});
        break;
      case 2:  // cut at a random point
        p.resize(below(p.size() + 1));
        out.push_back({name + " (payload cut)", with_payload(good, p)});
        break;
      case 3:  // random bytes appended
        for (int k = 1 + static_cast<int>(rng() % 16); k > 0; --k) p.push_back(static_cast<uint8_t>(rng()));
        out.push_back({name + " (bytes appended)", with_payload(good, p)});
        break;
      case 4: {  // one mapped field set to a random value
        if (!map.fields.empty()) {
          const FieldRef& f = map.fields[below(map.fields.size())];
          set_le(p, f.offset, rng(), f.width);
        }
        out.push_back({name + " (a field set at random)", with_payload(good, p)});
        break;
      }
      default: {  // a payload of random bytes
        p.resize(below(300));
        for (auto& x : p) x = static_cast<uint8_t>(rng());
        out.push_back({name + " (random payload)", with_payload(good, p)});
      }
    }
  }
  return out;
}

// ------------------------------------------------------------------------------------------------
// Sending one hostile message and seeing what the daemon makes of it

constexpr uint64_t kProbeId = 0xC0FFEE;  // request id of the LIST_SESSIONS sent behind each message

struct Seen {
  std::vector<proto::Envelope> messages;  // before the probe's answer or the end
  bool probe_answered = false;
  bool closed = false;
  bool timed_out = false;
  std::string garbage;  // a message from the daemon that did not decode
};

// Sends `bytes`, then a LIST_SESSIONS probe, and reads until the probe is answered or the daemon
// closes the connection. A daemon that does neither within 20 s is a failure, not a hang.
Seen exchange(int sock, const std::vector<uint8_t>& bytes) {
  Seen seen;
  if (bytes.empty())
    (void)::send(sock, "", 0, MSG_NOSIGNAL);
  else
    (void)proto::send_message(sock, bytes);
  (void)proto::send_message(sock, proto::encode(kProbeId, proto::ListSessions{}));
  std::vector<uint8_t> buf;
  for (;;) {
    pollfd p{sock, POLLIN, 0};
    if (::poll(&p, 1, 20000) != 1) {
      seen.timed_out = true;
      return seen;
    }
    const long n = proto::recv_message(sock, buf);
    // Closing a connection with our probe unread makes the kernel report ECONNRESET first; what the
    // daemon sent before is still queued behind it.
    if (n == -ECONNRESET) continue;
    if (n <= 0) {
      seen.closed = true;
      return seen;
    }
    auto d = proto::decode(buf);
    if (!d.envelope) {
      seen.garbage = d.error;
      return seen;
    }
    if (d.envelope->request_id == kProbeId && std::holds_alternative<proto::Sessions>(d.envelope->body)) {
      seen.probe_answered = true;
      return seen;
    }
    seen.messages.push_back(std::move(*d.envelope));
  }
}

// Checks what was seen against what was expected; returns false (after CHECKs say why) on a mismatch.
bool judge(const Expect& e, const Seen& s) {
  CHECK_FALSE(s.timed_out);
  CHECK(s.garbage.empty());  // whatever the daemon sends decodes
  if (s.timed_out || !s.garbage.empty()) return false;
  const proto::ErrorReply* first_error =
      s.messages.empty() ? nullptr : std::get_if<proto::ErrorReply>(&s.messages.front().body);
  switch (e.what) {
    case Expect::Refused: {
      INFO("expected: refused with code " << e.code << ", then closed");
      CHECK(!s.messages.empty());
      if (s.messages.empty()) return false;
      INFO("got: " << (first_error ? first_error->code : -1) << " "
                   << (first_error ? first_error->message
                                   : std::string(proto::type_name(type_of(s.messages.front().body)))));
      const bool ok =
          first_error && first_error->code == e.code && s.messages.size() == 1 && s.closed && !s.probe_answered;
      CHECK(ok);
      return ok;
    }
    case Expect::Dropped: {
      INFO("expected: closed without an answer");
      const bool ok = s.closed && s.messages.empty() && !s.probe_answered;
      CHECK(ok);
      return ok;
    }
    case Expect::HelloAnswer: {
      INFO("expected: WELCOME, or an ERROR and the connection closed");
      CHECK(!s.messages.empty());
      if (s.messages.empty()) return false;
      const bool welcomed = std::holds_alternative<proto::Welcome>(s.messages.front().body) && s.probe_answered;
      const bool refused = first_error && s.closed && !s.probe_answered;
      CHECK((welcomed || refused));
      return welcomed || refused;
    }
    case Expect::Served: {
      INFO("expected: served, the connection still usable");
      INFO("its answer: " << (first_error ? std::to_string(first_error->code) + " " + first_error->message
                                          : std::string("no error")));
      const bool ok = s.probe_answered && !s.closed;
      CHECK(ok);
      return ok;
    }
  }
  return false;
}

// A connection in `place`: raw, after a control HELLO, or after a shim HELLO (a small session of its
// own rank, so that none waits for another's teardown).
UniqueFd open_in(const Daemon& d, Place place) {
  static int64_t next_rank = 1000;
  if (place == Place::BeforeHello) {
    UniqueFd fd(proto::connect_seqpacket(d.socket, 10000));
    REQUIRE(fd);
    return fd;
  }
  proto::Hello h;
  if (place == Place::Control) {
    h.role = static_cast<uint8_t>(proto::Role::Control);
  } else {
    h.role = static_cast<uint8_t>(proto::Role::Shim);
    h.job = "adv-hostile";
    h.rank = next_rank++;
    h.staging_budget_bytes = 128 * 1024;
    h.chunk_bytes = 64 * 1024;
  }
  auto r = proto::connect_and_hello(d.socket, h, 10000);
  INFO(r.message);
  REQUIRE(r);
  return UniqueFd(std::exchange(r.sock, -1));  // the staging memfd closes with `r`
}

// A daemon for the batches: staging budgets small and capped, so that no mutated HELLO can make it
// pin more than a few MiB.
void start_small(Daemon& d) {
  d.start({"--staging-budget-mb", "2", "--chunk-mb", "1", "--max-staging-budget-mb", "4"});
}

// Every hostile message of the table and the generator in `place`, each on a fresh connection.
void run_batch(Place place) {
  const uint64_t seed = suite_seed();
  INFO("seed " << seed << ", " << place_name(place));
  Daemon d(kSmallSessions);
  start_small(d);
  d.check_serving();
  const int baseline = d.fds();

  std::mt19937_64 rng(seed ^ (static_cast<uint64_t>(place) * 0x9E3779B97F4A7C15ull));
  std::vector<Hostile> all;
  std::set<MsgType> types;
  for (const auto& sample : samples({.root = d.roots[0]})) {
    // Every sample is valid: a new message type without a working sample fails here, not silently.
    INFO(proto::type_name(type_of(sample)));
    REQUIRE(proto::decode(proto::encode(1, sample)).envelope);
    types.insert(type_of(sample));
    for (auto& h : targeted(sample)) all.push_back(std::move(h));
    for (auto& h : random_mutants(sample, rng, 12)) all.push_back(std::move(h));
  }
  REQUIRE(types.size() == std::variant_size_v<proto::Message>);
  all.push_back({"an empty datagram", {}});
  for (uint16_t t :
       {uint16_t{3}, uint16_t{9}, uint16_t{24}, uint16_t{29}, uint16_t{37}, uint16_t{47}, uint16_t{0x8000}}) {
    auto b = proto::encode(1, proto::Gc{});
    set_le(b, kTypeAt, t, 2);
    all.push_back({"unknown type " + std::to_string(t), b});
  }

  std::size_t sent = 0, failed = 0;
  std::map<std::string, std::size_t> not_sent, outcomes;
  for (const auto& h : all) {
    if (const std::string why = not_sent_because(place, h.bytes); !why.empty()) {
      ++not_sent[why];
      continue;
    }
    INFO(h.name);
    UniqueFd sock = open_in(d, place);
    const Expect e = expect(place, h.bytes);
    if (!judge(e, exchange(sock.get(), h.bytes))) ++failed;
    ++outcomes[e.what == Expect::Refused       ? "refused with " + std::string(std::strerror(e.code))
               : e.what == Expect::Served      ? std::string("served")
               : e.what == Expect::HelloAnswer ? std::string("a first HELLO")
                                               : std::string("dropped")];
    ++sent;
    if (failed > 20) FAIL("more than 20 messages handled wrongly; stopping");
  }
  std::printf("%s: %zu hostile messages sent:", place_name(place), sent);
  for (auto& [what, n] : outcomes) std::printf(" %zu %s;", n, what.c_str());
  for (auto& [why, n] : not_sent) std::printf(" %zu not sent (%s);", n, why.c_str());
  std::printf("\n");
  CHECK(sent > 1000);
  d.check_serving();
  d.check_fds(baseline);
}

// ------------------------------------------------------------------------------------------------
// Descriptors

// A pipe whose write end is what clients pass: once every copy of it is closed (ours and the
// daemon's), the read end reports a hangup. One pipe thus counts any number of passed copies.
struct Witness {
  UniqueFd read_end, write_end;
  Witness() {
    int p[2];
    REQUIRE(::pipe2(p, O_CLOEXEC) == 0);
    read_end.reset(p[0]);
    write_end.reset(p[1]);
  }
  // Closes our copy and waits until no process holds another.
  bool all_closed() {
    write_end.reset();
    return eventually(
        [&] {
          pollfd p{read_end.get(), POLLIN, 0};
          return ::poll(&p, 1, 0) == 1 && (p.revents & POLLHUP);
        },
        std::chrono::seconds(20));
  }
};

// The first answer on `sock` within 20 s: its error (0 for another message), -1 if it closed first.
int first_answer_code(int sock, std::string* message = nullptr) {
  std::vector<uint8_t> buf;
  for (;;) {
    pollfd p{sock, POLLIN, 0};
    if (::poll(&p, 1, 20000) != 1) return -2;
    const long n = proto::recv_message(sock, buf);
    if (n == -ECONNRESET) continue;
    if (n <= 0) return -1;
    auto d = proto::decode(buf);
    if (!d.envelope) return -3;
    if (auto* e = std::get_if<proto::ErrorReply>(&d.envelope->body)) {
      if (message) *message = e->message;
      return e->code;
    }
    return 0;
  }
}

// Whether the daemon closed `sock` (after whatever it sent first) within 20 s.
bool closed_by_daemon(int sock) {
  std::vector<uint8_t> buf;
  for (;;) {
    pollfd p{sock, POLLIN, 0};
    if (::poll(&p, 1, 20000) != 1) return false;
    const long n = proto::recv_message(sock, buf);
    if (n == -ECONNRESET) continue;
    if (n <= 0) return true;
  }
}

}  // namespace

// ------------------------------------------------------------------------------------------------
// The generated batches

TEST_CASE("hostile messages of every type before HELLO are refused with the decoder's code, or as not HELLO") {
  run_batch(Place::BeforeHello);
}

TEST_CASE("hostile messages of every type on a control connection: malformed, wrong-role and second HELLO refused") {
  run_batch(Place::Control);
}

TEST_CASE("hostile messages of every type on a shim session: malformed, daemon-only and second HELLO refused") {
  run_batch(Place::Shim);
}

// ------------------------------------------------------------------------------------------------
// Well-formed on the wire, hostile in meaning

TEST_CASE("requests well-formed but hostile in meaning are answered with errors and the session stays usable") {
  Daemon d(kSmallSessions);
  start_small(d);
  d.check_serving();
  const int baseline = d.fds();
  {
    auto c = d.shim({.job = "meaning", .rank = 0, .staging_budget_bytes = 2 * MiB, .chunk_bytes = 1 * MiB});
    auto code = [&](const proto::Message& m) {
      auto r = c.call(m);
      return r ? 0 : r.error().errnum();
    };
    const uint8_t whole = proto::kReserveFirst | proto::kReserveLast;
    CHECK(code(proto::Reserve{.flags = whole, .blobs = {{1, 4096}, {1, 8192}}}) == EINVAL);  // one id twice
    // Chunks are bounded per rank (2^26) before anything is allocated for them: zero chunks take no
    // disk space, so the space check no longer bounds a set's records.
    CHECK(code(proto::Reserve{.flags = whole, .blobs = {{1, (uint64_t{1} << 60) + 1}}}) == E2BIG);
    CHECK(code(proto::Reserve{.flags = whole, .blobs = {{1, uint64_t{60} << 40}}}) == ENOSPC);  // 60 TiB
    CHECK(code(proto::Reserve{.flags = whole, .blobs = {{1, ~uint64_t{0}}}}) == E2BIG);
    // Zero runs that name a blob not in the set, reach past its end or overlap.
    CHECK(code(proto::Reserve{.flags = whole, .blobs = {{1, 4 * MiB}}, .zero_runs = {{2, 0, 1}}}) == EINVAL);
    CHECK(code(proto::Reserve{.flags = whole, .blobs = {{1, 4 * MiB}}, .zero_runs = {{1, 3, 2}}}) == EINVAL);
    CHECK(code(proto::Reserve{.flags = whole, .blobs = {{1, 4 * MiB}}, .zero_runs = {{1, 0, 2}, {1, 1, 1}}}) == EINVAL);
    CHECK(code(proto::Reserve{.flags = whole, .blobs = {{1, 4 * MiB}}, .zero_runs = {{1, 1, (uint64_t{1} << 63)}}}) ==
          EINVAL);

    // A reservation sent in pages is bounded: the daemon refuses to collect more than 2^20 blobs.
    proto::Reserve page{.flags = 0};
    const std::size_t per_page = (proto::kMaxPayload - 16) / 16;
    int refused_at = -1;
    for (int i = 0; i < 300 && refused_at < 0; ++i) {
      page.flags = i == 0 ? proto::kReserveFirst : 0;
      page.blobs.clear();
      for (std::size_t k = 0; k < per_page; ++k) page.blobs.push_back({uint64_t(i) * per_page + k + 1, 4096});
      if (code(page) == E2BIG) refused_at = i;
    }
    CHECK(refused_at == static_cast<int>((std::size_t{1} << 20) / per_page));     // the page that would pass 2^20
    REQUIRE(code(proto::Reserve{.flags = whole, .blobs = {{1, 2 * MiB}}}) == 0);  // a fresh set drops the pages

    CHECK(code(proto::Write{{.slot = 0, .length = 4096, .blob = 99}}) == ENOENT);
    CHECK(code(proto::Write{{.slot = 0, .length = 1 * MiB, .blob = 1, .offset = 1 * MiB + 4096}}) == EINVAL);
    CHECK(code(proto::Write{{.slot = ~0u, .length = 1 * MiB, .blob = 1}}) == ERANGE);
    CHECK(code(proto::Read{{.slot = 0, .length = 1 * MiB, .blob = 1}}) == ENODATA);
    CHECK(code(proto::IpcRevoke{.export_id = 0x5eed, .freed = 0}) == ENOENT);
    CHECK(code(proto::IpcRevoke{.export_id = 0x5eed, .freed = 1}) == ENOENT);
    CHECK(code(proto::IpcClose{.export_id = 0x5eed}) == ENOENT);
    CHECK(code(proto::IpcOpen{.export_id = 0x5eed}) == ENOENT);
    CHECK(code(proto::IpcExport{.export_id = 0x5eed, .bytes = 4096, .device = 0}) == EINVAL);  // no descriptor

    // Answers nobody asked for, and a report of anything within its bounds, are taken without a reply.
    REQUIRE(c.send(proto::CommandDone{.code = 0, .message = "unasked"}));
    REQUIRE(c.send(proto::Progress{.done_bytes = 1, .total_bytes = 1}));
    proto::Report report;
    report.stats.state = static_cast<uint8_t>(proto::RankState::PartiallyPaused);
    report.stats.damaged_allocations = 1000;
    report.stats.damaged_bytes = ~uint64_t{0};
    for (int i = 0; i < 4; ++i) report.stats.damaged.push_back({.address = uint64_t(i) << 40, .size = 1, .reason = 3});
    REQUIRE(c.send(report));
    auto listed = c.call(proto::ListSessions{.start = 0});  // answered: nothing above was
    REQUIRE(listed);
    auto* sessions = std::get_if<proto::Sessions>(&*listed);
    REQUIRE(sessions);
    REQUIRE(sessions->sessions.size() == 1);
    CHECK(sessions->sessions[0].stats.damaged_allocations == 1000);  // shown as reported, to its own user
    auto far = c.call(proto::ListSessions{.start = ~0u});
    REQUIRE(far);
    CHECK(std::get<proto::Sessions>(*far).sessions.empty());
    CHECK(std::get<proto::Sessions>(*far).total == 1);

    // The session works after all of it.
    REQUIRE(c.write_all({{1, 2 * MiB}}, fill_pattern));
    REQUIRE(c.read_all({{1, 2 * MiB}}, check_pattern));

    // A second session of the same rank of the same process is refused; so is taking it over with a
    // token guessed or stolen from it while it lives.
    auto twin = d.try_shim({.job = "meaning", .rank = 0});
    REQUIRE_FALSE(twin);
    CHECK(twin.error().errnum() == EBUSY);
    auto thief = d.try_shim({.job = "meaning", .rank = 0, .token = c.welcome().token});
    REQUIRE_FALSE(thief);
    CHECK(thief.error().errnum() == EBUSY);
  }
  for (auto [staging, chunk] : {std::pair<uint64_t, uint32_t>{2 * MiB, 4097},
                                {2 * MiB, 32 * 1024},
                                {2 * MiB, 128 * MiB},
                                {96 * 1024, 64 * 1024},
                                {8 * MiB, 1 * MiB}}) {
    auto bad = d.try_shim({.job = "sizes", .staging_budget_bytes = staging, .chunk_bytes = chunk});
    INFO("staging " << staging << ", chunk " << chunk);
    REQUIRE_FALSE(bad);
    CHECK(bad.error().errnum() == EINVAL);
  }
  {
    // A control connection may have one pause or resume outstanding at a time.
    auto silent = d.shim({.job = "busy", .rank = 0});
    proto::Hello hello;
    hello.role = static_cast<uint8_t>(proto::Role::Control);
    auto ctl = proto::connect_and_hello(d.socket, hello, 10000);
    REQUIRE(ctl);
    proto::Control req{.op = 1, .match = proto::kMatchJob, .job = "busy", .timeout_ms = ~0u};
    REQUIRE(proto::send_message(ctl.sock, proto::encode(2, req)) == 0);
    CHECK(first_answer_code(ctl.sock) == 0);  // CONTROL_TARGETS
    REQUIRE(silent.receive());                // the COMMAND, never answered
    REQUIRE(proto::send_message(ctl.sock, proto::encode(3, req)) == 0);
    CHECK(first_answer_code(ctl.sock) == EBUSY);
    proto::Control nobody{.op = 2, .match = proto::kMatchPid, .pid = 1};
    auto other = d.control().control(nobody);
    REQUIRE_FALSE(other);
    CHECK(other.error().errnum() == ENOENT);
  }
  d.check_serving();
  d.check_fds(baseline);
}

// ------------------------------------------------------------------------------------------------
// Floods

namespace {

// Makes room for `want` descriptors in this process (and what it starts); false if the hard limit
// does not allow it.
bool allow_descriptors(rlim_t want) {
  rlimit lim{};
  if (::getrlimit(RLIMIT_NOFILE, &lim) != 0) return false;
  if (lim.rlim_cur >= want) return true;
  if (lim.rlim_max < want) return false;
  lim.rlim_cur = want;
  return ::setrlimit(RLIMIT_NOFILE, &lim) == 0;
}

// More connections than any per-user limit the daemon should have (kMaxConnectionsPerUid, 512 today,
// in daemon/server/server.cpp); the flood finds the limit rather than assuming it.
constexpr int kMaxFlood = 2048;

// As one non-root user: opens connections, each saying HELLO, until the daemon closes one unanswered
// (its per-user limit); one more is refused too; the first connections keep being served; once the
// flood ends, a new connection is served again. Writes the number of connections served before the
// refusal to `report` and returns 0, or the number of the step that failed.
int flood_as_this_user(const std::string& socket, int report) {
  proto::Hello hello;
  hello.role = static_cast<uint8_t>(proto::Role::Control);
  std::vector<proto::HelloReply> open;
  for (;;) {
    auto r = proto::connect_and_hello(socket, hello, 10000);
    if (!r) {
      if (open.empty()) return r.error == EACCES ? kUnreachable : 11;
      break;  // the limit
    }
    open.push_back(std::move(r));
    if (open.size() >= kMaxFlood) return 12;  // no limit at all
  }
  const int limit = static_cast<int>(open.size());
  if (::write(report, &limit, sizeof(limit)) != sizeof(limit)) return 13;
  if (proto::connect_and_hello(socket, hello, 10000)) return 14;  // still at the limit: still refused
  std::vector<uint8_t> buf;
  for (std::size_t i : {std::size_t{0}, open.size() / 2, open.size() - 1}) {
    const int sock = open[i].sock;
    if (proto::send_message(sock, proto::encode(9, proto::ListSessions{})) != 0) return 15;
    pollfd p{sock, POLLIN, 0};
    if (::poll(&p, 1, 20000) != 1 || proto::recv_message(sock, buf) <= 0) return 16;
    auto d = proto::decode(buf);
    if (!d.envelope || !std::holds_alternative<proto::Sessions>(d.envelope->body)) return 17;
  }
  open.clear();
  // The daemon counts the closed connections out as it sees them go.
  const bool again = eventually([&] { return static_cast<bool>(proto::connect_and_hello(socket, hello, 10000)); },
                                std::chrono::seconds(20));
  return again ? 0 : 18;
}

}  // namespace

TEST_CASE("a connection flood up to the per-user limit: the one beyond is closed, the others and other users served") {
  if (!allow_descriptors(2 * kMaxFlood + 256)) skip("RLIMIT_NOFILE's hard limit is below 4352 descriptors");
  Daemon d(kSmallSessions);
  d.start();  // inherits the raised limit: it must hold every connection of the flood
  d.check_serving();
  const int baseline = d.fds();
  int report[2];
  REQUIRE(::pipe2(report, O_CLOEXEC) == 0);
  UniqueFd report_read(report[0]), report_write(report[1]);
  if (::geteuid() == 0) {
    // Root is exempt from the limit, so the flood comes from another user, while root is served.
    std::atomic<bool> stop{false};
    std::atomic<int> served{0}, refused{0};
    std::thread root_client([&] {
      while (!stop) {
        auto c = ctl::Client::connect(d.socket);
        if (c && c->list_sessions())
          ++served;
        else
          ++refused;
      }
    });
    const int rc = as_other_user([&] { return flood_as_this_user(d.socket, report_write.get()); });
    stop = true;
    root_client.join();
    CHECK(rc == 0);
    CHECK(served > 0);
    CHECK(refused == 0);
  } else {
    CHECK(flood_as_this_user(d.socket, report_write.get()) == 0);
  }
  int limit = 0;
  REQUIRE(::read(report_read.get(), &limit, sizeof(limit)) == sizeof(limit));
  std::printf("per-user connection limit: %d\n", limit);
  CHECK(limit > 1);
  CHECK(limit < kMaxFlood);
  d.check_serving();
  d.check_fds(baseline);
}

TEST_CASE(
    "a flood beyond the daemon's own descriptor limit: it keeps serving, and takes the waiting ones as others go") {
  Daemon d(kSmallSessions);
  d.start();
  // Room for 64 descriptors (tmsdiskd raises its soft limit to the hard one at startup, so both).
  rlimit lim{64, 64};
  REQUIRE(::prlimit(d.proc.pid(), RLIMIT_NOFILE, &lim, nullptr) == 0);
  d.check_serving();
  const int baseline = d.fds();
  {
    proto::Hello hello;
    hello.role = static_cast<uint8_t>(proto::Role::Control);
    const auto hello_bytes = proto::encode(1, hello);
    // More connections than the daemon can hold: the kernel queues those it cannot accept (the
    // listen backlog is 128), so every connect and HELLO goes out at once.
    constexpr int kFlood = 80;
    std::vector<UniqueFd> flood;
    for (int i = 0; i < kFlood; ++i) {
      UniqueFd fd(proto::connect_seqpacket(d.socket, 10000));
      INFO("connection " << i);
      REQUIRE(fd);
      REQUIRE(proto::send_message(fd.get(), hello_bytes) == 0);
      flood.push_back(std::move(fd));
    }
    // The first are welcomed, in the order they came; the daemon then runs out of descriptors and
    // stops accepting: the first connection without an answer in 3 s is where it stopped.
    CHECK(first_answer_code(flood[0].get()) == 0);
    int welcomed = 1;
    for (int i = 1; i < kFlood; ++i) {
      pollfd p{flood[static_cast<std::size_t>(i)].get(), POLLIN, 0};
      if (::poll(&p, 1, 3000) != 1) break;
      CHECK(first_answer_code(flood[static_cast<std::size_t>(i)].get()) == 0);
      ++welcomed;
    }
    INFO(welcomed << " of " << kFlood << " welcomed while the daemon had room");
    CHECK(welcomed < kFlood);
    REQUIRE(2 * welcomed >= kFlood);  // so that those waiting all fit once the welcomed ones go
    // Out of descriptors, it still serves the connections it has.
    REQUIRE(proto::send_message(flood[0].get(), proto::encode(2, proto::ListSessions{})) == 0);
    CHECK(first_answer_code(flood[0].get()) == 0);
    // Room again: the connections that waited are taken and answered, each in turn.
    for (int i = 0; i < welcomed; ++i) flood[static_cast<std::size_t>(i)].reset();
    for (int i = welcomed; i < kFlood; ++i) {
      INFO("connection " << i << ", waiting while the daemon was full");
      CHECK(first_answer_code(flood[static_cast<std::size_t>(i)].get()) == 0);
    }
  }
  d.check_serving();
  d.check_fds(baseline);
}

// ------------------------------------------------------------------------------------------------
// Passed descriptors

TEST_CASE("thousands of descriptors passed with messages that take none are all closed, on every kind of connection") {
  Daemon d(kSmallSessions);
  start_small(d);
  d.check_serving();
  const int baseline = d.fds();
  Witness w;
  std::size_t passed = 0;
  {
    auto shim = d.shim({.job = "fds", .rank = 0, .staging_budget_bytes = 2 * MiB, .chunk_bytes = 1 * MiB});
    const auto report = proto::encode(1, proto::Report{});
    for (int i = 0; i < 400; ++i) {  // REPORT has no answer: nothing to read in between
      const std::size_t n = 1 + static_cast<std::size_t>(i % proto::kMaxPassedFds);
      REQUIRE(send_with_fds(shim.fd(), report, w.write_end.get(), n) == static_cast<ssize_t>(report.size()));
      passed += n;
    }
    // With requests that are answered (the first descriptor goes to the request, which takes none).
    for (uint64_t id = 2; id < 50; ++id) {
      REQUIRE(send_with_fds(shim.fd(), proto::encode(id, proto::IpcClose{.export_id = 7}), w.write_end.get(),
                            proto::kMaxPassedFds) > 0);
      passed += proto::kMaxPassedFds;
      auto answer = shim.receive();
      REQUIRE(answer);
      auto* e = std::get_if<proto::ErrorReply>(&answer->body);
      REQUIRE(e);
      CHECK(e->code == ENOENT);
    }
    // On a control connection, and with HELLO itself.
    proto::Hello hello;
    hello.role = static_cast<uint8_t>(proto::Role::Control);
    UniqueFd ctl(proto::connect_seqpacket(d.socket, 10000));
    REQUIRE(ctl);
    REQUIRE(send_with_fds(ctl.get(), proto::encode(1, hello), w.write_end.get(), proto::kMaxPassedFds) > 0);
    passed += proto::kMaxPassedFds;
    CHECK(first_answer_code(ctl.get()) == 0);  // WELCOME
    for (uint64_t id = 2; id < 100; ++id) {
      REQUIRE(send_with_fds(ctl.get(), proto::encode(id, proto::ListSessions{}), w.write_end.get(),
                            proto::kMaxPassedFds) > 0);
      passed += proto::kMaxPassedFds;
      CHECK(first_answer_code(ctl.get()) == 0);  // SESSIONS
    }
    // Before HELLO, with a message that is refused and closes the connection.
    for (int i = 0; i < 50; ++i) {
      UniqueFd raw(proto::connect_seqpacket(d.socket, 10000));
      REQUIRE(raw);
      REQUIRE(send_with_fds(raw.get(), std::vector<uint8_t>(40, 0x5A), w.write_end.get(), proto::kMaxPassedFds) > 0);
      passed += proto::kMaxPassedFds;
      CHECK(first_answer_code(raw.get()) == EPROTO);
    }
    // The shim session still works.
    REQUIRE(shim.reserve({{1, 1 * MiB}}));
    REQUIRE(shim.write_all({{1, 1 * MiB}}, fill_pattern));
  }
  std::printf("%zu descriptors passed\n", passed);
  CHECK(passed > 2000);
  CHECK(w.all_closed());
  d.check_serving();
  d.check_fds(baseline);
}

TEST_CASE(
    "more descriptors on one message than the protocol takes: all closed, the connection refused, the daemon serving") {
  Daemon d(kSmallSessions);
  start_small(d);
  d.check_serving();
  const int baseline = d.fds();
  Witness w;
  for (std::size_t n : {proto::kMaxPassedFds + 1, 2 * proto::kMaxPassedFds, std::size_t{253}}) {
    for (Place place : {Place::BeforeHello, Place::Control, Place::Shim}) {
      INFO(n << " descriptors " << place_name(place));
      UniqueFd sock = open_in(d, place);
      REQUIRE(send_with_fds(sock.get(), proto::encode(5, proto::ListSessions{}), w.write_end.get(), n) > 0);
      CHECK(first_answer_code(sock.get()) > 0);  // refused, whatever it says (see the next case)
      CHECK(closed_by_daemon(sock.get()));
    }
  }
  CHECK(w.all_closed());
  d.check_serving();
  d.check_fds(baseline);
}

// Found by the adversarial run this suite keeps: a message with more descriptors than the daemon
// takes (proto::kMaxPassedFds) was refused as "message exceeds the 64 KiB protocol limit", which sent
// a user looking for a size problem.
TEST_CASE("more descriptors on one message than the protocol takes are refused as too many, not as too large") {
  Daemon d(kSmallSessions);
  start_small(d);
  Witness w;
  UniqueFd sock = open_in(d, Place::Control);
  REQUIRE(send_with_fds(sock.get(), proto::encode(5, proto::ListSessions{}), w.write_end.get(),
                        proto::kMaxPassedFds + 1) > 0);
  std::string message;
  const int code = first_answer_code(sock.get(), &message);
  INFO("refused with " << code << ": " << message);
  CHECK(code > 0);
  CHECK(message.find("64 KiB") == std::string::npos);
  CHECK(message.find("descriptor") != std::string::npos);
}
