"""Where the model runs and in which precision: `device="auto"`, `dtype="auto"`.

    device  auto      CUDA when torch sees a GPU, else CPU
    dtype   auto      bfloat16 on a GPU (half the memory of float32, and what the recipe trains
                      in), float32 on a CPU (bfloat16 matmuls are slow there and change results)
    threads default   1 on a CPU (a run's processes share a few cores), torch's own on a GPU

Whatever the weights' dtype, log-probabilities are computed in float32
(grpo_lab.algo.logprobs.token_logprobs upcasts the logits): the ratio pi_theta / pi_old is a
difference of two log-probabilities, and bfloat16 keeps only ~3 significant digits.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> str:
    """`auto` -> `cuda` or `cpu`; other names are checked against what torch sees."""
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {name!r}: torch sees no CUDA GPU here (use device='auto' or "
                         "'cpu')")
    try:
        torch.device(name)
    except RuntimeError as exc:
        raise ValueError(f"device {name!r}: not a torch device ({exc})") from None
    return name


def resolve_dtype(name: str, device: str) -> torch.dtype:
    """`auto` -> bfloat16 on CUDA, float32 elsewhere; else the named dtype."""
    if name == "auto":
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    if name not in DTYPES:
        raise ValueError(f"dtype {name!r}: choose auto or one of {sorted(DTYPES)}")
    return DTYPES[name]


def default_threads(device: str, asked: int | None = None) -> int | None:
    """torch intra-op threads for a process on `device` (`auto`, `cpu`, `cuda:1`...): `asked`
    when given; 1 on the CPU, where a run's processes share a few cores and a second thread each
    slows them all down; None on a GPU: leave torch's own (OMP_NUM_THREADS, else every core)."""
    if asked:
        return asked
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return 1 if device.split(":")[0] == "cpu" else None


def cap_gpu_memory(device: str, fraction: float | None) -> None:
    """Let this process allocate at most `fraction` of CUDA `device`'s memory (an out-of-memory
    error beyond it), so that processes sharing one GPU each keep to their part. Nothing on the
    CPU or without a fraction."""
    if fraction and device.startswith("cuda"):
        # an index, or None: the current device (torch.device("cuda") itself is refused)
        torch.cuda.set_per_process_memory_fraction(float(fraction), torch.device(device).index)


KERNEL_LEVELS = ("default", "avx2", "avx512")
"""ATEN_CPU_CAPABILITY's values on x86: PyTorch's CPU kernel level (none = the best this processor
has)."""


def compile_cache_dir(env: Mapping[str, str] | None = None) -> str:
    """torch.compile's kernel cache for a process started with `env` (default: this one's): a
    folder per CPU kernel level inside Inductor's own (TORCHINDUCTOR_CACHE_DIR, else
    /tmp/torchinductor_<user>).

    Inductor keeps the C++ it generates on disk, and its cache key misses the vector width that
    ATEN_CPU_CAPABILITY picks. Measured with torch 2.13 on an AVX-512 machine: vLLM's sampler,
    compiled once under ATEN_CPU_CAPABILITY=avx2 (8 floats a vector), was reused by a server
    without it, built for 16 floats a vector; it wrote past its buffers and the engine aborted
    (`free(): invalid next size`). The other way round, a loop would skip half its vector."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    env = os.environ if env is None else env
    forced = env.get("ATEN_CPU_CAPABILITY", "").lower()
    level = forced if forced in KERNEL_LEVELS else native_kernel_level()
    base = env.get("TORCHINDUCTOR_CACHE_DIR") or default_cache_dir()
    return os.path.join(base, f"kernels-{level}")


def native_kernel_level() -> str:
    """The CPU kernel level PyTorch picks on this processor when nothing forces one (whatever
    ATEN_CPU_CAPABILITY says in this process): avx512, avx2, or what torch reports elsewhere."""
    if torch.cpu._is_avx512_supported():  # the processor's flags, not the forced level
        return "avx512"
    if torch.cpu._is_avx2_supported():
        return "avx2"
    return torch.backends.cpu.get_cpu_capability().lower()
