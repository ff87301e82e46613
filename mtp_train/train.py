"""Train a draft head on a precomputed store, or on states the target computes in the job (`train.states`).

    python -m mtp_train.train model=smollm2_135m                       # one process (CPU or GPU)
    accelerate launch --config_file launch/accelerate/zero2_8gpu.yaml -m mtp_train.train model=llama3_1_8b

Global micro-batch g (a pure function of the store and the seed) goes to rank g mod world, so a
run on N processes with accumulation A sees the same samples per optimizer step as one process
with accumulation N·A, and a resumed run continues from its step number.
"""

from __future__ import annotations

# ruff: noqa: E402  (the imports below come after `--help` is answered)
from mtp_train.cli import answer_help_first

answer_help_first(__name__, __file__)  # before torch & co.: they take seconds to import

import json
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import hydra
import torch
from accelerate import Accelerator
from omegaconf import OmegaConf

from inference_ref.head_spec import HeadSpec
from inference_ref.target import frozen_target_tensors
from mtp_train import checkpoint
from mtp_train.batching import DraftBatch, MicroBatchPlan, collate, prefetched
from mtp_train.cli import one_line_errors
from mtp_train.config import ModelConfig, RunConfig, TrainConfig, checked
from mtp_train.data import check_holdout_unseen
from mtp_train.heads import MTPHead, build
from mtp_train.locks import exclusive
from mtp_train.losses import DraftObjective, LossWeights
from mtp_train.progress import Progress
from mtp_train.run import Run, Target, head_spec, refuse_static_fp8, resolve_run
from mtp_train.states import OnlineStates, StoreStates
from mtp_train.states import choose as choose_states
from mtp_train.store import Store

TrainingStates = StoreStates | OnlineStates
from mtp_train.validate.during_training import DuringTraining, eval_prompts


def build_head(
    model: ModelConfig, target: Target, frozen_dtype: torch.dtype, states: TrainingStates | None = None
) -> MTPHead:
    """A fresh head on the target's frozen embeddings, final norm and lm_head (read by name only).
    A draft vocabulary is the training data's most frequent supervised tokens (`states`)."""
    spec = head_spec(model, target.config, target.dir)
    frozen = {k: v.to(frozen_dtype) for k, v in frozen_target_tensors(target.dir).items()}
    draft_ids = None
    if spec.draft_vocab_size:
        if states is None:
            raise ValueError("a head with a draft vocabulary needs the training data to count tokens in")
        draft_ids = states.most_frequent_tokens(spec.draft_vocab_size, spec.target.vocab_size)
    head = build(spec, frozen, draft_ids)
    if model.init_from_target_mtp:
        from mtp_train.heads.deepseek_v2 import shipped_mtp_state

        head.load_state_dict(shipped_mtp_state(target.dir, spec.target, spec.mlp), strict=True)
    return head


def configure_deepspeed(acc: Accelerator, tc) -> None:
    """Fill the DeepSpeed JSON's "auto" values from the Hydra config, the one source of truth.
    The micro-batch "size" is one packed token-budget batch."""
    plugin = acc.state.deepspeed_plugin
    if plugin is not None:
        plugin.deepspeed_config.update(
            gradient_accumulation_steps=tc.grad_accum,
            gradient_clipping=tc.grad_clip,
            train_micro_batch_size_per_gpu=1,
        )


def warmup_cosine(warmup: int, total: int, min_ratio: float):
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def trained_steps(spec: HeadSpec, tc: TrainConfig) -> tuple[int, float]:
    """Steps trained per position and the loss weight ratio of consecutive ones: the chained kinds'
    `unroll_steps` and `unroll_decay`; a block drafter's every mask row, row j weighted
    exp(−(j − 1)/γ) (DFlash's decay, `train.dflash_gamma`)."""
    if not spec.kind.blocks:
        return tc.unroll_steps, tc.unroll_decay
    gamma = tc.dflash_gamma or dflash_gamma(spec.block_size)
    return spec.block_size - 1, math.exp(-1 / gamma)


