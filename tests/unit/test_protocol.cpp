// SPDX-License-Identifier: Apache-2.0
// Protocol: every message round-trips, and malformed input is rejected with the right code.
#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <cerrno>
#include <cstring>
#include <vector>

#include "fd_passing.h"
#include "tmsdisk/protocol/client.h"
#include "tmsdisk/protocol/messages.h"
#include "tmsdisk/protocol/socket.h"

using namespace tmsdisk::proto;
using tmsdisk::testing::send_with_fds;

namespace {

template <class T>
T round_trip(const T& in, uint64_t id = 77) {
  auto bytes = encode(id, in);
  REQUIRE(!bytes.empty());
  REQUIRE(bytes.size() <= kMaxMessageSize);
  auto d = decode(bytes);
  INFO(d.error);
  REQUIRE(d.envelope);
  CHECK(d.envelope->request_id == id);
  auto* out = std::get_if<T>(&d.envelope->body);
  REQUIRE(out);
  return *out;
}

int decode_code(const std::vector<uint8_t>& bytes) {
  auto d = decode(bytes);
  CHECK_FALSE(d.envelope);
  CHECK_FALSE(d.error.empty());
  return d.code;
}

}  // namespace

TEST_CASE("every message type round-trips with its fields") {
  Hello h;
  h.role = static_cast<uint8_t>(Role::Shim);
  h.rank = 5;
  h.device_count = 8;
  h.job = "job-1.a_b";
  h.backup_dir = "/nvme0/x";
  h.token = 0xdeadbeef;
  h.staging_budget_bytes = 256 << 20;
  h.chunk_bytes = 8 << 20;
  auto h2 = round_trip(h);
  CHECK(h2.rank == 5);
  CHECK(h2.job == "job-1.a_b");
  CHECK(h2.backup_dir == "/nvme0/x");
  CHECK(h2.token == 0xdeadbeef);
  CHECK(h2.chunk_bytes == (8u << 20));

  Welcome w;
  w.session_id = 9;
  w.staging_budget_bytes = 64 << 20;
  w.chunk_bytes = 8 << 20;
  w.slot_count = 8;
  w.restored = 1;
  w.adopted = 1;
  w.rank_dir = "/r/0/j/rank0-1";
  CHECK(round_trip(w).rank_dir == w.rank_dir);
  CHECK(round_trip(w).adopted == 1);
  w.version = "0.1.0";
  CHECK(round_trip(w).version == "0.1.0");

  Reserve r;
  r.flags = kReserveFirst | kReserveLast;
  r.blobs = {{1, 100}, {2, 1ull << 40}};
  r.zero_runs = {{2, 5, 1000}};
  auto r2 = round_trip(r);
  REQUIRE(r2.blobs.size() == 2);
  CHECK(r2.blobs[1].size == (1ull << 40));
  REQUIRE(r2.zero_runs.size() == 1);
  CHECK(r2.zero_runs[0].blob == 2);
  CHECK(r2.zero_runs[0].first_chunk == 5);
  CHECK(r2.zero_runs[0].count == 1000);

  Read rd;
  rd.slot = 1;
  rd.length = 10;
  rd.blob = 2;
  rd.offset = 3;
  CHECK(round_trip(rd).offset == 3);
  // Acknowledgements only: checksums stay in the daemon's storage (since version 3); WRITTEN says
  // whether the chunk was unchanged (version 5).
  CHECK(encode(9, Written{}).size() == kHeaderSize + 1);
  CHECK(round_trip(Written{.unchanged = 1}).unchanged == 1);
  CHECK(encode(9, ReadDone{}).size() == kHeaderSize);
  CHECK(std::holds_alternative<Written>(decode(encode(9, Written{})).envelope->body));
  CHECK(std::holds_alternative<ReadDone>(decode(encode(9, ReadDone{})).envelope->body));
  CHECK(encode(9, rd).size() == kHeaderSize + 24);  // slot, length, blob, offset: no checksum
  CHECK(round_trip(Commit{.state = 2}).state == 2);
  CHECK(encode(9, Commit{.state = 1}).size() == kHeaderSize + 1);  // no generation: the daemon numbers pauses
  CHECK(encode(9, PauseState{}).size() == kHeaderSize);
  CHECK(std::holds_alternative<PauseState>(decode(encode(9, PauseState{})).envelope->body));
  auto ps = round_trip(PauseStateReply{.paused = 1, .generation = 12});
  CHECK(ps.paused == 1);
  CHECK(ps.generation == 12);
  CHECK(decode_code(encode(9, PauseStateReply{.paused = 2})) == EBADMSG);

  Report rep;
  rep.stats.state = static_cast<uint8_t>(RankState::Paused);
  rep.stats.unmanaged_bytes[static_cast<int>(Unmanaged::Pool)] = 123;
  CHECK(round_trip(rep).stats.unmanaged_bytes[4] == 123);
  rep.stats.state = static_cast<uint8_t>(RankState::PartiallyPaused);
  rep.stats.damaged_allocations = 7;
  rep.stats.damaged_bytes = 7 << 20;
  rep.stats.damaged = {{.address = 0x7f0000400000, .size = 6 << 20, .reason = 1, .chunk = 1},
                       {.address = 0x7f0001000000, .size = 1 << 20, .reason = 2, .chunk = 0}};
  auto rep2 = round_trip(rep);
  CHECK(rep2.stats.damaged_allocations == 7);
  CHECK(rep2.stats.damaged_bytes == (7u << 20));
  REQUIRE(rep2.stats.damaged.size() == 2);
  CHECK(rep2.stats.damaged[0].address == 0x7f0000400000);
  CHECK(rep2.stats.damaged[0].size == (6u << 20));
  CHECK(rep2.stats.damaged[0].reason == static_cast<uint8_t>(Damage::ChecksumMismatch));
  CHECK(rep2.stats.damaged[0].chunk == 1);
  CHECK(rep2.stats.damaged[1].reason == static_cast<uint8_t>(Damage::ReadError));

  CHECK(round_trip(Command{.op = 2}).op == 2);
  CommandDone cd;
  cd.code = ENOSPC;
  cd.message = "no space";
  CHECK(round_trip(cd).message == "no space");
  CHECK(round_trip(cd).outcome == static_cast<uint8_t>(Outcome::Done));
  auto noop = round_trip(CommandDone{.message = "already paused", .outcome = static_cast<uint8_t>(Outcome::NoOp)});
  CHECK(noop.outcome == static_cast<uint8_t>(Outcome::NoOp));
  CHECK(noop.message == "already paused");
  CHECK(round_trip(Progress{.session_id = 1, .done_bytes = 5, .total_bytes = 10}).done_bytes == 5);
  CHECK(round_trip(ListSessions{.start = 4}).start == 4);

  Sessions ss;
  ss.total = 1;
  SessionInfo info;
  info.job = "j";
  info.rank = 3;
  info.host_tier_bytes = 64 << 20;
  info.host_tier_kept = 1;
  ss.sessions.push_back(info);
  ss.host_tier_budget_bytes = 1 << 30;
  ss.host_tier_used_bytes = 64 << 20;
  auto ss2 = round_trip(ss);
  CHECK(ss2.sessions.at(0).rank == 3);
  CHECK(ss2.sessions.at(0).host_tier_bytes == (64u << 20));
  CHECK(ss2.sessions.at(0).host_tier_kept == 1);
  CHECK(ss2.host_tier_budget_bytes == (1u << 30));
  CHECK(ss2.host_tier_used_bytes == (64u << 20));

  // The host tier (protocol 6): an ask, a grant with its note, a release and an adoption.
  CHECK(round_trip(TierAsk{.bytes = 123}).bytes == 123);
  auto grant = round_trip(TierGrant{.bytes = 8 << 20, .note = "a fair share"});
  CHECK(grant.bytes == (8u << 20));
  CHECK(grant.note == "a fair share");
  CHECK(decode_code(encode(9, TierGrant{.bytes = 0, .note = "bad\nnote"})) == EBADMSG);
  CHECK(std::holds_alternative<TierRelease>(decode(encode(9, TierRelease{})).envelope->body));
  CHECK(std::holds_alternative<TierAdopt>(decode(encode(9, TierAdopt{})).envelope->body));
  // Kept memory (protocol 7): a grant's flags, and the messages of keeping and taking it back.
  auto reuse = round_trip(TierGrant{.bytes = 8 << 20, .flags = kTierReuse | kTierKeep});
  CHECK(reuse.flags == (kTierReuse | kTierKeep));
  CHECK(decode_code(encode(9, TierGrant{.flags = 8})) == EBADMSG);                               // unknown bit
  CHECK(decode_code(encode(9, TierGrant{.flags = kTierReuse | kTierReleaseFirst})) == EBADMSG);  // both
  CHECK(decode_code(encode(9, TierGrant{.bytes = 1, .flags = kTierReleaseFirst})) == EBADMSG);   // with bytes
  CHECK(round_trip(TierGrant{.flags = kTierReleaseFirst}).flags == kTierReleaseFirst);
  CHECK(std::holds_alternative<TierKeep>(decode(encode(9, TierKeep{})).envelope->body));
  // Asked ahead of a pause (protocol 8).
  CHECK(round_trip(TierAsk{.bytes = 5, .flags = kTierAskAhead}).flags == kTierAskAhead);
  CHECK(decode_code(encode(9, TierAsk{.bytes = 5, .flags = 2})) == EBADMSG);  // unknown bit
  CHECK(std::holds_alternative<TierReclaim>(decode(encode(9, TierReclaim{})).envelope->body));
  Reserve with_host;
  with_host.blobs = {{.id = 1, .size = 10 << 20}};
  with_host.host_runs = {{.blob = 1, .first_chunk = 0, .count = 2}};
  CHECK(round_trip(with_host).host_runs.at(0).count == 2);
  with_host.host_runs[0].count = 0;
  CHECK(decode_code(encode(9, with_host)) == EBADMSG);
  // Blobs carried as they are stored (protocol 8).
  Reserve carrying;
  carrying.blobs = {{.id = 1, .size = 10 << 20}, {.id = 2, .size = 4096}};
  carrying.carry = {1};
  CHECK(round_trip(carrying).carry == std::vector<uint64_t>{1});
  // Host bytes are part of what a pause covered, beside zero and unchanged ones.
  CommandDone tiered;
  tiered.bytes = 10;
  tiered.skipped = {.zero_bytes = 4, .unchanged_bytes = 3, .host_bytes = 3};
  CHECK(round_trip(tiered).skipped.host_bytes == 3);
  tiered.skipped.host_bytes = 4;
  CHECK(decode_code(encode(9, tiered)) == EBADMSG);

  Control c;
  c.op = 1;
  c.match = kMatchJob | kMatchRank;
  c.job = "j";
  c.rank = 0;
  CHECK(round_trip(c).match == (kMatchJob | kMatchRank));
  CHECK(round_trip(c).flags == 0);
  c.op = static_cast<uint8_t>(CommandOp::Resume);
  c.flags = kAcceptLoss;
  CHECK(round_trip(c).flags == kAcceptLoss);
  CHECK(round_trip(Command{.op = 2, .flags = kAcceptLoss}).flags == kAcceptLoss);

  ControlResult cr;
  RankResult rr;
  rr.code = EIO;
  rr.message = "bad disk";
  cr.results.push_back(rr);
  rr.code = 0;
  rr.message = "nothing is paused";
  rr.outcome = static_cast<uint8_t>(Outcome::NoOp);
  cr.results.push_back(rr);
  auto cr2 = round_trip(cr);
  REQUIRE(cr2.results.size() == 2);
  CHECK(cr2.results[0].message == "bad disk");
  CHECK(cr2.results[0].outcome == static_cast<uint8_t>(Outcome::Done));
  CHECK(cr2.results[1].outcome == static_cast<uint8_t>(Outcome::NoOp));
  CHECK(round_trip(GcResult{.removed_dirs = 2, .removed_bytes = 3}).removed_bytes == 3);
  ErrorReply e;
  e.code = EPERM;
  e.message = "no";
  CHECK(round_trip(e).code == EPERM);
  round_trip(OkReply{});
  round_trip(Gc{});

  CHECK(round_trip(IpcExport{.export_id = 0, .bytes = 2 << 20, .device = 1}).device == 1);
  CHECK(round_trip(IpcExported{.export_id = 0xabc}).export_id == 0xabc);
  CHECK(round_trip(IpcRevoke{.export_id = 5, .freed = 1}).freed == 1);
  CHECK(round_trip(IpcOpen{.export_id = 6}).export_id == 6);
  auto opened = round_trip(IpcOpened{.export_id = 7, .bytes = 4096, .device = 0, .exporter_pid = 42});
  CHECK(opened.exporter_pid == 42);
  CHECK(opened.bytes == 4096);
  CHECK(round_trip(IpcClose{.export_id = 8}).export_id == 8);
  CHECK(round_trip(IpcUsers{.export_id = 9, .importers = 2}).importers == 2);
}

