"""TRL's `AsyncGRPOTrainer` as the trainer job: grpo_lab's data and rewards, adapters through the bucket.

    TRL AsyncGRPOTrainer ──/v1/completions (one completion per request)──> the proxy ──> replicas
          │   (a spawned rollout process scores each group with grpo_lab's RewardSet)
          └──every weight_sync_steps──> /pause, save trl-policy-vN into the bucket,
                                        /v1/load_lora_adapter trl-policy-vN, /resume,
                                        unload trl-policy-v(N - max_staleness - 1)

The same run as `grpo-lab train-async` (grpo_lab.cli.train_async), with TRL's trainer in place of
grpo_lab's: the task or dataset and the rewards come from grpo_lab's `AsyncGRPOConfig`
(`make_task`, `RewardSet`), mapped onto TRL's `AsyncGRPOConfig` by `trl_config`. TRL decides
adapter-only sync itself: a PEFT model and a server whose /server_info has a `lora_config`
(`--enable-lora`) with `max_loras >= max_staleness + 2`. It saves each version as
`trl-policy-v{N}` under `output_dir/.vllm_lora`; `BucketAsyncGRPOTrainer` points that folder at
the bucket, the folder every server reads adapters from (grpo_lab.bucket.adapters), as grpo_lab's
own trainer publishes.

What TRL needs that grpo_lab does not provide, and how this job handles it:
- vLLM installed: TRL's rollout worker refuses to start without `import vllm`, and its NCCL
  weight transfer imports vLLM helpers (never called: adapters travel as files). On a GPU the
  job runs in the vLLM image; on a CPU the vLLM CPU build does. Only where no `vllm` is
  installed do its tests use test-only stand-ins (tests/trl_stand_ins/); `summary.json` says
  which `vllm` the job imported.
- CUDA: FlashAttention-3 from the Hub (`kernels`) for its packed prefix trees, and the GPU's
  name for MFU. On a CUDA GPU TRL's own code runs (the job needs `pip install kernels` and the
  Hub); elsewhere grpo_lab.rollout.trl_cpu stands in for both.
- `BucketAsyncGRPOTrainer` sets an attribute of TRL 1.16's trainer (`_lora_dir`) and the CPU
  attention after TRL registers its own; tests/test_trl_async_job.py fails if they move.

Not mapped, TRL decides: the loss's aggregation and advantage scaling (`loss_type`,
`scale_rewards`: TRL's own token-mean loss, group std scaling), and no held-out evaluation
(`eval_every`; `grpo-lab train-async` evaluates, this job does not). `beta > 0` and
`num_iterations > 1` are refused.

One optimizer step is exactly `prompts_per_step` x G samples (`trl_config`): TRL's own
token-budget batcher packs a variable number of samples per micro-batch and, with one
micro-batch per step, would make a step one packed row; this job sizes fixed-count micro-batches
from `token_budget` and accumulates them instead. The weights stay float32, computed in
`--dtype` under autocast (bfloat16 on a GPU), with AdamW's betas (0.9, `adam_beta2`) and
`weight_decay`, as TRL and the reference train.

Checkpoints: every `checkpoint_every` steps TRL writes `checkpoint-N` (adapter, optimizer,
scheduler, RNG, the rollout worker's prompt position and adapter version) into
`<output-dir>/trl`, the run's folder in the bucket; `--resume` starts from the newest one and
keeps numbering adapters after the newest `trl-policy-vN` in the bucket, so no name a server
may still hold is published again.

Metrics are TRL's names (its `log_history`), written whole to `metrics.jsonl` at every log, with
one printed line per step; `summary.json` has the steps, the adapters published and the time.
"""

from __future__ import annotations

import importlib.util
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

from ..core.devices import resolve_device, resolve_dtype
from ..core.jsonl import read_jsonl
from .config import AsyncGRPOConfig
from .trl_data import (  # noqa: F401 (reward_funcs, with_response_parser: this job's API)
    max_prompt_tokens,
    reward_funcs,
    trl_dataset,
    with_response_parser,
)

LORA_NAME = "trl-policy"
"""TRL's adapter name: versions are `trl-policy-v1`, `trl-policy-v2`, ... on the servers."""