def dflash_gamma(block_size: int) -> float:
    """The DFlash paper's γ for a block size, as SpecForge's and ModelOpt's help give it: 7 for 16,
    5 for 10, 4 for 8 (and below)."""
    return 7.0 if block_size >= 16 else 5.0 if block_size >= 10 else 4.0


def micro_batches(
    t: Training, states: TrainingStates, start: int, device: torch.device
) -> Iterator[DraftBatch]:
    """This data-parallel rank's micro-batches from optimizer step `start` on. Global micro-batch
    g = (step · accum + micro) · dp_size + dp_rank: the ranks of a tensor-parallel group (online
    states) take the same ones, which they forward together. From a store they are built on two
    background threads (reads, alignment, pinned host memory) while the GPU runs the current step;
    online with the target whole, the next one's forward on one background thread (the GPU queues
    it beside the step; a SmolLM2 head sharing an H200 with three others had waited 40 % of its
    time for its data);
    online with the target sharded, in this thread, in step with the group's collectives."""
    tc = t.tc
    plan = MicroBatchPlan(states.lengths, tc.tokens_per_micro_batch, tc.seed)
    pin = device.type == "cuda" and not states.on_device

    def load(g: int) -> DraftBatch:
        batch = collate(states.samples(plan.samples(g)), t.steps)
        return batch.pin_memory() if pin else batch

    first = start * tc.grad_accum
    keys = (m * t.dp_size + t.dp_rank for m in range(first, tc.steps * tc.grad_accum))
    if states.kind == "online":
        if states.sharded:  # the forward's collectives stay in step with the group's
            return map(load, keys)
        return prefetched(load, keys, depth=1, workers=1)  # the next forward while this step trains
    # two builders: one did not keep up with a 65 ms step on one host (docs/benchmarks.md)
    return prefetched(load, keys, depth=3, workers=2)


@dataclass
class Training:
    """What the step loop works on, built by `set_up`."""

    acc: Accelerator
    objective: torch.nn.Module
    """The head inside its loss (`DraftObjective`), prepared by accelerate (DeepSpeed when configured)."""
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    tc: TrainConfig
    steps: int = 1
    """Steps trained per position (`trained_steps`)."""
    dp_rank: int = 0
    dp_size: int = 1
    """This process's data-parallel place: every process, or with online states its tensor-parallel group."""
    identity: dict | None = None
    """What the run was made with, recorded in its checkpoints (`run_identity`)."""
    autocast: torch.dtype | None = None
    """The dtype the step's forward autocasts to (`train.precision`; None: the parameters' own)."""
    data: dict | None = None
    """The data config the training samples were made with: the store's, or `cfg.data` online."""

    @property
    def param_dtype(self) -> torch.dtype:
        return next(self.acc.unwrap_model(self.objective).head.parameters()).dtype


def prepare_training(acc: Accelerator, head: MTPHead, tc: TrainConfig) -> Training:
    """The objective, AdamW and its warmup-cosine schedule around `head`, prepared by accelerate."""
    steps, decay = trained_steps(head.spec, tc)
    compiled = tc.compile_loss and acc.device.type == "cuda"
    objective = DraftObjective(head, LossWeights(tc.w_p, tc.w_h), tc.loss_chunk_logits, decay, compiled)
    optimizer = torch.optim.AdamW(
        head.parameters(), lr=tc.lr, betas=tuple(tc.betas), weight_decay=tc.weight_decay
    )
    # The schedule is stepped once per optimizer step by us, not per process by accelerate.
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, warmup_cosine(tc.warmup_steps, tc.steps, tc.min_lr_ratio)
    )
    configure_deepspeed(acc, tc)
    objective, optimizer = acc.prepare(objective, optimizer)
    return Training(acc, objective, optimizer, scheduler, tc, steps, autocast=autocast_dtype(acc, tc))


