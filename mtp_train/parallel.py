"""Where this process sits among the launched ranks: its data-parallel group and its rank inside a
tensor-parallel group (`model.tp_size`). Under `accelerate launch` (or torchrun) with N processes,
groups of tp_size consecutive ranks shard the target (`inference_ref.tensor_parallel`) and
N / tp_size groups split the data; the first rank of each group (its leader) writes that group's
outputs, the others run the same forwards in step with it."""

from __future__ import annotations

import atexit
import os
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Ranks:
    dp_rank: int
    dp_size: int
    tp_rank: int
    tp_size: int
    device: torch.device
    tp_mesh: object | None = None
    """The one-dimensional DeviceMesh of this rank's tensor-parallel group (None at tp_size 1)."""

    @property
    def leader(self) -> bool:
        """Writes its group's outputs (stores, answers, reports)."""
        return self.tp_rank == 0

    @property
    def main(self) -> bool:
        """The first rank of all: prints and merges."""
        return self.leader and self.dp_rank == 0

    @property
    def world(self) -> int:
        return self.dp_size * self.tp_size

    def broadcast(self, obj):
        """`obj` from the group's leader, on every rank of the group."""
        return from_leader(obj, self.tp_mesh)

    def from_main(self, read):
        """`read()` called on the main rank alone and its result given to every rank: what all
        groups must agree on before they split work (e.g. what an earlier run already wrote)."""
        if self.world == 1:
            return read()
        box = [read() if self.main else None]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier()

    def sum_over_groups(self, counts, fields: tuple[str, ...]):
        """`counts` (a dataclass) with `fields` summed over the data-parallel groups (one leader
        each: the ranks of a group count the same work); the other fields are this rank's."""
        if self.dp_size == 1:
            return counts
        every = [None] * self.world
        dist.all_gather_object(every, asdict(counts) if self.leader else None)
        leaders = [c for c in every if c is not None]
        return type(counts)(**{**asdict(counts), **{f: sum(c[f] for c in leaders) for f in fields}})


def one_process(device) -> Ranks:
    """The place of a process that was launched alone."""
    return Ranks(0, 1, 0, 1, torch.device(device))


def launched_processes() -> int:
    """How many processes the launcher (torchrun, `accelerate launch`) started; 1 without one."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def from_leader(obj, tp_mesh):
    """`obj` as the first rank of the tensor-parallel group `tp_mesh` has it, on every rank of the
    group (as it is where there is no group): what a rank reads from disk before a lockstep loop."""
    if tp_mesh is None:
        return obj
    group = tp_mesh.get_group()
    box = [obj]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
    return box[0]


def launched_ranks(tp_size: int, entry: str = "mtp_train.precompute") -> Ranks:
    """This process's place, from the launcher's environment (one process: rank 0 of 1). The
    device is the rank's own GPU, or the CPU (gloo) where there is none."""
    from accelerate import PartialState
    from accelerate.utils import parse_flag_from_env

    # cpu=True where there is no GPU: otherwise accelerate ignores torchrun/`accelerate launch --cpu`
    # ranks on a CPU-only host, and every process would think it is rank 0 of 1.
    state = PartialState(cpu=parse_flag_from_env("ACCELERATE_USE_CPU") or not torch.cuda.is_available())
    world, device = state.num_processes, torch.device(state.device)
    if tp_size == 1:
        return Ranks(state.process_index, world, 0, 1, device)
    if world % tp_size:
        raise ValueError(
            f"model.tp_size={tp_size} needs a multiple of {tp_size} processes, {world} launched: "
            f"accelerate launch --num_processes {tp_size} -m {entry} … model.tp_size={tp_size}"
        )
    from inference_ref.tensor_parallel import device_mesh

    mesh = device_mesh(tp_size, device)
    atexit.register(end_process_groups)
    dp, tp = mesh["dp"], mesh["tp"]
    return Ranks(dp.get_local_rank(), dp.size(), tp.get_local_rank(), tp_size, device, tp)


def end_process_groups() -> None:
    """Destroy the process group and the mesh's subgroups while the interpreter still runs: left
    to its teardown, a rank of the 4-process regeneration test once aborted after writing
    everything (SIGABRT, "terminate called without an active exception": a gloo thread destroyed
    unjoined)."""
    if dist.is_initialized():
        dist.destroy_process_group()


def one_group(ranks: Ranks, entry: str) -> Ranks:
    """Refuse data parallelism where a stage runs one tensor-parallel group only."""
    if ranks.dp_size > 1:
        raise ValueError(
            f"{entry} runs one tensor-parallel group: launch model.tp_size processes "
            f"({ranks.tp_size}), not {ranks.dp_size * ranks.tp_size}"
        )
    return ranks
