"""The engine's running batch (grpo_lab.serving.engine): one row per sequence being decoded.

Rows are kept sorted by adapter, so each LoRA adapter covers one contiguous slice
(`_segments`). The KV cache is an ordinary transformers `DynamicCache`; when the batch changes
its rows are selected (`_select_rows`: finished rows leave, columns that are padding for every
row are cut) or new rows merged in (`_merge`: both sides left padded to a common length).
All of it stays on the engine's device; the row indices are made there too.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from .lora_registry import LoRAAdapter
from .requests import Sequence


class RunningBatch:
    """The batch half of `Engine` (a mixin), owned by the engine thread: the rows, their KV
    cache, their attention mask and the last sampled token of each (not yet in the cache)."""

    _rows: list[Sequence]
    _cache: DynamicCache | None
    _mask: torch.Tensor  # (B, L) 1 on real tokens
    _next: torch.Tensor  # (B,)
    device: torch.device
    stats: dict

    def _reset_batch(self) -> None:
        self._rows, self._cache = [], None
        self._mask = torch.zeros(0, 0, dtype=torch.long, device=self.device)
        self._next = torch.zeros(0, dtype=torch.long, device=self.device)

    def _kv(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(layer.keys, layer.values) for layer in self._cache.layers]

    def _select_rows(self, keep: list[int]) -> None:
        """Keep these rows (in this order) and cut leading columns that are padding for all."""
        if not keep:
            self._reset_batch()
            return
        index = torch.tensor(keep, device=self.device)
        self._rows = [self._rows[i] for i in keep]
        mask = self._mask.index_select(0, index)
        start = int((mask.sum(0) > 0).long().argmax())  # first column holding a real token
        self._mask = mask[:, start:]
        self._next = self._next.index_select(0, index)
        self._cache = DynamicCache(ddp_cache_data=[(k.index_select(0, index)[:, :, start:],
                                                    v.index_select(0, index)[:, :, start:])
                                                   for k, v in self._kv()])

    def _segments(self, rows: list[Sequence]) -> list[tuple[LoRAAdapter, int, int]]:
        """Contiguous runs of rows under the same adapter (rows are sorted by adapter)."""
        segments: list[tuple[LoRAAdapter, int, int]] = []
        for i, seq in enumerate(rows):
            if seq.adapter is None:
                continue
            if segments and segments[-1][0] is seq.adapter and segments[-1][2] == i:
                segments[-1] = (seq.adapter, segments[-1][1], i + 1)
            else:
                segments.append((seq.adapter, i, i + 1))
        return segments

    def _merge(self, seqs, kv, mask, next_tokens) -> None:
        """Append new rows to the running batch, left padding the shorter side, sorted by adapter."""
        if not self._rows:
            rows, all_kv, all_mask, all_next = seqs, kv, mask, next_tokens
        else:
            old_kv, L_old, L_new = self._kv(), self._mask.shape[1], mask.shape[1]
            L = max(L_old, L_new)

            def pad(t, n):  # left pad dim -2 (keys/values) or -1 (mask) with n zeros
                return torch.nn.functional.pad(t, (0, 0, n, 0) if t.dim() == 4 else (n, 0))

            all_kv = [(torch.cat([pad(ko, L - L_old), pad(kn, L - L_new)]),
                       torch.cat([pad(vo, L - L_old), pad(vn, L - L_new)]))
                      for (ko, vo), (kn, vn) in zip(old_kv, kv, strict=True)]
            all_mask = torch.cat([pad(self._mask, L - L_old), pad(mask, L - L_new)])
            all_next = torch.cat([self._next, next_tokens])
            rows = self._rows + seqs
        order = sorted(range(len(rows)), key=lambda i: rows[i].adapter_key)  # stable
        index = torch.tensor(order, device=self.device)
        self._rows = [rows[i] for i in order]
        self._cache = DynamicCache(ddp_cache_data=[(k.index_select(0, index),
                                                    v.index_select(0, index)) for k, v in all_kv])
        self._mask = all_mask.index_select(0, index)
        self._next = all_next.index_select(0, index)
        self.stats["max_batch"] = max(self.stats["max_batch"], len(self._rows))
