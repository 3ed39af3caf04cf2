#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# A block device in host memory, mounted at DIR: a loop device over a file in /dev/shm with ext4 on it.
# A disk far faster than a GPU node's own, to compare tools where the disk is not what limits them
# (their reads and writes still go through a block device, O_DIRECT and the page cache as on a disk;
# dropping the page cache drops ext4's, not the file under it). Needs root; the node's memory holds it.
#   tests/gpu/ram_disk.sh DIR GIB        make and mount it (prints the loop device)
#   tests/gpu/ram_disk.sh --remove DIR   unmount it and free its memory
set -euo pipefail
if [ "${1:-}" = --remove ]; then
  dir=$2
  dev=$(findmnt -no SOURCE --target "$dir")
  umount "$dir"
  backing=$(losetup -nO BACK-FILE "$dev")
  losetup -d "$dev"
  rm -f "$backing"
  exit 0
fi
dir=$1
gib=$2
backing=/dev/shm/tmsdisk-ram-disk-$$.img
truncate -s "${gib}G" "$backing"
dev=$(losetup --find --show "$backing")
mkfs.ext4 -q -F -E lazy_itable_init=0,lazy_journal_init=0 "$dev"
mkdir -p "$dir"
mount "$dev" "$dir"
echo "$dev ($gib GiB in /dev/shm) mounted at $dir"
