#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The package as a user gets it: builds the .deb from a build tree (`cpack -G DEB`), installs it on
# this machine with apt-get, checks what it installed (files, dependencies, the systemd units with
# systemd-analyze verify), runs a pause/resume on simcuda through the installed tmsctl, tmsdiskd and
# libtmsdisk.so only (scripts/demo.sh --installed), and removes the package again. Root only; CI runs
# it after scripts/test.sh. Stops at the first failure.
#
#   scripts/check_install.sh [BUILD_DIR]    (default: build, as scripts/test.sh leaves it)
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
step() { echo "== check_install: $*"; }
fail() { echo "== check_install: FAIL: $*" >&2; exit 1; }

[ "$(id -u)" -eq 0 ] || fail "run as root: it installs and removes the tmsdisk package"
[ -f "$build/CMakeCache.txt" ] || fail "$build is not a build tree (run scripts/test.sh first)"
if dpkg-query -W -f='${Status}' tmsdisk 2>/dev/null | grep -q "install ok installed"; then
  fail "a tmsdisk package is already installed; remove it first (apt-get remove tmsdisk)"
fi

step "building the .deb"
rm -f "$build"/tmsdisk_*.deb
(cd "$build" && cpack -G DEB >/dev/null)
debs=("$build"/tmsdisk_*.deb)
[ ${#debs[@]} -eq 1 ] && [ -f "${debs[0]}" ] || fail "cpack made no single tmsdisk_*.deb in $build"
deb=$(realpath "${debs[0]}")
dpkg-deb --info "$deb"

step "installing $deb"
trap 'step "removing the package"; apt-get remove -y --purge tmsdisk >/dev/null' EXIT
DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "$deb"

step "checking the installed files"
files=$(dpkg -L tmsdisk)
unit_dir=$(pkg-config --variable=systemdsystemunitdir systemd 2>/dev/null || echo /lib/systemd/system)
for want in /usr/bin/tmsctl /usr/sbin/tmsdiskd "$unit_dir/tmsdiskd.service" "$unit_dir/tmsdiskd.socket" \
  /etc/tmsdisk/tmsdiskd.conf /usr/share/man/man1/tmsctl.1 /usr/share/man/man8/tmsdiskd.8 /usr/include/tmsdisk.h; do
  grep -qx "$want" <<<"$files" || fail "the package does not install $want"
  [ -e "$want" ] || fail "$want is listed by dpkg but absent"
done
shim=$(grep '/libtmsdisk\.so$' <<<"$files") || fail "the package does not install libtmsdisk.so"
[ "$(command -v tmsctl)" = /usr/bin/tmsctl ] || fail "tmsctl on PATH is $(command -v tmsctl), not /usr/bin/tmsctl"
dpkg-query -W -f='${Conffiles}\n' tmsdisk | grep -q '^ */etc/tmsdisk/tmsdiskd.conf ' ||
  fail "/etc/tmsdisk/tmsdiskd.conf is not a conffile: an upgrade would overwrite an administrator's edits"
# The binaries run on any node with a C and C++ runtime: nothing else may be needed.
for bin in /usr/bin/tmsctl /usr/sbin/tmsdiskd "$shim"; do
  needed=$(readelf -d "$bin" | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p')
  extra=$(grep -Ev '^(libc|libm|libstdc\+\+|libgcc_s|ld-linux[-a-z0-9_.]*)\.so' <<<"$needed" || true)
  [ -z "$extra" ] || fail "$bin needs $extra beyond the C and C++ runtimes"
done
tmsctl --help >/dev/null
tmsdiskd --help >/dev/null
# With no --config, the installed daemon reads the file the package installed (as `sudo tmsdiskd
# --check-config` in the README's Install does), whatever prefix the build tree was configured with.
check=$(tmsdiskd --check-config 2>&1) || fail "tmsdiskd --check-config (no --config) failed: $check"
[ "$(head -n 1 <<<"$check")" = "tmsdiskd: /etc/tmsdisk/tmsdiskd.conf: ok" ] ||
  fail "tmsdiskd --check-config did not read /etc/tmsdisk/tmsdiskd.conf: $check"
# tmsctl finds the Python start-up module (PyTorch's cache) where the package put it.
startup=$(grep '/tmsdisk/python/sitecustomize\.py$' <<<"$files") || fail "the package does not install sitecustomize.py"
env_out=$(env -u PYTHONPATH TMSDISK_SOCKET=/nonexistent tmsctl env 2>&1)
grep -qx "export PYTHONPATH='$(dirname "$startup")'" <<<"$env_out" ||
  fail "tmsctl env does not put $(dirname "$startup") on PYTHONPATH: $env_out"
# Beside it, the Python package and torch_memory_saver's compatibility module (--tms-compat).
grep -q '/tmsdisk/python/tmsdisk/__init__\.py$' <<<"$files" || fail "the package does not install the Python package tmsdisk"
grep -q '/tmsdisk/python/tms-compat/torch_memory_saver/__init__\.py$' <<<"$files" ||
  fail "the package does not install torch_memory_saver's compatibility module"
env_out=$(env -u PYTHONPATH TMSDISK_SOCKET=/nonexistent tmsctl env --tms-compat 2>&1)
grep -qx "export PYTHONPATH='$(dirname "$startup")/tms-compat:$(dirname "$startup")'" <<<"$env_out" ||
  fail "tmsctl env --tms-compat does not put the compatibility module first on PYTHONPATH: $env_out"

step "verifying the installed units"
sh tests/systemd/verify_units.sh "$unit_dir"

step "pause/resume through the installed tmsctl, tmsdiskd and libtmsdisk.so"
TMSDISK_BUILD_DIR="$build" scripts/demo.sh --installed
step "PASS"
