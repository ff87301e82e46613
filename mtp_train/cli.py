"""What every entry point does with a mistake its user made: one line naming the file or field and
the fix, exit code 2, no traceback (`HYDRA_FULL_ERROR=1` shows it); and its `--help`, answered
before the entry point imports torch (this module imports nothing heavy); and the recipe composed
in-process (`compose_recipe`), for the demo and the tests."""

from __future__ import annotations

import errno
import functools
import os
import sys
from pathlib import Path

HELP_FLAGS = frozenset({"--help", "-h", "--hydra-help"})
RECIPES = Path(__file__).resolve().parent.parent / "recipes"


def help_asked(argv: list[str] | None = None) -> bool:
    return not HELP_FLAGS.isdisjoint(sys.argv[1:] if argv is None else argv)


def answer_help_first(module: str, file: str, usage: str | None = None) -> None:
    """Called at the top of an entry module, before its imports: when that module runs as the
    program (`module` is `__main__`) with `--help`, print the help and exit. torch, transformers
    and DeepSpeed take seconds to import (16 s on a 2-core CPU) and the help needs none of them:
    Hydra composes it from `recipes/` and `mtp_train/config.py`. `usage`: the module's own help,
    for an entry point that is not a Hydra stage."""
    if module != "__main__" or not help_asked():
        return
    if usage is not None:
        print(usage)
        sys.exit(0)
    import hydra

    import mtp_train.config  # noqa: F401  (registers the schema the recipes compose)

    def stage(cfg) -> None:  # never runs: Hydra prints the help and exits
        raise AssertionError("unreachable")

    # Hydra names the app after the task function's module: this stage's, not this one's.
    stage.__module__ = f"mtp_train.{Path(file).stem}"
    hydra.main(config_path=str(RECIPES), config_name="config", version_base=None)(stage)()


def compose_recipe(overrides: list[str]):
    """`recipes/config.yaml` composed in-process with `overrides`, as an entry point composes it from
    its command line (the demo's settings, the tests' configs)."""
    from hydra import compose, initialize_config_dir

    import mtp_train.config  # noqa: F401  (registers the schema the recipes compose)

    with initialize_config_dir(config_dir=str(RECIPES), version_base=None):
        return compose("config", overrides=overrides)


USER_ERRORS = (ValueError, FileNotFoundError, FileExistsError, FloatingPointError)
"""Raised by the stages for bad input (config values, data, stores, heads, targets): each message
names what to change. Anything else is a bug and keeps its traceback."""


def one_line_errors(main):
    @functools.wraps(main)
    def wrapped(*args, **kwargs):
        try:
            return main(*args, **kwargs)
        except Exception as e:
            message = user_error(e)
            if message is None or os.environ.get("HYDRA_FULL_ERROR") == "1":
                raise
            print(f"error: {message}\n(for the traceback: HYDRA_FULL_ERROR=1)", file=sys.stderr)
            sys.exit(2)

    return wrapped


def causes(e: BaseException | None):
    """`e` and the exceptions it was raised from (`raise … from`), outermost first."""
    while e is not None:
        yield e
        e = e.__cause__


def user_error(e: BaseException) -> str | None:
    """The one line for a user's mistake, or None for a bug (it keeps its traceback)."""
    if isinstance(e, USER_ERRORS):
        return str(e)
    full = next((c for c in causes(e) if isinstance(c, OSError) and c.errno == errno.ENOSPC), None)
    if full is not None:  # also where a writer thread's failure is raised again, wrapped (precompute)
        return (
            f"no space left on the device writing {full.filename or 'a file'}: free space or choose "
            "another directory; what was written completely before (checkpoints, store shards) is kept"
        )
    from omegaconf.errors import MissingMandatoryValue

    if isinstance(e, MissingMandatoryValue):
        key = getattr(e, "full_key", None) or "a value"
        return f"{key} is not set (it has no default): pass {key}=… on the command line"
    return None
