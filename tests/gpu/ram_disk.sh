#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# A block device in host memory, mounted at DIR: a loop device over a file in /dev/shm with ext4 on it.
# A disk far faster than a GPU node's own, to compare tools where the disk is not what limits them
# (their reads and writes still go through a block device, O_DIRECT and the page cache as on a disk;
# dropping the page cache drops ext4's, not the file under it). Needs root; the node's memory holds it.
# One loop device serves its requests on one kernel worker (about 4.5 GB/s on an H200 node, as fast as
# one buffered reader); RAM_DISK_STRIPES=N (> 1) stripes N of them into one device (dm-stripe through
# dmsetup, else RAID 0 through mdadm, 512 KiB chunks), which like an NVMe array serves requests in
# parallel and so is faster than one reader.
#   tests/gpu/ram_disk.sh DIR GIB        make and mount it (prints the device)
#   tests/gpu/ram_disk.sh --remove DIR   unmount it and free its memory
set -euo pipefail
# What --remove undoes, one line each: "loop DEV FILE", "dm NAME" or "md DEV".
state_of() { echo "/dev/shm/tmsdisk-ram-disk-$(echo "$1" | tr / _).state"; }

if [ "${1:-}" = --remove ]; then
  dir=$2
  state=$(state_of "$dir")
  if mountpoint -q "$dir"; then umount "$dir"; fi
  tac "$state" | while read -r kind dev file; do
    case $kind in
      dm) dmsetup remove "$dev" ;;
      md) mdadm --stop "$dev" >/dev/null ;;
      loop) losetup -d "$dev"; rm -f "$file" ;;
    esac
  done
  rm -f "$state"
  exit 0
fi
dir=$1
gib=$2
stripes=${RAM_DISK_STRIPES:-1}
state=$(state_of "$dir")
[ -e "$state" ] && { echo "$dir already has a ram disk ($state): remove it first" >&2; exit 1; }
: >"$state"
# A step that fails undoes what the earlier ones made (set -e runs this on the way out).
trap '"$0" --remove "$dir" >/dev/null 2>&1 || true' ERR
loops=()
for i in $(seq "$stripes"); do
  backing=/dev/shm/tmsdisk-ram-disk-$$-$i.img
  # Each stripe rounded up to whole MiB so that the striped device is a whole number of chunks.
  truncate -s "$(( (gib * 1024 + stripes - 1) / stripes ))M" "$backing"
  loop=$(losetup --find --show "$backing")
  echo "loop $loop $backing" >>"$state"
  loops+=("$loop")
done
dev=${loops[0]}
if [ "$stripes" -gt 1 ]; then
  chunk_sectors=1024  # 512 KiB
  sectors=$(( $(blockdev --getsz "${loops[0]}") / chunk_sectors * chunk_sectors ))
  if command -v dmsetup >/dev/null; then
    name=tmsdisk-ram-$$
    table="0 $((sectors * stripes)) striped $stripes $chunk_sectors"
    for loop in "${loops[@]}"; do table+=" $loop 0"; done
    dmsetup create "$name" --table "$table"
    echo "dm $name" >>"$state"
    dev=/dev/mapper/$name
  elif command -v mdadm >/dev/null; then
    dev=/dev/md/tmsdisk-ram-$$
    mdadm --create "$dev" --run --level=0 --chunk=512 --raid-devices="$stripes" "${loops[@]}" >/dev/null 2>&1
    echo "md $dev" >>"$state"
  else
    echo "RAM_DISK_STRIPES=$stripes needs dmsetup or mdadm; this machine has neither" >&2
    false
  fi
fi
mkfs.ext4 -q -F -E lazy_itable_init=0,lazy_journal_init=0 "$dev"
mkdir -p "$dir"
mount "$dev" "$dir"
echo "$dev ($gib GiB in /dev/shm, $stripes loop device(s)) mounted at $dir"
