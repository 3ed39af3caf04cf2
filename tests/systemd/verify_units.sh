#!/bin/sh
# SPDX-License-Identifier: Apache-2.0
# Checks systemd/tmsdiskd.{socket,service} with systemd-analyze verify, pointing ExecStart at the
# built daemon. Exits 77 (skipped) where systemd-analyze is not installed.
set -eu
src=$1
daemon=$2
command -v systemd-analyze >/dev/null 2>&1 || { echo "SKIPPED: systemd-analyze not installed"; exit 77; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cp "$src/tmsdiskd.socket" "$tmp/"
sed "s|^ExecStart=/usr/local/sbin/tmsdiskd|ExecStart=$daemon|" "$src/tmsdiskd.service" >"$tmp/tmsdiskd.service"
out=$(cd "$tmp" && systemd-analyze verify --man=no ./tmsdiskd.socket ./tmsdiskd.service 2>&1) || { echo "$out"; exit 1; }
# verify exits 0 on some warnings; treat any message about our units as a failure.
if printf '%s\n' "$out" | grep -q 'tmsdiskd\.'; then echo "$out"; exit 1; fi
echo "units verified"
