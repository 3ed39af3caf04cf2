// SPDX-License-Identifier: Apache-2.0
// Damaged backups in the application's terms: what the daemon's refusal of a chunk says of an
// allocation's backup, the errno a resume that left it returns, and the words for messages and logs.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "registry.h"
#include "transfer.h"

namespace tmsdisk::shim {

// What the daemon's refusal of a chunk says of the allocation's backup: damaged (a proto::Damage: its
// data cannot be read back as written), or not (0: a failure of ours or of the transfer, which a retry
// may fix).
uint8_t damage_of(const TransferJob& j) noexcept;
// The errno a resume that left `damage` (a proto::Damage) returns: what the daemon said of the chunk.
int damage_errno(uint8_t damage) noexcept;
// The damaged allocation `a` in the application's terms: "0x7f2a40000000 (6.0 MiB; checksum
// mismatch in chunk 1)".
std::string damage_text(const Allocation& a);
// At most a few of `list`, then how many more: a message must stay readable with a thousand of them.
std::string damage_list(const std::vector<std::shared_ptr<Allocation>>& list);
// What a resume with --accept-loss says of the allocations it replaced with zero-filled memory
// (`zeroed`: each one's damage_text); empty when there are none.
std::string loss_note(const std::vector<std::string>& zeroed);

// What the user can do about a damaged backup.
inline constexpr const char* kDamageAdvice =
    "repair the file and run `tmsctl resume` again (the C API: tmsdisk_resume), or `tmsctl resume --accept-loss` "
    "(tmsdisk_resume_accept_loss) to replace it with zero-filled memory";

}  // namespace tmsdisk::shim
