// SPDX-License-Identifier: Apache-2.0
// The tmsdisk wire protocol's framing (messages.h has the whole protocol): the header, the message
// types, the limits every message is checked against, and the chunk reference the data messages share.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace tmsdisk::proto {

inline constexpr uint32_t kMagic = 0x444d5354u;  // "TSMD" in the first four bytes on the wire
// 2: legacy IPC brokered by the daemon (IPC_*).
// 3: checksums and the pause state stay in the daemon's storage: READ, WRITTEN and READ_DONE carry no
//    checksum, COMMIT no generation (the daemon assigns it); the shim asks with PAUSE_STATE.
// 4: COMMAND_DONE and each result of CONTROL_RESULT carry an Outcome: a pause or resume with nothing to
//    do says so instead of passing for one that moved 0 bytes. CONTROL is answered with CONTROL_TARGETS
//    (the ranks asked) first, then one CONTROL_RESULT per rank as soon as it answers; at the daemon's
//    deadline the last page comes without the ranks that did not answer, so that a client that stops
//    waiting (tmsctl's own deadline) has every answer so far and can name the ranks still silent.
//    CONTROL and COMMAND carry flags (kAcceptLoss: `tmsctl resume --accept-loss`), and RankStats the
//    allocations a resume could not restore because their backup is damaged (count, bytes and the
//    first kMaxDamagedRanges ranges), so that `tmsctl status` names them in the application's terms.
//    SessionInfo says whether the session is an orphan (its rank lost the connection and its files are
//    kept for it to reconnect) and since when: orphans count against max-sessions-per-uid, so
//    `tmsctl status` lists them.
// 5: bytes that need not move (README.md, "What moves"). RESERVE lists the runs of chunks whose bytes
//    are all zero (the shim scans the device before it reserves): they take no disk space, are never
//    written nor read, and resume sets them to zero on the device. WRITTEN says whether the chunk was
//    unchanged (its XXH3-128 equals what the rank's file provably holds there, so the daemon did not
//    rewrite it). COMMAND_DONE, each RankResult and RankStats' last pause/resume carry the bytes
//    skipped as zero and as unchanged, beside the total.
// 6: the host-memory tier (README.md, "The host tier"). Before it reserves, a pausing shim asks for
//    host memory (TIER_ASK); the daemon answers TIER_GRANT with the bytes of its node budget this rank
//    may use now and, when that is not 0, a sealed memfd of that size whose pages it has already
//    faulted in. The shim copies chunks into it by DMA and names them in RESERVE.host_runs: like zero
//    chunks they take no disk space and are never written nor read. TIER_RELEASE gives the memory back;
//    after a daemon restart the shim hands its memfd to the new daemon (TIER_ADOPT), which counts it
//    against the budget again. The bytes kept in the tier are reported beside the zero and unchanged
//    ones (Skipped.host_bytes), sessions say what they hold, and SESSIONS the node's budget.
// 9: the rank's store of named objects (README.md, "Streaming optimizer state"): STORE_OPEN names an
//    object (created at its size when missing) and gets a handle; STORE_WRITE and STORE_READ move its
//    chunks through the staging slots as WRITE and READ do a pause's (sealed, verified); STORE_COMMIT
//    makes a written range the object's current version at once (or drops it), STORE_REMOVE deletes
//    an object. A pause never touches the store.
// 10: objects in the host tier. STORE_OPEN may ask for the object to live in host-tier memory
//    (kStoreOpenHost): when the rank's share of the node's budget has room for all of it, STORE_OPENED
//    says so (host_bytes) and the object's memfd rides along; the rank copies its ranges in and out by
//    DMA and the object takes no disk space. After a daemon restart the rank hands that memfd back with
//    kStoreOpenHeld. Sessions say how much of their objects' bytes live in host memory. COMMAND and
//    CONTROL take CommandOp::Prefetch: paused memory read into the host tier ahead of its resume.
// 11: a directory of the rank's choosing (TMS_DISK_BACKUP_DIR outside the roots, torch_memory_saver's
//    set_disk_backup_dir). HELLO with kHelloRankDir hands over its descriptor, SET_RANK_DIR moves the
//    rank's files to another one while nothing of it is paused; the daemon keeps the rank's files
//    directly in that directory, never resolving a path the rank sent.
inline constexpr uint16_t kVersion = 11;

// Requests the daemon starts on a shim's session (COMMAND, TIER_RECLAIM) carry request ids with this
// bit set: the shim numbers its own requests from 1, and a command that arrives while the shim awaits
// the reply to one of them must never be taken for that reply.
inline constexpr uint64_t kDaemonRequestBit = uint64_t{1} << 63;
inline constexpr std::size_t kHeaderSize = 24;
inline constexpr std::size_t kMaxMessageSize = 64 * 1024;
inline constexpr std::size_t kMaxPayload = kMaxMessageSize - kHeaderSize;

