"""`grpo-lab train-async`: the trainer job of the recipe (docs/recipe.md).

    AsyncGRPOTrainer  ──generate──>  HTTPGenerator ──HTTP──> the proxy (or one server)
          │                               │
          └──every weight_sync_steps──> publish policy-vN into the bucket, load it on the servers
          └──every checkpoint_every──>  <bucket>/checkpoints/step-S (bucket/checkpoint.py)

The run folder (`--output-dir`) gets `metrics.jsonl` (TRL's names, see
grpo_lab.rollout.async_trainer), `syncs.jsonl` (one line per weight sync: version, seconds of
each stage, bytes), the final `adapter/` and `summary.json` (greedy held-out accuracy before and
after, evaluated here, in the trainer process). Adapters `policy-v{N}` go to the bucket
(`--bucket`, default `<output-dir>/adapters`).

**On a bucket mount** (`--local-dir`): a mounted Storage Bucket takes whole-file writes only
(hf-mount's default mode writes a file once, from its start, or overwrites it whole: no append,
no seek). The logs, appended line by line, are then kept in `--local-dir` and copied whole into
the run folder at every checkpoint (`syncs.jsonl` at every sync) and at the end, with
`config.json`, `summary.json` and the final `adapter/`; a restarted job first copies them back. Adapters and checkpoints are written
as new files in new folders, which a mount takes as they are.

**Resume** (`--resume`, e.g. after a preemption): load the newest checkpoint (adapter, optimizer,
step, version, RNGs), drop the metrics logged after it, unload every adapter of this name that
the servers still hold (they may come from steps the checkpoint does not have; a fresh run does
this too), then publish the
checkpoint's weights as the next unused version and go on. Versions keep counting up with no gap
and no name is ever reused (servers key their prefix caches by adapter name). Without a
checkpoint, `--resume` starts again from step 0 (after any versions already published), so a
job can always be restarted with the same command.

**Several trainer processes** (`accelerate launch ... -m grpo_lab.cli train-async ...`, DDP or
FSDP2): the main process does everything above and is the only one to talk to the servers, the
bucket and the run folder; it sends the others the checkpoint to resume from and the version to
start at, and each step's samples (grpo_lab.rollout.async_trainer). The others train their
share and write nothing (`_follow_main_process`). Checkpoints hold full weights, so a run
checkpointed by N processes resumes under M.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import time
from dataclasses import dataclass, replace
from pathlib import Path

from ..bucket.adapters import AdapterBucket
from ..bucket.checkpoint import Checkpoints, full_state
from ..core.jsonl import read_jsonl
from ..rollout.async_trainer import AsyncGRPOTrainer
from ..rollout.config import AsyncGRPOConfig
from ..rollout.http_generator import REQUEST_SHAPES, HTTPGenerator
from ..train.distributed import is_main_process
from ..train.metrics import read_metrics
from .flags import add_config_flags, config_from_args


@dataclass
class TrainAsyncJobConfig:
    """The trainer job's own flags of `grpo-lab train-async` (the training ones are
    `AsyncGRPOConfig`'s)."""

    server_url: str = ""
    """Base URL of the proxy (or of one `grpo-lab serve` / `vllm serve`). Required."""
    bucket: str | None = None
    """Folder the servers load adapters from (default <output-dir>/adapters)."""
    resume: bool = False
    """Continue from the newest checkpoint in the bucket, if any."""
    checkpoint_every: int = 10
    """Save a checkpoint to the bucket every N steps (0 = never)."""
    keep_checkpoints: int = 2
    """How many of the newest checkpoints to keep."""
    adapter_prefix: str = "policy"
    """Adapters are named <prefix>-v<N> in the bucket and on the servers."""
    request_retries: int = 3
    """Times a completion answered 502/503/504 (a replica died under it) is sent again."""
    request_shape: str = "group"
    """How a step's samples are asked for: "group" = one request per prompt with n = G;
    "single" = G requests of n = 1 per prompt (TRL's rollout worker, the blog's shape)."""
    max_inflight: int | None = None
    """Most completion requests in flight at once (default: all of a step's). With "group" a
    request is one prompt with n = G completions; with "single" it is one completion, as TRL
    counts its cap."""
    api_key_env: str | None = None
    """Environment variable holding the servers' bearer token."""
    local_dir: str | None = None
    """A local folder for the logs appended every step (metrics, syncs, completions), copied
    whole into --output-dir at each checkpoint and at the end: for an --output-dir on a bucket
    mount, which takes no appends (None = write in --output-dir directly)."""

    def __post_init__(self):
        if not self.server_url:
            raise ValueError("train-async needs --server-url (the proxy's or one server's URL)")
        if self.checkpoint_every < 0:
            raise ValueError(f"checkpoint_every must be >= 0, got {self.checkpoint_every}")
        if self.keep_checkpoints < 1:
            raise ValueError(f"keep_checkpoints must be >= 1, got {self.keep_checkpoints}")
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


