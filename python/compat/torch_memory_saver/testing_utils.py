# SPDX-License-Identifier: Apache-2.0
"""The helpers TMS's example programs import (test/examples/*), so that they run unmodified."""

import torch

from torch_memory_saver.utils import is_xpu


def get_device() -> str:
    return "xpu" if is_xpu() else "cuda"


def empty_cache():
    torch.cuda.empty_cache()


def get_and_print_gpu_memory(message, gpu_id=0):
    """The device's used memory as the driver counts it (what a pause frees), printed and returned."""
    if hasattr(torch.cuda, "device_memory_used"):
        mem = torch.cuda.device_memory_used(gpu_id)
    else:
        free, total = torch.cuda.mem_get_info(gpu_id)
        mem = total - free
    print(f"GPU {gpu_id} memory: {mem / 1024 ** 3:.2f} GB ({message})")
    return mem
