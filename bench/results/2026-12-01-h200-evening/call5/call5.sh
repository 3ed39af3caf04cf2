#!/usr/bin/env bash
# Call 5 (2026-12-01 evening): the tmpfs stand-in beside TMS at the goal's size, 16 GiB of random data, two cycles.
S=$OUT/s; mkdir -p $S; T0=$SECONDS
FAST_DEVICE=tmpfs FAST_GIB=16 FAST_CYCLES=2 timeout 400 tests/gpu/run_gpu_fast_disk.sh gpu-bundle $S/fast gpu-extra/tms-src >$S/fast.console 2>&1
echo "fast rc=$? at $((SECONDS-T0)) s" | tee -a $S/rc.txt
tail -30 $S/fast/fast_disk.txt
tar czf $OUT/e5.tgz -C $OUT s
