# SPDX-License-Identifier: Apache-2.0
"""Training bytes for the GPU scripts' language models, deterministic and offline (the nodes have no
internet): the standard library's .py files, in sorted order, concatenated. No torch, no tmsdisk: a
script that must not load tmsdisk.optim (an unstreamed run) imports it too."""

import os
import sysconfig

#: Where the bytes come from.
ROOT = sysconfig.get_paths()["stdlib"]


def corpus(limit_bytes):
    """The first `limit_bytes` of the standard library's .py files, in sorted order."""
    names = []
    for directory, subdirs, files in os.walk(ROOT):
        subdirs[:] = sorted(d for d in subdirs if d not in ("site-packages", "dist-packages", "__pycache__"))
        names += [os.path.join(directory, f) for f in files if f.endswith(".py")]
    data = bytearray()
    for name in sorted(names):
        with open(name, "rb") as f:
            data += f.read()
        if len(data) >= limit_bytes:
            break
    return bytes(data[:limit_bytes])
