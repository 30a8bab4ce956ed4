"""Model FLOPs utilisation (MFU): the model's FLOPs per second over the device's peak.

    MFU = 100 x flops_per_token x tokens / seconds / (peak FLOP/s x processes)

a percentage, as TRL's AsyncGRPOTrainer logs it (`perf/mfu_fwd_bwd`, `perf/mfu_wall_clock`).
FLOPs per token follow TRL's count for a dense decoder (PaLM's, Chowdhery et al. 2022, App. B):
every linear layer's matmul (2 FLOPs per weight), the attention scores (Q.K^T and attn.V over
the whole `seq_len`, not halved for causality) and the LM head, times 3 for the backward pass
(which costs twice the forward). The peak of a GPU is its published dense bf16 figure; a CPU
has none, so its peak is measured once on the machine, a float32 matmul at the trainer's thread
count, and kept in grpo_lab's cache (`cpu_peak_flops`).
"""

from __future__ import annotations

import json
import platform
import time
import warnings

import torch

from ..util.home import grpo_lab_home

# Dense (no 2:4 sparsity) bf16 tensor-core peaks, FLOP/s, from NVIDIA's data sheets (their
# "with sparsity" figures are twice these): H100/H200 SXM (nvidia.com/en-us/data-center/h100,
# /h200: 1,979 TFLOPS sparse), H100 PCIe (1,513 sparse), A100 (A100 data sheet: 312 dense), L40S
# (L40S data sheet: 733 sparse; 362 dense), L4 (L4 data sheet: 242 sparse), A10G (AWS G5 / the
# A10 data sheet: 125 dense). A more specific name comes before its prefix.
GPU_BF16_PEAKS: tuple[tuple[str, float], ...] = (
    ("H100 PCIe", 756e12),
    ("H100", 989e12),
    ("H200", 989e12),
    ("A100", 312e12),
    ("L40S", 362e12),
    ("L4", 121e12),
    ("A10G", 125e12),
)


def flops_per_token(config, seq_len: int) -> int | None:
    """Training FLOPs (forward + backward) per token of a dense decoder with this config (a
    transformers config: Llama, Qwen2, Mistral, ... field names), at mean sequence length
    `seq_len`; None for a config without those fields or a mixture of experts."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    try:
        h, L, V = config.hidden_size, config.num_hidden_layers, config.vocab_size
        heads, ffn = config.num_attention_heads, config.intermediate_size
    except AttributeError:
        return None
    if getattr(config, "num_experts_per_tok", None) is not None:
        return None
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or h // heads
    qkv = 2 * h * (heads + 2 * kv_heads) * head_dim  # Q, K, V projections
    out = 2 * heads * head_dim * h  # O projection
    scores = 2 * 2 * heads * head_dim * seq_len  # Q.K^T and attn.V
    mlp = 2 * 3 * h * ffn  # gate, up, down
    lm_head = 2 * V * h  # the embedding is a lookup: no FLOPs
    return 3 * (L * (qkv + out + scores + mlp) + lm_head)


def gpu_peak_flops(name: str, dtype: torch.dtype) -> float | None:
    """The published dense peak of a GPU named `name` (torch.cuda.get_device_name) in bf16 or
    fp16; None for a GPU not in GPU_BF16_PEAKS or another dtype."""
    if dtype not in (torch.bfloat16, torch.float16):
        return None
    folded = name.casefold()
    return next((peak for model, peak in GPU_BF16_PEAKS if model.casefold() in folded), None)


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def measure_cpu_flops(threads: int, sizes=(1024, 2048), repeats: int = 5) -> float:
    """FLOP/s of the best float32 square matmul (2 n^3 FLOPs) at `threads` torch threads: a
    few seconds at most."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        best = 0.0
        for n in sizes:
            a, b = torch.randn(n, n), torch.randn(n, n)
            a @ b  # warm-up
            for _ in range(repeats):
                start = time.perf_counter()
                a @ b
                best = max(best, 2 * n**3 / (time.perf_counter() - start))
        return best
    finally:
        torch.set_num_threads(before)


def cpu_peak_flops(threads: int, refresh: bool = False) -> float:
    """This CPU's float32 matmul peak at `threads` threads, measured on first use and kept in
    `<grpo_lab home>/cpu_peak_flops.json`, keyed by CPU model, threads and torch version.
    Measured on a busy machine it comes out low (and MFU high): `refresh=True` measures again
    and keeps the larger."""
    path = grpo_lab_home() / "cpu_peak_flops.json"
    key = f"{_cpu_name()} | threads={threads} | torch={torch.__version__}"
    try:
        known = json.loads(path.read_text())
    except (OSError, ValueError):
        known = {}
    if key not in known or refresh:
        known[key] = max(known.get(key, 0.0), measure_cpu_flops(threads))
        tmp = path.with_suffix(f".{time.time_ns()}.tmp")
        tmp.write_text(json.dumps(known, indent=1))
        tmp.replace(path)
    return float(known[key])


def peak_flops(device: str | torch.device, dtype: torch.dtype, threads: int) -> float | None:
    """Peak FLOP/s of one training process on `device`: the GPU's published peak (None, with a
    warning, when unknown), or this CPU's measured one at `threads`."""
    device = torch.device(device)
    if device.type == "cpu":
        return cpu_peak_flops(threads)
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        peak = gpu_peak_flops(name, dtype)
        if peak is None:
            warnings.warn(f"no published peak for {name} in {dtype} (grpo_lab.watch.flops."
                          "GPU_BF16_PEAKS): the MFU metrics are left out", stacklevel=2)
        return peak
    return None


def mfu(flops: float, seconds: float, peak: float, processes: int = 1) -> float:
    """Model FLOPs utilisation in percent (TRL's unit): `flops` done in `seconds` by
    `processes` devices of peak `peak` FLOP/s each."""
    return 100.0 * flops / seconds / (peak * processes)
