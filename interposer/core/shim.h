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
const char* api_version() noexcept;

}  // namespace tmsdisk::shim
