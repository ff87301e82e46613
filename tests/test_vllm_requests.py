"""How `vllm_engine` talks to its child process, with a stand-in for vLLM in the child's real
loop (`vllm_engine.main`; no vLLM needed): requests handed to a kept child while it still serves
an earlier one (`start_vllm`) come back each with its own result and its own progress lines,
whichever is waited for first; a fresh child per call does the same; a request that fails fails
alone, and a child that dies fails the requests queued behind it, each saying so."""

from __future__ import annotations

import subprocess
import sys

import pytest

from mtp_train.serving import vllm_engine
from mtp_train.serving.vllm_engine import Run, start_vllm

# `child` replaced: each run named in the request answered with the prompts; "raise" raises,
# "die" ends the process at once (as a crashed engine would).
CHILD = r"""
import json, os, sys, time
from mtp_train.serving import vllm_engine

def stand_in(request_file, result_file):
    request = json.load(open(request_file))
    names = [r["name"] for r in request["runs"]]
    print(f"{vllm_engine.PROGRESS}serving {names}", flush=True)
    if "die" in names:
        print("the stand-in died", flush=True)
        os._exit(3)
    if "raise" in names:
        raise RuntimeError("the stand-in raised")
    time.sleep(0.5)
    json.dump({"vllm_version": "stand-in", **{n: {"tokens": request["prompts"]} for n in names}},
              open(result_file, "w"))

vllm_engine.check_vllm = lambda: None
vllm_engine.child = stand_in
vllm_engine.main(sys.argv[1:])
"""


@pytest.fixture
def stand_in(monkeypatch):
    monkeypatch.setattr(vllm_engine, "check_vllm", lambda: None)

    def spawn(args, engine, out, cwd, **popen):
        return subprocess.Popen(
            [sys.executable, "-c", CHILD, *args], stdout=out, stderr=subprocess.STDOUT, **popen
        )

    monkeypatch.setattr(vllm_engine, "_spawn", spawn)
    monkeypatch.setattr(vllm_engine, "_kept", None)  # the session's kept children (conftest) left alone
    yield
    vllm_engine.keep_child(False)  # this test's exit


def ask(*names: str, prompts=((1, 2),)):
    return start_vllm("target", [list(p) for p in prompts], 4, [0], [Run(n) for n in names])


@pytest.mark.parametrize("keep", [True, False])
def test_requests_served_in_turn_come_back_each_with_its_own_lines(stand_in, keep, capsys):
    vllm_engine.keep_child(keep)
    first = ask("a", "b")
    second = ask("c", prompts=[[3]])
    assert second.result()["c"] == {"tokens": [[3]]}  # waited for first, though asked second
    out = capsys.readouterr().out
    assert "[vllm] serving ['c']" in out and "'a'" not in out  # its own line, not the other's
    got = first.result()
    assert (got["a"], got["b"], "c" in got) == ({"tokens": [[1, 2]]}, {"tokens": [[1, 2]]}, False)
    assert "[vllm] serving ['a', 'b']" in capsys.readouterr().out
    assert first.result() is got  # asked again: the same answer
    assert (first.log == second.log) == keep  # one log per child


def test_a_request_that_fails_fails_alone(stand_in):
    vllm_engine.keep_child(True)
    failing, after = ask("raise"), ask("a")
    with pytest.raises(
        RuntimeError, match=r"(?s)failed this request \(it serves the next\).*the stand-in raised"
    ):
        failing.result()
    assert after.result()["a"] == {"tokens": [[1, 2]]}  # the same child served it


def test_a_child_that_dies_fails_the_requests_queued_behind_it(stand_in):
    vllm_engine.keep_child(True)
    dying, queued = ask("die"), ask("a")
    with pytest.raises(RuntimeError, match=r"(?s)kept child failed \(exit 3\).*the stand-in died"):
        dying.result()
    with pytest.raises(RuntimeError, match=r"exited \(code 3\) before it served this request"):
        queued.result()
    assert ask("a").result()["a"] == {"tokens": [[1, 2]]}  # a new child takes the next request
    vllm_engine.keep_child(False)
    with pytest.raises(RuntimeError, match=r"(?s)vLLM child failed \(exit 3\).*the stand-in died"):
        ask("die").result()  # a child of its own