def autocast_dtype(acc: Accelerator, tc: TrainConfig) -> torch.dtype | None:
    """What `train.precision` asks of a run without DeepSpeed: bf16 autocast over fp32 parameters
    (their fp32 copy is the master weights AdamW updates), or plain fp32. Under DeepSpeed the
    parameters themselves are bf16 (ZeRO keeps the fp32 master copy), as its JSON says."""
    if acc.state.deepspeed_plugin is not None:
        if tc.precision != "auto":
            raise ValueError(
                f"train.precision={tc.precision} is for runs without DeepSpeed: under DeepSpeed its "
                "JSON's bf16 section decides (launch/accelerate/deepspeed/*.json); leave train.precision=auto"
            )
        return None
    if tc.precision == "auto":  # a CPU without AMX runs bf16 matmuls slower than fp32
        return torch.bfloat16 if acc.device.type == "cuda" else None
    return torch.bfloat16 if tc.precision == "bf16" else None


def train_step(t: Training, batches: Iterator[DraftBatch]) -> tuple[list, torch.Tensor, float]:
    """One optimizer step over `grad_accum` micro-batches. Returns each micro-batch's (loss,
    metrics, tokens), the gradient norm, and the seconds spent waiting for the loader."""
    stats, waited, grad_norm = [], 0.0, None
    for _ in range(t.tc.grad_accum):
        asked = time.perf_counter()
        batch = next(batches)
        waited += time.perf_counter() - asked
        batch = batch.to(t.acc.device, t.param_dtype)
        with t.acc.accumulate(t.objective):
            # Backward outside autocast: each op's gradient runs in the dtype its forward chose.
            with torch.autocast(t.acc.device.type, t.autocast, enabled=t.autocast is not None):
                loss, metrics = t.objective(batch)
            t.acc.backward(loss)
            if t.acc.sync_gradients:
                grad_norm = t.acc.clip_grad_norm_(t.objective.parameters(), t.tc.grad_clip)
            check_finite(t, loss, grad_norm)
            t.optimizer.step()
            t.optimizer.zero_grad()
        stats.append((loss.detach(), metrics, batch.tokens))
    t.scheduler.step()
    return stats, grad_norm, waited


def check_same_buffers(built: dict[str, torch.Tensor], head: MTPHead, ckpt: Path, data: str) -> None:
    """A head's persistent buffers (an eagle3 head's draft vocabulary, counted from the data) as
    built now must be those the checkpoint was trained with: its frozen lm_head rows follow them."""
    for name, tensor in built.items():
        if not torch.equal(tensor, head.get_buffer(name).to(tensor.device)):
            raise ValueError(
                f"checkpoint {ckpt} was trained with another {name} than {data} gives "
                "(another store?): resume with the data it was trained on, or another train.out_dir"
            )


class NonFiniteLoss(FloatingPointError):
    """Training stopped at a non-finite loss or gradient, before applying it."""


def check_finite(t: Training, loss: torch.Tensor, grad_norm: torch.Tensor | None) -> None:
    """Stop, on every process alike, before a non-finite loss or gradient reaches the weights.

    Stopping rather than skipping: a one-layer head at a sane learning rate does not overflow, so a
    NaN or inf means the run diverged (train.lr) or read damaged data, and skipped steps would hide
    either. Nothing non-finite is applied, so the checkpoints and exports written so far are intact."""
    bad = ~torch.isfinite(loss.detach().float())
    if isinstance(grad_norm, torch.Tensor):
        bad = bad | ~torch.isfinite(grad_norm.float())
    if t.acc.reduce(bad.float(), reduction="sum").item() > 0:  # one process's NaN stops them all
        raise NonFiniteLoss(
            f"training stopped: the loss is {loss.item()} (gradient norm {grad_norm}) at step "
            f"{t.scheduler.last_epoch + 1}; nothing of it was applied and the checkpoints in "
            f"{t.tc.out_dir} are intact. Lower train.lr (now {t.tc.lr:g}) or check the store."
        )


UNROLL_NOTE = 8
"""Above this many chained steps per sample, training says what it costs (engines draft k ≤ 5–8)."""


