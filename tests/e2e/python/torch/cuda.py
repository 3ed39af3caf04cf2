# SPDX-License-Identifier: Apache-2.0
"""The part of torch.cuda that tmsdisk's start-up module calls, over fakecuda."""
import fakecuda


def is_initialized():
    return fakecuda.is_initialized()


def empty_cache():
    fakecuda.empty_cache()


def memory_reserved():
    return fakecuda.reserved()
