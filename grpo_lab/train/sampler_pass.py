"""The asynchronous trainer's proximal policy pi_old: the trainer's own logprobs of the samples
before the update, TRL AsyncGRPOTrainer's `kl` (the k3 estimate of KL(pi_sampler || pi_theta),
logged at every step as TRL does; with beta > 0 the reference KL is `ref_kl`), and, with
`vllm_importance_sampling_correction`, TRL's correction of the sampler/trainer mismatch: each
token's loss weighted by pi_old / pi_sampler, truncated or masked (algo/sampler_correction),
and the ratio taken against pi_old. At staleness k the weights also carry the k versions' drift,
and the clip is then around the current policy (AReaL's decoupled objective, Fu et al. 2025).

pi_old costs no pass of its own: before the first update the policy *is* pi_old, so the update's
forward gives its logprobs (`ProximalLogprobs`, the `on_logprobs` hook of
grpo_lab.algo.packing.accumulate_grpo_loss): the numbers TRL computes as old_per_token_logps in
a no-grad pass of their own (tests/test_sampler_correction.py compares the two).
"""

from __future__ import annotations

import torch

from ..algo.sampler_correction import sampler_kl
from .rollout_batch import RolloutBatch


class ProximalLogprobs:
    """pi_old of one step's batch, collected micro-batch by micro-batch from the first update's
    forward (pass it as `on_logprobs`); `logps` is (B, T), 0 where no micro-batch reaches.

    With the correction, each micro-batch gets its weights before its loss: its `old_logps`
    become pi_old (the ratio is against pi_old) and its advantages carry the weights."""

    def __init__(self, trainer: SamplerPass, batch: RolloutBatch):
        self.trainer, self.batch = trainer, batch
        self.logps = torch.zeros_like(batch.old_logps)  # (B, T)

    def __call__(self, mb, logps: torch.Tensor) -> None:
        rows, width = torch.tensor(mb.indices), mb.completion_ids.shape[1]
        self.logps[rows, :width] = logps
        if not self.trainer.config.vllm_importance_sampling_correction:
            return
        # The weights of these rows, from whole rows (as for the whole batch): (n, T) or (n, 1).
        weights, _ = self.trainer.sampler_weights(self.logps[rows], self.batch.old_logps[rows],
                                                  self.batch.completion_mask[rows])
        mb.old_logps = logps  # the ratio is against pi_old
        # TRL multiplies the per-token surrogate by w. `accumulate_grpo_loss` takes no weights,
        # so they go into the advantages: w >= 0 factors out of -min(r A, clip(r) A), the same
        # loss and gradient. (Only the clip_ratio metrics differ from TRL's: a token with w = 0
        # has A = 0 and so never counts as clipped.)
        mb.advantages = mb.advantages.unsqueeze(1) * weights[:, :width]  # (n, 1) or (n, C)


class SamplerPass:
    """Mixed into grpo_lab.train.async_trainer.AsyncGRPOTrainer (it uses the trainer's
    config and `sampler_weights`)."""

    def sampler_metrics(self, batch: RolloutBatch, prox_logps: torch.Tensor) -> dict[str, float]:
        """TRL AsyncGRPOTrainer's `kl` (sampler vs pi_old, whatever beta), and with
        `vllm_importance_sampling_correction` TRL's `sampling/*` metrics, over the whole batch.

        `batch.old_logps` are the sampler's (the generator's, a server's over HTTP); `prox_logps`
        are pi_old's, the trainer's weights before this step's update (`ProximalLogprobs`). At
        staleness 0 these are the sampler's weights, so the weights pi_old / pi_sampler measure
        only the numeric mismatch (TRL's case); at staleness k they also carry the k versions'
        drift, and the clip is then around the current policy (the decoupled objective of
        AReaL, Fu et al. 2025).
        """
        mask = batch.completion_mask
        metrics = {"kl": sampler_kl(prox_logps, batch.old_logps, mask)}
        if not self.config.vllm_importance_sampling_correction:
            return metrics
        _, correction = self.sampler_weights(prox_logps, batch.old_logps, mask)
        return {**metrics, **correction}
