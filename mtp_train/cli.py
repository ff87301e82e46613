"""What every entry point does with a mistake its user made: one line naming the file or field and
the fix, exit code 2, no traceback (`HYDRA_FULL_ERROR=1` shows it)."""

from __future__ import annotations

import functools
import os
import sys

USER_ERRORS = (ValueError, FileNotFoundError, FileExistsError, FloatingPointError)
"""Raised by the stages for bad input (config values, data, stores, heads, targets): each message
names what to change. Anything else is a bug and keeps its traceback."""


def one_line_errors(main):
    @functools.wraps(main)
    def wrapped(*args, **kwargs):
        try:
            return main(*args, **kwargs)
        except USER_ERRORS as e:
            if os.environ.get("HYDRA_FULL_ERROR") == "1":
                raise
            print(f"error: {e}\n(for the traceback: HYDRA_FULL_ERROR=1)", file=sys.stderr)
            sys.exit(2)

    return wrapped
