"""The blog's run written down: its trainer settings and the `blog` preset of `grpo-lab launch`.

Figures from the blog post and its reference scripts (AmineDiro/hfjobs-lora-buckets:
run_vllm_job.sh, run_trainer_job.sh, src/async_grpo_lora_buckets.py); docs/recipe.md's table
"The blog's run as `--preset blog`" lists each one, and tests/test_blog_preset.py checks that
table against the plan.
"""

from __future__ import annotations

HF_BLOG_MODEL = "Qwen/Qwen2.5-Math-1.5B"

BLOG_TRAINING = {
    "dataset": "sail/Sanity-Test-R1D-1.5B",  # the reference's 1,460 MATH problems (20-80 % solved)
    "answer_column": "reward_model.ground_truth",  # a nested column, read flattened
    "reward": "math_answer",  # the last \boxed{} answer against the reference
    "learning_rate": 4e-5, "lr_scheduler_type": "constant",
    "loss_type": "dapo",  # TRL's AsyncGRPOTrainer divides the loss by the batch's token count
    "num_generations": 8, "prompts_per_step": 16,  # G = 8, 128 completions per step
    "max_new_tokens": "{max_completion_length}",  # 3,000 tokens
    "temperature": 1.0,
    "weight_sync_steps": 4,
    "buffer_size": 64,  # groups: max_staleness (4) steps of 16 prompts, the reference's queue
    "request_shape": "single", "max_inflight": 128,  # TRL's n = 1 requests, its in-flight cap
    "token_budget": 16384,  # micro-batches of 16k tokens: 128 x 4k tokens do not fit at once
    "gradient_checkpointing": False,  # off, as in the blog's fastest run
    "steps": 500, "checkpoint_every": 20,
    "eval_every": 0, "eval_size": 128,  # greedy held-out accuracy before and after only
}
"""The trainer's settings on GPU flavors: the blog's run (docs/recipe.md, "The blog's run as
`--preset blog`"), as `grpo-lab train-async` flags. CPU flavors and the local backend keep
train-async's CPU-sized defaults (the tiny model on its synthetic task)."""


PRESETS: dict[str, dict] = {
    "blog": dict(backend="hf-jobs", base_model=HF_BLOG_MODEL, replicas=2, lora_rank=1,
                 max_staleness=4, max_prompt_length=1096, max_completion_length=3000,
                 gpu_memory_utilization=0.85, replica_flavor="h200", trainer_flavor="h200x2",
                 timeout="4h"),
}
"""Named runs for `grpo-lab launch --preset NAME`, as RecipeConfig fields. `blog`: the blog's run
(docs/recipe.md, "The blog's run as `--preset blog`"); on its GPU flavors the trainer gets
BLOG_TRAINING. Its trainer is two H200s, as the reference's: `accelerate launch` with FSDP2, one
process per GPU (grpo_lab.launch.trainer_args.trainer_launcher)."""