def setting_notes(cfg: RunConfig) -> list[str]:
    """Settings that are legal but rarely what was meant, in words, before any work."""
    notes = []
    if cfg.model.tp_size > 1:
        notes.append(
            f"note: model.tp_size={cfg.model.tp_size} is for the stages that run the target (regenerate, "
            "precompute, validate, training with train.states=online); the head trains data-parallel, unsharded"
        )
    if cfg.train.unroll_steps > UNROLL_NOTE:
        notes.append(
            f"note: train.unroll_steps={cfg.train.unroll_steps} runs the head {cfg.train.unroll_steps} times per "
            "sample and step (each step costs about as many single-step ones); engines draft chains of "
            f"k ≤ 5–8, and positions past k are never served"
        )
    return notes


class DeadHead(FloatingPointError):
    """Training stopped: the gradient has been exactly zero for `train.dead_steps` steps."""


class DeadHeadWatch:
    """Counts the steps in a row whose gradient norm is exactly 0. A live head's gradient is never
    exactly zero; a dead one's (saturated activations after a far too high learning rate) stays
    zero, and every further step and the export would be wasted: stop with the reason."""

    def __init__(self, tc: TrainConfig):
        self.tc, self.zero = tc, 0

    def check(self, step: int, grad_norm) -> None:
        if grad_norm is None or not self.tc.dead_steps:
            return  # (DeepSpeed's engine clips inside its step and reports no norm here)
        self.zero = self.zero + 1 if float(grad_norm) == 0.0 else 0
        if self.zero >= self.tc.dead_steps:
            raise DeadHead(
                f"training stopped at step {step}: the gradient norm has been 0 for {self.zero} steps "
                f"in a row (train.dead_steps), so the head is dead and is not exported. Lower train.lr "
                f"(now {self.tc.lr:g}); the checkpoints in {self.tc.out_dir} are kept"
            )


def set_up(cfg: RunConfig) -> tuple[Training, Run, TrainingStates, int]:
    """Resolve the run, choose and check where the states come from (`train.states`), build the
    head and its training state, and resume from the latest checkpoint. Returns the training
    state, the run, the states and the step to start from."""
    checked(cfg)
    tc = cfg.train
    if tc.validate_every or tc.spec_validate_at:  # before any step, not at the first validation
        refuse_static_fp8(cfg.model.quantization, "validation during training (train.validate_every)")
    for line in setting_notes(cfg):
        print(line, flush=True)
    # cpu=True without CUDA: otherwise accelerate ignores torchrun's ranks on a CPU-only host.
    acc = Accelerator(gradient_accumulation_steps=tc.grad_accum, cpu=not torch.cuda.is_available())
    torch.manual_seed(tc.seed)
    target = Target.resolve(cfg.model.target)
    spec = head_spec(cfg.model, target.config, target.dir)
    mode, data = choose_states(cfg, spec, target.dir, acc.print)
    # Online, the target is sharded over model.tp_size processes and the groups split the data.
    sharding = {"sharded_as": "mtp_train.train", "data_parallel": True} if mode == "online" else {}
    run = resolve_run(cfg.model, device=acc.device, **sharding)
    states = open_states(cfg, run, mode, data, spec.aux_layers)
    if spec.draft_vocab_size:  # counts every supervised token of the data: seconds per 100M tokens
        acc.print(f"train: draft vocabulary: the {spec.draft_vocab_size} most frequent supervised tokens…")
    head = build_head(cfg.model, run.target, run.dtype, states)
    states.check(head.spec, run.target.identity, acc.print if acc.is_main_process else None)  # one bar
    t = prepare_training(acc, head, tc)
    if run.ranks is not None:
        t.dp_rank, t.dp_size = run.ranks.dp_rank, run.ranks.dp_size
    else:
        t.dp_rank, t.dp_size = acc.process_index, acc.num_processes
    start = 0
    identity = run_identity(run, states, tc, t.dp_size, head)
    last = checkpoint.latest(Path(tc.out_dir), identity, acc.print) if tc.resume else None
    if last is not None:
        built = {n: b.clone() for n, b in head.named_buffers() if n in head.state_dict()}
        start = checkpoint.load(acc, last, t.objective, t.optimizer, t.scheduler)
        check_same_buffers(built, head, last, describe_data(states, tc))
        acc.print(f"resumed from {last} at step {start}")
        for line in apply_changed_settings(t, checkpoint.saved_settings(last), start):
            acc.print(line)
    t.identity = identity
    t.data = samples_data_config(cfg, states)
    if tc.validate_every or tc.spec_validate_at:  # before any step: the set-aside text must be unseen
        check_holdout_unseen(cfg.data, t.data, describe_data(states, tc))
        eval_prompts(cfg.validate)  # the prompts it answers, read now: none, or a bad file, stops here
    return t, run, states, start


