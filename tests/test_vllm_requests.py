"""How `vllm_engine` talks to its child process, with a stand-in child (no vLLM needed): requests
handed to a kept child while it still serves an earlier one (`start_vllm`) come back each with its
own result and its own progress lines, whichever is waited for first; a fresh child per call
does the same; a child that dies fails its request with the log's tail."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from mtp_train.serving import vllm_engine
from mtp_train.serving.vllm_engine import Run, start_vllm

# The child's protocol: `REQUEST RESULT` (one request) or `--serve` (request and result paths, a
# tab between them, one pair per line on stdin); STARTED before and FINISHED after each request
# served; the result: {"vllm_version": ..., run name: {...}}.
CHILD = r"""
import json, sys, time
from mtp_train.serving.vllm_engine import FINISHED, PROGRESS, STARTED

def serve(request_file, result_file):
    request = json.load(open(request_file))
    names = [r["name"] for r in request["runs"]]
    if "crash" in names:
        print("Traceback: the stand-in crashed", flush=True)
        sys.exit(3)
    print(f"{PROGRESS}serving {names}", flush=True)
    time.sleep(0.5)
    json.dump({"vllm_version": "stand-in", **{n: {"tokens": request["prompts"]} for n in names}},
              open(result_file, "w"))

if sys.argv[1:] == ["--serve"]:
    for line in sys.stdin:
        request_file, result_file = line.rstrip("\n").split("\t")
        print(f"{STARTED}{result_file}", flush=True)
        serve(request_file, result_file)
        print(f"{FINISHED}{result_file}", flush=True)
else:
    serve(*sys.argv[1:])
"""


@pytest.fixture
def stand_in(monkeypatch):
    monkeypatch.setattr(vllm_engine, "check_vllm", lambda: None)

    def spawn(args, engine, out, cwd, **popen):
        return subprocess.Popen(
            [sys.executable, "-c", CHILD, *args], stdout=out, stderr=subprocess.STDOUT, **popen
        )

    monkeypatch.setattr(vllm_engine, "_spawn", spawn)
    kept = vllm_engine._kept
    yield
    vllm_engine.keep_child(False)  # this test's children exit
    vllm_engine._kept = kept  # the session's (conftest) is left as it was


@pytest.mark.parametrize("keep", [True, False])
def test_requests_served_in_turn_come_back_each_with_its_own_lines(stand_in, keep, capsys):
    vllm_engine.keep_child(keep)
    first = start_vllm("target", [[1, 2]], 4, [0], [Run("a"), Run("b")])
    second = start_vllm("target", [[3]], 4, [0], [Run("c")])
    assert second.result()["c"] == {"tokens": [[3]]}  # waited for first, though asked second
    assert capsys.readouterr().out.count("[vllm] serving") == 1  # its own line, not the other's
    got = first.result()
    assert (got["a"], got["b"], "c" in got) == ({"tokens": [[1, 2]]}, {"tokens": [[1, 2]]}, False)
    assert "[vllm] serving ['a', 'b']" in capsys.readouterr().out
    assert first.result() is got  # asked again: the same answer


def test_a_child_that_dies_fails_its_request_with_the_log(stand_in):
    vllm_engine.keep_child(True)
    with pytest.raises(RuntimeError, match=r"(?s)vLLM child failed \(exit 3\).*the stand-in crashed"):
        start_vllm("target", [[1]], 4, [0], [Run("crash")]).result()
    after = start_vllm("target", [[1]], 4, [0], [Run("a")])  # a new child takes the next request
    assert json.dumps(after.result()["a"]) == '{"tokens": [[1]]}'
