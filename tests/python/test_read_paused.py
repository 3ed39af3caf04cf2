# SPDX-License-Identifier: Apache-2.0
"""tmsdisk.read_paused() and tmsdisk_paused_view(): paused memory read without resuming it, from disk,
from the node's host tier, from both, and after a daemon restart; and torch_memory_saver's C entry
points, which show paused memory the same way, and its set_disk_backup_dir.

paused_app.py's scenarios under libtmsdisk.so on simcuda, against a tmsdiskd of their own (the harness
of test_optim.py's real-store cases).

    /usr/bin/python3 test_read_paused.py     (needs torch: Debian's python3-torch; exit 77 without it)
"""

import os
import sys
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from test_optim import RealStoreCase  # noqa: E402  (exits 77 without torch)


class ReadPaused(RealStoreCase):
    """Every data chunk on disk (no host tier): reads go through the daemon, verified."""

    app = "paused_app.py"
    daemon_args = ("--host-tier-ahead=false",)
    tier = "none"

    def test_read_while_paused(self):
        self.run_scenario("read", {"EXPECT_TIER": self.tier})

    def test_read_after_a_daemon_restart(self):
        child = self.start("restart", {"EXPECT_TIER": self.tier})
        self.read_until(child, "PAUSED")
        self.daemon.kill()
        self.daemon.start()  # the same roots and socket
        self.tell(child, "restarted")
        self.finish(child, "restart")


    def test_torch_memory_saver_get_cpu_backup(self):
        # The compatibility module first on the path, as `tmsctl run --tms-compat` puts it: the build's
        # copy, or the source tree's.
        built = os.environ.get("PYTHON_DIR")
        compat = os.path.join(built, "tms-compat") if built else os.path.join(HERE, "..", "..", "python", "compat")
        path = ":".join([compat] + self.child_env("unused")["PYTHONPATH"].split(":"))
        self.run_scenario("tms-get-cpu-backup", {"PYTHONPATH": path})


class ReadPausedFromTheTier(ReadPaused):
    """A tier that holds every data chunk: reads are copies out of memory, views need none."""

    daemon_args = ("--host-tier-mb", "64", "--host-tier-ahead=false")
    tier = "all"


class ReadPausedFromBoth(ReadPaused):
    """A tier of two chunks: the first two data chunks in memory, the rest on disk."""

    daemon_args = ("--host-tier-mb", "8", "--host-tier-ahead=false")
    tier = "part"


class Prefetch(RealStoreCase):
    """tmsdisk.prefetch(): a tag paused to disk read into a tier that holds all of it."""

    app = "paused_app.py"
    daemon_args = ("--host-tier-mb", "64", "--host-tier-ahead=false")
    tier = "all"

    keep = True  # the daemon's host-tier-keep

    def test_paused_tag_read_into_the_tier_ahead_of_its_resume(self):
        self.run_scenario("prefetch", {"EXPECT_TIER": self.tier, "EXPECT_KEEP": "1" if self.keep else "0"})

    def test_tmsctl_prefetch(self):
        import json
        import subprocess

        tmsctl = os.environ.get("TMSCTL")
        if not tmsctl or not os.path.exists(tmsctl):
            self.skipTest("needs TMSCTL (CTest passes it)")

        def prefetch(*selector):
            out = subprocess.run([tmsctl, "--socket", self.daemon.socket, "prefetch", "--pid", str(child.pid),
                                  *selector, "--json"], capture_output=True, text=True, timeout=60)
            self.assertEqual(out.returncode, 0, out.stdout + out.stderr)
            results = json.loads(out.stdout)
            self.assertEqual(len(results), 1, results)
            return results[0]

        child = self.start("prefetch-command", {"EXPECT_TIER": self.tier})
        self.read_until(child, "READY")
        # The tag's five data chunks (4 MiB each, the last one short): all of them, or the four that
        # the tier of 16 MiB holds.
        started = prefetch("--tag", "second")
        self.assertEqual(started["outcome"], "done", started)
        self.assertEqual(started["bytes"], (5 if self.tier == "all" else 4) * 4 << 20, started)
        nothing = prefetch("--tag", "nosuch")
        self.assertEqual(nothing["outcome"], "no-op", nothing)
        self.tell(child, "prefetched")
        self.finish(child, "prefetch-command")


class PrefetchPartly(Prefetch):
    """... into a tier of four chunks: the first four of the tag's five, the last one stays on disk."""

    daemon_args = ("--host-tier-mb", "16", "--host-tier-ahead=false")
    tier = "part"


class PrefetchWithoutKeep(Prefetch):
    """... with a daemon that takes the tier memory back at every resume (host-tier-keep=false): memory
    a prefetch asked for stays the rank's while it reads."""

    daemon_args = ("--host-tier-mb", "64", "--host-tier-ahead=false", "--host-tier-keep=false")
    keep = False


class TmsEntryPoints(RealStoreCase):
    """torch_memory_saver's C functions exported by libtmsdisk.so, called as its tests call them."""

    app = "paused_app.py"
    daemon_args = ("--host-tier-mb", "64", "--host-tier-ahead=false")

    def test_region_state_pause_resume_and_host_copy(self):
        self.run_scenario("tms-entry-points")


class BackupDir(RealStoreCase):
    """torch_memory_saver's set_disk_backup_dir: the rank's files in a directory of its choosing, handed
    to the daemon by descriptor, and removed with the process."""

    app = "paused_app.py"
    daemon_args = ("--host-tier-ahead=false",)

    def test_files_in_the_directory_set_and_gone_with_the_process(self):
        built = os.environ.get("PYTHON_DIR")
        compat = os.path.join(built, "tms-compat") if built else os.path.join(HERE, "..", "..", "python", "compat")
        path = ":".join([compat] + self.child_env("unused")["PYTHONPATH"].split(":"))
        parent = os.path.join(self.work, "backups")
        os.mkdir(parent, 0o700)
        self.run_scenario("tms-backup-dir", {"PYTHONPATH": path, "BACKUP_PARENT": parent})
        # The process is gone: its files go with it (once the daemon sees its connection end), the
        # directories stay.
        import time

        def leftover():
            return [n for d in os.listdir(parent) for n in os.listdir(os.path.join(parent, d))]

        deadline = time.monotonic() + 30
        while leftover() and time.monotonic() < deadline:
            time.sleep(0.2)
        self.assertEqual(leftover(), [], "files left behind in %s; daemon log:\n%s" % (parent, self.daemon.log()))
        self.assertTrue(os.path.isdir(os.path.join(parent, "second")))


class Retain(RealStoreCase):
    """tmsdisk.retain_host_copy(): resumed memory's host-tier copy kept readable (TMS's retain_cpu_backup)."""

    app = "paused_app.py"
    daemon_args = ("--host-tier-mb", "64", "--host-tier-ahead=false")

    def test_resumed_memory_read_from_its_retained_copy(self):
        self.run_scenario("retain")


class TierNotKept(RealStoreCase):
    """host-tier-keep = false: the host copy's memory is gone from the process when resume() returns (TMS's
    cpu_backup_rss), and a retained copy's view keeps its bytes in memory of the process's own."""

    app = "paused_app.py"
    daemon_args = ("--host-tier-mb", "64", "--host-tier-ahead=false", "--host-tier-keep=false")

    def test_host_copy_unmapped_by_the_time_resume_returns(self):
        self.run_scenario("not-kept")


if __name__ == "__main__":
    unittest.main(verbosity=2)