def samples_data_config(cfg: RunConfig, states: TrainingStates) -> dict:
    """The data config the samples came from: the store's header, or this run's (online)."""
    if states.kind == "store":
        return states.store.manifest["data"]["config"]
    return OmegaConf.to_container(OmegaConf.structured(cfg.data), resolve=True)


def open_states(cfg: RunConfig, run: Run, mode: str, data, aux_layers: tuple[int, ...]) -> TrainingStates:
    """The chosen source: the store, or the target loaded for online states (the head's layers captured)."""
    if mode == "store":
        return StoreStates(Store(cfg.train.store_dir))
    from inference_ref.target import load_target
    from mtp_train.precompute import data_hash

    refuse_static_fp8(run.quantization, "online training (train.states=online)")
    say = print if run.main else None
    model = load_target(
        run.target.dir, run.device, run.dtype, cfg.precompute.compile, run.quantization, run.tp_mesh, say=say
    )
    if run.ranks is not None and run.ranks.main:
        r = run.ranks
        print(f"online: the target on {r.tp_size} process(es) per copy, {r.dp_size} data-parallel copies")
    sharded = run.tp_mesh is not None
    return OnlineStates(data, model, aux_layers, cfg.precompute.hidden_dtype, data_hash(data), sharded)


def describe_data(states: TrainingStates, tc: TrainConfig) -> str:
    return f"store {tc.store_dir}" if states.kind == "store" else "the data (online states)"


SETTINGS = (
    "precision",
    "lr",
    "weight_decay",
    "betas",
    "steps",
    "warmup_steps",
    "min_lr_ratio",
    "grad_clip",
    "w_p",
    "w_h",
    "unroll_steps",
    "unroll_decay",
    "dflash_gamma",
    "loss_chunk_logits",
    "dead_steps",
)
"""The training settings a checkpoint records and a resume compares with its own: each may change
on resume and takes effect from the resumed step on (the plan, head, target and store may not:
`run_identity`)."""


def training_settings(tc: TrainConfig) -> dict:
    values = {name: getattr(tc, name) for name in SETTINGS}
    return {
        k: v if v is None or isinstance(v, (bool, int, float, str)) else list(v) for k, v in values.items()
    }


def apply_changed_settings(t: Training, saved: dict, step: int) -> list[str]:
    """After loading a checkpoint: this run's settings where they differ from the checkpoint's
    (the optimizer's saved lr, weight decay and betas would otherwise win), and the schedule
    recomputed for this run's steps, warmup and lr. Returns what changed, in words."""
    now = training_settings(t.tc)
    changed = {k: (saved[k], v) for k, v in now.items() if k in saved and saved[k] != v}
    if not changed:
        return []
    before = t.scheduler.get_last_lr()[0]
    t.scheduler.base_lrs = [t.tc.lr for _ in t.scheduler.base_lrs]
    factor = t.scheduler.lr_lambdas[0](t.scheduler.last_epoch)  # this run's warmup-cosine
    for group in t.optimizer.param_groups:
        group.update(lr=t.tc.lr * factor, initial_lr=t.tc.lr, weight_decay=t.tc.weight_decay)
        group["betas"] = tuple(t.tc.betas)
    # what get_last_lr() reports until the next scheduler step (LambdaLR keeps it in `_last_lr`)
    t.scheduler._last_lr = [group["lr"] for group in t.optimizer.param_groups]
    lines = [
        f"resume: train.{k} was {a}, now {b}: applied from step {step + 1} on"
        for k, (a, b) in changed.items()
    ]
    after = t.scheduler.get_last_lr()[0]
    if after != before:
        lines.append(
            f"resume: the warmup-cosine schedule follows this run's settings (train.lr {t.tc.lr:g}, "
            f"train.steps {t.tc.steps}, train.warmup_steps {t.tc.warmup_steps}): lr at step {step} "
            f"goes {before:.3g} → {after:.3g}"
        )
    return lines


