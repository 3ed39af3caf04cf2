# SPDX-License-Identifier: Apache-2.0
# Legacy CUDA IPC as PyTorch uses it: a tensor sent to a spawned process through a
# torch.multiprocessing queue (cudaIpcGetMemHandle / cudaIpcOpenMemHandle underneath). The parent
# pauses itself from outside (tmsctl, path in TMSCTL) while the child has the tensor open: the shared
# block must stay resident and correct while a private tensor of the same size goes to disk; once the
# child has dropped it, the next pause takes both. Run under `tmsctl run` so both processes have the
# shim. Prints one "PASS ..." or "FAIL ..." line per check and "done".
# With PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, PyTorch shares the segment's own VMM handle
# (cuMemExportToShareableHandle) instead of legacy IPC: that memory stays resident for good.
#   tmsctl run --job ipc -- python3 torch_ipc.py GIB
import json
import os
import subprocess
import sys

import torch
import torch.multiprocessing as mp


def child(inbox, outbox):
    t = inbox.get()  # the shared tensor, opened through CUDA IPC
    outbox.put(("sum", t.sum().item()))
    while True:
        cmd = inbox.get()
        if cmd == "check":
            outbox.put(("sum", t.sum().item()))
        elif cmd == "add":
            t.add_(1.0)
            torch.cuda.synchronize()
            outbox.put(("ok", 0))
        elif cmd == "drop":
            del t
            torch.cuda.synchronize()
            torch.cuda.ipc_collect()
            outbox.put(("ok", 0))
        elif cmd == "exit":
            return


def tmsctl(*args):
    r = subprocess.run([os.environ["TMSCTL"], "--json", *args, "--pid", str(os.getpid())], capture_output=True, text=True)
    # One object per rank; a failure of the command itself is one object {"ok": false, "error": ...}.
    answer = json.loads(r.stdout) if r.stdout.strip() else {"ok": False, "error": r.stderr.strip()}
    return answer if isinstance(answer, list) else [{"ok": False, "message": answer.get("error", "")}]


def report(name, ok, detail=""):
    print(("PASS " if ok else "FAIL ") + name + (": " + detail if detail else ""), flush=True)
    return ok


def main():
    gib = float(sys.argv[1]) if len(sys.argv) > 1 else 1.0
    n = int(gib * (1 << 30)) // 4
    shared = torch.full((n,), 3.0, device="cuda")
    private = torch.full((n,), 5.0, device="cuda")
    torch.cuda.synchronize()
    ctx = mp.get_context("spawn")
    inbox, outbox = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=child, args=(inbox, outbox))
    p.start()
    inbox.put(shared)
    _, s = outbox.get()
    report("child reads the shared tensor", s == 3.0 * n, f"sum {s}")

    pause = tmsctl("pause")
    moved = pause[0].get("bytes", 0)
    # Only the private tensor's block moves; the shared one is open in the child.
    report("pause while shared leaves the shared block resident", pause[0].get("ok") and moved < 2 * n * 4, json.dumps(pause))
    inbox.put("check")
    _, s = outbox.get()
    report("child reads the shared tensor while the parent is paused", s == 3.0 * n, f"sum {s}")
    inbox.put("add")
    outbox.get()
    status = subprocess.run([os.environ["TMSCTL"], "status"], capture_output=True, text=True).stdout
    print(status, flush=True)
    resume = tmsctl("resume")
    report("resume", resume[0].get("ok"), json.dumps(resume))
    report("parent sees the child's writes", shared.sum().item() == 4.0 * n)
    report("private tensor intact", private.sum().item() == 5.0 * n)

    inbox.put("drop")
    outbox.get()
    pause = tmsctl("pause")
    moved = pause[0].get("bytes", 0)
    if "expandable_segments:True" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""):
        report("a segment shared by its VMM handle stays resident for good", pause[0].get("ok") and moved < 2 * n * 4,
               json.dumps(pause))
    else:
        report("after the child dropped it, the pause moves both", pause[0].get("ok") and moved >= 2 * n * 4,
               json.dumps(pause))
    resume = tmsctl("resume")
    report("resume", resume[0].get("ok"), json.dumps(resume))
    report("shared tensor intact after its own pause", shared.sum().item() == 4.0 * n)
    report("private tensor intact after the second pause", private.sum().item() == 5.0 * n)
    inbox.put("exit")
    p.join()
    print("done", flush=True)


if __name__ == "__main__":
    main()
