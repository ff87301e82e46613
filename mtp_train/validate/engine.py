"""Validation through a serving engine (`validate.engine=vllm`): the head exported in the `vllm`
layout, served by the real vLLM engine (`mtp_train.serving.vllm_engine`) on exactly the prompt
token ids our passes answered (every turn, the target's own greedy answers as the earlier turns'
context), at each chain length and temperature; vLLM's spec-decode counters read back beside our
loop's, with the engine gap (DESIGN.md "Serving": the engine is the judge).

Greedy in fp32 the counts must be equal (`counts_equal`): a difference is a train/serve mismatch
(a wrong layout, another norm, another aux layer). Sampled, the two engines draw other random
numbers, so their counts differ; `tau_gap` says by how much. (vLLM 0.32's CPU build accepts far
fewer sampled drafts than our loop, its stock EAGLE-3 class included: docs/export.md.)"""

from __future__ import annotations

import tempfile
from pathlib import Path

from mtp_train.config import ConfigError
from mtp_train.export import export_layouts
from mtp_train.parallel import launched_processes
from mtp_train.run import Run
from mtp_train.serving.vllm_engine import Engine, check_vllm, run_vllm
from mtp_train.serving.vllm_engine import Run as EngineRun
from mtp_train.validate.passes import Evaluator, answer_turns, temperature_name


def check_engine(vc, tp_size: int) -> None:
    """Before any decoding: a missing engine is one line naming its install command."""
    if vc.engine == "inference_ref":
        return
    check_vllm()
    if tp_size > 1 or launched_processes() > 1:
        # our loop's tensor-parallel ranks would hold the GPUs the engine's own workers need
        raise ConfigError(
            f"validate.engine={vc.engine} runs in one process on one device (model.tp_size 1): validate "
            "a tensor-parallel target's head in vLLM itself (python -m mtp_train.serve prints the command)"
        )


def engine_temperatures(vc) -> list[float]:
    return list(vc.temperatures if vc.engine_temperatures is None else vc.engine_temperatures)


def turn_prompts(ev: Evaluator, prompts, batch_size: int, target_tokens: list[list[int]]) -> list[list[int]]:
    """The token ids of every turn's prompt in the order our passes answer them, each earlier turn
    answered with the target's own greedy answer (`target_tokens`, in that order too)."""
    asked: list[list[int]] = []
    answers = iter(target_tokens)

    def answer(ids, rows):
        asked.extend(list(map(int, i)) for i in ids)
        return [next(answers) for _ in rows]

    answer_turns(ev, prompts, batch_size, answer)
    return asked


def vllm_validation(vc, run: Run, ev: Evaluator, prompts, target_tokens, speculative: dict) -> dict:
    """vLLM's figures for every chain length and temperature of `engine_temperatures`, beside ours
    (`speculative`: the report's section of our loop)."""
    ids = turn_prompts(ev, prompts, vc.batch_size, target_tokens)
    temperatures = engine_temperatures(vc)
    dtype = str(run.dtype).removeprefix("torch.")  # validate.dtype resolved ("auto": the device's)
    with tempfile.TemporaryDirectory(prefix="validate_vllm_") as tmp:
        head = export_layouts(vc.head, run.target, ["vllm"], Path(tmp), dtype=dtype)["vllm"]
        # sampled, vLLM drafts as our loop does (from the draft's distribution, judged by p/q), so
        # that the two differ by random numbers only; its default drafts the argmax (see the docs)
        runs = [EngineRun("target")] if vc.engine_target_alone else []
        runs += [
            EngineRun(f"{temperature_name(t)} k={k}", str(head), k, t, vc.seed, draft_sampling(t))
            for k in vc.chain_lengths
            for t in temperatures
        ]
        longest = max(map(len, ids)) + vc.max_new_tokens + max(vc.chain_lengths) + 1
        engine = Engine(dtype=dtype, max_model_len=longest, max_num_seqs=vc.batch_size)
        result = run_vllm(run.target.dir, ids, vc.max_new_tokens, ev.eos, runs, engine)
    alone = result["target"]["tokens"] if vc.engine_target_alone else None
    report = {"name": "vllm", "version": result["vllm_version"], "answers": len(ids), "speculative": {}}
    if alone is not None:
        report["target_only"] = {
            "identical_to_inference_ref": share_identical(alone, target_tokens),
            "seconds": result["target"]["generate_s"],
        }
    for t in temperatures:
        name = temperature_name(t)
        for k in vc.chain_lengths:
            theirs = result[f"{name} k={k}"]
            figures = engine_figures(theirs)
            greedy = t == 0
            figures["identical_to_vllm_target"] = (
                share_identical(theirs["tokens"], alone) if greedy and alone is not None else None
            )
            figures["identical_to_inference_ref_target"] = (
                share_identical(theirs["tokens"], target_tokens) if greedy else None
            )
            figures["gap"] = engine_gap(speculative[name][f"k={k}"]["counts"], figures["counts"])
            report["speculative"].setdefault(name, {})[f"k={k}"] = figures
    return report


def draft_sampling(temperature: float) -> str:
    return "greedy" if temperature == 0 else "probabilistic"


def engine_figures(run: dict) -> dict:
    """Rates and τ from vLLM's counters: drafts (= verify steps), accepted tokens per position."""
    drafts, accepted = run["num_drafts"], run["accepted_per_pos"]
    tried = [drafts] + accepted[:-1]  # token j is judged where tokens < j were accepted
    return {
        "counts": {"num_drafts": drafts, "accepted_per_pos": accepted},
        "accept_rate": [a / n if n else float("nan") for a, n in zip(accepted, tried)],
        "mean_accepted_len": tau(drafts, accepted),
        "draft_sampling": run["draft_sampling"],
        "seconds": run["generate_s"],
    }


def tau(steps: int, accepted: list[int]) -> float:
    """Tokens per verify step: the accepted draft tokens plus the target's own token."""
    return 1 + sum(accepted) / steps if steps else float("nan")


def engine_gap(ours: dict, theirs: dict) -> dict:
    """Our loop's counts against the engine's: equal or not, and the τ difference (engine − ours)."""
    steps, accepted = ours["tried"][0], ours["accepted"]
    return {
        "counts_equal": steps == theirs["num_drafts"] and accepted == theirs["accepted_per_pos"],
        "ours": {"num_drafts": steps, "accepted_per_pos": accepted},
        "tau_ours": tau(steps, accepted),
        "tau_gap": tau(theirs["num_drafts"], theirs["accepted_per_pos"]) - tau(steps, accepted),
    }


def share_identical(a: list[list[int]], b: list[list[int]]) -> float:
    return sum(x == y for x, y in zip(a, b)) / max(1, len(b))
