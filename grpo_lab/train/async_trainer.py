"""Asynchronous GRPO in one process: a rollout worker thread and the trainer, joined by a buffer.

    worker thread                                    trainer (the caller's thread)
    Stages 1-3  sample G completions per prompt      get prompts_per_step groups from the buffer
                from policy version v, score them,   Stage 4  clipped-surrogate update(s)
                advantages; put each group in the    every weight_sync_steps steps: publish v+1
                RolloutBuffer, tagged v

Generation of step j+1 overlaps training of step j. The price is staleness, bounded twice: the
worker starts a batch only once the policy is recent enough (admission), and the buffer drops
staler samples. `asynchronous=False` runs the same pipeline in one thread. How and why:
docs/internals.md, "The asynchronous trainer"; the metrics (TRL AsyncGRPOTrainer's names):
docs/metrics.md.
"""

from __future__ import annotations

import copy
import json
import statistics
import threading
import time
import warnings

import torch

from ..algo.sampler_correction import sampler_kl
from ..data.completions import Completions
from ..data.prompts import encode_prompts
from ..rollout.buffer import RolloutBuffer
from ..rollout.generators import Generator, LocalGenerator
from ..rollout.groups import SampledGroups, split
from ..util.files import read_jsonl
from ..watch.step_metrics import async_reward_names, buffer_metrics, inline_metrics
from . import grpo_step
from .async_config import AsyncGRPOConfig
from .rollout_batch import RolloutBatch, rollout_metrics
from .trainer import GRPOTrainer

SYNC_LOG = "syncs.jsonl"
"""One line per weight sync, in output_dir: the version, and the seconds it took."""


