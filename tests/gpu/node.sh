# SPDX-License-Identifier: Apache-2.0
# Sourced by the run_gpu*.sh checks: the environment they run in and a daemon on a fresh root.
#
# start_node BUNDLE_DIR OUT_DIR NAME
#   Sets `bundle`, `tmsctl` and `work` ($NODE_DISK/tmsdisk-gpu-NAME; NODE_DISK defaults to /var/tmp, a
#   directory on the node's disk), exports TMSDISK_*, and starts
#   tmsdiskd with its log in OUT_DIR/tmsdiskd-NAME.log (with the options in $NODE_DAEMON_ARGS, if
#   set); it is stopped and `work` removed on exit, or by stop_node.
start_node() {
  bundle=$(cd "$1" && pwd)
  mkdir -p "$2"
  work=${NODE_DISK:-/var/tmp}/tmsdisk-gpu-$3
  rm -rf "$work"
  mkdir -p "$work/root"
  export TMSDISK_SOCKET=$work/tmsdiskd.sock TMSDISK_LIBRARY=$bundle/libtmsdisk.so TMSDISK_DAEMON=$bundle/tmsdiskd
  # NVLink multicast stays off (a program using it can take the host's shared GPUs out of service);
  # cuBLAS workspaces are fixed so that deterministic runs can be compared digest for digest.
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 CUBLAS_WORKSPACE_CONFIG=:4096:8
  tmsctl=$bundle/tmsctl
  # A root on tmpfs (NODE_DISK=/dev/shm/...: run_gpu_fast_disk.sh's FAST_DEVICE=tmpfs) is refused
  # unless allowed: there it stands in for a device faster than one reader.
  local tmpfs=""
  [ "$(stat -f -c %T "$work/root")" = tmpfs ] && tmpfs=--allow-tmpfs
  # shellcheck disable=SC2086  # NODE_DAEMON_ARGS is a list of options
  "$bundle/tmsdiskd" --root "$work/root" --socket "$TMSDISK_SOCKET" --log-level info $tmpfs ${NODE_DAEMON_ARGS:-} \
    2>"$2/tmsdiskd-$3.log" &
  node_daemon=$!
  trap 'kill $node_daemon 2>/dev/null; wait $node_daemon 2>/dev/null; rm -rf "$work"' EXIT
  for _ in $(seq 100); do "$tmsctl" status >/dev/null 2>&1 && return 0; sleep 0.1; done
  echo "tmsdiskd did not start; see $2/tmsdiskd-$3.log" >&2
  return 1
}

# Stops the daemon start_node started and removes its root (a later start_node starts another).
stop_node() {
  kill "$node_daemon" 2>/dev/null
  wait "$node_daemon" 2>/dev/null
  rm -rf "$work"
  trap - EXIT
}
