# SPDX-License-Identifier: Apache-2.0
"""What several GPU scripts of tests/gpu do alike: run the tools without a preloaded library, drop the
page cache, and find a pause's or resume's figures in `tmsctl --json status`. No torch, no tmsdisk
imported here (a script that compares against torch_memory_saver imports it too)."""

import json
import os
import subprocess
import time


def child_env():
    """The environment for helpers (nvidia-smi, tmsctl): without either tool's preloaded library."""
    env = dict(os.environ)
    env.pop("LD_PRELOAD", None)
    return env


def drop_caches():
    """Drops the page cache (root only), so that a read from disk is one; False when it could not."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def daemon_last(tmsdisk, kind, log, wait_s=10.0):
    """This rank's last pause or resume ("pause" or "resume") in `tmsctl --json status`, once it is the
    one the shim (the `tmsdisk` package given) did last, same bytes and nanoseconds: bytes, host_bytes
    (the tier), moved_bytes (the disk), zero_bytes, unchanged_bytes, ns. None without TMSCTL or an
    answer within wait_s; `log` says why."""
    tmsctl = os.environ.get("TMSCTL")
    if not tmsctl:
        return None
    st = tmsdisk.status()
    want = (st.last_pause_bytes, st.last_pause_ns) if kind == "pause" else (st.last_resume_bytes, st.last_resume_ns)
    deadline = time.monotonic() + wait_s
    while True:
        try:
            r = subprocess.run([tmsctl, "--json", "status"], capture_output=True, text=True, timeout=30, env=child_env())
            for row in json.loads(r.stdout):
                last = row.get(f"last_{kind}") or {}
                if row.get("pid") == os.getpid() and (last.get("bytes"), last.get("ns")) == want:
                    return last
        except Exception as e:  # pylint: disable=broad-except
            log(f"tmsctl status: {e!r}")
        if time.monotonic() > deadline:
            log(f"tmsctl status has not got this rank's last {kind} {want} within {wait_s} s")
            return None
        time.sleep(0.3)