inline constexpr std::size_t kMaxNameLength = 64;     // job names
inline constexpr std::size_t kMaxVersionLength = 64;  // a package version, e.g. "0.1.0"

// A job name becomes a directory under each root, so it is kept to characters that are safe there:
// 1-64 letters, digits, '.', '_' or '-', not starting with '.' (no "..", no hidden names).
constexpr bool job_name_char(char c) noexcept {
  return (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '.' || c == '_' || c == '-';
}
constexpr bool valid_job_name(std::string_view name) noexcept {
  if (name.empty() || name.size() > kMaxNameLength || name.front() == '.') return false;
  for (char c : name)
    if (!job_name_char(c)) return false;
  return true;
}
inline constexpr const char* kJobNameRule = "use 1-64 letters, digits, '.', '_' or '-', not starting with '.'";
// Human-readable messages. Room for a refusal that quotes a full path (kMaxPathLength) with its
// advice, so none reaches the user cut; every message stays far below kMaxMessageSize.
inline constexpr std::size_t kMaxTextLength = 8192;
// Per-rank message inside ControlResult: as long as any message, so a rank's answer arrives whole
// (each rank's result has a page of its own, which it always fits in).
inline constexpr std::size_t kMaxResultText = kMaxTextLength;
inline constexpr std::size_t kMaxPathLength = 4095;
static_assert(kMaxTextLength > kMaxPathLength + 1024 && kMaxTextLength + 1024 < kMaxPayload);

enum class MsgType : uint16_t {
  // Replies, any direction.
  Error = 1,
  Ok = 2,
  // Session: shim <-> daemon.
  Hello = 10,            // first message of every connection (shim or tmsctl)
  Welcome = 11,          // daemon's answer; for a shim it carries the staging memfd
  Reserve = 12,          // shim: the blobs this pause will write (may span several messages)
  Write = 13,            // shim: write one staging slot to a blob chunk
  Written = 14,          // daemon: the chunk is on disk and sealed (its checksum recorded by storage)
  Read = 15,             // shim: read one blob chunk into a staging slot
  ReadDone = 16,         // daemon: the slot holds the chunk, verified against storage's record
  Commit = 17,           // shim: the pause (or resume) is complete; daemon syncs and commits the manifest
  Report = 18,           // shim: its current accounting (no reply)
  Command = 19,          // daemon -> shim: pause or resume, routed from tmsctl
  CommandDone = 20,      // shim -> daemon: the outcome of a Command
  Progress = 21,         // shim -> daemon -> tmsctl: bytes moved so far
  PauseState = 22,       // shim: what the daemon's manifest says of this rank (answered with PAUSE_STATE_REPLY)
  PauseStateReply = 23,  // daemon: whether a committed pause holds the rank's data, and its generation
  TierAsk = 24,          // shim: host-tier memory wanted for the pause it is starting
  TierGrant = 25,        // daemon: how much of it the rank may use; its memfd rides along when not 0
  TierRelease = 26,      // shim: gives its host-tier memory back (answered with OK)
  TierAdopt = 27,        // shim, on a new session: the host-tier memfd it still holds rides along (OK)
  TierKeep = 28,         // shim: resumed, it keeps its host-tier memory for the next pause (no reply)
  TierReclaim = 29,      // daemon -> shim: give kept host-tier memory back (TIER_RELEASE) for another rank
  // Control: tmsctl <-> daemon.
  ListSessions = 30,
  Sessions = 31,
  Control = 32,        // pause/resume the sessions a selector matches
  ControlResult = 33,  // per-rank outcomes, each as soon as its rank answers
  Gc = 34,             // sweep directories of dead ranks now
  GcResult = 35,
  ControlTargets = 36,  // the ranks a CONTROL was sent to, before any CONTROL_RESULT
  // Legacy CUDA IPC brokered by the daemon: shim <-> daemon (see the IPC messages below).
  IpcExport = 40,    // exporter: share an allocation's physical memory; its POSIX fd rides along
  IpcExported = 41,  // daemon: the id importers name it by
  IpcRevoke = 42,    // exporter: drop the fd (before a pause: refused while imported; after a free)
  IpcOpen = 43,      // importer: resolve an id from a CUipcMemHandle
  IpcOpened = 44,    // daemon: the physical memory's fd rides along
  IpcClose = 45,     // importer: done with it
  IpcUsers = 46,     // daemon -> exporter: how many processes have it open now (no reply)
  // The rank's store of named objects: shim <-> daemon (see the STORE messages below).
  StoreOpen = 50,    // shim: the handle of an object, created at its size when missing
  StoreOpened = 51,  // daemon: its handle
  StoreWrite = 52,   // shim: write one staging slot to a chunk of an object (answered with WRITTEN)
  StoreRead = 53,    // shim: read one chunk of an object's current version (answered with READ_DONE)
  StoreCommit = 54,  // shim: a written range becomes the object's current version, or is dropped (OK)
  StoreRemove = 55,  // shim: delete an object (OK)
  // The rank's directory: shim -> daemon.
  SetRankDir = 60,  // shim: the rank's files go in the directory whose descriptor rides along (OK)
};

enum class Role : uint8_t { Shim = 1, Control = 2 };

// Rank state as the shim reports it.
enum class RankState : uint8_t { Running = 0, Pausing = 1, Paused = 2, Resuming = 3, PartiallyPaused = 4 };
inline constexpr uint8_t kRankStateMax = 4;

// Why bytes the program allocated are not paused (invariant 7 of DESIGN.md).
enum class Unmanaged : uint8_t {
  Small = 0,          // below TMSDISK_MIN_BYTES, left to the native allocator
  Exported = 1,       // shareable handle exported to another process
  Imported = 2,       // memory imported from another process
  Multicast = 3,      // bound to a multicast object
  Pool = 4,           // stream-ordered pool memory
  ManagedMemory = 5,  // cuMemAllocManaged
  Other = 6,
  Resident = 7,  // allocated under a tag whose policy is resident (tmsdisk.disabled()): never paused
};
inline constexpr std::size_t kUnmanagedReasons = 8;

// Prefetch: start reading paused memory from disk into the rank's host-tier memory ahead of its
// resume (version 10); answered once started, in the background after that.
enum class CommandOp : uint8_t { Pause = 1, Resume = 2, Prefetch = 3 };
inline bool valid_command_op(uint8_t op) noexcept {
  return op >= static_cast<uint8_t>(CommandOp::Pause) && op <= static_cast<uint8_t>(CommandOp::Prefetch);
}

// What a pause or resume amounted to. Done: it ran; bytes moved, or it failed (see the code). NoOp:
// the rank was already in the state asked for and nothing moved; the message says which state
// ("already paused", "nothing is paused", "no managed allocations to pause"). Apart, so that a no-op
// does not pass for a pause of 0 bytes, and the rank's last figures stay those of a real one.
enum class Outcome : uint8_t { Done = 0, NoOp = 1 };
inline constexpr uint8_t kOutcomeMax = 1;

enum class CommitState : uint8_t { Paused = 1, Resumed = 2 };

// Control.flags and Command.flags.
// A resume replaces allocations whose backup is damaged (checksum mismatch, read error, chunk
// missing) with zero-filled memory at the same addresses, instead of leaving them paused. Resume only.
inline constexpr uint8_t kAcceptLoss = 1;

// Why a resume could not restore an allocation from its backup (DamagedRange.reason).
enum class Damage : uint8_t {
  ChecksumMismatch = 1,  // a chunk read back does not match the checksum sealed when it was written
  ReadError = 2,         // reading a chunk failed: an I/O error, or the file is shorter than recorded
  Missing = 3,           // the daemon holds no sealed copy of a chunk (never written, or its record is gone)
};
// A READ refused with EUCLEAN: the daemon's record of where the chunk lies or what it must read back
// as (the rank's manifest, or its checksum journal) is missing or unreadable. The data file is kept
// untouched; the message names the file and what the user can do. The shim counts it as Missing.
inline constexpr uint8_t kDamageMax = 3;
// RankStats lists at most this many damaged ranges (the first ones by address); the counts cover all.
inline constexpr std::size_t kMaxDamagedRanges = 4;

// Reserve.flags
inline constexpr uint8_t kReserveFirst = 1;  // starts a new blob set, dropping any half-sent one
inline constexpr uint8_t kReserveLast = 2;   // the set is complete: apply it (all or nothing)

// Control.match: which selectors apply; they combine with AND. kMatchAll must stand alone.
inline constexpr uint8_t kMatchJob = 1;
inline constexpr uint8_t kMatchRank = 2;
inline constexpr uint8_t kMatchPid = 4;
inline constexpr uint8_t kMatchAll = 8;

struct Header {
  uint32_t magic = kMagic;
  uint16_t version = kVersion;
  uint16_t type = 0;
  uint32_t length = 0;  // payload bytes after the header
  uint32_t flags = 0;   // reserved, must be zero
  uint64_t request_id = 0;
};

// Write and Read name one chunk: `slot` of the staging buffer and bytes [offset, offset+length) of a
// blob. Offsets are multiples of the chunk size; length is the chunk size except for a blob's tail.
struct ChunkRef {
  uint32_t slot = 0;
  uint32_t length = 0;
  uint64_t blob = 0;
  uint64_t offset = 0;
  template <class F>
  void fields(F&& f) {
    f(slot), f(length), f(blob), f(offset);
  }
  bool check(std::string& why) const;
};

}  // namespace tmsdisk::proto
