"""Several LoRA adapters served at once on one frozen base model, each request under its own.

Forward hooks add each adapter's s * B (A x) to the rows of the batch that name it (the rows are
sorted by adapter, one slice each), so the model stays an ordinary transformers model. Adapters
are read from PEFT's safetensors files; a request holds on to its adapter object, so unloading a
name never changes rollouts in flight. `max_loras` and `max_cpu_loras` are vLLM's limits
(docs/serving-api.md, "LoRA adapters"; docs/internals.md, "Several LoRA adapters in one batch").
"""

from __future__ import annotations

import json
import math
import os
import re
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from .protocol import RequestError

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def not_found(name: str, path: str) -> RequestError:
    """vLLM's 'No adapter found' 404: the one load error worth retrying (a lagging mount)."""
    return RequestError(f"Loading lora {name} failed: No adapter found for {path}", 404)


@dataclass
class LoRAAdapter:
    """One loaded adapter: per adapted module (e.g. `model.layers.0.self_attn.q_proj`), A, B, s."""

    name: str
    path: str
    rank: int
    weights: dict[str, tuple[torch.Tensor, torch.Tensor, float]]
    id: int = 0  # load order; orders the rows of a batch
    loaded_at: float = field(default_factory=time.time)


def _pattern_value(patterns: dict, module: str, default):
    """PEFT's rank_pattern / alpha_pattern: a key matches a module name or its dotted suffix."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def _inside(path: str, root: str) -> bool:
    return os.path.commonpath([path, root]) == root


def read_adapter(
    name: str,
    lora_path: str,
    *,
    module_shapes: dict[str, tuple[int, int]],
    max_lora_rank: int,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    allowed_root: str | None = None,
    visibility_lag_s: float = 0.0,
) -> LoRAAdapter:
    """Read and check an adapter directory; raises `RequestError` with vLLM's status and text.

    `module_shapes` maps each adaptable module name to its (out_features, in_features).
    `dtype`, `device`: the base model's, where A and B are put (safetensors loads on the CPU).
    `allowed_root`: refuse any path (after resolving `..` and symlinks) outside this directory.
    `visibility_lag_s`: emulate a lagging bucket mount: a directory modified less than this many
    seconds ago is treated as not there yet ("No adapter found").
    """
    path = os.path.abspath(os.path.expanduser(lora_path))
    if allowed_root is not None:
        root = os.path.realpath(allowed_root)
        if not _inside(os.path.realpath(path), root):
            raise RequestError(f"Loading lora {name} failed: lora_path {lora_path!r} is outside "
                               f"the allowed LoRA root {root!r}.")
    config_file = Path(path) / ADAPTER_CONFIG
    if not config_file.is_file():
        raise not_found(name, lora_path)
    if visibility_lag_s > 0 and time.time() - os.stat(path).st_mtime < visibility_lag_s:
        raise not_found(name, lora_path)  # the emulated mount has not caught up yet
    weights_file = Path(path) / ADAPTER_WEIGHTS
    if not weights_file.is_file():
        raise RequestError(f"Loading lora {name} failed: {lora_path} has no {ADAPTER_WEIGHTS} "
                           "(only safetensors adapters are loaded).")
    for file in (config_file, weights_file):  # a symlinked file must not lead out of the root
        if allowed_root is not None and not _inside(os.path.realpath(file), root):
            raise RequestError(f"Loading lora {name} failed: {file.name} resolves outside the "
                               f"allowed LoRA root {root!r}.")
    try:
        config = json.loads(config_file.read_text())
        tensors = load_file(str(weights_file))
    except (OSError, ValueError) as exc:
        raise RequestError(f"Loading lora {name} failed: cannot read the adapter: {exc}") from exc

    if not isinstance(config, dict) or config.get("peft_type", "LORA") != "LORA":
        raise RequestError(f"Loading lora {name} failed: not a LoRA adapter config.")
    for key in ("use_dora", "modules_to_save", "lora_bias"):
        if config.get(key):
            raise RequestError(f"Loading lora {name} failed: `{key}` is not supported.")
    rank = int(config.get("r", 0))
    ranks = [rank, *map(int, (config.get("rank_pattern") or {}).values())]
    if max(ranks) > max_lora_rank:  # checked before the tensors, like vLLM
        raise RequestError(f"LoRA rank {max(ranks)} is greater than max_lora_rank "
                           f"{max_lora_rank}.", 500)

    # PEFT names tensors `base_model.model.<module>.lora_A.weight` (and lora_B).
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = re.fullmatch(r"base_model\.model\.(.+)\.lora_([AB])\.weight", key)
        if match is None:
            raise RequestError(f"Loading lora {name} failed: unsupported tensor {key!r}.")
        pairs.setdefault(match.group(1), {})[match.group(2)] = tensor
    weights = {}
    for module, ab in pairs.items():
        if module not in module_shapes:
            raise RequestError(f"Loading lora {name} failed: module {module!r} is not a linear "
                               "layer of the base model.")
        if set(ab) != {"A", "B"}:
            raise RequestError(f"Loading lora {name} failed: {module} lacks lora_A or lora_B.")
        A, B = ab["A"], ab["B"]  # (r, in), (out, r)
        out_features, in_features = module_shapes[module]
        r = A.shape[0]
        if A.shape != (r, in_features) or B.shape != (out_features, r):
            raise RequestError(f"Loading lora {name} failed: {module} has shapes "
                               f"{tuple(A.shape)}, {tuple(B.shape)} for a {in_features}->"
                               f"{out_features} layer.")
        if r > max_lora_rank:
            raise RequestError(f"LoRA rank {r} is greater than max_lora_rank {max_lora_rank}.",
                               500)
        alpha = _pattern_value(config.get("alpha_pattern") or {}, module,
                               config.get("lora_alpha", 8))
        scale = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
        weights[module] = (A.to(device, dtype).contiguous(), B.to(device, dtype).contiguous(),
                           float(scale))
    if not weights:
        raise RequestError(f"Loading lora {name} failed: the adapter has no LoRA weights.")
    return LoRAAdapter(name=name, path=lora_path, rank=max(rank, *(w[0].shape[0] for w in
                                                                   weights.values())),
                       weights=weights)


class LoRARegistry:
    """The adapters loaded under their names, and the hooks that apply them per batch segment."""

    def __init__(self, model, max_loras: int, max_lora_rank: int,
                 max_cpu_loras: int | None = None):
        self.max_loras = max_loras
        self.max_lora_rank = max_lora_rank
        self.max_cpu_loras = max_cpu_loras if max_cpu_loras is not None else max_loras
        if self.max_cpu_loras < max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras "
                             f"({max_loras})")
        self._last_used: dict[str, int] = {}  # name -> use counter; the smallest goes first
        self._uses = 0
        self.evictions = 0
        self.reloads = 0
        self.dtype = next(model.parameters()).dtype
        self._adapters: dict[str, LoRAAdapter] = {}
        self._lock = threading.Lock()
        self._next_id = 1
        self.segments: list[tuple[LoRAAdapter, int, int]] = []  # set by the engine per forward
        output_layer = model.get_output_embeddings()
        self.module_shapes: dict[str, tuple[int, int]] = {}
        for module_name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear) and module is not output_layer:
                self.module_shapes[module_name] = (module.out_features, module.in_features)
                module.register_forward_hook(self._hook(module_name))

    def _hook(self, module_name: str):
        def add_lora_deltas(module, inputs, output):
            for adapter, start, end in self.segments:
                w = adapter.weights.get(module_name)
                if w is not None:
                    A, B, scale = w
                    x = inputs[0][start:end]  # (rows, T, in)
                    output[start:end] = output[start:end] + F.linear(F.linear(x, A), B) * scale
            return output

        return add_lora_deltas

    def add(self, adapter: LoRAAdapter, replace: bool = False) -> None:
        with self._lock:
            if adapter.name in self._adapters and not replace:
                raise RequestError(f"The lora adapter '{adapter.name}' has already been loaded. "
                                   "If you want to load the adapter in place, set 'load_inplace'"
                                   " to True.", 400, "InvalidUserInput")
            adapter.id = self._next_id
            self._next_id += 1
            self._adapters[adapter.name] = adapter
            self._touch(adapter.name)
            self._evict_beyond_limit(keep=adapter.name)

    def _touch(self, name: str) -> None:
        self._uses += 1
        self._last_used[name] = self._uses

    def _evict_beyond_limit(self, keep: str) -> None:
        """Drop the weights of the least recently used adapters beyond max_cpu_loras. The name
        stays (with an empty weights dict); requests already running hold the old object."""
        resident = [n for n, a in self._adapters.items() if a.weights and n != keep]
        while len(resident) + 1 > self.max_cpu_loras:
            oldest = min(resident, key=lambda n: self._last_used.get(n, 0))
            evicted = self._adapters[oldest]
            self._adapters[oldest] = LoRAAdapter(name=evicted.name, path=evicted.path,
                                                 rank=evicted.rank, weights={}, id=evicted.id,
                                                 loaded_at=evicted.loaded_at)
            resident.remove(oldest)
            self.evictions += 1

    def restore(self, adapter: LoRAAdapter) -> None:
        """Weights read again for an evicted name (same id: the name's place in the batch order)."""
        with self._lock:
            current = self._adapters.get(adapter.name)
            if current is None or current.weights:  # unloaded meanwhile, or already restored
                return
            adapter.id, adapter.loaded_at = current.id, current.loaded_at
            self._adapters[adapter.name] = adapter
            self.reloads += 1
            self._touch(adapter.name)
            self._evict_beyond_limit(keep=adapter.name)

    def remove(self, name: str) -> LoRAAdapter | None:
        with self._lock:
            self._last_used.pop(name, None)
            return self._adapters.pop(name, None)

    def get(self, name: str) -> LoRAAdapter | None:
        """The adapter under `name`, marked as just used; its `weights` are empty when they
        were evicted (read them again with `read_adapter` and `restore`)."""
        with self._lock:
            adapter = self._adapters.get(name)
            if adapter is not None:
                self._touch(name)
            return adapter

    def __contains__(self, name: str) -> bool:
        with self._lock:
            return name in self._adapters

    def adapters(self) -> list[LoRAAdapter]:
        """Loaded adapters in load order."""
        with self._lock:
            return sorted(self._adapters.values(), key=lambda a: a.id)
