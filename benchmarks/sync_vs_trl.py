"""Benchmark grpo_lab's synchronous GRPOTrainer against TRL's GRPOTrainer on notebook 03's run.

    python benchmarks/sync_vs_trl.py                    # 3 seeds, ~8 minutes on 2 quiet cores
    python benchmarks/sync_vs_trl.py --seeds 0 --steps 30 --profile-steps 0   # a smoke run
    python benchmarks/sync_vs_trl.py --model smollm2-135m --seeds 0 --steps 20 --profile-steps 0
                                    # the real model: notebook 09b's run (its own results file)

The run is notebook 03's: the tiny model, 2-digit addition, 16 prompts x 8 completions per step,
150 steps, rank-1 LoRA, learning rate 1e-3, `exact_match_reward`, TRL configured as the notebook
configures it (the same prompts in the same order, the same loss, clip, optimizer and schedule).
Per seed both trainers run in this process, one after the other (the order alternates from seed
to seed, so that a change in the machine's load does not favour one), with the same torch
thread count. Timed: the training steps only (grpo_lab's evaluations before and after are taken
out, TRL's `train()` makes none); CPU seconds of this process beside the wall time, because
tokens per CPU second do not depend on the share of the cores other processes leave.
Both are scored by the same held-out greedy accuracy before and after.

Goal (issue 26): grpo_lab's time / TRL's <= 0.7 (median over the seeds) at equal gain: the two
median accuracy gains within 3 points.

`--model smollm2-135m` runs notebook 09b's setting instead (SmolLM2-135M-Instruct, `sum_form`
conversations through the chat template, 8 prompts x 8, LoRA r 8, learning rate 5e-4, 14 new
tokens, 256 held-out problems), each trainer in a process of its own so that each one's peak
resident memory is its own; goals (issue 44): time <= 0.8x TRL's, peak memory <= 1.0x.

`--profile-steps N` then profiles N steps of each trainer (cProfile) and keeps the top
functions by own time: where each one's time goes.
Results go to benchmarks/results/sync_vs_trl.json and are printed.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import random
import resource
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from grpo_lab.data.rewards import exact_match_reward  # noqa: E402
from grpo_lab.model.evaluation import greedy_accuracy  # noqa: E402
from grpo_lab.model.models import load_model_and_tokenizer  # noqa: E402
from grpo_lab.train.config import GRPOConfig  # noqa: E402
from grpo_lab.train.trainer import GRPOTrainer  # noqa: E402

GOALS = {"time_ratio": 0.7, "gain_gap": 0.03}
REAL_GOALS = {"time_ratio": 0.8, "gain_gap": 0.03, "peak_rss_ratio": 1.0}
RESULTS = Path(__file__).parent / "results" / "sync_vs_trl.json"
REAL_RESULTS = Path(__file__).parent / "results" / "sync_vs_trl_smollm2.json"
MODEL = "tiny"  # set by --model
warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)


def cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def timed_train(trainer, profile: cProfile.Profile | None) -> tuple[float, float]:
    """`trainer.train()` (profiled when `profile` is given) -> (wall seconds, CPU seconds)."""
    cpu, start = cpu_s(), time.perf_counter()
    if profile:
        profile.enable()
    trainer.train()
    if profile:
        profile.disable()
    return time.perf_counter() - start, cpu_s() - cpu


def notebook_config(steps: int, seed: int, threads: int) -> GRPOConfig:
    """Notebook 03's grpo_lab run (its parameters cell and section 1), or notebook 09b's."""
    if MODEL != "tiny":
        return GRPOConfig(model=MODEL, task="sum_form", difficulty=30, steps=steps,
                          prompts_per_step=8, num_generations=8, lora_rank=8,
                          learning_rate=5e-4, max_completion_length=14, eval_size=256, seed=seed,
                          num_threads=threads, eval_every=0, log_every=10**6, progress=False,
                          log_completions_every=0)
    return GRPOConfig(steps=steps, prompts_per_step=16, num_generations=8, use_lora=True,
                      lora_rank=1, learning_rate=1e-3, seed=seed, num_threads=threads,
                      eval_every=0, log_every=10**6, progress=False, log_completions_every=0)


def run_grpo_lab(steps: int, seed: int, threads: int, profile: cProfile.Profile | None = None):
    trainer = GRPOTrainer(notebook_config(steps, seed, threads))
    evaluate, eval_s = trainer.evaluate, [0.0]

    def timed_evaluate():  # evaluations are not training: their time is taken out
        start = time.perf_counter()
        accuracy = evaluate()
        eval_s[0] += time.perf_counter() - start
        return accuracy

    trainer.evaluate = timed_evaluate
    wall, cpu_total = timed_train(trainer, profile)
    wall -= eval_s[0]
    (_, before), (_, after) = trainer.accuracy_history[0], trainer.accuracy_history[-1]
    # CPU seconds: the evaluations' share taken out in proportion to their wall time.
    return {"train_s": wall, "cpu_s": cpu_total * wall / (wall + eval_s[0]),
            "accuracy_before": before, "accuracy_after": after, "gain": after - before}


def run_trl(steps: int, seed: int, threads: int, run_dir: Path,
            profile: cProfile.Profile | None = None):
    """Notebook 03's TRL run (section 2): the same prompts, model, reward, LoRA and settings."""
    from datasets import Dataset
    from peft import LoraConfig
    from transformers.trainer_callback import PrinterCallback
    from trl import GRPOConfig as TRLConfig
    from trl import GRPOTrainer as TRLTrainer

    config = notebook_config(steps, seed, threads)
    torch.set_num_threads(threads)
    task = config.make_task()
    max_new_tokens = config.max_completion_length or task.max_answer_chars + 2
    problems = task.sample_batch(random.Random(seed), steps * config.prompts_per_step)
    dataset = Dataset.from_list([{"prompt": p.prompt, "answer": p.answer} for p in problems])
    args = TRLConfig(
        output_dir=str(run_dir / f"trl-{seed}"), report_to="none", save_strategy="no",
        use_cpu=True, bf16=False, activation_checkpointing=False, max_steps=steps,
        per_device_train_batch_size=config.prompts_per_step * config.num_generations,
        num_generations=config.num_generations, max_completion_length=max_new_tokens,
        temperature=config.temperature, loss_type=config.loss_type,
        scale_rewards="group" if config.scale_rewards else "none",
        epsilon=config.epsilon_low, epsilon_high=config.epsilon_high, beta=config.beta,
        num_iterations=config.num_iterations, learning_rate=config.learning_rate,
        lr_scheduler_type="constant", weight_decay=config.weight_decay,
        adam_beta2=config.adam_beta2, max_grad_norm=config.max_grad_norm, seed=seed,
        shuffle_dataset=False, logging_steps=1, disable_tqdm=True)
    lora = LoraConfig(r=config.lora_rank, lora_alpha=config.effective_lora_alpha,
                      target_modules="all-linear", lora_dropout=0.0, task_type="CAUSAL_LM")
    model, tokenizer = load_model_and_tokenizer(GRPOTrainer.resolve_model_path(config))
    trainer = TRLTrainer(model=model, reward_funcs=exact_match_reward, args=args,
                         train_dataset=dataset, processing_class=tokenizer, peft_config=lora)
    trainer.remove_callback(PrinterCallback)

    def accuracy() -> float:  # conversations through the template, as TRL's prompts
        return greedy_accuracy(trainer.model, tokenizer, task.eval_set(),
                               max_new_tokens=max_new_tokens)

    before = accuracy()
    wall, cpu_total = timed_train(trainer, profile)
    after = accuracy()
    return {"train_s": wall, "cpu_s": cpu_total, "accuracy_before": before,
            "accuracy_after": after, "gain": after - before}


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_in_child(name: str, steps: int, seed: int, threads: int) -> dict:
    """One trainer's run in a process of its own (`--only`): its peak memory is its own."""
    import subprocess

    out = subprocess.run([sys.executable, __file__, "--model", MODEL, "--only", name,
                          "--seeds", str(seed), "--steps", str(steps), "--threads", str(threads)],
                         capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"{name}'s run failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def top_functions(profile: cProfile.Profile, n: int = 15) -> list[dict]:
    """The n functions with the most own time, and their share of the profiled time."""
    stats = pstats.Stats(profile)
    total = stats.total_tt
    rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:n]
    return [{"function": f"{Path(file).name}:{line}({name})", "calls": nc,
             "own_s": round(tt, 3), "own_share": round(tt / total, 3),
             "cumulative_s": round(ct, 3)}
            for (file, line, name), (_cc, nc, tt, ct, _callers) in rows]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--steps", type=int, default=150, help="notebook 03's 150")
    parser.add_argument("--threads", type=int, default=2,
                        help="torch threads of both trainers (notebook 03: 2; 1 on a busy machine)")
    parser.add_argument("--profile-steps", type=int, default=20,
                        help="steps of each trainer under cProfile after the timed runs (0: none)")
    parser.add_argument("--model", default="tiny", choices=("tiny", "smollm2-135m"))
    parser.add_argument("--only", choices=("grpo_lab", "trl"),
                        help="run one trainer at the first seed and print its row (the parent's "
                        "child process)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    global MODEL
    MODEL = args.model
    real = MODEL != "tiny"
    goals = REAL_GOALS if real else GOALS
    args.out = args.out or (REAL_RESULTS if real else RESULTS)
    if args.only:
        seed = int(args.seeds.split(",")[0])
        with tempfile.TemporaryDirectory(prefix="grpo_lab_sync_vs_trl_") as scratch:
            row = (run_grpo_lab(args.steps, seed, args.threads) if args.only == "grpo_lab"
                   else run_trl(args.steps, seed, args.threads, Path(scratch)))
        print(json.dumps({**row, "peak_rss_mib": round(peak_rss_mib())}))
        return 0
    started = time.perf_counter()
    runs = []
    with tempfile.TemporaryDirectory(prefix="grpo_lab_sync_vs_trl_") as scratch:
        for k, seed in enumerate(int(s) for s in args.seeds.split(",")):
            load = [round(x, 2) for x in os.getloadavg()]
            order = ("grpo_lab", "trl") if k % 2 == 0 else ("trl", "grpo_lab")
            row = {"seed": seed, "order": list(order), "loadavg_before": load}
            for name in order:
                if real:
                    row[name] = run_in_child(name, args.steps, seed, args.threads)
                else:
                    row[name] = (run_grpo_lab(args.steps, seed, args.threads)
                                 if name == "grpo_lab"
                                 else run_trl(args.steps, seed, args.threads, Path(scratch)))
            row["time_ratio"] = row["grpo_lab"]["train_s"] / row["trl"]["train_s"]
            if real:
                row["peak_rss_ratio"] = (row["grpo_lab"]["peak_rss_mib"]
                                         / row["trl"]["peak_rss_mib"])
            row["cpu_ratio"] = row["grpo_lab"]["cpu_s"] / row["trl"]["cpu_s"]
            row["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]
            runs.append(row)
            print(f"seed {seed} (load {load[0]}): grpo_lab {row['grpo_lab']['train_s']:.1f} s "
                  f"gain {row['grpo_lab']['gain']:+.3f} | TRL {row['trl']['train_s']:.1f} s "
                  f"gain {row['trl']['gain']:+.3f} | time ratio {row['time_ratio']:.3f}, "
                  f"CPU ratio {row['cpu_ratio']:.3f}", flush=True)
        profiles = {}
        if args.profile_steps:
            for name in ("grpo_lab", "trl"):
                profile = cProfile.Profile()
                if name == "grpo_lab":
                    run_grpo_lab(args.profile_steps, 0, args.threads, profile)
                else:
                    run_trl(args.profile_steps, 0, args.threads, Path(scratch), profile)
                profiles[name] = top_functions(profile)

    def spread(values):
        return {"median": statistics.median(values), "min": min(values), "max": max(values)}

    gains = {name: statistics.median(r[name]["gain"] for r in runs) for name in ("grpo_lab", "trl")}
    summary = {
        "time_ratio": spread([r["time_ratio"] for r in runs]),
        "cpu_ratio": spread([r["cpu_ratio"] for r in runs]),
        "gain_grpo_lab": spread([r["grpo_lab"]["gain"] for r in runs]),
        "gain_trl": spread([r["trl"]["gain"] for r in runs]),
        "gain_gap": gains["grpo_lab"] - gains["trl"],
    }
    met = {"time_ratio": summary["time_ratio"]["median"] <= goals["time_ratio"],
           "equal_gain": abs(summary["gain_gap"]) <= goals["gain_gap"]}
    if real:
        summary["peak_rss_ratio"] = spread([r["peak_rss_ratio"] for r in runs])
        met["peak_rss_ratio"] = summary["peak_rss_ratio"]["median"] <= goals["peak_rss_ratio"]
    result = {"model": MODEL, "summary": summary, "goals": goals, "met": met, "runs": runs,
              "profile_top_own_time": profiles, "steps": args.steps, "threads": args.threads,
              "cpu_count": os.cpu_count(), "benchmark_s": round(time.perf_counter() - started)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(json.dumps({"summary": summary, "met": met}, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
