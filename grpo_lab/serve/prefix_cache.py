"""Automatic prefix caching (vLLM's `--enable-prefix-caching`): reuse the KV of prompt prefixes.

GRPO sends each prompt G times, and prompts share templates, so prefill would compute the same
keys and values again and again. `PrefixCache` keeps them block by block, keyed by the chained
hash of grpo_lab.serve.block_hashes under the adapter's name, least recently used evicted
first; `assemble_prefixes` and `cut_blocks` move blocks into and out of a batched prefill.
How: docs/internals.md, "Prefill and the prefix cache"; what it counts: docs/serving-api.md,
"Prefix caching in grpo-lab serve".
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from .block_hashes import DEFAULT_BLOCK_SIZE, chained_block_hashes

DEFAULT_MAX_BLOCKS = 1024  # 16,384 tokens; the tiny model's KV is 64 KiB a block


@dataclass(eq=False)
class KVBlock:
    """The keys and values of one full block of tokens, under one load of one adapter."""

    kv: torch.Tensor  # (layers, 2, kv_heads, block_size, head_dim): [:, 0] keys, [:, 1] values
    adapter_id: int  # the adapter's load id (grpo_lab.serve.lora_registry), 0 = base model


@dataclass
class PrefixMatch:
    """A prompt's full-block hashes and the cached run at their start (from `match`)."""

    namespace: str  # the adapter's name, "" = base model
    adapter_id: int
    prompt_len: int
    hashes: list[int]  # one per full block of the prompt
    blocks: list[KVBlock] = field(default_factory=list)  # the cached run, from block 1

    @property
    def cached_tokens(self) -> int:
        return sum(block.kv.shape[3] for block in self.blocks)

    def keys(self, start: int = 0) -> list[tuple[str, int, int]]:
        """Keys of the blocks from `start` on, as the cache and prefill waves name them."""
        return [(self.namespace, self.adapter_id, h) for h in self.hashes[start:]]


