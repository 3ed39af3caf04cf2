// SPDX-License-Identifier: Apache-2.0
// What a gated call does while the gate is closed (TMSDISK_ON_TOUCH): its own header, so that the
// settings (config.h) need not know the gate.
#pragma once

#include <cstdint>

namespace tmsdisk::shim {

enum class OnTouch : uint8_t { Wait = 0, Resume = 1, Fail = 2 };

}  // namespace tmsdisk::shim
