"""Where this process stands in a ``torch.distributed`` job, and the collectives the
data-parallel fit uses.

One process is a group of size 1 (``ProcessGroup(0, 1, "none")``): every collective here
is then the identity, so the data-parallel code path is the only one. Rank r of P holds
the contiguous rows ``training.numerics.shard_bounds`` gives it; ``gather_rows`` all-gathers
per-rank rows into the full (N, ...) tensor; ``broadcast_from_rank0`` and ``agreed_flags`` make
every rank see rank 0's numbers, so rounding can never make ranks take different branches
(a mismatched collective would hang the job). The data-parallel objective built on them is
``training.optim.sharded_problem``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from training.numerics import shard_bounds


@dataclass(frozen=True)
class ProcessGroup:
    """Where this process stands: rank, world_size and backend ("none" for one process)."""

    rank: int = 0
    world_size: int = 1
    backend: str = "none"

    @property
    def is_distributed(self) -> bool:
        """A process group is initialised (torchrun), even of one process: the data-parallel
        code path runs, so ``--nproc_per_node 1`` and 2 compute the same things."""
        return self.backend != "none"


def current_group() -> ProcessGroup:
    """The default process group when one is initialised, else a single process."""
    if dist.is_available() and dist.is_initialized():
        return ProcessGroup(dist.get_rank(), dist.get_world_size(), str(dist.get_backend()))
    return ProcessGroup()


def init_from_environment(device: str = "auto") -> ProcessGroup:
    """Join the process group ``torchrun`` describes in the environment (RANK, WORLD_SIZE,
    LOCAL_RANK, MASTER_ADDR, MASTER_PORT): NCCL when this rank trains on CUDA, gloo on CPU.
    Without those variables (no torchrun), nothing happens: a single process.

    On CUDA each rank takes the GPU of its LOCAL_RANK, so device "auto" / "cuda" means that
    one."""
    if dist.is_available() and dist.is_initialized():
        return current_group()
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return ProcessGroup()
    use_cuda = device != "cpu" and torch.cuda.is_available()
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    backend = "nccl" if use_cuda else "gloo"
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if restart is None:
        dist.init_process_group(backend)
        return current_group()
    # torchrun restarted the world (--max-restarts): its agent's store outlives the last
    # world and still holds that world's addresses, which a new world would read and fail to
    # connect to. Each world's keys go under a prefix of its own.
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world_size,
        is_master=False,
        timeout=timedelta(minutes=30),
    )
    prefixed = dist.PrefixStore(f"nca-knn/world{restart}", store)
    dist.init_process_group(backend, store=prefixed, rank=rank, world_size=world_size)
    return current_group()


def gather_rows(local: torch.Tensor, n: int, group: ProcessGroup) -> torch.Tensor:
    """Concatenate every rank's row shard (N_r, ...) in rank order -> (N, ...).

    all_gather needs equal sizes: shards are padded to the largest and trimmed after."""
    if not group.is_distributed:
        return local
    bounds = [shard_bounds(n, r, group.world_size) for r in range(group.world_size)]
    largest = max(stop - start for start, stop in bounds)
    padded = local.new_zeros((largest, *local.shape[1:]))
    padded[: local.shape[0]] = local
    parts = [torch.empty_like(padded) for _ in bounds]
    dist.all_gather(parts, padded.contiguous())
    return torch.cat(
        [part[: stop - start] for part, (start, stop) in zip(parts, bounds, strict=True)]
    )


def broadcast_from_rank0(values: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """Rank 0's ``values`` on every rank (in place); unchanged in a single process."""
    if group.is_distributed:
        dist.broadcast(values, src=0)
    return values


def lowest_and_highest(value: int, group: ProcessGroup) -> tuple[int, int]:
    """(the smallest, the largest) of every rank's ``value`` (two all-reduces); (value,
    value) in a single process."""
    if not group.is_distributed:
        return value, value
    device = torch.device("cuda", torch.cuda.current_device()) if group.backend == "nccl" else None
    values = torch.tensor([value, -value], dtype=torch.int64, device=device)
    dist.all_reduce(values, op=dist.ReduceOp.MIN)
    return int(values[0]), -int(values[1])


def agreed_value(value: float, group: ProcessGroup) -> float:
    """Rank 0's ``value`` on every rank (the other ranks' are ignored): a choice rank 0 made
    alone from the gathered rows, which every rank then acts on. Unchanged in a single
    process."""
    if not group.is_distributed:
        return value
    device = torch.device("cuda", torch.cuda.current_device()) if group.backend == "nccl" else None
    values = torch.tensor([value], dtype=torch.float64, device=device)
    return float(broadcast_from_rank0(values, group)[0])


def agreed_flags(flags: tuple[bool, ...], group: ProcessGroup) -> tuple[bool, ...]:
    """Rank 0's ``flags`` on every rank: a decision taken by a clock (a budget spent, a
    held-out check due) must be taken by every rank at the same iteration, or their
    collectives stop matching. Unchanged in a single process."""
    if not group.is_distributed:
        return flags
    device = torch.device("cuda", torch.cuda.current_device()) if group.backend == "nccl" else None
    values = torch.tensor([int(bool(f)) for f in flags], dtype=torch.int64, device=device)
    return tuple(bool(v) for v in broadcast_from_rank0(values, group).tolist())
