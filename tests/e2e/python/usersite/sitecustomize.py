# SPDX-License-Identifier: Apache-2.0
"""A site's own sitecustomize, which tmsdisk's start-up module hides on sys.path and must still run."""
import sys

sys.tmsdisk_test_user_sitecustomize_ran = True
