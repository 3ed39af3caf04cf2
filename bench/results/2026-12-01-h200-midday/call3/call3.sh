#!/usr/bin/env bash
# Call 3: the session bench's read and write by chunk size and staging, then daemon memory at 32 GiB.
S=$OUT/s; mkdir -p $S; T0=$SECONDS
export TMSDISK_DAEMON=$PWD/gpu-bundle/tmsdiskd
log() { echo "$1 rc=$2 at $((SECONDS-T0)) s" | tee -a $S/rc.txt; }
mkdir -p /var/tmp/chunks
for cfg in "8 256" "32 1024" "8 1024" "32 256" "64 1024"; do
  set -- $cfg
  timeout 80 gpu-bundle/tmsdisk-session-bench /var/tmp/chunks --gib 8 --repeat 2 --chunk-mb $1 --staging-budget-mb $2 >$S/chunk$1-staging$2.txt 2>&1
  log "chunk $1 staging $2" $?
done
timeout 200 gpu-bundle/tmsdisk-session-bench /var/tmp/chunks --gib 32 --repeat 1 >$S/session32.txt 2>&1; log session32 $?
rm -rf /var/tmp/chunks
cat $S/rc.txt; for f in $S/chunk*.txt $S/session32.txt; do echo "== $f"; grep -h "bytes each\|passes\|^write\|^read\|RSS" $f; done
tar czf $OUT/call3.tgz -C $OUT s
