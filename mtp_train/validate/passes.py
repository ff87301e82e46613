"""The decoding passes validation runs through inference_ref, on the evaluation prompts with every
turn answered in order: target-only greedy decoding (the baseline and the teacher-forced text),
and speculative decoding for each draft measured (`drafts`: chains, trees, SSD and Saguaro
variants), with its counts, timing, per-category τ and report entry (`speculative_report`)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import AutoTokenizer

from inference_ref.draft import MTPDraft, check_head_fits_target, load_draft
from inference_ref.generate import generate
from inference_ref.head_files import read_native_config
from inference_ref.speculative import SSD, Chain, SpecStats, speculative_generate
from inference_ref.target import TargetModel, eos_ids, load_target
from inference_ref.tree import TreeShape
from mtp_train.data import Prompt, prompt_ids
from mtp_train.run import Run, refuse_static_fp8
from mtp_train.target_files import check_same_target


@dataclass
class Evaluator:
    """Target, draft and tokenizer loaded once, for the validation passes."""

    target: TargetModel
    draft: MTPDraft
    tokenizer: object
    eos: list[int]

    @classmethod
    def load(cls, run: Run, head_dir: Path, compile: bool = False, say=print) -> Evaluator:
        config = read_native_config(head_dir)  # a native or an eagle3/vllm export
        check_head_fits_target(config, run.target.config)  # before loading the target
        check_same_target(run.target.identity, config["target"], f"head {head_dir}")
        refuse_static_fp8(run.quantization, "validation")
        say = say if run.main else None
        target = load_target(
            run.target.dir, run.device, run.dtype, compile, run.quantization, run.tp_mesh, say=say
        )
        tokenizer = AutoTokenizer.from_pretrained(str(run.target.dir))
        eos = eos_ids(target, tokenizer)
        return cls(target, load_draft(head_dir, target), tokenizer, eos)

    def release(self) -> None:
        """Free the models (the tokenizer and EOS stay): before an engine loads the target itself."""
        self.target = self.draft = None
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


# --- speculative decoding ---------------------------------------------------------------------


def merge(total: SpecStats, part: SpecStats) -> None:
    for j in range(total.k):
        total.tried[j] += part.tried[j]
        total.accepted[j] += part.accepted[j]
    for i in range(len(total.hits)):
        total.hits[i] += part.hits[i]
    total.steps += part.steps
    total.emitted += part.emitted
    total.draft_s += part.draft_s
    total.target_s += part.target_s
    total.graphed |= part.graphed


def answer_turns(ev: Evaluator, prompts: list[Prompt], batch_size: int, answer) -> list[list[dict]]:
    """Answer every prompt's turns in order (turn 2 sees the answer to turn 1); `answer(ids, rows)`
    gives new tokens per prompt (`rows`: the prompts' indices). Returns the dialogs."""
    dialogs: list[list[dict]] = [[] for _ in prompts]
    for turn in range(max(len(p.turns) for p in prompts)):
        asking = [i for i, p in enumerate(prompts) if turn < len(p.turns)]
        for start in range(0, len(asking), batch_size):
            rows = asking[start : start + batch_size]
            ids = prompt_ids(ev.tokenizer, [dialogs[i] + prompts[i].turns[turn] for i in rows])
            for i, new in zip(rows, answer(ids, rows)):
                text = ev.tokenizer.decode([t for t in new if t not in ev.eos])
                dialogs[i] += prompts[i].turns[turn] + [{"role": "assistant", "content": text}]
    return dialogs


def timed_pass(
    ev: Evaluator, prompts, vc, generate_ids, label: str | None = None
) -> tuple[dict, list, list[list[int]]]:
    """Answer every turn with `generate_ids(ids, rows) -> new tokens per prompt`, timed; with a `label`,
    a progress bar (answers done, new tokens/s, ETA). Returns (new tokens and rate, dialogs, the
    new tokens of every answer in order)."""
    tokens: list[list[int]] = []
    bar = tqdm(total=sum(len(p.turns) for p in prompts), desc=label, unit="answer", disable=label is None)
    started = time.perf_counter()

    def answer(ids, rows):
        out = generate_ids(ids, rows)
        tokens.extend(out)
        bar.update(len(out))
        bar.set_postfix(new_tok_s=f"{sum(map(len, tokens)) / (time.perf_counter() - started):,.0f}")
        return out

    dialogs = answer_turns(ev, prompts, vc.batch_size, answer)
    seconds = time.perf_counter() - started
    bar.close()
    new_tokens = sum(map(len, tokens))
    return (
        {"new_tokens": new_tokens, "seconds": seconds, "tokens_per_s": new_tokens / seconds},
        dialogs,
        tokens,
    )


def speculative_pass(
    ev: Evaluator,
    prompts,
    shape: Chain | TreeShape,
    temperature: float,
    vc,
    seed: int,
    label: str | None = None,
    ssd: SSD | None = None,
):
    """Speculative decoding over every turn with a draft of `shape`, a chain or a tree (`ssd`: SSD's
    outcome prediction scored too): its counts and times, the dialogs and answer tokens."""
    stats = SpecStats(shape.most_accepted, fan_outs=ssd.fan_outs if ssd else ())
    generator = torch.Generator(device=ev.target.embed_tokens.weight.device).manual_seed(seed)
    per_prompt = [[0, 0, 0] for _ in prompts]

    def generate_ids(ids, rows):
        out = speculative_generate(
            ev.target,
            ev.draft,
            ids,
            vc.max_new_tokens,
            ev.eos,
            shape,
            temperature,
            generator,
            vc.cuda_graph,
            ssd,
        )
        merge(stats, out.stats)
        for i, counts in zip(rows, out.per_prompt):
            per_prompt[i] = [a + b for a, b in zip(per_prompt[i], counts)]
        return out.tokens

    timing, dialogs, tokens = timed_pass(ev, prompts, vc, generate_ids, label)
    timing["by_category"] = by_category(prompts, per_prompt)
    return stats, timing, dialogs, tokens


def by_category(prompts: list[Prompt], per_prompt: list[list[int]]) -> dict[str, dict]:
    """τ and first-draft-token acceptance per prompt category (MT-bench's eight), where the prompts
    have categories: the weak ones show."""
    sums: dict[str, list[int]] = {}
    for p, counts in zip(prompts, per_prompt):
        if p.category is not None:
            sums[p.category] = [a + b for a, b in zip(sums.get(p.category, [0, 0, 0]), counts)]
    return {
        c: {"mean_accepted_len": emitted / steps, "accept_first": first / steps, "steps": steps}
        for c, (steps, emitted, first) in sums.items()
        if steps
    }


def speculative_report(stats: SpecStats, timing: dict, shape: Chain | TreeShape) -> dict:
    """Rates and the counts behind them, the draft's shape and the verify forward's size, timing."""
    return {
        **shape.report_fields(),
        "verify_tokens": shape.verify_tokens,
        "accept_rate": stats.accept_rate,
        "mean_accepted_len": stats.mean_accepted_len,
        "counts": {
            "tried": stats.tried,
            "accepted": stats.accepted,
            "steps": stats.steps,
            "emitted": stats.emitted,
        },
        **(
            {"ssd_hit_rate": {str(f): r for f, r in stats.hit_rate.items()}, "counts_ssd_hits": stats.hits}
            if stats.fan_outs
            else {}
        ),
        **timing,
        # the eager loop's split; replayed graphs are not split (their draft_s/target_s would be the prefills')
        **({"cuda_graph": True} if stats.graphed else {"draft_s": stats.draft_s, "target_s": stats.target_s}),
    }


def target_only_pass(ev: Evaluator, prompts, vc, label: str | None = None):
    return timed_pass(
        ev, prompts, vc, lambda ids, rows: generate(ev.target, ids, vc.max_new_tokens, ev.eos), label
    )


def temperature_name(temperature: float) -> str:
    """A temperature's key in the report: `greedy`, `T=1`."""
    return "greedy" if temperature == 0 else f"T={temperature:g}"


def drafts(vc, temperature: float) -> list[tuple[str, Chain | TreeShape, SSD | None]]:
    """The drafts measured, under their report keys: each chain (`k=3`; with SSD scored where
    `ssd_fan_outs` asks), each tree (`tree n=16`), then sampled, each chain under Saguaro sampling
    per factor (`k=3 saguaro c=0.5`)."""
    trees = [TreeShape(vc.tree_depth, vc.tree_top_k, n) for n in vc.tree_budgets]
    fan_outs = tuple(vc.ssd_fan_outs)
    ssd = SSD(fan_outs) if fan_outs else None
    saguaro = [c for c in vc.saguaro_factors if temperature > 0]
    return (
        [(f"k={k}", Chain(k), ssd) for k in vc.chain_lengths]
        + [(f"tree n={t.nodes}", t, None) for t in trees]
        + [
            (f"k={k} saguaro c={c:g}", Chain(k), SSD(fan_outs, c, vc.saguaro_fan_out))
            for c in saguaro
            for k in vc.chain_lengths
        ]
    )
