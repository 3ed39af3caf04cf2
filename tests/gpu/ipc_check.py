# SPDX-License-Identifier: Apache-2.0
# The e2e legacy-IPC scenario (tests/e2e/test_ipc.cpp) on a real GPU: cuda_ipc exports a cuMemAlloc
# buffer, a second cuda_ipc opens it; the exporter is paused from outside while the buffer is open
# (it must stay resident and correct) and again after it was closed (it must move). Both run with
# the shim (TMSDISK_LIBRARY) and reach the daemon through TMSDISK_SOCKET; tmsctl is TMSCTL.
# Prints one "PASS ..." or "FAIL ..." line per check.
#   python3 ipc_check.py CUDA_IPC GIB [IMPORTER_DEVICE]
# The exporter runs on device 0, the importer on IMPORTER_DEVICE (default 0).
import json
import os
import subprocess
import sys

prog, gib = sys.argv[1], float(sys.argv[2])
importer_device = sys.argv[3] if len(sys.argv) > 3 else "0"
size = int(gib * (1 << 30))
env = dict(os.environ, LD_PRELOAD=os.environ["TMSDISK_LIBRARY"], TMSDISK_JOB="ipc-c")


def start(*args, device="0"):
    return subprocess.Popen([prog, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            env=dict(env, CUDA_IPC_DEVICE=device))


def ask(p, cmd):
    p.stdin.write(cmd + "\n")
    p.stdin.flush()
    return p.stdout.readline().strip()


def tmsctl(*args):
    r = subprocess.run([os.environ["TMSCTL"], "--json", *args], capture_output=True, text=True)
    # One object per rank; a failure of the command itself is one object {"ok": false, "error": ...}.
    answer = json.loads(r.stdout) if r.stdout.strip() else {"ok": False, "error": r.stderr.strip()}
    return answer if isinstance(answer, list) else [{"ok": False, "message": answer.get("error", "")}]


def report(name, ok, detail=""):
    print(("PASS " if ok else "FAIL ") + name + (": " + detail if detail else ""), flush=True)


exporter = start("export", str(size))
ready = exporter.stdout.readline().strip()
report("exporter shares its cuMemAlloc buffer", ready.startswith("ready "), ready[:40])
if not ready.startswith("ready "):
    sys.exit(1)
handle = ready.split()[1]
report("opening its own handle is refused like the driver does", ask(exporter, "selfopen") == "rc 201")
importer = start("import", handle, device=importer_device)
report("importer opens it", importer.stdout.readline().strip() == "ready")
report("importer reads the exporter's data", ask(importer, "check shared 1") == "ok")
report("importer writes", ask(importer, "fill shared 7") == "ok")
report("exporter sees the importer's write", ask(exporter, "check shared 7") == "ok")
me = ["--pid", str(exporter.pid)]
r = tmsctl("pause", *me)
report("pause while open moves only the private buffer", r[0].get("ok") and r[0].get("bytes") == size, json.dumps(r))
print(subprocess.run([os.environ["TMSCTL"], "status"], capture_output=True, text=True).stdout, flush=True)
report("importer reads while the exporter is paused", ask(importer, "check shared 7") == "ok")
report("importer writes while the exporter is paused", ask(importer, "fill shared 8") == "ok")
report("importer closes", ask(importer, "close") == "ok")
r = tmsctl("resume", *me)
report("resume", r[0].get("ok"), json.dumps(r))
report("shared buffer holds the importer's last write", ask(exporter, "check shared 8") == "ok")
report("private buffer intact", ask(exporter, "check private 2") == "ok")
r = tmsctl("pause", *me)
report("once closed, the pause moves both", r[0].get("ok") and r[0].get("bytes") == 2 * size, json.dumps(r))
report("opening while the exporter is paused is refused", ask(importer, "open") == "err 800")
r = tmsctl("resume", *me)
report("resume", r[0].get("ok"), json.dumps(r))
report("the same handle opens the resumed memory", ask(importer, "open") == "ok")
report("and reads it", ask(importer, "check shared 8") == "ok")
ask(importer, "close")
ask(importer, "exit")
ask(exporter, "exit")
importer.wait()
exporter.wait()
