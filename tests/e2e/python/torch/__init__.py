# SPDX-License-Identifier: Apache-2.0
"""A fake `torch` for the tests of tmsdisk's start-up module: only torch.cuda's memory calls."""
from . import cuda  # noqa: F401  (as the real torch, importing torch loads torch.cuda)