TEST_CASE("IPC messages refuse ids, sizes and devices that cannot be right") {
  auto refused = [](const Message& m) {
    auto bytes = encode(1, m);
    REQUIRE(!bytes.empty());
    return decode_code(bytes) == EBADMSG;
  };
  CHECK(refused(IpcExport{.export_id = 0, .bytes = 0, .device = 0}));
  CHECK(refused(IpcExport{.export_id = 0, .bytes = kMaxIpcBytes + 1, .device = 0}));
  CHECK(refused(IpcExport{.export_id = 0, .bytes = 4096, .device = -1}));
  CHECK(refused(IpcExported{.export_id = 0}));
  CHECK(refused(IpcRevoke{.export_id = 1, .freed = 2}));
  CHECK(refused(IpcRevoke{.export_id = 0, .freed = 0}));
  CHECK(refused(IpcOpen{.export_id = 0}));
  CHECK(refused(IpcOpened{.export_id = 1, .bytes = 4096, .device = 0, .exporter_pid = -1}));
  CHECK(refused(IpcClose{.export_id = 0}));
  CHECK(refused(IpcUsers{.export_id = 0, .importers = 1}));
}

TEST_CASE("the outcome of a pause or resume: Done or NoOp, and a no-op neither failed nor moved bytes") {
  CHECK(std::string(outcome_name(Outcome::Done)) == "done");
  CHECK(std::string(outcome_name(Outcome::NoOp)) == "no-op");
  CHECK(std::string(outcome_name(static_cast<Outcome>(2))) == "unknown");

  CHECK(decode_code(encode(1, CommandDone{.outcome = kOutcomeMax + 1})) == EBADMSG);
  CHECK(decode_code(encode(1, CommandDone{.code = EIO, .outcome = static_cast<uint8_t>(Outcome::NoOp)})) == EBADMSG);
  CHECK(decode_code(encode(1, CommandDone{.bytes = 1, .outcome = static_cast<uint8_t>(Outcome::NoOp)})) == EBADMSG);
  // A no-op still took the time of finding out (it asks the daemon for the pause state).
  CHECK(decode(encode(1, CommandDone{.nanos = 5, .outcome = static_cast<uint8_t>(Outcome::NoOp)})).envelope);

  auto refused_result = [](RankResult r) {
    ControlResult cr;
    cr.results = {RankResult{}, std::move(r)};
    return decode_code(encode(1, cr)) == EBADMSG;
  };
  CHECK(refused_result(RankResult{.outcome = kOutcomeMax + 1}));
  CHECK(refused_result(RankResult{.code = ETIMEDOUT, .outcome = static_cast<uint8_t>(Outcome::NoOp)}));
  CHECK(refused_result(RankResult{.bytes = 4096, .outcome = static_cast<uint8_t>(Outcome::NoOp)}));

  // The outcome and what was skipped close each: a result's size, by which ControlResult pages,
  // counts them.
  CHECK(encode(1, CommandDone{}).size() == kHeaderSize + 4 + 8 + 8 + 2 + 1 + 32);
  CHECK(encoded_size(RankResult{}) == 8 + 4 + 8 + 2 + 4 + 8 + 8 + 2 + 1 + 32);
  CHECK(encoded_size(RankResult{.job = "j", .message = "m"}) == encoded_size(RankResult{}) + 2);
}