class LoggedHTTPGenerator(HTTPGenerator):
    """`HTTPGenerator` that appends each weight sync to `syncs.jsonl` as soon as it is done (and
    copies the file whole into `published_dir`, if given: a sync log on a bucket mount)."""

    def __init__(self, *args, log_path: Path, published_dir: Path | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.log_path, self.published_dir = log_path, published_dir

    def publish(self, model, version: int) -> None:
        super().publish(model, version)
        with self.log_path.open("a") as f:
            f.write(json.dumps(self.syncs[-1]) + "\n")
        if self.published_dir is not None:
            copy_whole(self.log_path.parent, self.published_dir, names=(self.log_path.name,))


def _truncate_metrics(path: Path, last_step: int) -> list[dict]:
    """Keep the records up to `last_step` (a resumed run logs the later steps again)."""
    if not path.exists():
        return []
    kept = [r for r in read_metrics(path) if r.get("step", 0) <= last_step]
    path.write_text("".join(json.dumps(r) + "\n" for r in kept))
    return kept


BUFFER_COUNTERS = {"dropped_stale": "sample/dropped_stale_cumulative",
                   "enqueued": "sample/enqueued", "delivered": "sample/delivered"}
"""summary.json's `groups` counts (kept in checkpoints) and the buffer's `stats()` they add up."""

LOG_FILES = ("metrics.jsonl", "syncs.jsonl", "completions.jsonl", "config.json")
"""What the trainer writes into its run folder while it trains (the rest is written once, at
the end: `adapter/`, `summary.json`)."""


def copy_whole(source: Path, destination: Path, names=LOG_FILES) -> None:
    """Copy each of `names` that exists in `source` into `destination` as a whole new file
    (open, write from the start, close), the one kind of write a bucket mount takes."""
    destination.mkdir(parents=True, exist_ok=True)
    for name in names:
        if (source / name).is_file():
            shutil.copyfile(source / name, destination / name)


def _reset_live_versions(generator: HTTPGenerator, bucket: AdapterBucket) -> list[str]:
    """Unload every adapter of this run from the servers; mark them all unloaded in the bucket."""
    prefix = bucket.prefix + "-v"
    loaded = [m["id"] for m in generator.client.models() if m["id"].startswith(prefix)]
    for name in loaded:
        generator.client.unload_lora_adapter(name)
    for version in bucket.versions():
        bucket.mark_unloaded(version)
    return loaded


def run_train_async(config: AsyncGRPOConfig, job: TrainAsyncJobConfig) -> dict:
    """Train against `job.server_url`; returns (and writes) the run's summary."""
    if not config.output_dir:
        raise ValueError("train-async needs --output-dir")
    if not config.use_lora:
        raise ValueError("train-async syncs adapters through the bucket: it needs use_lora")
    if not is_main_process():
        return _follow_main_process(config, job)
    resume, prefix = job.resume, job.adapter_prefix
    published = Path(config.output_dir)  # the run folder others read (on a bucket mount)
    published.mkdir(parents=True, exist_ok=True)
    if job.local_dir:  # logs appended here, copied whole to `published` (see the docstring)
        out = Path(job.local_dir)
        for name in LOG_FILES:  # this run's logs only: a restarted job's so far, if any
            (out / name).unlink(missing_ok=True)
        copy_whole(published, out)
        config = replace(config, output_dir=str(out))
    else:
        out = published

    def publish_logs() -> None:
        if out != published:
            copy_whole(out, published)

    bucket = AdapterBucket(job.bucket or published / "adapters", prefix=prefix,
                           max_staleness=config.max_staleness)
    checkpoints = Checkpoints(bucket.root / "checkpoints", keep=job.keep_checkpoints)
    latest = checkpoints.latest() if resume else None
    if not resume and bucket.versions():
        raise ValueError(f"{bucket.root} already holds {prefix}-v* adapters: pass --resume to "
                         "continue that run, or use a new --bucket")
    state = Checkpoints.read_state(latest) if latest else {}
    if latest is None:  # from step 0: no metrics from an earlier attempt
        (out / "metrics.jsonl").unlink(missing_ok=True)
        if not bucket.versions():  # and no version published yet
            (out / "syncs.jsonl").unlink(missing_ok=True)
    previous = _truncate_metrics(out / "metrics.jsonl", state.get("step", 0))

    # A kill between an adapter's rename and its log line: the bucket says it was published.
    logged = {s["version"] for s in read_jsonl(out / "syncs.jsonl")}
    with (out / "syncs.jsonl").open("a") as f:
        for version in bucket.versions():
            if version not in logged:
                f.write(json.dumps({"version": version, "recovered": True}) + "\n")

    generator = LoggedHTTPGenerator(job.server_url, bucket, api_key=job.api_key,
                                    max_staleness=config.max_staleness, seed=config.seed,
                                    log_path=out / "syncs.jsonl", retries=job.request_retries,
                                    published_dir=published if out != published else None,
                                    max_inflight=job.max_inflight,
                                    request_shape=job.request_shape)
    try:
        trainer = AsyncGRPOTrainer(config, generator=generator)  # publishes when it starts
        trainer.logger.records = list(previous)
        # Adapters of this name the servers still hold come from a killed attempt (or an
        # earlier run into another bucket): never sample from them.
        unloaded = _reset_live_versions(generator, bucket)
        # Start at the next unused version: the bucket may hold versions newer than the
        # checkpoint (or, killed before the first checkpoint, versions of an attempt that
        # restarts at 0). The trainer publishes it first and counts on from there.
        start_version = max([state["version"] if latest else -1, *bucket.versions()]) + 1
        trainer.processes.broadcast((str(latest) if latest else None, start_version))
        if latest is not None:
            Checkpoints.load(latest, trainer)  # weights, optimizer, step, version, RNGs
        if resume:
            print(f"resuming from {latest.name if latest else 'step 0 (no checkpoint)'}: step "
                  f"{trainer.step_count}, version {trainer.version} -> {start_version}; "
                  f"unloaded {unloaded}", flush=True)
        trainer.version = start_version
        trainer.publish_current()  # (re-)register the live version before anything else

        counters = dict(state.get("counters", {}))
        offsets = {k: counters.get(k, 0) for k in BUFFER_COUNTERS}
        lost = counters.get("lost_on_resume", 0)
        if latest is not None:  # groups generated but neither trained nor dropped: gone with it
            lost += max(0, offsets["enqueued"] - offsets["delivered"] - offsets["dropped_stale"])

        def totals() -> dict:  # groups, over every attempt: the buffer counts one attempt's
            stats = trainer.buffer.stats() if trainer.buffer is not None else {}
            now = {k: offsets[k] + stats.get(BUFFER_COUNTERS[k], 0) for k in offsets}
            return {**now, "lost_on_resume": lost}

        def on_step(record: dict) -> None:
            if job.checkpoint_every and record["step"] % job.checkpoint_every == 0:
                # Counters at a step boundary: what is in the buffer now is not trained yet.
                checkpoints.save(trainer, {"counters": totals(),
                                           "accuracy_before": accuracy_before()})
                publish_logs()  # the logs up to this checkpoint, what a resume keeps

        def accuracy_before():
            history = trainer.accuracy_history
            return state.get("accuracy_before", history[0][1] if history else None)

        start = time.perf_counter()
        remaining = config.steps - trainer.step_count
        if remaining > 0:
            trainer.train(steps=remaining, callback=on_step)
        seconds = time.perf_counter() - start
        syncs = [s for s in read_jsonl(out / "syncs.jsonl") if "sync_s" in s]
        history = trainer.accuracy_history
        summary = {
            "steps": trainer.step_count,
            "samples": trainer.step_count * config.prompts_per_step * config.num_generations,
            "version": trainer.version,
            "accuracy_before": accuracy_before(),
            "accuracy_after": history[-1][1] if history else None,
            "syncs": len(read_jsonl(out / "syncs.jsonl")),
            "sync_p50_s": statistics.median(s["sync_s"] for s in syncs) if syncs else None,
            "resumed_from": latest.name if latest else None,
            "groups": totals(),
            "retried_requests": generator.retried,
            "inflight_peak": generator.inflight_peak,
            "seconds": round(seconds, 1),
            "bucket": str(bucket.root),
        }
        (out / "summary.json").write_text(json.dumps(summary, indent=2))
        if out != published:
            publish_logs()
            copy_whole(out, published, names=("summary.json",))
            if (out / "adapter").is_dir():
                shutil.copytree(out / "adapter", published / "adapter", dirs_exist_ok=True)
        return summary
    finally:
        generator.close()


def _follow_main_process(config: AsyncGRPOConfig, job: TrainAsyncJobConfig) -> dict:
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

    remaining = config.steps - trainer.step_count
    if remaining > 0:
        trainer.train(steps=remaining, callback=on_step)
    return {}


def add_parser(sub) -> None:
    parser = sub.add_parser("train-async", help="the trainer job: asynchronous LoRA GRPO against "
                            "inference servers (a proxy or one server), adapters through a bucket")
    add_config_flags(parser, TrainAsyncJobConfig)
    add_config_flags(parser, AsyncGRPOConfig)
    parser.set_defaults(func=run)


def run(args) -> int:
    summary = run_train_async(config_from_args(args, AsyncGRPOConfig),
                              config_from_args(args, TrainAsyncJobConfig))
    if is_main_process():
        print(json.dumps(summary, indent=2), flush=True)
    return 0
