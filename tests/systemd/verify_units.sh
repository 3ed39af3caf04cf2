#!/bin/sh
# SPDX-License-Identifier: Apache-2.0
# Checks installed systemd units: systemd-analyze verify passes, and the service names what was
# installed beside it (the daemon ExecStart= runs, the configuration it passes with --config).
#   verify_units.sh UNIT_DIR [DESTDIR]  units in DESTDIR/UNIT_DIR, installed for DESTDIR (default /)
#   verify_units.sh --build BUILD_DIR   installs BUILD_DIR under a temp DESTDIR with the prefixes /usr
#                                       and /usr/local, and checks each (CTest: systemd_units)
# Exits 77 (skipped) where systemd-analyze is not installed. It needs no running systemd.
set -eu
command -v systemd-analyze >/dev/null 2>&1 || { echo "SKIPPED: systemd-analyze not installed"; exit 77; }
fail() { echo "FAIL: $*"; exit 1; }

if [ "$1" = --build ]; then
  build=$2
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  for prefix in /usr /usr/local; do
    DESTDIR="$tmp$prefix-install" cmake --install "$build" --prefix "$prefix" >/dev/null
    service=$(find "$tmp$prefix-install" -name tmsdiskd.service)
    [ -n "$service" ] || fail "no tmsdiskd.service installed under the prefix $prefix"
    unit_dir=$(dirname "${service#"$tmp$prefix-install"}")
    sh "$0" "$unit_dir" "$tmp$prefix-install"
  done
  exit 0
fi

unit_dir=$1
root=${2:-}
[ -f "$root$unit_dir/tmsdiskd.service" ] && [ -f "$root$unit_dir/tmsdiskd.socket" ] || fail "no units in $root$unit_dir"
exec_start=$(sed -n 's/^ExecStart=//p' "$root$unit_dir/tmsdiskd.service")
daemon=${exec_start%% *}
config=$(printf '%s\n' "$exec_start" | sed -n 's/.*--config \([^ ]*\).*/\1/p')
[ -x "$root$daemon" ] || fail "ExecStart= names $daemon, which is not installed"
[ -n "$config" ] && [ -f "$root$config" ] || fail "ExecStart= passes --config '$config', which is not installed"

tmp_units=$(mktemp -d)
trap 'rm -rf "$tmp_units"' EXIT
cp "$root$unit_dir/tmsdiskd.socket" "$tmp_units/"
# Under a DESTDIR the paths exist only below it.
sed "s|^ExecStart=$daemon --config $config|ExecStart=$root$daemon --config $root$config|" \
  "$root$unit_dir/tmsdiskd.service" >"$tmp_units/tmsdiskd.service"
out=$(cd "$tmp_units" && systemd-analyze verify --man=no ./tmsdiskd.socket ./tmsdiskd.service 2>&1) || { echo "$out"; exit 1; }
# verify exits 0 on some warnings; treat any message about our units as a failure.
if printf '%s\n' "$out" | grep -q 'tmsdiskd\.'; then echo "$out"; exit 1; fi
echo "units in $root$unit_dir verified: ExecStart=$exec_start"