TEST_CASE(
    "what a pause skipped (zero, unchanged) is part of the bytes it covered, and runs of zero chunks are not empty") {
  const Skipped some{.zero_bytes = 4096, .unchanged_bytes = 8192};
  auto cd = round_trip(CommandDone{.bytes = 3 * 4096, .skipped = some});
  CHECK(cd.skipped.zero_bytes == 4096);
  CHECK(cd.skipped.unchanged_bytes == 8192);
  CHECK(decode_code(encode(1, CommandDone{.bytes = 4096, .skipped = some})) == EBADMSG);
  CHECK(decode_code(encode(1, CommandDone{.bytes = 8192, .skipped = {.zero_bytes = 8192, .unchanged_bytes = 1}})) ==
        EBADMSG);
  ControlResult cr;
  cr.results = {RankResult{.bytes = 100, .skipped = {.zero_bytes = 101}}};
  CHECK(decode_code(encode(1, cr)) == EBADMSG);
  RankStats st;
  st.last_pause_bytes = 10;
  st.last_pause_skipped.unchanged_bytes = 10;
  CHECK(round_trip(Report{st}).stats.last_pause_skipped.unchanged_bytes == 10);
  st.last_resume_skipped.zero_bytes = 1;  // of a resume of 0 bytes
  CHECK(decode_code(encode(1, Report{st})) == EBADMSG);

  Reserve r;
  r.flags = kReserveFirst;
  r.zero_runs = {{1, 0, 0}};
  CHECK(decode_code(encode(1, r)) == EBADMSG);
  r.zero_runs = {{1, ~uint64_t{0}, 2}};
  CHECK(decode_code(encode(1, r)) == EBADMSG);
  CHECK(decode_code(encode(1, Written{.unchanged = 2})) == EBADMSG);
}

