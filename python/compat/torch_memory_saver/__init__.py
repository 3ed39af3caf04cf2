# SPDX-License-Identifier: Apache-2.0
"""torch_memory_saver, as tmsdisk offers it: the API of torch_memory_saver (TMS) over libtmsdisk.so.

`tmsctl run --tms-compat -- CMD` puts this package first on PYTHONPATH, so that RL frameworks calling
torch_memory_saver (SGLang, slime, miles, verl) pause and resume through tmsdisk, to disk or the host
tier, with no code change. entrypoint.py says what maps to what and what is refused.
"""

from .entrypoint import TorchMemorySaver
from .hooks.mode_preload import configure_subprocess

# The global singleton, as in TMS.
torch_memory_saver = TorchMemorySaver()

__all__ = ["TorchMemorySaver", "configure_subprocess", "torch_memory_saver"]
