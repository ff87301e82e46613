"""Hydra structured configs: one small dataclass per component, composed into `RunConfig`.

YAML under `recipes/` fills these in; a key that is not a field here is an error.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

QUANTIZATIONS = ("none", "fp8", "fp8_static")
"""`model.quantization`'s values (`fp8_static`: precompute only)."""


class ConfigError(ValueError):
    """A config value out of its range, or a key no component has: one line naming the field."""


def require(ok: bool, field_name: str, value, rule: str) -> None:
    if not ok:
        raise ConfigError(f"{field_name}={value!r}: must be {rule}")


def at_least(section: str, obj, minimum, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        require(value is None or value >= minimum, f"{section}.{name}", value, f">= {minimum}")


@dataclass
class ModelConfig:
    name: str = MISSING
    """Recipe name; also names the run directory."""
    target: str = MISSING
    """Target checkpoint: a Hugging Face directory (any kind of `inference_ref.models.TARGET_KINDS`,
    by its config.json's `model_type`), a Llama `.gguf` file, or `smollm2-135m-instruct` (demo)."""
    variant: str = "rmsnorm-restored"
    """Head architecture: `rmsnorm-restored` (default), `eagle1` (the EAGLE paper's head, for
    ablations), `eagle3` / `eagle3.1` (EAGLE-3, EAGLE-3.1) or `dflash` (a block drafter); the
    last three are for Llama-kind and Qwen3 targets and need a store made with `precompute.aux`."""
    aux_layers: list[int] | None = None
    """eagle3: the target layers whose entering states it fuses (id k = Hugging Face's
    `hidden_states[k]`); None: 2, L/2, L − 3, the layers vLLM and SGLang capture by default
    (dflash: the DFlash references' choice for `draft_layers`, `head_spec.dflash_aux_layers`)."""
    draft_layers: int = 1
    """Decoder layers. dflash: its layers (1 is SpecForge's default; its shipped recipes and
    ModelOpt use 5). eagle3 / eagle3.1: Llama layers stacked after the first, each chained step
    passing through all of them (vLLM's `Eagle3LlamaForCausalLM` serves any number; each costs a
    layer's work per draft token). The other chained kinds have one."""
    block_size: int = 8
    """dflash: tokens per block, the anchor and block_size − 1 masks: it drafts up to
    block_size − 1 tokens per verify (ModelOpt's default 8; SpecForge's 16). Ignored by the
    chained kinds."""
    mask_token_id: int | None = None
    """dflash: the token id fed at masked block positions (its frozen target embedding); None:
    the tokenizer's mask token, else its first unused embedding row, else pad, else EOS (the
    order SpecForge and speculators follow)."""
    draft_vocab_size: int | None = None
    """The draft vocabulary: the head scores only the most frequent target tokens of the training
    answers (its lm_head and loss cost shrink in proportion). None: for eagle3 32,000 on target
    vocabularies of ≥ 100k, else the whole vocabulary. The engines' eagle3 / speculators layouts
    carry it; their eagle1 / deepseek_mtp loaders score the whole vocabulary and refuse it."""

    def __post_init__(self):
        require(self.head_mlp in ("dense", "moe"), "model.head_mlp", self.head_mlp, "dense or moe")
        require(
            self.quantization in QUANTIZATIONS,
            "model.quantization",
            self.quantization,
            "none, fp8 or fp8_static",
        )
        require(
            self.dtype in ("auto", "bfloat16", "float32"),
            "model.dtype",
            self.dtype,
            "auto, bfloat16 or float32",
        )
        at_least("model", self, 1, "draft_vocab_size", "tp_size", "draft_layers")
        at_least("model", self, 2, "block_size")
        require(
            self.aux_layers is None or len(self.aux_layers) > 0,
            "model.aux_layers",
            self.aux_layers,
            "null or ids",
        )

    head_mlp: str = "dense"
    """MLP of the head's decoder layer on a DeepSeek-V2 target: `dense` (SwiGLU of the target's
    `intermediate_size`) or `moe` (the target's MoE block: router, routed and shared experts).
    Llama targets have only `dense`."""
    quantization: str = "none"
    """The target's linear maps: `none` (the model's dtype) or `fp8` (e4m3 weights with a scale per
    output channel, activations scaled per token; FP8 tensor cores on Hopper) for precompute,
    regeneration and validation alike. `fp8_static`, precompute only: one input scale per linear
    map instead of one per token (vLLM's static FP8 scheme), calibrated on the data's first
    8,192 tokens before anything is stored (1.61× bf16 at the Llama-3.1-8B
    shape against fp8's 1.56×, docs/benchmarks.md). Embeddings, lm_head and routers keep the
    model's dtype."""
    tp_size: int = 1
    """Tensor-parallel ranks the target is sharded over (`inference_ref.tensor_parallel`; Llama-layer
    kinds). Under `accelerate launch` with N processes, N / tp_size groups split precompute's and
    regeneration's data; validation runs one group (N = tp_size). Set it where the weights do not fit one
    GPU: a 70B target in bf16 needs tp_size ≥ 2 on 80 GB GPUs."""
    init_from_target_mtp: bool = False
    """Start the head from the MTP layer the target checkpoint ships (DeepSeek-V3/R1:
    `model.layers.{num_hidden_layers}.*`) instead of from random weights; needs `head_mlp: moe`."""
    dtype: str = "auto"
    """Compute dtype for the target and the frozen lm_head: `auto` (bf16 on CUDA and on CPUs with
    native bf16 matrix units, else fp32), `bfloat16`, `float32`. Head parameters stay fp32."""


@dataclass
class DataConfig:
    train_files: list[str] = field(default_factory=list)
    """Conversation files (jsonl/json/parquet) or `datasets.save_to_disk` directories."""
    max_seq_len: int = 2048
    """Token limit per rendered sample."""
    overlong: str = "truncate"
    """What to do with samples over `max_seq_len`: `truncate` or `drop` (both counted)."""
    require_assistant: bool = True
    """Error on a conversation without an assistant turn (training needs one to supervise)."""
    max_samples: int | None = None
    """Use at most this many records (after skipping `holdout`)."""
    holdout: int = 0
    """The first `holdout` records are kept out of training; when > 0 they are validation's
    teacher-forced text (else the target's answers to `validate.eval_files` are)."""

    def __post_init__(self):
        at_least("data", self, 3, "max_seq_len")  # a sample needs 3 tokens for one draft position
        at_least("data", self, 1, "max_samples")
        at_least("data", self, 0, "holdout")
        require(self.overlong in ("truncate", "drop"), "data.overlong", self.overlong, "truncate or drop")


@dataclass
class RegenerateConfig:
    prompts: list[str] = field(default_factory=list)
    """Prompt files (any format `mtp_train.data` reads); their assistant turns are replaced."""
    output: str = "${run_dir}/regenerated.jsonl"
    """Messages-format jsonl written (and appended to on resume)."""
    max_prompt_tokens: int = 1024
    """Prompts longer than this (rendered) are skipped and counted."""
    max_new_tokens: int = 512
    """Tokens generated per assistant turn."""
    temperature: float = 0.0
    """0 for greedy; otherwise sampled at this temperature."""
    batch_size: int = 64
    """Sequences decoded together."""
    limit: int | None = None
    """Regenerate at most this many records."""
    seed: int = 0
    """Sampling seed."""
    compile: bool = False
    """On CUDA, fuse the target's layers with torch.compile (`CausalLM.compile_layers`): the graphed
    decode step replays a third of the kernels and takes 0.38–0.67× the time, after 8–17 s of
    compiling up to five shape variants (docs/benchmarks.md). Off by default: a regeneration of 0.8M
    new tokens ran slower with it; by extrapolation it pays from about 3M. Ignored on CPU and for
    DeepSeek-kind targets."""
    capture: bool = False
    """Also write the training store (`precompute.store_dir`, with `precompute`'s settings) from the
    states the target computes while answering, instead of running it over the answers again in
    precompute, which then finds the store complete (`mtp_train.capture`). Needs
    `data.train_files=[<regenerate.output>]`."""
    stop_repeat: int = 0
    """Stop an answer when its last N tokens repeat an earlier N-gram of it (a loop), keeping that
    N-gram once; 0: off. At 1,024 new tokens SmolLM2-135M's capped answers were 82 % of the
    regenerated tokens and lowered the head's acceptance (docs/results.md); e.g. 32."""

    def __post_init__(self):
        at_least("regenerate", self, 1, "max_prompt_tokens", "max_new_tokens", "batch_size", "limit")
        at_least("regenerate", self, 0, "temperature", "stop_repeat")


@dataclass
class PrecomputeConfig:
    store_dir: str = "${run_dir}/store"
    """Output directory of the hidden-state store."""
    tokens_per_batch: int = 16384
    """Tokens per packed forward batch."""
    shard_tokens: int = 262_144
    """Tokens per shard file (closed at the first sample boundary past this); a rank holds up to
    three shards in host memory (≈ 6 GiB at hidden size 4096 in bf16; (1 + 3)× that with `aux`)."""
    hidden_dtype: str = "bf16"
    """Stored hidden-state dtype: `bf16`, or `fp8` (e4m3 with a per-token scale)."""
    aux: bool = False
    """Also store the states entering `model.aux_layers` (what an eagle3 head fuses), beside the
    last layer's: the store grows (1 + 3)× (disk estimate and check included)."""
    compile: bool = True
    """On CUDA, fuse each layer's elementwise chains with torch.compile (`CausalLM.compile_layers`):
    1.25× at the Llama-3.1-8B shape after a 5.9 s compile (docs/benchmarks.md). Ignored on CPU and
    for DeepSeek-kind targets (not measured there)."""

    def __post_init__(self):
        at_least("precompute", self, 1, "tokens_per_batch", "shard_tokens")
        require(
            self.hidden_dtype in ("bf16", "fp8"), "precompute.hidden_dtype", self.hidden_dtype, "bf16 or fp8"
        )


@dataclass
class TrainConfig:
    store_dir: str = "${precompute.store_dir}"
    """Store written by precompute (the same directory unless overridden)."""
    states: str = "auto"
    """Where the target's states come from: `store` (precomputed, `train.store_dir`), `online` (the
    target runs in the training job, `model.tp_size` processes per copy, for data whose store
    would not fit the disk) or `auto` (the store where there is one; else online where its
    estimate exceeds the free disk; else a request to precompute). `mtp_train.states`."""
    out_dir: str = "${run_dir}/train"
    """Checkpoints, exported heads and logs."""
    steps: int = 1000
    """Optimizer steps."""
    tokens_per_micro_batch: int = 8192
    """Token budget of one packed micro-batch per process."""
    grad_accum: int = 1
    """Micro-batches per optimizer step."""
    precision: str = "auto"
    """How a run without DeepSpeed computes: `bf16` (mixed precision: matmuls and attention in bf16
    under autocast; fp32 master weights, AdamW state, norms and the loss' softmax), `fp32`, or
    `auto` (bf16 on a GPU, fp32 on a CPU, whose bf16 is slow without AMX). Under DeepSpeed its JSON's
    `bf16` section decides and this must be `auto`."""
    lr: float = 1e-4
    """Peak learning rate."""
    min_lr_ratio: float = 0.1
    """Cosine decays to lr × this."""
    warmup_steps: int = 50
    """Linear warmup steps."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    """AdamW betas."""
    grad_clip: float = 0.5
    """Max global gradient norm."""
    dead_steps: int = 20
    """Stop, saying why, when the gradient norm has been exactly 0 for this many steps in a row:
    the head is dead (e.g. `train.lr` far too high) and more steps cannot revive it; nothing is
    exported. 0: never stop for this."""
    w_p: float = 1.0
    """Weight of the soft cross-entropy to the target's distribution."""
    w_h: float = 0.1
    """Weight of the SmoothL1 on normalized hidden states."""
    loss_chunk_logits: int = 2**27
    """Logit elements (tokens × vocab) per loss chunk: the loss' peak memory is set by this alone,
    not by the micro-batch's tokens or the vocabulary (2^27 fp32 ≈ 0.5 GiB per logits tensor)."""
    compile_loss: bool = True
    """On CUDA, fuse each loss chunk's elementwise work with torch.compile (`losses.chunk_function`):
    the step at the Llama-3.1-8B shape is faster by what docs/benchmarks.md says. Ignored on CPU."""
    unroll_steps: int = 1
    """Train k chained steps, the head consuming its own output state after the first."""
    unroll_decay: float = 0.8
    """Loss weight of chained step j is decay^(j-1)."""
    dflash_gamma: float | None = None
    """dflash: block position j's loss weight is exp(−(j − 1)/γ) (DFlash's decay; `unroll_steps`
    and `unroll_decay` do not apply: every mask of the block is trained). None: the paper's γ
    for the block size, 7 for 16, 5 for 10, 4 for 8 and below (SpecForge's and ModelOpt's help)."""
    seed: int = 0
    """Seed for data order and initialisation."""
    save_every: int = 500
    """Checkpoint every N steps (and at the end)."""
    export_every: int = 0
    """Export the head every N steps (0: only at the end)."""
    validate_every: int = 0
    """Teacher-forced validation through inference_ref every N steps (0: off)."""
    spec_validate_at: list[int] = field(default_factory=list)
    """Steps at which the full speculative-decoding validation runs."""
    resume: bool = True
    """Resume from the latest checkpoint in `out_dir` if there is one."""

    def __post_init__(self):
        require(
            self.states in ("store", "online", "auto"), "train.states", self.states, "store, online or auto"
        )
        require(
            self.precision in ("auto", "bf16", "fp32"),
            "train.precision",
            self.precision,
            "auto, bf16 or fp32",
        )
        at_least(
            "train",
            self,
            1,
            "steps",
            "tokens_per_micro_batch",
            "grad_accum",
            "loss_chunk_logits",
            "unroll_steps",
        )
        at_least("train", self, 0, "warmup_steps", "weight_decay", "w_p", "w_h", "save_every", "export_every")
        at_least("train", self, 0, "validate_every")
        require(0 < self.lr < math.inf, "train.lr", self.lr, "a positive finite number")
        require(
            self.grad_clip > 0,
            "train.grad_clip",
            self.grad_clip,
            "> 0 (a negative clip ascends the gradient)",
        )
        at_least("train", self, 0, "dead_steps")
        require(0 <= self.min_lr_ratio <= 1, "train.min_lr_ratio", self.min_lr_ratio, "in [0, 1]")
        require(0 < self.unroll_decay <= 1, "train.unroll_decay", self.unroll_decay, "in (0, 1]")
        require(
            self.dflash_gamma is None or self.dflash_gamma > 0, "train.dflash_gamma", self.dflash_gamma, "> 0"
        )
        require(self.w_p + self.w_h > 0, "train.w_p + train.w_h", self.w_p + self.w_h, "> 0")
        betas = list(self.betas)
        require(
            len(betas) == 2 and all(0 <= b < 1 for b in betas), "train.betas", betas, "two values in [0, 1)"
        )
        steps = list(self.spec_validate_at)
        require(
            all(1 <= s <= self.steps for s in steps),
            "train.spec_validate_at",
            steps,
            f"steps in 1 … {self.steps}",
        )


@dataclass
class ValidateConfig:
    head: str = "${train.out_dir}/head"
    """Exported head directory (native format): the trained head unless overridden."""
    eval_files: list[str] = field(default_factory=list)
    """Evaluation prompts (MT-bench `turns`, or any conversation file)."""
    num_prompts: int | None = None
    """Use at most this many prompts."""
    max_new_tokens: int = 256
    """Tokens generated per turn."""
    chain_lengths: list[int] = field(default_factory=lambda: [1, 2, 3, 4, 5])
    """Draft chain lengths k to measure (a verify forward processes k + 1 tokens per sequence)."""
    tree_budgets: list[int] = field(default_factory=list)
    """Draft trees to measure beside the chains, by node budget N (EAGLE-2 dynamic trees,
    `inference_ref/tree.py`; a verify forward processes N + 1 tokens per sequence, so a tree of N
    nodes costs the verify of a chain of k = N). Off by default (a CPU run has no time for them);
    on a GPU e.g. [4, 16, 32, 64] at depth 5 beside chains 1 … 5 (EAGLE's reference serves 60 nodes,
    top-k 10). Run eagerly (no CUDA graph)."""
    tree_depth: int = 5
    """The trees' depth: the most draft tokens one verify can accept."""
    tree_top_k: int = 8
    """Children each expanded tree node scores, and nodes expanded per depth (EAGLE-2's top-k: 10)."""
    temperatures: list[float] = field(default_factory=lambda: [0.0, 1.0])
    """0 for greedy; otherwise sampled with rejection sampling."""
    ssd_fan_outs: list[int] = field(default_factory=list)
    """SSD outcome prediction scored on every chain (`inference_ref/ssd.py`): the share of verifies
    whose outcome (accepted count, the target's token) an asynchronous drafter caching the draft's
    top F tokens per outcome position would have predicted, per F (e.g. [1, 4, 8, 16]). Costs one
    more draft step per verify (in the chains' timing). Off by default."""
    saguaro_factors: list[float] = field(default_factory=list)
    """SSD's Saguaro sampling: for each factor c and each sampled temperature, every chain again
    with the draft's top `saguaro_fan_out` + 1 tokens scaled by c in the distribution it drafts
    from and is verified against (the output stays the target's); reported beside the plain
    chain with its acceptance and SSD hit rates (e.g. [0.5, 0.2])."""
    saguaro_fan_out: int = 4
    """The draft tokens Saguaro sampling scales (+ the drafted one)."""
    verify_costs: list[str] = field(default_factory=list)
    """Measured step costs of target shapes (`benchmarks/results/verify_cost_<shape>.json`, from
    `benchmarks/bench_verify_cost`): the report then projects the speed-up of every chain and
    greedy tree per batch size on each shape and names the best (`mtp_train/projection.py`)."""
    batch_size: int = 16
    """Sequences decoded together."""
    cuda_graph: bool = True
    """Greedy speculative steps replayed as one CUDA graph each (on CUDA; 2.2× faster on MT-bench
    at batch 80, docs/benchmarks.md); the draft/target time split is then not measured. Ignored on
    CPU and when sampling."""
    compile: bool = False
    """On CUDA, fuse the target's layers with torch.compile, as `regenerate.compile` does (fp32
    greedy outputs stay identical, tested on the GPU). Off by default: a validation of a few
    seconds would spend longer compiling."""
    teacher_forced_samples: int = 64
    """Evaluation conversations (the prompts with the target's own greedy answers) on which the
    teacher-forced loss is computed by both code paths."""
    dtype: str = "${model.dtype}"
    """Compute dtype of the validation run. In bf16 a verify step (k+1 tokens) and a decode step
    (1 token) round differently, so greedy outputs can part on near-ties; in float32 they are
    token-identical, which is what `identical_to_target_greedy` checks."""
    engine: str = "inference_ref"
    """`inference_ref`: our loop only. `vllm`: then also the real vLLM engine (its CPU build on a
    machine without CUDA; `scripts/setup.sh` installs it) on the same prompt token ids, with the head
    exported in the `vllm` layout: its spec-decode counters and τ per chain length beside ours, the
    engine gap, and the share of answers identical to vLLM's target alone (report `engine`;
    mtp_train/validate/engine.py). Chains only: trees and SSD are this loop's."""
    engine_temperatures: list[float] | None = None
    """The temperatures the engine decodes at (default: `temperatures`)."""
    engine_target_alone: bool = True
    """Also run the engine's target alone (one more engine start) and compare its speculative
    answers with those; off, with inference_ref's target alone (equal in fp32: tests/test_vllm.py)."""
    report: str = "${run_dir}/validate/report.json"
    """JSON report path (a PNG plot is written beside it)."""
    seed: int = 0
    """Sampling seed."""

    def __post_init__(self):
        at_least("validate", self, 1, "num_prompts", "max_new_tokens", "batch_size")
        at_least("validate", self, 0, "teacher_forced_samples")
        ks, temps = list(self.chain_lengths), list(self.temperatures)
        require(len(ks) > 0 and all(k >= 1 for k in ks), "validate.chain_lengths", ks, "chain lengths >= 1")
        at_least("validate", self, 1, "tree_depth", "tree_top_k")
        pool = self.tree_top_k + (self.tree_depth - 1) * self.tree_top_k**2  # the nodes drafting scores
        budgets = list(self.tree_budgets)
        require(
            all(1 <= n <= pool for n in budgets),
            "validate.tree_budgets",
            budgets,
            f"node budgets in 1 … {pool} (top_k + (depth − 1)·top_k² at this depth and top_k)",
        )
        require(
            len(temps) > 0 and all(t >= 0 for t in temps), "validate.temperatures", temps, "temperatures >= 0"
        )
        fan_outs, factors = list(self.ssd_fan_outs), list(self.saguaro_factors)
        require(all(f >= 1 for f in fan_outs), "validate.ssd_fan_outs", fan_outs, "fan-outs >= 1")
        require(all(c > 0 for c in factors), "validate.saguaro_factors", factors, "factors > 0")
        require(
            not factors or fan_outs, "validate.saguaro_factors", factors, "set with validate.ssd_fan_outs"
        )
        at_least("validate", self, 1, "saguaro_fan_out")
        require(
            self.engine in ("inference_ref", "vllm"), "validate.engine", self.engine, "inference_ref or vllm"
        )
        engine_temps = [] if self.engine_temperatures is None else list(self.engine_temperatures)
        require(
            all(t in temps for t in engine_temps),
            "validate.engine_temperatures",
            engine_temps,
            f"some of validate.temperatures {temps} (the gap compares with our loop's run)",
        )


@dataclass
class ExportConfig:
    checkpoint: str = "${train.out_dir}/head"
    """Head to export (native format directory): the trained head unless overridden."""
    out_dir: str = "${run_dir}/export"
    """Where the exported layouts go."""
    formats: list[str] = field(default_factory=lambda: ["native"])
    """Layouts to write: `native`, and the engine layouts the head's kind lists (`HeadKind.layouts`):
    `vllm` (every kind: what tests/test_vllm.py serves), `deepseek_mtp` (restored), `eagle1`,
    `eagle3` and `speculators` (eagle3); docs/export.md."""
    store_shared: bool = False
    """Also store the embeddings and lm_head (they are normally shared with the target)."""
    dtype: str = "bfloat16"
    """Dtype of the exported tensors: `bfloat16`, `float16` or `float32`."""

    def __post_init__(self):
        require(len(self.formats) > 0, "export.formats", list(self.formats), "at least one layout")
        dtypes = ("bfloat16", "float16", "float32")
        require(self.dtype in dtypes, "export.dtype", self.dtype, f"one of {', '.join(dtypes)}")


@dataclass
class ServeConfig:
    head: str = "${export.out_dir}/vllm"
    """The exported head vLLM serves: a `vllm` export (every kind; `export.formats=[vllm]`), or an
    eagle3 head's `eagle3` / `speculators` export."""
    k: int = 3
    """Draft tokens per step (vLLM's `num_speculative_tokens`)."""
    dtype: str = "auto"
    """vLLM's `--dtype`."""
    tensor_parallel_size: int | None = None
    """vLLM's `--tensor-parallel-size` (default: `model.tp_size`)."""
    launch: bool = False
    """Run `vllm serve` (in place of this process) instead of printing the commands."""

    def __post_init__(self):
        at_least("serve", self, 1, "k")
        require(
            self.tensor_parallel_size is None or self.tensor_parallel_size >= 1,
            "serve.tensor_parallel_size",
            self.tensor_parallel_size,
            ">= 1",
        )


@dataclass
class LoggingConfig:
    wandb: str = "disabled"
    """wandb mode: `disabled`, `offline` or `online` (wandb is imported only if not disabled)."""
    project: str = "mtp-train"
    """wandb project."""
    log_every: int = 10
    """Console/wandb progress line every N steps."""

    def __post_init__(self):
        modes = ("disabled", "offline", "online")
        require(self.wandb in modes, "logging.wandb", self.wandb, f"one of {', '.join(modes)}")
        at_least("logging", self, 1, "log_every")


@dataclass
class RunConfig:
    run_dir: str = "outputs/${model.name}"
    """Everything a run writes goes under here; identical on every rank."""
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    regenerate: RegenerateConfig = field(default_factory=RegenerateConfig)
    precompute: PrecomputeConfig = field(default_factory=PrecomputeConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    validate: ValidateConfig = field(default_factory=ValidateConfig)
    export: ExportConfig = field(default_factory=ExportConfig)
    serve: ServeConfig = field(default_factory=ServeConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)


def checked(cfg: DictConfig) -> RunConfig:
    """`cfg` as the dataclasses, every value range-checked (their `__post_init__`), and refused
    with one line if it holds a key no component has (a `+key=value` override included)."""
    if isinstance(cfg, RunConfig):
        return cfg
    unknown = unknown_keys(cfg, RunConfig)
    if unknown:
        raise ConfigError(f"unknown config keys {unknown}: every field is in mtp_train/config.py")
    try:
        return OmegaConf.to_object(cfg)
    except Exception as e:  # OmegaConf wraps the __post_init__ error; show ours alone
        cause = e
        while cause.__cause__ is not None or cause.__context__ is not None:
            if isinstance(cause, ConfigError):
                break
            cause = cause.__cause__ or cause.__context__
        if isinstance(cause, ConfigError):
            raise ConfigError(str(cause)) from None
        raise


def unknown_keys(cfg: DictConfig, schema: type, prefix: str = "") -> list[str]:
    fields = {f.name: f for f in dataclasses.fields(schema)}
    out = []
    for key in cfg:
        name = f"{prefix}{key}"
        if key not in fields:
            out.append(name)
        elif dataclasses.is_dataclass(
            fields[key].default_factory() if callable(fields[key].default_factory) else None
        ):
            out += unknown_keys(cfg[key], type(fields[key].default_factory()), name + ".")
    return out


def register() -> None:
    ConfigStore.instance().store(name="run_schema", node=RunConfig)


register()
