"""Smoke-run grpo_lab on a CUDA GPU: bfloat16 training, the server's engine, async GRPO over HTTP.

    python benchmarks/gpu_smoke.py                   # a CUDA machine, offline: 1-2 minutes
    python benchmarks/gpu_smoke.py --device cpu --steps 2 --prompts 4 --generations 4 \\
        --requests 4                                 # the same phases on the CPU (the test's run)

Needs torch, transformers and peft only (no vLLM, no TRL, no hub): the tiny model is built first,
on the CPU, into a temporary GRPO_LAB_HOME (or `--home`, where it may already be). Then:

    sync_full   GRPOTrainer, full fine-tuning, weights in --dtype (bfloat16)
    sync_lora   GRPOTrainer, a LoRA adapter on the same weights
    serve       `grpo-lab serve --device D --dtype bfloat16` as its own process: one burst of
                concurrent completions, each token's served logprob compared with the same
                model run in this process
    async_http  AsyncGRPOTrainer (LoRA) sampling from that server through HTTPGenerator, its
                adapters synced through an AdapterBucket folder
    real_shape  GRPOTrainer (LoRA) at a real model's published shape with random weights
                (--shape, default Qwen2.5-0.5B; grpo_lab.model.shaped_models, built here),
                --shape-prompts x G completions of --shape-new-tokens tokens on its word
                problems, beside grpo_lab.model.memory_model's prediction of the step

The check, per phase: the mean `ratio` exp(logp_trainer - logp_generator) over completion tokens
is within 1e-2 of 1. Both sides compute logprobs in float32 from bfloat16 logits; what separates
them is bfloat16 rounding in two different forward passes (a full pass against a KV-cached one,
PEFT's LoRA against the server's hooks). At `--max-staleness 0` (the default) every batch is
on-policy, so the ratio measures that rounding and nothing else. The server must also report the
device and dtype it was asked for in /server_info.

Reported per phase: the first step's time (it includes CUDA's warm-up) and the median of the rest,
the peak GPU memory of this process (torch.cuda.max_memory_allocated, reset between phases) and of
the server process (from its /server_info), the mean ratio. Any failed check exits 1 with the
reason. Results go to --out (default benchmarks/results/gpu_smoke.json) and are printed.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

from grpo_lab.algo.logprobs import policy_logprobs  # noqa: E402
from grpo_lab.bucket.adapters import AdapterBucket  # noqa: E402
from grpo_lab.data.completions import Completions  # noqa: E402
from grpo_lab.model.memory_model import StepSetting, step_memory  # noqa: E402
from grpo_lab.model.models import load_model_and_tokenizer  # noqa: E402
from grpo_lab.model.shaped_models import SHAPES, dataset_files, shaped_model_path  # noqa: E402
from grpo_lab.model.tiny_model import tiny_model_path  # noqa: E402
from grpo_lab.rollout.http_generator import HTTPGenerator  # noqa: E402
from grpo_lab.serve.client import BlockingClient  # noqa: E402
from grpo_lab.serve.process import start_server_process  # noqa: E402
from grpo_lab.train.async_config import AsyncGRPOConfig  # noqa: E402
from grpo_lab.train.async_trainer import AsyncGRPOTrainer  # noqa: E402
from grpo_lab.train.config import GRPOConfig  # noqa: E402
from grpo_lab.train.rollout_batch import pad_left, pad_right
from grpo_lab.train.trainer import GRPOTrainer
from grpo_lab.util.devices import DTYPES, resolve_device  # noqa: E402

RATIO_TOLERANCE = 1e-2


class GPUMemory:
    """Peak bytes torch allocated on the device in this process since `reset` (None on a CPU)."""

    def __init__(self, device: str):
        self.device, self.cuda = device, device.startswith("cuda")

    def reset(self) -> None:
        gc.collect()  # the previous phase's model and optimizer must not count in this one
        if self.cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)

    def peak(self) -> int | None:
        return torch.cuda.max_memory_allocated(self.device) if self.cuda else None


def step_summary(records: list[dict]) -> dict:
    """Step times (the first apart: warm-up) and the ratio of a run's steps (step > 0)."""
    times = [r["perf/step_s"] for r in records]
    ratios = [r["ratio"] for r in records]
    return {"steps": len(records), "first_step_s": round(times[0], 4),
            "step_s_median": round(statistics.median(times[1:] or times), 4),
            "ratio_mean": statistics.mean(ratios),
            "ratio_max_dev": max(abs(r - 1) for r in ratios),
            "reward_mean": round(statistics.mean(r["reward"] for r in records), 4)}


def train_sync(args, use_lora: bool) -> dict:
    """A few synchronous GRPO steps (local generation) on the device."""
    config = GRPOConfig(steps=args.steps, prompts_per_step=args.prompts,
                        num_generations=args.generations, device=args.device, dtype=args.dtype,
                        use_lora=use_lora, learning_rate=1e-3 if use_lora else 1e-4,
                        eval_every=0, eval_size=16, log_every=10**6, progress=False,
                        log_completions_every=0)
    trainer = GRPOTrainer(config)
    return step_summary([r for r in trainer.train() if r["step"] > 0])


