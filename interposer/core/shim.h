// SPDX-License-Identifier: Apache-2.0
// Entry points of the core that hooks.cpp exports: one-time initialization and the C API.
#pragma once

#include <cstddef>

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

}  // namespace tmsdisk::shim
