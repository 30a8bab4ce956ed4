"""Which GPUs each job of a local plan gets (grpo_lab.launch.recipe_plan), on a machine that has
some.

One GPU per replica and the rest to the trainer (one process per GPU, FSDP2, when it has
several: grpo_lab.launch.trainer_args). With fewer GPUs than jobs they share: the trainer keeps
GPU 0 to itself when there are two or more, and the replicas split the others, each capped at
its part of the memory (`--gpu-memory-utilization`, the plan's value split between them):

    GPUs   trainer          replica-0        replica-1        (2 replicas, 0.85 by default)
    0      the CPU          the CPU          the CPU          today's plan: one thread each
    1      0, the rest      0, 0.21          0, 0.21          half the GPU left to the trainer
    2      0                1, 0.42          1, 0.42
    4      0,1 (FSDP2)      2, 0.85          3, 0.85          the blog's layout
    8      0-5 (FSDP2)      6, 0.85          7, 0.85

GPUs are named as this process sees them: `CUDA_VISIBLE_DEVICES=2,3 grpo-lab launch` plans over
GPUs 2 and 3, and `CUDA_VISIBLE_DEVICES= grpo-lab launch` plans for the CPU.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass

TRAINER_SHARE = 0.5
"""On a GPU the trainer shares with replicas (a machine with one GPU), the part of
`--gpu-memory-utilization` left to the trainer: the replicas split the rest of it."""


@dataclass(frozen=True)
class JobDevices:
    """The GPUs one job of a local plan sees."""

    gpus: tuple[str, ...]
    """Its CUDA_VISIBLE_DEVICES, one entry per GPU (the job numbers them from 0)."""
    memory_fraction: float | None = None
    """Replicas: the most of their GPU's memory they may take (`--gpu-memory-utilization`).
    None for the trainer, which takes what the replicas leave."""

    @property
    def cuda_visible_devices(self) -> str:
        return ",".join(self.gpus)


def visible_gpus() -> list[str]:
    """This machine's GPUs as a job must name them in CUDA_VISIBLE_DEVICES: the entries of this
    process's own CUDA_VISIBLE_DEVICES when it is set, else 0 .. N-1 (torch.cuda.device_count)."""
    import torch

    count = torch.cuda.device_count()
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is None:
        return [str(i) for i in range(count)]
    return [name.strip() for name in listed.split(",") if name.strip()][:count]


def assign_devices(gpus: int | Sequence[str], replicas: int,
                   gpu_memory_utilization: float = 0.85) -> dict[str, JobDevices]:
    """{"trainer": ..., "replica-0": ..., ...} for `gpus` GPUs (a count, numbered from 0, or
    their names); {} without any (every job on the CPU). `gpu_memory_utilization`: what one
    replica takes of a GPU of its own; replicas sharing a GPU split it."""
    names = [str(i) for i in range(gpus)] if isinstance(gpus, int) else list(gpus)
    if not names:
        return {}
    if len(names) > replicas:  # enough for all: a GPU per replica, the rest to the trainer
        trainer, replica_gpus = names[:-replicas], names[-replicas:]
    elif len(names) > 1:  # the trainer alone on the first, the replicas share the others
        trainer, replica_gpus = names[:1], names[1:]
    else:  # one GPU for every job
        trainer, replica_gpus = names, names
    placed = [replica_gpus[i % len(replica_gpus)] for i in range(replicas)]
    devices = {"trainer": JobDevices(tuple(trainer))}
    for i, gpu in enumerate(placed):
        fraction, sharing = gpu_memory_utilization, placed.count(gpu)
        if sharing > 1 or gpu in trainer:  # a part of the budget: 2 decimals, rounded down
            budget = gpu_memory_utilization * ((1 - TRAINER_SHARE) if gpu in trainer else 1)
            fraction = math.floor(round(100 * budget / sharing, 6)) / 100
        if fraction <= 0:
            raise ValueError(f"{sharing} replicas cannot share GPU {gpu} at "
                             f"gpu_memory_utilization {gpu_memory_utilization}")
        devices[f"replica-{i}"] = JobDevices((gpu,), fraction)
    return devices


def usable_cores() -> int:
    """CPU cores this process may run on (its affinity, where the OS says)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def threads_per_process(processes: int, cores: int | None = None) -> int:
    """OMP_NUM_THREADS of each of a GPU plan's `processes`: the cores split between them (each
    process's CPU side: tokenizing, sampling; the tensors work on its GPU)."""
    return max(1, (cores or usable_cores()) // max(1, processes))
