# SPDX-License-Identifier: Apache-2.0
"""The rank's store of named objects with the node's host tier on (tmsdiskd --host-tier-mb): objects
that fit the rank's share live in host-tier memory of their own, the others on disk, and the streamed
optimizer gives the same bits either way.

optim_app.py's scenarios under libtmsdisk.so on simcuda, against a tmsdiskd of their own (the harness
of test_optim.py's real-store cases). Each small object takes one 4 MiB chunk of memory, so a 32 MiB
budget holds some buckets of the scenarios and leaves the rest on disk.

    /usr/bin/python3 test_store_tier.py     (needs torch: Debian's python3-torch; exit 77 without it)
"""

import json
import os
import re
import signal
import subprocess
import sys
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from test_optim import RealStoreCase  # noqa: E402  (exits 77 without torch)

BUDGET_MB = 32


class ObjectsInTheHostTier(RealStoreCase):
    # info: the daemon's log says where each object went.
    daemon_args = ("--host-tier-mb", str(BUDGET_MB), "--host-tier-ahead=false", "--log-level", "info")

    def tmsctl(self, *args):
        tmsctl = os.environ.get("TMSCTL")
        if not tmsctl or not os.path.exists(tmsctl):
            self.skipTest("needs TMSCTL (CTest passes it)")
        out = subprocess.run([tmsctl, "--socket", self.daemon.socket, *args], capture_output=True, text=True,
                             timeout=60)
        self.assertEqual(out.returncode, 0, "tmsctl %s: %s%s" % (" ".join(args), out.stdout, out.stderr))
        return out.stdout

    def session_of(self, child):
        sessions = [s for s in json.loads(self.tmsctl("status", "--json")) if s["pid"] == child.pid]
        self.assertEqual(len(sessions), 1, "the session of pid %d" % child.pid)
        return sessions[0]

    def node_tier_used(self):
        """What the node's host tier holds, as `tmsctl status` says it ("host tier: X of Y in use")."""
        text = self.tmsctl("status")
        found = re.search(r"host tier: (\S+ \S+) of", text)
        self.assertIsNotNone(found, text)
        return found.group(1)

    def objects_file_blocks(self, child):
        path = os.path.join(self.rank_dir(child), "objects")
        return os.stat(path).st_blocks if os.path.exists(path) else 0

    def test_streamed_adamw_bit_identical_with_buckets_in_memory_and_on_disk(self):
        # matches-torch opens more buckets than the budget holds: some live in the tier, the rest on disk.
        self.run_scenario("matches-torch")
        log = self.daemon.log()
        self.assertIn("lives in 4.0 MiB of host-tier memory", log)
        self.assertIn("lives on disk", log)

    def test_checkpoint_through_the_tier(self):
        self.run_scenario("checkpoint")

    def test_objects_in_memory_take_no_disk_and_read_back_intact(self):
        child = self.start("roundtrip")
        self.read_until(child, "WRITTEN")
        session = self.session_of(child)
        # The four objects of one chunk the scenario keeps, each in 4 MiB of host-tier memory.
        self.assertEqual(session["objects"], 4, session)
        self.assertEqual(session["object_host_bytes"], 4 * 4 << 20, session)
        self.assertEqual(session["object_bytes"], 0, session)
        self.assertEqual(self.objects_file_blocks(child), 0)
        directory = self.rank_dir(child)
        self.tell(child, "exit")
        self.finish(child, "roundtrip")
        self.assertGone(directory, "its process exited")

    def test_store_host_tier_off_keeps_objects_on_disk(self):
        child = self.start("roundtrip", {"TMSDISK_STORE_HOST_TIER": "0"})
        self.read_until(child, "WRITTEN")
        session = self.session_of(child)
        self.assertEqual(session["object_host_bytes"], 0, session)
        self.assertGreater(session["object_bytes"], 0, session)
        self.assertGreater(self.objects_file_blocks(child), 0)
        self.tell(child, "exit")
        self.finish(child, "roundtrip")

    def test_a_killed_rank_gives_its_objects_memory_back(self):
        child = self.start("rank-killed")
        self.read_until(child, "WRITTEN")
        self.assertGreater(self.session_of(child)["object_host_bytes"], 0)
        directory = self.rank_dir(child)
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
        self.assertGone(directory, "its rank was killed")
        self.assertEqual(self.node_tier_used(), "0 B")

    def test_a_pause_moves_parameters_and_gradients_not_buckets(self):
        self.run_scenario("pause-between-steps")


class ObjectsBeforePauseMemory(ObjectsInTheHostTier):
    """With host-tier-ahead on, the rank holds memory for a pause to come; its objects still come first."""

    daemon_args = ("--host-tier-mb", str(BUDGET_MB), "--log-level", "info")

    def test_idle_pause_memory_yields_to_the_rank_objects(self):
        import time

        child = self.start("objects-first")
        self.read_until(child, "ALLOCATED")
        # 24 MiB to back up: the shim asks for it once its allocations are quiet (2 s).
        deadline = time.monotonic() + 60
        while self.session_of(child)["host_tier_bytes"] == 0 and time.monotonic() < deadline:
            time.sleep(0.2)
        self.assertEqual(self.session_of(child)["host_tier_bytes"], 24 << 20, self.daemon.log())
        # Four objects of 4 MiB: 16 of the 32 MiB share, which only 8 MiB of is free while that grant holds.
        self.tell(child, "open")
        self.read_until(child, "OPENED")
        session = self.session_of(child)
        self.assertEqual(session["object_host_bytes"], 4 * 4 << 20, session)
        self.assertEqual(session["object_bytes"], 0, session)
        self.tell(child, "exit")
        self.finish(child, "objects-first")


if __name__ == "__main__":
    unittest.main(verbosity=2)
