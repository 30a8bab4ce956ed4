"""TRL's AsyncGRPOTrainer off a GPU: its tree attention with torch's SDPA, no CUDA queries.

TRL 1.16's asynchronous trainer assumes CUDA in two places, which `use_cpu_tree_attention` and
`skip_cuda_queries` replace for the process they are called in (TRL's files are not touched):
FlashAttention-3 for its packed prefix trees becomes `tree_attention_cpu`, and MFU is not logged.
The trees' layout and the mask: docs/internals.md, "TRL's AsyncGRPOTrainer".

Both replacements reach into TRL's own submodules (`trl.experimental.async_grpo.packing` and
`.async_grpo_trainer`), which TRL 1.18 removes when the trainer becomes stable. This module is
the only place in grpo_lab (tests included) that imports them, through `trl_internal`, and only
on the TRL releases grpo_lab is tested on (`require_trl`, which every use of TRL in grpo_lab
calls first); anything else gets an error naming them.
TRL's public classes come from grpo_lab.trl.async_trainer.trl_async_grpo.
"""

from __future__ import annotations

import importlib
from importlib.metadata import PackageNotFoundError, version

import torch
import torch.nn.functional as F

TRL_EXTRA = "trl>=1.16.0,<1.17"
"""pyproject.toml's `trl` extra (tests/test_dependency_ranges.py holds them equal): the TRL
releases grpo_lab's TRL integration is tested on."""


def require_trl() -> str:
    """The installed TRL's version when it is in `TRL_EXTRA`; otherwise an ImportError naming
    the range and the extra. Every use of TRL in grpo_lab calls it first: the core imports no
    TRL, and a TRL outside the tested range fails at the start, not mid-step."""
    from packaging.specifiers import SpecifierSet  # transformers' own dependency

    try:
        found = version("trl")
    except PackageNotFoundError:
        found = None
    tested = SpecifierSet(TRL_EXTRA.removeprefix("trl"))
    if found is None or not tested.contains(found):
        raise ImportError(
            f"grpo_lab's TRL integration (TRL's trainers beside grpo_lab's, train-trl-async, "
            f"notebook 03) needs trl {tested}, the releases it is tested on; found "
            f"{found or 'none installed'}. Install the extra: pip install 'grpo_lab[trl]'")
    return found


def trl_internal(name: str):
    """TRL's submodule `trl.experimental.async_grpo.<name>` (`packing`, `async_grpo_trainer`),
    after `require_trl` (the tested releases have them)."""
    require_trl()
    return importlib.import_module(f"trl.experimental.async_grpo.{name}")


def tree_attention_cpu(module, query, key, value, attention_mask, *, tree_kv_index,
                       tree_cu_seqlens_q, tree_cu_seqlens_k, scaling=None, sliding_window=None,
                       softcap=None, **kwargs):
    """transformers' attention-function signature; query (1, H, N, D), key/value (1, Hkv, N, D)
    -> ((1, N, H, D), None)."""
    if sliding_window or softcap:
        raise NotImplementedError("tree_attention_cpu: sliding-window and softcapped attention "
                                  "are not supported (run on a GPU with TRL's kernel)")
    q, k, v = (x.transpose(1, 2)[0] for x in (query, key, value))  # (N, H, D), (N, Hkv, D)
    k, v = k.index_select(0, tree_kv_index), v.index_select(0, tree_kv_index)  # the paths
    repeat = q.shape[1] // k.shape[1]  # grouped-query attention: KV heads shared by query heads
    out = torch.zeros_like(q)
    cu_q, cu_k = tree_cu_seqlens_q.tolist(), tree_cu_seqlens_k.tolist()
    for s in range(len(cu_q) - 1):
        q0, q1, k0, k1 = cu_q[s], cu_q[s + 1], cu_k[s], cu_k[s + 1]
        if min(q0, q1, k0, k1) < 0 or q1 <= q0:  # padding between data-parallel rows
            continue
        sq, sk = q1 - q0, k1 - k0
        mask = torch.ones(sq, sk, dtype=torch.bool, device=q.device).tril(diagonal=sk - sq)
        seg = F.scaled_dot_product_attention(
            q[q0:q1].transpose(0, 1),                                    # (H, Sq, D)
            k[k0:k1].repeat_interleave(repeat, dim=1).transpose(0, 1),   # (H, Sk, D)
            v[k0:k1].repeat_interleave(repeat, dim=1).transpose(0, 1),
            attn_mask=mask, scale=scaling)
        out[q0:q1] = seg.transpose(0, 1)
    return out.unsqueeze(0), None


def use_cpu_tree_attention() -> None:
    """Serve TRL's tree-attention name with `tree_attention_cpu`. TRL registers its kernel in
    the trainer's __init__: call this after it."""
    from transformers import AttentionInterface

    AttentionInterface.register(trl_internal("packing").TREE_ATTENTION, tree_attention_cpu)


def no_peak_flops(accelerator, dtype) -> None:
    """No known peak FLOPs off a CUDA GPU: TRL then logs no MFU."""
    return None


def skip_cuda_queries() -> None:
    """Before the trainer is built: TRL's MFU lookup answers None instead of asking CUDA."""
    trl_internal("async_grpo_trainer").get_peak_flops_per_device = no_peak_flops
