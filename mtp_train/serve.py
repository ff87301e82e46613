"""Serve the target with an exported head in vLLM: `python -m mtp_train.serve`.

Prints the `vllm serve` command and the equivalent offline `vllm.LLM(...)` arguments for
`model.target` and `serve.head` (the export's speculative method follows from its layout:
`mtp_train.serving.vllm_plugin.METHODS`), after checking that vLLM can serve the head and that it
was exported for this target; `serve.launch=true` runs the server instead.

    python -m mtp_train.export model=smollm2_135m "export.formats=[vllm]"
    python -m mtp_train.serve model=smollm2_135m serve.k=3            # the commands
    python -m mtp_train.serve model=smollm2_135m serve.launch=true    # vllm serve …

The restored and eagle1 heads load through this package's vLLM plugin (an entry point, found once
mtp-train is installed in vLLM's environment; it imports neither DeepSpeed nor Hydra); eagle3
heads through stock vLLM's EAGLE-3 class. docs/export.md "Serving in vLLM".
"""

from __future__ import annotations

# ruff: noqa: E402  (the imports below come after `--help` is answered)
from mtp_train.cli import answer_help_first

answer_help_first(__name__, __file__)

import json
import os
import shlex
import shutil

import hydra

from mtp_train.cli import RECIPES, one_line_errors
from mtp_train.config import checked
from mtp_train.run import Target
from mtp_train.serving.vllm_engine import (
    INSTALL,
    VLLMMissing,
    check_head_fits_target,
    check_k_fits_block,
    head_method,
    serve_command,
    speculative_config,
)


def serve_plan(cfg) -> dict:
    """The checked commands: {"command": `vllm serve …`, "llm_kwargs": `vllm.LLM(**…)`}."""
    sc = checked(cfg).serve
    target = Target.resolve(cfg.model.target)
    head_method(sc.head)  # a head vLLM cannot serve: named before anything starts
    check_head_fits_target(sc.head, target.dir)
    check_k_fits_block(sc.head, sc.k)
    tp = sc.tensor_parallel_size or cfg.model.tp_size
    kwargs = {
        "model": str(target.dir),
        "dtype": sc.dtype,
        "speculative_config": speculative_config(sc.head, sc.k),
    }
    if tp > 1:
        kwargs["tensor_parallel_size"] = tp
    return {"command": serve_command(target.dir, sc.head, sc.k, sc.dtype, tp), "llm_kwargs": kwargs}


def serve(cfg) -> None:
    plan = serve_plan(cfg)
    if not cfg.serve.launch:
        print(f"# the OpenAI-compatible server:\n{plan['command']}")
        print(f"# offline, in Python:\nvllm.LLM(**{json.dumps(plan['llm_kwargs'], indent=1)})")
        return
    if shutil.which("vllm") is None:
        raise VLLMMissing(f"the vllm command is not on PATH: {INSTALL}")
    argv = shlex.split(plan["command"])
    print(plan["command"], flush=True)
    os.execvp(argv[0], argv)


serve.__module__ = "mtp_train.serve"
main = hydra.main(config_path=str(RECIPES), config_name="config", version_base=None)(one_line_errors(serve))

if __name__ == "__main__":
    main()
