"""Generators of asynchronous GRPO: prompt ids and a policy version in, completions out.

    generator.publish(model, version)      # trainer: "my current weights are policy `version`"
    generator.generate(prompt_ids, version=v, ...) -> Completions   # worker: sample with policy v

`LocalGenerator` samples in this process from its own copy of the policy, loading a published
snapshot of the trainable weights between generations, so that sampling never sees half-updated
weights; `HTTPGenerator` (grpo_lab.rollout.http_generator) samples from inference servers
(docs/internals.md, "Generators").
"""

from __future__ import annotations

import copy
import threading
from collections import OrderedDict
from typing import Protocol, runtime_checkable

import torch

from ..data.completions import Completions
from ..model.generation import sample_from_ids


@runtime_checkable
class Generator(Protocol):
    """Anything that samples completions, with their logprobs, from a named policy version."""

    def publish(self, model, version: int) -> None:
        """Make the weights of `model` (the trainer's, right now) available as policy `version`."""
        ...

    def generate(
        self,
        prompt_ids: list[list[int]],
        *,
        version: int,
        num_generations: int,
        max_new_tokens: int,
        temperature: float,
    ) -> Completions:
        """`num_generations` completions per prompt (prompt-major), sampled from policy `version`,
        with the per-token logprobs of the distribution they were sampled from."""
        ...

    @property
    def latest_version(self) -> int:
        """The newest published version (-1 before the first `publish`)."""
        ...


def is_peft_model(model) -> bool:
    return hasattr(model, "peft_config")


def trainable_state(model) -> dict[str, torch.Tensor]:
    """A detached copy of the parameters training changes (`requires_grad`), by name: the
    adapter's lora_A/lora_B for LoRA (11,776 numbers at rank 1), every weight for full tuning."""
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


@torch.no_grad()
def load_trainable_state(model, state: dict[str, torch.Tensor]) -> None:
    """Copy a `trainable_state` snapshot into a model with the same parameter names (in place)."""
    params = dict(model.named_parameters())
    for name, value in state.items():
        params[name].copy_(value)


class MergedLoRAModel:
    """A plain copy of a peft model whose adapted linears hold W0 + scaling * B @ A.

    Sampling from merged weights skips the adapter's extra matmuls and Python per layer (an
    unmerged adapter roughly halves `generate` throughput on the tiny model), and the trainer's
    unmerged forward gives the same logprobs to float rounding. `load` re-merges a new adapter
    snapshot from the kept base weights W0, so merges never accumulate. Plain LoRA only
    (no DoRA, no fan_in_fan_out, nothing trainable but lora_A/lora_B): see `mergeable`.
    """

    def __init__(self, peft_model):
        self.model = copy.deepcopy(peft_model).merge_and_unload()  # plain model, weights merged
        self._targets = {}  # peft module name -> (the plain model's Linear, W0, scaling)
        for name, module in self._lora_layers(peft_model):
            linear = self.model.get_submodule(name.removeprefix("base_model.model."))
            w0 = module.base_layer.weight.detach().clone()
            self._targets[name] = (linear, w0, module.scaling["default"])

    @staticmethod
    def _lora_layers(model):
        from peft.tuners.lora import LoraLayer

        return [(n, m) for n, m in model.named_modules() if isinstance(m, LoraLayer)]

    @classmethod
    def mergeable(cls, model) -> bool:
        if not is_peft_model(model) or list(model.peft_config) != ["default"]:
            return False
        layers = cls._lora_layers(model)
        only_adapters = all(".lora_A." in n or ".lora_B." in n
                            for n, p in model.named_parameters() if p.requires_grad)
        return bool(layers) and only_adapters and all(
            not m.fan_in_fan_out and not m.use_dora.get("default", False)
            and isinstance(m.base_layer, torch.nn.Linear) for _, m in layers)

    @torch.no_grad()
    def load(self, state: dict[str, torch.Tensor]) -> None:
        for name, (linear, w0, scaling) in self._targets.items():
            a = state[f"{name}.lora_A.default.weight"]  # (r, in)
            b = state[f"{name}.lora_B.default.weight"]  # (out, r)
            linear.weight.copy_(w0 + scaling * (b @ a))


class LocalGenerator:
    """Samples in this process from a private copy of the policy, one published version at a time.

    For a LoRA policy the copy is a plain model with the adapter merged in (`merge_lora=True`);
    `merge_lora=False` keeps a peft copy and copies the adapter weights into it instead.

    Keeps the last `max_versions` snapshots (the recipe's `max_staleness + 1` adapter slots), so a
    worker that read `latest_version` just before a publish still finds its version. Asking for
    an evicted or unknown version raises `KeyError`, as a server answers "No adapter found".
    """

    def __init__(self, model, tokenizer, max_versions: int = 2, merge_lora: bool = True):
        if max_versions < 1:
            raise ValueError(f"max_versions must be >= 1, got {max_versions}")
        # LoRA: sample from a plain copy with the adapter merged in (faster), if it is plain LoRA.
        mergeable = merge_lora and MergedLoRAModel.mergeable(model)
        self._merged = MergedLoRAModel(model) if mergeable else None
        self.model = self._merged.model if self._merged else copy.deepcopy(model)
        self.model.eval().requires_grad_(False)
        self.tokenizer = copy.deepcopy(tokenizer)  # fast tokenizers are not thread safe
        self.max_versions = max_versions
        self._snapshots: OrderedDict[int, dict[str, torch.Tensor]] = OrderedDict()
        self._lock = threading.Lock()  # guards _snapshots (publish and generate run in two threads)
        self._generating = threading.Lock()  # one generation at a time on the private copy
        self._loaded_version: int | None = None  # which snapshot the private copy holds
        self.loads = 0
        """How many times a snapshot was loaded into the private copy."""

    def publish(self, model, version: int) -> None:
        state = trainable_state(model)  # trainer thread, between optimizer steps
        with self._lock:
            latest = next(reversed(self._snapshots)) if self._snapshots else -1
            if version <= latest:
                raise ValueError(f"versions must increase: {version} after {latest}")
            self._snapshots[version] = state
            while len(self._snapshots) > self.max_versions:
                self._snapshots.popitem(last=False)  # evict the oldest

    @property
    def latest_version(self) -> int:
        with self._lock:
            return next(reversed(self._snapshots)) if self._snapshots else -1

    @property
    def versions(self) -> list[int]:
        """The versions that can be sampled from now, oldest first."""
        with self._lock:
            return list(self._snapshots)

    def generate(self, prompt_ids, *, version, num_generations, max_new_tokens, temperature):
        with self._lock:
            if version not in self._snapshots:
                raise KeyError(f"policy version {version} not available "
                               f"(have {list(self._snapshots)})")
            state = self._snapshots[version]
        with self._generating:
            if self._loaded_version != version:  # swap weights between generations, never during
                if self._merged is not None:
                    self._merged.load(state)
                else:
                    load_trainable_state(self.model, state)
                self._loaded_version = version
                self.loads += 1
            return sample_from_ids(self.model, self.tokenizer, prompt_ids,
                                   num_generations=num_generations,
                                   max_new_tokens=max_new_tokens, temperature=temperature)
