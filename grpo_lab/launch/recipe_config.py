"""`RecipeConfig`: the settings of the recipe's plan (grpo_lab.launch.recipe_plan), the flags of
`grpo-lab launch`, one docstring per field."""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..serve.prefix_cache import DEFAULT_BLOCK_SIZE

RUN_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]*")
"""A run's name becomes its HF jobs' names and a label: the Hub's labels take letters, digits, `-`
and `_` only (huggingface_hub's `_sanitize_job_name` turns anything else, `.` included, into
`-`)."""


def check_run_name(name: str) -> None:
    """Raise ValueError naming a run name the Hub would refuse, and the name it would take."""
    if not RUN_NAME_RE.fullmatch(name):
        fixed = re.sub(r"[^A-Za-z0-9_-]", "-", name).lstrip("-_") or "run"
        raise ValueError(f"run name {name!r}: a run's name labels its HF jobs, and the Hub's "
                         f"labels take letters, digits, '-' and '_' (starting with a letter or "
                         f"digit): use e.g. {fixed!r}")


@dataclass
class RecipeConfig:
    """Parameters of `recipe_plan` (and flags of `grpo-lab launch`)."""

    backend: str = "local"
    """`local` (one process per job on this machine) or `hf-jobs` (one Hugging Face Job each)."""
    base_model: str | None = None
    """Base model the replicas serve and the trainer adapts (default: `tiny`, the offline tiny
    model, locally and on CPU flavors; Qwen/Qwen2.5-Math-1.5B, the blog's model, on GPUs)."""
    replicas: int = 2
    """Inference replicas behind the proxy."""
    trainer: str = "grpo-lab"
    """The trainer job: `grpo-lab` (`grpo-lab train-async`) or `trl` (`grpo-lab train-trl-async`,
    TRL's AsyncGRPOTrainer: on a GPU it imports vLLM, which the vLLM image has, and fetches its
    attention kernel from the Hub with `kernels`; docs/recipe.md). On HF Jobs `trl` needs a GPU
    trainer flavor: the cpu-* image has no vLLM."""
    lora_rank: int = 1
    """LoRA rank of the trained adapter; the servers' --max-lora-rank is the smallest of vLLM's
    allowed values (1, 8, 16, 32, 64, 128, 256, 320, 512) that holds it."""
    max_staleness: int = 4
    """Versions a sample may lag the trainer; servers hold max_staleness + 2 adapters."""
    max_cpu_loras: int | None = None
    """vLLM replicas: adapters kept in CPU memory, at least max_staleness + 2 (default:
    max_staleness + 4, the reference's 8 at the default staleness)."""
    gpu_memory_utilization: float = 0.85
    """vLLM replicas: fraction of the GPU each one takes (weights, activations, KV cache); the
    reference's 0.85. Replicas sharing one local GPU must split it."""
    max_prompt_length: int = 1096
    """vLLM replicas: longest prompt in tokens; with max_completion_length it sets
    --max-model-len (1096 + 3000 = 4096, the reference's)."""
    max_completion_length: int = 3000
    """vLLM replicas: longest completion in tokens (the blog's 3,000)."""
    block_size: int = DEFAULT_BLOCK_SIZE
    """KV block size of the replicas' prefix caches and of the proxy's router (vLLM's
    --block-size, 16 by default). A prompt shorter than one block has nothing to be routed or
    cached on: the demo's tiny prompts (7 tokens) use 4."""
    bucket: str | None = None
    """Local directory (default: $GRPO_LAB_HOME/bucket) or hf://buckets/<owner>/<bucket>
    (required on HF Jobs)."""
    mount_path: str | None = None
    """Where every job sees the bucket (default /lora on HF Jobs; locally the directory itself,
    since processes on one machine already share paths)."""
    replica_flavor: str | None = None
    """HF Jobs flavor of each replica (default h200: `vllm serve`; a cpu-* flavor runs
    `grpo-lab serve`). Locally: `local`."""
    trainer_flavor: str | None = None
    """HF Jobs flavor of the trainer job, which also runs the proxy (default h200)."""
    engine: str | None = None
    """Replica server: `vllm` or `grpo-lab` (default: vllm on GPU flavors, grpo-lab otherwise)."""
    port: int = 8000
    """Port of each replica on HF Jobs, and of the proxy inside the trainer job. Locally every
    job gets a free port."""
    free_ports: bool = False
    """HF Jobs plan: give each replica and the proxy a free port of this machine instead of
    `port`, for jobs that share one host (tests/hf_jobs_emulator.py runs the plan here); on HF
    Jobs every job has a network of its own, so all can use `port`."""
    network_group: bool = False
    """HF Jobs: the run's jobs join one network group (huggingface_hub's `network_group`), so the
    trainer's proxy reaches the replicas inside it rather than through the public jobs proxy
    (no response-hold limit, no bearer). The public URLs stay for the launcher's health checks
    and are the fallback where huggingface_hub has no network groups. Off by default: not yet
    run on the real Hub."""
    steps: int | None = None
    """The trainer's optimizer steps (train-async's and train-trl-async's `--steps`; default: the
    blog's 500 on GPU flavors, the trainer's own default otherwise). The forecast simulates it."""
    max_inflight: int | None = None
    """The trainer's cap on requests in flight to the replicas (`--max-inflight`; default: the
    blog's 128 on GPU flavors). The forecast simulates it."""
    token_budget: int | None = None
    """The trainer's tokens per micro-batch (`--token-budget`; default: the blog's 16,384 on GPU
    flavors). The forecast simulates it and checks it against the trainer's GPU memory."""
    timeout: str = "4h"
    """Longest run of each HF job. On GPU flavors `grpo-lab launch` sets it from the forecast
    (wall clock x 1.5 + 30 min) unless given, and refuses a given one the forecast exceeds."""
    install: str | None = None
    """Shell command that installs grpo_lab in the HF jobs that run it. Default: a wheel of this
    checkout, built and copied into the bucket at submission (`<bucket>/<run>/wheels/`) and
    installed from the mount (core dependencies only, retried: grpo_lab.launch.specs). Or e.g.
    `pip install git+https://github.com/<you>/grpo_lab`; `true` for an image that already has
    it."""
    run_name: str | None = None
    """Names the HF jobs and the run's folder in the bucket (default: recipe-<date>-<time>);
    letters, digits, `-` and `_`, as the Hub's labels take them."""
    health_timeout_s: float = 300.0
    """Local backend: how long to wait for each server's /health."""
    report_to: str = "none"
    """The trainer's `--report-to`: where it sends each metrics.jsonl record besides, `none`,
    `trackio`, `tensorboard` or several, comma separated; the run is named `run_name` there, the
    same across the job's resumes. The HF trainer job then installs grpo_lab[tracking]."""
    trackio_space_id: str | None = None
    """The trainer's `--trackio-space-id`: the Space trackio logs to (`user/name`, with the job's
    HF_TOKEN). None = locally under TRACKIO_DIR; on HF Jobs, where the job's disk goes with it,
    report_to trackio needs a Space."""

    def __post_init__(self):
        if self.run_name is not None:
            check_run_name(self.run_name)
        for name in TRAINER_KNOBS:
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < 1):
                raise ValueError(f"{name} must be a whole number >= 1 (or None for the "
                                 f"default), got {value!r}")

    def trainer_knobs(self) -> dict:
        """The trainer's settings given here (TRAINER_KNOBS not None), as train-async fields."""
        return {name: getattr(self, name) for name in TRAINER_KNOBS
                if getattr(self, name) is not None}


