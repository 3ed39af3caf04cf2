# SPDX-License-Identifier: Apache-2.0
"""Tests of the `tmsdisk` Python package (and of torch_memory_saver's compatibility module) on simcuda.

A real tmsdiskd on a temp root, and programs (tmsdisk_app.py, tms_compat_app.py) started under
`tmsctl run` with libtmsdisk.so preloaded and simcuda as libcuda. CTest passes the binaries' paths:

    TMSDISKD, TMSCTL, SHIM, SIMCUDA_DIR   the build's tmsdiskd, tmsctl, libtmsdisk.so, simcuda's directory
    PYTHON_DIR                           where the build put tmsdisk's Python directory (tmsctl's)
    TEST_TMPDIR                          where to make temp directories (optional)

python3 -m unittest test_tmsdisk (from this directory). Python's standard library only: no torch.
"""

import json
import os
import select
import shutil
import socket
import subprocess
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
NEEDED = ("TMSDISKD", "TMSCTL", "SHIM", "SIMCUDA_DIR", "PYTHON_DIR")
CHILD_TIMEOUT_S = 120  # a child that hangs (a call held by mistake) fails the test instead of blocking it


def missing():
    return [name for name in NEEDED if not os.environ.get(name) or not os.path.exists(os.environ[name])]


class Daemon:
    """tmsdiskd on a temp root, ready once it says READY=1 (sd_notify), as systemd would see it.

    extra_args go to its command line; start() again (after kill() or stop()) restarts it on the same
    root and socket, as systemd restarts a daemon that died."""

    def __init__(self, work, extra_args=()):
        self.work = work
        self.root = os.path.join(work, "root")
        self.socket = os.path.join(work, "d.sock")
        self.extra_args = list(extra_args)
        self.log_path = os.path.join(work, "tmsdiskd.log")
        os.mkdir(self.root)
        self.start()

    def start(self):
        notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        name = "tmsdisk-python-test-%d-%s" % (os.getpid(), os.path.basename(self.work))
        notify.bind("\0" + name)
        env = dict(os.environ, NOTIFY_SOCKET="@" + name)
        env.pop("LD_PRELOAD", None)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [os.environ["TMSDISKD"], "--root", self.root, "--socket", self.socket, "--staging-budget-mb", "32",
                 "--chunk-mb", "4", "--log-level", "warn", *self.extra_args],
                env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            pidfd = os.pidfd_open(self.proc.pid)
            try:
                ready, _, _ = select.select([notify, pidfd], [], [], 30)
            finally:
                os.close(pidfd)
            if notify in ready and b"READY=1" in notify.recv(256):
                return
            self.stop()
            raise RuntimeError("tmsdiskd did not become ready (exit status %s): %s" % (self.proc.returncode, self.log()))
        finally:
            notify.close()

    def log(self):
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
        self.proc.wait(timeout=60)

    def kill(self):
        """SIGKILL: the daemon gets no chance to tidy up."""
        self.proc.kill()
        self.proc.wait(timeout=60)


class TmsdiskTestCase(unittest.TestCase):
    """A daemon per test class, a fresh simcuda device per child."""

    @classmethod
    def setUpClass(cls):
        lacking = missing()
        if lacking:
            raise unittest.SkipTest("not given by CTest (or not there): " + ", ".join(lacking))
        base = os.environ.get("TEST_TMPDIR") or None
        if base:
            os.makedirs(base, exist_ok=True)
        cls.work = tempfile.mkdtemp(prefix="py.", dir=base)
        try:
            cls.daemon = Daemon(cls.work)
        except BaseException:
            shutil.rmtree(cls.work, ignore_errors=True)
            raise

    @classmethod
    def tearDownClass(cls):
        cls.daemon.stop()
        shutil.rmtree(cls.work, ignore_errors=True)

    def child_env(self, extra=None):
        env = dict(os.environ)
        for name in ("LD_PRELOAD", "PYTHONPATH", "TMSDISK_LIBRARY", "TMS_DISK_BACKUP_DIR"):
            env.pop(name, None)
        state = tempfile.NamedTemporaryFile(dir=self.work, prefix="simcuda.", delete=False)
        state.close()
        env.update(
            TMSDISK_SOCKET=self.daemon.socket,
            LD_LIBRARY_PATH=os.environ["SIMCUDA_DIR"],
            SIMCUDA_STATE=state.name,
            SIMCUDA_DEVICE_MEM_MB="256",
            TEST_PYTHON_DIR=os.environ["PYTHON_DIR"],
        )
        env.update(extra or {})
        return env

    def run_child(self, argv, env, expect_ok=True):
        try:
            done = subprocess.run(argv, env=env, cwd=HERE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  timeout=CHILD_TIMEOUT_S)
        except subprocess.TimeoutExpired as e:
            self.fail("%s did not finish within %d s; its output:\n%s" % (argv, CHILD_TIMEOUT_S,
                                                                          (e.output or b"").decode(errors="replace")))
        out = done.stdout.decode(errors="replace")
        if expect_ok:
            self.assertEqual(done.returncode, 0, "%s exited %d:\n%s\ndaemon log:\n%s" % (
                argv, done.returncode, out, self.daemon.log()))
        return done.returncode, out

    def tmsctl_run(self, app, scenario, options=(), extra_env=None):
        argv = [os.environ["TMSCTL"], "run", "--job", "py-" + scenario, "--on-touch", "fail", *options, "--",
                sys.executable, os.path.join(HERE, app), scenario]
        _, out = self.run_child(argv, self.child_env(extra_env))
        self.assertIn("OK " + scenario, out)
        return out


