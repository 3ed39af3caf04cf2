#!/usr/bin/env bash
# Call 3 (2026-12-01 afternoon): pause lanes. The 16 GiB shim bench twice (all changed, half, one piece), then
# beside TMS on the node's disk with the disk's raw ceiling before each tool.
S=$OUT/s; mkdir -p $S; T0=$SECONDS
log() { echo "$1 rc=$2 at $((SECONDS-T0)) s" | tee -a $S/rc.txt; }
DISK_PARTS=shim DISK_REPEAT=2 timeout 300 tests/gpu/run_gpu_disk.sh gpu-bundle $S/disk >$S/disk.console 2>&1; log disk $?
left=$((585-(SECONDS-T0)))
TMS_COMPARE_CASES=random TMS_COMPARE_RANDOM_CYCLES=2 TMS_COMPARE_DEADLINE_S=$((left-10)) timeout $left \
  tests/gpu/run_gpu_tms_compare.sh gpu-bundle $S/cmp gpu-extra/tms-src >$S/cmp.console 2>&1; log compare $?
cat $S/rc.txt; cat $S/disk/disk.txt; tail -20 $S/cmp/tms_compare.txt
tar czf $OUT/call3.tgz -C $OUT s
