# SPDX-License-Identifier: Apache-2.0
"""configure_subprocess(): subprocesses started inside get libtmsdisk.so preloaded, as TMS's get its own."""

import os
from contextlib import contextmanager

from torch_memory_saver.utils import _import_tmsdisk, change_env


@contextmanager
def configure_subprocess():
    """LD_PRELOAD names libtmsdisk.so while inside (it already does under `tmsctl run`, inherited)."""
    tmsdisk = _import_tmsdisk()
    lib = (tmsdisk.library_path() if tmsdisk.loaded() else None) or os.environ.get("TMSDISK_LIBRARY")
    if not lib:
        raise tmsdisk.NotLoadedError(
            "torch_memory_saver.configure_subprocess()",
            "libtmsdisk.so is not loaded in this process and TMSDISK_LIBRARY is not set: run the program under "
            "`tmsctl run --tms-compat -- CMD`",
        )
    current = os.environ.get("LD_PRELOAD", "")
    if lib in current.split(":"):
        new = current
    else:
        new = f"{lib}:{current}" if current else lib
    with change_env("LD_PRELOAD", new):
        yield
