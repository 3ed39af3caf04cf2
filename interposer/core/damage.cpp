// SPDX-License-Identifier: Apache-2.0
// Damaged backups in the application's terms (damage.h).
#include "damage.h"

#include <fmt/format.h>

#include <cerrno>

#include "tmsdisk/common/human.h"
#include "tmsdisk/protocol/messages.h"

namespace tmsdisk::shim {

uint8_t damage_of(const TransferJob& j) noexcept {
  if (!j.refused_offset || !j.error) return 0;
  switch (j.error->errnum()) {
    case EBADMSG: return static_cast<uint8_t>(proto::Damage::ChecksumMismatch);
    case EIO: return static_cast<uint8_t>(proto::Damage::ReadError);
    case ENODATA:
    case ENOENT:
    case EUCLEAN: return static_cast<uint8_t>(proto::Damage::Missing);
    default: return 0;
  }
}

int damage_errno(uint8_t damage) noexcept {
  switch (static_cast<proto::Damage>(damage)) {
    case proto::Damage::ChecksumMismatch: return EBADMSG;
    case proto::Damage::ReadError: return EIO;
    default: return ENODATA;
  }
}

std::string damage_text(const Allocation& a) {
  const uint64_t chunk = a.damaged_chunk.load();
  std::string why;
  switch (static_cast<proto::Damage>(a.damage.load())) {
    case proto::Damage::ChecksumMismatch: why = fmt::format("checksum mismatch in chunk {}", chunk); break;
    case proto::Damage::ReadError: why = fmt::format("read error in chunk {} (I/O error or short read)", chunk); break;
    case proto::Damage::Missing: why = fmt::format("chunk {} is missing from the backup", chunk); break;
    default: why = "damaged"; break;
  }
  return fmt::format("{:#x} ({}; {})", a.base, human_bytes(a.size), why);
}

std::string damage_list(const std::vector<std::shared_ptr<Allocation>>& list) {
  constexpr std::size_t kNamed = proto::kMaxDamagedRanges;
  std::string out;
  for (std::size_t i = 0; i < list.size() && i < kNamed; ++i) out += (i ? ", " : "") + damage_text(*list[i]);
  if (list.size() > kNamed) out += fmt::format(" and {} more (see `tmsctl status`)", list.size() - kNamed);
  return out;
}

std::string loss_note(const std::vector<std::string>& zeroed) {
  std::string note;
  if (zeroed.empty()) return note;
  note = fmt::format(
      "DATA LOST: {} allocation(s) whose backup was damaged are now zero-filled memory, as "
      "--accept-loss asked: ",
      zeroed.size());
  for (std::size_t i = 0; i < zeroed.size() && i < proto::kMaxDamagedRanges; ++i) note += (i ? ", " : "") + zeroed[i];
  if (zeroed.size() > proto::kMaxDamagedRanges)
    note += fmt::format(" and {} more", zeroed.size() - proto::kMaxDamagedRanges);
  return note;
}

}  // namespace tmsdisk::shim