@dataclass
class TrlAsyncJobConfig:
    """The trainer job's own flags of `grpo-lab train-trl-async` (the training ones are
    grpo_lab's `AsyncGRPOConfig`, mapped onto TRL's by `trl_config`)."""

    server_url: str = ""
    """Base URL of the proxy (or of one `grpo-lab serve` / `vllm serve`). Required."""
    bucket: str | None = None
    """Folder the servers load adapters from, at the same path (default <output-dir>/adapters)."""
    max_inflight: int | None = None
    """Most completion requests in flight (TRL's max_inflight_tasks; default: TRL's
    max_staleness x samples per step)."""
    server_timeout_s: float = 240.0
    """Longest wait for the server's /health before the first request."""
    request_timeout_s: int = 600
    """Longest wait for one completion (TRL's and the reference's 600 s: a 3,000-token
    completion on a busy replica takes minutes)."""
    resume: bool = False
    """Continue from the newest checkpoint-N in <output-dir>/trl, if any (a preempted job
    restarted with the same command); adapters already in the bucket are then expected."""
    checkpoint_every: int = 10
    """TRL's save_steps: write checkpoint-N into <output-dir>/trl every N steps and at the end
    (0 = never)."""
    keep_checkpoints: int = 2
    """How many of the newest checkpoints to keep (TRL's save_total_limit)."""

    def __post_init__(self):
        if not self.server_url:
            raise ValueError("train-trl-async needs --server-url (the proxy's or one server's URL)")
        if self.max_inflight is not None and self.max_inflight < 1:
            raise ValueError(f"max_inflight must be >= 1, got {self.max_inflight}")
        if self.checkpoint_every < 0 or self.keep_checkpoints < 1:
            raise ValueError("need checkpoint_every >= 0 and keep_checkpoints >= 1, got "
                             f"{self.checkpoint_every} and {self.keep_checkpoints}")


