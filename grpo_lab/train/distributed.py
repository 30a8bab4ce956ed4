"""The trainer on several processes under `accelerate launch`: DDP, or FSDP2 (sharded weights).

    accelerate launch --multi_gpu --num_processes 2 -m grpo_lab.cli train ...      (DDP)
    accelerate launch --use_fsdp --fsdp_version 2 --num_processes 2 -m grpo_lab.cli train ...

`Processes` is the trainer's one view of data-parallel GRPO: each process's share of the step in
whole groups, a loss scaled so the averaged gradient is the whole step's, the main process alone
writing; with one process it is the plain one-process code (docs/internals.md, "Several
processes").
"""

from __future__ import annotations

import os
from contextlib import nullcontext

import torch

LOSS_UNITS = {"grpo": 0, "dr_grpo": 0, "dapo": 1}
"""What each aggregation normalises by: 0 = the step's sequences (GRPO's mean of per-sequence
means, Dr. GRPO's B x max_len), 1 = the step's completion tokens (DAPO's token mean)."""


def launched_processes() -> int:
    """Processes started by `accelerate launch` / torchrun (WORLD_SIZE), 1 without one."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def is_main_process() -> bool:
    """Process 0 of a launch (RANK), or the only process: known before any Accelerator exists."""
    return int(os.environ.get("RANK", "0")) == 0


def end_launched_processes() -> None:
    """Under `accelerate launch`: wait for every process, then close the process group, so that
    no process tears its connections down while another still uses them at exit (gloo aborts a
    process whose peer vanished mid-read). No-op with one process."""
    import torch.distributed as dist

    if launched_processes() > 1 and dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


class FullWeights:
    """An FSDP2 model's full state dict, gathered from every process, that saves like the model
    (`save_pretrained`): what the main process publishes and checkpoints."""

    def __init__(self, model, state_dict: dict):
        self.model, self.state_dict = model, state_dict

    def save_pretrained(self, path, **kwargs):
        return self.model.save_pretrained(path, state_dict=self.state_dict, **kwargs)


class Processes:
    """The trainer's processes: one (no Accelerator) or several (accelerate's DDP or FSDP2)."""

    def __init__(self, device: str = "auto"):
        self.accelerator = None
        if launched_processes() > 1:
            from accelerate import Accelerator

            # Under torchrun accelerate picks CUDA when it exists; on CPUs it needs `cpu=True`.
            self.accelerator = Accelerator(cpu=device == "cpu" or not torch.cuda.is_available())

    # ------------------------------------------------------------------ who am I

    @property
    def distributed(self) -> bool:
        return self.accelerator is not None

    @property
    def num_processes(self) -> int:
        return self.accelerator.num_processes if self.distributed else 1

    @property
    def index(self) -> int:
        return self.accelerator.process_index if self.distributed else 0

    @property
    def is_main(self) -> bool:
        return not self.distributed or self.accelerator.is_main_process

    @property
    def is_fsdp(self) -> bool:
        return self.distributed and bool(getattr(self.accelerator, "is_fsdp2", False))

    @property
    def device(self) -> str | None:
        """This process's device (`cuda:1`, `cpu`) under a launch; None with one process."""
        return str(self.accelerator.device) if self.distributed else None

    # ------------------------------------------------------------------ the model

    def prepare(self, model, optimizer):
        """(train_model, model, optimizer): the wrapped model that forwards and backwards for the
        loss (DDP's wrapper; FSDP2 shards the model in place), the plain module everything else
        uses (generation, evaluation, adapters), and the optimizer over the prepared weights."""
        if not self.distributed:
            return model, model, optimizer
        train_model, optimizer = self.accelerator.prepare(model, optimizer)
        return train_model, self.accelerator.unwrap_model(train_model), optimizer

    def backward(self, loss: torch.Tensor) -> None:
        if self.distributed:
            self.accelerator.backward(loss)
        else:
            loss.backward()

    def no_sync(self, train_model, sync: bool):
        """Skip the gradient all-reduce (DDP) / reduce-scatter (FSDP2) unless `sync`: one per
        optimizer step, after the last micro-batch."""
        if sync or not self.distributed:
            return nullcontext()
        return self.accelerator.no_sync(train_model)

    def clip_grad_norm_(self, params: list, max_norm: float) -> torch.Tensor:
        """The norm of the whole step's gradient (over every shard under FSDP2), clipped."""
        if self.distributed:
            return self.accelerator.clip_grad_norm_(params, max_norm)
        return torch.nn.utils.clip_grad_norm_(params, max_norm)

    def full_model(self, train_model, model):
        """Something with the model's full weights and `save_pretrained`: the model itself, or
        under FSDP2 its gathered state dict (every process must call this; None except on the
        main process)."""
        if not self.is_fsdp:
            return model
        state = self.accelerator.get_state_dict(train_model)
        return FullWeights(model, state) if self.is_main else None

    def optimizer_state(self, train_model, optimizer) -> dict:
        """The optimizer's full state dict (collective under FSDP2)."""
        if not self.is_fsdp:
            return optimizer.state_dict()
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_optimizer_state_dict,
        )

        return get_optimizer_state_dict(train_model, optimizer, options=StateDictOptions(
            full_state_dict=True, cpu_offload=True))

    def load_full_state(self, train_model, optimizer, weights: dict, optimizer_state: dict):
        """FSDP2: load full (unsharded) weights and optimizer state, as a checkpoint holds them,
        into the shards. PEFT saves LoRA weights without the adapter's name: put it back."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        names = set(train_model.state_dict())
        for key in list(weights):
            for part in (".lora_A.", ".lora_B."):
                named = key.replace(part, part + "default.")
                if key not in names and named in names:
                    weights[named] = weights.pop(key)
        options = StateDictOptions(full_state_dict=True, strict=False)
        set_model_state_dict(train_model, weights, options=options)
        set_optimizer_state_dict(train_model, optimizer, optimizer_state, options=options)

    # ------------------------------------------------------------------ samples and numbers

    def share(self, items: list) -> list:
        """This process's contiguous share of `items` (the same list on every process)."""
        if not self.distributed:
            return items
        with self.accelerator.split_between_processes(items) as mine:
            return list(mine)

    def scatter(self, shares: list[list] | None) -> list:
        """From the main process's list of one share per process, this process's share."""
        if not self.distributed:
            return shares[0]
        from accelerate.utils import broadcast_object_list

        return broadcast_object_list([shares], from_process=0)[0][self.index]

    def broadcast(self, value):
        """The main process's `value`, on every process."""
        if not self.distributed:
            return value
        from accelerate.utils import broadcast_object_list

        return broadcast_object_list([value], from_process=0)[0]

    def gather(self, value) -> list:
        """Every process's `value`, in process order, on every process."""
        if not self.distributed:
            return [value]
        from accelerate.utils import gather_object

        return gather_object([value])

    def sum(self, values: list[float]) -> list[float]:
        """Element-wise sums over the processes."""
        if not self.distributed:
            return list(values)
        from accelerate.utils import reduce

        local = torch.tensor(values, dtype=torch.float64, device=self.device)
        return reduce(local, reduction="sum").tolist()

    def loss_scale(self, loss_type: str, sequences: int, tokens: int) -> tuple[float, list]:
        """(scale, step totals): multiply this process's loss by `scale` before backward.

        Each process's loss is normalised by its own sequences (or tokens: DAPO); the step's loss
        is normalised by all processes'. Weighting by this process's share of the step gives the
        step's loss as the sum over processes; the gradient all-reduce averages, so times N.
        One process: scale 1.
        """
        totals = self.sum([sequences, tokens])
        local = (sequences, tokens)[LOSS_UNITS[loss_type]]
        total = max(totals[LOSS_UNITS[loss_type]], 1)
        return local / total * self.num_processes, totals

    def passes(self, count: int) -> int:
        """The most forward passes any process makes this round: under FSDP2 (every forward
        gathers weights) and DDP (one gradient all-reduce per step) all must make as many."""
        if not self.distributed:
            return count
        return max(self.gather(count))

    def combine_metrics(self, metrics: dict[str, float], weight: float) -> dict[str, float]:
        """Every process's metrics as one step's: `*/min` and `*/max` over processes, the rest
        averaged with `weight` (the process's completion tokens)."""
        if not self.distributed:
            return metrics
        everyone = self.gather((metrics, weight))
        total = sum(w for _, w in everyone) or 1.0
        out = {}
        for name in metrics:
            values = [m[name] for m, _ in everyone if name in m]
            if name.endswith("/min"):
                out[name] = min(values)
            elif name.endswith("/max"):
                out[name] = max(values)
            else:
                out[name] = sum(m.get(name, 0.0) * w for m, w in everyone) / total
        return out

    def wait(self) -> None:
        if self.distributed:
            self.accelerator.wait_for_everyone()