class PackageTest(TmsdiskTestCase):
    def test_tags_pause_resume_and_figures(self):
        self.tmsctl_run("tmsdisk_app.py", "tags")

    def test_regions_nest_per_thread_and_refuse_bad_input(self):
        self.tmsctl_run("tmsdisk_app.py", "regions")

    def test_no_daemon_raises_with_the_shims_message(self):
        env = self.child_env({"LD_PRELOAD": os.environ["SHIM"], "PYTHONPATH": os.environ["PYTHON_DIR"],
                              "TMSDISK_SOCKET": os.path.join(self.work, "nobody-listens.sock")})
        _, out = self.run_child([sys.executable, "tmsdisk_app.py", "no-daemon"], env)
        self.assertIn("OK no-daemon", out)

    def test_not_loaded_says_how(self):
        env = self.child_env({"PYTHONPATH": os.environ["PYTHON_DIR"], "TMSDISK_LIBRARY": os.environ["SHIM"]})
        _, out = self.run_child([sys.executable, "tmsdisk_app.py", "not-loaded"], env)
        self.assertIn("OK not-loaded", out)

    def test_ray_recipe_an_actor_started_with_tmsctl_env_pauses_itself_and_from_outside(self):
        """README "Ray": the actor gets `tmsctl env --json` as its environment, no wrapper command."""
        done = subprocess.run([os.environ["TMSCTL"], "env", "--json", "--job", "rl-run"], env=self.child_env(),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=CHILD_TIMEOUT_S)
        self.assertEqual(done.returncode, 0, done.stderr)
        env_vars = json.loads(done.stdout)
        self.assertTrue(all(isinstance(v, str) for v in env_vars.values()), env_vars)  # runtime_env's shape
        actor = subprocess.Popen([sys.executable, os.path.join(HERE, "tmsdisk_app.py"), "actor"],
                                 env=dict(self.child_env(), **env_vars), cwd=HERE, stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

        def answer():
            ready, _, _ = select.select([actor.stdout], [], [], CHILD_TIMEOUT_S)
            line = actor.stdout.readline().strip() if ready else ""
            if not line:
                actor.kill()
                self.fail("the actor stopped answering; its output:\n%s\ndaemon log:\n%s" % (
                    actor.communicate()[0], self.daemon.log()))
            return line

        def call(method):
            actor.stdin.write(method + "\n")
            actor.stdin.flush()
            return answer()

        def tmsctl(*args):
            done = subprocess.run([os.environ["TMSCTL"], *args], env=self.child_env(), stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True, timeout=CHILD_TIMEOUT_S)
            self.assertEqual(done.returncode, 0, done.stdout)
            return done.stdout

        try:
            self.assertEqual(answer(), "ready")
            self.assertEqual(call("sleep"), "sleep: None")  # Ray calls the actor's method: it pauses itself
            self.assertEqual(call("state"), "state: paused")
            ranks = [r for r in json.loads(tmsctl("--json", "status")) if r["job"] == "rl-run"]
            self.assertEqual([(r["pid"], r["state"], r["paused_bytes"]) for r in ranks],
                             [(actor.pid, "paused", 12 << 20)])
            self.assertEqual(call("wake_up"), "wake_up: None")
            self.assertEqual(call("check"), "check: intact")
            # The same actor, paused and resumed by job name from outside (one tmsctl per node).
            tmsctl("pause", "--job", "rl-run")
            self.assertEqual(call("state"), "state: paused")
            tmsctl("resume", "--job", "rl-run")
            self.assertEqual(call("check"), "check: intact")
            actor.stdin.write("exit\n")
            actor.stdin.flush()
            self.assertEqual(answer(), "OK actor")
            self.assertEqual(actor.wait(timeout=CHILD_TIMEOUT_S), 0)
        finally:
            if actor.poll() is None:
                actor.kill()
                actor.wait()

    def test_tmsctl_env_puts_the_package_on_the_path(self):
        done = subprocess.run([os.environ["TMSCTL"], "env", "--json"], env=self.child_env(), stdout=subprocess.PIPE,
                              check=True, timeout=CHILD_TIMEOUT_S)
        first = json.loads(done.stdout)["PYTHONPATH"].split(":")[0]
        self.assertTrue(os.path.isfile(os.path.join(first, "tmsdisk", "__init__.py")), first)


class CompatTest(TmsdiskTestCase):
    """torch_memory_saver's names over tmsdisk, without torch: `tmsctl run --tms-compat`."""

    def compat_dir(self):
        return os.path.join(os.environ["PYTHON_DIR"], "tms-compat")

    def run_compat(self, scenario, extra_env=None, options=()):
        env = dict(extra_env or {}, TEST_COMPAT_DIR=self.compat_dir())
        self.tmsctl_run("tms_compat_app.py", scenario, options=("--tms-compat", *options), extra_env=env)

    def test_regions_pause_resume_by_tag_and_all(self):
        self.run_compat("regions")

    def test_init_enable_makes_memory_outside_regions_the_default_tag(self):
        self.run_compat("init-enable", {"TMS_INIT_ENABLE": "1", "TMS_INIT_ENABLE_CPU_BACKUP": "1"})

    def test_what_cannot_be_honoured_is_refused(self):
        self.run_compat("refusals")

    def test_retain_cpu_backup_from_the_environment_turns_it_on(self):
        self.run_compat("retain-env", {"TMS_RETAIN_CPU_BACKUP": "1"})

    def test_with_torch_regions_use_a_pool_each(self):
        self.run_compat("torch-pools", {"PYTHONPATH": os.path.join(HERE, "faketorch")})

    def test_with_torch_lacking_mempool_regions_are_refused(self):
        self.run_compat("torch-without-mempool", {"PYTHONPATH": os.path.join(HERE, "faketorch"),
                                                   "FAKE_TORCH_NO_MEMPOOL": "1"})

    def test_without_the_shim_the_first_call_says_how(self):
        # Only the compatibility directory on the path: it finds the tmsdisk package beside itself.
        env = self.child_env({"PYTHONPATH": self.compat_dir()})
        _, out = self.run_child([sys.executable, "tms_compat_app.py", "not-loaded"], env)
        self.assertIn("OK not-loaded", out)

    def test_tmsctl_puts_the_module_first_only_when_asked(self):
        def launch_env(*options):
            done = subprocess.run([os.environ["TMSCTL"], "env", "--json", *options],
                                  env=self.child_env({"PYTHONPATH": "/opt/user"}), stdout=subprocess.PIPE,
                                  check=True, timeout=CHILD_TIMEOUT_S)
            return json.loads(done.stdout)

        def python_path(*options):
            return launch_env(*options).get("PYTHONPATH", "").split(":")

        python_dir = os.environ["PYTHON_DIR"]
        want = [os.path.realpath(self.compat_dir()), os.path.realpath(python_dir), "/opt/user"]
        got = [os.path.realpath(p) for p in python_path("--tms-compat")]
        self.assertEqual(got, want)
        got = [os.path.realpath(p) for p in python_path("--tms-compat", "--keep-torch-cache")]
        self.assertEqual(got, want)
        # As torch_memory_saver does, PyTorch's cache is kept (and pauses with its region).
        self.assertEqual(launch_env("--tms-compat").get("TMSDISK_TORCH_EMPTY_CACHE"), "0")
        self.assertNotIn(os.path.realpath(self.compat_dir()), [os.path.realpath(p) for p in python_path()])
        # And without it, torch_memory_saver is not there to import (nor shadows a real one).
        argv = [os.environ["TMSCTL"], "run", "--", sys.executable, "-c",
                "import importlib.util as u; print('absent' if u.find_spec('torch_memory_saver') is None else 'found')"]
        _, out = self.run_child(argv, self.child_env())
        self.assertIn("absent", out)


if __name__ == "__main__":
    unittest.main()
