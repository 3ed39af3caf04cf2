#!/usr/bin/env bash
# Call 2 (2026-12-01 afternoon): beside TMS on the node's disk, random data; then the 16 GiB shim bench.
S=$OUT/s; mkdir -p $S; T0=$SECONDS
log() { echo "$1 rc=$2 at $((SECONDS-T0)) s" | tee -a $S/rc.txt; }
TMS_COMPARE_CASES=random TMS_COMPARE_RANDOM_CYCLES=2 TMS_COMPARE_DEADLINE_S=240 timeout 260 \
  tests/gpu/run_gpu_tms_compare.sh gpu-bundle $S/cmp gpu-extra/tms-src >$S/cmp.console 2>&1; log compare $?
left=$((585-(SECONDS-T0))); DISK_PARTS=shim DISK_REPEAT=2 timeout $left tests/gpu/run_gpu_disk.sh gpu-bundle $S/disk >$S/disk.console 2>&1; log disk $?
cat $S/rc.txt; tail -16 $S/cmp/tms_compare.txt; cat $S/disk/disk.txt
tar czf $OUT/call2.tgz -C $OUT s
