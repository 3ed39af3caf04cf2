#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Where the disk is not the limit: the same checks on a block device in host memory (ram_disk.sh),
# several times faster than a GPU node's own disk, so that what tmsdisk adds on top of the disk shows.
# 1: the raw O_DIRECT ceiling there (tmsdisk-rawdisk); 2: the daemon's session path beside it
# (tmsdisk-session-bench: write and read against raw passes of the same run, 256 MiB staging);
# 3: tmsdisk beside torch_memory_saver's disk backup, random data (run_gpu_tms_compare.sh, case
# random) on that device. About 3 minutes with the defaults, TMS's build included.
#   tests/gpu/run_gpu_fast_disk.sh BUNDLE_DIR OUT_DIR [TMS_SRC_DIR]
# Environment: FAST_GIB (8: GiB the comparison moves; the device holds both tools' files),
# FAST_CYCLES (2), FAST_SESSION_GIB (4), FAST_DEVICE (loop: ext4 on a loop device over /dev/shm,
# which reads at about 4.5 GB/s on an H200 node, about as fast as one buffered reader; stripe: the
# same over FAST_STRIPES (4) loop devices striped into one (dmsetup or mdadm), a block device that
# serves requests in parallel like an NVMe array, faster than one reader; tmpfs: a directory in
# /dev/shm itself, where O_DIRECT is a memory copy (Linux >= 6.6) done by the thread that submits it,
# and the daemon runs with --allow-tmpfs).
set -uo pipefail  # not -e: every part runs and reports
bundle_dir=$1
out=$2
here=$(cd "$(dirname "$0")" && pwd)
bundle=$(cd "$bundle_dir" && pwd)
gib=${FAST_GIB:-8}
cycles=${FAST_CYCLES:-2}
session_gib=${FAST_SESSION_GIB:-4}
device=${FAST_DEVICE:-loop}
mkdir -p "$out"
out=$(cd "$out" && pwd)
report=$out/fast_disk.txt
tmpfs_flag=()
case $device in
  loop | stripe)
    mnt=/mnt/tmsdisk-fast
    stripes=1
    [ "$device" = stripe ] && stripes=${FAST_STRIPES:-4}
    RAM_DISK_STRIPES=$stripes "$here/ram_disk.sh" "$mnt" $((3 * gib + 8)) >"$report" 2>&1 || { cat "$report"; exit 1; }
    trap '"$here/ram_disk.sh" --remove "$mnt"' EXIT
    ;;
  tmpfs)
    mnt=/dev/shm/tmsdisk-fast
    rm -rf "$mnt"
    mkdir -p "$mnt" || exit 1
    [ "$(stat -f -c %T "$mnt")" = tmpfs ] || { echo "FAIL: /dev/shm is not tmpfs here" | tee "$report"; exit 1; }
    echo "$mnt: a directory on tmpfs ($(uname -r))" >"$report"
    tmpfs_flag=(--allow-tmpfs)
    trap 'rm -rf "$mnt"' EXIT
    ;;
  *)
    echo "FAST_DEVICE must be loop, stripe or tmpfs, not '$device'" >&2
    exit 2
    ;;
esac

echo "== raw O_DIRECT, 8 MiB requests, 32 in flight" >>"$report"
mkdir -p "$mnt/raw"
"$bundle/tmsdisk-rawdisk" "$mnt/raw" --gib "$session_gib" --request-mib 8 --queue-depth 32 >>"$report" 2>&1
rm -rf "$mnt/raw"

echo "== session bench, $session_gib GiB x 2, 256 MiB staging" >>"$report"
mkdir -p "$mnt/session"
TMSDISK_DAEMON=$bundle/tmsdiskd "$bundle/tmsdisk-session-bench" "$mnt/session" --gib "$session_gib" --repeat 2 \
  "${tmpfs_flag[@]}" \
  >>"$report" 2>&1 || echo "FAIL: session bench" >>"$report"
rm -rf "$mnt/session"

echo "== beside torch_memory_saver, random data, $gib GiB x $cycles (tms_compare.txt)" >>"$report"
NODE_DISK=$mnt TMS_COMPARE_GIB=$gib TMS_COMPARE_CASES=random TMS_COMPARE_RANDOM_CYCLES=$cycles \
  "$here/run_gpu_tms_compare.sh" "$bundle" "$out/compare" "${3:-$here/../../gpu-extra/tms-src}" >"$out/compare.console" 2>&1
sed -n '/^== case random/,/^$/p' "$out/compare/tms_compare.txt" >>"$report" 2>&1
grep "^random (goal" "$out/compare/tms_compare.txt" >>"$report" 2>&1
cat "$report"
