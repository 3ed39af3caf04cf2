#!/usr/bin/env bash
# Call 4: tmsdisk beside torch_memory_saver, random data, on a block device in host memory.
S=$OUT/s; mkdir -p $S; T0=$SECONDS
tests/gpu/ram_disk.sh /mnt/fast 24 >$S/ramdisk.txt 2>&1 || { cat $S/ramdisk.txt; exit 1; }
mkdir -p /mnt/fast/raw && timeout 30 gpu-bundle/tmsdisk-rawdisk /mnt/fast/raw --gib 4 --request-mib 8 --queue-depth 32 >>$S/ramdisk.txt 2>&1; rm -rf /mnt/fast/raw
echo "raw at $((SECONDS-T0)) s" >>$S/ramdisk.txt
NODE_DISK=/mnt/fast TMS_COMPARE_GIB=8 TMS_COMPARE_CASES=random TMS_COMPARE_RANDOM_CYCLES=1 TMS_COMPARE_DEADLINE_S=$((175-(SECONDS-T0))) \
  tests/gpu/run_gpu_tms_compare.sh gpu-bundle $S/cmp gpu-extra/tms-src >$S/cmp.console 2>&1
echo "compare rc=$? at $((SECONDS-T0)) s" >>$S/ramdisk.txt
cat $S/ramdisk.txt; tail -25 $S/cmp/tms_compare.txt
tar czf $OUT/call4.tgz -C $OUT s
