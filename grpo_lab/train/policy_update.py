"""Stage 4 of GRPO: the clipped-surrogate update of a sampled batch, over micro-batches.

Mixed into grpo_lab.train.trainer.GRPOTrainer (and so into the asynchronous trainer): the KL
reference, the micro-batch layout, pi_old and the sampler correction, the optimizer step, and
bfloat16 autocast over float32 master weights. It uses the trainer's `config`, `model`,
`train_model`, `ref_model`, `optimizer`, `processes`, `device`, `autocast_dtype`, `step_count`
and `max_new_tokens`.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext

import torch

from ..algo.packing import accumulate_grpo_loss
from ..algo.sampler_correction import sampler_correction_metrics, sampler_importance_weights
from ..algo.shared_prompt import layout_micro_batches
from ..watch.flops import flops_per_token, peak_flops
from ..watch.step_metrics import layout_metrics, throughput_metrics
from .rollout_batch import RolloutBatch


class PolicyUpdate:
    """The update half of a GRPO trainer (stage 4)."""

    def autocast(self):
        """bfloat16 autocast around forward passes when full fine-tuning keeps float32 master
        weights (`autocast_dtype`); a no-op otherwise."""
        if self.autocast_dtype is None:
            return nullcontext()
        return torch.autocast(torch.device(self.device).type, dtype=self.autocast_dtype)

    @contextmanager
    def reference(self):
        """The model that scores the KL reference, without gradients: the frozen copy (full
        fine-tuning), or LoRA's base model with the adapter switched off."""
        with torch.no_grad():
            if self.ref_model is not None:
                yield self.ref_model
            else:
                with self.model.disable_adapter():
                    yield self.model

    def _pick_threads(self, _micro_batch=None) -> None:
        """Before each forward pass of a step (the asynchronous trainer picks thread counts)."""

    def _no_grad_logprobs(self, model, micro_batches: list,
                          pick_threads: bool = True) -> list[torch.Tensor]:
        """Each micro-batch's logprobs under `model`; under FSDP2 every process makes as many
        forward passes (each gathers the weights), repeating its first micro-batch if short."""
        passes = self.processes.passes(len(micro_batches)) if self.processes.is_fsdp else 0
        logps = []
        with torch.no_grad(), self.autocast():
            for mb in micro_batches:
                if pick_threads:
                    self._pick_threads(mb)
                logps.append(mb.logprobs(model, self.config.temperature))
            for _ in range(passes - len(micro_batches)):
                micro_batches[0].logprobs(model, self.config.temperature)
        return logps

    def micro_batches(self, batch: RolloutBatch, token_budget: int | None = None, **packing):
        """The batch laid out for forward passes: a row per group when `share_prompts`
        (grpo_lab.algo.shared_prompt), else a row per sequence (or `packing`'s layout)."""
        cfg = self.config
        return layout_micro_batches(
            batch, token_budget, group_size=cfg.num_generations if self.share_prompts else None,
            max_row_tokens=cfg.shared_prompt_max_tokens, **packing)

    def apply_gradients(self) -> float:
        """Clip the gradients, set this step's learning rate, take the optimizer step; returns
        the gradient norm before clipping. The schedule is a function of `step_count`, so a
        resumed run needs no scheduler state."""
        params = [p for p in self.train_model.parameters() if p.requires_grad]
        grad_norm = self.processes.clip_grad_norm_(params, self.config.max_grad_norm)
        for group in self.optimizer.param_groups:
            group["lr"] = self.config.learning_rate_at(self.step_count)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(grad_norm)

    def optimize(self, batch: RolloutBatch) -> dict[str, float]:
        """Stage 4: `num_iterations` clipped-surrogate updates on one batch, over micro-batches
        of at most `token_budget` forward tokens (one pass when None): the same loss and
        gradient either way (grpo_lab.algo.packing.accumulate_grpo_loss).

        With `vllm_importance_sampling_correction` the ratio is taken against the trainer's own
        logprobs before the first update (TRL's old_per_token_logps) and each token's loss is
        weighted by pi_old / pi_sampler. Here the sampler is this very model (`generate`), so
        the weights are 1 up to float rounding: the `sampling/*` metrics show that gap.
        """
        cfg = self.config
        micro_batches = self.micro_batches(batch, cfg.token_budget)
        ref_logps = None
        if cfg.beta > 0:
            with self.reference() as ref:
                ref_logps = self._no_grad_logprobs(ref, micro_batches, pick_threads=False)
        pi_old = torch.zeros_like(batch.old_logps)  # (B, T), from the first update's forward

        def take_pi_old(mb, logps: torch.Tensor) -> None:
            """Before any update the policy is pi_old: its logprobs are the ratio's baseline for
            every iteration, and the sampler correction weighs each token by pi_old / pi_sampler."""
            pi_old[torch.tensor(mb.indices), :logps.shape[1]] = logps
            mb.importance_weights, _ = self.sampler_weights(logps, mb.old_logps,
                                                            mb.completion_mask)
            mb.old_logps = logps

        correcting = cfg.vllm_importance_sampling_correction
        metrics: dict[str, float] = {}
        for iteration in range(cfg.num_iterations):
            loss, metrics = self.accumulate(micro_batches, ref_logps,
                                            take_pi_old if correcting and iteration == 0 else None)
            metrics.update(loss=loss, grad_norm=self.apply_gradients())
        if correcting:  # TRL's `sampling/*`, over the whole batch (this process's share)
            _, correction = self.sampler_weights(pi_old, batch.old_logps, batch.completion_mask)
            if self.processes.distributed:
                correction = self.processes.combine_metrics(correction,
                                                            float(batch.completion_mask.sum()))
            metrics.update(correction)
        metrics["batch/microbatches_per_step"] = self.processes.passes(len(micro_batches))
        metrics.update(self.step_work(batch, micro_batches))
        return metrics

    def accumulate(self, micro_batches: list, ref_logps: list | None, on_logprobs=None
                   ) -> tuple[float, dict[str, float]]:
        """One forward and backward over the step's micro-batches with this trainer's loss
        settings, under its autocast: the step's loss and metrics (`accumulate_grpo_loss`)."""
        cfg = self.config
        with self.autocast():
            return accumulate_grpo_loss(
                self.train_model, micro_batches, temperature=cfg.temperature,
                loss_type=cfg.loss_type, epsilon_low=cfg.epsilon_low,
                epsilon_high=cfg.epsilon_high, beta=cfg.beta, ref_logps=ref_logps,
                max_completion_length=self.max_new_tokens, before_each=self._pick_threads,
                on_logprobs=on_logprobs, processes=self.processes,
                use_bias_correction_kl=cfg.use_bias_correction_kl)

    def step_work(self, batch: RolloutBatch, micro_batches: list) -> dict[str, float]:
        """The step's layout metrics (grpo_lab.watch.step_metrics, a collective), keeping the
        model FLOPs of its passes for `throughput`: every training pass (num_iterations) over
        the unpadded tokens, and the reference's no-grad forward (beta > 0), a third of one."""
        cfg = self.config
        metrics, (tokens, sequences) = layout_metrics(batch, micro_batches, cfg.token_budget,
                                                      self.processes)
        per_token = flops_per_token(self.model.config, tokens // max(sequences, 1))
        passes = cfg.num_iterations + (1 / 3 if cfg.beta > 0 else 0)
        self._step_flops = per_token * tokens * passes if per_token else None
        return metrics

    def peak_flops(self) -> float | None:
        """One process's peak FLOP/s (grpo_lab.watch.flops): a GPU's published one, or the CPU's
        measured once at the trainer's threads. None when unknown (no MFU is logged)."""
        if not hasattr(self, "_peak_flops"):
            dtype = self.autocast_dtype or next(self.model.parameters()).dtype
            threads = getattr(self.config, "trainer_threads", None) or torch.get_num_threads()
            self._peak_flops = peak_flops(self.device, dtype, threads)
        return self._peak_flops

    def throughput(self, metrics: dict, fwd_bwd_s: float, step_s: float) -> dict[str, float]:
        """Tokens per second and MFU of the step whose `step_work` went into `metrics`; none
        when the update made no layout metrics (a subclass's own `optimize`, as notebook 01's)."""
        if "batch/forwarded_tokens_per_step" not in metrics:
            return {}
        return throughput_metrics(metrics, self.config.num_iterations, fwd_bwd_s, step_s,
                                  getattr(self, "_step_flops", None), self.peak_flops(),
                                  self.processes.num_processes)

    def sampler_weights(self, old_logps: torch.Tensor, sampler_logps: torch.Tensor,
                        mask: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
        """The importance weights pi_old / pi_sampler of the configured mode and cap, (B, T) or
        (B, 1), and TRL's `sampling/*` metrics of them (grpo_lab.algo.sampler_correction)."""
        cfg = self.config
        mode = cfg.vllm_importance_sampling_mode
        weights = sampler_importance_weights(
            old_logps, sampler_logps, mask, mode=mode,
            clip_max=cfg.vllm_importance_sampling_clip_max,
            clip_min=cfg.vllm_importance_sampling_clip_min)
        return weights, sampler_correction_metrics(old_logps, sampler_logps, weights, mask, mode)
