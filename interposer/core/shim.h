// SPDX-License-Identifier: Apache-2.0
// Entry points of the core that hooks.cpp exports: one-time initialization and the C API.
#pragma once

#include <cstddef>
#include <cstdint>

#include "tmsdisk.h"

namespace tmsdisk::shim {

// First-use initialization (pthread_atfork, settings); cheap after the first call. Static
// initializers do nothing: a preloaded library's constructors run before the host is ready.
void ensure_init() noexcept;

int api_pause() noexcept;
int api_resume() noexcept;
int api_resume_accept_loss() noexcept;
int api_status(struct tmsdisk_status* status, std::size_t size) noexcept;
int api_on_pause(void (*callback)(void* arg), void* arg) noexcept;
int api_tag_push(const char* tag, int policy) noexcept;
int api_tag_pop() noexcept;
int api_pause_tag(const char* tag) noexcept;
int api_resume_tag(const char* tag) noexcept;
int api_resume_tag_accept_loss(const char* tag) noexcept;
int api_tags(struct tmsdisk_tag_info* out, std::size_t count, std::size_t size) noexcept;
const char* api_version() noexcept;
// The rank's store of named objects (api_objects.cpp).
uint64_t api_store_chunk_bytes() noexcept;
int api_store_open(const char* name, uint64_t size, uint64_t* handle) noexcept;
int api_store_remove(const char* name) noexcept;
int api_store_write(uint64_t handle, uint64_t offset, const void* src, uint64_t length, void* stream,
                    uint64_t* ticket) noexcept;
int api_store_read(uint64_t handle, uint64_t offset, void* dst, uint64_t length, void* stream,
                   uint64_t* ticket) noexcept;
int api_store_prefetch(uint64_t handle, uint64_t offset, uint64_t length) noexcept;
int api_store_wait(uint64_t ticket) noexcept;
int api_store_flush() noexcept;
int api_read_paused(const void* ptr, uint64_t length, void* dst) noexcept;
int api_paused_view(const void* ptr, uint64_t length, const void** view) noexcept;
int api_prefetch(const char* tag, int wait) noexcept;
int api_retain_host_copy(int on) noexcept;
int api_set_backup_dir(const char* path) noexcept;

}  // namespace tmsdisk::shim