class PrefixCache:
    """KV blocks keyed by (adapter name, chained hash); LRU, at most `max_blocks` of them."""

    def __init__(self, block_size: int = DEFAULT_BLOCK_SIZE,
                 max_blocks: int = DEFAULT_MAX_BLOCKS):
        if block_size < 1 or max_blocks < 1:
            raise ValueError(f"block_size and max_blocks must be >= 1, got {block_size}, "
                             f"{max_blocks}")
        self.block_size, self.max_blocks = block_size, max_blocks
        self._blocks: OrderedDict[tuple[str, int], KVBlock] = OrderedDict()  # oldest first
        self._lock = threading.Lock()
        self._counts = dict(queries=0, hits=0, inserted=0, evicted=0, dropped=0, resets=0)

    def __len__(self) -> int:
        return len(self._blocks)

    # ---- lookup ---------------------------------------------------------------------------------

    def match(self, prompt_ids: list[int], namespace: str = "", adapter_id: int = 0) -> PrefixMatch:
        """The longest cached run of the prompt's full blocks; counts nothing, moves nothing
        (the engine calls `use` once it prefills the sequence)."""
        hashes = chained_block_hashes(prompt_ids, namespace, self.block_size)
        found = PrefixMatch(namespace, adapter_id, len(prompt_ids), hashes)
        usable = (len(prompt_ids) - 1) // self.block_size  # keep >= 1 token to compute
        with self._lock:
            for h in hashes[:usable]:
                block = self._blocks.get((namespace, h))
                if block is None or block.adapter_id != adapter_id:
                    break  # chained keys: nothing after a miss can be the same prefix
                found.blocks.append(block)
        return found

    def use(self, found: PrefixMatch) -> None:
        """Count one lookup (vLLM: queries += prompt tokens, hits += cached tokens) and
        refresh its blocks in the LRU order."""
        with self._lock:
            self._counts["queries"] += found.prompt_len
            self._counts["hits"] += found.cached_tokens
            self._refresh(found.namespace, found.hashes[: len(found.blocks)])

    # ---- insertion, eviction, flushing -----------------------------------------------------------

    def insert(self, found: PrefixMatch, new_blocks: list[torch.Tensor]) -> None:
        """Store the blocks computed after `found`'s cached run (block len(found.blocks) on)."""
        start = len(found.blocks)
        with self._lock:
            for h, kv in zip(found.hashes[start:], new_blocks, strict=True):
                key = (found.namespace, h)
                old = self._blocks.get(key)
                if old is None or old.adapter_id != found.adapter_id:  # new, or a newer load
                    self._blocks[key] = KVBlock(kv, found.adapter_id)
                    self._counts["inserted"] += 1
            self._refresh(found.namespace, found.hashes[: start + len(new_blocks)])
            while len(self._blocks) > self.max_blocks:  # least recently used first
                self._blocks.popitem(last=False)
                self._counts["evicted"] += 1

    def _refresh(self, namespace: str, hashes: list[int]) -> None:
        """Mark a prefix's blocks most recently used, deepest first: block 1 ends freshest."""
        for h in reversed(hashes):
            if (namespace, h) in self._blocks:
                self._blocks.move_to_end((namespace, h))

    def drop(self, namespace: str) -> int:
        """Forget every block of one adapter name (loaded again or unloaded); -> blocks dropped."""
        with self._lock:
            keys = [key for key in self._blocks if key[0] == namespace]
            for key in keys:
                del self._blocks[key]
            self._counts["dropped"] += len(keys)
            return len(keys)

    def reset(self) -> int:
        """Forget every block (`POST /reset_prefix_cache`); the counters keep counting."""
        with self._lock:
            n = len(self._blocks)
            self._blocks.clear()
            self._counts["resets"] += 1
            self._counts["dropped"] += n
            return n

    def stats(self) -> dict:
        """Counters in tokens (queries, hits) and blocks (inserted, evicted, dropped), and the
        cache's size now (blocks, bytes)."""
        with self._lock:
            size = sum(b.kv.numel() * b.kv.element_size() for b in self._blocks.values())
            return dict(self._counts, blocks=len(self._blocks), bytes=size,
                        block_size=self.block_size, max_blocks=self.max_blocks)


# ---- moving KV between the cache and a batch ------------------------------------------------


def assemble_prefixes(rows: list[list[KVBlock]],
                      width: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each row's cached blocks, concatenated and left padded to `width` tokens, as one past KV
    per layer: [(keys, values)], each (rows, kv_heads, width, head_dim). Rows without a cached
    prefix are all padding (the attention mask hides it)."""
    template = next(blocks[0].kv for blocks in rows if blocks)
    layers, _, heads, _, dim = template.shape
    past = template.new_zeros(len(rows), layers, 2, heads, width, dim)
    for i, blocks in enumerate(rows):
        if blocks:
            prefix = torch.cat([b.kv for b in blocks], dim=3)  # (layers, 2, heads, c, dim)
            past[i, :, :, :, width - prefix.shape[3]:] = prefix  # left padded: ends at `width`
    return [(past[:, layer, 0], past[:, layer, 1]) for layer in range(layers)]


def cut_blocks(layers_kv: list[tuple[torch.Tensor, torch.Tensor]], row: int, start: int,
               n_blocks: int, block_size: int) -> list[torch.Tensor]:
    """Copy `n_blocks` full blocks of one batch row out of a KV cache, from column `start`:
    one new (layers, 2, kv_heads, block_size, head_dim) tensor each (no view of the batch)."""
    blocks = []
    for b in range(n_blocks):
        a, z = start + b * block_size, start + (b + 1) * block_size
        blocks.append(torch.stack([torch.stack([k[row, :, a:z], v[row, :, a:z]])
                                   for k, v in layers_kv]))  # stack copies: a fresh tensor
    return blocks
