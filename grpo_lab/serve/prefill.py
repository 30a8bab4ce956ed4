"""Prefill: the engine's first forward over newly admitted prompts, reusing cached prefixes.

Each prompt's longest cached run of full blocks (grpo_lab.serve.prefix_cache) is handed to the
forward as past keys and values, and only the rest of the prompt is computed, its positions
continuing from the cached length. Copies of one prompt admitted together are prefilled in waves,
so that the later ones read the blocks the first one computed (docs/internals.md, "Prefill and
the prefix cache").
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from .batch import Sequence
from .prefix_cache import PrefixCache, PrefixMatch, assemble_prefixes, cut_blocks


class Prefill:
    """The prefill half of `Engine` (a mixin); see the module docstring."""

    prefix_cache: PrefixCache | None
    device: torch.device
    stats: dict

    def _prefill(self, seqs: list[Sequence]) -> None:
        """Prefill the admitted sequences, in waves when a prefix cache is on."""
        if self.prefix_cache is None:
            self._prefill_wave([(s, None) for s in seqs])
            return
        while seqs:
            wave, seqs = self._next_wave(seqs)
            self._prefill_wave(wave)

    def _next_wave(self, seqs: list[Sequence]) -> tuple[list, list[Sequence]]:
        """-> (sequences to prefill now with their cache matches, sequences to prefill after)."""
        wave, later, computing = [], [], set()
        for seq in seqs:
            found = self.prefix_cache.match(seq.prompt_ids, seq.adapter.name if seq.adapter
                                            else "", seq.adapter_key)
            usable = (len(seq.prompt_ids) - 1) // self.prefix_cache.block_size
            upcoming = found.keys(len(found.blocks))  # full blocks this sequence would compute
            if len(found.blocks) < usable and upcoming[0] in computing:
                later.append(seq)  # an earlier row computes its next block: read it next wave
                continue
            computing.update(upcoming)
            wave.append((seq, found))
        return wave, later

    def _prefill_wave(self, wave: list[tuple[Sequence, PrefixMatch | None]]) -> None:
        """One forward over the uncached part of each prompt; sample the first tokens; cache the
        new full blocks; merge the rows into the running batch."""
        wave = sorted(wave, key=lambda pair: pair[0].adapter_key)  # LoRA: one slice per adapter
        seqs = [seq for seq, _ in wave]
        cached = [found.cached_tokens if found else 0 for _, found in wave]
        for (seq, found), c in zip(wave, cached, strict=True):
            seq.num_cached_tokens = c
            if found is not None:
                self.prefix_cache.use(found)
        suffixes = [seq.prompt_ids[c:] for seq, c in zip(seqs, cached, strict=True)]
        P, T = max(cached), max(map(len, suffixes))  # past columns, new columns
        ids = torch.tensor([[0] * (T - len(x)) + x for x in suffixes], device=self.device)
        mask = torch.tensor([[0] * (P - c) + [1] * c + [0] * (T - len(x)) + [1] * len(x)
                             for c, x in zip(cached, suffixes, strict=True)], device=self.device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)[:, P:]  # continue from the cached length
        past = DynamicCache()
        if P:
            past = DynamicCache(ddp_cache_data=assemble_prefixes(
                [found.blocks if found else [] for _, found in wave], P))
        logits, cache = self._forward(seqs, ids, mask, positions, past)
        self.stats["prefills"] += 1
        self.stats["prompt_tokens"] += sum(len(s.prompt_ids) for s in seqs)
        self.stats["cached_prompt_tokens"] += sum(cached)
        kv = [(layer.keys, layer.values) for layer in cache.layers]
        if self.prefix_cache is not None:
            self._cache_new_blocks(wave, kv, P + T)
        for s in seqs:
            if s.params.repetition_penalty != 1.0:
                s.seen = torch.zeros(logits.shape[-1], dtype=torch.bool, device=self.device)
                s.seen[torch.tensor(s.prompt_ids, device=self.device)] = True
        tokens = self._sample_and_record(seqs, logits)
        alive = [i for i, s in enumerate(seqs) if s.finish_reason is None]
        if not alive:
            return
        index = torch.tensor(alive, device=self.device)
        new_kv = [(k.index_select(0, index), v.index_select(0, index)) for k, v in kv]
        self._merge([seqs[i] for i in alive], new_kv, mask.index_select(0, index),
                    tokens.index_select(0, index))

    def _cache_new_blocks(self, wave, kv, width: int) -> None:
        """Copy each prompt's newly computed full blocks into the prefix cache."""
        bs = self.prefix_cache.block_size
        for row, (seq, found) in enumerate(wave):
            n_new = len(found.hashes) - len(found.blocks)
            if n_new:  # the suffix ends at column `width`; its first token is prompt token c
                start = width - (len(seq.prompt_ids) - found.cached_tokens)
                self.prefix_cache.insert(found, cut_blocks(kv, row, start, n_new, bs))
