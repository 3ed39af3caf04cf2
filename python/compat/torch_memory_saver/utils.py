# SPDX-License-Identifier: Apache-2.0
"""Helpers of tmsdisk's torch_memory_saver, with TMS's public ones (change_env, is_xpu)."""

import logging
import os
import sys
from contextlib import contextmanager
from functools import lru_cache

logger = logging.getLogger(__name__)

_TRUE = ("1", "true", "TRUE", "yes", "YES")
_FALSE = ("0", "false", "FALSE", "no", "NO")


def bool_env(name):
    """A TMS_* flag as TMS reads it: unset is false; a value it does not know is refused (TMS exits)."""
    value = os.environ.get(name)
    if value is None or value in _FALSE:
        return False
    if value in _TRUE:
        return True
    raise ValueError("%s=%r is not one of %s" % (name, value, ", ".join(_TRUE + _FALSE)))


def _import_tmsdisk():
    """The `tmsdisk` package: on the path already (tmsctl run puts it there), else beside this one.

    `tmsctl run --tms-compat --keep-torch-cache` leaves tmsdisk's directory off PYTHONPATH; this package
    lies in its tms-compat/ subdirectory, in the build tree and installed alike.
    """
    try:
        import tmsdisk
    except ImportError:
        python_dir = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        if not os.path.isfile(os.path.join(python_dir, "tmsdisk", "__init__.py")):
            raise
        sys.path.append(python_dir)
        import tmsdisk
    return tmsdisk


@lru_cache(maxsize=1)
def is_xpu() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return hasattr(torch, "xpu") and torch.xpu.is_available()


# private utils, not to be used by end users (as in TMS; its tests use it)
@contextmanager
def change_env(key: str, value: str):
    old_value = os.environ.get(key)
    os.environ[key] = value
    logger.debug("change_env set key=%s value=%s", key, value)
    try:
        yield
    finally:
        assert os.environ[key] == value
        if old_value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = old_value
        logger.debug("change_env restore key=%s value=%s", key, old_value)
