#!/usr/bin/env bash
# Call 1: tags + TMS examples, the four-rank tier case, CUDA/torch checks, a raw disk sweep, the gate.
S=$OUT/s; mkdir -p $S; T0=$SECONDS
log() { echo "$1 rc=$2 at $((SECONDS-T0)) s" | tee -a $S/rc.txt; }
TAGS_DEADLINE_S=190 TAGS_EXAMPLE_TIMEOUT_S=90 tests/gpu/run_gpu_tags.sh gpu-bundle $S/tags gpu-extra/tms-src >$S/tags.console 2>&1; log tags $?
TIER_CASES=four timeout 100 tests/gpu/run_gpu_tier.sh gpu-bundle $S/tier >$S/tier.console 2>&1; log tier $?
GPU_BENCHES= timeout 100 tests/gpu/run_gpu.sh gpu-bundle $S/main 6 >$S/main.console 2>&1; log main $?
mkdir -p /var/tmp/sweep $S/sweep
for qd in 8 32; do for mib in 1 8 32; do
  timeout 30 gpu-bundle/tmsdisk-rawdisk /var/tmp/sweep --gib 4 --request-mib $mib --queue-depth $qd >$S/sweep/qd$qd-mib$mib.txt 2>&1
  echo "qd $qd mib $mib: $(grep -h '^write\|^read' $S/sweep/qd$qd-mib$mib.txt | tr '\n' ' ')" >>$S/sweep.txt
done; done
sync; echo 3 >/proc/sys/vm/drop_caches
dd if=/dev/urandom of=/var/tmp/sweep/f bs=64M count=64 status=none; sync; echo 3 >/proc/sys/vm/drop_caches
( time dd if=/var/tmp/sweep/f of=/dev/null bs=256M status=none ) 2>>$S/sweep.txt; echo "buffered read of 4 GiB above" >>$S/sweep.txt
rm -rf /var/tmp/sweep; log sweep 0
left=$((575-(SECONDS-T0))); [ $left -gt 30 ] && { timeout $left tests/gpu/run_gpu_gate.sh gpu-bundle $S/gate >$S/gate.console 2>&1; log gate $?; }
cat $S/rc.txt $S/sweep.txt; tail -3 $S/tags.console; tail -8 $S/tier/tier.txt; grep -h "check" $S/main/*.txt | head; tail -3 $S/gate.console
tar czf $OUT/call1.tgz -C $OUT s
