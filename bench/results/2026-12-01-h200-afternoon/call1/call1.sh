#!/usr/bin/env bash
# Call 1 (2026-12-01 afternoon): the checks with the READ-verification bundle, then the ram-disk comparison.
S=$OUT/s; mkdir -p $S; T0=$SECONDS
log() { echo "$1 rc=$2 at $((SECONDS-T0)) s" | tee -a $S/rc.txt; }
GPU_BENCHES= timeout 120 tests/gpu/run_gpu.sh gpu-bundle $S/main 6 >$S/main.console 2>&1; log main $?
timeout 150 tests/gpu/run_gpu_gate.sh gpu-bundle $S/gate >$S/gate.console 2>&1; log gate $?
left=$((580-(SECONDS-T0))); timeout $left tests/gpu/run_gpu_fast_disk.sh gpu-bundle $S/fast gpu-extra/tms-src >$S/fast.console 2>&1; log fast $?
cat $S/rc.txt; grep -h "check\|PASS\|FAIL" $S/main/*.txt | head -20; tail -4 $S/gate.console; cat $S/fast/fast_disk.txt | tail -40
tar czf $OUT/call1.tgz -C $OUT s
