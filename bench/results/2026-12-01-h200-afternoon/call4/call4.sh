#!/usr/bin/env bash
# Call 4 (2026-12-01 afternoon): the CUDA program, PyTorch training and the gate with the pause lanes.
S=$OUT/s; mkdir -p $S; T0=$SECONDS
log() { echo "$1 rc=$2 at $((SECONDS-T0)) s" | tee -a $S/rc.txt; }
GPU_BENCHES= timeout 130 tests/gpu/run_gpu.sh gpu-bundle $S/main 6 >$S/main.console 2>&1; log main $?
timeout 170 tests/gpu/run_gpu_gate.sh gpu-bundle $S/gate >$S/gate.console 2>&1; log gate $?
cat $S/rc.txt; grep -h "check" $S/main/*.txt | head; grep -h "PASS\|FAIL" $S/gate/gate.txt
tar czf $OUT/call4.tgz -C $OUT s
