"""`grpo-lab train-async`: the recipe's trainer job with grpo_lab's asynchronous trainer.

    AsyncGRPOTrainer  ──generate──>  HTTPGenerator ──HTTP──> the proxy (or one server)
          │                               │
          └──every weight_sync_steps──> publish policy-vN into the bucket, load it on the servers
          └──every checkpoint_every──>  <bucket>/checkpoints/step-S (bucket/checkpoint.py)

The run folder (`--output-dir`) gets `metrics.jsonl`, `syncs.jsonl` (one line per weight sync),
`completions.jsonl`, the final `adapter/` and `summary.json` (greedy held-out accuracy before and
after). `run_train_async` runs the steps below in order; docs/recipe.md ("The trainer job")
explains the bucket mount (`--local-dir`), resuming (`--resume`) and several processes.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import ClassVar

from ..bucket.adapters import AdapterBucket
from ..bucket.checkpoint import Checkpoints, full_state
from ..model.models import made_model_folder_name
from ..rollout.http_generator import REQUEST_SHAPES, HTTPGenerator, check_replicas
from ..serve.sampling_settings import sampling_settings
from ..util.files import read_jsonl
from ..watch.metrics import read_metrics
from ..watch.reporters import TENSORBOARD_DIR
from .async_config import AsyncGRPOConfig
from .async_trainer import SYNC_LOG, AsyncGRPOTrainer
from .distributed import is_main_process

# ------------------------------------------------------------ what both trainer jobs share
# What both trainer jobs share: `grpo-lab train-async` (grpo_lab's asynchronous trainer,
# grpo_lab.train.async_job) and `grpo-lab train-trl-async` (TRL's AsyncGRPOTrainer,
# grpo_lab.trl.async_job) take the same training flags (`AsyncGRPOConfig`) and these job
# flags, then their own. docs/recipe.md, "The trainer job", describes the run folder, the bucket and
# resuming.


@dataclass
class TrainerJobConfig:
    """The job flags both trainer jobs take (their training flags are `AsyncGRPOConfig`'s)."""

    command: ClassVar[str] = "the trainer job"  # named in error messages

    server_url: str = ""
    """Base URL of the proxy (or of one `grpo-lab serve` / `vllm serve`). Required."""
    bucket: str | None = None
    """Folder the servers load adapters from, at the same path (default <output-dir>/adapters)."""
    resume: bool = False
    """Continue from the newest checkpoint, if any: a preempted job restarted with the same
    command (without one it starts from step 0)."""
    checkpoint_every: int = 10
    """Save a checkpoint every N steps (0 = never): train-async into <bucket>/checkpoints,
    train-trl-async TRL's checkpoint-N into <output-dir>/trl (and one at the end)."""
    keep_checkpoints: int = 2
    """How many of the newest checkpoints to keep."""
    max_inflight: int | None = None
    """Most completion requests in flight at once. train-async: default all of a step's (a
    request is one prompt's G completions, or one completion with --request-shape single);
    train-trl-async: TRL's max_inflight_tasks, default max_staleness x samples per step."""
    check_base_model: bool = True
    """At start, ask every replica's /v1/models and refuse to train when one serves another base
    model than --model (grpo_lab.rollout.http_generator); false = skip (e.g. a replica serving a
    local copy of the hub model under another name)."""

    def __post_init__(self):
        if not self.server_url:
            raise ValueError(f"{self.command} needs --server-url (the proxy's or one server's "
                             "URL)")
        if self.checkpoint_every < 0:
            raise ValueError(f"checkpoint_every must be >= 0, got {self.checkpoint_every}")
        if self.keep_checkpoints < 1:
            raise ValueError(f"keep_checkpoints must be >= 1, got {self.keep_checkpoints}")
        if self.max_inflight is not None and self.max_inflight < 1:
            raise ValueError(f"max_inflight must be >= 1, got {self.max_inflight}")


def check_trainer_settings(command: str, config) -> None:
    """The settings both jobs need (`config`: an AsyncGRPOConfig): a run folder, and LoRA (the
    adapters travel through the bucket)."""
    if not config.output_dir:
        raise ValueError(f"{command} needs --output-dir")
    if not config.use_lora:
        raise ValueError(f"{command} syncs adapters through the bucket: it needs use_lora")


@dataclass
class TrainAsyncJobConfig(TrainerJobConfig):
    """The job flags of `grpo-lab train-async`: the shared ones (TrainerJobConfig) and these.
    Its checkpoints go to <bucket>/checkpoints; `max_inflight` defaults to all of a step's
    requests, counted as `request_shape` makes them."""

    command: ClassVar[str] = "train-async"

    adapter_prefix: str = "policy"
    """Adapters are named <prefix>-v<N> in the bucket and on the servers."""
    request_retries: int = 3
    """Times a completion answered 502/503/504 (a replica died under it) is sent again."""
    request_shape: str = "group"
    """How a step's samples are asked for: "group" = one request per prompt with n = G;
    "single" = G requests of n = 1 per prompt (TRL's rollout worker, the blog's shape)."""
    api_key_env: str | None = None
    """Environment variable holding the servers' bearer token."""
    local_dir: str | None = None
    """A local folder for the logs appended every step (metrics, syncs, completions), copied
    whole into --output-dir at each checkpoint and at the end: for an --output-dir on a bucket
    mount, which takes no appends (None = write in --output-dir directly)."""

    def __post_init__(self):
        super().__post_init__()
        if self.request_shape not in REQUEST_SHAPES:
            raise ValueError(f"request_shape must be one of {REQUEST_SHAPES}, "
                             f"got {self.request_shape!r}")

    @property
    def api_key(self) -> str | None:
        if not self.api_key_env:
            return None
        key = os.environ.get(self.api_key_env)
        if not key:
            raise ValueError(f"--api-key-env {self.api_key_env}: that environment variable is "
                             "not set or empty")
        return key


BUFFER_COUNTERS = {"dropped_stale": "sample/dropped_stale_cumulative",
                   "enqueued": "sample/enqueued", "delivered": "sample/delivered"}
"""summary.json's `groups` counts (kept in checkpoints) and the buffer's `stats()` they add up."""

LOG_FILES = ("metrics.jsonl", "syncs.jsonl", "completions.jsonl", "config.json", "findings.jsonl",
             TENSORBOARD_DIR)
"""What the trainer writes into its run folder while it trains (the rest is written once, at
the end: `adapter/`, `summary.json`); `tensorboard/` with `--report-to tensorboard`."""


def copy_whole(source: Path, destination: Path, names=LOG_FILES) -> None:
    """Copy each of `names` that exists in `source` into `destination` as a whole new file
    (open, write from the start, close), the one kind of write a bucket mount takes."""
    destination.mkdir(parents=True, exist_ok=True)
    for name in names:
        if (source / name).is_file():
            shutil.copyfile(source / name, destination / name)
        elif (source / name).is_dir():  # tensorboard/: each event file copied whole
            shutil.copytree(source / name, destination / name, dirs_exist_ok=True)


def remove(path: Path) -> None:
    """A log file, or the tensorboard folder, if there."""
    if path.is_dir():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


# -- step 0: the replicas serve the trainer's base model ------------------------------------------
def check_base_model(config: AsyncGRPOConfig, job: TrainAsyncJobConfig) -> None:
    """Refuse to start when a replica serves another base model than `config.model` (its
    adapters would be loaded onto the wrong weights); say which replicas could not be asked."""
    if not job.check_base_model:
        return
    # grpo_lab's own models by their cache folder's name, worked out without making them
    path = made_model_folder_name(config.model, task=config.task,
                                  difficulty=config.difficulty) or config.model
    cards, unreachable = check_replicas(job.server_url, config.model, path, api_key=job.api_key)
    for replica, why in unreachable.items():
        print(f"base model check: could not ask {replica}/v1/models ({why}); checked "
              f"{', '.join(cards)}", flush=True)


# -- step 1: the run folder ---------------------------------------------------------------------
def prepare_run_folder(config: AsyncGRPOConfig, job: TrainAsyncJobConfig):
    """(config, out, published): `published` is the run folder others read (perhaps on a bucket
    mount); `out` is where the logs are appended (`--local-dir`, seeded with a restarted job's
    logs so far, or `published` itself)."""
    published = Path(config.output_dir)
    published.mkdir(parents=True, exist_ok=True)
    if not job.local_dir:
        return config, published, published
    out = Path(job.local_dir)
    for name in LOG_FILES:  # this run's logs only: a restarted job's so far, if any
        remove(out / name)
    copy_whole(published, out)
    # the run keeps the run folder's name in trackio, not the local folder's
    return (replace(config, output_dir=str(out), run_name=config.effective_run_name), out,
            published)


# -- step 2: where to start from ----------------------------------------------------------------
def find_checkpoint(config: AsyncGRPOConfig, job: TrainAsyncJobConfig, published: Path):
    """(bucket, checkpoints, latest checkpoint or None, its state). A bucket that already holds
    this prefix's adapters is another run's unless --resume says it is this one's."""
    bucket = AdapterBucket(job.bucket or published / "adapters", prefix=job.adapter_prefix,
                           max_staleness=config.max_staleness)
    checkpoints = Checkpoints(bucket.root / "checkpoints", keep=job.keep_checkpoints)
    if not job.resume and bucket.versions():
        raise ValueError(f"{bucket.root} already holds {job.adapter_prefix}-v* adapters: pass "
                         "--resume to continue that run, or use a new --bucket")
    latest = checkpoints.latest() if job.resume else None
    return bucket, checkpoints, latest, Checkpoints.read_state(latest) if latest else {}


def recover_logs(out: Path, bucket: AdapterBucket, latest, state: dict) -> list[dict]:
    """Drop the metrics logged after the checkpoint (they are logged again), log a version the
    bucket holds but `syncs.jsonl` missed (a kill between the rename and the log line), and
    return the metrics kept."""
    if latest is None:  # from step 0: no metrics from an earlier attempt
        (out / "metrics.jsonl").unlink(missing_ok=True)
        remove(out / TENSORBOARD_DIR)  # nor their TensorBoard copy
        if not bucket.versions():  # and no version published yet
            (out / "syncs.jsonl").unlink(missing_ok=True)
    kept = []
    if (out / "metrics.jsonl").exists():
        kept = [r for r in read_metrics(out) if r.get("step", 0) <= state.get("step", 0)]
        (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in kept))
    logged = {s["version"] for s in read_jsonl(out / "syncs.jsonl")}
    with (out / "syncs.jsonl").open("a") as f:
        for version in bucket.versions():
            if version not in logged:
                f.write(json.dumps({"version": version, "recovered": True}) + "\n")
    return kept


