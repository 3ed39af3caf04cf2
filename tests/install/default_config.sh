#!/bin/sh
# SPDX-License-Identifier: Apache-2.0
# An installed tmsdiskd reads, with no --config, the file the install put beside it, and tmsctl doctor
# names that file: the build tree installed under a temp DESTDIR with a prefix other than the one it
# was configured with (the .deb does the same with /usr; scripts/check_install.sh checks that one).
#   default_config.sh BUILD_DIR    (CTest: installed_default_config)
set -eu
build=$1
fail() { echo "FAIL: $*"; exit 1; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
prefix=$tmp/prefix
DESTDIR=$tmp/stage cmake --install "$build" --prefix "$prefix" >/dev/null
installed=$tmp/stage$prefix  # a prefix other than / , /usr or /opt/*: the file goes to <prefix>/etc
conf=$installed/etc/tmsdisk/tmsdiskd.conf
daemon=$(find "$installed" -path '*/sbin/tmsdiskd')
tmsctl=$(find "$installed" -path '*/bin/tmsctl')
[ -f "$conf" ] || fail "the install put no configuration at $conf"
[ -x "$daemon" ] && [ -x "$tmsctl" ] || fail "no tmsdiskd or tmsctl installed under $installed"

out=$("$daemon" --check-config 2>&1) || fail "tmsdiskd --check-config: $out"
first=$(printf '%s\n' "$out" | head -n 1)
[ "$first" = "tmsdiskd: $conf: ok" ] || fail "tmsdiskd --check-config read another file: '$first' (want $conf)"
"$daemon" --help | grep -qF -- "$conf" || fail "tmsdiskd --help does not name $conf as --config's default"

# doctor names the file in the fix for a root that does not exist.
out=$(TMSDISK_SOCKET=$tmp/none.sock "$tmsctl" doctor --root "$tmp/no-such-root" 2>&1 || true)
printf '%s\n' "$out" | grep -qF -- "$conf" || fail "tmsctl doctor does not name $conf: $out"
echo "installed under $prefix: tmsdiskd and tmsctl doctor use $conf"
