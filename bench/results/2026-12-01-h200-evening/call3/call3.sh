#!/usr/bin/env bash
# Call 3 (2026-12-01 evening): roots in memory send their requests to io_uring's workers. The tmpfs
# stand-in again (raw, session, beside TMS), then the host tier with the gate/host-tier fixes.
S=$OUT/s; mkdir -p $S; T0=$SECONDS
log() { echo "$1 rc=$2 at $((SECONDS-T0)) s" | tee -a $S/rc.txt; }
FAST_DEVICE=tmpfs FAST_CYCLES=3 timeout 200 tests/gpu/run_gpu_fast_disk.sh gpu-bundle $S/fast gpu-extra/tms-src >$S/fast.console 2>&1; log fast $?
left=$((585-(SECONDS-T0))); timeout $left tests/gpu/run_gpu_tier.sh gpu-bundle $S/tier >$S/tier.console 2>&1; log tier $?
cat $S/rc.txt; tail -34 $S/fast/fast_disk.txt; grep -h "PASS\|FAIL\|ratio\|budget" $S/tier/tier.txt | head -30
tar czf $OUT/e3.tgz -C $OUT s
