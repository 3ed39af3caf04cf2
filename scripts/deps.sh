#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Installs the Debian/Ubuntu packages tmsdisk builds and tests with (skipped when all are present).
set -euo pipefail
packages=(cmake ninja-build g++ pkg-config liburing-dev libspdlog-dev libfmt-dev libcli11-dev catch2
          libxxhash-dev libtomlplusplus-dev nlohmann-json3-dev e2fsprogs util-linux systemd clang libclang-rt-14-dev clang-format dpkg-dev file python3 python3-torch)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
[ ${#missing[@]} -eq 0 ] && exit 0
if [ "$(id -u)" -ne 0 ]; then
  echo "missing packages: ${missing[*]}; run: sudo apt-get install -y ${missing[*]}" >&2
  exit 1
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update
apt-get install -y --no-install-recommends "${missing[@]}"