TEST_CASE("CONTROL_TARGETS names the ranks a CONTROL asked: a full page fits, impossible targets are refused") {
  ControlTargets t;
  t.last = 0;
  t.ranks.push_back(RankTarget{.session_id = 4, .pid = 1234, .rank = 3, .job = "job-1"});
  t.ranks.push_back(RankTarget{.session_id = 5, .pid = 0, .rank = -1, .job = "j"});  // no pid here, no rank declared
  auto t2 = round_trip(t);
  CHECK(t2.last == 0);
  REQUIRE(t2.ranks.size() == 2);
  CHECK(t2.ranks[0].session_id == 4);
  CHECK(t2.ranks[0].pid == 1234);
  CHECK(t2.ranks[0].rank == 3);
  CHECK(t2.ranks[0].job == "job-1");
  CHECK(t2.ranks[1].rank == -1);
  CHECK(std::string(type_name(MsgType::ControlTargets)) == "CONTROL_TARGETS");

  // The daemon pages targets by count: a page of the longest ones still fits in a message.
  ControlTargets full;
  full.ranks.assign(
      kTargetsPerPage,
      RankTarget{.session_id = ~0ull, .pid = INT32_MAX, .rank = INT64_MAX, .job = std::string(kMaxNameLength, 'j')});
  CHECK(round_trip(full).ranks.size() == kTargetsPerPage);

  auto refused = [](ControlTargets m) { return decode_code(encode(1, m)) == EBADMSG; };
  CHECK(refused(ControlTargets{.last = 2}));
  CHECK(refused(ControlTargets{.ranks = {RankTarget{.pid = 1, .rank = -2, .job = "j"}}}));
  CHECK(refused(ControlTargets{.ranks = {RankTarget{.pid = -1, .rank = 0, .job = "j"}}}));
  CHECK(refused(ControlTargets{.ranks = {RankTarget{.pid = 1, .rank = 0, .job = "j\x1b[2J"}}}));
}

