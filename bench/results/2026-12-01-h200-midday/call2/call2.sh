#!/usr/bin/env bash
# Call 2: 16 GiB x 3 disk only through the shim, daemon memory (16 GiB bench, 32 GiB session), chunk sizes on reads.
S=$OUT/s; mkdir -p $S; T0=$SECONDS
log() { echo "$1 rc=$2 at $((SECONDS-T0)) s" | tee -a $S/rc.txt; }
timeout 430 tests/gpu/run_gpu_disk.sh gpu-bundle $S/disk >$S/disk.console 2>&1; log disk $?
mkdir -p /var/tmp/chunks
for cfg in "8 256" "32 1024" "8 1024" "32 256"; do
  set -- $cfg; left=$((570-(SECONDS-T0))); [ $left -lt 40 ] && break
  timeout $left gpu-bundle/tmsdisk-session-bench /var/tmp/chunks --gib 8 --repeat 1 --chunk-mb $1 --staging-budget-mb $2 >$S/chunk$1-staging$2.txt 2>&1
  log "chunk $1 staging $2" $?
done
rm -rf /var/tmp/chunks
cat $S/rc.txt $S/disk/disk.txt; grep -h "write\|read" $S/chunk*.txt
tar czf $OUT/call2.tgz -C $OUT s
