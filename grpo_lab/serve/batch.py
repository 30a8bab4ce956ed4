"""The engine's running batch (grpo_lab.serve.engine): one row per sequence being decoded.

Rows are kept sorted by adapter, so each LoRA adapter covers one contiguous slice. The KV cache's
layers are preallocated (`PreallocatedLayer`): a decode step writes its one new column in place
instead of concatenating the whole cache. The buffers are rebuilt only when rows leave or join
(docs/internals.md, "The running batch").
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch
from transformers.cache_utils import Cache, DynamicLayer

from .lora_registry import LoRAAdapter
from .sampling import SamplingParams

MAX_ROOM = 256  # columns reserved beyond the current length, at most (memory on a GPU)


class PreallocatedLayer(DynamicLayer):
    """One layer of the running batch's KV cache: `keys` and `values` (B, H, L, D) are views of
    (B, H, capacity, D) buffers; `update` writes the new columns into the room after them."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, length: int):
        super().__init__()
        self.device, self.is_initialized = keys.device, True
        self.buffers = keys, values
        self.keys, self.values = keys[:, :, :length], values[:, :, :length]

    def update(self, key_states, value_states, *args, **kwargs):
        n, t = self.keys.shape[-2], key_states.shape[-2]
        keys, values = self.buffers
        if n + t > keys.shape[-2]:  # the engine reserves the room before each step
            raise RuntimeError(f"no room for {t} columns after {n} of {keys.shape[-2]}")
        keys[:, :, n:n + t] = key_states
        values[:, :, n:n + t] = value_states
        self.keys, self.values = keys[:, :, :n + t], values[:, :, :n + t]
        return self.keys, self.values


class RunningBatch:
    """The batch half of `Engine` (a mixin), owned by the engine thread: the rows, their KV
    cache, their attention mask and the last sampled token of each (not yet in the cache)."""

    _rows: list[Sequence]
    _cache: Cache | None  # of PreallocatedLayers
    _mask: torch.Tensor  # (B, L) 1 on real tokens: the first L columns of _mask_buffer
    _mask_buffer: torch.Tensor  # (B, capacity)
    _next: torch.Tensor  # (B,)
    device: torch.device
    max_model_len: int
    stats: dict

    def _reset_batch(self) -> None:
        self._rows, self._cache = [], None
        self._mask_buffer = torch.zeros(0, 0, dtype=torch.long, device=self.device)
        self._mask = self._mask_buffer
        self._next = torch.zeros(0, dtype=torch.long, device=self.device)

    def _kv(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(layer.keys, layer.values) for layer in self._cache.layers]

    def _decode_columns(self) -> torch.Tensor:
        """The mask with one more real column for every row (the token this step feeds)."""
        L = self._mask.shape[1]
        if L == self._mask_buffer.shape[1]:  # out of room: rebuild with more
            self._fill([(self._kv(), self._mask, self._next, None, None)], L)
        self._mask_buffer[:, L] = 1
        self._mask = self._mask_buffer[:, :L + 1]
        return self._mask

    def _select_rows(self, keep: list[int]) -> None:
        """Keep these rows (in this order) and cut leading columns that are padding for all."""
        if not keep:
            self._reset_batch()
            return
        index = torch.tensor(keep, device=self.device)
        mask = self._mask.index_select(0, index)
        start = int((mask.sum(0) > 0).long().argmax())  # first column holding a real token
        kv = [(k[:, :, start:], v[:, :, start:]) for k, v in self._kv()]
        part = (kv, self._mask[:, start:], self._next, index, None)
        self._rows = [self._rows[i] for i in keep]
        self._fill([part], self._mask.shape[1] - start)

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
        """Append new rows to the running batch, left padding the shorter side, sorted by
        adapter."""
        rows = self._rows + seqs
        order = sorted(range(len(rows)), key=lambda i: rows[i].adapter_key)  # stable
        where = [0] * len(rows)  # where[i]: the new row of rows[i]
        for new, old in enumerate(order):
            where[old] = new
        n_old = len(self._rows)
        parts = [(kv, mask, next_tokens, None, torch.tensor(where[n_old:], device=self.device))]
        if n_old:
            parts.append((self._kv(), self._mask, self._next, None,
                          torch.tensor(where[:n_old], device=self.device)))
        self._rows = [rows[i] for i in order]
        self._fill(parts, max(p[1].shape[1] for p in parts))
        self.stats["max_batch"] = max(self.stats["max_batch"], len(self._rows))

    def _room(self) -> int:
        """The most decode steps any running row may still take, at most MAX_ROOM."""
        steps = max(min(s.params.max_tokens, self.max_model_len - len(s.prompt_ids))
                    - len(s.output_ids) for s in self._rows)
        return max(1, min(steps, MAX_ROOM))

    def _fill(self, parts, L: int) -> None:
        """New buffers for `self._rows`, L columns used. Each part is (kv, mask, next tokens,
        source rows or None for all, destination rows or None for the same); its columns are
        right aligned at L, after left padding (zeros: hidden by the mask, finite for attention).
        The room after L is left unset: each step writes its column before attention reads it."""
        B, capacity = len(self._rows), L + self._room()
        template = parts[0][0]
        layers = []
        for layer in range(len(template)):
            buffers = []
            for which in (0, 1):  # keys, values
                like = template[layer][which]  # (B', H, L', D)
                buffer = like.new_empty(B, like.shape[1], capacity, like.shape[3])
                for kv, mask, _, src, dest in parts:
                    rows = kv[layer][which]
                    if src is not None:
                        rows = rows.index_select(0, src)
                    to, pad = slice(None) if dest is None else dest, L - mask.shape[1]
                    buffer[to, :, pad:L] = rows
                    if pad:
                        buffer[to, :, :pad] = 0
                buffers.append(buffer)
            layers.append(PreallocatedLayer(*buffers, L))
        self._cache = Cache(layers=layers)
        self._mask_buffer = parts[0][1].new_zeros(B, capacity)
        self._next = parts[0][2].new_zeros(B)
        for _, mask, next_tokens, src, dest in parts:
            if src is not None:
                mask, next_tokens = mask.index_select(0, src), next_tokens.index_select(0, src)
            to = slice(None) if dest is None else dest
            self._mask_buffer[to, L - mask.shape[1]:L] = mask
            self._next[to] = next_tokens
        self._mask = self._mask_buffer[:, :L]


