"""Console progress line and optional wandb logging for the trainer (main process only)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
from omegaconf import OmegaConf


def start_wandb(cfg):
    """A wandb run, or None when `logging.wandb` is `disabled` (wandb is then never imported)."""
    mode = cfg.logging.wandb
    if mode == "disabled":
        return None
    import wandb

    return wandb.init(
        project=cfg.logging.project,
        mode=mode,
        dir=cfg.run_dir,
        name=cfg.model.name,
        config=OmegaConf.to_container(cfg, resolve=True),
    )


class Progress:
    def __init__(self, acc, cfg, total_steps: int, start_step: int):
        self.acc, self.every, self.total = acc, cfg.logging.log_every, total_steps
        self.start_step, self.started = start_step, time.time()
        self.window_tokens, self.window_start, self.window_wait = 0, time.time(), 0.0
        self.wandb = start_wandb(cfg) if acc.is_main_process else None
        self.last: dict[str, float] = {}
        self.tokens = 0  # stored tokens this process trained on since (re)start
        self.metrics_file = Path(cfg.train.out_dir) / "metrics.jsonl"  # appended to on resume
        self.metrics_file.parent.mkdir(parents=True, exist_ok=True)
        if acc.is_main_process:
            drop_steps_after(self.metrics_file, start_step)

    def step(self, step: int, stats, grad_norm, lr: float, data_wait_s: float = 0.0) -> None:
        """stats: one (loss, metrics, tokens) per micro-batch of this process; data_wait_s: how
        long this step waited for its micro-batches (the loader thread had not built them yet)."""
        self.window_wait += data_wait_s
        self.window_tokens += sum(t for _, _, t in stats)
        self.tokens += sum(t for _, _, t in stats)
        if step % self.every and step != self.total:
            return
        values = self._reduce(stats)
        elapsed = time.time() - self.window_start
        tokens = self.window_tokens * self.acc.num_processes
        values.update(
            lr=lr,
            grad_norm=float(grad_norm) if grad_norm is not None else float("nan"),
            tokens_per_s=tokens / max(elapsed, 1e-9),
            # share of the window this process spent waiting for data: 0 when the loader keeps up
            data_wait_share=self.window_wait / max(elapsed, 1e-9),
        )
        if torch.cuda.is_available():
            values["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
        self.window_tokens, self.window_start, self.window_wait = 0, time.time(), 0.0
        self.last = values
        if not self.acc.is_main_process:
            return
        done = step - self.start_step
        eta = (time.time() - self.started) / max(done, 1) * (self.total - step)
        print(
            f"step {step}/{self.total}  loss {values['loss']:.4f}  top1 {values['top1']:.3f}  "
            f"lr {lr:.2e}  {values['tokens_per_s']:,.0f} tok/s  ETA {eta / 60:.1f} min",
            flush=True,
        )
        with open(self.metrics_file, "a") as f:
            f.write(json.dumps({"step": step, **values}) + "\n")
        if self.wandb is not None:
            self.wandb.log({f"train/{k}": v for k, v in values.items()}, step=step)

    def _reduce(self, stats) -> dict[str, float]:
        """Means over micro-batches and processes; each metric weighted by its supervised count."""
        names = [k for k in stats[0][1] if not k.endswith("count")]
        rows = []
        for loss, metrics, _ in stats:
            weighted = [metrics[k].float() * metrics[_count_key(k)] for k in names]
            counts = [metrics[_count_key(k)] for k in names]
            rows.append(torch.stack([loss.float(), *weighted, *counts]))
        total = self.acc.reduce(torch.stack(rows).sum(0), reduction="sum")
        out = {"loss": float(total[0]) / (len(stats) * self.acc.num_processes)}
        for i, k in enumerate(names):
            out[k] = float(total[1 + i] / total[1 + len(names) + i].clamp(min=1))
        return out

    def log_validation(self, step: int, values: dict[str, float]) -> None:
        """Validation figures: console, metrics.jsonl and wandb (main process)."""
        shown = "  ".join(f"{k.removeprefix('val/')} {v:.4g}" for k, v in values.items() if "_pos" not in k)
        print(f"step {step} validation: {shown}", flush=True)
        with open(self.metrics_file, "a") as f:
            f.write(json.dumps({"step": step, **values}) + "\n")
        if self.wandb is not None:
            self.wandb.log(values, step=step)

    def summary(self) -> dict:
        """Last logged figures plus the tokens and time of this (possibly resumed) run."""
        return {
            **self.last,
            "tokens": self.tokens * self.acc.num_processes,
            "seconds": time.time() - self.started,
        }

    def close(self) -> None:
        if self.wandb is not None:
            self.wandb.finish()


def _count_key(metric: str) -> str:
    return metric.rsplit("/", 1)[0] + "/count" if "/" in metric else "count"


def drop_steps_after(path: Path, step: int) -> None:
    """On resume from `step`: the lines of steps after it, logged by the run that was stopped
    before its next checkpoint, go; the resumed run logs those steps again."""
    if not path.exists():
        return
    lines = path.read_text().splitlines(keepends=True)
    kept = [line for line in lines if logged_step(line) is not None and logged_step(line) <= step]
    if len(kept) != len(lines):
        tmp = path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(kept))
        tmp.replace(path)


def logged_step(line: str) -> int | None:
    """A metrics line's step; None for a line torn by a kill mid-write."""
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return None
