// SPDX-License-Identifier: Apache-2.0
// The tmsdisk wire protocol: every message the shim, the daemon and tmsctl exchange.
//
// Transport: a SOCK_SEQPACKET Unix socket, so each send is one message and file descriptors ride
// along with SCM_RIGHTS (see socket.h). A message is a 24-byte header followed by at most
// kMaxPayload bytes of payload; all integers are little-endian, strings are a u16 length and bytes.
//
// Version policy: the header carries kVersion and both ends require an exact match. A daemon that
// receives HELLO with another version answers with ErrorReply{EPROTONOSUPPORT, "..."} encoded with
// its own version and closes the connection; the header and ErrorReply layouts are frozen across
// versions so that this refusal is always readable. Shim, daemon and tmsctl ship together: mixing
// builds is a deployment mistake that must be reported, not papered over.
//
// Each message lists its fields once, in `fields()`; the encoder and the decoder both walk that list,
// so the two can never disagree. `check()` adds the semantic rules the decoder enforces on input.
//
// The framing, types and limits are in wire.h; the legacy IPC messages in ipc_messages.h and the object
// store's in store_messages.h; this header includes them all.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "tmsdisk/common/object_name.h"
#include "tmsdisk/protocol/ipc_messages.h"
#include "tmsdisk/protocol/store_messages.h"
#include "tmsdisk/protocol/wire.h"

namespace tmsdisk::proto {

// ---------------------------------------------------------------------------------------------
// Shared records

// An allocation a resume could not restore, in the application's terms: its address and size, why,
// and the first chunk (of the daemon's chunk size) that failed.
struct DamagedRange {
  uint64_t address = 0;
  uint64_t size = 0;
  uint8_t reason = 0;  // Damage
  uint64_t chunk = 0;
  template <class F>
  void fields(F&& f) {
    f(address), f(size), f(reason), f(chunk);
  }
};

// What a pause or resume did not move to or from disk, of the bytes it covered (RankResult,
// CommandDone, RankStats). The three are disjoint; the rest went through the disk.
struct Skipped {
  uint64_t zero_bytes = 0;       // all-zero chunks: not written on pause, set on the device on resume
  uint64_t unchanged_bytes = 0;  // pause only: the file already held them, so they were not rewritten
  uint64_t host_bytes = 0;       // kept in the host-memory tier (moved by DMA, not through the disk)
  // Under a tag whose policy is discard: released without being saved; zero-filled on resume.
  uint64_t discarded_bytes = 0;
  template <class F>
  void fields(F&& f) {
    f(zero_bytes), f(unchanged_bytes), f(host_bytes), f(discarded_bytes);
  }
};

// A tag name: what part of a process an operation is about. Empty: all of it.
inline constexpr std::size_t kMaxTagLength = 63;
bool valid_tag(std::string_view tag) noexcept;  // empty, or 1 to 63 of [A-Za-z0-9_.-]

// Bytes of a rank's managed allocations that carry one tag with one policy.
inline constexpr std::size_t kMaxTagsReported = 16;
struct TagBytes {
  std::string tag;
  uint8_t policy = 0;  // 0 backup, 1 discard (resident memory is unmanaged)
  uint64_t resident_bytes = 0;
  uint64_t paused_bytes = 0;
  template <class F>
  void fields(F&& f) {
    f(tag, kMaxTagLength), f(policy), f(resident_bytes), f(paused_bytes);
  }
};

struct RankStats {
  uint8_t state = 0;  // RankState
  uint64_t resident_bytes = 0;
  uint64_t paused_bytes = 0;
  std::array<uint64_t, kUnmanagedReasons> unmanaged_bytes{};  // indexed by Unmanaged
  uint32_t managed_allocations = 0;
  uint64_t last_pause_bytes = 0;
  uint64_t last_pause_ns = 0;
  uint64_t last_resume_bytes = 0;
  uint64_t last_resume_ns = 0;
  uint64_t last_change_unix_ms = 0;
  // Paused allocations a resume could not restore because their backup is damaged (counted in
  // paused_bytes too); `damaged` lists the first kMaxDamagedRanges of them by address.
  uint32_t damaged_allocations = 0;
  uint64_t damaged_bytes = 0;
  std::vector<DamagedRange> damaged;
  // Of last_pause_bytes and last_resume_bytes, what did not move (each at most the total).
  Skipped last_pause_skipped;
  Skipped last_resume_skipped;
  // Per tag and policy, the first kMaxTagsReported.
  std::vector<TagBytes> tags;