# ------------------------------------------------------------ the requests
# The requests of the engine (grpo_lab.serve.engine): one `Sequence` per completion, grouped.
#
# A request for n completions of each of its prompts becomes one `RequestGroup` of `Sequence`s,
# each with its own sampling parameters and seeded generator. The server submits the group to the
# engine and awaits its asyncio future, which resolves once every sequence has finished
# (`finish_reason` "stop", "length" or "abort").


@dataclass(eq=False)
class Sequence:
    """One completion being generated (child `index` of a request with n completions)."""

    prompt_ids: list[int]
    params: SamplingParams
    adapter: LoRAAdapter | None
    generator: torch.Generator
    group: RequestGroup | None = None
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    finish_reason: str | None = None  # "stop", "length" or "abort"
    stop_reason: int | str | None = None  # the stop token id, when one ended it
    seen: torch.Tensor | None = None  # (V,) bool, only with a repetition penalty
    num_cached_tokens: int = 0  # prompt tokens read from the prefix cache, not computed

    @property
    def adapter_key(self) -> int:
        return self.adapter.id if self.adapter is not None else 0


class RequestGroup:
    """The sequences of one request; its asyncio future resolves when all have finished."""

    def __init__(self, sequences: list[Sequence], loop=None, future=None):
        self.sequences = sequences
        self.loop, self.future = loop, future
        self.cancelled = False  # set by the server when the client goes away
        self.error: BaseException | None = None
        self._left = len(sequences)
        for seq in sequences:
            seq.group = self

    def sequence_finished(self) -> None:
        """The engine finished one of the group's sequences; the last one resolves the group."""
        self._left -= 1
        if self._left == 0:
            self.resolve()

    def resolve(self) -> None:
        """Hand the group back to whoever waits for it (the server's request, on its loop)."""
        if self.future is not None and self.loop is not None:
            self.loop.call_soon_threadsafe(self._set_future)

    def _set_future(self) -> None:
        if not self.future.done():
            if self.error is not None:
                self.future.set_exception(self.error)
            else:
                self.future.set_result(self)


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator:
    """A per-sequence generator on the engine's device (sampling draws its noise there);
    unseeded sequences get a fresh random seed. A CUDA generator draws other numbers than a CPU
    one from the same seed: a seed repeats its samples on one kind of device."""
    seed = random.SystemRandom().getrandbits(63) if seed is None else seed
    return torch.Generator(device=device).manual_seed(seed % 2**64)
