"""The trainer job's command line: which `grpo-lab` command the plan's trainer runs, with which
flags, on each backend and flavor (`{model}`, `{proxy_url}`, ... are filled in by the plan)."""

from __future__ import annotations

from ..util.argv import flag_args
from .recipe_config import BLOG_TRAINING
from .specs import flavor_gpus

DEFAULT_TRAINER_ARGS = (
    "train-async", "--model", "{model}", "--server-url", "{proxy_url}",
    "--output-dir", "{output_dir}", "--lora-rank", "{lora_rank}",
    "--max-staleness", "{max_staleness}", "--bucket", "{output_dir}/adapters",
    "--device", "{device}", "--resume",
)
"""`grpo-lab train-async` (grpo_lab.train.async_job). `--resume` makes a restarted trainer
job (a preemption) continue from its newest checkpoint; on a first start there is none.
`{device}` is `auto` locally; on HF Jobs it follows the trainer's flavor (`cuda` on a GPU, `cpu`
on cpu-*)."""

LOCAL_RUN_DIR = "/tmp/grpo-lab-run"
"""HF trainer job: where metrics.jsonl, syncs.jsonl and completions.jsonl are appended. A bucket
mount takes whole-file writes only (hf-mount's default write mode: a file is written once from
the start, or overwritten whole; no append, no seek), so train-async's `--local-dir` copies them
whole into the run's folder of the bucket at each checkpoint and at the end."""

TRL_TRAINER_ARGS = (
    "train-trl-async", "--model", "{model}", "--server-url", "{proxy_url}",
    "--output-dir", "{output_dir}", "--lora-rank", "{lora_rank}",
    "--max-staleness", "{max_staleness}", "--bucket", "{output_dir}/adapters",
    "--device", "{device}", "--resume",
)
"""`grpo-lab train-trl-async` (grpo_lab.cli.train_trl_async): TRL's AsyncGRPOTrainer on the same
data and rewards. `--resume`: a restarted job (a preemption) continues from TRL's newest
`checkpoint-N` in the run's folder and numbers its adapters after those in the bucket; on a
first start there is none. No `--local-dir` (it rewrites its files whole, which a bucket mount
allows)."""

TRAIN_ASYNC_ONLY_FLAGS = ("request_shape",)
"""BLOG_TRAINING keys that are train-async's own: TRL's trainer shapes its requests (n = 1)
itself. `checkpoint_every` is both jobs' (TRL's save_steps)."""


def default_trainer_args(backend: str, gpu: bool = False,
                         trainer: str = "grpo-lab") -> tuple[str, ...]:
    """The trainer's `grpo-lab` arguments when none are given: DEFAULT_TRAINER_ARGS (or
    TRL_TRAINER_ARGS), plus on HF Jobs `--local-dir` (bucket mounts take whole-file writes) and
    on a GPU the blog's run."""
    if trainer == "trl":
        blog = {k: v for k, v in BLOG_TRAINING.items() if k not in TRAIN_ASYNC_ONLY_FLAGS}
        return (*TRL_TRAINER_ARGS, *(flag_args(blog) if gpu and backend != "local" else ()))
    if backend == "local":
        return DEFAULT_TRAINER_ARGS
    return (*DEFAULT_TRAINER_ARGS, "--local-dir", LOCAL_RUN_DIR,
            *(flag_args(BLOG_TRAINING) if gpu else ()))


def dropped_flags(given: tuple[str, ...] | list[str], default: tuple[str, ...]) -> list[str]:
    """The flags of `default` (the trainer's arguments when none are given) that `given`, which
    replaces them whole, leaves out: their values no longer reach the trainer."""
    return [flag for flag in dict.fromkeys(a.split("=")[0] for a in default if a.startswith("--"))
            if not any(a == flag or a.startswith(flag + "=") for a in given)]


FSDP2_LAUNCH_FLAGS = (
    "--use_fsdp", "--fsdp_version", "2",
    "--fsdp_auto_wrap_policy", "TRANSFORMER_BASED_WRAP",  # one shard group per decoder layer
    "--fsdp_reshard_after_forward", "true",  # free the gathered layer after its forward
    "--fsdp_state_dict_type", "FULL_STATE_DICT",  # adapters and checkpoints: full weights
    "--mixed_precision", "no",  # the trainer loads bf16 weights itself (grpo_lab.util.devices)
    "--dynamo_backend", "no",
)
"""`accelerate launch` flags of the trainer on several GPUs: FSDP2 shards every weight, gradient
and AdamW moment over the processes (grpo_lab.train.distributed). Flags rather than a config
file: the job script shows them, and `--dry-run` prints them."""


def trainer_launcher(flavor: str) -> list[str]:
    """The command that starts the trainer's `grpo-lab` arguments on `flavor`: `grpo-lab` on one
    GPU or a CPU; `accelerate launch` with FSDP2, one process per GPU, on several (`h200x2`)."""
    gpus = flavor_gpus(flavor)
    if gpus < 2:
        return ["grpo-lab"]
    return fsdp_launcher(gpus)


def fsdp_launcher(processes: int, accelerate: tuple[str, ...] = ("accelerate",),
                  main_process_port: int | None = None) -> list[str]:
    """`accelerate launch` with FSDP2 and `processes` processes (one per GPU), then `-m
    grpo_lab.cli`: the trainer's `grpo-lab` arguments follow. `accelerate`: how accelerate's CLI
    is called (a local plan: this interpreter, `-m accelerate.commands.accelerate_cli`);
    `main_process_port`: the processes' rendezvous port (accelerate's default: 29500)."""
    port = ["--main_process_port", str(main_process_port)] if main_process_port else []
    return [*accelerate, "launch", *FSDP2_LAUNCH_FLAGS, "--num_machines", "1",
            "--num_processes", str(processes), *port, "-m", "grpo_lab.cli"]