TRAINER_KNOBS = ("steps", "max_inflight", "token_budget")
"""RecipeConfig fields that go to the trainer's command line (after its defaults, so they win)
and into the planner's forecast: the recipe's knobs a launch most often changes."""


# --- The blog's run
# The blog's run written down: its trainer settings and the `blog` preset of `grpo-lab launch`.
#
# Figures from the blog post and its reference scripts (AmineDiro/hfjobs-lora-buckets:
# run_vllm_job.sh, run_trainer_job.sh, src/async_grpo_lora_buckets.py); docs/recipe.md's table
# "The blog's run as `--preset blog`" lists each one, and tests/test_blog_preset.py checks that
# table against the plan.


HF_BLOG_MODEL = "Qwen/Qwen2.5-Math-1.5B"

BLOG_TRAINING = {
    "dataset": "sail/Sanity-Test-R1D-1.5B",  # the reference's 1,460 MATH problems (20-80 % solved)
    "answer_column": "reward_model.ground_truth",  # a nested column, read flattened
    "reward": "math_answer",  # the last \boxed{} answer against the reference
    "learning_rate": 4e-5, "lr_scheduler_type": "constant",
    "loss_type": "dapo",  # TRL's AsyncGRPOTrainer divides the loss by the batch's token count
    "num_generations": 8, "prompts_per_step": 16,  # G = 8, 128 completions per step
    "max_completion_length": "{max_completion_length}",  # 3,000 tokens
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
