#!/usr/bin/env bash
# Call 4 (2026-12-01 evening): the 16 GiB shim bench on the node's disk with this session's bundle.
S=$OUT/s; mkdir -p $S; T0=$SECONDS
log() { echo "$1 rc=$2 at $((SECONDS-T0)) s" | tee -a $S/rc.txt; }
DISK_PARTS=shim DISK_REPEAT=1 timeout 420 tests/gpu/run_gpu_disk.sh gpu-bundle $S/disk >$S/disk.console 2>&1; log disk $?
cat $S/rc.txt; cat $S/disk/disk.txt
tar czf $OUT/e4.tgz -C $OUT s