class AsyncGRPOTrainer(GRPOTrainer):
    """GRPO with generation in a background thread.

    `train()` starts the worker after the initial evaluation and stops it at the end, even on
    error. Calling `step()` directly starts it too; then call `stop_steps()` when done.

    The run starts at `step_count` and `version` (0 and 0; a resumed job sets both, e.g. from a
    checkpoint, before training): the first step publishes the weights as `version`, and later
    versions count up from there, one every `weight_sync_steps` steps.
    """

    config: AsyncGRPOConfig
    config_class = AsyncGRPOConfig

    def __init__(self, config: AsyncGRPOConfig | None = None, model=None, tokenizer=None,
                 generator: Generator | None = None, *, reward_funcs=None,
                 args: AsyncGRPOConfig | None = None, train_dataset=None, eval_dataset=None,
                 peft_config=None, processing_class=None):
        # TRL's form as GRPOTrainer takes it: AsyncGRPOTrainer(model, reward_funcs,
        # args=AsyncGRPOConfig(...), train_dataset=..., processing_class=...)
        super().__init__(config, model, tokenizer, reward_funcs=reward_funcs, args=args,
                         train_dataset=train_dataset, eval_dataset=eval_dataset,
                         peft_config=peft_config, processing_class=processing_class)
        config = self.config
        if generator is None and self.processes.is_fsdp and self.processes.is_main:
            raise ValueError("the in-process generator samples from a full copy of the weights; "
                             "under FSDP2 use `grpo-lab train-async` against servers")
        self.generator = None  # several processes: only the main one talks to the generator
        if self.processes.is_main:
            self.generator = generator or LocalGenerator(self.model, self.tokenizer,
                                                         max_versions=config.max_staleness + 2)
        # A fast tokenizer must not be used by two threads at once ("Already borrowed"), and
        # evaluation uses the trainer's: the worker gets its own copy.
        self.worker_tokenizer = copy.deepcopy(self.tokenizer)
        self.version = 0  # published by the first step (`publish_current`)
        self._published = threading.Condition()  # the worker waits here for a newer version
        self.buffer: RolloutBuffer[SampledGroups] | None = None
        self._worker: threading.Thread | None = None
        self._stop = threading.Event()
        # Set while the worker computes (stages 1-3), clear while it waits (admission, full buffer).
        # `publish` sets it when it admits a waiting worker, before the worker even wakes up, so
        # the trainer never borrows a core that the worker is about to take back.
        self._worker_busy = threading.Event()
        # the version a waiting worker needs (None: not waiting)
        self._admission_needs: int | None = None
        self._version_offset = 0  # version - step // weight_sync_steps when the steps started
        self._worker_error: BaseException | None = None
        self._counters = dict(gen_s=0.0, gen_tokens=0, version_wait_s=0.0, retried=0)
        self._last = dict(self._counters, tok_s=0.0)
        self._buffer_last: dict = {}  # the buffer's cumulative counters at the last step
        self._started_at = time.perf_counter()

    # ------------------------------------------------------------------ stages 1-3 (the worker)

    def produce(self, version: int) -> list[SampledGroups]:
        """Sample and score one step's prompts with policy `version`: a group per prompt."""
        cfg = self.config
        problems = self.task.sample_batch(self.rng, cfg.prompts_per_step)
        prompt_ids = encode_prompts(self.worker_tokenizer, [p.prompt for p in problems],
                                    **self.prompt_format)
        start = time.perf_counter()
        out = self.generator.generate(  # Stage 1
            prompt_ids, version=version, num_generations=cfg.num_generations,
            max_new_tokens=self.max_completion_length, temperature=cfg.temperature)
        rewards, parts = self.score(problems, out)  # Stage 2
        self._counters["gen_s"] += time.perf_counter() - start
        self._counters["gen_tokens"] += out.num_tokens
        return SampledGroups(problems, out, rewards, parts).per_problem()

    def _rollout_loop(self, first_batch: int) -> None:
        cfg = self.config
        self._set_threads(cfg.generator_threads)  # this thread's intra-op pool only
        batch_index = first_batch
        try:
            while not self._stop.is_set():
                # Admission: batch j is trained at version j // weight_sync_steps (plus the
                # offset of a run that did not start at version 0).
                needed = (batch_index // cfg.weight_sync_steps + self._version_offset
                          - cfg.max_staleness)
                with self._published:
                    start = time.perf_counter()
                    while self.version < needed and not self._stop.is_set():
                        self._admission_needs = needed
                        self._worker_busy.clear()
                        self._published.wait()
                    self._admission_needs = None
                    self._worker_busy.set()
                    self._counters["version_wait_s"] += time.perf_counter() - start
                    version = self.version
                if self._stop.is_set():
                    return
                groups = self.produce(version)
                self._worker_busy.clear()  # idle while put blocks on a full buffer
                for group in groups:
                    if not self.buffer.put(group, version):  # blocks while full; False = closed
                        return
                self._worker_busy.set()
                batch_index += 1
        except BaseException as exc:  # surfaced in the trainer's thread by `step`
            self._worker_error = exc
            self.buffer.close()
        finally:
            self._worker_busy.clear()

    def publish_current(self) -> None:
        """Publish the weights as `version` unless the generator already has it (the run's
        first step; after a resume, the version it continues at)."""
        fresh = (self.generator is not None and self.generator.latest_version < 0
                 and self.step_count == 0 and not self.processes.distributed)
        cleaned = getattr(self.generator, "unloaded_at_start", None) is not None  # by the job
        if fresh and hasattr(self.generator, "start_after_earlier_runs") and not cleaned:
            # a bucket and servers an earlier (or failed) run used: number after its versions
            self.version = max(self.version, self.generator.start_after_earlier_runs())
        due = self.generator is not None and self.generator.latest_version < self.version
        if self.processes.broadcast(due):
            model = self.processes.full_model(self.train_model, self.model)  # FSDP2: gathered
            if self.generator is not None:
                self.send_weights(model, self.version)
            self._version_offset = self.version - self.step_count // self.config.weight_sync_steps

    def resume(self, checkpoint):
        """GRPOTrainer.resume, then the next unused version: those published after the
        checkpoint stay in the bucket (a version name is never reused), and the servers drop
        this run's adapters (`start_after_earlier_runs`)."""
        path = super().resume(checkpoint)
        start_after = getattr(self.generator, "start_after_earlier_runs", None)
        self.version = max(self.version + 1, start_after() if start_after else 0)
        return path

    def start_steps(self) -> None:
        """Start the rollout worker (called by `train()` after the initial evaluation)."""
        cfg = self.config
        self._set_threads(cfg.trainer_threads)
        self.peak_flops()  # a CPU's is measured (once per machine) before the worker starts
        self._started_at = time.perf_counter()
        if self._worker is not None and self._worker.is_alive():
            return
        self.publish_current()
        if not cfg.asynchronous or not self.processes.is_main:
            return
        self.buffer = RolloutBuffer(cfg.effective_buffer_size, cfg.max_staleness)
        self._buffer_last = {}
        self._stop.clear()
        self._worker_error = None
        self._worker_busy.set()
        self._worker = threading.Thread(target=self._rollout_loop, args=(self.step_count,),
                                        name="grpo-rollout-worker", daemon=True)
        self._worker.start()

    def stop_steps(self, timeout_s: float = 60.0) -> None:
        """Stop the worker and wait for it; unblocks it wherever it waits. Idempotent."""
        self._stop.set()
        if self.buffer is not None:
            self.buffer.close()
        with self._published:
            self._published.notify_all()
        if self._worker is not None:
            self._worker.join(timeout_s)
            if self._worker.is_alive():
                warnings.warn(f"rollout worker still running after {timeout_s}s", stacklevel=2)
            self._worker = None

    @property
    def worker_alive(self) -> bool:
        return self._worker is not None and self._worker.is_alive()

    @property
    def worker_busy(self) -> bool:
        """True while the rollout worker computes (stages 1-3); False while it waits, for
        admission or for room in a full buffer (the trainer may then borrow its core)."""
        return self._worker_busy.is_set()

    # ------------------------------------------------------------------ stage 4 (the trainer)

    def collate(self, groups: list[SampledGroups]) -> tuple[RolloutBatch, Completions, dict]:
        """Stage 3 on the step's groups (grpo_step.to_batch): the batch, its completions and
        each reward function's scores."""
        step = SampledGroups.concat(groups)
        return self.make_batch(step.problems, step)

    def _set_threads(self, count: int) -> None:
        """The calling thread's torch threads, on the CPU only: on a GPU the kernels run there
        and torch's default is left alone."""
        if torch.device(self.device).type == "cpu" and torch.get_num_threads() != count:
            torch.set_num_threads(count)

    def _pick_threads(self, _micro_batch=None) -> None:
        cfg = self.config
        wanted = cfg.trainer_threads
        if cfg.asynchronous and cfg.trainer_idle_threads and not self._worker_busy.is_set():
            wanted = cfg.trainer_idle_threads
        self._set_threads(wanted)

    def optimize(self, batch: RolloutBatch) -> dict[str, float]:
        """Stage 4 (grpo_step.update) over token-budget micro-batches, packed when
        `pack_sequences`, the thread count picked before each forward pass."""
        cfg = self.config
        return grpo_step.update(self, batch, before_each=self._pick_threads,
                                packed=cfg.pack_sequences, row_tokens=cfg.pack_row_tokens)

    def sampler_metrics(self, batch: RolloutBatch, pi_old: torch.Tensor) -> dict[str, float]:
        """TRL AsyncGRPOTrainer's `kl` (the k3 estimate of KL(pi_sampler || pi_old), whatever
        beta; with beta > 0 the reference KL is `ref_kl`), and with
        `vllm_importance_sampling_correction` TRL's `sampling/*`, over the whole batch.

        `batch.old_logps` are the sampler's (the generator's, a server's over HTTP); `pi_old` is
        the trainer's before this step's update. At staleness 0 the two differ only by numeric
        mismatch (TRL's case); at staleness k they also carry the k versions' drift."""
        kl = sampler_kl(pi_old, batch.old_logps, batch.completion_mask)
        return {"kl": kl, **super().sampler_metrics(batch, pi_old)}

    def send_weights(self, model, version: int) -> None:
        """The generator publishes `model` as `version` (the main process); the sync is logged
        to `<output_dir>/syncs.jsonl`, one line per version: the generator's own timings where
        it keeps them (HTTPGenerator's pause, load, resume), else the seconds it took."""
        start = time.perf_counter()
        self.generator.publish(model, version)
        seconds = time.perf_counter() - start
        if self.logger.path is None:
            return
        syncs = getattr(self.generator, "syncs", None)
        record = syncs[-1] if syncs else {"version": version, "sync_s": seconds}
        with (self.logger.path.parent / SYNC_LOG).open("a") as f:
            f.write(json.dumps(record) + "\n")

    def summary(self) -> dict:
        """The run in a few numbers, as `summary.json` has them (`train()` writes it into
        output_dir): steps, samples, the version reached, held-out accuracy before and after,
        the weight syncs and their median seconds, the run doctor's findings."""
        cfg = self.config
        history = self.accuracy_history
        syncs = read_jsonl(self.logger.path.parent / SYNC_LOG) if self.logger.path else []
        timed = [s["sync_s"] for s in syncs if "sync_s" in s]
        return {
            "steps": self.step_count,
            "samples": self.step_count * cfg.prompts_per_step * cfg.num_generations,
            "version": self.version,
            "accuracy_before": history[0][1] if history else None,
            "accuracy_after": history[-1][1] if history else None,
            "syncs": len(syncs),
            "sync_p50_s": statistics.median(timed) if timed else None,
            "seconds": round(time.perf_counter() - self._started_at, 1),
            "findings": [f.as_dict() for f in self.logger.findings],  # the run doctor's
        }

    def train(self, steps: int | None = None, callback=None, resume_from_checkpoint=None):
        """GRPOTrainer.train, then `summary.json` in output_dir (the main process)."""
        records = super().train(steps, callback, resume_from_checkpoint)
        if self.logger.path is not None:
            (self.logger.path.parent / "summary.json").write_text(
                json.dumps(self.summary(), indent=2))
        return records

    def publish(self) -> float:
        """Publish the trainer's weights as version v+1; returns the seconds it took."""
        start = time.perf_counter()
        model = self.processes.full_model(self.train_model, self.model)  # FSDP2: gathered
        if self.generator is not None:  # the main process
            self.send_weights(model, self.version + 1)
        with self._published:
            self.version += 1
            if self._admission_needs is not None and self.version >= self._admission_needs:
                self._worker_busy.set()  # the worker is admitted: its core is no longer free
            self._published.notify_all()
        return time.perf_counter() - start

    def step(self) -> dict[str, float]:
        """One optimizer step on a batch from the buffer (or generated inline in sync mode)."""
        cfg = self.config
        start = time.perf_counter()
        groups, staleness, pipeline = None, [0], {}
        if self.processes.is_main:
            groups, staleness, pipeline = self.next_groups(start)
        elif not cfg.asynchronous:
            self.publish_current()  # the main process's next_groups does: a collective
        got = time.perf_counter()
        mine = self.processes.scatter(split(groups, self.processes.num_processes)
                                      if self.processes.is_main else None)
        batch, _, _ = self.collate(mine)
        metrics = self.optimize(batch)
        trained = time.perf_counter()
        self.step_count += 1
        if self.processes.is_main:  # the step's, from every process's share
            step = SampledGroups.concat(groups)
            out, rewards, parts = step.out, step.rewards, step.parts
            self.completion_log.log(self.step_count, step.problems, out, rewards.cpu(), parts)
        sync_s = 0.0
        if not cfg.asynchronous or self.step_count % cfg.weight_sync_steps == 0:
            sync_s = self.publish()
        done = time.perf_counter()
        metrics.update(step=self.step_count, version=self.version)
        if not self.processes.is_main:
            return metrics
        metrics.update(async_reward_names(rollout_metrics(rewards, out, cfg.num_generations, parts),
                                          rewards, cfg.num_generations))
        metrics.update(pipeline)
        metrics.update({
            "sample/staleness_mean": sum(staleness) / len(staleness),
            "sample/staleness_max": max(staleness),
            "perf/fwd_bwd_s": trained - got - metrics["perf/optimizer_s"],
            "perf/weight_sync_s": sync_s,
            "perf/step_s": done - start,
            "rollout/generated_tok_s_busy": self._generation_speed(),
            "rollout/version_wait_s": self._delta("version_wait_s"),
            "time_s": done - self._started_at,
            "batch/groups_per_step": len(groups),
        })
        metrics.update(self.throughput(metrics, metrics["perf/fwd_bwd_s"], done - start))
        if hasattr(self.generator, "retried"):  # HTTP generators: vLLM calls sent again
            self._counters["retried"] = self.generator.retried
            metrics["rollout/vllm_retry_total"] = self._delta("retried")
        if hasattr(self.generator, "pop_inflight_peak"):
            metrics["rollout/inflight_max"] = self.generator.pop_inflight_peak()
        return metrics

    def next_groups(self, start: float) -> tuple[list[SampledGroups], list[int], dict]:
        """The step's groups (from the buffer, or generated now in sync mode), their staleness
        and the pipeline's metrics. The main process's job when there are several."""
        cfg = self.config
        if cfg.asynchronous:
            if self._worker is None:
                self.start_steps()  # step() called directly, outside train()
            queue_size = len(self.buffer)
            entries = self.buffer.get(cfg.prompts_per_step, trainer_version=self.version)
            if len(entries) < cfg.prompts_per_step:
                raise RuntimeError("the rollout worker stopped") from self._worker_error
            pipeline = buffer_metrics(self.buffer.stats(), self._buffer_last, queue_size,
                                      cfg.num_generations)
            return [e.item for e in entries], [e.staleness for e in entries], pipeline
        self.publish_current()  # step() called directly, outside train()
        self._set_threads(cfg.generator_threads)
        groups = self.produce(self.version)
        self._set_threads(cfg.trainer_threads)
        return groups, [0], inline_metrics(time.perf_counter() - start)

    def _delta(self, name: str) -> float:
        now = self._counters[name]  # read once: the worker thread keeps adding to it
        value, self._last[name] = now - self._last[name], now
        return value

    def _generation_speed(self) -> float:
        """Tokens per generation-second since the last step (the last value if none since)."""
        seconds, tokens = self._delta("gen_s"), self._delta("gen_tokens")
        if seconds > 0:
            self._last["tok_s"] = tokens / seconds
        return self._last["tok_s"]
