"""The asynchronous trainer's pass before its update: the trainer's own logprobs of the samples
(pi_old), TRL AsyncGRPOTrainer's `kl` (the k3 estimate of KL(pi_sampler || pi_theta), logged at
every step as TRL does; with beta > 0 the reference KL is `ref_kl`), and, with
`vllm_importance_sampling_correction`, TRL's correction of the sampler/trainer mismatch: each
token's loss weighted by pi_old / pi_sampler, truncated or masked (core/sampler_correction),
and the ratio taken against pi_old. At staleness k the weights also carry the k versions' drift,
and the clip is then around the current policy (AReaL's decoupled objective, Fu et al. 2025).
"""

from __future__ import annotations

import torch

from ..core.sampler_correction import sampler_kl
from ..train.rollout_batch import RolloutBatch


class SamplerPass:
    """Mixed into grpo_lab.rollout.async_trainer.AsyncGRPOTrainer (it uses the trainer's model,
    config, processes, `_pick_threads` and `sampler_weights`)."""

    def _no_grad_logprobs(self, model, micro_batches: list,
                          pick_threads: bool = True) -> list[torch.Tensor]:
        """Each micro-batch's logprobs under `model`; under FSDP2 every process makes as many
        forward passes (each gathers the weights), repeating its first micro-batch if short."""
        passes = self.processes.passes(len(micro_batches)) if self.processes.is_fsdp else 0
        logps = []
        for mb in micro_batches:
            if pick_threads:
                self._pick_threads(mb)
            logps.append(mb.logprobs(model, self.config.temperature))
        for _ in range(passes - len(micro_batches)):
            micro_batches[0].logprobs(model, self.config.temperature)
        return logps

    @torch.no_grad()
    def trainer_logprobs(self, batch: RolloutBatch, micro_batches: list) -> torch.Tensor:
        """The trainer's logprobs of the batch's completions with its current weights, (B, T),
        one no-grad pass over the micro-batches (TRL's old_per_token_logps)."""
        logps = torch.zeros_like(batch.old_logps)
        for mb, mb_logps in zip(micro_batches, self._no_grad_logprobs(self.model, micro_batches),
                                strict=True):
            logps[mb.indices, : mb.completion_ids.shape[1]] = mb_logps
        return logps

    def correct_for_sampler(self, batch: RolloutBatch, micro_batches: list) -> dict[str, float]:
        """Before the update: TRL AsyncGRPOTrainer's `kl` (sampler vs current policy, whatever
        beta), and with `vllm_importance_sampling_correction` TRL's correction, set into the
        micro-batches.

        `batch.old_logps` are the sampler's (the generator's, a server's over HTTP). pi_old is
        the trainer's current policy: at staleness 0 the sampler's weights, so the weights
        pi_old / pi_sampler measure only the numeric mismatch (TRL's case); at staleness k they
        also carry the k versions' drift, and the clip is then around the current policy (the
        decoupled objective of AReaL, Fu et al. 2025).
        """
        cfg = self.config
        mask = batch.completion_mask
        old_logps = self.trainer_logprobs(batch, micro_batches)
        metrics = {"kl": sampler_kl(old_logps, batch.old_logps, mask)}
        if not cfg.vllm_importance_sampling_correction:
            return metrics
        weights, correction = self.sampler_weights(old_logps, batch.old_logps, mask)
        for mb in micro_batches:
            rows, width = torch.tensor(mb.indices), mb.completion_ids.shape[1]
            mb.old_logps = old_logps[rows, :width]  # the ratio is against pi_old
            # TRL multiplies the per-token surrogate by w. `accumulate_grpo_loss` takes no
            # weights, so they go into the advantages: w >= 0 factors out of
            # -min(r A, clip(r) A), the same loss and gradient. (Only the clip_ratio metrics
            # differ from TRL's: a token with w = 0 has A = 0 and so never counts as clipped.)
            mb.advantages = mb.advantages.unsqueeze(1) * weights[rows, :width]  # (n, 1) or (n, C)
        return {**metrics, **correction}
