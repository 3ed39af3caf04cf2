#!/usr/bin/env bash
# Call 2 (2026-12-01 evening): beside TMS on four loop devices striped into one (a device faster than
# one reader, like an NVMe array), then the tags checks with the gate fixes.
S=$OUT/s; mkdir -p $S; T0=$SECONDS
log() { echo "$1 rc=$2 at $((SECONDS-T0)) s" | tee -a $S/rc.txt; }
{ command -v dmsetup mdadm; ls /dev/mapper; grep -E "dm_mod|raid0|device-mapper" /proc/modules /proc/misc /proc/devices; nproc; } >$S/probe.txt 2>&1
FAST_DEVICE=stripe FAST_CYCLES=3 timeout 260 tests/gpu/run_gpu_fast_disk.sh gpu-bundle $S/fast gpu-extra/tms-src >$S/fast.console 2>&1; log fast $?
left=$((585-(SECONDS-T0))); TAGS_DEADLINE_S=$((left-25)) TAGS_EXAMPLE_TIMEOUT_S=90 timeout $left tests/gpu/run_gpu_tags.sh gpu-bundle $S/tags gpu-extra/tms-src >$S/tags.console 2>&1; log tags $?
cat $S/probe.txt $S/rc.txt; tail -34 $S/fast/fast_disk.txt; grep -c PASS $S/tags/tags.txt; grep -h "FAIL" $S/tags/tags.txt | head
tar czf $OUT/e2.tgz -C $OUT s
