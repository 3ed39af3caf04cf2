// SPDX-License-Identifier: Apache-2.0
// Everything a test or benchmark that talks to a real tmsdiskd needs: temp directories, a daemon
// child process with readiness notification, a client that plays the shim's role, the test pattern,
// skip() and MiB. The pieces have their own headers; this one is for programs that use most of them.
#pragma once

#include "daemon_process.h"
#include "pattern.h"
#include "shim_client.h"
#include "sizes.h"
#include "skip.h"
#include "temp_dir.h"
