"""The flags of `grpo-lab serve` (grpo_lab.serve.server): one dataclass, named like vLLM's.

Each field's docstring is its `--flag`'s help (grpo_lab.cli.flags); a bad value fails when the
config is built, before a model is loaded. `device` and `dtype` resolve as the trainers' do
(grpo_lab.util.devices): `auto` = bfloat16 on a CUDA GPU, float32 on the CPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..util.devices import DTYPES, default_threads, resolve_device, resolve_dtype
from .prefix_cache import DEFAULT_BLOCK_SIZE, DEFAULT_MAX_BLOCKS
from .sampling import LOGPROBS_MODES

VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # what vLLM accepts for max_lora_rank


@dataclass
class ServeConfig:
    """Flags of `grpo-lab serve` (named like vLLM's); MODEL is the positional argument."""

    model: str = "tiny"
    """Hub id or local path of the base model; `tiny` = the offline tiny model (addition)."""
    served_model_name: str | None = None
    """Name of the base model in requests and /v1/models (default: MODEL as given)."""
    host: str = "127.0.0.1"
    """Interface to bind (127.0.0.1 = this machine only)."""
    port: int = 8000
    """TCP port (0 = any free port; the chosen one is printed)."""
    api_key: str | None = None
    """Require `Authorization: Bearer KEY` on every route but /health (default: $VLLM_API_KEY)."""
    enable_lora: bool = False
    """Serve LoRA adapters (loaded at runtime with /v1/load_lora_adapter)."""
    max_lora_rank: int = 16
    """Largest adapter rank accepted; one of 1, 8, 16, 32, 64, 128, 256, 320, 512 (as vLLM)."""
    max_loras: int = 1
    """Most distinct adapters decoded in one batch (requests under others wait their turn)."""
    max_cpu_loras: int | None = None
    """Most adapters whose weights stay in memory (default: max_loras, as vLLM). Beyond it the
    least recently used one's weights are dropped and read again from its path when a request
    names it (an error if that path is gone)."""
    max_model_len: int | None = None
    """Prompt + completion token limit (default: the model's max_position_embeddings)."""
    logprobs_mode: str = "raw_logprobs"
    """`raw_logprobs` (before any processing) or `processed_logprobs` (after penalties,
    temperature, min_p, top-k and top-p: what a GRPO trainer computes)."""
    max_num_seqs: int = 256
    """Most sequences decoded together in one step."""
    max_num_batched_tokens: int = 8192
    """Most prompt tokens prefilled in one step."""
    max_logprobs: int = 20
    """Largest `logprobs` a request may ask for."""
    device: str = "auto"
    """Where the model and the engine's tensors live: auto (CUDA when present), cpu, cuda,
    cuda:1... Results come back to the CPU only as the tokens and logprobs of each step."""
    dtype: str = "auto"
    """Weights dtype: auto (bfloat16 on CUDA, float32 on the CPU: what the trainer uses there),
    float32, float16 or bfloat16. Logprobs are computed in float32 whatever it is."""
    num_threads: int | None = None
    """torch intra-op threads of this process (default: 1 on the CPU, where several processes
    share a few cores; torch's own on a GPU: grpo_lab.util.devices.default_threads)."""
    gpu_memory_utilization: float | None = None
    """On a CUDA device: the most of its memory this process may allocate, in (0, 1], for
    replicas that share a GPU (torch.cuda.set_per_process_memory_fraction; default: no cap).
    Named as vLLM's, but a cap rather than vLLM's reservation made up front."""
    allowed_lora_root: str | None = None
    """Refuse adapter paths outside this directory (after resolving `..` and symlinks)."""
    adapter_visibility_lag_s: float = 0.0
    """Emulate a lagging bucket mount: a directory modified less than S seconds ago answers
    'No adapter found' (404), as a replica that has not seen it yet."""
    max_request_bytes: int = 16 * 2**20
    """Largest request body accepted (413 above)."""
    enable_prefix_caching: bool = True
    """Reuse the KV of cached prompt prefixes, block by block, per adapter (on by default, as in
    vLLM; `--no-enable-prefix-caching` or `--enable-prefix-caching false` turns it off)."""
    block_size: int = DEFAULT_BLOCK_SIZE
    """Tokens per KV block of the prefix cache (vLLM: 16); only full blocks are cached."""
    prefix_cache_max_blocks: int = DEFAULT_MAX_BLOCKS
    """Most blocks the prefix cache keeps (least recently used evicted first); 1024 blocks of 16
    = 16,384 tokens, 64 MiB for the tiny model."""

    def __post_init__(self):
        problems = []
        if self.logprobs_mode not in LOGPROBS_MODES:
            problems.append(f"logprobs_mode must be one of {LOGPROBS_MODES}")
        if self.max_lora_rank not in VLLM_LORA_RANKS:
            problems.append(f"max_lora_rank must be one of {VLLM_LORA_RANKS} (as in vLLM)")
        if self.dtype != "auto" and self.dtype not in DTYPES:
            problems.append(f"dtype must be auto or one of {sorted(DTYPES)}")
        try:
            resolve_device(self.device)
        except ValueError as exc:
            problems.append(str(exc))
        for name in ("max_loras", "max_num_seqs", "max_num_batched_tokens", "num_threads",
                     "max_request_bytes", "block_size", "prefix_cache_max_blocks"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                problems.append(f"{name} must be >= 1 (got {getattr(self, name)})")
        if self.gpu_memory_utilization is not None and not 0 < self.gpu_memory_utilization <= 1:
            problems.append("gpu_memory_utilization must be in (0, 1] "
                            f"(got {self.gpu_memory_utilization})")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            problems.append(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras "
                            f"({self.max_loras}), as in vLLM")
        if not 0 <= self.port < 65536:
            problems.append(f"port must be in 0..65535 (got {self.port})")
        if self.adapter_visibility_lag_s < 0:
            problems.append("adapter_visibility_lag_s must be >= 0")
        if problems:
            raise ValueError("invalid ServeConfig: " + "; ".join(problems))

    def torch_device(self) -> str:
        """`device` with `auto` resolved: `cuda` when torch sees a GPU, else `cpu`."""
        return resolve_device(self.device)

    def threads(self) -> int | None:
        """`num_threads`, or its default on this device: 1 on the CPU, None (torch's own) on a
        GPU."""
        return default_threads(self.device, self.num_threads)

    def torch_dtype(self) -> torch.dtype:
        """`dtype` with `auto` resolved for the device: bfloat16 on CUDA, float32 elsewhere."""
        return resolve_dtype(self.dtype, self.torch_device())
