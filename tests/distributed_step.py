"""One GRPO step's loss and gradients, on fixed samples, in one process or under `accelerate
launch` (tests/test_distributed.py runs it both ways and compares). Writes JSON to argv[1].

Both trainers: `GRPOTrainer` (one pass, the GRPO aggregation) and `AsyncGRPOTrainer` (token-budget
micro-batches, DAPO's token mean, the sampler correction): the two ways the loss is aggregated.
"""

from __future__ import annotations

import json
import sys

import torch

from grpo_lab.rollout.groups import split
from grpo_lab.train.async_config import AsyncGRPOConfig
from grpo_lab.train.async_trainer import AsyncGRPOTrainer
from grpo_lab.train.config import GRPOConfig
from grpo_lab.train.rollout_batch import RolloutBatch
from grpo_lab.train.trainer import GRPOTrainer

SMALL = dict(prompts_per_step=5, num_generations=4, eval_size=8, progress=False,  # tiny step
             log_completions_every=0, device="cpu", seed=3)


def step_on_fixed_samples(trainer: GRPOTrainer) -> dict:
    """Generate the step's samples on the main process, give each process its prompts' rows
    (whole groups), take one optimizer step; returns the loss and the gradient."""
    processes, G = trainer.processes, trainer.config.num_generations
    batch = None
    if processes.is_main:
        problems = trainer.task.sample_batch(trainer.rng, trainer.config.prompts_per_step)
        batch, _, _ = trainer.make_batch(problems)
    batch = processes.broadcast(batch)
    prompts = split(list(range(trainer.config.prompts_per_step)), processes.num_processes)
    rows = torch.tensor([p * G + g for p in prompts[processes.index] for g in range(G)])
    mine = RolloutBatch(*(getattr(batch, f)[rows] for f in RolloutBatch.__dataclass_fields__))
    grads = {}
    apply = trainer.apply_gradients

    def capture() -> float:
        grads.update({n: p.grad.detach().flatten().tolist()
                      for n, p in trainer.model.named_parameters() if p.requires_grad})
        return apply()

    trainer.apply_gradients = capture
    metrics = trainer.optimize(mine)
    real = batch.completion_mask.bool()
    # What the float32 tolerances of the comparison count (tests/float_tolerance.py): the step's
    # tokens (the loss's terms), their mean |advantage| (the terms' size at ratio 1) and every
    # real position (the terms of a gradient entry).
    sizes = {"tokens": int(real.sum()),
             "term_size": batch.advantages.abs().unsqueeze(1).expand_as(real)[real].mean().item(),
             "positions": int(batch.prompt_mask.sum() + batch.completion_mask.sum())}
    # The step's completions, every process's (grpo_lab.watch.step_metrics): as one process's.
    layout = {n: metrics[n] for n in ("batch/trained_tokens_per_step", "batch/samples_per_step",
                                      "batch/masked_token_frac", "sample/forwarded_tokens_max")}
    return {"loss": metrics["loss"], "ratio": metrics["ratio"], "grads": grads,
            "rows": len(rows), "layout": layout, **sizes}


def main(path: str) -> None:
    torch.manual_seed(0)
    sync = GRPOTrainer(GRPOConfig(loss_type="grpo", **SMALL))
    result = {"sync": step_on_fixed_samples(sync)}
    del sync
    asynchronous = AsyncGRPOTrainer(AsyncGRPOConfig(
        loss_type="dapo", token_budget=40, vllm_importance_sampling_correction=True,
        asynchronous=False, **SMALL))
    result["async"] = step_on_fixed_samples(asynchronous)
    result["processes"] = asynchronous.processes.num_processes
    if asynchronous.processes.is_main:
        with open(path, "w") as f:
            json.dump(result, f)
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():  # a clean teardown: a process that exits
        dist.barrier()  # while its peer still talks over gloo can abort it (SIGABRT)
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
