# SPDX-License-Identifier: Apache-2.0
"""A PyTorch-like program for tests/e2e/test_torch_cache.cpp: tensors and a cache on the device.

    python3 torch_cache_app.py TENSOR_MIB CACHE_MIB [--no-torch]

With --no-torch it allocates the same memory without importing torch (the start-up module must then
call nothing). It prints "ready", then answers one line per command read on stdin:
  check        "ok" if every tensor holds its pattern, else "bad"
  pause-self   tmsdisk_pause() through ctypes.CDLL (the GIL released while it waits): "paused RC"
  pause-gil    the same through ctypes.PyDLL (the GIL held while it waits): "paused RC"
  resume-self  tmsdisk_resume(): "resumed RC"
  callbacks    whether this process registered the start-up module's callback: "registered yes|no"
  site         whether the sitecustomize that tmsdisk's hides ran, and is `sitecustomize`: "site yes|no"
"""
import ctypes
import sys

MiB = 1 << 20


def main():
    tensor_mib, cache_mib = int(sys.argv[1]), int(sys.argv[2])
    if "--no-torch" in sys.argv[3:]:
        import fakecuda as memory
    else:
        import torch  # noqa: F401  (the fake one, first on the test's PYTHONPATH after tmsdisk's)
        import fakecuda as memory
    memory.init()
    memory.allocate(tensor_mib * MiB, cache_mib * MiB)
    print("ready", flush=True)
    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "check":
            print("ok" if memory.tensors_intact() else "bad", flush=True)
        elif cmd == "pause-self":
            print("paused %d" % ctypes.CDLL(None).tmsdisk_pause(), flush=True)
        elif cmd == "pause-gil":
            print("paused %d" % ctypes.PyDLL(None).tmsdisk_pause(), flush=True)
        elif cmd == "resume-self":
            print("resumed %d" % ctypes.CDLL(None).tmsdisk_resume(), flush=True)
        elif cmd == "callbacks":
            startup = sys.modules.get("_tmsdisk_sitecustomize")
            registered = startup is not None and startup._CALLBACK is not None
            print("registered %s" % ("yes" if registered else "no"), flush=True)
        elif cmd == "site":
            ran = getattr(sys, "tmsdisk_test_user_sitecustomize_ran", False)
            named = getattr(sys.modules.get("sitecustomize"), "__file__", "").endswith("usersite/sitecustomize.py")
            print("site %s" % ("yes" if ran and named else "no"), flush=True)
        else:
            print("unknown command %r" % cmd, flush=True)


if __name__ == "__main__":
    main()
