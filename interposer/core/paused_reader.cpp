// SPDX-License-Identifier: Apache-2.0
// Paused memory read without resuming it (paused_reader.h).
#include "paused_reader.h"

#include <fmt/format.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <mutex>
#include <vector>

#include "driver.h"
#include "host_copy.h"

namespace tmsdisk::shim {
Result<PausedReader::Located> PausedReader::locate(CUdeviceptr ptr, uint64_t length) const {
  if (length == 0) return make_error(EINVAL, "a read of paused memory reads at least one byte");
  std::shared_ptr<Allocation> a = registry().find(ptr);
  if (!a)
    return make_error(EINVAL, fmt::format("{:#x} is not in memory tmsdisk manages (such memory stays on the device "
                                          "through a pause: read it there)",
                                          ptr));
  const uint64_t offset = ptr - a->base;
  if (offset >= a->size || length > a->size - offset)
    return make_error(EINVAL, fmt::format("[{:#x}, {:#x}) passes the end of its allocation ({} bytes at {:#x})", ptr,
                                          ptr + length, a->size, a->base));
  const bool paused = a->state.load() == AllocState::Paused;
  // Resumed with its host copy retained: in its view, which keeps it whatever the host tier does, or
  // still in the memory the resume copied it from.
  const bool viewed = !paused && views_.has(*a);
  const bool retained = !paused && !viewed && !a->retained.empty() && a->retained_generation == tier_.generation() &&
                        tier_.memory().held();
  if (!paused && !retained && !viewed) return make_error(ENODATA, "the range is resident: the device holds its bytes");
  if (a->policy == Policy::Discard)
    return make_error(ENODATA, "the range was paused without a backup (its tag discards): there are no bytes to read");
  const uint32_t chunk = slots_.chunk_bytes();
  if (chunk == 0) return make_error(ENOTCONN, "no session with tmsdiskd");
  if (viewed) return Located{.a = a, .offset = offset, .chunk = chunk, .viewed = true};
  Located at{.a = a,
             .offset = offset,
             .chunk = chunk,
             .placement = retained ? &a->retained : &a->placement,
             .host_offset = retained ? a->retained_offset : a->host_offset,
             .retained = retained};
  const uint64_t first = offset / chunk;
  at.host_before = host_chunks(*at.placement, first);
  // The disk chunks a resume read are the daemon's no more: a retained copy is its host chunks.
  if (retained)
    for (uint64_t c = first; c * chunk < offset + length; ++c)
      if (at.place_of(c) == ChunkPlace::Disk)
        return make_error(ENODATA, "the range is resident and its retained copy holds only what the host tier held");
  return at;
}

Status PausedReader::copy(const Located& at, uint64_t length, uint8_t* dst) {
  const Allocation& a = *at.a;
  const uint64_t chunk = at.chunk;
  const uint64_t end = at.offset + length;
  const uint8_t* tier = tier_.memory().held() ? tier_.memory().base() + at.host_offset : nullptr;
  uint64_t host_index = at.host_before;
  // Disk chunks the range covers whole are read straight into dst, in runs; a chunk it covers only
  // part of (at either end) into a buffer of its own, then the part copied out.
  std::vector<TransferJob> jobs;
  struct Edge {
    std::vector<uint8_t> bytes;
    uint64_t from = 0;
    uint8_t* to = nullptr;
    uint64_t length = 0;
  };
  std::vector<Edge> edges;
  edges.reserve(2);
  // The host and zero chunks copied, and the disk chunks' pages made, while the disk chunks are read;
  // joined on return.
  HostCopies copies;
  for (uint64_t c = at.offset / chunk; c * chunk < end; ++c) {
    const uint64_t cs = c * chunk, ce = std::min(cs + chunk, uint64_t{a.size});
    const uint64_t lo = std::max(cs, at.offset), hi = std::min(ce, end);
    uint8_t* out = dst + (lo - at.offset);
    switch (at.place_of(c)) {
      case ChunkPlace::Zero: copies.add(out, nullptr, hi - lo); break;
      case ChunkPlace::Host:
        if (!tier) return make_error(EIO, "the host-tier memory that holds the range's chunks is gone");
        copies.add(out, tier + host_index * chunk + (lo - cs), hi - lo);
        ++host_index;
        break;
      case ChunkPlace::Disk: {
        CUdeviceptr into = reinterpret_cast<CUdeviceptr>(out);
        if (lo != cs || hi != ce) {
          Edge& e = edges.emplace_back(Edge{std::vector<uint8_t>(ce - cs), lo - cs, out, hi - lo});
          into = reinterpret_cast<CUdeviceptr>(e.bytes.data());
        } else {
          // Its pages made ahead of the READs, which copy each chunk in from a staging slot on the
          // control thread: there, a first touch of every page would hold up the next READ.
          copies.populate(out, ce - cs);
          if (!jobs.empty() && jobs.back().blob_offset + jobs.back().size == cs &&
              jobs.back().base + jobs.back().size == into) {
            jobs.back().size += ce - cs;
            break;
          }
        }
        TransferJob& j = jobs.emplace_back();
        j.base = into;
        j.size = ce - cs;
        j.blob = a.id;
        j.blob_offset = cs;
        j.host_memory = true;
        break;
      }
    }
  }
  copies.start();
  if (jobs.empty()) return {};
  if (!session_.connected())
    if (Status c = session_.connect(); !c) return c;
  if (std::optional<Error> failed = pipeline_.run_plain(Direction::FromStorage, jobs)) {
    for (const TransferJob& j : jobs)
      if (j.error)
        return make_error(j.error->errnum(),
                          fmt::format("bytes at {:#x} of the paused allocation: {}",
                                      j.refused_offset.value_or(j.blob_offset), j.error->describe()));
    return std::move(*failed);
  }
  for (const Edge& e : edges) std::memcpy(e.to, e.bytes.data() + e.from, e.length);
  return {};
}

Status PausedReader::read(CUdeviceptr ptr, uint64_t length, void* dst) noexcept {
  if (!dst) return make_error(EINVAL, "no memory to read paused bytes into");
  // Copied into with memcpy: device memory there would fault.
  const DriverApi& api = driver().api;
  unsigned int type = 0;
  const auto into = reinterpret_cast<CUdeviceptr>(dst);
  if (registry().find(into) ||
      (api.cuPointerGetAttribute &&
       api.cuPointerGetAttribute(&type, CU_POINTER_ATTRIBUTE_MEMORY_TYPE, into) == CUDA_SUCCESS &&
       type == CU_MEMORYTYPE_DEVICE))
    return make_error(EINVAL, "paused bytes are read into host memory, not device memory");
  try {
    return control_.call([&]() -> Status {
      std::shared_lock lock(op_lock_);
      Result<Located> at = locate(ptr, length);
      if (!at) return std::move(at).error();
      if (at->viewed)
        return views_.copy(*at->a, at->offset, length, static_cast<uint8_t*>(dst))
                   ? Status{}
                   : make_error(ENODATA,
                                "the range is resident and its retained copy holds only what the host tier held");
      return copy(*at, length, static_cast<uint8_t*>(dst));
    });
  } catch (...) {
    return make_error(ENOMEM, "out of memory reading paused memory");
  }
}

Result<const void*> PausedReader::view(CUdeviceptr ptr, uint64_t length) noexcept try {
  const void* view = nullptr;
  Status st = control_.call([&]() -> Status {
    std::shared_lock lock(op_lock_);
    Result<Located> at = locate(ptr, length);
    if (!at) return std::move(at).error();
    static const std::vector<ChunkPlace> kNone;
    const std::vector<ChunkPlace>& placement = at->viewed ? kNone : *at->placement;
    if (!at->viewed && host_chunks(placement) > 0 && !tier_.memory().held())
      return make_error(EIO, "the host-tier memory that holds the range's chunks is gone");
    Result<const uint8_t*> shown =
        views_.of(at->a, at->offset, length, tier_.memory().fd(), at->host_offset, placement, at->chunk);
    if (!shown) return std::move(shown).error();
    view = *shown;
    return {};
  });
  if (!st) return std::move(st).error();
  return view;
} catch (...) {
  return make_error(ENOMEM, "out of memory finding a view of paused memory");
}

}  // namespace tmsdisk::shim