TEST_CASE("pause and resume flags: accept-loss is known, for a resume only, in CONTROL and COMMAND alike") {
  auto control = [](uint8_t op, uint8_t flags) {
    Control c;
    c.op = op;
    c.match = kMatchAll;
    c.flags = flags;
    return encode(1, c);
  };
  const uint8_t pause = static_cast<uint8_t>(CommandOp::Pause), resume = static_cast<uint8_t>(CommandOp::Resume);
  CHECK(decode(control(resume, kAcceptLoss)).envelope);
  CHECK(decode_code(control(pause, kAcceptLoss)) == EBADMSG);  // a pause has nothing to lose
  CHECK(decode_code(control(resume, 2)) == EBADMSG);           // unknown bits are refused, not ignored
  CHECK(decode(encode(1, Command{.op = resume, .flags = kAcceptLoss})).envelope);
  CHECK(decode_code(encode(1, Command{.op = pause, .flags = kAcceptLoss})) == EBADMSG);
  CHECK(decode_code(encode(1, Command{.op = resume, .flags = 0x80})) == EBADMSG);
  CHECK(encode(1, Command{.op = resume}).size() == kHeaderSize + 2 + 2);  // op, flags, an empty tag
  // A tag (protocol 7): only that tag's allocations; names are checked as the shim checks them.
  CHECK(round_trip(Command{.op = pause, .tag = "kv_cache"}).tag == "kv_cache");
  CHECK(decode_code(encode(1, Command{.op = pause, .tag = "kv cache"})) == EBADMSG);
  CHECK(decode_code(encode(1, Control{.op = pause, .match = kMatchAll, .tag = "a/b"})) == EBADMSG);
  CHECK(round_trip(Control{.op = pause, .match = kMatchAll, .tag = "weights"}).tag == "weights");
}

TEST_CASE("damaged ranges in a rank's stats: bounded, counted, with a known reason and a size") {
  CHECK(std::string(damage_name(Damage::ChecksumMismatch)) == "checksum-mismatch");
  CHECK(std::string(damage_name(Damage::ReadError)) == "read-error");
  CHECK(std::string(damage_name(Damage::Missing)) == "missing");
  CHECK(std::string(damage_name(static_cast<Damage>(0))) == "unknown");
  auto report = [](uint32_t count, std::vector<DamagedRange> ranges) {
    Report r;
    r.stats.damaged_allocations = count;
    r.stats.damaged = std::move(ranges);
    return encode(1, r);
  };
  const DamagedRange good{.address = 0x1000, .size = 4096, .reason = 1, .chunk = 0};
  CHECK(decode(report(9, {good, good, good, good})).envelope);               // the first 4 of 9
  CHECK(decode_code(report(9, {good, good, good, good, good})) == EBADMSG);  // more than kMaxDamagedRanges
  CHECK(decode_code(report(1, {good, good})) == EBADMSG);                    // more listed than counted
  CHECK(decode_code(report(1, {{.address = 0x1000, .size = 4096, .reason = 0}})) == EBADMSG);
  CHECK(decode_code(report(1, {{.address = 0x1000, .size = 4096, .reason = kDamageMax + 1}})) == EBADMSG);
  CHECK(decode_code(report(1, {{.address = 0x1000, .size = 0, .reason = 1}})) == EBADMSG);
  // Sessions carry the same stats, and page by size: each listed range is 25 bytes of its entry.
  SessionInfo info;
  const std::size_t bare = encoded_size(info);
  info.stats.damaged_allocations = 2;
  info.stats.damaged = {good, good};
  CHECK(encoded_size(info) == bare + 2 * (8 + 8 + 1 + 8));
  Sessions page;
  page.sessions.push_back(info);
  page.total = 1;
  CHECK(decode(encode(1, page)).envelope);
  page.sessions[0].stats.damaged_allocations = 1;  // fewer counted than listed
  CHECK(decode_code(encode(1, page)) == EBADMSG);
  // The daemon's page of 128 sessions fits a message even when each lists every range it may.
  info.job = std::string(kMaxNameLength, 'j');
  info.stats.damaged_allocations = 1000;
  info.stats.damaged.assign(kMaxDamagedRanges, good);
  CHECK(128 * encoded_size(info) + 64 <= kMaxPayload);
}

TEST_CASE("a listed session says whether it is orphaned and since when; an entry that contradicts itself is refused") {
  Sessions page;
  page.total = 2;
  SessionInfo connected;
  connected.job = "j";
  SessionInfo orphan = connected;
  orphan.orphaned = 1;
  orphan.orphaned_unix_ms = 1700000000123;
  page.sessions = {connected, orphan};
  auto back = round_trip(page);
  REQUIRE(back.sessions.size() == 2);
  CHECK(back.sessions[0].orphaned == 0);
  CHECK(back.sessions[0].orphaned_unix_ms == 0);
  CHECK(back.sessions[1].orphaned == 1);
  CHECK(back.sessions[1].orphaned_unix_ms == 1700000000123);

  auto refused = [&](SessionInfo bad) {
    Sessions one;
    one.total = 1;
    one.sessions.push_back(std::move(bad));
    return decode_code(encode(1, one)) == EBADMSG;
  };
  SessionInfo no_time = orphan;
  no_time.orphaned_unix_ms = 0;  // `tmsctl status` could not say since when
  CHECK(refused(no_time));
  SessionInfo time_only = connected;
  time_only.orphaned_unix_ms = 5;  // a connected session is nobody's orphan
  CHECK(refused(time_only));
  SessionInfo two = orphan;
  two.orphaned = 2;
  CHECK(refused(two));
}

