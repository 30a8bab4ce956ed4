"""The requests of the engine (grpo_lab.serve.engine): one `Sequence` per completion, grouped.

A request for n completions of each of its prompts becomes one `RequestGroup` of `Sequence`s,
each with its own sampling parameters and seeded generator. The server submits the group to the
engine and awaits its asyncio future, which resolves once every sequence has finished
(`finish_reason` "stop", "length" or "abort").
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

from .lora_registry import LoRAAdapter
from .sampling import SamplingParams


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
