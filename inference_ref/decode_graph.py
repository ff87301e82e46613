"""One decode step as a CUDA graph.

At decode batch sizes a step is bound by kernel launches, not arithmetic (HF's `generate` spends
~80 ms a step at batch 64 on an H200 for a 135M model). Capturing the step once and replaying it
turns several hundred launches into one. The graph reads the token ids from a static buffer and
the cache's `lengths` tensor, which callers advance in place.
"""

from __future__ import annotations

import torch

from inference_ref.skinny_linear import recording_graph
from inference_ref.target import Cache, TargetModel


def record(step, warmups: int = 2, after_warmups=None) -> tuple[torch.cuda.CUDAGraph, object]:
    """`step()` captured as a CUDA graph, after `warmups` eager runs on a side stream (the
    allocator's pools and the kernels' choices: cuBLAS's, and the skinny maps' block shapes, which
    are timed there and never inside a capture); `after_warmups()` runs before the capture (a
    caller's state restored). Returns the graph and what the captured call returned: its output
    buffers, which each replay refills. Both runs are inside `recording_graph`, where
    `use_linear_kernel`'s in_graphs takes eager maps through the skinny kernels."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with recording_graph(), torch.cuda.stream(side):
        for _ in range(warmups):
            step()
    torch.cuda.current_stream().wait_stream(side)
    if after_warmups is not None:
        after_warmups()
    graph = torch.cuda.CUDAGraph()
    with recording_graph(), torch.cuda.graph(graph):  # records the step; runs nothing
        out = step()
    return graph, out


class DecodeStep:
    """Next-token logits [B, V] (fp32) for ids [B, new] placed after each row's committed entries.
    The step's states stay readable until the next call: `hidden` [B, new, H] before the final norm
    (widened by `capture`, see `causal_lm.widened`)."""

    def __init__(
        self,
        model: TargetModel,
        cache: Cache,
        new: int = 1,
        graph: bool | None = None,
        capture: tuple[int, ...] = (),
    ):
        self.model, self.cache, self.capture = model, cache, capture
        device = cache.lengths.device
        self.graph = None
        # A sharded target (tensor parallelism) runs eager: its collectives are not captured here.
        if graph if graph is not None else (device.type == "cuda" and model.tp_size == 1):
            self.ids = torch.zeros(cache.lengths.shape[0], new, dtype=torch.long, device=device)
            self._capture()

    def _run(self, ids: torch.Tensor, static: bool) -> torch.Tensor:
        # In a captured graph `hidden` is the graph's output buffer, which each replay refills.
        self.hidden = self.model.forward_cached(ids, self.cache, static=static, capture=self.capture)
        return self.model.logits(self.hidden[:, -1])

    @torch.inference_mode()
    def _capture(self) -> None:
        # the warm-ups' cache writes land in scratch slots
        self.graph, self.logits = record(lambda: self._run(self.ids, static=True))

    @torch.inference_mode()
    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        if self.graph is None:
            return self._run(ids, static=False)
        self.ids.copy_(ids)
        self.graph.replay()
        return self.logits