TEST_CASE("encode refuses fields beyond their limits") {
  Hello h;
  h.role = 1;
  h.job = std::string(kMaxNameLength + 1, 'a');
  CHECK(encode(1, h).empty());
  Reserve r;
  r.blobs.resize(5000, BlobSize{1, 1});  // 80 KB of entries: over the message limit
  CHECK(encode(1, r).empty());
}

TEST_CASE("header problems are rejected with their codes") {
  auto good = encode(1, Gc{});
  REQUIRE(decode(good).envelope);

  CHECK(decode_code({}) == EPROTO);
  CHECK(decode_code(std::vector<uint8_t>(good.begin(), good.begin() + 10)) == EPROTO);

  auto bad_magic = good;
  bad_magic[0] ^= 0xFF;
  CHECK(decode_code(bad_magic) == EPROTO);

  auto bad_version = good;
  bad_version[4] = static_cast<uint8_t>(kVersion + 1);
  CHECK(decode_code(bad_version) == EPROTONOSUPPORT);

  auto bad_flags = good;
  bad_flags[12] = 1;
  CHECK(decode_code(bad_flags) == EPROTO);

  auto bad_type = good;
  bad_type[6] = 0xFF;
  CHECK(decode_code(bad_type) == EPROTO);

  auto long_length = good;
  long_length[8] = 5;  // claims payload bytes that are not there
  CHECK(decode_code(long_length) == EPROTO);

  std::vector<uint8_t> huge(kMaxMessageSize + 1, 0);
  CHECK(decode_code(huge) == EMSGSIZE);
}

TEST_CASE("payload problems are rejected: truncation, trailing bytes, lying counts, bad enums") {
  Write w;
  w.length = 4096;
  auto bytes = encode(1, w);
  auto truncated = bytes;
  truncated.pop_back();
  truncated[8] = static_cast<uint8_t>(truncated.size() - kHeaderSize);
  CHECK(decode_code(truncated) == EBADMSG);

  auto trailing = bytes;
  trailing.push_back(0);
  trailing[8] = static_cast<uint8_t>(trailing.size() - kHeaderSize);
  CHECK(decode_code(trailing) == EBADMSG);

  Reserve r;
  r.flags = kReserveLast;
  r.blobs = {{1, 1}};
  auto lying = encode(1, r);
  lying[kHeaderSize + 1] = 0xFF;  // element count far beyond the payload
  lying[kHeaderSize + 2] = 0xFF;
  CHECK(decode_code(lying) == EBADMSG);

  Hello h;
  h.role = 9;
  auto bytes_role = encode(1, h);
  CHECK(decode_code(bytes_role) == EBADMSG);

  Write zero;
  zero.length = 0;
  CHECK(decode_code(encode(1, zero)) == EBADMSG);

  Write overflow;
  overflow.length = 10;
  overflow.offset = UINT64_MAX - 2;
  CHECK(decode_code(encode(1, overflow)) == EBADMSG);

  Control all_and_job;
  all_and_job.op = 1;
  all_and_job.match = kMatchAll | kMatchJob;
  all_and_job.job = "j";
  CHECK(decode_code(encode(1, all_and_job)) == EBADMSG);

  Control empty_job;
  empty_job.op = 1;
  empty_job.match = kMatchJob;
  CHECK(decode_code(encode(1, empty_job)) == EBADMSG);

  Hello nul;
  nul.role = 1;
  nul.job = std::string("a\0b", 3);
  CHECK(decode_code(encode(1, nul)) == EBADMSG);

  Reserve zero_blob;
  zero_blob.flags = kReserveLast;
  zero_blob.blobs = {{1, 0}};
  CHECK(decode_code(encode(1, zero_blob)) == EBADMSG);
}

TEST_CASE("socket I/O passes one descriptor, closes extras and reports oversized messages") {
  int sv[2];
  REQUIRE(::socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv) == 0);
  auto bytes = encode(5, Gc{});
  int pipefd[2];
  REQUIRE(::pipe(pipefd) == 0);
  REQUIRE(send_message(sv[0], bytes, pipefd[0]) == 0);
  std::vector<uint8_t> buf;
  int got = -1;
  REQUIRE(recv_message(sv[1], buf, &got) == static_cast<long>(bytes.size()));
  REQUIRE(got >= 0);
  CHECK(buf == bytes);
  // The received descriptor is a working copy of the pipe's read end.
  REQUIRE(::write(pipefd[1], "x", 1) == 1);
  char c = 0;
  CHECK(::read(got, &c, 1) == 1);
  CHECK(c == 'x');
  ::close(got);

  // A receiver that does not want descriptors gets none leaked to it.
  REQUIRE(send_message(sv[0], bytes, pipefd[0]) == 0);
  REQUIRE(recv_message(sv[1], buf, nullptr) > 0);

  std::vector<uint8_t> big(kMaxMessageSize + 100, 1);
  REQUIRE(send_message(sv[0], big) == 0);
  CHECK(recv_message(sv[1], buf, &got) == -EMSGSIZE);

  ::close(sv[0]);
  CHECK(recv_message(sv[1], buf, &got) == 0);
  ::close(sv[1]);
  ::close(pipefd[0]);
  ::close(pipefd[1]);
}

