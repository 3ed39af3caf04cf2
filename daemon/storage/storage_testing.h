// SPDX-License-Identifier: Apache-2.0
// What only tests use of the storage component: fault injection that production code never sets,
// and looks at a RankStore that the daemon never needs.
#pragma once

#include <algorithm>
#include <cerrno>
#include <cstddef>
#include <cstdint>

#include "storage.h"

namespace tmsdisk::storage::testing {

// Called before every fallocate(2) that reserve() issues, with the root index and the range. Returning
// a positive errno makes that fallocate fail with it (without calling the kernel); 0 lets it run.
// Lets tests drive the all-or-nothing rollback at any point, on any filesystem.
using FallocateHook = int (*)(std::size_t root, uint64_t offset, uint64_t length);

// Installs `hook` (nullptr removes it) and returns the previous one.
FallocateHook set_fallocate_hook(FallocateHook hook) noexcept;

// Called before every truncation and every punched piece that gives a reservation's unused space
// back (background_punch.h), on the thread that does it, with the root index and the range (a
// truncation: the new size and the bytes cut off). A test that blocks in it holds that work back.
using PunchHook = void (*)(std::size_t root, uint64_t offset, uint64_t length);
PunchHook set_punch_hook(PunchHook hook) noexcept;

// Called on a store's thread when it is about to wait for space still being given back (its next
// reservation, wait_for_punches(), removal, destruction), before it waits.
using PunchWaitHook = void (*)();
PunchWaitHook set_punch_wait_hook(PunchWaitHook hook) noexcept;

// Returns once the space the last reservation of `store` gives back is given back (at once if it
// is): the files' blocks as they will be. The store's next reservation, its removal and its
// destruction wait for it themselves.
void wait_for_punches(RankStore& store) noexcept;

// Chunks of the reserved set that no checksum vouches for yet: those a READ is refused for want of
// one (open_read(): ENODATA, never written in this generation, or EUCLEAN, its record lost). Zero
// and host-tier chunks are recorded at the reservation.
inline uint64_t missing_chunks(const RankStore& store) {
  uint64_t missing = 0;
  const uint32_t chunk = store.chunk_bytes();
  for (const BlobSize& b : store.blobs()) {
    for (uint64_t off = 0; off < b.size; off += chunk) {
      auto ticket = store.open_read(b.id, off, static_cast<uint32_t>(std::min<uint64_t>(chunk, b.size - off)));
      if (!ticket && (ticket.error().errnum() == ENODATA || ticket.error().errnum() == EUCLEAN)) ++missing;
    }
  }
  return missing;
}

}  // namespace tmsdisk::storage::testing
