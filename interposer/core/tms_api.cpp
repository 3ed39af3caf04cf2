// SPDX-License-Identifier: Apache-2.0
// torch_memory_saver's C entry points over the shim (tms_entry_points.h). The region state is the
// calling thread's (tags.h, TmsRegion), as in TMS; pause and resume act on the tags TMS regions gave
// allocations; the host copy is what the paused reader can show without a copy (of resumed memory,
// its retained copy). What tmsdisk does not do (another backup directory, a memory margin) is logged
// and ignored: these functions return nothing that could say so, and TMS's own would stop the process.
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <string>
#include <system_error>

#include "config.h"
#include "engine.h"
#include "log.h"
#include "shim.h"
#include "tags.h"
#include "tms_entry_points.h"

namespace tmsdisk::shim::tms {
namespace {

// tms_get_current_tag's answer: the thread's own copy, valid until the thread's next call.
thread_local char tls_tag_name[kMaxTagLength + 1];

// Pauses (`pausing`) or resumes `tag`, or with none every tag a TMS region gave memory: 0 or -errno.
int run_tags(bool pausing, const char* tag) noexcept {
  ensure_init();
  Engine* e = Engine::instance();
  if (!e) return -ENOMEM;
  const proto::CommandOp op = pausing ? proto::CommandOp::Pause : proto::CommandOp::Resume;
  try {
    if (tag) {
      const Status st = e->run(op, 0, tag);
      return st ? 0 : -st.error().errnum();
    }
    // TMS pauses the memory of its regions only; memory outside them stays resident, as with TMS.
    int rc = 0;
    for (TagId id : tms_tags_used()) {
      const Status st = e->run(op, 0, tag_name(id));
      if (!st && rc == 0) rc = -st.error().errnum();
    }
    return rc;
  } catch (...) {
    return -ENOMEM;
  }
}

}  // namespace

void tms_set_interesting_region(bool interesting) noexcept {
  tms_region().interesting = interesting;
}
bool tms_get_interesting_region() noexcept {
  return tms_region().interesting;
}

void tms_set_current_tag(const char* tag) noexcept {
  TagId id = kUntagged;
  if (const int rc = intern_tag(tag, &id); rc != 0) {
    TMS_WARN("tms_set_current_tag(%s): %s; the thread's tag stays as it was", tag ? tag : "NULL",
             rc == -EINVAL ? "a tag name is 1 to 63 of A-Z a-z 0-9 _ . -" : "too many distinct tags");
    return;
  }
  tms_region().tag = id;
  tms_region().tag_set = true;
}
const char* tms_get_current_tag() noexcept {
  const TmsRegion& r = tms_region();
  const std::string name = r.tag_set ? tag_name(r.tag) : std::string("default");
  std::memset(tls_tag_name, 0, sizeof(tls_tag_name));
  name.copy(tls_tag_name, kMaxTagLength);
  return tls_tag_name;
}

void tms_set_enable_cpu_backup(bool enable) noexcept {
  tms_region().cpu_backup = enable;
}
bool tms_get_enable_cpu_backup() noexcept {
  return tms_region().cpu_backup;
}

void tms_set_cpu_backup_backend(const char* backend) noexcept {
  if (backend && std::strcmp(backend, "mmap") == 0)
    tms_region().mmap_backend = true;
  else if (backend && std::strcmp(backend, "pinned") == 0)
    tms_region().mmap_backend = false;
  else
    TMS_WARN("tms_set_cpu_backup_backend(%s): not \"mmap\" or \"pinned\"; ignored", backend ? backend : "NULL");
}
const char* tms_get_cpu_backup_backend() noexcept {
  return tms_region().mmap_backend ? "mmap" : "pinned";
}

void tms_set_enable_disk_backup(bool enable) noexcept {
  tms_region().disk_backup = enable;
}
bool tms_get_enable_disk_backup() noexcept {
  return tms_region().disk_backup;
}

// As TMS, the directory is made when missing (its own part 0700: it must be writable by no one else).
void tms_set_disk_backup_dir(const char* dir) noexcept {
  try {
    if (!dir || !*dir) {
      TMS_WARN("tms_set_disk_backup_dir(NULL): ignored");
      return;
    }
    std::error_code ec;
    if (std::filesystem::create_directories(dir, ec) && !ec)
      std::filesystem::permissions(dir, std::filesystem::perms::owner_all, ec);
    if (const int rc = api_set_backup_dir(dir); rc != 0)
      TMS_WARN("tms_set_disk_backup_dir(%s): refused (%s); this rank's files stay where they were", dir,
               std::strerror(-rc));
  } catch (...) {
  }
}

void set_memory_margin_bytes(uint64_t bytes) noexcept {
  if (bytes)
    TMS_WARN("set_memory_margin_bytes(%llu): ignored; a resume takes the memory it needs or fails, it keeps no margin",
             static_cast<unsigned long long>(bytes));
}

void tms_set_retain_cpu_backup(bool retain) noexcept {
  ensure_init();
  if (Engine* e = Engine::instance()) e->set_retain_host_copy(retain);
}
bool tms_get_retain_cpu_backup() noexcept {
  Engine* e = Engine::existing();
  return e && e->retain_host_copy();
}

int tms_pause(const char* tag) noexcept {
  return run_tags(true, tag);
}
int tms_resume(const char* tag) noexcept {
  return run_tags(false, tag);
}

uint8_t* tms_get_cpu_backup_pointer(const uint8_t* gpu_ptr, uint64_t size) noexcept {
  // TMS's host copy, while paused or retained, at the address TMS would keep it at (host_view.h); none for
  // resident memory nor, as in TMS, for memory backed up to disk: here, a range with a chunk on disk.
  ensure_init();
  Engine* e = Engine::instance();
  if (!e) return nullptr;
  Result<const void*> view = e->paused_reader().view(reinterpret_cast<CUdeviceptr>(gpu_ptr), size);
  // TMS hands its copy out writable (writing into it changes what its resume brings back); ours is read-only.
  return view ? static_cast<uint8_t*>(const_cast<void*>(*view)) : nullptr;
}

}  // namespace tmsdisk::shim::tms