namespace {

// Whether every write end of these pipes is closed everywhere (each read end reports a hangup).
bool all_closed(const std::vector<int>& read_ends) {
  for (int r : read_ends) {
    pollfd p{r, POLLIN, 0};
    if (::poll(&p, 1, 0) != 1 || !(p.revents & POLLHUP)) return false;
  }
  return true;
}

}  // namespace

TEST_CASE("a message with more descriptors than a receiver takes is refused as such, and every one is closed") {
  int sv[2];
  REQUIRE(::socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv) == 0);
  const auto bytes = encode(9, Gc{});  // a small message: nothing about it is too large
  for (bool want_extra : {true, false}) {
    std::vector<int> read_ends, write_ends;
    for (std::size_t i = 0; i < kMaxPassedFds + 3; ++i) {
      int p[2];
      REQUIRE(::pipe2(p, O_CLOEXEC) == 0);
      read_ends.push_back(p[0]);
      write_ends.push_back(p[1]);
    }
    REQUIRE(send_with_fds(sv[0], bytes, write_ends) == static_cast<ssize_t>(bytes.size()));
    for (int w : write_ends) ::close(w);
    std::vector<uint8_t> buf;
    std::vector<int> extra;
    int got = -1;
    CHECK(recv_message(sv[1], buf, &got, want_extra ? &extra : nullptr) == -ETOOMANYREFS);
    CHECK(got == -1);     // none is handed on as the message's descriptor
    CHECK(buf == bytes);  // the message itself came whole: its request id can be answered
    if (want_extra) {
      CHECK(extra.size() == kMaxPassedFds);  // those that arrived, for the caller to close
      for (int e : extra) ::close(e);
    }
    CHECK(all_closed(read_ends));  // those beyond, the kernel closed
    for (int r : read_ends) ::close(r);
  }
  ::close(sv[0]);
  ::close(sv[1]);
}

TEST_CASE("text fields with control characters are refused: no terminal escapes, no forged log lines") {
  CommandDone escape;
  escape.message = "done\x1b]0;owned\x07";
  CHECK(decode_code(encode(1, escape)) == EBADMSG);
  CommandDone newline;
  newline.message = "ok\n[info] forged line";
  CHECK(decode_code(encode(1, newline)) == EBADMSG);
  Hello h;
  h.role = 1;
  h.job = "job\x7f";
  CHECK(decode_code(encode(1, h)) == EBADMSG);
  ControlResult cr;
  RankResult rr;
  rr.message = "\x1b[2J";
  cr.results.push_back(rr);
  CHECK(decode_code(encode(1, cr)) == EBADMSG);
  Welcome w;
  w.version = "0.1.0\x1b[2J";  // printed by `tmsctl doctor` as it is
  CHECK(decode_code(encode(1, w)) == EBADMSG);
  CommandDone utf8;
  utf8.message = "caf\xc3\xa9 ok";
  auto d = decode(encode(1, utf8));
  CHECK(d.envelope);
}

TEST_CASE("wire_text gives a sender exactly what the decoder accepts: a multi-line reason is one line") {
  // The shim once kept '\n' and '\t' while CommandDone::check refuses them: its whole answer was
  // refused as malformed and the connection closed.
  const std::string reason = "cannot pause:\n\tdisk full\r\x1b[2J\x7f done caf\xc3\xa9";
  CHECK_FALSE(printable(reason));
  CommandDone done;
  done.code = ENOSPC;
  done.message = wire_text(reason);
  CHECK(printable(done.message));
  CHECK(done.message == "cannot pause:  disk full  [2J  done caf\xc3\xa9");
  auto d = decode(encode(1, done));
  REQUIRE(d.envelope);
  CHECK(std::get<CommandDone>(d.envelope->body).message == done.message);
  // Cut to the field's limit, never beyond it.
  CHECK(wire_text(std::string(kMaxTextLength + 10, 'x')).size() == kMaxTextLength);
  CHECK(wire_text("a\nb", 2) == "a ");
  CHECK(decode(encode(1, CommandDone{.message = wire_text(std::string(kMaxTextLength + 1, '\n'))})).envelope);
}

// ------------------------------------------------------------------------------------------------
// The HELLO client (client.h), against a scripted daemon on the other end of a socket pair.

namespace {

struct Pair {
  int client = -1, daemon = -1;
  Pair() {
    int sv[2];
    REQUIRE(::socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv) == 0);
    client = sv[0];
    daemon = sv[1];
  }
  ~Pair() {
    if (client >= 0) ::close(client);
    if (daemon >= 0) ::close(daemon);
  }
  // Receives the HELLO the client sent (it is sent before the client waits: the buffer holds it).
  Hello hello_received() {
    std::vector<uint8_t> buf;
    REQUIRE(recv_message(daemon, buf) > 0);
    auto d = decode(buf);
    REQUIRE(d.envelope);
    CHECK(d.envelope->request_id == 5);
    auto* h = std::get_if<Hello>(&d.envelope->body);
    REQUIRE(h);
    return *h;
  }
  void answer(const Message& m, int fd = -1) { REQUIRE(send_message(daemon, encode(5, m), fd) == 0); }
};

