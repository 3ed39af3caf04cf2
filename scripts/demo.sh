#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The main job, end to end: build, start a daemon on a temp directory, launch a CUDA program with
# `tmsctl run`, fill its device memory, `tmsctl pause` it, show the memory is free for another
# process, `tmsctl resume` it and check every byte at the same addresses.
# Uses the real driver when a GPU is present, otherwise the simulated one (and says so).
#
#   scripts/demo.sh [--installed] [GIB]
#   GIB: device memory the program fills (default 4 on a GPU, 0.25 simulated)
#   --installed: tmsctl, tmsdiskd and libtmsdisk.so as installed on this machine (the .deb, `cmake
#     --install`): tmsctl from PATH, and `tmsctl run` finds the library and starts a private tmsdiskd
#     beside itself; fails if any of the three comes from this tree. Only the CUDA test programs and
#     simcuda come from the build tree. scripts/check_install.sh runs this.
#
# The build tree is $TMSDISK_BUILD_DIR, default build-demo: the demo's own, Release and without
# -Werror, set at every run. scripts/test.sh keeps build/ (with -Werror) and the README's Building
# step uses build/ too, so the two scripts run in either order on one clone, and neither changes the
# other's build type or flags (which would also rebuild everything at each switch).
set -euo pipefail
cd "$(dirname "$0")/.."
installed=0
if [ "${1:-}" = --installed ]; then
  installed=1
  shift
fi
build=${TMSDISK_BUILD_DIR:-build-demo}
programs=(cuda_pattern cuda_probe simcuda)
configure=(cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DTMSDISK_WERROR=OFF)
if [ "$installed" = 1 ]; then
  # A tree that exists is used as it is (check_install.sh passes the one scripts/test.sh built).
  [ -f "$build/CMakeCache.txt" ] || { scripts/deps.sh; "${configure[@]}" >/dev/null; }
  cmake --build "$build" --target "${programs[@]}"
  tmsctl=$(command -v tmsctl) || { echo "--installed: no tmsctl on PATH"; exit 1; }
  unset TMSDISK_DAEMON TMSDISK_LIBRARY TMSDISK_SOCKET
else
  scripts/deps.sh
  "${configure[@]}" >/dev/null
  cmake --build "$build" --target tmsdiskd tmsctl tmsdisk "${programs[@]}"
  tmsctl=$build/tools/tmsctl/tmsctl
fi
build=$(cd "$build" && pwd)  # absolute: LD_LIBRARY_PATH

work=$(mktemp -d "${TMSDISK_DEMO_DIR:-/var/tmp}/tmsdisk-demo.XXXXXX")
daemon_pid=""
cleanup() {
  if [ -n "$daemon_pid" ]; then
    kill "$daemon_pid" 2>/dev/null || true
    # The private daemon (--installed) is not our child: wait for it by polling.
    for _ in $(seq 100); do kill -0 "$daemon_pid" 2>/dev/null || break; sleep 0.1; done
    wait "$daemon_pid" 2>/dev/null || true
  fi
  rm -rf "$work"
}
trap cleanup EXIT

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  mode="GPU ($(nvidia-smi --query-gpu=name --format=csv,noheader | head -1), real driver)"
  gib=${1:-4}
else
  mode="SIMULATED DRIVER (no GPU found: simcuda, host memory with real virtual-memory semantics)"
  gib=${1:-0.25}
  export LD_LIBRARY_PATH="$build/simcuda${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  export SIMCUDA_STATE="$work/simcuda-state" SIMCUDA_DEVICE_MEM_MB=512
fi
bytes=$(awk -v g="$gib" 'BEGIN { printf "%d", g * 1073741824 }')
echo "== tmsdisk demo: $mode; $gib GiB"

mkdir -p "$work/root"
if [ "$installed" = 1 ]; then
  # No daemon yet: `tmsctl run` starts this user's private one, here rather than in the user's own
  # runtime directory, so that no other daemon of this machine can answer.
  mkdir -m 0700 "$work/run"
  export XDG_RUNTIME_DIR="$work/run" TMS_DISK_BACKUP_DIR="$work/root"
else
  export TMSDISK_SOCKET="$work/tmsdiskd.sock"
  "$build/daemon/tmsdiskd" --root "$work/root" --socket "$TMSDISK_SOCKET" --log-level warn &
  daemon_pid=$!
  for _ in $(seq 100); do "$tmsctl" status >/dev/null 2>&1 && break; sleep 0.1; done
  "$tmsctl" status >/dev/null
fi

# The program reads commands on stdin and answers one line each (see tests/e2e/cuda_pattern.cpp).
coproc PROG { exec "$tmsctl" run --job demo -- "$build/tests/e2e/cuda_pattern"; }
prog_pid=$PROG_PID
ask() { echo "$1" >&"${PROG[1]}"; read -r answer <&"${PROG[0]}"; echo "$answer"; }
read -r ready <&"${PROG[0]}"
[ "$ready" = ready ] || { echo "program did not start: $ready"; exit 1; }

if [ "$installed" = 1 ]; then
  # Which library the program preloaded, and which daemon holds the private socket's lock.
  shim=$(awk '$6 ~ /\/libtmsdisk\.so$/ { print $6; exit }' "/proc/$prog_pid/maps")
  lock="$work/run/tmsdisk/tmsdiskd.sock.lock"
  for fd in /proc/[0-9]*/fd/*; do
    if [ "$(readlink "$fd" 2>/dev/null)" = "$lock" ]; then
      daemon_pid=${fd#/proc/}
      daemon_pid=${daemon_pid%%/*}
      break
    fi
  done
  daemon=$([ -n "$daemon_pid" ] && readlink "/proc/$daemon_pid/exe" || true)
  echo "installed: $tmsctl, shim ${shim:-none}, daemon ${daemon:-none}"
  for f in "$tmsctl" "$shim" "$daemon"; do
    case "$f" in
      "" | "$PWD"/*) echo "== FAIL: tmsctl, libtmsdisk.so and tmsdiskd must all be installed ones"; exit 1 ;;
    esac
  done
fi

alloc=$(ask "alloc 1 $bytes direct")
echo "program allocated and filled $gib GiB at ${alloc##* }"
free_before=$("$build/tests/e2e/cuda_probe" free)

"$tmsctl" pause --job demo
"$tmsctl" status
free_paused=$("$build/tests/e2e/cuda_probe" free)
echo "device free memory: $free_before MiB before the pause, $free_paused MiB while paused"
want=$(( bytes / 1048576 * 9 / 10 ))
"$build/tests/e2e/cuda_probe" "$want"   # another process takes most of what the pause freed

"$tmsctl" resume --job demo
check=$(ask check)
addr=$(ask "addr 1")
ask exit >/dev/null || true
if [ "$check" = "ok 1" ] && [ "${addr#ok }" = "${alloc##* }" ]; then
  echo "== PASS ($mode): every byte restored at ${addr#ok }"
else
  echo "== FAIL: check said '$check', address '$addr' (was ${alloc##* })"
  exit 1
fi
