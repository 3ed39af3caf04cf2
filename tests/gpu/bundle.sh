#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Builds the binaries the GPU checks need (Release, stripped) into DIR, ready to carry to a GPU node:
# they depend only on libc and libstdc++, so they run there as built here.
#   tests/gpu/bundle.sh DIR
set -euo pipefail
cd "$(dirname "$0")/../.."
dest=$1
cmake -S . -B build-release -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build-release --target tmsdiskd tmsctl tmsdisk cuda_ipc cuda_pattern cuda_probe tmsdisk-shim-bench tmsdisk-session-bench \
  tmsdisk-rawdisk
mkdir -p "$dest"
cp build-release/daemon/tmsdiskd build-release/tools/tmsctl/tmsctl build-release/interposer/libtmsdisk.so \
   build-release/tests/e2e/cuda_ipc build-release/tests/e2e/cuda_pattern build-release/tests/e2e/cuda_probe \
   build-release/bench/tmsdisk-shim-bench build-release/bench/tmsdisk-session-bench build-release/bench/tmsdisk-rawdisk \
   "$dest/"
find "$dest" -maxdepth 1 -type f -exec strip {} +  # the binaries, not python/ (a directory)
# The Python start-up module (PyTorch's cache), the tmsdisk package and torch_memory_saver's
# compatibility module (tms-compat/), where tmsctl looks for them in a flat bundle.
mkdir -p "$dest/python"
cp -r build-release/python/. "$dest/python/"
ls -la "$dest"
