"""`AsyncGRPOConfig`: `GRPOConfig` plus the pipeline's settings (grpo_lab.train.async_trainer).

Staleness and weight syncs, the rollout buffer's size, token-budget micro-batches and the
torch threads of the worker and the trainer. A docstring under each field is its flag's help.
"""

from __future__ import annotations

from dataclasses import dataclass

from .config import GRPOConfig, named_like_trl


@named_like_trl
@dataclass
class AsyncGRPOConfig(GRPOConfig):
    # --- the pipeline ---
    asynchronous: bool = True
    """False = generate then train in the trainer's thread (the synchronous baseline, same code)."""
    max_staleness: int = 1
    """Most versions a sample may lag the trainer (0 = on-policy only: no overlap)."""
    weight_sync_steps: int = 1
    """Optimizer steps between weight syncs; each sync publishes version v+1 to the generator.
    The synchronous mode syncs every step (it always samples from the current weights)."""
    buffer_size: int | None = None
    """Groups (one prompt's G completions) the rollout buffer holds; None = prompts_per_step."""
    vllm_importance_sampling_correction: bool = False
    """As TRL's AsyncGRPOTrainer, which has no such correction: the ratio is taken against the
    sampler's own logprobs (stale by up to max_staleness versions). True: the ratio is taken
    against the trainer's weights before the update (pi_old, from the update's own forward) and
    each token is weighted by pi_old / pi_sampler, truncated or masked (AReaL's decoupled
    objective; grpo_lab.algo.sampler_correction). TRL's `kl` (sampler vs policy) is logged
    either way."""

    # --- micro-batching (token_budget: grpo_lab.train.config.GRPOConfig) ---
    pack_sequences: bool = False
    """Pack several sequences per row with a block-diagonal mask (needs token_budget)."""
    pack_row_tokens: int = 64
    """Row length when packing; the dense mask costs row_tokens^2 per row, so keep it short."""

    # --- threads (torch's intra-op thread count is per calling thread; CPU runs only) ---
    generator_threads: int = 1
    """torch intra-op threads of the rollout worker."""
    trainer_threads: int = 1
    """torch intra-op threads of the trainer."""
    trainer_idle_threads: int | None = None
    """Threads for a micro-batch that starts while the worker is not generating (blocked by
    backpressure or admission): the trainer borrows the idle core. None = trainer_threads.
    Useful with a token_budget that gives 2+ micro-batches per step, on cores no other process
    uses (a torch thread without a free core slows every op of its team)."""

    def __post_init__(self):
        super().__post_init__()
        problems = []
        if self.max_staleness < 0:
            problems.append(f"max_staleness must be >= 0 (got {self.max_staleness})")
        for name in ("weight_sync_steps", "generator_threads", "trainer_threads",
                     "pack_row_tokens"):
            if getattr(self, name) < 1:
                problems.append(f"{name} must be >= 1 (got {getattr(self, name)})")
        if self.buffer_size is not None and self.buffer_size < self.prompts_per_step:
            problems.append(f"buffer_size must hold one step's {self.prompts_per_step} groups "
                            f"(got {self.buffer_size})")
        if self.pack_sequences and self.token_budget is None:
            problems.append("pack_sequences needs a token_budget")
        if self.trainer_idle_threads is not None and self.trainer_idle_threads < 1:
            problems.append(f"trainer_idle_threads must be >= 1 (got {self.trainer_idle_threads})")
        if self.dynamic_sampling:
            problems.append("dynamic_sampling is implemented by the synchronous GRPOTrainer only")
        if problems:
            raise ValueError("invalid AsyncGRPOConfig: " + "; ".join(problems))

    @property
    def effective_buffer_size(self) -> int:
        """Computed at runtime: buffer_size, or prompts_per_step when unset."""
        return self.buffer_size or self.prompts_per_step
