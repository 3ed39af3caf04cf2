#!/usr/bin/env bash
# Call 5 (2026-12-01 afternoon): the lanes where the disk is not the limit (pause all changed, resume, beside TMS).
S=$OUT/s; mkdir -p $S; T0=$SECONDS
FAST_CYCLES=3 timeout 200 tests/gpu/run_gpu_fast_disk.sh gpu-bundle $S/fast gpu-extra/tms-src >$S/fast.console 2>&1
echo "fast rc=$? at $((SECONDS-T0)) s" | tee -a $S/rc.txt
cat $S/rc.txt; tail -32 $S/fast/fast_disk.txt
tar czf $OUT/call5.tgz -C $OUT s