  template <class F>
  void fields(F&& f) {
    f(state), f(resident_bytes), f(paused_bytes), f(unmanaged_bytes), f(managed_allocations), f(last_pause_bytes),
        f(last_pause_ns), f(last_resume_bytes), f(last_resume_ns), f(last_change_unix_ms), f(damaged_allocations),
        f(damaged_bytes), f(damaged), f(last_pause_skipped), f(last_resume_skipped), f(tags);
  }
  bool check(std::string& why) const;
};

struct BlobSize {
  uint64_t id = 0;
  uint64_t size = 0;
  template <class F>
  void fields(F&& f) {
    f(id), f(size);
  }
};

// Chunks [first_chunk, first_chunk + count) of `blob` (chunk i covers bytes [i*chunk, (i+1)*chunk)):
// in Reserve.zero_runs every byte of them is zero; in Reserve.host_runs the shim keeps them in its
// host-tier memory.
struct ChunkRun {
  uint64_t blob = 0;
  uint64_t first_chunk = 0;
  uint64_t count = 0;
  template <class F>
  void fields(F&& f) {
    f(blob), f(first_chunk), f(count);
  }
};

struct SessionInfo {
  uint64_t session_id = 0;
  int32_t pid = 0;
  uint32_t uid = 0;
  int64_t rank = 0;
  std::string job;
  uint64_t disk_bytes = 0;  // bytes reserved on disk for this rank
  RankStats stats;          // as the rank last reported them (an orphan's: before it lost its connection)
  // 1: the rank lost its connection while its files hold memory it released (or it shares memory
  // through legacy IPC); the daemon keeps the session and its files until the rank reconnects with its
  // session token or its process exits. It counts against max-sessions-per-uid like any session.
  uint8_t orphaned = 0;
  uint64_t orphaned_unix_ms = 0;   // when it lost its connection; set exactly when orphaned
  uint64_t host_tier_bytes = 0;    // host-tier memory the rank holds (granted or adopted)
  uint8_t host_tier_kept = 0;      // 1: that memory holds nothing now, kept for the rank's next pause
  uint32_t objects = 0;            // objects in the rank's store (STORE_OPEN), apart from its pauses
  uint64_t object_bytes = 0;       // ... the bytes they hold on disk
  uint64_t object_host_bytes = 0;  // ... the host-tier memory objects live in (not in host_tier_bytes)
  template <class F>
  void fields(F&& f) {
    f(session_id), f(pid), f(uid), f(rank), f(job, kMaxNameLength), f(disk_bytes), f(stats), f(orphaned),
        f(orphaned_unix_ms), f(host_tier_bytes), f(host_tier_kept), f(objects), f(object_bytes), f(object_host_bytes);
  }
  bool check(std::string& why) const;
};

// A rank a CONTROL was sent to (ControlTargets).
struct RankTarget {
  uint64_t session_id = 0;
  int32_t pid = 0;    // 0: outside the daemon's pid namespace
  int64_t rank = -1;  // -1: the rank declared none
  std::string job;
  template <class F>
  void fields(F&& f) {
    f(session_id), f(pid), f(rank), f(job, kMaxNameLength);
  }
};
// A page of targets never outgrows a message: each takes at most 8 + 4 + 8 + 2 + kMaxNameLength bytes.
inline constexpr std::size_t kTargetsPerPage = 512;
static_assert(kTargetsPerPage * (22 + kMaxNameLength) + 16 < kMaxPayload);

struct RankResult {
  uint64_t session_id = 0;
  int32_t pid = 0;
  int64_t rank = 0;
  std::string job;
  int32_t code = 0;  // 0 on success, else a positive errno value
  uint64_t bytes = 0;
  uint64_t nanos = 0;
  std::string message;
  uint8_t outcome = 0;  // Outcome: the rank's own; Done for a rank that exited before answering
  Skipped skipped;      // of `bytes`, what did not move
  template <class F>
  void fields(F&& f) {
    f(session_id), f(pid), f(rank), f(job, kMaxNameLength), f(code), f(bytes), f(nanos), f(message, kMaxResultText),
        f(outcome), f(skipped);
  }
};

// ---------------------------------------------------------------------------------------------
// Messages

struct ErrorReply {
  static constexpr MsgType kType = MsgType::Error;
  int32_t code = 0;  // positive errno value
  std::string message;
  template <class F>
  void fields(F&& f) {
    f(code), f(message, kMaxTextLength);
  }
  bool check(std::string& why) const;
};

struct OkReply {
  static constexpr MsgType kType = MsgType::Ok;
  template <class F>
  void fields(F&&) {}
};

// Hello.flags.
// The descriptor of a directory rides along: the rank's files go there (TMS_DISK_BACKUP_DIR as the
// rank opened it), unless it is one of the daemon's roots, which keeps its usual layout. A directory
// owned by the rank's user and writable by no one else; refused on tmpfs as roots are.
inline constexpr uint8_t kHelloRankDir = 1;

struct Hello {
  static constexpr MsgType kType = MsgType::Hello;
  uint8_t role = 0;  // Role
  int64_t rank = -1;
  uint32_t device_count = 0;
  std::string job;
  // TMS_DISK_BACKUP_DIR as the rank names it: for messages, and without kHelloRankDir checked to lie
  // under a root. The daemon never opens it.
  std::string backup_dir;
  uint64_t token = 0;                 // non-zero: reconnect to the session this token was issued for
  uint64_t staging_budget_bytes = 0;  // 0: the daemon's default staging budget
  uint32_t chunk_bytes = 0;           // 0: the daemon's default chunk size
  uint8_t flags = 0;                  // kHello*
  template <class F>
  void fields(F&& f) {
    f(role), f(rank), f(device_count), f(job, kMaxNameLength), f(backup_dir, kMaxPathLength), f(token),
        f(staging_budget_bytes), f(chunk_bytes), f(flags);
  }
  bool check(std::string& why) const;
};

struct Welcome {
  static constexpr MsgType kType = MsgType::Welcome;
  uint64_t session_id = 0;
  uint64_t token = 0;
  uint64_t staging_budget_bytes = 0;
  uint32_t chunk_bytes = 0;
  uint32_t slot_count = 0;
  uint8_t restored = 0;  // 1: a paused manifest of this rank was adopted (daemon restart)
  std::string rank_dir;
  // 1: this session continues the one the rank lost its connection from (kept as an orphan): what
  // the daemon held for it (files, legacy IPC exports and opens) is still there.
  uint8_t adopted = 0;
  // To a control client (which has no session): the daemon's defaults and limits, so that `tmsctl run`
  // refuses a staging budget the daemon would refuse, before the program starts. staging_budget_bytes
  // and chunk_bytes above are then the defaults a rank gets.
  uint64_t max_staging_budget_bytes = 0;
  // To a control client: the daemon's package version ("0.1.0"), which `tmsctl doctor` reports. The
  // protocol version in the header is what decides compatibility; this is for people.
  std::string version;
  template <class F>
  void fields(F&& f) {
    f(session_id), f(token), f(staging_budget_bytes), f(chunk_bytes), f(slot_count), f(restored),
        f(rank_dir, kMaxPathLength), f(adopted), f(max_staging_budget_bytes), f(version, kMaxVersionLength);
  }
  bool check(std::string& why) const;
};

// The blobs a pause will write, the runs of their chunks that are all zero, and those the shim keeps
// in its host-tier memory (a run names a blob of this message or of an earlier one of the same set;
// no two runs, of either list, overlap). Such chunks take no disk space and are recorded at once: no
// WRITE for them follows, and no READ may ask for them. `carry` names blobs of the set that stay
// paused as the store holds them (another tag's pause): nothing of them is written, and
// the rank says that what it does not carry is resident again (RankStore::reserve).
struct Reserve {
  static constexpr MsgType kType = MsgType::Reserve;
  uint8_t flags = 0;
  std::vector<BlobSize> blobs;
  std::vector<ChunkRun> zero_runs;
  std::vector<ChunkRun> host_runs;
  std::vector<uint64_t> carry;
  template <class F>
  void fields(F&& f) {
    f(flags), f(blobs), f(zero_runs), f(host_runs), f(carry);
  }
  bool check(std::string& why) const;
};

// WRITE and READ (ChunkRef: wire.h).
struct Write : ChunkRef {
  static constexpr MsgType kType = MsgType::Write;
};
// The daemon's storage seals every chunk it writes and verifies every chunk it reads against its own
// record (which survives a daemon restart mid-pause, see its checksum journal): no checksum crosses
// the wire, so the shim keeps none that could disagree.
struct Read : ChunkRef {
  static constexpr MsgType kType = MsgType::Read;
};

// Acknowledges a WRITE: the chunk is on disk and storage recorded its checksum.
struct Written {
  static constexpr MsgType kType = MsgType::Written;
  // 1: the rank's file provably held these very bytes for this chunk already (same blob and offset,
  // the XXH3-128 recorded by the last committed generation), so it was not rewritten.
  uint8_t unchanged = 0;
  template <class F>
  void fields(F&& f) {
    f(unchanged);
  }
  bool check(std::string& why) const;
};

// Acknowledges a READ: the slot holds the chunk and storage verified it.
struct ReadDone {
  static constexpr MsgType kType = MsgType::ReadDone;
  template <class F>
  void fields(F&&) {}
};

// The daemon's manifest is the one record of whether the rank is paused: COMMIT changes it (the daemon
// numbers each committed pause), PAUSE_STATE reads it. The shim keeps no copy that could disagree
// (after a resume whose commit failed, say).
struct Commit {
  static constexpr MsgType kType = MsgType::Commit;
  uint8_t state = 0;  // CommitState
  template <class F>
  void fields(F&& f) {
    f(state);
  }
  bool check(std::string& why) const;
};

struct PauseState {
  static constexpr MsgType kType = MsgType::PauseState;
  template <class F>
  void fields(F&&) {}
};

struct PauseStateReply {
  static constexpr MsgType kType = MsgType::PauseStateReply;
  uint8_t paused = 0;       // 1: a committed pause holds the only copy of some of the rank's memory
  uint64_t generation = 0;  // of the last committed pause (0: none yet)
  template <class F>
  void fields(F&& f) {
    f(paused), f(generation);
  }
  bool check(std::string& why) const;
};

// Host-memory tier (README.md, "The host tier"). The daemon owns one budget for the node
// (host-tier-mb); a rank asks for what its pause would like to keep there, and gets at most its
// fair share of the budget, less whatever the node cannot spare now (MemAvailable, the daemon's
// cgroup). Granted memory belongs to the rank until it releases it or exits: the daemon keeps no
// descriptor of it.
//
// Ahead of a pause (kTierAskAhead): a running rank whose memory stopped growing asks for what its
// pause would want, so that its first pause finds the memory made and pinned, as every later one
// does with kept memory. Granted only from what is free now (nobody's kept memory is reclaimed for
// it), and kept from the start: the daemon takes it back as it takes kept memory.
inline constexpr uint8_t kTierAskAhead = 1;

struct TierAsk {
  static constexpr MsgType kType = MsgType::TierAsk;
  uint64_t bytes = 0;  // wanted; the grant is a whole number of the session's chunks
  uint8_t flags = 0;   // kTierAsk*
  template <class F>
  void fields(F&& f) {
    f(bytes), f(flags);
  }
  bool check(std::string& why) const;
};

//
// Kept memory: a grant with kTierKeep lets the rank keep its memory, mapped and registered with CUDA,
// after the resume that emptied it (TIER_KEEP), so that its next pause has only the copy on its path
// (making and pinning a few GiB takes seconds; copying them, a fraction of one). The daemon takes it
// back when another rank's pause needs it (TIER_RECLAIM) or when the session ends. A rank that asks
// while it holds kept memory is told to reuse it (kTierReuse, no fd), or to release it first and ask
// again (kTierReleaseFirst) when it holds less than it could get or more than its fair share.
inline constexpr uint8_t kTierKeep = 1;
inline constexpr uint8_t kTierReuse = 2;
inline constexpr uint8_t kTierReleaseFirst = 4;

struct TierGrant {
  static constexpr MsgType kType = MsgType::TierGrant;
  // 0: none (no fd); else what the rank may use: the memfd's size (its pages faulted in and sealed),
  // or with kTierReuse, as much of the memory it holds.
  uint64_t bytes = 0;
  std::string note;   // why less than asked (for the rank's log); empty when all of it
  uint8_t flags = 0;  // kTier*
  template <class F>
  void fields(F&& f) {
    f(bytes), f(note, kMaxTextLength), f(flags);
  }
  bool check(std::string& why) const;
};

struct TierRelease {
  static constexpr MsgType kType = MsgType::TierRelease;
  template <class F>
  void fields(F&&) {}
};

// The memfd a daemon granted (this one or one that stopped since) rides along; the daemon counts
// its pages against the budget (the rank keeps them either way).
struct TierAdopt {
  static constexpr MsgType kType = MsgType::TierAdopt;
  template <class F>
  void fields(F&&) {}
};

struct TierKeep {
  static constexpr MsgType kType = MsgType::TierKeep;
  template <class F>
  void fields(F&&) {}
};

struct TierReclaim {
  static constexpr MsgType kType = MsgType::TierReclaim;
  template <class F>
  void fields(F&&) {}
};

struct Report {
  static constexpr MsgType kType = MsgType::Report;
  RankStats stats;
  template <class F>
  void fields(F&& f) {
    f(stats);
  }
  bool check(std::string& why) const { return stats.check(why); }
};

struct Command {
  static constexpr MsgType kType = MsgType::Command;
  uint8_t op = 0;     // CommandOp
  uint8_t flags = 0;  // kAcceptLoss, from the Control that asked
  std::string tag;    // only the allocations carrying this tag; empty: every allocation
  template <class F>
  void fields(F&& f) {
    f(op), f(flags), f(tag, kMaxTagLength);
  }
  bool check(std::string& why) const;
};

struct CommandDone {
  static constexpr MsgType kType = MsgType::CommandDone;
  int32_t code = 0;  // 0 or a positive errno value
  uint64_t bytes = 0;
  uint64_t nanos = 0;
  std::string message;
  uint8_t outcome = 0;  // Outcome; a NoOp has code 0 and moved no bytes
  Skipped skipped;      // of `bytes`, what did not move
  template <class F>
  void fields(F&& f) {
    f(code), f(bytes), f(nanos), f(message, kMaxTextLength), f(outcome), f(skipped);
  }
  bool check(std::string& why) const;
};

struct Progress {
  static constexpr MsgType kType = MsgType::Progress;
  uint64_t session_id = 0;  // filled in by the daemon when it forwards
  uint64_t done_bytes = 0;
  uint64_t total_bytes = 0;
  template <class F>
  void fields(F&& f) {
    f(session_id), f(done_bytes), f(total_bytes);
  }
  bool check(std::string& why) const;
};

struct ListSessions {
  static constexpr MsgType kType = MsgType::ListSessions;
  uint32_t start = 0;  // index of the first session wanted (paging)
  template <class F>
  void fields(F&& f) {
    f(start);
  }
};

struct Sessions {
  static constexpr MsgType kType = MsgType::Sessions;
  uint32_t total = 0;  // sessions visible to the caller; ask again from start+size() for more
  std::vector<SessionInfo> sessions;
  // The node's host-memory tier: its budget (0: off) and what all ranks hold of it now, every
  // user's (a number, no names: the caller sees only its own sessions).
  uint64_t host_tier_budget_bytes = 0;
  uint64_t host_tier_used_bytes = 0;
  template <class F>
  void fields(F&& f) {
    f(total), f(sessions), f(host_tier_budget_bytes), f(host_tier_used_bytes);
  }
  bool check(std::string& why) const;
};

struct Control {
  static constexpr MsgType kType = MsgType::Control;
  uint8_t op = 0;     // CommandOp
  uint8_t match = 0;  // kMatch* bits
  std::string job;
  int64_t rank = -1;
  int32_t pid = 0;
  uint32_t timeout_ms = 0;  // 0: no limit
  uint8_t flags = 0;        // kAcceptLoss (resume only); forwarded to each rank in its Command
  std::string tag;          // forwarded too: only that tag's allocations; empty: all
  template <class F>
  void fields(F&& f) {
    f(op), f(match), f(job, kMaxNameLength), f(rank), f(pid), f(timeout_ms), f(flags), f(tag, kMaxTagLength);
  }
  bool check(std::string& why) const;
};

// The ranks a CONTROL asked, sent before any of their results (in as many pages as they need): a
// client that gives up waiting names those without a result, as ranks that did not answer.
struct ControlTargets {
  static constexpr MsgType kType = MsgType::ControlTargets;
  uint8_t last = 1;  // 0: more ControlTargets messages follow for the same request
  std::vector<RankTarget> ranks;
  template <class F>
  void fields(F&& f) {
    f(last), f(ranks);
  }
  bool check(std::string& why) const;
};

// One page per rank, sent as soon as the rank answers (or the daemon knows it never will: it exited,
// ECONNRESET); the page that completes the request has last = 1. At the daemon's deadline
// (Control.timeout_ms) the last page carries no result for the ranks still silent: every result is a
// rank's answer, and a target without one did not answer.
struct ControlResult {
  static constexpr MsgType kType = MsgType::ControlResult;
  uint8_t last = 1;  // 0: more ControlResult messages follow for the same request
  std::vector<RankResult> results;
  template <class F>
  void fields(F&& f) {
    f(last), f(results);
  }
  bool check(std::string& why) const;
};

struct Gc {
  static constexpr MsgType kType = MsgType::Gc;
  template <class F>
  void fields(F&&) {}
};

struct GcResult {
  static constexpr MsgType kType = MsgType::GcResult;
  uint32_t removed_dirs = 0;
  uint64_t removed_bytes = 0;
  template <class F>
  void fields(F&& f) {
    f(removed_dirs), f(removed_bytes);
  }
};

// The directory the rank's files go in from now on (torch_memory_saver's set_disk_backup_dir); its
// descriptor rides along (O_PATH will do). Answered with OK once the rank's files are there; refused
// while anything of the rank is paused or being paused or resumed, or while it stores objects
// (STORE_*), saying so; the rank's files stay where they were then. A root of the daemon's brings its
// usual layout back.
struct SetRankDir {
  static constexpr MsgType kType = MsgType::SetRankDir;
  std::string path;  // as the rank named it, for messages only: the daemon never opens it
  template <class F>
  void fields(F&& f) {
    f(path, kMaxPathLength);
  }
  bool check(std::string& why) const;
};

using Message =
    std::variant<ErrorReply, OkReply, Hello, Welcome, Reserve, Write, Written, Read, ReadDone, Commit, PauseState,
                 PauseStateReply, TierAsk, TierGrant, TierRelease, TierAdopt, TierKeep, TierReclaim, Report, Command,
                 CommandDone, Progress, ListSessions, Sessions, Control, ControlResult, Gc, GcResult, ControlTargets,
                 IpcExport, IpcExported, IpcRevoke, IpcOpen, IpcOpened, IpcClose, IpcUsers, StoreOpen, StoreOpened,
                 StoreWrite, StoreRead, StoreCommit, StoreRemove, SetRankDir>;

struct Envelope {
  uint64_t request_id = 0;
  Message body;
};

// Encodes one message. Returns an empty vector if it would exceed kMaxMessageSize or a field breaks
// its own limits (a string too long): callers treat that as a programming error and report it.
std::vector<uint8_t> encode(uint64_t request_id, const Message& body);

// Bytes one RankResult takes inside a ControlResult: a sender fills a page while the sum stays
// within kMaxPayload (less a few bytes for the page's own fields).
std::size_t encoded_size(const RankResult& r);
// Bytes one SessionInfo takes inside a Sessions page (which pages the same way).
std::size_t encoded_size(const SessionInfo& s);

struct DecodeResult {
  std::optional<Envelope> envelope;  // set on success
  int code = 0;                      // on failure: EPROTO, EBADMSG, EPROTONOSUPPORT, EMSGSIZE
  std::string error;                 // on failure: what was wrong, for the log and the peer
};

// Decodes and validates one received message. Never throws on bad input; every field is checked.
DecodeResult decode(std::span<const uint8_t> bytes) noexcept;

// Reads only the header (for answering a version mismatch before trusting anything else).
std::optional<Header> peek_header(std::span<const uint8_t> bytes) noexcept;

// The rule every text field's check() applies: no control character (bytes < 0x20 and 0x7f).
bool printable(std::string_view s) noexcept;
// `s` as the decoder accepts it in a text field: at most `max` bytes, each control character
// replaced by a space. A sender builds its messages with this, so a newline in a reason never
// gets the whole message refused as malformed.
std::string wire_text(std::string s, std::size_t max = kMaxTextLength);

const char* type_name(MsgType type) noexcept;
const char* state_name(RankState state) noexcept;
const char* outcome_name(Outcome outcome) noexcept;  // "done", "no-op"
const char* unmanaged_name(Unmanaged reason) noexcept;
const char* damage_name(Damage reason) noexcept;  // "checksum-mismatch", "read-error", "missing"

template <class T>
constexpr MsgType type_of() noexcept {
  return T::kType;
}

}  // namespace tmsdisk::proto
