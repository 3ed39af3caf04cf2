#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Sets up and runs every test: installs dependencies, builds with -Werror, runs CTest; then builds
# the daemon, tools and tests with ASan+UBSan and runs them again; then fuzzes the protocol decoder
# for a bounded time; last, checks that the C/C++ files follow .clang-format (scripts/format.sh fixes
# them). GPU tests are not part of this (see tests/gpu/).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/deps.sh
jobs=$(nproc)

# build/ is this script's, with its build type set at every run: a tree configured otherwise before
# (an older scripts/demo.sh made build/ Release) must not carry its type into the -Werror build.
# scripts/demo.sh builds in build-demo/.
cmake -S . -B build -G Ninja -DTMSDISK_WERROR=ON -DCMAKE_BUILD_TYPE=RelWithDebInfo
cmake --build build -j"$jobs"
ctest --test-dir build --output-on-failure -j"$jobs"

# -O1 and line tables only (-g1), as sanitizer builds usually are: the reports keep their file:line
# frames, and the build on CI's two cores takes far less than at -O2 -g.
cmake -S . -B build-asan -G Ninja -DTMSDISK_WERROR=ON -DTMSDISK_SANITIZE=ON -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -g1 -DNDEBUG" -DCMAKE_C_FLAGS_RELWITHDEBINFO="-O1 -g1 -DNDEBUG"
cmake --build build-asan -j"$jobs"
ctest --test-dir build-asan --output-on-failure -j"$jobs"

CC=clang CXX=clang++ cmake -S . -B build-fuzz -G Ninja -DTMSDISK_BUILD_FUZZ=ON -DTMSDISK_FUZZ_SECONDS="${TMSDISK_FUZZ_SECONDS:-60}"
cmake --build build-fuzz -j"$jobs" --target fuzz_decode
ctest --test-dir build-fuzz --output-on-failure -R fuzz_decode

scripts/format.sh --check
