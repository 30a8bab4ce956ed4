"""Where the model runs and in which precision: `device="auto"`, `dtype="auto"`.

    device  auto      CUDA when torch sees a GPU, else CPU
    dtype   auto      bfloat16 on a GPU (half the memory of float32, and what the recipe trains
                      in), float32 on a CPU (bfloat16 matmuls are slow there and change results)

Whatever the weights' dtype, log-probabilities are computed in float32
(grpo_lab.core.grpo_loss.token_logprobs upcasts the logits): the ratio pi_theta / pi_old is a
difference of two log-probabilities, and bfloat16 keeps only ~3 significant digits.
"""

from __future__ import annotations

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
