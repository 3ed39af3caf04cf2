// SPDX-License-Identifier: Apache-2.0
// Manifest encoding and decoding (see manifest.h).
#include "manifest.h"

#include <fmt/format.h>
#include <xxhash.h>

namespace tmsdisk::storage {

namespace {

void put(std::string& out, uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

class Reader {
 public:
  explicit Reader(std::string_view bytes) : b_(bytes) {}
  bool get(uint64_t& v, int bytes) {
    if (b_.size() - pos_ < static_cast<std::size_t>(bytes)) return false;
    v = 0;
    for (int i = 0; i < bytes; ++i) v |= static_cast<uint64_t>(static_cast<uint8_t>(b_[pos_ + i])) << (8 * i);
    pos_ += static_cast<std::size_t>(bytes);
    return true;
  }
  std::size_t left() const { return b_.size() - pos_; }
  uint8_t byte_at(std::size_t i) const { return static_cast<uint8_t>(b_[pos_ + i]); }
  void skip(std::size_t n) { pos_ += n; }

 private:
  std::string_view b_;
  std::size_t pos_ = 0;
};

uint64_t chunk_count(uint64_t size, uint32_t chunk) {
  return size == 0 ? 0 : (size - 1) / chunk + 1;
}

// Version 2: C state bytes, then C 128-bit checksums.
bool read_sums(Reader& r, uint64_t chunks, ManifestBlob& b) {
  if (chunks > r.left() / 17) return false;
  b.states.resize(chunks);
  for (auto& st : b.states) {
    uint64_t v = 0;
    r.get(v, 1);
    if (v > kChunkStateMax) return false;
    st = static_cast<ChunkState>(v);
  }
  b.sums.resize(chunks);
  for (auto& sum : b.sums) {
    r.get(sum.low, 8);
    r.get(sum.high, 8);
  }
  return true;
}

// Version 1: C XXH3-64 checksums, then the bitmap of those recorded. They stay XXH3-64 (Data64):
// the bytes they vouch for were never hashed otherwise.
bool read_sums_v1(Reader& r, uint64_t chunks, ManifestBlob& b) {
  const uint64_t bitmap = (chunks + 7) / 8;
  if (chunks > r.left() / 8 || chunks * 8 + bitmap > r.left()) return false;
  b.sums.resize(chunks);
  for (auto& sum : b.sums) r.get(sum.low, 8);
  b.states.resize(chunks);
  for (uint64_t i = 0; i < chunks; ++i)
    b.states[i] = (r.byte_at(i / 8) >> (i % 8)) & 1 ? ChunkState::Data64 : ChunkState::Missing;
  r.skip(bitmap);
  return true;
}

}  // namespace

std::string encode_manifest(const Manifest& m) {
  std::string out;
  put(out, kManifestMagic, 8);
  put(out, kManifestVersion, 4);
  put(out, m.state, 4);
  put(out, m.generation, 8);
  put(out, m.chunk_bytes, 4);
  put(out, m.data_end.size(), 4);
  for (uint64_t end : m.data_end) put(out, end, 8);
  for (std::size_t r = 0; r < m.data_end.size(); ++r) {
    const std::optional<detail::FileIdentity> id = r < m.data_files.size() ? m.data_files[r] : std::nullopt;
    const detail::FileIdentity f = id.value_or(detail::FileIdentity{});
    put(out, id ? 1 : 0, 8);
    for (uint64_t v : {f.dev, f.ino, f.size, static_cast<uint64_t>(f.mtime_sec), static_cast<uint64_t>(f.mtime_nsec),
                       static_cast<uint64_t>(f.ctime_sec), static_cast<uint64_t>(f.ctime_nsec)})
      put(out, v, 8);
  }
  put(out, m.blobs.size(), 8);
  for (const auto& b : m.blobs) {
    put(out, b.id, 8);
    put(out, b.size, 8);
    for (const auto& e : b.extents) {
      put(out, e.offset, 8);
      put(out, e.length, 8);
    }
    for (ChunkState st : b.states) put(out, static_cast<uint8_t>(st), 1);
    for (const Checksum128& sum : b.sums) {
      put(out, sum.low, 8);
      put(out, sum.high, 8);
    }
  }
  put(out, XXH3_64bits(out.data(), out.size()), 8);
  return out;
}

std::optional<Manifest> decode_manifest(std::string_view bytes, std::string& why) {
  if (bytes.size() < 8 + 8) {
    why = "too short";
    return std::nullopt;
  }
  Reader head(bytes);
  uint64_t magic = 0;
  head.get(magic, 8);
  if (magic != kManifestMagic) {
    why = "bad magic: not a tmsdisk manifest";
    return std::nullopt;
  }
  std::string_view body = bytes.substr(0, bytes.size() - 8);
  Reader tail(bytes.substr(bytes.size() - 8));
  uint64_t stored = 0;
  tail.get(stored, 8);
  if (XXH3_64bits(body.data(), body.size()) != stored) {
    why = "checksum mismatch: the file is torn or was modified";
    return std::nullopt;
  }

  Reader r(body);
  Manifest m;
  uint64_t v = 0, version = 0, state = 0, chunk = 0, nroots = 0, nblobs = 0;
  r.get(v, 8);
  if (!r.get(version, 4) || version < kManifestVersion1 || version > kManifestVersion) {
    why = fmt::format("unsupported format version {} (this daemon reads {} to {})", version, kManifestVersion1,
                      kManifestVersion);
    return std::nullopt;
  }
  m.version = static_cast<uint32_t>(version);
  if (!r.get(state, 4) || (state != kManifestPaused && state != kManifestResumed && state != kManifestWriting)) {
    why = "invalid state";
    return std::nullopt;
  }
  m.state = static_cast<uint32_t>(state);
  if (!r.get(m.generation, 8) || !r.get(chunk, 4) || chunk == 0 || chunk % 4096 != 0) {
    why = "invalid chunk size";
    return std::nullopt;
  }
  m.chunk_bytes = static_cast<uint32_t>(chunk);
  if (!r.get(nroots, 4) || nroots == 0 || nroots > kManifestMaxRoots || r.left() / 8 < nroots) {
    why = "invalid root count";
    return std::nullopt;
  }
  m.data_end.resize(nroots);
  for (auto& end : m.data_end) {
    r.get(end, 8);
    if (end % 4096 != 0) {
      why = "misaligned data file end";
      return std::nullopt;
    }
  }
  if (m.version >= 3) {
    if (r.left() / 64 < nroots) {
      why = "truncated data file identities";
      return std::nullopt;
    }
    m.data_files.resize(nroots);
    for (auto& id : m.data_files) {
      uint64_t known = 0;
      detail::FileIdentity f;
      uint64_t t[4] = {};
      r.get(known, 8);
      r.get(f.dev, 8);
      r.get(f.ino, 8);
      r.get(f.size, 8);
      for (auto& v : t) r.get(v, 8);
      if (known > 1) {
        why = "invalid data file identity";
        return std::nullopt;
      }
      f.mtime_sec = static_cast<int64_t>(t[0]);
      f.mtime_nsec = static_cast<int64_t>(t[1]);
      f.ctime_sec = static_cast<int64_t>(t[2]);
      f.ctime_nsec = static_cast<int64_t>(t[3]);
      if (known) id = f;
    }
  }
  const uint64_t per_blob_min = 16 + 16 * nroots;
  if (!r.get(nblobs, 8) || nblobs > r.left() / per_blob_min) {
    why = "invalid blob count";
    return std::nullopt;
  }
  m.blobs.resize(nblobs);
  for (auto& b : m.blobs) {
    if (r.left() < per_blob_min) {
      why = "truncated blob list";
      return std::nullopt;
    }
    r.get(b.id, 8);
    r.get(b.size, 8);
    b.extents.resize(nroots);
    for (auto& e : b.extents) {
      r.get(e.offset, 8);
      r.get(e.length, 8);
      if (e.offset % 4096 != 0 || e.length % 4096 != 0) {
        why = "misaligned extent";
        return std::nullopt;
      }
    }
    const uint64_t chunks = chunk_count(b.size, m.chunk_bytes);
    const bool read = m.version == kManifestVersion1 ? read_sums_v1(r, chunks, b) : read_sums(r, chunks, b);
    if (!read) {
      why = fmt::format("truncated or invalid checksums of blob {}", b.id);
      return std::nullopt;
    }
  }
  if (r.left() != 0) {
    why = "trailing bytes";
    return std::nullopt;
  }
  return m;
}

}  // namespace tmsdisk::storage
