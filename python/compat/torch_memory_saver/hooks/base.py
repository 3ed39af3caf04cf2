# SPDX-License-Identifier: Apache-2.0
"""TMS's hook modes. Under tmsdisk both work alike: the shim sees the driver calls either way."""

from typing import Literal

HookMode = Literal["preload", "torch"]
