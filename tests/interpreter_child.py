"""The Triton interpreter's checks (`kernel_checks.py`) in one child process, started as soon as the
session's tests are collected (conftest.py) so that its work, about 1.8 minutes of one core's Python
on 2 cores, runs beside the rest of the suite instead of inside test_triton_kernels.py's turn.

The child runs with TRITON_INTERPRET=1, which Triton reads when the kernels are defined (hence a
process of its own), and one thread: the interpreter is single-threaded Python, and the other core
is the suite's."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import pytest

ROOT = Path(__file__).resolve().parents[1]
MODULE = "test_triton_kernels.py"


@dataclass
class Child:
    process: subprocess.Popen
    output: IO[str]  # a file, not a pipe: a pipe nobody reads would stall the child once full
    specs: list[str]


CHILD = pytest.StashKey[Child]()


def specs_of(items: list[pytest.Item]) -> list[str]:
    """The checks the selected tests of MODULE ask for: their `spec` parameters."""
    return [
        callspec.params["spec"]
        for item in items
        if item.path.name == MODULE
        and (callspec := getattr(item, "callspec", None))
        and "spec" in callspec.params
    ]


def start(specs: list[str]) -> Child:
    env = {
        **os.environ,
        "TRITON_INTERPRET": "1",
        "PYTHONPATH": str(ROOT),
        "OMP_NUM_THREADS": "1",
        "TORCHINDUCTOR_COMPILE_THREADS": "1",
    }
    output = tempfile.TemporaryFile("w+")
    process = subprocess.Popen(
        [sys.executable, str(ROOT / "tests" / "kernel_checks.py"), "--each", *specs],
        cwd=ROOT,
        env=env,
        stdout=output,
        stderr=subprocess.STDOUT,
        text=True,
    )
    return Child(process, output, specs)


def results(child: Child) -> dict[str, str]:
    """spec → "" where the check passed, else its output (`kernel_checks.run_each`); a spec without a
    line (the child died first) gets its exit status and the output's end, never "" (an empty
    output must not pass)."""
    child.process.wait()
    child.output.seek(0)
    out = child.output.read()
    died = f"no result: the child exited with {child.process.returncode}\n{out[-3000:]}"
    found = dict.fromkeys(child.specs, died)
    found |= dict.fromkeys(re.findall(r"^OK (.+)$", out, re.M), "")
    for spec, trace in re.findall(r"^FAILED ([^\n]+)\n(.*?)^END \1$", out, re.M | re.S):
        found[spec] = trace
    return found


def stop(child: Child) -> None:
    if child.process.poll() is None:  # the session ended early (a failure with -x, ^C)
        child.process.kill()
        child.process.wait()
    child.output.close()
