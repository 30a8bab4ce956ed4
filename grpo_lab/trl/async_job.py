"""`grpo-lab train-trl-async`: the trainer job with TRL's AsyncGRPOTrainer (trl/async_trainer).

The same run as `grpo-lab train-async`, TRL's trainer in place of grpo_lab's: the same training
and job flags, TRL's checkpoints in `<output-dir>/trl` (`--resume` numbers adapters after the
newest one in the bucket), TRL's metric names in metrics.jsonl (docs/internals.md, "TRL's trainer
job"; docs/recipe.md, "TRL's AsyncGRPOTrainer as the trainer job").
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from ..rollout.http_generator import check_replicas
from ..train.async_config import AsyncGRPOConfig
from ..train.async_job import TrainerJobConfig, check_trainer_settings
from ..util.devices import resolve_device
from ..util.files import read_jsonl
from ..watch.doctor import make_doctor
from . import async_trainer as trl_async
from .async_trainer import (
    LORA_NAME,
    max_prompt_tokens,
    reward_funcs,
    trl_dataset,
    with_response_parser,
)
from .doctor_callback import DoctorCallback


@dataclass
class TrlAsyncJobConfig(TrainerJobConfig):
    """The job flags of `grpo-lab train-trl-async`: the shared ones (TrainerJobConfig) and these.
    Its checkpoints are TRL's `checkpoint-N` in <output-dir>/trl (save_steps, save_total_limit);
    `max_inflight` is TRL's max_inflight_tasks (default: max_staleness x samples per step)."""

    command: ClassVar[str] = "train-trl-async"

    server_timeout_s: float = 240.0
    """Longest wait for the server's /health before the first request."""
    request_timeout_s: int = 600
    """Longest wait for one completion (TRL's and the reference's 600 s: a 3,000-token
    completion on a busy replica takes minutes)."""


def run_train_trl_async(config: AsyncGRPOConfig, job: TrlAsyncJobConfig) -> dict:
    """Train with TRL's AsyncGRPOTrainer against `job.server_url`; returns (and writes) the
    run's summary."""
    check_trainer_settings(job.command, config)
    if config.beta > 0:
        raise ValueError("TRL's AsyncGRPOTrainer has no KL term: set --beta 0")
    if config.num_iterations != 1:
        raise ValueError("TRL's AsyncGRPOTrainer takes one optimizer step per batch: set "
                         "--num-iterations 1")
    if trl_async.vllm_origin() is None:
        raise ValueError("TRL's AsyncGRPOTrainer does not start without the `vllm` package, "
                         "although adapter sync only needs it importable: run the job in the "
                         "vLLM image, or pip install vllm (its CPU build does off a GPU). Where "
                         "no vllm can be installed, tests put the stand-ins of "
                         "tests/trl_stand_ins/ on PYTHONPATH")
    from transformers import AutoTokenizer
    from transformers.trainer_utils import get_last_checkpoint

    from ..train.trainer import GRPOTrainer

    out = Path(config.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    bucket = Path(job.bucket) if job.bucket else out / "adapters"
    bucket.mkdir(parents=True, exist_ok=True)
    published = max((int(p.name.rsplit("-v", 1)[1]) for p in bucket.glob(f"{LORA_NAME}-v*")
                     if p.name.rsplit("-v", 1)[1].isdigit()), default=0)
    if published and not job.resume:
        raise ValueError(f"{bucket} already holds {LORA_NAME}-v* adapters from another run: "
                         "use a new --bucket (TRL numbers versions from 1), or --resume to "
                         "continue the run that wrote them")
    trl_dir = out / "trl"
    checkpoint = get_last_checkpoint(str(trl_dir)) if job.resume and trl_dir.is_dir() else None
    start_step = int(checkpoint.rsplit("-", 1)[1]) if checkpoint else 0
    device = resolve_device(config.device)
    model_path = str(GRPOTrainer.resolve_model_path(config))
    if job.check_base_model:  # the replicas must serve this base model (check_replicas)
        check_replicas(job.server_url, config.model, model_path)
    tokenizer = with_response_parser(AutoTokenizer.from_pretrained(model_path,
                                                                   padding_side="left"))
    task = config.make_task()
    max_completion_length = config.max_completion_length or task.default_max_completion_length
    dataset = trl_dataset(config, task)
    prompt_tokens = max_prompt_tokens(dataset, tokenizer) if config.token_budget else 0
    args = trl_async.trl_config(config, job, trl_dir, device, max_completion_length, prompt_tokens)
    BucketAsyncGRPOTrainer, LogLines = trl_async.trainer_classes()
    if not device.startswith("cuda"):
        from .cpu import skip_cuda_queries

        skip_cuda_queries()
    metrics = out / "metrics.jsonl"
    kept = read_jsonl(metrics) if start_step else []
    log = LogLines(metrics, config.steps, [r for r in kept if r["step"] <= start_step])
    doctor = DoctorCallback(make_doctor(config)) if config.doctor else None  # the run doctor
    trainer = BucketAsyncGRPOTrainer(
        model=model_path, reward_funcs=reward_funcs(config), args=args,
        train_dataset=dataset, processing_class=tokenizer,
        peft_config=trl_async.lora_config(config), bucket=bucket,
        callbacks=[log] + ([doctor] if doctor else []),
        cpu_attention=not device.startswith("cuda"), published=published)
    from transformers.trainer_callback import PrinterCallback

    trainer.remove_callback(PrinterCallback)  # LogLines prints one line per step instead
    if not trainer._lora_sync:
        raise RuntimeError(f"{job.server_url} does not take LoRA adapters (TRL chose merged "
                           "weights over NCCL): start the servers with --enable-lora and "
                           "VLLM_ALLOW_RUNTIME_LORA_UPDATING=1")
    if checkpoint:
        print(f"resuming from {checkpoint} (step {start_step}); adapters from "
              f"{LORA_NAME}-v{published + 1}", flush=True)
    start = time.perf_counter()
    trainer.train(resume_from_checkpoint=checkpoint)
    seconds = time.perf_counter() - start
    trainer.save_model(str(out / "adapter"))
    summary = {
        "trainer": "trl",
        "steps": trainer.state.global_step,
        "resumed_from_step": start_step,
        "checkpoints": sorted((p.name for p in trl_dir.glob("checkpoint-*")),
                              key=lambda name: int(name.rsplit("-", 1)[1])),
        "version": trainer.model_version,
        "adapters_in_bucket": sorted(p.name for p in bucket.glob(f"{LORA_NAME}-v*")),
        "final_loss": log.records[-1]["loss"] if log.records else None,
        "reward_first": log.records[0].get("reward") if log.records else None,
        "reward_last": log.records[-1].get("reward") if log.records else None,
        "seconds": round(seconds, 1),
        "bucket": str(bucket),
        "vllm": trl_async.vllm_origin(),
        "findings": [f.as_dict() for f in doctor.findings] if doctor else [],
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary
