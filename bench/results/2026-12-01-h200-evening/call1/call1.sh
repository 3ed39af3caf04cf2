#!/usr/bin/env bash
# Call 1 (2026-12-01 evening): the fast stand-in (tmpfs) beside TMS, then the checks with the gate/host-tier fixes.
S=$OUT/s; mkdir -p $S; T0=$SECONDS
log() { echo "$1 rc=$2 at $((SECONDS-T0)) s" | tee -a $S/rc.txt; }
FAST_DEVICE=tmpfs FAST_CYCLES=3 timeout 200 tests/gpu/run_gpu_fast_disk.sh gpu-bundle $S/fast gpu-extra/tms-src >$S/fast.console 2>&1; log fast $?
GPU_BENCHES= timeout 130 tests/gpu/run_gpu.sh gpu-bundle $S/main 6 >$S/main.console 2>&1; log main $?
left=$((585-(SECONDS-T0))); timeout $left tests/gpu/run_gpu_gate.sh gpu-bundle $S/gate >$S/gate.console 2>&1; log gate $?
cat $S/rc.txt; tail -32 $S/fast/fast_disk.txt; grep -h "check" $S/main/*.txt | head; grep -h "PASS\|FAIL" $S/gate/gate.txt
tar czf $OUT/e1.tgz -C $OUT s