def train_real_shape(args) -> dict:
    """Synchronous LoRA GRPO steps at a published shape (random weights), and the memory the
    memory model predicts for such a step."""
    start = time.perf_counter()
    path = shaped_model_path(args.shape, num_threads=os.cpu_count())
    built_s = time.perf_counter() - start
    files = dataset_files(path)
    config = GRPOConfig(model=str(path), dataset=str(files["train"]),
                        eval_split=str(files["test"]), steps=args.steps,
                        prompts_per_step=args.shape_prompts, num_generations=args.generations,
                        max_completion_length=args.shape_new_tokens, device=args.device,
                        dtype=args.dtype, use_lora=True, lora_rank=8, learning_rate=1e-5,
                        eval_every=0, eval_size=4, log_every=10**6, progress=False,
                        log_completions_every=0)
    trainer = GRPOTrainer(config)
    records = [r for r in trainer.train() if r["step"] > 0]
    setting = StepSetting(prompts=args.shape_prompts, num_generations=args.generations,
                          completion_tokens=args.shape_new_tokens, dtype=args.dtype,
                          lora_rank=8, logits_chunk_rows=110)
    predicted = step_memory(trainer.model.config, setting).total
    return {**step_summary(records), "shape": args.shape, "model_build_s": round(built_s, 1),
            "predicted_peak_bytes": predicted}


def serve_burst(args, url: str, path: Path) -> dict:
    """Concurrent completions from the server; their logprobs against the same model here."""
    model, tokenizer = load_model_and_tokenizer(path, device=args.device,
                                                dtype=DTYPES[args.dtype])
    prompts = [tokenizer(f"{3 * i + 11}+{7 * i + 5}=")["input_ids"] for i in range(args.requests)]
    with BlockingClient(url) as client:
        info = client.server_info()

        async def burst(seed: int) -> list[dict]:  # all prompts in flight at once
            return await asyncio.gather(*(client.client.completions(
                ids, max_tokens=8, n=args.generations, temperature=1.0, seed=seed + i)
                for i, ids in enumerate(prompts)))

        client.call(burst(0))  # warm-up: CUDA kernels, the engine's first prefill
        start = time.perf_counter()
        out = Completions.from_choices(client.call(burst(1000)))
        seconds = time.perf_counter() - start
    p_ids, p_mask = pad_left(out.prompt_ids, tokenizer.pad_token_id)
    c_ids, c_mask = pad_right(out.completion_ids, tokenizer.pad_token_id)
    served, _ = pad_right(out.logprobs, 0.0)
    on = lambda t: t.to(args.device)  # noqa: E731
    with torch.no_grad():
        local = policy_logprobs(model, on(p_ids), on(p_mask), on(c_ids), on(c_mask)).cpu()
    ratio = float(((local - served.float()).exp() * c_mask).sum() / c_mask.sum())
    return {"completions": len(out), "tokens": out.num_tokens, "burst_s": round(seconds, 4),
            "tokens_per_s": round(out.num_tokens / seconds, 1), "ratio_mean": ratio,
            "server_device": info["device_config"]["device"],
            "server_dtype": info["model_config"]["dtype"]}


def train_async_http(args, url: str, bucket_root: Path) -> dict:
    """A few asynchronous LoRA GRPO steps whose rollouts all come from the server."""
    config = AsyncGRPOConfig(steps=args.steps, prompts_per_step=args.prompts,
                             num_generations=args.generations, device=args.device,
                             dtype=args.dtype, use_lora=True, max_staleness=args.max_staleness,
                             eval_every=0, eval_size=16, log_every=10**6, progress=False,
                             log_completions_every=0)
    bucket = AdapterBucket(bucket_root, prefix="smoke", max_staleness=args.max_staleness)
    generator = HTTPGenerator(url, bucket, max_staleness=args.max_staleness, seed=0)
    try:
        trainer = AsyncGRPOTrainer(config, generator=generator)  # publishes v0 when it starts
        records = [r for r in trainer.train() if r["step"] > 0]
    finally:
        generator.close()
    summary = step_summary(records)
    summary["staleness_mean"] = statistics.mean(r["sample/staleness_mean"] for r in records)
    summary["weight_sync_s_median"] = round(statistics.median(
        r["perf/weight_sync_s"] for r in records), 4)
    return summary