def micro_batch_size(samples: int, sample_tokens: int, token_budget: int | None) -> int:
    """Samples per micro-batch: the whole step's without a budget; with one, the most samples of
    the longest possible length (`sample_tokens`) that fit in `token_budget` (at least one),
    lowered to a divisor of `samples` so that the micro-batches add up to exactly one step."""
    if token_budget is None:
        return samples
    fit = max(1, min(samples, token_budget // sample_tokens))
    return max(n for n in range(1, fit + 1) if samples % n == 0)


def trl_config(config: AsyncGRPOConfig, job: TrlAsyncJobConfig, output_dir: Path, device: str,
               max_completion_length: int, prompt_tokens: int = 0):
    """grpo_lab's settings -> TRL's `AsyncGRPOConfig`; one optimizer step = exactly
    prompts_per_step x G samples.

    TRL's own `token_budget` (its `TokenBudgetBatcher`; None means the server's max_model_len)
    fills each micro-batch with however many samples fit, ignoring per_device_train_batch_size,
    so a step would be one packed row. TRL is given `token_budget=0` (its fixed-count batcher)
    instead: without grpo_lab's token_budget one micro-batch holds the whole step; with it, each
    holds `micro_batch_size` samples (at most `token_budget` tokens even if every sample has the
    longest prompt, `prompt_tokens`, and a full completion) and gradient accumulation adds them
    up to the step. The weights stay float32: `--dtype` (bfloat16 on a GPU) is the autocast's."""
    from trl.experimental.async_grpo import AsyncGRPOConfig as TRLAsyncGRPOConfig

    group = config.num_generations
    samples = config.prompts_per_step * group
    micro = micro_batch_size(samples, prompt_tokens + max_completion_length, config.token_budget)
    compute = str(resolve_dtype(config.dtype, device)).removeprefix("torch.")
    checkpoints = ({"save_strategy": "steps", "save_steps": job.checkpoint_every,
                    "save_total_limit": job.keep_checkpoints} if job.checkpoint_every
                   else {"save_strategy": "no"})
    return TRLAsyncGRPOConfig(
        output_dir=str(output_dir), max_steps=config.steps, seed=config.seed,
        per_device_train_batch_size=micro, gradient_accumulation_steps=samples // micro,
        token_budget=0, num_generations=group,
        max_completion_length=max_completion_length, temperature=config.temperature,
        learning_rate=config.learning_rate, lr_scheduler_type=config.lr_scheduler_type,
        adam_beta2=config.adam_beta2, weight_decay=config.weight_decay,
        max_grad_norm=config.max_grad_norm, epsilon=config.epsilon_low,
        epsilon_high=config.epsilon_high, max_staleness=config.max_staleness,
        weight_sync_steps=config.weight_sync_steps,
        queue_maxsize=config.effective_buffer_size * group,
        max_inflight_tasks=job.max_inflight if job.max_inflight is not None else -1,
        vllm_server_base_url=job.server_url, vllm_server_timeout=job.server_timeout_s,
        request_timeout=job.request_timeout_s,
        gradient_checkpointing=config.gradient_checkpointing,
        dtype="float32", bf16=compute == "bfloat16", fp16=compute == "float16",
        use_cpu=device == "cpu", logging_steps=1, report_to="none", disable_tqdm=True,
        **checkpoints)


def vllm_origin() -> str | None:
    """Where `import vllm` finds the package: the real one, or a stand-in (None = neither)."""
    spec = importlib.util.find_spec("vllm")
    return spec.origin if spec else None


def lora_config(config: AsyncGRPOConfig):
    from peft import LoraConfig

    return LoraConfig(r=config.lora_rank, lora_alpha=config.effective_lora_alpha,
                      target_modules="all-linear", lora_dropout=0.0, task_type="CAUSAL_LM")


def _trainer_class():
    from transformers import TrainerCallback
    from trl.experimental.async_grpo import AsyncGRPOTrainer

    class BucketAsyncGRPOTrainer(AsyncGRPOTrainer):
        """TRL's trainer, with its adapters saved into `bucket` (the servers' adapter folder),
        numbered after `published` (the newest version a previous run left there) and, off a
        GPU, tree attention computed by grpo_lab.rollout.trl_cpu."""

        def __init__(self, *args, bucket: Path, cpu_attention: bool, published: int = 0,
                     **kwargs):
            super().__init__(*args, **kwargs)  # registers TRL's FlashAttention-3 tree attention
            if cpu_attention:
                from .trl_cpu import use_cpu_tree_attention

                use_cpu_tree_attention()
            self._lora_dir = str(bucket.resolve())  # trl-policy-vN/ land in the bucket
            self._published = published

        def _sync_weight(self):
            # A resumed run: TRL restores the checkpoint's version, but a preempted run may have
            # published later ones that the servers still hold; go on after the newest.
            if self._published > self.model_version:
                self.model_version = self._published
            self._published = 0
            super()._sync_weight()

    class LogLines(TrainerCallback):
        """One line per logged step with fixed keys; `metrics.jsonl` rewritten whole each time
        (a file on a bucket mount is written in one piece, never appended to)."""

        def __init__(self, path: Path, steps: int, records: list[dict]):
            self.path, self.steps, self.records = path, steps, records

        def on_log(self, args, state, control, logs=None, **kwargs):
            if not logs or "loss" not in logs:
                return
            record = {"step": state.global_step, **logs}
            self.records.append(record)
            self.path.write_text("".join(json.dumps(r) + "\n" for r in self.records))
            print(f"[step {state.global_step}/{self.steps}] loss={logs['loss']:.4f} "
                  f"reward={logs.get('reward', math.nan):.3f} "
                  f"staleness={logs.get('sample/staleness_mean', math.nan):.2f} "
                  f"sync_s={logs.get('perf/weight_sync_s', math.nan):.2f}", flush=True)

    return BucketAsyncGRPOTrainer, LogLines


def run_train_trl_async(config: AsyncGRPOConfig, job: TrlAsyncJobConfig) -> dict:
    """Train with TRL's AsyncGRPOTrainer against `job.server_url`; returns (and writes) the
    run's summary."""
    if not config.output_dir:
        raise ValueError("train-trl-async needs --output-dir")
    if not config.use_lora:
        raise ValueError("train-trl-async syncs adapters through the bucket: it needs use_lora")
    if config.beta > 0:
        raise ValueError("TRL's AsyncGRPOTrainer has no KL term: set --beta 0")
    if config.num_iterations != 1:
        raise ValueError("TRL's AsyncGRPOTrainer takes one optimizer step per batch: set "
                         "--num-iterations 1")
    if vllm_origin() is None:
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
    tokenizer = with_response_parser(AutoTokenizer.from_pretrained(model_path,
                                                                   padding_side="left"))
    task = config.make_task()
    max_completion_length = config.max_new_tokens or task.max_answer_chars + 2
    dataset = trl_dataset(config, task)
    prompt_tokens = max_prompt_tokens(dataset, tokenizer) if config.token_budget else 0
    args = trl_config(config, job, trl_dir, device, max_completion_length, prompt_tokens)
    BucketAsyncGRPOTrainer, LogLines = _trainer_class()
    if not device.startswith("cuda"):
        from .trl_cpu import skip_cuda_queries

        skip_cuda_queries()
    metrics = out / "metrics.jsonl"
    kept = read_jsonl(metrics) if start_step else []
    log = LogLines(metrics, config.steps, [r for r in kept if r["step"] <= start_step])
    trainer = BucketAsyncGRPOTrainer(
        model=model_path, reward_funcs=reward_funcs(config), args=args,
        train_dataset=dataset, processing_class=tokenizer,
        peft_config=lora_config(config), callbacks=[log], bucket=bucket,
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
        "vllm": vllm_origin(),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary
