"""Validate a head through the serving implementations: `python -m mtp_train.validate`.

Two measurements, both on the evaluation prompts (MT-bench by default, every turn answered in order):

- speculative decoding with inference_ref's target and draft, for each chain length k, each draft
  tree budget (EAGLE-2 dynamic trees of `validate.tree_depth`, N nodes: `validate.tree_budgets`) and
  temperature: per-position (per-depth) acceptance, mean accepted length τ, the tokens each verify
  forward processes (k + 1 or N + 1: chains and trees side by side at equal verify budgets), the
  draft/target time split, and (greedy) whether the output equals target-only greedy output;
- the teacher-forced loss and top-1 on the target's own answers, computed twice: by the training
  module on states from the precompute path (rounded on CUDA as the training store holds them, bf16
  or fp8 by its manifest; fp32 on CPU, see `store_rounding`), and by the inference draft on states from the target's
  KV-cache path. Their difference is `parity_gap`.
"""

from __future__ import annotations

# ruff: noqa: E402  (the imports below come after `--help` is answered)
from mtp_train.cli import answer_help_first

answer_help_first(__name__, __file__)  # before torch & co.: they take seconds to import

import hashlib
import json
import time
from dataclasses import astuple, dataclass, fields
from pathlib import Path

import hydra
import torch
from omegaconf import OmegaConf
from tqdm import tqdm
from transformers import AutoTokenizer

from inference_ref.causal_lm import cu_seqlens_of
from inference_ref.draft import MTPDraft, check_head_fits_target, load_draft
from inference_ref.generate import generate, prefill
from inference_ref.speculative import SSD, SpecStats, most_accepted, speculative_generate, verify_tokens
from inference_ref.target import TargetModel, load_target
from inference_ref.tree import TreeShape
from mtp_train.batching import align_sample, collate
from mtp_train.cli import one_line_errors
from mtp_train.config import ConfigError, RunConfig, checked
from mtp_train.data import Conversation, Prompt, Sample, encode, load_prompts, load_samples, prompt_ids
from mtp_train.export import load_head
from mtp_train.heads import MTPHead
from mtp_train.losses import DraftObjective, LossWeights
from mtp_train.projection import project
from mtp_train.run import Run, resolve_run
from mtp_train.store import dequantize_fp8, quantize_fp8
from mtp_train.targets import check_same_target