def run_phases(args, home: Path, scratch: Path, results: dict) -> None:
    """Fill results["phases"] phase by phase (what finished stays in, whatever fails later).
    The tiny model is built in (or read from) `home`; the adapter bucket goes in `scratch`."""
    os.environ["GRPO_LAB_HOME"] = str(home)  # the trainers and the server process read it
    start = time.perf_counter()
    path = tiny_model_path(progress=False, num_threads=os.cpu_count())
    results["model_ready_s"] = round(time.perf_counter() - start, 1)
    memory, phases = GPUMemory(args.device), results["phases"]
    for name, use_lora in (("sync_full", False), ("sync_lora", True)):
        memory.reset()
        phases[name] = {**train_sync(args, use_lora), "peak_memory_bytes": memory.peak()}
    with start_server_process("tiny", device=args.device, dtype=args.dtype, enable_lora=True,
                              max_lora_rank=8, max_loras=4, num_threads=args.threads,
                              logprobs_mode="processed_logprobs") as server:
        for name, run in (("serve", lambda: serve_burst(args, server.url, path)),
                          ("async_http", lambda: train_async_http(args, server.url,
                                                                  scratch / "bucket"))):
            memory.reset()
            phases[name] = run()
            phases[name]["peak_memory_bytes"] = memory.peak()
            with BlockingClient(server.url) as client:  # its peak since it started
                phases[name]["server_peak_memory_bytes"] = \
                    client.server_info()["grpo_lab"]["peak_gpu_memory_bytes"]
    if args.shape != "none":
        memory.reset()
        phases["real_shape"] = {**train_real_shape(args), "peak_memory_bytes": memory.peak()}


def failed_checks(args, phases: dict) -> list[str]:
    failures = [f"{name}: mean ratio {p['ratio_mean']:.5f} is not within {RATIO_TOLERANCE} of 1"
                for name, p in phases.items() if abs(p["ratio_mean"] - 1) > RATIO_TOLERANCE]
    serve = phases.get("serve", {})
    wanted = (args.device, f"torch.{args.dtype}")
    if serve and (serve["server_device"], serve["server_dtype"]) != wanted:
        failures.append(f"serve: /server_info reports {serve['server_device']} / "
                        f"{serve['server_dtype']}, asked for {wanted[0]} / {wanted[1]}")
    return failures


def mib(value: int | None) -> str:
    return "-" if value is None else f"{value / 2**20:.0f} MiB"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help="cuda, cuda:1, ... or cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    parser.add_argument("--steps", type=int, default=4, help="GRPO steps per training phase")
    parser.add_argument("--prompts", type=int, default=16, help="prompts per step")
    parser.add_argument("--generations", type=int, default=8, help="G completions per prompt")
    parser.add_argument("--requests", type=int, default=32, help="prompts in the serve burst")
    parser.add_argument("--max-staleness", type=int, default=0,
                        help="of the async phase (0: on-policy, the ratio measures rounding)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads per process")
    parser.add_argument("--shape", default="qwen2.5-0.5b", choices=[*SHAPES, "none"],
                        help="the real_shape phase's published shape (none: skip it)")
    parser.add_argument("--shape-prompts", type=int, default=2, help="real_shape: prompts")
    parser.add_argument("--shape-new-tokens", type=int, default=128,
                        help="real_shape: max_new_tokens (random weights always reach it)")
    parser.add_argument("--home", type=Path, default=None,
                        help="GRPO_LAB_HOME to build the tiny model in or reuse (default: a "
                             "temporary folder, removed at the end)")
    parser.add_argument("--out", type=Path,
                        default=Path(__file__).parent / "results" / "gpu_smoke.json")
    args = parser.parse_args(argv)
    try:
        args.device = resolve_device(args.device)
    except ValueError as exc:
        print(f"FAILED: {exc}", file=sys.stderr)
        return 1
    torch.set_num_threads(args.threads)
    results = {"machine": {"device": args.device, "torch": torch.__version__,
                           "python": platform.python_version(), "cores": os.cpu_count(),
                           "gpu": (torch.cuda.get_device_name(args.device)
                                   if args.device.startswith("cuda") else None)},
               "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
               "ratio_tolerance": RATIO_TOLERANCE, "phases": {}}
    start = time.perf_counter()
    try:
        with tempfile.TemporaryDirectory(prefix="grpo-lab-gpu-smoke-") as tmp:
            run_phases(args, args.home or Path(tmp) / "home", Path(tmp), results)
        failures = failed_checks(args, results["phases"])
    except Exception as exc:  # a phase crashed: report it like a failed check
        failures = [f"{type(exc).__name__}: {exc}"]
    results.update(wall_s=round(time.perf_counter() - start, 1), failures=failures,
                   passed=not failures)
    for name, p in results["phases"].items():
        steps = (f"first step {p['first_step_s']:.3f} s, then {p['step_s_median']:.3f} s"
                 if "steps" in p else f"{p['tokens']} tokens in {p['burst_s']:.3f} s "
                 f"({p['tokens_per_s']:.0f} tok/s)")
        server = (f", server {mib(p['server_peak_memory_bytes'])}"
                  if "server_peak_memory_bytes" in p else "")
        print(f"{name:<11} {steps}; peak {mib(p['peak_memory_bytes'])}{server}; "
              f"mean ratio {p['ratio_mean']:.5f}")
    print(f"{results['wall_s']:.0f} s in all on {args.device} ({args.dtype})")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    for failure in failures:
        print(f"FAILED: {failure}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