Hello shim_hello() {
  Hello h;
  h.role = static_cast<uint8_t>(Role::Shim);
  h.job = "job";
  h.rank = 3;
  return h;
}

}  // namespace

TEST_CASE("say_hello returns the WELCOME with the descriptor that came along") {
  Pair p;
  Welcome w;
  w.session_id = 9;
  w.chunk_bytes = 4096;
  w.slot_count = 2;
  w.staging_budget_bytes = 8192;
  int pipe_fds[2];
  REQUIRE(::pipe2(pipe_fds, O_CLOEXEC) == 0);
  // The answer is queued before the client asks: say_hello sends, then reads it.
  p.answer(w, pipe_fds[1]);
  ::close(pipe_fds[1]);
  HelloReply r = say_hello(p.client, shim_hello(), 1000, 5);
  INFO(r.message);
  REQUIRE(r);
  CHECK_FALSE(r.refused);
  CHECK(r.welcome.session_id == 9);
  CHECK(r.welcome.slot_count == 2);
  REQUIRE(r.fd >= 0);
  CHECK(r.sock == -1);  // the caller's socket stays the caller's
  const Hello h = p.hello_received();
  CHECK(h.job == "job");
  CHECK(h.rank == 3);
  // The reply owns the descriptor: once it goes, the pipe's last writer is closed.
  { HelloReply gone = std::move(r); }
  char c;
  CHECK(::read(pipe_fds[0], &c, 1) == 0);
  ::close(pipe_fds[0]);
}

TEST_CASE("say_hello reports a refusal with the daemon's own code and words") {
  Pair p;
  ErrorReply e;
  e.code = EDQUOT;
  e.message = "uid 1000 has 2 sessions, the limit";
  p.answer(e);
  HelloReply r = say_hello(p.client, shim_hello(), 1000, 5);
  CHECK_FALSE(r);
  CHECK(r.refused);
  CHECK(r.error == EDQUOT);
  CHECK(r.message == e.message);
  CHECK(r.fd == -1);
}

TEST_CASE("say_hello tells a closed connection, silence, garbage and a wrong answer apart") {
  SECTION("closed") {
    Pair p;
    ::shutdown(p.daemon, SHUT_WR);
    HelloReply r = say_hello(p.client, shim_hello(), 1000, 5);
    CHECK(r.error == ECONNRESET);
    CHECK_FALSE(r.refused);
  }
  SECTION("silent past the timeout") {
    Pair p;
    HelloReply r = say_hello(p.client, shim_hello(), 50, 5);
    CHECK(r.error == ETIMEDOUT);
    CHECK(r.message.find("50 ms") != std::string::npos);
  }
  SECTION("garbage") {
    Pair p;
    std::vector<uint8_t> junk(kHeaderSize, 0xAB);
    REQUIRE(send_message(p.daemon, junk) == 0);
    HelloReply r = say_hello(p.client, shim_hello(), 1000, 5);
    CHECK_FALSE(r);
    CHECK_FALSE(r.refused);
    CHECK(r.message.find("bad answer to HELLO") != std::string::npos);
  }
  SECTION("an answer other than WELCOME") {
    Pair p;
    p.answer(OkReply{});
    HelloReply r = say_hello(p.client, shim_hello(), 1000, 5);
    CHECK(r.error == EPROTO);
    CHECK(r.message.find("instead of WELCOME") != std::string::npos);
  }
}

TEST_CASE("connect_and_hello names the path it could not reach") {
  HelloReply r = connect_and_hello("/nonexistent/tmsdisk-unit-test.sock", shim_hello(), 1000);
  CHECK(r.error == ENOENT);
  CHECK_FALSE(r.refused);
  CHECK(r.message.find("/nonexistent/tmsdisk-unit-test.sock") != std::string::npos);
  CHECK(r.sock == -1);
}

TEST_CASE("connect_seqpacket gives up on a listener whose backlog is full instead of waiting forever") {
  // A daemon that is stopped (SIGSTOP) or wedged accepts no connection: once its backlog is full, a
  // plain connect would block until it accepts again.
  char dir[] = "/tmp/tmsdisk-proto-XXXXXX";
  REQUIRE(::mkdtemp(dir));
  const std::string path = std::string(dir) + "/full.sock";
  int listener = ::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
  REQUIRE(listener >= 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::strcpy(addr.sun_path, path.c_str());
  REQUIRE(::bind(listener, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0);
  REQUIRE(::listen(listener, 0) == 0);  // room for one connection that is never accepted
  std::vector<int> held;
  // Fill the backlog; the connect that finds it full answers within its limit.
  int rc = 0;
  for (int i = 0; i < 4 && rc >= 0; ++i) {
    rc = connect_seqpacket(path, 200);
    if (rc >= 0) held.push_back(rc);
  }
  CHECK(rc == -ETIMEDOUT);
  CHECK_FALSE(held.empty());
  for (int fd : held) ::close(fd);
  ::close(listener);
  ::unlink(path.c_str());
  ::rmdir(dir);
}