def run_identity(run: Run, states: TrainingStates, tc: TrainConfig, world: int, head: MTPHead) -> dict:
    """What an exact resume needs unchanged, recorded in every checkpoint: the target, the data
    (the store's shards, or online the tokenized data), the micro-batch plan (budget, seed,
    micro-batches per optimizer step across data-parallel ranks) and the head (its kind and shape:
    another one cannot load the checkpoint's weights)."""
    shards = states.identity
    target = {k: run.target.identity[k] for k in ("config_hash", "weights_hash", "tokenizer_hash")}
    plan = {
        "tokens_per_micro_batch": tc.tokens_per_micro_batch,
        "seed": tc.seed,
        "micro_batches": tc.grad_accum * world,
    }
    spec = json.loads(json.dumps(head.spec.to_config()))  # as state.json holds it (lists, not tuples)
    return {"target": target, "store": shards, "plan": plan, "head": spec}


def train(cfg: RunConfig) -> Path:
    """Run (or resume) training; returns the directory of the final exported head."""
    with exclusive(cfg.train.out_dir, "train.out_dir"):  # a second training there is refused
        return _train(cfg)


def _train(cfg: RunConfig) -> Path:
    tc, out_dir = cfg.train, Path(cfg.train.out_dir)
    t, run, states, start = set_up(cfg)
    batches = micro_batches(t, states, start, t.acc.device)
    progress = Progress(t.acc, cfg, total_steps=tc.steps, start_step=start)
    if start < tc.steps:  # step lines come at multiples of log_every (on a GPU the first step compiles)
        every = cfg.logging.log_every
        t.acc.print(f"train: steps {start + 1}-{tc.steps}, a line every {every} steps and at the last")
    hooks = Hooks(cfg, t, run, states.lock)
    dead = DeadHeadWatch(tc)
    for step in range(start, tc.steps):
        stats, grad_norm, waited = train_step(t, batches)
        progress.step(step + 1, stats, grad_norm, t.scheduler.get_last_lr()[0], waited)
        hooks.after_step(step + 1, progress)
        dead.check(step + 1, grad_norm)
    head_dir = export_head(t, out_dir / "head", run.target.identity, cfg, tc.steps)
    if t.acc.is_main_process and start < tc.steps:  # a rerun of a finished run keeps its figures
        write_summary(out_dir / "train_summary.json", tc.steps, progress.summary())
    if states.kind == "online":
        t.acc.print(states.cost())
    progress.close()
    return head_dir


def write_summary(path: Path, steps: int, figures: dict) -> None:
    """The run's last figures; tokens and seconds added to those of the runs it resumed."""
    earlier = json.loads(path.read_text()) if path.exists() else {}
    totals = {k: earlier.get(k, 0) + figures.get(k, 0) for k in ("tokens", "seconds")}
    path.write_text(json.dumps({"steps": steps, **figures, **totals}, indent=2))