@dataclass
class Evaluator:
    """Target, draft and tokenizer loaded once, for the validation passes."""

    target: TargetModel
    draft: MTPDraft
    tokenizer: object
    eos: list[int]

    @classmethod
    def load(cls, run: Run, head_dir: Path, compile: bool = False) -> Evaluator:
        config = json.loads((Path(head_dir) / "config.json").read_text())
        check_head_fits_target(config, run.target.config)  # before loading the target
        check_same_target(run.target.identity, config["target"], f"head {head_dir}")
        target = load_target(run.target.dir, run.device, run.dtype, compile, run.quantization, run.tp_mesh)
        tokenizer = AutoTokenizer.from_pretrained(str(run.target.dir))
        eos = sorted({tokenizer.eos_token_id, *target.cfg.eos_token_ids} - {None})
        return cls(target, load_draft(head_dir, target), tokenizer, eos)


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
    k: int | TreeShape,
    temperature: float,
    vc,
    seed: int,
    label: str | None = None,
    ssd: SSD | None = None,
):
    """Speculative decoding over every turn with a chain of k or a tree of shape k (`ssd`: SSD's
    outcome prediction scored too): its counts and times, the dialogs and answer tokens."""
    stats = SpecStats(most_accepted(k), fan_outs=ssd.fan_outs if ssd else ())
    generator = torch.Generator(device=ev.target.embed_tokens.weight.device).manual_seed(seed)
    per_prompt = [[0, 0, 0] for _ in prompts]

    def generate_ids(ids, rows):
        out = speculative_generate(
            ev.target,
            ev.draft,
            ids,
            vc.max_new_tokens,
            ev.eos,
            k,
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


def speculative_report(stats: SpecStats, timing: dict, k: int | TreeShape) -> dict:
    """Rates and the counts behind them, the draft's shape and the verify forward's size, timing."""
    shape = (
        {"draft": "chain", "k": k}
        if isinstance(k, int)
        else {"draft": "tree", "depth": k.depth, "top_k": k.top_k, "nodes": k.nodes}
    )
    return {
        **shape,
        "verify_tokens": verify_tokens(k),
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


def drafts(vc, temperature: float) -> list[tuple[str, int | TreeShape, SSD | None]]:
    """The drafts measured, under their report keys: each chain (`k=3`; with SSD scored where
    `ssd_fan_outs` asks), each tree (`tree n=16`), then sampled, each chain under Saguaro sampling
    per factor (`k=3 saguaro c=0.5`)."""
    trees = [TreeShape(vc.tree_depth, vc.tree_top_k, n) for n in vc.tree_budgets]
    fan_outs = tuple(vc.ssd_fan_outs)
    ssd = SSD(fan_outs) if fan_outs else None
    saguaro = [c for c in vc.saguaro_factors if temperature > 0]
    return (
        [(f"k={k}", k, ssd) for k in vc.chain_lengths]
        + [(f"tree n={t.nodes}", t, None) for t in trees]
        + [
            (f"k={k} saguaro c={c:g}", k, SSD(fan_outs, c, vc.saguaro_fan_out))
            for c in saguaro
            for k in vc.chain_lengths
        ]
    )


# --- teacher-forced loss, twice -----------------------------------------------------------------


def trainer_path(head: MTPHead, target: TargetModel, samples: list[Sample], rounding: str, chunk_logits: int):
    """CE and top-1 by the training module on packed-forward states rounded to the store's dtype."""
    objective = DraftObjective(head, LossWeights(1.0, 0.0), chunk_logits, 1.0)
    ce = top1 = count = 0.0
    device, dtype = target.embed_tokens.weight.device, next(head.parameters()).dtype
    for s in samples:
        ids = torch.tensor(s.input_ids, device=device)
        hidden, _ = target.forward_packed(
            ids, cu_seqlens_of([len(ids)], device), capture=head.spec.aux_layers
        )
        hidden = round_as_stored(hidden, rounding, 1 + len(head.spec.aux_layers)).to(dtype).clone()
        sample = (ids.cpu(), torch.tensor(s.loss_mask), hidden.cpu())
        with torch.no_grad():
            _, m = objective(collate([sample], steps=1).to(device, dtype))
        n = float(m["count"])
        ce, top1, count = ce + float(m["ce"]) * n, top1 + float(m["top1"]) * n, count + n
    return {"ce": ce / max(count, 1), "top1": top1 / max(count, 1), "positions": int(count)}


@torch.inference_mode()
def inference_path(ev: Evaluator, samples: list[Sample]):
    """CE and top-1 by the serving draft on the target's KV-cache (prefill) states."""
    ce = top1 = count = 0.0
    for s in samples:
        n = len(s.input_ids)
        cache, hidden = prefill(ev.target, [s.input_ids], n, ev.draft.capture)
        ids = torch.tensor([s.input_ids], device=hidden.device)
        draft_cache = ev.draft.new_cache(1, n)
        y = ev.draft.prefill(hidden[:, :-1], ids[:, 1:], draft_cache)
        draft_logits = ev.draft.logits(y)[0]
        target_logits = ev.target.logits(hidden[0, 1:])
        vocab = ev.draft.draft_ids
        if vocab is not None:  # a draft vocabulary: the target's distribution over it, as trained
            draft_logits, target_logits = draft_logits[:, vocab], target_logits[:, vocab]
        _, _, valid = align_sample(torch.tensor(s.input_ids), torch.tensor(s.loss_mask), 0, 1)
        rows = valid[0].to(hidden.device)
        p = target_logits[rows].softmax(-1)
        ce += float(-(p * draft_logits[rows].log_softmax(-1)).sum())
        top1 += float((draft_logits[rows].argmax(-1) == target_logits[rows].argmax(-1)).sum())
        count += int(rows.sum())
    return {"ce": ce / max(count, 1), "top1": top1 / max(count, 1), "positions": int(count)}


def report_fingerprint(cfg: RunConfig) -> str:
    """What a report depends on: the head's files, the target, the validation and data settings.
    A rerun with all of them unchanged reuses the report instead of decoding again."""
    head = Path(cfg.validate.head)
    h = hashlib.sha256()
    for name in ("config.json", "head.safetensors"):
        h.update((head / name).read_bytes() if (head / name).exists() else b"")
    settings = {k: OmegaConf.to_container(cfg[k], resolve=True) for k in ("model", "validate", "data")}
    h.update(json.dumps(settings, sort_keys=True, default=str).encode())
    return h.hexdigest()[:16]


def store_rounding(cfg: RunConfig, device: torch.device) -> str:
    """How the trainer path's states are rounded: on CUDA as the training store holds them (its
    manifest's `hidden_dtype`, `bf16` or `fp8`; `precompute.hidden_dtype` before a store exists),
    and not at all (`fp32`) on CPU, where the parity tests compare the two code paths alone."""
    if device.type != "cuda":
        return "fp32"
    manifest = Path(cfg.train.store_dir) / "manifest.json"
    if manifest.exists():
        return json.loads(manifest.read_text())["hidden_dtype"]
    return cfg.precompute.hidden_dtype


def round_as_stored(hidden: torch.Tensor, rounding: str, layers: int) -> torch.Tensor:
    """`hidden` [T, L·H] after the store's encoding and decoding (`precompute.encode_hidden`)."""
    if rounding == "fp32":
        return hidden.float()
    if rounding == "bf16":
        return hidden.to(torch.bfloat16)
    return dequantize_fp8(*quantize_fp8(hidden, layers))


def teacher_forced(
    ev: Evaluator, head: MTPHead, samples: list[Sample], rounding: str, chunk_logits: int
) -> dict:
    trainer = trainer_path(head, ev.target, samples, rounding, chunk_logits)
    inference = inference_path(ev, samples)
    gap = {k: abs(trainer[k] - inference[k]) for k in ("ce", "top1")}
    return {"trainer": trainer, "inference": inference, "parity_gap": gap, "store_rounding": rounding}


def samples_of(ev: Evaluator, dialogs: list[list[dict]], limit: int, max_len: int) -> list[Sample]:
    convs = [Conversation(d, f"eval:{i}", str(i)) for i, d in enumerate(dialogs[:limit]) if d]
    return [
        Sample(s.input_ids[:max_len], s.loss_mask[:max_len], s.source) for s in encode(ev.tokenizer, convs)
    ]


def holdout_samples(cfg: RunConfig, ev: Evaluator) -> list[Sample]:
    """The teacher-forced text when the training data sets some aside (`data.holdout`): the first
    `validate.teacher_forced_samples` held-out records. Empty otherwise: the text is then the
    target's own answers to the evaluation prompts."""
    if not cfg.data.holdout:
        return []
    return load_samples(cfg.data, ev.tokenizer, split="holdout")[0][: cfg.validate.teacher_forced_samples]


# --- the report ----------------------------------------------------------------------------------


def verify_costs(path: str) -> dict:
    if not Path(path).is_file():
        raise ConfigError(
            f"validate.verify_costs: {path} does not exist (measure a shape with python -m "
            "benchmarks.bench_verify_cost; benchmarks/results/verify_cost_*.json hold the H200's)"
        )
    return json.loads(Path(path).read_text())


def run_validation(cfg: RunConfig) -> dict:
    checked(cfg)
    vc = cfg.validate
    if not vc.eval_files:
        raise ConfigError(
            "validate.eval_files is empty: name the evaluation prompts (e.g. data/mt_bench.jsonl)"
        )
    shapes = [verify_costs(path) for path in vc.verify_costs]  # before any work: a bad path fails now
    fingerprint = report_fingerprint(cfg)
    previous = Path(vc.report)
    if previous.exists() and json.loads(previous.read_text()).get("fingerprint") == fingerprint:
        print(f"validation: {previous} was made with this head and these settings; reused")
        return json.loads(previous.read_text())
    run = resolve_run(cfg.model, vc.dtype, sharded_as="mtp_train.validate")
    ev = Evaluator.load(run, Path(vc.head), vc.compile)
    prompts = load_prompts(vc.eval_files, limit=vc.num_prompts)
    baseline, base_dialogs, base_tokens = target_only_pass(ev, prompts, vc, "validate: target alone")
    report = {
        "head": str(vc.head),
        "target": str(run.target.dir),
        "eval_files": list(vc.eval_files),
        "prompts": len(prompts),
        "turns": sum(len(p.turns) for p in prompts),
        "max_new_tokens": vc.max_new_tokens,
        "batch_size": vc.batch_size,
        "target_only": baseline,
        "verify_tokens": "tokens one verify forward of the target processes per sequence: the last "
        "committed token and the drafted ones (a chain of k: k + 1; a tree of N nodes: N + 1)",
        "speculative": {},
        "fingerprint": fingerprint,
    }
    for temperature in vc.temperatures:
        name = "greedy" if temperature == 0 else f"T={temperature:g}"
        runs = report["speculative"][name] = {}
        for key, k, ssd in drafts(vc, temperature):
            label = f"validate: {name}, {key}"
            stats, timing, _, tokens = speculative_pass(ev, prompts, k, temperature, vc, vc.seed, label, ssd)
            figures = speculative_report(stats, timing, k)
            if ssd and ssd.saguaro_factor != 1.0:
                figures["saguaro"] = {"factor": ssd.saguaro_factor, "fan_out": ssd.saguaro_fan_out}
            if temperature == 0:
                figures["identical_to_target_greedy"] = tokens == base_tokens
                # in bf16 near-ties can part the texts (see validate.dtype): the share that did not
                same = sum(a == b for a, b in zip(tokens, base_tokens))
                figures["identical_answers"] = same / max(1, len(base_tokens))
            figures["speedup_vs_target_only"] = figures["tokens_per_s"] / baseline["tokens_per_s"]
            runs[key] = figures
    head = load_head(vc.head, run.target).to(device=run.device, dtype=run.dtype)
    held = holdout_samples(cfg, ev)
    samples = held or samples_of(ev, base_dialogs, vc.teacher_forced_samples, cfg.data.max_seq_len)
    rounding = store_rounding(cfg, run.device)
    report["teacher_forced"] = teacher_forced(ev, head, samples, rounding, cfg.train.loss_chunk_logits)
    report["teacher_forced"]["text"] = "data.holdout" if held else "target answers to eval_files"
    for costs in shapes:
        if "greedy" in report["speculative"]:
            report.setdefault("projected", {})[costs["shape"]] = project(report, costs)
    if run.leader:  # a tensor-parallel group's ranks hold the same report
        write_report(report, Path(vc.report))
    return report


class DuringTraining:
    """The trainer's periodic validation: the teacher-forced part every `validate_every` steps and
    the greedy speculative loop at the `spec_validate_at` steps, through inference_ref on the head
    the trainer has just exported. The target and the target's own answers to the evaluation
    prompts (the teacher-forced text) are computed once and kept.

    In a job of N processes each validates every N-th prompt and returns sums, which the trainer
    adds across processes (`figures` turns them into rates): no process waits while another
    validates, and the work is split N ways. Each process loads the target for this."""

    def __init__(self, cfg: RunConfig, run: Run, rank: int = 0, world: int = 1):
        if cfg.model.tp_size > 1:
            raise ConfigError(
                f"train.validate_every / train.spec_validate_at load the whole target on every training "
                f"process, and model.tp_size={cfg.model.tp_size} says it does not fit one GPU: validate "
                "after training (mtp_train.validate, launched as one tensor-parallel group)"
            )
        self.cfg, self.run, self.rank, self.world = cfg, run, rank, world
        self.ev: Evaluator | None = None
        vc = cfg.validate
        self.prompts = load_prompts(vc.eval_files, limit=vc.num_prompts)[rank::world]
        # Prompt m of this rank is prompt rank + m·world overall: the teacher-forced set is the
        # first `teacher_forced_samples` prompts whatever the number of processes.
        self.tf_limit = max(0, -(-(vc.teacher_forced_samples - rank) // world))
        self.samples: list[Sample] = []

    def __call__(self, head_dir: Path, spec: bool) -> ValidationSums:
        """Sums over this process's prompts (the same shape on every process)."""
        chains = self.cfg.validate.chain_lengths if spec else []
        sums = ValidationSums.empty(chains)
        if self.prompts:
            self._load(head_dir)
            sums.trainer, sums.inference = self._teacher_forced_sums(head_dir)
            for k in chains:
                sums.chains[k] = self._speculative_sums(k)
        return sums

    def _load(self, head_dir: Path) -> None:
        vc = self.cfg.validate
        if self.ev is None:
            self.ev = Evaluator.load(self.run, head_dir, vc.compile)
            _, dialogs, _ = target_only_pass(self.ev, self.prompts, vc)
            held = holdout_samples(self.cfg, self.ev)[self.rank :: self.world]
            self.samples = held or samples_of(self.ev, dialogs, self.tf_limit, self.cfg.data.max_seq_len)
        else:
            self.ev.draft = load_draft(head_dir, self.ev.target)

    def _teacher_forced_sums(self, head_dir: Path) -> tuple[PathSums, PathSums]:
        head = load_head(head_dir, self.run.target).to(device=self.run.device, dtype=self.run.dtype)
        rounding = store_rounding(self.cfg, self.run.device)
        tf = teacher_forced(self.ev, head, self.samples, rounding, self.cfg.train.loss_chunk_logits)
        return PathSums.of(tf["trainer"]), PathSums.of(tf["inference"])

    def _speculative_sums(self, k: int) -> SpecStats:
        vc = self.cfg.validate
        return speculative_pass(self.ev, self.prompts, k, 0.0, vc, vc.seed)[0]


@dataclass
class PathSums:
    """Teacher-forced sums of one code path: CE and top-1 summed over positions, and the positions."""

    ce: float = 0.0
    top1: float = 0.0
    positions: float = 0.0

    @classmethod
    def of(cls, means: dict) -> PathSums:
        n = means["positions"]
        return cls(means["ce"] * n, means["top1"] * n, n)


@dataclass
class ValidationSums:
    """One process's validation sums. Processes add theirs elementwise (`flat` / `from_flat`),
    then `figures` turns the totals into rates."""

    trainer: PathSums
    inference: PathSums
    chains: dict[int, SpecStats]
    """Greedy speculative decoding with k drafts: its counts (verify steps, tokens emitted, drafts
    tried and accepted per position) are what is added."""

    @classmethod
    def empty(cls, chains: list[int]) -> ValidationSums:
        """Zeros of the full shape: a process without prompts still takes part in the reduce."""
        return cls(PathSums(), PathSums(), {k: SpecStats(k) for k in chains})

    def flat(self) -> list[float]:
        values = [*astuple(self.trainer), *astuple(self.inference)]
        for c in self.chains.values():
            values += [c.steps, c.emitted, *c.tried, *c.accepted]
        return values

    def from_flat(self, values: list[float]) -> ValidationSums:
        """Sums of this shape holding `values` (as `flat` lays them out)."""
        it = iter(values)

        def take(n: int) -> list[float]:
            return [next(it) for _ in range(n)]

        per_path = len(fields(PathSums))
        trainer, inference = PathSums(*take(per_path)), PathSums(*take(per_path))
        chains = {k: SpecStats(k) for k in self.chains}
        for k, c in chains.items():
            c.steps, c.emitted = take(2)
            c.tried, c.accepted = take(k), take(k)
        return ValidationSums(trainer, inference, chains)

    def figures(self) -> dict[str, float]:
        """The logged figures: teacher-forced loss, top-1 and the two paths' gap; τ and per-position
        acceptance for each chain length."""

        def rate(a: float, b: float) -> float:
            return a / b if b else float("nan")

        t, i = self.trainer, self.inference
        out = {
            "val/loss": rate(i.ce, i.positions),
            "val/top1": rate(i.top1, i.positions),
            "val/parity_gap": abs(rate(t.ce, t.positions) - rate(i.ce, i.positions)),
        }
        for k, c in self.chains.items():
            out[f"val/tau_k{k}"] = c.mean_accepted_len
            for j, accepted in enumerate(c.accept_rate):
                out[f"val/accept_k{k}_pos{j + 1}"] = accepted
        return out


def write_report(report: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2))
    plot_acceptance(report, path.with_suffix(".png"))


def plot_acceptance(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes, projected = report["speculative"], report.get("projected", {})
    rows = 3 if projected else 2
    columns = max(len(modes), len(projected))
    fig, axes = plt.subplots(rows, columns, figsize=(5 * columns, 4 * rows), squeeze=False)
    for ax, (shape, figures) in zip(axes[2] if projected else [], projected.items()):
        plot_projection(ax, shape, figures)
    for ax in [
        *axes[0][len(modes) :],
        *axes[1][len(modes) :],
        *(axes[2][len(projected) :] if projected else []),
    ]:
        ax.axis("off")
    for ax, budgets, (mode, runs) in zip(axes[0], axes[1], modes.items()):
        for name, run in runs.items():
            if "saguaro" in run:
                continue  # Saguaro sampling is in the SSD lines of the summary
            rates = run["accept_rate"]
            ax.plot(
                range(1, len(rates) + 1),
                rates,
                marker="o",
                linestyle="--" if run.get("draft") == "tree" else "-",
                label=f"{name}  τ={run['mean_accepted_len']:.2f}",
            )
        ax.set(
            title=f"acceptance by position ({mode})",
            xlabel="draft position j (a tree: depth j)",
            ylabel="accept rate",
            ylim=(0, 1),
        )
        ax.legend(fontsize=8)
        plot_budgets(budgets, mode, runs)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_projection(ax, shape: str, figures: dict) -> None:
    """Projected speed-up (greedy) against batch size on a target shape, one line per draft."""
    batches = sorted(figures["speedup"], key=int)
    for draft in figures["speedup"][batches[0]]:
        ax.plot(
            [int(b) for b in batches],
            [figures["speedup"][b][draft] for b in batches],
            marker="o",
            linestyle="--" if draft.startswith("tree") else "-",
            label=draft,
        )
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xscale("log", base=2)
    ax.set(
        title=f"projected speed-up on {shape} (greedy)",
        xlabel="batch size",
        ylabel="× target-only decoding",
    )
    ax.legend(fontsize=8)


def plot_budgets(ax, mode: str, runs: dict) -> None:
    """τ against the tokens one verify forward processes: chains and trees at equal verify budgets."""
    for draft in ("chain", "tree"):
        points = sorted(
            (run["verify_tokens"], run["mean_accepted_len"])
            for run in runs.values()
            if run.get("draft", "chain") == draft and "verify_tokens" in run and "saguaro" not in run
        )
        if points:
            ax.plot(*zip(*points), marker="o", linestyle="--" if draft == "tree" else "-", label=draft)
    ax.set_xscale("log", base=2)
    ax.set(
        title=f"τ by verify budget ({mode})",
        xlabel="tokens per verify forward (chain: k + 1, tree: nodes + 1)",
        ylabel="τ (tokens per verify)",
    )
    ax.legend(fontsize=8)


def draft_words(name: str, run: dict) -> str:
    """A report entry's draft in words, with the tokens its verify forward processes."""
    if run.get("draft") == "tree":
        return (
            f"a tree of {run['nodes']} draft nodes (depth ≤ {run['depth']}, top-{run['top_k']} "
            f"expansion), {run['verify_tokens']} tokens per verify"
        )
    verify = f", {run['verify_tokens']} tokens per verify" if "verify_tokens" in run else ""
    if "saguaro" in run:
        s = run["saguaro"]
        return (
            f"k={run['k']} draft tokens per step{verify}, drafted with Saguaro sampling (the draft's "
            f"top {s['fan_out']} + 1 tokens weighted by {s['factor']:g})"
        )
    return f"{name} draft tokens per step{verify}"


def equal_budgets(mode: str, runs: dict) -> list[str]:
    """A line of τ by tokens per verify forward, chains beside trees, where the report has trees."""
    by_size: dict[int, dict[str, float]] = {}
    for run in runs.values():
        if "verify_tokens" in run and "saguaro" not in run:
            by_size.setdefault(run["verify_tokens"], {})[run.get("draft", "chain")] = run["mean_accepted_len"]
    if not any("tree" in drafts for drafts in by_size.values()):
        return []
    cells = [
        f"{size}: " + ", ".join(f"{draft} {tau:.2f}" for draft, tau in sorted(drafts.items()))
        for size, drafts in sorted(by_size.items())
    ]
    head = f"{mode}, τ by tokens per verify forward (chains and trees at equal verify budgets): "
    return [head + "; ".join(cells)]


def summary(report: dict) -> str:
    """The report in words: what each figure is, and how to read it."""
    tf = report["teacher_forced"]
    text = "held-out training records" if tf.get("text") == "data.holdout" else "the target's own answers"
    lines = [
        f"teacher-forced on {text} ({tf['inference']['positions']} positions): the head's next-token "
        f"cross-entropy {tf['inference']['ce']:.3f} against the target, top-1 agreement {tf['inference']['top1']:.3f}",
        f"  (the training code computes {tf['trainer']['ce']:.3f} / {tf['trainer']['top1']:.3f} on the same text: "
        f"train/serve gap {tf['parity_gap']['ce']:.1e}; this top-1 differs from training's, which was on training text)",
    ]
    for mode, runs in report["speculative"].items():
        for name, run in runs.items():
            rates = ", ".join(f"{r:.2f}" for r in run["accept_rate"])
            token_j = "a draft token at depth j" if run.get("draft") == "tree" else "draft token j"
            lines.append(
                f"speculative decoding, {mode}, {draft_words(name, run)}: {run['mean_accepted_len']:.2f} "
                f"tokens per target step (τ); {token_j} accepted (given the ones before): {rates}"
            )
            if run.get("identical_to_target_greedy") is not None:
                lines.append(
                    f"  output identical to the target decoding alone: {run['identical_to_target_greedy']} "
                    f"({run['identical_answers']:.0%} of answers)"
                )
            if run.get("by_category"):
                taus = ", ".join(f"{c} {v['mean_accepted_len']:.2f}" for c, v in run["by_category"].items())
                lines.append(f"  τ by prompt category: {taus}")
            if "ssd_hit_rate" in run:
                hits = ", ".join(f"F={f}: {r:.2f}" for f, r in run["ssd_hit_rate"].items())
                lines.append(
                    "  SSD: verifies whose outcome (accepted count and the target's token) is among the "
                    f"draft's top F predictions per position (an asynchronous drafter's cache hits): {hits}"
                )
            lines.append(
                f"  {run['speedup_vs_target_only']:.2f}× the target's own speed in this reference loop "
                "(on a CPU or a 135M target the loop's overheads dominate: read τ, not this, for serving)"
            )
        lines += equal_budgets(mode, runs)
    for shape, figures in report.get("projected", {}).items():
        best = ", ".join(f"batch {b}: {v}" for b, v in figures["best"].items())
        lines.append(
            f"projected on the {shape} shape's measured step costs, the best draft per batch: {best}"
        )
    return "\n".join(lines)


@hydra.main(config_path="../recipes", config_name="config", version_base=None)
@one_line_errors
def main(cfg: RunConfig) -> None:
    report = run_validation(cfg)
    if torch.distributed.is_initialized() and torch.distributed.get_rank() != 0:
        return  # the other ranks of a tensor-parallel group: the same report, printed once
    print(summary(report))
    print(f"report: {cfg.validate.report}")


if __name__ == "__main__":
    main()