# -- step 3: the trainer at its checkpoint, the servers clean ------------------------------------
def restore(trainer: AsyncGRPOTrainer, generator: HTTPGenerator, bucket: AdapterBucket,
            latest, state: dict, resume: bool) -> None:
    """Unload every adapter of this run the servers still hold (a killed attempt's: never sample
    from them), load the checkpoint, and publish its weights as the next unused version."""
    # The bucket may hold versions newer than the checkpoint: count on from the newest.
    start_version = max(state["version"] + 1 if latest else 0,
                        generator.start_after_earlier_runs())
    unloaded = generator.unloaded_at_start
    trainer.processes.broadcast((str(latest) if latest else None, start_version))
    if latest is not None:
        Checkpoints.load(latest, trainer)  # weights, optimizer, step, version, RNGs
    if resume:
        print(f"resuming from {latest.name if latest else 'step 0 (no checkpoint)'}: step "
              f"{trainer.step_count}, version {trainer.version} -> {start_version}; "
              f"unloaded {unloaded}", flush=True)
    trainer.version = start_version
    trainer.publish_current()  # (re-)register the live version before anything else


class GroupCounts:
    """Groups enqueued, delivered, dropped and lost, over every attempt of a resumed run (the
    buffer counts one attempt's; a checkpoint keeps the totals so far)."""

    def __init__(self, trainer: AsyncGRPOTrainer, state: dict, resumed: bool):
        self.trainer = trainer
        counters = dict(state.get("counters", {}))
        self.offsets = {k: counters.get(k, 0) for k in BUFFER_COUNTERS}
        self.lost = counters.get("lost_on_resume", 0)
        if resumed:  # generated but neither trained nor dropped: gone with the killed attempt
            o = self.offsets
            self.lost += max(0, o["enqueued"] - o["delivered"] - o["dropped_stale"])

    def totals(self) -> dict:
        buffer = self.trainer.buffer
        stats = buffer.stats() if buffer is not None else {}
        now = {k: self.offsets[k] + stats.get(BUFFER_COUNTERS[k], 0) for k in self.offsets}
        return {**now, "lost_on_resume": self.lost}