class Hooks:
    """What runs between optimizer steps: checkpoints, intermediate exports and in-job validation."""

    def __init__(self, cfg: RunConfig, t: Training, run: Run, states_lock):
        self.cfg, self.t, self.run = cfg, t, run
        # online states: the next micro-batch's forward waits while the head is validated (a CUDA
        # graph capture must not see another thread's work)
        self.states_lock = states_lock
        self.out_dir = Path(cfg.train.out_dir)
        self.validator: DuringTraining | None = (
            None  # built at the first validation (it loads the target once)
        )

    def after_step(self, done: int, progress: Progress) -> None:
        tc, t, identity = self.cfg.train, self.t, self.run.target.identity
        if tc.save_every and (done % tc.save_every == 0 or done == tc.steps):
            settings = training_settings(t.tc)
            checkpoint.save(
                t.acc, self.out_dir, done, t.objective, t.optimizer, t.scheduler, t.identity, settings
            )
        if tc.export_every and done % tc.export_every == 0 and done != tc.steps:
            export_head(t, self.out_dir / f"head-step{done:07d}", identity, self.cfg, done)
        spec = done in tc.spec_validate_at
        if spec or (tc.validate_every and done % tc.validate_every == 0):
            head_dir = export_head(t, self.out_dir / "head-latest", identity, self.cfg, done)
            rank, world = t.acc.process_index, t.acc.num_processes
            self.validator = self.validator or DuringTraining(self.cfg, self.run, rank, world)
            with self.states_lock:
                figures = validate_in_job(t.acc, self.validator, head_dir, spec)
            if t.acc.is_main_process:
                progress.log_validation(done, figures)


def validate_in_job(acc: Accelerator, validator: DuringTraining, head_dir: Path, spec: bool) -> dict:
    """Every process validates its share of the prompts; the sums are added across processes.
    The slowest and fastest process's seconds are logged too: their difference is how long the
    fastest waited for the others."""
    started = time.perf_counter()
    sums = validator(head_dir, spec)
    seconds = torch.tensor([time.perf_counter() - started], dtype=torch.float64, device=acc.device)
    values = torch.tensor(sums.flat(), dtype=torch.float64, device=acc.device)
    totals = acc.reduce(values, reduction="sum")
    every = acc.gather(seconds)
    figures = sums.from_flat(totals.tolist()).figures()
    return {**figures, "val/seconds_max": every.max().item(), "val/seconds_min": every.min().item()}


def deepspeed_masters(acc: Accelerator, head: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The fp32 master copy of the head's trained parameters under DeepSpeed (its model holds bf16;
    ZeRO 1-3 keep the fp32 copy sharded in the optimizer), on the CPU, by parameter name; empty
    without DeepSpeed. A collective: every rank calls it, in the same parameter order."""
    if acc.state.deepspeed_plugin is None:
        return {}
    from deepspeed.utils import safe_get_full_fp32_param

    masters = {}
    for name, param in head.named_parameters():
        full = safe_get_full_fp32_param(param) if param.requires_grad else None
        if full is not None:  # None: a parameter the optimizer does not hold
            masters[name] = full.detach().cpu()
    return masters


def export_head(t: Training, out: Path, identity: dict, cfg: RunConfig, step: int) -> Path:
    """Write the head in the native format (gathering ZeRO-3 shards first). Its config records the
    run's config and the data config its samples were made with (`training.data`: validation's
    `data.holdout` is checked against it)."""
    from mtp_train.export import save_head

    acc = t.acc
    state = acc.get_state_dict(t.objective)
    head = acc.unwrap_model(t.objective).head
    masters = deepspeed_masters(acc, head)
    if acc.is_main_process:
        params = {k.removeprefix("head."): v for k, v in state.items() if k.startswith("head.")}
        params.update(masters)
        training = {"step": step, "config": OmegaConf.to_container(cfg, resolve=True), "data": t.data}
        # The weights as trained: fp32 masters (one process's parameters, DeepSpeed's optimizer
        # copy), not a bf16 model copy. `export.dtype` casts for the engines.
        dtype = next(iter(masters.values())).dtype if masters else next(head.parameters()).dtype
        save_head(head, out, identity, training, dtype, params=params)
    acc.wait_for_everyone()
    return out


@hydra.main(config_path="../recipes", config_name="config", version_base=None)
@one_line_errors
def main(cfg: RunConfig) -> None:
    started = time.time()
    head_dir = train(cfg)
    print(f"head: {head_dir}  ({time.time() - started:.0f} s)")


if __name__ == "__main__":
    main()
