"""Teacher-forced parity: the head's loss and top-1 on one text computed twice, by the training
module on states from the precompute path rounded as the training store holds them
(`trainer_path`, `store_rounding`, `round_as_stored`), and by the inference draft on the target's
KV-cache states (`inference_path`); `teacher_forced` reports both and their gap. The text is the
held-out training records (`holdout_samples`) or the target's own answers (`samples_of`)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from inference_ref.causal_lm import cu_seqlens_of
from inference_ref.generate import prefill
from inference_ref.head_files import read_native_config
from inference_ref.target import TargetModel
from mtp_train.batching import align_sample, collate
from mtp_train.config import RunConfig
from mtp_train.data import Conversation, Sample, check_holdout_unseen, encode, load_samples
from mtp_train.heads import MTPHead
from mtp_train.losses import DraftObjective, LossWeights
from mtp_train.store import dequantize_fp8, quantize_fp8
from mtp_train.validate.passes import Evaluator


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
        draft_logits = ev.draft.teacher_forced_logits(hidden[:, :-1], ids[:, 1:])
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


def holdout_samples(cfg: RunConfig, ev: Evaluator, head_dir: Path) -> list[Sample]:
    """The teacher-forced text when the training data sets some aside (`data.holdout`): the first
    `validate.teacher_forced_samples` held-out records, refused where the head may have trained on
    them (the data config its config records). Empty otherwise: the text is then the target's own
    answers to the evaluation prompts."""
    if not cfg.data.holdout:
        return []
    training = read_native_config(head_dir).get("training") or {}
    # heads exported before `training.data` was recorded: the run's own data config
    trained = training.get("data") or (training.get("config") or {}).get("data") or {}
    check_holdout_unseen(cfg.data, trained, f"head {head_dir}'s training data")
    return load_samples(cfg.data, ev.tokenizer, split="holdout")[0][: cfg.validate.teacher_forced_samples]