# -- step 5: the summary -------------------------------------------------------------------------
def summarize(trainer: AsyncGRPOTrainer, generator: HTTPGenerator, bucket: AdapterBucket,
              latest, groups: dict, accuracy_before, seconds: float) -> dict:
    """The trainer's summary (AsyncGRPOTrainer.summary) with the job's: the accuracy before the
    whole run (kept across resumes), the checkpoint it resumed from, the groups' counts, the
    requests sent again, the in-flight peak, this job's seconds and the bucket."""
    return {**trainer.summary(), "accuracy_before": accuracy_before,
            "resumed_from": latest.name if latest else None, "groups": groups,
            "retried_requests": generator.retried, "inflight_peak": generator.inflight_peak,
            "seconds": round(seconds, 1), "bucket": str(bucket.root)}


def run_train_async(config: AsyncGRPOConfig, job: TrainAsyncJobConfig) -> dict:
    """Train against `job.server_url`; returns (and writes) the run's summary."""
    check_trainer_settings(job.command, config)
    if not is_main_process():
        return follow_main_process(config, job)
    check_base_model(config, job)
    config, out, published = prepare_run_folder(config, job)
    bucket, checkpoints, latest, state = find_checkpoint(config, job, published)
    previous = recover_logs(out, bucket, latest, state)
    # The trainer logs each weight sync to out/syncs.jsonl (AsyncGRPOTrainer.send_weights).
    generator = HTTPGenerator(job.server_url, bucket, api_key=job.api_key,
                              max_staleness=config.max_staleness, seed=config.seed,
                              retries=job.request_retries, max_inflight=job.max_inflight,
                              request_shape=job.request_shape, sampling=sampling_settings(config))
    try:
        trainer = AsyncGRPOTrainer(config, generator=generator)  # publishes when it starts
        trainer.logger.records = list(previous)
        restore(trainer, generator, bucket, latest, state, job.resume)
        groups = GroupCounts(trainer, state, resumed=latest is not None)

        def accuracy_before():
            history = trainer.accuracy_history
            return state.get("accuracy_before", history[0][1] if history else None)

        # -- step 4: train, checkpointing every `checkpoint_every` steps
        def on_step(record: dict) -> None:
            if out != published:  # the sync log, whole, where the bucket mount shows it
                copy_whole(out, published, names=(SYNC_LOG,))
            if job.checkpoint_every and record["step"] % job.checkpoint_every == 0:
                # Counters at a step boundary: what is in the buffer now is not trained yet.
                checkpoints.save(trainer, {"counters": groups.totals(),
                                           "accuracy_before": accuracy_before()})
                if out != published:  # the logs up to this checkpoint, what a resume keeps
                    copy_whole(out, published)

        start = time.perf_counter()
        if config.steps > trainer.step_count:
            trainer.train(steps=config.steps - trainer.step_count, callback=on_step)
        summary = summarize(trainer, generator, bucket, latest, groups.totals(),
                            accuracy_before(), time.perf_counter() - start)
        (out / "summary.json").write_text(json.dumps(summary, indent=2))
        if out != published:
            copy_whole(out, published, names=(*LOG_FILES, "summary.json"))
            if (out / "adapter").is_dir():
                shutil.copytree(out / "adapter", published / "adapter", dirs_exist_ok=True)
        return summary
    finally:
        generator.close()


def follow_main_process(config: AsyncGRPOConfig, job: TrainAsyncJobConfig) -> dict:
    """A process other than the main one under `accelerate launch`: the same trainer, in step
    with the main process's collective calls, training its share of each step; it writes
    nothing and never talks to the servers. Returns an empty summary."""
    trainer = AsyncGRPOTrainer(config)  # no generator: the main process has it
    latest, start_version = trainer.processes.broadcast(None)
    if latest is not None:
        Checkpoints.load(latest, trainer)
    trainer.version = start_version
    trainer.publish_current()  # the main process publishes; FSDP2 gathers from every process

    def on_step(record: dict) -> None:
        if job.checkpoint_every and record["step"] % job.checkpoint_every == 0:
            full_state(trainer)  # the main process's checkpoint gathers from every process

    if config.steps > trainer.step_count:
        trainer.train(steps=config.steps - trainer.step_count, callback=on_step)
    return {}
